"""Closed-form counts for a decoder-only transformer: parameters, FLOPs, memory per rank.

Sources (see /work/shared/anchors.md):
- Parameters and FLOPs: Narayanan et al., "Efficient Large-Scale Language Model Training on GPU
  Clusters Using Megatron-LM", SC21, eq. (2)-(3):
  P = 12*l*h^2*(1 + 13/(12h) + (V+s)/(12*l*h));
  F = 96*B*s*l*h^2*(1 + s/(6h) + V/(16*l*h)) with full recomputation, factor 72 without.
- Activation bytes per layer: Korthikanti et al., "Reducing Activation Recomputation in Large
  Transformer Models", 2022, Sec. 4.1 and Table 2 (16-bit activations), less the dropout masks where the
  model has no dropout (:attr:`Shape.dropout`).
- Activations in flight under a pipeline: Korthikanti et al. Sec. 4.2.3 for the first stage; per rank and
  per model chunk, the warm-up of the interleaved 1F1B schedule as Megatron-Core and torch run it
  (:func:`inflight_layers`).
- Optimizer/gradient/parameter bytes per ZeRO stage: Rajbhandari et al., ZeRO, SC20.
- Grouped-query attention (Ainslie et al., "GQA", EMNLP 2023): k and v project to n_kv_head heads,
  so their weights, FLOPs and stored activations shrink by n_kv_head/n_head; the score and value
  products QK^T and AV still run over all n_head query heads (their FLOPs do not change).
- Fused attention (Dao et al., FlashAttention, NeurIPS 2022, and FlashAttention-2, 2023): scores
  are never written to device memory (no 5*a*s/h term in Korthikanti's activations, no score
  traffic); the backward recomputes them, 5 matrix products instead of 4 (FlashAttention-2 Sec.
  3.1.2), so training costs 3.5 forward attention passes instead of 3.
- Mixture of experts (Shazeer et al., "Outrageously Large Neural Networks", ICLR 2017; Fedus et al.,
  "Switch Transformers", JMLR 2022; Jiang et al., "Mixtral of Experts", 2024): a MoE block holds
  ``experts`` SwiGLU experts of width ``expert_ffn`` and a bias-free linear router (h x E), but each
  token runs only its ``top_k`` experts (plus an optional shared expert): weights, gradients and
  optimizer state count every expert (*total* parameters), FLOPs and activations only the routed ones
  (*active* parameters), as Megatron-LM's ``num_floating_point_operations`` (``moe_ffn_hidden_size *
  moe_router_topk``) and torchtitan's ``get_nparams_and_flops`` (routed experts scaled by top_k/E) count
  them. The router adds 2*h*E forward FLOPs per token (Fedus et al. Sec. 2.1: a linear layer h -> E).

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
    # Mixture of experts: routed experts per MoE block (0 = dense), experts per token, one expert's SwiGLU
    # width, the width of a dense shared expert every token also runs (0 = none), and how many of the
    # ``layers`` blocks are MoE (0 with experts > 0: all of them). The other blocks keep the dense ``ffn``.
    experts: int = 0
    top_k: int = 0
    expert_ffn: int = 0
    shared_ffn: int = 0
    moe_layers: int = 0
    # Dropout on the attention probabilities and on the attention and MLP outputs (GPT-2/GPT-3, Megatron's GPT:
    # ``--attention-dropout`` and ``--hidden-dropout`` 0.1 by default; OPT 0.1). Its masks are activations the
    # backward keeps (Korthikanti et al. Sec. 4.1). Llama (Touvron et al. 2023; Meta's reference ``model.py``
    # has no dropout layer) and Qwen (``attention_dropout`` 0.0) train without it, as this runtime's models do.
    dropout: bool = True

    @classmethod
    def from_model(cls, m: ModelConfig) -> Shape:
        """Shape of a ``model/`` preset."""
        return cls(layers=m.n_layer, hidden=m.d_model, heads=m.n_head, seq=m.seq_len, vocab=m.vocab_size,
                   ffn=m.ffn_dim, swiglu=m.mlp == "swiglu", bias=m.bias, learned_pos=m.pos == "learned",
                   kv_heads=m.n_kv_head, tied=m.tie_embeddings, head_dim=m.d_head, qkv_bias=m.attn_qkv_bias,
                   qk_norm=m.qk_norm, experts=m.moe_experts, top_k=m.moe_top_k if m.moe_experts else 0,
                   expert_ffn=m.moe_ffn_dim if m.moe_experts else 0, shared_ffn=m.moe_shared_ffn_hidden,
                   moe_layers=len(m.moe_layers), dropout=False)  # the runtime's GPT has no dropout layer

    @property
    def n_moe(self) -> int:
        """Blocks whose feed-forward is a mixture of experts (0 for a dense model)."""
        if not self.experts:
            return 0
        return self.moe_layers or self.layers

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


def dense_mlp_params(sh: Shape) -> int:
    """A dense block's MLP weights: (2 or 3)*h*ffn."""
    return (3 if sh.swiglu else 2) * sh.hidden * sh.ffn


def router_params(sh: Shape) -> int:
    """A MoE block's router: one bias-free linear layer h -> E (Fedus et al. 2022, Sec. 2.1)."""
    return sh.hidden * sh.experts


def expert_params(sh: Shape) -> int:
    """A MoE block's routed experts, all of them: E SwiGLU experts of 3*h*expert_ffn each. This is what
    expert parallelism shards (E/ep experts per rank)."""
    return sh.experts * 3 * sh.hidden * sh.expert_ffn


def moe_mlp_params(sh: Shape) -> int:
    """A MoE block's feed-forward weights: router + every routed expert + the shared expert (3*h*shared_ffn)."""
    return router_params(sh) + expert_params(sh) + 3 * sh.hidden * sh.shared_ffn


def moe_active_mlp_params(sh: Shape) -> int:
    """The MoE weights one token runs through: router + top_k routed experts + the shared expert."""
    return router_params(sh) + sh.top_k * 3 * sh.hidden * sh.expert_ffn + 3 * sh.hidden * sh.shared_ffn


def _per_block(dense: float, moe: float, sh: Shape) -> float:
    """The mean over the blocks of a quantity that is ``dense`` in a dense block and ``moe`` in a MoE block."""
    if not sh.n_moe:
        return dense
    if sh.n_moe == sh.layers:
        return moe
    return ((sh.layers - sh.n_moe) * dense + sh.n_moe * moe) / sh.layers


def _block_params_but_mlp(sh: Shape) -> int:
    """One block's attention projections, biases (the MLP's: dense blocks only) and norms."""
    h = sh.hidden
    if sh.bias:
        bias = sh.q_width + h + 2 * sh.kv_width  # q, o, k, v
    else:
        bias = sh.q_width + 2 * sh.kv_width if sh.qkv_bias else 0
    norms = 2 * h * (2 if sh.bias else 1) + (2 * sh.hd if sh.qk_norm else 0)
    return attn_matrix_params(sh) + bias + norms


def layer_params(sh: Shape) -> float:
    """Parameters of one block: attention projections + (2 or 3)*h*ffn MLP + norms and biases.

    For GELU with ffn=4h, biases and no GQA this is Narayanan et al.'s 12h^2 + 13h per layer. A MoE block
    holds :func:`moe_mlp_params` instead of the MLP (every expert: total parameters); where only some blocks
    are MoE this is the mean over the blocks (exact sums in :func:`total_params`).
    """
    mlp_bias = (sh.ffn + sh.hidden + (sh.ffn if sh.swiglu else 0)) if sh.bias else 0  # up, down, gate
    dense = dense_mlp_params(sh) + mlp_bias
    mean = _per_block(dense, moe_mlp_params(sh), sh)
    out = _block_params_but_mlp(sh) + mean
    return int(out) if float(out).is_integer() else out


def layer_expert_params(sh: Shape) -> float:
    """Routed-expert parameters of one block, mean over the blocks (0 for a dense model): the share of
    :func:`layer_params` that expert parallelism shards."""
    return _per_block(0, expert_params(sh), sh)


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
    """Narayanan et al. eq. (2) generalised: l*(12h^2 + 13h) + (V + s)*h for the GELU GPT (+ V*h untied); a
    MoE block counts every expert (total parameters)."""
    mlp_bias = (sh.ffn + sh.hidden + (sh.ffn if sh.swiglu else 0)) if sh.bias else 0
    dense_blocks = sh.layers - sh.n_moe
    blocks = (sh.layers * _block_params_but_mlp(sh) + dense_blocks * (dense_mlp_params(sh) + mlp_bias)
              + sh.n_moe * moe_mlp_params(sh))
    return blocks + embedding_params(sh) + head_params(sh)


def active_params(sh: Shape) -> int:
    """Parameters one token runs through: :func:`total_params` with each MoE block's experts cut to the
    ``top_k`` routed ones (+ the router and the shared expert). Equal to the total for a dense model."""
    return total_params(sh) - sh.n_moe * (moe_mlp_params(sh) - moe_active_mlp_params(sh))


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
    A MoE block's dense part runs the router and only the ``top_k`` routed experts (+ the shared expert):
    :func:`moe_active_mlp_params`, mean over the blocks where some are dense.
    """
    h = sh.hidden
    mlp = _per_block(dense_mlp_params(sh), moe_active_mlp_params(sh), sh)
    dense = 2.0 * tokens * (attn_matrix_params(sh) + mlp)
    attn = 4.0 * tokens * sh.seq * h
    return dense, attn


def router_flops(sh: Shape, tokens: int) -> float:
    """Forward FLOPs of one MoE block's router over ``tokens``: 2*tokens*h*E (0 for a dense block)."""
    return 2.0 * tokens * router_params(sh)


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
    """Forward FLOPs of a block's last GEMM, the MLP down-projection: 2*b*s*ffn*h.

    A MoE block ends in the routing-weighted sum of its experts' outputs, whose backward needs those
    outputs (for the routing weights' gradient): they are saved, and a non-reentrant checkpoint recomputes
    them. Nothing is skipped there (0; the mean over the blocks where some are dense).
    """
    return _per_block(2.0 * tokens * sh.ffn * sh.hidden, 0.0, sh)


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
                           flash: bool = False, dropout: bool | None = None) -> float:
    """Activation bytes one layer keeps for backward, per microbatch (Korthikanti et al. Table 2).

    16-bit activations, per layer: no parallelism s*b*h*(34 + 5*a*s/h); tensor parallel
    s*b*h*(10 + 24/t + 5*a*s/(h*t)); + sequence parallel s*b*h*(34/t + 5*a*s/(h*t));
    selective recompute drops the 5*a*s/h score term; full recompute keeps only the layer input
    2*s*b*h (divided by t under sequence parallelism). ``act_bytes`` rescales 16-bit to fp32.
    The "34" assumes a 4h GELU MLP; a different MLP width scales its 16 bytes/element share. Of
    the attention's 11, K and V take 2 each: GQA scales those 4 by kv_width/h. A fused attention
    kernel (``flash``) stores no scores: the 5*a*s/h term goes, as under selective recompute.
    A MoE block's feed-forward keeps :func:`moe_activation_share` instead of the MLP's share.

    Without dropout (``dropout``, default the shape's :attr:`Shape.dropout`) the masks are not kept
    (Korthikanti et al. Sec. 4.1 counts them one byte per element): the attention output's and the MLP
    output's, s*b*h each, 2 of the 34 and 2 of the "10" that tensor parallelism replicates (without sequence
    parallelism); and the attention-probability mask a*s^2*b with the dropout output 2*a*s^2*b, 3 of the
    5*a*s/h: what remains is the softmax output 2*a*s^2*b, which its backward and the product with V read.
    """
    s, b, h, a, t = sh.seq, micro, sh.hidden, sh.heads, tp
    drop = sh.dropout if dropout is None else dropout
    scale = act_bytes / 2.0
    masks = 2.0 if drop else 0.0  # attention-output and MLP-output dropout masks, 1 byte per s*b*h element each
    dense_mlp = 16.0 * (sh.ffn / (4.0 * h)) * (1.5 if sh.swiglu else 1.0)  # MLP share of the 34
    mlp = _per_block(dense_mlp, moe_activation_share(sh), sh)
    # = 34 for GELU 4h without GQA: attention 11 (9 + the mask), two norms' inputs 4, MLP input 2 + the mask
    base = 16.0 + masks - 4.0 * (1.0 - sh.kv_width / h) + mlp
    if recompute == "full":
        return scale * 2.0 * s * b * h / (t if sp else 1)
    score_bytes = 5.0 if drop else 2.0  # per a*s^2*b: softmax output 2 (+ dropout mask 1 and output 2)
    score = 0.0 if (recompute == "selective" or flash) else score_bytes * a * s / (h * t)
    replicated = 8.0 + masks  # Korthikanti's 10: two norms' inputs 4, QKV and MLP inputs 2 each, the masks
    if t == 1:
        per = base + score
    elif sp:
        per = base / t + score
    else:
        per = replicated + (base - replicated) / t + score
    return scale * s * b * h * per


def inflight_layers(chunks: tuple[float, ...], m: int, p: int, r: int) -> float:
    """Peak layer-microbatches whose activations pipeline rank ``r`` of ``p`` holds at once under 1F1B.

    ``chunks`` are the blocks of the rank's model chunks in order (one entry without interleaving), ``m`` the
    microbatches per step. Without interleaving rank r runs p - r - 1 warm-up forwards before its first
    backward (Narayanan et al. SC21 Sec. 2.2; Korthikanti et al. Sec. 4.2.3: the first stage holds p
    microbatches): min(m, p - r) microbatches of all its blocks. Interleaved, the warm-up is
    2*(p - r - 1) + (v - 1)*p chunk forwards, capped at the m*v of the step (Megatron-LM
    ``core/pipeline_parallel/schedules.py``, ``forward_backward_pipelining_with_interleaving``, with its default
    group of p microbatches per chunk; torch ``ScheduleInterleaved1F1B``'s ``get_rank_warmup_ops`` alike); the
    forwards take chunk (k mod p*v) // p of each group of p microbatches, the backwards the chunks in reverse,
    one forward then one backward in the steady state. On rank 0 with even chunks that peak is Korthikanti's
    p*(1 + (p-1)/(p*v)) microbatches; later ranks hold almost as many (2 chunk forwards fewer per rank), not
    p - r. Chunks of different sizes (an embedding-only or head-only chunk: :func:`chunk_split`) are counted
    by their own blocks, so the peak is found by following the schedule: the steady state repeats every
    p*v steps with no net change, so one period after the warm-up is enough.
    """
    v = len(chunks)
    if v == 1:
        return chunks[0] * min(m, p - r)
    total = m * v
    group = p * v
    warm = min(total, 2 * (p - r - 1) + (v - 1) * p)
    held = float(sum(chunks[(k % group) // p] for k in range(warm)))
    peak = held
    for i in range(min(total - warm, group)):
        held += chunks[((warm + i) % group) // p]  # the steady state's forward ...
        peak = max(peak, held)
        held -= chunks[v - 1 - (i % group) // p]  # ... then the oldest backward, last chunk first
    return peak


def moe_activation_share(sh: Shape) -> float:
    """Bytes per s*b*h element a MoE block's feed-forward keeps for the backward (16-bit activations).

    A hand count of the tensors its backward saves, after Korthikanti et al.'s per-tensor count of the dense
    MLP (whose SwiGLU share, 16*(ffn/4h)*1.5 = 6*ffn/h, is the gate, up and product tensors of ffn width):
    each token's ``top_k`` expert copies run SwiGLUs of ``expert_ffn`` width (6*top_k*expert_ffn/h), the
    shared expert one of ``shared_ffn`` (6*shared_ffn/h); the permuted token copies the experts read and their
    outputs the weighted combine reads back (2 bytes each per element and copy: 4*top_k); the router's
    fp32 logits and probabilities (8*E/h).
    """
    h = sh.hidden
    return 6.0 * (sh.top_k * sh.expert_ffn + sh.shared_ffn) / h + 4.0 * sh.top_k + 8.0 * sh.experts / h


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


def chunk_split(layers: int, chunks: int, emb_layers: float, head_layers: float,
                ends_as_layers: bool = False) -> tuple[int, ...]:
    """Blocks per model chunk, the ``chunks`` = p*v of them in pipeline order (chunk c on rank c mod p).

    By default :func:`pipeline_split`'s balanced split. ``ends_as_layers``: the embedding and the output head
    each take one block's place, as Llama 3 405B was split (Llama 3 Herd of Models, Sec. 3.3.2: one Transformer
    layer fewer on the first and on the last stage, so that "the first model chunk on the first stage has only
    the embedding, and the last model chunk on the last stage has only output projection and loss
    calculation"; Megatron-Core's ``--account-for-embedding-in-pipeline-split`` and
    ``--account-for-loss-in-pipeline-split``): ``layers`` + 2 places split evenly, and the first and the last
    chunk each give one back, so that they may hold no block at all.
    """
    if not ends_as_layers:
        return pipeline_split(layers, chunks, emb_layers, head_layers)
    counts = list(pipeline_split(layers + 2, chunks, 0.0, 0.0))
    counts[0] -= 1
    counts[-1] -= 1
    return tuple(counts)
