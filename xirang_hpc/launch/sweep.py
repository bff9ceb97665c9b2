"""Hydra launcher: a multirun on Slurm becomes **one** array job (fire-and-forget).

``xirang-train -m train.lr=1e-3,3e-4 model=tiny,gpt2-small cluster=testbed`` composes and
validates every point of the sweep first (nothing is submitted if one is invalid), then submits
a single ``sbatch --array=0-N%array_parallelism`` through submitit's ``map_array``, prints the
array id and each task's run directory, and returns. Each task's run directory is the
experiment's deterministic one (:func:`~xirang_hpc.launch.rundir.run_dir_for`), so a requeued
task (requeued alone, as ``ARRAYJOBID_TASKID``) finds its own checkpoints.
Local sweeps (``cluster=local``) run one after another through Hydra's basic launcher.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
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


def submit_array(cfgs: list[XirangConfig], overrides: Sequence[Sequence[str]]
                 ) -> tuple[str | None, list[Path], list[str | None]]:
    """Submit every point as one task of one array job; returns (array job id, run dirs, task ids).

    A point whose run is already complete is reported (how to extend it) and left out of the array:
    its run directory is still returned, its task id is None. When every point is complete nothing
    is submitted and the array id is None.
    """
    from xirang_hpc.job.training import run_training
    from xirang_hpc.launch import slurm
    from xirang_hpc.launch.preflight import complete_message, open_run_dir, preflight
    from xirang_hpc.launch.rundir import make_private_dir, run_dir_for
    from xirang_hpc.launch.train_cli import _ensure_data

    check_same_resources(cfgs, overrides)
    if len({run_dir_for(c) for c in cfgs}) != len(cfgs):
        raise ConfigError("train.run_dir", str(run_dir_for(cfgs[0])),
                          "two points of the sweep map to the same run directory; leave train.run_dir empty")
    statuses = [preflight(c) for c in cfgs]  # every point's identity and paths before any directory is made
    for c, st in zip(cfgs, statuses):
        if st.complete:
            print(complete_message(c, st), flush=True)
    todo = [i for i, st in enumerate(statuses) if not st.complete]
    if todo:
        # Every task asks the same resources: the account's quota is stated (or the sweep refused) once.
        from xirang_hpc.launch.quota_check import check_quota

        lines, fit = check_quota(cfgs[0], tasks=len(todo))
        if fit is not None:
            at_once = min(len(todo), cfgs[0].cluster.array_parallelism)
            lines.append(f"  (per task; the array runs at most {at_once} at once, "
                         "the quota decides how many of them run together)")
        print("\n".join(lines), flush=True)
    run_dirs = [open_run_dir(c) for c in cfgs]
    if not todo:
        return None, run_dirs, [None] * len(run_dirs)
    all_dirs, cfgs, run_dirs = run_dirs, [cfgs[i] for i in todo], [run_dirs[i] for i in todo]
    overrides = [overrides[i] for i in todo]
    data_dirs = [_ensure_data(c) for c in cfgs]
    folder = make_private_dir(sweep_folder(cfgs, overrides))
    for c, d in zip(cfgs, run_dirs):
        slurm.write_job_file(c, d)
    slurm.write_run_dir_map(folder / "submitit", run_dirs, array=True)
    c0 = cfgs[0]
    ex = slurm.make_slurm_executor(c0.cluster, folder / "submitit", c0.train.priority, c0.requeue)
    ex.update_parameters(job_name=f"xirang-sweep-{c0.train.name}")
    jobs = ex.map_array(run_training, [dataclasses.asdict(c) for c in cfgs], [str(d) for d in run_dirs],
                        [str(d) for d in data_dirs])
    array_id = str(jobs[0].job_id).split("_")[0]
    for i, (j, d) in enumerate(zip(jobs, run_dirs)):
        append_event(d, "submit", "submitted", job=str(j.job_id), array=array_id, task=i, cluster=c0.cluster.name)
    tasks: list[str | None] = [None] * len(all_dirs)
    for i, j in zip(todo, jobs):
        tasks[i] = str(j.job_id)
    return array_id, all_dirs, tasks


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
            print(f"follow it with: squeue -j {array_id}; xirang-status {run_dirs[0].parent}", flush=True)
        return [JobReturn(overrides=list(ov), cfg=c, hydra_cfg=self.config, working_dir=str(d),
                          task_name="xirang-train", status=JobStatus.COMPLETED, _return_value=task_of.get(d))
                for ov, c, d in zip(job_overrides, loaded, run_dirs)]

