"""The node watchdog: how it looks at a rank's process, when it judges after a pause, and how an abort waits for
the ranks' stack dumps before it kills them."""

from __future__ import annotations

import faulthandler
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from xirang_hpc.config.schema import MonitorConfig
from xirang_hpc.files import write_json_atomic
from xirang_hpc.monitor.detect import ALIVE, GONE, STOPPED
from xirang_hpc.monitor.events import read_events
from xirang_hpc.monitor.heartbeat import dump_complete, stack_end
from xirang_hpc.monitor.watchdog import dump_and_kill, probe
from xirang_hpc.runtime.process_identity import identity


def test_probe_tells_a_rank_by_its_start_since_boot_whatever_the_wall_clock_does() -> None:
    """The watchdog's look at a rank's process: alive, stopped, gone, elsewhere. A reused pid (another start since
    boot) is gone; a wall-clock step since the rank recorded itself (+31 s, as when a paused VM resumes: psutil's
    create_time then reads 31 s after the rank's start) is not, where it used to make every rank look dead."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    host = socket.gethostname()
    try:
        ident = identity(proc.pid)
        hb = {"pid": proc.pid, "host": host, "started": ident["create_time"] + 0.5, "start_ticks": ident["start_ticks"]}
        assert probe(hb, host) == ALIVE and probe(hb, "another-host") is None
        stepped = dict(hb, started=ident["create_time"] - 31.0)
        assert probe(stepped, host) == ALIVE
        assert probe(dict(stepped, start_ticks=None), host) == GONE  # no ticks recorded: the wall-clock check
        assert probe(dict(hb, start_ticks=ident["start_ticks"] - 1), host) == GONE  # the pid of another process
        os.kill(proc.pid, signal.SIGSTOP)
        deadline = time.monotonic() + 60  # the stop is delivered asynchronously; a safety net, not a bound
        while probe(hb, host) != STOPPED and time.monotonic() < deadline:
            time.sleep(0.01)
        assert probe(hb, host) == STOPPED
        os.kill(proc.pid, signal.SIGCONT)
    finally:
        proc.kill()
        proc.wait()
    assert probe(hb, host) == GONE


def test_a_watchdog_that_did_not_run_for_a_while_judges_again_only_after_fresh_beats(tmp_path: Path) -> None:
    """Rounds 31 s apart (the machine paused the watchdog, or the wall clock stepped): every heartbeat reads 31 s
    old, which is not the ranks' doing. No hang is called then; one is, RESYNC_S later, if they still have not
    moved (a real hang)."""
    import dataclasses

    from xirang_hpc.monitor.heartbeat import HEARTBEAT_DIR
    from xirang_hpc.monitor.watchdog import RESYNC_S, Watchdog

    cfg = dict(dataclasses.asdict(MonitorConfig()), hang_s=12.0, hang_min_s=5.0, abort_on_hang=False)
    t0 = time.time()
    ident = identity(os.getpid())
    (tmp_path / HEARTBEAT_DIR).mkdir()
    for rank in (0, 1):  # live processes of this host, on a node that is not the watchdog's (nothing to kill)
        write_json_atomic(tmp_path / HEARTBEAT_DIR / f"rank-{rank}.json",
                          {"rank": rank, "session": "s", "node": "vnode0", "host": socket.gethostname(),
                           "pid": os.getpid(), "start_ticks": ident["start_ticks"], "started": t0 - 60,
                           "beat": t0, "progress": t0, "active": t0, "step": 7, "phase": "forward", "step_s": 0.1})
    wd = Watchdog(tmp_path, "s", "vnode1", leader=True, cfg=cfg)
    wd.check(t0)
    wd.check(t0 + 31)  # heartbeats 31 s old: a naive watchdog calls a hang here
    assert [e["kind"] for e in read_events(tmp_path)] == []
    for i in range(1, int(2 * RESYNC_S) + 2):  # rounds every 0.5 s again; RESYNC_S on, no rank has moved: a hang
        wd.check(t0 + 31 + 0.5 * i)
    assert [e["kind"] for e in read_events(tmp_path)] == ["hang", "hang"], read_events(tmp_path)


def test_the_kill_waits_for_a_stack_dump_that_starts_late_and_ends_slowly(tmp_path: Path) -> None:
    """On a loaded machine a rank runs its dump handler only when next scheduled: here it starts writing 1.5 s
    after the signal (past the 1 s grace) and takes until 2.5 s. The SIGKILL comes after the file has been quiet
    for settle_s, not after the fixed grace (which cut the dump after its first frame)."""
    now = [0.0]
    path = tmp_path / "rank-2.txt"
    path.write_text("=== rank 2 header ===\n")
    sent: list[tuple[float, int, int]] = []
    writes: list[float] = []

    def sleep(s: float) -> None:
        now[0] += s
        if 1.5 <= now[0] <= 2.5:
            writes.append(now[0])
            with path.open("a") as f:
                f.write(f'  File "trainer.py", line {int(now[0] * 100)} in fit\n')

    hb = {"rank": 2, "pid": 4242}
    hit = dump_and_kill([hb], signal.SIGQUIT, "h", tmp_path, send=lambda pid, sig: sent.append((now[0], pid, sig)),
                        look=lambda hb: STOPPED, clock=lambda: now[0], sleep=sleep)
    assert hit == [2]
    # Resumed first, then asked for its dump once its threads are back in their waits (resume_s).
    assert [(pid, sig) for _, pid, sig in sent] == [(4242, signal.SIGCONT), (4242, signal.SIGQUIT),
                                                    (4242, signal.SIGKILL)]
    assert sent[1][0] - sent[0][0] == pytest.approx(0.5), sent
    t_kill, t_last = sent[-1][0], writes[-1]
    assert t_last > 2.3 and t_last + 0.5 <= t_kill < t_last + 0.5 + 0.25, (t_last, t_kill)
    assert path.read_text().count("in fit") >= 10


def test_a_dump_names_its_end_and_faulthandler_writes_it_last(tmp_path: Path) -> None:
    """``stack_end`` (read from the main thread) is the last line faulthandler writes for this very process, with
    another thread beside it; a dump cut anywhere before that line is not complete."""
    marker = stack_end()
    assert marker["stack_thread"] == f"0x{threading.main_thread().ident:016x}", marker
    stop = threading.Event()
    other = threading.Thread(target=stop.wait, daemon=True)
    other.start()
    try:
        with (tmp_path / "dump.txt").open("w") as f:
            faulthandler.dump_traceback(f, all_threads=True)
    finally:
        stop.set()
        other.join()
    text = (tmp_path / "dump.txt").read_text()
    assert text.count("(most recent call first):") >= 2, text
    assert text.rstrip("\n").splitlines()[-1].endswith(marker["stack_last"]), (marker, text)
    assert dump_complete(text, marker) is True
    lines = text.splitlines(keepends=True)
    assert not any(dump_complete("".join(lines[:n]), marker) for n in range(len(lines))), "a cut dump is not whole"
    assert dump_complete(text, {}) is None  # a heartbeat that names no end: the settle rule decides
    deep = text[: text.rindex("(most recent call first):\n") + 26] + '  File "x.py", line 3 in f\n  ...\n'
    assert dump_complete(deep, marker) is True  # deeper than faulthandler writes: it ends with "..."


def test_the_kill_waits_for_the_main_threads_last_frame_through_a_pause(tmp_path: Path) -> None:
    """A dump that stalls between two threads for longer than settle_s (a loaded machine: seen cut after the first
    thread) is waited for until its main thread's outermost frame is written, then killed at once."""
    now = [0.0]
    path = tmp_path / "rank-3.txt"
    path.write_text("=== rank 3 header ===\n")
    hb = {"rank": 3, "pid": 4343, "stack_thread": "0x00000000000000aa", "stack_last": "line 7 in <module>"}
    parts = {1.5: 'Thread 0x00000000000000bb (most recent call first):\n  File "threading.py", line 1 in wait\n\n',
             4.0: 'Current thread 0x00000000000000aa (most recent call first):\n  File "trainer.py", line 9 in fit\n',
             4.5: '  File "train.py", line 7 in <module>\n'}
    sent: list[tuple[float, int]] = []

    def sleep(s: float) -> None:
        now[0] = round(now[0] + s, 3)
        for t in [t for t in parts if t <= now[0]]:
            with path.open("a") as f:
                f.write(parts.pop(t))

    hit = dump_and_kill([hb], signal.SIGQUIT, "h", tmp_path, send=lambda pid, sig: sent.append((now[0], sig)),
                        look=lambda hb: ALIVE, clock=lambda: now[0], sleep=sleep)
    assert hit == [3]
    t_kill = [t for t, sig in sent if sig == signal.SIGKILL]
    assert t_kill == [4.5], (t_kill, path.read_text())  # not at 2.0 (quiet for settle_s after the first thread)
    assert path.read_text().endswith("line 7 in <module>\n")


def test_the_kill_does_not_wait_for_a_rank_that_is_gone_and_waits_at_most_max_wait(tmp_path: Path) -> None:
    now = [0.0]

    def sleep(s: float) -> None:
        now[0] += s

    sent: list[tuple[float, int]] = []
    states = {1: GONE, 2: ALIVE}  # rank 1 died of the signal; rank 2 never writes (its file stays as it was)

    def look(hb: dict) -> str:  # both alive when signalled
        return ALIVE if len(sent) < 2 else states[hb["rank"]]

    hit = dump_and_kill([{"rank": 1, "pid": 11}, {"rank": 2, "pid": 12}], signal.SIGQUIT, "h", tmp_path,
                        max_wait_s=4.0, send=lambda pid, sig: sent.append((now[0], sig)), look=look,
                        clock=lambda: now[0], sleep=sleep)
    assert hit == [1, 2]
    kills = [t for t, sig in sent if sig == signal.SIGKILL]
    assert len(kills) == 2 and 4.0 <= kills[0] < 4.2, kills


def test_a_stopped_rank_dumps_its_whole_stack_before_the_kill(tmp_path: Path) -> None:
    """A real process, stopped, with faulthandler on SIGQUIT (as a rank registers it): its dump is complete."""
    stacks = tmp_path / "stacks"
    stacks.mkdir()
    code = ("import faulthandler, signal, sys, time\n"
            "f = open(sys.argv[1], 'a'); f.write('=== header ===\\n'); f.flush()\n"
            "faulthandler.register(signal.SIGQUIT, file=f, all_threads=True, chain=False)\n"
            "import json, threading\n"
            "from xirang_hpc.monitor.heartbeat import stack_end\n"
            "threading.Thread(target=threading.Event().wait, daemon=True).start()\n"
            "def deep(n):\n"
            "    if n:\n"
            "        return deep(n - 1)\n"
            "    print(json.dumps(stack_end()), flush=True)\n"
            "    time.sleep(600)\n"
            "deep(30)\n")
    proc = subprocess.Popen([sys.executable, "-c", code, str(stacks / "rank-0.txt")], stdout=subprocess.PIPE, text=True)
    try:
        marker = json.loads(proc.stdout.readline())
        ident = identity(proc.pid)
        hb = {"rank": 0, "pid": proc.pid, "host": socket.gethostname(), "started": ident["create_time"],
              "start_ticks": ident["start_ticks"], **marker}
        os.kill(proc.pid, signal.SIGSTOP)
        deadline = time.monotonic() + 60  # a safety net: the stop is delivered asynchronously
        while probe(hb, hb["host"]) != STOPPED and time.monotonic() < deadline:
            time.sleep(0.01)
        assert dump_and_kill([hb], signal.SIGQUIT, hb["host"], stacks) == [0]
        assert proc.wait(timeout=60) == -signal.SIGKILL
    finally:
        proc.kill()
        proc.wait()
    text = (stacks / "rank-0.txt").read_text()
    assert "most recent call first" in text and text.count("in deep") == 31, text
    assert dump_complete(text, marker) and text.count("most recent call first") == 2, text  # both threads, whole
