"""The pipeline's stage entry points: prepare -> train -> eval -> serve, one config for all.

With a preference stage (``preference.corpus``) the chain is prepare -> train -> export -> dpo -> eval -> serve:
prepare, eval and serve take the DPO run's config (``pref``, from ``submit/preference.py``) too, export writes the
train stage's result as a Hugging Face directory, and dpo is the DPO run's training job.

Each runs inside the stage's Slurm job, or in-process on the local executor, and records its
status through :mod:`xirang_hpc.runs.chain` (``<run>/pipeline/<stage>.json``).

The training, evaluation and serving stacks are imported inside the stage that runs them: ``xirang-pipeline``
imports this module to submit the stages (by reference), and a submission needs no torch. They are imported with
the garbage collector paused, as the training job's are (``runtime/startup.py``).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from xirang_hpc.config.schema import DataConfig
from xirang_hpc.config.schema.serve import SERVE_FILE
from xirang_hpc.config.validate import load_config
from xirang_hpc.data.prepare import ensure_prepared
from xirang_hpc.files import private_by_default
from xirang_hpc.job.entry import training_stack
from xirang_hpc.runs.chain import DPO_ADAPTER, SFT_MODEL, stage_record
from xirang_hpc.runtime.startup import collector_paused


def _cfg(cfg_dict: dict[str, Any]) -> Any:
    cfg = load_config(OmegaConf.create(cfg_dict))
    private_by_default(cfg.train.share_group)  # what the stage creates: private, or the group's
    return cfg


# ---- stage entry points (run inside the stage's job, or in-process on the local executor) ----
def prepare_stage(cfg_dict: dict[str, Any], run_dir: str, data_dir: str, pref: dict[str, Any] | None = None) -> str:
    """Tokenize the corpus into ``data_dir`` (skipped when already prepared); with ``pref`` (the DPO run's config)
    its pairs into their ``data.out_dir`` too."""
    cfg = _cfg(cfg_dict)
    with stage_record(Path(run_dir), "prepare"):
        ensure_prepared(cfg.data, data_dir)
        if pref is not None:  # its model.init_from does not exist yet: only its data group is read here
            ensure_prepared(DataConfig(**pref["data"]), pref["data"]["out_dir"])
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


SFT_EXPORT_RECORD = "xirang_export.json"


def export_stage(cfg_dict: dict[str, Any], run_dir: str, data_dir: str) -> dict[str, Any]:
    """The train stage's newest checkpoint as a Hugging Face directory ``<run>/sft-model`` (a LoRA run's adapters
    merged into its base): the DPO run's start and reference, and the base its adapter is served over.

    Idempotent: a directory already exported from the same checkpoint is kept (a rerun of the chain, a
    requeued DPO job's dependency); one from an older checkpoint is replaced, whole, by a rename.
    """
    with collector_paused():
        from xirang_hpc.checkpoint import layout as ckpt_layout
        from xirang_hpc.config.schema.finetune import trains_adapters
        from xirang_hpc.weights.hf import export_hf
        from xirang_hpc.weights.load import find_step_dir

    _cfg(cfg_dict)  # checked, and what the stage creates private (or the group's)
    run, out = Path(run_dir), Path(run_dir) / SFT_MODEL
    with stage_record(run, "export", model_dir=str(out)):
        step_dir = find_step_dir(run)
        state = ckpt_layout.read_state(step_dir)
        merge = trains_adapters(state["config"].get("finetune") or {})
        record = {"source": str(step_dir), "step": int(state.get("step", -1)), "merged_lora": merge}
        try:
            done = json.loads((out / SFT_EXPORT_RECORD).read_text())
        except (OSError, ValueError):
            done = None
        if done is not None and done.get("source") == record["source"]:
            return {**record, "model_dir": str(out), "reused": True}
        tmp = run / f".{SFT_MODEL}.partial"
        shutil.rmtree(tmp, ignore_errors=True)
        export_hf(step_dir, tmp, merge=merge)
        (tmp / SFT_EXPORT_RECORD).write_text(json.dumps(record, indent=1))
        if out.exists():  # an export of an older checkpoint: the new one replaces it whole
            shutil.rmtree(out)
        tmp.rename(out)
        return {**record, "model_dir": str(out), "reused": False}


def dpo_stage(cfg_dict: dict[str, Any], run_dir: str, data_dir: str, pipeline_dir: str) -> dict[str, Any]:
    """The DPO run's training job (every rank), in its own run directory; rank 0 records the pipeline's dpo stage."""
    training = training_stack()
    with stage_record(Path(pipeline_dir), "dpo", enabled=_rank() == 0, dpo_run=run_dir):
        return training.run_training(cfg_dict, run_dir, data_dir)


def _final(pref: dict[str, Any]) -> tuple[Any, Path]:
    """The DPO run's config and run directory (the model eval and serve take in a chain with a preference stage)."""
    cfg = _cfg(pref)
    return cfg, Path(cfg.train.run_dir)


def eval_stage(cfg_dict: dict[str, Any], run_dir: str, data_dir: str,
               pref: dict[str, Any] | None = None) -> dict[str, Any]:
    """Evaluate the newest checkpoint; fails (nonzero exit on Slurm) when ``eval.max_val_loss`` is exceeded.

    With ``pref``: the DPO run's newest checkpoint, on the held-out split of ``data_dir`` (the train stage's data,
    not the pairs); ``eval.json`` and the harness results go to the DPO run, which the stage record names."""
    with collector_paused():
        from xirang_hpc.eval.evaluate import EVAL_FILE, run_eval

    cfg = _cfg(cfg_dict)
    model_cfg, model_run = (cfg, Path(run_dir)) if pref is None else _final(pref)
    where = {} if pref is None else {"eval_file": str(model_run / EVAL_FILE)}  # runs/chain.py eval_dir
    with stage_record(Path(run_dir), "eval", **where):
        return run_eval(model_run, data_dir, cfg.eval, cfg.serve, model_cfg)


def serve_stage(cfg_dict: dict[str, Any], run_dir: str, data_dir: str,
                log: Callable[[str], None] = print, pref: dict[str, Any] | None = None) -> dict[str, Any]:
    """Serve the newest checkpoint (``<run>/serve.json`` says where) until stopped or ``serve.duration_s``.

    With ``pref``: the DPO run. When it trained adapters they are exported as a PEFT adapter (``<dpo run>/adapter``)
    and served, as the model ``dpo``, over the exported fine-tuned model (the base keeps its own id); a full DPO
    run is served as it is."""
    with collector_paused():
        from xirang_hpc.serve.run import serve
        from xirang_hpc.weights.load import find_step_dir, load_checkpoint, load_hf
        from xirang_hpc.weights.peft import export_peft

    cfg = _cfg(cfg_dict)
    step = cfg.eval.step if cfg.eval.step >= 0 else None
    with stage_record(Path(run_dir), "serve"):
        scfg = cfg.serve
        if pref is None:
            loaded = load_checkpoint(run_dir, step)
        else:
            dpo, dpo_run = _final(pref)
            if not dpo.finetune.adapters:
                loaded = load_checkpoint(dpo_run, step)
            else:
                adapter = dpo_run / "adapter"
                shutil.rmtree(adapter, ignore_errors=True)  # always the checkpoint served now, never an older one
                export_peft(find_step_dir(dpo_run, step), adapter)
                loaded = load_hf(Path(run_dir) / SFT_MODEL)
                scfg = dataclasses.replace(scfg, adapters={**scfg.adapters, DPO_ADAPTER: str(adapter)})
        return serve(loaded, scfg, Path(run_dir) / SERVE_FILE, log=log)


STAGE_FNS: dict[str, Callable[..., Any]] = {"prepare": prepare_stage, "train": train_stage, "export": export_stage,
                                            "dpo": dpo_stage, "eval": eval_stage, "serve": serve_stage}
