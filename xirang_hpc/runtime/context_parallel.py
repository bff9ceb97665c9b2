"""Context parallelism (``parallel.cp``): every sequence split over the ranks of a cp group.

Load-balanced causal chunking (as Megatron-Core and torchtitan do): a row of T tokens is cut into
``2*cp`` equal chunks and cp rank ``i`` keeps chunks ``i`` and ``2cp-1-i``. Under a causal mask the
work of a query grows with its position, so pairing an early chunk with a late one gives every rank
the same attention work (rank 0 would otherwise idle on the cheapest chunk while the last rank did the
most expensive one).

Attention across the shards gathers keys and values: each rank all-gathers K and V of its cp group
(n_kv heads, before grouped-query repetition) and attends with its local queries to every key before
them: on the CPU with torch's fused kernel per chunk, merged by log-sum-exp (no mask, no scores held;
:class:`_ChunkedCausalAttention`), elsewhere through SDPA per chunk with torch's lower-right causal bias.
Packed rows take SDPA with their per-sample mask over the shards
(:func:`xirang_hpc.models.gpt.sharded_causal_mask`, built in the model). This is torchtitan's
``allgather`` rotation; a ring would overlap the transfer with compute, at the price of ``cp`` steps
of online softmax. torch's own ``context_parallel`` needs its fused SDPA kernels, which the CPU (gloo)
path does not have.

The gathered tensor's gradient is the sum, over the cp ranks, of what each rank's queries sent back
to each key: the backward reduce-scatters it (nccl), or all-reduces it and keeps this rank's slice
(gloo has no reduce-scatter). Everything else -- embeddings, MLP, norms, the loss -- is local to the
rank's tokens; the gradient reduction over dp x cp then sums the parameter gradients of the parts.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.nn.attention.bias import causal_lower_right

from xirang_hpc.models.gpt import GPT, Attention
from xirang_hpc.runtime.device import CPU


def shard_index(seq_len: int, cp: int, rank: int) -> torch.Tensor:
    """Global positions (seq_len // cp,) held by cp rank ``rank``: chunks ``rank`` and ``2cp-1-rank`` of ``2cp``."""
    if seq_len % (2 * cp):
        raise ValueError(f"2*cp={2 * cp} must divide the sequence length {seq_len}")
    if not 0 <= rank < cp:
        raise ValueError(f"cp rank {rank} is outside 0..{cp - 1}")
    c = seq_len // (2 * cp)
    first, second = rank * c, (2 * cp - 1 - rank) * c
    return torch.cat([torch.arange(first, first + c), torch.arange(second, second + c)])


class _GatherSeq(torch.autograd.Function):
    """All-gather along a sequence dimension over a group; the backward returns each shard its summed gradient."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup, dim: int) -> torch.Tensor:  # type: ignore[override]
        n, rank = dist.get_world_size(group), dist.get_rank(group)
        ctx.group, ctx.dim, ctx.n, ctx.rank = group, dim, n, rank
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(n)]
        dist.all_gather(parts, x, group=group)
        return torch.cat(parts, dim=dim)  # the shards in cp-rank order

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:  # type: ignore[override]
        chunks = [c.contiguous() for c in grad.chunk(ctx.n, dim=ctx.dim)]
        if dist.get_backend(ctx.group) == "gloo":  # gloo has no reduce-scatter: sum everything, keep our slice
            full = torch.cat(chunks, dim=ctx.dim)
            dist.all_reduce(full, group=ctx.group)
            return full.chunk(ctx.n, dim=ctx.dim)[ctx.rank].contiguous(), None, None
        out = torch.empty_like(chunks[ctx.rank])
        dist.reduce_scatter(out, chunks, group=ctx.group)
        return out, None, None


def _flash_cpu_available() -> bool:
    """torch's fused CPU attention kernels (forward with log-sum-exp, and their backward) are present."""
    return hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu") and hasattr(
        torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward")


class _ChunkedCausalAttention(torch.autograd.Function):
    """Causal attention of a rank's two load-balanced chunks over the keys in global order, no mask held.

    Query chunk ``j`` (of ``c`` tokens, global positions ``[jc, (j+1)c)``) sees every key before its chunk
    in full and the keys of its own chunk causally: two fused-kernel calls (the full past block, the
    square diagonal with ``is_causal``) merged by their log-sum-exps, as ring attention merges blocks.
    Memory stays linear in the sequence (the kernel keeps no scores; no ``(T/cp, T)`` mask exists), and
    the work is the causal share only. The backward runs the kernel's own backward per block with the
    *merged* output and log-sum-exp, whose per-block gradients sum to the whole attention's.
    """

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,  # type: ignore[override]
                chunks: tuple[int, ...]) -> torch.Tensor:
        c = q.shape[2] // len(chunks)
        fwd = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
        outs, lses = [], []
        for i, j in enumerate(chunks):
            qc = q[:, :, i * c:(i + 1) * c]  # (B, H, c, hd)
            o, lse = fwd(qc, k[:, :, j * c:(j + 1) * c], v[:, :, j * c:(j + 1) * c], 0.0, True)
            if j > 0:  # the keys of every earlier chunk, all visible
                o_past, lse_past = fwd(qc, k[:, :, :j * c], v[:, :, :j * c], 0.0, False)
                both = torch.logaddexp(lse, lse_past)  # (B, H, c)
                o = (o.float() * (lse - both).exp()[..., None]
                     + o_past.float() * (lse_past - both).exp()[..., None]).to(q.dtype)
                lse = both
            outs.append(o)
            lses.append(lse)
        out, lse = torch.cat(outs, dim=2), torch.cat(lses, dim=2)  # (B, H, T/cp, hd), (B, H, T/cp)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.chunks = chunks
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, None]:  # type: ignore[override]
        q, k, v, out, lse = ctx.saved_tensors
        c = q.shape[2] // len(ctx.chunks)
        bwd = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        grad = grad.contiguous()
        for i, j in enumerate(ctx.chunks):
            rows = slice(i * c, (i + 1) * c)
            g, qc, oc, lc = grad[:, :, rows], q[:, :, rows], out[:, :, rows], lse[:, :, rows]
            blocks = [(slice(j * c, (j + 1) * c), True)] + ([(slice(0, j * c), False)] if j > 0 else [])
            for keys, causal in blocks:
                gq, gk, gv = bwd(g, qc, k[:, :, keys], v[:, :, keys], oc, lc, 0.0, causal)
                dq[:, :, rows] += gq
                dk[:, :, keys] += gk
                dv[:, :, keys] += gv
        return dq, dk, dv, None


class ContextShards:
    """This rank's shard of every sequence in its cp group (implements :class:`xirang_hpc.models.gpt.SequenceShards`).

    ``index`` (T/cp,): the global positions this rank holds; ``key_index`` (T,): the positions of the
    gathered keys (every rank's ``index``, concatenated in cp-rank order).
    """

    def __init__(self, group: dist.ProcessGroup, seq_len: int, device: torch.device | str = CPU) -> None:
        self.group = group
        self.cp, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.seq_len = seq_len
        self.index = shard_index(seq_len, self.cp, self.rank).to(device)
        self.key_index = torch.cat([shard_index(seq_len, self.cp, r) for r in range(self.cp)]).to(device)
        self.chunks = (self.rank, 2 * self.cp - 1 - self.rank)  # the global chunk numbers held, in order
        self._order = torch.argsort(self.key_index)  # gathered keys -> global positions
        self._fused = _flash_cpu_available()

    def shard(self, rows: torch.Tensor) -> torch.Tensor:
        """(B, T) -> (B, T/cp): this rank's tokens of every row (inputs, targets or position ids)."""
        if rows.shape[1] != self.seq_len:
            raise ValueError(f"rows of {rows.shape[1]} tokens, the cp shards cut {self.seq_len}")
        return rows.index_select(1, self.index.to(rows.device))

    def causal_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Plain causal attention of this rank's queries (B, H, T/cp, hd) over gathered k, v (B, H, T, hd).

        The keys are put in global order first; query chunk ``j`` then sees the first ``(j+1)c`` of them,
        causally aligned to their end. On the CPU: the fused kernel per chunk (:class:`_ChunkedCausalAttention`;
        torch's CPU kernels would otherwise materialize a lower-right mask). Elsewhere: SDPA per chunk with
        torch's lower-right causal bias, which the fused GPU kernels take without a mask tensor. Either way
        no ``(T/cp, T)`` mask is held and only the causal share of the work is done.
        """
        order = self._order.to(k.device)
        k, v = k.index_select(2, order), v.index_select(2, order)  # rank order -> global positions
        if q.device.type == CPU and self._fused:
            return _ChunkedCausalAttention.apply(q, k, v, self.chunks)
        c = q.shape[2] // len(self.chunks)
        outs = [F.scaled_dot_product_attention(q[:, :, i * c:(i + 1) * c], k[:, :, :(j + 1) * c], v[:, :, :(j + 1) * c],
                                               attn_mask=causal_lower_right(c, (j + 1) * c))
                for i, j in enumerate(self.chunks)]
        return torch.cat(outs, dim=2)  # (B, H, T/cp, hd)

    def gather(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """Every shard of ``x`` concatenated along ``dim`` in :attr:`key_index` order (autograd-correct)."""
        return _GatherSeq.apply(x, self.group, dim)

    @torch.no_grad()
    def gather_ids(self, ids: torch.Tensor) -> torch.Tensor:
        """(B, T/cp) -> (B, T) in :attr:`key_index` order, no gradient (position ids of packed rows)."""
        parts = [torch.empty_like(ids) for _ in range(self.cp)]
        dist.all_gather(parts, ids.contiguous(), group=self.group)
        return torch.cat(parts, dim=1)


def apply_context_parallel(model: nn.Module, cp_mesh: DeviceMesh, seq_len: int,
                           device: torch.device | str = CPU) -> ContextShards:
    """Make ``model`` (a GPT) run on sequence shards of the ``cp_mesh`` group: itself and every attention."""
    shards = ContextShards(cp_mesh.get_group(), seq_len, device)
    if not isinstance(model, GPT):
        raise TypeError(f"context parallelism shards a GPT, not {type(model).__name__}")
    model.seq_shards = shards
    for m in model.modules():
        if isinstance(m, Attention):
            m.seq_shards = shards
    return shards
