"""Moving a run between sites: its site state (``site.json``), the preemptor's hold on its nodes, the
decision, the copy and the submission on the other site; ``python -m xirang_hpc.submit.sites``."""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as dt
import json
import os
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from xirang_hpc.config.errors import ConfigError
from xirang_hpc.config.schema import XirangConfig
from xirang_hpc.files import write_json_atomic
from xirang_hpc.monitor.events import append_event
from xirang_hpc.slurm import control
from xirang_hpc.slurm.accounting import Caller, Result, call
from xirang_hpc.submit.sites.placement import Placement, apply_site, choose, gather, place, record_placement, site_of
from xirang_hpc.submit.sites.transfer import CopyError, copy_run, site_run_dir


def _slurm_time(text: str) -> float | None:
    try:
        return dt.datetime.strptime(text, "%Y-%m-%dT%H:%M:%S").timestamp()
    except ValueError:
        return None


def hostnames(expr: str, run: Caller = call) -> list[str]:
    """A Slurm hostlist (``sa[1-2]``) -> names (``scontrol show hostnames``); [] for ``(null)``/empty or when
    scontrol cannot expand it."""
    try:
        return control.hostnames(expr, run=lambda argv, **_: run(argv))
    except control.SlurmCommandError:
        return []


def held_until(site: str, nodes: Sequence[str], job_id: str, run: Caller = call) -> tuple[float | None, list[str]]:
    """When the jobs that take ``nodes`` from a preempted job on ``site`` end, and their ids.

    At a preemption ``sbatch --test-only`` is no guide to the requeue's start: the preempted job still
    holds its nodes and the job that preempts it is pending, so Slurm's will-run test answers "now".
    The preemptor is visible in ``squeue --start``: a pending job scheduled onto the preempted job's
    nodes (SCHEDNODES) or already running there. The requeue cannot start on those nodes before it
    ends (its start + time limit); ``inf`` for a job without a limit; None when none is found.
    """
    from xirang_hpc.slurm.control import parse_duration

    r = run(["squeue", "-M", site, "-h", "-t", "PENDING,RUNNING", "-o", "%i|%S|%l|%Y|%N|%T"])
    if r.rc != 0:
        return None, []
    mine, latest, who = set(nodes), None, []
    for line in r.out.splitlines():
        parts = line.strip().split("|")
        if len(parts) != 6 or parts[0] == job_id:
            continue
        jid, start, limit, sched, alloc, state = parts
        on = hostnames(sched if state == "PENDING" else alloc, run)
        begin = _slurm_time(start)
        if not mine & set(on) or begin is None:
            continue
        dur = parse_duration(limit)
        end = float("inf") if dur is None else begin + dur
        latest = end if latest is None else max(latest, end)
        who.append(jid)
    return latest, who


def should_migrate(current: str, p: Placement, wait_limit_s: float) -> bool:
    """Move a preempted run: its requeue on ``current`` waits longer than ``wait_limit_s`` (or ``current``
    does not answer) and the placement chose another site."""
    if p.site.name == current:
        return False
    here = next((e for e in p.estimates if e.site == current), None)
    return here is None or not here.alive or (here.wait_s or 0.0) > wait_limit_s


SITE_FILE = "site.json"


def write_site_state(run_dir: Path, cfg: XirangConfig, data_dir: Path, site: str, job_id: str,
                     run_at: Path | None = None) -> dict[str, Any]:
    """``<run>/site.json``: the site the run is on, its job there, where its run directory is now
    (``run_at``, default ``run_dir``), the config and data to resubmit it elsewhere, and the run's
    history across sites (appended, oldest first)."""
    old = read_site_state(run_dir) or {}
    at = str(run_at or run_dir)
    history = [*old.get("history", []), {"site": site, "job": job_id, "run_dir": at, "time": time.time()}]
    state = {"site": site, "job": job_id, "run_dir": at, "data_dir": str(data_dir),
             "config": dataclasses.asdict(cfg), "history": history}
    write_json_atomic(run_dir / SITE_FILE, state, indent=1, default=str)
    return state


def read_site_state(run_dir: Path) -> dict[str, Any] | None:
    """The run's ``site.json`` (None for a run placed on one cluster only, or unreadable)."""
    try:
        return json.loads((run_dir / SITE_FILE).read_text())
    except (OSError, ValueError):
        return None


def cancel_on(site: str, job_id: str, run: Caller = call) -> Result:
    """``scancel -M <site> <job>`` (the run's pending requeue on the site it leaves)."""
    return run(["scancel", "-M", site, job_id])


def _default_submit(c: XirangConfig, d: Path, data: Path, site: str,
                    handover: tuple[str, str | None] | None = None) -> Any:
    from xirang_hpc.job.entry import train_job
    from xirang_hpc.submit.slurm import submit as slurm_submit

    return slurm_submit(c, d, data, train_job, dataclasses.asdict(c), str(d), str(data), site=site,
                        handover=handover)


def _move(run_dir: Path, state: dict[str, Any], cfg: XirangConfig, p: Placement, current: str,
          submit: Callable[..., Any], before_submit: Callable[[], Any] | None = None,
          handover: tuple[str, str | None] | None = None, **why: Any) -> dict[str, Any]:
    """Copy (when the target has its own run root), then submit on the target site; record it all."""
    target = p.site
    t0 = time.monotonic()
    runs_root = Path(site_of(cfg.cluster, current).run_root or cfg.train.runs_root)
    dst = site_run_dir(run_dir, runs_root, target) if target.run_root else run_dir
    record_placement(run_dir, p, moving_from=current, **why)
    copied = None
    if dst != run_dir:  # the target site has its own run root: copy and verify before the job starts there
        copied = copy_run(run_dir, dst)  # CopyError: nothing cancelled or submitted, the run stays on `current`
    if before_submit is not None:
        before_submit()
    new_cfg = apply_site(cfg, target)
    job = submit(new_cfg, dst, Path(state["data_dir"]), target.name, **({"handover": handover} if handover else {}))
    job_id = str(getattr(job, "job_id", job))
    # The new site's state carries the history; the old run dir points at where the run went.
    write_site_state(dst, new_cfg, Path(state["data_dir"]), target.name, job_id)
    if dst != run_dir:
        write_site_state(run_dir, cfg, Path(state["data_dir"]), target.name, job_id, run_at=dst)
    facts = {"from": current, "to": target.name, "job": job_id, "dst": str(dst),
             "copy_s": round(copied.seconds, 3) if copied else 0.0, "copy_bytes": copied.bytes if copied else 0,
             "step": copied.step if copied else None, "seconds": round(time.monotonic() - t0, 3),
             "estimates": p.evidence(), **why}
    for d in {run_dir, dst}:
        append_event(d, "migrate", p.reason, **facts)
    return facts


def migrate(run_dir: Path, run: Caller | None = None, submit: Callable[..., Any] | None = None,
            force_site: str | None = None, out: Callable[[str], None] = print,
            now: Callable[[], float] = time.time) -> dict[str, Any] | None:
    """Move a preempted (requeued, pending) run to the site where it starts soonest.

    Placement runs with the run's current site as ``current``; the run moves when
    :func:`should_migrate` says so with ``cluster.site_migrate_wait_s`` (or to ``force_site``).
    The newest good checkpoint and the records are copied and verified first (without a shared
    filesystem), then the pending job on the old site is cancelled and the job submitted on the new
    site. A failed copy raises :class:`CopyError` before anything is cancelled or submitted: the run
    keeps its place in the old site's queue. Returns the move's facts, or None when the run stays.
    """
    state, cfg = _load_state(run_dir)
    current = state["site"]
    p = place(cfg, current=current, run=run, now=now)
    if force_site:
        p = dataclasses.replace(p, site=site_of(cfg.cluster, force_site), reason=f"forced to {force_site}")
    elif not should_migrate(current, p, cfg.cluster.site_migrate_wait_s):
        out(f"run stays on {current}: {p.reason}")
        return None
    facts = _move(run_dir, state, cfg, p, current, submit or _default_submit,
                  before_submit=lambda: cancel_on(current, str(state["job"]), run or call), trigger="command")
    out(f"moved run from {current} to {p.site.name} (job {facts['job']}, {facts['dst']}); copy "
        f"{facts['copy_bytes']} bytes in {facts['copy_s']:.2f}s")
    return facts


def _load_state(run_dir: Path) -> tuple[dict[str, Any], XirangConfig]:
    from omegaconf import OmegaConf

    from xirang_hpc.config.validate import load_config

    state = read_site_state(run_dir)
    if state is None:
        raise ConfigError("run", str(run_dir), f"has no {SITE_FILE}: it was not placed on several sites "
                                                "(list them in cluster.sites)")
    return state, load_config(OmegaConf.create(state["config"]))


# Job-specific variables a job submitted from inside another job must not inherit (sbatch exports the
# environment): a stale SLURM_RESTART_COUNT or array id would give the new job a wrong identity.
_KEEP_ENV = {"SLURM_CONF"}


@contextlib.contextmanager
def _clean_job_env() -> Iterator[None]:
    saved = {k: v for k, v in os.environ.items()
             if k.startswith(("SLURM_", "SBATCH_", "SUBMITIT_", "XIRANG_INJOB")) and k not in _KEEP_ENV}
    for k in saved:
        del os.environ[k]
    try:
        yield
    finally:
        os.environ.update(saved)


def migrate_at_preemption(run_dir: Path, job_id: str, current: str, nodes: Sequence[str],
                          run: Caller | None = None, submit: Callable[..., Any] | None = None,
                          now: Callable[[], float] = time.time,
                          before_submit: Callable[[], Any] | None = None) -> dict[str, Any] | None:
    """The job's own move at a preemption (called by the batch script's supervisor, batch/supervise.py).

    Places the run again with ``current`` as its site. ``current``'s expected start is the later of
    ``sbatch --test-only`` and the end of the jobs that take the preempted job's ``nodes``
    (:func:`held_until`). When that wait exceeds ``cluster.site_migrate_wait_s`` and another site starts
    the run sooner, the newest good checkpoint is copied and verified (separate run roots) and the run is
    submitted there (``sbatch -M``) by this job, which is then not requeued: the caller cancels it. The
    decision and its evidence (expected start per site, the preempting jobs, copy bytes and seconds) go
    to ``events.jsonl`` (kinds ``placement``/``migrate``, or ``migrate_check`` when the run stays).
    Returns the move's facts, or None when the run stays (the caller requeues it here as usual).
    Raises :class:`CopyError`/:class:`ConfigError` when the move failed before anything was submitted.
    ``before_submit`` runs after the verified copy, right before the submission (the supervisor makes its
    own job non-requeueable there, so Slurm's preemption cannot requeue it beside the moved run).
    """
    state, cfg = _load_state(run_dir)
    if not cfg.cluster.site_auto_migrate:
        return None
    caller = run or call
    estimates = gather(cfg, run, now)
    until, preemptors = held_until(current, nodes, job_id, caller)
    t = now()
    for e in estimates:
        if e.site == current and e.alive and until is not None and until > (e.start or 0.0):
            e.start = until if until != float("inf") else t + 365 * 86400.0
            e.wait_s = max(0.0, e.start - t)
            e.error = f"nodes held by job(s) {','.join(preemptors)}"
    p = choose(cfg.cluster.sites, estimates, cfg.cluster.site_policy, current, cfg.cluster.site_stay_s)
    limit = cfg.cluster.site_migrate_wait_s
    if not should_migrate(current, p, limit):
        append_event(run_dir, "migrate_check", f"stays on {current}: {p.reason}", site=current, job=job_id,
                     estimates=p.evidence(), preempted_by=preemptors, site_migrate_wait_s=limit)
        return None
    with _clean_job_env():
        return _move(run_dir, state, cfg, p, current, submit or _default_submit, handover=(job_id, current),
                     before_submit=before_submit, trigger="preemption", preempted_by=preemptors, old_job=job_id,
                     site_migrate_wait_s=limit)


def main(argv: list[str] | None = None) -> int:
    """``python -m xirang_hpc.submit.sites migrate RUN_DIR [--to SITE]``: move a preempted run now."""
    import argparse
    import sys

    ap = argparse.ArgumentParser(prog="python -m xirang_hpc.submit.sites", description=main.__doc__)
    ap.add_argument("action", choices=["migrate"])
    ap.add_argument("run_dir", type=Path)
    ap.add_argument("--to", default=None, help="move to this site whatever the placement says")
    a = ap.parse_args(argv)
    try:
        migrate(a.run_dir.absolute(), force_site=a.to)
    except (ConfigError, CopyError) as exc:
        print(f"xirang: error: {exc}", file=sys.stderr)
        return 2
    return 0
