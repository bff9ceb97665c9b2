"""Run many parallel layouts inside one real gloo process group per world size.

Used by tests/test_parallel_matrix.py and benchmarks/bench_parallel.py. Each spawned rank
joins a real ``torch.distributed`` gloo group, then for every layout builds a fresh Trainer
(new DeviceMesh, new sub-groups) and trains a few steps; results go back to the parent over a
multiprocessing queue. The single-process reference runs in the parent without any group.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from ranks import rank_context
from torch.distributed.tensor import DTensor

from xirang_hpc.config.schema import (
    ClusterConfig,
    DataConfig,
    FinetuneConfig,
    LoraConfig,
    ModelConfig,
    ParallelConfig,
    TrainConfig,
    XirangConfig,
)
from xirang_hpc.config.validate import check_runnable, validate
from xirang_hpc.runtime.expert_parallel import EXPERT_WEIGHTS
from xirang_hpc.runtime.local_ranks import LocalRanks, RankPlace, free_port  # noqa: F401 - free_port: the tests take it from here
from xirang_hpc.runtime.topology import Topology
from xirang_hpc.runtime.trainer import Trainer

# name -> ParallelConfig fields (world size = product of the degrees).
LAYOUTS: dict[str, dict[str, Any]] = {
    "dp2": {"dp": 2},
    "dp2zero": {"dp": 2, "optimizer_sharding": True},
    "tp2": {"tp": 2},
    "pp2": {"pp": 2, "microbatches": 2},
    "dp2xtp2": {"dp": 2, "tp": 2},
    "dp2xpp2": {"dp": 2, "pp": 2, "microbatches": 2},
    "tp2xpp2": {"tp": 2, "pp": 2, "microbatches": 2, "schedule": "gpipe"},
    "fsdp4": {"dp": 4, "data_parallel": "fsdp"},
    "fsdp2xtp2": {"dp": 2, "tp": 2, "data_parallel": "fsdp"},
    "hsdp2x2": {"dp": 4, "data_parallel": "fsdp", "dp_replicate": 2},
    "tp2sp": {"tp": 2, "sequence_parallel": True},
    "dp2xtp2xpp2": {"dp": 2, "tp": 2, "pp": 2, "microbatches": 2},
    # Interleaved 1F1B: 2 ranks x 2 virtual stages = 4 stages of one block each.
    "pp2v2": {"pp": 2, "microbatches": 2, "schedule": "interleaved", "virtual_stages": 2},
    "dp2xpp2v2": {"dp": 2, "pp": 2, "microbatches": 2, "schedule": "interleaved", "virtual_stages": 2},
    # ZeRO stages composed with TP and PP (parallel.zero; 3 is data_parallel=fsdp above).
    "zero2dp2": {"dp": 2, "zero": 2, "microbatches": 2},  # reduce-scatter in each of 2 accumulation steps
    "zero3dp2": {"dp": 2, "zero": 3, "microbatches": 2},
    "zero1dp2xtp2": {"dp": 2, "tp": 2, "zero": 1},
    "zero1dp2xpp2": {"dp": 2, "pp": 2, "microbatches": 2, "zero": 1},
    "zero2dp2xtp2": {"dp": 2, "tp": 2, "zero": 2},
    "zero2dp2xpp2": {"dp": 2, "pp": 2, "microbatches": 2, "zero": 2},
    "zero3dp2xpp2": {"dp": 2, "pp": 2, "microbatches": 2, "zero": 3},
    "zero1dp2xtp2xpp2": {"dp": 2, "tp": 2, "pp": 2, "microbatches": 2, "zero": 1},
    "zero3dp2xtp2xpp2": {"dp": 2, "tp": 2, "pp": 2, "microbatches": 2, "zero": 3},
    # Context parallelism: every row split over the cp ranks (load-balanced chunks), K/V all-gathered.
    "cp2": {"cp": 2},
    "cp2xdp2": {"dp": 2, "cp": 2},
    "cp2xtp2": {"cp": 2, "tp": 2},
    "fsdp2xcp2": {"dp": 2, "cp": 2, "data_parallel": "fsdp"},
    "cp2acc": {"cp": 2, "microbatches": 2},  # two accumulation steps
    # Expert parallelism (mixture-of-experts models): ep of the dp ranks hold E/ep experts each.
    "ep2": {"dp": 2, "ep": 2},
    "ep4": {"dp": 4, "ep": 4},
    "ep2xdp2": {"dp": 4, "ep": 2},  # DDP over 4; experts on 2 ranks, replicated twice
    "ep2xfsdp2": {"dp": 4, "ep": 2, "data_parallel": "fsdp"},  # FSDP2: dense over 4, experts over edp 2 (efsdp)
    # ZeRO-2 (weights kept from forward to backward) with efsdp; reduce-scatters in each of 2 accumulation steps
    "ep2xzero2x2": {"dp": 4, "ep": 2, "zero": 2, "microbatches": 2},
    "ep2xfsdp2xtp2": {"dp": 4, "ep": 2, "tp": 2, "data_parallel": "fsdp"},  # efsdp beside tensor parallelism
    "ep2xfsdp2xpp2": {"dp": 4, "ep": 2, "pp": 2, "microbatches": 2, "data_parallel": "fsdp"},  # efsdp in each stage
    # efsdp over 4 ranks with 2 experts per group (H.MOE): each expert split on dim 1 instead
    "ep2xfsdp4": {"dp": 8, "ep": 2, "data_parallel": "fsdp"},
    "ep2xhsdp2x2": {"dp": 4, "ep": 2, "data_parallel": "fsdp", "dp_replicate": 2},  # efsdp 1: replicas over 2
    # HSDP, 2 replicate groups of 4: experts sharded over the 2 expert groups of each (efsdp 2), replicated over 2
    "ep2xhsdp2x4": {"dp": 8, "ep": 2, "data_parallel": "fsdp", "dp_replicate": 2},
    "ep2xpp2": {"dp": 2, "ep": 2, "pp": 2, "microbatches": 2},  # each stage's experts over its 2 dp ranks
    "ep2xtp2": {"dp": 2, "ep": 2, "tp": 2},  # attention over tp; each tp position's experts over its 2 dp ranks
}

#: A small mixture-of-experts model for the layout matrix: 4 SwiGLU experts of width 32, top-2, in every block.
MOE = {"name": "moe", "mlp": "swiglu", "norm": "rmsnorm", "pos": "rope", "bias": False, "moe_experts": 4,
       "moe_top_k": 2, "moe_ffn_hidden": 32}


def world_of(layout: dict[str, Any]) -> int:
    """Ranks a layout needs."""
    return layout.get("dp", 1) * layout.get("cp", 1) * layout.get("tp", 1) * layout.get("pp", 1)


def make_cfg(world: int, parallel: dict[str, Any], steps: int = 10, model: dict[str, Any] | None = None,
             train: dict[str, Any] | None = None, finetune: FinetuneConfig | None = None,
             data: DataConfig | None = None) -> XirangConfig:
    """A validated config for ``world`` ranks on 2 virtual nodes (1 node for world 1)."""
    nodes = 2 if world >= 4 else 1
    m = {"name": "test", "n_layer": 4, "n_head": 4, "d_model": 32, "d_ff": 64, "seq_len": 16, **(model or {})}
    t = {"max_steps": steps, "global_batch": 8, "lr": 3e-3, "warmup_steps": 2, "grad_clip": 0.05,
         "eval_batches": 1, "log_every": 1000, **(train or {})}
    cfg = XirangConfig(
        model=ModelConfig(**m),
        cluster=ClusterConfig(name="test", nodes=nodes, tasks_per_node=world // nodes, backend="gloo"),
        parallel=ParallelConfig(**parallel),
        train=TrainConfig(**t),
        finetune=finetune or FinetuneConfig(),
        data=data or DataConfig(),
    )
    cfg = validate(cfg)
    check_runnable(cfg)
    return cfg


def topology(rank: int, world: int, port: int) -> Topology:
    """2 virtual nodes x world/2 ranks, numbered node-major."""
    nodes = 2 if world >= 4 else 1
    per = world // nodes
    return Topology(rank=rank, world_size=world, local_rank=rank % per, local_world_size=per, node_id=rank // per,
                    num_nodes=nodes, node_name=f"vnode{rank // per}", master_addr="127.0.0.1", master_port=port,
                    job_id="test", source="local")


def full_params(trainer: Trainer) -> dict[str, Any]:
    """This rank's parameters as full tensors (gathers DTensor shards: a collective)."""
    out = {}
    for name, p in trainer.model.named_parameters():
        t = p.full_tensor() if isinstance(p, DTensor) else p
        out[name] = t.detach().numpy().copy()  # numpy: crosses the queue without shared memory
    return out


def run_layout(cfg: XirangConfig, topo: Topology, data_dir: Path, steps: int, want_params: bool = True,
               ) -> dict[str, Any]:
    """Train ``steps`` steps; returns losses, grad norms, timings and (reporting ranks') params."""
    from torch._dynamo.utils import counters

    graphs0 = counters["stats"]["unique_graphs"]
    with tempfile.TemporaryDirectory() as run_dir:
        tr = Trainer(cfg, topo, Path(run_dir), data_dir, log=lambda s: None)
        losses, norms, times = [], [], []
        for s in range(steps):
            t0 = time.perf_counter()
            loss, gnorm = tr.train_step(s)
            times.append(time.perf_counter() - t0)
            losses.append(loss)
            norms.append(gnorm)
        val = tr.evaluate()  # through the same forward path (pipeline schedule's eval, autocast)
        params = full_params(tr) if want_params else {}
        inner = getattr(tr.opt, "optim", tr.opt)  # ZeRO-1 optimizers keep this rank's AdamW as .optim
        opt_state = sum((v.to_local() if isinstance(v, DTensor) else v).numel()
                        for st in inner.state.values() for k, v in st.items() if k == "exp_avg")
        keep = tr.pm.coords["dp"] == 0 and tr.pm.coords["tp"] == 0
        out = {"losses": losses, "norms": norms, "times": times, "params": params if keep else {}, "val": val,
               # graphs torch.compile made for this layout beyond its start-up probe's one (train.compile)
               "graphs": counters["stats"]["unique_graphs"] - graphs0 - int(cfg.train.compile),
               "optimizer": {k: inner.defaults.get(k) for k in ("foreach", "fused")},
               # tokens of each row this rank holds (a context-parallel shard: seq_len / cp)
               "seq_tokens": tr.pm.seq_shards.index.numel() if tr.pm.seq_shards is not None else cfg.model.seq_len,
               "n_opt_state": opt_state, "n_local_params": sum((p.to_local() if isinstance(p, DTensor) else p).numel()
                                     for p in tr.model.parameters()),
               # the stacked expert weights (mixture of experts) this rank stores: name -> local shape
               "expert_shapes": {n: tuple((p.to_local() if isinstance(p, DTensor) else p).shape)
                                 for n, p in tr.model.named_parameters() if n.rsplit(".", 1)[-1] in EXPERT_WEIGHTS}}
        del tr
        if dist.is_initialized():
            dist.barrier()
    return out


def _worker(place: RankPlace, queue: Any, jobs: list[tuple[str, XirangConfig]], data_dir: str, steps: int,
            threads: int) -> None:
    torch.set_num_threads(threads)
    rank = place.rank
    try:
        place.init_process_group("gloo")
        topo = topology(rank, place.world_size, place.master_port)
        for name, cfg in jobs:
            res = run_layout(cfg, topo, Path(data_dir), steps)
            queue.put((rank, name, res))
        queue.put((rank, "__done__", None))
    except Exception:  # report the failure to the parent instead of hanging it
        queue.put((rank, "__error__", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_group(world: int, jobs: list[tuple[str, XirangConfig]], data_dir: Path, steps: int = 10,
              threads: int = 1, timeout_s: float = 600) -> dict[str, list[dict[str, Any]]]:
    """Spawn ``world`` ranks once and run every job in it; returns name -> per-rank results. ``timeout_s``:
    a hang's limit, counted from the last report (each rank reports each job), not the group's total time."""
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))
    results: dict[str, list[dict[str, Any]]] = {name: [{}] * world for name, _ in jobs}
    done = 0
    # The product's local-rank helper on the fork-server context: a rank that dies, or the group silent for
    # timeout_s, raises (RankFailed / TimeoutError) with every rank killed.
    with LocalRanks(_worker, world, (jobs, str(data_dir), steps, threads), ctx=rank_context(), timeout_s=timeout_s,
                    join_s=30, per_report=True) as ranks:
        while done < world:
            rank, name, res = ranks.get()
            if name == "__error__":
                raise RuntimeError(f"world {world} rank {rank} failed:\n{res}")
            if name == "__done__":
                done += 1
            else:
                results[name] = [*results[name][:rank], res, *results[name][rank + 1 :]]
    return results


def merged_params(per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    """Union of the parameters reported by each stage's (dp 0, tp 0) rank."""
    out: dict[str, torch.Tensor] = {}
    for r in per_rank:
        out.update(r["params"])
    return out


def reference(data_dir: Path, steps: int = 10, **kw: Any) -> dict[str, Any]:
    """The single-process run (no process group) of the same model, data and seed."""
    cfg = make_cfg(1, {}, steps, **kw)
    return run_layout(cfg, topology(0, 1, 0), data_dir, steps)


def with_recompute(cfg: XirangConfig, mode: str) -> XirangConfig:
    """``cfg`` with another recompute mode."""
    return dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, recompute=mode))


#: LoRA on every linear of the test model's blocks (GELU MLP: no gate); rank 4.
LORA = FinetuneConfig(method="lora", lora=LoraConfig(rank=4, alpha=8.0,
                                                     target_modules=["q_proj", "k_proj", "v_proj", "o_proj",
                                                                     "up_proj", "down_proj"]))
