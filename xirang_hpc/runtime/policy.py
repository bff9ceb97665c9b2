"""Requeue policy: given why a job stopped and how often it was requeued, requeue or not.

Pure logic over :class:`~xirang_hpc.config.schema.RequeueConfig` (the ``conf/requeue/`` presets a
sysadmin can set site-wide); the side effects (``scontrol``) live in :mod:`xirang_hpc.slurm.control`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from xirang_hpc.config.schema import RequeueConfig

# Reasons a job can stop, and the policy switch that governs each.
REASONS = {
    "preemption": "on_preemption",
    "timeout": "on_timeout",
    "node_failure": "on_node_failure",
    "nonzero_exit": "on_nonzero_exit",
    # The job's own machinery failed, not a node: the batch step's driver died, a step could not be
    # launched. Governed by the node-failure switch (an infrastructure fault), but no node is excluded.
    "infra_failure": "on_node_failure",
    # Out of memory: the same layout on the same limit runs out again; a failure of the job's own making.
    "oom": "on_nonzero_exit",
}


# Reasons no policy requeues, and why.
NEVER_REQUEUED = {
    "terminated": "SIGTERM without preemption or time limit (scancel or admin): not requeued",
    # A checkpoint save failed on the storage (full, quota, read-only): every node writes to the same place.
    "save_failed": "the checkpoint storage is full or unwritable: a requeue would fail the same way",
    # Slurm refused the training step itself (a request no node of the allocation can meet).
    "launch_refused": "Slurm refuses the job's step (its request cannot run on these nodes): a requeue would be "
                      "refused the same way",
}


# The requeue budget's classes, and the stop reasons each counts.
BUDGET_CLASSES = {"failures": "failures_per_day", "preemptions": "preemptions_per_day", "timeouts": "timeouts_per_day"}
CLASS_OF = {"preemption": "preemptions", "timeout": "timeouts", "node_failure": "failures",
            "infra_failure": "failures", "nonzero_exit": "failures", "oom": "failures"}
DAY_S = 86400.0


@dataclass(frozen=True)
class History:
    """What a run's event log says of its requeues so far: per budget class, and the days since it started."""

    days: float
    used: dict[str, int]

    @classmethod
    def of(cls, events: Iterable[Mapping[str, Any]], now: float) -> History:
        """From the run's events (``events.jsonl`` rows): requeues by class, days since its first event."""
        rows = list(events)
        times = [float(e["time"]) for e in rows if isinstance(e.get("time"), (int, float))]
        used = dict.fromkeys(BUDGET_CLASSES, 0)
        for e in rows:
            if e.get("kind") == "requeue" and e.get("reason") in CLASS_OF:
                used[CLASS_OF[e["reason"]]] += 1
        return cls(days=max(0.0, now - min(times)) / DAY_S if times else 0.0, used=used)


@dataclass(frozen=True)
class Left:
    """One class's budget: requeues used, allowed by now, and at what rate it grows."""

    used: int
    allowed: int
    per_day: float | None
    burst: int

    @property
    def left(self) -> int | None:
        """Requeues still allowed now (None: no limit)."""
        return None if self.per_day is None else max(0, self.allowed - self.used)


def budget_left(policy: RequeueConfig, history: History) -> dict[str, Left]:
    """Each class's budget after ``history``: ``budget_burst`` + rate x days, floored (None rate: unlimited)."""
    out = {}
    for cls, field in BUDGET_CLASSES.items():
        rate = getattr(policy, field)
        allowed = math.inf if rate is None else policy.budget_burst + rate * history.days
        out[cls] = Left(history.used[cls], -1 if math.isinf(allowed) else math.floor(allowed + 1e-9), rate,
                        policy.budget_burst)
    return out


@dataclass(frozen=True)
class Decision:
    """The verdict: requeue or not, why, and the final status when not."""

    requeue: bool
    reason: str
    why: str
    backoff_s: int = 0
    start_now: bool = False

    @property
    def final_status(self) -> str:
        """``requeued`` or the run's final status (``max_requeues_exceeded``, ``not_requeued``...)."""
        if self.requeue:
            return "requeued"
        if "max_requeues" in self.why:
            return "max_requeues_exceeded"
        return "requeue_budget_exceeded" if "budget" in self.why else f"stopped_{self.reason}"


def decide(reason: str, restarts: int, policy: RequeueConfig, history: History | None = None) -> Decision:
    """Requeue after ``reason`` when the policy allows it and the reason's class is within its budget.

    ``history`` is the run's requeues so far (:meth:`History.of` its events); its class's budget is
    ``budget_burst`` + rate x the run's days. ``restarts`` is Slurm's ``SLURM_RESTART_COUNT`` (0 on the first
    run): the deprecated ``max_requeues``, when set, caps it. Backoff grows linearly with the restart count
    (``backoff_s * (restarts + 1)``), capped at one hour.
    """
    if reason not in REASONS and reason not in NEVER_REQUEUED:
        raise ValueError(f"unknown stop reason {reason!r}; expected one of {sorted(REASONS)} or "
                         f"{' or '.join(repr(r) for r in NEVER_REQUEUED)}")
    if not policy.enabled:
        return Decision(False, reason, "requeue.enabled=false")
    if reason in NEVER_REQUEUED:
        return Decision(False, reason, NEVER_REQUEUED[reason])
    switch = REASONS[reason]
    if not getattr(policy, switch):
        return Decision(False, reason, f"requeue.{switch}=false")
    if policy.max_requeues is not None and restarts >= policy.max_requeues:
        return Decision(False, reason, f"max_requeues={policy.max_requeues} reached after {restarts} requeue(s)")
    count = f"requeue {restarts + 1}" + (f" of {policy.max_requeues}" if policy.max_requeues is not None else "")
    if history is not None:
        cls = CLASS_OF[reason]
        left = budget_left(policy, history)[cls]
        if left.left is not None and left.left <= 0:
            return Decision(False, reason, f"requeue budget for {cls} spent: {left.used} requeue(s) in "
                            f"{history.days:.2f} day(s), {left.allowed} allowed by now (requeue.budget_burst="
                            f"{left.burst} + requeue.{BUDGET_CLASSES[cls]}={left.per_day:g} x days)")
        if left.left is not None:
            count += f", {cls} {left.used + 1} of {left.allowed} allowed by now"
    backoff = min(3600, policy.backoff_s * (restarts + 1)) if policy.backoff_s else 0
    return Decision(True, reason, f"requeue.{switch}=true, {count}", backoff_s=backoff, start_now=policy.start_now)
