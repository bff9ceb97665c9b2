"""Deterministic, private run directories.

The directory of an experiment is ``runs_root/<train.name>-<model.name>-<hash>``, where the
hash covers the config that defines *what* is trained (model, data, optimisation) and not
*where or how* (cluster, parallel layout, checkpoint and requeue policy, logging cadence).
Resubmitting, requeueing or resuming on another layout therefore finds the same directory
and its checkpoints; Hydra's timestamped directories are switched off in ``conf/config.yaml``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from pathlib import Path

from xirang_hpc.config.schema import XirangConfig
from xirang_hpc.config.validate import tokenizer_file
from xirang_hpc.data.tokenizer import file_sha256

# Train fields that change how a run is executed or reported, not what it computes.
_TRAIN_NON_SEMANTIC = {"name", "grad_accum", "eval_every", "eval_batches", "log_every", "runs_root",
                       "run_dir", "wait", "resume_from",
                       "priority", "loggers", "mlflow_uri", "after_active"}
_DATA_NON_SEMANTIC = {"out_dir", "shard_tokens"}
# Data fields added with tokenizer/corpus choice: left out of the key at their defaults, so the run
# directories of byte-level runs keep the names they always had.
_DATA_DEFAULTS = {"vocab_size": 0, "text_field": "text", "on_bad_record": "fail"}
# Model fields added with grouped-query attention, tying and the norm/rotary constants: left out of
# the key where they mean what the model always did (n_kv_head == n_head, LayerNorm's 1e-5, RoPE's
# 10000, untied), so earlier runs keep their directories. RMSNorm's epsilon was 1e-6 before it
# became a field: an RMSNorm run at 1e-5 computes something else and gets its own directory.
_MODEL_DEFAULTS = {"norm_eps": 1e-5, "rope_theta": 10000.0, "tie_embeddings": False}


def tokenizer_identity(spec: str, bpe_vocab: int) -> dict[str, object]:
    """What defines a tokenizer: byte; bpe + its vocab size (trained on the corpus, also in the key);
    or the sha256 of a tokenizer.json (whatever its path), so different files never share a run dir."""
    if spec == "byte":
        return {"kind": "byte"}
    if spec == "bpe":
        return {"kind": "bpe", "vocab_size": bpe_vocab}
    f = tokenizer_file(spec)
    assert f is not None
    return {"kind": "file", "sha256": file_sha256(f)}


def experiment_key(cfg: XirangConfig) -> dict[str, object]:
    """The part of the config that identifies the experiment (the tokenizer by its identity, not its path)."""
    train = {k: v for k, v in dataclasses.asdict(cfg.train).items() if k not in _TRAIN_NON_SEMANTIC}
    data = {k: v for k, v in dataclasses.asdict(cfg.data).items() if k not in _DATA_NON_SEMANTIC}
    for k, default in _DATA_DEFAULTS.items():
        if data.get(k) == default or (k == "vocab_size" and cfg.data.tokenizer != "bpe"):
            data.pop(k, None)
    if cfg.data.tokenizer != "byte":
        data["tokenizer"] = tokenizer_identity(cfg.data.tokenizer, cfg.data.vocab_size)
    model = dataclasses.asdict(cfg.model)
    if model.get("n_kv_head") == cfg.model.n_head:
        model.pop("n_kv_head")
    for k, default in _MODEL_DEFAULTS.items():
        if model.get(k) == default and not (k == "norm_eps" and cfg.model.norm == "rmsnorm"):
            model.pop(k, None)
    return {"model": model, "data": data, "train": train}


def experiment_hash(cfg: XirangConfig) -> str:
    """12 hex digits of sha256 over the canonical JSON of :func:`experiment_key`."""
    blob = json.dumps(experiment_key(cfg), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def run_dir_for(cfg: XirangConfig) -> Path:
    """Where this experiment lives (``train.run_dir`` overrides)."""
    if cfg.train.run_dir:
        return Path(cfg.train.run_dir).expanduser().absolute()
    name = f"{cfg.train.name}-{cfg.model.name}-{experiment_hash(cfg)}"
    return (Path(cfg.train.runs_root).expanduser() / name).absolute()


def make_private_dir(path: Path, mode: int = 0o700) -> Path:
    """Create ``path`` (and missing parents) with ``mode``, whatever the umask; tighten if it exists."""
    path.mkdir(parents=True, exist_ok=True)
    os.chmod(path, mode)
    return path
