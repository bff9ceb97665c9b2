"""Submission to Slurm: the cluster config becomes sbatch parameters, a submitit executor, a job.

- :func:`sbatch_parameters` is the single mapping from :class:`ClusterConfig` (+ scheduling class)
  to sbatch flags; the executor and ``xirang-sbatch`` both use it, so they cannot drift.
- Every job's batch script ends with a supervisor step (:mod:`xirang_hpc.batch.supervise`) that
  applies the requeue policy when the training step itself fails (a crashed rank, a dead node),
  which no in-job signal handler can do.
- :func:`submit` returns at once (fire-and-forget) unless ``train.wait``; :func:`wait_for` polls
  ``scontrol`` until the job has ended for good (requeues included).
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import os
import shlex
import sys
import time
from pathlib import Path
from typing import Any

import submitit

import xirang_hpc
from xirang_hpc.config.errors import ConfigError
from xirang_hpc.config.schema import ClusterConfig, RequeueConfig, XirangConfig
from xirang_hpc.config.validate import scheduling_class
from xirang_hpc.monitor import audit
from xirang_hpc.monitor.events import append_event, read_events
from xirang_hpc.slurm import accounting, container, control, states
from xirang_hpc.slurm.control import job_state  # noqa: F401 - the launcher's name for it
from xirang_hpc.slurm.request import SlurmRequest

JOB_FILE = "slurm_job.json"
RUN_DIR_MAP = "xirang_run_dirs.json"


def site_qos_names(timeout_s: float = 10.0) -> list[str] | None:
    """The QOS names the cluster's accounting defines (``sacctmgr show qos``); None when it does not answer
    (no sacctmgr, accounting_storage/none, slurmdbd down): then sbatch itself is the judge."""
    return accounting.qos_names(timeout_s=timeout_s)


def check_site_qos(c: ClusterConfig, priority: str, names: list[str] | None) -> None:
    """Refuse a QOS the cluster does not define, before submission, naming the ones it has.

    ``names`` is :func:`site_qos_names` (None: unknown, nothing checked). sbatch would refuse too,
    but only with "Invalid qos specification" and after the run directory was claimed.
    """
    qos = scheduling_class(c, priority)[1]
    if names is None or not qos or qos in names:
        return
    key = {"normal": "cluster.qos", "high": "cluster.high_qos", "exploratory": "cluster.scavenger_qos"}[priority]
    if priority != "normal" and qos == c.qos:
        key = "cluster.qos"
    raise ConfigError(key, qos, f"Slurm's accounting on this cluster defines the QOS {names} (sacctmgr show qos); "
                                f"choose one of them for train.priority={priority}, or ask the admin to "
                                f"`sacctmgr add qos {qos}`")


def sbatch_parameters(c: ClusterConfig, priority: str = "normal") -> dict[str, Any]:
    """submitit ``SlurmExecutor`` parameters for ``c`` (the job's :class:`SlurmRequest`)."""
    return SlurmRequest.from_cluster(c, priority).submitit_params()


def supervisor_lines(folder: Path) -> list[str]:
    """Batch-script lines after ``srun``: hand its exit code to the requeue supervisor."""
    cmd = [sys.executable, "-m", "xirang_hpc.batch.supervise", "--rc", "$XIRANG_SRUN_RC",
           "--map", str(folder / RUN_DIR_MAP)]
    # `trap '' TERM`: the supervisor requeues the job, which SIGTERMs all of it; the script and the
    # supervisor (which inherits the ignore) must outlive that for the post-requeue updates.
    line = " ".join(shlex.quote(a) if not a.startswith("$") else f'"{a}"' for a in cmd)
    return ["XIRANG_SRUN_RC=$?", "trap '' TERM", line, "exit $XIRANG_SRUN_RC"]


def injob_lines(folder: Path) -> list[str]:
    """Batch-script lines that hand the job to the in-job restart driver (its attempts, then the supervisor).

    They run after ``cluster.setup`` and end the script, so submitit's single ``srun`` never runs.
    """
    cmd = [sys.executable, "-m", "xirang_hpc.batch.injob", "--map", str(folder / RUN_DIR_MAP),
           "--folder", str(folder)]
    # `trap '' TERM`: the driver ends with the supervisor, which may requeue the job; the requeue SIGTERMs all
    # of it, and the script must outlive that (when the script ends, Slurm kills what is left of the job,
    # the supervisor's StartTime update included). The driver sets SIGTERM back to its default for itself.
    line = " ".join(shlex.quote(a) for a in cmd)
    # The guard: a driver that died before its decision (kill -9, the OOM killer) would end the script, and Slurm
    # would end the job under the ranks as if cancelled; the guard names it, has the ranks save, applies the policy.
    return ["# in-job restart: the driver runs every srun step (requeue.max_restarts_in_job)", "trap '' TERM",
            line, 'XIRANG_DRIVER_RC=$?', f'{line} --guard "$XIRANG_DRIVER_RC"', "exit $?"]


def environment_paths() -> list[str]:
    """This package's checkout and the Python environment it runs in (a virtualenv and its base interpreter)."""
    return list(dict.fromkeys([str(Path(xirang_hpc.__file__).resolve().parents[1]), sys.prefix, sys.base_prefix]))


def container_paths(cfg: XirangConfig | None = None) -> list[str]:
    """Host paths the ranks need inside a container: the runs root and data dir of ``cfg``, this package's
    checkout and its Python environment (the virtualenv and the interpreter it was made from)."""
    paths = environment_paths()
    if cfg is not None:
        root = Path(cfg.train.run_dir).parent if cfg.train.run_dir else Path(cfg.train.runs_root)
        paths = [str(root.expanduser().absolute()), str(Path(cfg.data.out_dir).expanduser().absolute()), *paths]
    return paths


def rank_start(c: ClusterConfig, paths: list[str], python: str = sys.executable) -> tuple[list[str], list[str]]:
    """(arguments of the rank ``srun`` step, the command that starts a rank's interpreter) on ``c``: the
    same for submitit's batch script, the in-job restart's steps and ``xirang-sbatch`` (slurm/container.py)."""
    wd = os.getcwd()
    return ([*c.srun_args, *container.srun_args(c, paths, wd)],
            container.rank_python(c, paths, wd, python))


def make_slurm_executor(c: ClusterConfig, folder: Path, priority: str = "normal",
                        requeue: RequeueConfig | None = None,
                        paths: list[str] | None = None) -> submitit.SlurmExecutor:
    """A submitit SlurmExecutor for ``c``; submitit's own timeout requeue is off (ours decides).

    With ``requeue.max_restarts_in_job`` the job is submitted ``--no-kill`` (a failed node leaves the
    allocation instead of ending the job) and the in-job restart driver runs its steps. ``paths``: what a
    container mounts (:func:`container_paths`).
    """
    check_site_qos(c, priority, site_qos_names())
    srun, python = rank_start(c, paths if paths is not None else container_paths())
    ex = submitit.SlurmExecutor(folder=folder, max_num_timeout=0, python=" ".join(shlex.quote(a) for a in python))
    params = sbatch_parameters(c, priority)
    if srun:
        params["srun_args"] = srun
    if requeue is not None and requeue.max_restarts_in_job > 0:
        params["setup"] = [*params.get("setup", []), *injob_lines(Path(folder))]
        extra = {**params["additional_parameters"], "no_kill": True}
        if 0 < requeue.min_nodes < c.nodes:
            # A node range: a (re)queued job whose nodes are drained or down starts on what is left,
            # and the driver shrinks the layout to it. (submitit's own "nodes" stays the int it counts tasks with.)
            extra["nodes"] = f"{requeue.min_nodes}-{c.nodes + c.spare_nodes}"
        params["additional_parameters"] = extra
    ex.update_parameters(**params, teardown=supervisor_lines(Path(folder)))
    return ex


def min_alloc_nodes(cfg: XirangConfig) -> int:
    """The fewest nodes the job may be allocated: ``requeue.min_nodes`` when in-job restart may shrink to it.

    A floor the layout cannot shrink to is refused here, before submission, naming the counts it can.
    """
    r, c = cfg.requeue, cfg.cluster
    if not (r.max_restarts_in_job > 0 and 0 < r.min_nodes < c.nodes):
        return c.nodes
    from xirang_hpc.config.elastic import shrink_options

    options = shrink_options(dataclasses.replace(cfg, requeue=dataclasses.replace(r, min_nodes=0)))
    if r.min_nodes not in options:
        raise ConfigError("requeue.min_nodes", r.min_nodes,
                          f"the layout shrinks only to {options or 'no smaller'} node count(s) of cluster.nodes="
                          f"{c.nodes} (dp must shrink by a whole factor, tp*pp must fit); choose one of them, "
                          f"or 0 (no floor)")
    return r.min_nodes


def write_job_file(cfg: XirangConfig, run_dir: Path) -> None:
    """What the supervisor needs inside the job: the requeue policy and the signal delay."""
    from xirang_hpc.config.elastic import shrink_options

    srun, python = rank_start(cfg.cluster, container_paths(cfg))
    payload = {"requeue": dataclasses.asdict(cfg.requeue), "signal_delay_s": cfg.cluster.signal_delay_s,
               "nodes": cfg.cluster.nodes, "partition": scheduling_class(cfg.cluster, cfg.train.priority)[0],
               # For the in-job restart driver: how each step is placed, and the node counts a shrunk layout allows.
               "tasks_per_node": cfg.cluster.tasks_per_node, "spare_nodes": cfg.cluster.spare_nodes,
               "srun_args": srun, "python": python, "shrink_to": shrink_options(cfg), "mem_gb": cfg.cluster.mem_gb,
               "min_alloc_nodes": min_alloc_nodes(cfg),
               # Recovery from memory: the driver removes the job's node-local copies when the job ends.
               "in_memory": cfg.checkpoint.in_memory, "memory_dir": cfg.checkpoint.memory_dir}
    (run_dir / JOB_FILE).write_text(json.dumps(payload, indent=1))


def write_run_dir_map(folder: Path, run_dirs: list[Path], array: bool) -> None:
    """Array task id (or "" for a single job) -> run directory, read by the supervisor."""
    folder.mkdir(parents=True, exist_ok=True)
    mapping = {str(i): str(d) for i, d in enumerate(run_dirs)} if array else {"": str(run_dirs[0])}
    (folder / RUN_DIR_MAP).write_text(json.dumps(mapping, indent=1))


def final_status(run_dir: Path) -> dict[str, Any] | None:
    """The run's final ``exit`` event (``final: true``), if it has ended for good."""
    finals = [e for e in read_events(run_dir) if e.get("kind") == "exit" and e.get("final")]
    return finals[-1] if finals else None


class SubmissionError(RuntimeError):
    """sbatch refused or failed the submission; the message is its reason in one line and what to do."""


def submit_refusal(stderr: str) -> str:
    """One line for a failed ``sbatch``: its own error line, and what to do."""
    lines = [ln.strip() for ln in stderr.splitlines() if ln.strip()]
    said = next((ln for ln in lines if "error" in ln.lower()), lines[0] if lines else "no message")
    if control.controller_down(stderr):
        return (f"sbatch could not reach slurmctld: {said}; nothing was submitted. Try again when `squeue` "
                "answers (or ask the cluster's admins)")
    return f"sbatch refused the job: {said}; nothing was submitted"


def wait_for(job_id: str, poll_s: float = 2.0, timeout_s: float | None = None, cluster: str | None = None) -> str:
    """Block until ``job_id`` (on ``cluster``, ``-M``) has ended for good (a requeued job is followed through
    its reruns)."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    seen_terminal = 0
    while True:
        state = job_state(job_id, cluster)
        # Two consecutive terminal polls: a requeue in flight passes through brief states.
        seen_terminal = seen_terminal + 1 if states.has_ended(state) or state == states.UNKNOWN else 0
        if seen_terminal >= 2:
            return state
        if deadline is not None and time.monotonic() > deadline:
            raise TimeoutError(f"job {job_id} still {state} after {timeout_s:.0f}s")
        time.sleep(poll_s)


def submit(cfg: XirangConfig, run_dir: Path, data_dir: Path, fn: Any, *args: Any, site: str | None = None,
           handover: tuple[str, str | None] | None = None) -> submitit.Job:
    """Submit ``fn(*args)`` as one Slurm job for ``cfg``; log the submission in the run's event log.

    ``site``: the Slurm cluster to submit to (``sbatch -M``, chosen by submit/sites/); None: this one.
    ``handover``: ``(job id, cluster)`` of the job that submits its own successor (a run moving to another
    site from inside its job): that owner does not count as busy.

    The run directory must be free (one job per run directory, submit/runlock.py): a live job of it
    refuses the submission, or with ``train.after_active`` the new job waits for it (afterany).
    """
    from xirang_hpc.submit.runlock import claim, record_owner, submission_lock

    folder = run_dir / "submitit"
    with submission_lock(run_dir):
        after = claim(run_dir, "slurm", cfg.train.after_active, handover=handover)
        write_job_file(cfg, run_dir)
        write_run_dir_map(folder, [run_dir], array=False)
        ex = make_slurm_executor(cfg.cluster, folder, cfg.train.priority, cfg.requeue, container_paths(cfg))
        ex.update_parameters(job_name=f"xirang-{cfg.train.name}")
        extra = dict(ex.parameters.get("additional_parameters") or {})
        if after:
            extra["dependency"] = f"afterany:{after}"
        if site:
            extra["clusters"] = site
        ex.update_parameters(additional_parameters=extra)
        err = io.StringIO()
        try:
            with contextlib.redirect_stderr(err):  # submitit prints sbatch's stderr itself before raising
                job = ex.submit(fn, *args)
        except (submitit.core.utils.FailedJobError, submitit.core.utils.FailedSubmissionError) as exc:
            raise SubmissionError(submit_refusal(f"{exc}\n{err.getvalue()}")) from None
        record_owner(run_dir, "slurm", str(job.job_id), after=after, cluster=site)
    append_event(run_dir, "submit", "submitted", job=str(job.job_id), cluster=cfg.cluster.name,
                 nodes=cfg.cluster.nodes, tasks_per_node=cfg.cluster.tasks_per_node,
                 **({"after": after} if after else {}), **({"site": site} if site else {}))
    audit.record(run_dir, "launch", str(job.job_id), cluster=cfg.cluster.name, argv=sys.argv[1:],
                 **({"site": site} if site else {}))
    return job


def follow_hint(job: submitit.Job, run_dir: Path) -> str:
    """How to follow a submitted job."""
    return (f"follow it with: squeue -j {job.job_id}; tail -f {job.paths.stdout}; "
            f"events: {run_dir / 'events.jsonl'}")


def cancel(job_id: str, cluster: str | None = None) -> None:
    """``scancel`` (for interrupted --wait), on the job's cluster."""
    control.scancel(job_id, cluster)


def launch_slurm(cfg: XirangConfig, run_dir: Path, data_dir: Path, fn: Any, site: str | None = None,
                 on_submit: Any = None) -> dict[str, Any] | None:
    """``xirang-train`` on Slurm: submit, print job id / run dir / how to follow; block if ``train.wait``.

    ``site``: the Slurm cluster (``-M``) chosen by submit/sites/; ``on_submit(job)`` runs right after.
    """
    job = submit(cfg, run_dir, data_dir, fn, dataclasses.asdict(cfg), str(run_dir), str(data_dir), site=site)
    if on_submit is not None:
        on_submit(job)
    where = f"{cfg.cluster.name}, site {site}" if site else cfg.cluster.name
    print(f"submitted Slurm job {job.job_id} ({where}: {cfg.cluster.nodes} node(s) x "
          f"{cfg.cluster.tasks_per_node} ranks) | run dir {run_dir}", flush=True)
    print(follow_hint(job, run_dir), flush=True)
    if not cfg.train.wait:
        return None
    try:
        state = wait_for(str(job.job_id), cluster=site)  # -M: the job's id is only meaningful on its site
    except KeyboardInterrupt:
        cancel(str(job.job_id), site)
        raise
    final = final_status(run_dir)
    print(f"job {job.job_id} ended: Slurm state {state}; run status "
          f"{final['status'] if final else 'unknown'}", flush=True)
    return {"job_id": str(job.job_id), "state": state, "final": final}
