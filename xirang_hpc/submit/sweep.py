"""Hydra launcher: a multirun on Slurm becomes **one** array job (fire-and-forget).

``xirang-train -m train.lr=1e-3,3e-4 model=tiny,gpt2-small cluster=testbed`` composes and
validates every point of the sweep first (nothing is submitted if one is invalid), then submits
a single ``sbatch --array=0-N%array_parallelism`` through submitit's ``map_array``, prints the
array id and each task's run directory, and returns. Each task's run directory is the
experiment's deterministic one (:func:`~xirang_hpc.submit.rundir.run_dir_for`), so a requeued
task (requeued alone, as ``ARRAYJOBID_TASKID``) finds its own checkpoints.
Local sweeps (``cluster=local``) run one after another through Hydra's basic launcher.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hydra.core.config_store import ConfigStore
from hydra.core.utils import JobReturn, JobStatus, filter_overrides
from hydra.plugins.launcher import Launcher
from omegaconf import DictConfig

from xirang_hpc.config.errors import ConfigError
from xirang_hpc.config.schema import XirangConfig
from xirang_hpc.files import private_by_default
from xirang_hpc.monitor import audit
from xirang_hpc.monitor.events import append_event


@dataclass
class XirangLauncherConf:
    """``hydra/launcher=xirang``."""

    _target_: str = "hydra_plugins.xirang_launcher.XirangLauncher"


def register_launcher() -> None:
    """Make ``hydra/launcher: xirang`` available to the defaults list."""
    ConfigStore.instance().store(group="hydra/launcher", name="xirang", node=XirangLauncherConf, provider="xirang")


def sweep_folder(cfgs: list[XirangConfig], overrides: Sequence[Sequence[str]]) -> Path:
    """``<runs_root>/sweeps/<name>-<hash of the override lists>``: the array's submitit folder."""
    blob = json.dumps([sorted(o) for o in overrides], sort_keys=True)
    h = hashlib.sha256(blob.encode()).hexdigest()[:12]
    return (Path(cfgs[0].train.runs_root).expanduser() / "sweeps" / f"{cfgs[0].train.name}-{h}").absolute()


def check_same_resources(cfgs: list[XirangConfig], overrides: Sequence[Sequence[str]]) -> None:
    """One array job has one resource set: every point must use the same cluster config."""
    first = cfgs[0].cluster
    for c, ov in zip(cfgs[1:], overrides[1:]):
        if c.cluster != first:
            diff = [f.name for f in dataclasses.fields(first) if getattr(first, f.name) != getattr(c.cluster, f.name)]
            raise ConfigError(f"cluster.{diff[0]}", getattr(c.cluster, diff[0]),
                              f"a sweep is one Slurm array with one resource set, but {' '.join(ov)} changes "
                              f"cluster.{', cluster.'.join(diff)}; sweep over it in separate submissions")
        if c.train.priority != cfgs[0].train.priority:
            raise ConfigError("train.priority", c.train.priority, "must be the same for every point of a sweep")


def split_sweep(n: int, alive: Sequence[str]) -> list[str]:
    """Task index -> site: ``n`` tasks in near-equal contiguous chunks over ``alive`` (earliest start first;
    the earlier sites take the remainder)."""
    k = len(alive)
    sizes = [n // k + (1 if i < n % k else 0) for i in range(k)]
    return [site for site, size in zip(alive, sizes) for _ in range(size)]


def _site_plan(cfgs: list[XirangConfig]) -> tuple[list[XirangConfig], list[str | None], dict[str, Any] | None]:
    """With ``cluster.sites``: each point as submitted to its site (its run root, partition, account, QOS)
    and the site names; the placement evidence (``None`` without sites)."""
    c0 = cfgs[0].cluster
    if not c0.sites:
        return cfgs, [None] * len(cfgs), None
    from xirang_hpc.submit.sites import apply_site, place, site_of

    p = place(cfgs[0])
    for w in p.warnings:
        print(f"warning: {w}", flush=True)
    print(p.describe(), flush=True)
    if c0.site_sweep == "spread":
        alive = [e.site for e in sorted((e for e in p.estimates if e.alive), key=lambda e: (e.start, e.site))]
        names = split_sweep(len(cfgs), alive)
    else:
        names = [p.site.name] * len(cfgs)
    plan = {"policy": c0.site_sweep, "chosen": p.site.name, "reason": p.reason, "estimates": p.evidence(),
            "warnings": p.warnings}
    return [apply_site(c, site_of(c0, n)) for c, n in zip(cfgs, names)], list(names), plan


def submit_array(cfgs: list[XirangConfig], overrides: Sequence[Sequence[str]]
                 ) -> tuple[str | None, list[Path], list[str | None]]:
    """Submit every point as one task of one array job; returns (array job id, run dirs, task ids).

    A point whose run is already complete is reported (how to extend it) and left out of the array:
    its run directory is still returned, its task id is None. When every point is complete nothing
    is submitted and the array id is None. With ``cluster.sites`` the array goes to the placed site, or
    with ``cluster.site_sweep=spread`` one array per site (array ids then read ``<site>:<id>``, joined
    by commas, and task ids ``<site>:<array>_<task>``).
    """
    from xirang_hpc.submit.preflight import complete_message, corrupt_message, open_run_dir, preflight
    from xirang_hpc.submit.rundir import run_dir_for

    check_same_resources(cfgs, overrides)
    record_at = sweep_folder(cfgs, overrides)  # the split's record: under train.runs_root, whatever the sites
    cfgs, sites, plan = _site_plan(cfgs)
    if len({run_dir_for(c) for c in cfgs}) != len(cfgs):
        raise ConfigError("train.run_dir", str(run_dir_for(cfgs[0])),
                          "two points of the sweep map to the same run directory; leave train.run_dir empty")
    statuses = [preflight(c) for c in cfgs]  # every point's identity and paths before any directory is made
    for c, st in zip(cfgs, statuses):
        if st.complete:
            print(complete_message(c, st), flush=True)
        elif (damaged := corrupt_message(st)) is not None:
            print(damaged, file=sys.stderr, flush=True)
    todo = [i for i, st in enumerate(statuses) if not st.complete]
    groups: dict[str | None, list[int]] = {}
    for i in todo:
        groups.setdefault(sites[i], []).append(i)
    for site, idx in groups.items():
        _state_quota(cfgs[idx[0]], site, len(idx))
    run_dirs = [open_run_dir(c) for c in cfgs]
    if not todo:
        return None, run_dirs, [None] * len(run_dirs)
    tasks: list[str | None] = [None] * len(run_dirs)
    arrays = []
    for site, idx in groups.items():
        array_id, ids = _submit_group([cfgs[i] for i in idx], [overrides[i] for i in idx],
                                      [run_dirs[i] for i in idx], site, plan)
        arrays.append(f"{site}:{array_id}" if plan and len(groups) > 1 else array_id)
        for i, t in zip(idx, ids):
            tasks[i] = f"{site}:{t}" if plan and len(groups) > 1 else t
    if plan is not None:
        from xirang_hpc.submit.rundir import make_private_dir

        folder = make_private_dir(record_at)
        split = [{"task": i, "site": sites[i], "run_dir": str(run_dirs[i]), "job": tasks[i]} for i in range(len(cfgs))]
        (folder / "sites.json").write_text(json.dumps({**plan, "arrays": arrays, "split": split}, indent=1))
    return ",".join(arrays), run_dirs, tasks


def _state_quota(cfg: XirangConfig, site: str | None, tasks: int) -> None:
    """The account's quota for ``tasks`` tasks, on ``site`` (``-M``) when the sweep goes to several sites."""
    from xirang_hpc.submit.quota_check import check_quota

    db = None
    if site is not None:
        from xirang_hpc.slurm.accounting import SlurmDB, call, on_cluster

        db = SlurmDB(run=on_cluster(call, site), cluster=site)
    lines, fit = check_quota(cfg, db=db, tasks=tasks)
    if fit is not None:
        at_once = min(tasks, cfg.cluster.array_parallelism)
        lines.append(f"  (per task; the array runs at most {at_once} at once, "
                     "the quota decides how many of them run together)")
    print("\n".join(lines), flush=True)


def _submit_group(cfgs: list[XirangConfig], overrides: Sequence[Sequence[str]], run_dirs: list[Path],
                  site: str | None, plan: dict[str, Any] | None) -> tuple[str, list[str]]:
    """One array job (on ``site`` with ``-M`` when named) for these points; (array id, task ids)."""
    from xirang_hpc.data.prepare import ensure_prepared
    from xirang_hpc.job.entry import train_job
    from xirang_hpc.submit import slurm
    from xirang_hpc.submit.rundir import make_private_dir

    data_dirs = [ensure_prepared(c.data, c.data.out_dir) for c in cfgs]
    folder = make_private_dir(sweep_folder(cfgs, overrides))
    for c, d in zip(cfgs, run_dirs):
        slurm.write_job_file(c, d)
    # submitit submits a single point as a plain job (no SLURM_ARRAY_TASK_ID): then the map's key is "".
    slurm.write_run_dir_map(folder / "submitit", run_dirs, array=len(run_dirs) > 1)
    c0 = cfgs[0]
    ex = slurm.make_slurm_executor(c0.cluster, folder / "submitit", c0.train.priority, c0.requeue,
                                   sorted({p for c in cfgs for p in slurm.container_paths(c)}))
    ex.update_parameters(job_name=f"xirang-sweep-{c0.train.name}")
    if site is not None:
        ex.update_parameters(additional_parameters={**(ex.parameters.get("additional_parameters") or {}),
                                                    "clusters": site})
    jobs = ex.map_array(train_job, [dataclasses.asdict(c) for c in cfgs], [str(d) for d in run_dirs],
                        [str(d) for d in data_dirs])
    array_id = str(jobs[0].job_id).split("_")[0]
    for i, (j, d, dd) in enumerate(zip(jobs, run_dirs, data_dirs)):
        audit.record(d, "launch", str(j.job_id), array=array_id, task=i, cluster=c0.cluster.name)
        append_event(d, "submit", "submitted", job=str(j.job_id), array=array_id, task=i, cluster=c0.cluster.name,
                     **({"site": site} if site else {}))
        if site is not None and plan is not None:  # the task's site and its evidence, as for a single run
            from xirang_hpc.submit.sites import write_site_state

            append_event(d, "placement", plan["reason"], site=site, policy=plan["policy"],
                         estimates=plan["estimates"], warnings=plan["warnings"], sweep_task=i)
            write_site_state(d, cfgs[i], dd, site, str(j.job_id))
    return array_id, [str(j.job_id) for j in jobs]


class XirangLauncher(Launcher):
    """Slurm sweeps -> one array job; anything else -> Hydra's basic (sequential) launcher."""

    def __init__(self, **_: Any) -> None:
        self.config: DictConfig | None = None
        self.hydra_context: Any = None
        self.task_function: Any = None

    def setup(self, *, hydra_context: Any, task_function: Any, config: DictConfig) -> None:
        self.hydra_context, self.task_function, self.config = hydra_context, task_function, config

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        from xirang_hpc.config.validate import check_runnable, load_config

        assert self.config is not None and self.hydra_context is not None
        loaded = [self.hydra_context.config_loader.load_sweep_config(self.config, list(o)) for o in job_overrides]
        try:
            cfgs = [load_config(c) for c in loaded]
            private_by_default(cfgs[0].train.share_group if cfgs else "")  # before anything is created
            for c in cfgs:
                check_runnable(c)
        except ConfigError as exc:
            raise SystemExit(f"xirang-train: error: {exc}") from None
        if any(c.cluster.executor != "slurm" for c in cfgs):
            from hydra._internal.core_plugins.basic_launcher import BasicLauncher

            basic = BasicLauncher()
            basic.setup(hydra_context=self.hydra_context, task_function=self.task_function, config=self.config)
            return basic.launch(job_overrides, initial_job_idx)
        try:
            array_id, run_dirs, tasks = submit_array(cfgs, job_overrides)
        except ConfigError as exc:
            raise SystemExit(f"xirang-train: error: {exc}") from None
        common = set.intersection(*(set(o) for o in job_overrides))
        task_of = {d: t for d, t in zip(run_dirs, tasks) if t is not None}  # complete runs have no task
        if array_id is None:
            print(f"nothing submitted: all {len(cfgs)} runs of the sweep are complete", flush=True)
        else:
            print(f"submitted Slurm array job {array_id}: {len(task_of)} task(s), at most "
                  f"{min(len(task_of), cfgs[0].cluster.array_parallelism)} at once"
                  + (f"; {len(cfgs) - len(task_of)} complete run(s) left out" if len(task_of) < len(cfgs) else ""),
                  flush=True)
        for ov, d in zip(job_overrides, run_dirs):
            varying = [o for o in filter_overrides(ov) if o not in common]
            print(f"  {task_of.get(d, 'complete')}: {' '.join(varying) or '(defaults)'} -> {d}", flush=True)
        if array_id is not None:
            q = "squeue -M all" if ":" in array_id else f"squeue -j {array_id}"
            print(f"follow it with: {q}; xirang-status --queue --sites all; xirang-status {run_dirs[0].parent}"
                  if ":" in array_id else f"follow it with: {q}; xirang-status {run_dirs[0].parent}", flush=True)
        return [JobReturn(overrides=list(ov), cfg=c, hydra_cfg=self.config, working_dir=str(d),
                          task_name="xirang-train", status=JobStatus.COMPLETED, _return_value=task_of.get(d))
                for ov, c, d in zip(job_overrides, loaded, run_dirs)]

