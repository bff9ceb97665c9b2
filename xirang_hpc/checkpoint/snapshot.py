"""Snapshot a state dict to host memory, and RNG states to/from JSON.

The snapshot is the only part of an asynchronous save the training loop waits for: every
tensor is copied into a host buffer (reused between saves, so the second save allocates
nothing), after which training may modify its tensors freely (CheckFreq's snapshot/persist
split). DTensor shards stay DTensors so DCP's planner still sees their global placement.
"""

from __future__ import annotations

import base64
import random
from typing import Any

import numpy as np
import torch

try:  # DTensor moved between releases; both spellings are public.
    from torch.distributed.tensor import DTensor
except ImportError:  # pragma: no cover - older torch
    from torch.distributed._tensor import DTensor  # type: ignore[no-redef]

from xirang_hpc.runtime import liveness


class HostSnapshot:
    """Copies nested state dicts into reusable host buffers."""

    def __init__(self, pin_memory: bool = False) -> None:
        self.pin_memory = pin_memory and torch.accelerator.is_available()
        self._buffers: dict[str, torch.Tensor] = {}
        # The copy plan of the last snapshot: (its source object, [(buffer, source tensor)], the copy it returned).
        self._plan: tuple[Any, list[tuple[torch.Tensor, torch.Tensor]], Any] | None = None
        self._pairs: list[tuple[torch.Tensor, torch.Tensor]] | None = None

    def _host_copy(self, key: str, t: torch.Tensor) -> torch.Tensor:
        t = t.detach()
        buf = self._buffers.get(key)
        if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
            buf = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=self.pin_memory)
            self._buffers[key] = buf
        buf.copy_(t, non_blocking=self.pin_memory)
        liveness.tick("checkpoint snapshot")
        if self._pairs is not None:
            self._pairs.append((buf, t))
        return buf

    def copy(self, obj: Any, key: str = "") -> Any:
        """A structurally identical copy of ``obj`` whose tensors live in host buffers."""
        if isinstance(obj, DTensor):
            local = self._host_copy(key, obj.to_local())
            return DTensor.from_local(local, obj.device_mesh, obj.placements, run_check=False,
                                      shape=obj.shape, stride=obj.stride())
        if isinstance(obj, torch.Tensor):
            return self._host_copy(key, obj)
        if isinstance(obj, dict):
            return {k: self.copy(v, f"{key}.{k}") for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            return type(obj)(self.copy(v, f"{key}.{i}") for i, v in enumerate(obj))
        return obj

    def snapshot(self, obj: Any, static: bool = False) -> Any:
        """Copy and wait for any device-to-host transfer to land.

        ``static``: ``obj`` is the object of the previous call, holding the same tensors (the caller
        guarantees it, e.g. a state dict it caches while every tensor is updated in place); the copy
        then replays the recorded plan -- a ``copy_`` per tensor, nothing else, as a plain host copy.
        """
        if static and self._plan is not None and self._plan[0] is obj:
            for buf, t in self._plan[1]:
                buf.copy_(t, non_blocking=self.pin_memory)
                liveness.tick("checkpoint snapshot")
            out = self._plan[2]
        else:
            self._pairs = []
            try:
                out = self.copy(obj)
                self._plan = (obj, self._pairs, out)
            finally:
                self._pairs = None
        if self.pin_memory:
            torch.accelerator.synchronize()
        return out


def _b64(t: torch.Tensor) -> str:
    return base64.b64encode(t.cpu().numpy().tobytes()).decode()


def _unb64(s: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8)


def capture_rng() -> dict[str, Any]:
    """This process's python, numpy, torch (and cuda) RNG states as JSON-able data."""
    version, state, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    out: dict[str, Any] = {
        "python": [version, list(state), gauss],
        "numpy": [kind, keys.tolist(), int(pos), int(has_gauss), float(cached)],
        "torch": _b64(torch.get_rng_state()),
    }
    kind, mod = _accelerator_rng()
    if mod is not None:  # keyed by the device type (cuda, xpu, ...)
        out[kind] = [_b64(s) for s in mod.get_rng_state_all()]
    return out


def _accelerator_rng() -> tuple[str, Any]:
    """The accelerator's torch module with per-device RNG states, once this process has used it; else ("", None)."""
    if not torch.accelerator.is_available():
        return "", None
    acc = torch.accelerator.current_accelerator()
    mod = getattr(torch, acc.type, None) if acc is not None else None
    if acc is None or not callable(getattr(mod, "get_rng_state_all", None)):
        return "", None
    used = getattr(mod, "is_initialized", None)
    return (acc.type, mod) if not callable(used) or used() else ("", None)


def restore_rng(d: dict[str, Any]) -> None:
    """Inverse of :func:`capture_rng`."""
    version, state, gauss = d["python"]
    random.setstate((version, tuple(state), gauss))
    kind, keys, pos, has_gauss, cached = d["numpy"]
    np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(_unb64(d["torch"]))
    kind, mod = _accelerator_rng()
    if mod is not None and kind in d:
        mod.set_rng_state_all([_unb64(s) for s in d[kind]])
