"""One job per run directory.

A run directory belongs to at most one live job: two jobs in one directory would write duplicated
metrics, interleave events and commit the same checkpoint steps. ``<run>/job.json`` names the job
that owns the directory (executor, job id; for the local executor also the pid and its start time);
a launch that finds a live owner is refused with its id, or, on Slurm and when asked
(``train.after_active=true``), queued behind it with ``--dependency=afterany:<id>``.

A dead job cannot leave the directory locked: the owner is "live" only while Slurm reports it in a
non-terminal state (``scontrol show job``: pending, running, requeued, suspended, ...) or, for the
local executor, while its process (same pid and start time, so a reused pid does not count) runs.
Concurrent launches of the same run serialise on an ``flock`` of ``<run>/.submit.lock`` from the
check to the record, so exactly one of them submits.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from xirang_hpc.files import record_mode, write_json_atomic
from xirang_hpc.runtime.process_identity import identity, is_running
from xirang_hpc.slurm import control, states

OWNER_FILE = "job.json"
SUBMIT_LOCK = ".submit.lock"


class RunBusyError(RuntimeError):
    """The run directory already has a live job; the message names it and the ways out."""


def read_owner(run_dir: Path) -> dict[str, Any] | None:
    """The recorded owner of ``run_dir`` (None when none was recorded or the file is unreadable)."""
    try:
        return json.loads((run_dir / OWNER_FILE).read_text())
    except (OSError, ValueError):
        return None


def live_owner(run_dir: Path, slurm_state: Callable[[str, str | None], str] = control.job_state
               ) -> dict[str, Any] | None:
    """The owner of ``run_dir`` if its job is still live, with ``state``; None when free (or stale).

    A job submitted to a named cluster (``cluster`` in the record: a site of ``cluster.sites``) is looked
    up there (``scontrol -M``): another cluster knows nothing of it, or has a job with the same id.
    """
    owner = read_owner(run_dir)
    if owner is None:
        return None
    if owner.get("executor") == "slurm":
        jid = str(owner.get("job_id") or "")
        state = slurm_state(jid, owner.get("cluster") or None).split()[0] if jid else "UNKNOWN"
        if state == states.NO_ANSWER:  # a job that may be live is never taken for dead
            where = f" of cluster {owner['cluster']}" if owner.get("cluster") else ""
            raise RunBusyError(f"cannot tell whether job {jid}, which owns run directory {run_dir}, is still live: "
                               f"slurmctld{where} does not answer; nothing was submitted. Launch again when "
                               "`squeue` answers")
        return dict(owner, state=state) if states.is_live(state) else None
    pid, started = owner.get("pid"), owner.get("pid_started")
    if isinstance(pid, int) and isinstance(started, (int, float)) \
            and is_running(pid, owner.get("pid_start_ticks"), float(started), exact=True):
        return dict(owner, state="RUNNING")
    return None


def busy_message(run_dir: Path, owner: dict[str, Any]) -> str:
    """Why a launch is refused, and the ways out."""
    jid, state = owner.get("job_id"), owner.get("state", "RUNNING")
    if owner.get("executor") == "slurm":
        m = f"-M {owner['cluster']} " if owner.get("cluster") else ""
        raw = owner.get("job_id")
        jid = f"{raw} on cluster {owner['cluster']}" if owner.get("cluster") else raw
        outs = (f"wait for it (squeue {m}-j {raw}), cancel it (scancel {m}{raw}), queue this launch behind it with "
                "train.after_active=true, or use another train.run_dir")
    else:
        outs = f"wait for it, stop it (kill {owner.get('pid')}), or use another train.run_dir"
    return f"run directory {run_dir} already has job {jid} ({state}, submitted {owner.get('submitted', '?')}): {outs}"


@contextlib.contextmanager
def submission_lock(run_dir: Path) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``<run>/.submit.lock`` (released when the process dies, too)."""
    fd = os.open(run_dir / SUBMIT_LOCK, os.O_RDWR | os.O_CREAT, record_mode())
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


def record_owner(run_dir: Path, executor: str, job_id: str, pid: int | None = None,
                 after: str | None = None, cluster: str | None = None) -> dict[str, Any]:
    """Write ``<run>/job.json`` (atomically) naming the job that now owns the directory (and the Slurm
    cluster it was submitted to with ``-M``, when one was named)."""
    owner: dict[str, Any] = {"executor": executor, "job_id": str(job_id),
                             "submitted": time.strftime("%Y-%m-%dT%H:%M:%S"), "host": os.uname().nodename}
    if pid is not None:
        owner["pid"] = pid
        ident = identity(pid)
        if "create_time" in ident:
            owner["pid_started"] = ident["create_time"]
        if "start_ticks" in ident:
            owner["pid_start_ticks"] = ident["start_ticks"]
    if after:
        owner["after"] = after
    if cluster:
        owner["cluster"] = cluster
    write_json_atomic(run_dir / OWNER_FILE, owner, indent=1)
    return owner


def claim(run_dir: Path, executor: str, after_active: bool,
          slurm_state: Callable[[str, str | None], str] = control.job_state,
          handover: tuple[str, str | None] | None = None) -> str | None:
    """Check ``run_dir`` before submitting (call inside :func:`submission_lock`).

    Returns None when the directory is free, or the live owner's job id to depend on when
    ``after_active`` (Slurm only); raises :class:`RunBusyError` otherwise. ``handover`` is the
    ``(job id, cluster)`` of a job submitting its own successor (a run moving to another site from
    inside its job): that owner is ending and does not count.
    """
    owner = live_owner(run_dir, slurm_state)
    if owner is None:
        return None
    if handover is not None and (str(owner.get("job_id")), owner.get("cluster") or None) == (
            str(handover[0]), handover[1] or None):
        return None
    if after_active and executor == "slurm" and owner.get("executor") == "slurm":
        return str(owner["job_id"])
    msg = busy_message(run_dir, owner)
    if after_active:
        msg += "; train.after_active queues behind a Slurm job only (the local executor has no dependencies)"
    raise RunBusyError(msg)
