"""Process-group start-up with a rendezvous that names the ranks that never arrived."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from collections.abc import Callable, Mapping
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from xirang_hpc.config.schema import ClusterConfig
from xirang_hpc.runtime import testpoint
from xirang_hpc.runtime.device import Device
from xirang_hpc.runtime.device import decide as decide_device
from xirang_hpc.runtime.topology import Topology, job_topology

log = logging.getLogger(__name__)


class RendezvousError(RuntimeError):
    """Not every rank reached the rendezvous in time."""


def pick_backend(requested: str, device: str = "") -> str:
    """The process group's backend for ``device`` (this rank's, or the one ``auto`` finds): ``requested`` unless
    ``auto``, else torch's map of device type to backend, with gloo beside it for CPU tensors on an accelerator."""
    dev = Device.parse(device) if device else decide_device("auto", 0, requested)
    return dev.backend(requested)


def _wait_for_all(store: dist.TCPStore, topo: Topology, port: int, timeout_s: float) -> None:
    """Every rank checks in under ``arrived/<rank>``; rank 0 reports who is missing."""
    store.set(f"arrived/{topo.rank}", topo.node_name)
    deadline = time.monotonic() + timeout_s
    while True:
        n = store.add("arrived_count", 0)
        if n >= topo.world_size:
            return
        if time.monotonic() > deadline:
            missing = [r for r in range(topo.world_size) if not store.check([f"arrived/{r}"])]
            raise RendezvousError(
                f"rendezvous at {topo.master_addr}:{port} timed out after {timeout_s:.0f}s: "
                f"ranks {missing} of {topo.world_size} never arrived (job {topo.job_id})"
            )
        time.sleep(0.05)


def _port_file(rendezvous_dir: Path, topo: Topology) -> Path:
    return rendezvous_dir / f"rendezvous-{topo.job_id}.json"


def _connect_published(rendezvous_dir: Path, topo: Topology, timeout_s: float) -> tuple[dist.TCPStore, int]:
    """Connect to the port rank 0 published (local jobs only).

    A file left by an earlier attempt of the same job may name a dead port: keep re-reading
    until a store answers or the deadline passes.
    """
    path = _port_file(rendezvous_dir, topo)
    deadline = time.monotonic() + timeout_s
    last = ""
    while time.monotonic() < deadline:
        try:
            port = int(json.loads(path.read_text())["port"])
            return _open_store(topo, port, min(5.0, timeout_s)), port
        except (OSError, ValueError, KeyError, RendezvousError) as exc:
            last = str(exc)
            time.sleep(0.1)
    raise RendezvousError(
        f"rank {topo.rank} on {topo.node_name}: rank 0 never published a live rendezvous port in {path} "
        f"within {timeout_s:.0f}s (job {topo.job_id}); last error: {last}"
    )


def _open_store(topo: Topology, port: int, timeout_s: float) -> dist.TCPStore:
    try:
        return dist.TCPStore(
            topo.master_addr,
            port,
            topo.world_size,
            is_master=topo.rank == 0,
            timeout=timedelta(seconds=timeout_s),
            wait_for_workers=False,
        )
    except (RuntimeError, dist.DistStoreError) as exc:
        who = "could not host it" if topo.rank == 0 else "rank 0 (the store host) never arrived"
        raise RendezvousError(
            f"rank {topo.rank} on {topo.node_name}: rendezvous at {topo.master_addr}:{port} "
            f"failed, {who} (job {topo.job_id}): {exc}"
        ) from exc


def init_distributed(
    topo: Topology, backend: str = "auto", timeout_s: float = 300.0, rendezvous_dir: Path | None = None
) -> str:
    """Start the default process group for ``topo``; returns the backend in use.

    Multi-host jobs meet on the port derived from the job id. Jobs on one host (the local
    executor) with a ``rendezvous_dir`` let rank 0 bind any free port and publish it there
    (a private run directory), so a port that happens to be taken cannot break the start.
    """
    device = Device.parse(topo.device)
    backend = device.backend(backend)
    if topo.world_size == 1 and dist.is_initialized():
        return backend
    port = topo.master_port
    if topo.source == "local" and rendezvous_dir is not None:
        if topo.rank == 0:
            rendezvous_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
            _port_file(rendezvous_dir, topo).unlink(missing_ok=True)
            store = _open_store(topo, 0, timeout_s)
            port = store.port
            tmp = _port_file(rendezvous_dir, topo).with_suffix(".tmp")
            tmp.write_text(json.dumps({"port": port, "pid": os.getpid()}))
            os.replace(tmp, _port_file(rendezvous_dir, topo))
        else:
            store, port = _connect_published(rendezvous_dir, topo, timeout_s)
    else:
        store = _open_store(topo, port, timeout_s)
    if topo.rank > 0:
        testpoint.pause("rendezvous")  # tests only: rank 0 is then waiting in the rendezvous
    store.add("arrived_count", 1)
    _wait_for_all(store, topo, port, timeout_s)
    device.set_current()  # before the group starts: its communicators bind to the current device
    dist.init_process_group(
        backend, store=store, rank=topo.rank, world_size=topo.world_size, timeout=timedelta(seconds=timeout_s)
    )
    log.info("rank %d/%d joined %s process group via %s:%d", topo.rank, topo.world_size, backend,
             topo.master_addr, port)
    return backend


def shutdown() -> None:
    """Destroy the default process group if one exists."""
    if dist.is_initialized():
        dist.destroy_process_group()


def cgroup_cpu_limit(path: Path = Path("/sys/fs/cgroup/cpu.max")) -> int | None:
    """CPUs the cgroup's quota allows (cgroup v2 ``cpu.max`` "quota period", rounded up); None: no quota."""
    try:
        quota, period = path.read_text().split()[:2]
    except (OSError, ValueError):
        return None
    if quota == "max":
        return None
    return max(1, -(-int(quota) // int(period)))


def usable_cpus() -> int:
    """CPUs this process may run on: its CPU set (Slurm's binding, a cgroup cpuset), capped by a CPU quota."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    limit = cgroup_cpu_limit()
    return min(cores, limit) if limit else cores


def threads_per_rank(requested: int, local_world: int, env: Mapping[str, str] | None = None,
                     cpus: int | None = None) -> int:
    """Torch intra-op threads for one rank: ``requested``, else the CPUs this rank is given.

    Under Slurm with ``--cpus-per-task=c`` a task bound to its own CPUs sees c of them (all are its own);
    one that sees more shares them with the node's other ranks and takes c at most. Elsewhere the node's
    usable CPUs are split between its ``local_world`` ranks. Never more threads than CPUs: oversubscribed
    OpenMP threads wait on each other at every parallel region.
    """
    if requested > 0:
        return requested
    env = os.environ if env is None else env
    cpus = usable_cpus() if cpus is None else cpus
    per_task = int(env.get("SLURM_CPUS_PER_TASK", "0") or 0)
    if per_task > 0 and cpus <= per_task:
        return cpus
    share = max(1, cpus // local_world)
    return min(share, per_task) if per_task > 0 else share


def start_job(cluster: ClusterConfig, rendezvous_dir: Path | None = None,
              before_join: Callable[[Topology], None] | None = None) -> Topology:
    """Join the job described by ``cluster``: topology (checked against it), torch threads, process group.

    Shared by the training job and the planner's calibration job, so both see the same
    topology and the same per-rank thread count. ``before_join`` runs once the topology is
    known (e.g. to set up logging with the rank). Pair with :func:`shutdown`.
    """
    topo = job_topology(cluster)
    # The one device decision: every consumer reads topo.device (and the Layout that carries it).
    topo = dataclasses.replace(topo, device=str(decide_device(cluster.device, topo.local_rank, cluster.backend)))
    if before_join is not None:
        before_join(topo)
    torch.set_num_threads(threads_per_rank(cluster.threads_per_rank, topo.local_world_size))
    init_distributed(topo, cluster.backend, rendezvous_dir=rendezvous_dir)
    return topo


def collective_seq() -> int | None:
    """Collectives issued so far on the world process group; None without one (or without the counter).

    Read from the heartbeat thread while the main thread may sit inside a collective: it only reads
    the group's counter (c10d increments it when a collective is issued).
    """
    try:
        from torch.distributed import distributed_c10d as c10d

        if not dist.is_available() or not dist.is_initialized():
            return None
        return int(c10d._get_default_group()._get_sequence_number_for_group())
    except Exception:  # noqa: BLE001 - a liveness probe never raises into the heartbeat thread
        return None


# Group name -> its global ranks; a group's members never change, so they are looked up once.
_group_ranks: dict[str, list[int]] = {}


def collective_progress() -> dict[str, tuple[int, list[int]]]:
    """Per process group this rank belongs to (size > 1): (collectives issued on it so far, its global ranks).

    c10d counts every collective a group issues, at issue time, in each backend (gloo, NCCL): the explicit
    reductions of the trainer, DDP's bucketed gradient all-reduce, FSDP2's and DTensor's all-gathers and
    reduce-scatters, pipeline sends. So the counts cover the collectives no wrapper can reach, and the
    rank whose count on a group is below its peers' has not entered the collective they entered. Group
    names are the same on every rank (c10d derives them from the order of creation, which every rank
    shares). Read from the heartbeat thread while the main thread may sit inside a collective: it only
    reads counters. Empty without a process group; never raises into the heartbeat thread.
    """
    out: dict[str, tuple[int, list[int]]] = {}
    try:
        from torch.distributed import distributed_c10d as c10d

        if not dist.is_available() or not dist.is_initialized():
            return out
        world = c10d._world
        for pg, name in list(world.pg_names.items()):
            ranks = _group_ranks.get(name)
            if ranks is None:
                ranks = _group_ranks[name] = sorted(dist.get_process_group_ranks(pg))
            if len(ranks) < 2:
                continue
            out[name] = (_issued(pg), ranks)
    except Exception:  # noqa: BLE001 - a liveness probe never raises into the heartbeat thread
        return out
    return out


def _issued(pg: dist.ProcessGroup) -> int:
    """Collectives issued on ``pg``, summed over its backends (gloo for CPU tensors beside NCCL on a GPU)."""
    total, seen = 0, False
    backends: list[object] = []
    for dev in getattr(pg, "_device_types", ()):
        try:
            backend = pg._get_backend(dev)
            if any(backend is b for b in backends):
                continue  # gloo serves both CPU and CUDA tensors: one backend, counted once
            backends.append(backend)
            total += int(backend._get_sequence_number_for_group())
            seen = True
        except Exception:  # noqa: BLE001 - a backend without the counter: the group's own below
            continue
    return total if seen else int(pg._get_sequence_number_for_group())
