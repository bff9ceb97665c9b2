"""Where this process sits: rank, node, local rank, and the rendezvous address.

Discovery order:
1. submitit's local executor (``SUBMITIT_LOCAL_*``), split into the *virtual* nodes of
   ``cluster/local`` so that node-aware code runs on one machine. Checked first because a
   local job started inside a Slurm allocation inherits ``SLURM_*`` variables that do not
   describe it.
2. Slurm (``SLURM_PROCID``, ``SLURM_LOCALID``, ``SLURM_NODEID``, ``SLURM_JOB_NUM_NODES``).
   Nodes come from ``SLURM_NODEID``, never from hostnames: on a one-machine testbed every
   node has the same hostname.
3. torchrun (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``GROUP_RANK``).
4. A single process.
"""

from __future__ import annotations

import hashlib
import os
import re
import socket
from collections.abc import Mapping
from dataclasses import dataclass

from xirang_hpc.config.schema import ClusterConfig


@dataclass(frozen=True)
class Topology:
    """This rank's place in the job."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    node_id: int
    num_nodes: int
    node_name: str
    master_addr: str
    master_port: int
    job_id: str
    source: str  # local | slurm | torchrun | single
    # This rank's device (``cuda:3``, ``cpu``): decided once at start-up (runtime/device.py, by start_job).
    device: str = "cpu"

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} outside world size {self.world_size}")
        if self.world_size != self.num_nodes * self.local_world_size:
            raise ValueError(
                f"world size {self.world_size} != {self.num_nodes} nodes x {self.local_world_size} "
                "ranks per node; xirang needs the same number of ranks on every node"
            )


# Rendezvous ports are derived in [PORT_BASE, PORT_BASE + PORT_SPAN): below Linux's default ephemeral range
# (net.ipv4.ip_local_port_range, 32768-60999), where any outgoing connection (gloo's pairs, store clients)
# may hold the very port a job derives and make its rank 0 fail to host the rendezvous (EADDRINUSE, seen
# on a busy node with a derived port of 38843).
PORT_BASE, PORT_SPAN = 20000, 12000


def rendezvous_port(job_id: str, cluster: str = "") -> int:
    """A port derived deterministically from the job id, in [20000, 32000) (:data:`PORT_BASE`, :data:`PORT_SPAN`).

    ``cluster`` (Slurm's ``SLURM_CLUSTER_NAME``) is part of the key: several Slurm clusters can run on
    one host (or share nodes) and each numbers its jobs from 1, so job 5 of ``alpha`` and job 5 of
    ``beta`` would otherwise meet on the same port. The cluster moves the job's port by a per-cluster
    offset, so the same job id on two clusters never gets the same port unless the two names' offsets
    coincide (checked for the names at hand by :func:`cluster_offset`).
    """
    base = int(hashlib.sha256(job_id.encode()).hexdigest()[:8], 16)
    return PORT_BASE + (base + cluster_offset(cluster)) % PORT_SPAN


def cluster_offset(cluster: str) -> int:
    """The port offset of a Slurm cluster name (0 without a name: the single-cluster ports are unchanged)."""
    if not cluster:
        return 0
    return int(hashlib.sha256(f"cluster:{cluster}".encode()).hexdigest()[:8], 16) % PORT_SPAN


def first_host(nodelist: str) -> str:
    """First host of a Slurm hostlist: ``n[3-5,9],m1`` -> ``n3``."""
    m = re.match(r"([^,\[]+)(?:\[([^\]]+)\])?", nodelist.strip())
    if not m:
        raise ValueError(f"cannot parse SLURM_JOB_NODELIST={nodelist!r}")
    prefix, ranges = m.group(1), m.group(2)
    if not ranges:
        return prefix
    first = ranges.split(",")[0].split("-")[0]
    return prefix + first


def _resolvable(host: str) -> bool:
    try:
        socket.gethostbyname(host)
        return True
    except OSError:
        return False


def discover(env: Mapping[str, str] | None = None, local_nodes: int = 1) -> Topology:
    """Build the :class:`Topology` of this process from its environment."""
    env = os.environ if env is None else env
    if "SUBMITIT_LOCAL_GLOBALID" in env:
        world = int(env["SUBMITIT_LOCAL_NTASKS"])
        rank = int(env["SUBMITIT_LOCAL_GLOBALID"])
        nodes = local_nodes if local_nodes >= 1 and world % local_nodes == 0 else 1
        per_node = world // nodes
        job = env["SUBMITIT_LOCAL_JOB_ID"]
        return Topology(
            rank=rank, world_size=world, local_rank=rank % per_node, local_world_size=per_node,
            node_id=rank // per_node, num_nodes=nodes, node_name=f"vnode{rank // per_node}",
            master_addr="127.0.0.1", master_port=rendezvous_port(job), job_id=job, source="local",
        )
    if "SLURM_PROCID" in env and "SLURM_JOB_ID" in env:
        # The step's counts and nodes first: an in-job restart runs a step on part of the allocation
        # (a spare node, or fewer nodes), where the job-level variables still describe all of it.
        world = int(env.get("SLURM_STEP_NUM_TASKS") or env.get("SLURM_NTASKS", env.get("SLURM_NPROCS", "1")))
        nodes = int(env.get("SLURM_STEP_NUM_NODES") or env.get("SLURM_JOB_NUM_NODES", env.get("SLURM_NNODES", "1")))
        job = env.get("SLURM_ARRAY_JOB_ID", env["SLURM_JOB_ID"])
        if "SLURM_ARRAY_TASK_ID" in env:
            job = f"{job}_{env['SLURM_ARRAY_TASK_ID']}"
        host = first_host(env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST",
                                                                    env.get("SLURM_NODELIST", "localhost")))
        # Each in-job restart attempt gets its own rendezvous port (the last one may linger).
        attempt = env.get("XIRANG_INJOB_ATTEMPT", "")
        port_key = f"{job}.{attempt}" if attempt not in ("", "0") else job
        # MASTER_ADDR/MASTER_PORT in a Slurm job are usually inherited from the submitting shell
        # (sbatch exports it) and would make array tasks on one node collide; only the explicit
        # XIRANG_MASTER_* variables override the job-derived values.
        # A testbed's virtual node names do not resolve; every node is this host there.
        # Several clusters number their jobs independently: the cluster name is part of the port's key.
        cluster = env.get("SLURM_CLUSTER_NAME", "")
        addr = env.get("XIRANG_MASTER_ADDR") or (host if _resolvable(host) else "127.0.0.1")
        return Topology(
            rank=int(env["SLURM_PROCID"]), world_size=world, local_rank=int(env.get("SLURM_LOCALID", "0")),
            local_world_size=world // nodes, node_id=int(env.get("SLURM_NODEID", "0")), num_nodes=nodes,
            node_name=env.get("SLURMD_NODENAME", host), master_addr=addr,
            master_port=int(env.get("XIRANG_MASTER_PORT") or rendezvous_port(port_key, cluster)), job_id=job,
            source="slurm",
        )
    if "RANK" in env and "WORLD_SIZE" in env:
        world = int(env["WORLD_SIZE"])
        per_node = int(env.get("LOCAL_WORLD_SIZE", world))
        return Topology(
            rank=int(env["RANK"]), world_size=world, local_rank=int(env.get("LOCAL_RANK", "0")),
            local_world_size=per_node, node_id=int(env.get("GROUP_RANK", "0")), num_nodes=world // per_node,
            node_name=socket.gethostname(), master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
            master_port=int(env.get("MASTER_PORT", "29500")), job_id=env.get("TORCHELASTIC_RUN_ID", "torchrun"),
            source="torchrun",
        )
    return Topology(
        rank=0, world_size=1, local_rank=0, local_world_size=1, node_id=0, num_nodes=1,
        node_name=socket.gethostname(), master_addr="127.0.0.1", master_port=rendezvous_port(str(os.getpid())),
        job_id=str(os.getpid()), source="single",
    )


class TopologyMismatchError(RuntimeError):
    """The processes the job was started with do not match ``cfg.cluster``."""


_SOURCE_VARS = {
    "local": "SUBMITIT_LOCAL_NTASKS and cluster/local's virtual nodes",
    "slurm": "SLURM_JOB_NUM_NODES and SLURM_NTASKS",
    "torchrun": "WORLD_SIZE and LOCAL_WORLD_SIZE",
    "single": "no launcher variables: one process",
}


def check_matches(topo: Topology, cluster: ClusterConfig) -> Topology:
    """Raise :class:`TopologyMismatchError` unless ``topo`` has ``cluster.nodes`` x ``cluster.tasks_per_node`` ranks.

    Validation and the parallel layout were derived from ``cfg.cluster``; a job started with other
    resources (an edited sbatch script, a torchrun with other counts) would silently train another layout.
    """
    if (topo.num_nodes, topo.local_world_size) != (cluster.nodes, cluster.tasks_per_node):
        raise TopologyMismatchError(
            f"this job runs {topo.num_nodes} node(s) x {topo.local_world_size} rank(s) per node (from "
            f"{_SOURCE_VARS.get(topo.source, topo.source)}), but the config asks for cluster.nodes={cluster.nodes} x "
            f"cluster.tasks_per_node={cluster.tasks_per_node}; start the job with the config's resources "
            f"(xirang-train / xirang-sbatch do) or set cluster.nodes={topo.num_nodes} "
            f"cluster.tasks_per_node={topo.local_world_size}"
        )
    return topo


def job_topology(cluster: ClusterConfig, env: Mapping[str, str] | None = None) -> Topology:
    """This rank's :class:`Topology` for a job described by ``cluster``, checked against it.

    The one place that turns a cluster config into a topology: the training job and the
    planner's calibration job both start here. On the local executor the ranks are split into
    ``cluster.nodes`` virtual nodes; elsewhere the nodes come from the launcher's variables.
    """
    local_nodes = cluster.nodes if cluster.executor == "local" else 1
    return check_matches(discover(env, local_nodes=local_nodes), cluster)
