"""Cluster config -> submitit executor. The same job function runs under both."""

from __future__ import annotations

from pathlib import Path

import submitit

from xirang_hpc.config.schema import ClusterConfig
from xirang_hpc.local import controller as local_controller
from xirang_hpc.local import preload
from xirang_hpc.submit.slurm import make_slurm_executor


def local_python(c: ClusterConfig) -> str | None:
    """The command the local executor starts each task with: through the job's fork server when
    ``cluster.preload`` and the job has more than one rank, else None (submitit's default, this interpreter).
    One rank gains nothing from it (the server imports what the rank would), and single-rank runs with two
    intra-op threads were seen to take more CPU forked than fresh on a loaded machine."""
    return preload.command() if c.preload and c.world_size > 1 else None


def make_executor(c: ClusterConfig, folder: Path, watch_pid: int | None = None) -> submitit.Executor:
    """A submitit executor for ``c`` that keeps its files under ``folder``.

    Locally, ``watch_pid`` is the launcher that follows the job: when it dies, the job stops after a final
    checkpoint (local/controller.py).
    """
    if c.executor == "local":
        ex = local_controller.LocalExecutor(folder=folder, python=local_python(c), watch_pid=watch_pid,
                                            grace_s=max(60.0, float(c.signal_delay_s)),
                                            rank_env=c.rank_environment())
        # The local executor runs one node; virtual nodes are carved out inside the job.
        ex.update_parameters(tasks_per_node=c.world_size, timeout_min=c.time_min,
                             signal_delay_s=min(c.signal_delay_s, 60 * c.time_min // 2))
        return ex
    # One mapping from the cluster config to sbatch flags, shared with xirang-sbatch.
    return make_slurm_executor(c, folder)
