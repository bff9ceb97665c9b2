"""The in-job stop path on real gloo process groups with real signals.

Two ranks (spawned processes) run the :class:`StopSignalHook` step by step. A real SIGUSR2 or
SIGTERM is sent to one rank only; the all-reduce makes both stop at the same step boundary, both
save, rank 0 decides and logs, and *both* exit with the same code. The trainer is a stand-in
object (the hook only reads ``state.step`` and sets ``stop_requested``); Slurm is absent here
(the missing-``scontrol`` path is exercised for real with a PATH that lacks it).
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
from conftest import FakeLoop, compose_cfg
from parallel_harness import free_port
from ranks import rank_context, run_ranks


class _Exit(Exception):
    pass


def _worker(rank: int, port: int, run_dir: str, overrides: list[str], source: str, sig_rank: int, sig: int,
            sig_step: int, out: dict) -> None:
    import torch.distributed as dist

    from xirang_hpc.config.validate import load_config
    from xirang_hpc.monitor.events import EventLog
    from xirang_hpc.runtime.signals import StopSignalHook
    from xirang_hpc.runtime.topology import Topology

    if source == "slurm":
        os.environ.update({"SLURM_JOB_ID": "4242", "SLURM_RESTART_COUNT": "0", "PATH": "/nonexistent"})
    cfg = load_config(compose_cfg(overrides))
    topo = Topology(rank=rank, world_size=2, local_rank=rank, local_world_size=2, node_id=0, num_nodes=1,
                    node_name="n1", master_addr="127.0.0.1", master_port=port, job_id="4242", source=source)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    saved: list[int] = []
    codes: list[int] = []

    def exit_fn(code: int) -> None:
        codes.append(code)
        raise _Exit

    def save_fn(trainer) -> int:
        saved.append(trainer.state.step)
        return trainer.state.step

    hook = StopSignalHook(cfg, topo, Path(run_dir), events=EventLog(run_dir), exit_fn=exit_fn,
                          save_fn=save_fn).installed()
    trainer = FakeLoop(step=0)
    hook.on_fit_start(trainer)
    try:
        for step in range(1, 20):
            trainer.state.step = step
            if rank == sig_rank and step == sig_step:
                os.kill(os.getpid(), sig)  # a real signal, delivered to this rank only
            hook.on_step_end(trainer, {})
    except _Exit:
        pass
    out[rank] = {"codes": codes, "saved": saved, "stop_requested": trainer.stop_requested,
                 "stopped_at": trainer.state.step}
    dist.destroy_process_group()


def _run(tmp_path: Path, overrides: list[str], source: str = "local", sig_rank: int = 1,
         sig: int = signal.SIGUSR2, sig_step: int = 3) -> dict:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    ctx = rank_context()
    out, port = ctx.Manager().dict(), free_port()
    procs = [ctx.Process(target=_worker, args=(r, port, str(run_dir), overrides, source, sig_rank, sig, sig_step, out))
             for r in range(2)]
    codes = run_ranks(procs)
    assert codes == [0, 0], f"ranks exited with {codes}"
    return dict(out)


def _events(tmp_path: Path) -> list[dict]:
    from xirang_hpc.monitor.events import read_events

    return read_events(tmp_path / "run")


@pytest.mark.slow
def test_signal_on_one_rank_stops_all_ranks_at_the_same_step(tmp_path):
    from xirang_hpc.runtime.signals import EXIT_REQUEUED

    out = _run(tmp_path, ["requeue=testbed", "cluster=local"])
    for r in (0, 1):
        assert out[r]["codes"] == [EXIT_REQUEUED], out
        assert out[r]["saved"] == [3] and out[r]["stopped_at"] == 3 and out[r]["stop_requested"]
    kinds = [(e["kind"], e["reason"]) for e in _events(tmp_path)]
    assert kinds[0] == ("start", "restart 0")
    assert ("stop", "preemption") in kinds and ("requeue", "preemption") in kinds
    assert kinds[-1] == ("exit", "requeued")
    stop = next(e for e in _events(tmp_path) if e["kind"] == "stop")
    assert stop["signal"] == "SIGUSR2" and stop["saved_step"] == 3 and stop["signal_to_durable_s"] >= 0
    # Every rank left a start and an exit-marker-to-be (atexit) record.
    assert sorted(p.name for p in (tmp_path / "run" / "ranks" / "r0").glob("*.start")) == ["0.start", "1.start"]


@pytest.mark.slow
def test_sigterm_on_rank0_with_requeue_limit_gives_final_status(tmp_path):
    from xirang_hpc.runtime.signals import EXIT_STOPPED

    out = _run(tmp_path, ["requeue=testbed", "requeue.max_requeues=0", "cluster=local"], sig_rank=0,
               sig=signal.SIGTERM, sig_step=5)
    assert out[0]["codes"] == out[1]["codes"] == [EXIT_STOPPED]
    final = [e for e in _events(tmp_path) if e["kind"] == "exit"][-1]
    # Outside Slurm a bare SIGTERM reads as "terminated", which the policy never requeues.
    assert final["final"] is True and final["status"] == "stopped_terminated"


@pytest.mark.slow
def test_missing_scontrol_in_a_slurm_job_exits_cleanly_with_clear_status(tmp_path):
    from xirang_hpc.runtime.signals import EXIT_STOPPED

    out = _run(tmp_path, ["requeue=testbed", "cluster=testbed"], source="slurm")
    assert out[0]["codes"] == out[1]["codes"] == [EXIT_STOPPED]
    assert out[0]["saved"] == out[1]["saved"] == [3]  # the save still happened before the failure
    final = [e for e in _events(tmp_path) if e["kind"] == "exit"][-1]
    assert final["status"] == "requeue_failed" and final["final"] is True
    assert "scontrol not found on PATH" in final["error"]


def test_a_preemption_past_max_requeues_makes_the_job_non_requeueable(tmp_path):
    # max_requeues reached: the run's final status is written, and the job is made non-requeueable first, so
    # that Slurm's own preemption requeue (ranks still leaving at the end of the grace time) cannot bring it
    # back to train past that status. A time limit is not a preemption: nothing to pin there.
    from xirang_hpc.config.validate import load_config
    from xirang_hpc.monitor.events import EventLog, read_events
    from xirang_hpc.runtime.signals import EXIT_STOPPED, StopSignalHook
    from xirang_hpc.runtime.topology import Topology

    topo = Topology(rank=0, world_size=1, local_rank=0, local_world_size=1, node_id=0, num_nodes=1,
                    node_name="n1", master_addr="127.0.0.1", master_port=20001, job_id="41", source="slurm")
    phases: list[str] = []
    trainer = FakeLoop(step=5, phases=phases)
    for info, pinned_expected in (({"PreemptTime": "2026-11-30T18:10:00", "JobState": "RUNNING"}, ["41"]),
                                  ({"PreemptTime": "None", "TimeLimit": "00:01:00", "RunTime": "00:00:55",
                                    "JobState": "RUNNING"}, [])):
        run = tmp_path / str(len(pinned_expected))
        run.mkdir()
        codes: list[int] = []
        requeued: list[str] = []
        pinned: list[str] = []
        hook = StopSignalHook(load_config(compose_cfg(["requeue.max_requeues=0"])), topo, run, events=EventLog(run),
                              env={"SLURM_JOB_ID": "41"}, exit_fn=codes.append, save_fn=lambda t: 5,
                              job_info=lambda j, i=info: i, requeue_fn=requeued.append,
                              start_now_fn=lambda *a: None, no_requeue_fn=pinned.append)
        phases.clear()
        hook.stop(trainer, "SIGUSR2")
        assert codes == [EXIT_STOPPED] and requeued == [] and pinned == pinned_expected
        assert phases[-1] == "exit"  # the monitor knows the rank is leaving: its teardown is no hang
        # The save on the stop is a checkpoint phase: the goodput record's block ends at the saved step.
        assert phases[0] == "checkpoint"
        final = [e for e in read_events(run) if e["kind"] == "exit"]
        assert final[-1]["final"] and final[-1]["status"] == "max_requeues_exceeded", final
