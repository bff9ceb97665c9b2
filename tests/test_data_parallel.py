"""DDP over the dp mesh (``runtime/data_parallel.py``) with names to ignore: two real gloo ranks (fork server)."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest
import torch
from ranks import rank_context
from torch import nn

from xirang_hpc.runtime.local_ranks import LocalRanks, RankPlace


class _TwoLinears(nn.Module):
    """``shared`` replicated by DDP; ``local`` and the ``counts`` buffer per rank (as expert shards and MoE
    counters are)."""

    def __init__(self, rank: int) -> None:
        super().__init__()
        torch.manual_seed(rank)  # different values on each rank: a broadcast would show
        self.shared, self.local = nn.Linear(4, 4, bias=False), nn.Linear(4, 1, bias=False)
        self.register_buffer("counts", torch.full((3,), float(rank)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.local(torch.tanh(self.shared(x)))


def _numpy(tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    return {k: v.detach().numpy().copy() for k, v in tensors.items()}


def _ddp_rank(place: RankPlace, queue: Any) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from xirang_hpc.runtime.data_parallel import apply_ddp

    dist.init_process_group("gloo")
    try:
        model = _TwoLinears(place.rank)
        start = _numpy(model.state_dict())
        mesh = init_device_mesh("cpu", (2, 1), mesh_dim_names=("dp_replicate", "dp_shard"))
        ddp = apply_ddp(model, mesh, ignore=["local.weight", "counts"])
        built = {k: v.detach().clone() for k, v in model.state_dict().items()}
        x = torch.randn(8, 4, generator=torch.Generator().manual_seed(10 + place.rank))
        ddp(x).pow(2).sum().backward()
        own = _TwoLinears(place.rank)  # this rank's own gradients of the same weights, without DDP
        own.load_state_dict(built)
        own(x).pow(2).sum().backward()
        # numpy, not tensors: a tensor sent through the queue lives in this rank's shared memory, gone with it
        queue.put({"rank": place.rank, "start": start, "built": _numpy(built),
                   "after_forward": _numpy(model.state_dict()),
                   "grads": _numpy({n: p.grad for n, p in model.named_parameters()}),
                   "own_grads": _numpy({n: p.grad for n, p in own.named_parameters()})})
    finally:
        dist.destroy_process_group()


def test_ddp_leaves_ignored_params_and_buffers_unsynced() -> None:
    """What ``ignore`` names keeps each rank's values (no broadcast at construction, none of the buffer before
    the forward) and each rank's own gradient (no all-reduce); the rest is rank 0's and averaged."""
    with LocalRanks(_ddp_rank, 2, ctx=rank_context(), timeout_s=120) as ranks:
        r0, r1 = sorted((ranks.get() for _ in range(2)), key=lambda r: r["rank"])
    for r in (r0, r1):
        np.testing.assert_allclose(r["built"]["shared.weight"], r0["start"]["shared.weight"], rtol=0, atol=0)
        for name in ("local.weight", "counts"):  # not broadcast: still this rank's own
            np.testing.assert_allclose(r["built"][name], r["start"][name], rtol=0, atol=0)
        np.testing.assert_allclose(r["after_forward"]["counts"], r["start"]["counts"], rtol=0, atol=0)
        # not all-reduced: this rank's own gradient
        np.testing.assert_allclose(r["grads"]["local.weight"], r["own_grads"]["local.weight"], rtol=1e-6)
    assert not np.array_equal(r0["start"]["local.weight"], r1["start"]["local.weight"])
    assert not np.array_equal(r0["own_grads"]["local.weight"], r1["own_grads"]["local.weight"])
    mean = (r0["own_grads"]["shared.weight"] + r1["own_grads"]["shared.weight"]) / 2
    for r in (r0, r1):  # the replicated weight's gradient is the ranks' mean
        np.testing.assert_allclose(r["grads"]["shared.weight"], mean, rtol=1e-5, atol=1e-7)


def _fsdp_rank(place: RankPlace, queue: Any, pp_dims: bool) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.profiler import ProfilerActivity, profile

    from xirang_hpc.config.schema import ModelConfig, ParallelConfig
    from xirang_hpc.models.gpt import GPT
    from xirang_hpc.runtime.data_parallel import apply_fsdp
    from xirang_hpc.runtime.parallel_dims import ParallelDims

    dist.init_process_group("gloo")
    try:
        dims = ParallelDims.from_config(ParallelConfig(dp=2, data_parallel="fsdp"), 2)
        mesh = init_device_mesh("cpu", dims.shape, mesh_dim_names=dims.dim_names)
        if pp_dims:  # the same model and mesh, its roots told they run under a pipeline (pp's own size unused)
            dims = dataclasses.replace(dims, pp=2, world_size=4)
        cfg = ModelConfig(name="t", n_layer=3, n_head=4, d_model=32, d_ff=64, seq_len=16, vocab_size=64)
        model = GPT(cfg, seed=1)
        apply_fsdp(model, mesh, dims)
        x = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(place.rank))
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(2):  # two steps' forward and backward
                model(x).float().pow(2).mean().backward()
        gathers: dict[str, int] = {}
        for e in prof.events():
            if e.name.startswith("FSDP::all_gather") and "copy" not in e.name:
                gathers[e.name] = gathers.get(e.name, 0) + 1
        queue.put({"rank": place.rank, "gathers": gathers})
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("pp_dims", [False, True], ids=["last-kept", "pipeline"])
def test_fsdp_gathers_the_blocks_twice_and_the_root_and_last_block_once_per_step(pp_dims: bool) -> None:
    """ZeRO-3: each block is gathered for its forward and again for its backward; the root (embedding, final
    norm, head) and the last block once, kept gathered from their forward into the backward, which starts with
    them; under a pipeline they reshard after each forward too."""
    with LocalRanks(_fsdp_rank, 2, (pp_dims,), ctx=rank_context(), timeout_s=120) as ranks:
        results = [ranks.get() for _ in range(2)]
    for r in results:
        g = r["gathers"]
        assert g.get("FSDP::all_gather (layers.0)") == g.get("FSDP::all_gather (layers.1)") == 4, g
        assert g.get("FSDP::all_gather (layers.2)") == g.get("FSDP::all_gather") == (4 if pp_dims else 2), g


def _bf16_kept_rank(place: RankPlace, queue: Any) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from xirang_hpc.config.schema import ModelConfig, ParallelConfig
    from xirang_hpc.models.gpt import GPT
    from xirang_hpc.runtime.data_parallel import apply_fsdp, block_precision
    from xirang_hpc.runtime.parallel_dims import ParallelDims
    from xirang_hpc.runtime.precision import apply_autocast

    dist.init_process_group("gloo")
    try:
        dims = ParallelDims.from_config(ParallelConfig(dp=2, data_parallel="fsdp"), 2)
        mesh = init_device_mesh("cpu", dims.shape, mesh_dim_names=dims.dim_names)
        out = {"rank": place.rank}
        # 3 x 10 tokens: no activation has a weight's shape (d_model 48, d_ff 80)
        cfg = ModelConfig(name="t", n_layer=4, n_head=4, d_model=48, d_ff=80, seq_len=16, vocab_size=64)
        x = torch.randint(0, 64, (3, 10), generator=torch.Generator().manual_seed(place.rank))
        for policy in ("block_precision", "autocast_only"):
            model = GPT(cfg, seed=1)
            apply_autocast(model, "bf16", torch.device("cpu"))
            apply_fsdp(model, mesh, dims, mp_policy=block_precision("bf16") if policy == "block_precision" else None)
            weights = {tuple(p.shape) for n, p in model.named_parameters() if n.startswith("layers.") and p.dim() == 2}
            weights |= {s[::-1] for s in weights}  # a matmul may keep the transposed view
            saved: list[torch.Tensor] = []

            def keep(t: torch.Tensor, saved: list[torch.Tensor] = saved) -> torch.Tensor:
                saved.append(t)
                return t

            with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
                loss = model(x).float().pow(2).mean()
            # what the backward will find still allocated: a whole (gathered) block weight, in bf16
            out[policy] = sum(t.untyped_storage().nbytes() for t in saved
                              if tuple(t.shape) in weights and t.untyped_storage().nbytes() > 0)
            loss.backward()
            out[policy + "_grad_dtypes"] = sorted({str(p.grad.dtype) for p in model.parameters()})
        queue.put(out)
    finally:
        dist.destroy_process_group()


def test_a_bf16_zero3_forward_leaves_no_whole_block_weight_for_the_backward_but_the_last() -> None:
    """bf16 under FSDP2: the blocks' weights are gathered in bf16 (FSDP2's mixed precision), so what autograd
    keeps for the backward are FSDP2's own gathered weights, freed after the forward, but the last block's, kept
    gathered for the backward that starts with it. Under autocast alone each matmul's bf16 copy of its gathered
    fp32 weight is kept instead: every block's whole weights, 2 bytes each."""
    with LocalRanks(_bf16_kept_rank, 2, ctx=rank_context(), timeout_s=120) as ranks:
        results = [ranks.get() for _ in range(2)]
    block_elements = 4 * 48 * 48 + 2 * 48 * 80  # per block: q, k, v, o and the two MLP matrices
    for r in results:
        assert r["block_precision"] == block_elements * 2, r  # the last block, in bf16
        assert r["autocast_only"] == 4 * block_elements * 2, r  # the four blocks, 2 bytes each (bf16)
        assert r["block_precision_grad_dtypes"] == r["autocast_only_grad_dtypes"] == ["torch.float32"], r
