"""Goodput per run: hand-built ``steps.jsonl`` / ``events.jsonl`` with known answers for every bucket, bad input
(torn and interleaved lines, clocks that disagree, no accounting), the recording hook, the CLI, and a real run
killed with SIGKILL and resumed."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import signal
import subprocess
import sys
import time
import types
import uuid
from pathlib import Path
from typing import Any

import pytest

from xirang_hpc.cli import status as status_cli
from xirang_hpc.monitor import goodput
from xirang_hpc.monitor.goodput import Allocation, load_run, report, run_goodput
from xirang_hpc.monitor.goodput_hook import GoodputHook
from xirang_hpc.runtime.topology import Topology
from xirang_hpc.slurm.accounting import HistJob

T0 = 1_700_000_000.0  # wall time of the first process start


def _w(path: Path, rows: list[dict[str, Any]], extra: str = "") -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + extra)


def session(pid: int, proc_start: float, startup: float, setup: float, restored: int, eval_s: float = 0.0,
            job: str = "local-1", mono0: float = 1000.0) -> dict[str, Any]:
    """A session row whose process started at ``proc_start`` (wall) and reached fit start ``startup`` s later."""
    return {"kind": "session", "pid": pid, "host": "n0", "job": job, "time": proc_start + startup, "mono": mono0,
            "startup_s": startup, "setup_s": setup, "eval_s": eval_s, "step": restored}


def blocks(s: dict[str, Any], spec: list[tuple[int, int, float, float, float, float]]) -> list[dict[str, Any]]:
    """Contiguous blocks after the session's set-up: (first step, last step, seconds, data, eval, save)."""
    mono = s["mono"] + s["setup_s"] + s["eval_s"]
    out = []
    for a, b, dur, data, ev, save in spec:
        mono += dur
        n = b - a + 1
        out.append({"pid": s["pid"], "a": a, "b": b, "time": s["time"] + mono - s["mono"], "mono": mono, "dur": dur,
                    "data": data, "eval": ev, "save": save, "med": (dur - data - ev - save) / n})
    return out


def end_of(s: dict[str, Any], after: dict[str, Any], eval_s: float, step: int) -> dict[str, Any]:
    return {"kind": "end", "pid": s["pid"], "time": after["time"] + eval_s, "mono": after["mono"] + eval_s,
            "step": step, "eval_s": eval_s}


def _clean_run(tmp_path: Path) -> Path:
    """One start, no disruption: 10 s start-up, 2 s set-up, 1 s initial eval, 20 steps of 1 s (+ data, eval, saves),
    a 0.5 s final eval and a 3 s final save."""
    run = tmp_path / "clean"
    run.mkdir()
    s = session(1, T0, startup=10.0, setup=2.0, restored=0, eval_s=1.0)
    bl = blocks(s, [(1, 1, 1.0, 0.0, 0.0, 0.0), (2, 10, 9.5, 0.2, 0.3, 0.0), (11, 20, 10.4, 0.1, 0.0, 0.3)])
    end = end_of(s, bl[-1], 0.5, 20)
    _w(run / "steps.jsonl", [s, *bl, end])
    _w(run / "events.jsonl", [{"time": end["time"] + 3.0, "kind": "exit", "reason": "completed", "status": "completed",
                               "final": True, "step": 20}])
    return run


def test_a_clean_run_splits_into_known_buckets_and_says_what_is_unknown(tmp_path):
    r = run_goodput(_clean_run(tmp_path), allocations=None)
    b = r["badput_s"]
    assert r["basis"] == "observed" and r["allocated_s"] is None and r["queue_wait_s"] is None
    assert r["unknown"][:2] == ["allocated", "queue_wait"]
    # 10 + 2 + 1 + 20.9 + 0.5 + 3 seconds of records.
    assert r["total_s"] == pytest.approx(37.4)
    assert b["startup"] == pytest.approx(12.0)  # process start -> first step's set-up (nothing restored)
    assert b["restore"] == 0 and b["lost_progress"] == 0 and b["recovery"] == 0 and b["hang_detection"] == 0
    assert b["eval"] == pytest.approx(1.0 + 0.3 + 0.5)
    assert b["data_loading"] == pytest.approx(0.3)
    assert b["checkpoint_save"] == pytest.approx(0.3 + 3.0)  # blocking save inside the loop + the final one
    assert r["productive_s"] == pytest.approx(1.0 + 9.0 + 10.0)
    assert b["other"] == pytest.approx(0.0, abs=1e-5)  # float error of wall times near 1.7e9
    assert r["productive_s"] + sum(b.values()) == pytest.approx(r["total_s"])
    assert r["goodput"] == pytest.approx(20.0 / 37.4)
    assert r["disruptions"] == 0 and r["mtbf_s"] is None and r["steps_kept"] == 20
    assert r["ideal_step_s"] == pytest.approx(1.0)
    assert r["bad_lines"] == {"steps.jsonl": 0, "events.jsonl": 0} and r["negative_spans"] == []


def _disrupted_run(tmp_path: Path, fault: list[dict[str, Any]], restored: int = 10) -> tuple[Path, dict[str, Any]]:
    """Start 1 runs steps 1..15 (1 s each; blocks end at the step-10 save) and is disrupted; start 2 begins 20 s after
    start 1's last step, restores ``restored`` (4 s) and runs to step 20."""
    run = tmp_path / "disrupted"
    run.mkdir(parents=True)
    s1 = session(1, T0, startup=10.0, setup=1.0, restored=0)
    b1 = blocks(s1, [(1, 1, 1.0, 0, 0, 0), (2, 10, 9.0, 0, 0, 0), (11, 15, 5.0, 0, 0, 0)])
    last = b1[-1]["time"]
    s2 = session(2, last + 20.0, startup=5.0, setup=4.0, restored=restored, mono0=50.0)
    b2 = blocks(s2, [(restored + 1, restored + 1, 1.0, 0, 0, 0), (restored + 2, 20, 20.0 - restored - 1, 0, 0, 0)])
    end = end_of(s2, b2[-1], 0.0, 20)
    _w(run / "steps.jsonl", [s1, *b1, s2, *b2, end])
    _w(run / "events.jsonl", [dict(e, time=last + e["time"]) for e in fault])
    return run, {"last": last, "s2": s2}


def test_a_hang_costs_detection_lost_steps_recovery_and_restore(tmp_path):
    run, at = _disrupted_run(tmp_path, [{"time": 6.0, "kind": "hang", "reason": "all ranks stalled", "step": 15},
                                        {"time": 6.5, "kind": "abort", "reason": "job aborted after hang"}])
    r = run_goodput(run, allocations=None)
    b = r["badput_s"]
    assert b["hang_detection"] == pytest.approx(6.0)  # last step -> the hang event
    assert b["lost_progress"] == pytest.approx(5.0)  # steps 11..15 ran, start 2 resumed from 10
    assert b["recovery"] == pytest.approx(20.0 - 6.0)  # hang event -> next process start
    assert b["restore"] == pytest.approx(4.0)
    assert b["startup"] == pytest.approx(10.0 + 1.0 + 5.0)
    assert r["productive_s"] == pytest.approx(20.0)  # every step 1..20 once
    assert r["steps_kept"] == 20 and r["disruptions"] == 1 and r["mtbf_s"] == pytest.approx(r["total_s"])
    (d,) = r["disruption_list"]
    assert (d["cause"], d["step_reached"], d["restored_step"], d["lost_steps"]) == ("hang", 15, 10, 5)
    assert d["lost_s"] == pytest.approx(5.0) and d["detection_s"] == pytest.approx(6.0)
    assert d["recovery_s"] == pytest.approx(14.0 + 5.0 + 4.0)  # fault -> the next start's first step
    assert r["productive_s"] + sum(b.values()) == pytest.approx(r["total_s"])


def test_a_kill_without_hang_counts_the_unrecorded_tail_as_lost(tmp_path):
    # The watchdog names the dead rank 2 s after the last block: that work (steps past 15) was lost too.
    run, _ = _disrupted_run(tmp_path, [{"time": 2.0, "kind": "dead", "reason": "rank 0 dead", "cause": "killed",
                                        "step": 17}])
    r = run_goodput(run, allocations=None)
    assert r["badput_s"]["lost_progress"] == pytest.approx(5.0 + 2.0)
    assert r["badput_s"]["hang_detection"] == 0 and r["badput_s"]["recovery"] == pytest.approx(18.0)
    (d,) = r["disruption_list"]
    assert (d["cause"], d["detail"], d["step_reached"], d["lost_steps"]) == ("dead", "killed", 17, 7)


def test_a_fault_named_by_its_process_belongs_to_its_start_whenever_it_was_written(tmp_path):
    """A loaded machine's watchdog may write a dead rank's event after the next start began, or stamp it a
    moment before the start's last record (two clocks): the ``pid`` it names decides whose end it was."""
    for when in (25.0, -0.2):  # after start 2 began (it began 20 s after start 1's last step); just before it
        run, _ = _disrupted_run(tmp_path / str(when), [{"time": when, "kind": "dead", "reason": "rank 0 dead",
                                                        "cause": "killed", "pid": 1}])
        r = run_goodput(run, allocations=None)
        (d,) = r["disruption_list"]
        assert d["cause"] == "dead" and d["restored_step"] == 10, (when, d)
        assert r["productive_s"] + sum(r["badput_s"].values()) == pytest.approx(r["total_s"])


def test_a_preemption_that_saved_loses_nothing_and_its_save_is_checkpoint_time(tmp_path):
    run, _ = _disrupted_run(tmp_path, [{"time": 3.0, "kind": "stop", "reason": "preemption", "step": 15,
                                        "saved_step": 15},
                                       {"time": 3.5, "kind": "requeue", "reason": "preemption"}], restored=15)
    r = run_goodput(run, allocations=None)
    assert r["badput_s"]["lost_progress"] == 0
    assert r["badput_s"]["checkpoint_save"] == pytest.approx(3.0)
    (d,) = r["disruption_list"]
    assert (d["cause"], d["lost_steps"], d["restored_step"]) == ("preemption", 0, 15)


def test_a_later_rollback_discards_steps_of_every_start_after_it(tmp_path):
    """Starts resume from 10, then (a bad checkpoint skipped) from 5: start 2's and start 1's steps past 5 are lost."""
    run = tmp_path / "rollback"
    run.mkdir()
    s1 = session(1, T0, 1.0, 0.0, 0)
    b1 = blocks(s1, [(1, 5, 5.0, 0, 0, 0), (6, 12, 7.0, 0, 0, 0)])
    s2 = session(2, b1[-1]["time"] + 1.0, 1.0, 0.0, 10)
    b2 = blocks(s2, [(11, 14, 4.0, 0, 0, 0)])
    s3 = session(3, b2[-1]["time"] + 1.0, 1.0, 0.0, 5)
    b3 = blocks(s3, [(6, 20, 15.0, 0, 0, 0)])
    _w(run / "steps.jsonl", [s1, *b1, s2, *b2, s3, *b3, end_of(s3, b3[-1], 0.0, 20)])
    r = run_goodput(run, allocations=None)
    assert r["badput_s"]["lost_progress"] == pytest.approx(7.0 + 4.0)
    assert r["productive_s"] == pytest.approx(20.0)
    assert r["steps_kept"] == 20 and r["disruptions"] == 2
    assert [d["lost_steps"] for d in r["disruption_list"]] == [7, 9]  # 12 -> 5 and 14 -> 5


def test_accounting_gives_allocated_time_queue_wait_and_other(tmp_path):
    run, at = _disrupted_run(tmp_path, [{"time": 1.0, "kind": "stop", "reason": "preemption", "saved_step": 15},
                                        {"time": 1.0, "kind": "requeue", "reason": "preemption"}], restored=15)
    t_last = at["last"]
    s2_start = at["s2"]["time"] - at["s2"]["startup_s"]
    # Allocation 1 from 2 s before the process to 2 s after the stop; the requeue pends 10 s; allocation 2 from
    # 7 s before start 2's process to 1 s after its last record.
    rep0 = run_goodput(run, allocations=None)
    end2 = T0 + rep0["total_s"] + 100  # generous: the report clips to what is recorded
    allocs = [Allocation("77", submit=T0 - 30, start=T0 - 2, end=t_last + 3.0, state="PREEMPTED"),
              Allocation("77", submit=t_last + 3.0, start=s2_start - 7.0, end=end2, state="COMPLETED")]
    r = run_goodput(run, allocations=allocs)
    assert r["basis"] == "allocation" and r["unknown"] == []
    assert r["allocated_s"] == pytest.approx((t_last + 3.0 - (T0 - 2)) + (end2 - (s2_start - 7.0)))
    assert r["queue_wait_s"] == pytest.approx(28.0 + (s2_start - 7.0 - (t_last + 3.0)))
    # Recovery is only what the allocations held of the gap (2 s after the stop's save, 7 s before start 2).
    assert r["badput_s"]["recovery"] == pytest.approx(2.0 + 7.0)
    records = r["productive_s"] + sum(v for k, v in r["badput_s"].items() if k != "other")
    assert r["badput_s"]["other"] == pytest.approx(r["allocated_s"] - records)
    assert r["scheduling_goodput"] == pytest.approx(r["allocated_s"] / (r["allocated_s"] + r["queue_wait_s"]))


def test_sacct_records_become_allocations_and_no_answer_means_unknown(tmp_path):
    def hist(start: str, end: str, state: str) -> HistJob:
        return HistJob("88", "x", "u", "acct", "normal", "p", state, "0:0", "", "2026-01-01T00:00:00", start, end,
                       1, "n1", 4, 0, "")

    seen = []

    def history(jobs):
        seen.append(list(jobs))
        return [hist("2026-01-01T00:01:00", "2026-01-01T00:11:00", "PREEMPTED"),
                hist("Unknown", "Unknown", "PENDING")]

    allocs = goodput.slurm_allocations(["88", "local-7", ""], history)
    assert seen == [["88"]] and len(allocs) == 1
    assert allocs[0].end - allocs[0].start == 600 and allocs[0].start - allocs[0].submit == 60
    assert goodput.slurm_allocations(["local-7"], history) is None  # not a Slurm job: nothing to ask

    def down(jobs):
        from xirang_hpc.slurm.accounting import AccountingDown

        raise AccountingDown("slurmdbd is down")

    assert goodput.slurm_allocations(["88"], down) is None
    r = run_goodput(_clean_run(tmp_path), history=down)
    assert r["basis"] == "observed" and "queue_wait" in r["unknown"]


def test_torn_and_interleaved_lines_are_counted_and_skipped(tmp_path):
    run = _clean_run(tmp_path)
    good = run_goodput(run, allocations=None)
    lines = (run / "steps.jsonl").read_text().splitlines()
    # A line torn by a kill, two writers' lines glued together, a foreign line, and a torn tail.
    lines.insert(2, lines[2][:17])
    lines.insert(4, '{"pid": 9, "a": 1}{"pid": 9, "a": 2}')
    lines.insert(5, "[1, 2, 3]")
    (run / "steps.jsonl").write_text("\n".join(lines) + "\n" + lines[1][:10])
    (run / "events.jsonl").write_text((run / "events.jsonl").read_text() + '{"time": 1, "kind": "de\n')
    r = run_goodput(run, allocations=None)
    assert r["bad_lines"] == {"steps.jsonl": 4, "events.jsonl": 1}
    assert r["bad_line_numbers"]["steps.jsonl"][:3] == [3, 5, 6]
    assert r["total_s"] == pytest.approx(good["total_s"]) and r["productive_s"] == pytest.approx(good["productive_s"])
    # A block whose start is unknown (its session row was lost) is skipped and counted too.
    (run / "steps.jsonl").write_text(json.dumps({"pid": 42, "a": 1, "b": 2, "time": T0, "mono": 5, "dur": 1}) + "\n"
                                     + (run / "steps.jsonl").read_text())
    assert run_goodput(run, allocations=None)["bad_lines"]["steps.jsonl"] == 5
    text = status_cli_text(run)
    assert "skipped 5 unreadable line(s) of steps.jsonl" in text
    assert "skipped 1 unreadable line(s) of events.jsonl" in text


def test_a_start_before_the_previous_one_ended_is_a_flagged_negative_span(tmp_path):
    """Host B's clock is 30 s behind host A's: its start seems to come before A's last step. Durations inside each
    start come from the monotonic clock and stay right; the span between them is flagged and counted as zero."""
    run, at = _disrupted_run(tmp_path, [])
    rows = [json.loads(x) for x in (run / "steps.jsonl").read_text().splitlines()]
    for row in rows:
        if row.get("pid") == 2:
            row["time"] -= 50.0  # 20 s after A's last step by A's clock = 30 s before it by B's
    _w(run / "steps.jsonl", rows)
    r = run_goodput(run, allocations=None)
    assert [s["where"] for s in r["negative_spans"]] == ["between starts"]
    assert r["negative_spans"][0]["seconds"] == pytest.approx(-30.0)
    assert r["badput_s"]["recovery"] == 0
    assert r["productive_s"] == pytest.approx(20.0)  # per-start durations unaffected
    assert "flagged 1 negative span(s)" in status_cli_text(run)


def test_rolling_windows_cover_only_their_time(tmp_path):
    run = tmp_path / "long"
    run.mkdir()
    # Two hours of steps: the first hour all eval-free productive steps, the last hour with half of each block in eval.
    s = session(1, T0, 0.0, 0.0, 0)
    bl = blocks(s, [(1, 60, 3600.0, 0, 0, 0), (61, 120, 3600.0, 0, 1800.0, 0)])
    _w(run / "steps.jsonl", [s, *bl])
    now = bl[-1]["time"]
    r = report(load_run(run, allocations=None), now=now)
    assert r["goodput"] == pytest.approx(0.75)
    assert r["windows"]["last_hour"]["goodput"] == pytest.approx(0.5)
    assert r["windows"]["last_hour"]["total_s"] == pytest.approx(3600.0)
    assert r["windows"]["last_day"]["goodput"] == pytest.approx(0.75)
    later = report(load_run(run, allocations=None), now=now + 7200)
    assert later["windows"]["last_hour"]["goodput"] is None  # nothing recorded in it


def status_cli_text(run: Path, *extra: str) -> str:
    """What ``xirang-status RUN --goodput`` prints (in this process)."""
    import contextlib
    import io

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert status_cli.main([str(run), "--goodput", *extra]) == 0
    return buf.getvalue()


def test_the_cli_prints_text_json_and_a_plot(tmp_path, monkeypatch):
    run, _ = _disrupted_run(tmp_path, [{"time": 6.0, "kind": "hang", "reason": "stalled"}])
    monkeypatch.setattr(goodput, "slurm_allocations", lambda jobs, history=None: None)
    text = status_cli_text(run)
    assert "goodput of" in text and "steps lost to disruptions" in text and "queue wait" in text
    assert "1. " in text and "hang" in text and "resumed from step 10" in text
    rep = json.loads(status_cli_text(run, "--json"))
    assert rep["disruptions"] == 1 and rep["badput_s"]["hang_detection"] == pytest.approx(6.0)
    out = tmp_path / "g.png"
    rep = json.loads(status_cli_text(run, "--json", "--plot", str(out)))
    assert out.stat().st_size > 0 and rep["plot"]["disruptions"] == 1
    assert rep["plot"]["spans"]["productive"] >= 2 and rep["plot"]["spans"]["hang_detection"] == 1
    assert rep["plot"]["bars"]["lost_progress"] == pytest.approx(100 * 5.0 / rep["total_s"], abs=1e-3)


def test_the_cli_names_a_run_without_a_goodput_record(tmp_path, capsys):
    run = tmp_path / "old"
    run.mkdir()
    (run / "events.jsonl").write_text("")
    assert status_cli.main([str(run), "--goodput"]) == 2
    assert "no steps.jsonl" in capsys.readouterr().err


# ---- the recording hook -------------------------------------------------------------------------------------------

class _Loop:
    """What the hook reads of the loop: the step and the run directory (a fork moves it during fit start)."""

    def __init__(self, run_dir: Path) -> None:
        self.state = types.SimpleNamespace(step=0)
        self.run_dir = run_dir


def _topo(rank: int = 0) -> Topology:
    return Topology(rank=rank, world_size=2, local_rank=rank, local_world_size=2, node_id=0, num_nodes=1,
                    node_name="n0", master_addr="127.0.0.1", master_port=1, job_id="j1", source="local")


def _drive(hook: GoodputHook, loop: _Loop, steps: int, save_every: int, eval_at: tuple[int, ...] = ()) -> None:
    """The loop's calls in the trainer's order (hooks.Loop): phases per step, eval, step end, then the save."""
    hook.on_fit_start(loop)
    for step in range(loop.state.step, steps):
        for ph in ("data", "forward", "backward", "optimizer"):
            hook.on_phase(loop, ph)
        loop.state.step = step + 1
        if loop.state.step in eval_at:
            hook.on_phase(loop, "eval")
        hook.on_step_end(loop, {})
        if loop.state.step % save_every == 0:  # the checkpoint hook, after this one
            hook.on_phase(loop, "checkpoint")
    hook.on_phase(loop, "eval")
    hook.on_fit_end(loop, {})


def test_the_hook_ends_blocks_at_saves_and_writes_where_the_run_trains(tmp_path):
    parent, fork = tmp_path / "parent", tmp_path / "fork"
    parent.mkdir()
    fork.mkdir()
    loop = _Loop(parent)
    hook = GoodputHook(_topo(), parent, flush_s=math.inf)
    orig = hook.on_fit_start

    def fit_start_then_fork(lp: _Loop) -> None:
        orig(lp)
        lp.state.step, lp.run_dir = 4, fork  # the checkpoint hook forks (train.resume_from=4) and restores

    hook.on_fit_start = fit_start_then_fork  # type: ignore[method-assign]
    _drive(hook, loop, steps=13, save_every=4, eval_at=(10,))
    assert not (parent / "steps.jsonl").exists()  # the parent's record is untouched
    rows = [json.loads(x) for x in (fork / "steps.jsonl").read_text().splitlines()]
    assert rows[0]["kind"] == "session" and rows[0]["step"] == 4 and rows[0]["job"] == "j1"
    assert rows[-1]["kind"] == "end" and rows[-1]["step"] == 13
    # The first step alone; blocks end at each saved step (8, 12) and after the evaluated step (10).
    assert [(r["a"], r["b"]) for r in rows[1:-1]] == [(5, 5), (6, 8), (9, 10), (11, 12), (13, 13)]
    assert all(r["dur"] >= r["data"] + r["eval"] + r["save"] for r in rows[1:-1])
    rec = load_run(fork, allocations=None)
    assert rec.sessions[0].restored == 4 and rec.timeline.steps_done == 9
    other = tmp_path / "rank1"
    other.mkdir()
    _drive(GoodputHook(_topo(rank=1), other), _Loop(other), steps=3, save_every=2)
    assert not (other / "steps.jsonl").exists()  # only rank 0 records


# ---- a real run ---------------------------------------------------------------------------------------------------

RANK_SCRIPT = r'''
import json, os, signal, sys
from pathlib import Path
from xirang_hpc.checkpoint.layout import committed_steps
from xirang_hpc.job import training as jobmod
from xirang_hpc.runtime.hooks import TrainerHook
cfg, run, data, kill_at = json.loads(sys.argv[1]), sys.argv[2], sys.argv[3], int(sys.argv[4])


class KillAt(TrainerHook):
    # kill -9 of the rank between two checkpoints, once one is committed (saves persist in the background)
    def on_step_end(self, trainer, metrics):
        s = trainer.state.step
        if kill_at and s >= kill_at and s % 5 and committed_steps(Path(run) / "checkpoints"):
            os.kill(os.getpid(), signal.SIGKILL)


def hooks(*a):
    out = [*real(*a), KillAt()]
    out[0].flush_s = 0.0  # a block per step, as for steps longer than FLUSH_S: the steps reached are all recorded
    return out


real = jobmod.build_hooks
jobmod.build_hooks = hooks
jobmod.run_training(cfg, run, data)
'''


@pytest.mark.slow
def test_a_real_run_killed_and_resumed_has_lost_steps_and_recovery(tmp_path, email_data):
    from conftest import compose_cfg

    from xirang_hpc.config.validate import load_config
    from xirang_hpc.submit.rundir import make_private_dir

    run = tmp_path / "run"
    make_private_dir(run)
    over = ["model=tiny", "cluster=local", "cluster.nodes=1", "cluster.tasks_per_node=1", "parallel.tp=1",
            "parallel.pp=1", "parallel.microbatches=1", "train.max_steps=20", "train.global_batch=4",
            "train.warmup_steps=2", "train.eval_batches=1", "train.log_every=2", "checkpoint.every_steps=5",
            "checkpoint.async_save=false", f"data.out_dir={email_data}", f"train.run_dir={run}"]
    cfg = json.dumps(dataclasses.asdict(load_config(compose_cfg(over))))
    env = dict(os.environ, SUBMITIT_LOCAL_GLOBALID="0", SUBMITIT_LOCAL_LOCALID="0", SUBMITIT_LOCAL_NTASKS="1")
    for kill_at, rc in ((8, -signal.SIGKILL), (0, 0)):
        env["SUBMITIT_LOCAL_JOB_ID"] = f"gp-{uuid.uuid4().hex[:6]}"
        p = subprocess.run([sys.executable, "-c", RANK_SCRIPT, cfg, str(run), str(email_data), str(kill_at)],
                           env=env, capture_output=True, text=True, timeout=600)
        assert p.returncode == rc, p.stdout[-2000:] + p.stderr[-2000:]
        time.sleep(0.5)
    r = run_goodput(run)  # local jobs: no accounting to ask
    assert r["basis"] == "observed" and r["starts"] == 2 and r["last_step"] == 20 and r["steps_kept"] == 20
    (d,) = r["disruption_list"]
    assert d["cause"] == "dead" and d["restored_step"] in (5, 10, 15)
    assert d["step_reached"] % 5 and d["lost_steps"] == d["step_reached"] - d["restored_step"] >= 1
    b = r["badput_s"]
    assert b["lost_progress"] > 0 and d["lost_s"] > 0
    assert b["recovery"] > 0 and d["recovery_s"] > b["recovery"]
    assert b["restore"] > 0 and b["startup"] > 0 and b["eval"] > 0 and b["checkpoint_save"] > 0
    assert 0 < r["goodput"] < 1
    assert r["productive_s"] + sum(b.values()) == pytest.approx(r["total_s"])
    assert r["bad_lines"] == {"steps.jsonl": 0, "events.jsonl": 0} and r["negative_spans"] == []


def test_the_fleet_view_sums_runs_per_account_and_writes_prometheus_gauges(tmp_path, monkeypatch):
    root = tmp_path / "runs"
    root.mkdir()
    a = _clean_run(root)
    (root / "old").mkdir()
    (root / "old" / "events.jsonl").write_text("")
    monkeypatch.setattr(goodput, "slurm_allocations", lambda jobs, history=None: None)
    one = run_goodput(a, allocations=None)
    view = goodput.fleet([a, root / "old"], -math.inf, math.inf)
    (g,) = view["groups"]
    assert g["account"] == "local" and g["runs"] == 1 and view["skipped"] == [str(root / "old")]
    assert g["total_s"] == pytest.approx(one["total_s"]) and g["goodput"] == pytest.approx(one["goodput"])
    assert g["top_causes"][0] == "startup" and "queue_wait" in g["unknown"]
    text = goodput.prometheus_text(view)
    assert f'xirang_goodput_ratio{{account="local",user="{g["user"]}"}} {one["goodput"]:.6f}' in text
    assert 'cause="startup"} 12.000' in text
    prom = tmp_path / "goodput.prom"
    out = status_cli_text(Path("unused"), "--queue", "--runs-root", str(root), "--since", "1e9", "--prom", str(prom))
    assert "local" in out and "1 run(s) without a goodput record" in out
    assert prom.read_text() == text
