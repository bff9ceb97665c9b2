"""Helpers shared by the benchmark scripts (each run as ``python benchmarks/bench_X.py``, so this directory is
first on ``sys.path`` and ``from _common import ...`` finds this module; spawned ranks inherit the path)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator


def rss_mib() -> float:
    """This process's resident memory now (``VmRSS`` in /proc/self/status), MiB; 0.0 where it is not reported."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


@contextlib.contextmanager
def saved_storages() -> Iterator[dict[int, int]]:
    """Within the block, every tensor autograd saves for the backward: ``{storage pointer: bytes}`` (each storage
    once, so views of one tensor count once). Imports torch only when used."""
    import torch

    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield saved
