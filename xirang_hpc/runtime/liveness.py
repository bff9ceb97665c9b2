"""Liveness ticks and collective counts: how long-running work tells the hang watchdog it still moves.

A phase that legitimately lasts much longer than a training step (a checkpoint save writing
tensor after tensor, an evaluation batch after batch) calls :func:`tick` as it advances; the
monitor's heartbeat records the time of the last tick, and the watchdog measures a stall from
the later of that and the last phase change. So a save or an evaluation that keeps moving is
never a hang, while one that stops moving is named within the same bound as a training step.

:func:`xirang_hpc.runtime.dist.collective_seq` counts the collectives this rank has issued on the world process group
(c10d's per-group sequence number, which gloo and NCCL both keep): the watchdog compares it
across ranks to name the rank that did not arrive at a collective. Only the world group: every
rank issues the same collectives on it in the same order (loss and grad-norm reductions, the
stop-signal consensus, evaluation, broadcasts; DDP's gradient all-reduce unless the hierarchical
hook moves it to per-node groups), so equal positions have equal counts. Subgroups (a node's, a
pipeline stage's, the checkpoint writer's) would compare only within themselves.

Torch-free, since checkpoint verification ticks and runs on the login node too. Both are process-wide
and cheap; with no monitor installed a tick does nothing. Ticks may come
from any thread (the checkpoint writer runs in the background).
"""

from __future__ import annotations

from collections.abc import Callable

_sink: Callable[[str], None] | None = None


def set_sink(fn: Callable[[str], None] | None) -> None:
    """Install (or with None remove) the receiver of ticks: the monitor's heartbeat."""
    global _sink
    _sink = fn


def tick(what: str = "") -> None:
    """Report that long-running work advanced (``what``: a short label, e.g. ``checkpoint write``)."""
    fn = _sink
    if fn is not None:
        fn(what)
