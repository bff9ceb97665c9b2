"""xirang-pipeline on the real Slurm testbed: four dependent jobs (afterok), and a failing eval stage
(the eval.max_val_loss gate) stops the chain with a clear status while Slurm cancels the serve job.

Skips when the testbed is not up (`tools/slurm-testbed start`); CI starts it. Tier: ``slurm``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import slurm_conf_for, testbed_held

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def _testbed_env() -> dict[str, str] | None:
    """The environment of this module's testbed (``conftest.slurm_conf_for``, else SLURM_CONF, else the default
    testbed's), or None when no testbed answers."""
    env = dict(os.environ)
    conf = slurm_conf_for(__file__)
    if conf:
        env["SLURM_CONF"] = conf
    if not env.get("SLURM_CONF"):
        try:
            r = subprocess.run([str(ROOT / "tools" / "slurm-testbed"), "env"], capture_output=True, text=True,
                               timeout=300)
        except (OSError, subprocess.TimeoutExpired):
            return None
        line = r.stdout.strip().splitlines()[-1] if r.returncode == 0 and r.stdout.strip() else ""
        if not line.startswith("export SLURM_CONF="):
            return None
        env["SLURM_CONF"] = line.split("=", 1)[1]
    try:
        r = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True, timeout=300, env=env)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return env if r.returncode == 0 and r.stdout.strip() else None


ENV: dict[str, str] | None = None  # the testbed's environment, probed when a test of this module first runs
pytestmark = [pytest.mark.slurm]


@pytest.fixture(scope="module", autouse=True)
def _testbed() -> None:
    """Probe the testbed lazily (not at import: collecting the suite must not run Slurm commands)."""
    global ENV
    ENV = _testbed_env()
    if ENV is None:
        pytest.skip("Slurm testbed not up (tools/slurm-testbed start)")


def _launch(tmp: Path, name: str, *extra: str) -> tuple[Path, list[dict]]:
    r = subprocess.run([str(BIN / "xirang-pipeline"), "cluster=testbed", f"train.name={name}", "train.max_steps=6",
                        "train.warmup_steps=2", "train.log_every=3", f"train.runs_root={tmp}/runs",
                        f"data.out_dir={tmp}/data", f"data.corpus={ROOT / 'xirang_hpc'}", "serve.port=0",
                        "serve.duration_s=3", "eval.batches=2", *extra],
                       cwd=tmp, capture_output=True, text=True, timeout=600, env=ENV)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert "submitted pipeline: prepare (" in r.stdout
    (run,) = (tmp / "runs").glob(f"{name}-*")
    pipe = json.loads((run / "pipeline.json").read_text())
    assert pipe["executor"] == "slurm"
    return run, pipe["stages"]


def _squeue_deps(job_ids: list[str]) -> dict[str, str]:
    r = subprocess.run(["squeue", "-h", "-j", ",".join(job_ids), "-o", "%i %E"], capture_output=True, text=True,
                       env=ENV, timeout=300)
    return dict(line.split(maxsplit=1) for line in r.stdout.splitlines() if len(line.split()) == 2)


def _status(run: Path) -> tuple[int, dict, str]:
    js = subprocess.run([str(BIN / "xirang-pipeline"), "--status", str(run), "--json"], capture_output=True,
                        text=True, env=ENV, timeout=300)
    txt = subprocess.run([str(BIN / "xirang-pipeline"), "--status", str(run)], capture_output=True, text=True,
                         env=ENV, timeout=300)
    return txt.returncode, json.loads(js.stdout), txt.stdout


def _wait_done(run: Path, timeout_s: float = 900) -> tuple[int, dict, str]:
    deadline = time.monotonic() + timeout_s
    while True:
        rc, chain, text = _status(run)
        if chain["status"] == "completed" or chain["status"].startswith("failed"):
            # Slurm too: a stage reports completed a moment before its job leaves RUNNING/COMPLETING.
            if all(s["status"] in ("completed", "failed", "cancelled")
                   and s["slurm_state"] not in ("PENDING", "CONFIGURING", "RUNNING", "COMPLETING")
                   for s in chain["stages"]):
                return rc, chain, text
        assert time.monotonic() < deadline, text
        time.sleep(3)


def test_pipeline_runs_as_four_dependent_jobs_and_a_failing_eval_stops_the_chain(tmp_path: Path) -> None:
    # Every CPU of both nodes held in `high` while the chains are submitted and their dependencies read, so
    # that no stage can run (and Slurm clear a fulfilled dependency) before the test has looked, however slow
    # the machine is at submitting the second chain.
    with testbed_held(ENV):
        ok_run, ok_stages = _launch(tmp_path, "chain")
        # Same data dir; the gate run is a separate experiment (its own run dir), on one rank: it only has to
        # reach its eval gate (the chain above runs the testbed's 2 nodes x 2 ranks).
        bad_run, bad_stages = _launch(tmp_path, "gate", "eval.max_val_loss=0.5", "cluster.nodes=1",
                                      "cluster.tasks_per_node=1", "parallel.pp=1")
        deps = _squeue_deps([ok_stages[3]["job_id"], bad_stages[3]["job_id"]])

    for stages in (ok_stages, bad_stages):
        assert [s["stage"] for s in stages] == ["prepare", "train", "eval", "serve"]
        ids = [s["job_id"] for s in stages]
        assert len(set(ids)) == 4
        assert [s["depends_on"] for s in stages] == [None, *ids[:3]]
    # Slurm itself holds the chain: the serve jobs are still pending on their eval job (afterok).
    assert deps.get(ok_stages[3]["job_id"], "").startswith(f"afterok:{ok_stages[2]['job_id']}"), deps
    assert deps.get(bad_stages[3]["job_id"], "").startswith(f"afterok:{bad_stages[2]['job_id']}"), deps

    rc, chain, text = _wait_done(ok_run)
    assert rc == 0 and chain["status"] == "completed", text
    assert [s["slurm_state"] for s in chain["stages"]] == ["COMPLETED"] * 4, text
    ev = json.loads((ok_run / "eval.json").read_text())
    assert ev["step"] == 6 and ev["val_loss"] > 0 and ev["passed"] is True
    assert f"val loss {ev['val_loss']:.4f}" in text
    serve = json.loads((ok_run / "serve.json").read_text())
    assert serve["status"] == "stopped" and serve["host"] == "127.0.0.1" and serve["step"] == 6

    rc, chain, text = _wait_done(bad_run)
    assert rc == 1 and chain["status"] == "failed at eval", text
    by = {s["stage"]: s for s in chain["stages"]}
    assert by["prepare"]["status"] == by["train"]["status"] == "completed"
    assert by["eval"]["status"] == "failed" and by["eval"]["slurm_state"] == "FAILED"
    assert "val loss" in by["eval"]["detail"] and "eval.max_val_loss=0.5" in by["eval"]["detail"]
    assert by["serve"]["status"] == "cancelled" and by["serve"]["slurm_state"] == "CANCELLED"
    assert "stage eval failed" in by["serve"]["detail"]
    assert "failed at eval" in text.splitlines()[0]
    assert not (bad_run / "serve.json").exists()  # the server never started


def test_the_fine_tuning_chain_runs_as_six_dependent_jobs(tmp_path: Path) -> None:
    """prepare (chat + pairs) -> train (LoRA SFT, 2 ranks) -> export -> dpo (2 ranks) -> eval (harness) -> serve,
    each job afterok the previous one; the chain completes, and serve serves the DPO adapter over the export."""
    from test_pipeline_preference import chain_overrides, make_chat_model, write_corpora

    from xirang_hpc.runs.chain import DPO_ADAPTER, DPO_RUN, PREFERENCE_STAGES, SFT_MODEL

    model = make_chat_model(tmp_path / "my-llama")
    chats, pairs = write_corpora(tmp_path)
    argv = ["cluster=testbed", *chain_overrides(tmp_path, model, chats, pairs), "cluster.tasks_per_node=2",
            "train.name=ftchain", "finetune.method=lora", "preference.lora=true", "preference.steps=4",
            "eval.harness_tasks=[xirang_heldout_mc]", "eval.harness_limit=4", "eval.batches=2", "serve.port=0",
            "serve.duration_s=3"]
    with testbed_held(ENV):
        r = subprocess.run([str(BIN / "xirang-pipeline"), *argv], cwd=tmp_path, capture_output=True, text=True,
                           timeout=600, env=ENV)
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
        (run,) = (tmp_path / "runs").glob("ftchain-*")
        stages = json.loads((run / "pipeline.json").read_text())["stages"]
        ids = [s["job_id"] for s in stages]
        deps = _squeue_deps(ids[1:])
    assert [s["stage"] for s in stages] == list(PREFERENCE_STAGES)
    assert len(set(ids)) == 6 and [s["depends_on"] for s in stages] == [None, *ids[:5]]
    for prev, job in zip(ids, ids[1:]):  # Slurm itself holds the chain
        assert deps.get(job, "").startswith(f"afterok:{prev}"), deps
    assert "submitted pipeline: prepare (" in r.stdout and "-> dpo (" in r.stdout

    rc, chain, text = _wait_done(run, timeout_s=1800)
    assert rc == 0 and chain["status"] == "completed", text
    assert [s["slurm_state"] for s in chain["stages"]] == ["COMPLETED"] * 6, text
    dpo = run / DPO_RUN
    assert (dpo / "checkpoints" / "step_4").is_dir() and (run / SFT_MODEL / "config.json").is_file()
    ev = json.loads((dpo / "eval.json").read_text())
    assert ev["step"] == 4 and "xirang_heldout_mc" in ev["harness"]["metrics"]
    assert "harness xirang_heldout_mc acc" in text
    serve = json.loads((run / "serve.json").read_text())
    assert serve["status"] == "stopped" and serve["adapters"] == [DPO_ADAPTER]
    assert serve["source"] == str(run / SFT_MODEL)
