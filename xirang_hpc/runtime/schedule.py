"""The learning-rate schedule, shared by the loop, the checkpoint record and the benchmarks."""

from __future__ import annotations

import math

from xirang_hpc.config.schema import TrainConfig


def lr_at(step: int, t: TrainConfig) -> float:
    """Linear warmup to ``t.lr``, then cosine decay to ``t.lr * t.min_lr_ratio`` at max_steps.

    Steps past ``max_steps`` (a run extended with ``train.extend_to``) stay at the final, minimum LR:
    the schedule the run was trained under is not re-stretched, so no LR jump follows the resume.
    """
    warmup = t.warmup  # train.warmup_steps, or train.warmup_frac of max_steps
    if step < warmup:
        return t.lr * (step + 1) / warmup
    span = max(1, t.max_steps - warmup)
    progress = min(1.0, (step - warmup) / span)
    return t.lr * (t.min_lr_ratio + (1 - t.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))
