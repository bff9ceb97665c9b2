"""Per-rank memory and per-iteration time of one parallel plan.

Step time = pipeline (compute + TP communication per microbatch, stretched by the bubble)
+ pipeline point-to-point + exposed data-parallel communication + optimizer step:

- compute per microbatch: this stage's FLOPs (``formulas.iteration_flops``, recompute included)
  / (peak * efficiency(h/t)); efficiency = gemm_efficiency * w/(w + gemm_half_width), w = h/t,
  plus a fixed kernel overhead per layer;
- full recomputation re-runs each block's forward except its last GEMM where the checkpoint stops
  early (``checkpoint_early_stop``: PyTorch's non-reentrant checkpoint, ``formulas.recompute_extra``);
- MoE (``Shape.experts``): FLOPs and activations count the routed experts only (active parameters),
  weights, gradients and optimizer state every expert (total parameters; formulas.py). Expert parallelism
  (``Plan.ep``) puts E/ep whole experts on each of ep ranks drawn from the tp*dp ranks of a pipeline stage
  (expert tensor parallelism 1: Megatron-Core's ``--expert-tensor-parallel-size 1``, torchtitan's
  ``expert_tensor_parallel_degree`` 1, the rule ``dp_shard*cp*tp == efsdp*ep``); without it (ep = 1) the
  experts are split over tp like the dense MLP. The expert state is then sharded by the ZeRO stage over the
  remaining edp = tp*dp/(ep*etp) ranks (torchtitan's efsdp, Megatron's expert data parallel group), and the
  expert gradients are reduced over that group, not over dp. Each MoE block moves its tokens twice per pass
  through an all-to-all over the ep group (dispatch and combine: 4 per microbatch, 6 under full
  recomputation; torchtitan ``ExpertParallel``, Megatron-Core ``MoEAlltoAllTokenDispatcher``), each rank
  sending its b*s/t tokens x top_k x h activations (sequence-parallel tokens, as Megatron-Core requires
  sequence parallelism for MoE with tp > 1), (ep-1)/ep of them off the rank: inside a node when the ep
  group fits in one (ranks are ordered tp fastest, then dp, so a group of ep consecutive ranks), else partly
  across nodes (``comm.all_to_all``). Routing is taken as balanced (every expert gets top_k/E of the tokens);
  the all-to-all is exposed (not overlapped with compute). This is Megatron-Core's layout (the published MoE
  rows); this runtime takes the ep ranks from the dp ranks only and refuses ep with tp > 1
  (``auto.runtime_allows``), so the plans it is given (tp = 1 where ep > 1) have the same experts per rank and
  the same edp = dp/ep.
- TP: 4 all-reduces of b*s*h activations per layer (2 forward, 2 backward; +2 under full recompute),
  a ring inside the node (Narayanan et al. SC21 Sec. 3.2); sequence parallelism swaps each for a
  reduce-scatter + all-gather of the same volume; a stack that overlaps them with the GEMMs
  (Megatron-Core's ``--tp-comm-overlap``) hides ``tp_comm_overlap`` of their time (hardware.py);
- pipeline stages need not divide the layers: blocks are split to balance the slowest stage, the
  last one also running the output head (``formulas.pipeline_split``); the slowest rank sets the
  slot, the rank with the most bytes sets the memory;
- attention: with a fused kernel (``flash_attention``, FlashAttention / SDPA on GPUs) no scores in
  memory and half a forward pass of score products recomputed in the backward; it runs only the
  tiles on and below the causal diagonal (``formulas.causal_fraction``, FlashAttention-2 Sec. 3.1.1)
  at ``attn_efficiency`` of peak (0 = the GEMM efficiency);
- loss: the last stage streams the b*s*V/t logits through device memory, ``logit_bytes`` per
  element and step (fp32 cross-entropy: 36; a fused loss kernel: 6; see hardware.py), plus
  ``metric_bytes`` per element where the training loop computes metrics on every microbatch's logits
  (Composer's train metrics: unfused fp32 cross-entropies, 28-44 bytes; hardware.py);
- bubble: (p-1)/v microbatch slots (Narayanan et al.: (p-1)/m of ideal time, (p-1)/(v*m) interleaved);
- p2p: two sends of b*s*h/t (scatter-gather) per pipeline slot, 2*(v*m + p - 1) on the critical path;
- context parallelism (cp > 1, ``parallel.cp``): each rank holds s/cp tokens of every sequence (load-balanced
  causal chunks), so its dense, attention, loss and activation work and memory are 1/cp of the sequence's;
  attention all-gathers K and V over the cp group (the n_kv heads' 2*b*s*kv_width/t elements) once in the
  forward (again under full recompute) and reduce-scatters their gradients in the backward, not overlapped
  (the runtime's all-gather is blocking), inside the node while cp*tp fits one; the gathered full-length K
  and V are kept for the backward. The gradient reduction then runs over dp*cp ranks, and FSDP shards
  over them;
- DP, as this runtime runs each ZeRO stage (runtime/data_parallel.py, runtime/trainer.py):
  a collective hidden behind compute still costs ``comm_interference`` of its time (SM and HBM
  contention; sources in hardware.py).
  ZeRO-0: one gradient all-reduce per step (hierarchical when the group spans nodes with >1 rank per
  node; accumulation steps do not sync), minus what ``dp_overlap`` of the last backward can hide;
  ZeRO-1: the same all-reduce, then the owners' broadcast of the updated weights (an all-gather's
  volume, exposed after the step; a stack with Megatron-Core's overlapped distributed optimizer,
  ``distributed_optimizer``, instead reduce-scatters in the last backward and all-gathers in the next
  forward, both hidden like ZeRO-0's all-reduce); ZeRO-2 (FSDP2, weights kept from forward to backward): per
  microbatch one all-gather in the forward and one gradient reduce-scatter in the backward, so the
  gradients stay sharded; ZeRO-3: the same plus a second all-gather in the backward (FSDP2 reshards
  after the forward). Under a pipeline, torch's schedule defers FSDP2's reduction to the end of the
  step and keeps the weights gathered across microbatches: ZeRO-2/3 then gather once (ZeRO-3: also
  once per microbatch's backward), reduce-scatter once, and hold full weights and gradients beside
  FSDP2's 1/dp shards of both (so under a pipeline ZeRO-2/3 hold more than ZeRO-1, and save only
  optimizer state against ZeRO-0).
  The gathers move weights (``weight_bytes``), the reduce-scatters gradients in the stack's reduce
  precision (``grad_comm_bytes``: 4 where FSDP or Megatron reduces in fp32 under bf16). Where
  ``pipelined_rings`` is set (NCCL on GPUs), the sharded stages' all-gathers and reduce-scatters across
  nodes are NCCL's rings, whose NVLink and network hops overlap (``comm.pipelined_ring``); the ZeRO-0/1
  all-reduce stays this runtime's hierarchical one (``comm.group_allreduce``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import lru_cache

from xirang_hpc.planner import comm
from xirang_hpc.planner.formulas import (
    Shape,
    causal_fraction,
    chunk_split,
    embedding_params,
    inflight_layers,
    iteration_flops,
    layer_activation_bytes,
    layer_expert_params,
    layer_forward_flops,
    layer_params,
    logits_flops,
    mlp_down_flops,
    model_flops,
    recompute_extra,
    stage_tensors,
    state_bytes_per_param,
)
from xirang_hpc.planner.hardware import Hardware

GiB = 1024.0**3
DDP_BUCKET_BYTES = 25 * 1024 * 1024  # PyTorch DDP bucket size (Li et al., VLDB 2020)


@dataclass(frozen=True)
class Plan:
    """One point of the search space."""

    dp: int
    tp: int
    pp: int
    micro: int  # sequences per microbatch (b)
    v: int = 1  # interleaved virtual stages per rank
    zero: int = 0  # 0 = DDP, 1/2/3 = ZeRO stage (3 = FSDP)
    recompute: str = "none"  # none | selective | full
    sp: bool = False  # sequence parallel (needs tp > 1)
    schedule: str = "1f1b"  # 1f1b | gpipe
    ep: int = 1  # expert parallel degree (MoE): E/ep experts per rank, ep dividing tp*dp
    cp: int = 1  # context parallel: ranks sharing each sequence
    # The embedding and the output head each take a block's place in the pipeline split (formulas.chunk_split:
    # Llama 3's layout, Megatron-Core's --account-for-{embedding,loss}-in-pipeline-split). Published runs only:
    # the search does not emit it (this runtime splits by cost, runtime/pipeline.py).
    ends_as_layers: bool = False

    @property
    def grad_ranks(self) -> int:
        """Ranks that reduce (and under ZeRO shard) one dense gradient: dp x cp."""
        return self.dp * self.cp

    @property
    def etp(self) -> int:
        """Expert tensor parallel degree: tp without expert parallelism, 1 (whole experts) with it."""
        return self.tp if self.ep == 1 else 1

    @property
    def edp(self) -> int:
        """Expert data parallel degree: the tp*dp ranks of a stage over the ep*etp that hold distinct expert
        shards; the ZeRO stage shards the expert state over these (torchtitan's efsdp)."""
        return max(1, self.tp * self.dp // (self.ep * self.etp))

    def label(self) -> str:
        """Compact human-readable form."""
        extra = [f"cp={self.cp}"] if self.cp > 1 else []
        extra += [f"v={self.v}"] if self.v > 1 else []
        extra += [f"zero{self.zero}"] if self.zero else []
        extra += ["sp"] if self.sp else []
        extra += [f"rc={self.recompute}"] if self.recompute != "none" else []
        extra += [self.schedule] if self.schedule != "1f1b" else []
        extra += ["ends-as-layers"] if self.ends_as_layers else []
        ep = f"ep={self.ep} " if self.ep > 1 else ""
        return f"dp={self.dp} tp={self.tp} pp={self.pp} {ep}b={self.micro} " + " ".join(extra)


@dataclass
class Estimate:
    """Predicted memory (bytes, per rank) and time (seconds, per iteration) of a plan."""

    plan: Plan
    microbatches: int
    memory: dict[str, float] = field(default_factory=dict)
    time: dict[str, float] = field(default_factory=dict)
    fits: bool = True
    tflops_per_gpu: float = 0.0  # hardware FLOP/s per GPU, counting recomputation (as Narayanan et al.)
    mfu: float = 0.0  # model FLOPs (no recomputation) / peak
    tokens_per_s: float = 0.0
    dp_algo: str = "none"

    @property
    def step_time(self) -> float:
        """Seconds per iteration."""
        return self.time["total"]

    @property
    def peak_memory(self) -> float:
        """Bytes per rank."""
        return self.memory["total"]

    def to_dict(self) -> dict[str, object]:
        """JSON-friendly form (memory in GiB, time in seconds)."""
        p = self.plan
        return {
            "plan": {"dp": p.dp, "tp": p.tp, "pp": p.pp, "micro_batch": p.micro, "microbatches": self.microbatches,
                     "interleave": p.v, "zero": p.zero, "recompute": p.recompute, "sequence_parallel": p.sp,
                     "schedule": p.schedule, "ep": p.ep, "cp": p.cp,
                     "ends_as_layers": p.ends_as_layers},
            "label": p.label(),
            "fits": self.fits,
            "memory_gib": {k: v / GiB for k, v in self.memory.items()},
            "time_s": dict(self.time),
            "tflops_per_gpu": self.tflops_per_gpu,
            "mfu": self.mfu,
            "tokens_per_s": self.tokens_per_s,
            "dp_allreduce": self.dp_algo,
        }


@dataclass(frozen=True)
class Problem:
    """What stays fixed while plans vary."""

    shape: Shape
    hw: Hardware
    nodes: int
    per_node: int
    global_batch: int

    @property
    def world(self) -> int:
        """Number of ranks."""
        return self.nodes * self.per_node


@lru_cache(maxsize=4096)
def rank_chunks(sh: Shape, p: int, v: int, ends_as_layers: bool = False) -> tuple[tuple[int, ...], ...]:
    """Blocks of each of the ``v`` model chunks of each of the ``p`` pipeline ranks (loop placement: chunk c
    on rank c mod p), the head weighed by its FLOPs against a block's (formulas.chunk_split)."""
    dense, attn = layer_forward_flops(sh, 1)
    counts = chunk_split(sh.layers, p * v, 0.0, logits_flops(sh, 1) / (dense + attn), ends_as_layers)
    return tuple(tuple(counts[r + k * p] for k in range(v)) for r in range(p))


@lru_cache(maxsize=4096)
def rank_layers(sh: Shape, p: int, v: int, ends_as_layers: bool = False) -> tuple[int, ...]:
    """Blocks each of the ``p`` pipeline ranks holds (``v`` interleaved stages each, loop placement)."""
    return tuple(sum(c) for c in rank_chunks(sh, p, v, ends_as_layers))


@lru_cache(maxsize=65536)
def _inflight(chunks: tuple[int, ...], m: int, p: int, r: int) -> float:
    return inflight_layers(chunks, m, p, r)


def _memory(pb: Problem, pl: Plan, m: int, counts: tuple[int, ...]) -> dict[str, float]:
    sh, hw = pb.shape, pb.hw
    t, p, b, cp = pl.tp, pl.pp, pl.micro, pl.cp
    lp = layer_params(sh)
    le = layer_expert_params(sh)  # routed experts: E/ep per rank, whole (ep > 1) or split over tp (ep = 1)
    ld = lp - le
    e_share = 1.0 / (pl.ep * pl.etp)
    flash = hw.flash_attention > 0
    dcp = pl.grad_ranks  # FSDP shards over dp x cp
    w, g, o = state_bytes_per_param(pl.zero, dcp, hw.weight_bytes, hw.grad_bytes, hw.optim_bytes)
    we, ge, oe = state_bytes_per_param(pl.zero, pl.edp, hw.weight_bytes, hw.grad_bytes, hw.optim_bytes)
    pipelined_fsdp = p > 1 and pl.zero >= 2 and dcp > 1
    if pipelined_fsdp:
        # torch's pipeline schedule (PipelineStage.backward_one_chunk) sets FSDP2's reshard_after_backward
        # and requires_gradient_sync to False until the last microbatch: the gathered weights and the
        # unreduced gradients stay whole, beside FSDP2's own sharded parameter storage and, after the
        # step's one reduce-scatter, the sharded gradients. Only the optimizer state is 1/dp.
        w = hw.weight_bytes * (1 + 1 / dcp)
        g = hw.grad_bytes * (1 + 1 / dcp)
        we = hw.weight_bytes * (1 + 1 / pl.edp)
        ge = hw.grad_bytes * (1 + 1 / pl.edp)
    # Every activation, scores included (s/cp queries x s keys), is the rank's 1/cp share of the sequence's;
    # the gathered K and V (full length) are kept beside them for the backward, unless recomputed.
    kv_gathered = 4.0 * sh.seq * b * sh.kv_width / t * (hw.act_bytes / 2.0) * (cp - 1) / cp
    act = layer_activation_bytes(sh, b, t, pl.sp, pl.recompute, hw.act_bytes, flash) / cp
    act += kv_gathered if pl.recompute != "full" else 0.0
    working = 0.0
    if pl.recompute == "full":  # one layer's full activations while it is recomputed
        working = layer_activation_bytes(sh, b, t, pl.sp, "none", hw.act_bytes, flash) / cp + kv_gathered
    # A tied head is the embedding on a single stage; with pp > 1 the last stage keeps its own copy
    # (Megatron-LM), as an untied model does.
    head = 0.0 if (sh.tied and p == 1) else sh.vocab * sh.hidden / t
    logits = 2.0 * sh.seq * b * sh.vocab / t * 4 / cp  # fp32 logits and their gradient (the rank's tokens)
    stages = []
    chunks = rank_chunks(sh, p, pl.v, pl.ends_as_layers)
    # Per chunk layout, only the earliest rank matters (it runs the most warm-up forwards), plus the first
    # and last ranks (embedding, head).
    firsts: dict[tuple[int, ...], int] = {}
    for r, c in enumerate(chunks):
        firsts.setdefault(c, r)
    for r in sorted(set(firsts.values()) | {0, p - 1}):
        n = counts[r]
        # Layer-microbatches in flight at the rank's peak: the 1F1B warm-up by its chunks
        # (formulas.inflight_layers); GPipe holds all m.
        held = float(m * n) if pl.schedule == "gpipe" else _inflight(chunks[r], m, p, r)
        params = n * ld / t + (embedding_params(sh) / t if r == 0 else 0.0) + (head if r == p - 1 else 0.0)
        acts = held * act + working + (logits if r == p - 1 else 0.0)
        stages.append((params, n * le * e_share, acts))
    params, experts, acts = max(stages, key=lambda x: x[0] * (w + g + o) + x[1] * (we + ge + oe) + x[2])
    buffers = hw.reserved_gb * GiB
    if (dcp > 1 or pl.edp > 1) and pl.zero <= 1:
        buffers += 2 * min(DDP_BUCKET_BYTES, (params + experts) * hw.grad_comm_bytes)
    if pl.zero == 3 and not pipelined_fsdp:  # gathered weights of the layer being computed and the one prefetched
        buffers += 2 * (ld / t + le * e_share) * hw.weight_bytes
    if pl.zero >= 2:
        # What a backend keeps beyond them, per unsharded parameter byte (calibrated on CPU: gloo
        # reduce-scatters as a full all-reduce, FSDP2 copy-in/out buffers).
        buffers += hw.fsdp_buffer_factor * (params + experts) * hw.weight_bytes
    mem = {"params": params * w + experts * we, "grads": params * g + experts * ge,
           "optimizer": params * o + experts * oe, "activations": acts, "buffers": buffers}
    mem["total"] = sum(mem.values())
    return mem


def estimate(pb: Problem, pl: Plan) -> Estimate:
    """Memory and time of ``pl`` on ``pb``. Raises ValueError for a plan that does not tile the batch."""
    sh, hw = pb.shape, pb.hw
    t, p, b, v, cp = pl.tp, pl.pp, pl.micro, pl.v, pl.cp
    if pb.global_batch % (pl.dp * b):
        raise ValueError(f"global batch {pb.global_batch} is not a multiple of dp*micro={pl.dp * b}")
    if sh.seq % (2 * cp):
        raise ValueError(f"2*cp={2 * cp} must divide the sequence length {sh.seq}")
    m = pb.global_batch // (pl.dp * b)
    # The gradient is reduced over dp x cp ranks: below, ``d`` is that group (cp's shards of a sequence
    # are data-parallel ranks as far as the weights are concerned).
    d = pl.grad_ranks
    links = comm.Links.of(hw)
    k = pb.per_node
    # This rank's tokens of the microbatch; layer_forward_flops pairs them with all sh.seq keys.
    tokens = b * sh.seq // cp
    flash = hw.flash_attention > 0
    counts = rank_layers(sh, p, v, pl.ends_as_layers)
    layers = max(counts)  # the rank holding the most blocks (parameters, per-layer costs)

    # Compute per microbatch on each pipeline rank; the last one also runs the output layer.
    dense, attn = layer_forward_flops(sh, tokens)
    early_stop = hw.checkpoint_early_stop > 0 and pl.recompute == "full"
    skipped = mlp_down_flops(sh, tokens) if early_stop else 0.0
    extra = recompute_extra(dense, attn, pl.recompute, flash, skipped)
    width = sh.hidden / t
    eff = hw.gemm_efficiency * width / (width + hw.gemm_half_width)
    # A fused kernel runs at its own measured rate (attn_efficiency) and skips the masked tiles
    # (causal_fraction); materialized scores are batched GEMMs at the GEMM rate, computed in full.
    attn_eff = (hw.attn_efficiency or eff) if flash else eff
    causal = causal_fraction(sh.seq, flash)
    passes = 4.0 if pl.recompute == "full" else 3.0
    # Softmax, dropout, norms, GeLU are memory-bound: they stream the layer's activations
    # (Korthikanti et al.'s per-layer bytes, no recompute) through device memory on every pass. This traffic
    # proxy keeps the dropout masks' bytes whatever the model (``dropout=True``): ``elementwise_traffic`` was
    # fitted as a multiple of that count, on rows with and without dropout alike; only memory drops them.
    act_stream = layer_activation_bytes(sh, b, t, pl.sp, "none", hw.act_bytes, flash, dropout=True) / cp
    score_bytes = act_stream - layer_activation_bytes(sh, b, t, pl.sp, "selective", hw.act_bytes, flash,
                                                      dropout=True) / cp
    # Training = 3 forward passes + recomputation; the attention products run at the attention
    # kernel's rate, the rest at the GEMM rate.
    dense_extra = dense - skipped if pl.recompute == "full" else 0.0
    dense_share = 3.0 * dense + dense_extra
    attn_share = 3.0 * attn + extra - dense_extra

    # The linear layers' GEMMs run at linear_peak_tflops where set (FP8: hardware.with_precision); the head and
    # the attention products at peak_tflops.
    linear_peak = (hw.linear_peak_tflops or hw.peak_tflops) * 1e12

    def compute_of(n: int, last: bool) -> float:
        flops_time = (n * dense_share / t / (linear_peak * eff)
                      + (3 * logits_flops(sh, tokens) if last else 0.0) / t / (hw.peak_tflops * 1e12 * eff)
                      + n * attn_share * causal / t / (hw.peak_tflops * 1e12 * attn_eff))
        overhead = n * hw.kernel_overhead_us * 1e-6 * passes
        elementwise = n * passes * hw.elementwise_traffic * act_stream / (hw.mem_bw_gbs * 1e9)
        # Softmax over the b * a/t * s^2 attention scores (exp per element; calibrated on CPU, 0 on GPUs
        # where fused attention hides it in the FLOP rate).
        scores = 0.0 if flash else n * passes * b * (sh.heads / t) * sh.seq**2 / cp * hw.attn_score_ns * 1e-9
        # Selective recomputation (Korthikanti et al. 2022, Sec. 5) re-runs QK^T, softmax, dropout and the
        # product with V in the backward: over materialized scores that is one more pass of the memory-bound
        # softmax and dropout over the 5*a*s^2*b bytes the recomputation saved (the score term of
        # ``layer_activation_bytes``), at the same ``elementwise_traffic`` as the other passes. A fused kernel
        # recomputes its scores in on-chip memory: no traffic.
        rescore = 0.0
        if pl.recompute == "selective" and not flash:
            rescore = n * hw.elementwise_traffic * score_bytes / (hw.mem_bw_gbs * 1e9)
        # The loss streams the b*s*V/t logits through device memory (hardware.logit_bytes per element).
        loss = (hw.logit_bytes * tokens * sh.vocab / t / (hw.mem_bw_gbs * 1e9)) if last else 0.0
        # Training metrics computed on every microbatch's logits stream them again (hardware.metric_bytes).
        loss += (hw.metric_bytes * tokens * sh.vocab / t / (hw.mem_bw_gbs * 1e9)) if last else 0.0
        return flops_time + overhead + elementwise + scores + rescore + loss + hw.microbatch_overhead_us * 1e-6

    def tp_of(n: int) -> float:
        # Tensor parallel all-reduces of b*s*h activations, inside the node.
        n_ar = 6 if pl.recompute == "full" else 4
        out = n * n_ar * comm.ring_allreduce(tokens * sh.hidden * hw.act_bytes, t, links.a_intra, links.b_intra)
        out *= 1.0 - hw.tp_comm_overlap  # what a stack that pipelines them with the GEMMs hides (hardware.py)
        if t > 1:  # DTensor dispatch and redistribution around each sharded layer (calibrated on CPU)
            act_mb = tokens * sh.hidden * hw.act_bytes / 1e6
            out += n * passes * (hw.tp_overhead_us + hw.tp_overhead_us_per_mb * act_mb
                                 + (hw.sp_overhead_us if pl.sp else 0.0)) * 1e-6
        return out

    # Expert parallelism: each MoE block's token dispatch and combine, an all-to-all over the ep group in
    # every pass (comm.all_to_all); the group is ep consecutive ranks of the tp-then-dp order.
    # A dispatcher that sends a token once per target node (hardware.a2a_node_dedup, DeepEP) moves only
    # comm.node_dedup_share of the cross-node copies.
    ep_local = math.gcd(pl.ep, k)
    ep_nodes = pl.ep // ep_local
    a2a_bytes = tokens / t * sh.top_k * sh.hidden * hw.act_bytes
    inter_bytes = None
    if hw.a2a_node_dedup > 0 and ep_nodes > 1:
        inter_bytes = (ep_nodes - 1) / ep_nodes * a2a_bytes * comm.node_dedup_share(sh.experts, sh.top_k, ep_nodes)
    a2a = comm.all_to_all(a2a_bytes, ep_local, ep_nodes, links, flows=k, inter_n=inter_bytes) if pl.ep > 1 else 0.0
    moe_share = sh.n_moe / sh.layers
    n_a2a = 6 if pl.recompute == "full" else 4

    def ep_of(n: int) -> float:
        return n * moe_share * n_a2a * a2a

    def cp_of(n: int) -> float:
        # K/V all-gather (forward; again under full recompute) and the reduce-scatter of their gradients:
        # each half an all-reduce of the gathered 2*b*s*kv_width/t elements; inside the node while cp*tp fits.
        if cp == 1:
            return 0.0
        kv = 2.0 * b * sh.seq * sh.kv_width / t * hw.act_bytes
        intra = cp * t <= k
        a, bw = (links.a_intra, links.b_intra) if intra else (links.a_inter, links.b_inter(k))
        n_coll = 3 if pl.recompute == "full" else 2
        return n * n_coll * comm.ring_allreduce(kv, cp, a, bw) / 2

    # Ranks differ only by their block count and by holding the head: few distinct cases.
    kinds = {(n, r == p - 1) for r, n in enumerate(counts)}
    compute_mb, tp_mb, ep_mb, cp_mb = max(((compute_of(n, last), tp_of(n), ep_of(n), cp_of(n)) for n, last in kinds),
                                          key=lambda x: x[0] + x[1] + x[2] + x[3])

    slot = compute_mb + tp_mb + ep_mb + cp_mb
    bubble = (p - 1) / v * slot * hw.bubble_exposed

    # Pipeline p2p: ranks are ordered tp fastest, then dp, then pp (Megatron), so a stage boundary
    # crosses nodes once a stage spans a node.
    p2p = 0.0
    if p > 1:
        n = tokens * sh.hidden * hw.act_bytes / t
        p2p = 2 * (v * m + p - 1) * comm.p2p(n, t * d >= k, links, flows=k)
        p2p += (v * m + p - 1) * hw.pp_overhead_us * 1e-6  # schedule bookkeeping per slot

    # Data parallel gradient all-reduce over dp ranks, k_dp per node.
    le = layer_expert_params(sh)
    lp = layer_params(sh) - le
    stage_params = (layers * lp + max(embedding_params(sh), sh.vocab * sh.hidden)) / t
    grad_bytes = stage_params * hw.grad_comm_bytes
    # Expert gradients are reduced over the expert data parallel group (edp ranks at a stride of ep*etp).
    e_params = layers * le / (pl.ep * pl.etp)
    e_grad_bytes = e_params * hw.grad_comm_bytes
    de = pl.edp if le else 1
    k_e = math.gcd(de, max(1, k // (pl.ep * pl.etp)))
    k_dp = max(1, min(d, k // t)) if k % t == 0 else 1
    while d % k_dp:
        k_dp -= 1
    dp_full, algo = comm.group_allreduce(grad_bytes, k_dp, d // k_dp, links, flows=k)
    dp_full += comm.group_allreduce(e_grad_bytes, k_e, de // k_e, links, flows=k)[0]
    backward = compute_mb * (passes - 1) / passes  # backward (+ recompute) of the last microbatch
    forward = compute_mb - backward
    hide = hw.dp_overlap
    # An all-gather or a reduce-scatter moves half an all-reduce's volume. The gradients go on the wire
    # as ``grad_comm_bytes`` (a stack that reduces in fp32 under bf16 compute sends 4: FSDP's
    # ``MixedPrecision(reduce_dtype=torch.float32)`` casts each gradient before its reduce-scatter,
    # torch 2.1 ``fsdp/_runtime_utils._post_backward_hook``); the gathered weights as ``weight_bytes``.
    # Where the collective library runs them as pipelined multi-channel rings (``pipelined_rings``: NCCL),
    # the sharded stacks' all-gathers and reduce-scatters cost the slowest link's time (comm.pipelined_ring).
    sharded = pl.zero >= 2 or (pl.zero == 1 and hw.distributed_optimizer > 0)

    def group(n: float, kk: int = k_dp, nodes: int = d // k_dp) -> float:
        if sharded and hw.pipelined_rings > 0:
            return comm.pipelined_ring(n, kk, nodes, links, flows=k, channels=round(hw.sharded_ring_channels))
        return comm.group_allreduce(n, kk, nodes, links, flows=k)[0]

    scatter = group(grad_bytes) / 2 + group(e_grad_bytes, k_e, de // k_e) / 2
    gather = scatter if hw.weight_bytes == hw.grad_comm_bytes else (
        group(stage_params * hw.weight_bytes) / 2 + group(e_params * hw.weight_bytes, k_e, de // k_e) / 2)
    if sharded and hw.pipelined_rings > 0 and d > k_dp:
        algo = "ring-pipelined"
    # A collective overlapped with compute still slows it by hw.comm_interference of its hidden time.
    def exposed(comm_s: float, compute_s: float) -> float:
        hidden = min(comm_s, hide * compute_s)
        return comm_s - hidden + hw.comm_interference * hidden

    if d == 1 and de == 1:
        dp_exposed = 0.0
    elif pl.zero == 0:  # all-reduce in buckets as the backward runs
        dp_exposed = exposed(dp_full, backward)
    elif pl.zero == 1 and hw.distributed_optimizer > 0:
        # Megatron-Core's distributed optimizer: reduce-scatter in the last backward, all-gather of the
        # updated weights in the next forward, both overlapped (hardware.distributed_optimizer).
        dp_exposed = exposed(scatter, backward) + exposed(gather, forward)
    elif pl.zero == 1:  # the same all-reduce; the owners broadcast the updated weights after the step
        dp_exposed = exposed(dp_full, backward) + gather
    else:
        # FSDP units are layers: each gather/scatter pays the collective's latency once per layer.
        per_layer = group(1.0)
        if p == 1:  # every microbatch: forward gather, backward reduce-scatter (+ a backward gather for ZeRO-3)
            back = scatter + (gather if pl.zero == 3 else 0.0)
            n_coll = m * (3 if pl.zero == 3 else 2)
            dp_exposed = m * (exposed(gather, forward) + exposed(back, backward))
        else:  # the schedule: gathered once (ZeRO-3: again in each backward), one reduce-scatter at the end
            gathers = 1 + (m if pl.zero == 3 else 0)
            n_coll = gathers + 1
            dp_exposed = (exposed(gather, forward) + (gathers - 1) * exposed(gather, backward)
                          + exposed(scatter, backward))
        dp_exposed += n_coll / 2 * layers * per_layer

    # FSDP units (one per layer + the root) each add hook and collective-launch costs per step. This
    # runtime also uses FSDP2 (replicate) instead of DDP for dp > 1 with tp > 1 or pp > 1.
    # Calibrated per-MB terms: what synchronising a MB of gradients costs beyond the alpha-beta time
    # of an idle link (on CPU ranks: copies and gloo threads competing with compute for the cores).
    tensors = stage_tensors(sh, layers, p == 1, True)
    grad_mb = grad_bytes / 1e6
    if d > 1 and pl.zero >= 2:
        dp_exposed += (layers + 1) * hw.fsdp_unit_overhead_us * 1e-6 + grad_mb * hw.fsdp_overhead_us_per_mb * 1e-6
    elif d > 1:
        dp_exposed += grad_mb * hw.dp_overhead_us_per_mb * 1e-6
        if t > 1 or p > 1:  # replicated through FSDP2 units
            dp_exposed += (layers + 1) * hw.replicate_unit_overhead_us * 1e-6
        if pl.zero == 1:  # broadcasts after the step: one per tensor under DDP, one per owner rank otherwise
            dp_exposed += (d if (t > 1 or p > 1) else tensors) * hw.zero1_overhead_us * 1e-6

    # Adam reads and writes weights, grads and states of the parameters this rank updates.
    updated = stage_params / (d if pl.zero else 1) + e_params / (de if pl.zero else 1)
    # Measured per parameter on CPU ranks, where Adam's arithmetic on a shared core is the bound.
    optim = updated * max((hw.optim_bytes + hw.weight_bytes + hw.grad_bytes) * 2 / (hw.mem_bw_gbs * 1e9),
                          hw.optimizer_ns_per_param * 1e-9)
    # Per-tensor work of a step (Adam's loop, grad-norm, zero_grad) on the busiest stage.
    optim += (tensors * hw.step_overhead_us + hw.step_fixed_us) * 1e-6

    total = m * slot + bubble + p2p + dp_exposed + optim
    est = Estimate(plan=pl, microbatches=m, dp_algo=algo)
    est.time = {"compute": m * compute_mb, "tp_comm": m * tp_mb, "ep_comm": m * ep_mb, "cp_comm": m * cp_mb,
                "bubble": bubble, "p2p": p2p,
                "dp_comm": dp_exposed, "optimizer": optim, "total": total}
    est.memory = _memory(pb, pl, m, counts)
    est.fits = est.memory["total"] <= hw.mem_gb * GiB
    n_dev = pb.world
    est.tflops_per_gpu = iteration_flops(sh, pb.global_batch, pl.recompute, flash, early_stop) / (total * n_dev) / 1e12
    est.mfu = model_flops(sh, pb.global_batch) / (total * n_dev * hw.peak_tflops * 1e12)
    est.tokens_per_s = pb.global_batch * sh.seq / total
    return est
