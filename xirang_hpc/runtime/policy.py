"""Requeue policy: given why a job stopped and how often it was requeued, requeue or not.

Pure logic over :class:`~xirang_hpc.config.schema.RequeueConfig` (the ``conf/requeue/`` presets a
sysadmin can set site-wide); the side effects (``scontrol``) live in :mod:`xirang_hpc.slurm.control`.
"""

from __future__ import annotations

from dataclasses import dataclass

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
        return "max_requeues_exceeded" if "max_requeues" in self.why else f"stopped_{self.reason}"


def decide(reason: str, restarts: int, policy: RequeueConfig) -> Decision:
    """Requeue after ``reason`` when the policy allows it and ``restarts < max_requeues``.

    ``restarts`` is Slurm's ``SLURM_RESTART_COUNT`` (0 on the first run). Backoff grows
    linearly with the restart count (``backoff_s * (restarts + 1)``), capped at one hour.
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
    if restarts >= policy.max_requeues:
        return Decision(False, reason, f"max_requeues={policy.max_requeues} reached after {restarts} requeue(s)")
    backoff = min(3600, policy.backoff_s * (restarts + 1)) if policy.backoff_s else 0
    return Decision(True, reason, f"requeue.{switch}=true, requeue {restarts + 1} of {policy.max_requeues}",
                    backoff_s=backoff, start_now=policy.start_now)
