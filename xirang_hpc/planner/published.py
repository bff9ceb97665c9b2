"""Published training runs the cost model is checked against, with their sources.

Two roles, kept apart so that accuracy is never reported on the rows that set the constants:

- *fit* rows set constants of a software stack on a GPU (:data:`STACKS`): Narayanan et al. SC21
  Table 1 (Megatron-LM on A100-80GB; TFLOP/s per GPU counting recomputation) set the A100 compute
  constants of the presets (``gemm_efficiency``, ``gemm_half_width``, ``elementwise_traffic``);
  for FSDP stacks, torchtitan's three FSDP2 Llama rows on A100-80GB and llm-foundry's MPT rows at
  short sequences (512 and 1,024 tokens) set ``gemm_efficiency``, ``elementwise_traffic``,
  ``dp_overlap`` and ``comm_interference``, and the composer stack's ``metric_bytes`` (:func:`fit`,
  rerun by ``bench_planner.py --fit``);
  on H100 the MPT rows at 512 and 1,024 tokens set ``gemm_efficiency`` and ``elementwise_traffic``;
  every other row by size of Megatron-LM's H100 table, from the smallest (1.7B, 16B, 70B, 177B, 462B), sets
  the megatron-core stack's overlap constants ``tp_comm_overlap``, ``dp_overlap`` and ``comm_interference``
  (:func:`fit_megatron_core`), the H100 compute constants being llm-foundry's;
- *held-out* rows are predicted with those constants and nothing refitted: every other MPT row of
  llm-foundry's tables (sequences of 2,048 to 65,536 tokens, 8 to 64 GPUs, 125M to 70B parameters),
  on A100-80GB and on H100-80GB; and the four Megatron-LM rows between the fit rows (7.1B, 32B, 119B,
  314B). The rules (fit on the short-sequence rows, predict the long ones; every other Megatron row) were
  fixed before looking at the errors; the first makes the MPT held-out rows an extrapolation in sequence
  length, the second the Megatron ones an interpolation in size, tp and pp.
- at hundreds to thousands of GPUs: Narayanan et al. SC21 Table 2's ZeRO-3 rows set the ``deepspeed-zero3``
  stack's two communication constants on 175B (:func:`fit_deepspeed_zero3`) and are held out on 530B; that
  table's PTD-P rows, BLOOM-176B, OPT-175B and Llama 3 405B are all held out, on stacks whose constants were
  fitted on other rows (each stack's comment in :data:`STACKS` says where from).

Sources (read 2026-11):
- Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters Using
  Megatron-LM", SC21, Table 1 (batch/micro-batch as in that table; b=1, full recompute).
- pytorch/torchtitan ``docs/performance.md`` (2024), "Llama 3 performance numbers" and "Llama 2
  performance numbers": FSDP2 on 64 A100 (80GB), tokens/s per GPU ("WPS"). Rows with torchtitan's
  op-level selective checkpointing ("selective op"/"selective layer") are left out: this runtime and
  its cost model have no such policy (it recomputes every other matmul), so they are not expressible.
  torchtitan's H100 rows (2024-12) ran on 500 W HBM2e H100s whose peak the authors do not know, so
  they are not used.
- mosaicml/llm-foundry ``scripts/train/benchmarking/README.md``, tables "H100 80GB BF16" and
  "A100 80GB with 1600 Gbps node-node interconnect (RoCE)": Throughput (T/s/GPU). Composer FSDP
  FULL_SHARD, fused attention, llm-foundry's fused cross-entropy (flash-attn's kernel, ``loss_fn`` default
  ``fused_crossentropy``), full activation checkpointing of every MPT block where the table says so. The
  tables came with commit b2a43a1 (2023-10), whose ``submit_benchmarks.py`` installs llm-foundry v0.3.0's
  ``.[gpu]`` (flash-attn 1.0.9; MPT's ``attn_impl`` triton by default; the ``.[gpu-flash2]`` install is a
  later script's) on Composer 0.16, whose trainer updates the model's train metrics after every
  microbatch; llm-foundry's MPT has two, each an unfused fp32 cross-entropy over the logits
  (``hardware.metric_bytes``, fitted with the A100 rows). That script also sets Composer's FSDP
  ``mixed_precision`` to ``DEFAULT`` (the tables' "MP Mode" column; the A100 70b rows say ``PURE``), whose
  ``reduce_dtype`` is fp32 (Composer 0.16 ``get_mixed_precision``): FSDP casts each gradient to fp32 before
  its reduce-scatter (torch 2.1 ``fsdp/_runtime_utils._post_backward_hook``), 4 bytes per element on the
  wire where bf16 weights are gathered in 2 (``grad_comm_bytes``; torchtitan's FSDP2 and Megatron-LM under
  bf16 reduce in fp32 too). MPT shapes from llm-foundry's ``yamls``
  (expansion ratio 4, vocab 50368, no biases; the table's parameter counts include a learned position
  table of the sequence length, so we count one). The H100 table does not state its network; the
  h100 preset's (8x 400 Gb/s per node) is used for its 16-64 GPU rows, FSDP's collectives across nodes
  timed as NCCL's pipelined rings (``comm.pipelined_ring``).
- NVIDIA/Megatron-LM ``README.md`` (commit f2e5db4, 2024-07, "New scaling figures on H100 GPUs";
  ``images/model_table.png``): GPT 1.7B..462B on 48..6,144 H100s, each row with its tensor, pipeline
  and data-parallel sizes, global batch and per-GPU teraFLOP/s; vocabulary 131,072, 4,096 tokens,
  Megatron-Core r0.8 with ``--overlap-grad-reduce --overlap-param-gather`` (so the distributed
  optimizer: ZeRO-1) and ``--tp-comm-overlap`` (which needs sequence parallelism). Their teraFLOP/s are
  *model* FLOPs by Megatron's own ``num_floating_point_operations`` of that commit (no recomputation,
  full s^2 attention: :func:`megatron_model_flops`); MFU = that / 989. Micro-batch size, interleaving
  and recomputation are not stated: each row is predicted with the planner's fastest fitting choice of
  those for the published tp/pp/dp (:func:`predict`). The H100 compute constants come from llm-foundry's
  fit rows; the loss is Megatron's fp32 vocab-parallel cross-entropy. Megatron-Core overlaps what this
  runtime exposes, so its stack carries three constants of its own, fitted on five of the nine rows:
  ``tp_comm_overlap`` (``--tp-comm-overlap``: Transformer Engine's userbuffers pipeline each sequence-
  parallel all-gather/reduce-scatter with the GEMM it feeds, Megatron-LM docs, "Communication overlap";
  Wang et al. ASPLOS 2023), and ``dp_overlap`` / ``comm_interference`` of the distributed optimizer
  (``distributed_optimizer``: ``--overlap-grad-reduce`` reduce-scatters gradient buckets during the
  backward, ``--overlap-param-gather`` all-gathers the updated weights during the next forward;
  Megatron-LM docs, "Distributed optimizer"). The README does not state the network; the h100 preset's
  is used.
  The README's strong-scaling figure (GPT-3 175B, 96..4,608 GPUs) gives no layouts and is not used.
- yanring/Megatron-MoE-ModelZoo ``best_practice/Qwen3/readme.md`` (commit c1ad0b5, NVIDIA's Megatron-Core MoE
  recipes), "Performance Results": Qwen3-235B-A22B on 256 H100s (NVLink4, 8x 50 GB/s InfiniBand per node),
  BF16, 4,096 tokens, global batch 2,048, each row with its TP, EP, PP, virtual stages, DP, FSDP, micro-batch,
  recomputation and step time (seconds); tokens/s per GPU = 2048 * 4096 / (step * 256). Held out, nothing
  fitted on them (:data:`MOE_H100`, outside :data:`ALL`): the megatron-core stack's H100 constants, with the MoE
  terms of ``formulas.py`` / ``cost.py``; the DeepEP dispatcher of these rows sends a token once per target node
  (``hardware.a2a_node_dedup``, a property of the dispatcher, not a fitted constant; added after a first
  comparison had charged the cross-node row a plain all-to-all, -32%). Expert tensor parallelism is 1 in every
  row (the ETP column), as the planner's ep > 1. Of the table's five Qwen3-235B rows, the "+1f1b overlap" row
  (the all-to-all of one microbatch hidden behind another's compute, which the cost model does not have) is
  reported apart. Every row ran with ``--account-for-embedding-in-pipeline-split`` and
  ``--account-for-loss-in-pipeline-split`` (``model_configs/benchmarking/Qwen3-235B-A22B.yaml`` of that commit):
  the embedding and the loss each take a block's place in the split (``Plan.ends_as_layers``), which is how the
  A2A-dispatcher row's 32 stages x 3 virtual stages = 96 places hold the 94 blocks; that row's dispatcher is
  Megatron's plain all-to-all (``--moe-token-dispatcher-type alltoall``), not DeepEP's.
- NeMo AutoModel's performance summary (``docs/performance-summary.md`` of NVIDIA-NeMo/Automodel, pre-training on
  DGX-H100, BF16), its Qwen3-30B-A3B row: one node, FSDP2 over 8 with ep 8, full recomputation, micro-batch 4 x
  16 (:data:`~xirang_hpc.planner.published_rows.AUTOMODEL_QWEN3_30B`). A second source and a second stack
  (``automodel``: the h100 preset, this runtime's own FSDP2 description, with fp32 gradient reduction); held out
  in :data:`MOE_H100` with the rows above.
"""

from __future__ import annotations

from xirang_hpc.planner.cost import Plan, Problem, estimate
from xirang_hpc.planner.formulas import model_flops
from xirang_hpc.planner.hardware import PRESETS, Hardware

# The rows, re-exported: the harness below and its callers take them from here.
from xirang_hpc.planner.published_rows import (  # noqa: F401
    ALL,
    BLOOM,
    FIT_LONG_SEQ,
    FIT_MAX_SEQ,
    LLAMA3,
    MEGATRON_H100,
    MOE_H100,
    MPT_A100,
    MPT_H100,
    NARAYANAN,
    NARAYANAN_PTDP,
    NARAYANAN_ZERO3,
    OPT,
    TORCHTITAN_A100,
    PublishedRun,
    _mpt,
    is_original_held_out,
    megatron_model_flops,
)

# Constants of the FSDP stacks, as fitted by :func:`fit` on the fit rows (``bench_planner.py --fit``
# prints them again); the loss's traffic is each stack's own (hardware.logit_bytes).
_A100_FSDP_FIT = dict(gemm_efficiency=0.809, elementwise_traffic=3.193, dp_overlap=0.085, comm_interference=0.452,
                      attn_efficiency=0.326)
_H100_FSDP_FIT = dict(gemm_efficiency=0.753, elementwise_traffic=4.064, attn_efficiency=0.184)
# Composer's two train metrics per microbatch (hardware.metric_bytes), fitted with the A100 constants within the
# hand count's 28-44 bytes; the same software ran the H100 table.
_COMPOSER_METRICS = dict(metric_bytes=31.85)
# Megatron-Core's overlap (hardware.tp_comm_overlap, hardware.distributed_optimizer), fitted by
# :func:`fit_megatron_core` on the Megatron-LM fit rows, with the H100 compute constants above.
_MEGATRON_CORE_FIT = dict(tp_comm_overlap=0.025, dp_overlap=0.824, comm_interference=0.0)
_FUSED_LOSS, _FP32_LOSS = 6.0, 36.0
# DeepSpeed ZeRO-3's overlap and NICs reached, fitted by :func:`fit_deepspeed_zero3` on the 175B rows of Narayanan
# et al. SC21 Table 2.
_DEEPSPEED_ZERO3_FIT = dict(dp_overlap=0.98, sharded_ring_channels=1.0)
# Gradients reduced in fp32 under bf16 compute (4 bytes per element on the wire): Composer FSDP's ``DEFAULT``
# mixed precision (above), torchtitan's FSDP2 ``MixedPrecisionPolicy(reduce_dtype=torch.float32)``
# (``parallelize_llama.py`` of 395a526, later the ``--training.mixed_precision_reduce`` default), and
# Megatron-LM under ``--bf16`` (``arguments.py``: "bfloat16 requires gradient accumulation and all-reduce to
# be done in fp32"). The weights are gathered in bf16 (``weight_bytes`` 2).
_FP32_REDUCE = 4
# Gradients *kept* in fp32 (4 bytes per parameter, not 2) where the stack accumulates them there under 16-bit
# compute: Megatron-LM's ``main_grad`` buffers (``--accumulate-allreduce-grads-in-fp32``, forced on by ``--bf16``,
# ``arguments.py``; Megatron-LM docs, "Distributed optimizer": 18 bytes per parameter for bf16 weights with fp32
# gradients, 6 + 12/d with the distributed optimizer) and DeepSpeed's ``BF16_Optimizer``
# (``deepspeed/runtime/bf16_optimizer.py``: an fp32 gradient buffer the size of the bf16 weights, into which
# every microbatch's gradients are accumulated).
_FP32_GRADS = 4

STACKS: dict[tuple[str, str], Hardware] = {
    # Megatron-LM 2021 materialized the attention scores (no fused attention kernel), reduced after the backward.
    ("a100-80gb", "megatron2021"): PRESETS["a100-80gb"].scaled(flash_attention=0.0, logit_bytes=_FP32_LOSS,
                                                                checkpoint_early_stop=0.0),
    ("a100-80gb", "torchtitan"): PRESETS["a100-80gb"].scaled(logit_bytes=_FP32_LOSS, grad_comm_bytes=_FP32_REDUCE,
                                                              **_A100_FSDP_FIT),
    ("a100-80gb", "composer"): PRESETS["a100-80gb"].scaled(logit_bytes=_FUSED_LOSS, grad_comm_bytes=_FP32_REDUCE,
                                                            **_A100_FSDP_FIT, **_COMPOSER_METRICS),
    ("h100", "composer"): PRESETS["h100"].scaled(
        logit_bytes=_FUSED_LOSS, grad_comm_bytes=_FP32_REDUCE, **_COMPOSER_METRICS,
        dp_overlap=_A100_FSDP_FIT["dp_overlap"],
        comm_interference=_A100_FSDP_FIT["comm_interference"], **_H100_FSDP_FIT),
    # Megatron-Core 2024 (r0.8): fused attention (Transformer Engine), fp32 vocab-parallel cross-entropy, the
    # H100 compute constants as fitted above; TP collectives pipelined with the GEMMs (--tp-comm-overlap) and
    # the distributed optimizer's overlapped reduce-scatter/all-gather, whose constants are its own fit.
    # The H100 compute constants are llm-foundry's fitted set, attention rate included: the three were fitted
    # together, and the preset's public FlashAttention-2 rate beside the other two over-predicts the small rows
    # (held-out mean 6.4% against 3.3%).
    ("h100", "megatron-core"): PRESETS["h100"].scaled(
        logit_bytes=_FP32_LOSS, grad_comm_bytes=_FP32_REDUCE, grad_bytes=_FP32_GRADS, distributed_optimizer=1.0,
        **_H100_FSDP_FIT,
        **_MEGATRON_CORE_FIT),
    # DeepSpeed's pipeline engine over Megatron-DeepSpeed's layers (BLOOM): Megatron 2021's kernels (materialized
    # scores with the fused scaled-masked softmax, reentrant activation checkpointing, fp32 vocab-parallel loss)
    # and its A100 compute constants; BF16_Optimizer keeps and reduces fp32 gradients (grad_bytes 4,
    # grad_comm_bytes 4), all-reduces them once after the last microbatch's backward (``PipelineEngine``'s
    # ``ReduceGrads`` instruction follows the whole schedule: nothing overlapped, dp_overlap 0) and then
    # all-gathers the updated bf16 weights from their owners: this runtime's ZeRO-1 (cost.py).
    ("a100-80gb", "deepspeed"): PRESETS["a100-80gb"].scaled(flash_attention=0.0, logit_bytes=_FP32_LOSS,
                                                             checkpoint_early_stop=0.0, grad_bytes=_FP32_GRADS,
                                                             grad_comm_bytes=_FP32_REDUCE, dp_overlap=0.0),
    ("a100-40gb", "deepspeed"): PRESETS["a100-40gb"].scaled(flash_attention=0.0, logit_bytes=_FP32_LOSS,
                                                             checkpoint_early_stop=0.0, grad_bytes=_FP32_GRADS,
                                                             grad_comm_bytes=_FP32_REDUCE, dp_overlap=0.0),
    # metaseq (OPT, 2022): Megatron-LM's tensor-parallel layers and kernels (materialized scores, reentrant
    # checkpointing, fp32 vocab-parallel loss; the A100 compute constants of Megatron-LM 2021) under FairScale's
    # FSDP, whose gathers are prefetched behind compute as PyTorch FSDP's are: the A100 FSDP overlap constants.
    ("a100-80gb", "metaseq"): PRESETS["a100-80gb"].scaled(
        flash_attention=0.0, logit_bytes=_FP32_LOSS, checkpoint_early_stop=0.0,
        dp_overlap=_A100_FSDP_FIT["dp_overlap"], comm_interference=_A100_FSDP_FIT["comm_interference"]),
    # DeepSpeed ZeRO-3 of 2021 (Narayanan et al. SC21 Table 2's baseline) over Megatron-LM's GPT: Megatron 2021's
    # kernels and A100 compute constants, fp16 weights and gradients (reduced in fp16); parameters prefetched and
    # gradients reduced in buckets during the passes (DeepSpeed's ``overlap_comm``, ``stage3_prefetch_bucket_size``),
    # how much of a pass that hides (``dp_overlap``) and how many NICs per node its gathers reach
    # (``sharded_ring_channels``) fitted on the 175B rows (:func:`fit_deepspeed_zero3`).
    ("a100-80gb", "deepspeed-zero3"): PRESETS["a100-80gb"].scaled(
        flash_attention=0.0, logit_bytes=_FP32_LOSS, checkpoint_early_stop=0.0,
        comm_interference=_A100_FSDP_FIT["comm_interference"], **_DEEPSPEED_ZERO3_FIT),
    # Meta's Llama 3 stack on H100 (Sec. 3.3.2): the h100 preset (fused attention at FlashAttention-2's published
    # H100 rate, fp32 cross-entropy, FSDP overlap from the A100 FSDP fit) with fp32 gradients kept and reduced.
    ("h100", "llama3"): PRESETS["h100"].scaled(grad_bytes=_FP32_GRADS, grad_comm_bytes=_FP32_REDUCE),
    # NeMo AutoModel (PyTorch FSDP2 with expert parallelism): the h100 preset, which describes this runtime's own
    # FSDP2 stack (fused attention at FlashAttention-2's published rate, the FSDP overlap of the A100 fit, fp32
    # logits in the loss), with gradients reduced in fp32 (``MixedPrecisionPolicy(reduce_dtype=torch.float32)``,
    # its MoE parallelizer's default). Its Transformer Engine attention and its loss without the fp32 upcast
    # (``MaskedCrossEntropy(fp32_upcast=False)``) have no published H100 rate of their own: the preset's stand.
    ("h100", "automodel"): PRESETS["h100"].scaled(grad_comm_bytes=_FP32_REDUCE),
}


def hardware_for(run: PublishedRun, stacks: dict[tuple[str, str], Hardware] | None = None) -> Hardware:
    """The hardware preset with the row's software stack's constants (from ``stacks``, default
    :data:`STACKS`) and the row's own reduce precision where it differs from its stack's."""
    hw = (stacks or STACKS)[(run.gpu, run.stack)]
    if run.inter_gbps:
        hw = hw.scaled(inter_bw_gbs=run.inter_gbps, inter_nics=run.nics or hw.inter_nics)
    if run.a2a_node_dedup:
        hw = hw.scaled(a2a_node_dedup=run.a2a_node_dedup)
    return hw.scaled(grad_comm_bytes=run.reduce_bytes) if run.reduce_bytes else hw


def _free_plans(run: PublishedRun, dp: int) -> list[Plan]:
    """The published tp/pp/dp/ZeRO/sp with every micro-batch, interleaving and recomputation the planner
    could choose (interleaving as Megatron allows it: v divides the blocks per stage, m a multiple of pp)."""
    per_dp = run.global_batch // dp
    plans = []
    for micro in (b for b in range(1, per_dp + 1) if per_dp % b == 0):
        m = per_dp // micro
        if run.pp > 1 and m < run.pp:
            continue
        per_stage = (run.shape.layers + (2 if run.ends_as_layers else 0)) // run.pp
        # Megatron interleaves only from 3 stages up, with m a multiple of pp; a published v is kept.
        vs = [1] if run.pp <= 2 else [v for v in range(1, per_stage + 1)
                                      if per_stage % v == 0 and (v == 1 or m % run.pp == 0)]
        if run.v > 1:
            vs = [run.v] if m % run.pp == 0 else []
        for v in vs:
            for rc in (run.recompute,) if run.fixed_recompute else ("none", "selective", "full"):
                plans.append(Plan(dp=dp, tp=run.tp, pp=run.pp, micro=micro, v=v, zero=run.zero, recompute=rc,
                                  sp=run.sp, ep=run.ep, ends_as_layers=run.ends_as_layers))
    return plans


def plan_for(run: PublishedRun, hw: Hardware | None = None) -> Plan:
    """The plan ``run`` is predicted with: as published, or for ``free_knobs`` rows the fastest plan that fits
    among the published layout's unpublished choices (none fitting: the fastest)."""
    hw = hw or hardware_for(run)
    dp = run.gpus // (run.tp * run.pp)
    if not run.free_knobs:
        return Plan(dp=dp, tp=run.tp, pp=run.pp, micro=run.micro, v=run.v, zero=run.zero, recompute=run.recompute,
                    sp=run.sp, ep=run.ep, ends_as_layers=run.ends_as_layers)
    pb = _problem(run, hw)
    ests = [estimate(pb, pl) for pl in _free_plans(run, dp)]
    return min(ests, key=lambda e: (not e.fits, e.step_time)).plan


def _problem(run: PublishedRun, hw: Hardware) -> Problem:
    per_node = min(8, run.gpus)
    return Problem(run.shape, hw, run.gpus // per_node, per_node, run.global_batch)


def predict(run: PublishedRun, hw: Hardware | None = None) -> float:
    """The cost model's figure for ``run`` in the row's own metric."""
    hw = hw or hardware_for(run)
    est = estimate(_problem(run, hw), plan_for(run, hw))
    if run.metric == "tflops":
        return est.tflops_per_gpu
    if run.metric == "model_tflops":  # model FLOPs (no recomputation) per GPU: MFU x peak
        return model_flops(run.shape, run.global_batch) / est.step_time / run.gpus / 1e12
    if run.metric == "megatron_tflops":  # the published figure's own FLOP count over the predicted step
        return megatron_model_flops(run.shape, run.global_batch) / est.step_time / run.gpus / 1e12
    return est.tokens_per_s / run.gpus


def relative_errors(runs: list[PublishedRun]) -> list[float]:
    """predicted / published - 1 per row."""
    return [predict(r) / r.value - 1 for r in runs]


# Fields that belong to one software stack's behaviour: a fit applies them to that stack's rows only.
STACK_FIELDS = {"metric_bytes": ("composer",)}


def _for_stack(vals: dict[str, float], stack: str) -> dict[str, float]:
    return {k: v for k, v in vals.items() if stack in STACK_FIELDS.get(k, (stack,))}


def fit(runs: list[PublishedRun], base: dict[tuple[str, str], Hardware], fields: dict[str, tuple[float, float]],
        rounds: int = 4, steps: int = 24) -> dict[str, float]:
    """Constants minimising the mean |relative error| over ``runs`` (each predicted with its stack in ``base``
    plus the fitted fields, less those :data:`STACK_FIELDS` keeps to other stacks): coordinate search over
    each field's (low, high) range, ``steps`` points per round, the range narrowing around the best point
    each round. Deterministic; no row outside ``runs``."""
    values = {k: (lo + hi) / 2 for k, (lo, hi) in fields.items()}
    spans = {k: hi - lo for k, (lo, hi) in fields.items()}

    def loss(vals: dict[str, float]) -> float:
        errs = [predict(r, hardware_for(r, base).scaled(**_for_stack(vals, r.stack))) / r.value - 1 for r in runs]
        return sum(map(abs, errs)) / len(errs)

    for _ in range(rounds):
        for k, (lo, hi) in fields.items():
            grid = [max(lo, min(hi, values[k] + spans[k] * (i / (steps - 1) - 0.5))) for i in range(steps)]
            values[k] = min(grid, key=lambda x: loss({**values, k: x}))
            spans[k] /= 3
    return values


# What the fits vary, and over which ranges (fractions of peak, passes over the activations; the bytes of
# Composer's two train metrics per logit element between all re-reads served by L2 and none: hardware.py).
FSDP_FIT_FIELDS = {"gemm_efficiency": (0.5, 0.95), "elementwise_traffic": (0.0, 6.0), "dp_overlap": (0.0, 1.0),
                   "comm_interference": (0.0, 1.0), "attn_efficiency": (0.2, 0.95), "metric_bytes": (28.0, 44.0)}
H100_FIT_FIELDS = {"gemm_efficiency": (0.3, 0.9), "elementwise_traffic": (0.0, 8.0), "attn_efficiency": (0.1, 0.9)}
MEGATRON_CORE_FIT_FIELDS = {"tp_comm_overlap": (0.0, 1.0), "dp_overlap": (0.0, 1.0), "comm_interference": (0.0, 1.0)}


def fit_a100() -> dict[str, float]:
    """The A100 FSDP constants from the A100 fit rows of the FSDP stacks (torchtitan + llm-foundry)."""
    rows = [r for r in ALL if r.role == "fit" and r.gpu == "a100-80gb" and r.stack in ("torchtitan", "composer")]
    return fit(rows, STACKS, FSDP_FIT_FIELDS)


def fit_h100(a100: dict[str, float]) -> dict[str, float]:
    """The H100 compute constants from the H100 fit rows, overlap constants and Composer's train-metric bytes
    (the same software on both GPUs) taken from the A100 fit."""
    rows = [r for r in MPT_H100 if r.role == "fit"]
    base = {k: v.scaled(**_for_stack({"dp_overlap": a100["dp_overlap"], "comm_interference": a100["comm_interference"],
                                      "metric_bytes": a100.get("metric_bytes", v.metric_bytes)}, k[1]))
            for k, v in STACKS.items()}
    return fit(rows, base, H100_FIT_FIELDS)


def fit_megatron_core() -> dict[str, float]:
    """Megatron-Core's overlap constants (TP communication hidden, data-parallel overlap and its interference)
    from the Megatron-LM fit rows, every other constant as stored (H100 compute constants from llm-foundry)."""
    return fit([r for r in MEGATRON_H100 if r.role == "fit"], STACKS, MEGATRON_CORE_FIT_FIELDS)


DEEPSPEED_ZERO3_FIT_FIELDS = {"dp_overlap": (0.0, 1.0), "sharded_ring_channels": (1.0, 8.0)}


def fit_deepspeed_zero3() -> dict[str, float]:
    """DeepSpeed ZeRO-3's overlap and NICs reached from the fit rows of Narayanan et al. SC21 Table 2 (175B): for
    each whole number of NICs (1 to 8, the node's), :func:`fit` of the overlap; the pair with the least mean
    |relative error| is kept."""
    rows = [r for r in NARAYANAN_ZERO3 if r.role == "fit"]

    def loss(vals: dict[str, float]) -> float:
        return sum(abs(predict(r, hardware_for(r).scaled(**vals)) / r.value - 1) for r in rows) / len(rows)

    best: dict[str, float] = {}
    for nics in range(1, 9):
        base = {k: v.scaled(sharded_ring_channels=float(nics)) for k, v in STACKS.items()}
        vals = {**fit(rows, base, {"dp_overlap": DEEPSPEED_ZERO3_FIT_FIELDS["dp_overlap"]}),
                "sharded_ring_channels": float(nics)}
        if not best or loss(vals) < loss(best):
            best = vals
    return best
