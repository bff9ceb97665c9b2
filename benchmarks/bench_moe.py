"""Mixture-of-experts block, forward+backward tokens/s: ours (models/moe.py) vs transformers' Qwen3MoeSparseMoeBlock.

Both blocks hold the same weights (ours copied from transformers'), run in this process with the
same torch threads, fp32 on CPU, on the same random input; one iteration is forward, a sum-of-squares
loss and backward (input and all weights get gradients). Outputs are checked equal first.

- ours: one argsort of the flat top-k expert ids groups the (token, choice) slots by expert, one gather
  (index_select) takes their rows; each expert runs on its contiguous slice (a hand-written backward) and
  adds its weighted output into the result (index_add_; a token picks an expert once, so no row is added
  twice in one call);
- transformers: a one-hot expert mask and, per hit expert, a ``torch.where`` over it, a gather
  and an index_add (its default "eager" experts implementation).

Printed per case (experts, top-k): median seconds per iteration over ``--repeats`` timed runs (the two
blocks taking turns), tokens/s of each, the median of the paired ratios theirs/ours, the bytes autograd keeps
for the backward of one forward (weights excluded), and the expert GEMMs alone (``floor``: the same experts, weights
and slot counts on slots already grouped by expert, nothing routed, gathered or combined): the work any
dispatch must do, so theirs/floor is the most any implementation of the same fp32 arithmetic can gain.

    python benchmarks/bench_moe.py [--hidden 512 --ffn 256 --tokens 2048 --repeats 5]

``--ep-memory``: peak RSS per rank of one training step of a small MoE GPT on 4 gloo ranks (1 thread each),
expert parallelism ``ep=4`` against ``ep=1`` (both dense DDP over the 4 ranks), each in fresh processes. Per
rank, the dense share and the expert share are the training state of those weights at ep=1 (parameters,
gradients, AdamW's two moments); target: ep=4 peak <= (dense share + expert share / 4) x 1.25 + footprint.
Two footprints are measured, each in fresh ranks, and the target is checked against both: ``import`` (ranks
that import, join the group and build nothing) and ``floor`` (the same ep=4 step on a negligible model of one
block, d_model 16: the runtime's size-independent cost of a step, its kernels' and communicators' first use).

    python benchmarks/bench_moe.py --ep-memory [--layers 4 --hidden 256 --ffn 512 --experts 16]

``--ep-memory --fsdp``: the same with FSDP2 (ZeRO-3) over the 4 ranks instead of DDP, ``ep=2`` against ``ep=1``.
At ep=1 FSDP2 already shards every weight, experts included, over the 4 ranks; at ep=2 the experts are sharded
over the 2 ranks of each expert group and, by FSDP2, over the other 2 (efsdp), so the target keeps the expert
share whole: ep=2 peak <= (dense share + expert share) x 1.25 + footprint.

    python benchmarks/bench_moe.py --ep-memory --fsdp [--layers 4 --hidden 256 --ffn 512 --experts 16]

``--ep-bitwise``: the price of ``parallel.ep_bitwise`` on an expert rank: its experts' forward+backward
(models/moe.py ``_GroupedSwiGLU``, routing weights included) on the same rows as one segment per expert (the
default) and as 2, 4 or 8 segments per expert, one per source rank (each run through GEMMs of its own and the
weight gradients added as a pairwise tree), timed in turns in one process; the median of the paired ratios.

    python benchmarks/bench_moe.py --ep-bitwise [--repeats 7]
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from _common import saved_storages
from torch.distributed.tensor import DTensor

from xirang_hpc.config.schema import ClusterConfig, ModelConfig, ParallelConfig, TrainConfig, XirangConfig
from xirang_hpc.config.validate import validate
from xirang_hpc.models.gpt import lm_loss
from xirang_hpc.models.moe import MoE
from xirang_hpc.runtime.local_ranks import LocalRanks, RankPlace
from xirang_hpc.runtime.parallel_dims import Layout
from xirang_hpc.runtime.parallelize import make_optimizer, parallelize

GIB = 1024.0**3
RANKS = 4

CASES = [(8, 2), (8, 8), (64, 2), (64, 8)]


def _pair(experts: int, top_k: int, hidden: int, ffn: int) -> tuple[MoE, torch.nn.Module]:
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    hc = Qwen3MoeConfig(hidden_size=hidden, num_experts=experts, num_experts_per_tok=top_k,
                        moe_intermediate_size=ffn, norm_topk_prob=True)
    theirs = Qwen3MoeSparseMoeBlock(hc).float()
    for p in theirs.parameters():
        torch.nn.init.normal_(p, std=0.02)
    cfg = ModelConfig(name="bench", d_model=hidden, n_head=8, norm="rmsnorm", mlp="swiglu", pos="rope", bias=False,
                      moe_experts=experts, moe_top_k=top_k, moe_ffn_hidden=ffn, moe_norm_topk=True)
    ours = MoE(cfg)
    with torch.no_grad():
        ours.gate.weight.copy_(theirs.gate.weight)
        gate, up = theirs.experts.gate_up_proj.chunk(2, dim=1)  # (E, ffn, d) each
        ours.w1.copy_(gate)
        ours.w3.copy_(up)
        ours.w2.copy_(theirs.experts.down_proj)
    return ours, theirs


def _time(blocks: list[torch.nn.Module], x: torch.Tensor, repeats: int, warmup: int = 2) -> list[list[float]]:
    """Seconds of one forward+backward of each block, the blocks taking turns (the order reversed every
    iteration, so a drift of the machine's load falls on all alike): one list per block, warm-up dropped."""
    times: list[list[float]] = [[] for _ in blocks]
    for i in range(warmup + repeats):
        order = list(range(len(blocks)))[:: 1 if i % 2 == 0 else -1]
        for j in order:
            xi = x.detach().requires_grad_(True)
            t0 = time.perf_counter()
            blocks[j](xi).pow(2).sum().backward()
            dt = time.perf_counter() - t0
            blocks[j].zero_grad(set_to_none=True)
            if i >= warmup:
                times[j].append(dt)
    return times


def _saved_mib(block: torch.nn.Module, x: torch.Tensor) -> float:
    """MiB autograd keeps for the backward of one forward (each saved storage counted once; the weights too)."""
    weights = {p.untyped_storage().data_ptr() for p in block.parameters()}
    with saved_storages() as saved:
        y = block(x.detach().requires_grad_(True))
    del y
    return sum(n for k, n in saved.items() if k not in weights) / 2**20


def _floor(ours: MoE, x: torch.Tensor, repeats: int, warmup: int = 2) -> float:
    """Median seconds of forward+backward of the expert GEMMs alone: ``ours``'s experts, each on its own input of
    the slot count the router chose on ``x``, nothing gathered, concatenated or combined (module docstring)."""
    with torch.no_grad():
        _, _, idx = ours.route(x.reshape(-1, x.shape[-1]))
    sizes = torch.bincount(idx.reshape(-1), minlength=ours.num_experts).tolist()
    times = []
    for i in range(warmup + repeats):
        xs = [torch.randn(n, x.shape[-1], requires_grad=True) for n in sizes]
        t0 = time.perf_counter()
        w1, w3, w2 = ours.w1.unbind(0), ours.w3.unbind(0), ours.w2.unbind(0)
        loss = sum(F.linear(F.silu(F.linear(xe, w1[e])) * F.linear(xe, w3[e]), w2[e]).pow(2).sum()
                   for e, xe in enumerate(xs))
        loss.backward()  # type: ignore[union-attr]
        dt = time.perf_counter() - t0
        ours.zero_grad(set_to_none=True)
        if i >= warmup:
            times.append(dt)
    return statistics.median(times)


def _vm(field: str) -> float:
    """A byte count from /proc/self/status (VmHWM: peak resident set; VmRSS: now)."""
    m = re.search(rf"^{field}:\s+(\d+) kB", Path("/proc/self/status").read_text(), re.M)
    return float(m.group(1)) * 1024.0 if m else float("nan")


def _ep_cfg(a: argparse.Namespace, ep: int, floor: bool = False) -> XirangConfig:
    """The MoE GPT on 4 ranks (2 virtual nodes), dense DDP (``a.fsdp``: FSDP2) over all, experts over ``ep`` of them.

    ``floor``: a negligible model of the same kind (one block, d_model 16, 4 experts of width 16).
    """
    layers, hidden, experts, ffn = (1, 16, RANKS, 16) if floor else (a.layers, a.hidden, a.experts, a.ffn)
    model = ModelConfig(name="bench-moe", n_layer=layers, n_head=8, d_model=hidden, vocab_size=256, seq_len=64,
                        norm="rmsnorm", mlp="swiglu", pos="rope", bias=False, moe_experts=experts,
                        moe_top_k=2, moe_ffn_hidden=ffn)
    cluster = ClusterConfig(name="bench", nodes=2, tasks_per_node=RANKS // 2, backend="gloo")
    parallel = ParallelConfig(dp=RANKS, ep=ep, data_parallel="fsdp" if a.fsdp else "ddp")
    return validate(XirangConfig(model=model, parallel=parallel, cluster=cluster,
                                 train=TrainConfig(global_batch=2 * RANKS, lr=1e-4)))


def _state_bytes(p: torch.Tensor, opt: torch.optim.Optimizer) -> float:
    """This rank's bytes of a parameter's training state: the weight, its gradient, AdamW's two moments."""
    def local(t: torch.Tensor | None) -> int:
        t = t.to_local() if isinstance(t, DTensor) else t
        return 0 if t is None else t.numel() * t.element_size()
    st = opt.state.get(p, {})
    return float(local(p) + local(p.grad) + local(st.get("exp_avg")) + local(st.get("exp_avg_sq")))


def _ep_rank(place: RankPlace, queue: Any, ep: int, a: argparse.Namespace, floor: bool) -> None:
    torch.set_num_threads(1)
    try:
        place.init_process_group("gloo")
        dist.barrier()
        out = {"footprint": _vm("VmHWM")}
        if ep:
            cfg = _ep_cfg(a, ep, floor)
            topo = place.topology("bench")
            layout = Layout.for_job(cfg.parallel, topo)
            pm = parallelize(cfg, layout, layout.build_mesh(topo))
            opt = make_optimizer(pm, cfg, layout)
            g = torch.Generator().manual_seed(place.rank)
            x = torch.randint(0, 256, (2, cfg.model.seq_len + 1), generator=g)
            loss = lm_loss(pm.module(x[:, :-1]), x[:, 1:]) + pm.model.moe_aux_loss()  # type: ignore[operator]
            loss.backward()
            if pm.expert is not None:
                pm.expert.reduce_grads()
            opt.step()
            dist.barrier()
            out["peak"] = _vm("VmHWM")
            experts = {id(getattr(m, n)) for m in pm.model.moe_blocks() for n in ("w1", "w2", "w3")}  # type: ignore[operator]
            params = list(pm.model.parameters())
            out["expert"] = sum(_state_bytes(p, opt) for p in params if id(p) in experts)
            out["dense"] = sum(_state_bytes(p, opt) for p in params if id(p) not in experts)
        queue.put((place.rank, out))
    except Exception:
        queue.put((place.rank, {"error": traceback.format_exc()}))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _ep_phase(ep: int, a: argparse.Namespace, floor: bool = False) -> list[dict[str, float]]:
    """Fresh ranks for one phase (ep=0: the import footprint; ``floor``: the negligible model); by rank."""
    res: list[dict[str, float]] = [{} for _ in range(RANKS)]
    with LocalRanks(_ep_rank, RANKS, (ep, a, floor), nodes=2) as ranks:
        for _ in range(RANKS):
            r, out = ranks.get()
            if "error" in out:
                sys.exit(f"ep={ep} rank {r} failed:\n{out['error']}")
            res[r] = out
    return res


def ep_memory(a: argparse.Namespace) -> None:
    """Peak RSS per rank of one MoE training step at ep=4 (FSDP2: ep=2) vs ep=1, against the target."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    # As in bench_meta_init.py: a fixed mmap threshold, so freed large buffers leave the resident set.
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(1 << 20))
    # DDP: each rank's expert state shrinks by ep. FSDP2 shards it over all 4 ranks already at ep=1; ep=2
    # keeps that share (E/(ep*edp) = E/4 experts a rank, efsdp) while the experts need no gather over 4.
    ep, shrink, dense = (2, 1, "FSDP2 (ZeRO-3)") if a.fsdp else (RANKS, RANKS, "dense DDP")
    print(f"MoE GPT: {a.layers} layers, d_model {a.hidden}, {a.experts} experts of width {a.ffn}, top-2; one step "
          f"(2 x 64 tokens per rank) on {RANKS} gloo ranks, {dense}; torch {torch.__version__}")
    foot, floor = _ep_phase(0, a), _ep_phase(ep, a, floor=True)
    one, many = _ep_phase(1, a), _ep_phase(ep, a)
    share = f"expert/{shrink}" if shrink > 1 else "expert"
    print(f"peak RSS per rank (GiB); dense/expert share: training state at ep=1; "
          f"target = (dense + {share}) x 1.25 + footprint (import, or the step's floor)")
    print(f"| rank | import | floor | dense share | expert share | ep=1 peak | ep={ep} peak | ep={ep}/ep=1 | "
          "target (import) | target (floor) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    met = {"import": True, "floor": True}
    for r in range(RANKS):
        d, x, peak = one[r]["dense"], one[r]["expert"], many[r]["peak"]
        cells = []
        for name, fp in (("import", foot[r]["footprint"]), ("floor", floor[r]["peak"])):
            target = (d + x / shrink) * 1.25 + fp
            met[name] &= peak <= target
            cells.append(f"{target / GIB:.3f} {'met' if peak <= target else 'MISSED'}")
        print(f"| {r} | {foot[r]['footprint'] / GIB:.3f} | {floor[r]['peak'] / GIB:.3f} | {d / GIB:.3f} | "
              f"{x / GIB:.3f} | {one[r]['peak'] / GIB:.3f} | {peak / GIB:.3f} | {peak / one[r]['peak']:.2f}x | "
              f"{cells[0]} | {cells[1]} |")
    print(f"expert state per rank at ep={ep}: {many[0]['expert'] / GIB:.3f} GiB (ep=1: {one[0]['expert'] / GIB:.3f})")
    for name in ("import", "floor"):
        print(f"target with the {name} footprint (every rank's ep={ep} peak <= (dense + {share}) x 1.25 + "
              f"footprint): {'met' if met[name] else 'MISSED'}")


#: --ep-bitwise shapes: (local experts, d_model, expert width, rows per expert on the expert rank)
SEGMENT_SHAPES = [(4, 512, 512, 256), (4, 2048, 1024, 1024), (2, 1024, 512, 4096)]


def _experts_time(x: torch.Tensor, scale: torch.Tensor, ws: list[torch.Tensor], sizes: list[int],
                  sources: int) -> float:
    """Seconds of one forward+backward of ``_GroupedSwiGLU`` on ``sizes`` segments (``sources`` per expert)."""
    from xirang_hpc.models.moe import _GroupedSwiGLU

    xi, si = x.clone().requires_grad_(True), scale.clone().requires_grad_(True)
    t0 = time.perf_counter()
    _GroupedSwiGLU.apply(xi, *ws, sizes, si, sources).pow(2).sum().backward()
    dt = time.perf_counter() - t0
    for w in ws:
        w.grad = None
    return dt


def ep_bitwise(repeats: int) -> None:
    """Per-source segments (``parallel.ep_bitwise``) against one segment per expert: paired time ratios."""
    torch.manual_seed(0)
    print(f"expert rank's experts fwd+bwd, fp32 CPU, {torch.get_num_threads()} threads, torch {torch.__version__}; "
          f"median of {repeats} paired ratios (2 warm-up pairs dropped)")
    print("| local experts | d_model | expert width | rows per expert | sources | rows per source | "
          "per-source / per-expert time |")
    print("|---|---|---|---|---|---|---|")
    for experts, d, ffn, rows in SEGMENT_SHAPES:
        ws = [(torch.randn(*shape) * 0.02).requires_grad_(True)
              for shape in ((experts, ffn, d), (experts, ffn, d), (experts, d, ffn))]
        x, scale = torch.randn(experts * rows, d), torch.rand(experts * rows)
        for sources in (2, 4, 8):
            runs = [([rows] * experts, 1), ([rows // sources] * (experts * sources), sources)]
            ratios = []
            for i in range(2 + repeats):
                order = runs if i % 2 == 0 else runs[::-1]  # alternate, so a drift of the load falls on both
                t = {src: _experts_time(x, scale, ws, sizes, src) for sizes, src in order}
                if i >= 2:
                    ratios.append(t[sources] / t[1])
            print(f"| {experts} | {d} | {ffn} | {rows} | {sources} | {rows // sources} | "
                  f"{statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f}) |")


def main() -> None:
    """Run every case and print the side-by-side table (or, with --ep-memory, the expert-parallel memory)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--ffn", type=int, default=256)
    ap.add_argument("--tokens", type=int, default=2048, help="tokens per iteration (batch 4 x tokens/4)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--ep-memory", action="store_true", help="peak RSS per rank at ep=4 vs ep=1 (4 gloo ranks)")
    ap.add_argument("--layers", type=int, default=4, help="--ep-memory: transformer blocks, all MoE")
    ap.add_argument("--experts", type=int, default=16, help="--ep-memory: experts per block")
    ap.add_argument("--fsdp", action="store_true", help="--ep-memory: FSDP2 over the 4 ranks, ep=2 vs ep=1")
    ap.add_argument("--ep-bitwise", action="store_true", help="the price of parallel.ep_bitwise on an expert rank")
    a = ap.parse_args()
    if a.ep_bitwise:
        ep_bitwise(a.repeats)
        return
    if a.ep_memory:
        if "--hidden" not in sys.argv:
            a.hidden = 256
        if "--ffn" not in sys.argv:
            a.ffn = 512
        ep_memory(a)
        return
    torch.manual_seed(0)
    print(f"MoE block fwd+bwd, fp32 CPU, {torch.get_num_threads()} threads, hidden {a.hidden}, expert ffn {a.ffn}, "
          f"{a.tokens} tokens, median of {a.repeats}, torch {torch.__version__}")
    print("experts | top-k | ours s | theirs s | floor s | ours tok/s | theirs tok/s | ours/theirs (paired) | "
          "theirs/floor (the most possible) | kept for backward, ours / theirs MiB")
    for experts, top_k in CASES:
        ours, theirs = _pair(experts, top_k, a.hidden, a.ffn)
        x = torch.randn(4, a.tokens // 4, a.hidden)
        with torch.no_grad():
            torch.testing.assert_close(ours(x), theirs(x), atol=1e-4, rtol=1e-4)
        mine, base = _time([ours, theirs], x, a.repeats)
        t_ours, t_theirs, floor = statistics.median(mine), statistics.median(base), _floor(ours, x, a.repeats)
        paired = statistics.median(b / m for m, b in zip(mine, base, strict=True))
        print(f"{experts:7d} | {top_k:5d} | {t_ours:6.3f} | {t_theirs:8.3f} | {floor:7.3f} | "
              f"{a.tokens / t_ours:10.0f} | {a.tokens / t_theirs:12.0f} | {paired:19.2f}x | "
              f"{t_theirs / floor:.2f}x | {_saved_mib(ours, x):.1f} / {_saved_mib(theirs, x):.1f}")


if __name__ == "__main__":
    main()
