"""Data parallelism: DDP, or FSDP2 ``fully_shard`` (HSDP on a 2-D replicate x shard mesh).

- ``ddp``: ``DistributedDataParallel`` over the flattened ``dp`` sub-mesh. On a sliced mesh
  DDP first converts tensor-parallel DTensor parameters to their local shards, so dp x tp works.
  Optional ZeRO-1 (``ZeroRedundancyOptimizer``) shards the optimizer state over dp.
- ``fsdp``: FSDP2 per block, then the root. Parameters, gradients and optimizer state are
  sharded over ``dp_shard`` (ZeRO-3); with ``dp_replicate > 1`` the mesh is 2-D and FSDP2 runs
  HSDP: shard inside a group, all-reduce between groups. Parameter names do not change
  (``fully_shard`` swaps the module class in place; it does not wrap).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel as DDP

from xirang_hpc.config.schema import CommConfig, TrainConfig
from xirang_hpc.runtime.parallel_dims import ParallelDims, dp_mesh


def apply_fsdp(model: nn.Module, mesh: DeviceMesh, dims: ParallelDims, reshard_after_forward: bool = True,
               roots: list[nn.Module] | None = None) -> None:
    """Shard ``model`` (GPT or stage) with FSDP2 over the dp dimensions of ``mesh``, in place.

    ``roots``: the modules whose forward is called (default ``[model]``). Interleaved pipelines pass
    their stage chunks, each of which then owns (and unshards) the embedding/head it runs.
    """
    dp_mesh = mesh["dp_replicate", "dp_shard"] if dims.dp_replicate > 1 else mesh["dp_shard"]
    for block in model.layers.values():
        fully_shard(block, mesh=dp_mesh, reshard_after_forward=reshard_after_forward)
    for root in roots or [model]:
        fully_shard(root, mesh=dp_mesh, reshard_after_forward=reshard_after_forward)


def ddp_bucket_cap_mb(comm: CommConfig) -> float:
    """DDP's bucket cap from ``comm.bucket``: the size itself; for ``auto`` the smallest candidate.

    The hierarchical hook (xirang_hpc/runtime/comm) coalesces DDP's buckets into messages of the
    chosen size, so with small buckets every auto-tune candidate is reachable without losing overlap.
    """
    if str(comm.bucket) == "auto":
        return min(comm.auto_candidates_mb) if comm.hierarchical else 25.0
    return float(comm.bucket)


def apply_ddp(model: nn.Module, mesh: DeviceMesh, bucket_cap_mb: float = 25.0) -> DDP:
    """Wrap ``model`` in DDP over the flattened dp sub-mesh (buckets of ``bucket_cap_mb`` MB).

    DDP given a *sliced* ``device_mesh`` applies torch's DP x TP workaround
    (``_pre_dp_module_transform``): forward hooks that walk every parameter twice per forward to
    swap DTensors in and out. Without tensor-parallel parameters that is pure overhead (~6% of a
    small model's step here), so DDP then gets the dp mesh's process group instead.
    """
    dp = dp_mesh(mesh)
    if any(isinstance(p, DTensor) for p in model.parameters()):
        return DDP(model, device_mesh=dp, bucket_cap_mb=bucket_cap_mb)
    return DDP(model, process_group=dp.get_group(), bucket_cap_mb=bucket_cap_mb)


def param_groups(model: nn.Module, t: TrainConfig) -> list[dict[str, object]]:
    """Weight decay on matrices only (not norms, biases)."""
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    return [{"params": decay, "weight_decay": t.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def build_optimizer(model: nn.Module, t: TrainConfig, zero_mesh: DeviceMesh | None = None) -> torch.optim.Optimizer:
    """AdamW; with ``zero_mesh`` its state is sharded over that (dp) mesh by ZeroRedundancyOptimizer."""
    kw = {"lr": t.lr, "betas": (t.beta1, t.beta2)}
    groups = param_groups(model, t)
    if zero_mesh is not None:
        opt = ZeroRedundancyOptimizer(groups[0]["params"], optimizer_class=torch.optim.AdamW,
                                      process_group=zero_mesh.get_group(), weight_decay=t.weight_decay, **kw)
        opt.add_param_group(groups[1])
        return opt
    return torch.optim.AdamW(groups, **kw)
