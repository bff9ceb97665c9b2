"""Compose the layout for one rank: pipeline split -> tensor parallel -> recompute -> compile -> data parallel.

The order matters: a stage first drops the blocks it does not own; tensor parallelism shards the
remaining blocks; recomputation wraps each block's forward; ``train.compile`` compiles each block's
forward over both (torchtitan's order); data parallelism (DDP or FSDP2) goes last and sees the final
(possibly DTensor) parameters, its hooks outside the compiled graphs. ``model`` always keeps the full-model
parameter names (``layers.3.attn.q.weight``), whatever the layout.

Also here: the global operations that must be right across dp, tp and pp together (gradient
norm for clipping, loss averaging), done with one all-reduce of two numbers per step.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate

from xirang_hpc.config.schema import XirangConfig
from xirang_hpc.models.gpt import GPT
from xirang_hpc.models.lora import apply_lora
from xirang_hpc.runtime import pipeline
from xirang_hpc.runtime.compile import apply_compile, probe
from xirang_hpc.runtime.context_parallel import ContextShards, apply_context_parallel
from xirang_hpc.runtime.data_parallel import (
    apply_ddp,
    apply_fsdp,
    backward_first_reshard,
    block_precision,
    build_optimizer,
    ddp_bucket_cap_mb,
    fsdp_mesh,
)
from xirang_hpc.runtime.expert_parallel import (
    ExpertParallel,
    apply_expert_fsdp,
    apply_expert_parallel,
    data_parallel_ignored,
    shards_over_edp,
)
from xirang_hpc.runtime.parallel_dims import Layout, ParallelDims, dp_mesh, mesh_coords
from xirang_hpc.runtime.precision import apply_autocast, apply_float8
from xirang_hpc.runtime.recompute import apply_recompute
from xirang_hpc.runtime.tensor_parallel import apply_tensor_parallel

log = logging.getLogger(__name__)


@dataclass
class ParallelModel:
    """One rank's share of the model and how to run it."""

    dims: ParallelDims
    mesh: DeviceMesh | None
    model: nn.Module  # the GPT (or this stage of it), full-model parameter names
    module: nn.Module  # what forward is called on (DDP wrapper or ``model``)
    data_parallel: str  # none | ddp | fsdp
    zero: int = 0  # ZeRO stage over dp (parallel.zero, resolved)
    coords: dict[str, int] = field(default_factory=dict)
    stage_layers: range = range(0)
    schedule: object | None = None
    n_microbatches: int = 1
    precision: str = "fp32"  # resolved train.precision: fp32 | bf16 (autocast) | fp8 (autocast + float8 linears)
    seq_shards: ContextShards | None = None  # context parallelism: this rank's shard of every row
    expert: ExpertParallel | None = None  # parallel.ep > 1: the expert groups; reduces the expert gradients

    @property
    def is_first_stage(self) -> bool:
        """Holds the embedding (consumes token ids)."""
        return self.coords.get("pp", 0) == 0

    @property
    def is_last_stage(self) -> bool:
        """Holds the head (produces the loss)."""
        return self.coords.get("pp", 0) == self.dims.pp - 1

    @property
    def reports_loss(self) -> bool:
        """One rank per dp replica and cp shard contributes the loss: last stage, tp rank 0."""
        return self.is_last_stage and self.coords.get("tp", 0) == 0


def parallelize(cfg: XirangConfig, layout: Layout, mesh: DeviceMesh | None, *,
                _full_build: bool = False) -> ParallelModel:
    """Build this rank's model for ``layout`` on ``mesh``: on the meta device, then materialise only its share.

    The layout (degrees and choices) comes only from ``layout``; ``cfg`` supplies the model, the
    training settings (seed, precision, accumulation) and DDP's bucket size.

    The whole GPT is built without storage (``torch.device("meta")``), carved to this rank's
    pipeline stage(s), tensor-parallelised and FSDP2-sharded; only then are this rank's parameters
    (or DTensor shards) allocated and initialised from ``train.seed`` with the layout-independent
    init of xirang_hpc/models/init.py, so every layout starts from bitwise the same weights and no
    rank holds more than its share. DDP replicates the materialised model afterwards.

    ``_full_build`` (benchmarks only): the previous way, the full model allocated and initialised
    on every rank before carving and sharding (same values, full-model peak memory).
    """
    p, t, dims = layout.parallel, cfg.train, layout.dims
    coords = mesh_coords(dims, mesh)
    device = layout.device.torch  # the job's one device decision (runtime/device.py)
    if t.compile:  # a node that cannot build kernels is refused here, by name, not mid-step
        probe(device)
    if _full_build:
        model = GPT(cfg.model, seed=t.seed)
    else:
        with torch.device("meta"):
            model = GPT(cfg.model)
    chunks_per_rank = layout.virtual_stages
    ranges = pipeline.stage_ranges(cfg.model, dims.pp * chunks_per_rank)
    stages = pipeline.rank_stages(coords["pp"], dims.pp, chunks_per_rank)
    model.loss_chunk = t.loss_chunk_tokens
    if t.precision == "fp8":  # float8 linears (torchao, rowwise), still on meta; refused where the device has none
        apply_float8(model, layout.device)
    if cfg.finetune.adapters:  # adapters beside the frozen base linears, before any carving or sharding
        apply_lora(model, cfg.finetune.lora)
    if dims.pp > 1:
        pipeline.carve_stage(model, stages, ranges)
    if _full_build:
        model.to(device)
    # Interleaved: one view per virtual stage (sharing the modules); these are what the schedule runs.
    chunks: list[nn.Module] = pipeline.stage_chunks(model, stages, ranges) if chunks_per_rank > 1 else [model]
    if dims.tp > 1:
        for c in chunks:  # per chunk: sequence-parallel scatter/gather sits at each stage's boundary
            apply_tensor_parallel(c, mesh["tp"], p.sequence_parallel)
    # Experts sharded over ep of the dp ranks (still on meta); data parallelism below leaves them alone.
    expert = apply_expert_parallel(model, mesh, dims, per_source=p.ep_bitwise)
    ignored, ignored_names = data_parallel_ignored(model)
    apply_recompute(model, p.recompute)
    if t.compile:  # regional: each block, over its TP plan and recompute wrapper, before FSDP2 wraps it
        apply_compile(model, chunks if chunks_per_rank > 1 else ())
    for c in chunks:
        precision = apply_autocast(c, t.precision, device)  # bf16 autocast around the forward, or nothing
    # Context parallelism: the cp ranks see parts of the same rows, so their gradients are reduced together
    # with dp's (over dp x cp); FSDP2 then shards over dp_shard x cp, as torchtitan does.
    use_fsdp = dims.dp_cp > 1 and (p.data_parallel == "fsdp" or dims.tp > 1 or dims.pp > 1)
    if use_fsdp:
        # DDP cannot hold tensor-parallel DTensors without swapping parameters (which breaks
        # their names), and its reducer rejects the several forwards before a backward that a
        # 1F1B pipeline runs. FSDP2 with a shard degree of 1 is exactly replication (gradient
        # all-reduce over dp), DTensor- and pipeline-aware, so it stands in for DDP there.
        # ZeRO-2 keeps the gathered weights from forward to backward; ZeRO-3 (and replication) reshards.
        if expert is not None and shards_over_edp(dims):  # efsdp: experts sharded over edp too
            apply_expert_fsdp(model, expert, fsdp_mesh(mesh, dims), reshard_after_forward=layout.zero != 2,
                              mp_policy=block_precision(precision),
                              last_reshard=backward_first_reshard(layout.zero != 2, dims))
        apply_fsdp(model, mesh, dims, reshard_after_forward=layout.zero != 2, roots=chunks, ignored=ignored,
                   mp_policy=block_precision(precision))
    if not _full_build:
        model.materialize(device, seed=t.seed)  # this rank's stage/shards only
        for c in chunks:  # stage views hold their own references to the (recomputed) rope tables
            if c is not model and cfg.model.pos == "rope":
                c.rope_cos, c.rope_sin = model.rope_cos, model.rope_sin
    shards = None
    if dims.cp > 1:
        assert mesh is not None
        shards = apply_context_parallel(model, mesh["cp"], cfg.model.seq_len, device)
    kind = "none"
    module: nn.Module = model
    if use_fsdp:
        kind = "fsdp"
    elif dims.dp_cp > 1:
        module = apply_ddp(model, mesh, ddp_bucket_cap_mb(cfg.comm), ignore=ignored_names)
        kind = "ddp"
    pm = ParallelModel(dims=dims, mesh=mesh, model=model, module=module, data_parallel=kind, zero=layout.zero,
                       coords=coords,
                       stage_layers=ranges[stages[0]], precision=precision, seq_shards=shards, expert=expert)
    if dims.pp > 1:
        pm.n_microbatches = p.microbatches * t.grad_accum
        interleaved = chunks_per_rank > 1
        pm.schedule = pipeline.build_schedule(chunks if interleaved else module, stages if interleaved else stages[0],
                                              dims.pp * chunks_per_rank, mesh["pp"], pm.n_microbatches, p.schedule,
                                              device, loss_in_stage=t.loss_chunk_tokens > 0)
    return pm


def make_optimizer(pm: ParallelModel, cfg: XirangConfig, layout: Layout) -> torch.optim.Optimizer:
    """AdamW over this rank's parameters; ZeRO-1 shards its state over dp (under DDP or FSDP2 replication).

    ZeRO-2/3 need nothing here: FSDP2's parameters are dp shards, so AdamW's state already is.
    """
    zero1 = pm.zero == 1 and pm.dims.dp > 1 and pm.dims.dp_shard == 1
    return build_optimizer(pm.model, cfg.train, dp_mesh(pm.mesh) if zero1 else None,
                           replicated_dtensors=pm.data_parallel == "fsdp", device_type=layout.device.type)


def _grad_sq_weighted(params: Iterable[nn.Parameter], replicas: int) -> torch.Tensor:
    """Sum of squared gradient entries held here, each divided by how many ranks hold a copy.

    A gradient chunk is held by ``dp*cp*tp / shards`` ranks of a pipeline stage, where ``shards``
    is the product of the mesh sizes its DTensor is sharded over (1 for a plain tensor).
    Summing the weighted values over the whole world counts every entry exactly once.
    """
    total = torch.zeros((), dtype=torch.float64)
    plain = []
    for prm in params:
        g = prm.grad
        if g is None:
            continue
        if not isinstance(g, DTensor):
            plain.append(g.detach())
            continue
        shards = 1
        if any(pl.is_partial() for pl in g.placements):
            # e.g. sequence-parallel norm weights: pending sums must be reduced before squaring.
            g = g.redistribute(placements=[Replicate() if pl.is_partial() else pl for pl in g.placements])
        for i, pl in enumerate(g.placements):
            # Not ``is_shard()``: FSDP over a TP-sharded dim uses _StridedShard, for which it is False.
            if not (pl.is_replicate() or pl.is_partial()):
                shards *= g.device_mesh.size(i)
        g = g.to_local()
        # Accumulated in float64 inside the reduction: no float64 copy of the whole gradient.
        total += torch.linalg.vector_norm(g.detach(), dtype=torch.float64).pow(2).cpu() * (shards / replicas)
    if plain:  # one fused kernel for the replicated (plain) grads, accumulated in fp64 as the DTensors above
        total += torch.stack(torch._foreach_norm(plain, 2, dtype=torch.float64)).pow(2).sum().cpu() / replicas
    return total


def clip_and_reduce(
    pm: ParallelModel, max_norm: float, local_loss: float, replicated: bool = False, reduce_loss: bool = True
) -> tuple[float, float]:
    """Global gradient norm (clipping every grad to ``max_norm``) and the global mean loss.

    ``local_loss`` is this rank's mean loss over its share of the batch (ignored unless
    :attr:`ParallelModel.reports_loss`; under cp each shard's tokens are as many, so the mean over
    dp x cp is the batch's). One all-reduce over the world carries both numbers.
    When every rank holds the same full gradients (``replicated``: plain DDP) and the caller
    does not need the global loss this step, the norm is computed locally, as
    ``clip_grad_norm_`` does, and no collective runs; the returned loss is then this rank's.
    """
    buf = torch.zeros(2, dtype=torch.float64)
    if replicated and not reduce_loss:
        buf[0] = _grad_sq_weighted(pm.model.parameters(), 1)
        buf[1] = local_loss * pm.dims.dp_cp
    else:
        buf[0] = _grad_sq_weighted(pm.model.parameters(), pm.dims.dp_cp * pm.dims.tp)
        buf[1] = local_loss if pm.reports_loss else 0.0
        if dist.is_initialized() and pm.dims.world_size > 1:
            dist.all_reduce(buf)
    norm = math.sqrt(float(buf[0]))
    # Same arithmetic as torch.nn.utils.clip_grad_norm_ (fp32 coefficient, eps 1e-6, clamp 1).
    coef = torch.clamp(torch.tensor(max_norm, dtype=torch.float32) / (torch.tensor(norm, dtype=torch.float32) + 1e-6),
                       max=1.0)
    if max_norm > 0 and coef < 1.0:
        grads = [prm.grad for prm in pm.model.parameters() if prm.grad is not None]
        plain = [g for g in grads if not isinstance(g, DTensor)]
        if plain:
            torch._foreach_mul_(plain, float(coef))
        for g in grads:
            if isinstance(g, DTensor):
                g.mul_(float(coef))
    return float(buf[1]) / pm.dims.dp_cp, norm


def global_mean(pm: ParallelModel, local_value: float) -> float:
    """Mean over dp replicas (and cp shards) of a value known on the loss-reporting ranks."""
    buf = torch.tensor([local_value if pm.reports_loss else 0.0], dtype=torch.float64)
    if dist.is_initialized() and pm.dims.world_size > 1:
        dist.all_reduce(buf)
    return float(buf[0]) / pm.dims.dp_cp
