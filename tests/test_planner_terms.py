"""Cost terms for today's models, each against a hand computation from its cited formula:
grouped-query attention, fused (flash) attention, tied/untied heads, uneven pipelines, ZeRO-2/3
communication per microbatch, and evaluating a given layout."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

from xirang_hpc.config.schema import ModelConfig
from xirang_hpc.models.gpt import full_model_params
from xirang_hpc.planner import comm
from xirang_hpc.planner.cost import Plan, Problem, estimate, rank_layers
from xirang_hpc.planner.evaluate import evaluate, parse_layout
from xirang_hpc.planner.formulas import (
    Shape,
    embedding_params,
    iteration_flops,
    layer_activation_bytes,
    layer_forward_flops,
    layer_params,
    model_params,
    pipeline_split,
    total_params,
)
from xirang_hpc.planner.hardware import PRESETS
from xirang_hpc.planner.search import _tp_options, search

LLAMA3_8B = Shape(layers=32, hidden=4096, heads=32, seq=8192, vocab=128256, ffn=14336, swiglu=True, bias=False,
                  learned_pos=False, kv_heads=8, tied=False)


@pytest.mark.parametrize("model", [
    dict(name="a", n_layer=3, n_head=4, n_kv_head=2, d_model=64, d_ff=192, norm="rmsnorm", mlp="swiglu", pos="rope",
         bias=False),
    dict(name="b", n_layer=2, n_head=4, d_model=64, tie_embeddings=True),
    dict(name="c", n_layer=2, n_head=8, n_kv_head=1, d_model=64, seq_len=32),
])
def test_parameter_count_equals_the_model_built(model: dict) -> None:
    """The closed form counts exactly what GPT holds (total_params leaves out the final norm; model_params,
    what the launcher sizes checkpoints by, has it)."""
    cfg = ModelConfig(**model)
    final_norm = cfg.d_model * (2 if cfg.bias and cfg.norm == "layernorm" else 1)
    assert total_params(Shape.from_model(cfg)) + final_norm == full_model_params(cfg) == model_params(cfg)


def test_gqa_params_and_flops_by_hand() -> None:
    h, kv, f = 4096, 8 * 128, 14336  # Llama 3 8B: 8 kv heads of 128
    assert layer_params(LLAMA3_8B) == 2 * h * h + 2 * h * kv + 3 * h * f + 2 * h
    dense, attn = layer_forward_flops(LLAMA3_8B, tokens=10)
    assert dense == 2 * 10 * (2 * h * h + 2 * h * kv + 3 * h * f)
    assert attn == 4 * 10 * 8192 * h  # QK^T and AV over all 32 query heads: unchanged by GQA
    assert round(total_params(LLAMA3_8B) / 1e9, 2) == 8.03  # Meta's model card (+4096 for the final norm)


def test_gqa_shrinks_kv_activations_and_tp_must_divide_kv_heads() -> None:
    mha = dataclasses.replace(LLAMA3_8B, kv_heads=0)
    # Korthikanti's 11 sbh of attention holds K and V at 2 sbh each: GQA keeps 2*kv/h of each.
    saved = layer_activation_bytes(mha, 1, 1, False, "selective", 2) - layer_activation_bytes(
        LLAMA3_8B, 1, 1, False, "selective", 2)
    assert saved == pytest.approx(8192 * 4096 * 4 * (1 - 1024 / 4096))
    pb = Problem(dataclasses.replace(LLAMA3_8B, kv_heads=2), PRESETS["h100"], 1, 8, 8)
    assert _tp_options(pb) == [1, 2]  # 4 and 8 would split a key/value head


def test_flash_attention_drops_score_memory_and_recomputes_scores() -> None:
    sh = LLAMA3_8B
    plain = layer_activation_bytes(sh, 1, 1, False, "none", 2)
    flash = layer_activation_bytes(sh, 1, 1, False, "none", 2, flash=True)
    assert plain - flash == pytest.approx(8192 * 1 * 4096 * 5 * 32 * 8192 / 4096)  # Korthikanti's 5as^2b
    assert flash == layer_activation_bytes(sh, 1, 1, False, "selective", 2)
    _, attn = layer_forward_flops(sh, 8192)
    # FlashAttention-2's backward: 5 products instead of 4 = half a forward pass of scores more.
    assert iteration_flops(sh, 1, "none", flash=True) - iteration_flops(sh, 1, "none") == pytest.approx(
        32 * 0.5 * attn)
    assert iteration_flops(sh, 1, "selective", flash=True) == iteration_flops(sh, 1, "none", flash=True)


def test_tied_head_is_counted_once_on_one_stage() -> None:
    tied = dataclasses.replace(LLAMA3_8B, tied=True)
    assert total_params(LLAMA3_8B) - total_params(tied) == 128256 * 4096
    pb_t, pb_u = (Problem(s, PRESETS["h200"], 1, 8, 8) for s in (tied, LLAMA3_8B))
    plan = Plan(dp=1, tp=8, pp=1, micro=1, sp=True, recompute="full")
    extra = estimate(pb_u, plan).memory["params"] - estimate(pb_t, plan).memory["params"]
    assert extra == pytest.approx(128256 * 4096 / 8 * 2)  # bf16 weights of the head, per tp rank


def test_uneven_pipeline_split_balances_and_covers_every_layer() -> None:
    assert pipeline_split(70, 12, 0.0, 0.0) == (5,) + (6,) * 10 + (5,)  # the edge stages one layer short
    # The head costs a block: the last stage holds one block less, so every stage costs 8 blocks at most.
    counts = pipeline_split(126, 16, 0.0, 1.0)
    assert sum(counts) == 126 and max(counts) == 8 and counts[-1] + 1.0 <= 8
    assert pipeline_split(4, 4, 0.0, 3.0) == (1, 1, 1, 1)
    with pytest.raises(ValueError):
        pipeline_split(3, 4, 0.0, 0.0)


def test_search_finds_layouts_whose_stages_do_not_divide_the_layers() -> None:
    sh = dataclasses.replace(LLAMA3_8B, layers=30)
    res = search(Problem(sh, PRESETS["h100"], 4, 8, 64))
    assert any(30 % e.plan.pp for e in res.ranked), "pp=4 or 8 over 30 layers is searched"
    est = estimate(res.problem, Plan(dp=4, tp=2, pp=4, micro=1, sp=True))
    counts = rank_layers(sh, 4, 1)  # the head costs ~1.8 blocks of Llama 3 8B: the last stage holds fewer
    assert sum(counts) == 30 and max(counts) == 8 and counts[-1] == 6 and est.fits


def test_zero3_gathers_every_microbatch_and_zero2_reduces_every_microbatch() -> None:
    sh = dataclasses.replace(LLAMA3_8B, layers=8, seq=2048)
    pb1, pb8 = (Problem(sh, PRESETS["h100"], 2, 8, b) for b in (16, 128))
    for zero in (2, 3):
        one = estimate(pb1, Plan(dp=16, tp=1, pp=1, micro=1, zero=zero)).time["dp_comm"]
        eight = estimate(pb8, Plan(dp=16, tp=1, pp=1, micro=1, zero=zero)).time["dp_comm"]
        assert eight > 4 * one, (zero, one, eight)
    one1 = estimate(pb1, Plan(dp=16, tp=1, pp=1, micro=1, zero=1)).time["dp_comm"]
    eight1 = estimate(pb8, Plan(dp=16, tp=1, pp=1, micro=1, zero=1)).time["dp_comm"]
    assert eight1 == pytest.approx(one1)  # ZeRO-1 accumulates full gradients: one reduce-scatter per step


def test_dp_communication_per_zero_stage_is_what_the_runtime_runs() -> None:
    """Hand-computed from the runtime's collectives (h100 preset without overlap; no fitted per-MB terms).

    R = one gradient all-reduce of the stage, G = an all-gather = a reduce-scatter = R/2, L = the
    per-layer collective latency. Without a pipeline: ZeRO-0 R; ZeRO-1 R + G (owners broadcast the
    updated weights); ZeRO-2 m*(G + G) + m*layers*L (forward gather, backward reduce-scatter per
    microbatch); ZeRO-3 m*(G + 2G) + 1.5*m*layers*L. Under a pipeline (torch defers FSDP2's reduction
    and keeps weights gathered): ZeRO-2 G + G + layers*L whatever m; ZeRO-3 (1 + m) gathers + G.
    """
    sh = dataclasses.replace(LLAMA3_8B, layers=8, seq=2048)
    # Every collective timed as the runtime's hierarchical all-reduce (G = R/2): NCCL's pipelined rings for the
    # sharded stages are checked in the next test.
    hw = PRESETS["h100"].scaled(dp_overlap=0.0, comm_interference=0.0, pipelined_rings=0.0)

    def dp(zero: int, batch: int, pp: int = 1) -> float:
        plan = Plan(dp=32 // pp, tp=1, pp=pp, micro=1, zero=zero)
        return estimate(Problem(sh, hw, 4, 8, batch), plan).time["dp_comm"]

    r = dp(0, 32)
    assert dp(1, 32) == pytest.approx(1.5 * r) and dp(1, 256) == pytest.approx(1.5 * r)  # accumulation: once
    two, three = dp(2, 32), dp(3, 32)
    latency = three - 1.5 * two  # 1.5*m*layers*L - 1.5*m*layers*L cancels the volumes: only G's remain
    assert two > r and three == pytest.approx(1.5 * two, rel=1e-9) and abs(latency) < 1e-12
    assert dp(2, 256) == pytest.approx(8 * two) and dp(3, 256) == pytest.approx(8 * three)  # per microbatch
    # A pipeline of 2 stages: ZeRO-2 communicates the same whatever the microbatch count, ZeRO-3 grows with it.
    assert dp(2, 64, pp=2) == pytest.approx(dp(2, 256, pp=2))
    assert dp(3, 256, pp=2) > 3 * dp(3, 64, pp=2) / 2


def test_sharded_collectives_are_nccl_rings_with_gradients_in_their_reduce_precision() -> None:
    """ZeRO-3 across 4 nodes on the h100 preset (``pipelined_rings`` 1, no overlap): per microbatch two weight
    all-gathers (2 bytes) and one gradient reduce-scatter (``grad_comm_bytes``), each half of
    comm.pipelined_ring's all-reduce time, plus 1.5 ring latencies per layer; fp32 gradients (4 bytes, as
    FSDP's ``reduce_dtype=torch.float32``) cost one more weight gather's worth."""
    sh = dataclasses.replace(LLAMA3_8B, layers=8, seq=2048)
    hw = PRESETS["h100"].scaled(dp_overlap=0.0, comm_interference=0.0)
    links = comm.Links.of(hw)
    params = 8 * layer_params(sh) + max(embedding_params(sh), sh.vocab * sh.hidden)

    def ring(n: float) -> float:
        return comm.pipelined_ring(n, 8, 4, links, flows=8)

    plan = Plan(dp=32, tp=1, pp=1, micro=1, zero=3)
    got = {}
    for grad_bytes in (2, 4):
        est = estimate(Problem(sh, hw.scaled(grad_comm_bytes=grad_bytes), 4, 8, 32), plan)
        want = ring(2 * params) + ring(grad_bytes * params) / 2 + 1.5 * 8 * ring(1.0)
        assert est.time["dp_comm"] == pytest.approx(want, rel=1e-9) and est.dp_algo == "ring-pipelined"
        got[grad_bytes] = est.time["dp_comm"]
    assert got[4] - got[2] == pytest.approx((ring(4 * params) - ring(2 * params)) / 2, rel=1e-9)
    assert got[4] > 1.3 * got[2]  # 4 + 2 + 2 bytes on the wire instead of 2 + 2 + 2
    # The same plan timed as sequential hierarchical phases costs more: NVLink and network no longer overlap.
    seq = estimate(Problem(sh, hw.scaled(pipelined_rings=0.0), 4, 8, 32), plan)
    assert seq.time["dp_comm"] > 1.4 * got[2]


def test_pipelined_zero2_and_zero3_hold_full_weights_and_gradients() -> None:
    """torch's pipeline schedule keeps FSDP2's weights gathered and gradients unreduced until the end of
    the step, so under pp > 1 only the optimizer state stays sharded; without a pipeline ZeRO-2 shards
    gradients and ZeRO-3 also weights (Rajbhandari et al.)."""
    sh = dataclasses.replace(LLAMA3_8B, layers=8, seq=2048)
    pb = Problem(sh, PRESETS["h100"], 4, 8, 64)

    def mem(zero: int, pp: int) -> dict[str, float]:
        return estimate(pb, Plan(dp=32 // pp, tp=1, pp=pp, micro=1, zero=zero)).memory

    dp = 16  # 32 GPUs over pp=2
    for zero in (2, 3):
        # Whole weights and gradients (kept by the schedule) plus FSDP2's own 1/dp shards of both.
        assert mem(zero, 2)["params"] == pytest.approx(mem(1, 2)["params"] * (1 + 1 / dp))
        assert mem(zero, 2)["grads"] == pytest.approx(mem(1, 2)["grads"] * (1 + 1 / dp))
        assert mem(zero, 2)["optimizer"] == mem(1, 2)["optimizer"]
        # So under a pipeline ZeRO-2/3 hold more than ZeRO-1 (the planner must not rank them as savings).
        assert mem(zero, 2)["total"] > mem(1, 2)["total"]
    # ZeRO-3's two gathered layers are not extra under a pipeline: every weight is already gathered.
    assert mem(3, 2)["buffers"] == mem(2, 2)["buffers"]
    assert mem(3, 1)["buffers"] > mem(2, 1)["buffers"]
    assert mem(2, 1)["grads"] == pytest.approx(mem(1, 1)["grads"] / 32)
    assert mem(3, 1)["params"] == pytest.approx(mem(1, 1)["params"] / 32)


def test_evaluate_a_given_layout_and_refuse_bad_ones() -> None:
    pb = Problem(LLAMA3_8B, PRESETS["h100"], 8, 8, 256)
    ev = evaluate(pb, parse_layout("tp=8,pp=1,dp=8,mbs=1,zero=1,recompute=selective,sp=true", pb))
    assert ev.estimate.fits and ev.rank is not None and ev.rank >= 1
    best = ev.searched.ranked[0]
    assert evaluate(pb, best.plan).rank == 1
    for bad, words in [("tp=3", "must divide"), ("tp=8,pp=2,dp=2", "must equal the 64 GPUs"),
                       ("tp=16", "must divide"), ("xx=1", "cannot read")]:
        with pytest.raises(ValueError, match=words):
            parse_layout(bad, pb)


@pytest.mark.slow
def test_plan_cli_layout_flag(tmp_path: Path) -> None:
    exe = Path(sys.executable).parent / "xirang-plan"
    res = subprocess.run([str(exe), "--layout", "tp=8,pp=16,dp=128,mbs=1,v=7,zero=1,recompute=full,sp=true",
                          "model=llama3-405b", "cluster=h100-ib", "cluster.nodes=2048", "train.global_batch=2048"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr
    assert "layout dp=128 tp=8 pp=16" in res.stdout and "fits; ranks #" in res.stdout
    bad = subprocess.run([str(exe), "--layout", "tp=3", "model=llama3-8b", "cluster=h100-ib"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=600)
    assert bad.returncode == 2 and "tp=3 must divide" in bad.stderr


def test_inflight_layers_follow_the_1f1b_warm_up_by_hand() -> None:
    """Without interleaving rank r holds min(m, p - r) microbatches of its blocks. Interleaved (Megatron-Core's
    and torch's schedule) rank r runs 2*(p - r - 1) + (v - 1)*p chunk forwards before its first backward, so it
    holds one more than that at its peak: on rank 0 with even chunks Korthikanti's p*(1 + (p-1)/(p*v))
    microbatches of its blocks, and every later rank only 2 chunk-microbatches fewer than the one before (not
    p - r); capped by the m*v forwards of the step."""
    from xirang_hpc.planner.formulas import inflight_layers

    assert inflight_layers((7,), 32, 16, 0) == 7 * 16
    assert inflight_layers((7,), 32, 16, 5) == 7 * 11
    assert inflight_layers((7,), 4, 16, 0) == 7 * 4
    p, v, m = 4, 2, 8
    assert inflight_layers((3, 3), m, p, 0) == pytest.approx(6 * p * (1 + (p - 1) / (p * v)))  # 33 = 11 chunks x 3
    assert [inflight_layers((3, 3), m, p, r) for r in range(p)] == [3 * (2 * (p - r - 1) + (v - 1) * p + 1)
                                                                     for r in range(p)]
    # m = p: rank 0's warm-up (10 chunk forwards) exceeds the step's 8, so it runs every forward first.
    assert inflight_layers((3, 3), 4, 4, 0) == 3 * 8
    # Uneven chunks are counted by their own blocks: an empty first chunk on rank 0 (16 stages, 8 chunks of one
    # block): its warm-up is 2*15 + 7*16 = 142 forwards, 31 of them (then one more) through the empty chunk.
    assert inflight_layers((0, 1, 1, 1, 1, 1, 1, 1), 32, 16, 0) == 7 * 16
    assert inflight_layers((1,) * 8, 32, 16, 1) == 2 * 14 + 7 * 16 + 1
    assert inflight_layers((1,) * 8, 16, 16, 1) == 16 * 8  # 140 warm-up forwards > the step's 128


def test_ends_as_layers_split_llama3_405b_as_published() -> None:
    """Llama 3 405B's 126 blocks on 16 stages x 8 chunks with the embedding and the head each in a block's place:
    the first chunk holds only the embedding and the last only the head (Sec. 3.3.2); the first and last ranks 7
    blocks, the others 8."""
    from xirang_hpc.planner.cost import rank_chunks
    from xirang_hpc.planner.formulas import chunk_split
    from xirang_hpc.planner.published import LLAMA3

    assert chunk_split(126, 128, 0.0, 0.0, ends_as_layers=True) == (0,) + (1,) * 126 + (0,)
    sh = LLAMA3[0].shape
    assert rank_layers(sh, 16, 8, True) == (7,) + (8,) * 14 + (7,)
    chunks = rank_chunks(sh, 16, 8, True)
    assert chunks[0] == (0,) + (1,) * 7 and chunks[15] == (1,) * 7 + (0,)
    assert rank_layers(sh, 16, 1, True) == (7,) + (8,) * 14 + (7,)
