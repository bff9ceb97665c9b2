"""Process-group start-up with a rendezvous that names the ranks that never arrived."""

from __future__ import annotations

import logging
import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from xirang_hpc.runtime.topology import Topology

log = logging.getLogger(__name__)


class RendezvousError(RuntimeError):
    """Not every rank reached the rendezvous in time."""


def pick_backend(requested: str) -> str:
    """``auto`` -> nccl when CUDA is usable, else gloo."""
    if requested != "auto":
        return requested
    return "nccl" if torch.cuda.is_available() else "gloo"


def _wait_for_all(store: dist.TCPStore, topo: Topology, timeout_s: float) -> None:
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
                f"rendezvous at {topo.master_addr}:{topo.master_port} timed out after {timeout_s:.0f}s: "
                f"ranks {missing} of {topo.world_size} never arrived (job {topo.job_id})"
            )
        time.sleep(0.05)


def init_distributed(topo: Topology, backend: str = "auto", timeout_s: float = 300.0) -> str:
    """Start the default process group for ``topo``; returns the backend in use."""
    backend = pick_backend(backend)
    if topo.world_size == 1 and dist.is_initialized():
        return backend
    os.environ.setdefault("MASTER_ADDR", topo.master_addr)
    os.environ.setdefault("MASTER_PORT", str(topo.master_port))
    try:
        store = dist.TCPStore(
            topo.master_addr,
            topo.master_port,
            topo.world_size,
            is_master=topo.rank == 0,
            timeout=timedelta(seconds=timeout_s),
            wait_for_workers=False,
        )
    except (RuntimeError, dist.DistStoreError) as exc:
        who = "could not host it" if topo.rank == 0 else "rank 0 (the store host) never arrived"
        raise RendezvousError(
            f"rank {topo.rank} on {topo.node_name}: rendezvous at {topo.master_addr}:{topo.master_port} "
            f"failed, {who} (job {topo.job_id}): {exc}"
        ) from exc
    store.add("arrived_count", 1)
    _wait_for_all(store, topo, timeout_s)
    if backend == "nccl":
        torch.cuda.set_device(topo.local_rank)
    dist.init_process_group(
        backend, store=store, rank=topo.rank, world_size=topo.world_size, timeout=timedelta(seconds=timeout_s)
    )
    log.info("rank %d/%d joined %s process group via %s:%d", topo.rank, topo.world_size, backend,
             topo.master_addr, topo.master_port)
    return backend


def shutdown() -> None:
    """Destroy the default process group if one exists."""
    if dist.is_initialized():
        dist.destroy_process_group()
