"""Heartbeat files: ``run_dir/heartbeats/rank-N.json``, rewritten atomically (temp file + rename).

A heartbeat says where a rank is (``step``, ``phase``, ``progress`` = when it entered that phase)
and that its process still runs (``beat`` = when a background thread last wrote the file). The
two clocks separate the failure modes: a rank blocked in a collective keeps beating but stops
progressing; a stopped or lost process stops both; a dead one also loses its pid.

Two more fields serve hang detection (:mod:`xirang_hpc.monitor.detect`): ``active`` is the time
of the last liveness tick (:mod:`xirang_hpc.runtime.liveness`: a checkpoint save that wrote
another tensor, an evaluation that finished another batch), so a long phase that still moves is
not a stall; ``coll_seq`` counts the collectives the rank has issued, so the rank that did not
arrive at a collective has a lower count than the ranks waiting in it.

This module must not import torch: the watchdog process and ``xirang-status`` read it.
"""

from __future__ import annotations

import json
import statistics
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


def stack_file(stacks_dir: Path, rank: int) -> Path:
    """Where rank ``rank`` dumps its stacks under ``run_dir/STACKS_DIR`` (written by the rank, awaited by the
    watchdog)."""
    return stacks_dir / f"rank-{rank}.txt"


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
                 sampler: Any = None, seq_fn: Callable[[], int | None] | None = None) -> None:
        self.path, self.ident, self.interval_s = path, dict(ident), interval_s
        self.sampler = sampler  # e.g. resources.ProcessSampler: CPU/RSS/GPU of this rank
        self.seq_fn = seq_fn  # e.g. runtime.liveness.collective_seq: collectives issued so far
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
        if self.sampler is not None:
            row.update(self.sampler.sample())
        if self.step_times:
            row["step_s"] = statistics.median(self.step_times)
            row["local_s"] = statistics.median(self.local_times)
            row["timed_steps"] = len(self.step_times)
        return row

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
