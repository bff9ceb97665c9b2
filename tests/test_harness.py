"""lm-evaluation-harness against xirang-serve: ``eval.harness_tasks`` in ``xirang-eval`` and the pipeline's eval stage.

Unit tier: tasks that would need a download are refused before anything runs (the config check, and
``xirang-pipeline`` itself); the shipped tasks' documents come from the held-out split, with the true
continuation among the choices. Slow tier: a run with its own BPE tokenizer trained here, exported with
``xirang-ckpt export --format hf``, evaluated on the same local tasks by lm_eval's own ``hf`` model on the exported
weights and through our server (``local-completions``): equal accuracy, equal generations, per-document
log-likelihoods within 1e-4; and ``xirang-pipeline`` with harness tasks writing ``harness.json``, TensorBoard
scalars (read back with TensorBoard's reader) and the ``xirang-status`` line.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from xirang_hpc.config.errors import ConfigError
from xirang_hpc.config.schema import EvalConfig
from xirang_hpc.eval.harness import TASKS_DIR, check_tasks, heldout_documents, local_task_names

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
LOCAL = ["xirang_heldout_mc", "xirang_heldout_gen"]


def test_the_shipped_tasks_are_local_and_accepted() -> None:
    assert local_task_names() == sorted(LOCAL)
    for f in TASKS_DIR.glob("*.yaml"):
        assert "dataset_path: json" in f.read_text()
    check_tasks(EvalConfig(harness_tasks=LOCAL))


def test_a_task_that_needs_a_download_is_refused_naming_it_and_the_fix(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as e:
        check_tasks(EvalConfig(harness_tasks=["xirang_heldout_mc", "hellaswag"]))
    msg = str(e.value)
    assert "eval.harness_tasks" in msg and "'hellaswag'" in msg and "nothing is downloaded" in msg
    assert "xirang_heldout_mc" in msg and "eval.harness_include" in msg
    mine = tmp_path / "tasks"
    mine.mkdir()
    (mine / "hub.yaml").write_text("task: hub_task\ndataset_path: Rowan/hellaswag\noutput_type: multiple_choice\n")
    with pytest.raises(ConfigError, match="hub_task.*dataset_path='Rowan/hellaswag', which would be downloaded"):
        check_tasks(EvalConfig(harness_tasks=["hub_task"], harness_include=str(mine)))
    (mine / "gone.yaml").write_text(f"task: gone\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
                                    f"    test: {tmp_path}/nope.jsonl\n")
    with pytest.raises(ConfigError, match="nope.jsonl, which does not exist here"):
        check_tasks(EvalConfig(harness_tasks=["gone"], harness_include=str(mine)))
    (tmp_path / "nope.jsonl").write_text('{"q": "a", "a": "b"}\n')
    check_tasks(EvalConfig(harness_tasks=["gone", "xirang_heldout_gen"], harness_include=str(mine)))


def test_harness_fields_without_tasks_or_named_twice_are_refused() -> None:
    with pytest.raises(ConfigError, match="eval.harness_tasks"):
        EvalConfig(harness_limit=5)
    with pytest.raises(ConfigError, match="name each task once"):
        EvalConfig(harness_tasks=["xirang_heldout_mc", "xirang_heldout_mc"])
    with pytest.raises(ConfigError, match="use 0 or more"):
        EvalConfig(harness_tasks=LOCAL, harness_num_fewshot=-1)


def test_the_pipeline_refuses_a_download_task_before_any_stage(tmp_path: Path) -> None:
    r = subprocess.run([str(BIN / "xirang-pipeline"), "eval.harness_tasks=[arc_easy]",
                        f"train.runs_root={tmp_path}/runs", f"data.out_dir={tmp_path}/data"],
                       cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "task 'arc_easy' is not a local task" in r.stderr
    assert not (tmp_path / "runs").exists() and not (tmp_path / "data").exists()  # nothing ran, nothing prepared


def test_xirang_eval_refuses_a_download_task_and_a_run_without_checkpoints(tmp_path: Path) -> None:
    base = [f"train.runs_root={tmp_path}/runs", f"data.out_dir={tmp_path}/data"]
    r = subprocess.run([str(BIN / "xirang-eval"), "eval.harness_tasks=[hellaswag]", *base], cwd=tmp_path,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "xirang-eval: error: invalid config eval.harness_tasks='hellaswag'" in r.stderr
    r = subprocess.run([str(BIN / "xirang-eval"), "eval.harness_tasks=[xirang_heldout_mc]", *base], cwd=tmp_path,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "no checkpoints in" in r.stderr and "train it first" in r.stderr, r.stderr
    assert not (tmp_path / "runs").exists()


def test_heldout_documents_come_from_the_val_split_with_the_true_continuation(tmp_path: Path,
                                                                              small_corpus: Path) -> None:
    from xirang_hpc.data.prepare import prepare
    from xirang_hpc.data.tokenizer import ByteTokenizer

    prepare(str(small_corpus), tmp_path / "data", val_fraction=0.3)
    tok = ByteTokenizer()
    index = json.loads((tmp_path / "data" / "index.json").read_text())
    import h5py

    val_text = ""
    for s in index["splits"]["val"]:
        with h5py.File(tmp_path / "data" / s["file"], "r") as f:
            val_text += tok.decode(f["tokens"][:])
    mc, gen = heldout_documents(tmp_path / "data", tok, 64, 20, seed=0)
    assert len(mc) == 20 and len(gen) == 20
    golds = {d["gold"] for d in mc}
    assert len(golds) > 1  # the true continuation is not always in one place
    for d in mc:
        assert len(set(d["choices"])) == 4
        assert d["context"] + d["choices"][d["gold"]] in val_text
    for d in gen:
        assert "\n" not in d["target"] and d["context"] + d["target"] in val_text
    assert heldout_documents(tmp_path / "data", tok, 64, 20, seed=0) == (mc, gen)  # a function of eval.seed


# ---- slow: lm_eval itself, against our server and against transformers -----------------------------


def _train(tmp: Path, *extra: str) -> Path:
    r = subprocess.run([str(BIN / "xirang-train"), "cluster.nodes=1", "cluster.tasks_per_node=1", "parallel.pp=1",
                        "train.max_steps=6", "train.warmup_steps=2", "train.log_every=3", f"train.runs_root={tmp}/runs",
                        f"data.out_dir={tmp}/data", f"data.corpus={ROOT / 'xirang_hpc' / 'eval'}", *extra],
                       cwd=tmp, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    (run,) = (tmp / "runs").iterdir()
    return run


@pytest.mark.slow
def test_served_harness_equals_lm_evals_hf_model_on_the_exported_weights(tmp_path: Path) -> None:
    from xirang_hpc.config.schema import ServeConfig
    from xirang_hpc.eval.harness import metrics_of, run_harness, run_lm_eval
    from xirang_hpc.weights.load import load_checkpoint

    run = _train(tmp_path, "data.tokenizer=bpe", "model.vocab_size=512")
    hf = tmp_path / "hf"
    e = subprocess.run([str(BIN / "xirang-ckpt"), "export", str(run), "--format", "hf", "--out", str(hf)],
                       capture_output=True, text=True, timeout=600)
    assert e.returncode == 0, e.stdout + e.stderr
    assert (hf / "tokenizer.json").is_file()

    ecfg = EvalConfig(harness_tasks=LOCAL, harness_limit=24)
    ours = run_harness(run, tmp_path / "data", ecfg, ServeConfig(max_batch=8), load_checkpoint(run))
    theirs = run_lm_eval({"model": "hf", "model_args": {"pretrained": str(hf), "dtype": "float32", "device": "cpu"},
                          "tasks": LOCAL, "include_path": [str(run / "harness" / "tasks")], "limit": 24,
                          "num_fewshot": 0, "batch_size": 8}, run)
    assert ours["metrics"] == metrics_of(theirs["results"])
    assert ours["n_samples"]["xirang_heldout_mc"]["effective"] == 24
    mc = [json.loads(x) for x in (run / "harness" / "samples_xirang_heldout_mc.jsonl").read_text().splitlines()]
    ref = {s["doc_id"]: s for s in theirs["samples"]["xirang_heldout_mc"]}
    assert len(mc) == len(ref) == 24
    for s in mc:
        lls = [ll for ll, _ in s["filtered_resps"]]
        want = [ll for ll, _ in ref[s["doc_id"]]["filtered_resps"]]
        assert lls == pytest.approx(want, abs=1e-4), s["doc_id"]
        assert [g for _, g in s["filtered_resps"]] == [g for _, g in ref[s["doc_id"]]["filtered_resps"]]
    gen = [json.loads(x) for x in (run / "harness" / "samples_xirang_heldout_gen.jsonl").read_text().splitlines()]
    ref_gen = {s["doc_id"]: s["filtered_resps"] for s in theirs["samples"]["xirang_heldout_gen"]}
    assert [s["filtered_resps"] for s in gen] == [ref_gen[s["doc_id"]] for s in gen]  # greedy text, both ways


@pytest.mark.slow
def test_pipeline_harness_stage_writes_results_tracking_and_status(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    r = subprocess.run([str(BIN / "xirang-pipeline"), "cluster.nodes=1", "cluster.tasks_per_node=1", "parallel.pp=1",
                        "train.max_steps=6", "train.warmup_steps=2", "train.log_every=3",
                        f"train.runs_root={tmp_path}/runs", f"data.out_dir={tmp_path}/data",
                        f"data.corpus={ROOT / 'xirang_hpc' / 'eval'}",
                        "serve.port=0", "serve.duration_s=1", "eval.batches=2", "train.loggers=[jsonl,tensorboard]",
                        f"eval.harness_tasks=[{','.join(LOCAL)}]", "eval.harness_limit=12"],
                       cwd=tmp_path, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    (run,) = (tmp_path / "runs").iterdir()
    h = json.loads((run / "harness.json").read_text())
    assert h["tasks"] == LOCAL and h["step"] == 6 and h["model"] == "local-completions"
    acc = h["metrics"]["xirang_heldout_mc"]["acc"]
    assert 0 <= acc <= 1 and "exact_match" in h["metrics"]["xirang_heldout_gen"]
    assert h["n_samples"]["xirang_heldout_mc"]["effective"] == 12
    assert h["server"]["url"].startswith("http://127.0.0.1:")
    assert json.loads((run / "eval.json").read_text())["harness"]["metrics"] == h["metrics"]
    acc_ev = EventAccumulator(str(run / "tb"))
    acc_ev.Reload()
    (pt,) = acc_ev.Scalars("harness/xirang_heldout_mc/acc")
    assert pt.step == 6 and pt.value == pytest.approx(acc)
    view = subprocess.run([str(BIN / "xirang-status"), str(run)], capture_output=True, text=True).stdout
    assert f"harness   xirang_heldout_mc acc {acc:.4f}" in view and "@ step 6" in view
    chain = subprocess.run([str(BIN / "xirang-pipeline"), "--status", str(run)], capture_output=True, text=True)
    assert f"harness xirang_heldout_mc acc {acc:.4f}" in chain.stdout


@pytest.mark.slow
def test_docs_lm_evaluation_harness_commands(tmp_path: Path, stdlib_data: Path) -> None:
    """The bash block of the docs' lm-evaluation-harness section, as written (the default corpus, prepared once)."""
    import os
    import re

    text = (ROOT / "docs" / "serving-and-evaluation.md").read_text()
    script = re.search(r"```bash\n(.*?)```", text.split("## lm-evaluation-harness", 1)[1], flags=re.S).group(1)
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "stdlib-bytes").symlink_to(stdlib_data)
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"}
    r = subprocess.run(["bash", "-e", "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=1500)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    (run,) = (tmp_path / "runs").iterdir()
    h = json.loads((run / "harness.json").read_text())
    assert h["tasks"] == ["xirang_heldout_mc"] and h["num_fewshot"] == 2 and h["step"] == 40
    acc = h["metrics"]["xirang_heldout_mc"]["acc"]
    assert f"harness   xirang_heldout_mc acc {acc:.4f}" in r.stdout
    # lm_eval's own table, from the CLI run against xirang-serve (0-shot, the same 50 documents)
    assert re.search(r"\|xirang_heldout_mc\|.*\|acc\s*\|", r.stdout), r.stdout[-3000:]


def test_metrics_after_training_go_to_the_runs_tensorboard_and_mlflow_run(tmp_path: Path) -> None:
    import os

    from conftest import compose_cfg
    from mlflow.tracking import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from xirang_hpc.config.validate import load_config
    from xirang_hpc.monitor.tracking import log_run_metrics

    cfg = load_config(compose_cfg(["train.loggers=[jsonl,tensorboard,mlflow]"]))
    values = {"harness/xirang_heldout_mc/acc": 0.375, "harness/xirang_heldout_gen/exact_match": 0.0}
    assert log_run_metrics(cfg, tmp_path, 12, values) == ["tensorboard", "mlflow"]
    state = json.loads((tmp_path / "tracking.json").read_text())
    assert log_run_metrics(cfg, tmp_path, 13, {"harness/xirang_heldout_mc/acc": 0.5}) == ["tensorboard", "mlflow"]
    assert json.loads((tmp_path / "tracking.json").read_text())["mlflow"]["run_id"] == state["mlflow"]["run_id"]
    ev = EventAccumulator(str(tmp_path / "tb"))
    ev.Reload()
    assert [(p.step, p.value) for p in ev.Scalars("harness/xirang_heldout_mc/acc")] == [(12, 0.375), (13, 0.5)]
    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    client = MlflowClient(tracking_uri=(tmp_path / "mlruns").as_uri())
    (only,) = client.search_runs([client.get_experiment_by_name(cfg.train.name).experiment_id])
    hist = client.get_metric_history(only.info.run_id, "harness/xirang_heldout_mc/acc")
    assert [(m.step, m.value) for m in hist] == [(12, 0.375), (13, 0.5)]  # one MLflow run, continued
    assert only.info.status == "FINISHED"
