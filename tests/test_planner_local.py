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
    for n in names:
        est, (step, peak) = cands[n][0], meas[n]
        assert est.step_time == pytest.approx(step, rel=0.25), report
        assert est.peak_memory == pytest.approx(peak, rel=0.20), report


@pytest.mark.slow
def test_train_parallel_auto_runs_the_plan_and_records_measured(calibrated: Path, tmp_path: Path) -> None:
    conf = tmp_path / "conf" / "cluster"
    conf.mkdir(parents=True)
    (conf / "local-calibrated.yaml").write_text(calibrated.read_text())
    r = subprocess.run([str(BIN / "xirang-train"), f"hydra.searchpath=[file://{tmp_path / 'conf'}]",
                        "cluster=local-calibrated", "parallel=auto", "train.max_steps=12", "train.eval_batches=1",
                        "train.log_every=6", f"train.runs_root={tmp_path}/runs"],
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
