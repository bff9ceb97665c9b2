"""Monitor logic without processes: detection rules, heartbeat timing, events, FLOPs, status views,
plot markers. Inputs are real files written by the monitor's own writers; the only substitute is
the Slurm command runner (no Slurm here), passed in explicitly."""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path

import pytest
from conftest import committed_stub

from xirang_hpc.cli.status import main as status_main
from xirang_hpc.config.errors import ConfigError
from xirang_hpc.config.schema import MonitorConfig
from xirang_hpc.files import write_json_atomic
from xirang_hpc.monitor.detect import ALIVE, GONE, STOPPED, Thresholds, WatchState, assess, bound_phase, hang_bound
from xirang_hpc.monitor.events import EVENTS_FILE, EventTail, append_event, failed_nodes, read_events
from xirang_hpc.monitor.flops import flops_per_token, mfu, peak_for_device
from xirang_hpc.monitor.heartbeat import (
    HEARTBEAT_DIR,
    SESSION_FILE,
    SESSIONS_LOG,
    Heartbeat,
    heartbeat_dir,
    read_heartbeats,
    read_json,
)
from xirang_hpc.runs.plot import plot_run
from xirang_hpc.runs.status import run_status
from xirang_hpc.slurm.jobs import slurm_state

TH = Thresholds(hang_s=30, stale_s=5, straggler_k=2.0, straggler_min_s=0.05, straggler_window=3)
NOW = 1000.0


def beat(rank: int, step: int = 10, phase: str = "backward", progress: float = NOW - 1, last: float = NOW - 0.5,
         **kw: object) -> dict:
    return {"rank": rank, "node": f"n{rank // 2}", "step": step, "phase": phase, "progress": progress, "beat": last,
            "pid": 100 + rank, **kw}


def test_dead_rank_without_exit_record_is_primary_peers_are_not_faults() -> None:
    beats = {r: beat(r) for r in range(4)}
    beats[0]["exited"], beats[0]["exit_time"] = True, NOW - 0.1  # crashed because rank 3 vanished
    st = WatchState()
    fs = assess(beats, {0: GONE, 1: ALIVE, 2: ALIVE, 3: GONE}, NOW, TH, st)
    assert [(f.kind, f.rank, f.node) for f in fs] == [("dead", 3, "n1"), ("peer_exit", 0, "n0")]
    assert "without an exit record" in fs[0].cause
    # Reported once; a later death is a peer exit; no hang is assessed after a death.
    fs = assess(beats, {0: GONE, 1: GONE, 2: ALIVE, 3: GONE}, NOW + 100, TH, st)
    assert [(f.kind, f.rank) for f in fs] == [("peer_exit", 1)]


def test_hang_inside_a_timed_step_is_named_within_k_times_the_step_time() -> None:
    """hang_k: a rank stopped mid-step is hung after max(hang_min_s, k x step time), not after hang_s."""
    th = Thresholds(hang_s=300, stale_s=5, hang_k=20, hang_min_s=10)
    timed = {"step_s": 0.2, "timed_steps": 5, "local_s": 0.01}
    assert hang_bound(beat(0, **timed), th) == 10  # 20 x 0.2 s = 4 s < hang_min_s
    assert hang_bound(beat(0, **{**timed, "step_s": 2.0}), th) == 40
    assert hang_bound(beat(0, **{**timed, "step_s": 60.0}), th) == 300  # never beyond hang_s
    # No measured steps yet (the first step, its data preparation), or start-up: hang_s.
    assert hang_bound(beat(0, step=0), th) == 300 and bound_phase(beat(0, step=0), th) == "first-step"
    assert hang_bound(beat(0, phase="start", **timed), th) == 300
    assert hang_bound(beat(0, phase="eval", step=0), th) == 300  # the initial evaluation: nothing measured
    # Saving, evaluation and the consensus: the step's bound, measured from the last phase change or tick.
    for phase, label in (("checkpoint", "saving"), ("eval", "eval"), ("comm", "step")):
        assert (hang_bound(beat(0, phase=phase, **timed), th), bound_phase(beat(0, phase=phase, **timed), th)) == \
            (10, label), phase
    assert hang_bound(beat(0, **timed), Thresholds(hang_s=300, hang_k=0)) == 300  # off

    beats = {r: beat(r, progress=NOW - 12, last=NOW - 0.5, **timed) for r in range(4)}
    beats[2]["beat"] = NOW - 12
    fs = assess(beats, {r: (STOPPED if r == 2 else ALIVE) for r in range(4)}, NOW, th, WatchState())
    assert [(f.kind, f.rank) for f in fs] == [("hang", 2)] and "stopped" in fs[0].cause
    assert fs[0].extra["bound_s"] == 10 and fs[0].extra["bound_phase"] == "step"
    assert fs[0].cause.startswith("rank 2 (node n1, pid 102) did not reach"), fs[0].cause
    # The same stall during a save or an evaluation that still ticks is no alarm; one that stopped ticking is.
    for phase in ("checkpoint", "eval"):
        moving = {r: dict(hb, phase=phase, active=NOW - 1) for r, hb in beats.items()}
        assert assess(moving, {r: ALIVE for r in range(4)}, NOW, th, WatchState()) == [], phase
        still = {r: dict(hb, phase=phase, active=NOW - 11) for r, hb in beats.items()}
        assert [f.kind for f in assess(still, {r: ALIVE for r in range(4)}, NOW, th, WatchState())] == ["hang"]
    # One rank still moving (a throttled or stopped-and-resumed rank): its waiting peers are no alarm.
    crawl = {**beats, 3: dict(beats[3], progress=NOW - 2)}
    assert assess(crawl, {r: ALIVE for r in range(4)}, NOW, th, WatchState()) == []


def test_hang_names_the_rank_that_did_not_reach_the_collective() -> None:
    """Per-rank collective counts: the rank with fewer issued collectives is named with what it missed."""
    th = Thresholds(hang_s=300, stale_s=5, hang_k=20, hang_min_s=10)
    timed = {"step_s": 0.2, "timed_steps": 5, "local_s": 0.01}
    beats = {r: beat(r, phase="backward", progress=NOW - 15, coll_seq=57, **timed) for r in range(4)}
    beats[3].update(phase="forward", coll_seq=56)
    fs = assess(beats, {r: ALIVE for r in range(4)}, NOW, th, WatchState())
    assert [(f.kind, f.rank) for f in fs] == [("hang", 3)]
    assert fs[0].cause.startswith("rank 3 (node n1, pid 103) did not reach collective #57 (the gradient all-reduce "
                                  "of step 10) that rank(s) 0, 1, 2 wait in; it issued #56"), fs[0].cause
    # Same phase everywhere: the counts alone find it (SIGSTOP between two collectives of one phase).
    same = {r: dict(hb, phase="backward") for r, hb in beats.items()}
    fs = assess(same, {r: ALIVE for r in range(4)}, NOW, th, WatchState())
    assert [f.rank for f in fs] == [3] and "did not reach collective #57" in fs[0].cause
    # Inside the collective with everyone (equal counts), stopped: named as not completing it.
    inside = {r: dict(hb, coll_seq=57) for r, hb in same.items()}
    fs = assess(inside, {r: (STOPPED if r == 1 else ALIVE) for r in range(4)}, NOW, th, WatchState())
    assert [f.rank for f in fs] == [1] and "did not reach the end of the gradient all-reduce of step 10" in fs[0].cause
    # No counts (or equal ones: the hierarchical hook's gradient all-reduce is not on the world group):
    # the (step, phase) positions name what it missed.
    plain = {r: {k: v for k, v in hb.items() if k != "coll_seq"} for r, hb in beats.items()}
    fs = assess(plain, {r: ALIVE for r in range(4)}, NOW, th, WatchState())
    assert [f.rank for f in fs] == [3]
    assert fs[0].cause.startswith("rank 3 (node n1, pid 103) did not reach the gradient all-reduce of step 10 that "
                                  "rank(s) 0, 1, 2 wait in; it is in forward of step 10"), fs[0].cause


def test_finished_rank_that_exits_is_not_dead() -> None:
    beats = {0: beat(0, done=True), 1: beat(1, done=True)}
    assert assess(beats, {0: GONE, 1: GONE}, NOW, TH, WatchState()) == []


def test_ranks_leaving_on_an_agreed_stop_are_neither_hung_nor_dead() -> None:
    """After a requeue/time-limit stop every rank is in phase ``exit``: a teardown that outlasts every bound on
    a loaded node (heartbeat thread silent, no progress) is no hang, and Slurm killing it is no death.
    The same snapshot in the consensus phase is a hang, so the phase is what tells them apart."""
    th = Thresholds(hang_s=300, stale_s=5, hang_k=20, hang_min_s=10)
    timed = {"step_s": 0.2, "timed_steps": 5, "local_s": 0.01}
    stale = {r: beat(r, phase="exit", progress=NOW - 60, last=NOW - 60, **timed) for r in range(2)}
    for hb in stale.values():
        hb["beat"] = NOW - 60
    assert assess(stale, {0: ALIVE, 1: ALIVE}, NOW, th, WatchState()) == []
    assert assess(stale, {0: GONE, 1: ALIVE}, NOW, th, WatchState()) == []  # killed without an exit record
    in_comm = {r: dict(hb, phase="comm") for r, hb in stale.items()}
    assert [f.kind for f in assess(in_comm, {0: ALIVE, 1: ALIVE}, NOW, th, WatchState())] == ["hang", "hang"]
    assert [f.kind for f in assess(in_comm, {0: GONE, 1: ALIVE}, NOW, th, WatchState())] == ["dead"]


def test_hang_names_stopped_rank_then_lagging_then_odd_phase_then_first_stalled() -> None:
    stalled = NOW - 40
    base = {r: beat(r, progress=stalled) for r in range(4)}
    # (1) a stopped process wins, whatever the others say
    fs = assess(base, {0: ALIVE, 1: ALIVE, 2: STOPPED, 3: ALIVE}, NOW, TH, WatchState())
    assert [(f.kind, f.rank) for f in fs] == [("hang", 2)] and "stopped" in fs[0].cause
    assert fs[0].extra["stalled_ranks"] == [0, 1, 2, 3]
    # (2) a silent heartbeat on another host
    b = {**base, 1: beat(1, progress=stalled, last=NOW - 20)}
    fs = assess(b, {r: None for r in b}, NOW, TH, WatchState())
    assert [(f.kind, f.rank) for f in fs if f.kind == "hang"] == [("hang", 1)]
    assert [f.rank for f in fs if f.kind == "unresponsive"] == [1]
    # (3) one rank a step behind
    b = {**base, 3: beat(3, step=9, phase="data", progress=stalled)}
    fs = assess(b, {r: ALIVE for r in b}, NOW, TH, WatchState())
    assert [(f.rank, f.phase) for f in fs] == [(3, "data")] and "step 9 while others reached step 10" in fs[0].cause
    # (4) same step, odd phase out
    b = {**base, 0: beat(0, phase="forward", progress=stalled)}
    fs = assess(b, {r: ALIVE for r in b}, NOW, TH, WatchState())
    assert [f.rank for f in fs] == [0] and "wait in 'backward'" in fs[0].cause
    # (5) nobody stands out: the first to stall
    b = {**base, 2: beat(2, progress=stalled - 3)}
    fs = assess(b, {r: ALIVE for r in b}, NOW, TH, WatchState())
    assert [f.rank for f in fs] == [2] and "network hang" in fs[0].cause


def test_hang_culprit_is_the_rank_outside_comm_even_when_tied() -> None:
    # 2 ranks, 1-1: rank 0 announced the consensus all-reduce ("comm"), rank 1 is still saving.
    # A majority vote cannot decide; the rank in the collective is waiting, so rank 1 is named,
    # whichever order the heartbeats come in.
    stalled = NOW - 40
    for order in ((0, 1), (1, 0)):
        phases = {0: "comm", 1: "checkpoint"}
        b = {r: beat(r, phase=phases[r], progress=stalled) for r in order}
        fs = assess(b, {0: ALIVE, 1: ALIVE}, NOW, TH, WatchState())
        assert [(f.kind, f.rank, f.phase) for f in fs] == [("hang", 1, "checkpoint")], fs
        assert "1 rank(s) wait in a collective ('comm')" in fs[0].cause
    # every rank in comm: a collective/network hang, the first to stall is named
    b = {r: beat(r, phase="comm", progress=stalled + r) for r in range(3)}
    fs = assess(b, {r: ALIVE for r in b}, NOW, TH, WatchState())
    assert [(f.rank, f.phase) for f in fs] == [(0, "comm")] and "network hang" in fs[0].cause


def test_signal_hook_announces_comm_before_its_all_reduce(tmp_path: Path) -> None:
    # The consensus all-reduce is what a rank blocks in at the step boundary; the hook must say so.
    import types

    from conftest import compose_cfg

    from xirang_hpc.config.validate import load_config
    from xirang_hpc.runtime import signals
    from xirang_hpc.runtime.topology import Topology

    seen: list[str] = []

    class Recorder(signals.StopSignalHook):
        def _agree(self, code: int) -> int:
            seen.append("all_reduce")
            return code

    cfg = load_config(compose_cfg(["cluster=local"]))
    for world, want in ((2, ["comm", "all_reduce"]), (1, ["all_reduce"])):
        seen.clear()
        topo = Topology(rank=0, world_size=world, local_rank=0, local_world_size=world, node_id=0, num_nodes=1,
                        node_name="n1", master_addr="127.0.0.1", master_port=1, job_id="1", source="local")
        hook = Recorder(cfg, topo, tmp_path)
        trainer = types.SimpleNamespace(state=types.SimpleNamespace(step=1), stop_requested=False,
                                        phase=seen.append)
        hook.first_step_logged = True
        hook.on_step_end(trainer, {})
        assert seen == want


def test_no_hang_below_threshold_and_hang_reported_once() -> None:
    b = {r: beat(r, progress=NOW - 29) for r in range(2)}
    st = WatchState()
    assert assess(b, {0: ALIVE, 1: ALIVE}, NOW, TH, st) == []
    assert len(assess(b, {0: ALIVE, 1: ALIVE}, NOW + 2, TH, st)) == 1
    assert assess(b, {0: ALIVE, 1: ALIVE}, NOW + 4, TH, st) == []


def test_straggler_needs_k_times_median_and_absolute_excess() -> None:
    def beats(slow: float) -> dict:
        return {r: beat(r, local_s=slow if r == 1 else 0.02, timed_steps=3) for r in range(4)}

    st = WatchState()
    fs = assess(beats(0.30), {r: ALIVE for r in range(4)}, NOW, TH, st)
    assert [(f.kind, f.rank) for f in fs] == [("straggler", 1)] and fs[0].extra["median_local_s"] == 0.02
    assert assess(beats(0.30), {r: ALIVE for r in range(4)}, NOW, TH, st) == []  # once
    # 3x the median but only 40 ms more: noise, not a straggler
    assert assess(beats(0.06), {r: ALIVE for r in range(4)}, NOW, TH, WatchState()) == []
    # too few timed steps
    b = {r: beat(r, local_s=0.3 if r == 1 else 0.02, timed_steps=2) for r in range(4)}
    assert assess(b, {r: ALIVE for r in range(4)}, NOW, TH, WatchState()) == []


def test_heartbeat_times_local_work_and_writes_atomically(tmp_path: Path) -> None:
    hb = Heartbeat(heartbeat_dir(tmp_path) / "rank-0.json", {"rank": 0, "session": "s"}, window=2)
    for k in range(3):
        t = 100.0 * k
        hb.mark_phase("data", t)
        hb.mark_phase("forward", t + 1.0)
        hb.mark_phase("backward", t + 3.0)   # data = 1 s of local work
        hb.mark_phase("optimizer", t + 10.0)
        hb.mark_step(k + 1, t + 11.0)
    hb.write()
    got = read_heartbeats(tmp_path, "s")[0]
    assert (got["step"], got["step_s"], got["local_s"], got["timed_steps"]) == (3, 11.0, 1.0, 2)
    assert read_heartbeats(tmp_path, "other") == {}
    assert [p.name for p in (tmp_path / HEARTBEAT_DIR).iterdir()] == ["rank-0.json"]  # no temp files left
    assert oct((tmp_path / HEARTBEAT_DIR).stat().st_mode & 0o777) == "0o700"


def test_events_append_read_and_failed_nodes(tmp_path: Path) -> None:
    append_event(tmp_path, "straggler", "slow", node="n1")
    append_event(tmp_path, "dead", "gone", node="n2", rank=5)
    with (tmp_path / "events.jsonl").open("a") as f:
        f.write('{"torn": \n')
    append_event(tmp_path, "hang", "stuck", node="n3")
    append_event(tmp_path, "dead", "again", node="n2")
    assert [e["kind"] for e in read_events(tmp_path)] == ["straggler", "dead", "hang", "dead"]
    assert failed_nodes(tmp_path) == ["n2", "n3"]
    assert oct((tmp_path / "events.jsonl").stat().st_mode & 0o777) == "0o600"


def test_flops_match_narayanan_and_mfu() -> None:
    l_, h, s, v = 24, 2304, 2048, 51200
    # Narayanan et al. (SC21) without recomputation: 72*l*h^2*(1 + s/(6h)) + 6*h*V per token.
    expect = 72 * l_ * h * h * (1 + s / (6 * h)) + 6 * h * v
    assert flops_per_token(l_, h, s, v, 4 * h) == pytest.approx(expect, rel=1e-12)
    assert peak_for_device("NVIDIA H100 80GB HBM3") == 989.0 and peak_for_device("cpu") == 0.0
    assert mfu(1000.0, 1e9, 2, 1.0) == 0.5 and mfu(1000.0, 1e12, 0, 312.0) is None


def test_monitor_config_rejects_requeue_signals_and_bad_staleness() -> None:
    with pytest.raises(ConfigError, match="monitor.stack_signal.*requeue signals"):
        MonitorConfig(stack_signal="SIGUSR2")
    with pytest.raises(ConfigError, match="monitor.stale_s"):
        MonitorConfig(heartbeat_s=5, stale_s=6)


def _fake_run(tmp: Path, job: str, sessions: list[int], steps: int, total: int, done: bool,
              events: list[tuple[str, dict]] = ()) -> Path:
    """A run directory as the monitor and trainer leave it, for a process that is no longer running."""
    run = tmp / f"run-{job}"
    hdir = heartbeat_dir(run)
    t0 = time.time() - 100
    for k, start in enumerate(sessions):
        row = {"session": f"s{k}", "job_id": job, "source": "local", "host": socket.gethostname(),
               "started": t0 + k, "start_step": start, "max_steps": total, "global_batch": 8, "seq_len": 16,
               "flops_per_token": 1e6, "devices": 0, "peak_tflops": 0, "world_size": 2, "num_nodes": 1,
               "model": "tiny"}
        write_json_atomic(hdir / SESSION_FILE, row)
        with (hdir / SESSIONS_LOG).open("a") as f:
            f.write(json.dumps(row) + "\n")
    for r in range(2):
        write_json_atomic(hdir / f"rank-{r}.json", {"rank": r, "node": "vnode0", "pid": 2**22 + 7, "host": "elsewhere",
                                                     "session": f"s{len(sessions) - 1}", "step": steps, "phase": "done"
                                                     if done else "forward", "progress": t0, "beat": t0, "done": done,
                                                     "started": t0, "rss_mb": 100.0, "cpu_pct": 50.0})
    with (run / "metrics.jsonl").open("w") as f:
        for s in range(5, steps + 1, 5):
            f.write(json.dumps({"step": s, "loss": 5.0 / s, "tokens_per_s": 1000.0, "time": t0 + s}) + "\n")
    for kind, fields in events:
        append_event(run, kind, fields.pop("reason", kind), **fields)
    return run


def test_status_requeued_run_counts_requeues_and_plot_marks_them(tmp_path: Path) -> None:
    run = _fake_run(tmp_path, "9999977", sessions=[0, 30], steps=60, total=100, done=True,
                    events=[("requeue", {"reason": "preemption", "step": 30})]
                    + [("checkpoint", {"reason": f"step {s} committed", "step": s}) for s in (10, 25, 50)])
    committed_stub(run / "checkpoints" / "step_50")
    committed_stub(run / "checkpoints" / "step_25")  # step 10 was pruned by retention
    with (run / "metrics.jsonl").open("a") as f:
        for s in (0, 60):
            f.write(json.dumps({"step": s, "val_loss": 4.0 - s / 30}) + "\n")
    s = run_status(run)
    assert (s["state"], s["requeues"], s["sessions"], s["step"], s["total_steps"]) == ("COMPLETED", 1, 2, 60, 100)
    assert s["checkpoint"]["step"] == 50 and 0 <= s["checkpoint"]["age_s"] < 600  # written by this test just now
    assert s["loss"] == pytest.approx(5.0 / 60) and s["tflops"] == pytest.approx(1000.0 * 1e6 / 1e12)
    info = plot_run(run, tmp_path / "p.png")
    assert info["requeue_steps"] == [30] and info["points"] == 12
    # every checkpoint ever committed (the event log), the pruned one drawn apart
    assert info["checkpoint_steps"] == [10, 25, 50] and info["pruned_checkpoint_steps"] == [10]
    # two evaluations are two points, not a line between them; the throughput axis starts at zero
    assert info["val_points"] == [0, 60] and info["val_segments"] == []
    assert info["tokens_per_s_ylim"][0] == 0.0
    assert (tmp_path / "p.png").read_bytes()[:4] == b"\x89PNG"


def test_a_plain_rerun_is_not_a_requeue_slurm_restarts_are(tmp_path: Path) -> None:
    # Two sessions (the same run started twice by hand), no requeue event, no Slurm restart count.
    run = _fake_run(tmp_path, "9999978", sessions=[0, 30], steps=60, total=100, done=True)
    assert run_status(run)["requeues"] == 0
    assert plot_run(run, tmp_path / "p.png")["requeue_steps"] == []
    # Slurm says the job was requeued twice (scontrol's Restarts): that is the count.
    sc = "JobId=9999978 JobState=RUNNING Reason=None Restarts=2"
    hdir = run / HEARTBEAT_DIR
    session = json.loads((hdir / SESSION_FILE).read_text())
    write_json_atomic(hdir / SESSION_FILE, {**session, "source": "slurm"})
    s = run_status(run, run=lambda argv: {"squeue": "RUNNING|None\n", "scontrol": sc}.get(argv[0]))
    assert (s["state"], s["requeues"]) == ("RUNNING", 2)


def test_periodic_evaluation_is_drawn_as_measured(tmp_path: Path) -> None:
    from xirang_hpc.runs.plot import val_segments

    run = _fake_run(tmp_path, "9999979", sessions=[0], steps=60, total=60, done=True)
    with (run / "metrics.jsonl").open("a") as f:
        for s in (0, 20, 40, 60):
            f.write(json.dumps({"step": s, "val_loss": 4.0 - s / 30}) + "\n")
    info = plot_run(run, tmp_path / "p.png")
    assert info["val_points"] == [0, 20, 40, 60] and info["val_segments"] == [(0, 20), (20, 40), (40, 60)]
    # a gap (evaluations missing between 20 and 90) is not bridged
    assert val_segments([0, 10, 20, 90, 100]) == [(0, 10), (10, 20), (90, 100)]
    assert val_segments([0, 300]) == []


def test_status_failed_run_and_array_view_one_line_per_task(tmp_path: Path, capsys) -> None:
    root = tmp_path / "sweep"
    root.mkdir()
    _fake_run(root, "500_0", sessions=[0], steps=40, total=40, done=True)
    _fake_run(root, "500_1", sessions=[0], steps=15, total=40, done=False,
              events=[("dead", {"reason": "rank 1 on vnode0 (forward, step 15): dead: killed", "node": "vnode0"})])
    _fake_run(root, "501", sessions=[0], steps=5, total=40, done=False)
    s = run_status(root / "run-500_1")
    assert s["state"] == "FAILED" and s["state_reason"].startswith("rank 1 on vnode0")
    assert status_main([str(root)]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 4 and lines[0].startswith("task")
    assert lines[1].split()[:3] == ["500_0", "COMPLETED", "40/40"]
    assert lines[2].split()[:3] == ["500_1", "FAILED", "15/40"] and "rank 1 on vnode0" in lines[2]
    # by job id: the array's two tasks, not job 501
    assert status_main(["500", "--runs-root", str(root), "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert [r["job_id"] for r in got["runs"]] == ["500_0", "500_1"]
    assert status_main(["999", "--runs-root", str(root)]) == 2
    assert "no run directory for job '999'" in capsys.readouterr().err


def test_slurm_state_prefers_squeue_then_sacct_then_scontrol_and_degrades() -> None:
    # No Slurm here: the single subprocess function is replaced by canned outputs of the real commands.
    def runner(table: dict[str, str | None]):
        return lambda argv: table.get(argv[0])

    sc = "JobId=7 JobName=x JobState=PENDING Reason=BeginTime Restarts=2 BatchFlag=1"
    assert slurm_state("7", runner({"squeue": "RUNNING|None\n", "scontrol": sc})) == {
        "state": "RUNNING", "reason": "None", "source": "squeue", "restarts": "2"}
    # sacct -D: one line per run of the job (here requeued once), fields as accounting.SACCT_FIELDS.
    sacct = ("7|x|root|proja|normal|low|REQUEUED|0:0|00:00:03|2026-11-30T17:48:16|2026-11-30T17:48:16|"
             "2026-11-30T17:48:19|2|q[1-2]|2|6|None\n"
             "7|x|root|proja|normal|low|COMPLETED|0:0|00:00:06|2026-11-30T17:48:16|2026-11-30T17:48:22|"
             "2026-11-30T17:48:28|2|q[1-2]|2|12|None\n")
    done = slurm_state("7", runner({"squeue": "", "sacct": sacct}))
    assert (done["state"], done["exit_code"], done["source"], done["restarts"]) == ("COMPLETED", "0:0", "sacct", "1")
    assert (done["elapsed"], done["nodes"], done["cpu_seconds"]) == ("00:00:06", "q[1-2]", "18")
    assert slurm_state("7", runner({"squeue": None, "sacct": None, "scontrol": sc}))["state"] == "PENDING"
    assert slurm_state("7", runner({})) == {}
    # sacct names who cancelled (a uid); the state says so with the user's name.
    cancelled = sacct.splitlines()[0].replace("REQUEUED", "CANCELLED by 0") + "\n"
    gone = slurm_state("7", runner({"squeue": "", "sacct": cancelled}))
    assert gone["state"] == "CANCELLED" and gone["reason"].startswith("cancelled by root (uid 0); exit code 0:0")


def test_submitted_run_not_yet_started_shows_its_slurm_state(tmp_path: Path) -> None:
    # Only the launcher's submit event exists (no session, no metrics): the job id comes from it.
    # No Slurm here: canned squeue output through the single subprocess function.
    root = tmp_path / "runs"
    run = root / "run-a"
    run.mkdir(parents=True)
    append_event(run, "submit", "submitted", job="77_1", array="77", task=1, cluster="testbed")
    asked: list[list[str]] = []

    def runner(argv: list[str]) -> str | None:
        asked.append(argv)
        return "PENDING|JobArrayTaskLimit\n" if argv[0] == "squeue" else None

    s = run_status(run, run=runner)
    assert (s["job_id"], s["executor"], s["state"], s["state_reason"]) == ("77_1", "slurm", "PENDING",
                                                                           "JobArrayTaskLimit")
    assert asked[0][:4] == ["squeue", "-h", "-j", "77_1"]
    from xirang_hpc.runs.status import find_runs

    assert find_runs(root, "77") == [run] and find_runs(root, "78") == []


GOLDEN = Path(__file__).parent / "golden"


def _early_failure(root: Path, name: str, job: str) -> Path:
    """A run directory as a job that failed before its first step leaves it: only submitit's logs."""
    import traceback

    run = root / name
    (run / "submitit").mkdir(parents=True)
    try:
        raise FileNotFoundError("data.out_dir=/data/nodata has no index.json; run xirang-prepare first")
    except FileNotFoundError:
        tb = traceback.format_exc()
    (run / "submitit" / f"{job}_0_log.out").write_text("starting\n")
    (run / "submitit" / f"{job}_0_log.err").write_text(f"submitit ERROR (2026-11-30) - Submitted job triggered "
                                                      f"an exception\n{tb}")
    return run


def test_status_lists_every_run_sorted_by_task_in_fixed_columns(tmp_path: Path, capsys) -> None:
    """Array tasks in task order (2 before 10), a run that failed before training with its cause, a
    state longer than its column, all in columns that do not shift (golden file)."""
    root = tmp_path / "sweep"
    root.mkdir()
    for task, steps in ((10, 40), (2, 40), (0, 40)):
        _fake_run(root, f"700_{task}", sessions=[0], steps=steps, total=40, done=True)
    # a task stopped for good by the requeue policy: its final exit status is longer than the state column
    _fake_run(root, "700_3", sessions=[0], steps=20, total=40, done=False,
              events=[("exit", {"reason": "preemption", "final": True, "status": "max_requeues_exceeded"})])
    _early_failure(root, "run-early", "4242")
    snap_rows = [run_status(p, now=0.0) for p in sorted(root.iterdir())]
    assert len(snap_rows) == 5  # the early failure is a run too
    assert status_main([str(root)]) == 0
    text = capsys.readouterr().out
    lines = text.rstrip("\n").splitlines()
    assert [ln.split()[0] for ln in lines[1:]] == ["700_0", "700_2", "700_3", "700_10", "4242"]
    # every line has the run name at the same column
    col = lines[0].index("  run: ")
    assert all(ln[col:col + 2] == "  " and ln[col + 2] != " " for ln in lines)
    assert "MAX_REQUEUES_~" in lines[3] and "preemption" in lines[3]
    assert "FAILED" in lines[5] and "failed before training started: FileNotFoundError: data.out_dir=" in lines[5]
    # the golden file: paths and ages are the only things that vary between machines
    norm = text.replace(str(tmp_path), "TMP")
    golden = GOLDEN / "status_array.txt"
    if os.environ.get("XIRANG_UPDATE_GOLDEN"):
        golden.write_text(norm)
    assert norm == golden.read_text()
    # by job id
    assert status_main(["4242", "--runs-root", str(root), "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["state"] == "FAILED" and got["job_id"] == "4242" and got["state_source"] == "job log"


def test_status_missing_path_is_no_such_run_directory(tmp_path: Path, capsys) -> None:
    assert status_main([str(tmp_path / "nope")]) == 2
    err = capsys.readouterr().err
    assert f"no such run directory: {tmp_path / 'nope'}" in err and "unknown job" not in err
    assert status_main(["runs/typo-dir"]) == 2
    assert "no such run directory" in capsys.readouterr().err
    (tmp_path / "f.txt").write_text("x")
    assert status_main([str(tmp_path / "f.txt")]) == 2
    assert "is a file, not a run directory" in capsys.readouterr().err
    # comparing: each argument must be a run directory
    run = _fake_run(tmp_path, "1", sessions=[0], steps=10, total=10, done=True)
    assert status_main([str(run), str(tmp_path / "nope")]) == 2
    assert "no such run directory" in capsys.readouterr().err


def test_a_sweeps_submitit_folder_is_not_a_run(tmp_path: Path) -> None:
    from xirang_hpc.runs import status as st
    from xirang_hpc.runs.status import find_runs, is_run_dir
    from xirang_hpc.submit.slurm import RUN_DIR_MAP, write_run_dir_map

    assert st.RUN_DIR_MAP == RUN_DIR_MAP  # the monitor reads the launcher's file by name (no upward import)
    root = tmp_path / "runs"
    run = _early_failure(root, "exp-tiny-abc", "77_0")
    sweep = root / "sweeps" / "exp-123"
    write_run_dir_map(sweep / "submitit", [run], array=True)
    write_run_dir_map(run / "submitit", [run], array=False)  # a pipeline's own map names itself
    assert not is_run_dir(sweep) and is_run_dir(run)
    assert find_runs(root) == [run] and find_runs(root / "sweeps") == []


def test_event_tail_reads_each_appended_event_once_and_waits_for_a_torn_line(tmp_path):
    """The in-job driver's poll: only what was appended since the last read, whole lines only."""
    tail = EventTail(tmp_path)
    assert tail.read() == []  # no file yet
    append_event(tmp_path, "start", "first", step=0)
    append_event(tmp_path, "dead", "rank 1", rank=1)
    assert [e["kind"] for e in tail.read()] == ["start", "dead"]
    assert tail.read() == []  # nothing new
    with open(tmp_path / EVENTS_FILE, "ab") as f:  # a writer caught mid-line
        f.write(b'{"time": 1.0, "kind": "ab')
    assert tail.read() == []
    with open(tmp_path / EVENTS_FILE, "ab") as f:
        f.write(b'ort", "reason": "x"}\nnot json\n')
    assert [e["kind"] for e in tail.read()] == ["abort"]  # the finished line; the foreign one skipped
    append_event(tmp_path, "requeue", "y")
    assert [e["kind"] for e in tail.read()] == ["requeue"]
    assert [e["kind"] for e in read_events(tmp_path)] == ["start", "dead", "abort", "requeue"]


def test_heartbeats_start_before_the_restore_and_the_session_takes_the_step_restored(tmp_path: Path,
                                                                                     monkeypatch) -> None:
    import atexit
    import faulthandler

    from conftest import FakeLoop, compose_cfg

    from xirang_hpc.config.validate import load_config
    from xirang_hpc.monitor import trainer_hook
    from xirang_hpc.runtime import liveness
    from xirang_hpc.runtime.topology import Topology

    # This process is the rank: no watchdog process, no stack-dump handler or exit hook left in it.
    monkeypatch.setattr(trainer_hook, "spawn", lambda *a: 4242)
    monkeypatch.setattr(faulthandler, "register", lambda *a, **k: None)
    monkeypatch.setattr(atexit, "register", lambda *a, **k: None)
    topo = Topology(rank=0, world_size=1, local_rank=0, local_world_size=1, node_id=0, num_nodes=1,
                    node_name="n1", master_addr="127.0.0.1", master_port=0, job_id="local", source="single")
    mon = trainer_hook.MonitorHook(load_config(compose_cfg([])), topo, tmp_path)
    hdir = tmp_path / "heartbeats"
    loop = FakeLoop(0)
    mon.start_hook().on_fit_start(loop)  # registered before the weight import and the restore
    try:
        hb = read_json(hdir / "rank-0.json")
        assert hb is not None and (hb["phase"], hb["step"], hb["watchdog_pid"]) == ("start", 0, 4242), hb
        first = read_json(hdir / "session.json")
        assert first is not None and first["session"] == hb["session"] and first["restoring"], first
        assert "start_step" not in first and not (hdir / "sessions.jsonl").exists()
        assert run_status(tmp_path)["nodes"][0]["ranks"] == [0]  # xirang-status reads this start meanwhile
        mon.on_phase(loop, "restore")  # the checkpoint hook announces its load
        liveness.tick("checkpoint read")
        mon.hb.write()
        hb = read_json(hdir / "rank-0.json")
        assert hb["phase"] == "restore" and hb["activity"] == "checkpoint read", hb
        loop.state.step = 40  # the restore reached step 40
        mon.on_fit_start(loop)  # registered after the restore: the same session, the step restored
        mon.hb.write()
        hb = read_json(hdir / "rank-0.json")
        assert (hb["phase"], hb["step"], hb["session"]) == ("start", 40, first["session"]), hb
        final = read_json(hdir / "session.json")
        assert final["start_step"] == 40 and "restoring" not in final and final["started"] == first["started"]
        rows = (hdir / "sessions.jsonl").read_text().splitlines()
        assert [json.loads(r)["start_step"] for r in rows] == [40]
    finally:
        mon.on_fit_end(loop, {})


def test_a_rank_that_exited_with_an_error_at_start_up_names_the_error_from_its_log(tmp_path) -> None:
    """The watchdog sees a rank leave with an error (a refused checkpoint in the restore) and records only that;
    the status adds the exception from the job's log, which says what to do."""
    import json as _json
    import time as _time

    from xirang_hpc.runs.status import run_status

    started = _time.time() - 60
    hdir = tmp_path / "heartbeats"
    hdir.mkdir()
    (hdir / "session.json").write_text(_json.dumps({"session": "s1", "job_id": "999999999", "source": "local",
                                                     "host": "elsewhere", "started": started, "restoring": True}))
    dead = {"time": started + 5, "kind": "dead", "rank": 0,
            "reason": "rank 0 on vnode0 (restore, step 0): dead: process exited with an error before finishing "
                      "(see its log)"}
    (tmp_path / "events.jsonl").write_text(_json.dumps(dead) + "\n")
    (tmp_path / "submitit").mkdir()
    (tmp_path / "submitit" / "999999999_0_log.err").write_text(
        "Traceback (most recent call last):\n  File \"x.py\", line 1, in <module>\n"
        "xirang_hpc.checkpoint.integrity.CheckpointCorruptError: no checkpoint under runs/x/checkpoints is usable\n")
    s = run_status(tmp_path, run=lambda *a, **k: "")
    assert s["state"] == "FAILED", s
    assert s["state_reason"].startswith("rank 0 on vnode0 (restore, step 0): dead: process exited with an error"), s
    assert s["state_reason"].endswith("CheckpointCorruptError: no checkpoint under runs/x/checkpoints is usable"), s
