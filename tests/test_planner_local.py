"""Calibrated CPU predictions against real runs on 4 local gloo ranks (2 virtual nodes x 2).

Calibration (``xirang-plan --calibrate cluster=local``) measures rates and the runtime's fixed
costs on a 2-layer probe model; the checks below run model ``tiny`` (4 layers), a shape the
calibration never saw. Tolerances are the issue's targets (step time 25%, peak RSS 20%) and
assume a quiet machine, as CI has; on a machine shared with other jobs step times drift.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from xirang_hpc.config.schema import ClusterConfig, ModelConfig, TrainConfig, XirangConfig
from xirang_hpc.config.validate import validate
from xirang_hpc.planner.hardware import hardware_for
from xirang_hpc.planner.local_check import candidates, load_cluster, measure

BIN = Path(sys.executable).parent
TINY = {"name": "tiny", "n_layer": 4, "n_head": 4, "d_model": 64, "d_ff": 256, "seq_len": 64}


@pytest.fixture
def calibrated(calibrated_preset: Path) -> Path:
    """``xirang-plan --calibrate`` of this machine (conftest: measured once per session)."""
    return calibrated_preset


@pytest.mark.slow
def test_calibrated_predictions_match_two_layouts(calibrated: Path) -> None:
    cluster = load_cluster(calibrated)
    assert cluster.hardware["reserved_gb"] > 0.1  # the torch + gloo footprint was measured
    cfg = validate(XirangConfig(model=ModelConfig(**TINY), cluster=cluster,
                                train=TrainConfig(global_batch=32, warmup_steps=2, eval_batches=1)))
    cands = {name: (est, c) for name, est, c in candidates(cfg)}
    names = ["dp4", "fsdp:dp4"]  # plain DDP and FSDP2 (ZeRO-3): different mechanisms, both calibrated
    assert set(names) <= set(cands), sorted(cands)
    # Step time is checked only on request (below); peak memory is the same in every round, so one round does.
    timing = os.environ.get("XIRANG_TIMING_TESTS") == "1"
    meas = measure([(n, cands[n][1]) for n in names], cluster.nodes, cluster.tasks_per_node, steps=5,
                   rounds=2 if timing else 1)
    report = []
    for n in names:
        est = cands[n][0]
        (step, peak) = meas[n]
        report.append(f"{n}: step {est.step_time:.3f} vs {step:.3f} s, peak {est.peak_memory / 2**20:.0f} vs "
                      f"{peak / 2**20:.0f} MiB (load {os.getloadavg()[0]:.1f})")
    # Peak memory does not depend on how busy the machine is; step time does, so its check (a
    # timing assertion) runs only on request, on a quiet machine: benchmarks/bench_planner.py --local
    # is where the step-time accuracy is measured and recorded.
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
                       cwd=tmp_path, capture_output=True, text=True, timeout=900)
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

    truth = {"step_overhead_us": 900.0, "step_fixed_us": 4e3, "dp_overhead_us_per_mb": 2e3, "zero1_overhead_us": 700.0,
             "fsdp_unit_overhead_us": 30e3, "fsdp_overhead_us_per_mb": 9e3, "replicate_unit_overhead_us": 25e3,
             "tp_overhead_us": 3e3, "tp_overhead_us_per_mb": 40e3, "sp_overhead_us": 5e3, "pp_overhead_us": 7e3}
    hw0 = PRESETS["cpu"].scaled(bubble_exposed=0.4)  # derived from ranks per core, not fitted
    lays = probe_layouts(4, 2)
    assert list(lays) == ["dp", "dp_deep", "dp_wide", "zero1", "fsdp", "fsdp_wide", "replicate", "pp", "pp_deep",
                          "tp_narrow", "tp", "sp"]
    assert lays["pp"] == {"dp": 1, "pp": 4, "microbatches": 4} and lays["tp"] == {"dp": 1, "tp": 2, "pp": 2,
                                                                                    "microbatches": 2}

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


def test_calibration_rounds_are_the_probe_runs_per_layout(monkeypatch, tmp_path) -> None:
    """``xirang-plan --calibrate --rounds N``: each probe layout is trained N times (the median is kept)."""
    from types import SimpleNamespace

    from xirang_hpc.planner import probe
    from xirang_hpc.planner.hardware import PRESETS

    calls: list[str] = []
    monkeypatch.setattr(probe, "layer_times", lambda model, reps: (1e-3, 2e-3))
    monkeypatch.setattr(probe, "ensure_data", lambda folder, rank: tmp_path)
    monkeypatch.setattr(probe, "time_layout",
                        lambda cfg, topo, data, steps: calls.append(cfg.model.name) or (0.01, 2.0**28))
    topo = SimpleNamespace(num_nodes=2, local_world_size=2, world_size=4, rank=0)
    said: list[str] = []
    for rounds in (1, 2):
        calls.clear()
        probe.measure_overheads(PRESETS["cpu"], topo, tmp_path, say=said.append, rounds=rounds)
        assert len(calls) == rounds * len(probe.probe_layouts(4, 2)), calls


def test_fit_overheads_pair_falls_back_to_one_non_negative_term() -> None:
    """When the exact solution would need a negative part, the others explain the residuals instead."""
    from xirang_hpc.planner.calibrate import bubble_exposed
    from xirang_hpc.planner.probe import nnls

    assert (bubble_exposed(4, 2), bubble_exposed(2, 2), bubble_exposed(3, 2), bubble_exposed(8, 64)) == (
        0.0, 1.0, 0.5, 1.0)
    assert nnls([(1.0, 2.0, 5.0), (1.0, 4.0, 9.0)]) == pytest.approx((1.0, 2.0))
    assert nnls([(2.0, 0.0, 4.0), (4.0, 0.0, 8.0)]) == pytest.approx((2.0, 0.0))  # one unknown
    assert nnls([(1.0, 1.0, -1.0), (1.0, 2.0, -1.0)]) == (0.0, 0.0)  # faster than the model: nothing to add
    x, y = nnls([(3.0, 1.0, 3.0), (5.0, 1.0, 1.0)])  # solution (-1, 6): keep the better single term
    assert x >= 0 and y >= 0 and (x == 0 or y == 0)
    # Three unknowns, two rows: the feasible subset with the least residual (here exact with two terms).
    got = nnls([(1.0, 1.0, 0.0, 3.0), (2.0, 1.0, 0.0, 4.0)])
    assert got == pytest.approx((1.0, 2.0, 0.0))
    # Over-determined: least squares over all three rows.
    assert nnls([(1.0, 0.0, 2.0), (0.0, 1.0, 3.0), (1.0, 1.0, 5.0)]) == pytest.approx((2.0, 3.0))


def test_runtime_allows_follows_what_the_runtime_runs() -> None:
    from conftest import compose_cfg

    from xirang_hpc.config.validate import load_config
    from xirang_hpc.planner.auto import runtime_allows
    from xirang_hpc.planner.cost import Plan

    ok = runtime_allows(load_config(compose_cfg()))  # tiny, 2 x 2 ranks, global batch 32
    assert ok(Plan(dp=4, tp=1, pp=1, micro=8, zero=1))  # ZeRO-1 under DDP
    assert ok(Plan(dp=2, tp=1, pp=2, micro=4, zero=1))  # ZeRO-1 over FSDP2 replication under a pipeline
    assert ok(Plan(dp=2, tp=1, pp=2, micro=4, zero=2))  # ZeRO-2 (FSDP2 keeping weights for the backward)
    assert ok(Plan(dp=2, tp=1, pp=2, micro=8))  # m = 2 microbatches for 2 stages
    assert not ok(Plan(dp=2, tp=1, pp=2, micro=16))  # m = 1 < pp: torch's 1F1B refuses it


def test_fit_layers_recovers_kernel_overhead_and_efficiency() -> None:
    """Per-layer times made by the cost model's own layer formula give back its three fitted terms."""
    from xirang_hpc.config.schema import ModelConfig as MC
    from xirang_hpc.planner.cost import Plan, Problem, estimate
    from xirang_hpc.planner.formulas import Shape
    from xirang_hpc.planner.hardware import PRESETS
    from xirang_hpc.planner.probe import ATTN_MODEL, DISPATCH_MODEL, LAYER_MODEL, PROBE_BATCH, PROBE_MODEL, fit_layers

    truth = PRESETS["cpu"].scaled(gemm_half_width=20.0, kernel_overhead_us=250.0, gemm_efficiency=0.6,
                                  attn_score_ns=3.0, microbatch_overhead_us=0.0)

    def per_layer(model: dict) -> float:
        # Two layers minus one: the cost model's own per-layer compute for one microbatch.
        def compute(n: int) -> float:
            sh = Shape.from_model(MC(**{**model, "n_layer": n}))
            return estimate(Problem(sh, truth, 1, 1, PROBE_BATCH), Plan(dp=1, tp=1, pp=1, micro=PROBE_BATCH)
                            ).time["compute"]
        return compute(2) - compute(1)

    models = (DISPATCH_MODEL, PROBE_MODEL, ATTN_MODEL, LAYER_MODEL)
    got = fit_layers(PRESETS["cpu"].scaled(gemm_half_width=20.0), [(m, per_layer(m), 1.0) for m in models])
    assert got["kernel_overhead_us"] == pytest.approx(250.0, rel=1e-6)
    assert got["gemm_efficiency"] == pytest.approx(0.6, rel=1e-6)
    assert got["attn_score_ns"] == pytest.approx(3.0, rel=1e-6)
    assert got["microbatch_overhead_us"] > 0


def test_hardware_fractions_and_per_tensor_costs() -> None:
    """A fraction above 1 is refused by name; ZeRO-1's broadcast cost grows with the tensors a rank holds."""
    from xirang_hpc.config.errors import ConfigError
    from xirang_hpc.config.schema import ClusterConfig
    from xirang_hpc.planner.cost import Plan, Problem, estimate
    from xirang_hpc.planner.formulas import Shape
    from xirang_hpc.planner.hardware import PRESETS, hardware_for

    with pytest.raises(ConfigError, match="cluster.hardware.bubble_exposed.*0 to 1"):
        hardware_for(ClusterConfig(gpus_per_node=0, hardware={"bubble_exposed": 1.5}))
    hw = PRESETS["cpu"]
    plan0, plan1 = Plan(dp=4, tp=1, pp=1, micro=2), Plan(dp=4, tp=1, pp=1, micro=2, zero=1)

    def zero1_extra(layers: int, per_tensor_us: float) -> float:
        sh = Shape(layers=layers, hidden=64, heads=4, seq=64, vocab=256, ffn=256)
        h = hw.scaled(zero1_overhead_us=per_tensor_us)
        pb = Problem(sh, h, 2, 2, 8)
        return estimate(pb, plan1).time["dp_comm"] - estimate(Problem(sh, h.scaled(zero1_overhead_us=0.0), 2, 2, 8),
                                                               plan1).time["dp_comm"]

    assert zero1_extra(2, 1000.0) < zero1_extra(4, 1000.0)
    assert zero1_extra(4, 1000.0) == pytest.approx(2 * zero1_extra(4, 500.0))
    # The measured per-parameter optimizer cost replaces the bandwidth bound only when it is larger.
    sh = Shape(layers=2, hidden=64, heads=4, seq=64, vocab=256, ffn=256)
    slow = estimate(Problem(sh, hw.scaled(optimizer_ns_per_param=1e3), 2, 2, 8), plan0).time["optimizer"]
    base = estimate(Problem(sh, hw, 2, 2, 8), plan0).time["optimizer"]
    assert slow > base


def test_fit_memory_recovers_footprint_and_fsdp_buffers() -> None:
    """Peaks made by the memory model with a known footprint and FSDP buffer factor are fitted back."""
    from xirang_hpc.config.schema import ModelConfig as MC
    from xirang_hpc.planner.cost import GiB, Problem, estimate
    from xirang_hpc.planner.formulas import Shape
    from xirang_hpc.planner.hardware import PRESETS
    from xirang_hpc.planner.probe import PROBE_BATCH, fit_memory, plan_of, probe_layouts, probe_model

    truth = PRESETS["cpu"].scaled(reserved_gb=0.35, fsdp_buffer_factor=6.0)
    lays = probe_layouts(4, 2)
    peaks = {n: estimate(Problem(Shape.from_model(MC(**probe_model(n))), truth, 2, 2, PROBE_BATCH),
                         plan_of(lays[n], PROBE_BATCH)).peak_memory for n in ("dp", "fsdp_wide")}
    got = fit_memory(PRESETS["cpu"], 2, 2, peaks)
    assert got["reserved_gb"] == pytest.approx(0.35, rel=1e-6)
    assert got["fsdp_buffer_factor"] == pytest.approx(6.0, rel=1e-6)
    assert peaks["dp"] / GiB > 0.35


@pytest.mark.slow
def test_calibrate_local_cluster_writes_usable_preset(calibrated: Path) -> None:
    out = calibrated  # the preset `xirang-plan --calibrate --out ... --rounds 1` wrote
    assert out.read_text().startswith("# Measured by `xirang-plan --calibrate` on ") and ", --rounds 1)" in \
        out.read_text().splitlines()[0]
    data = OmegaConf.to_container(OmegaConf.load(out))
    assert data["name"] == "local-calibrated" and data["gpu"] == "cpu"
    hw = data["hardware"]
    for key in ("peak_tflops", "mem_bw_gbs", "intra_bw_gbs", "intra_latency_us", "inter_bw_gbs", "inter_latency_us"):
        assert hw[key] > 0, key
    fields = {f.name for f in dataclasses.fields(ClusterConfig)}
    cluster = ClusterConfig(**{k: v for k, v in data.items() if k in fields})
    measured = hardware_for(cluster)
    assert measured.peak_tflops == pytest.approx(hw["peak_tflops"])
    assert measured.intra_bw_gbs == pytest.approx(hw["intra_bw_gbs"])
