"""Pipeline parallelism with ``torch.distributed.pipelining``: layer split, stage, schedule.

The model is split by layer into ``pp`` contiguous stages. The split minimises the slowest
stage's cost, counting the embedding on the first stage and the final norm + head on the last
(per-token forward FLOPs: a block is 2*(4h^2 + k*h*f) + 4*s*h with k = 2 or 3 MLP matrices;
the head 2*h*V; the embedding lookup h). A stage keeps its blocks under their original keys
(``layers.5`` stays ``layers.5``), so parameter names match the full model.

Schedules: GPipe (all forwards, then all backwards) and 1F1B; the bubble is (p-1)/m for m
microbatches (Narayanan et al. SC21). Gradients are averaged over microbatches by the schedule
(``scale_grads``), so the loss function is the per-microbatch mean.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

from xirang_hpc.config.schema import ModelConfig
from xirang_hpc.models.gpt import lm_loss

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}


def layer_costs(cfg: ModelConfig) -> tuple[float, list[float], float]:
    """(embedding cost, per-block costs, norm+head cost) in forward FLOPs per token."""
    h, f, s, v = cfg.d_model, cfg.ffn_dim, cfg.seq_len, cfg.vocab_size
    mats = 3 if cfg.mlp == "swiglu" else 2
    block = 2.0 * (4 * h * h + mats * h * f) + 4.0 * s * h
    return float(h), [block] * cfg.n_layer, 2.0 * h * v + 5.0 * h


def split_layers(n_stages: int, emb: float, blocks: list[float], head: float) -> list[range]:
    """Contiguous block ranges, one per stage, minimising the maximum stage cost.

    Every stage gets at least one block. Exact dynamic programme (L*p^2 is tiny).
    """
    n = len(blocks)
    if not 1 <= n_stages <= n:
        raise ValueError(f"cannot split {n} layers into {n_stages} pipeline stages (need 1 <= pp <= {n})")
    prefix = [0.0]
    for c in blocks:
        prefix.append(prefix[-1] + c)

    def cost(stage: int, i: int, j: int) -> float:
        c = prefix[j] - prefix[i]
        return c + (emb if stage == 0 else 0.0) + (head if stage == n_stages - 1 else 0.0)

    inf = float("inf")
    # best[k][j]: minimal max-cost splitting the first j blocks into k stages; cut[k][j]: start of stage k-1.
    best = [[inf] * (n + 1) for _ in range(n_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(n_stages + 1)]
    best[0][0] = 0.0
    for k in range(1, n_stages + 1):
        for j in range(k, n - (n_stages - k) + 1):
            for i in range(k - 1, j):
                c = max(best[k - 1][i], cost(k - 1, i, j))
                if c < best[k][j]:
                    best[k][j], cut[k][j] = c, i
    bounds, j = [], n
    for k in range(n_stages, 0, -1):
        i = cut[k][j]
        bounds.append(range(i, j))
        j = i
    return bounds[::-1]


def stage_ranges(cfg: ModelConfig, pp: int) -> list[range]:
    """The block range each of ``pp`` stages owns for model ``cfg``."""
    emb, blocks, head = layer_costs(cfg)
    return split_layers(pp, emb, blocks, head)


def carve_stage(model: nn.Module, stage: int, ranges: list[range]) -> None:
    """Delete the blocks, embedding and head that ``stage`` does not own (in place)."""
    own = {str(i) for i in ranges[stage]}
    for key in list(model.layers.keys()):
        if key not in own:
            del model.layers[key]
    if stage != 0:
        model.tok_emb = None
        model.pos_emb = None
    if stage != len(ranges) - 1:
        model.norm = None
        model.head = None


def build_schedule(module: nn.Module, stage: int, n_stages: int, pp_mesh: DeviceMesh, n_microbatches: int,
                   schedule: str, device: torch.device) -> tuple[PipelineStage, object]:
    """The pipelining stage for ``module`` and its schedule (loss = per-microbatch mean)."""
    if schedule not in SCHEDULES:
        raise ValueError(f"pipeline schedule {schedule!r}: choose one of {sorted(SCHEDULES)}")
    pstage = PipelineStage(module, stage, n_stages, device, group=pp_mesh.get_group())
    return pstage, SCHEDULES[schedule](pstage, n_microbatches=n_microbatches, loss_fn=lm_loss, scale_grads=True)
