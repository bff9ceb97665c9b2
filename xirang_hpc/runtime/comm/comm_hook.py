"""The DDP communication hook: DDP buckets -> messages of ``bucket`` bytes -> hierarchical all-reduce.

DDP keeps its bucketing and backward overlap: the hook only enqueues the bucket and returns a
future; one worker thread per rank coalesces consecutive buckets (and splits big ones) into
messages of the configured size and runs :class:`HierarchicalAllreduce` on them in order, so
every rank issues the same collectives in the same order. DDP waits on the futures at the end
of backward.

``bucket=auto``: :class:`BucketTuner` runs each candidate size for a few steps after a warm-up
step, measures the time from the step's first bucket to the end of its last message (the
communication that backward could not hide), takes the max over ranks (so every rank decides
the same), and keeps the fastest. The decision is logged.
"""

from __future__ import annotations

import logging
import queue
import statistics
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from xirang_hpc.runtime.comm.hierarchical import HierarchicalAllreduce

log = logging.getLogger(__name__)
MB = 1 << 20


class BucketTuner:
    """Try ``candidates`` (bytes) for ``steps_each`` steps each after ``warmup`` steps; keep the fastest."""

    def __init__(self, candidates: list[int], steps_each: int = 2, warmup: int = 1) -> None:
        if not candidates:
            raise ValueError("bucket auto-tune needs at least one candidate size")
        self.candidates, self.steps_each, self.warmup = list(candidates), steps_each, warmup
        self.samples: dict[int, list[float]] = {c: [] for c in self.candidates}
        self.step = 0
        self.chosen: int | None = None

    @property
    def tuning(self) -> bool:
        """Still measuring."""
        return self.chosen is None

    def current(self) -> int:
        """Message size for the step in progress."""
        if self.chosen is not None:
            return self.chosen
        i = max(0, self.step - self.warmup) // self.steps_each
        return self.candidates[min(i, len(self.candidates) - 1)]

    def record(self, seconds: float) -> int | None:
        """Record one step's (rank-max) time; returns the chosen size once decided."""
        if self.chosen is None and self.step >= self.warmup:
            self.samples[self.current()].append(seconds)
        self.step += 1
        if self.chosen is None and self.step >= self.warmup + self.steps_each * len(self.candidates):
            medians = {c: statistics.median(v) for c, v in self.samples.items()}
            self.chosen = min(self.candidates, key=lambda c: (medians[c], c))
            return self.chosen
        return None

    def summary(self) -> dict[str, Any]:
        """The decision and the medians it was based on (seconds per step)."""
        return {"chosen_bytes": self.chosen,
                "median_s": {str(c): statistics.median(v) for c, v in self.samples.items() if v}}


class CommHook:
    """Callable registered with ``DDP.register_comm_hook(None, hook)``; owns the worker thread."""

    def __init__(self, ar: HierarchicalAllreduce, bucket_bytes: int, tuner: BucketTuner | None = None,
                 log_fn: Callable[[str], None] | None = None) -> None:
        self.ar, self.tuner = ar, tuner
        self.bucket_bytes = tuner.current() if tuner else bucket_bytes
        self.inter_node = True  # False in the local steps of budget mode (set between steps)
        self.steps = 0
        self.last_step_s = 0.0
        self._log = log_fn
        self._q: queue.Queue[Any] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="xirang-comm", daemon=True)
        self._thread.start()

    def __call__(self, _state: object, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        self._q.put((bucket.buffer(), fut, bucket.is_last(), time.perf_counter()))
        return fut

    def close(self) -> None:
        """Stop the worker (after the last backward)."""
        self._q.put(None)
        self._thread.join(timeout=30)

    def _flush(self, pending: list[tuple[torch.Tensor, torch.futures.Future[torch.Tensor]]]) -> None:
        try:
            self.ar.allreduce_([t for t, _ in pending], inter_node=self.inter_node, chunk_bytes=self.bucket_bytes)
        except BaseException as exc:  # noqa: BLE001 - handed to DDP, which re-raises in backward
            for _, f in pending:
                f.set_exception(exc)
            pending.clear()
            return

    def _run(self) -> None:
        pending: list[tuple[torch.Tensor, torch.futures.Future[torch.Tensor]]] = []
        size, t_first = 0, None
        while True:
            item = self._q.get()
            if item is None:
                return
            buf, fut, last, t_enq = item
            t_first = t_enq if t_first is None else t_first
            if pending and pending[0][0].dtype != buf.dtype:
                self._flush(pending)
                self._complete(pending)
                size = 0
            pending.append((buf, fut))
            size += buf.numel() * buf.element_size()
            if size >= self.bucket_bytes or last:
                self._flush(pending)
                if last:
                    self._end_step(time.perf_counter() - t_first)
                    t_first = None
                self._complete(pending)
                size = 0

    @staticmethod
    def _complete(pending: list[tuple[torch.Tensor, torch.futures.Future[torch.Tensor]]]) -> None:
        for t, f in pending:
            if not f.done():
                f.set_result(t)
        pending.clear()

    def _end_step(self, seconds: float) -> None:
        """Bookkeeping at the end of a step's last message, before DDP's backward can return."""
        self.steps += 1
        self.last_step_s = seconds
        if self.tuner is None or not self.tuner.tuning:
            return
        if dist.is_initialized() and self.ar.layout.group is not None:
            # Collective on DDP's group while the main thread still waits in backward: safe ordering.
            t = torch.tensor([seconds], dtype=torch.float64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.ar.layout.group)
            seconds = float(t.item())
        chosen = self.tuner.record(seconds)
        if chosen is not None:
            med = ", ".join(f"{int(c) / MB:g} MB {s * 1e3:.1f} ms" for c, s in self.tuner.summary()["median_s"].items())
            msg = f"comm: bucket auto-tune (step time to last message, rank max, median): {med} -> {chosen / MB:g} MB"
            if self._log is not None:
                self._log(msg)
            log.info(msg)
        self.bucket_bytes = self.tuner.current()
