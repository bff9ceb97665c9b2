"""lm-evaluation-harness against the served model: ``eval.harness_tasks=[...]``.

The run's checkpoint is served by xirang-serve's own server on 127.0.0.1 (an ephemeral port, a fresh bearer
token), and lm-evaluation-harness runs in a child process with its ``local-completions`` model: prompts go as
token ids, log-likelihoods come back as ``echo``ed ``logprobs``, and the tokenizer is the server's own
(``tokenizer_backend=remote``: ``/tokenize``, ``/detokenize``, ``/tokenizer_info``), so any run tokenizer
(bytes, a trained BPE, a tokenizer.json) works. Nothing is downloaded: the child runs with the Hugging Face
libraries offline and a datasets cache inside the run, and only tasks whose data are local files are accepted
(:func:`check_tasks`, before anything runs).

Shipped local tasks (``xirang_hpc/eval/tasks/``), built from the run's held-out text (the prepared data's val
split): ``xirang_heldout_mc`` (which of four continuations follows a context; ``acc``, ``acc_norm``) and
``xirang_heldout_gen`` (greedy continuation to the end of the line; ``exact_match``). Their documents and the
run's copies of the YAMLs go to ``<run>/harness/``; ``eval.harness_include`` adds a directory of task YAMLs of
your own (``dataset_path: json|csv|parquet|text`` with local ``data_files``).

Results: ``<run>/harness.json`` (every task's metrics, the per-document responses in
``<run>/harness/samples_<task>.jsonl``), the run's trackers (``harness/<task>/<metric>``) and ``xirang-status``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml

from xirang_hpc.config.errors import ConfigError
from xirang_hpc.config.schema import EvalConfig

TASKS_DIR = Path(__file__).parent / "tasks"
HARNESS_FILE = "harness.json"
HARNESS_DIR = "harness"
# datasets' packaged builders that read only the data_files they are given.
LOCAL_BUILDERS = ("json", "csv", "parquet", "text", "arrow")
# The child's environment: nothing fetched from the Hugging Face Hub (datasets, models, metrics).
OFFLINE_ENV = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
               "HF_EVALUATE_OFFLINE": "1", "HF_HUB_DISABLE_TELEMETRY": "1", "TOKENIZERS_PARALLELISM": "false"}
DEFAULT_DOCS = 100  # documents per shipped task (eval.harness_limit caps what is evaluated)


class HarnessError(RuntimeError):
    """lm-evaluation-harness failed (its output tail is in the message)."""


def _task_yamls(include: str) -> dict[str, tuple[Path, dict[str, Any]]]:
    """Task name -> (YAML file, its config) for the shipped tasks and ``eval.harness_include``."""
    dirs = [TASKS_DIR] + ([Path(include).expanduser()] if include else [])
    out: dict[str, tuple[Path, dict[str, Any]]] = {}
    for d in dirs:
        for f in sorted(d.rglob("*.yaml")):
            try:
                doc = yaml.safe_load(f.read_text())
            except (OSError, yaml.YAMLError):
                continue
            if isinstance(doc, dict) and isinstance(doc.get("task"), str):
                out.setdefault(doc["task"], (f, doc))
    return out


def local_task_names() -> list[str]:
    """The tasks shipped with the package."""
    return sorted(_task_yamls(""))


def check_tasks(ecfg: EvalConfig) -> None:
    """Refuse, before anything runs, a harness task that would need a download (or does not exist here).

    A task is accepted when it is shipped (:func:`local_task_names`) or a YAML under ``eval.harness_include``
    whose ``dataset_path`` is one of datasets' file builders (:data:`LOCAL_BUILDERS`) with local ``data_files``.
    """
    if not ecfg.harness_tasks:
        return
    import importlib.util

    if importlib.util.find_spec("lm_eval") is None:
        raise ConfigError("eval.harness_tasks", list(ecfg.harness_tasks),
                          "lm-evaluation-harness is not installed; pip install 'xirang-hpc[eval]'")
    if ecfg.harness_include and not Path(ecfg.harness_include).expanduser().is_dir():
        raise ConfigError("eval.harness_include", ecfg.harness_include, "use a directory of task YAML files")
    known = _task_yamls(ecfg.harness_include)
    fix = (f"use a local task ({', '.join(local_task_names())}) or put a task YAML with dataset_path: json and "
           "local data_files in a directory named by eval.harness_include")
    for name in ecfg.harness_tasks:
        if name not in known:
            raise ConfigError("eval.harness_tasks", name,
                              f"task {name!r} is not a local task: lm-evaluation-harness's own tasks read their "
                              f"datasets from the Hugging Face Hub, and nothing is downloaded here; {fix}")
        path, doc = known[name]
        if path.parent == TASKS_DIR:
            continue
        builder = doc.get("dataset_path")
        files = (doc.get("dataset_kwargs") or {}).get("data_files")
        if builder not in LOCAL_BUILDERS or not files:
            raise ConfigError("eval.harness_tasks", name,
                              f"task {name!r} ({path}) reads dataset_path={builder!r}, which would be downloaded; "
                              f"give it dataset_path: one of {list(LOCAL_BUILDERS)} with local data_files")
        for f in _data_files(files):
            if not Path(f).expanduser().is_file():
                raise ConfigError("eval.harness_tasks", name,
                                  f"task {name!r} ({path}) names the data file {f}, which does not exist here; "
                                  "use absolute paths to local files")


def _data_files(files: Any) -> list[str]:
    if isinstance(files, str):
        return [files]
    if isinstance(files, dict):
        return [x for v in files.values() for x in _data_files(v)]
    if isinstance(files, list):
        return [x for v in files for x in _data_files(v)]
    return []


# ---- the shipped tasks' documents, from the run's held-out text ----------------------------------------


def heldout_documents(data_dir: str | Path, tok: Any, seq_len: int, n_docs: int, seed: int
                      ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(multiple-choice docs, generation docs) from the val split: contexts and their true continuations."""
    import numpy as np

    from xirang_hpc.data.dataset import TokenWindows

    cont = max(4, min(16, seq_len // 8))
    ctx = max(8, min(64, seq_len // 2))
    val = TokenWindows(data_dir, "val", ctx + cont)
    rng = np.random.default_rng([seed, 7])

    def clean(ids: Any) -> str:
        return tok.decode([int(t) for t in ids]).replace("\ufffd", "")

    try:
        pool = [val.window(int(p)) for p in rng.integers(0, val.num_windows, size=8 * n_docs)]
    finally:
        val.close()
    pairs = [(clean(w[:ctx]), clean(w[ctx:ctx + cont])) for w in pool]
    pairs = [(c, k) for c, k in pairs if c and k.strip()]
    mc: list[dict[str, Any]] = []
    conts = [k for _, k in pairs]
    for i, (c, k) in enumerate(pairs):
        if len(mc) == n_docs:
            break
        others: list[str] = []
        for j in rng.permutation(len(conts)):
            if conts[j] != k and conts[j] not in others and int(j) != i:
                others.append(conts[j])
            if len(others) == 3:
                break
        if len(others) < 3:
            continue
        gold = int(rng.integers(0, 4))
        choices = others[:gold] + [k] + others[gold:]
        mc.append({"id": len(mc), "context": c, "choices": choices, "gold": gold})
    gen: list[dict[str, Any]] = []
    for c, k in pairs:
        line = k.split("\n", 1)[0]
        if line.strip() and len(gen) < n_docs:
            gen.append({"id": len(gen), "context": c, "target": line})
    return mc, gen


def write_local_tasks(run_dir: Path, data_dir: str | Path, tok: Any, seq_len: int, ecfg: EvalConfig) -> Path:
    """The shipped tasks' documents and YAMLs (data_files made absolute) under ``<run>/harness/``; the task dir."""
    base = run_dir / HARNESS_DIR
    (base / "data").mkdir(parents=True, exist_ok=True)
    (base / "tasks").mkdir(parents=True, exist_ok=True)
    n_docs = ecfg.harness_limit or DEFAULT_DOCS
    mc, gen = heldout_documents(data_dir, tok, seq_len, n_docs, ecfg.seed)
    for name, docs in (("heldout_mc.jsonl", mc), ("heldout_gen.jsonl", gen)):
        (base / "data" / name).write_text("".join(json.dumps(d) + "\n" for d in docs))
    for f in sorted(TASKS_DIR.glob("*.yaml")):
        doc = yaml.safe_load(f.read_text())
        files = doc["dataset_kwargs"]["data_files"]
        doc["dataset_kwargs"]["data_files"] = {k: str((base / "data" / v).absolute()) for k, v in files.items()}
        (base / "tasks" / f.name).write_text(yaml.safe_dump(doc, sort_keys=False))
    return base / "tasks"


# ---- running lm-evaluation-harness ---------------------------------------------------------------------


def harness_env(run_dir: Path) -> dict[str, str]:
    """The child's environment: offline, caches inside the run."""
    env = dict(os.environ)
    env.update(OFFLINE_ENV)
    env["HF_DATASETS_CACHE"] = str((run_dir / HARNESS_DIR / "cache").absolute())
    env.setdefault("HF_HOME", str((run_dir / HARNESS_DIR / "hf_home").absolute()))
    return env


def run_lm_eval(request: dict[str, Any], run_dir: Path, timeout_s: float | None = None) -> dict[str, Any]:
    """Run ``lm_eval.simple_evaluate`` in a child process (:mod:`xirang_hpc.eval.harness_child`).

    ``request``: ``model``, ``model_args``, ``tasks``, ``include_path``, ``limit``, ``num_fewshot``,
    ``batch_size``. Returns ``{"results", "samples", "seconds"}``; raises :class:`HarnessError`."""
    t0 = time.perf_counter()
    out_file = run_dir / HARNESS_DIR / f"lm_eval_{request['model']}.json"
    out_file.parent.mkdir(parents=True, exist_ok=True)
    req = {**request, "output": str(out_file)}
    p = subprocess.run([sys.executable, "-m", "xirang_hpc.eval.harness_child"], input=json.dumps(req), text=True,
                       capture_output=True, env=harness_env(run_dir), timeout=timeout_s)
    if p.returncode != 0 or not out_file.is_file():
        tail = (p.stdout + p.stderr)[-3000:]
        raise HarnessError(f"lm-evaluation-harness exited with {p.returncode}:\n{tail}")
    res = json.loads(out_file.read_text())
    res["seconds"] = time.perf_counter() - t0
    return res


def metrics_of(results: dict[str, Any]) -> dict[str, dict[str, float]]:
    """``{task: {metric: value}}`` from lm_eval's ``results`` (``acc,none`` -> ``acc``; stderr kept)."""
    out: dict[str, dict[str, float]] = {}
    for task, vals in results.items():
        for key, v in vals.items():
            if isinstance(v, (int, float)) and not isinstance(v, bool) and "," in key:
                metric, filt = key.split(",", 1)
                out.setdefault(task, {})[metric if filt == "none" else f"{metric}_{filt}"] = float(v)
    return out


def served_harness(loaded: Any, scfg: Any, tasks: list[str], include: list[str], ecfg: EvalConfig,
                   run_dir: Path) -> dict[str, Any]:
    """Serve ``loaded`` on 127.0.0.1 (ephemeral port, a fresh token) and run lm_eval's ``local-completions``."""
    import asyncio
    import dataclasses
    import secrets
    import threading

    from xirang_hpc.serve.run import start_server

    token = secrets.token_urlsafe(24)
    scfg = dataclasses.replace(scfg, host="127.0.0.1", port=0, keys_file="", duration_s=0.0)
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="harness-server", daemon=True)
    thread.start()
    running = asyncio.run_coroutine_threadsafe(start_server(loaded, scfg, token), loop).result()
    try:
        model_args = {"base_url": f"{running.url}/v1/completions", "model": running.server.model_id,
                      "tokenizer_backend": "remote", "tokenized_requests": True, "auth_token": token,
                      "max_length": loaded.cfg.seq_len, "batch_size": scfg.max_batch, "max_retries": 1,
                      "timeout": 3600, "max_gen_toks": min(256, scfg.max_new_tokens)}
        res = run_lm_eval({"model": "local-completions", "model_args": model_args, "tasks": tasks,
                           "include_path": include, "limit": ecfg.harness_limit or None,
                           "num_fewshot": ecfg.harness_num_fewshot, "api_key": token}, run_dir)
        res["server"] = {"url": running.url, "model": running.server.model_id,
                         "requests": dict(running.engine.stats)}
    finally:
        asyncio.run_coroutine_threadsafe(running.stop(), loop).result()
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=30)
        loop.close()
    return res


def run_harness(run_dir: str | Path, data_dir: str | Path, ecfg: EvalConfig, scfg: Any, loaded: Any,
                tracking: Any = None) -> dict[str, Any]:
    """``eval.harness_tasks`` against the served checkpoint; writes ``<run>/harness.json`` and returns it.

    ``tracking(step, values)``: where the metrics also go (the run's TensorBoard / MLflow)."""
    from xirang_hpc.files import write_json_atomic

    run_dir = Path(run_dir)
    check_tasks(ecfg)
    include = [str(write_local_tasks(run_dir, data_dir, loaded.tokenizer, loaded.cfg.seq_len, ecfg))]
    if ecfg.harness_include:
        include.append(str(Path(ecfg.harness_include).expanduser().absolute()))
    res = served_harness(loaded, scfg, list(ecfg.harness_tasks), include, ecfg, run_dir)
    metrics = metrics_of(res["results"])
    for task, rows in res.get("samples", {}).items():
        (run_dir / HARNESS_DIR / f"samples_{task}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = {"step": loaded.step, "source": loaded.source, "tasks": list(ecfg.harness_tasks), "metrics": metrics,
           "n_samples": res.get("n_samples", {}), "limit": ecfg.harness_limit,
           "num_fewshot": ecfg.harness_num_fewshot, "model": "local-completions", "server": res.get("server"),
           "lm_eval_version": res.get("lm_eval_version"), "seconds": res["seconds"], "time": time.time()}
    write_json_atomic(run_dir / HARNESS_FILE, out, indent=1)
    if tracking is not None:
        tracking(loaded.step, {f"harness/{t}/{m}": v for t, ms in metrics.items() for m, v in ms.items()
                               if not m.endswith("_stderr")})
    return out
