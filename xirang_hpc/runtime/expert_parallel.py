"""Expert parallelism (``parallel.ep``): each rank holds E/ep experts of every mixture-of-experts block.

The expert-parallel ranks are data-parallel ranks re-cut (:func:`~xirang_hpc.runtime.parallel_dims.expert_mesh`,
torchtitan's rule ``dp_shard * cp * tp == efsdp * ep`` with the experts whole over tp and no cp with ep; each tp
position (and pipeline stage) has expert groups of its own): blocks of ``ep`` consecutive dp ranks exchange
tokens, and the ``dp / ep`` ranks at the same position of each block (``edp``) hold the same experts: as
replicas under DDP, as FSDP2 shards of them under FSDP2 (``efsdp``: all of edp), and under HSDP as FSDP2 shards
over the dp_shard/ep blocks of each replicate group, replicated over the ``dp_replicate`` groups.

- The stacked expert weights ``w1``/``w3``/``w2`` (E, ...) become DTensors sharded on the expert dim over the
  ``ep`` mesh (``Shard(0)``), on the meta device before materialising, so each rank allocates and initialises
  only its experts (the layout-independent init gives them the values one process would) and the checkpoint
  (DCP) sees their global placement: it loads under any other ``ep``, or none.
- The router, the attention and every dense weight stay data-parallel over all dp ranks (DDP or FSDP2, which
  are told to leave the expert weights alone); tokens are routed where they are, dispatched to their experts
  by all-to-all and combined back (``MoE._dispatch_and_combine``, models/moe.py).
- efsdp (torchtitan's name): where FSDP2 shards the dense weights (ZeRO-2/3, HSDP) and ``efsdp > 1``,
  :func:`apply_expert_fsdp` gives each MoE block's experts a ``fully_shard`` of their own on the ``efsdp``
  mesh (HSDP: the 2-D ``("erep", "efsdp")`` mesh): a rank then stores E/(ep*efsdp) experts' weights,
  gradients and AdamW state (E/dp without replicate groups; a DTensor on the ``("efsdp", "ep")`` or
  ``("erep", "efsdp", "ep")`` mesh, still the global (E, ...) tensor to the checkpoint) and gathers its E/ep
  experts over ``efsdp`` for the forward and backward.
- An expert weight's gradient after the backward already sums the contributions of every token of its ep
  group (the all-to-all's backward brought them); :meth:`ExpertParallel.reduce_grads` sums it over the
  ``edp`` ranks and divides by dp, which is the data-parallel mean the dense weights get. Under efsdp FSDP2's
  reduce-scatter over ``efsdp`` (and all-reduce over ``erep``) does the same: it sums and divides by dp (its
  divide factor), not by ``edp``.
- The load-balancing statistics are summed over all dp ranks (``GPT.moe_group``), so the auxiliary loss and
  the expert-bias update are the whole batch's, as in one process; this holds without ep too, and under
  context parallelism (``parallel.cp``, with ep=1), where the group is dp x cp: each cp rank routes the tokens
  of its sequence shard (routing is per token), and the shards' counts add up to the rows'.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Shard

from xirang_hpc.models.moe import MoE
from xirang_hpc.runtime.parallel_dims import ParallelDims, dp_cp_mesh, expert_mesh

EXPERT_WEIGHTS = ("w1", "w2", "w3")
# Per-rank observations of a MoE block, never synchronised by data parallelism (DDP would broadcast rank 0's).
LOCAL_BUFFERS = ("tokens_per_expert", "load_since_update")


@dataclass
class ExpertParallel:
    """The expert groups of one rank and the expert weights it holds (DTensor shards on the ``ep`` mesh)."""

    mesh: DeviceMesh  # ("erep", "efsdp", "ep"): parallel_dims.expert_mesh
    dp: int
    params: list[nn.Parameter]
    # efsdp: FSDP2 also shards the expert weights over ``efsdp`` and reduces their gradients itself.
    sharded: bool = False

    @torch.no_grad()
    def reduce_grads(self) -> None:
        """After the backward (all microbatches): expert gradients summed over ``edp``, divided by dp.

        A rank whose experts got no token still has a zero gradient (the experts ran on zero rows), so
        every rank joins every all-reduce. Nothing to do when FSDP2 shards the experts over ``efsdp``
        (:func:`apply_expert_fsdp`): its reduce-scatter (and all-reduce over ``erep``) already summed them
        and divided by dp.
        """
        if self.sharded:
            return
        edp = self.edp()
        for p in self.params:
            if p.grad is None:  # e.g. an evaluation-only forward; keep the collectives aligned
                p.grad = DTensor.from_local(torch.zeros_like(p.to_local()), p.device_mesh, p.placements,
                                            run_check=False)
        grads = [p.grad.to_local() for p in self.params]  # type: ignore[union-attr]
        if edp.size() > 1:  # one message for all experts of all blocks, not one per tensor
            flat = _flatten_dense_tensors(grads)
            dist.all_reduce(flat, group=edp.get_group())
            for g, v in zip(grads, _unflatten_dense_tensors(flat, grads), strict=True):
                g.copy_(v)
        torch._foreach_div_(grads, float(self.dp))

    def edp(self) -> DeviceMesh:
        """The 1-D mesh of the ranks holding the same experts (erep x efsdp flattened; created once, cached)."""
        return self.mesh["erep", "efsdp"]._flatten("edp")


def moe_blocks(model: nn.Module) -> list[MoE]:
    """The MoE feed-forwards of ``model`` (a GPT or a stage of it)."""
    return [m for m in model.modules() if isinstance(m, MoE)]


def apply_expert_parallel(model: nn.Module, mesh: DeviceMesh | None, dims: ParallelDims,
                          per_source: bool = False) -> ExpertParallel | None:
    """Shard the experts over ``dims.ep`` ranks and give the blocks their groups (before materialising).

    Collective when ``mesh`` is set (the expert mesh's groups). Without MoE blocks nothing changes. With
    several dp ranks the model's token statistics group is set whatever ``ep`` is; the returned object
    (``ep > 1`` only) reduces the expert gradients. ``per_source`` (``parallel.ep_bitwise``): the experts run
    each source rank's rows apart (``MoE.ep_per_source``), so that a change of ``ep`` continues bitwise.
    """
    blocks = moe_blocks(model)
    if not blocks or mesh is None:
        return None
    if dims.dp_cp > 1:  # every rank holding part of the batch: its rows (dp), or its rows' sequence shards (cp)
        model.moe_group = dp_cp_mesh(mesh).get_group()  # type: ignore[assignment]
    if dims.ep == 1:
        return None
    emesh = expert_mesh(mesh, dims)
    ep_mesh = emesh["ep"]
    params: list[nn.Parameter] = []
    for m in blocks:
        for name in EXPERT_WEIGHTS:
            full = getattr(m, name)  # (E, ...), meta
            local = full.new_empty((full.shape[0] // dims.ep, *full.shape[1:]))  # (E/ep, ...), meta
            shard = nn.Parameter(DTensor.from_local(local, ep_mesh, [Shard(0)], run_check=False,
                                                    shape=full.shape, stride=full.stride()))
            setattr(m, name, shard)
            params.append(shard)
        m.ep_group, m.ep_size, m.ep_per_source = ep_mesh.get_group(), dims.ep, per_source
    return ExpertParallel(mesh=emesh, dp=dims.dp, params=params)


def shards_over_edp(dims: ParallelDims) -> bool:
    """Whether the expert weights are FSDP2-sharded over ``efsdp`` too (torchtitan's efsdp).

    When FSDP2 shards the dense weights (``dp_shard > 1`` only under FSDP2 and HSDP), ``ep > 1`` divides
    ``dp_shard`` (every expert group inside one shard group) and a shard group has more than one expert group
    (``efsdp = dp_shard / ep > 1``). DDP layouts, and FSDP2 standing in for DDP (tp/pp), keep the experts
    replicated over ``edp`` (:meth:`ExpertParallel.reduce_grads`); HSDP replicates them over its replicate groups.
    """
    return dims.ep > 1 and dims.dp_shard % dims.ep == 0 and dims.dp_shard // dims.ep > 1


def apply_expert_fsdp(model: nn.Module, expert: ExpertParallel, dense_mesh: DeviceMesh,
                      reshard_after_forward: bool, mp_policy: MixedPrecisionPolicy | None = None,
                      last_reshard: bool | None = None) -> None:
    """Shard every MoE block's expert weights over ``efsdp`` with FSDP2 (before the dense ``fully_shard``).

    Each block's ``fully_shard`` on the ``efsdp`` mesh (HSDP: ``("erep", "efsdp")``, replicated over erep)
    manages only its ``w1``/``w2``/``w3``: the router and the shared expert get ``fully_shard`` groups of their
    own over ``dense_mesh`` first (FSDP2 leaves a module that already has one to it), so they stay sharded as the
    dense weights. The expert weights are DTensors ``Shard(0)`` on ``ep`` (:func:`apply_expert_parallel`);
    FSDP2 shards each rank's E/ep experts again on dim 0 over ``efsdp``, so a rank holds E/(ep*efsdp) experts'
    elements (a DTensor on the ``("efsdp", "ep")`` mesh, ``(_StridedShard(0), Shard(0))``, with a leading
    ``Replicate()`` on ``erep`` under HSDP), and gathers its E/ep experts for the forward and backward. The
    checkpoint still sees the global (E, ...) placement. When ``efsdp`` does not divide E/ep (fewer experts per
    group than efsdp ranks), dim 0 would leave ranks empty and others a whole expert; as torchtitan does, every
    expert is then split on dim 1 (``Shard(1)``: the ffn rows of ``w1``/``w3``, the d rows of ``w2``) where
    ``efsdp`` divides it, so each rank still holds 1/(ep*efsdp) of the elements.

    Gradients: the all-to-all's backward already summed each expert's contributions over its ep group; the
    reduce-scatter over ``efsdp`` (and the all-reduce over ``erep``) sums them and divides by dp (not by
    ``efsdp``, FSDP2's default), the data-parallel mean the dense weights get. The division runs after a plain
    sum (gloo has no pre-scaled sum).

    ``mp_policy``: the blocks' mixed-precision policy (bf16 gathers, fp32 reduction), for the router, the shared
    expert and the experts alike. ``last_reshard``: ``reshard_after_forward`` for the last layer's units, whose
    backward comes first (``data_parallel.backward_first_reshard``, as :func:`apply_fsdp` treats the last
    block); None: the same as the others.
    """
    mp = {"mp_policy": mp_policy} if mp_policy is not None else {}
    efsdp = expert.mesh["efsdp"]
    shard_mesh = efsdp if expert.mesh["erep"].size() == 1 else expert.mesh["erep", "efsdp"]
    blocks = moe_blocks(model)
    last_layer = {id(x) for x in list(model.layers.values())[-1].modules()}
    for m in blocks:
        reshard = last_reshard if last_reshard is not None and id(m) in last_layer else reshard_after_forward
        for dense in (m.gate, m.shared):  # dense: over every dp rank, as the rest of the block
            if dense is not None:
                fully_shard(dense, mesh=dense_mesh, reshard_after_forward=reshard, **mp)
        local = [getattr(m, name).to_local() for name in EXPERT_WEIGHTS]  # (E/ep, ...) each, meta
        on_dim1 = local[0].shape[0] % efsdp.size() != 0 and all(t.shape[1] % efsdp.size() == 0 for t in local)
        fsdp_experts = fully_shard(m, mesh=shard_mesh, reshard_after_forward=reshard,
                                   shard_placement_fn=(lambda _: Shard(1)) if on_dim1 else None, **mp)
        fsdp_experts.set_gradient_divide_factor(float(expert.dp))
        fsdp_experts.set_force_sum_reduction_for_comms(True)
    # FSDP2 swapped in its own (E/(ep*efsdp), ...) parameters
    expert.params = [getattr(m, name) for m in blocks for name in EXPERT_WEIGHTS]
    expert.sharded = True


def data_parallel_ignored(model: nn.Module) -> tuple[set[nn.Parameter], list[str]]:
    """What DDP/FSDP2 must leave alone: the expert-parallel weights, and (names) the per-rank MoE buffers."""
    experts = {id(getattr(m, name)): getattr(m, name) for m in moe_blocks(model) for name in EXPERT_WEIGHTS}
    params = {p for i, p in experts.items() if isinstance(p, DTensor)}
    names = [n for n, p in model.named_parameters() if id(p) in experts and isinstance(p, DTensor)]
    names += [n for n, _ in model.named_buffers() if n.rsplit(".", 1)[-1] in LOCAL_BUFFERS]
    return params, names
