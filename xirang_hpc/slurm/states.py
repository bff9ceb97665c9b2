"""Slurm's job states (``squeue``/``scontrol``/``sacct`` long names) and the sets the platform decides by.

One source: the run lock (is a job still live?), the launcher's wait, ``xirang-status`` (has the run
ended?) and the requeue history (how did the previous start end?) all read these sets, so they cannot
disagree. ``sacct`` prints ``CANCELLED by <uid>``: :func:`base` drops the tail.
"""

from __future__ import annotations

# Every state of Slurm 22.05's ``squeue --states`` list (job_state_string()), by meaning.
PENDING = "PENDING"
RUNNING = "RUNNING"
# A job that may still run or write to its run directory: queued, starting, running, held, ending.
LIVE = frozenset({PENDING, RUNNING, "CONFIGURING", "COMPLETING", "RESIZING", "SIGNALING", "STAGE_OUT",
                  "STOPPED", "SUSPENDED", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "RESV_DEL_HOLD",
                  "SPECIAL_EXIT"})
# A job (or, in sacct's history, one start of it) that has ended: it runs no more and writes nothing.
ENDED = frozenset({"BOOT_FAIL", "CANCELLED", "COMPLETED", "DEADLINE", "FAILED", "NODE_FAIL", "OUT_OF_MEMORY",
                   "PREEMPTED", "TIMEOUT", "REVOKED"})
# How sacct records a start that ended in a requeue (the job itself went back to the queue).
REQUEUED = frozenset({"REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED"})
# A start of a job that was followed by another start (sacct's history of a requeued job).
RESTARTED_FROM = REQUEUED | {"PREEMPTED", "NODE_FAIL"}
# Slurm ended the job on a request: a user's or an admin's scancel, the time limit, a preemption.
ENDED_ON_REQUEST = frozenset({"CANCELLED", "TIMEOUT", "PREEMPTED"})
# A rank that gets SIGTERM while its job reads one of these was not cancelled: the batch script ended under
# it (killed or crashed) and Slurm signals what is left. Not COMPLETING: a job ended by scancel reads
# COMPLETING too while its processes are being killed.
BATCH_GONE = frozenset({"FAILED", "COMPLETED"})
# What the launcher's job-state query says when Slurm has forgotten the job (past MinJobAge).
UNKNOWN = "UNKNOWN"
# Not a Slurm state: slurmctld did not answer, so whether the job is live cannot be told.
NO_ANSWER = "NO_ANSWER"


def base(state: str) -> str:
    """``CANCELLED by 1000`` -> ``CANCELLED``; ``RUNNING`` -> ``RUNNING``; '' -> ''."""
    return state.split()[0] if state.split() else ""


def is_live(state: str) -> bool:
    """The job may still run or write (queued, running, held or ending)."""
    return base(state) in LIVE


def has_ended(state: str) -> bool:
    """The job (or one start of it) has ended for good."""
    return base(state) in ENDED


def start_ended(state: str) -> bool:
    """In sacct's history of a requeued job: this start is over (ended, or ended by a requeue)."""
    return base(state) in ENDED or base(state) in REQUEUED
