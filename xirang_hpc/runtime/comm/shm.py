"""A shared-memory segment for the ranks of one node, with a spin barrier.

On CPU the intra-node steps of the hierarchical all-reduce go through this segment instead of
gloo: gloo's ``reduce_scatter_tensor`` (torch 2.13) is a clone + a *full* all-reduce + a copy,
so a reduce-scatter built from gloo costs a whole all-reduce over loopback TCP. Here the ranks
of a node write their inputs into one mmap-ed file under ``/dev/shm``, each rank sums its own
shard of the inputs (a memory-bandwidth operation), and everyone reads the result back.

The file is created 0600 by local rank 0, opened by the others, and unlinked as soon as all of
them have mapped it, so nothing is left in ``/dev/shm`` even after ``kill -9``.

Layout: a 4 KiB header of per-rank barrier counters (one 64-byte cache line each), then two
regions (double buffering) of ``k + 1`` slots of ``slot_bytes``: ``k`` input slots and one output.
The barrier relies on each rank writing only its own counter and on x86-64 store ordering (data
stores become visible before the counter store that follows them).
"""

from __future__ import annotations

import mmap
import os
import time
from pathlib import Path

import numpy as np
import torch

HEADER = 4096
_LINE = 8  # int64 per 64-byte cache line


class ShmTimeout(RuntimeError):
    """A local peer did not reach the shared-memory barrier in time."""


def shm_path(token: str, node: int) -> Path:
    """Path of the segment of ``node`` for one communicator instance."""
    base = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(os.environ.get("TMPDIR", "/tmp"))
    return base / f"xirang-comm-{os.getuid()}-{token}-n{node}"


class NodeShm:
    """One node's shared segment, seen from local rank ``me`` of ``k``."""

    def __init__(self, path: Path, me: int, k: int, slot_bytes: int, create: bool, timeout_s: float = 300.0) -> None:
        self.path, self.me, self.k, self.timeout_s = path, me, k, timeout_s
        self.slot_bytes = (slot_bytes + 63) // 64 * 64
        self.size = HEADER + 2 * (k + 1) * self.slot_bytes
        if k * _LINE * 8 > HEADER:
            raise ValueError(f"{k} local ranks do not fit the {HEADER}-byte shared-memory header")
        if create:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            os.ftruncate(fd, self.size)
        else:
            fd = os.open(path, os.O_RDWR)
            if os.fstat(fd).st_size != self.size:
                os.close(fd)
                raise RuntimeError(f"shared segment {path} has the wrong size (another job's file?)")
        try:
            self.mm = mmap.mmap(fd, self.size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        self._counters = np.frombuffer(self.mm, dtype=np.int64, count=k * _LINE)
        self._mine = self._counters[me * _LINE : me * _LINE + 1]
        self._all = self._counters[::_LINE]
        self._bytes = torch.frombuffer(self.mm, dtype=torch.uint8)
        self.epoch = 0

    def unlink(self) -> None:
        """Remove the file (the mapping stays valid); safe to call twice."""
        try:
            self.path.unlink()
        except FileNotFoundError:
            pass

    def close(self) -> None:
        """Drop the mapping (tensors viewing it must be gone)."""
        self._counters = self._mine = self._all = None  # type: ignore[assignment]
        self._bytes = None  # type: ignore[assignment]
        try:
            self.mm.close()
        except BufferError:
            pass  # a live view still exists; the mapping goes when the process ends

    def barrier(self) -> None:
        """Wait until every local rank has called ``barrier`` as often as this one."""
        self.epoch += 1
        e = self.epoch
        self._mine[0] = e
        spins = 0
        deadline = 0.0
        while self._all.min() < e:
            spins += 1
            if spins < 64:
                continue
            if spins < 4096:
                os.sched_yield()
                continue
            if not deadline:
                deadline = time.monotonic() + self.timeout_s
            elif time.monotonic() > deadline:
                late = [i for i, v in enumerate(self._all) if v < e]
                raise ShmTimeout(f"local ranks {late} did not reach shared-memory barrier {e} within "
                                 f"{self.timeout_s:.0f}s (segment {self.path}); a peer died or hangs")
            time.sleep(20e-6)

    def slots(self, region: int, numel: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs ``[k, numel]``, output ``[numel]``) views of ``region`` (0 or 1)."""
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        if nbytes > self.slot_bytes:
            raise ValueError(f"{nbytes} bytes exceed the {self.slot_bytes}-byte shared slot")
        base = HEADER + region * (self.k + 1) * self.slot_bytes
        first = self._bytes[base : base + nbytes].view(dtype)
        out_at = base + self.k * self.slot_bytes
        out = self._bytes[out_at : out_at + nbytes].view(dtype)
        # The k input slots are equally spaced (slot_bytes is a multiple of 64): one strided 2-D view.
        inputs = first.as_strided((self.k, numel), (self.slot_bytes // first.element_size(), 1))
        return inputs, out
