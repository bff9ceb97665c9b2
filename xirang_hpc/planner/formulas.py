"""Closed-form counts for a decoder-only transformer: parameters, FLOPs, memory per rank.

Sources (see /work/shared/anchors.md):
- Parameters and FLOPs: Narayanan et al., "Efficient Large-Scale Language Model Training on GPU
  Clusters Using Megatron-LM", SC21, eq. (2)-(3):
  P = 12*l*h^2*(1 + 13/(12h) + (V+s)/(12*l*h));
  F = 96*B*s*l*h^2*(1 + s/(6h) + V/(16*l*h)) with full recomputation, factor 72 without.
- Activation bytes per layer: Korthikanti et al., "Reducing Activation Recomputation in Large
  Transformer Models", 2022, Table 2 (16-bit activations).
- Optimizer/gradient/parameter bytes per ZeRO stage: Rajbhandari et al., ZeRO, SC20.

Everything here is pure arithmetic on a :class:`Shape`; the step-time model lives in ``cost.py``.
"""

from __future__ import annotations

from dataclasses import dataclass

from xirang_hpc.config.schema import ModelConfig


@dataclass(frozen=True)
class Shape:
    """The parts of a model config that costs depend on."""

    layers: int
    hidden: int
    heads: int
    seq: int
    vocab: int
    ffn: int
    swiglu: bool = False
    bias: bool = True
    learned_pos: bool = True

    @classmethod
    def from_model(cls, m: ModelConfig) -> Shape:
        """Shape of a ``model/`` preset."""
        return cls(layers=m.n_layer, hidden=m.d_model, heads=m.n_head, seq=m.seq_len, vocab=m.vocab_size,
                   ffn=m.ffn_dim, swiglu=m.mlp == "swiglu", bias=m.bias, learned_pos=m.pos == "learned")


def layer_params(sh: Shape) -> int:
    """Parameters of one block: 4h^2 attention + (2 or 3)*h*ffn MLP + norms and biases.

    For GELU with ffn=4h and biases this is Narayanan et al.'s 12h^2 + 13h per layer.
    """
    h, f = sh.hidden, sh.ffn
    mats = 4 * h * h + (3 if sh.swiglu else 2) * h * f
    bias = (4 * h + f + h + (f if sh.swiglu else 0)) if sh.bias else 0
    norms = 2 * h * (2 if sh.bias else 1)
    return mats + bias + norms


def layer_tensors(sh: Shape) -> int:
    """Parameter tensors of one block (per-tensor costs: optimizer loop, grad-norm, hooks)."""
    per = 2 if sh.bias else 1
    return (4 + (3 if sh.swiglu else 2)) * per + 2 * per


def stage_tensors(sh: Shape, layers: float, first: bool, last: bool) -> float:
    """Parameter tensors a pipeline stage holds: its blocks, the embeddings (first), norm + head (last)."""
    per = 2 if sh.bias else 1
    return layers * layer_tensors(sh) + (1 + sh.learned_pos if first else 0) + (per + 1 if last else 0)


def embedding_params(sh: Shape) -> int:
    """Token embedding plus learned positions (one copy, as in Narayanan et al.'s (V+s)h term)."""
    return sh.vocab * sh.hidden + (sh.seq * sh.hidden if sh.learned_pos else 0)


def total_params(sh: Shape) -> int:
    """Narayanan et al. eq. (2) generalised: l*(12h^2 + 13h) + (V + s)*h for the GELU GPT."""
    return sh.layers * layer_params(sh) + embedding_params(sh)


def layer_forward_flops(sh: Shape, tokens: int) -> tuple[float, float]:
    """(dense, attention-score) forward FLOPs of one layer over ``tokens`` = b*s tokens.

    Dense: 2 FLOPs per multiply-add over 4 h x h projections and the MLP (24*b*s*h^2 for GELU 4h);
    attention scores QK^T and AV: 4*b*s^2*h. Their sum is 24*b*s*h^2*(1 + s/(6h)) (Narayanan et al.).
    """
    h = sh.hidden
    dense = 2.0 * tokens * (4 * h * h + (3 if sh.swiglu else 2) * h * sh.ffn)
    attn = 4.0 * tokens * sh.seq * h
    return dense, attn


def logits_flops(sh: Shape, tokens: int) -> float:
    """Forward FLOPs of the output projection: 2*b*s*h*V."""
    return 2.0 * tokens * sh.hidden * sh.vocab


def iteration_flops(sh: Shape, batch: int, recompute: str) -> float:
    """FLOPs per iteration over ``batch`` sequences, counting recomputation.

    Training is forward + backward (2x forward) = 3x forward. Full recomputation adds one more
    forward of every layer (Narayanan et al.'s factor 96 instead of 72); selective recomputation
    (Korthikanti et al.) re-runs only the attention-score part. The output layer is not recomputed.
    """
    tokens = batch * sh.seq
    dense, attn = layer_forward_flops(sh, tokens)
    extra = {"none": 0.0, "selective": attn, "full": dense + attn}[recompute]
    return sh.layers * (3.0 * (dense + attn) + extra) + 3.0 * logits_flops(sh, tokens)


def model_flops(sh: Shape, batch: int) -> float:
    """FLOPs per iteration without recomputation (the numerator of MFU)."""
    return iteration_flops(sh, batch, "none")


def narayanan_flops(sh: Shape, batch: int, recompute: bool = True) -> float:
    """Narayanan et al. eq. (3) verbatim: 96 (or 72) * B*s*l*h^2 * (1 + s/(6h) + V/(16lh))."""
    b, s, n, h, v = batch, sh.seq, sh.layers, sh.hidden, sh.vocab
    if recompute:
        return 96.0 * b * s * n * h * h * (1 + s / (6 * h) + v / (16 * n * h))
    return 72.0 * b * s * n * h * h * (1 + s / (6 * h) + v / (12 * n * h))


def layer_activation_bytes(sh: Shape, micro: int, tp: int, sp: bool, recompute: str, act_bytes: int) -> float:
    """Activation bytes one layer keeps for backward, per microbatch (Korthikanti et al. Table 2).

    16-bit activations, per layer: no parallelism s*b*h*(34 + 5*a*s/h); tensor parallel
    s*b*h*(10 + 24/t + 5*a*s/(h*t)); + sequence parallel s*b*h*(34/t + 5*a*s/(h*t));
    selective recompute drops the 5*a*s/h score term; full recompute keeps only the layer input
    2*s*b*h (divided by t under sequence parallelism). ``act_bytes`` rescales 16-bit to fp32.
    The "34" assumes a 4h GELU MLP; a different MLP width scales its 16 bytes/element share.
    """
    s, b, h, a, t = sh.seq, micro, sh.hidden, sh.heads, tp
    scale = act_bytes / 2.0
    mlp = 16.0 * (sh.ffn / (4.0 * h)) * (1.5 if sh.swiglu else 1.0)  # MLP share of the 34
    base = 18.0 + mlp  # = 34 for GELU 4h
    if recompute == "full":
        return scale * 2.0 * s * b * h / (t if sp else 1)
    score = 0.0 if recompute == "selective" else 5.0 * a * s / (h * t)
    if t == 1:
        per = base + score
    elif sp:
        per = base / t + score
    else:
        per = 10.0 + (base - 10.0) / t + score
    return scale * s * b * h * per


def state_bytes_per_param(zero: int, dp: int, w: int, g: int, o: int) -> tuple[float, float, float]:
    """(weights, grads, optimizer) bytes per parameter under ZeRO stage ``zero`` over ``dp`` ranks.

    Rajbhandari et al.: mixed-precision Adam keeps 2 + 2 + 12 = 16 bytes/param; stage 1 shards the
    optimizer (4P + 12P/Nd), stage 2 also the gradients (2P + 14P/Nd), stage 3 everything (16P/Nd).
    """
    if zero == 0:
        return float(w), float(g), float(o)
    if zero == 1:
        return float(w), float(g), o / dp
    if zero == 2:
        return float(w), g / dp, o / dp
    return w / dp, g / dp, o / dp
