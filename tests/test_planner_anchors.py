"""The planner against the public rows of Narayanan et al. SC21 Table 1 (shared/anchors.md).

The A100 preset's three efficiency constants were fitted to these same four rows, so this checks
that the cost model can express all four at once with one set of constants (in-sample), not an
out-of-sample prediction. The published micro-batch size is not in the table; we take b=1, full
recomputation (their TFLOP/s count it, factor 96), no interleaving, no distributed optimizer.
"""

from __future__ import annotations

import dataclasses

import pytest

from xirang_hpc.planner.cost import Plan, Problem, estimate
from xirang_hpc.planner.formulas import Shape, iteration_flops, model_flops, narayanan_flops, total_params
from xirang_hpc.planner.published import STACKS
from xirang_hpc.planner.search import search

# params (B), heads, hidden, layers, TP, PP, GPUs, batch, TFLOP/s per GPU
ROWS = [
    (1.7, 24, 2304, 24, 1, 1, 32, 512, 137),
    (18.4, 48, 6144, 40, 8, 1, 256, 1024, 135),
    (145.6, 96, 12288, 80, 8, 8, 1536, 2304, 148),
    (1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 163),
]
# Megatron-LM 2021 materialized the attention scores (no fused attention kernel) and recomputed whole
# blocks (reentrant): the preset's compute constants with that stack's settings.
HW = STACKS[("a100-80gb", "megatron2021")]


def _shape(heads: int, hidden: int, layers: int) -> Shape:
    return Shape(layers=layers, hidden=hidden, heads=heads, seq=2048, vocab=51200, ffn=4 * hidden)


def _published(row: tuple) -> tuple[Problem, Plan]:
    _, a, h, nl, t, p, n, batch, _ = row
    pb = Problem(_shape(a, h, nl), HW, nodes=n // 8, per_node=8, global_batch=batch)
    return pb, Plan(dp=n // (t * p), tp=t, pp=p, micro=1, recompute="full")


@pytest.mark.parametrize("row", ROWS, ids=[f"{r[0]}B" for r in ROWS])
def test_param_count_matches_published(row: tuple) -> None:
    params_b, a, h, nl, *_ = row
    # The table rounds: 1.652B is printed as 1.7B, 1007.9B as 1008B.
    decimals = 0 if params_b >= 1000 else 1
    assert round(total_params(_shape(a, h, nl)) / 1e9, decimals) == params_b


@pytest.mark.parametrize("row", ROWS, ids=[f"{r[0]}B" for r in ROWS])
def test_flops_equal_narayanan_formula(row: tuple) -> None:
    _, a, h, nl, *_, batch, _ = row
    sh = _shape(a, h, nl)
    assert iteration_flops(sh, batch, "full") == pytest.approx(narayanan_flops(sh, batch, True), rel=1e-12)
    assert model_flops(sh, batch) == pytest.approx(narayanan_flops(sh, batch, False), rel=1e-12)
    # The recompute factor is 96 vs 72 on the layer part only.
    assert 1.30 < iteration_flops(sh, batch, "full") / model_flops(sh, batch) < 4 / 3


@pytest.mark.parametrize("row", ROWS, ids=[f"{r[0]}B" for r in ROWS])
def test_published_config_within_10_percent_and_fits_80gb(row: tuple) -> None:
    pb, plan = _published(row)
    est = estimate(pb, plan)
    assert est.tflops_per_gpu == pytest.approx(row[-1], rel=0.10)
    assert est.fits and est.peak_memory < 80 * 1024**3


def test_mean_error_at_most_5_percent() -> None:
    errs = [abs(estimate(*_published(r)).tflops_per_gpu / r[-1] - 1) for r in ROWS]
    assert sum(errs) / len(errs) <= 0.05, errs


@pytest.mark.parametrize("row", ROWS, ids=[f"{r[0]}B" for r in ROWS])
def test_recommended_plan_at_least_as_fast_as_published(row: tuple) -> None:
    pb, plan = _published(row)
    published = estimate(pb, plan)
    res = search(pb)
    assert res.best.fits
    assert res.best.tokens_per_s >= published.tokens_per_s
    # The published layout is searched and fits (with tp > 1 as its sequence-parallel twin, which
    # the search keeps instead: no more predicted time, less memory).
    twin = dataclasses.replace(plan, sp=plan.tp > 1)
    assert any(e.plan == twin for e in res.ranked)
    assert estimate(pb, twin).step_time <= published.step_time


def test_search_covers_1024_and_16384_gpus() -> None:
    sh = _shape(96, 12288, 96)  # GPT-3 175B
    r1 = search(Problem(sh, HW, nodes=128, per_node=8, global_batch=1536))
    r2 = search(Problem(sh, HW, nodes=2048, per_node=8, global_batch=16384))
    assert r1.evaluated > 1000 and r2.evaluated > 1000
    assert r1.best.fits and r2.best.fits
    # How long the search takes (targets: < 1 s and < 10 s) is benchmarks/bench_planner.py's job, not a test's.


# ---- published runs beyond Narayanan et al.: fit rows vs held-out rows (planner/published.py) ----

def test_mpt_shapes_match_the_published_parameter_counts() -> None:
    """The held-out rows' shapes are the models that ran: within 0.1% of llm-foundry's NumParams (seq 2048)."""
    from xirang_hpc.planner.published import _mpt

    published = {"125m": 125311488, "350m": 355985408, "760m": 760470528, "1b": 1315950592, "3b": 2651837440,
                 "7b": 6658859008, "13b": 12853954560, "30b": 29975214080}
    for size, n in published.items():
        assert total_params(_mpt(size, 2048)) == pytest.approx(n, rel=1e-3), size


def _stats(rows: list) -> tuple[int, float, float]:
    import statistics

    from xirang_hpc.planner.published import relative_errors

    errs = [abs(e) for e in relative_errors(rows)]
    return len(errs), statistics.mean(errs), max(errs)


def test_rows_that_set_the_constants_fit_within_their_recorded_accuracy() -> None:
    """In-sample, per stack (benchmarks/RESULTS.md, "Planner"): Narayanan 2.3% / 5.6% (4 rows),
    torchtitan 1.6% / 3.6% (3), llm-foundry A100 4.0% / 25.7% (20: the 760M rows at 512 and 1,024
    tokens run 25% below their own 2,048-token row), llm-foundry H100 1.8% / 6.3% (12), Megatron-LM H100
    6.1% / 24.1% (5: the 70B row, tp=8 pp=2, is predicted 24.1% slow)."""
    from xirang_hpc.planner.published import ALL

    def rows(stack: str, gpu: str) -> list:
        return [r for r in ALL if r.role == "fit" and r.stack == stack and r.gpu == gpu]

    for (stack, gpu), (n, mean, worst) in {("megatron2021", "a100-80gb"): (4, 0.025, 0.058),
                                          ("torchtitan", "a100-80gb"): (3, 0.017, 0.037),
                                          ("composer", "a100-80gb"): (20, 0.041, 0.258),
                                          ("composer", "h100"): (12, 0.018, 0.063),
                                          ("megatron-core", "h100"): (5, 0.061, 0.242)}.items():
        got = _stats(rows(stack, gpu))
        assert got[0] == n and got[1] <= mean and got[2] <= worst, (stack, gpu, got)


def test_held_out_rows_keep_their_recorded_accuracy() -> None:
    """Out of sample, nothing refitted (benchmarks/RESULTS.md): llm-foundry A100 rows of 2,048 to 32,768
    tokens mean 2.7%, max 9.6% (40 rows), H100 2.9%, 9.0% (39 rows); the 16 A100 rows first held out
    (2 of them now fit rows) less the excluded one: 2.3%, 4.5% (15 rows). MPT-30b at 8,192 tokens on 8
    GPUs is excluded from those statistics (published.py says why) and kept in the "every row" figures:
    A100 3.6% / 39.2% (41 rows), H100 3.6% / 32.8% (40). A change to the cost model that makes any of
    these worse fails here."""
    from xirang_hpc.planner.published import MPT_A100, MPT_H100, is_original_held_out

    a100_all = [r for r in MPT_A100 if r.role == "held-out"]
    h100_all = [r for r in MPT_H100 if r.role == "held-out"]
    a100 = [r for r in a100_all if not r.excluded]
    h100 = [r for r in h100_all if not r.excluded]
    first = [r for r in MPT_A100 if is_original_held_out(r) and not r.excluded]
    for rows, (n, mean, worst) in ((a100, (40, 0.028, 0.096)), (h100, (39, 0.029, 0.090)),
                                   (first, (15, 0.024, 0.046)), (a100_all, (41, 0.037, 0.393)),
                                   (h100_all, (40, 0.037, 0.329))):
        got = _stats(rows)
        assert got[0] == n and got[1] <= mean and got[2] <= worst, got
    # Exactly one row per GPU is excluded, the same configuration on both, with its reason.
    excluded = [r for r in a100_all + h100_all if r.excluded]
    assert [(r.gpu, r.name) for r in excluded] == [("a100-80gb", "MPT-30b seq 8192, full AC"),
                                                   ("h100", "MPT-30b seq 8192, full AC")]
    assert all("allocator" in r.excluded for r in excluded)


def test_megatron_h100_rows_tensor_and_pipeline_parallel_out_of_sample() -> None:
    """Megatron-LM's README table on H100 (tp 1-8, pp 1-16, 48-6,144 GPUs). Megatron-Core's three overlap
    constants are fitted on every other row by size from the smallest (1.7B, 16B, 70B, 177B, 462B); the four
    between (7.1B tp=2, 32B tp=8, 119B tp=8 pp=4, 314B tp=8 pp=8) are out of sample: mean 3.3%, max 6.7%
    (RESULTS.md; 3.2% before Megatron's fp32 gradients were held at 4 bytes, which leaves the 314B row's
    unpublished micro-batch 2 at 87.5 GiB and moves it to micro-batch 1, 0.5% slower). The shapes are the
    table's models, and every predicted plan keeps the published tp/pp/dp and fits in 80 GB."""
    from xirang_hpc.planner.published import MEGATRON_H100, _problem, hardware_for, plan_for

    sizes = [1.7, 7.1, 16, 32, 70, 119, 177, 314, 462]
    for r, billions in zip(MEGATRON_H100, sizes, strict=True):
        assert total_params(r.shape) / 1e9 == pytest.approx(billions, rel=0.03), r.name  # the table rounds
        plan = plan_for(r)
        assert (plan.tp, plan.pp, plan.dp) == (r.tp, r.pp, r.gpus // (r.tp * r.pp)) and plan.zero == 1
        assert estimate(_problem(r, hardware_for(r)), plan).fits
    held = [r for r in MEGATRON_H100 if r.role == "held-out"]
    assert [r.name.split()[1] for r in held] == ["7.1B", "32B", "119B", "314B"]
    n, mean, worst = _stats(held)
    assert n == 4 and mean <= 0.0331 and worst <= 0.067, (mean, worst)
    # Without the overlap terms every row is predicted slow (max 52.2%, 32B; 41.1% before the fp32 gradient
    # reduction and the refit H100 constants). Exposing the TP collectives and this runtime's ZeRO-1 again (the
    # planner's own costs) must bring that back.
    from xirang_hpc.planner.published import predict

    exposed = [predict(r, hardware_for(r).scaled(tp_comm_overlap=0.0, distributed_optimizer=0.0, dp_overlap=0.107,
                                                 comm_interference=0.442)) / r.value - 1 for r in MEGATRON_H100]
    assert max(map(abs, exposed)) == pytest.approx(0.522, abs=0.001) and all(e < 0 for e in exposed)


def test_rows_reduce_gradients_in_the_precision_their_software_used() -> None:
    """Composer FSDP's ``DEFAULT`` mixed precision (every H100 row and all A100 rows but MPT-70b, whose
    "MP Mode" column says ``PURE``), torchtitan's FSDP2 and Megatron-LM under bf16 reduce gradients in fp32:
    4 bytes per element on the wire; the weights are gathered in bf16 (published.py)."""
    from xirang_hpc.planner.published import ALL, hardware_for

    for r in ALL:
        hw = hardware_for(r)
        pure = r.stack == "composer" and r.gpu == "a100-80gb" and r.name.startswith("MPT-70b")
        # OPT's FSDP and DeepSpeed's 2021 ZeRO-3 runs reduced fp16 gradients in fp16.
        want = 2 if pure or r.stack in ("megatron2021", "metaseq", "deepspeed-zero3") else 4
        assert (hw.grad_comm_bytes, hw.weight_bytes) == (want, 2), r.name
    assert sum(1 for r in ALL if r.reduce_bytes) == 3


def test_multi_node_mpt_13b_on_h100_scales_as_published() -> None:
    """MPT-13b at 2,048 tokens, micro-batch 2, one microbatch a step, no checkpointing: llm-foundry's H100
    table gives 4,792 / 4,767 / 4,811 / 4,800 tokens/s/GPU on 8 / 16 / 32 / 64 GPUs. With fp32 gradients and
    NCCL's pipelined rings the predictions fall by 8.4% from 8 to 64 GPUs (the network's 320 GB/s per node
    against NVLink's 360 GB/s per GPU), where the sequential hierarchical model gives 24.5% (RESULTS.md)."""
    from xirang_hpc.planner.published import MPT_H100, hardware_for, predict

    rows = {r.gpus: r for r in MPT_H100 if r.name.startswith("MPT-13b seq 2048")}
    assert sorted(rows) == [8, 16, 32, 64]
    pred = {n: predict(r) for n, r in rows.items()}
    assert all(abs(pred[n] / rows[n].value - 1) < 0.08 for n in rows), pred
    assert 1 - pred[64] / pred[8] == pytest.approx(0.084, abs=0.005)
    sequential = {n: predict(r, hardware_for(r).scaled(pipelined_rings=0.0)) for n, r in rows.items()}
    assert sequential[8] == pytest.approx(pred[8]) and 1 - sequential[64] / sequential[8] > 0.2


def test_the_stored_fsdp_constants_are_what_the_fit_rows_give() -> None:
    """published.fit on the fit rows reproduces the constants the presets and stacks carry (so a changed
    cost model cannot keep stale constants), and no held-out row enters the fit."""
    from xirang_hpc.planner.published import (
        ALL,
        FSDP_FIT_FIELDS,
        H100_FIT_FIELDS,
        MEGATRON_CORE_FIT_FIELDS,
        fit_a100,
        fit_h100,
        fit_megatron_core,
    )

    a100 = fit_a100()
    for k in FSDP_FIT_FIELDS:
        assert a100[k] == pytest.approx(STACKS[("a100-80gb", "composer")].__getattribute__(k), rel=0.02, abs=0.01), k
    h100 = fit_h100(a100)
    for k in H100_FIT_FIELDS:
        assert h100[k] == pytest.approx(STACKS[("h100", "composer")].__getattribute__(k), rel=0.02, abs=0.01), k
    mc = fit_megatron_core()
    for k in MEGATRON_CORE_FIT_FIELDS:
        assert mc[k] == pytest.approx(STACKS[("h100", "megatron-core")].__getattribute__(k), rel=0.02, abs=0.01), k
    assert [r.role for r in ALL if r.stack == "megatron-core"] == ["fit", "held-out"] * 4 + ["fit"]
    # The fit rows of llm-foundry's tables are exactly the short (<= 1,024) and 65,536-token ones.
    mpt = [r for r in ALL if r.stack == "composer"]
    assert all((r.role == "fit") == (r.shape.seq <= 1024 or r.shape.seq == 65536) for r in mpt)
