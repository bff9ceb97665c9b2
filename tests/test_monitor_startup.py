"""The watchdog covers a rank's start-up, the checkpoint restore included, on real 4-rank gloo runs (2 virtual
nodes x 2 ranks) started as ``xirang-train`` starts them (the ``launch`` fixture of test_monitor_faults).

Heartbeats, the stack dump and the node watchdogs start before the weight import and the restore. A run trains a
few steps and saves; it is resumed (``train.extend_to``), and rank 3 is stopped inside the checkpoint load (the
test point ``XIRANG_TESTPOINT=load@0/3=...`` holds that rank alone there, so its peers go on into the load's
collectives): the collective rule names it within ``monitor.collective_timeout_s`` and a few seconds, not after
``monitor.hang_s``. A restore that is slow but reads (``XIRANG_TESTPOINT_SLOW=load_s=...``, a tick per tensor
read) lasts far beyond ``hang_s`` without a false alarm.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
import test_monitor_faults as faults
from test_monitor_hang import Observer

from xirang_hpc.monitor.events import read_events
from xirang_hpc.monitor.heartbeat import HEARTBEAT_DIR, SESSION_FILE, SESSIONS_LOG, read_json
from xirang_hpc.runs.status import run_status

pytestmark = pytest.mark.slow
launch = faults.launch  # the fixture: a job submitted as xirang-train submits it, cleaned up after
Run, _assert_all_gone = faults.Run, faults._assert_all_gone

COMMON = ("monitor.heartbeat_s=0.25", "train.warmup_steps=2")


def _sessions(run: Run) -> int:
    """Rows in the sessions' log: one per start that got past its restore."""
    return len((run.run_dir / HEARTBEAT_DIR / SESSIONS_LOG).read_text().splitlines())


def _held(run: Run, points: Path, stage: str, what: str) -> int:
    """The pid of the rank the test point holds at ``stage`` (its arrival file), once it is there."""
    deadline = time.time() + 900
    arrived: list[Path] = []
    while time.time() < deadline and not arrived:
        assert not run.job.done(), f"the job ended before {what}"
        arrived = list(points.glob(f"{stage}@0.*"))
        time.sleep(0.05)
    assert arrived, f"rank 3 never reached {what}"
    return int(arrived[0].name.rsplit(".", 1)[1])


def _trained(launch, steps: int = 4) -> Run:
    """A run that trained ``steps`` steps and saved the last one (its final save)."""
    run = launch(*COMMON, steps=steps)
    run.wait_end(900)
    s = run_status(run.run_dir)
    assert s["state"] == "COMPLETED" and s["checkpoint"]["step"] == steps, s
    return run


def test_a_rank_stopped_in_the_checkpoint_restore_is_named_in_seconds(launch, tmp_path, capsys) -> None:
    collective_s, margin_s = 10.0, 5.0  # margin: heartbeat sampling (0.25 s) + watchdog poll (0.5 s) + scheduling
    first = _trained(launch)
    sessions_before = _sessions(first)
    points = tmp_path / "testpoints"
    points.mkdir()
    # Rank 3 alone waits in the load (120 s, far beyond what the test waits); the test stops it there.
    run = launch(*COMMON, "train.extend_to=400", steps=4, run_dir=first.run_dir,
                 env={"XIRANG_TESTPOINT": "load@0/3=120", "XIRANG_TESTPOINT_DIR": str(points)})
    pid3 = _held(run, points, "load", "the checkpoint load")
    # Already watched: this start's heartbeats (rank 3's in the restore) and the session record name it.
    session = read_json(run.run_dir / HEARTBEAT_DIR / SESSION_FILE)
    assert session is not None and session.get("restoring") and "start_step" not in session, session
    hb = run.beats()
    assert all(b.get("session") == session["session"] for b in hb.values()) and len(hb) == 4, hb
    assert hb[3]["pid"] == pid3 and all("watchdog_pid" in hb[r] for r in (0, 2)), hb
    t_stop = time.time()
    os.kill(pid3, signal.SIGSTOP)
    s = run_status(run.run_dir)  # xirang-status reads this start while it restores
    assert s["state"] == "RUNNING" and [n["ranks"] for n in s["nodes"]] == [[0, 1], [2, 3]], s
    ev = run.wait_event("hang", 200)  # a safety net below hang_s (300 s); the latency is asserted below
    latency = ev["time"] - t_stop
    run.beats()
    run.wait_end()
    assert (ev["rank"], ev["node"], ev["pid"], ev["detector"]) == (3, "vnode1", pid3, "collective"), ev
    assert ev["phase"] == "restore" and ev["bound_phase"] == "start", ev
    head = f"rank 3 (node vnode1, pid {pid3}) did not reach collective #"
    assert ev["cause"].startswith(head) and "process is stopped" in ev["cause"], ev["cause"]
    assert "checkpoint restore collective" in ev["cause"] and set(ev["waiting"]) <= {0, 1, 2} and ev["waiting"], ev
    assert latency <= collective_s + margin_s, (latency, ev)
    abort = run.wait_event("abort", 120)
    assert abort["rank"] == 3
    text = (run.run_dir / "stacks" / "rank-3.txt").read_text()
    assert "checkpoint/manager.py" in text and "testpoint.py" in text, text[-2000:]  # its stack: in the load
    _assert_all_gone(run)
    s = run_status(run.run_dir)
    assert s["state"] == "FAILED" and head in s["state_reason"], s
    # The start that never got past its restore adds no row to the sessions' log.
    assert _sessions(run) == sessions_before
    with capsys.disabled():
        print(f"\nrank 3 stopped in the checkpoint load: named {latency:.1f}s after SIGSTOP "
              f"({ev['time'] - ev['waiting_since']:.1f}s after its peers entered collective #{ev['seq']}, "
              f"bound {ev['bound_s']}s): {ev['cause']}")


def test_a_slow_restore_that_reads_is_no_hang(launch) -> None:
    # hang_s=12 bounds a still start-up; every tensor read takes 0.25 s more (a tick each), so the restore
    # lasts well beyond hang_s on every rank while it moves.
    hang_s = 12.0
    first = _trained(launch)
    run = launch(*COMMON, f"monitor.hang_s={hang_s}", "train.extend_to=8", steps=4, run_dir=first.run_dir,
                 env={"XIRANG_TESTPOINT_SLOW": "load_s=0.25"})
    with Observer(run.run_dir) as obs:
        run.wait_end(1200)
    run.beats()
    kinds = [e["kind"] for e in read_events(run.run_dir)]
    assert "hang" not in kinds and "abort" not in kinds and "dead" not in kinds, read_events(run.run_dir)
    s = run_status(run.run_dir)
    assert s["state"] == "COMPLETED" and s["step"] == 8, s
    restore = [e for e in read_events(run.run_dir) if e["kind"] == "restore"]
    assert restore and restore[-1]["step"] == 4, restore
    # The restore really was slow, and the ticks kept every rank moving through it.
    assert obs.longest(obs.phase_age, "restore") > hang_s + 2, dict(obs.phase_age)
    assert 0 < obs.longest(obs.idle, "restore") < hang_s / 2, dict(obs.idle)
    session = read_json(run.run_dir / HEARTBEAT_DIR / SESSION_FILE)
    assert session is not None and session["start_step"] == 4 and "restoring" not in session, session
    print(f"\nslow restore: {obs.longest(obs.phase_age, 'restore'):.1f}s in the restore phase (hang_s={hang_s}), "
          f"at most {obs.longest(obs.idle, 'restore'):.1f}s between ticks")


def test_a_rank_stopped_in_the_model_build_is_named_in_seconds(launch, tmp_path, capsys) -> None:
    """A fresh start: rank 3 is held after the rendezvous, before its model is built, and stopped there, while its
    peers go on into the build's collectives (the weights' broadcast, DDP's set-up): named in seconds."""
    collective_s, margin_s = 10.0, 5.0
    points = tmp_path / "testpoints"
    points.mkdir()
    run = launch(*COMMON, steps=4, env={"XIRANG_TESTPOINT": "build@0/3=120", "XIRANG_TESTPOINT_DIR": str(points)})
    pid3 = _held(run, points, "build", "the build")
    t_stop = time.time()
    os.kill(pid3, signal.SIGSTOP)
    ev = run.wait_event("hang", 200)
    latency = ev["time"] - t_stop
    run.beats()
    run.wait_end()
    assert (ev["rank"], ev["node"], ev["pid"], ev["detector"]) == (3, "vnode1", pid3, "collective"), ev
    assert ev["bound_phase"] == "start" and "process is stopped" in ev["cause"], ev
    assert latency <= collective_s + margin_s, (latency, ev)
    text = (run.run_dir / "stacks" / "rank-3.txt").read_text()
    assert "trainer.py" in text and "testpoint.py" in text, text[-2000:]  # its stack: in the build
    _assert_all_gone(run)
    with capsys.disabled():
        print(f"\nrank 3 stopped in the model build: named {latency:.1f}s after SIGSTOP: {ev['cause']}")
