"""Interval tuner: Daly's formula, bounds, MTBF from history, and a fault-injection simulation."""

from __future__ import annotations

import math

import pytest

from xirang_hpc.checkpoint.tuner import (
    IntervalTuner,
    daly_interval,
    expected_waste,
    simulate_waste,
    young_interval,
)


def test_daly_formula_values():
    # delta = 60 s, M = 3 h: sqrt(2*60*10800) = 1138.4; Daly's correction terms on top, minus delta.
    d, m = 60.0, 10800.0
    r = d / (2 * m)
    assert daly_interval(d, m) == pytest.approx(math.sqrt(2 * d * m) * (1 + math.sqrt(r) / 3 + r / 9) - d)
    assert daly_interval(d, m) == pytest.approx(1098.4, abs=0.5)
    assert young_interval(d, m) == pytest.approx(1138.4, abs=0.1)
    assert daly_interval(500.0, 200.0) == 200.0  # delta >= 2M: checkpoint every M
    assert daly_interval(0.0, 100.0) == 0.0


def test_tuner_bounded_by_persist_and_adapts():
    t = IntervalTuner(mtbf_s=3600.0, smoothing=1.0)
    t.observe(stall_s=0.5, persist_s=2.0, step_s=0.1)
    daly = daly_interval(0.5, 3600.0)
    assert t.interval_s() == pytest.approx(daly) and t.interval_steps() == round(daly / 0.1)
    t.observe(stall_s=0.01, persist_s=30.0, step_s=0.1)  # persist dominates: never save faster than it commits
    assert t.interval_s() == 30.0 and t.interval_steps() == 300


def test_mtbf_from_the_runs_own_restarts():
    t = IntervalTuner(mtbf_s=86400.0, history=[0.0, 3600.0, 7200.0, 10800.0])
    assert t.mtbf() == (3600.0, "run history (3 interruptions)")
    assert IntervalTuner(mtbf_s=86400.0, history=[0.0, 50.0]).mtbf()[1].startswith("config")


@pytest.mark.parametrize("delta,mtbf", [(60.0, 3 * 3600.0), (5.0, 7.9 * 3600.0), (300.0, 3600.0)])
def test_daly_interval_is_within_10pct_of_the_simulated_optimum(delta, mtbf):
    """Random failures at the given MTBF: the tuned interval's simulated waste is within 10% of the best
    interval found by sweeping (same random failures for every candidate)."""
    work = 30 * mtbf
    tuned = IntervalTuner(mtbf_s=mtbf, smoothing=1.0)
    tuned.observe(stall_s=delta, persist_s=0.0, step_s=1.0)
    t_star = tuned.interval_s()
    grid = [t_star * 2 ** (k / 4) for k in range(-12, 13)]
    sims = {t: simulate_waste(t, delta, mtbf, work, seed=7, trials=60) for t in grid}
    best_t = min(sims, key=sims.get)
    assert sims[t_star] <= 1.10 * sims[best_t], (t_star, sims[t_star], best_t, sims[best_t])
    # ... and the sweep really has a minimum: far-off intervals are clearly worse.
    assert sims[grid[0]] > 1.3 * sims[t_star] and sims[grid[-1]] > 1.3 * sims[t_star]
    # The first-order model's prediction is in the simulation's neighbourhood.
    assert expected_waste(t_star, delta, mtbf) == pytest.approx(sims[t_star], rel=0.35)
