"""Fast, single-process checks of the layout logic: dims, placement, stage split, recompute, config errors."""

from __future__ import annotations

import dataclasses

import parallel_harness as H
import pytest
import torch

from xirang_hpc.config.errors import ConfigError
from xirang_hpc.config.schema import ModelConfig, ParallelConfig
from xirang_hpc.config.validate import check_runnable, validate
from xirang_hpc.models.gpt import GPT, lm_loss
from xirang_hpc.runtime.parallel_dims import LayoutError, ParallelDims, format_table
from xirang_hpc.runtime.pipeline import carve_stage, rank_stages, split_layers, stage_chunks, stage_ranges
from xirang_hpc.runtime.recompute import apply_recompute


def test_dims_product_must_equal_world() -> None:
    with pytest.raises(LayoutError, match="pp=2 x dp_replicate=2 x dp_shard=1 x tp=2 = 8 ranks, but the world has 4"):
        ParallelDims(pp=2, dp_replicate=2, dp_shard=1, tp=2, world_size=4)
    with pytest.raises(LayoutError, match="tp=0"):
        ParallelDims(pp=1, dp_replicate=4, dp_shard=1, tp=0, world_size=4)


def test_dims_from_config_ddp_fsdp_hsdp() -> None:
    assert ParallelDims.from_config(ParallelConfig(dp=4, tp=2), 8).shape == (1, 4, 1, 2)
    assert ParallelDims.from_config(ParallelConfig(dp=4, data_parallel="fsdp"), 4).shape == (1, 1, 4, 1)
    hsdp = ParallelDims.from_config(ParallelConfig(dp=4, data_parallel="fsdp", dp_replicate=2), 4)
    assert (hsdp.dp_replicate, hsdp.dp_shard, hsdp.dp) == (2, 2, 4)


def test_placement_keeps_tp_inside_a_node_even_with_cyclic_rank_numbering() -> None:
    dims = ParallelDims(pp=2, dp_replicate=1, dp_shard=1, tp=2, world_size=4)
    # Slurm --distribution=cyclic: rank r on node r % 2.
    nodes = [(r % 2, r // 2) for r in range(4)]
    order = dims.placement(nodes)
    assert order == [0, 2, 1, 3]  # tp pairs (0,2) on node 0 and (1,3) on node 1
    rows = dims.table(nodes)
    assert [(r["node"], r["pp"], r["tp"]) for r in rows] == [(0, 0, 0), (1, 1, 0), (0, 0, 1), (1, 1, 1)]
    assert "rank  node  local  pp  dp  tp" in format_table(dims, rows)


def test_table_dp_pp_span_nodes_tp_inside() -> None:
    dims = ParallelDims(pp=2, dp_replicate=2, dp_shard=1, tp=2, world_size=8)
    rows = dims.table([(r // 4, r % 4) for r in range(8)])
    for r in rows:
        assert r["pp"] == r["node"]  # pp stage per node; dp and tp inside
        assert (r["dp"], r["tp"]) == divmod(r["local_rank"], 2)


def test_tp_group_spanning_nodes_is_rejected() -> None:
    dims = ParallelDims(pp=1, dp_replicate=2, dp_shard=1, tp=2, world_size=4)
    with pytest.raises(LayoutError, match="would span nodes"):
        dims.placement([(r, 0) for r in range(4)])  # 4 nodes x 1 rank


def test_split_counts_embedding_and_head() -> None:
    # Six equal blocks, head worth two blocks: the last stage takes fewer blocks.
    assert split_layers(2, 0.0, [1.0] * 6, 2.0) == [range(0, 4), range(4, 6)]
    assert split_layers(2, 2.0, [1.0] * 6, 0.0) == [range(0, 2), range(2, 6)]
    assert split_layers(3, 0.0, [1.0] * 3, 0.0) == [range(0, 1), range(1, 2), range(2, 3)]
    with pytest.raises(ValueError, match="cannot split 2 layers into 3"):
        split_layers(3, 0.0, [1.0] * 2, 0.0)


def test_interleaved_rank_holds_looped_stages_as_chunks_sharing_modules() -> None:
    cfg = ModelConfig(name="t", n_layer=4, n_head=2, d_model=16, seq_len=8)
    ranges = stage_ranges(cfg, 4)
    assert ranges == [range(i, i + 1) for i in range(4)]
    assert rank_stages(0, 2, 2) == [0, 2] and rank_stages(1, 2, 2) == [1, 3]
    torch.manual_seed(0)
    full = GPT(cfg)
    x = torch.randint(0, 256, (2, 8))
    m0, m1 = GPT(cfg), GPT(cfg)
    m0.load_state_dict(full.state_dict())
    m1.load_state_dict(full.state_dict())
    carve_stage(m0, [0, 2], ranges)
    carve_stage(m1, [1, 3], ranges)
    assert sorted(m0.layers) == ["0", "2"] and m0.tok_emb is not None and m0.head is None
    assert sorted(m1.layers) == ["1", "3"] and m1.tok_emb is None and m1.head is not None
    (c0, c2), (c1, c3) = stage_chunks(m0, [0, 2], ranges), stage_chunks(m1, [1, 3], ranges)
    assert c2.layers["2"] is m0.layers["2"], "chunks share the rank's modules (no copies)"
    with torch.no_grad():
        torch.testing.assert_close(c3(c2(c1(c0(x)))), full(x), rtol=0, atol=0)
    with pytest.raises(ConfigError, match="parallel.virtual_stages"):
        ParallelConfig(pp=2, schedule="interleaved", virtual_stages=1)


def test_stage_keeps_full_model_names() -> None:
    cfg = ModelConfig(name="t", n_layer=4, n_head=2, d_model=16, seq_len=8)
    full = {n for n, _ in GPT(cfg).named_parameters()}
    ranges = stage_ranges(cfg, 2)
    names = set()
    for s in range(2):
        m = GPT(cfg)
        carve_stage(m, s, ranges)
        stage_names = {n for n, _ in m.named_parameters()}
        assert stage_names <= full
        assert ("tok_emb.weight" in stage_names) == (s == 0) and ("head.weight" in stage_names) == (s == 1)
        names |= stage_names
    assert names == full


@pytest.mark.parametrize("mode", ["selective", "full"])
def test_recompute_gives_identical_gradients_and_names(mode: str) -> None:
    cfg = ModelConfig(name="t", n_layer=2, n_head=2, d_model=16, seq_len=8)
    x = torch.randint(0, 256, (2, 8))
    grads = []
    for m in ("none", mode):
        torch.manual_seed(0)
        model = GPT(cfg)
        assert apply_recompute(model, m) == (0 if m == "none" else 2)
        lm_loss(model(x), x).backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    assert grads[0].keys() == grads[1].keys()
    for n in grads[0]:
        torch.testing.assert_close(grads[0][n], grads[1][n], rtol=0, atol=0)
    with pytest.raises(ValueError, match="recompute mode 'some'"):
        apply_recompute(GPT(cfg), "some")


@pytest.mark.parametrize("parallel,field,words", [
    ({"tp": 3}, "parallel.tp", ["n_head=4"]),
    ({"pp": 5}, "parallel.pp", ["n_layer=4"]),
    ({"dp": 4, "dp_replicate": 2}, "parallel.dp_replicate", ["data_parallel=fsdp"]),
    ({"dp": 4, "data_parallel": "fsdp", "dp_replicate": 3}, "parallel.dp_replicate", ["divide"]),
    ({"dp": 4, "data_parallel": "fsdp", "zero": 1}, "parallel.zero", ["fsdp", "zero=2 or 3"]),
    ({"dp": 4, "optimizer_sharding": True, "zero": 0}, "parallel.zero", ["optimizer_sharding", "zero=1"]),
    ({"dp": 4, "sequence_parallel": True}, "parallel.sequence_parallel", ["tp > 1"]),
    ({"dp": 2, "pp": 2, "schedule": "interleaved", "virtual_stages": 3}, "parallel.virtual_stages",
     ["pp*virtual_stages=6", "n_layer=4", "virtual_stages <= 2"]),
    ({"dp": 4, "schedule": "interleaved"}, "parallel.schedule", ["parallel.pp > 1"]),
    ({"dp": 2, "pp": 2, "microbatches": 5, "schedule": "interleaved"}, "parallel.microbatches",
     ["multiple of parallel.pp=2"]),
])
def test_unsupported_layouts_fail_at_config_time(parallel: dict, field: str, words: list[str]) -> None:
    with pytest.raises(ConfigError) as exc:
        H.make_cfg(4, parallel)
    msg = str(exc.value)
    assert field in msg and all(w in msg for w in words), msg


def test_tp_must_divide_ranks_per_node() -> None:
    cfg = H.make_cfg(4, {"dp": 4})
    bad = dataclasses.replace(cfg, cluster=dataclasses.replace(cfg.cluster, nodes=2, tasks_per_node=6),
                              parallel=ParallelConfig(dp=-1, tp=4),
                              train=dataclasses.replace(cfg.train, global_batch=24))
    with pytest.raises(ConfigError, match="tasks_per_node=6"):
        check_runnable(validate(bad))
