"""Closed-form counts for a decoder-only transformer: parameters, FLOPs, memory per rank.

Sources (see /work/shared/anchors.md):
- Parameters and FLOPs: Narayanan et al., "Efficient Large-Scale Language Model Training on GPU
  Clusters Using Megatron-LM", SC21, eq. (2)-(3):
  P = 12*l*h^2*(1 + 13/(12h) + (V+s)/(12*l*h));
  F = 96*B*s*l*h^2*(1 + s/(6h) + V/(16*l*h)) with full recomputation, factor 72 without.
- Activation bytes per layer: Korthikanti et al., "Reducing Activation Recomputation in Large
  Transformer Models", 2022, Table 2 (16-bit activations).
- Optimizer/gradient/parameter bytes per ZeRO stage: Rajbhandari et al., ZeRO, SC20.
- Grouped-query attention (Ainslie et al., "GQA", EMNLP 2023): k and v project to n_kv_head heads,
  so their weights, FLOPs and stored activations shrink by n_kv_head/n_head; the score and value
  products QK^T and AV still run over all n_head query heads (their FLOPs do not change).
- Fused attention (Dao et al., FlashAttention, NeurIPS 2022, and FlashAttention-2, 2023): scores
  are never written to device memory (no 5*a*s/h term in Korthikanti's activations, no score
  traffic); the backward recomputes them, 5 matrix products instead of 4 (FlashAttention-2 Sec.
  3.1.2), so training costs 3.5 forward attention passes instead of 3.

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
    kv_heads: int = 0  # key/value heads (grouped-query attention); 0 = heads
    # The output head shares the token embedding (Megatron's GPT, GPT-2: Narayanan et al.'s (V+s)h
    # count). Untied models (Llama) hold another V*h.
    tied: bool = True
    # Width of one attention head; 0 = hidden/heads (Qwen3's small models decouple it).
    head_dim: int = 0
    # Biases on q/k/v only (Qwen2) and per-head q/k RMSNorm weights (Qwen3): small, but counted so the
    # planner's parameter count equals the model's exactly.
    qkv_bias: bool = False
    qk_norm: bool = False

    @classmethod
    def from_model(cls, m: ModelConfig) -> Shape:
        """Shape of a ``model/`` preset."""
        return cls(layers=m.n_layer, hidden=m.d_model, heads=m.n_head, seq=m.seq_len, vocab=m.vocab_size,
                   ffn=m.ffn_dim, swiglu=m.mlp == "swiglu", bias=m.bias, learned_pos=m.pos == "learned",
                   kv_heads=m.n_kv_head, tied=m.tie_embeddings, head_dim=m.d_head, qkv_bias=m.attn_qkv_bias,
                   qk_norm=m.qk_norm)

    @property
    def kv_width(self) -> int:
        """Width of the key and of the value projection: n_kv_head * head_dim (= hidden without GQA)."""
        if self.head_dim:
            return self.n_kv * self.head_dim
        return self.hidden * (self.kv_heads or self.heads) // self.heads

    @property
    def q_width(self) -> int:
        """Width of the query projection (and the output projection's input): heads * head_dim."""
        return self.heads * self.head_dim if self.head_dim else self.hidden

    @property
    def hd(self) -> int:
        """Width of one attention head."""
        return self.head_dim or self.hidden // self.heads

    @property
    def n_kv(self) -> int:
        """Key/value heads."""
        return self.kv_heads or self.heads


def attn_matrix_params(sh: Shape) -> int:
    """q and output projections h*q_width each (h*h unless head_dim is decoupled), k and v h*kv_width each
    (GQA); 4h^2 without GQA."""
    return 2 * sh.hidden * sh.q_width + 2 * sh.hidden * sh.kv_width


def layer_params(sh: Shape) -> int:
    """Parameters of one block: attention projections + (2 or 3)*h*ffn MLP + norms and biases.

    For GELU with ffn=4h, biases and no GQA this is Narayanan et al.'s 12h^2 + 13h per layer.
    """
    h, f = sh.hidden, sh.ffn
    mats = attn_matrix_params(sh) + (3 if sh.swiglu else 2) * h * f
    if sh.bias:
        bias = sh.q_width + h + 2 * sh.kv_width + f + h + (f if sh.swiglu else 0)  # q, o, k, v, up, down, gate
    else:
        bias = sh.q_width + 2 * sh.kv_width if sh.qkv_bias else 0
    norms = 2 * h * (2 if sh.bias else 1) + (2 * sh.hd if sh.qk_norm else 0)
    return mats + bias + norms


def layer_tensors(sh: Shape) -> int:
    """Parameter tensors of one block (per-tensor costs: optimizer loop, grad-norm, hooks)."""
    per = 2 if sh.bias else 1
    extra = (3 if sh.qkv_bias and not sh.bias else 0) + (2 if sh.qk_norm else 0)
    return (4 + (3 if sh.swiglu else 2)) * per + 2 * per + extra


def stage_tensors(sh: Shape, layers: float, first: bool, last: bool) -> float:
    """Parameter tensors a pipeline stage holds: its blocks, the embeddings (first), norm + head (last)."""
    per = 2 if sh.bias else 1
    return layers * layer_tensors(sh) + (1 + sh.learned_pos if first else 0) + (per + 1 if last else 0)


def embedding_params(sh: Shape) -> int:
    """Token embedding plus learned positions (one copy, as in Narayanan et al.'s (V+s)h term)."""
    return sh.vocab * sh.hidden + (sh.seq * sh.hidden if sh.learned_pos else 0)


def head_params(sh: Shape) -> int:
    """The output projection's own parameters: V*h, or 0 when tied to the embedding."""
    return 0 if sh.tied else sh.vocab * sh.hidden


def total_params(sh: Shape) -> int:
    """Narayanan et al. eq. (2) generalised: l*(12h^2 + 13h) + (V + s)*h for the GELU GPT (+ V*h untied)."""
    return sh.layers * layer_params(sh) + embedding_params(sh) + head_params(sh)


def model_params(m: ModelConfig) -> int:
    """Parameters of the whole model a ``model/`` preset builds, exactly (the final norm included), without
    torch: what the launcher sizes a checkpoint by before it submits."""
    final_norm = m.d_model * (2 if m.bias and m.norm == "layernorm" else 1)
    return total_params(Shape.from_model(m)) + final_norm


def layer_forward_flops(sh: Shape, tokens: int) -> tuple[float, float]:
    """(dense, attention-score) forward FLOPs of one layer over ``tokens`` = b*s tokens.

    Dense: 2 FLOPs per multiply-add over the attention projections and the MLP (24*b*s*h^2 for GELU 4h
    without GQA); attention scores QK^T and AV over all query heads: 4*b*s^2*h. Their sum is
    24*b*s*h^2*(1 + s/(6h)) (Narayanan et al.).
    """
    h = sh.hidden
    dense = 2.0 * tokens * (attn_matrix_params(sh) + (3 if sh.swiglu else 2) * h * sh.ffn)
    attn = 4.0 * tokens * sh.seq * h
    return dense, attn


FLASH_BLOCK = 128  # FlashAttention-2's tile of keys/queries along the sequence (Dao 2023, Sec. 3.1.1)


def causal_fraction(seq: int, flash: bool) -> float:
    """Share of the s x s score products a causal attention kernel actually runs.

    A fused kernel skips the tiles above the diagonal (Dao, FlashAttention-2, 2023, Sec. 3.1.1,
    "Causal masking"): with n = ceil(s / 128) tiles per row it runs n(n+1)/2 of n^2, i.e. 1/2 + 1/(2n)
    (0.53 at 2,048 tokens, 0.5 in the limit). Materialized scores (``flash`` false) are computed in
    full and then masked: 1. FLOP counts (MFU, Narayanan's formula) keep the full 4*b*s^2*h either way.
    """
    if not flash:
        return 1.0
    n = max(1, -(-seq // FLASH_BLOCK))
    return (n + 1) / (2 * n)


def logits_flops(sh: Shape, tokens: int) -> float:
    """Forward FLOPs of the output projection: 2*b*s*h*V."""
    return 2.0 * tokens * sh.hidden * sh.vocab


def mlp_down_flops(sh: Shape, tokens: int) -> float:
    """Forward FLOPs of a block's last GEMM, the MLP down-projection: 2*b*s*ffn*h."""
    return 2.0 * tokens * sh.ffn * sh.hidden


def recompute_extra(dense: float, attn: float, recompute: str, flash: bool = False, skipped: float = 0.0) -> float:
    """Forward FLOPs re-run in the backward, per layer.

    Full recomputation re-runs the whole layer (Narayanan et al.'s factor 96 instead of 72), less
    ``skipped``: PyTorch's non-reentrant checkpoint stops recomputing once every tensor the backward
    saved is back (``torch.utils.checkpoint``, "early stop", on by default since PyTorch 2.1), so the
    block's last GEMM, whose output no backward needs, is not re-run (:func:`mlp_down_flops`);
    Megatron-LM's own (reentrant) recomputation re-runs it. Selective recomputation (Korthikanti et
    al.) re-runs the attention-score part. A fused attention kernel always recomputes its scores in
    the backward (FlashAttention-2: 5 products instead of 4, i.e. half a forward pass more), which is
    then what selective recomputation amounts to.
    """
    scores = 0.5 * attn if flash else 0.0
    full = dense - skipped + attn + scores
    return {"none": scores, "selective": attn if not flash else scores, "full": full}[recompute]


def iteration_flops(sh: Shape, batch: int, recompute: str, flash: bool = False, early_stop: bool = False) -> float:
    """FLOPs per iteration over ``batch`` sequences, counting recomputation.

    Training is forward + backward (2x forward) = 3x forward, plus :func:`recompute_extra` (with
    ``early_stop``, full recomputation skips the MLP down-projection). The output layer is not recomputed.
    """
    tokens = batch * sh.seq
    dense, attn = layer_forward_flops(sh, tokens)
    skipped = mlp_down_flops(sh, tokens) if early_stop else 0.0
    extra = recompute_extra(dense, attn, recompute, flash, skipped)
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


def layer_activation_bytes(sh: Shape, micro: int, tp: int, sp: bool, recompute: str, act_bytes: int,
                           flash: bool = False) -> float:
    """Activation bytes one layer keeps for backward, per microbatch (Korthikanti et al. Table 2).

    16-bit activations, per layer: no parallelism s*b*h*(34 + 5*a*s/h); tensor parallel
    s*b*h*(10 + 24/t + 5*a*s/(h*t)); + sequence parallel s*b*h*(34/t + 5*a*s/(h*t));
    selective recompute drops the 5*a*s/h score term; full recompute keeps only the layer input
    2*s*b*h (divided by t under sequence parallelism). ``act_bytes`` rescales 16-bit to fp32.
    The "34" assumes a 4h GELU MLP; a different MLP width scales its 16 bytes/element share. Of
    the attention's 11, K and V take 2 each: GQA scales those 4 by kv_width/h. A fused attention
    kernel (``flash``) stores no scores: the 5*a*s/h term goes, as under selective recompute.
    """
    s, b, h, a, t = sh.seq, micro, sh.hidden, sh.heads, tp
    scale = act_bytes / 2.0
    mlp = 16.0 * (sh.ffn / (4.0 * h)) * (1.5 if sh.swiglu else 1.0)  # MLP share of the 34
    base = 18.0 - 4.0 * (1.0 - sh.kv_width / h) + mlp  # = 34 for GELU 4h without GQA
    if recompute == "full":
        return scale * 2.0 * s * b * h / (t if sp else 1)
    score = 0.0 if (recompute == "selective" or flash) else 5.0 * a * s / (h * t)
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


def pipeline_split(layers: int, stages: int, emb_layers: float, head_layers: float) -> tuple[int, ...]:
    """Blocks per pipeline stage when ``stages`` need not divide ``layers``: the balanced split.

    Costs are in blocks: the first stage also runs the embedding (``emb_layers`` blocks' worth),
    the last the final norm + output head (``head_layers``). The slowest stage is minimised, as
    the runtime's split does (runtime/pipeline.py) and as Megatron-LM and torchtitan allow with
    uneven first/last stages. Every stage gets at least one block. O(stages) per candidate load.
    """
    if not 1 <= stages <= layers:
        raise ValueError(f"cannot split {layers} layers into {stages} pipeline stages")
    if stages == 1:
        return (layers,)
    extra = [emb_layers] + [0.0] * (stages - 2) + [head_layers]
    # The optimal maximum load is n + extra[i] for some stage i and block count n: try them in order.
    candidates = sorted({n + e for n in range(1, layers + 1) for e in set(extra)})
    lo, hi = 0, len(candidates) - 1
    while lo < hi:  # capacity grows with the load: binary search the smallest load that holds every block
        mid = (lo + hi) // 2
        if sum(max(0, int(candidates[mid] - e + 1e-9)) for e in extra) >= layers and all(
                candidates[mid] - e >= 1 - 1e-9 for e in extra):
            hi = mid
        else:
            lo = mid + 1
    load = candidates[lo]
    counts = [int(load - e + 1e-9) for e in extra]
    # Give the surplus capacity back where it is cheapest: the first and last stages first (they
    # carry the embedding and head; Llama 3 405B ran its first and last stages one layer short).
    order = [0, stages - 1] + sorted(range(1, stages - 1), key=lambda i: -extra[i])
    surplus, i = sum(counts) - layers, 0
    while surplus > 0:
        r = order[i % stages]
        if counts[r] > 1:
            counts[r] -= 1
            surplus -= 1
        i += 1
    return tuple(counts)
