"""Mixed precision: bf16 autocast on GPU, plain fp32 on CPU by default (``train.precision``).

- ``auto``: bf16 autocast when the model runs on an accelerator (runtime/device.py), fp32 on the CPU.
- ``fp32``: no autocast at all; the forward is left untouched (bitwise the plain fp32 run).
- ``bf16``: ``torch.autocast(device_type, dtype=torch.bfloat16)`` around the forward. Parameters,
  gradients and optimizer state stay fp32 (the autocast recipe: only the matmul-class ops run in
  bf16). CPU autocast supports bf16 too, which is how it is tested here.

The loss is always computed in fp32: :func:`xirang_hpc.models.gpt.lm_loss` casts the logits
before the cross-entropy, outside the autocast region.

The autocast wraps the *root* module's ``forward`` on the instance (as recompute wraps the
blocks'), so every caller is covered without code paths of its own: DDP and FSDP2 (which call
the module), pipeline stages (the schedule calls the stage module) and evaluation; parameter
names do not change.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

MODES = ("auto", "fp32", "bf16")


def resolve(mode: str, device: torch.device) -> str:
    """The effective precision (``fp32`` or ``bf16``) of ``mode`` on ``device``."""
    if mode not in MODES:
        raise ValueError(f"train.precision {mode!r}: choose one of {MODES}")
    if mode == "auto":
        return "fp32" if device.type == "cpu" else "bf16"
    return mode


def apply_autocast(model: nn.Module, mode: str, device: torch.device) -> str:
    """Run ``model``'s forward under bf16 autocast when ``mode`` resolves to bf16; returns the resolved mode."""
    eff = resolve(mode, device)
    if eff == "fp32":
        return eff
    forward = model.forward

    @functools.wraps(forward)
    def run(*args: object, **kw: object) -> torch.Tensor:
        with torch.autocast(device_type=device.type, dtype=torch.bfloat16):
            return forward(*args, **kw)

    model.forward = run  # type: ignore[method-assign]
    return eff
