"""Peak RSS per rank while building the model and taking one FSDP training step: meta init vs full build.

Three phases, each in fresh gloo processes (``--ranks`` of them, 1 thread each), run one after
another in one invocation:

1. footprint: a rank that imports torch and xirang, initialises the process group and builds nothing;
2. meta (ours): ``parallelize`` builds the GPT on the meta device, shards it with FSDP2 and
   materialises only this rank's shards (layout-independent blocked init);
3. full (previous way, ``parallelize(..., _full_build=True)``): the whole model is allocated and
   initialised on every rank, then sharded.

Each rank then takes one training step (forward, backward, AdamW step) on ``--micro`` sequences
of ``--seq-len`` tokens (short, so activations stay small). Peak RSS is the kernel's VmHWM. The
shard's bytes are measured from the rank's tensors after the step: local parameter shards +
gradient shards + AdamW state. Target per rank: meta peak <= 1.25 * shard bytes + footprint.

Peak RSS is VmHWM with a fixed glibc mmap threshold (see main; `--glibc-dynamic` for the default).

Run:  python benchmarks/bench_meta_init.py [--layers 24 --d-model 1024 --heads 16 --ranks 4]
"""

from __future__ import annotations

import argparse
import gc
import os
import re
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from xirang_hpc.config.schema import ClusterConfig, ModelConfig, ParallelConfig, TrainConfig, XirangConfig
from xirang_hpc.config.validate import validate
from xirang_hpc.models.gpt import full_model_params, lm_loss
from xirang_hpc.runtime.local_ranks import LocalRanks, RankPlace
from xirang_hpc.runtime.parallel_dims import Layout
from xirang_hpc.runtime.parallelize import make_optimizer, parallelize

GIB = 1024.0**3


def _kb(field: str) -> float:
    m = re.search(rf"^{field}:\s+(\d+) kB", Path("/proc/self/status").read_text(), re.M)
    return float(m.group(1)) * 1024.0 if m else float("nan")


def _local_bytes(t: torch.Tensor | None) -> int:
    if t is None:
        return 0
    t = t.to_local() if isinstance(t, DTensor) else t
    return t.numel() * t.element_size()


def make_cfg(args: argparse.Namespace) -> XirangConfig:
    """fsdp over ``args.ranks`` ranks on 2 virtual nodes, the model from the command line."""
    model = ModelConfig(name="bench", n_layer=args.layers, n_head=args.heads, d_model=args.d_model,
                        vocab_size=args.vocab, seq_len=args.seq_len)
    nodes = 2 if args.ranks >= 4 else 1
    return validate(XirangConfig(
        model=model,
        cluster=ClusterConfig(name="bench", nodes=nodes, tasks_per_node=args.ranks // nodes, backend="gloo"),
        parallel=ParallelConfig(dp=args.ranks, data_parallel="fsdp"),
        train=TrainConfig(global_batch=args.micro * args.ranks, lr=1e-4),
    ))


def _rank(place: RankPlace, queue: Any, phase: str, args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    rank = place.rank
    try:
        place.init_process_group("gloo")
        dist.barrier()
        out: dict[str, float] = {"footprint": _kb("VmHWM")}
        if phase != "footprint":
            cfg = make_cfg(args)
            topo = place.topology("bench")
            layout = Layout.for_job(cfg.parallel, topo)
            mesh = layout.build_mesh(topo)
            t0 = time.perf_counter()
            pm = parallelize(cfg, layout, mesh, _full_build=phase == "full")
            gc.collect()
            out["build_s"] = time.perf_counter() - t0
            out["build_peak"] = _kb("VmHWM")
            opt = make_optimizer(pm, cfg, layout)
            g = torch.Generator().manual_seed(rank)
            x = torch.randint(0, cfg.model.vocab_size, (args.micro, cfg.model.seq_len + 1), generator=g)
            loss = lm_loss(pm.module(x[:, :-1]), x[:, 1:])
            out["fwd_peak"], out["fwd_rss"] = _kb("VmHWM"), _kb("VmRSS")
            loss.backward()
            out["bwd_peak"], out["bwd_rss"] = _kb("VmHWM"), _kb("VmRSS")
            opt.step()
            dist.barrier()
            out["step_peak"], out["step_rss"] = _kb("VmHWM"), _kb("VmRSS")
            params = list(pm.model.parameters())
            out["shard"] = float(sum(_local_bytes(p) + _local_bytes(p.grad) for p in params)
                                 + sum(_local_bytes(v) for s in opt.state.values() for v in s.values()
                                       if isinstance(v, torch.Tensor) and v.dim() > 0))
            out["loss"] = loss.detach().item()
        queue.put((rank, out))
    except Exception:
        queue.put((rank, {"error": traceback.format_exc()}))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_phase(phase: str, args: argparse.Namespace, target: Callable[..., None] = _rank) -> list[dict[str, float]]:
    """Spawn ``args.ranks`` fresh ranks running ``target`` for ``phase`` (2 virtual nodes from 4 ranks); their
    measurements by rank."""
    res: list[dict[str, float]] = [{} for _ in range(args.ranks)]
    with LocalRanks(target, args.ranks, (phase, args), nodes=2 if args.ranks >= 4 else 1) as ranks:
        for _ in range(args.ranks):
            r, out = ranks.get()
            if "error" in out:  # leaving the block kills the other ranks
                sys.exit(f"{phase} rank {r} failed:\n{out['error']}")
            res[r] = out
    return res


def _mem_available() -> float:
    m = re.search(r"^MemAvailable:\s+(\d+) kB", Path("/proc/meminfo").read_text(), re.M)
    return float(m.group(1)) * 1024.0 if m else float("inf")


def main() -> None:
    """Run the three phases and print the per-rank table, the ratio and the target check."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--d-model", type=int, default=1024)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--vocab", type=int, default=256, help="the byte tokenizer's vocabulary (default 256)")
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--micro", type=int, default=1, help="sequences per rank in the training step")
    ap.add_argument("--glibc-dynamic", action="store_true",
                    help="keep glibc's dynamic mmap threshold (RSS then includes freed, fragmented heap)")
    ap.add_argument("--only-meta", action="store_true", help="diagnostics: the meta phase's per-stage figures only")
    args = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if not args.glibc_dynamic:
        # glibc raises its mmap threshold to the size of each freed mmapped block (up to 32 MiB), after
        # which FSDP2's per-block all-gather outputs and gradient buffers come from the heap and stay in
        # RSS once freed, so RSS would measure allocator fragmentation rather than what is in use.
        # A fixed threshold, read by every spawned rank at start, applies to all three phases alike.
        os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(1 << 20))
    cfg = make_cfg(args)
    n = full_model_params(cfg.model)
    full_bytes = 4.0 * n
    # The previous way holds the full model plus the shard's training state on every rank at once.
    need = args.ranks * (full_bytes * 1.5 + 16.0 * n / args.ranks + 0.5 * GIB)
    print(f"model: {args.layers} layers, d_model {args.d_model}, vocab {args.vocab}, seq_len {args.seq_len}: "
          f"{n / 1e6:.1f}M params ({full_bytes / GIB:.2f} GiB fp32); fsdp over {args.ranks} ranks, "
          f"micro-batch {args.micro}")
    if _mem_available() < need:
        sys.exit(f"only {_mem_available() / GIB:.1f} GiB available, the full-build phase needs about "
                 f"{need / GIB:.1f} GiB; pass a smaller --layers/--d-model")
    foot = run_phase("footprint", args)
    meta = run_phase("meta", args)
    if args.only_meta:
        for r, m in enumerate(meta):
            print(r, {k: round(v / GIB, 3) if k not in ("loss", "build_s") else v for k, v in m.items()})
        return
    full = run_phase("full", args)
    print("\npeak RSS per rank (GiB); budget = 1.25 x shard (params + grads + AdamW state) + footprint")
    hdr = ("rank", "footprint", "shard", "budget", "meta build", "meta step", "full build", "full step",
           "build full/meta", "step full/meta", "target")
    print("| " + " | ".join(hdr) + " |")
    print("|" + "---|" * len(hdr))
    ok, ratios = True, []
    for r in range(args.ranks):
        fp, m, f = foot[r]["footprint"], meta[r], full[r]
        budget = 1.25 * m["shard"] + fp
        good = m["step_peak"] <= budget
        ok &= good
        ratios.append(f["step_peak"] / m["step_peak"])
        print(f"| {r} | {fp / GIB:.3f} | {m['shard'] / GIB:.3f} | {budget / GIB:.3f} | {m['build_peak'] / GIB:.3f} | "
              f"{m['step_peak'] / GIB:.3f} | {f['build_peak'] / GIB:.3f} | {f['step_peak'] / GIB:.3f} | "
              f"{f['build_peak'] / m['build_peak']:.2f}x | {ratios[-1]:.2f}x | {'met' if good else 'MISSED'} |")
    print(f"\nmax build peak over ranks: full build {max(f['build_peak'] for f in full) / GIB:.3f} GiB, "
          f"meta init {max(m['build_peak'] for m in meta) / GIB:.3f} GiB: ratio "
          f"{max(f['build_peak'] for f in full) / max(m['build_peak'] for m in meta):.2f}x")
    worst_meta = max(m["step_peak"] for m in meta)
    worst_full = max(f["step_peak"] for f in full)
    print(f"max peak over ranks (build + step): full build {worst_full / GIB:.3f} GiB, "
          f"meta init {worst_meta / GIB:.3f} GiB: ratio {worst_full / worst_meta:.2f}x "
          f"(min over ranks {min(ratios):.2f}x)")
    print(f"build time (max over ranks): meta {max(m['build_s'] for m in meta):.1f} s, "
          f"full {max(f['build_s'] for f in full):.1f} s")
    same = all(abs(m["loss"] - f["loss"]) <= 1e-6 * abs(f["loss"]) for m, f in zip(meta, full))
    print(f"first-step loss meta {meta[0]['loss']:.6f} vs full {full[0]['loss']:.6f} ({'same' if same else 'DIFFERS'})")
    print(f"target (every rank's meta peak <= 1.25 x shard + footprint): {'met' if ok else 'MISSED'}")


if __name__ == "__main__":
    main()
