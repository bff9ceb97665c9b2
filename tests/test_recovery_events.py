"""Every stop, requeue and skipped checkpoint is in events.jsonl: requeues the job did not log itself
(Slurm, submitit, an admin) found at the next start; the test points that pause a job at one stage."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from xirang_hpc.monitor.events import append_event, read_events
from xirang_hpc.monitor.requeues import classify, previous_state, record_unlogged_requeue, submitit_requeues
from xirang_hpc.runtime import testpoint
from xirang_hpc.slurm import accounting

TRAIN = [sys.executable, "-c", "from xirang_hpc.cli.train import main; main()"]

# sacct -n -P -X -D -j 1 --format=JobID,State,Start, recorded on the testbed: a job requeued with
# `scontrol requeue`, then preempted by a `high` job, now pending again.
SACCT_REQUEUED_THEN_PREEMPTED = ("1|REQUEUED|2026-11-30T21:24:04\n1|PREEMPTED|2026-11-30T21:24:10\n"
                                 "1|PENDING|Unknown\n")


def _env(restart: int, job: str = "7") -> dict[str, str]:
    return {"SLURM_RESTART_COUNT": str(restart), "SLURM_JOB_ID": job}


def test_previous_state_is_the_newest_ended_start_and_unknown_when_sacct_fails():
    seen = []

    def run(argv):
        seen.append(argv)
        return accounting.Result(0, SACCT_REQUEUED_THEN_PREEMPTED, "")

    assert previous_state("1", run) == "PREEMPTED"
    assert seen[0][:2] == ["sacct", "-n"] and "-D" in seen[0] and seen[0][seen[0].index("-j") + 1] == "1"
    assert previous_state("1", lambda a: accounting.Result(1, "", "slurmdbd: Connection refused")) is None
    assert previous_state("1", lambda a: accounting.Result(0, "1|RUNNING|2026-11-30T21:24:10\n", "")) is None


def test_classify_names_who_requeued():
    assert classify("PREEMPTED", 0, 0) == ("slurm", "preemption")
    assert classify("NODE_FAIL", 0, 0) == ("slurm", "node_failure")
    assert classify("REQUEUED", 0, 0) == ("scontrol", "requeued")
    # submitit's handler ran `scontrol requeue` (its log says so) and we have not logged that one yet.
    assert classify("REQUEUED", 2, 1) == ("submitit", "preemption")
    assert classify(None, 1, 0) == ("submitit", "preemption")
    assert classify("REQUEUED", 1, 1) == ("scontrol", "requeued")
    assert classify(None, 0, 0) == ("slurm", "unknown")


def test_an_unlogged_preemption_requeue_is_recorded_once_with_its_source(tmp_path):
    append_event(tmp_path, "start", "restart 0", job="7", restart=0)
    ev = record_unlogged_requeue(tmp_path, _env(1), state_of=lambda job: "PREEMPTED")
    assert ev is not None and (ev["source"], ev["reason"], ev["restart"]) == ("slurm", "preemption", 0)
    kinds = [(e["kind"], e.get("restart")) for e in read_events(tmp_path)]
    assert kinds == [("start", 0), ("stop", 0), ("requeue", 0)]
    stop = read_events(tmp_path)[1]
    assert stop["handled_by"] == "slurm" and stop["detail"] == "sacct State=PREEMPTED"
    # The next start of the same restart (an in-job restart, another rank) does not log it again.
    assert record_unlogged_requeue(tmp_path, _env(1), state_of=lambda job: "PREEMPTED") is None
    assert len(read_events(tmp_path)) == 3


def test_a_requeue_the_job_logged_is_not_recorded_again_and_a_first_start_has_none(tmp_path):
    asked = []
    append_event(tmp_path, "stop", "preemption", job="7", restart=0)
    append_event(tmp_path, "requeue", "preemption", job="7", restart=0)
    assert record_unlogged_requeue(tmp_path, _env(1), state_of=asked.append) is None
    assert record_unlogged_requeue(tmp_path, _env(0), state_of=asked.append) is None
    assert asked == []  # no sacct query when nothing is missing
    # Another job's requeue in the same run directory (a resubmission) does not count for job 8.
    ev = record_unlogged_requeue(tmp_path, _env(1, job="8"), state_of=lambda job: "NODE_FAIL")
    assert ev["job"] == "8" and ev["reason"] == "node_failure"
    # The stop was missing too, and is written; a stop that exists is not duplicated.
    assert [e["kind"] for e in read_events(tmp_path)][-2:] == ["stop", "requeue"]


def test_submitit_requeue_is_read_from_its_rank0_log(tmp_path):
    folder = tmp_path / "submitit"
    folder.mkdir()
    # Recorded on the testbed: submitit's rank-0 log when its handler requeued a job preempted in start-up.
    (folder / "7_0_log.err").write_text(
        "submitit WARNING (2026-11-30 21:30:49,192) - Bypassing signal SIGCONT\n"
        "submitit WARNING (2026-11-30 21:30:49,192) - Caught signal SIGUSR2 on vm: this job is preempted.\n"
        "slurmstepd-r1: error: *** JOB 7 ON r1 CANCELLED AT 2026-11-30T21:30:49 DUE TO JOB REQUEUE ***\n")
    # Not rank 0: submitit requeues only from rank 0.
    (folder / "7_1_log.err").write_text("Caught signal SIGUSR2 on vm: this job is preempted.\n")
    assert submitit_requeues(folder, "7") == 1
    ev = record_unlogged_requeue(tmp_path, _env(1), state_of=lambda job: "REQUEUED")
    assert (ev["source"], ev["reason"]) == ("submitit", "preemption")
    # Restart 2 after a requeue by an admin: submitit's one requeue is already accounted for.
    ev2 = record_unlogged_requeue(tmp_path, _env(2), state_of=lambda job: "REQUEUED")
    assert (ev2["source"], ev2["reason"], ev2["restart"]) == ("scontrol", "requeued", 1)


def test_array_task_requeue_is_matched_by_its_task_id(tmp_path):
    env = {**_env(1, job="12"), "SLURM_ARRAY_JOB_ID": "10", "SLURM_ARRAY_TASK_ID": "2"}
    append_event(tmp_path, "requeue", "preemption", job="10_2", restart=0)
    assert record_unlogged_requeue(tmp_path, env, state_of=lambda job: "PREEMPTED") is None
    targets = []
    record_unlogged_requeue(tmp_path, {**env, "SLURM_RESTART_COUNT": "2"}, state_of=lambda j: targets.append(j))
    assert targets == ["10_2"]


def test_slow_testpoint_parses_once_and_sleeps_only_where_it_says():
    assert testpoint.parse_slow("rank=3, s=6,steps=8+9,phases=data+forward") == testpoint.Slow(
        rank=3, s=6.0, steps=(8, 9), phases=("data", "forward"))
    assert testpoint.parse_slow("save_s=0.25,eval_s=0.5") == testpoint.Slow(save_s=0.25, eval_s=0.5)
    assert testpoint.parse_slow("rank=1") is testpoint.parse_slow("rank=1")  # parsed once
    with pytest.raises(ValueError, match="debug_slow_s.*rank, s, steps, phases, save_s, eval_s"):
        testpoint.parse_slow("debug_slow_s=1")
    assert testpoint.slow_phase(0, "data", 0, {}) == 0.0 and testpoint.slow_item("save", {}) == 0.0  # unset
    env = {testpoint.SLOW_ENV: "rank=1,s=0.1,steps=2,save_s=0.05"}
    assert testpoint.slow_phase(0, "data", 2, env) == 0.0  # another rank
    assert testpoint.slow_phase(1, "forward", 2, env) == 0.0  # another phase (default: data only)
    assert testpoint.slow_phase(1, "data", 3, env) == 0.0  # another step
    t0 = time.monotonic()
    assert testpoint.slow_phase(1, "data", 2, env) == 0.1 and testpoint.slow_item("save", env) == 0.05
    assert time.monotonic() - t0 >= 0.15
    assert testpoint.slow_item("eval", env) == 0.0
    every = {testpoint.SLOW_ENV: "rank=0,s=0.01"}  # no steps: every step
    assert all(testpoint.slow_phase(0, "data", step, every) == 0.01 for step in (0, 7))


def test_testpoint_pauses_only_at_its_stage_restart_and_arrival(tmp_path, monkeypatch):
    assert testpoint.parse("load@1=60, save@0#2=0.5,rendezvous=3,load@2/3=7") == {
        ("load", 1): (0, 60.0, -1), ("save", 0): (2, 0.5, -1), ("rendezvous", 0): (0, 3.0, -1),
        ("load", 2): (0, 7.0, 3)}
    monkeypatch.setattr(testpoint, "_arrivals", {})
    env = {testpoint.ENV: "save@0#2=0.2,load@1=0.2", testpoint.DIR_ENV: str(tmp_path), "SLURM_RESTART_COUNT": "0"}
    assert testpoint.pause("save", {}) == 0.0  # unset: nothing
    assert testpoint.pause("load", env) == 0.0  # another restart
    assert testpoint.pause("save", env) == 0.0  # first arrival; only the second pauses
    t0 = time.monotonic()
    assert testpoint.pause("save", env) == 0.2 and time.monotonic() - t0 >= 0.2
    assert [p.name for p in tmp_path.iterdir()] == [f"save@0.{os.getpid()}"]
    assert testpoint.pause("save", env) == 0.0
    # ``/RANK``: that rank only (the stage passes its rank)
    ranked = {testpoint.ENV: "load@0/3=0.05", "SLURM_RESTART_COUNT": "0"}
    assert testpoint.pause("load", ranked, rank=2) == 0.0 and testpoint.pause("load", ranked) == 0.0
    assert testpoint.pause("load", ranked, rank=3) == 0.05


@pytest.mark.slow
def test_a_corrupt_checkpoint_skipped_on_load_is_an_event_naming_the_step_used(stdlib_data, tmp_path):
    """A real run saves steps 10 and 20; bytes of step 20's shard are flipped; the extended run falls back
    to step 10 and events.jsonl says which checkpoint was skipped, why, and which step was used."""
    common = ["cluster=local", "cluster.nodes=1", "cluster.tasks_per_node=1", f"data.out_dir={stdlib_data}",
              f"train.runs_root={tmp_path}", "train.max_steps=20", "checkpoint.every_steps=10",
              "train.warmup_steps=2", "train.eval_batches=1", "train.wait=true", "parallel.pp=1", "parallel.tp=1"]
    out = subprocess.run(TRAIN + common, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stdout + out.stderr
    run = Path(re.search(r"run dir (\S+)", out.stdout).group(1))
    shard = run / "checkpoints" / "step_20" / "rank_0.h5"
    data = bytearray(shard.read_bytes())
    mid = len(data) // 2
    data[mid:mid + 64] = bytes(b ^ 0xFF for b in data[mid:mid + 64])
    shard.write_bytes(bytes(data))  # same size: only the checksum can tell
    out = subprocess.run(TRAIN + common + ["train.extend_to=30"], capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stdout + out.stderr
    skipped = [e for e in read_events(run) if e["kind"] == "checkpoint_skipped"]
    assert len(skipped) == 1, read_events(run)
    ev = skipped[0]
    assert ev["step"] == 20 and ev["used_step"] == 10 and ev["path"] == str(shard.parent), ev
    assert "rank_0.h5" in ev["reason"] and "checksum" in ev["reason"], ev
    starts = [e for e in read_events(run) if e["kind"] == "start"]
    assert starts[-1]["step"] == 10, starts


def test_a_stop_signal_before_the_hook_exists_is_handed_to_it(tmp_path):
    """Signals from the job function's first line (start-up, rendezvous, checkpoint load) are recorded,
    not left to submitit's handler, and the stop-signal hook acts on them at its first step boundary."""
    from conftest import compose_cfg

    from xirang_hpc.config.validate import load_config
    from xirang_hpc.runtime import signals
    from xirang_hpc.runtime.topology import Topology

    old = {s: signal.getsignal(s) for s in (signal.SIGUSR2, signal.SIGTERM)}
    try:
        signals.capture_early()
        os.kill(os.getpid(), signal.SIGUSR2)
        assert [name for name, _ in signals._early] == ["SIGUSR2"]
        topo = Topology(rank=0, world_size=1, local_rank=0, local_world_size=1, node_id=0, num_nodes=1,
                        node_name="n1", master_addr="127.0.0.1", master_port=1, job_id="1", source="single")
        hook = signals.StopSignalHook(load_config(compose_cfg([])), topo, tmp_path).installed()
        assert [name for name, _ in hook.received] == ["SIGUSR2"] and signals._early == []
        assert hook._local_code() == 1  # USR2: the first step boundary stops, saves and requeues
    finally:
        for s, h in old.items():
            signal.signal(s, h)
