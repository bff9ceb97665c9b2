"""Resource use of one process (psutil) and of its GPU (NVML, when ``pynvml`` is installed)."""

from __future__ import annotations

import os
from typing import Any

import psutil

_NVML: Any = None  # the pynvml module once initialised, False when unavailable


def _nvml() -> Any:
    global _NVML
    if _NVML is None:
        try:
            import pynvml  # optional: `pip install nvidia-ml-py`

            pynvml.nvmlInit()
            _NVML = pynvml
        except Exception:  # no library, no driver, no GPU: all mean "absent"
            _NVML = False
    return _NVML


def gpu_sample(index: int) -> dict[str, float] | None:
    """Utilisation (%) and memory (MB used/total) of GPU ``index``; None without NVML or that GPU."""
    nv = _nvml()
    if not nv:
        return None
    try:
        h = nv.nvmlDeviceGetHandleByIndex(index)
        util = nv.nvmlDeviceGetUtilizationRates(h)
        mem = nv.nvmlDeviceGetMemoryInfo(h)
        name = nv.nvmlDeviceGetName(h)
    except Exception:
        return None
    return {"gpu": index, "gpu_name": name.decode() if isinstance(name, bytes) else str(name),
            "gpu_util": float(util.gpu), "gpu_mem_mb": mem.used / 2**20, "gpu_mem_total_mb": mem.total / 2**20}


class ProcessSampler:
    """CPU % since the previous sample and RSS of one process (this one by default)."""

    def __init__(self, pid: int | None = None, gpu_index: int | None = None) -> None:
        self.proc = psutil.Process(pid or os.getpid())
        self.proc.cpu_percent(None)  # primes the counter
        self.gpu_index = gpu_index

    def sample(self) -> dict[str, Any]:
        """``{"cpu_pct", "rss_mb"}`` plus the GPU fields when available."""
        try:
            with self.proc.oneshot():
                row: dict[str, Any] = {"cpu_pct": self.proc.cpu_percent(None),
                                       "rss_mb": self.proc.memory_info().rss / 2**20}
        except psutil.Error:
            return {}
        if self.gpu_index is not None:
            row.update(gpu_sample(self.gpu_index) or {})
        return row
