"""``python -m xirang_hpc.batch.injob``: in-job restart, a restart loop in the batch step.

With ``requeue.max_restarts_in_job > 0`` the batch script runs this module instead of a single
``srun`` (see :func:`xirang_hpc.submit.slurm.injob_lines`). Each attempt is one ``srun`` step on
chosen nodes of the allocation. When a rank dies (``kill -9``, OOM, a lost node) or hangs, the
monitor's watchdog names it and aborts the ranks; the step ends (or, when a lost node's part of the
step never reports back, the driver ends it a few seconds after the abort or the dead rank). The driver then
excludes the named node and starts a new step -- a new rendezvous, the newest checkpoint -- on
``cluster.nodes`` healthy nodes when the allocation still has them (``cluster.spare_nodes``:
same layout, bitwise the same training), else on fewer nodes with the layout shrunk
(:mod:`xirang_hpc.config.elastic`: same global batch through more gradient accumulation), down
to ``requeue.min_nodes``. The job is submitted ``--no-kill``, so Slurm keeps the allocation when a
node of it fails. Every restart is an ``events.jsonl`` event with the cause and the node.

Only when a restart is impossible (no culprit node named: a plain non-zero exit; too few healthy
nodes; ``max_restarts_in_job`` reached) does the requeue supervisor
(:func:`xirang_hpc.batch.supervise.supervise`) take over, as after a single ``srun``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from xirang_hpc.batch.supervise import (
    already_handled,
    handed_over,
    hostnames,
    oom_detail,
    oom_nodes,
    oom_nodes_in,
    preempt_time,
    run_dir_for_task,
    supervise,
)
from xirang_hpc.checkpoint.naming import memory_root
from xirang_hpc.monitor.events import EventTail, append_event, failed_nodes, read_events, storage_failure
from xirang_hpc.runtime.markers import missing_ranks, write_stop_cause
from xirang_hpc.slurm import control, states
from xirang_hpc.slurm.commands import Result, call
from xirang_hpc.slurm.jobs import live_steps

# After the watchdog named a dead rank or aborted the ranks, how long the step may take to end by itself
# before the driver ends it (a lost node's part never reports its exit to srun).
ABORT_GRACE_S = 5.0
# The events after which this attempt is over: the watchdog's abort, or a rank it found dead (when the
# survivors fail on their own first, e.g. gloo's "connection reset" after a node loss, no abort follows,
# and srun would wait for the lost node's tasks until slurmctld marks the node down, minutes later).
ENDING_EVENTS = ("abort", "dead")
# How long srun may take to end after SIGTERM before SIGKILL. It forwards the SIGTERM to the step's tasks,
# then waits for every task to report its end, which a lost node's never do (on the testbed it always ran
# into the 10 s this used to be); waiting longer only delays the restart.
SRUN_TERM_S = 2.0
# A step whose srun ends before any task started (slurmctld does not answer: "Unable to confirm allocation";
# a step that cannot be created) is launched again after 2, 4, 8 ... 60 s, for this long in all; then the policy
# decides, as for any infrastructure failure. slurmctld fail-over takes SlurmctldTimeout (120 s by default).
LAUNCH_RETRY_S = 600.0
LAUNCH_BACKOFF_MAX_S = 60.0
# srun's words for a step it could not create (besides the controller not answering: control.CONTROLLER_DOWN).
STEP_NOT_CREATED = ("Unable to create step", "step creation temporarily disabled", "Unable to confirm allocation")
# What srun says when Slurm refuses the step itself: the request cannot be met on any node of the allocation,
# now or later (Slurm 22.05's slurm_strerror texts). Retrying, or a requeue, would be refused the same way.
STEP_REFUSED = ("Requested node configuration is not available", "Invalid generic resource",
                "More processors requested than permitted", "Invalid node name specified",
                "Requested partition configuration not available", "Invalid account", "Invalid qos",
                "Invalid job credential")
NODES_ENV = "XIRANG_NODES"  # read by xirang_hpc.config.elastic inside the job
ATTEMPT_ENV = "XIRANG_INJOB_ATTEMPT"  # read by xirang_hpc.runtime.topology (a fresh rendezvous port)


@dataclass(frozen=True)
class Plan:
    """Where the next attempt runs."""

    nodes: list[str]
    shrunk: bool


def choose_nodes(healthy: list[str], wanted: int, shrink_to: list[int]) -> Plan | None:
    """``wanted`` healthy nodes (same layout), else the most the shrunk layouts allow, else None."""
    if len(healthy) >= wanted:
        return Plan(healthy[:wanted], shrunk=False)
    fits = [k for k in shrink_to if k <= len(healthy)]
    return Plan(healthy[:max(fits)], shrunk=True) if fits else None


def srun_command(job: Mapping[str, Any], folder: Path, nodes: list[str], attempt: int, python: str,
                 env: Mapping[str, str]) -> list[str]:
    """The ``srun`` of one attempt: submitit's own step command, placed on ``nodes``; a rank starts as the job
    file says (``python``: in a container, through its runtime; see slurm/container.py), else with ``python``."""
    out, err = str(folder / "%j_%t_log.out"), str(folder / "%j_%t_log.err")
    if "SLURM_ARRAY_TASK_ID" in env:
        out, err = out.replace("%j", "%A_%a"), err.replace("%j", "%A_%a")
    tpn = int(job["tasks_per_node"])
    cmd = ["srun", "--unbuffered", "--open-mode=append", "--output", out, "--error", err,
           *job.get("srun_args", []), f"--nodes={len(nodes)}", f"--ntasks={len(nodes) * tpn}",
           f"--ntasks-per-node={tpn}", f"--nodelist={','.join(nodes)}"]
    if attempt:
        # The failed step may still hold its CPUs and memory in the controller's books until the lost node is
        # down: --overlap shares the CPUs, --mem=0 gives the step the job's memory on each node (where memory is
        # a consumable resource, CR_*_Memory, the new step is otherwise refused: "Memory required by task is
        # not available"). The job's cgroup still limits it to the job's memory.
        cmd += ["--overlap", "--mem=0"]
    return [*cmd, *job.get("python", [python]), "-u", "-m", "submitit.core._submit", str(folder)]


def _ending(events: list[dict], since: float) -> tuple[float, str] | None:
    """Time and kind of the first event at or after ``since`` that ends this attempt (see ENDING_EVENTS)."""
    for ev in events:
        if ev.get("kind") in ENDING_EVENTS and ev.get("time", 0) >= since:
            return float(ev["time"]), str(ev["kind"])
    return None


def run_step(cmd: list[str], env: Mapping[str, str], run_dir: Path, since: float,
             grace_s: float = ABORT_GRACE_S, poll_s: float = 0.5,
             clock: Callable[[], float] = time.time) -> int:
    """Run one attempt's ``srun``; end it ``grace_s`` after an abort, a dead rank or an OOM kill when it does not
    end by itself (the survivors of a rank killed before the rendezvous would wait for it for minutes)."""
    folder = Path(cmd[cmd.index("--error") + 1]).parent if "--error" in cmd else None
    sizes = log_sizes(folder, env) if folder is not None else {}
    proc = subprocess.Popen(cmd, env=dict(env))
    tail, ended = EventTail(run_dir), None
    while proc.poll() is None:
        time.sleep(poll_s)
        ended = ended or _ending(tail.read(), since)
        if ended is None and folder is not None and oom_nodes_in(written_since(folder, sizes)):
            ended = (clock(), "oom")
        if ended is not None and clock() - ended[0] > grace_s and proc.poll() is None:
            what = {"abort": "the abort", "dead": "a rank was found dead", "oom": "an OOM kill"}[ended[1]]
            print(f"xirang: ending the step {grace_s:.0f}s after {what} (its other tasks did not end by themselves)",
                  file=sys.stderr, flush=True)
            proc.terminate()
            try:
                return proc.wait(timeout=SRUN_TERM_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                return proc.wait()
    return proc.returncode


def culprits(run_dir: Path, restart: int, since: float) -> tuple[list[str], str, float | None]:
    """The failed nodes of the attempt that started at ``since``, the cause in words, the fault's time.

    The watchdog's fault events (dead rank, hang) name the culprit precisely; after its abort every
    rank lacks an exit marker, so the markers are the fallback when it did not run.
    """
    faults = [e for e in read_events(run_dir) if e.get("kind") in ("dead", "hang") and e.get("time", 0) >= since]
    nodes = failed_nodes(run_dir, since=since)
    if nodes:
        f = faults[0] if faults else {}
        return nodes, f"{f.get('kind', 'fault')}: {f.get('reason', '')}".strip(), f.get("time")
    lost = missing_ranks(run_dir, restart)
    return sorted({n for _, n in lost}), f"ranks {[r for r, _ in lost]} ended without exiting (killed)", None


def log_sizes(folder: Path, env: Mapping[str, str] | None = None) -> dict[Path, int]:
    """The size of the batch step's log in ``folder``, where srun and slurmstepd write their own messages (also
    task 0's: submitit's ``%j_0_log.err``); of every job log there when the job is not known."""
    env = os.environ if env is None else env
    job = (f"{env['SLURM_ARRAY_JOB_ID']}_{env['SLURM_ARRAY_TASK_ID']}" if "SLURM_ARRAY_TASK_ID" in env
           else env.get("SLURM_JOB_ID", ""))
    if job:  # the batch log (0 bytes so far when it does not exist yet)
        batch = folder / f"{job}_0_log.err"
        return {batch: batch.stat().st_size if batch.exists() else 0}
    out = {}
    for log in folder.glob("*_log.*"):
        try:
            out[log] = log.stat().st_size
        except OSError:
            continue
    return out


def written_since(folder: Path, sizes: dict[Path, int], limit: int = 65536) -> str:
    """What was appended to the logs of ``sizes`` (:func:`log_sizes`) since (the last ``limit`` bytes of each)."""
    parts = []
    for log, start in sizes.items():
        try:
            size = log.stat().st_size
        except OSError:
            continue
        if size > start:
            with log.open("rb") as f:
                f.seek(max(start, size - limit))
                parts.append(f.read().decode(errors="replace"))
    return "\n".join(parts)


def launch_failure(text: str) -> str | None:
    """srun's line saying the step could not be started (the controller did not answer, no step could be
    created), from what the step wrote; None when there is none."""
    for line in text.splitlines():
        if line.startswith("srun: error") and (control.controller_down(line)
                                               or any(m in line for m in STEP_NOT_CREATED)):
            return line.strip()
    return None


def refused_for_good(line: str) -> bool:
    """Whether srun's failure line says Slurm refuses the step itself (no retry can help)."""
    return any(m in line for m in STEP_REFUSED) and not control.controller_down(line)


def ranks_started(run_dir: Path, restart: int) -> bool:
    """Whether any rank of this attempt wrote its start marker."""
    markers = run_dir / "ranks" / f"r{restart}"
    return markers.is_dir() and any(markers.glob("*.start"))


def controller_answers() -> bool:
    """``scontrol ping`` says slurmctld is UP (False when it says DOWN, fails or times out)."""
    from xirang_hpc.slurm import control

    try:
        return " is UP" in control.run_scontrol(["ping"], timeout_s=20)
    except control.SlurmCommandError:
        return False


def launch_retry_s(env: Mapping[str, str]) -> float:
    """How long failed step launches are retried before the policy takes over (``XIRANG_LAUNCH_RETRY_S``)."""
    return float(env.get("XIRANG_LAUNCH_RETRY_S", LAUNCH_RETRY_S))


def archive_markers(run_dir: Path, restart: int, attempt: int) -> None:
    """Move this attempt's rank markers aside, so the next attempt's are not mixed with them."""
    d = run_dir / "ranks" / f"r{restart}"
    if d.is_dir():
        d.rename(run_dir / "ranks" / f"r{restart}-attempt{attempt}")


def drive(run_dir: Path, folder: Path, env: Mapping[str, str], python: str = sys.executable,
          step: Callable[..., int] = run_step, allocation: Callable[[str], list[str]] = hostnames,
          preempted: Callable[[str], str | None] = preempt_time, outcome: dict[str, str] | None = None,
          answers: Callable[[], bool] = controller_answers,
          sleep: Callable[[float], None] = time.sleep, clock: Callable[[], float] = time.time) -> int:
    """Run attempts until one ends without a restartable failure; returns the last step's exit code.

    A step launch that fails before any task started is retried with backoff (:data:`LAUNCH_RETRY_S`); when
    the retries run out, ``outcome["cause"]`` says ``infra_failure`` for the supervisor.
    """
    outcome = {} if outcome is None else outcome
    first_failure: float | None = None
    failures = 0
    job = json.loads((run_dir / "slurm_job.json").read_text())
    policy = job["requeue"]
    restart = control.restart_count(env)
    job_id = env.get("SLURM_JOB_ID", "")
    alloc = allocation(env.get("SLURM_JOB_NODELIST", ""))
    wanted, shrink_to = int(job["nodes"]), [int(k) for k in job.get("shrink_to", [])]
    excluded: list[str] = []
    attempt = 0
    plan = choose_nodes(alloc, wanted, shrink_to)
    if plan is None:
        append_event(run_dir, "restart_refused", f"allocation {alloc} holds fewer than {wanted} nodes and no "
                     "shrunk layout fits", job=job_id, restart=restart)
        return 1
    while True:
        since = time.time()
        step_env = {**env, "SUBMITIT_EXECUTOR": "slurm", NODES_ENV: str(len(plan.nodes)), ATTEMPT_ENV: str(attempt)}
        sizes = log_sizes(folder, env)
        rc = step(srun_command(job, folder, plan.nodes, attempt, python, env), step_env, run_dir, since)
        if rc == 0 or already_handled(run_dir, restart) or handed_over(run_dir, restart):
            return rc  # finished, or the job itself stopped (preemption, time limit): not ours to restart
        if job_id and preempted(job_id):
            return rc  # preempted before the ranks' own handler could act: Slurm takes the job; the supervisor says so
        said_all = written_since(folder, sizes) if rc != 0 else ""  # srun's and slurmstepd's words on this step
        oom = oom_nodes_in(said_all) or (oom_nodes(job_id, tries=1) if rc != 0 and job_id else [])
        if oom:  # a memory limit the job exceeded: the same layout would run out again on any node
            detail = oom_detail(oom, job)
            append_event(run_dir, "restart_refused", detail, cause="oom", nodes=oom, node=oom[0], job=job_id,
                         restart=restart)
            outcome.update(cause="oom", detail=detail)
            return rc
        said = launch_failure(said_all) if rc != 0 and not ranks_started(run_dir, restart) else None
        # srun's own word, or slurmctld not answering now (it may have answered srun with a refusal).
        down = said is not None and (control.controller_down(said) or not answers())
        if said is not None and refused_for_good(said) and attempt == 0:
            # The first launch of this start refused: what the job asks for cannot run here; say what and how.
            detail = (f"Slurm refuses the training step: {said}. The job's request (cluster.tasks_per_node, "
                      "cpus_per_task, gpus_per_node, mem_gb, srun_args) cannot run on its nodes; fix it and launch "
                      "again (a requeue would be refused the same way)")
            append_event(run_dir, "restart_refused", detail, cause="launch_refused", srun=said, job=job_id,
                         restart=restart)
            outcome.update(cause="launch_refused", detail=detail)
            return rc
        if said is not None:
            first_failure = clock() if first_failure is None else first_failure
            cause = "slurmctld does not answer" if down else f"srun could not start the step: {said}"
            waited = clock() - first_failure
            if waited < launch_retry_s(env):
                wait = min(LAUNCH_BACKOFF_MAX_S, 2.0 * 2 ** failures)
                failures += 1
                append_event(run_dir, "step_launch_failed", cause, rc=rc, attempt=attempt, retry=failures,
                             retry_in_s=wait, failing_since=first_failure, controller_down=down, nodes=plan.nodes,
                             srun=said, job=job_id, restart=restart)
                print(f"xirang: step launch failed: {cause} (srun exit {rc}); retry {failures} in {wait:.0f}s",
                      file=sys.stderr, flush=True)
                sleep(wait)
                continue
            detail = f"step launches failed for {waited:.0f}s ({cause})"
            append_event(run_dir, "restart_refused", detail, cause="infra_failure", controller_down=down,
                         job=job_id, restart=restart)
            outcome.update(cause="infra_failure", detail=detail)
            return rc
        first_failure, failures = None, 0
        storage = storage_failure(run_dir, since=since)
        if storage is not None:
            # The checkpoint storage is full or unwritable: the same on every node, a restart would fail alike.
            why = storage.get("error") or storage.get("cause")
            append_event(run_dir, "restart_refused", f"checkpoint storage: {why}", cause="save_failed",
                         job=job_id, restart=restart)
            return rc
        failed, cause, fault_time = culprits(run_dir, restart, since)
        if not failed:
            return rc  # a plain non-zero exit: restarting would repeat it; the policy decides
        if attempt >= int(policy.get("max_restarts_in_job", 0)):
            append_event(run_dir, "restart_refused", f"requeue.max_restarts_in_job={attempt} reached", cause=cause,
                         node=failed[0], nodes=failed, job=job_id, restart=restart)
            return rc
        excluded = sorted(set(excluded) | set(failed))
        floor = int(policy.get("min_nodes", 0))
        nxt = choose_nodes([n for n in alloc if n not in excluded], wanted, [k for k in shrink_to if k >= floor])
        if nxt is None:
            append_event(run_dir, "restart_refused", f"too few healthy nodes: {len(alloc) - len(excluded)} of "
                         f"{len(alloc)} (excluded {excluded}); the layout needs {wanted} or one of {shrink_to}",
                         cause=cause, node=failed[0], nodes=failed, job=job_id, restart=restart)
            return rc
        archive_markers(run_dir, restart, attempt)
        attempt += 1
        append_event(run_dir, "restart", cause, node=failed[0], failed_nodes=failed, excluded=excluded,
                     nodes=nxt.nodes, shrunk=nxt.shrunk, attempt=attempt, fault_time=fault_time, job=job_id,
                     restart=restart)
        print(f"xirang: in-job restart {attempt}: {cause}; excluded {excluded}; now on {nxt.nodes}"
              f"{' (shrunk layout)' if nxt.shrunk else ''}", file=sys.stderr, flush=True)
        plan = nxt


def release_memory(run_dir: Path, env: Mapping[str, str], allocation: Callable[[str], list[str]] = hostnames,
                   run: Callable[..., Result] = call) -> Path | None:
    """Remove the job's in-memory checkpoint copies (``checkpoint.in_memory``) once its steps are over.

    This node's directory tree directly; the other healthy nodes of the allocation through one
    ``srun`` step (best effort: a copy left behind on a node is freed with its tmpfs at the latest).
    """
    job = json.loads((run_dir / "slurm_job.json").read_text())
    if not job.get("in_memory"):
        return None
    root = memory_root(env.get("SLURM_JOB_ID", ""), run_dir, job.get("memory_dir", ""))
    shutil.rmtree(root, ignore_errors=True)
    here, lost = env.get("SLURMD_NODENAME", ""), set(failed_nodes(run_dir))
    others = [n for n in allocation(env.get("SLURM_JOB_NODELIST", "")) if n != here and n not in lost]
    if others:
        r = control.srun_on(others, ["rm", "-rf", str(root)], run=run)
        if r.rc != 0:
            print(f"xirang: could not remove {root} on {others}: {r.err.strip() or f'exit {r.rc}'}", file=sys.stderr,
                  flush=True)
    return root


def _how(rc: int) -> str:
    if 128 < rc < 128 + signal.NSIG:
        return f"killed by {signal.Signals(rc - 128).name}"
    if rc < 0 and -rc < signal.NSIG:
        return f"killed by {signal.Signals(-rc).name}"
    return f"exit {rc}"


def job_state(job_id: str) -> str:
    """Slurm's JobState of ``job_id`` ('' when unknown or slurmctld does not answer)."""
    if not job_id:
        return ""
    try:
        return control.job_info(job_id).get("JobState", "")
    except control.SlurmCommandError:
        return ""


def guard(rc: int, run_dir: Path, env: Mapping[str, str], run: Callable[..., Result] = call,
          wait_s: float = 180.0, poll_s: float = 1.0, clock: Callable[[], float] = time.time) -> int:
    """After the driver: nothing when it decided (an ``exit`` event of this restart); else it died undecided.

    Then the guard names it (``supervisor_died``), has the running step's ranks save and stop (SIGUSR2, with
    the cause written beside their markers, so rank 0 applies the policy as ``infra_failure`` instead of
    asking Slurm), waits for their verdict, and applies the policy itself when no step runs or the ranks
    did not decide within ``wait_s``. No node is blamed: the driver's death says nothing about a node.
    """
    restart = control.restart_count(env)
    if already_handled(run_dir, restart) or handed_over(run_dir, restart):
        return rc
    job_id = env.get("SLURM_JOB_ID", "")
    if rc == 128 + signal.SIGTERM or states.base(job_state(job_id)) in states.ENDED_ON_REQUEST:
        return rc  # Slurm is ending the job (scancel, time limit, preemption): the ranks take that themselves
    detail = f"the batch step's in-job driver ended without a decision ({_how(rc)})"
    append_event(run_dir, "supervisor_died", detail, rc=rc, job=job_id, restart=restart,
                 node=env.get("SLURMD_NODENAME"))
    print(f"xirang: {detail}; the guard takes over", file=sys.stderr, flush=True)
    steps = live_steps(job_id, run) if job_id else []
    if steps:
        write_stop_cause(run_dir, restart, "infra_failure", f"{detail}; the ranks saved, the policy decides")
        for step in steps:
            control.scancel(step, signal="USR2", run=run, timeout_s=30)
        deadline = clock() + wait_s
        while clock() < deadline and not already_handled(run_dir, restart):
            if not live_steps(job_id, run):
                break
            time.sleep(poll_s)
        if already_handled(run_dir, restart):
            return rc
    return supervise(rc, run_dir, dict(env), cause="infra_failure", detail=detail)


def main(argv: list[str] | None = None) -> None:
    """Entry point in the batch script: the attempts, then the requeue supervisor on the last exit code."""
    # The batch script ignores SIGTERM so that it outlives a requeue (launch/slurm.injob_lines); this process,
    # and the srun steps it starts, take SIGTERM as usual until the supervisor ignores it before requeuing.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--map", type=Path, required=True, help="task id -> run dir JSON")
    ap.add_argument("--folder", type=Path, required=True, help="the submitit folder of the job")
    ap.add_argument("--guard", type=int, default=None, metavar="RC",
                    help="run as the guard after a driver that exited with RC (see guard())")
    a = ap.parse_args(argv)
    env = dict(os.environ)
    run_dir = run_dir_for_task(a.map, env)
    if a.guard is not None:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # outlive the requeue the ranks may do meanwhile
        sys.exit(guard(a.guard, run_dir, env))
    outcome: dict[str, str] = {}
    rc = drive(run_dir, a.folder, env, outcome=outcome)
    release_memory(run_dir, env)
    sys.exit(supervise(rc, run_dir, env, cause=outcome.get("cause"), detail=outcome.get("detail", "")))


if __name__ == "__main__":
    main()
