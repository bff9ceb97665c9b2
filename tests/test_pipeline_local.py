"""xirang-pipeline on the local executor: stages in sequence; a failing eval stops the chain (exit 1,
serve never runs); after relaxing the gate the same command resumes (training restored from the
checkpoint, not redone), evaluates, and serves for a moment."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def _pipeline(tmp: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(BIN / "xirang-pipeline"), "cluster.nodes=1", "cluster.tasks_per_node=1",
                           "parallel.pp=1", "train.max_steps=8", "train.warmup_steps=2", "train.log_every=4",
                           f"train.runs_root={tmp}/runs", f"data.out_dir={tmp}/data",
                           f"data.corpus={ROOT / 'xirang_hpc'}", "serve.port=0", "serve.duration_s=1",
                           "eval.batches=2", *extra], cwd=tmp, capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_local_pipeline_stops_at_a_failing_eval_then_completes(tmp_path: Path) -> None:
    r = _pipeline(tmp_path, "eval.max_val_loss=0.5")
    assert r.returncode == 1, r.stdout[-3000:] + r.stderr[-3000:]
    (run,) = (tmp_path / "runs").iterdir()
    out = r.stdout
    assert "== pipeline stage eval" in out and "== pipeline stage serve" not in out
    assert f"pipeline {run} (local): failed at eval" in out
    assert "eval     failed" in out and "above eval.max_val_loss=0.5" in out
    assert "serve    cancelled  in-process  not run: stage eval failed" in out
    assert not (run / "serve.json").exists()
    ev = json.loads((run / "eval.json").read_text())
    assert ev["passed"] is False and ev["val_loss"] > 0.5  # the numbers are still recorded

    st = subprocess.run([str(BIN / "xirang-pipeline"), "--status", str(run)], capture_output=True, text=True)
    assert st.returncode == 1 and "failed at eval" in st.stdout

    r2 = _pipeline(tmp_path)  # gate relaxed: same experiment, same run dir
    assert r2.returncode == 0, r2.stdout[-3000:] + r2.stderr[-3000:]
    # Training had finished: the train stage says so and starts nothing; eval and serve run.
    assert f"run {run} is complete: its last checkpoint is step 8 of 8" in r2.stdout
    assert "step     4/8 | loss" not in r2.stdout
    assert f"pipeline {run} (local): completed" in r2.stdout
    serve = json.loads((run / "serve.json").read_text())
    assert serve["status"] == "stopped" and serve["step"] == 8 and serve["host"] == "127.0.0.1"
    chain = json.loads(subprocess.run([str(BIN / "xirang-pipeline"), "--status", str(run), "--json"],
                                      capture_output=True, text=True).stdout)
    assert [s["status"] for s in chain["stages"]] == ["completed"] * 4
    # xirang-status shows the evaluation and the whole chain.
    view = subprocess.run([str(BIN / "xirang-status"), str(run)], capture_output=True, text=True).stdout
    ev = json.loads((run / "eval.json").read_text())
    assert f"eval      val loss {ev['val_loss']:.4f}, perplexity {ev['perplexity']:.2f} @ step 8" in view
    assert ("pipeline  completed: prepare completed -> train completed -> eval completed -> serve completed"
            in view), view
