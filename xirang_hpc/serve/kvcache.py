"""A key/value cache for batched decoding with the (unchanged) :class:`GPT` modules.

The cache holds ``slots`` sequences: per layer, keys and values of shape (slots, heads, seq_len,
head_dim). :meth:`KVCache.forward` runs T new tokens of B slots (prefill: B=1, T=prompt; decode:
B=active requests, T=1) through the model's own submodules (embeddings, norms, q/k/v/o, MLP),
writes their keys/values at each slot's positions, and attends over every slot's cached prefix.
The result equals the full forward's logits at those positions (same math, fewer FLOPs: a
decode step costs one token per row instead of the whole window).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from xirang_hpc.models.gpt import GPT, repeat_kv


def _rope_at(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x (B, nh, T, hd) with per-row position tables cos/sin (B, T, hd/2)."""
    c, s = cos[:, None], sin[:, None]
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack((x1 * c - x2 * s, x1 * s + x2 * c), dim=-1).flatten(-2)


class KVCache:
    """Keys/values of ``slots`` sequences of up to ``model.cfg.seq_len`` tokens."""

    def __init__(self, model: GPT, slots: int) -> None:
        cfg = model.cfg
        self.model, self.seq_len = model, cfg.seq_len
        self.head_dim, self.groups = cfg.head_dim, cfg.n_head // cfg.n_kv_head
        p = next(model.parameters())
        # Grouped-query attention caches only the n_kv_head key/value heads (the memory GQA saves).
        shape = (slots, cfg.n_kv_head, cfg.seq_len, self.head_dim)
        self.device = p.device  # the model's: the cache lives beside the weights
        self.k = [torch.zeros(shape, dtype=p.dtype, device=p.device) for _ in range(cfg.n_layer)]
        self.v = [torch.zeros(shape, dtype=p.dtype, device=p.device) for _ in range(cfg.n_layer)]
        # q, k and v of a layer as one projection: one matmul per layer instead of three (a decode
        # step is a few rows, so its cost is per call, not per FLOP). Copies, made once: serving
        # does not change weights.
        self.qkv: list[tuple[torch.Tensor, torch.Tensor | None]] = []
        for block in model.layers.values():
            a = block.attn
            w = torch.cat([a.q.weight, a.k.weight, a.v.weight]).detach()
            bias = None if a.q.bias is None else torch.cat([a.q.bias, a.k.bias, a.v.bias]).detach()
            self.qkv.append((w, bias))
        self.q_width, self.kv_width = model.cfg.n_head * self.head_dim, cfg.n_kv_head * self.head_dim

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, slots: torch.Tensor, start: torch.Tensor) -> torch.Tensor:
        """tokens (B, T) at positions start[b]..start[b]+T-1 of slot slots[b] -> logits (B, T, V)."""
        m, cfg, dev = self.model, self.model.cfg, self.device
        tokens, slots, start = tokens.to(dev), slots.to(dev), start.to(dev)
        b, t = tokens.shape
        pos = start[:, None] + torch.arange(t, device=dev)[None, :]  # (B, T)
        h = m.tok_emb(tokens)  # type: ignore[misc]
        if m.pos_emb is not None:
            h = h + m.pos_emb(pos)
        rope = None
        if cfg.pos == "rope":
            rope = (m.rope_cos[pos], m.rope_sin[pos])  # (B, T, hd/2) each
        # Key j of a row is visible to its query i when j <= position of i (causal over the cache).
        visible = torch.arange(self.seq_len, device=dev)[None, None, :] <= pos[:, :, None]  # (B, T, S)
        mask = visible[:, None]  # (B, 1, T, S)
        rows = slots[:, None].expand(b, t)
        # Rows whose slots are consecutive (a full batch, or the usual case after sorting by slot) read
        # the cache through a view; otherwise gather their slots (a copy per layer).
        lo = int(slots[0])
        contiguous = bool(torch.equal(slots, torch.arange(lo, lo + b, device=dev)))
        for i, block in enumerate(m.layers.values()):
            a = block.attn
            x = block.attn_norm(h)
            qkv = F.linear(x, *self.qkv[i])  # (B, T, (nh + 2 nkv) hd)
            qkv = _with_adapters(qkv, x, (a.q, a.k, a.v))
            q, k, v = qkv.split((self.q_width, self.kv_width, self.kv_width), dim=-1)
            q = q.view(b, t, -1, self.head_dim).transpose(1, 2)  # (B, nh, T, hd)
            k = k.view(b, t, -1, self.head_dim).transpose(1, 2)  # (B, nkv, T, hd)
            v = v.view(b, t, -1, self.head_dim).transpose(1, 2)
            q, k = a.norm_qk(q, k)  # Qwen3's per-head q/k RMSNorm, before rotary as in the full forward
            if rope is not None:
                q, k = _rope_at(q, *rope), _rope_at(k, *rope)
            self.k[i][rows, :, pos] = k.transpose(1, 2)  # (B, T, nkv, hd) into (slot, :, position)
            self.v[i][rows, :, pos] = v.transpose(1, 2)
            ck, cv = ((self.k[i][lo:lo + b], self.v[i][lo:lo + b]) if contiguous
                      else (self.k[i].index_select(0, slots), self.v[i].index_select(0, slots)))
            keys, vals = repeat_kv(ck, self.groups), repeat_kv(cv, self.groups)  # (B, nh, S, hd)
            y = F.scaled_dot_product_attention(q, keys, vals, attn_mask=mask)  # (B, nh, T, hd)
            h = h + a.o(y.transpose(1, 2).reshape(b, t, -1))
            h = h + block.mlp(block.mlp_norm(h))
        return m.head(m.norm(h))  # type: ignore[misc]


def _with_adapters(qkv: torch.Tensor, x: torch.Tensor, projections: tuple[nn.Module, ...]) -> torch.Tensor:
    """The fused q/k/v product plus the per-row LoRA updates of served adapters (serve/adapters.py), if any."""
    parts = [getattr(m, "row_delta", lambda _x: None)(x) for m in projections]
    if all(d is None for d in parts):
        return qkv
    widths = [m.weight.shape[0] for m in projections]
    full = [d if d is not None else qkv.new_zeros(*qkv.shape[:-1], w) for d, w in zip(parts, widths, strict=True)]
    return qkv + torch.cat(full, dim=-1)
