"""Liveness ticks and collective counts: how long-running work tells the hang watchdog it still moves.

A phase that legitimately lasts much longer than a training step (a checkpoint save writing
tensor after tensor, an evaluation batch after batch) calls :func:`tick` as it advances; the
monitor's heartbeat records the time of the last tick, and the watchdog measures a stall from
the later of that and the last phase change. So a save or an evaluation that keeps moving is
never a hang, while one that stops moving is named within the same bound as a training step.

:func:`collective_seq` counts the collectives this rank has issued on its training process
groups (c10d's per-group sequence numbers, which gloo and NCCL both keep): the watchdog compares
it across ranks to name the rank that did not arrive at a collective. Groups used only by
background work (the checkpoint writer's) are registered with :func:`background_group` and left
out, so an asynchronous save does not make the counts differ between ranks.

Both are process-wide and cheap; with no monitor installed a tick does nothing. Ticks may come
from any thread (the checkpoint writer runs in the background).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

_sink: Callable[[str], None] | None = None
_background: set[int] = set()


def set_sink(fn: Callable[[str], None] | None) -> None:
    """Install (or with None remove) the receiver of ticks: the monitor's heartbeat."""
    global _sink
    _sink = fn


def tick(what: str = "") -> None:
    """Report that long-running work advanced (``what``: a short label, e.g. ``checkpoint write``)."""
    fn = _sink
    if fn is not None:
        fn(what)


def background_group(group: Any) -> None:
    """Leave ``group`` out of :func:`collective_seq` (its collectives run beside training)."""
    if group is not None:
        _background.add(id(group))


def collective_seq() -> int | None:
    """Collectives issued so far on this rank's training process groups; None without a process group.

    Read from the heartbeat thread while the main thread may sit inside a collective: it only reads
    each group's counter (c10d increments it when a collective is issued).
    """
    try:
        import torch.distributed as dist
        from torch.distributed import distributed_c10d as c10d

        if not dist.is_available() or not dist.is_initialized():
            return None
        total = 0
        for pg in list(c10d._world.pg_map):
            if id(pg) in _background:
                continue
            try:
                total += int(pg._get_sequence_number_for_group())
            except (RuntimeError, AttributeError):
                continue  # a backend without sequence numbers (fake, custom)
        return total
    except Exception:  # noqa: BLE001 - a liveness probe never raises into the heartbeat thread
        return None
