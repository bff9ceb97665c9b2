"""Read a checkpoint's tensors whole (unsharded), and export model weights as safetensors + JSON config."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

from xirang_hpc.checkpoint import layout as ckpt_layout
from xirang_hpc.checkpoint.storage import HDF5StorageReader, read_metadata
from xirang_hpc.config.schema.finetune import trains_adapters
from xirang_hpc.data.tokenizer import copy_tokenizer_file, load_run_tokenizer, tokenizer_info


def load_full(step_dir: Path, prefix: str = "") -> dict[str, torch.Tensor]:
    """Every tensor whose flattened name starts with ``prefix``, assembled from all shards (one process)."""
    md = read_metadata(step_dir)
    sd = {k: torch.empty(tuple(m.size), dtype=m.properties.dtype)
          for k, m in md.state_dict_metadata.items() if k.startswith(prefix) and hasattr(m, "size")}
    if sd:
        dcp.load(sd, storage_reader=HDF5StorageReader(step_dir), no_dist=True)
    return sd


def run_dir_of(step_dir: Path) -> Path:
    """The run directory of ``<run>/checkpoints/step_N`` (the step's parent for a bare checkpoints root)."""
    root = Path(step_dir).absolute().parent
    return root.parent if root.name == "checkpoints" else root


def export_safetensors(step_dir: Path, out_dir: Path, mode: int = 0o700) -> tuple[Path, Path]:
    """Write ``model.safetensors`` (full weights, names without the ``model.`` prefix) and ``config.json``."""
    from safetensors.torch import save_file

    ckpt_layout.verify(step_dir)
    if trains_adapters((ckpt_layout.read_state(step_dir).get("config") or {}).get("finetune") or {}):
        raise ValueError(f"{step_dir}: a LoRA run's checkpoint holds adapters only; export them with --format peft, "
                         "or a whole model with --format hf --merge")
    weights = {k.removeprefix("model."): v.contiguous() for k, v in load_full(step_dir, "model.").items()}
    if not weights:
        raise ValueError(f"{step_dir}: no model tensors in this checkpoint")
    state: dict[str, Any] = ckpt_layout.read_state(step_dir)
    ckpt_layout.make_dir(out_dir, mode)
    wpath, cpath = out_dir / "model.safetensors", out_dir / "config.json"
    save_file(weights, str(wpath), metadata={"format": "pt", "step": str(state.get("step", ""))})
    cfg = state.get("config", {})
    # The run's tokenizer travels with its weights: xirang-serve FILE.safetensors reads it from beside the file.
    tok = load_run_tokenizer(run_dir_of(step_dir))
    if tok.tokenizer_json is not None:
        copy_tokenizer_file(tok.tokenizer_json, out_dir)
    cpath.write_text(json.dumps({"model": cfg.get("model", {}), "tokenizer": tokenizer_info(tok),
                                 "step": state.get("step"),
                                 "tokens_seen": state.get("tokens_seen"), "source": str(step_dir),
                                 "architecture": "xirang_hpc.models.gpt.GPT"}, indent=1))
    return wpath, cpath
