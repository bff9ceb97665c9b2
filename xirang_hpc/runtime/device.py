"""The job's one device decision: which device this rank computes on, and the process group that goes with it.

Decided once per rank at start-up (:func:`decide`, called by ``runtime.dist.start_job``), recorded in the rank's
:class:`~xirang_hpc.runtime.topology.Topology` (``topo.device``) and carried by the job's
:class:`~xirang_hpc.runtime.parallel_dims.Layout`; everything else takes it from there: the process group's
backend, the device mesh, where the model is materialised, the optimizer state, mixed precision, checkpoint
snapshots, the tracked memory, serving and evaluation. Nothing else names a device type.

Device-generic through ``torch.accelerator`` (CUDA and ROCm as ``cuda``, Intel ``xpu``, Apple ``mps``, and
out-of-tree devices such as Ascend ``npu`` registered by their extension) and torch's own map of device type to
collective backend (``nccl``, ``xccl``, ``hccl``, ...). An accelerator's process group also carries a ``gloo``
backend for CPU tensors (``cpu:gloo,cuda:nccl``), so CPU-side collectives (object gathers, CPU-resident
checkpoint metadata) never need a device copy.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from xirang_hpc.config.errors import ConfigError

CPU = "cpu"
_TYPE = re.compile(r"^[a-z][a-z0-9_]*$")
# Float8 tensor-core matmuls (torch._scaled_mm, which torchao's float8 training runs on): NVIDIA compute capability
# 8.9 (Ada) and 9.0 (Hopper) onwards (CUDA C++ Programming Guide, "Compute Capabilities"; torch's _scaled_mm
# refuses older devices).
FP8_MIN_CAPABILITY = (8, 9)


@dataclass(frozen=True)
class Device:
    """A device type and, for an accelerator, this rank's index (``cuda:3``); ``cpu`` has no index."""

    type: str
    index: int | None = None

    @classmethod
    def parse(cls, text: str) -> Device:
        """``"cuda:3"`` -> Device("cuda", 3); ``"cpu"`` -> Device("cpu")."""
        kind, _, idx = text.partition(":")
        return cls(kind, int(idx) if idx else None)

    def __str__(self) -> str:
        return self.type if self.index is None else f"{self.type}:{self.index}"

    @property
    def torch(self) -> torch.device:
        """The ``torch.device`` to place tensors on."""
        return torch.device(self.type) if self.index is None else torch.device(self.type, self.index)

    @property
    def is_accelerator(self) -> bool:
        """Anything but the CPU."""
        return self.type != CPU

    def backend(self, requested: str = "auto") -> str:
        """The process group's backend for this device: ``cluster.backend``, or torch's own map under ``auto``.

        An accelerator's group gets ``gloo`` for CPU tensors beside its collective library. A device type with no
        distributed backend is refused by name.
        """
        if requested != "auto":
            if requested != "gloo" and not self.is_accelerator:
                raise ConfigError("cluster.backend", requested, f"needs an accelerator; this rank's device is {self}; "
                                  "use cluster.backend=auto or gloo")
            return requested if requested == "gloo" else f"cpu:gloo,{self.type}:{requested}"
        known = dict(dist.Backend.default_device_backend_map)
        be = known.get(self.type)
        if be is None:
            raise ConfigError("cluster.device", self.type,
                              f"torch has no distributed backend for device type {self.type!r} (known: {known}); "
                              "install the device's extension, or set cluster.backend=gloo")
        return be if not self.is_accelerator or be == "gloo" else f"cpu:gloo,{self.type}:{be}"

    def set_current(self) -> None:
        """Make this rank's accelerator the current one (before its process group starts)."""
        if self.is_accelerator and self.index is not None:
            torch.accelerator.set_device_index(self.index)

    def synchronize(self) -> None:
        """Wait for the device's queued work (no-op on the CPU)."""
        if self.is_accelerator:
            torch.accelerator.synchronize(self.index)

    def peak_memory_mb(self) -> float | None:
        """Peak memory the allocator handed out on this device, MiB; None on the CPU."""
        if not self.is_accelerator:
            return None
        return torch.accelerator.max_memory_allocated(self.index) / 2**20

    def name(self) -> str:
        """The device's product name where torch knows it (for peak-FLOPs look-ups), else its type."""
        mod: Any = getattr(torch, self.type, None)
        get = getattr(mod, "get_device_name", None)
        if self.is_accelerator and callable(get):
            return str(get(self.index))
        return self.type

    def capability(self) -> tuple[int, int] | None:
        """The NVIDIA compute capability of a CUDA device (None for the CPU, ROCm and other accelerators)."""
        if self.type != "cuda" or getattr(torch.version, "hip", None) or not torch.cuda.is_available():
            return None
        return tuple(torch.cuda.get_device_capability(self.index))  # type: ignore[return-value]

    def describe(self) -> str:
        """This device in words, for refusals: ``the CPU``, ``cuda:0 (NVIDIA A100-SXM4-80GB, compute capability
        8.0)``."""
        if not self.is_accelerator:
            return "the CPU (no accelerator)"
        cap = self.capability()
        extra = f", compute capability {cap[0]}.{cap[1]}" if cap else ""
        return f"{self} ({self.name()}{extra})"

    def supports_fp8(self) -> bool:
        """Float8 tensor-core matmuls: a CUDA device of compute capability >= 8.9."""
        cap = self.capability()
        return cap is not None and cap >= FP8_MIN_CAPABILITY

    def rng_state(self) -> list[torch.Tensor] | None:
        """Every local device's RNG state (for exact resume), None on the CPU."""
        mod: Any = getattr(torch, self.type, None)
        if not self.is_accelerator or not callable(getattr(mod, "get_rng_state_all", None)):
            return None
        return list(mod.get_rng_state_all())

    def set_rng_state(self, states: list[torch.Tensor]) -> None:
        """Restore what :meth:`rng_state` returned."""
        mod: Any = getattr(torch, self.type, None)
        if self.is_accelerator and callable(getattr(mod, "set_rng_state_all", None)):
            mod.set_rng_state_all(states)


def decide(requested: str = "auto", local_rank: int = 0, backend: str = "auto", accel: Any = None,
           field: str = "cluster.device") -> Device:
    """This rank's device: ``cluster.device`` (``auto``: the accelerator torch finds, else the CPU).

    ``auto`` with ``cluster.backend=gloo`` trains on the CPU, as gloo alone cannot reduce accelerator tensors
    for every layout. An accelerator rank takes the device ``local_rank % device_count``. ``accel`` stands in for
    ``torch.accelerator`` in tests; ``field`` is the config field a refusal names (``serve.device``, ...).
    """
    acc = torch.accelerator if accel is None else accel
    if not _TYPE.match(requested) and requested != "auto":
        raise ConfigError(field, requested, "use auto, cpu or an accelerator type (cuda, xpu, npu, mps)")
    if requested == CPU or (requested == "auto" and backend == "gloo"):
        return Device(CPU)
    found = acc.current_accelerator() if acc.is_available() else None
    if requested == "auto":
        if found is None:
            return Device(CPU)
        requested = found.type
    if found is None or found.type != requested:
        raise ConfigError(field, requested, f"this node has {'no accelerator' if found is None else found}"
                          f"; use {field}=auto")
    count = max(1, int(acc.device_count()))
    return Device(requested, local_rank % count)


def accelerator_stack() -> dict[str, Any]:
    """torch and, where present, CUDA / cuDNN / NCCL versions and the devices this process sees."""
    info: dict[str, Any] = {"torch": torch.__version__, "cuda": torch.version.cuda,
                            "hip": getattr(torch.version, "hip", None)}
    try:
        info["cudnn"] = torch.backends.cudnn.version()
    except Exception:  # noqa: BLE001 - a build without cuDNN
        info["cudnn"] = None
    if torch.cuda.is_available():
        info["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        info["devices"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return info
