"""Requeues the job did not log itself, found at the next start and written to ``events.jsonl``.

The job logs its own stops and requeues (the stop-signal hook, the supervisor after ``srun``). Some
happen without either getting to act: Slurm requeues a preempted job itself once the grace time is
over (``PreemptMode=REQUEUE``) or after a node failure; submitit's own USR2 handler requeues a job
preempted before ours is installed; an admin runs ``scontrol requeue``. The rerun knows it was
requeued (``SLURM_RESTART_COUNT`` > 0); when the log has no ``requeue`` event for the previous
start, :func:`record_unlogged_requeue` asks Slurm's accounting how that start ended
(``sacct --duplicates``: ``PREEMPTED``, ``NODE_FAIL``, ``REQUEUED``) and submitit's log whether it
requeued, and writes the missing ``stop`` and ``requeue`` events with their ``source``.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from xirang_hpc.monitor import audit
from xirang_hpc.monitor.events import append_event, read_events
from xirang_hpc.slurm import accounting, control, states

# sacct's state of an ended start -> (who requeued it, why).
_STATES = {"PREEMPTED": ("slurm", "preemption"), "NODE_FAIL": ("slurm", "node_failure"),
           "REQUEUED": ("scontrol", "requeued"), "REQUEUE_FED": ("slurm", "requeued"),
           "REQUEUE_HOLD": ("scontrol", "requeued")}
# submitit's USR2 handler on rank 0 logs this line, then runs `scontrol requeue` (its "Requeued job" line
# after it is often lost: the requeue kills the process first). A timed-out job it does not requeue here
# (xirang submits with max_num_timeout=0).
_SUBMITIT_PREEMPTED = re.compile(r"Caught signal SIGUSR2 on .*: this job is preempted")


def previous_state(job_id: str, run: accounting.Caller = accounting.call) -> str | None:
    """How the start before this one ended: sacct's State of the newest ended run of ``job_id`` (None: unknown)."""
    r = run(["sacct", "-n", "-P", "-X", "-D", "-j", job_id, "--format=JobID,State,Start"])
    if r.rc != 0:
        return None
    ended = [row["State"].split()[0] for row in accounting.parse_rows(r.out, ("JobID", "State", "Start"))
             if states.start_ended(row["State"])]
    return ended[-1] if ended else None


def submitit_requeues(folder: Path, target: str) -> int:
    """How often submitit's own handler requeued ``target`` on a preemption (read from its rank-0 log)."""
    return sum(len(_SUBMITIT_PREEMPTED.findall(log.read_text(errors="replace")))
               for log in sorted(folder.glob(f"{target}_0_log.*")))


def classify(state: str | None, submitit_count: int, submitit_logged: int) -> tuple[str, str]:
    """(source, reason) of an unlogged requeue from sacct's state and submitit's log."""
    if submitit_count > submitit_logged and state in (None, "REQUEUED"):
        return "submitit", "preemption"
    if state is None:
        return "slurm", "unknown"
    return _STATES.get(state, ("slurm", state.lower()))


def record_unlogged_requeue(run_dir: Path, env: Mapping[str, str],
                            state_of: Callable[[str], str | None] = previous_state) -> dict[str, Any] | None:
    """Write the ``stop`` and ``requeue`` events of the previous start when nobody logged them; returns the requeue.

    ``SLURM_RESTART_COUNT`` = N > 0 and no ``requeue`` event of restart N-1 for this job. The
    events carry ``restart`` = N-1 (the start that was stopped), ``source`` (slurm, submitit,
    scontrol) and sacct's ``slurm_state``.
    """
    restart = control.restart_count(env)
    job = env.get("SLURM_JOB_ID", "")
    if restart <= 0 or not job:
        return None
    target = (f"{env['SLURM_ARRAY_JOB_ID']}_{env['SLURM_ARRAY_TASK_ID']}"
              if "SLURM_ARRAY_JOB_ID" in env and "SLURM_ARRAY_TASK_ID" in env else job)
    events = read_events(run_dir)
    ours = {job, target}
    prior = [e for e in events if e.get("restart") == restart - 1 and e.get("job", job) in ours]
    if any(e.get("kind") == "requeue" for e in prior):
        return None
    state = state_of(target)
    count = submitit_requeues(Path(run_dir) / "submitit", target)
    logged = sum(1 for e in events if e.get("kind") == "requeue" and e.get("source") == "submitit"
                 and e.get("job", job) in ours)
    source, reason = classify(state, count, logged)
    fields = dict(source=source, slurm_state=state, job=job, target=target, restart=restart - 1,
                  detected_at_restart=restart)
    if not any(e.get("kind") == "stop" for e in prior):
        append_event(run_dir, "stop", reason, handled_by=source, detail=f"sacct State={state}", **fields)
    audit.record(run_dir, "requeue", target, reason=reason, why=f"requeued by {source}, not by the job",
                 by=source, detected_at_restart=restart)
    return append_event(run_dir, "requeue", reason, why=f"requeued by {source}, not by the job", **fields)
