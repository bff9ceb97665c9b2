"""Each rank's torch threads come from the CPUs it is given; OpenMP's wait policy reaches the ranks."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from xirang_hpc.config.errors import ConfigError
from xirang_hpc.config.schema import ClusterConfig
from xirang_hpc.runtime.dist import cgroup_cpu_limit, threads_per_rank


@pytest.mark.unit
@pytest.mark.parametrize("requested,local_world,env,cpus,want", [
    (3, 4, {}, 16, 3),  # asked for: taken as it is
    (0, 4, {}, 16, 4),  # no Slurm: the node's CPUs shared by its ranks
    (0, 3, {}, 2, 1),  # never 0
    (0, 4, {"SLURM_CPUS_PER_TASK": "6"}, 6, 6),  # bound to its own 6 CPUs: all of them
    (0, 4, {"SLURM_CPUS_PER_TASK": "2"}, 16, 2),  # sees the node: takes its allocation, not a quarter of the node
    (0, 4, {"SLURM_CPUS_PER_TASK": "8"}, 16, 4),  # ... nor more than its share of what it sees
])
def test_threads_follow_the_cpus_a_rank_is_given(requested: int, local_world: int, env: dict, cpus: int,
                                                 want: int) -> None:
    assert threads_per_rank(requested, local_world, env=env, cpus=cpus) == want


@pytest.mark.unit
def test_a_cgroup_cpu_quota_caps_the_cpus(tmp_path: Path) -> None:
    f = tmp_path / "cpu.max"
    f.write_text("250000 100000\n")  # 2.5 CPUs of quota -> 3 threads' worth
    assert cgroup_cpu_limit(f) == 3
    f.write_text("max 100000\n")
    assert cgroup_cpu_limit(f) is None
    assert cgroup_cpu_limit(tmp_path / "absent") is None


@pytest.mark.unit
def test_the_wait_policy_is_validated_and_exported() -> None:
    assert ClusterConfig().rank_environment() == {"OMP_WAIT_POLICY": "PASSIVE"}
    assert ClusterConfig(omp_wait_policy="active").rank_environment() == {"OMP_WAIT_POLICY": "ACTIVE"}
    assert ClusterConfig(omp_wait_policy="inherit").rank_environment() == {}
    with pytest.raises(ConfigError, match="cluster.omp_wait_policy"):
        ClusterConfig(omp_wait_policy="spin")


@pytest.mark.unit
def test_the_batch_script_exports_it_before_the_setup_lines() -> None:
    from xirang_hpc.slurm.request import SlurmRequest

    req = SlurmRequest.from_cluster(ClusterConfig(executor="slurm", setup=["module load cuda"]), "normal")
    assert req.setup == ("export OMP_WAIT_POLICY=PASSIVE", "module load cuda")


@pytest.mark.slow
def test_a_local_task_starts_with_the_policy(tmp_path: Path) -> None:
    """A real task of the local executor (its own controller process) sees the variable."""
    from xirang_hpc.submit.executors import make_executor

    ex = make_executor(ClusterConfig(omp_wait_policy="active", preload=False), tmp_path / "jobs")
    assert ex.submit(os.getenv, "OMP_WAIT_POLICY").result() == "ACTIVE"  # os.getenv: pickled by reference
