"""The next-token loss computed with the output head, a chunk of tokens at a time.

The plain path (``head(h)`` then :func:`xirang_hpc.models.gpt.lm_loss`) holds the whole ``(tokens,
vocab)`` logits, their fp32 copy and, in the backward, a gradient of the same size: at a 128k
vocabulary and 4 x 4,096 tokens that is 8 GiB per copy. Here the head's matmul and the
cross-entropy run on ``chunk`` tokens at a time, and the gradients of the hidden states and of the
head weight are computed in the same pass (as Liger-Kernel's fused linear cross-entropy does), so
no more than one chunk's logits ever exists, forward or backward. The backward only scales the
stored gradients by the incoming one.

The result equals the plain loss up to summation order (a few ulps in fp32); under autocast the
chunk's matmul runs in the autocast dtype and the softmax in fp32, as in the plain path.

Masked targets (chat data: prompt tokens, padding) are :data:`IGNORE_INDEX`; they add nothing to the
loss or the gradients. The loss is then the sum over learned targets divided by a denominator: by
default their count (a mean), or :attr:`LossNorm.denom`, which the trainer sets each step so that
every loss term of every rank divides by the same count of the *global* batch (see
:class:`LossNorm`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

#: A target the loss ignores (torch's cross-entropy default ``ignore_index``).
IGNORE_INDEX = -100

#: :func:`chunk_step`'s signature: the plain function, or what ``torch.compile`` made of it.
ChunkKernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, "torch.Tensor | None", "float | torch.Tensor", bool,
                        bool],
                       "tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]"]


class LossNorm:
    """The denominator of the masked next-token loss, shared by the model, its pipeline views and loss function.

    With masked targets the loss must be the mean over *all learned tokens of the global batch*, not a
    mean of per-microbatch or per-rank means (which would weight a token of a short reply more than a
    token of a long one). Every loss term is ``sum(token losses) / denom`` with ``denom = N / (k * dp)``
    (``N`` learned targets in the global batch, ``k`` loss terms a rank averages: accumulation steps or
    pipeline microbatches, ``dp`` replicas averaged by the gradient reduction): the averages over
    ``k`` and ``dp`` that follow then give exactly ``sum over the global batch / N``, for the loss and
    the gradients. ``denom`` None: the plain mean over the term's own tokens (unmasked pretraining data).
    """

    def __init__(self) -> None:
        self.denom: float | None = None


def _chunk_logits(h: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """(n, C) x (V, C) -> (n, V) fp32 logits of one chunk (the head has no bias)."""
    return F.linear(h, weight).float()


def chunk_step(hc: torch.Tensor, weight: torch.Tensor, tc: torch.Tensor, keep: torch.Tensor | None,
               n: float | torch.Tensor, need_h: bool, need_w: bool
               ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """One chunk of the fused head + loss: (summed loss, d/dh, d/dweight), the gradients already divided by ``n``.

    hc (n_c, C), weight (V, C), tc (n_c,) target ids (masked ones clamped to a valid index), keep (n_c,) bool or
    None. A pure function of its inputs, so ``train.compile`` can hand it to ``torch.compile`` as it is (one
    graph: the matmul, the log-sum-exp, the softmax written over the logits and both gradient matmuls).
    """
    logits = _chunk_logits(hc, weight)  # (n_c, V)
    lse = torch.logsumexp(logits, dim=-1)  # (n_c,)
    per_token = lse - logits.gather(1, tc[:, None]).squeeze(1)  # (n_c,)
    loss = (per_token * keep).sum() if keep is not None else per_token.sum()
    if not (need_h or need_w):
        return loss, None, None
    # d(sum of the chunk's losses)/d logits = softmax - one_hot, written over the logits (no second
    # (n_c, V) buffer); the 1/n of the mean is applied here once.
    g = logits.sub_(lse[:, None]).exp_()  # (n_c, V)
    g[torch.arange(tc.shape[0], device=g.device), tc] -= 1.0
    if keep is not None:
        g.mul_(keep[:, None])  # ignored targets: no gradient
    g.div_(n)
    grad_h = (g.to(weight.dtype) @ weight).to(hc.dtype) if need_h else None  # (n_c, C)
    grad_w = g.t() @ hc.float() if need_w else None  # (V, C) fp32
    return loss, grad_h, grad_w


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    """Mean cross-entropy of ``h @ weight.T`` against ``targets``; gradients computed in the forward."""

    @staticmethod
    def forward(ctx: Any, h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,  # type: ignore[override]
                chunk: int, denom: float | None = None, masked: bool = False,
                kernel: ChunkKernel | None = None) -> torch.Tensor:
        rows = h.shape[0]
        n = rows if denom is None else denom  # what the summed losses are divided by
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        step = kernel or chunk_step
        # A compiled kernel takes the denominator as a 0-d tensor: a Python float would be a constant of its graph,
        # and chat data changes the denominator every step (one recompilation per step).
        n_arg: float | torch.Tensor = (float(n) if kernel is None
                                       else torch.tensor(float(n), dtype=torch.float32, device=h.device))
        grad_h = torch.empty_like(h) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        total = torch.zeros((), dtype=torch.float32, device=h.device)
        for start in range(0, rows, chunk):
            hc, tc = h[start:start + chunk], targets[start:start + chunk]  # (n_c, C), (n_c,)
            keep = tc != IGNORE_INDEX if masked else None  # (n_c,) learned targets
            if keep is not None:
                tc = tc.clamp_min(0)  # an index for gather; its row is zeroed in the step
            loss, gh, gw = step(hc, weight, tc, keep, n_arg, need_h, need_w)
            total += loss
            if gh is not None:
                grad_h[start:start + chunk] = gh  # type: ignore[index]
            if gw is not None:
                grad_w += gw  # type: ignore[operator]
            del gh, gw
        ctx.save_for_backward(*(t for t in (grad_h, grad_w) if t is not None))
        ctx.has = (grad_h is not None, grad_w is not None)
        ctx.weight_dtype = weight.dtype
        return total / n

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        saved = list(ctx.saved_tensors)
        grad_h = saved.pop(0) * grad_out.to(saved[0].dtype) if ctx.has[0] else None
        grad_w = (saved.pop(0) * grad_out).to(ctx.weight_dtype) if ctx.has[1] else None
        return grad_h, grad_w, None, None, None, None, None


def chunked_lm_loss(h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk: int,
                    denom: float | None = None, kernel: ChunkKernel | None = None) -> torch.Tensor:
    """Next-token cross-entropy of ``h @ weight.T``: h (B, T, C), weight (V, C), targets (B, T).

    Equal to ``lm_loss(F.linear(h, weight), targets, denom)`` (values and gradients) without ever holding
    more than ``chunk`` tokens' logits. Targets of :data:`IGNORE_INDEX` are left out; ``denom`` None: the
    mean over the others. ``kernel``: :func:`chunk_step` or a compiled version of it (``train.compile``).
    """
    if chunk <= 0:
        raise ValueError(f"chunked_lm_loss: chunk must be > 0, got {chunk}")
    flat_h = h.reshape(-1, h.shape[-1])  # (B*T, C)
    flat_t = targets.reshape(-1)  # (B*T,)
    masked = bool((flat_t == IGNORE_INDEX).any())
    if denom is None and masked:
        denom = max(int((flat_t != IGNORE_INDEX).sum()), 1)
    if not torch.is_grad_enabled() or not (h.requires_grad or weight.requires_grad):
        with torch.no_grad():  # evaluation: the loss only, chunk by chunk
            total = sum(F.cross_entropy(_chunk_logits(flat_h[s:s + chunk], weight), flat_t[s:s + chunk],
                                        reduction="sum") for s in range(0, flat_h.shape[0], chunk))
            return torch.as_tensor(total, dtype=torch.float32) / (flat_h.shape[0] if denom is None else denom)
    return _ChunkedLinearCrossEntropy.apply(flat_h, weight, flat_t, chunk, denom, masked, kernel)
