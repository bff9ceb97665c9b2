"""Hierarchical all-reduce: intra-node reduce-scatter, k parallel inter-node all-reduces, intra-node all-gather.

Horovod's scheme (anchors.md): for ``p = m`` nodes x ``k`` ranks, each local rank ``j`` owns
shard ``j`` of the message; it sums the k inputs of that shard inside the node, all-reduces the
shard with the rank-``j`` peers of the other nodes (k flows in parallel, one gloo subgroup each),
and the node then reads the full result back. Alpha-beta cost (anchors.md):
``2(k-1)a_l + 2(k-1)/k n b_l + 2(m-1)a_g + 2(m-1)/m (n/k) b_g``; each node's NIC carries
``2(m-1)/m n`` bytes instead of ``2(p-1)/p n`` for a node-ordered flat ring.

On CPU the intra-node steps use :class:`~xirang_hpc.runtime.comm.shm.NodeShm` (no gloo
reduce-scatter: in torch 2.13 it is a full all-reduce). On GPU they use NCCL's
``reduce_scatter_tensor``/``all_gather_into_tensor`` on an intra-node group; that path cannot
run on this CPU-only machine and is untested here.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from xirang_hpc.runtime import liveness
from xirang_hpc.runtime.comm.groups import CommLayout
from xirang_hpc.runtime.comm.shm import NodeShm, shm_path


def shard_bounds(n: int, k: int, j: int, align: int = 16) -> tuple[int, int]:
    """Elements ``[lo, hi)`` of shard ``j`` of ``k`` over ``n`` (aligned; trailing shards may be short or empty)."""
    per = -(-n // k)
    per = -(-per // align) * align
    lo = min(n, j * per)
    return lo, min(n, lo + per)


def _pieces(tensors: list[torch.Tensor], start: int, n: int) -> list[tuple[torch.Tensor, int, int, int]]:
    """(tensor, offset in tensor, offset in chunk, length) of the virtual concatenation's ``[start, start+n)``."""
    out, base = [], 0
    for t in tensors:
        lo, hi = max(start, base), min(start + n, base + t.numel())
        if lo < hi:
            out.append((t, lo - base, lo - start, hi - lo))
        base += t.numel()
    return out


class HierarchicalAllreduce:
    """Averages flat tensors over a :class:`CommLayout`'s group, node-aware."""

    def __init__(self, layout: CommLayout, slot_bytes: int = 32 << 20, timeout_s: float = 300.0,
                 pipeline_bytes: int = 4 << 20) -> None:
        self.layout = layout
        self.pipeline_bytes = pipeline_bytes
        # An accelerator's group ("cpu:gloo,cuda:nccl", runtime/device.py) reduces device tensors itself;
        # a plain gloo group goes through the node's shared memory.
        self.gpu = dist.is_initialized() and str(dist.get_backend(layout.group)) != "gloo"
        self.shm: NodeShm | None = None
        self.slot_bytes = slot_bytes
        self.region = 0
        # Measured inter-node traffic of this rank (ring: 2(m-1)/m of each shard's bytes).
        self.internode_bytes = 0.0
        self.internode_s = 0.0
        if layout.local > 1 and not self.gpu:
            path = shm_path(layout.token, layout.node_id)
            creator = layout.local_index == 0
            if creator:
                self.shm = NodeShm(path, 0, layout.local, slot_bytes, create=True, timeout_s=timeout_s)
            dist.barrier(group=layout.group)
            if not creator:
                self.shm = NodeShm(path, layout.local_index, layout.local, slot_bytes, create=False,
                                   timeout_s=timeout_s)
            dist.barrier(group=layout.group)
            self.shm.unlink()

    def close(self) -> None:
        """Release the shared segment."""
        if self.shm is not None:
            self.shm.unlink()
            self.shm.close()
            self.shm = None

    def _counted(self, what: str) -> liveness.collective:
        """The node barrier as a collective of the node's ranks (c10d does not count it): a rank waiting in it
        for a stopped peer is a waiter for the watchdog's collective rule, not a laggard."""
        lay = self.layout
        return liveness.collective(what, group=f"shm-{lay.token}-{lay.node_index}", ranks=lay.intra_ranks)

    def _cross(self, t: torch.Tensor) -> None:
        lay = self.layout
        if lay.num_nodes == 1 or t.numel() == 0:
            return
        t0 = time.perf_counter()
        dist.all_reduce(t, group=lay.cross_group)
        self.internode_s += time.perf_counter() - t0
        self.internode_bytes += 2 * (lay.num_nodes - 1) / lay.num_nodes * t.numel() * t.element_size()

    def allreduce_(self, tensors: list[torch.Tensor], inter_node: bool = True, chunk_bytes: int = 0) -> None:
        """Average the 1-D ``tensors`` (one dtype) in place over the group, or over this node only.

        The virtual concatenation of ``tensors`` is processed in chunks of ``chunk_bytes``
        (at most the shared slot; 0 = the slot size).
        """
        if not tensors:
            return
        lay = self.layout
        divisor = lay.size if inter_node else lay.local
        if lay.local == 1:
            for t in tensors:
                t.div_(divisor)
                if inter_node:
                    self._cross(t)
            return
        if self.gpu:
            self._allreduce_nccl(tensors, divisor, inter_node)
            return
        dtype = tensors[0].dtype
        total = sum(t.numel() for t in tensors)
        limit = min(self.slot_bytes, chunk_bytes) if chunk_bytes > 0 else self.slot_bytes
        # Pipeline: chunks of at most pipeline_bytes, so the intra-node work of chunk c+1 overlaps
        # the inter-node all-reduce of chunk c (gloo runs it on its own thread).
        cap = max(1, min(limit, self.pipeline_bytes) // tensors[0].element_size())
        prev: tuple | None = None
        for start in range(0, total, cap):
            n = min(cap, total - start)
            cur = self._reduce_chunk(_pieces(tensors, start, n), n, dtype, divisor, inter_node)
            if prev is not None:
                self._finish_chunk(*prev)
            prev = cur
        if prev is not None:
            self._finish_chunk(*prev)

    def _reduce_chunk(self, pieces: list[tuple[torch.Tensor, int, int, int]], n: int, dtype: torch.dtype,
                      divisor: int, inter_node: bool) -> tuple:
        """Copy in, reduce this rank's shard, start its inter-node all-reduce (async)."""
        shm, lay = self.shm, self.layout
        assert shm is not None
        ins, out = shm.slots(self.region, n, dtype)
        self.region ^= 1  # double buffering (see _finish_chunk for why two regions suffice)
        me = lay.local_index
        for t, t_lo, c_lo, ln in pieces:
            ins[me, c_lo : c_lo + ln].copy_(t[t_lo : t_lo + ln])
        with self._counted("node shared-memory barrier (inputs written)"):
            shm.barrier()  # every input of this chunk is written
        lo, hi = shard_bounds(n, lay.local, me)
        work = None
        if hi > lo:
            shard = out[lo:hi]
            if lay.local == 2:
                torch.add(ins[0, lo:hi], ins[1, lo:hi], out=shard)
            else:
                torch.sum(ins[:, lo:hi], dim=0, out=shard)
            shard.div_(divisor)
            if inter_node and lay.num_nodes > 1:
                work = dist.all_reduce(shard, group=lay.cross_group, async_op=True)
                self.internode_bytes += 2 * (lay.num_nodes - 1) / lay.num_nodes * shard.numel() * shard.element_size()
        return pieces, out, work, time.perf_counter()

    def _finish_chunk(self, pieces: list[tuple[torch.Tensor, int, int, int]], out: torch.Tensor, work: object,
                      t0: float) -> None:
        """Wait for the shard's all-reduce, then read the whole chunk back.

        Chunk c+2 reuses chunk c's region; a rank writes it only after passing chunk c+1's first
        barrier, which every rank reaches only after finishing chunk c here. So two regions suffice.
        """
        if work is not None:
            work.wait()  # type: ignore[attr-defined]
            self.internode_s += time.perf_counter() - t0
        assert self.shm is not None
        with self._counted("node shared-memory barrier (shards reduced)"):
            self.shm.barrier()  # every shard is reduced (and all-reduced across nodes)
        for t, t_lo, c_lo, ln in pieces:
            t[t_lo : t_lo + ln].copy_(out[c_lo : c_lo + ln])

    def _allreduce_nccl(self, tensors: list[torch.Tensor], divisor: int, inter_node: bool) -> None:
        """GPU path: NCCL reduce-scatter / all-reduce / all-gather (untested on this CPU machine)."""
        lay = self.layout
        flat = torch.cat([t.reshape(-1) for t in tensors])
        n = flat.numel()
        padded = -(-n // lay.local) * lay.local
        if padded != n:
            flat = torch.cat([flat, flat.new_zeros(padded - n)])
        shard = flat.new_empty(padded // lay.local)
        dist.reduce_scatter_tensor(shard, flat, group=lay.intra_group)
        shard.div_(divisor)
        if inter_node:
            self._cross(shard)
        dist.all_gather_into_tensor(flat, shard, group=lay.intra_group)
        pos = 0
        for t in tensors:
            t.copy_(flat[pos : pos + t.numel()].view_as(t))
            pos += t.numel()
