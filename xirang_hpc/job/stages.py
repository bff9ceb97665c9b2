"""The pipeline's stage entry points: prepare -> train -> eval -> serve, one config for all.

Each runs inside the stage's Slurm job, or in-process on the local executor, and records its
status through :mod:`xirang_hpc.runs.chain` (``<run>/pipeline/<stage>.json``).

The training, evaluation and serving stacks are imported inside the stage that runs them: ``xirang-pipeline``
imports this module to submit the stages (by reference), and a submission needs no torch. They are imported with
the garbage collector paused, as the training job's are (``runtime/startup.py``).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from xirang_hpc.config.schema.serve import SERVE_FILE
from xirang_hpc.config.validate import load_config
from xirang_hpc.data.prepare import ensure_prepared
from xirang_hpc.files import private_by_default
from xirang_hpc.job.entry import training_stack
from xirang_hpc.runs.chain import stage_record
from xirang_hpc.runtime.startup import collector_paused


def _cfg(cfg_dict: dict[str, Any]) -> Any:
    cfg = load_config(OmegaConf.create(cfg_dict))
    private_by_default(cfg.train.share_group)  # what the stage creates: private, or the group's
    return cfg


# ---- stage entry points (run inside the stage's job, or in-process on the local executor) ----
def prepare_stage(cfg_dict: dict[str, Any], run_dir: str, data_dir: str) -> str:
    """Tokenize the corpus into ``data_dir`` (skipped when already prepared)."""
    cfg = _cfg(cfg_dict)
    with stage_record(Path(run_dir), "prepare"):
        ensure_prepared(cfg.data, data_dir)
    return data_dir


def _rank() -> int:
    for var in ("SLURM_PROCID", "RANK", "SUBMITIT_LOCAL_GLOBAL_RANK"):
        if os.environ.get(var, "").isdigit():
            return int(os.environ[var])
    return 0


def train_stage(cfg_dict: dict[str, Any], run_dir: str, data_dir: str) -> dict[str, Any]:
    """The training job (every rank); rank 0 records the stage."""
    training = training_stack()
    with stage_record(Path(run_dir), "train", enabled=_rank() == 0):
        return training.run_training(cfg_dict, run_dir, data_dir)


def eval_stage(cfg_dict: dict[str, Any], run_dir: str, data_dir: str) -> dict[str, Any]:
    """Evaluate the newest checkpoint; fails (nonzero exit on Slurm) when ``eval.max_val_loss`` is exceeded."""
    with collector_paused():
        from xirang_hpc.eval.evaluate import run_eval

    cfg = _cfg(cfg_dict)
    with stage_record(Path(run_dir), "eval"):
        return run_eval(run_dir, data_dir, cfg.eval, cfg.serve, cfg)


def serve_stage(cfg_dict: dict[str, Any], run_dir: str, data_dir: str,
                log: Callable[[str], None] = print) -> dict[str, Any]:
    """Serve the newest checkpoint (``<run>/serve.json`` says where) until stopped or ``serve.duration_s``."""
    with collector_paused():
        from xirang_hpc.serve.run import serve
        from xirang_hpc.weights.load import load_checkpoint

    cfg = _cfg(cfg_dict)
    with stage_record(Path(run_dir), "serve"):
        loaded = load_checkpoint(run_dir, cfg.eval.step if cfg.eval.step >= 0 else None)
        return serve(loaded, cfg.serve, Path(run_dir) / SERVE_FILE, log=log)


STAGE_FNS: dict[str, Callable[..., Any]] = {"prepare": prepare_stage, "train": train_stage, "eval": eval_stage,
                                            "serve": serve_stage}
