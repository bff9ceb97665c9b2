"""Cost terms behind the planner's accuracy on published runs at scale, each against a hand computation from
its cited source: the softmax traffic of selective recomputation, fp32 gradients where the stack keeps them,
the DeepSpeed stack, the H100 attention rate, ZeRO-3 gathers at hundreds of GPUs; and the held-out statistics
of the published-runs harness, which no change may make worse."""

from __future__ import annotations

import dataclasses

import pytest

from xirang_hpc.planner.cost import Plan, Problem, estimate
from xirang_hpc.planner.formulas import Shape, layer_activation_bytes, layer_forward_flops
from xirang_hpc.planner.hardware import PRESETS

GPT_13B = Shape(layers=40, hidden=5120, heads=40, seq=2048, vocab=51200, ffn=4 * 5120)


def test_selective_recompute_pays_the_softmax_traffic_over_materialized_scores() -> None:
    """Korthikanti et al. 2022, Sec. 5: selective recomputation re-runs QK^T, softmax, dropout and the product
    with V. Over materialized scores (Megatron-LM 2021: no fused kernel) the re-run costs the attention FLOPs
    at the GEMM rate and one more memory-bound pass over the 5*a*s^2*b score bytes; a fused kernel re-runs
    them on chip and pays FLOPs only."""
    hw = PRESETS["a100-80gb"].scaled(flash_attention=0.0, kernel_overhead_us=0.0)
    pb = Problem(GPT_13B, hw, 1, 8, 8)
    none = estimate(pb, Plan(dp=1, tp=8, pp=1, micro=1, recompute="none"))
    sel = estimate(pb, Plan(dp=1, tp=8, pp=1, micro=1, recompute="selective"))
    s, b, a, t, h, n = 2048, 1, 40, 8, 5120, 40
    score_bytes = 5 * a * s * s * b / t  # Korthikanti's 5as/(ht) x sbh, 16-bit
    _, attn = layer_forward_flops(GPT_13B, s * b)
    eff = hw.gemm_efficiency * (h / t) / (h / t + hw.gemm_half_width)
    by_hand = n * (attn / t / (hw.peak_tflops * 1e12 * eff)
                   + hw.elementwise_traffic * score_bytes / (hw.mem_bw_gbs * 1e9))
    per_mb = sel.time["compute"] / sel.microbatches - none.time["compute"] / none.microbatches
    assert per_mb == pytest.approx(by_hand, rel=1e-9)
    assert layer_activation_bytes(GPT_13B, 1, t, False, "none", 2) - layer_activation_bytes(
        GPT_13B, 1, t, False, "selective", 2) == pytest.approx(score_bytes)
    # Fused attention: selective recomputation is what the kernel does anyway; nothing more is charged.
    fused = Problem(GPT_13B, hw.scaled(flash_attention=1.0), 1, 8, 8)
    assert estimate(fused, Plan(dp=1, tp=8, pp=1, micro=1, recompute="selective")).time["compute"] == pytest.approx(
        estimate(fused, Plan(dp=1, tp=8, pp=1, micro=1, recompute="none")).time["compute"])


def test_megatron_and_deepspeed_keep_fp32_gradients() -> None:
    """Megatron-LM docs, "Distributed optimizer": bf16 weights with fp32 gradients hold 18 bytes per parameter
    (2 + 4 + 12), 6 + 12/d with the distributed optimizer; DeepSpeed's BF16_Optimizer accumulates into an fp32
    buffer the size of the weights. This runtime's presets keep 2-byte gradients."""
    from xirang_hpc.planner.published import STACKS

    for key in (("h100", "megatron-core"), ("a100-80gb", "deepspeed"), ("a100-40gb", "deepspeed")):
        assert STACKS[key].grad_bytes == 4, key
    assert PRESETS["h100"].grad_bytes == PRESETS["a100-80gb"].grad_bytes == 2
    hw = STACKS[("h100", "megatron-core")]
    pb = Problem(GPT_13B, hw, 6, 8, 48)
    d = 12
    est = estimate(pb, Plan(dp=d, tp=4, pp=1, micro=1, zero=1, sp=True))
    params = est.memory["params"] / 2  # bf16 weights, whole on every data-parallel rank
    assert est.memory["grads"] == pytest.approx(4 * params)
    assert est.memory["params"] + est.memory["grads"] + est.memory["optimizer"] == pytest.approx(
        (6 + 12 / d) * params)


def _stats(rows: list) -> tuple[int, float, float]:
    from xirang_hpc.planner.published import relative_errors

    errs = [abs(e) for e in relative_errors(rows)]
    return len(errs), sum(errs) / len(errs), max(errs)


# Held-out statistics per (stack, GPU), as recorded in benchmarks/RESULTS.md ("Planner"): (rows, mean |error|,
# max |error|). The llm-foundry groups are what they were before the DeepSpeed and metaseq stacks, fp32 gradients
# and the H100 attention rate; Megatron-Core's moved from 3.19% / 6.67% (its 314B row's unpublished micro-batch 2
# no longer fits once fp32 gradients take 4 bytes). BLOOM was over-predicted by 13.4% on the Megatron-LM 2021
# stack and the preset's network, the only A100 tensor/pipeline stack before; Llama 3 405B under-predicted by
# 14.9% and 15.7% with the H100 attention rate fitted on llm-foundry's 2023 rows and 2-byte gradients; Narayanan
# et al.'s 530B ZeRO-3 rows over-predicted by 35%, 70% and 184% on the Megatron-LM 2021 stack with NCCL's
# multi-channel rings; OPT-175B under-predicted by 10.1% on torchtitan's FSDP stack (14.7% on its own).
HELD_OUT_RECORD = {
    ("composer", "a100-80gb"): (40, 0.02714, 0.09590),
    ("composer", "h100"): (39, 0.02855, 0.08996),
    ("megatron-core", "h100"): (4, 0.03310, 0.06674),
    ("deepspeed", "a100-80gb"): (1, 0.08506, 0.08506),
    ("metaseq", "a100-80gb"): (1, 0.14655, 0.14655),
    ("llama3", "h100"): (2, 0.11066, 0.11737),
    ("deepspeed-zero3", "a100-80gb"): (3, 0.04737, 0.09692),
    ("megatron2021", "a100-80gb"): (6, 0.01479, 0.02924),
}


def test_held_out_statistics_are_no_worse_than_recorded() -> None:
    """Every held-out group (the rows excluded by name apart) keeps its row count and is at most as wrong as
    recorded, mean and max, to 0.01 points; fit rows and held-out rows stay apart."""
    from xirang_hpc.planner.published import ALL

    groups: dict[tuple[str, str], list] = {}
    for r in ALL:
        assert r.role in ("fit", "held-out"), r.name
        if r.role == "held-out" and not r.excluded:
            groups.setdefault((r.stack, r.gpu), []).append(r)
    assert set(groups) == set(HELD_OUT_RECORD)
    for key, (n, mean, worst) in HELD_OUT_RECORD.items():
        got = _stats(groups[key])
        assert got[0] == n and got[1] <= mean + 1e-4 and got[2] <= worst + 1e-4, (key, got)


def test_deepspeed_and_metaseq_rows_are_held_out_and_bloom_improves_on_megatron_2021() -> None:
    """BLOOM-176B and OPT-175B set nothing: their stacks are built from constants fitted on other rows, and
    BLOOM's error on its own stack (DeepSpeed's fp32 gradients, exposed all-reduce and weight gather, Jean
    Zay's 4 x 100 Gb/s Omni-Path) is smaller than on the Megatron-LM 2021 stack over the preset's network."""
    from xirang_hpc.planner.published import BLOOM, OPT, _problem, hardware_for, plan_for, predict

    assert all(r.role == "held-out" for r in BLOOM + OPT)
    bloom = BLOOM[0]
    assert (bloom.tp, bloom.pp, bloom.gpus // (bloom.tp * bloom.pp), bloom.global_batch) == (4, 12, 8, 2048)
    hw = hardware_for(bloom)
    assert (hw.inter_bw_gbs, hw.inter_nics, hw.grad_bytes, hw.dp_overlap) == (40.0, 4, 4, 0.0)
    old = dataclasses.replace(bloom, stack="megatron2021", inter_gbps=0.0, nics=0)
    assert abs(predict(bloom) / bloom.value - 1) < abs(predict(old) / bloom.value - 1)
    assert predict(old) / bloom.value - 1 == pytest.approx(0.134, abs=0.001)
    # One BLOOM replica in 48 GPUs used about 60 GB each (the model page): 2-byte gradients put it at 36 GiB,
    # BF16_Optimizer's fp32 ones at 45 GiB, the rest being the allocator's cache and DeepSpeed's buffers.
    mem = estimate(_problem(bloom, hw), plan_for(bloom)).memory
    assert mem["total"] / 2**30 == pytest.approx(45.0, abs=0.1)
    assert mem["grads"] == pytest.approx(2 * mem["params"])
    opt = OPT[0]
    plan = plan_for(opt)
    assert (plan.tp, plan.dp, plan.zero, plan.recompute) == (8, 124, 3, "full")


def test_llama3_405b_rows_gain_from_the_published_h100_attention_rate() -> None:
    """Llama 3 405B (Table 4: 430 and 400 model TFLOP/s per GPU at dp 64 and 128), at its published split (16
    stages x 8 chunks, the first chunk the embedding only, the last the head only), is predicted 10.4% and 11.7%
    low with FlashAttention-2's published H100 rate (335 of 989 TFLOP/s), 15.6% and 16.7% with the 0.184 fitted on
    llm-foundry's 2023 H100 rows; the drop from dp 64 to dp 128 (fewer microbatches per step, a larger bubble
    share) is predicted 8% where the paper measured 7%."""
    from xirang_hpc.planner.published import LLAMA3, hardware_for, plan_for, predict

    assert PRESETS["h100"].attn_efficiency == pytest.approx(335 / 989, abs=5e-4)
    for r, now, before in zip(LLAMA3, (-0.104, -0.117), (-0.156, -0.167), strict=True):
        assert r.role == "held-out" and r.global_batch == 2048  # 16M tokens of 8,192
        assert predict(r) / r.value - 1 == pytest.approx(now, abs=0.001)
        old = hardware_for(r).scaled(attn_efficiency=0.184)
        assert predict(r, old) / r.value - 1 == pytest.approx(before, abs=0.001)
        plan = plan_for(r)
        assert (plan.tp, plan.pp, plan.dp, plan.zero, plan.v, plan.ends_as_layers) == (8, 16, r.gpus // 128, 2, 8,
                                                                                        True)
    assert 1 - predict(LLAMA3[1]) / predict(LLAMA3[0]) == pytest.approx(0.084, abs=0.005)


def test_llama3_405b_without_recomputation_by_hand() -> None:
    """The published layout without recomputation, rank by rank. Rank 0 holds the embedding and 7 one-block
    chunks after an empty one: 7 x 16 = 112 block-microbatches in flight. Rank 1 holds 8 one-block chunks and runs
    2*14 + 7*16 = 140 warm-up forwards (m = 32 at dp 64): 141 in flight, the most of any rank, beside its 8
    blocks' bf16 weights and fp32 gradients whole (FSDP under the pipeline) and 1/64 of the optimizer state:
    91.6 GiB, over the 80. At dp 128 (m = 16) every rank up to 7 runs its 128 forwards first: 84.7 GiB. So the
    planner keeps full recomputation for both rows (the Megatron-order warm-up of rank 1, not rank 0's, binds)."""
    from xirang_hpc.planner.cost import GiB
    from xirang_hpc.planner.formulas import layer_params
    from xirang_hpc.planner.published import LLAMA3, _problem, hardware_for, plan_for

    for r, held, total in zip(LLAMA3, (141, 128), (91.6, 84.7), strict=True):
        hw = hardware_for(r)
        plan = dataclasses.replace(plan_for(r), recompute="none")
        est = estimate(_problem(r, hw), plan)
        d = plan.dp
        per = layer_activation_bytes(r.shape, 1, 8, True, "none", 2, flash=True)
        assert est.memory["activations"] == pytest.approx(held * per)
        params = 8 * layer_params(r.shape) / 8
        states = params * (2 * (1 + 1 / d) + 4 * (1 + 1 / d) + 12 / d)
        assert est.peak_memory == pytest.approx(held * per + states + hw.reserved_gb * GiB)
        assert est.peak_memory / GiB == pytest.approx(total, abs=0.05) and not est.fits


def test_a_ring_through_fewer_nics_crosses_nodes_at_their_share_by_hand() -> None:
    """Every link of a ring carries (p-1)/p of an all-gather's bytes, so c rings on c NICs leave a node at c NICs'
    bandwidth: 2(p-m)a_l + 2(m-1)a_g + 2(p-1)/p * n * max((k-1)/k * b_l, b_g / c), b_g one of the node's
    ``flows`` streams (all-reduce-equivalent; an all-gather is half). c = k is NCCL's multi-channel ring."""
    from xirang_hpc.planner import comm

    links = comm.Links(a_intra=3e-6, b_intra=1 / 240e9, a_inter=8e-6, b_inter_node=1 / 160e9, nics=8)
    n, k, m = 3.6e9, 8, 48
    p = k * m
    lat = 2 * (p - m) * 3e-6 + 2 * (m - 1) * 8e-6
    b_g = 8 / 160e9  # one of 8 flows: a single NIC's 20 GB/s
    assert comm.pipelined_ring(n, k, m, links, flows=8, channels=1) == pytest.approx(
        lat + 2 * (p - 1) / p * n * b_g)
    assert comm.pipelined_ring(n, k, m, links, flows=8, channels=2) == pytest.approx(
        lat + 2 * (p - 1) / p * n * b_g / 2)
    assert comm.pipelined_ring(n, k, m, links, flows=8) == comm.pipelined_ring(n, k, m, links, flows=8, channels=8)
    assert comm.pipelined_ring(n, k, m, links, flows=8) == pytest.approx(lat + 2 * (p - 1) / p * n * b_g / 8)


def test_deepspeed_zero3_at_hundreds_of_gpus_fit_on_175b_held_out_on_530b() -> None:
    """Narayanan et al. SC21 Table 2: ZeRO-3 without model parallelism halves its TFLOP/s per GPU as the GPUs double
    at a fixed batch (144, 88, 44 for 175B on 384-1,536 A100s): the step is the gathers' time, constant in dp. With
    NCCL's multi-channel rings the planner over-predicted the 530B rows by 35-184%; the stack's gathers through one
    NIC per node and DeepSpeed's prefetch hiding nearly a whole pass, both fitted on the 175B rows only, predict the
    530B rows within 10%. The stored constants are what the fit gives, and no 530B row enters it."""
    from xirang_hpc.planner.published import (
        _DEEPSPEED_ZERO3_FIT,
        NARAYANAN_ZERO3,
        STACKS,
        fit_deepspeed_zero3,
        predict,
    )

    got = fit_deepspeed_zero3()
    assert got["sharded_ring_channels"] == _DEEPSPEED_ZERO3_FIT["sharded_ring_channels"] == 1.0
    assert got["dp_overlap"] == pytest.approx(_DEEPSPEED_ZERO3_FIT["dp_overlap"], abs=0.01)
    assert [r.role for r in NARAYANAN_ZERO3] == ["fit"] * 3 + ["held-out"] * 3
    assert all(r.shape.layers == 96 for r in NARAYANAN_ZERO3[:3]) and all(r.accum == 1 for r in NARAYANAN_ZERO3)
    held = NARAYANAN_ZERO3[3:]
    assert all(abs(predict(r) / r.value - 1) < 0.10 for r in held)
    before = [predict(dataclasses.replace(r, stack="megatron2021")) / r.value - 1 for r in held]
    assert before == pytest.approx([0.346, 0.701, 1.836], abs=0.002)
    rings = STACKS[("a100-80gb", "deepspeed-zero3")].scaled(sharded_ring_channels=0.0)
    assert all(predict(r, rings) / r.value - 1 > 0.4 for r in held)
    # The presets keep NCCL's multi-channel rings: nothing of this stack leaks into this runtime's plans.
    assert all(hw.sharded_ring_channels == 0.0 for hw in PRESETS.values())


def test_tensor_and_pipeline_parallelism_ranks_ahead_of_zero3_at_every_published_size() -> None:
    """Narayanan et al. SC21 Table 2: PTD-P is faster per GPU than ZeRO-3 at every size (175B on 384-1,536 GPUs,
    530B on 560-2,240 against 640-2,240), by 6% to 3.2x. The planner, each row on its own stack, ranks them so,
    and the PTD-P rows, held out, are within 3% (their constants come from Table 1's fit rows)."""
    from xirang_hpc.planner.published import NARAYANAN_PTDP, NARAYANAN_ZERO3, predict

    assert all(r.role == "held-out" and r.stack == "megatron2021" for r in NARAYANAN_PTDP)
    for ptdp, zero3 in zip(NARAYANAN_PTDP, NARAYANAN_ZERO3, strict=True):
        assert ptdp.value > zero3.value and predict(ptdp) > predict(zero3), (ptdp.name, zero3.name)
        assert abs(predict(ptdp) / ptdp.value - 1) < 0.03, ptdp.name
