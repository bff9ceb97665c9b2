"""What a run trains: the part of the config that identifies an experiment, and its record on disk.

The same key names the run directory (its hash, see ``submit/rundir.py``) and is recorded in
``<run>/identity.json`` at the first launch, so a later launch into that directory can be checked
against what the directory already holds before anything is written or started.
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path
from typing import Any

from xirang_hpc.config.errors import ConfigError
from xirang_hpc.config.schema import XirangConfig
from xirang_hpc.config.validate import tokenizer_file
from xirang_hpc.data.tokenizer import file_sha256
from xirang_hpc.files import write_json_atomic

IDENTITY_FILE = "identity.json"
IDENTITY_FORMAT = 1

# Train fields that change how a run is executed or reported, not what it computes.
TRAIN_NON_SEMANTIC = frozenset({"name", "grad_accum", "eval_every", "eval_batches", "log_every", "runs_root",
                                "run_dir", "wait", "resume_from", "priority", "loggers", "mlflow_uri",
                                "after_active", "extend_to", "share_group",
                                # how the loss is computed, not what: equal up to summation order
                                "loss_chunk_tokens",
                                # compiled blocks, AdamW's kernels: the same arithmetic, fused or reordered
                                "compile", "optimizer_impl"})
DATA_NON_SEMANTIC = frozenset({"out_dir", "shard_tokens"})
# Data fields added with tokenizer/corpus choice: left out of the key at their defaults, so the run
# directories of byte-level runs keep the names they always had.
DATA_DEFAULTS = {"vocab_size": 0, "text_field": "text", "on_bad_record": "fail", "format": "text",
                 "train_on": "assistant", "packing": False, "overlong": "truncate"}
# Model fields added with grouped-query attention, tying and the norm/rotary constants: left out of
# the key where they mean what the model always did (n_kv_head == n_head, LayerNorm's 1e-5, RoPE's
# 10000, untied), so earlier runs keep their directories. RMSNorm's epsilon was 1e-6 before it
# became a field: an RMSNorm run at 1e-5 computes something else and gets its own directory.
MODEL_DEFAULTS = {"norm_eps": 1e-5, "rope_theta": 10000.0, "tie_embeddings": False,
                  # The Qwen/Llama 3.1 options: off by default, so earlier runs keep their keys too.
                  "attn_qkv_bias": False, "d_head": 0, "qk_norm": False, "rope_scaling": "none",
                  "rope_factor": 1.0, "rope_low_freq_factor": 1.0, "rope_high_freq_factor": 4.0,
                  "rope_original_max_pos": 8192,
                  # Mixture of experts: a dense model (0 experts) keeps the key it had before MoE existed.
                  "moe_experts": 0, "moe_top_k": 2, "moe_ffn_hidden": 0, "moe_shared_ffn_hidden": 0,
                  "moe_score": "softmax", "moe_norm_topk": True, "moe_balance": "aux_loss", "moe_aux_coef": 0.01,
                  "moe_bias_rate": 0.001, "moe_every": 1, "moe_first_dense": 0}


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


def key_of_dict(cfg: dict[str, Any], strict: bool = True) -> dict[str, Any]:
    """:func:`experiment_key` of a config given as a plain dict (e.g. the one a checkpoint recorded).

    With ``strict=False`` a tokenizer.json that no longer exists leaves ``data.tokenizer`` out of the
    key (it cannot be identified) instead of raising.
    """
    train = {k: v for k, v in cfg.get("train", {}).items() if k not in TRAIN_NON_SEMANTIC}
    data = {k: v for k, v in cfg.get("data", {}).items() if k not in DATA_NON_SEMANTIC}
    spec = str(data.get("tokenizer", "byte"))
    for k, default in DATA_DEFAULTS.items():
        if data.get(k) == default or (k == "vocab_size" and spec != "bpe"):
            data.pop(k, None)
    if spec != "byte":
        try:
            data["tokenizer"] = tokenizer_identity(spec, int(cfg.get("data", {}).get("vocab_size", 0)))
        except ConfigError:
            if strict:
                raise
            data.pop("tokenizer", None)
    model = dict(cfg.get("model", {}))
    if "n_kv_head" in model and model.get("n_kv_head") == model.get("n_head"):
        model.pop("n_kv_head")
    for k, default in MODEL_DEFAULTS.items():
        if model.get(k) == default and not (k == "norm_eps" and model.get("norm") == "rmsnorm"):
            model.pop(k, None)
    key: dict[str, Any] = {"model": model, "data": data, "train": train}
    finetune = cfg.get("finetune") or {}
    if finetune.get("method", "full") != "full":  # LoRA: what trains is part of the experiment
        key["finetune"] = finetune
    return key


def experiment_key(cfg: XirangConfig) -> dict[str, Any]:
    """The part of the config that identifies the experiment (the tokenizer by its identity, not its path)."""
    return key_of_dict({"model": dataclasses.asdict(cfg.model), "data": dataclasses.asdict(cfg.data),
                        "train": dataclasses.asdict(cfg.train), "finetune": dataclasses.asdict(cfg.finetune)})


def flatten(key: dict[str, Any]) -> dict[str, Any]:
    """``{"model": {"d_model": 64}}`` -> ``{"model.d_model": 64}`` (the override spelling of each field)."""
    return {f"{group}.{name}": value for group in ("model", "data", "train", "finetune")
            for name, value in key.get(group, {}).items()}


def write_identity(run_dir: Path, cfg: XirangConfig, **extra: Any) -> Path:
    """Record what ``run_dir`` trains (``identity.json``, mode 0600, replaced atomically)."""
    record = {"format": IDENTITY_FORMAT, "created": time.time(), **experiment_key(cfg), **extra}
    path = Path(run_dir) / IDENTITY_FILE
    write_json_atomic(path, record, indent=1, sort_keys=True)
    return path


def read_identity(run_dir: Path) -> dict[str, Any] | None:
    """The recorded identity of ``run_dir``, or None when it has none."""
    path = Path(run_dir) / IDENTITY_FILE
    if not path.exists():
        return None
    return json.loads(path.read_text())
