"""A pre-LN decoder-only transformer (GPT / LLaMA-like), laid out for parallelism.

Structure choices made for tensor and pipeline parallelism later:
- Q, K, V, attention output, MLP up (and gate) and MLP down are separate ``nn.Linear``s, so
  Megatron-style colwise (q/k/v/up/gate) and rowwise (o/down) plans apply per module.
- Blocks live in an ``nn.ModuleDict`` keyed "0".."L-1": a pipeline stage deletes the blocks it
  does not own and the remaining parameter names (FQNs) stay the same as in the full model,
  which keeps checkpoints layout-independent.
- Embedding, final norm and head may be ``None`` on stages that do not own them.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from xirang_hpc.config.schema import ModelConfig
from xirang_hpc.models.init import init_parameters
from xirang_hpc.models.loss import ChunkKernel, LossNorm, chunked_lm_loss
from xirang_hpc.models.moe import MoE, load_balancing_loss


class RMSNorm(nn.Module):
    """Root-mean-square norm (Zhang & Sennrich 2019), as in LLaMA."""

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Normalise the last dimension (in fp32 under autocast, as Llama's reference does)."""
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight


class LayerNorm(nn.LayerNorm):
    """``nn.LayerNorm`` whose weight and bias take the input's dtype: a bf16 run's blocks get their weights in bf16
    (FSDP2's mixed precision) while the residual stream they normalise stays fp32. A no-op in fp32."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = None if self.weight is None else self.weight.to(x.dtype)
        b = None if self.bias is None else self.bias.to(x.dtype)
        return F.layer_norm(x, self.normalized_shape, w, b, self.eps)


def _norm(cfg: ModelConfig) -> nn.Module:
    if cfg.norm == "rmsnorm":
        return RMSNorm(cfg.d_model, cfg.norm_eps)
    return LayerNorm(cfg.d_model, eps=cfg.norm_eps, bias=cfg.bias)


def rope_inv_freq(head_dim: int, base: float, cfg: ModelConfig | None = None) -> torch.Tensor:
    """Rotary inverse frequencies (head_dim/2,), rescaled as ``cfg.rope_scaling`` says.

    ``linear`` (position interpolation, Chen et al. 2023) divides every frequency by ``rope_factor``.
    ``llama3`` (Llama 3.1) keeps high frequencies (wavelength < original context / high_freq_factor),
    divides low ones (wavelength > original context / low_freq_factor) by the factor and blends
    smoothly in between: the same arithmetic as transformers' ``_compute_llama3_parameters``, so
    imported Llama 3.1 weights see the angles they were trained with.
    """
    inv = 1.0 / base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim)
    kind = cfg.rope_scaling if cfg is not None else "none"
    if kind == "linear":
        return inv / cfg.rope_factor  # type: ignore[union-attr]
    if kind == "llama3":
        assert cfg is not None
        factor, low, high = cfg.rope_factor, cfg.rope_low_freq_factor, cfg.rope_high_freq_factor
        old = cfg.rope_original_max_pos
        low_wavelen, high_wavelen = old / low, old / high
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
        smooth = (old / wavelen - low) / (high - low)
        blended = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return torch.where(medium, blended, scaled)
    return inv


def rope_tables(seq_len: int, head_dim: int, base: float = 10000.0,
                cfg: ModelConfig | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables for rotary embeddings (Su et al. 2021), each (seq_len, head_dim/2)."""
    inv = rope_inv_freq(head_dim, base, cfg)
    ang = torch.outer(torch.arange(seq_len, dtype=torch.float32), inv)
    return ang.cos(), ang.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs of channels of x (B, nh, T, hd) by position-dependent angles.

    ``cos``/``sin``: the tables (max_T, hd/2), of which the first T rows are used, or per-token angles
    (B, 1, T, hd/2) already gathered at each token's position (packed samples, see :func:`packed_attention`).
    """
    x1, x2 = x[..., 0::2], x[..., 1::2]  # (B, nh, T, hd/2) each
    t = x.shape[-2]
    c, s = (cos[:t], sin[:t]) if cos.dim() == 2 else (cos, sin)
    out = torch.stack((x1 * c - x2 * s, x1 * s + x2 * c), dim=-1)  # (B, nh, T, hd/2, 2)
    return out.flatten(-2)  # (B, nh, T, hd)


def packed_attention(position_ids: torch.Tensor) -> torch.Tensor:
    """Block-diagonal causal mask (B, 1, T, T) of packed rows: a token sees the earlier tokens of its own sample.

    ``position_ids`` (B, T) restart at 0 where each sample starts; True = may attend (SDPA's boolean mask).
    """
    doc = torch.cumsum((position_ids == 0).to(torch.int32), dim=1)  # (B, T) sample number within the row
    t = position_ids.shape[1]
    causal = torch.ones(t, t, dtype=torch.bool, device=position_ids.device).tril()  # (T, T)
    return ((doc[:, :, None] == doc[:, None, :]) & causal)[:, None]  # (B, 1, T, T)


class SequenceShards(Protocol):
    """This rank's part of every sequence under context parallelism (built by ``runtime/context_parallel.py``).

    The model only needs where its tokens and the gathered keys sit in the whole sequence, and a way to
    gather keys and values (or position ids) from the other shards; the process group stays in the runtime.
    """

    #: (T_local,) int64: the global position of each token this rank holds, in its order.
    index: torch.Tensor
    #: (T,) int64: the global position of each key after :meth:`gather` (the shards concatenated in rank order).
    key_index: torch.Tensor

    def gather(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """All shards of ``x`` concatenated along ``dim`` (autograd-correct: gradients return to their shard)."""
        ...

    def gather_ids(self, ids: torch.Tensor) -> torch.Tensor:
        """(B, T_local) integer ids -> (B, T) in :attr:`key_index` order, without gradient."""
        ...

    def causal_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Causal attention of local queries (B, H, T_local, hd) over gathered k, v (B, H, T, hd) -> like q."""
        ...


def sharded_causal_mask(q_index: torch.Tensor, k_index: torch.Tensor, q_pos: torch.Tensor | None = None,
                        k_pos: torch.Tensor | None = None) -> torch.Tensor:
    """Causal mask of queries at global positions ``q_index`` (Tq,) over keys at ``k_index`` (Tk,): (B|1, 1, Tq, Tk).

    Any order of either side works (context-parallel shards hold non-contiguous chunks). With packed rows
    (``q_pos`` (B, Tq), ``k_pos`` (B, Tk): positions restarting at 0 per sample) a key also has to lie in
    the query's sample: inside one sample positions advance exactly as the tokens do, while any restart
    between the key and the query leaves the query's position short, so ``q_pos - k_pos == q - k`` decides
    it from the two tokens alone, without the whole row. True = may attend (SDPA's boolean mask).
    """
    gap = q_index[:, None] - k_index[None, :]  # (Tq, Tk): how many tokens the key lies before the query
    causal = gap >= 0
    if q_pos is None or k_pos is None:
        return causal[None, None]  # (1, 1, Tq, Tk)
    same = (q_pos[:, :, None] - k_pos[:, None, :]) == gap  # (B, Tq, Tk)
    return (causal & same)[:, None]  # (B, 1, Tq, Tk)


def repeat_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    """Grouped-query attention: (B, n_kv, T, hd) -> (B, n_kv*groups, T, hd), query head i reading kv head i//groups.

    A plain copy rather than SDPA's ``enable_gqa`` so that every SDPA backend (flash and
    memory-efficient on GPU) accepts the call; same head order as Hugging Face's ``repeat_kv``.
    """
    if groups == 1:
        return x
    return x.repeat_interleave(groups, dim=1)


class Attention(nn.Module):
    """Causal self-attention with separate projections; grouped-query when n_kv_head < n_head.

    Options of the Qwen families: biases on q/k/v only (``attn_qkv_bias``, Qwen2), a per-head RMSNorm
    of q and k before rotary (``qk_norm``, Qwen3; one weight of head_dim shared by all heads, so a
    tensor-parallel shard keeps it whole), and a head width other than d_model/n_head (``d_head``).
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        d, hd = cfg.d_model, cfg.head_dim
        self.head_dim = hd
        self.groups = cfg.n_head // cfg.n_kv_head  # query heads per key/value head
        qkv_bias = cfg.bias or cfg.attn_qkv_bias
        self.q = nn.Linear(d, cfg.n_head * hd, bias=qkv_bias)
        self.k = nn.Linear(d, cfg.n_kv_head * hd, bias=qkv_bias)
        self.v = nn.Linear(d, cfg.n_kv_head * hd, bias=qkv_bias)
        self.o = nn.Linear(cfg.n_head * hd, d, bias=cfg.bias)
        self.q_norm: RMSNorm | None = RMSNorm(hd, cfg.norm_eps) if cfg.qk_norm else None
        self.k_norm: RMSNorm | None = RMSNorm(hd, cfg.norm_eps) if cfg.qk_norm else None
        self.use_rope = cfg.pos == "rope"
        # Context parallelism (set by the runtime): keys and values are gathered from every shard of the sequence.
        self.seq_shards: SequenceShards | None = None

    def norm_qk(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-head RMSNorm of q (B, nh, T, hd) and k (B, nkv, T, hd) over hd, when ``qk_norm``."""
        if self.q_norm is None or self.k_norm is None:
            return q, k
        return self.q_norm(q), self.k_norm(k)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None = None,
                mask: torch.Tensor | None = None) -> torch.Tensor:
        """x: (B, T, C) -> (B, T, C); ``mask`` (B, 1, T, T) bool replaces the causal mask (packed samples).

        Under context parallelism T is this rank's shard and the keys are gathered (T_all of them): plain rows
        go through ``seq_shards.causal_attention``, packed ones take ``mask`` (B, 1, T, T_all), additive.
        """
        b, t, _ = x.shape
        # Heads are derived from the local width so the same code runs on a TP shard, where q holds
        # n_head/tp heads and k/v hold n_kv_head/tp: (B, T, C_local) -> (B, nh_local, T, hd).
        q = self.q(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        k = self.k(x).view(b, t, -1, self.head_dim).transpose(1, 2)  # (B, nkv_local, T, hd)
        v = self.v(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        q, k = self.norm_qk(q, k)  # before rotary, as Qwen3 does
        if self.use_rope and rope is not None:
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        if self.seq_shards is not None:  # before repeat_kv: gather n_kv heads, not n_head
            k, v = self.seq_shards.gather(k, 2), self.seq_shards.gather(v, 2)  # (B, nkv_local, T_all, hd)
        k, v = repeat_kv(k, self.groups), repeat_kv(v, self.groups)  # (B, nh_local, T, hd)
        if self.seq_shards is not None and mask is None:  # plain causal rows over the shards
            y = self.seq_shards.causal_attention(q, k, v)  # (B, nh, T_local, hd)
        elif mask is None:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, nh, T, hd)
        else:
            if mask.is_floating_point() and mask.dtype != q.dtype:  # an additive mask under autocast
                mask = mask.to(q.dtype)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # (B, nh, T, hd)
        y = y.transpose(1, 2).reshape(b, t, -1)  # (B, T, C_local)
        return self.o(y)


class MLP(nn.Module):
    """GELU MLP, or SwiGLU (Shazeer 2020) with a separate gate projection."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.swiglu = cfg.mlp == "swiglu"
        self.up = nn.Linear(cfg.d_model, cfg.ffn_dim, bias=cfg.bias)
        self.gate = nn.Linear(cfg.d_model, cfg.ffn_dim, bias=cfg.bias) if self.swiglu else None
        self.down = nn.Linear(cfg.ffn_dim, cfg.d_model, bias=cfg.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (B, T, C) -> (B, T, C)."""
        if self.gate is not None:
            return self.down(F.silu(self.gate(x)) * self.up(x))
        return self.down(F.gelu(self.up(x), approximate="tanh"))


class Block(nn.Module):
    """Pre-LN transformer block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, cfg: ModelConfig, moe: bool = False) -> None:
        super().__init__()
        self.attn_norm = _norm(cfg)
        self.attn = Attention(cfg)
        self.mlp_norm = _norm(cfg)
        self.mlp: nn.Module = MoE(cfg) if moe else MLP(cfg)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None = None,
                mask: torch.Tensor | None = None) -> torch.Tensor:
        """x: (B, T, C) -> (B, T, C)."""
        h, y = self.attend(x, rope, mask)
        return h + self.mlp(y)

    def attend(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None = None,
               mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The attention half and the MLP's input: h = x + attn(norm(x)) and norm(h), both (B, T, C).

        A method of its own so that ``train.compile`` can compile it alone where the MLP cannot be traced in one
        graph (a mixture of experts' data-dependent routing; runtime/compile.py).
        """
        h = x + self.attn(self.attn_norm(x), rope, mask)
        return h, self.mlp_norm(h)


class GPT(nn.Module):
    """Decoder-only transformer. ``forward(tokens)`` returns logits (B, T, V).

    A pipeline stage may hold only some blocks and lack ``tok_emb`` or ``head``: then its
    input is hidden states (B, T, C) instead of token ids, and its output is hidden states.
    """

    def __init__(self, cfg: ModelConfig, seed: int | None = None) -> None:
        """Build and initialise (see :meth:`reset_parameters`); under ``torch.device("meta")`` only shapes.

        ``seed``: the initialisation seed; by default one drawn from torch's global generator, so
        ``torch.manual_seed(s); GPT(cfg)`` is reproducible and two models in a row differ.
        """
        super().__init__()
        self.cfg = cfg
        self.tok_emb: nn.Embedding | None = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_emb: nn.Embedding | None = (
            nn.Embedding(cfg.seq_len, cfg.d_model) if cfg.pos == "learned" else None
        )
        self.layers = nn.ModuleDict({str(i): Block(cfg, i in cfg.moe_layers) for i in range(cfg.n_layer)})
        self.norm: nn.Module | None = _norm(cfg)
        self.head: nn.Linear | None = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        # Tokens per chunk of the fused head + loss (train.loss_chunk_tokens; 0: the plain head), set by the
        # job that builds the model; a forward given targets then returns the loss, not the logits.
        self.loss_chunk = 0
        # The loss's denominator (learned tokens per loss term) for masked targets; shared with pipeline views.
        self.loss_norm = LossNorm()
        # The loss functions the job runs: the plain one (logits -> loss) and the chunked head's per-chunk step
        # (None: models/loss.chunk_step as it is); train.compile sets compiled versions (runtime/compile.py).
        self.loss_fn: Callable[..., torch.Tensor] = lm_loss
        self.loss_kernel: ChunkKernel | None = None
        # Context parallelism (set by the runtime): inputs are this rank's shard of every sequence.
        self.seq_shards: SequenceShards | None = None
        # The data-parallel ranks that share a batch (set by the runtime when there are several): MoE token
        # statistics (the auxiliary loss's counts, the expert-bias loads) are summed over them.
        self.moe_group: torch.distributed.ProcessGroup | None = None
        if cfg.tie_embeddings:
            # One parameter under two names: the state dict keeps both keys (identical tensors).
            self.head.weight = self.tok_emb.weight
        if cfg.pos == "rope":
            # Not persistent: derived from the config, so checkpoints hold only learned state.
            self.register_buffer("rope_cos", torch.empty(cfg.seq_len, cfg.head_dim // 2), persistent=False)
            self.register_buffer("rope_sin", torch.empty(cfg.seq_len, cfg.head_dim // 2), persistent=False)
        if not self.tok_emb.weight.is_meta:
            self.init_buffers()
            self.reset_parameters(seed)

    def init_buffers(self) -> None:
        """(Re)compute the non-persistent buffers (rope tables) on the model's device, e.g. after ``to_empty``."""
        if self.cfg.pos == "rope":
            cos, sin = rope_tables(self.cfg.seq_len, self.cfg.head_dim, self.cfg.rope_theta, self.cfg)
            self.rope_cos = cos.to(self.rope_cos.device)
            self.rope_sin = sin.to(self.rope_sin.device)
        for m in self.moe_blocks():
            m.reset_buffers()

    def reset_parameters(self, seed: int | None = None) -> None:
        """GPT-2 init: N(0, init_std), residual output projections scaled by 1/sqrt(2L), norms one, biases zero.

        Values are a pure function of (seed, parameter name, element index) (xirang_hpc/models/init.py),
        so this model, a pipeline stage of it or any shard of it starts from the same numbers.
        ``seed`` None draws one from torch's global generator.
        """
        if seed is None:
            seed = int(torch.randint(0, 2**62, (1,), device="cpu").item())
        init_parameters(self, self.cfg, seed)

    def tie_weights(self) -> None:
        """Point the head at the embedding again (``to_empty``/``load_state_dict(assign=True)`` can untie them)."""
        if self.cfg.tie_embeddings and self.head is not None and self.tok_emb is not None:
            if self.head.weight is not self.tok_emb.weight:
                self.head.weight = self.tok_emb.weight

    def materialize(self, device: torch.device | str, seed: int | None) -> None:
        """Allocate a meta-built (and possibly carved/sharded) model on ``device`` and initialise it.

        Each rank allocates and fills only the parameters (or DTensor shards) it holds; tied
        embeddings stay one parameter; the rope tables are recomputed. ``seed`` None leaves the
        parameters uninitialised (for weights that are loaded right after).
        """
        self.to_empty(device=device)
        self.tie_weights()
        self.init_buffers()
        if seed is not None:
            init_parameters(self, self.cfg, seed)

    @classmethod
    def for_loading(cls, cfg: ModelConfig, device: torch.device | str = "cpu") -> GPT:
        """A model with allocated but uninitialised parameters, for ``load_state_dict`` to fill (no wasted init)."""
        with torch.device("meta"):
            model = cls(cfg)
        model.materialize(device, seed=None)
        return model

    def moe_blocks(self) -> list[MoE]:
        """The mixture-of-experts feed-forwards this model (stage) holds, in block order."""
        return [m for m in self.modules() if isinstance(m, MoE)]

    def moe_aux_loss(self) -> torch.Tensor | None:
        """``moe_aux_coef`` * the load-balancing loss of the last forward over all MoE blocks; None if not used."""
        blocks = self.moe_blocks()
        if not blocks or self.cfg.moe_balance != "aux_loss":
            return None
        logits = [m.router_logits for m in blocks if m.router_logits is not None]
        return self.cfg.moe_aux_coef * load_balancing_loss(logits, self.cfg.moe_experts, self.cfg.moe_top_k,
                                                           group=self.moe_group)

    @torch.no_grad()
    def moe_after_step(self) -> None:
        """After ``optimizer.step()``: the expert-bias update of bias balancing (a no-op otherwise).

        The loads are summed over the data-parallel ranks first (``moe_group``, set by the runtime when there
        are several), so every replica takes the same bias step and the replicas stay identical.
        """
        blocks = self.moe_blocks()
        if not blocks or self.cfg.moe_balance != "bias":
            return
        loads = torch.stack([m.load_since_update for m in blocks])  # (n_moe, E)
        if self.moe_group is not None:  # not the whole world: pipeline stages hold different blocks
            torch.distributed.all_reduce(loads, group=self.moe_group)
        for m, load in zip(blocks, loads, strict=True):
            m.update_bias(load)

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """tokens (B, T) int64 -> logits (B, T, V); or hidden (B, T, C) on later stages.

        With ``targets`` (B, T) and ``loss_chunk`` > 0, the head's stage returns the loss (1,) instead
        (:func:`xirang_hpc.models.loss.chunked_lm_loss`, normalised as ``loss_norm`` says): computed inside
        the forward, so the head's weight is the gathered one under FSDP and the pipeline's last stage needs
        no other access to it. ``position_ids`` (B, T): packed samples (positions restart at 0 per sample):
        per-sample positions and a block-diagonal causal mask; every pipeline stage is given them.

        Context parallelism (:attr:`seq_shards` set): ``x``, ``targets`` and ``position_ids`` are this rank's
        shard of each row (T_local tokens at the global positions ``seq_shards.index``); rotary and learned
        positions use those true positions, and the mask covers the local queries against every shard's keys.
        """
        sh = self.seq_shards
        mask: torch.Tensor | None = None
        if sh is not None:
            if position_ids is not None:  # packed rows: causal within each sample, across the shards
                k_pos = sh.gather_ids(position_ids)  # (B, T_all)
                allowed = sharded_causal_mask(sh.index, sh.key_index, position_ids, k_pos)  # (B, 1, T_local, T_all)
                # Additive once here: SDPA's CPU kernel would turn a boolean mask into a float one in every layer
                # and keep each copy for the backward; one tensor is shared by all layers instead.
                mask = torch.zeros(allowed.shape, device=allowed.device).masked_fill_(~allowed, float("-inf"))
            where: torch.Tensor | None = position_ids if position_ids is not None else sh.index
        else:
            mask = packed_attention(position_ids) if position_ids is not None else None
            where = position_ids
        if self.tok_emb is not None:
            t = x.shape[1]
            h = self.tok_emb(x)  # (B, T, C)
            if self.pos_emb is not None:
                at = where if where is not None else torch.arange(t, device=x.device)
                h = h + self.pos_emb(at)  # (B, T, C) or broadcast (T, C)
        else:
            h = x
        rope = (self.rope_cos, self.rope_sin) if self.cfg.pos == "rope" else None
        if rope is not None and where is not None:
            if where.dim() == 1:  # a shard's positions, the same in every row: (T_local, hd/2) each
                rope = (rope[0][where], rope[1][where])
            else:
                rope = (rope[0][where][:, None], rope[1][where][:, None])  # (B, 1, T, hd/2) each
        for block in self.layers.values():
            h = block(h, rope) if mask is None else block(h, rope, mask)
        if self.norm is not None:
            h = self.norm(h)
        if self.head is not None:
            if targets is not None and self.loss_chunk > 0:
                # (1,): a pipeline concatenates its microbatches' outputs
                return chunked_lm_loss(h, self.head.weight, targets, self.loss_chunk,
                                       self.loss_norm.denom, self.loss_kernel).reshape(1)
            h = self.head(h)  # (B, T, V)
        return h


def num_params(model: nn.Module) -> int:
    """Number of parameters held by this module (this rank's shard under TP/PP)."""
    return sum(p.numel() for p in model.parameters())


def lm_loss(logits: torch.Tensor, targets: torch.Tensor, denom: float | None = None) -> torch.Tensor:
    """Next-token cross-entropy: logits (B, T, V), targets (B, T); targets of -100 are ignored.

    ``denom`` None: the mean over the targets that are not ignored; else their sum divided by ``denom``
    (the trainer's normalisation over a whole global batch, see :class:`xirang_hpc.models.loss.LossNorm`).
    """
    flat = logits.reshape(-1, logits.shape[-1]).float()  # (B*T, V)
    if denom is None:
        return F.cross_entropy(flat, targets.reshape(-1))
    return F.cross_entropy(flat, targets.reshape(-1), reduction="sum") / denom


def full_model_params(cfg: ModelConfig) -> int:
    """Parameters of the whole model (not one rank's stage or shard), counted without allocating."""
    with torch.device("meta"):
        return num_params(GPT(cfg))
