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
from xirang_hpc.planner.hardware import PRESETS
from xirang_hpc.planner.search import search

# params (B), heads, hidden, layers, TP, PP, GPUs, batch, TFLOP/s per GPU
ROWS = [
    (1.7, 24, 2304, 24, 1, 1, 32, 512, 137),
    (18.4, 48, 6144, 40, 8, 1, 256, 1024, 135),
    (145.6, 96, 12288, 80, 8, 8, 1536, 2304, 148),
    (1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 163),
]
# Megatron-LM 2021 materialized the attention scores (no fused attention kernel).
HW = PRESETS["a100-80gb"].scaled(flash_attention=0.0)


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


def test_rows_that_set_the_constants_are_within_5_percent_on_average() -> None:
    import statistics

    from xirang_hpc.planner.published import ALL, relative_errors

    errs = relative_errors([r for r in ALL if r.role == "fit"])
    assert len(errs) == 7 and statistics.mean(map(abs, errs)) <= 0.05 and max(map(abs, errs)) <= 0.10, errs


def test_held_out_rows_keep_their_recorded_accuracy() -> None:
    """Out of sample (16 MPT rows, nothing refitted): mean |error| 8.2%, max 25.9% when recorded in
    benchmarks/RESULTS.md. A change to the cost model that makes them worse fails here."""
    import statistics

    from xirang_hpc.planner.published import ALL, relative_errors

    errs = relative_errors([r for r in ALL if r.role == "held-out"])
    assert len(errs) == 16
    assert statistics.mean(map(abs, errs)) <= 0.09 and max(map(abs, errs)) <= 0.27, errs
