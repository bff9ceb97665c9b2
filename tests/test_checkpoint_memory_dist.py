"""Recovery from memory across real processes and gloo groups: 4 ranks on 2 "nodes" keep their sharded state
in node-local memory with replicas, are killed (SIGKILL), and new processes restore it -- same layout, after
losing a node (shrunk to its survivor, the lost node's directory deleted), and on a spare node that holds
nothing (the bundles move over the new process group) -- bitwise equal to the filesystem restore."""

from __future__ import annotations

import os
import shutil
import signal
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from parallel_harness import free_port
from ranks import rank_context
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from xirang_hpc.checkpoint.manager import CheckpointManager, LoadResult
from xirang_hpc.checkpoint.memory import MemoryStore

ROWS = 10  # uneven shards over 4 and 3 ranks


def _full(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(ROWS, 6, generator=g), "v": torch.randn(ROWS, generator=g),
            "r": torch.randn(3, 3, generator=g)}


def _sharded(full: dict[str, torch.Tensor], mesh) -> dict:
    return {"model": {"w": distribute_tensor(full["w"].clone(), mesh, [Shard(0)]),
                      "v": distribute_tensor(full["v"].clone(), mesh, [Shard(0)]), "r": full["r"].clone()}}


def _worker(rank: int, nodes: list[str], port: int, root: str, shm: str, mode: str, errq, outq) -> None:
    try:
        world = len(nodes)
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=world)
        mesh = init_device_mesh("cpu", (world,))
        group = dist.new_group(backend="gloo")
        store = MemoryStore(Path(shm), node=nodes[rank], rank=rank, world_size=world, group=group)
        mgr = CheckpointManager(Path(root), rank=rank, world_size=world, group=group, async_save=True, memory=store)
        if mode == "save":
            sd = _sharded(_full(4), mesh)
            mgr.save(4, sd, state={"step": 4}, rank_state={"rank": rank}, to_memory=True)  # disk + memory
            mgr.wait()
            sd = _sharded(_full(6), mesh)
            mgr.save(6, sd, state={"step": 6}, rank_state={"rank": rank}, to_memory=True)
            mgr.wait()
            dist.barrier()
            os.kill(os.getpid(), signal.SIGKILL)  # the training processes die; node memory stays
        mem = _sharded({k: torch.zeros_like(v) for k, v in _full(0).items()}, mesh)
        res = mgr.load_memory(mem, fs_step=6)
        assert isinstance(res, LoadResult), res
        disk = _sharded({k: torch.zeros_like(v) for k, v in _full(0).items()}, mesh)
        fs = mgr.load(disk)  # the filesystem path at the same step
        assert fs is not None and fs.step == 6 and fs.state == res.state and fs.rank_state == res.rank_state
        want = _sharded(_full(6), mesh)
        for k in ("w", "v"):
            assert torch.equal(mem["model"][k].to_local(), disk["model"][k].to_local()), (rank, k)
            assert torch.equal(mem["model"][k].to_local(), want["model"][k].to_local()), (rank, k)
        assert torch.equal(mem["model"]["r"], disk["model"]["r"])
        outq.put((rank, res.step, res.state, res.rank_state, res.local_bytes, res.received_bytes))
        dist.barrier()
        dist.destroy_process_group()
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        errq.put(f"rank {rank}: {type(exc).__name__}: {exc}")
        raise


def _run(nodes: list[str], root: Path, shm: Path, mode: str) -> tuple[list[int | None], list]:
    ctx = rank_context()
    errq, outq = ctx.Queue(), ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, nodes, port, str(root), str(shm), mode, errq, outq))
             for r in range(len(nodes))]
    for p in procs:
        p.start()
    for p in procs:
        p.join(240)
    errors = []
    while not errq.empty():
        errors.append(errq.get())
    out = []
    while not outq.empty():
        out.append(outq.get())
    assert not errors, errors
    return [p.exitcode for p in procs], sorted(out)


@pytest.mark.slow
def test_memory_restore_after_sigkill_node_loss_and_on_a_spare_node(tmp_path):
    root, shm = tmp_path / "ckpt", tmp_path / "shm"
    codes, _ = _run(["n1", "n1", "n2", "n2"], root, shm, "save")
    assert codes == [-signal.SIGKILL] * 4
    assert sorted(p.name for p in (shm / "n1" / "step_6").glob("bundle_*.json")) == [
        f"bundle_{i}.json" for i in range(4)]  # own bundles 0, 1 and the replicas of 2, 3

    saved = shm.parent / "shm-saved"
    shutil.copytree(shm, saved)
    # Same layout, new processes: each node reads only its own directory; nothing moves.
    codes, out = _run(["n1", "n1", "n2", "n2"], root, shm, "load")
    assert codes == [0] * 4
    assert [(r, s, st, rs, recv) for r, s, st, rs, _, recv in out] == [
        (r, 6, {"step": 6}, {"rank": r}, 0) for r in range(4)]

    # Node n2 lost: its directory is gone; the survivor restores the shrunk 2-rank layout from memory.
    shutil.rmtree(shm)
    shutil.copytree(saved, shm)
    shutil.rmtree(shm / "n2")
    codes, out = _run(["n1", "n1"], root, shm, "load")
    assert codes == [0] * 2 and [(r, s, recv) for r, s, _, _, _, recv in out] == [(0, 6, 0), (1, 6, 0)]

    # Node n2 lost and a spare n3 (empty memory) joins: n3 receives every bundle over the process group.
    shutil.rmtree(shm)
    shutil.copytree(saved, shm)
    shutil.rmtree(shm / "n2")
    codes, out = _run(["n1", "n1", "n3", "n3"], root, shm, "load")
    assert codes == [0] * 4
    recv = {r: b for r, _, _, _, _, b in out}
    assert recv[0] == recv[1] == recv[3] == 0 and recv[2] > 0  # one receiver per node
    assert sorted(p.name for p in (shm / "n3" / "step_6").glob("bundle_*.json")) == [
        f"bundle_{i}.json" for i in range(4)]


# ---- through the real job function: kill -9 of every rank, restart from memory, same weights ----------------

def _job_rank(rank: int, world: int, job: str, cfg: dict, run_dir: str, data_dir: str, kill_at: int) -> None:
    os.environ.update(SUBMITIT_LOCAL_GLOBALID=str(rank), SUBMITIT_LOCAL_LOCALID=str(rank),
                      SUBMITIT_LOCAL_NTASKS=str(world), SUBMITIT_LOCAL_JOB_ID=job)
    from xirang_hpc.job import training as jobmod
    from xirang_hpc.runtime.hooks import TrainerHook

    if kill_at:
        class KillAt(TrainerHook):  # once the checkpoint hook's memory save of this step is complete
            def on_step_end(self, trainer, metrics):
                if trainer.state.step >= kill_at:
                    for h in trainer.hooks:
                        if getattr(h, "mgr", None) is not None:
                            h.mgr.wait()
                    os.kill(os.getpid(), signal.SIGKILL)

        real = jobmod.build_hooks
        jobmod.build_hooks = lambda *a: [*real(*a), KillAt()]
    jobmod.run_training(cfg, run_dir, data_dir)


def _job(cfg: dict, run_dir: Path, data_dir: Path, kill_at: int = 0) -> list[int | None]:
    from xirang_hpc.submit.rundir import make_private_dir

    make_private_dir(run_dir)
    ctx = rank_context()
    job = f"mem-test-{os.getpid()}-{kill_at}"
    procs = [ctx.Process(target=_job_rank, args=(r, 4, job, cfg, str(run_dir), str(data_dir), kill_at))
             for r in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(300)
    for p in procs:
        if p.is_alive():
            p.kill()
    return [p.exitcode for p in procs]


# The layouts of the kill-and-restart-from-memory case: tensor parallelism; and a mixture-of-experts model with
# expert parallelism and bias balancing (its expert shards, router and persistent expert bias come back from memory),
# under DDP and under FSDP2 (efsdp: the experts sharded over the 2 edp ranks too).
MOE_EP2 = ["parallel.tp=1", "parallel.pp=1", "parallel.microbatches=1", "parallel.ep=2", "model.mlp=swiglu",
           "model.moe_experts=4", "model.moe_top_k=2", "model.moe_balance=bias", "model.moe_bias_rate=0.01"]
MEMORY_LAYOUTS = {
    "tp2": ["parallel.tp=2", "parallel.pp=1", "parallel.microbatches=1"],
    "moe-ep2": MOE_EP2,
    "moe-efsdp": [*MOE_EP2, "parallel.data_parallel=fsdp"],
}


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(MEMORY_LAYOUTS))
def test_job_killed_restarts_from_memory_of_the_last_step_bitwise(tmp_path, stdlib_data, layout):
    import dataclasses
    import json

    from conftest import compose_cfg

    from xirang_hpc.checkpoint import layout as ckpt_layout
    from xirang_hpc.config.validate import load_config
    from xirang_hpc.monitor.events import read_events

    def cfg(run: Path) -> dict:
        over = ["model=tiny", "cluster=local", "train.max_steps=20", "train.global_batch=8", "train.warmup_steps=2",
                "train.eval_batches=1", "train.log_every=1", "checkpoint.every_steps=10", "checkpoint.keep_last=10",
                "checkpoint.in_memory=true", "checkpoint.memory_every_steps=1",
                f"checkpoint.memory_dir={tmp_path / 'shm'}", "monitor.enabled=false", f"data.out_dir={stdlib_data}",
                f"train.run_dir={run}", *MEMORY_LAYOUTS[layout]]
        return dataclasses.asdict(load_config(compose_cfg(over)))

    full, split = tmp_path / "full", tmp_path / "split"
    assert _job(cfg(full), full, stdlib_data) == [0] * 4
    assert _job(cfg(split), split, stdlib_data, kill_at=13) == [-signal.SIGKILL] * 4
    assert ckpt_layout.committed_steps(split / "checkpoints") == [10]  # the disk has step 10 only
    assert _job(cfg(split), split, stdlib_data) == [0] * 4
    restores = [e for e in read_events(split) if e.get("kind") == "restore"]
    assert [(e["source"], e["step"]) for e in restores] == [("memory", 13)]  # 0 steps lost
    for s in (10, 20):
        a, b = full / "checkpoints" / f"step_{s}", split / "checkpoints" / f"step_{s}"
        ta, tb = _saved(a), _saved(b)
        assert ta.keys() == tb.keys() and all(torch.equal(ta[k], tb[k]) for k in ta), s
        if layout.startswith("moe"):
            bias = [k for k in ta if k.endswith("mlp.expert_bias")]
            assert bias and any(ta[k].abs().sum() > 0 for k in bias), "the expert bias trained and was restored"
    rows = [json.loads(x) for x in (split / "metrics.jsonl").read_text().splitlines() if x.strip()]
    ref = [json.loads(x) for x in (full / "metrics.jsonl").read_text().splitlines() if x.strip()]
    assert [(r["step"], r["loss"]) for r in rows if "loss" in r] == [(r["step"], r["loss"]) for r in ref if "loss" in r]
    assert not (tmp_path / "shm").exists() or not any((tmp_path / "shm").iterdir())  # removed at the run's end


def _saved(step_dir: Path) -> dict[str, torch.Tensor]:
    import torch.distributed.checkpoint as dcp

    from xirang_hpc.checkpoint.storage import HDF5StorageReader, read_metadata

    md = read_metadata(step_dir)
    sd = {k: torch.empty(tuple(m.size), dtype=m.properties.dtype) for k, m in md.state_dict_metadata.items()}
    dcp.load(sd, storage_reader=HDF5StorageReader(step_dir), no_dist=True)
    return sd
