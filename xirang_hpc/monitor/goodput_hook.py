"""Rank 0's record of where each start's time goes: ``run_dir/steps.jsonl`` (read by :mod:`.goodput`).

The hook times the loop's phases (``Loop.phase``: data, forward, backward, optimizer, comm, eval,
checkpoint) with a monotonic clock and writes, per process start, one ``session`` row (start-up:
process creation to the hooks' set-up; set-up: checkpoint restore and hooks until the first step;
the initial evaluation), ``block`` rows of consecutive steps and, when the loop finishes, an ``end``
row (the final evaluation). It is the first hook, so its ``on_fit_start`` runs before the restore
and its ``on_step_end`` closes a step before the checkpoint hook saves (that save then lands in
the next block's ``save`` seconds, and the block before ends at the saved step).

A block is written at every save (its last step is the saved one), after a start's first step,
after an evaluation, at the end, and at least every :data:`~.goodput.FLUSH_S` seconds; one
``O_APPEND`` write per block, so a kill -9 loses at most that much of the record and never tears
another writer's line.
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import time
from pathlib import Path
from typing import Any

import psutil

from xirang_hpc.files import record_mode
from xirang_hpc.monitor.goodput import FLUSH_S, STEPS_FILE
from xirang_hpc.runtime.hooks import Loop, TrainerHook
from xirang_hpc.runtime.topology import Topology

# Phases whose time is not step work (each its own badput bucket); everything else in a step is compute.
_BUCKET = {"data": "data", "eval": "eval", "checkpoint": "save"}


class GoodputHook(TrainerHook):
    """Time the loop on rank 0 and append ``steps.jsonl`` rows (other ranks do nothing)."""

    def __init__(self, topo: Topology, run_dir: Path, flush_s: float = FLUSH_S) -> None:
        self.active = topo.rank == 0
        self.topo, self.run_dir, self.flush_s = topo, Path(run_dir), flush_s
        self.session: dict[str, Any] | None = None  # written at the first step (after a fork is resolved)
        self.phase_name: str | None = None
        self.t_phase = 0.0  # monotonic: when the current phase began
        self.acc = {"data": 0.0, "eval": 0.0, "save": 0.0}  # since the last step end
        self.block: dict[str, Any] | None = None
        self.durs: list[float] = []  # compute seconds of each step in the open block
        self.t_step_end = 0.0
        self.t_flush = 0.0
        self.steps_in_session = 0

    def _write(self, row: dict[str, Any]) -> None:
        line = (json.dumps(row) + "\n").encode()
        fd = os.open(self.run_dir / STEPS_FILE, os.O_WRONLY | os.O_APPEND | os.O_CREAT, record_mode())
        try:
            os.write(fd, line)
        except OSError:
            pass  # bookkeeping never stops training (a full disk is reported by the checkpoint path)
        finally:
            os.close(fd)

    def _charge(self, now: float) -> None:
        """The time since the last phase change goes to that phase's bucket (compute when it has none)."""
        bucket = _BUCKET.get(self.phase_name or "")
        if bucket is not None:
            self.acc[bucket] += now - self.t_phase
        self.t_phase = now

    def on_fit_start(self, trainer: Loop) -> None:
        """Before the restore: how long the process took to get here."""
        if not self.active:
            return
        now_wall, now = time.time(), time.monotonic()
        try:
            created = psutil.Process().create_time()
        except psutil.Error:
            created = now_wall
        self.session = {"kind": "session", "pid": os.getpid(), "host": socket.gethostname(),
                        "job": str(self.topo.job_id), "time": now_wall, "mono": now,
                        "startup_s": round(max(0.0, now_wall - created), 6)}
        self.phase_name, self.t_phase = "setup", now

    def on_phase(self, trainer: Loop, phase: str) -> None:
        """Charge the phase that ends; the first ``data`` phase writes the session row."""
        if not self.active or self.session is None:
            return
        now = time.monotonic()
        self._charge(now)
        if self.block is None and phase == "data" and "setup_s" not in self.session:
            ev = self.acc["eval"]
            self.session.update(setup_s=round(now - self.session["mono"] - ev, 6), eval_s=round(ev, 6),
                                step=trainer.state.step)
            # The record goes with the run that trains (the trainer's directory).
            self.run_dir = Path(trainer.run_dir)
            self._write(self.session)
            self.acc = dict.fromkeys(self.acc, 0.0)
            self.t_step_end = self.t_flush = now
        elif phase == "checkpoint" and self.block is not None:
            self._flush(now)  # the block ends at the saved step: a restore to it falls on a boundary
        self.phase_name = phase

    def on_step_end(self, trainer: Loop, metrics: dict[str, float]) -> None:
        """Close the step into the open block; write it when due."""
        if not self.active or self.session is None or "setup_s" not in self.session:
            return
        now = time.monotonic()
        self._charge(now)
        self.phase_name = None
        dur = now - self.t_step_end
        step = trainer.state.step
        if self.block is None:
            self.block = {"pid": self.session["pid"], "a": step, "b": step, "dur": 0.0, "data": 0.0, "eval": 0.0,
                          "save": 0.0}
        b = self.block
        b["b"], b["dur"] = step, b["dur"] + dur
        evaluated = self.acc["eval"] > 0
        for k, v in self.acc.items():
            b[k] += v
        self.durs.append(max(0.0, dur - sum(self.acc.values())))
        self.acc = dict.fromkeys(self.acc, 0.0)
        self.t_step_end = now
        self.steps_in_session += 1
        if self.steps_in_session == 1 or evaluated or now - self.t_flush >= self.flush_s:
            self._flush(now)

    def _flush(self, now: float) -> None:
        b, s = self.block, self.session
        if b is None or s is None:
            return
        end = self.t_step_end
        # Wall time from this process's monotonic clock: a clock step during the run does not bend the record.
        row: dict[str, Any] = {"pid": b["pid"], "a": b["a"], "b": b["b"], "time": round(s["time"] + end - s["mono"], 6),
                               "mono": round(end, 6)}
        row.update({k: round(b[k], 6) for k in ("dur", "data", "eval", "save")})
        row["med"] = round(statistics.median(self.durs), 6) if self.durs else None
        self._write(row)
        self.block, self.durs, self.t_flush = None, [], now

    def on_fit_end(self, trainer: Loop, summary: dict[str, object]) -> None:
        """The open block, then the ``end`` row with the final evaluation."""
        if not self.active or self.session is None or "setup_s" not in self.session:
            return
        now = time.monotonic()
        self._charge(now)
        self._flush(now)
        self._write({"kind": "end", "pid": self.session["pid"], "time": round(time.time(), 6), "mono": round(now, 6),
                     "step": trainer.state.step, "eval_s": round(self.acc["eval"], 6)})
        self.phase_name = None
