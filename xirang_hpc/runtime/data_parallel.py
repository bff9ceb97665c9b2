"""Data parallelism: DDP, or FSDP2 ``fully_shard`` (HSDP on a 2-D replicate x shard mesh).

- ``ddp``: ``DistributedDataParallel`` over the flattened ``dp`` sub-mesh. On a sliced mesh
  DDP first converts tensor-parallel DTensor parameters to their local shards, so dp x tp works.
- ``fsdp``: FSDP2 per block, then the root. Parameters, gradients and optimizer state are
  sharded over ``dp_shard`` (ZeRO-3); with ``dp_replicate > 1`` the mesh is 2-D and FSDP2 runs
  HSDP: shard inside a group, all-reduce between groups. Parameter names do not change
  (``fully_shard`` swaps the module class in place; it does not wrap).

ZeRO stages (``parallel.zero``): 0 replicates everything; 1 shards the optimizer state over dp
(``ZeroRedundancyOptimizer`` under DDP; :class:`DpShardedOptimizer` where FSDP2 replicates for
tp > 1 or pp > 1, whose parameters are DTensors); 2 is FSDP2 with ``reshard_after_forward=False``
(weights gathered once per forward and kept for the backward, gradients reduce-scattered to shards
in every microbatch); 3 is FSDP2 resharding after the forward too.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel as DDP

from xirang_hpc.config.errors import ConfigError
from xirang_hpc.config.schema import CommConfig, TrainConfig
from xirang_hpc.runtime.parallel_dims import ParallelDims, dp_cp_mesh, dp_shard_cp_mesh


def fsdp_mesh(mesh: DeviceMesh, dims: ParallelDims) -> DeviceMesh:
    """FSDP2's mesh for the dense weights: ``dp_shard`` (x cp), 2-D with ``dp_replicate`` first under HSDP."""
    if dims.cp > 1:  # each cp rank holds a shard too (the gradients are reduced over dp x cp: cp saw parts of rows)
        shard_cp = dp_shard_cp_mesh(mesh)
        return mesh["dp_replicate", "dp_shard_cp"] if dims.dp_replicate > 1 else shard_cp
    return mesh["dp_replicate", "dp_shard"] if dims.dp_replicate > 1 else mesh["dp_shard"]


def block_precision(precision: str) -> MixedPrecisionPolicy | None:
    """FSDP2's mixed-precision policy for the blocks of a run whose forward runs in ``precision`` (resolved).

    Under bf16 (and fp8) the blocks' weights are gathered in bf16 and their gradients reduced in fp32, as
    torchtitan does: half the bytes of each all-gather, and, above all, no bf16 copy of a whole gathered weight
    kept for the backward. Under autocast alone the gathered weights stay fp32 and every matmul casts its weight
    to bf16; autograd keeps that copy until the backward, outside FSDP2's reach, so a ZeRO-3 rank would hold
    all the blocks' weights, unsharded, between its forward and its backward. The bf16 values the matmuls see
    are the same (the same rounding of the same fp32 weights); the norms' weights are rounded to bf16 too.
    Block inputs keep their dtype (``cast_forward_inputs=False``): the residual stream stays fp32, as under
    autocast. ``None`` under fp32.
    """
    if precision == "fp32":
        return None
    return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, cast_forward_inputs=False)


def backward_first_reshard(reshard_after_forward: bool, dims: ParallelDims) -> bool:
    """``reshard_after_forward`` for the units the backward starts with (the last block, the roots): kept
    gathered (False), but under a pipeline, whose forwards of several microbatches run before their backwards
    (see :func:`apply_fsdp`)."""
    return reshard_after_forward and dims.pp > 1


def apply_fsdp(model: nn.Module, mesh: DeviceMesh, dims: ParallelDims, reshard_after_forward: bool = True,
               roots: list[nn.Module] | None = None, ignored: set[nn.Parameter] | None = None,
               mp_policy: MixedPrecisionPolicy | None = None) -> None:
    """Shard ``model`` (GPT or stage) with FSDP2 over the dp dimensions of ``mesh``, in place.

    ``roots``: the modules whose forward is called (default ``[model]``). Interleaved pipelines pass
    their stage chunks, each of which then owns (and unshards) the embedding/head it runs.
    ``ignored``: parameters FSDP2 must not manage (expert-parallel shards, reduced by their own groups).

    ``reshard_after_forward`` (ZeRO-3) applies to the blocks but the last. A root's weights (embedding, final
    norm, head) are gathered again as soon as the backward starts (the head's gradient comes first), and kept
    until its end (the embedding's comes last), so resharding them after the forward would save no memory and
    cost one more all-gather of them per microbatch (at a 128k vocabulary about an eighth of an 8B model's
    weights): a root keeps them gathered from forward to backward, as FSDP2 does by default. The last block
    likewise: its backward comes right after the head's, so it keeps its weights too (as torchtitan does; one
    block's gathered weights while the head and the loss run, within the planner's one block plus the
    prefetched one), one all-gather fewer per microbatch. Under a pipeline neither does: there the forwards
    of several microbatches run before their backwards.

    ``mp_policy`` (:func:`block_precision`) applies to the blocks; the roots keep fp32 weights (the embedding's
    output starts the fp32 residual stream; the head's matmul runs under autocast).
    """
    dp_mesh = fsdp_mesh(mesh, dims)
    kw = {"ignored_params": ignored} if ignored else {}
    mp = {"mp_policy": mp_policy} if mp_policy is not None else {}
    first = backward_first_reshard(reshard_after_forward, dims)
    blocks = list(model.layers.values())
    for i, block in enumerate(blocks):
        reshard = first if i == len(blocks) - 1 else reshard_after_forward
        fully_shard(block, mesh=dp_mesh, reshard_after_forward=reshard, **kw, **mp)
    for root in roots or [model]:
        fully_shard(root, mesh=dp_mesh, reshard_after_forward=first, **kw)


def ddp_bucket_cap_mb(comm: CommConfig) -> float:
    """DDP's bucket cap from ``comm.bucket``: the size itself; for ``auto`` the smallest candidate.

    The hierarchical hook (xirang_hpc/runtime/comm) coalesces DDP's buckets into messages of the
    chosen size, so with small buckets every auto-tune candidate is reachable without losing overlap.
    """
    if str(comm.bucket) == "auto":
        return min(comm.auto_candidates_mb) if comm.hierarchical else 25.0
    return float(comm.bucket)


def ddp_ignore(model: nn.Module, names: list[str]) -> None:
    """Mark the parameters and buffers ``names`` (their names in ``model``) for a DDP wrapped around ``model``
    after this call to leave alone: neither broadcast from rank 0 when it is built (nor, buffers, before each
    forward) nor all-reduced in the backward. Each rank keeps its own values and gradients.

    torch has no public API for this. DDP's constructor reads the module attribute
    ``_ddp_params_and_buffers_to_ignore``, which the private ``_set_params_and_buffers_to_ignore_for_model``
    sets, together with the ``_ddp_ignored`` flag on each tensor that torch's DDP-aware code (the reducer's
    parameter lists, Dynamo's DDP optimizer, comm hooks) checks; setting the attribute alone would miss the
    flags. The public ``delay_all_reduce_named_params`` argument still all-reduces what it names (after the
    backward), so it is no substitute. The one private call is kept here so that it changes in one place.
    """
    DDP._set_params_and_buffers_to_ignore_for_model(model, names)


def apply_ddp(model: nn.Module, mesh: DeviceMesh, bucket_cap_mb: float = 25.0, ignore: list[str] | None = None) -> DDP:
    """Wrap ``model`` in DDP over the flattened dp sub-mesh (dp x cp with context parallelism; buckets of
    ``bucket_cap_mb`` MB).

    DDP given a *sliced* ``device_mesh`` applies torch's DP x TP workaround
    (``_pre_dp_module_transform``): forward hooks that walk every parameter twice per forward to
    swap DTensors in and out. Without tensor-parallel parameters that is pure overhead (~6% of a
    small model's step here), so DDP then gets the dp mesh's process group instead.
    ``ignore``: parameter and buffer names DDP neither reduces nor broadcasts (expert-parallel shards,
    per-rank MoE counters).

    ``gradient_as_bucket_view``: each gradient is a view into its all-reduce bucket, so the gradients are held
    once (DDP otherwise keeps every bucket beside the ``.grad`` tensors: a second copy of all the gradients,
    which the planner's memory model, two buckets in flight, does not count). Same all-reduces, same values.
    """
    dp = dp_cp_mesh(mesh)
    skip = set(ignore or ())
    if skip:
        ddp_ignore(model, sorted(skip))
    if any(isinstance(p, DTensor) for n, p in model.named_parameters() if n not in skip):
        return DDP(model, device_mesh=dp, bucket_cap_mb=bucket_cap_mb, gradient_as_bucket_view=True)
    return DDP(model, process_group=dp.get_group(), bucket_cap_mb=bucket_cap_mb, gradient_as_bucket_view=True)


def param_groups(model: nn.Module, t: TrainConfig) -> list[dict[str, object]]:
    """Weight decay on matrices only (not norms, biases)."""
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    return [{"params": decay, "weight_decay": t.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def split_dtensor_groups(groups: list[dict[str, object]]) -> list[dict[str, object]]:
    """Each group as two (same hyperparameters): its DTensor parameters, then its plain ones; empty ones dropped.

    Tensor parallelism leaves some parameters plain (norms, embeddings); a foreach or fused AdamW call over one
    group hands all of its tensors to one operator, which DTensor refuses when they are mixed. Groups without
    a mix are kept as they are. Adam is elementwise, so the update is the same. Every group carries
    ``origin_group`` (the index of the group it came from) for a checkpoint restore.
    """
    out: list[dict[str, object]] = []
    for i, g in enumerate(groups):
        params = list(g["params"])  # type: ignore[call-overload]
        dt = [p for p in params if isinstance(p, DTensor)]
        plain = [p for p in params if not isinstance(p, DTensor)]
        parts = [dt, plain] if dt and plain else [params]
        # origin_group: a checkpoint restore matches groups through it (checkpoint/state.py)
        out += [{**g, "params": part, "origin_group": i} for part in parts]
    return out


def _local(p: torch.Tensor) -> torch.Tensor:
    """The tensor this rank stores for ``p`` (its DTensor shard), aliasing the parameter's storage."""
    with torch.no_grad():
        return p.to_local() if isinstance(p, DTensor) else p.data


def partition(sizes: list[int], ranks: int) -> list[int]:
    """Owner rank of each tensor: largest first, each to the least-loaded rank (ties: lower index).

    Deterministic from the sizes alone, so every rank of a dp group computes the same partition.
    """
    load, owner = [0] * ranks, [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        r = min(range(ranks), key=lambda r: (load[r], r))
        owner[i], load[r] = r, load[r] + sizes[i]
    return owner


class DpShardedOptimizer:
    """ZeRO-1 over a data-parallel group whose ranks hold replicated (possibly DTensor) parameters.

    Each parameter tensor is owned by one dp rank (:func:`partition`); only the owner keeps AdamW
    state for it and updates it, then every owner broadcasts its updated tensors to the group,
    coalesced into one message per owner. The gradients are the replicated, already clipped ones,
    and Adam is elementwise, so the update is bitwise the one a replicated optimizer would make.
    Works on the local shards of tensor-parallel DTensors (each tp rank's dp group shares a shard),
    which ``ZeroRedundancyOptimizer`` cannot. Interface as the checkpoint expects of ZeRO-1:
    ``param_groups`` (every parameter; the trainer sets ``lr`` there) and ``optim`` (the local AdamW).
    """

    def __init__(self, groups: list[dict[str, object]], group: dist.ProcessGroup, **adamw: object) -> None:
        self.group, self.ranks, self.me = group, dist.get_world_size(group), dist.get_rank(group)
        self.params: list[nn.Parameter] = [p for g in groups for p in g["params"]]  # type: ignore[attr-defined]
        self.owner = partition([_local(p).numel() for p in self.params], self.ranks)
        mine = {id(p) for p, r in zip(self.params, self.owner) if r == self.me}
        self.param_groups = [dict(g) for g in groups]
        # Every group is kept (possibly empty) so hyperparameters line up with param_groups.
        local = [{**g, "params": [p for p in g["params"] if id(p) in mine]} for g in groups]  # type: ignore[attr-defined]
        self.optim = torch.optim.AdamW(local, **adamw)  # type: ignore[arg-type]

    @property
    def state(self) -> dict[torch.Tensor, dict[str, torch.Tensor]]:
        """AdamW state of the parameters this rank owns."""
        return self.optim.state  # type: ignore[return-value]

    @torch.no_grad()
    def step(self) -> None:
        """Update the owned parameters, then share every owner's updated tensors with the group."""
        for g, lg in zip(self.param_groups, self.optim.param_groups):
            lg.update({k: v for k, v in g.items() if k != "params"})
        self.optim.step()
        for r in range(self.ranks):
            tensors = [_local(p) for p, o in zip(self.params, self.owner) if o == r]
            if not tensors:
                continue
            flat = _flatten_dense_tensors(tensors)  # one message per owner, not one per tensor
            dist.broadcast(flat, group=self.group, group_src=r)
            if r != self.me:
                for t, v in zip(tensors, _unflatten_dense_tensors(flat, tensors)):
                    t.copy_(v)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop (or zero) every parameter's gradient, owned or not."""
        for p in self.params:
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()


def adamw_impl(impl: str, device_type: str) -> dict[str, bool]:
    """AdamW's keyword arguments for ``train.optimizer_impl`` on ``device_type``.

    ``auto``: none (torch's own choice: foreach on accelerators, the per-tensor loop on the CPU);
    ``foreach``: ``foreach=True``; ``fused``: ``fused=True``, refused by name on a device type for which
    this torch build has no fused kernel.
    """
    from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

    if impl == "auto":
        return {}
    if impl == "foreach":
        return {"foreach": True}
    if impl == "fused":
        supported = _get_fused_kernels_supported_devices()
        if device_type not in supported:
            raise ConfigError("train.optimizer_impl", impl,
                              f"this torch build has no fused AdamW for device {device_type} (it has one for "
                              f"{', '.join(supported)}); use train.optimizer_impl=foreach or auto")
        return {"fused": True}
    raise ConfigError("train.optimizer_impl", impl, "choose one of auto, foreach, fused")


def build_optimizer(model: nn.Module, t: TrainConfig, zero_mesh: DeviceMesh | None = None,
                    replicated_dtensors: bool = False, device_type: str | None = None) -> torch.optim.Optimizer:
    """AdamW; with ``zero_mesh`` its state is sharded over that (dp) mesh (ZeRO-1).

    ``replicated_dtensors``: the parameters are FSDP2-replicated DTensors (tp > 1 or pp > 1), sharded
    by :class:`DpShardedOptimizer`; otherwise (DDP) by ``ZeroRedundancyOptimizer``. ``device_type``: where
    the parameters live (default: the first parameter's), for ``train.optimizer_impl``.
    """
    if device_type is None:
        device_type = next((p.device.type for p in model.parameters()), "cpu")
    impl = adamw_impl(t.optimizer_impl, device_type)
    kw = {"lr": t.lr, "betas": (t.beta1, t.beta2), **impl}
    groups = param_groups(model, t)
    if impl:  # one multi-tensor kernel takes all of a group's tensors: DTensors and plain ones may not mix there
        groups = split_dtensor_groups(groups)
    if zero_mesh is not None and replicated_dtensors:
        return DpShardedOptimizer(groups, zero_mesh.get_group(), **kw)  # type: ignore[return-value]
    if zero_mesh is not None:
        # Imported here: torch.distributed.optim scripts its functional optimizers with TorchScript when
        # imported, CPU every rank would spend at start-up for ZeRO-1 under DDP alone.
        from torch.distributed.optim import ZeroRedundancyOptimizer

        opt = ZeroRedundancyOptimizer(groups[0]["params"], optimizer_class=torch.optim.AdamW,
                                      process_group=zero_mesh.get_group(), weight_decay=t.weight_decay, **kw)
        for g in groups[1:]:
            opt.add_param_group(g)
        return opt
    return torch.optim.AdamW(groups, **kw)
