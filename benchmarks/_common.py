"""Helpers shared by the benchmark scripts (each run as ``python benchmarks/bench_X.py``, so this directory is
first on ``sys.path`` and ``from _common import ...`` finds this module; spawned ranks inherit the path)."""

from __future__ import annotations


def rss_mib() -> float:
    """This process's resident memory now (``VmRSS`` in /proc/self/status), MiB; 0.0 where it is not reported."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0
