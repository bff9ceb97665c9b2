"""Context parallelism, single process: the chunking, the mask over shards, the mesh layout, the config checks.

The multi-process equivalence (cp2, cp2 x dp2, cp2 x tp2, fsdp2 x cp2, packed chat rows) is in
tests/test_parallel_matrix.py.
"""

from __future__ import annotations

import parallel_harness as H
import pytest
import torch

from xirang_hpc.config.errors import ConfigError
from xirang_hpc.config.schema import FinetuneConfig, ParallelConfig
from xirang_hpc.config.validate import cp_degrees
from xirang_hpc.models.gpt import packed_attention, sharded_causal_mask
from xirang_hpc.runtime.context_parallel import shard_index
from xirang_hpc.runtime.parallel_dims import LayoutError, ParallelDims, format_table


def test_shard_index_pairs_an_early_chunk_with_a_late_one() -> None:
    assert shard_index(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert shard_index(8, 2, 1).tolist() == [2, 3, 4, 5]
    assert shard_index(16, 4, 1).tolist() == [2, 3, 12, 13]
    for cp in (1, 2, 4):
        held = torch.cat([shard_index(32, cp, r) for r in range(cp)])
        assert sorted(held.tolist()) == list(range(32)), "every token held exactly once"
        # causal work of a query ~ its position + 1: the same on every rank (load balance)
        work = {int((shard_index(32, cp, r) + 1).sum()) for r in range(cp)}
        assert len(work) == 1, work
    with pytest.raises(ValueError, match="2\\*cp=6 must divide the sequence length 16"):
        shard_index(16, 3, 0)


@pytest.mark.parametrize("cp", [2, 4])
def test_mask_over_shards_is_the_full_mask_reordered(cp: int) -> None:
    """Local queries x gathered keys see exactly what they would see in the whole row, packed or not."""
    t = 16
    g = torch.Generator().manual_seed(0)
    # packed rows: samples of random lengths, positions restarting at 0 at each
    rows = []
    for _ in range(3):
        pos: list[int] = []
        while len(pos) < t:
            pos += list(range(int(torch.randint(1, 7, (1,), generator=g))))
        rows.append(pos[:t])
    pos_ids = torch.tensor(rows)  # (3, T)
    full_packed = packed_attention(pos_ids)  # (3, 1, T, T)
    full_causal = torch.ones(t, t, dtype=torch.bool).tril()
    keys = torch.cat([shard_index(t, cp, r) for r in range(cp)])
    for r in range(cp):
        q = shard_index(t, cp, r)
        got = sharded_causal_mask(q, keys, pos_ids[:, q], pos_ids[:, keys])  # (3, 1, T/cp, T)
        assert torch.equal(got, full_packed[:, :, q][:, :, :, keys])
        plain = sharded_causal_mask(q, keys)  # (1, 1, T/cp, T)
        assert torch.equal(plain[0, 0], full_causal[q][:, keys])
    # the packed rows really differ from plain causal (so the first check can fail)
    assert not torch.equal(full_packed[0, 0], full_causal)


def test_dims_with_cp_put_it_between_dp_and_tp() -> None:
    dims = ParallelDims.from_config(ParallelConfig(dp=2, cp=2, tp=2), 8)
    assert dims.dim_names == ("pp", "dp_replicate", "dp_shard", "cp", "tp")
    assert dims.shape == (1, 2, 1, 2, 2) and (dims.dp, dims.dp_cp) == (2, 4)
    # mesh order: tp fastest, then cp, then dp
    assert [(c["dp"], c["cp"], c["tp"]) for c in map(dims.coords, range(8))] == [
        (d, c, t) for d in range(2) for c in range(2) for t in range(2)]
    rows = dims.table([(r // 4, r % 4) for r in range(8)])
    assert [r["cp"] for r in rows] == [0, 0, 1, 1, 0, 0, 1, 1]
    assert "pp  dp  cp  tp" in format_table(dims, rows)
    assert ParallelDims.from_config(ParallelConfig(dp=4), 4).dim_names == ("pp", "dp_replicate", "dp_shard", "tp")
    with pytest.raises(LayoutError, match="x cp=2 x tp=1 = 8 ranks, but the world has 4"):
        ParallelDims(pp=1, dp_replicate=4, dp_shard=1, tp=1, cp=2, world_size=4)


def test_cp_derives_dp_from_the_rest_of_the_world() -> None:
    cfg = H.make_cfg(4, {"cp": 2})
    assert (cfg.parallel.dp, cfg.parallel.cp) == (2, 2)


@pytest.mark.parametrize("parallel,model,words", [
    ({"cp": 3}, {}, ["parallel.cp", "must divide the world size 4", "choose parallel.cp from [1, 2, 4]"]),
    ({"cp": 4}, {"seq_len": 20}, ["parallel.cp", "2*cp=8 must divide model.seq_len=20", "from [1, 2]"]),
    ({"cp": 2, "dp": 4}, {}, ["parallel.dp", "dp*cp*tp*pp=8", "parallel.dp=2"]),
])
def test_cp_degree_errors_name_the_valid_degrees(parallel: dict, model: dict, words: list[str]) -> None:
    with pytest.raises(ConfigError) as exc:
        H.make_cfg(4, parallel, model=model)
    assert all(w in str(exc.value) for w in words), str(exc.value)
    assert cp_degrees(8, 2, 1, 16) == [1, 2, 4]


@pytest.mark.parametrize("parallel,kw,field", [
    ({"cp": 2, "pp": 2, "microbatches": 2}, {}, "parallel.pp"),
    ({"cp": 2, "tp": 2, "sequence_parallel": True}, {}, "parallel.sequence_parallel"),
    ({"cp": 2, "dp": 2, "zero": 1}, {}, "parallel.zero"),
    ({"cp": 2}, {"train": {"compile": True}}, "train.compile"),
    ({"cp": 2, "dp": 2, "ep": 2}, {"model": {"moe_experts": 4, "mlp": "swiglu"}}, "parallel.ep"),
    ({"cp": 2}, {"finetune": H.LORA}, "finetune.method"),
])
def test_cp_refuses_what_it_does_not_run_by_name(parallel: dict, kw: dict, field: str) -> None:
    with pytest.raises(ConfigError) as exc:
        H.make_cfg(4, parallel, **kw)
    assert field in str(exc.value) and "parallel.cp=2" in str(exc.value), str(exc.value)


def test_full_finetune_is_not_refused() -> None:
    assert H.make_cfg(2, {"cp": 2}, finetune=FinetuneConfig()).parallel.cp == 2


@pytest.mark.parametrize("cp,heads", [(2, 2), (4, 3)])
def test_chunked_causal_attention_is_full_causal_attention(cp: int, heads: int) -> None:
    """The fused per-chunk attention (no mask held): every rank's rows and, summed over ranks, the gradients
    of plain causal SDPA over the whole sequence."""
    import torch.nn.functional as F

    from xirang_hpc.runtime.context_parallel import _ChunkedCausalAttention, _flash_cpu_available

    if not _flash_cpu_available():
        pytest.skip("this torch build has no fused CPU attention kernels")
    t, hd = 32, 8
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, heads, t, hd, generator=g, dtype=torch.float64).float().requires_grad_()
               for _ in range(3))
    weights = torch.randn(2, heads, t, hd, generator=g)  # a loss that weighs every output differently
    full = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    (full * weights).sum().backward()
    want = [x.grad.clone() for x in (q, k, v)]
    for x in (q, k, v):
        x.grad = None
    total = torch.zeros(())
    for r in range(cp):
        idx = shard_index(t, cp, r)
        out = _ChunkedCausalAttention.apply(q[:, :, idx], k, v, (r, 2 * cp - 1 - r))
        torch.testing.assert_close(out, full[:, :, idx].detach(), rtol=1e-5, atol=1e-6)
        total = total + (out * weights[:, :, idx]).sum()
    total.backward()
    for got, ref in zip((q.grad, k.grad, v.grad), want, strict=True):
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-5)


def test_in_job_shrink_keeps_the_cp_group_whole() -> None:
    """A restart on fewer nodes shrinks dp, never cp (each cp group shares its sequences)."""
    from xirang_hpc.config.elastic import shrink

    cfg = H.make_cfg(4, {"cp": 2})  # 2 nodes x 2 ranks: dp=2 x cp=2
    small = shrink(cfg, 1)
    assert (small.cluster.nodes, small.parallel.dp, small.parallel.cp, small.train.grad_accum) == (1, 1, 2, 2)
    wide = H.make_cfg(4, {"cp": 4})  # one cp group over both nodes
    with pytest.raises(ConfigError, match="cp\\*tp\\*pp=4 ranks do not fit on 1 node"):
        shrink(wide, 1)


def _attention_ranks(place, queue, fused: bool) -> None:  # noqa: ANN001 - a LocalRanks target
    """One cp rank: its queries and K/V shard of a shared sequence through ``ContextShards``; reports its
    output rows and, all-reduced, the gradients of the whole q, k, v."""
    import torch.distributed as dist

    from xirang_hpc.runtime.context_parallel import ContextShards

    place.init_process_group("gloo")
    try:
        t, hd = 32, 8
        g = torch.Generator().manual_seed(2)
        q, k, v = (torch.randn(2, 3, t, hd, generator=g).requires_grad_() for _ in range(3))
        weights = torch.randn(2, 3, t, hd, generator=g)
        sh = ContextShards(dist.group.WORLD, t)
        sh._fused = sh._fused and fused  # False: the mask path other devices take
        idx = sh.index
        k_all, v_all = sh.gather(k[:, :, idx], 2), sh.gather(v[:, :, idx], 2)  # (2, 3, T, hd), rank order
        out = sh.causal_attention(q[:, :, idx], k_all, v_all)
        (out * weights[:, :, idx]).sum().backward()
        grads = torch.stack([q.grad, k.grad, v.grad])
        dist.all_reduce(grads)  # each rank's loss term's gradients, summed: the whole loss's
        queue.put({"rank": place.rank, "index": idx.tolist(), "out": out.detach().numpy(),
                   "grads": grads.numpy(), "fused": sh._fused})
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("cp,fused", [(2, True), (2, False), (4, False)])
def test_attention_across_gloo_ranks_is_one_process_attention(cp: int, fused: bool) -> None:
    """Real gloo ranks: the K/V all-gather (its backward returning each shard its summed gradient) and causal
    attention over the shards, fused per chunk or through the mask, give one process's outputs and gradients."""
    import numpy as np
    import torch.nn.functional as F
    from ranks import rank_context

    from xirang_hpc.runtime.local_ranks import LocalRanks

    with LocalRanks(_attention_ranks, cp, (fused,), ctx=rank_context(), timeout_s=120) as ranks:
        reports = [ranks.get() for _ in range(cp)]
    t, hd = 32, 8
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(2, 3, t, hd, generator=g).requires_grad_() for _ in range(3))
    weights = torch.randn(2, 3, t, hd, generator=g)
    full = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    (full * weights).sum().backward()
    want = torch.stack([q.grad, k.grad, v.grad]).numpy()
    for r in reports:
        assert r["fused"] is fused
        np.testing.assert_allclose(r["out"], full[:, :, r["index"]].detach().numpy(), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(r["grads"], want, rtol=1e-4, atol=1e-5)
