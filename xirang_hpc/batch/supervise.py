"""``python -m xirang_hpc.batch.supervise``: the requeue policy after the training step ends.

Runs in the batch script after ``srun`` (see :func:`xirang_hpc.submit.slurm.supervisor_lines`).
A stop signal is handled inside the job (:mod:`xirang_hpc.runtime.signals`); this covers what the
job cannot handle itself: a rank killed (``kill -9``, OOM killer, a node gone) or a non-zero exit.
It names the failed ranks and nodes from the per-rank start/exit markers the job leaves in
``<run dir>/ranks/r<restart>/`` (a rank that started and never exited died without Python
unwinding), adds the monitor's fault events, applies the policy and requeues (``scontrol``).
A run on several sites (``cluster.sites``) that was preempted is first placed again: when another
site starts it sooner than its requeue here (submit/sites/), it is resubmitted there and this job
cancels itself instead of being requeued.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import re
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

from xirang_hpc.config.schema import RequeueConfig
from xirang_hpc.monitor import audit
from xirang_hpc.monitor.events import append_event, failed_nodes, read_events, storage_failure
from xirang_hpc.runtime.markers import missing_ranks
from xirang_hpc.runtime.policy import History, decide
from xirang_hpc.slurm import control
from xirang_hpc.slurm.commands import call
from xirang_hpc.slurm.jobs import oom_step_nodes


def run_dir_for_task(map_file: Path, env: dict[str, str]) -> Path:
    """This array task's (or this job's) run directory."""
    mapping = json.loads(map_file.read_text())
    return Path(mapping[env.get("SLURM_ARRAY_TASK_ID", "")] if "" not in mapping else mapping[""])


def _since_arrival(run_dir: Path) -> list[dict]:
    """The run's events since it arrived on this site (after its last ``migrate``): a run that moved
    carries the old site's events, whose job ids and restart counts mean nothing here."""
    events = read_events(run_dir)
    last = max((i for i, e in enumerate(events) if e.get("kind") == "migrate"), default=-1)
    return events[last + 1:]


def already_handled(run_dir: Path, restart: int) -> bool:
    """The job itself logged an exit (completed, requeued or final) for this restart."""
    return any(e.get("kind") == "exit" and e.get("restart") == restart for e in _since_arrival(run_dir))


def handed_over(run_dir: Path, restart: int) -> dict | None:
    """The ``handover`` event of ``restart``: the job's stop handler saved and left the preemption to this
    supervisor (to requeue once the ranks are gone; a run on several sites may move instead). None if not."""
    return next((e for e in reversed(_since_arrival(run_dir))
                 if e.get("kind") == "handover" and e.get("restart") == restart), None)


def cancel_self(job_id: str, cluster: str | None) -> None:
    """``scancel [-M cluster] JOB``: the job that moved its run to another site ends here, not requeued
    (also if Slurm's own preemption requeue got there first)."""
    control.scancel(job_id, cluster)


def try_migrate(run_dir: Path, job_id: str, env: dict[str, str]) -> dict | None:
    """A run placed on several sites and preempted here: move it to the site that starts it soonest
    (submit/sites/). None when it stays, or when the move failed before anything was submitted
    (logged as ``migrate_failed``): then it is requeued here as usual."""
    from xirang_hpc.config.errors import ConfigError
    from xirang_hpc.submit import sites

    if sites.read_site_state(run_dir) is None:
        return None
    # The copy and the submission need torch (checkpoint checksums, the job function): import it in the
    # background while the placement waits on Slurm, so the move fits the preemption's grace time.
    threading.Thread(target=importlib.import_module, args=("xirang_hpc.job.training",), daemon=True).start()
    current = env.get("SLURM_CLUSTER_NAME") or sites.read_site_state(run_dir)["site"]
    pinned: list[bool] = []

    def no_requeue() -> None:
        # From here on this job must not come back on `current` beside the moved run: Slurm's preemption
        # (PreemptMode=REQUEUE) requeues a job that is still running at the end of the grace time, but only a
        # requeueable one; a job with Requeue=0 ends PREEMPTED instead (checked on the testbed, Slurm 22.05).
        control.run_scontrol(["update", f"jobid={job_id}", "Requeue=0"])
        pinned.append(True)

    try:
        nodes = hostnames(env.get("SLURM_JOB_NODELIST", ""))
        return sites.migrate_at_preemption(run_dir, job_id, current, nodes, before_submit=no_requeue)
    except (ConfigError, sites.CopyError, control.SlurmCommandError, OSError, RuntimeError) as exc:
        if pinned:  # the move failed after all: requeueable again, for the requeue that follows
            with contextlib.suppress(control.SlurmCommandError):
                control.run_scontrol(["update", f"jobid={job_id}", "Requeue=1"])
        append_event(run_dir, "migrate_failed", type(exc).__name__, error=str(exc), job=job_id, site=current)
        print(f"xirang: moving the run to another site failed, requeued here: {exc}", file=sys.stderr, flush=True)
        return None


# Node states in which Slurm will not start a job there (``scontrol show node``'s State, e.g. IDLE+DRAIN).
_UNUSABLE = ("DOWN", "DRAIN", "FAIL", "NOT_RESPONDING", "POWERED_DOWN", "FUTURE")


hostnames = control.hostnames


def usable_nodes(partition: str | None) -> list[str]:
    """Nodes of ``partition`` (the default one if None) in a state where a job can start."""
    info = control.parse_job(control.run_scontrol(["show", "partition", "-o", *([partition] if partition else [])]))
    names = hostnames(info.get("Nodes", ""))
    if not names:
        return []
    out = []
    for line in control.run_scontrol(["show", "node", "-o", info["Nodes"]]).splitlines():
        node = control.parse_job(line)
        if node.get("NodeName") in names and not any(bad in node.get("State", "") for bad in _UNUSABLE):
            out.append(node["NodeName"])
    return out


def exclusion(job_id: str, failed: list[str], nodes_needed: int, partition: str | None) -> list[str]:
    """The job's new ExcNodeList: earlier exclusions plus ``failed``, or [] if the job could then not run.

    Excluding a node must never leave a requeued job pending forever: the usable nodes of the
    partition (not down/drained) that are not excluded must still hold ``nodes_needed``. Any
    ``scontrol`` failure means no exclusion (the requeue itself still happens).
    """
    try:
        earlier = hostnames(control.job_info(job_id).get("ExcNodeList", ""))
        wanted = sorted(set(earlier) | set(failed))
        left = [n for n in usable_nodes(partition) if n not in wanted]
    except control.SlurmCommandError:
        return []
    return wanted if len(left) >= nodes_needed else []


def preempt_time(job_id: str) -> str | None:
    """Slurm's ``PreemptTime`` of the job when it was preempted, else None (also when scontrol fails)."""
    try:
        value = control.job_info(job_id).get("PreemptTime", "None")
    except control.SlurmCommandError:
        return None
    return None if value in ("None", "N/A", "Unknown", "") else value


# srun and slurmstepd on an OOM kill in a step's cgroup (Slurm 22.05):
#   srun: error: n1: task 0: Out Of Memory
#   slurmstepd-n1: error: Detected 1 oom-kill event(s) in StepId=7.0. Some of your processes may have been killed ...
_OOM_LINES = (re.compile(r"^srun: error: (\S+): tasks? [\d,\-]+: Out Of Memory", re.M),
              re.compile(r"^slurmstepd-(\S+): error: Detected \d+ oom-kill event", re.M))


def oom_nodes_in(text: str) -> list[str]:
    """The nodes that srun's or slurmstepd's messages in ``text`` say ran out of memory."""
    return sorted({m.group(1) for rx in _OOM_LINES for m in rx.finditer(text)})


def oom_nodes(job_id: str, run: Any = call, tries: int = 3, wait_s: float = 1.0) -> list[str]:
    """The nodes of the job's steps that Slurm's accounting records as ``OUT_OF_MEMORY`` (the cgroup's oom-kill
    count, as slurmstepd reported it); [] without accounting. Asked a few times: the record may lag the step."""
    for i in range(tries):
        lists = oom_step_nodes(job_id, run)
        if lists is None:
            return []
        nodes = [n for nl in lists for n in (hostnames(nl, run) if "[" in nl else nl.split(","))]
        if nodes:
            return sorted(set(nodes))
        if i + 1 < tries:
            time.sleep(wait_s)
    return []


def oom_detail(nodes: list[str], job: dict[str, Any]) -> str:
    """An OOM in words: where, the limit, and the ways to fit (none of them is another node)."""
    mem = float(job.get("mem_gb") or 0)
    limit = (f"cluster.mem_gb={mem:g} GB per node (Slurm --mem)" if mem
             else "the node's default share (cluster.mem_gb not set: Slurm's DefMemPerCPU or the node's memory)")
    return (f"out of memory on {', '.join(nodes)}: the ranks exceeded {limit}. Fit it by raising train.grad_accum "
            "(smaller micro-batches, same global batch), parallel.recompute=selective or full, more nodes "
            "(cluster.nodes), or a higher cluster.mem_gb; the node is not at fault and is not excluded")


def supervise(rc: int, run_dir: Path, env: dict[str, str], cause: str | None = None, detail: str = "") -> int:
    """Apply the policy after a step that exited with ``rc``; returns the batch script's exit code.

    ``cause`` (a reason of runtime/policy.py, e.g. ``infra_failure``) is the cause when the caller knows it
    (the in-job driver's guard): then no node is blamed or excluded.
    """
    restart = control.restart_count(env)
    if already_handled(run_dir, restart):
        return rc
    job = json.loads((run_dir / "slurm_job.json").read_text())
    policy = RequeueConfig(**job["requeue"])
    job_id = control.requeue_target(env)
    if rc == 0:
        append_event(run_dir, "exit", "completed", final=True, status="completed", job=job_id, restart=restart)
        return 0
    lost = missing_ranks(run_dir, restart)
    handover = handed_over(run_dir, restart)
    storage: dict | None = None
    preempted = preempt_time(job_id)
    if handover:  # the stop handler saved and logged the preemption; the decision on the site is ours
        nodes: list[str] = []
        reason = "preemption"
    elif preempted:
        # Preempted where the job's own stop handler could not act (ranks still starting, in the
        # rendezvous or a checkpoint load: Slurm's signal ended them): Slurm's record says so, and
        # a preemption is requeued by its policy, not treated as a crash (no node is blamed).
        nodes = []
        reason = "preemption"
        append_event(run_dir, "stop", reason, detail=f"PreemptTime={preempted}", handled_by="supervisor",
                     job=job_id, restart=restart, srun_rc=rc, ranks_without_exit=[r for r, _ in lost])
    elif cause is not None:
        nodes, reason = [], cause
        append_event(run_dir, "failure", reason, detail=detail, job=job_id, restart=restart, srun_rc=rc,
                     ranks=[r for r, _ in lost], nodes=[], node=env.get("SLURMD_NODENAME"))
    else:
        starts = [e["time"] for e in read_events(run_dir) if e.get("kind") == "start" and e.get("restart") == restart]
        since = starts[-1] if starts else 0.0
        storage = storage_failure(run_dir, since=since)
        if storage is not None:
            # A save failed on the checkpoint storage (full disk, quota, read-only): no node is to blame, even
            # when the watchdog calls the first rank that left "dead" or ranks died in the aftermath.
            nodes = []
            reason = "save_failed"
            append_event(run_dir, "failure", reason, job=job_id, restart=restart, srun_rc=rc,
                         ranks=[r for r, _ in lost], nodes=[], node=None, cause=storage.get("cause"),
                         errno_name=storage.get("errno_name"), file=storage.get("file"),
                         free_bytes=storage.get("free_bytes"), needed_bytes=storage.get("needed_bytes"),
                         error=storage.get("error"))
        else:
            # The monitor's watchdog names the culprit (dead/hung rank) precisely; ranks killed in the
            # aftermath also lack exit markers, so the markers are the fallback when it did not run.
            nodes = failed_nodes(run_dir, since=since) or sorted({n for _, n in lost})
            reason = "node_failure" if lost else "nonzero_exit"
            oom = oom_nodes(env.get("SLURM_JOB_ID", job_id)) if env.get("SLURM_JOB_ID") else []
            if oom:  # the cgroup killed ranks for memory: a limit the job exceeded, not a bad node
                reason, nodes, detail = "oom", [], oom_detail(oom, job)
            append_event(run_dir, "failure", reason, job=job_id, restart=restart, srun_rc=rc,
                         ranks=[r for r, _ in lost], nodes=oom or nodes, node=(oom or nodes or [None])[0],
                         **({"detail": detail} if detail else {}))
    verdict = decide(reason, restart, policy, History.of(read_events(run_dir), time.time()))
    if not verdict.requeue:
        why = verdict.why
        if reason == "save_failed" and storage is not None:
            why = f"{storage.get('error') or storage.get('cause')}; {why}"
        elif detail:
            why = f"{detail}; {why}"
        append_event(run_dir, "exit", reason, final=True, status=verdict.final_status, why=why,
                     job=job_id, restart=restart)
        print(f"xirang: not requeued: {why}", file=sys.stderr, flush=True)
        return rc
    if reason == "preemption":
        # Several sites: the job itself resubmits the run where it starts soonest instead of requeuing it
        # here (nothing may outlive the job, so the move happens now, before the batch script ends).
        moved = try_migrate(run_dir, job_id, env)
        if moved is not None:
            append_event(run_dir, "exit", "migrated", final=False, status="migrated", job=job_id, restart=restart,
                         to=moved["to"], new_job=moved["job"], dst=moved["dst"])
            print(f"xirang: run moved to site {moved['to']} (job {moved['job']}, {moved['dst']}); this job ends",
                  file=sys.stderr, flush=True)
            cancel_self(job_id, env.get("SLURM_CLUSTER_NAME"))
            return rc
    excluded: list[str] = []
    if policy.exclude_failed_nodes and nodes:
        # A job that may start shrunk (sbatch --nodes=min-max) still runs on its fewest nodes.
        excluded = exclusion(job_id, nodes, int(job.get("min_alloc_nodes") or job["nodes"]), job.get("partition"))
    # Record the decision before acting: `scontrol requeue` makes Slurm end this batch script, and
    # anything after it may never run (the events would then miss the requeue).
    # The step the ranks saved and stopped at, when they handed the preemption over.
    at = {"step": handover["step"]} if handover and isinstance(handover.get("step"), int) else {}
    # A job that may start shrunk asks for its floor's task count (a requeued job keeps its first one).
    alloc = int(job["nodes"]) + int(job.get("spare_nodes", 0))
    tasks = control.floor_tasks(int(job.get("min_alloc_nodes") or job["nodes"]), alloc,
                                 int(job.get("tasks_per_node", 1)))
    append_event(run_dir, "requeue", reason, why=verdict.why, job=job_id, target=job_id, restart=restart,
                 excluded=excluded, nodes=nodes, num_tasks=tasks, **at)
    append_event(run_dir, "exit", "requeued", final=False, status="requeued", job=job_id, restart=restart)
    audit.record(run_dir, "requeue", job_id, why=verdict.why, restart=restart)
    # `scontrol requeue` sends SIGTERM to every process of the job; this one must live on for the
    # updates below (the batch script ignores SIGTERM around it for the same reason).
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        if not control.requeue(job_id, restarts=restart):
            append_event(run_dir, "requeue_update", reason, job=job_id, restart=restart, applied=[], by="slurm",
                         why="Slurm had requeued the job already (a preemption's grace time ended meanwhile)")
        start = bool(verdict.start_now or verdict.backoff_s)
        if start or excluded or tasks:
            applied = control.after_requeue(job_id, verdict.backoff_s, exclude=excluded, start=start, tasks=tasks)
            append_event(run_dir, "requeue_update", reason, job=job_id, restart=restart, applied=applied)
    except control.SlurmCommandError as exc:
        append_event(run_dir, "exit", "requeue_failed", final=True, status="requeue_failed", error=str(exc),
                     job=job_id, restart=restart)
        print(f"xirang: error: {exc}", file=sys.stderr, flush=True)
        return rc
    return rc


def main(argv: list[str] | None = None) -> None:
    """Entry point for the batch script."""
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rc", type=int, required=True, help="exit code of srun")
    ap.add_argument("--map", type=Path, required=True, help="task id -> run dir JSON")
    a = ap.parse_args(argv)
    env = dict(os.environ)
    sys.exit(supervise(a.rc, run_dir_for_task(a.map, env), env))


if __name__ == "__main__":
    main()
