"""Published training runs the cost model is checked against, with their sources.

Two roles, kept apart so that accuracy is never reported on the rows that set the constants:

- *fit* rows set constants of a hardware preset: Narayanan et al. SC21 Table 1 (Megatron-LM on
  A100-80GB; TFLOP/s per GPU counting recomputation) set the A100 compute constants
  (``gemm_efficiency``, ``gemm_half_width``, ``elementwise_traffic``), and torchtitan's FSDP2
  Llama rows on A100-80GB set ``dp_overlap`` for FSDP runs (FSDP2 prefetches the next layer's
  all-gather while the current one computes; Megatron-LM 2021 reduced after the backward, hence
  0 in the preset);
- *held-out* rows are predicted with those constants and nothing refitted: MosaicML's MPT
  benchmark table (Composer + FSDP FULL_SHARD on A100-80GB, amp_bf16, flash attention).

Sources (read 2026-11):
- Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters Using
  Megatron-LM", SC21, Table 1 (batch/micro-batch as in that table; b=1, full recompute).
- pytorch/torchtitan ``docs/performance.md`` (2024), "Llama 3 performance numbers" and "Llama 2
  performance numbers": FSDP2 on 64 A100 (80GB), tokens/s per GPU ("WPS"). Rows with torchtitan's
  op-level selective checkpointing ("selective op"/"selective layer") are left out: this runtime and
  its cost model have no such policy (it recomputes every other matmul), so they are not expressible.
- mosaicml/llm-foundry ``scripts/train/benchmarking/README.md``, table "A100 80GB with 1600 Gbps
  node-node interconnect (RoCE)": Throughput (T/s/GPU). MPT shapes from llm-foundry's ``yamls``
  (expansion ratio 4, vocab 50368, no biases; the table's parameter counts include a learned
  position table, so we count one). torchtitan's H100 rows (2024-12) ran on 500 W HBM2e H100s
  whose peak the authors do not know, so they are not used.
"""

from __future__ import annotations

from dataclasses import dataclass

from xirang_hpc.planner.cost import Plan, Problem, estimate
from xirang_hpc.planner.formulas import Shape
from xirang_hpc.planner.hardware import PRESETS, Hardware


@dataclass(frozen=True)
class PublishedRun:
    """One published configuration and its measured figure."""

    source: str
    name: str
    shape: Shape
    gpus: int
    micro: int  # sequences per microbatch per GPU
    accum: int  # gradient-accumulation steps (microbatches per step)
    recompute: str  # none | selective | full
    zero: int  # 0 = DDP / Megatron, 3 = FSDP full shard
    tp: int = 1
    pp: int = 1
    metric: str = "tokens_per_gpu"  # or "tflops" (hardware FLOP/s per GPU, recomputation counted)
    value: float = 0.0
    role: str = "held-out"  # fit | held-out

    @property
    def global_batch(self) -> int:
        """Sequences per optimizer step."""
        return self.gpus // (self.tp * self.pp) * self.micro * self.accum


# Megatron-LM 2021 materialized the attention scores (no fused attention kernel); FSDP overlap per module doc.
A100_MEGATRON_2021 = PRESETS["a100-80gb"].scaled(flash_attention=0.0)
FSDP_DP_OVERLAP = 0.8
A100_FSDP = PRESETS["a100-80gb"].scaled(dp_overlap=FSDP_DP_OVERLAP)


def _gpt(layers: int, hidden: int, heads: int) -> Shape:
    return Shape(layers=layers, hidden=hidden, heads=heads, seq=2048, vocab=51200, ffn=4 * hidden)


def _llama(layers: int, hidden: int, heads: int, kv: int, ffn: int, vocab: int, seq: int) -> Shape:
    return Shape(layers=layers, hidden=hidden, heads=heads, seq=seq, vocab=vocab, ffn=ffn, swiglu=True, bias=False,
                 learned_pos=False, kv_heads=kv, tied=False)


_MPT = {"125m": (12, 768, 12), "350m": (24, 1024, 16), "760m": (24, 1536, 12), "1b": (24, 2048, 16),
        "3b": (32, 2560, 20), "7b": (32, 4096, 32), "13b": (40, 5120, 40), "30b": (48, 7168, 56)}


def _mpt(size: str, seq: int) -> Shape:
    layers, hidden, heads = _MPT[size]
    return Shape(layers=layers, hidden=hidden, heads=heads, seq=seq, vocab=50368, ffn=4 * hidden, bias=False)


_NARAYANAN = "Narayanan et al. SC21 Table 1"
_TITAN = "torchtitan docs/performance.md (FSDP2, 64 A100-80GB)"
_MPT_SRC = "llm-foundry benchmarking README (Composer FSDP, A100-80GB)"

NARAYANAN = [
    PublishedRun(_NARAYANAN, "GPT 1.7B", _gpt(24, 2304, 24), 32, 1, 512 // 32, "full", 0, 1, 1, "tflops", 137, "fit"),
    PublishedRun(_NARAYANAN, "GPT 18.4B", _gpt(40, 6144, 48), 256, 1, 1024 // 32, "full", 0, 8, 1, "tflops", 135,
                 "fit"),
    PublishedRun(_NARAYANAN, "GPT 145.6B", _gpt(80, 12288, 96), 1536, 1, 2304 // 24, "full", 0, 8, 8, "tflops", 148,
                 "fit"),
    PublishedRun(_NARAYANAN, "GPT 1008B", _gpt(128, 25600, 160), 3072, 1, 3072 // 6, "full", 0, 8, 64, "tflops", 163,
                 "fit"),
]

TORCHTITAN_A100 = [
    PublishedRun(_TITAN, "Llama 3 70B, full AC", _llama(80, 8192, 64, 8, 28672, 128256, 8192), 64, 1, 1, "full", 3,
                 value=331, role="fit"),
    PublishedRun(_TITAN, "Llama 2 13B, no AC", _llama(40, 5120, 40, 40, 13824, 32000, 4096), 64, 2, 1, "none", 3,
                 value=2162, role="fit"),
    PublishedRun(_TITAN, "Llama 2 70B, full AC", _llama(80, 8192, 64, 8, 28672, 32000, 4096), 64, 2, 1, "full", 3,
                 value=353, role="fit"),
]

# (size, seq, micro, accum, activation checkpointing, tokens/s per GPU); 8 GPUs each.
_MPT_ROWS = [("30b", 8192, 1, 21, True, 574), ("30b", 2048, 3, 21, True, 916), ("13b", 32768, 1, 3, True, 1016),
             ("13b", 8192, 5, 3, True, 1795), ("13b", 2048, 2, 3, False, 2262), ("7b", 65536, 1, 2, True, 1013),
             ("7b", 8192, 8, 2, True, 3206), ("7b", 2048, 6, 2, False, 4641), ("3b", 16384, 1, 6, False, 5529),
             ("3b", 2048, 10, 2, False, 10811), ("1b", 8192, 3, 4, False, 13814), ("1b", 2048, 14, 4, False, 20513),
             ("760m", 4096, 12, 2, False, 27351), ("350m", 2048, 32, 2, False, 58782),
             ("125m", 2048, 40, 2, False, 142830), ("125m", 65536, 1, 2, False, 20368)]
MPT_A100 = [PublishedRun(_MPT_SRC, f"MPT-{size} seq {seq}{', full AC' if ac else ''}", _mpt(size, seq), 8, micro,
                         accum, "full" if ac else "none", 3, value=v)
            for size, seq, micro, accum, ac, v in _MPT_ROWS]

ALL = NARAYANAN + TORCHTITAN_A100 + MPT_A100


def hardware_for(run: PublishedRun) -> Hardware:
    """The preset a row is predicted with: Megatron-2021 settings for Megatron rows, FSDP overlap for FSDP rows."""
    return A100_MEGATRON_2021 if run.zero == 0 else A100_FSDP


def predict(run: PublishedRun, hw: Hardware | None = None) -> float:
    """The cost model's figure for ``run`` in the row's own metric."""
    hw = hw or hardware_for(run)
    per_node = min(8, run.gpus)
    pb = Problem(run.shape, hw, run.gpus // per_node, per_node, run.global_batch)
    dp = run.gpus // (run.tp * run.pp)
    est = estimate(pb, Plan(dp=dp, tp=run.tp, pp=run.pp, micro=run.micro, zero=run.zero, recompute=run.recompute))
    return est.tflops_per_gpu if run.metric == "tflops" else est.tokens_per_s / run.gpus


def relative_errors(runs: list[PublishedRun]) -> list[float]:
    """predicted / published - 1 per row."""
    return [predict(r) / r.value - 1 for r in runs]
