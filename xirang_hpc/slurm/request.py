"""What a job asks Slurm for, built once from the config: :class:`SlurmRequest`.

Every submission path reads it: the training job and its array (submitit's parameters), a pipeline stage
(:meth:`SlurmRequest.stage`), the placement estimate (``sbatch --test-only``), the quota check (its totals)
and ``xirang-sbatch``'s rendered script. One mapping, so the paths cannot drift apart: the spare nodes an
in-job restart needs are counted everywhere, a stage job keeps the memory and node constraints of the
cluster, and the partition/QOS of ``train.priority`` is decided once.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from xirang_hpc.config.errors import ConfigError
from xirang_hpc.config.schema import ClusterConfig
from xirang_hpc.config.validate import scheduling_class


def setup_lines(c: ClusterConfig) -> tuple[str, ...]:
    """The batch script's lines before the ranks start: the ranks' environment, then ``cluster.setup``."""
    return (*(f"export {k}={v}" for k, v in c.rank_environment().items()), *c.setup)


@dataclass(frozen=True)
class SlurmRequest:
    """One job's request: shape, limits, scheduling class, placement constraints."""

    nodes: int  # allocated nodes: the layout's plus the spare ones (idle until an in-job restart needs one)
    ntasks_per_node: int
    cpus_per_task: int
    time_min: int
    signal_delay_s: int
    gpus_per_node: int = 0
    mem_mb: int = 0  # per node; 0: the cluster's default share
    partition: str = ""
    qos: str = ""
    account: str = ""
    constraint: str = ""
    exclude: str = ""
    backfill_min_min: int = 0  # sbatch --time-min: backfill may start the job with this much time
    cluster: str = ""  # sbatch -M: one Slurm cluster of several (a site); '' for this one
    array_parallelism: int = 256
    setup: tuple[str, ...] = ()
    srun_args: tuple[str, ...] = ()

    @classmethod
    def from_cluster(cls, c: ClusterConfig, priority: str = "normal", cluster: str = "") -> SlurmRequest:
        """The request of a training job on ``c`` at ``train.priority`` (refusing limits that cannot work)."""
        if c.min_time_min < 0 or c.min_time_min > c.time_min:
            raise ConfigError("cluster.min_time_min", c.min_time_min,
                              f"use 0 (unset) or a value <= cluster.time_min={c.time_min}")
        if c.signal_delay_s >= 60 * c.time_min:
            raise ConfigError("cluster.signal_delay_s", c.signal_delay_s,
                              f"must be shorter than the time limit ({60 * c.time_min}s); "
                              "lower it or raise cluster.time_min")
        if c.min_time_min and c.signal_delay_s >= 60 * c.min_time_min:
            # Backfill may cut the limit to --time-min: the USR2 warning must still come after the start.
            raise ConfigError("cluster.min_time_min", c.min_time_min,
                              f"backfill may give the job only {c.min_time_min} min, no longer than the "
                              f"cluster.signal_delay_s={c.signal_delay_s} s warning before the limit; use "
                              f"cluster.min_time_min={c.signal_delay_s // 60 + 1} or more, or a shorter "
                              "signal_delay_s")
        partition, qos = scheduling_class(c, priority)
        backfill = c.min_time_min
        if not backfill and priority == "exploratory":
            # Requeue makes a short allocation safe: let backfill start it in any gap >= a quarter of the limit
            # (and longer than the USR2 warning, which must come after the start).
            backfill = min(c.time_min, max(c.time_min // 4, c.signal_delay_s // 60 + 1))
        return cls(nodes=c.nodes + c.spare_nodes, ntasks_per_node=c.tasks_per_node, cpus_per_task=c.cpus_per_task,
                   time_min=c.time_min, signal_delay_s=c.signal_delay_s, gpus_per_node=c.gpus_per_node,
                   mem_mb=int(c.mem_gb * 1024) if c.mem_gb else 0, partition=partition or "", qos=qos or "",
                   account=c.account or "", constraint=c.constraint or "", exclude=c.exclude or "",
                   backfill_min_min=backfill, cluster=cluster, array_parallelism=c.array_parallelism,
                   setup=setup_lines(c),
                   srun_args=tuple(c.srun_args))

    def stage(self) -> SlurmRequest:
        """A one-task job of a pipeline stage (prepare, eval, serve): one node of the same kind (memory,
        constraint, exclusions, scheduling class), no spare nodes, no GPUs, no srun arguments of the ranks."""
        return dataclasses.replace(self, nodes=1, ntasks_per_node=1, cpus_per_task=max(1, self.cpus_per_task),
                                   gpus_per_node=0, backfill_min_min=0, srun_args=())

    @property
    def total_cpus(self) -> int:
        """CPUs the whole allocation holds (quotas count them)."""
        return self.nodes * self.ntasks_per_node * self.cpus_per_task

    @property
    def total_gpus(self) -> int:
        """GPUs the whole allocation holds."""
        return self.nodes * self.gpus_per_node

    def sbatch_args(self) -> list[str]:
        """The request as ``sbatch`` options (``--test-only`` placement estimates use them as they are)."""
        args = [f"--nodes={self.nodes}", f"--ntasks-per-node={self.ntasks_per_node}",
                f"--cpus-per-task={self.cpus_per_task}", f"--time={self.time_min}"]
        if self.cluster:
            args.insert(0, f"--clusters={self.cluster}")
        for flag, value in (("--partition", self.partition), ("--qos", self.qos), ("--account", self.account),
                            ("--gpus-per-node", self.gpus_per_node), ("--constraint", self.constraint),
                            ("--exclude", self.exclude), ("--time-min", self.backfill_min_min)):
            if value:
                args.append(f"{flag}={value}")
        if self.mem_mb:
            args.append(f"--mem={self.mem_mb}M")
        return args

    def submitit_params(self, requeue: bool = True) -> dict[str, Any]:
        """submitit ``SlurmExecutor`` parameters (names as in submitit's ``_make_sbatch_string``)."""
        params: dict[str, Any] = {"nodes": self.nodes, "ntasks_per_node": self.ntasks_per_node,
                                  "cpus_per_task": self.cpus_per_task, "time": self.time_min,
                                  "signal_delay_s": self.signal_delay_s, "array_parallelism": self.array_parallelism,
                                  "stderr_to_stdout": False}
        extra: dict[str, Any] = {"requeue": True} if requeue else {}
        if self.backfill_min_min:
            extra["time_min"] = self.backfill_min_min
        if self.gpus_per_node:
            params["gpus_per_node"] = self.gpus_per_node
        if self.mem_mb:
            params["mem"] = f"{self.mem_mb}M"
        for key in ("partition", "qos", "account", "constraint", "exclude"):
            if getattr(self, key):
                params[key] = getattr(self, key)
        if self.setup:
            params["setup"] = list(self.setup)
        if self.srun_args:
            params["srun_args"] = list(self.srun_args)
        params["additional_parameters"] = extra
        return params
