"""Calibrated CPU predictions against real runs on 4 local gloo ranks (2 virtual nodes x 2).

Calibration (``xirang-plan --calibrate cluster=local``) measures rates and the runtime's fixed
costs on a 2-layer probe model; the checks below run model ``tiny`` (4 layers), a shape the
calibration never saw. Tolerances are the issue's targets (step time 25%, peak RSS 20%) and
assume a quiet machine, as CI has; on a machine shared with other jobs step times drift.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from xirang_hpc.config.schema import ModelConfig, TrainConfig, XirangConfig
from xirang_hpc.config.validate import validate
from xirang_hpc.planner.local_check import candidates, load_cluster, measure

BIN = Path(sys.executable).parent
TINY = {"name": "tiny", "n_layer": 4, "n_head": 4, "d_model": 64, "d_ff": 256, "seq_len": 64}


@pytest.fixture(scope="module")
def calibrated(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("cal")
    out = tmp / "local-calibrated.yaml"
    r = subprocess.run([str(BIN / "xirang-plan"), "--calibrate", "--out", str(out), f"train.runs_root={tmp}/runs"],
                       cwd=tmp, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    return out


@pytest.mark.slow
def test_calibrated_predictions_match_two_layouts(calibrated: Path) -> None:
    cluster = load_cluster(calibrated)
    assert cluster.hardware["reserved_gb"] > 0.1  # the torch + gloo footprint was measured
    cfg = validate(XirangConfig(model=ModelConfig(**TINY), cluster=cluster,
                                train=TrainConfig(global_batch=32, warmup_steps=2, eval_batches=1)))
    cands = {name: (est, c) for name, est, c in candidates(cfg)}
    names = ["dp4", "fsdp:dp4"]  # plain DDP and FSDP2 (ZeRO-3): different mechanisms, both calibrated
    assert set(names) <= set(cands), sorted(cands)
    meas = measure([(n, cands[n][1]) for n in names], cluster.nodes, cluster.tasks_per_node, steps=5, rounds=2)
    report = []
    for n in names:
        est = cands[n][0]
        (step, peak) = meas[n]
        report.append(f"{n}: step {est.step_time:.3f} vs {step:.3f} s, peak {est.peak_memory / 2**20:.0f} vs "
                      f"{peak / 2**20:.0f} MiB (load {os.getloadavg()[0]:.1f})")
    # Peak memory does not depend on how busy the machine is; step time does, so its check (a
    # timing assertion) runs only on request, on a quiet machine: benchmarks/bench_planner.py --local
    # is where the step-time accuracy is measured and recorded.
    timing = os.environ.get("XIRANG_TIMING_TESTS") == "1"
    for n in names:
        est, (step, peak) = cands[n][0], meas[n]
        assert est.peak_memory == pytest.approx(peak, rel=0.20), report
        if timing:
            assert est.step_time == pytest.approx(step, rel=0.25), report


@pytest.mark.slow
def test_train_parallel_auto_runs_the_plan_and_records_measured(calibrated: Path, tmp_path: Path) -> None:
    conf = tmp_path / "conf" / "cluster"
    conf.mkdir(parents=True)
    (conf / "local-calibrated.yaml").write_text(calibrated.read_text())
    r = subprocess.run([str(BIN / "xirang-train"), f"hydra.searchpath=[file://{tmp_path / 'conf'}]",
                        "cluster=local-calibrated", "parallel=auto", "train.max_steps=12", "train.eval_batches=1",
                        "train.warmup_steps=2", "train.log_every=6",
                        f"train.runs_root={tmp_path}/runs"],
                       cwd=tmp_path, capture_output=True, text=True, timeout=400)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-3000:]
    assert "parallel=auto chose dp=" in out and "measured" in out
    plans = list((tmp_path / "runs").glob("*/plan.json"))
    assert len(plans) == 1
    rec = json.loads(plans[0].read_text())
    assert rec["hardware"]["reserved_gb"] > 0.1  # the calibrated preset, not the placeholder
    p = rec["predicted"]["plan"]
    assert p["dp"] * p["tp"] * p["pp"] == 4
    m = rec["measured"]
    assert m["tokens_per_s"] > 0 and m["step_s"] > 0
    assert m["predicted_step_s"] == pytest.approx(rec["predicted"]["time_s"]["total"])


def test_fit_overheads_recovers_the_terms_it_is_given() -> None:
    """Probe 'measurements' made by the cost model with known overheads are fitted back exactly, in order."""
    from xirang_hpc.config.schema import ModelConfig as MC
    from xirang_hpc.planner.cost import Problem, estimate
    from xirang_hpc.planner.formulas import Shape
    from xirang_hpc.planner.hardware import PRESETS
    from xirang_hpc.planner.probe import PROBE_BATCH, fit_overheads, plan_of, probe_layouts, probe_model

    truth = {"step_overhead_us": 900.0, "step_fixed_us": 4e3, "zero1_overhead_us": 20e3, "fsdp_unit_overhead_us": 30e3,
             "replicate_unit_overhead_us": 25e3, "tp_overhead_us": 3e3, "tp_overhead_us_per_mb": 40e3,
             "sp_overhead_us": 5e3, "pp_overhead_us": 7e3}
    hw0 = PRESETS["cpu"].scaled(bubble_exposed=0.4)  # derived from ranks per core, not fitted
    lays = probe_layouts(4, 2)
    assert list(lays) == ["dp", "dp_deep", "zero1", "fsdp", "replicate", "tp_narrow", "tp", "sp", "pp", "pp_deep"]

    def made(name: str) -> float:
        sh = Shape.from_model(MC(**probe_model(name)))
        return estimate(Problem(sh, hw0.scaled(**truth), 2, 2, PROBE_BATCH), plan_of(lays[name], PROBE_BATCH)).step_time

    measured = {n: made(n) for n in lays if n != "replicate"}
    # Replication (HSDP, shard 1) = the dp run plus 25 ms per FSDP unit (2 layers + root).
    measured["replicate"] = measured["dp"] + 3 * 25e-3
    got = fit_overheads(hw0, 2, 2, measured)
    assert set(got) == set(truth)
    for k, v in truth.items():
        assert got[k] == pytest.approx(v, rel=1e-6), k


def test_fit_overheads_pair_falls_back_to_one_non_negative_term() -> None:
    """When the two-probe solution would need a negative part, one term explains the residuals instead."""
    from xirang_hpc.planner.calibrate import bubble_exposed
    from xirang_hpc.planner.probe import _solve2

    assert (bubble_exposed(4, 2), bubble_exposed(2, 2), bubble_exposed(3, 2), bubble_exposed(8, 64)) == (
        0.0, 1.0, 0.5, 1.0)
    assert _solve2([(1.0, 2.0, 5.0), (1.0, 4.0, 9.0)]) == pytest.approx((1.0, 2.0))
    assert _solve2([(2.0, 0.0, 4.0), (4.0, 0.0, 8.0)]) == pytest.approx((2.0, 0.0))  # one unknown
    x, y = _solve2([(1.0, 1.0, -1.0), (1.0, 2.0, -1.0)])  # faster than the model: nothing to add
    assert (x, y) == (0.0, 0.0)
    x, y = _solve2([(3.0, 1.0, 3.0), (5.0, 1.0, 1.0)])  # solution (-1, 6): keep the better single term
    assert x >= 0 and y >= 0 and (x == 0 or y == 0)


def test_runtime_allows_follows_what_the_runtime_runs() -> None:
    from conftest import compose_cfg

    from xirang_hpc.config.validate import load_config
    from xirang_hpc.planner.auto import runtime_allows
    from xirang_hpc.planner.cost import Plan

    ok = runtime_allows(load_config(compose_cfg()))  # tiny, 2 x 2 ranks, global batch 32
    assert ok(Plan(dp=4, tp=1, pp=1, micro=8, zero=1))  # ZeRO-1 under DDP
    assert not ok(Plan(dp=2, tp=1, pp=2, micro=4, zero=1))  # pp > 1 replicates with FSDP2: no ZeRO-1
    assert ok(Plan(dp=2, tp=1, pp=2, micro=8))  # m = 2 microbatches for 2 stages
    assert not ok(Plan(dp=2, tp=1, pp=2, micro=16))  # m = 1 < pp: torch's 1F1B refuses it
