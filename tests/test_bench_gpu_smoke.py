"""The GPU benchmark's code path, on CPU with a tiny model, so that it keeps working between GPU sessions."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_bench_gpu_train_smoke_runs_both_sides(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    res = subprocess.run([sys.executable, "benchmarks/bench_gpu_train.py", "--smoke", "--steps", "3", "--warmup", "1",
                          "--json", str(out)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout + res.stderr
    figures = json.loads(out.read_text())
    assert figures["ours_tok_s"] > 0 and figures["plain_tok_s"] > 0
    assert figures["ratio"] == pytest.approx(figures["ours_tok_s"] / figures["plain_tok_s"])
    assert "ratio xirang/plain" in res.stdout


def test_gpu_check_skips_cleanly_without_a_gpu(tmp_path: Path) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: gpu_check.sh runs for real")
    res = subprocess.run(["bash", "benchmarks/gpu_check.sh"], cwd=ROOT, capture_output=True, text=True, timeout=600,
                         env={**os.environ, "OUT": str(tmp_path), "PYTHON": sys.executable})
    assert res.returncode == 0 and "skipped: no CUDA device" in res.stdout, res.stdout + res.stderr
