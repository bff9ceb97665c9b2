"""Context parallelism in the cost model and the search, against a hand computation.

Llama 3 8B at 32,768 tokens on one node of 8 H100s, one sequence per microbatch, no pipeline: cp=2
halves every per-layer activation and the logits, keeps the gathered K and V (8 kv heads of 128, full
length) beside them, moves 2 K/V all-gathers' worth per layer and microbatch (forward gather, backward
reduce-scatter), and reduces gradients over dp x cp.
"""

from __future__ import annotations

import dataclasses

import pytest

from xirang_hpc.planner import comm
from xirang_hpc.planner.cost import Plan, Problem, estimate
from xirang_hpc.planner.evaluate import parse_layout
from xirang_hpc.planner.formulas import Shape, layer_activation_bytes
from xirang_hpc.planner.hardware import PRESETS
from xirang_hpc.planner.search import Space, search

LONG = Shape(layers=32, hidden=4096, heads=32, seq=32768, vocab=128256, ffn=14336, swiglu=True, bias=False,
             learned_pos=False, kv_heads=8, tied=False)


def test_cp_activation_memory_and_kv_traffic_by_hand() -> None:
    hw = PRESETS["h100"]
    pb = Problem(LONG, hw, 1, 8, 8)
    one = estimate(pb, Plan(dp=8, tp=1, pp=1, micro=1, zero=3))
    two = estimate(pb, Plan(dp=4, tp=1, pp=1, micro=1, zero=3, cp=2))
    s, b, kv_width, layers = 32768, 1, 8 * 128, 32
    flash = hw.flash_attention > 0
    per_layer = layer_activation_bytes(LONG, b, 1, False, "none", hw.act_bytes, flash)
    logits = 2.0 * s * b * LONG.vocab * 4  # fp32 logits and their gradient
    assert one.memory["activations"] == pytest.approx(layers * per_layer + logits)
    # cp=2: half of every activation and of the logits, plus the other half of the gathered K and V
    # (2 tensors x 2 bytes per 16-bit element, scaled by act_bytes / 2) kept for the backward
    gathered_kv = 2 * 2 * s * b * kv_width * (hw.act_bytes / 2) / 2
    assert two.memory["activations"] == pytest.approx(layers * (per_layer / 2 + gathered_kv) + logits / 2)
    assert two.memory["activations"] < 0.6 * one.memory["activations"]
    # K/V traffic: per layer and microbatch, a forward all-gather and a backward reduce-scatter, each half a
    # ring all-reduce of the gathered K and V (2 x s x kv_width elements) over the 2 cp ranks, in the node
    links = comm.Links.of(hw)
    kv_bytes = 2.0 * b * s * kv_width * hw.act_bytes
    per_mb = layers * 2 * comm.ring_allreduce(kv_bytes, 2, links.a_intra, links.b_intra) / 2
    assert two.microbatches == 8 // 4
    assert two.time["cp_comm"] == pytest.approx(two.microbatches * per_mb)
    assert one.time["cp_comm"] == 0.0
    # ZeRO-3 shards the state over dp x cp = 8 ranks either way
    assert two.memory["optimizer"] == pytest.approx(one.memory["optimizer"])
    # each rank computes half of each of twice as many sequences: about the same compute per step
    assert two.time["compute"] == pytest.approx(one.time["compute"], rel=0.05)


def test_full_recompute_gathers_kv_again() -> None:
    pb = Problem(LONG, PRESETS["h100"], 1, 8, 8)
    base = estimate(pb, Plan(dp=4, tp=1, pp=1, micro=1, zero=3, cp=2))
    full = estimate(pb, Plan(dp=4, tp=1, pp=1, micro=1, zero=3, cp=2, recompute="full"))
    assert full.time["cp_comm"] == pytest.approx(1.5 * base.time["cp_comm"])


def test_search_tries_cp_for_long_sequences_only() -> None:
    pb = Problem(LONG, PRESETS["h100"], 1, 8, 8)
    res = search(pb, keep_oom=50)
    tried = {e.plan.cp for e in res.ranked + res.oom}
    assert tried - {1}, "long sequences: cp > 1 is searched"
    assert all(e.plan.pp == 1 and e.plan.zero != 1 for e in res.ranked + res.oom if e.plan.cp > 1)
    assert any(e.plan.cp > 1 for e in res.ranked), "and some cp plan fits"
    short = Problem(dataclasses.replace(LONG, seq=2048), PRESETS["h100"], 1, 8, 8)
    assert {e.plan.cp for e in search(short).ranked} == {1}
    # a space naming its degrees is searched for them at any length
    assert {e.plan.cp for e in search(short, Space(cp=[2], zero=(3,))).ranked} == {2}


def test_layout_string_reads_cp() -> None:
    pb = Problem(LONG, PRESETS["h100"], 1, 8, 8)
    plan = parse_layout("cp=2,zero=3", pb)
    assert (plan.dp, plan.cp) == (4, 2) and "cp=2" in plan.label()
    with pytest.raises(ValueError, match="2\\*cp must divide the sequence length"):
        parse_layout("cp=8", Problem(dataclasses.replace(LONG, seq=24), PRESETS["h100"], 1, 8, 8))
