"""Activation recomputation per transformer block: none, selective or full.

- ``full``: each block's forward runs under non-reentrant ``torch.utils.checkpoint``; only
  the block input is kept, everything inside is recomputed in backward (Korthikanti et al.
  2022: ~2*s*b*h bytes per layer instead of s*b*h*(34 + 5*a*s/h)).
- ``selective``: the block is checkpointed with a policy that keeps the outputs of the
  matmuls and attention (expensive to recompute) and recomputes the cheap elementwise ops
  (norms, activations, residual adds), as torchtitan's op-level selective checkpointing.

The block's ``forward`` is replaced on the instance, not wrapped in a new module, so parameter
names (FQNs) are unchanged and checkpoints stay layout-independent.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

MODES = ("none", "selective", "full")

_SAVE_OPS = {
    torch.ops.aten.mm.default,
    torch.ops.aten.addmm.default,
    torch.ops.aten.bmm.default,
    torch.ops.aten.linear.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
}


def _policy(ctx: object, op: object, *args: object, **kwargs: object) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in _SAVE_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def _selective_context() -> tuple[object, object]:
    return create_selective_checkpoint_contexts(_policy)


def _checkpointed(forward: Callable[..., torch.Tensor], selective: bool) -> Callable[..., torch.Tensor]:
    kwargs = {"context_fn": _selective_context} if selective else {}

    @functools.wraps(forward)
    def run(*args: object, **kw: object) -> torch.Tensor:
        return checkpoint(forward, *args, use_reentrant=False, **kw, **kwargs)

    return run


def apply_recompute(model: nn.Module, mode: str) -> int:
    """Checkpoint every block of ``model`` (a GPT or a pipeline stage); returns how many."""
    if mode not in MODES:
        raise ValueError(f"recompute mode {mode!r}: choose one of {MODES}")
    if mode == "none":
        return 0
    blocks = list(model.layers.values())
    for block in blocks:
        block.forward = _checkpointed(block.forward, mode == "selective")  # type: ignore[method-assign]
    return len(blocks)
