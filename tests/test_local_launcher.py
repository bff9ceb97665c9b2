"""A local launch ends its job when the launcher ends: a signal to ``xirang-train`` (Ctrl-C, SIGTERM, SIGHUP)
stops the ranks after a final checkpoint with one line and no traceback; a launcher killed outright is noticed
by the job's controller, which stops the ranks the same way.

The launches are the real ``xirang-train`` on the embedded default layout (4 gloo ranks on 2 virtual nodes,
through the fork server), with a step budget far beyond what the test waits for.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

EXE = Path(sys.executable).parent / "xirang-train"
LONG = ["train.max_steps=5000", "train.log_every=1", "checkpoint.every_steps=1000"]


def _events(run: Path) -> list[dict]:
    p = run / "events.jsonl"
    return [json.loads(line) for line in p.read_text().splitlines() if line.strip()] if p.exists() else []


def _start(run: Path, data: Path) -> subprocess.Popen[str]:
    """``xirang-train`` in a session of its own (as a shell runs a foreground job), once its ranks have stepped."""
    p = subprocess.Popen([str(EXE), *LONG, f"train.run_dir={run}", f"data.out_dir={data}"], cwd=run.parent,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    deadline = time.time() + 300
    while not any(e["kind"] == "first_step" for e in _events(run)):
        assert p.poll() is None, p.communicate()[0][-3000:]
        assert time.time() < deadline, "no first step in 300 s"
        time.sleep(0.2)
    return p


def _ranks(run: Path) -> list[psutil.Process]:
    """The job's processes still alive: its controller and ranks (a fork server left idle, with no rank, is not)."""
    out = []
    for proc in psutil.process_iter(["cmdline", "status"]):
        try:
            cmd = " ".join(proc.info["cmdline"] or [])
            if str(run) not in cmd or proc.info["status"] == psutil.STATUS_ZOMBIE:
                continue
            if "--serve" in cmd and not [c for c in proc.children() if c.status() != psutil.STATUS_ZOMBIE]:
                continue
            out.append(proc)
        except psutil.Error:
            continue
    return out


def _wait_gone(run: Path, within_s: float = 120) -> None:
    deadline = time.time() + within_s
    while _ranks(run):
        assert time.time() < deadline, f"still running {within_s} s after the stop: {_ranks(run)}"
        time.sleep(0.2)


def _final_stop(run: Path) -> dict:
    stops = [e for e in _events(run) if e["kind"] == "stop"]
    assert stops, _events(run)
    stop = stops[-1]
    assert stop["saved_step"] == stop["step"] >= 1, stop
    assert (run / "checkpoints" / f"step_{stop['saved_step']}").is_dir()
    return stop


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP])
def test_a_signalled_launcher_stops_its_job_after_a_final_checkpoint(sig: signal.Signals, email_data: Path,
                                                                      tmp_path: Path) -> None:
    run = tmp_path / "run"
    p = _start(run, email_data)
    # Ctrl-C and a closed terminal signal the whole foreground process group; SIGTERM comes to the process.
    if sig == signal.SIGTERM:
        p.send_signal(sig)
    else:
        os.killpg(p.pid, sig)
    out, _ = p.communicate(timeout=180)
    assert p.returncode == 128 + sig, out[-3000:]
    assert "Traceback" not in out and "KeyboardInterrupt" not in out, out[-3000:]
    stop = _final_stop(run)
    if sig != signal.SIGHUP:  # after SIGHUP the terminal is gone: nothing is printed
        last = out.strip().splitlines()[-1]
        assert last.startswith(f"xirang-train: {sig.name}: job ") and f"checkpoint at step {stop['saved_step']}" in last
    assert any(e["kind"] == "launcher_stop" and e["signal"] == sig.name for e in _events(run))
    _wait_gone(run)


@pytest.mark.slow
def test_ranks_stop_when_their_launcher_is_killed(email_data: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    p = _start(run, email_data)
    p.kill()
    p.wait()
    _wait_gone(run)
    gone = [e for e in _events(run) if e["kind"] == "launcher_gone"]
    assert len(gone) == 1 and gone[0]["pid"] == p.pid, _events(run)
    assert _final_stop(run)["time"] >= gone[0]["time"]


@pytest.mark.slow
def test_a_launch_that_does_not_wait_is_not_watched(email_data: Path, tmp_path: Path) -> None:
    """``train.wait=false`` leaves on purpose: the job goes on (here to its end) without the launcher."""
    run = tmp_path / "run"
    r = subprocess.run([str(EXE), "train.max_steps=3", "train.warmup_steps=1", "train.wait=false",
                        f"train.run_dir={run}", f"data.out_dir={email_data}"],
                       cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    _wait_gone(run, within_s=300)
    ev = _events(run)
    assert not [e for e in ev if e["kind"] in ("launcher_gone", "stop")], ev
    assert [e for e in ev if e["kind"] == "exit"][-1]["status"] == "completed", ev
