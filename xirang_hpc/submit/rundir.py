"""Deterministic, private run directories.

The directory of an experiment is ``runs_root/<train.name>-<model.name>-<hash>``, where the
hash covers the config that defines *what* is trained (model, data, optimisation) and not
*where or how* (cluster, parallel layout, checkpoint and requeue policy, logging cadence).
Resubmitting, requeueing or resuming on another layout therefore finds the same directory
and its checkpoints; Hydra's timestamped directories are switched off in ``conf/config.yaml``.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from xirang_hpc import files
from xirang_hpc.checkpoint.identity import experiment_key, tokenizer_identity
from xirang_hpc.config.schema import XirangConfig

__all__ = ["experiment_key", "experiment_hash", "tokenizer_identity", "run_dir_for", "make_private_dir"]


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
    """Create ``path`` (and missing parents) with ``mode`` (0o2750 in the group when shared), whatever the
    umask; tighten if it exists (:func:`xirang_hpc.files.make_dir`)."""
    return files.make_dir(path, mode)
