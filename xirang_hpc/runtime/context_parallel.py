"""Context parallelism (``parallel.cp``): every sequence split over the ranks of a cp group.

Load-balanced causal chunking (as Megatron-Core and torchtitan do): a row of T tokens is cut into
``2*cp`` equal chunks and cp rank ``i`` keeps chunks ``i`` and ``2cp-1-i``. Under a causal mask the
work of a query grows with its position, so pairing an early chunk with a late one gives every rank
the same attention work (rank 0 would otherwise idle on the cheapest chunk while the last rank did the
most expensive one).

Attention across the shards gathers keys and values: each rank all-gathers K and V of its cp group
(n_kv heads, before grouped-query repetition) and attends with its local queries to every key, under
a mask built from the true positions (:func:`xirang_hpc.models.gpt.sharded_causal_mask`). This is
torchtitan's ``allgather`` rotation; a ring would overlap the transfer with compute, at the price of
``cp`` steps of online softmax. torch's own ``context_parallel`` needs its fused SDPA kernels, which
the CPU (gloo) path does not have.

The gathered tensor's gradient is the sum, over the cp ranks, of what each rank's queries sent back
to each key: the backward reduce-scatters it (nccl), or all-reduces it and keeps this rank's slice
(gloo has no reduce-scatter). Everything else -- embeddings, MLP, norms, the loss -- is local to the
rank's tokens; the gradient reduction over dp x cp then sums the parameter gradients of the parts.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from xirang_hpc.models.gpt import GPT, Attention


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


class ContextShards:
    """This rank's shard of every sequence in its cp group (implements :class:`xirang_hpc.models.gpt.SequenceShards`).

    ``index`` (T/cp,): the global positions this rank holds; ``key_index`` (T,): the positions of the
    gathered keys (every rank's ``index``, concatenated in cp-rank order).
    """

    def __init__(self, group: dist.ProcessGroup, seq_len: int, device: torch.device | str = "cpu") -> None:
        self.group = group
        self.cp, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.seq_len = seq_len
        self.index = shard_index(seq_len, self.cp, self.rank).to(device)
        self.key_index = torch.cat([shard_index(seq_len, self.cp, r) for r in range(self.cp)]).to(device)

    def shard(self, rows: torch.Tensor) -> torch.Tensor:
        """(B, T) -> (B, T/cp): this rank's tokens of every row (inputs, targets or position ids)."""
        if rows.shape[1] != self.seq_len:
            raise ValueError(f"rows of {rows.shape[1]} tokens, the cp shards cut {self.seq_len}")
        return rows.index_select(1, self.index.to(rows.device))

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
                           device: torch.device | str = "cpu") -> ContextShards:
    """Make ``model`` (a GPT) run on sequence shards of the ``cp_mesh`` group: itself and every attention."""
    shards = ContextShards(cp_mesh.get_group(), seq_len, device)
    if not isinstance(model, GPT):
        raise TypeError(f"context parallelism shards a GPT, not {type(model).__name__}")
    model.seq_shards = shards
    for m in model.modules():
        if isinstance(m, Attention):
            m.seq_shards = shards
    return shards
