"""Topology discovery from Slurm, submitit-local (virtual nodes) and torchrun environments."""

from __future__ import annotations

import pytest

from xirang_hpc.config.schema import ClusterConfig
from xirang_hpc.runtime.topology import (
    TopologyMismatchError,
    discover,
    first_host,
    job_topology,
    rendezvous_port,
)


def test_slurm_env_uses_node_ids_not_hostnames() -> None:
    env = {
        "SLURM_JOB_ID": "42", "SLURM_PROCID": "3", "SLURM_LOCALID": "1", "SLURM_NODEID": "1",
        "SLURM_NTASKS": "4", "SLURM_JOB_NUM_NODES": "2", "SLURMD_NODENAME": "n2",
        "SLURM_JOB_NODELIST": "n[1-2]",
    }
    t = discover(env)
    assert (t.rank, t.local_rank, t.node_id, t.num_nodes, t.local_world_size) == (3, 1, 1, 2, 2)
    assert t.node_name == "n2" and t.source == "slurm"
    # Testbed node names do not resolve: every node is this host.
    assert t.master_addr == "127.0.0.1"
    assert t.master_port == rendezvous_port("42")


def test_array_task_gets_its_own_port() -> None:
    base = {"SLURM_JOB_ID": "50", "SLURM_PROCID": "0", "SLURM_NTASKS": "1", "SLURM_JOB_NUM_NODES": "1",
            "SLURM_JOB_NODELIST": "localhost", "SLURM_ARRAY_JOB_ID": "49"}
    a = discover({**base, "SLURM_ARRAY_TASK_ID": "0"})
    b = discover({**base, "SLURM_ARRAY_TASK_ID": "1"})
    assert a.job_id == "49_0" and b.job_id == "49_1" and a.master_port != b.master_port


def test_same_job_id_on_two_clusters_gets_two_ports() -> None:
    # Two Slurm clusters on one host (the two-cluster testbed) both number their jobs from 1: job 7 of
    # alpha and job 7 of beta run side by side and must not meet on one rendezvous port.
    base = {"SLURM_PROCID": "0", "SLURM_NTASKS": "1", "SLURM_JOB_NUM_NODES": "1", "SLURM_JOB_NODELIST": "localhost"}
    for job in [str(i) for i in range(1, 500)] + ["49_0"]:
        jid = {"SLURM_JOB_ID": job} if "_" not in job else {"SLURM_JOB_ID": "60", "SLURM_ARRAY_JOB_ID": "49",
                                                               "SLURM_ARRAY_TASK_ID": "0"}
        a = discover({**base, **jid, "SLURM_CLUSTER_NAME": "alpha"})
        b = discover({**base, **jid, "SLURM_CLUSTER_NAME": "beta"})
        assert a.job_id == b.job_id and a.master_port != b.master_port, job
        assert 20000 <= a.master_port < 32000 and 20000 <= b.master_port < 32000
    # Without a cluster name (one cluster), the port is the job id's alone, as before.
    assert discover({**base, "SLURM_JOB_ID": "42"}).master_port == rendezvous_port("42")
    assert rendezvous_port("42", "alpha") != rendezvous_port("42")


def test_local_executor_virtual_nodes() -> None:
    env = {"SUBMITIT_LOCAL_GLOBALID": "2", "SUBMITIT_LOCAL_NTASKS": "4", "SUBMITIT_LOCAL_JOB_ID": "777",
           # Inherited from an enclosing allocation: must not win over the local executor.
           "SLURM_JOB_ID": "1", "SLURM_PROCID": "0"}
    t = discover(env, local_nodes=2)
    assert (t.rank, t.node_id, t.local_rank, t.num_nodes, t.node_name) == (2, 1, 0, 2, "vnode1")
    assert t.source == "local"


def test_torchrun_env() -> None:
    env = {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4", "GROUP_RANK": "1",
           "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29400"}
    t = discover(env)
    assert (t.rank, t.node_id, t.local_rank, t.num_nodes, t.master_port) == (5, 1, 1, 2, 29400)


def test_single_process_fallback() -> None:
    t = discover({})
    assert t.world_size == 1 and t.source == "single"


def test_uneven_nodes_are_rejected() -> None:
    with pytest.raises(ValueError, match="same number of ranks"):
        discover({"SLURM_JOB_ID": "1", "SLURM_PROCID": "0", "SLURM_NTASKS": "3", "SLURM_JOB_NUM_NODES": "2"})


@pytest.mark.parametrize("nodelist, host", [("n[3-5,9],m1", "n3"), ("gpu01", "gpu01"), ("a[07],b", "a07"),
                                             ("node-[1-2]", "node-1")])
def test_first_host(nodelist: str, host: str) -> None:
    assert first_host(nodelist) == host


def test_port_is_deterministic_and_in_range() -> None:
    assert rendezvous_port("123") == rendezvous_port("123")
    # Below Linux's default ephemeral range (32768-60999): no outgoing connection can hold a derived port.
    assert all(20000 <= rendezvous_port(str(i), c) < 32000 for i in range(2000) for c in ("", "alpha", "beta"))


def test_inherited_master_port_does_not_leak_into_slurm_jobs() -> None:
    # sbatch exports the submitter's environment: a MASTER_PORT set there must not make every
    # array task on a node use the same port.
    base = {"SLURM_JOB_ID": "50", "SLURM_PROCID": "0", "SLURM_NTASKS": "1", "SLURM_JOB_NUM_NODES": "1",
            "SLURM_JOB_NODELIST": "localhost", "SLURM_ARRAY_JOB_ID": "49", "MASTER_PORT": "45603",
            "MASTER_ADDR": "10.9.9.9"}
    a = discover({**base, "SLURM_ARRAY_TASK_ID": "0"})
    b = discover({**base, "SLURM_ARRAY_TASK_ID": "1"})
    assert a.master_port != b.master_port and 45603 not in (a.master_port, b.master_port)
    assert a.master_addr != "10.9.9.9"
    assert discover({**base, "XIRANG_MASTER_PORT": "31000"}).master_port == 31000


def _cluster(executor: str, nodes: int, per_node: int) -> ClusterConfig:
    return ClusterConfig(name="t", executor=executor, nodes=nodes, tasks_per_node=per_node)


def test_job_topology_splits_local_ranks_into_the_configured_nodes() -> None:
    env = {"SUBMITIT_LOCAL_GLOBALID": "3", "SUBMITIT_LOCAL_NTASKS": "4", "SUBMITIT_LOCAL_JOB_ID": "9"}
    topo = job_topology(_cluster("local", 2, 2), env)
    assert (topo.num_nodes, topo.local_world_size, topo.node_id, topo.local_rank) == (2, 2, 1, 1)


def test_job_topology_refuses_a_slurm_job_started_with_other_resources() -> None:
    env = {"SLURM_PROCID": "0", "SLURM_JOB_ID": "77", "SLURM_NTASKS": "4", "SLURM_JOB_NUM_NODES": "2",
           "SLURM_NODEID": "0", "SLURM_LOCALID": "0", "SLURM_JOB_NODELIST": "n[1-2]"}
    assert job_topology(_cluster("slurm", 2, 2), env).world_size == 4
    with pytest.raises(TopologyMismatchError) as err:
        job_topology(_cluster("slurm", 4, 1), env)
    msg = str(err.value)
    # Both counts, where the job's came from, and the fix.
    assert "2 node(s) x 2 rank(s)" in msg and "SLURM_JOB_NUM_NODES" in msg
    assert "cluster.nodes=4" in msg and "cluster.nodes=2 cluster.tasks_per_node=2" in msg


def test_job_topology_refuses_a_local_job_with_another_rank_count() -> None:
    env = {"SUBMITIT_LOCAL_GLOBALID": "0", "SUBMITIT_LOCAL_NTASKS": "2", "SUBMITIT_LOCAL_JOB_ID": "9"}
    with pytest.raises(TopologyMismatchError, match="cluster.tasks_per_node=2"):
        job_topology(_cluster("local", 2, 2), env)
