"""Heartbeat files: ``run_dir/heartbeats/rank-N.json``, rewritten atomically (temp file + rename).

A heartbeat says where a rank is (``step``, ``phase``, ``progress`` = when it entered that phase)
and that its process still runs (``beat`` = when a background thread last wrote the file). The
two clocks separate the failure modes: a rank blocked in a collective keeps beating but stops
progressing; a stopped or lost process stops both; a dead one also loses its pid.

Two more fields serve hang detection (:mod:`xirang_hpc.monitor.detect`): ``active`` is the time
of the last liveness tick (:mod:`xirang_hpc.runtime.liveness`: a checkpoint save that wrote
another tensor, a restore that read one, an evaluation that finished another batch), so a long phase that still moves is
not a stall; ``coll_seq`` counts the collectives the rank has issued, so the rank that did not
arrive at a collective has a lower count than the ranks waiting in it.

Collective progress (:mod:`xirang_hpc.monitor.detect`'s collective rule, ``monitor.collective_timeout_s``):
``colls`` holds, per process group of the rank, the collectives issued on it (``seq``, c10d's counter:
*entered*), when that count last changed (``since``, sampled by the heartbeat thread) and the group's
members (``span`` [start, stop, step] or ``ranks``); ``coll_in`` the explicit collective the rank is
inside (*entered, not exited*: ``what``, ``since``); ``busy`` the last time the rank's training thread
was seen using the CPU (its thread CPU clock advanced by at least ``BUSY_SHARE`` of the interval). A
rank that computes, however long, is busy; one that is stopped, blocked or asleep is not.

This module must not import torch: the watchdog process and ``xirang-status`` read it.
"""

from __future__ import annotations

import json
import statistics
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

from xirang_hpc.files import make_dir, write_json_atomic

HEARTBEAT_DIR = "heartbeats"
ABORT_FILE = "ABORT.json"
SESSION_FILE = "session.json"
SESSIONS_LOG = "sessions.jsonl"
STACKS_DIR = "stacks"  # run_dir/stacks/rank-N.txt: each rank's Python stacks, dumped on the stack signal
# Share of the wall time between two samples that the training thread must spend on the CPU to count as
# busy: a thread blocked in a collective or asleep uses ~0, one computing ~1 (or its share of a loaded core).
BUSY_SHARE = 0.05


def encode_members(ranks: list[int]) -> dict[str, list[int]]:
    """A group's members as ``{"span": [start, stop, step]}`` when evenly spaced (the world group, a
    mesh dimension: a few numbers at any scale), else ``{"ranks": [...]}``."""
    if len(ranks) >= 2:
        step = ranks[1] - ranks[0]
        if step > 0 and all(b - a == step for a, b in zip(ranks, ranks[1:])):
            return {"span": [ranks[0], ranks[-1] + step, step]}
    return {"ranks": list(ranks)}


def decode_members(entry: dict[str, Any]) -> list[int]:
    """The members written by :func:`encode_members`."""
    if "span" in entry:
        start, stop, step = (int(v) for v in entry["span"])
        return list(range(start, stop, step))
    return [int(r) for r in entry.get("ranks", ())]


def stack_file(stacks_dir: Path, rank: int) -> Path:
    """Where rank ``rank`` dumps its stacks under ``run_dir/STACKS_DIR`` (written by the rank, awaited by the
    watchdog)."""
    return stacks_dir / f"rank-{rank}.txt"


def stack_end() -> dict[str, str]:
    """How this process's stack dump ends, for the watchdog that waits for it (heartbeat fields).

    faulthandler writes the threads newest first, so the main thread comes last, and it ends with the main
    thread's outermost frame: the entry point's call, the same line for the whole run (``stack_thread``: the
    thread's id as faulthandler writes it; ``stack_last``: ``line N in name`` of that frame). Call from the
    main thread. Empty where the main thread's frame cannot be read.
    """
    main = threading.main_thread().ident
    frame = sys._current_frames().get(main) if main is not None else None
    if frame is None:
        return {}
    while frame.f_back is not None:
        frame = frame.f_back
    return {"stack_thread": f"0x{main:016x}", "stack_last": f"line {frame.f_lineno} in {frame.f_code.co_name}"}


def dump_complete(text: str, hb: dict[str, Any]) -> bool | None:
    """Whether ``text`` (what a rank's dump wrote) holds its whole stack dump: the main thread's block reached
    its outermost frame (``stack_end``), or faulthandler's ``...`` for a stack deeper than it writes. None
    when the heartbeat names no end (then only the file's quiet says the dump is over)."""
    thread, last = hb.get("stack_thread"), hb.get("stack_last")
    if not thread or not last:
        return None
    at = text.rfind(f"hread {thread} (most recent call first):\n")  # "Thread" or "Current thread"
    if at < 0:
        return False
    block = text[at:]
    return f'", {last}\n' in block or "\n  ...\n" in block


def heartbeat_dir(run_dir: Path | str) -> Path:
    """``run_dir/heartbeats``, created private (0700; the share group's when shared)."""
    d = Path(run_dir) / HEARTBEAT_DIR
    return d if d.is_dir() else make_dir(d)


def read_json(path: Path) -> dict[str, Any] | None:
    """A JSON object from ``path``, or None when missing or unreadable."""
    try:
        obj = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return obj if isinstance(obj, dict) else None


def read_heartbeats(run_dir: Path | str, session: str | None = None) -> dict[int, dict[str, Any]]:
    """Heartbeats by rank; only those of ``session`` when given (stale files of an earlier attempt are skipped)."""
    d = Path(run_dir) / HEARTBEAT_DIR
    out: dict[int, dict[str, Any]] = {}
    if not d.is_dir():
        return out
    for p in d.glob("rank-*.json"):
        hb = read_json(p)
        if hb is None or "rank" not in hb:
            continue
        if session is not None and hb.get("session") != session:
            continue
        out[int(hb["rank"])] = hb
    return dict(sorted(out.items()))


class Heartbeat:
    """This rank's live state; the main thread updates it cheaply, a daemon thread persists it.

    ``mark_phase`` is called at every phase change (several times a step), so it only touches
    attributes; the file is written every ``interval_s`` by :meth:`start`'s thread.
    """

    # Work before any collective of a step. Not "forward": DDP broadcasts buffers at the start of
    # forward, so there every rank also waits for the slowest one.
    LOCAL_PHASES = ("data",)

    def __init__(self, path: Path, ident: dict[str, Any], interval_s: float = 1.0, window: int = 5,
                 sampler: Any = None, seq_fn: Callable[[], int | None] | None = None,
                 progress_fn: Callable[[], dict[str, tuple[int, list[int]]]] | None = None,
                 inside_fn: Callable[[], tuple[str, float] | None] | None = None) -> None:
        self.path, self.ident, self.interval_s = path, dict(ident), interval_s
        self.sampler = sampler  # e.g. resources.ProcessSampler: CPU/RSS/GPU of this rank
        self.seq_fn = seq_fn  # e.g. runtime.dist.collective_seq: collectives issued so far
        # Collective progress (None: not tracked): e.g. runtime.dist.collective_progress and runtime.liveness.inside.
        self.progress_fn, self.inside_fn = progress_fn, inside_fn
        self._colls: dict[str, dict[str, Any]] = {}
        # The CPU clock of the thread that trains (the one constructing the heartbeat), for ``busy``.
        self._cpu_clock: int | None = None
        if progress_fn is not None and hasattr(time, "pthread_getcpuclockid"):
            try:
                self._cpu_clock = time.pthread_getcpuclockid(threading.get_ident())
            except OSError:
                self._cpu_clock = None
        self._cpu_last: tuple[float, float] | None = None  # (thread CPU seconds, wall time) at the last sample
        self.busy: float | None = None
        self.step, self.phase = 0, "start"
        self.progress = time.time()
        self.active: float | None = None  # the last liveness tick (None: none yet in this phase)
        self.activity = ""
        self.done, self.exited = False, False
        self._step_start: float | None = None
        self._local = 0.0
        self.step_times: deque[float] = deque(maxlen=window)
        self.local_times: deque[float] = deque(maxlen=window)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def mark_phase(self, phase: str, t: float | None = None) -> None:
        """Entering ``phase``; a ``data`` phase starts a new step's timing."""
        t = time.time() if t is None else t
        if self.phase in self.LOCAL_PHASES and self._step_start is not None:
            self._local += t - self.progress
        if phase == "data":
            self._step_start, self._local = t, 0.0
        self.phase, self.progress = phase, t
        self.active, self.activity = None, ""

    def tick(self, what: str = "", t: float | None = None) -> None:
        """Long-running work advanced (any thread): a save wrote a tensor, an evaluation a batch."""
        self.active, self.activity = (time.time() if t is None else t), what

    def mark_step(self, step: int, t: float | None = None) -> None:
        """A step completed; records its wall time and its local work time (the data phase)."""
        t = time.time() if t is None else t
        if self._step_start is not None:
            self.step_times.append(t - self._step_start)
            self.local_times.append(self._local)
        self.step, self.progress = step, t

    def snapshot(self) -> dict[str, Any]:
        """The heartbeat record."""
        row: dict[str, Any] = dict(self.ident)
        row.update(step=self.step, phase=self.phase, progress=self.progress, beat=time.time(),
                   done=self.done, exited=self.exited)
        if self.active is not None:
            row.update(active=self.active, activity=self.activity)
        if self.seq_fn is not None:
            seq = self.seq_fn()
            if seq is not None:
                row["coll_seq"] = seq
        if self.progress_fn is not None:
            self._sample_progress(row)
        if self.sampler is not None:
            row.update(self.sampler.sample())
        if self.step_times:
            row["step_s"] = statistics.median(self.step_times)
            row["local_s"] = statistics.median(self.local_times)
            row["timed_steps"] = len(self.step_times)
        return row

    def _sample_progress(self, row: dict[str, Any]) -> None:
        """Add ``colls``, ``coll_in`` and ``busy`` (see the module doc) to ``row``."""
        now = row["beat"]
        for name, (seq, ranks) in self.progress_fn().items():  # type: ignore[misc]
            known = self._colls.get(name)
            if known is None:
                self._colls[name] = {"seq": seq, "since": now, **encode_members(ranks)}
            elif known["seq"] != seq:
                known.update(seq=seq, since=now)
        if self._colls:
            row["colls"] = {k: dict(v) for k, v in self._colls.items()}
        cur = self.inside_fn() if self.inside_fn is not None else None
        if cur is not None:
            row["coll_in"] = {"what": cur[0], "since": cur[1]}
        if self._cpu_clock is not None:
            try:
                cpu = time.clock_gettime(self._cpu_clock)
            except OSError:  # the training thread is gone
                cpu = None
            if cpu is not None:
                last = self._cpu_last
                if last is not None and cpu - last[0] >= BUSY_SHARE * max(now - last[1], 1e-3):
                    self.busy = now
                self._cpu_last = (cpu, now)
        if self.busy is not None:
            row["busy"] = self.busy

    def write(self) -> None:
        """Persist now (thread-safe)."""
        with self._lock:
            write_json_atomic(self.path, self.snapshot())

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.write()
            except OSError:
                pass  # a full or flaky filesystem must not kill training; staleness will show it

    def start(self) -> None:
        """Write once, then keep writing from a daemon thread."""
        self.write()
        self._thread = threading.Thread(target=self._loop, name="xirang-heartbeat", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop the thread and write a final record."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2 * self.interval_s)
        self.write()
