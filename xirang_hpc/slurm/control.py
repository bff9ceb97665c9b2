"""``scontrol`` from inside a job: requeue, hold, the job's own record (run through :mod:`.commands`).

Everything else here is parsing and decisions over plain data, so it is testable without Slurm:
- :func:`requeue_target` names what to requeue: ``ARRAYJOBID_TASKID`` for an array task
  (never the whole array), else the job id;
- :func:`classify_stop` tells a time limit from a preemption from Slurm's own data
  (``PreemptTime``, ``TimeLimit``, ``RunTime`` of ``scontrol show job``), not a wall-clock guess.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from xirang_hpc.slurm import states
from xirang_hpc.slurm.commands import Result, call

_NODE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


class SlurmCommandError(RuntimeError):
    """``scontrol`` is missing or failed; the message says which and what to do."""


# What Slurm's clients print when slurmctld does not answer (killed: connect failure; stopped or overloaded:
# timeouts), as seen from scontrol, srun and sbatch of Slurm 22.05.
CONTROLLER_DOWN = ("Unable to contact slurm controller", "Socket timed out on send/recv",
                   "Zero Bytes were transmitted or received", "Communication connection failure",
                   "Unable to confirm allocation")


def controller_down(text: str) -> bool:
    """Whether a Slurm client's message says that slurmctld did not answer (not that it said no)."""
    return any(m in text for m in CONTROLLER_DOWN)


def run_scontrol(args: list[str], timeout_s: float = 30.0, run: Callable[..., Result] = call) -> str:
    """Run ``scontrol ARGS`` and return its stdout; :class:`SlurmCommandError` says what went wrong."""
    r = run(["scontrol", *args], timeout_s=timeout_s)
    if r.rc == 127:
        raise SlurmCommandError(
            "scontrol not found on PATH of this compute node/container: cannot requeue. "
            "Install the Slurm client in the job's environment (or bind-mount it into the container), "
            "or set requeue.enabled=false"
        )
    if r.rc == 124:
        raise SlurmCommandError(f"scontrol {' '.join(args)} timed out after {timeout_s:.0f}s")
    if r.rc != 0:
        raise SlurmCommandError(f"scontrol {' '.join(args)} failed (exit {r.rc}): {r.err.strip()}")
    return r.out


def requeue_target(env: Mapping[str, str] | None = None) -> str:
    """The id to requeue: ``<array job>_<task>`` for an array task, else ``SLURM_JOB_ID``."""
    env = os.environ if env is None else env
    if "SLURM_ARRAY_JOB_ID" in env and "SLURM_ARRAY_TASK_ID" in env:
        return f"{env['SLURM_ARRAY_JOB_ID']}_{env['SLURM_ARRAY_TASK_ID']}"
    if "SLURM_JOB_ID" not in env:
        raise SlurmCommandError("not inside a Slurm job (SLURM_JOB_ID is unset): nothing to requeue")
    return env["SLURM_JOB_ID"]


def restart_count(env: Mapping[str, str] | None = None) -> int:
    """How often Slurm has requeued this job before this start: ``SLURM_RESTART_COUNT`` (0 when unset)."""
    env = os.environ if env is None else env
    return int(env.get("SLURM_RESTART_COUNT", "0") or 0)


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


def job_info(job_id: str, cluster: str | None = None) -> dict[str, str]:
    """Slurm's record of ``job_id`` (``scontrol show job -o``); on ``cluster`` (``-M``) when given.

    Several clusters number their jobs independently: a job of another cluster than the default
    one (``SLURM_CONF``) is unknown there, or worse, another job with the same id.
    """
    return parse_job(run_scontrol([*cluster_args(cluster), "show", "job", "-o", job_id]))


def job_state(job_id: str, cluster: str | None = None) -> str:
    """Slurm's ``JobState`` of ``job_id`` on ``cluster`` (None: the default one; ``UNKNOWN`` once Slurm
    has forgotten the job; ``NO_ANSWER`` when slurmctld does not answer)."""
    try:
        return job_info(job_id, cluster).get("JobState", states.UNKNOWN)
    except SlurmCommandError as exc:
        return states.NO_ANSWER if controller_down(str(exc)) or "timed out" in str(exc) else states.UNKNOWN


def cluster_args(cluster: str | None) -> list[str]:
    """``["-M", cluster]`` for a job on a named Slurm cluster, ``[]`` for the default one."""
    return ["-M", cluster] if cluster else []


def hostnames(expr: str, run: Callable[..., Result] | None = None) -> list[str]:
    """A Slurm hostlist expression (``n[1-3],gpu07``) -> node names; ``(null)``/``None``/``N/A``/empty -> [].

    :class:`SlurmCommandError` when scontrol cannot expand it."""
    if not expr or expr in ("(null)", "None", "N/A"):
        return []
    args = ["show", "hostnames", expr]
    return (run_scontrol(args) if run is None else run_scontrol(args, run=run)).split()


def scancel(job_id: str, cluster: str | None = None, signal: str | None = None, run: Callable[..., Result] = call,
            timeout_s: float = 60.0) -> Result:
    """``scancel [-M cluster] [--signal=SIG] JOB`` (a job, an array task or a step ``JOB.STEP``); what it did."""
    sig = [f"--signal={signal}"] if signal else []
    return run(["scancel", *cluster_args(cluster), *sig, job_id], timeout_s=timeout_s)


def srun_on(nodes: Sequence[str], argv: list[str], run: Callable[..., Result] = call,
            timeout_s: float = 60.0) -> Result:
    """One task of ``argv`` on each of ``nodes`` as a step of this job, beside the running ones (``--overlap``,
    ``--mem=0``: it takes none of the memory the ranks hold, which Slurm's memory enforcement would refuse)."""
    return run(["srun", "--overlap", "--mem=0", f"--nodes={len(nodes)}", "--ntasks-per-node=1",
                f"--nodelist={','.join(nodes)}", *argv], timeout_s=timeout_s)


def requeue(job_id: str, restarts: int | None = None,
            info: Callable[[str], dict[str, str]] | None = None) -> bool:
    """``scontrol requeue JOB_ID``; Slurm then ends every task of the job. True when this call requeued it.

    With ``restarts`` (this start's ``SLURM_RESTART_COUNT``): False when Slurm had requeued the job already.
    A preemption's grace time can end while the job still decides (its ranks killed for a hang, its batch
    script choosing what to do): Slurm's own ``PreemptMode=REQUEUE`` then brings the job back by itself, and
    refuses a second requeue ("Job is pending execution"). A job whose ``Restarts`` passed ``restarts`` is
    requeued, whoever did it; any other refusal raises :class:`SlurmCommandError`.
    """
    try:
        run_scontrol(["requeue", job_id])
        return True
    except SlurmCommandError:
        if restarts is None:
            raise
        try:
            now = int((info or job_info)(job_id).get("Restarts", ""))
        except (SlurmCommandError, ValueError):
            now = -1
        if now > restarts:
            return False
        raise


def no_requeue(job_id: str) -> None:
    """``scontrol update JobId=JOB_ID Requeue=0``: Slurm's own preemption requeue (PreemptMode=REQUEUE, for a
    job still running when the grace time ends) then ends the job instead of bringing it back."""
    run_scontrol(["update", f"jobid={job_id}", "Requeue=0"])




def batch_gone(state: str, exit_code: str) -> bool:
    """Whether a SIGTERM to the ranks comes from their batch script's end, not from a cancel.

    The job reads FAILED or COMPLETED; or COMPLETING with the batch script killed by a signal (``ExitCode``
    ``0:9``). A cancel reads CANCELLED, or COMPLETING with no signal in the exit code: the batch script ignores
    SIGTERM (``trap '' TERM``), so when the ranks get theirs it is still alive, or has exited by itself.
    """
    base = states.base(state)
    if base in states.BATCH_GONE:
        return True
    _, _, sig = exit_code.partition(":")
    return base == "COMPLETING" and sig.isdigit() and int(sig) != 0


@dataclass(frozen=True)
class StopCause:
    """Why the job was told to stop, and the Slurm data the verdict rests on."""

    reason: str  # preemption | timeout | terminated | infra_failure
    detail: str


def classify_stop(info: Mapping[str, str], signal_name: str, signal_delay_s: float, slack_s: float = 60.0) -> StopCause:
    """Tell preemption from a time limit using Slurm's job record.

    - ``PreemptTime`` set: Slurm preempted the job (either signal) -> ``preemption``.
    - ``TimeLimit - RunTime <= signal_delay_s + slack_s``: the time-limit warning (``--signal=USR2@delay``
      fires ``delay`` seconds before the limit; Slurm's timer may fire late, never early) -> ``timeout``.
    - SIGTERM while the job reads FAILED/COMPLETED, or COMPLETING with the batch script killed by a signal (its
      batch script ended under the ranks: :func:`batch_gone`) -> ``infra_failure``;
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
    state = info.get("JobState", "")
    if signal_name == "SIGTERM" and batch_gone(state, info.get("ExitCode", "")):
        # Not a cancel: the job ended under its ranks because its batch script ended, killed or crashed (e.g.
        # kill -9 of it on the head node); Slurm then signals what is left of the job.
        return StopCause("infra_failure", f"the batch step is gone (JobState={state}, ExitCode={info.get('ExitCode')}):"
                                          " the batch script ended under the running ranks")
    if signal_name == "SIGTERM":
        return StopCause("terminated", f"SIGTERM with RunTime={info.get('RunTime')} TimeLimit={info.get('TimeLimit')}")
    return StopCause("preemption", f"{signal_name} before the time limit (RunTime={info.get('RunTime')} "
                                   f"TimeLimit={info.get('TimeLimit')})")


# Seconds ahead that ``StartTime`` is set after a requeue: Slurm keeps a begin time that is still in the
# future when the requeued job has left its nodes, and replaces one in the past by its own hold
# (now + the credential lifetime, ~2 min). Waiting a few seconds too long costs those seconds; missing the
# margin costs two minutes. A site with a long epilog raises both (``XIRANG_REQUEUE_START_MARGIN_S``).
# From the supervisor, after every rank has exited: the job leaves within a second (0.1 s on the testbed).
START_MARGIN_S = 5
# From rank 0 (a preemption or a time limit, requeued at once so that the grace time or the limit cannot
# end the job first): the job has left only when its last rank has, and the requeue ends srun under them.
# Measured on the testbed (Slurm 22.05, proctrack/cgroup, 2 nodes x 2 ranks on 2 cores): 7-17 s after the
# update, so 5 s met the two-minute hold there.
RANKS_LEAVING_MARGIN_S = 20


def start_margin_s(env: Mapping[str, str] | None = None, ranks_leaving: bool = False) -> int:
    """The begin-time margin: ``XIRANG_REQUEUE_START_MARGIN_S`` (whole seconds >= 1), else
    :data:`RANKS_LEAVING_MARGIN_S` when the job's ranks are still leaving, else :data:`START_MARGIN_S`."""
    env = os.environ if env is None else env
    raw = env.get("XIRANG_REQUEUE_START_MARGIN_S", "")
    if not raw:
        return RANKS_LEAVING_MARGIN_S if ranks_leaving else START_MARGIN_S
    if not raw.isdigit() or int(raw) < 1:
        raise SlurmCommandError(f"XIRANG_REQUEUE_START_MARGIN_S={raw!r}: use whole seconds >= 1 (defaults: "
                                f"{START_MARGIN_S} from the supervisor, {RANKS_LEAVING_MARGIN_S} from rank 0), "
                                f"longer than the site's epilog")
    return int(raw)


def floor_tasks(min_nodes: int, alloc_nodes: int, tasks_per_node: int) -> int | None:
    """``NumTasks`` a requeued job must ask for to start on as few as ``min_nodes`` nodes, or None.

    A requeued job keeps the task count of its first allocation (``NumTasks=alloc_nodes x
    tasks_per_node``), which with ``--ntasks-per-node`` as a per-node maximum pins it to that many
    nodes: with one of them drained it pends forever (``ReqNodeNotAvail``) despite its node range.
    Lowered to the floor's count, Slurm still gives it every node of the range that is up (and
    counts ``NumTasks`` again from them), else starts it on what is left (Slurm 22.05, checked).
    """
    return min_nodes * tasks_per_node if 0 < min_nodes < alloc_nodes else None


def after_requeue(job_id: str, delay_s: int = 0, exclude: Sequence[str] = (), start: bool = True,
                  tasks: int | None = None, margin_s: int | None = None, retry_s: float = 5.0,
                  run: Callable[[list[str]], str] | None = None,
                  sleep: Callable[[float], None] = time.sleep) -> list[str]:
    """Right after ``scontrol requeue`` (from inside the job): exclude failed nodes and shorten the restart hold;
    with ``tasks`` (:func:`floor_tasks`) let the job start on fewer nodes than its first allocation.

    Works under ``proctrack/cgroup`` because nothing has to outlive the job: ``requeue`` makes the
    job PENDING (shown as COMPLETING while its processes end), and Slurm accepts both ``ExcNodeList``
    and ``StartTime`` on a pending job at once; they survive the requeue. ``StartTime`` is set
    ``max(delay_s, margin)`` seconds ahead: Slurm keeps a future begin time when the job has left
    its nodes and replaces a past one with its ~2 min hold (checked on Slurm 22.05 under cgroup
    tracking: restarted 6 s after the requeue, on the other node). The caller must survive the
    SIGTERM that the requeue sends to the whole job (the batch script ignores it around the
    supervisor; a rank is inside its stop handler). Returns the ``scontrol update`` lines applied;
    an update still refused after ``retry_s`` raises :class:`SlurmCommandError`.
    """
    for node in exclude:  # node names come from our own events: refuse anything but a Slurm hostname
        if not _NODE_NAME.fullmatch(node):
            raise SlurmCommandError(f"refusing to exclude node {node!r}: not a Slurm node name")
    run = run_scontrol if run is None else run
    updates: list[list[str]] = []
    if tasks:  # first: the job must not start before it may start shrunk (floor_tasks)
        updates.append(["update", f"jobid={job_id}", f"NumTasks={int(tasks)}"])
    if exclude:
        updates.append(["update", f"jobid={job_id}", f"ExcNodeList={','.join(exclude)}"])
    if start:
        ahead = max(int(delay_s), start_margin_s() if margin_s is None else margin_s)
        updates.append(["update", f"jobid={job_id}", f"StartTime=now+{ahead}"])
    done: list[str] = []
    for args in updates:
        waited = 0.0
        while True:
            try:
                run(args)
                break
            except SlurmCommandError as exc:
                # "Job is no longer pending execution": the requeue has not reached slurmctld yet.
                if "pending" not in str(exc).lower() or waited >= retry_s:
                    raise
                sleep(0.2)
                waited += 0.2
        done.append(" ".join(args))
    return done
