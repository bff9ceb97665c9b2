"""The job's only contact with Slurm's command line: ``scontrol``, behind one tiny function.

Everything else here is parsing and decisions over plain data, so it is testable without Slurm:
- :func:`requeue_target` names what to requeue: ``ARRAYJOBID_TASKID`` for an array task
  (never the whole array), else the job id;
- :func:`classify_stop` tells a time limit from a preemption from Slurm's own data
  (``PreemptTime``, ``TimeLimit``, ``RunTime`` of ``scontrol show job``), not a wall-clock guess.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

_NODE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


class SlurmCommandError(RuntimeError):
    """``scontrol`` is missing or failed; the message says which and what to do."""


def run_scontrol(args: list[str], timeout_s: float = 30.0) -> str:
    """Run ``scontrol ARGS`` and return its stdout (the one place the job shells out to Slurm)."""
    exe = shutil.which("scontrol")
    if exe is None:
        raise SlurmCommandError(
            "scontrol not found on PATH of this compute node/container: cannot requeue. "
            "Install the Slurm client in the job's environment (or bind-mount it into the container), "
            "or set requeue.enabled=false"
        )
    try:
        out = subprocess.run([exe, *args], capture_output=True, text=True, timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired as exc:
        raise SlurmCommandError(f"scontrol {' '.join(args)} timed out after {timeout_s:.0f}s") from exc
    if out.returncode != 0:
        raise SlurmCommandError(f"scontrol {' '.join(args)} failed (exit {out.returncode}): {out.stderr.strip()}")
    return out.stdout


def requeue_target(env: Mapping[str, str] | None = None) -> str:
    """The id to requeue: ``<array job>_<task>`` for an array task, else ``SLURM_JOB_ID``."""
    env = os.environ if env is None else env
    if "SLURM_ARRAY_JOB_ID" in env and "SLURM_ARRAY_TASK_ID" in env:
        return f"{env['SLURM_ARRAY_JOB_ID']}_{env['SLURM_ARRAY_TASK_ID']}"
    if "SLURM_JOB_ID" not in env:
        raise SlurmCommandError("not inside a Slurm job (SLURM_JOB_ID is unset): nothing to requeue")
    return env["SLURM_JOB_ID"]


def parse_job(text: str) -> dict[str, str]:
    """``scontrol show job -o`` (one line of ``Key=Value`` pairs) -> dict."""
    fields: dict[str, str] = {}
    for tok in text.split():
        if "=" in tok:
            k, v = tok.split("=", 1)
            fields.setdefault(k, v)
    return fields


def parse_duration(text: str) -> float | None:
    """Slurm durations ``[D-]HH:MM:SS``/``MM:SS``/minutes -> seconds; ``UNLIMITED``/``N/A`` -> None."""
    if not text or text in ("UNLIMITED", "INFINITE", "N/A", "NONE", "Partition_Limit"):
        return None
    days = 0
    if "-" in text:
        d, text = text.split("-", 1)
        days = int(d)
    parts = [int(p) for p in text.split(":")]
    if len(parts) == 1:
        secs = parts[0] * 60
    elif len(parts) == 2:
        secs = parts[0] * 60 + parts[1]
    else:
        secs = parts[0] * 3600 + parts[1] * 60 + parts[2]
    return float(days * 86400 + secs)


def job_info(job_id: str) -> dict[str, str]:
    """Slurm's record of ``job_id`` (``scontrol show job -o``)."""
    return parse_job(run_scontrol(["show", "job", "-o", job_id]))


def requeue(job_id: str) -> None:
    """``scontrol requeue JOB_ID``; Slurm then ends every task of the job."""
    run_scontrol(["requeue", job_id])


@dataclass(frozen=True)
class StopCause:
    """Why the job was told to stop, and the Slurm data the verdict rests on."""

    reason: str  # preemption | timeout | terminated
    detail: str


def classify_stop(info: Mapping[str, str], signal_name: str, signal_delay_s: float, slack_s: float = 60.0) -> StopCause:
    """Tell preemption from a time limit using Slurm's job record.

    - ``PreemptTime`` set: Slurm preempted the job (either signal) -> ``preemption``.
    - ``TimeLimit - RunTime <= signal_delay_s + slack_s``: the time-limit warning (``--signal=USR2@delay``
      fires ``delay`` seconds before the limit; Slurm's timer may fire late, never early) -> ``timeout``.
    - otherwise: SIGTERM without either (``scancel``, admin) -> ``terminated``; a user signal without
      either is treated as preemption (e.g. a site script that signals before draining a node).
    """
    preempt = info.get("PreemptTime", "None")
    limit = parse_duration(info.get("TimeLimit", ""))
    run = parse_duration(info.get("RunTime", ""))
    if preempt not in ("None", "N/A", "Unknown", ""):
        return StopCause("preemption", f"PreemptTime={preempt}")
    if limit is not None and run is not None and limit - run <= signal_delay_s + slack_s:
        return StopCause("timeout", f"RunTime={info.get('RunTime')} TimeLimit={info.get('TimeLimit')}")
    if signal_name == "SIGTERM":
        return StopCause("terminated", f"SIGTERM with RunTime={info.get('RunTime')} TimeLimit={info.get('TimeLimit')}")
    return StopCause("preemption", f"{signal_name} before the time limit (RunTime={info.get('RunTime')} "
                                   f"TimeLimit={info.get('TimeLimit')})")


def after_requeue_detached(job_id: str, delay_s: int = 0, wait_s: int = 120, exclude: Sequence[str] = (),
                       start: bool = True) -> None:
    """After a requeue: exclude failed nodes and make the job eligible again at once (or after ``delay_s``).

    Slurm holds a requeued job in ``BeginTime`` for about two minutes, and sets that begin time
    only once the job has left the nodes (an earlier update is overwritten). ``ExcNodeList`` can
    only be changed while the job is pending ("Job is no longer pending execution" while it runs).
    So both updates must come from a process that outlives the job: a small detached shell polls
    until the job is PENDING with ``Reason=BeginTime``, then sets ``ExcNodeList`` (when ``exclude``
    names nodes) and ``StartTime`` (when ``start``). Where the site's process tracking (cgroups)
    kills it with the job, Slurm's default delay stands and no node is excluded.
    """
    exe = shutil.which("scontrol")
    if exe is None:
        raise SlurmCommandError("scontrol not found: cannot apply requeue.start_now / exclude_failed_nodes")
    for node in exclude:  # node names go into a shell line: refuse anything but a Slurm hostname
        if not _NODE_NAME.fullmatch(node):
            raise SlurmCommandError(f"refusing to exclude node {node!r}: not a Slurm node name")
    if not start and not exclude:
        return
    when = "now" if delay_s <= 0 else f"now+{int(delay_s)}"
    updates = []
    if exclude:
        updates.append(f"{exe} update jobid={job_id} ExcNodeList={','.join(exclude)}")
    if start:
        updates.append(f"{exe} update jobid={job_id} StartTime={when}")
    script = (
        f"for i in $(seq 1 {int(wait_s)}); do sleep 1; "
        f"if {exe} show job -o {job_id} | grep 'JobState=PENDING' | grep -q 'Reason=BeginTime'; then "
        f"{'; '.join(updates)}; exit 0; fi; done"
    )
    # A double fork (the intermediate shell exits) so the helper is no child of the job's tasks.
    subprocess.Popen(["sh", "-c", 'setsid sh -c "$1" </dev/null >/dev/null 2>&1 &', "sh", script],
                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).wait()
