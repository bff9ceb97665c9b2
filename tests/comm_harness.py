"""Spawn a real gloo group of ``nodes x per_node`` ranks (virtual nodes) and run comm scenarios in it.

Used by tests/test_comm*.py. Each rank runs the named scenario functions below in order and
sends their results to the parent over a multiprocessing queue.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import tempfile
import traceback
from collections.abc import Callable
from typing import Any

import h5py
import torch
import torch.distributed as dist
from ranks import rank_context
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from xirang_hpc.config.schema import CommConfig
from xirang_hpc.runtime.comm import install_comm
from xirang_hpc.runtime.comm.groups import build_layout
from xirang_hpc.runtime.comm.hierarchical import HierarchicalAllreduce
from xirang_hpc.runtime.topology import Topology

SIZES = [0, 1, 3, 7, 16, 17, 31, 1000, 4097, 65537, 300_001]


def topology(rank: int, nodes: int, per_node: int, port: int, interleaved: bool = False) -> Topology:
    """Virtual node layout; ``interleaved``: rank r sits on node r % nodes (cyclic numbering)."""
    node, local = (rank % nodes, rank // nodes) if interleaved else (rank // per_node, rank % per_node)
    return Topology(rank=rank, world_size=nodes * per_node, local_rank=local, local_world_size=per_node,
                    node_id=node, num_nodes=nodes, node_name=f"vnode{node}", master_addr="127.0.0.1",
                    master_port=port, job_id="comm-test", source="local")


def scen_sizes(topo: Topology) -> dict[str, Any]:
    """Hierarchical average vs flat all-reduce / p on random tensors of many sizes (and a small slot)."""
    ar = HierarchicalAllreduce(build_layout(topo), slot_bytes=4096)  # tiny slot: forces chunking
    worst = 0.0
    for dtype in (torch.float32, torch.float64):
        for n in SIZES:
            g = torch.Generator().manual_seed(1000 * n + topo.rank)
            a = torch.randn(n, generator=g, dtype=dtype) * 10
            b = a.clone()
            ar.allreduce_([a])
            dist.all_reduce(b)
            b /= topo.world_size
            if n:
                worst = max(worst, float((a - b).abs().max() / b.abs().max()))  # error relative to the scale
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    # A message made of several tensors (a coalesced DDP bucket set) crossing chunk boundaries.
    parts = [torch.full((n,), float(topo.rank + i)) for i, n in enumerate([5, 1030, 2, 700])]
    ar.allreduce_(parts, chunk_bytes=1024)
    mean_rank = (topo.world_size - 1) / 2
    for i, t in enumerate(parts):
        torch.testing.assert_close(t, torch.full_like(t, mean_rank + i))
    # Node-only average (budget mode's local steps): ranks of a node agree, nodes differ.
    x = torch.full((100,), float(topo.rank))
    ar.allreduce_([x], inter_node=False)
    per = topo.local_world_size
    node_mean = topo.node_id * per + (per - 1) / 2
    torch.testing.assert_close(x, torch.full_like(x, node_mean))
    ar.close()
    return {"worst_rel": worst}


class Net(nn.Module):
    """Small MLP with uneven parameter sizes (several DDP buckets when the cap is small)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(37, 129)
        self.b = nn.Linear(129, 65)
        self.c = nn.Linear(65, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(torch.tanh(self.b(torch.tanh(self.a(x)))))


def train(topo: Topology, cfg: CommConfig | None, steps: int = 10, log: list[str] | None = None,
          bucket_cap_mb: float = 0.01, resume: dict[str, Any] | None = None) -> dict[str, Any]:
    """``steps`` of Adam on rank-specific data with flat DDP (cfg None) or the comm hook.

    ``resume``: the ``"saved"`` dict of an earlier call (model, optimizer, data and comm state).
    """
    torch.manual_seed(0)
    model = Net()
    ddp = DDP(model, bucket_cap_mb=bucket_cap_mb)
    state = install_comm(ddp, topo, cfg, log_fn=log.append if log is not None else None) if cfg else None
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(topo.rank)
    if resume is not None:
        model.load_state_dict(resume["model"])
        opt.load_state_dict(resume["opt"])
        g.set_state(resume["gen"])
        if state is not None:
            state.load_state_dict(resume["comm"])
    losses, grads = [], []
    for _ in range(steps):
        x, y = torch.randn(8, 37, generator=g), torch.randn(8, 3, generator=g)
        loss = nn.functional.mse_loss(ddp(x), y)
        opt.zero_grad()
        loss.backward()
        grads.append(torch.cat([p.grad.reshape(-1) for p in model.parameters()]).clone())
        opt.step()
        if state is not None:
            state.after_step(0.01)
        losses.append(loss.item())
    out = {"losses": losses, "grads": torch.stack(grads).numpy(),
           "params": torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy(),
           "log": list(log or [])}
    if state is not None:
        out["stats"] = state.stats()
        out["state"] = {k: v for k, v in state.state_dict().items() if k != "averager"}
        if state.averager is not None:
            out["averager"] = {k: v for k, v in state.averager.state_dict().items()
                               if not isinstance(v, torch.Tensor)}
        out["saved"] = {"model": {k: v.clone() for k, v in model.state_dict().items()},
                        "opt": copy.deepcopy(opt.state_dict()), "gen": g.get_state(),
                        "comm": state.state_dict()}
        state.close()
    return out


def save_h5(path: str, sd: dict[str, Any]) -> None:
    """Tensors as HDF5 datasets, everything else as one JSON attribute (what a checkpoint stores)."""
    with h5py.File(path, "w") as f:
        plain = {}
        for k, v in sd.items():
            if isinstance(v, dict):
                for kk, vv in v.items():
                    if isinstance(vv, torch.Tensor):
                        f.create_dataset(f"{k}.{kk}", data=vv.numpy())
                    else:
                        plain.setdefault(k, {})[kk] = vv
            else:
                plain[k] = v
        f.attrs["json"] = json.dumps(plain)


def load_h5(path: str) -> dict[str, Any]:
    """Inverse of :func:`save_h5`."""
    with h5py.File(path, "r") as f:
        sd = json.loads(f.attrs["json"])
        for name in f:
            k, kk = name.split(".", 1)
            sd.setdefault(k, {})[kk] = torch.from_numpy(f[name][()])
    for k in ("global_params", "momentum"):
        sd.get("averager", {}).setdefault(k, None)
    return sd


def scen_resume(topo: Topology) -> dict[str, Any]:
    """16 straight steps vs 5 steps + save (averaging state through HDF5) + resume + 11 steps."""
    cfg = CommConfig(bucket="0.002", sync_period=4, outer_optimizer="nesterov")
    straight = train(topo, cfg, steps=16)["params"]
    first = train(topo, cfg, steps=5)
    saved = first["saved"]
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, f"comm-{topo.rank}.h5")
        save_h5(path, saved["comm"])
        saved["comm"] = load_h5(path)
    resumed = train(topo, cfg, steps=11, resume=saved)["params"]
    return {"straight": straight, "resumed": resumed, "saved_local_steps": saved["comm"]["averager"]["local_steps"]}


def _drop_saved(out: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in out.items() if k != "saved"}


SCENARIOS: dict[str, Callable[[Topology], dict[str, Any]]] = {
    "sizes": scen_sizes,
    "flat": lambda t: train(t, None),
    "hier": lambda t: {k: v for k, v in train(t, CommConfig(bucket="0.002")).items() if k != "saved"},
    "budget_h1": lambda t: {k: v for k, v in train(t, CommConfig(sync_period=1)).items() if k != "saved"},
    "auto": lambda t: _drop_saved(train(t, CommConfig(bucket="auto", auto_candidates_mb=[1 / 1024, 4 / 1024, 1 / 16],
                                                       auto_steps=1), steps=6, log=[])),
    "budget_h8": lambda t: {k: v for k, v in train(t, CommConfig(bucket="0.002", sync_period=8), steps=16).items()
                            if k != "saved"},
    "resume": scen_resume,
}


def _worker(rank: int, nodes: int, per_node: int, store: str, names: list[str], interleaved: bool, q: Any) -> None:
    torch.set_num_threads(1)
    try:
        # A FileStore: no port to race for on a shared machine.
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=nodes * per_node)
        topo = topology(rank, nodes, per_node, 0, interleaved)
        for name in names:
            q.put((rank, name, SCENARIOS[name](topo)))
            dist.barrier()
        q.put((rank, "__done__", None))
    except Exception:  # report to the parent instead of hanging it
        q.put((rank, "__error__", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run(names: list[str], nodes: int = 2, per_node: int = 2, interleaved: bool = False,
        timeout_s: float = 240) -> dict[str, list[dict[str, Any]]]:
    """Run scenarios on every rank; returns name -> per-rank results. Raises on any rank's error."""
    ctx = rank_context()
    q = ctx.Queue()
    world = nodes * per_node
    tmp = tempfile.mkdtemp(prefix="xirang-comm-test-")
    store = os.path.join(tmp, "store")
    procs = [ctx.Process(target=_worker, args=(r, nodes, per_node, store, names, interleaved, q)) for r in range(world)]
    for p in procs:
        p.start()
    out: dict[str, list[dict[str, Any]]] = {n: [{}] * world for n in names}
    done = 0
    try:
        while done < world:
            rank, name, res = q.get(timeout=timeout_s)
            if name == "__error__":
                raise RuntimeError(f"rank {rank} failed:\n{res}")
            if name == "__done__":
                done += 1
            else:
                out[name][rank] = res
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
        shutil.rmtree(tmp, ignore_errors=True)
    return out
