"""Hardware presets for the planner: one accelerator plus the network around it.

A cluster preset names an accelerator with ``cluster.gpu`` and may override any field below in
``cluster.hardware`` (a mapping, e.g. written by ``xirang-plan --calibrate``). Bandwidths are what
collectives *achieve* (NCCL bus bandwidth), not link line rates; where a preset derives them from
line rates the factor is stated.

Public specs used (dense bf16 Tensor Core rates; the datasheets print twice these "with sparsity"):

- A100 SXM (NVIDIA A100 Tensor Core GPU datasheet, 2021): 312 TFLOP/s, 40 GB HBM2 at 1,555 GB/s or
  80 GB HBM2e at 2,039 GB/s, NVLink3 600 GB/s bidirectional = 300 GB/s per direction.
- H100 SXM5 (NVIDIA H100 Tensor Core GPU datasheet, 2023): 989 TFLOP/s bf16, 80 GB HBM3 at
  3.35 TB/s, NVLink4 900 GB/s bidirectional = 450 GB/s per direction through NVSwitch.
- H200 SXM (NVIDIA H200 Tensor Core GPU datasheet, 2024): the H100's compute (989 TFLOP/s bf16) and
  NVLink (900 GB/s), 141 GB HBM3e at 4.8 TB/s.
- FP8 (the same H100 and H200 datasheets): 1,979 TFLOP/s dense FP8 Tensor Core (3,958 "with sparsity"),
  twice the bf16 rate; the A100 has no FP8 (``fp8_tflops`` 0).
- Network: a DGX A100 node has 8x ConnectX-6 200 Gb/s HDR InfiniBand (Narayanan et al. SC21's
  cluster); DGX H100 / DGX H200 nodes have 8x ConnectX-7 400 Gb/s NDR, one per GPU (DGX H100/H200
  user guide, "Hardware overview"): 50 GB/s per GPU, 400 GB/s per node line rate.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from xirang_hpc.config.errors import ConfigError
from xirang_hpc.config.schema import ClusterConfig


@dataclass(frozen=True)
class Hardware:
    """What the cost model needs to know about one rank's device and its links."""

    name: str
    peak_tflops: float  # dense peak of the training dtype, per device
    mem_gb: float  # device memory usable by one rank
    mem_bw_gbs: float  # device memory bandwidth (optimizer step is bandwidth-bound)
    gemm_efficiency: float  # fraction of peak a transformer layer reaches at large widths
    gemm_half_width: float  # per-rank hidden width h/t at which efficiency halves (kernel size effect)
    kernel_overhead_us: float  # fixed cost per layer per microbatch and pass (kernel launches)
    elementwise_traffic: float  # memory-bound ops: passes over the layer's activation bytes, per pass
    intra_bw_gbs: float  # per-rank collective bandwidth inside a node
    intra_latency_us: float
    inter_bw_gbs: float  # per-NODE bandwidth across nodes (shared by the node's ranks)
    inter_latency_us: float
    inter_nics: int  # NICs per node: one flow cannot exceed inter_bw_gbs / inter_nics
    dp_overlap: float  # fraction of the backward pass that can hide DP gradient communication
    reserved_gb: float  # context, communicator buffers, allocator slack
    act_bytes: int = 2  # bytes per activation element
    weight_bytes: int = 2
    grad_bytes: int = 2
    optim_bytes: int = 12  # fp32 master + Adam m, v (mixed precision)
    grad_comm_bytes: int = 2  # bytes per gradient element on the wire
    # Fixed runtime costs that matter where compute is small (CPU ranks); 0 on the GPU presets.
    # ``xirang-plan --calibrate`` measures them (planner/probe.py); all are per rank, in microseconds.
    attn_score_ns: float = 0.0  # per attention-score element (b * heads * seq^2) and pass, beyond its FLOPs
    microbatch_overhead_us: float = 0.0  # embedding + head + loss dispatch, per microbatch
    step_overhead_us: float = 0.0  # per step and parameter tensor held: Adam's loop, grad-norm, zero_grad
    step_fixed_us: float = 0.0  # per step, once: the loop's own work, data, the loss/grad-norm collectives
    tp_overhead_us: float = 0.0  # extra per layer, microbatch and pass under tensor parallelism (DTensor)
    tp_overhead_us_per_mb: float = 0.0  # ... plus this per MB of the layer's b*s*h activations (copies, waits)
    sp_overhead_us: float = 0.0  # further extra per layer, microbatch and pass with sequence parallelism
    pp_overhead_us: float = 0.0  # per pipeline slot (one microbatch's forward+backward on a stage)
    fsdp_unit_overhead_us: float = 0.0  # per FSDP unit (layer) and step: gather/reduce hooks (ZeRO-3)
    replicate_unit_overhead_us: float = 0.0  # per FSDP2 unit and step when it only replicates (tp/pp > 1)
    optimizer_ns_per_param: float = 0.0  # grad clip + Adam per parameter updated, when above the bandwidth bound
    # Per broadcast of updated weights after a ZeRO-1 step: one per parameter tensor under DDP
    # (ZeroRedundancyOptimizer), one per owner rank under FSDP2 replication (tp > 1 or pp > 1).
    zero1_overhead_us: float = 0.0
    dp_overhead_us_per_mb: float = 0.0  # per MB of gradients synchronised by DDP / ZeRO-1 / replicate
    fsdp_buffer_factor: float = 0.0  # FSDP (ZeRO-3) buffers beyond 2 gathered layers, x unsharded parameter bytes
    fsdp_overhead_us_per_mb: float = 0.0  # per MB of gradients under FSDP (ZeRO-3): gathers, scatters, copies
    # Fraction of the pipeline bubble that costs wall time: 1 where every rank owns its device (GPUs);
    # below 1 where ranks outnumber cores, since an idle stage's core runs another rank meanwhile.
    bubble_exposed: float = 1.0
    # Attention through a fused kernel (FlashAttention / PyTorch SDPA's flash and memory-efficient
    # kernels, which this runtime uses on GPUs): 1 = scores never in memory, 0 = materialized.
    flash_attention: float = 0.0
    # Fraction of peak the attention products reach (FlashAttention-2 reports 50-73% of peak on A100
    # forward, Dao 2023); 0 = the GEMM efficiency. Calibrated per hardware.
    attn_efficiency: float = 0.0
    # Bytes the loss moves through device memory per logit element (b*s*V/t) and training step, beyond
    # the output GEMM: PyTorch's cross_entropy on fp32-upcast logits (this runtime's models/gpt.py,
    # torchtitan, Megatron's vocab-parallel loss) reads the 16-bit logits and writes fp32 (2+4),
    # log_softmax reads and writes them (4+4); the backward writes the one-hot gradient (4), the
    # softmax backward reads two and writes one (12), the cast back reads 4 and writes 2: 36 bytes.
    # A fused loss kernel (flash-attn's cross_entropy, as llm-foundry uses) reads the 16-bit logits in
    # the forward and reads them again and writes their gradient in the backward: 6 bytes.
    # Cf. Wijmans et al., "Cut Your Losses in Large-Vocabulary Language Models" (ICLR 2025), Sec. 1-3:
    # the logit matrix, not the head GEMM, dominates the loss's memory and traffic at large vocabularies.
    logit_bytes: float = 0.0
    # Bytes per logit element and microbatch that the training loop moves through device memory *outside*
    # the loss, for training metrics computed on every microbatch's logits. Composer (0.16, which
    # llm-foundry 0.3 ran its benchmarks on) calls each train metric's update after every microbatch's
    # backward (``Trainer._train_microbatch`` -> ``_eval_train_metrics``, under autocast); llm-foundry's
    # MPT has two, ``LanguageCrossEntropy`` and ``LanguagePerplexity``, each an unfused
    # ``torch.nn.CrossEntropyLoss`` over the b*s x V logits. ``cross_entropy`` autocasts to fp32 (PyTorch
    # AMP docs, "CUDA ops that can autocast to float32"): read the 16-bit logits, write fp32 (2 + 4); then
    # log_softmax over rows of V fp32 elements, which at V = 50,368 exceed a block's 48 KiB of shared
    # memory, so PyTorch runs ``cunn_SoftMaxForward`` (aten/src/ATen/native/cuda/SoftMax.cu): a max pass, a
    # sum-of-exp pass and the epilogue each read the row, one write: 4 + 4 bytes from HBM if L2 serves the
    # re-reads, 12 + 4 if none does. Per metric 14 to 22 bytes, for two 28 to 44: the range the composer
    # stack's value is fitted in (planner/published.py). Training metrics of this runtime, torchtitan and
    # Megatron read only the loss: 0.
    metric_bytes: float = 0.0
    # Fraction of a data-parallel collective's time hidden behind compute that the compute still pays:
    # NCCL kernels occupy SMs and contend for HBM bandwidth with the GEMMs they overlap (Rashidi et al.,
    # "Enabling Compute-Communication Overlap in Distributed Deep Learning Training Platforms", ISCA
    # 2021; Jangda et al., "Breaking the Computation and Communication Abstraction Barrier", ASPLOS
    # 2022). 0 = overlap is free.
    comm_interference: float = 0.0
    # Full recomputation through PyTorch's non-reentrant checkpoint (this runtime, FSDP stacks) stops
    # once the backward's saved tensors are back, skipping each block's last GEMM (1); Megatron-LM's
    # reentrant recomputation re-runs the whole block (0). See formulas.recompute_extra.
    checkpoint_early_stop: float = 1.0
    # Fraction of the tensor-parallel collectives' time hidden behind the GEMMs they feed or drain, net of
    # what the overlap costs the GEMMs: Megatron-Core's ``--tp-comm-overlap`` (Transformer Engine's
    # userbuffers) splits each sequence-parallel all-gather + GEMM and GEMM + reduce-scatter into chunks and
    # pipelines them (Wang et al., "Overlap Communication with Dependent Computation via Decomposition in
    # Large Deep Learning Models", ASPLOS 2023; Megatron-LM docs, "Communication overlap"). 0 = exposed, as
    # in this runtime (DTensor collectives wait before the GEMM).
    tp_comm_overlap: float = 0.0
    # 1 = ZeRO-1 as Megatron-Core's distributed optimizer with ``--overlap-grad-reduce
    # --overlap-param-gather`` (Megatron-LM docs, "Distributed optimizer"): gradients are reduce-scattered
    # bucket by bucket during the last microbatch's backward and the updated weights all-gathered during
    # the next step's first forward, each hidden up to ``dp_overlap`` of that pass. 0 = this runtime's
    # ZeRO-1: the whole gradient all-reduce (hidden as ZeRO-0's) and an exposed broadcast after the step.
    distributed_optimizer: float = 0.0
    # 1 = the data-parallel all-gathers and reduce-scatters of sharded stacks (FSDP / ZeRO-2/3, a distributed
    # optimizer) run as NCCL runs them across nodes: one ring per channel, each channel through its own NIC,
    # data moved in chunks along every ring at once, so NVLink and network hops overlap and the slowest link
    # sets the time (comm.pipelined_ring). 0 = the best of a flat single-NIC ring and a hierarchical
    # all-reduce whose intra- and inter-node phases run one after the other (comm.group_allreduce).
    pipelined_rings: float = 0.0
    # NICs per node the sharded stages' rings cross nodes through (comm.pipelined_ring's ``channels``); 0 = one per
    # rank of the node, NCCL's multi-channel rings as above. A stack whose gathers reach less (DeepSpeed ZeRO-3 of
    # 2021, fitted on Narayanan et al. SC21 Table 2 in planner/published.py) sets the share it reaches.
    sharded_ring_channels: float = 0.0
    # 1 = expert parallelism's token dispatcher sends each token once to every other node that holds one of its
    # experts and forwards it there over NVLink (DeepEP; DeepSeek-V3 technical report Sec. 3.2.2): the network
    # carries comm.node_dedup_share of a plain all-to-all's cross-node bytes. 0 = a plain all-to-all (NCCL, as
    # torchtitan's and this runtime's expert parallelism).
    a2a_node_dedup: float = 0.0
    # Dense FP8 Tensor Core peak per device (datasheet; 0 = no FP8). Under train.precision=fp8 the planner runs the
    # linear layers' GEMMs at this rate (``linear_peak_tflops``; attention and the output head stay at
    # ``peak_tflops``, as torchao's float8 training converts only the linear layers and skips the head).
    fp8_tflops: float = 0.0
    # Peak of the linear layers' GEMMs (attention projections, MLP, experts, router); 0 = ``peak_tflops``.
    linear_peak_tflops: float = 0.0

    def scaled(self, **overrides: float) -> Hardware:
        """A copy with some fields replaced."""
        return dataclasses.replace(self, **overrides)


# NCCL reaches ~80% of NVLink/IB line rates as bus bandwidth; the presets use that factor.
_BUS = 0.8
# gemm_efficiency, gemm_half_width and elementwise_traffic of the A100 were fitted to the four
# Narayanan et al. SC21 Table 1 rows (Megatron-LM 2021, which reduced gradients after the backward:
# dp_overlap 0); ``planner/published.py`` reproduces that setup (materialized scores, reentrant
# recomputation) for those rows and keeps its FSDP-stack fits apart. This runtime runs attention
# through SDPA's fused kernels on GPUs (flash_attention=1), its loss on fp32 logits (logit_bytes 36)
# and full recomputation through non-reentrant checkpoint (checkpoint_early_stop 1).
_A100 = dict(peak_tflops=312.0, gemm_efficiency=0.70, gemm_half_width=25.0, kernel_overhead_us=20.0,
             elementwise_traffic=2.25, intra_bw_gbs=300.0 * _BUS, intra_latency_us=3.0,
             inter_bw_gbs=8 * 25.0 * _BUS, inter_latency_us=8.0, inter_nics=8, dp_overlap=0.0, reserved_gb=3.0,
             flash_attention=1.0, logit_bytes=36.0, pipelined_rings=1.0)
# H100/H200 SXM: datasheet peak, NVLink4 and 8x NDR 400 Gb/s per node (module docstring). The GEMM constants
# (gemm_efficiency, elementwise_traffic) were fitted on llm-foundry's H100 BF16 rows of 512, 1,024
# and 65,536 tokens (Composer FSDP; planner/published.py, 12 rows) and checked on its 40 other H100 rows
# (benchmarks/RESULTS.md); dp_overlap and comm_interference come from the A100 FSDP fit (torchtitan + llm-foundry A100
# rows). Both GPU presets time FSDP's collectives across nodes as NCCL's pipelined rings (pipelined_rings 1; this
# runtime's FSDP2 runs on NCCL there). attn_efficiency is the fused attention kernel's rate on the tiles it runs
# (formulas.causal_fraction), from the kernel this runtime runs on H100 (PyTorch SDPA's flash backend,
# FlashAttention-2): Dao, "FlashAttention-2" (2023), Sec. 4.1 and Fig. 7, up to 335 TFLOP/s forward + backward
# on H100 SXM5 at head dimension 128, causal FLOPs counted on the tiles run: 335 / 989 = 0.339. The 0.184 fitted
# on llm-foundry's 2023 H100 rows is that stack's older kernel (flash-attn 1.0.9 / Triton) and stays in its stack
# (planner/published.py). Megatron-LM's published TP/PP H100 rows are checked
# in planner/published.py under the megatron-core stack, whose TP and distributed-optimizer overlap (tp_comm_overlap,
# distributed_optimizer) this runtime does not have: the presets keep those at 0.
_H100 = dict(peak_tflops=989.0, gemm_efficiency=0.753, gemm_half_width=40.0, kernel_overhead_us=15.0,
             elementwise_traffic=4.064, intra_bw_gbs=450.0 * _BUS, intra_latency_us=3.0,
             inter_bw_gbs=8 * 50.0 * _BUS, inter_latency_us=8.0, inter_nics=8, dp_overlap=0.085, reserved_gb=3.0,
             flash_attention=1.0, attn_efficiency=round(335.0 / 989.0, 3), logit_bytes=36.0, comm_interference=0.452,
             pipelined_rings=1.0, fp8_tflops=1979.0)

PRESETS: dict[str, Hardware] = {
    "a100-40gb": Hardware(name="a100-40gb", mem_gb=40.0, mem_bw_gbs=1555.0, **_A100),
    "a100-80gb": Hardware(name="a100-80gb", mem_gb=80.0, mem_bw_gbs=2039.0, **_A100),
    "h100": Hardware(name="h100", mem_gb=80.0, mem_bw_gbs=3350.0, **_H100),
    "h200": Hardware(name="h200", mem_gb=141.0, mem_bw_gbs=4800.0, **_H100),
    # A CPU rank trains in fp32 (4-byte weights/grads, Adam m+v = 8 bytes, no master copy).
    # Rates are placeholders for a few cores per rank over loopback TCP: calibrate them.
    "cpu": Hardware(name="cpu", peak_tflops=0.05, mem_gb=8.0, mem_bw_gbs=10.0, gemm_efficiency=0.5,
                    gemm_half_width=16.0, kernel_overhead_us=200.0, elementwise_traffic=1.0, intra_bw_gbs=1.0,
                    intra_latency_us=50.0, inter_bw_gbs=1.0, inter_latency_us=100.0, inter_nics=1,
                    dp_overlap=0.5, reserved_gb=0.3, act_bytes=4, weight_bytes=4, grad_bytes=4, optim_bytes=8,
                    grad_comm_bytes=4),
}

_MAY_BE_ZERO = {"gemm_half_width", "kernel_overhead_us", "elementwise_traffic", "dp_overlap", "reserved_gb",
                "microbatch_overhead_us", "step_overhead_us", "step_fixed_us", "tp_overhead_us", "pp_overhead_us",
                "fsdp_unit_overhead_us", "replicate_unit_overhead_us", "zero1_overhead_us",
                "sp_overhead_us", "tp_overhead_us_per_mb", "bubble_exposed", "dp_overhead_us_per_mb",
                "fsdp_overhead_us_per_mb", "optimizer_ns_per_param", "fsdp_buffer_factor", "attn_score_ns",
                "flash_attention", "attn_efficiency", "logit_bytes", "comm_interference",
                "checkpoint_early_stop", "metric_bytes", "pipelined_rings", "sharded_ring_channels", "a2a_node_dedup",
                "fp8_tflops", "linear_peak_tflops"}
_FRACTIONS = {"bubble_exposed", "dp_overlap", "flash_attention", "attn_efficiency", "comm_interference",
              "checkpoint_early_stop", "pipelined_rings", "a2a_node_dedup"}
TUNABLE = tuple(f.name for f in dataclasses.fields(Hardware) if f.name != "name")


def default_gpu(cluster: ClusterConfig) -> str:
    """``cluster.gpu`` if set, else ``cpu`` for GPU-less clusters and ``a100-80gb`` otherwise."""
    if cluster.gpu:
        return cluster.gpu
    return "cpu" if cluster.gpus_per_node == 0 else "a100-80gb"


def with_precision(hw: Hardware, precision: str) -> Hardware:
    """``hw`` for ``train.precision``: under fp8 the linear layers' GEMMs at the device's FP8 peak
    (``fp8_tflops``); a device without one is refused, naming the preset and the fix."""
    if precision != "fp8":
        return hw
    if hw.fp8_tflops <= 0:
        raise ConfigError("train.precision", "fp8", f"the {hw.name} preset has no FP8 peak (no float8 tensor cores); "
                          "plan with train.precision=bf16, choose an h100/h200 cluster.gpu, or set "
                          "cluster.hardware.fp8_tflops")
    return hw.scaled(linear_peak_tflops=hw.fp8_tflops)


def hardware_for(cluster: ClusterConfig) -> Hardware:
    """The preset named by the cluster, with ``cluster.hardware`` overrides applied."""
    name = default_gpu(cluster)
    if name not in PRESETS:
        raise ConfigError("cluster.gpu", name, f"choose one of {sorted(PRESETS)}")
    hw = PRESETS[name]
    overrides: dict[str, float] = {}
    for key, value in dict(cluster.hardware).items():
        if key not in TUNABLE:
            raise ConfigError(f"cluster.hardware.{key}", value, f"unknown field; known: {', '.join(TUNABLE)}")
        if float(value) < 0 or (key not in _MAY_BE_ZERO and float(value) == 0):
            raise ConfigError(f"cluster.hardware.{key}", value,
                              "must be positive" if key not in _MAY_BE_ZERO else "must be 0 or more")
        if key in _FRACTIONS and float(value) > 1:
            raise ConfigError(f"cluster.hardware.{key}", value, "is a fraction: use a value from 0 to 1")
        kind = type(getattr(hw, key))
        overrides[key] = kind(value)
    return hw.scaled(**overrides) if overrides else hw
