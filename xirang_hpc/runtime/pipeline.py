"""Pipeline parallelism with ``torch.distributed.pipelining``: layer split, stage, schedule.

The model is split by layer into ``pp`` contiguous stages. The split minimises the slowest
stage's cost, counting the embedding on the first stage and the final norm + head on the last
(per-token forward FLOPs: a block is 2*(2h^2 + 2h*kv + k*h*f) + 4*s*h with kv the key/value width
under grouped-query attention and k = 2 or 3 MLP matrices;
the head 2*h*V; the embedding lookup h). A stage keeps its blocks under their original keys
(``layers.5`` stays ``layers.5``), so parameter names match the full model.

Schedules: GPipe (all forwards, then all backwards) and 1F1B; the bubble is (p-1)/m for m
microbatches (Narayanan et al. SC21). Gradients are averaged over microbatches by the schedule
(``scale_grads``), so the loss function is the per-microbatch mean.

Interleaved 1F1B (Narayanan et al. SC21, section 2.2; bubble (p-1)/(v*m)): the model is split
into ``p*v`` stages and rank r holds the v stages r, r+p, ..., r+(v-1)p ("loop" placement, as
torch's ``ScheduleInterleaved1F1B`` expects). The rank keeps one GPT with the union of its
blocks (full names) and runs each stage through a :class:`StageChunk` view that shares the
modules. The first rank still holds the embedding and the last rank the head.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from xirang_hpc.config.schema import ModelConfig
from xirang_hpc.models.gpt import GPT, lm_loss
from xirang_hpc.models.moe import MoE
from xirang_hpc.runtime import liveness

# Schedule names -> torch.distributed.pipelining's classes, imported when a pipeline is built: the
# package costs every rank ~0.5 s of CPU at start-up, which a job without pipeline parallelism never needs.
SCHEDULES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B"}
MULTI_SCHEDULES = {"interleaved": "ScheduleInterleaved1F1B"}


def layer_costs(cfg: ModelConfig) -> tuple[float, list[float], float]:
    """(embedding cost, per-block costs, norm+head cost) in forward FLOPs per token."""
    h, f, s, v = cfg.d_model, cfg.ffn_dim, cfg.seq_len, cfg.vocab_size
    kv, q = cfg.n_kv_head * cfg.head_dim, cfg.n_head * cfg.head_dim  # q = h unless d_head is decoupled
    mats = 3 if cfg.mlp == "swiglu" else 2
    block = 2.0 * (2 * h * q + 2 * h * kv + mats * h * f) + 4.0 * s * q
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


def rank_stages(pp_rank: int, pp: int, chunks_per_rank: int = 1) -> list[int]:
    """The stage indices rank ``pp_rank`` holds: r, r+pp, ... (``chunks_per_rank`` of them, loop placement)."""
    return [pp_rank + k * pp for k in range(chunks_per_rank)]


def carve_stage(model: nn.Module, stage: int | list[int], ranges: list[range]) -> None:
    """Delete the blocks, embedding and head that ``stage`` (or all of a list of stages) does not own (in place)."""
    stages = [stage] if isinstance(stage, int) else list(stage)
    own = {str(i) for s in stages for i in ranges[s]}
    for key in list(model.layers.keys()):
        if key not in own:
            del model.layers[key]
    if 0 not in stages:
        model.tok_emb = None
        model.pos_emb = None
    if len(ranges) - 1 not in stages:
        model.norm = None
        model.head = None


class StageChunk(nn.Module):
    """One virtual stage of a rank's (carved) GPT: shares its modules, runs ``GPT.forward`` on them."""

    def __init__(self, model: nn.Module, blocks: range, first: bool, last: bool) -> None:
        super().__init__()
        self.cfg = model.cfg
        self.tok_emb = model.tok_emb if first else None
        self.pos_emb = model.pos_emb if first else None
        self.layers = nn.ModuleDict({str(i): model.layers[str(i)] for i in blocks})
        self.norm = model.norm if last else None
        self.head = model.head if last else None
        self.loss_chunk = model.loss_chunk
        self.loss_fn, self.loss_kernel = model.loss_fn, model.loss_kernel  # plain or compiled (train.compile)
        self.loss_norm = model.loss_norm  # the same object: the trainer sets its denominator per step
        self.seq_shards = None  # context parallelism does not run with pipeline stages (refused at validation)
        if model.cfg.pos == "rope":
            self.register_buffer("rope_cos", model.rope_cos, persistent=False)
            self.register_buffer("rope_sin", model.rope_sin, persistent=False)

    forward = GPT.forward


def stage_chunks(model: nn.Module, stages: list[int], ranges: list[range]) -> list[StageChunk]:
    """One :class:`StageChunk` per stage in ``stages`` over the rank's carved ``model``."""
    return [StageChunk(model, ranges[s], s == 0, s == len(ranges) - 1) for s in stages]


def _loss_is_output(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The last stage computed the loss itself (chunked head + loss, given the targets as a kwarg): (1,) -> ()."""
    return output.squeeze(0)


def _metadata_stage(pipelining: object) -> type:
    """``PipelineStage`` whose metadata inference leaves the MoE token counts alone.

    Before its first step a stage runs its module once to learn the shapes it sends (on the first
    microbatch, or on placeholder activations, with grad when a backward follows): that forward's
    expert assignments are no training tokens, so the expert-bias loads must not count them.
    """
    base = pipelining.PipelineStage  # type: ignore[attr-defined]

    class Stage(base):  # type: ignore[misc, valid-type]
        def _compute_outputs(self, *args: object, module: nn.Module, **kwargs: object) -> object:
            blocks = [m for m in module.modules() if isinstance(m, MoE)]
            for m in blocks:
                m.counting = False
            try:
                return super()._compute_outputs(*args, module=module, **kwargs)
            finally:
                for m in blocks:
                    m.counting = True

    return Stage


def _mark_stage_waits() -> None:
    """Make the schedules' waits for a stage's sends and receives visible to the watchdog, once per process.

    torch's schedules wait for their point-to-point transfers in ``schedules._wait_batch_p2p``, a call the
    process group's collective counts do not see: a stage blocked there on a slow neighbour (a straggler) would
    look still, and a peer that waits for it in a collective would name it as the hang. Inside this wait it is
    marked as inside a collective (``runtime.liveness``), so it counts as waiting. Where a torch has no such
    function nothing is marked and the rule keeps its plain form.
    """
    from torch.distributed.pipelining import schedules

    wait = getattr(schedules, "_wait_batch_p2p", None)
    if wait is None or getattr(wait, "marks_liveness", False):
        return

    def marked(*args: object, **kwargs: object) -> object:
        with liveness.collective("pipeline stage send/receive"):
            return wait(*args, **kwargs)

    marked.marks_liveness = True  # type: ignore[attr-defined]
    schedules._wait_batch_p2p = marked


def build_schedule(module: nn.Module | list[nn.Module], stage: int | list[int], n_stages: int,
                   pp_mesh: DeviceMesh, n_microbatches: int, schedule: str, device: torch.device,
                   loss_in_stage: bool = False) -> object:
    """The schedule running ``module`` as ``stage`` (loss = per-microbatch mean).

    For ``interleaved``, ``module`` and ``stage`` are lists: this rank's chunks and their stage indices.
    ``loss_in_stage``: the last stage's forward gets ``targets=`` and returns the loss (``train.loss_chunk_tokens``).
    """
    last = module[-1] if isinstance(module, list) else module
    norm = getattr(last, "loss_norm", None)
    fn = getattr(last, "loss_fn", lm_loss)  # compiled under train.compile

    def plain_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return fn(output, target, norm.denom if norm is not None else None)

    loss_fn = _loss_is_output if loss_in_stage else plain_loss
    if schedule not in SCHEDULES and schedule not in MULTI_SCHEDULES:
        raise ValueError(f"pipeline schedule {schedule!r}: choose one of {sorted(SCHEDULES | MULTI_SCHEDULES)}")
    from torch.distributed import pipelining

    group = pp_mesh.get_group()
    _mark_stage_waits()
    stage_cls = _metadata_stage(pipelining)
    if schedule in MULTI_SCHEDULES:
        assert isinstance(module, list) and isinstance(stage, list)
        pstages = [stage_cls(m, s, n_stages, device, group=group) for m, s in zip(module, stage)]
        return getattr(pipelining, MULTI_SCHEDULES[schedule])(pstages, n_microbatches=n_microbatches,
                                                              loss_fn=loss_fn, scale_grads=True)
    pstage = stage_cls(module, stage, n_stages, device, group=group)
    return getattr(pipelining, SCHEDULES[schedule])(pstage, n_microbatches=n_microbatches, loss_fn=loss_fn,
                                                    scale_grads=True)
