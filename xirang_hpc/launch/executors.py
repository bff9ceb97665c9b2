"""Cluster config -> submitit executor. The same job function runs under both."""

from __future__ import annotations

from pathlib import Path

import submitit

from xirang_hpc.config.schema import ClusterConfig


def make_executor(c: ClusterConfig, folder: Path) -> submitit.Executor:
    """A submitit executor for ``c`` that keeps its files under ``folder``."""
    if c.executor == "local":
        ex = submitit.LocalExecutor(folder=folder)
        # The local executor runs one node; virtual nodes are carved out inside the job.
        ex.update_parameters(tasks_per_node=c.world_size, timeout_min=c.time_min,
                             signal_delay_s=min(c.signal_delay_s, 60 * c.time_min // 2))
        return ex
    ex = submitit.SlurmExecutor(folder=folder, max_num_timeout=0)
    params: dict[str, object] = {
        "nodes": c.nodes,
        "ntasks_per_node": c.tasks_per_node,
        "cpus_per_task": c.cpus_per_task,
        "time": c.time_min,
        "signal_delay_s": c.signal_delay_s,
        "array_parallelism": c.array_parallelism,
    }
    if c.gpus_per_node:
        params["gpus_per_node"] = c.gpus_per_node
    if c.mem_gb:
        params["mem"] = f"{int(c.mem_gb * 1024)}M"
    for key in ("partition", "qos", "account", "constraint", "exclude"):
        if getattr(c, key):
            params[key] = getattr(c, key)
    if c.setup:
        params["setup"] = list(c.setup)
    if c.srun_args:
        params["srun_args"] = list(c.srun_args)
    ex.update_parameters(**params)
    return ex
