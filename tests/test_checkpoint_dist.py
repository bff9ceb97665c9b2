"""Real gloo groups: sharded (DTensor) state saved by 2 ranks loads on 4 and back (hyperslab reads), and an
asynchronous save on its own gloo group commits while training collectives run on the default group."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from parallel_harness import free_port
from ranks import rank_context
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from xirang_hpc.checkpoint import layout as ckpt_layout
from xirang_hpc.checkpoint.manager import CheckpointManager

ROWS = 10  # not divisible by 4: uneven shards


def _full(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(ROWS, 6, generator=g), "v": torch.randn(ROWS, generator=g),
            "r": torch.randn(3, 3, generator=g)}


def _check_load(mgr: CheckpointManager, mesh, rank: int, world: int, step: int) -> None:
    full = _full(step)
    zeros = {"w": distribute_tensor(torch.zeros(ROWS, 6), mesh, [Shard(0)]),
             "v": distribute_tensor(torch.zeros(ROWS), mesh, [Shard(0)]), "r": torch.zeros(3, 3)}
    res = mgr.load({"model": zeros})
    assert res is not None and res.step == step, res
    for k in ("w", "v"):
        want = distribute_tensor(full[k], mesh, [Shard(0)]).to_local()
        assert isinstance(zeros[k], DTensor) and torch.equal(zeros[k].to_local(), want), (rank, k)
    assert torch.equal(zeros["r"], full["r"])
    saved_world = len(ckpt_layout.read_manifest(res.path)["files"]) // 2 - 1  # rank_i.h5 + rank_i.json, state, metadata
    assert res.rank_state == ({"rank": rank} if rank < saved_world else None)


def _worker(rank: int, world: int, port: int, root: str, mode: str, step: int, errq) -> None:
    try:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=world)
        mesh = init_device_mesh("cpu", (world,))
        group = dist.new_group(backend="gloo")  # the checkpoint's own group
        mgr = CheckpointManager(Path(root), rank=rank, world_size=world, group=group, async_save=True)
        if mode == "load+save":
            _check_load(mgr, mesh, rank, world, step - 1)
        full = _full(step)
        if mode in ("save", "load+save"):
            sd = {"w": distribute_tensor(full["w"].clone(), mesh, [Shard(0)]),
                  "v": distribute_tensor(full["v"].clone(), mesh, [Shard(0)]), "r": full["r"].clone()}
            mgr.save(step, {"model": sd}, state={"step": step}, rank_state={"rank": rank})
            # Training goes on: collectives on the default group and in-place updates while the save persists.
            for _ in range(20):
                x = torch.ones(1000)
                dist.all_reduce(x)
                sd["w"].to_local().add_(1.0)
                sd["r"].add_(1.0)
            mgr.wait()
        else:
            _check_load(mgr, mesh, rank, world, step)
        dist.barrier()
        dist.destroy_process_group()
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        errq.put(f"rank {rank}: {type(exc).__name__}: {exc}")
        raise


def _run(world: int, root: Path, mode: str, step: int) -> None:
    ctx = rank_context()
    errq = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, world, port, str(root), mode, step, errq)) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(180)
    errors = []
    while not errq.empty():
        errors.append(errq.get())
    assert [p.exitcode for p in procs] == [0] * world, errors


@pytest.mark.slow
def test_sharded_state_reshards_2_to_4_and_4_to_2(tmp_path):
    root = tmp_path / "ckpt"
    _run(2, root, "save", 1)  # async save on 2 ranks under concurrent training traffic
    m = ckpt_layout.verify(root / "step_1")
    assert set(m["files"]) >= {"rank_0.h5", "rank_1.h5", "rank_0.json", "rank_1.json"}
    _run(4, root, "load+save", 2)  # 2 -> 4 (each rank reads a hyperslab of one saved shard), then save on 4
    _run(2, root, "load", 2)  # 4 -> 2
