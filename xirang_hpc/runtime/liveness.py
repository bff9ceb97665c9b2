"""Liveness ticks and collective progress: how long-running work tells the hang watchdog it still moves.

A phase that legitimately lasts much longer than a training step (a checkpoint save writing
tensor after tensor, a restore or a weight import reading them, an evaluation batch after batch)
calls :func:`tick` as it advances; the
monitor's heartbeat records the time of the last tick, and the watchdog measures a stall from
the later of that and the last phase change. So a save or an evaluation that keeps moving is
never a hang, while one that stops moving is named within the same bound as a training step.

:func:`xirang_hpc.runtime.dist.collective_seq` counts the collectives this rank has issued on the world process group
and :func:`xirang_hpc.runtime.dist.collective_progress` on every group it belongs to (c10d's per-group sequence
number, which gloo and NCCL both keep, counted when a collective is issued): the heartbeat records when
each count last changed, and the watchdog compares the counts of a group's members to name the rank
that did not enter a collective its peers entered. Those counts say *entered*; :func:`collective`
adds *exited* for the collectives the trainer issues itself (the grad-norm / loss reduction, the
evaluation mean): the heartbeat carries which one the rank is inside and since when, so the
waiting ranks are named with what they wait in.

Torch-free, since checkpoint verification ticks and runs on the login node too. Both are process-wide
and cheap; with no monitor installed a tick does nothing. Ticks may come
from any thread (the checkpoint writer runs in the background).
"""

from __future__ import annotations

import time
from collections.abc import Callable

_sink: Callable[[str], None] | None = None
# The explicit collective this process is inside: [label, entered at (wall time)], or None. One list
# replaced whole, so the heartbeat thread reads a consistent pair without a lock.
_inside: list[object] | None = None
# Entries per explicitly counted group (``collective(..., group=...)``): name -> [count, global ranks].
_counts: dict[str, list[object]] = {}


def set_sink(fn: Callable[[str], None] | None) -> None:
    """Install (or with None remove) the receiver of ticks: the monitor's heartbeat."""
    global _sink
    _sink = fn


def tick(what: str = "") -> None:
    """Report that long-running work advanced (``what``: a short label, e.g. ``checkpoint write``)."""
    fn = _sink
    if fn is not None:
        fn(what)


class collective:  # noqa: N801 - used as a context manager, named like one
    """``with collective("grad-norm / loss all-reduce"): dist.all_reduce(...)``: record entry and exit.

    With ``group`` (a name the group's members share) and ``ranks`` (its global ranks), entry also counts
    on that group, for collectives c10d does not see (the node's shared-memory barrier of the hierarchical
    all-reduce): the heartbeat reports the count beside c10d's, so a rank waiting there is a waiter too.
    A few attribute writes and a clock read per collective (well under a microsecond against collectives
    of tens of microseconds at least), so it stays on in every run.
    """

    __slots__ = ("what", "group", "ranks")

    def __init__(self, what: str, group: str | None = None, ranks: list[int] | None = None) -> None:
        self.what, self.group, self.ranks = what, group, ranks

    def __enter__(self) -> collective:
        global _inside
        if self.group is not None:
            count = _counts.get(self.group)
            if count is None:
                count = _counts[self.group] = [0, list(self.ranks or ())]
            count[0] += 1
        _inside = [self.what, time.time()]
        return self

    def __exit__(self, *exc: object) -> None:
        global _inside
        _inside = None


def inside() -> tuple[str, float] | None:
    """The explicit collective this process is inside and when it entered it; None outside one."""
    cur = _inside
    return None if cur is None else (str(cur[0]), float(cur[1]))  # type: ignore[arg-type]


def counts() -> dict[str, tuple[int, list[int]]]:
    """Per group named in :class:`collective`: (entries so far, its global ranks), as c10d's counts read."""
    return {g: (int(c[0]), list(c[1])) for g, c in list(_counts.items())}  # type: ignore[call-overload]
