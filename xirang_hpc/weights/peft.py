"""LoRA adapters as PEFT adapter directories (``adapter_config.json`` + ``adapter_model.safetensors``).

PEFT names an adapter of Llama's ``q_proj`` in block i ``base_model.model.model.layers.i.self_attn.q_proj.
lora_A.weight`` (and ``lora_B``); ours is ``layers.i.attn.q.lora_A.weight``. The names come from the one
tensor map of :mod:`xirang_hpc.weights.hf`. A is (rank, in) and keeps its columns (the inputs are the same
on both sides); B is (out, rank) and its rows take the same in-head rotary permutation as the base weight's
rows (q and k), so ``PeftModel.from_pretrained(base, dir)`` computes what our adapted model computes.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from xirang_hpc.config.hf import PEFT_WEIGHTS, base_model_dir
from xirang_hpc.config.schema import ModelConfig
from xirang_hpc.config.schema.finetune import LORA_TARGETS, LoraConfig, trains_adapters
from xirang_hpc.runtime import liveness
from xirang_hpc.weights.hf import Src, hf_rows_for, tensor_map

PEFT_PREFIX = "base_model.model."


def _peft_key(name: str, tmap: dict[str, Src]) -> tuple[str, str, Src]:
    """(PEFT's key, "lora_A" or "lora_B", the base weight's Hugging Face source) of our adapter tensor ``name``."""
    mod = name.rsplit(".lora_", 1)[0]
    src = tmap[mod + ".weight"]
    kind = "lora_A" if name.endswith(".lora_A.weight") else "lora_B"
    return PEFT_PREFIX + src.hf.removesuffix(".weight") + f".{kind}.weight", kind, src


def to_peft_state(adapters: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """PEFT's tensors (names and row order) from our adapter tensors (unsharded, our names)."""
    tmap = tensor_map(cfg)
    out: dict[str, torch.Tensor] = {}
    for name, t in adapters.items():
        key, kind, src = _peft_key(name, tmap)
        if kind == "lora_B" and src.rope_heads:
            idx = torch.tensor(hf_rows_for(src, range(t.shape[0]), t.shape[0]))
            dst = torch.empty_like(t)
            dst[idx] = t
            t = dst
        out[key] = t.contiguous()
    return out


def from_peft_state(tensors: dict[str, torch.Tensor], cfg: ModelConfig,
                    expected: dict[str, tuple[int, ...]]) -> dict[str, torch.Tensor]:
    """Our adapter tensors from PEFT's; ``expected``: our adapter names and shapes (a ValueError names a mismatch)."""
    tmap = tensor_map(cfg)
    out: dict[str, torch.Tensor] = {}
    for name, shape in expected.items():
        key, kind, src = _peft_key(name, tmap)
        if key not in tensors:
            raise ValueError(f"PEFT adapter has no tensor {key} (for our {name})")
        t = tensors[key]
        if tuple(t.shape) != tuple(shape):
            raise ValueError(f"PEFT adapter tensor {key} has shape {tuple(t.shape)}, this model needs {tuple(shape)}: "
                             "an adapter for a different base model or rank")
        if kind == "lora_B" and src.rope_heads:
            t = t[torch.tensor(hf_rows_for(src, range(t.shape[0]), t.shape[0]))]
        out[name] = t
    return out


def adapter_config(lora: LoraConfig, base: str) -> dict[str, Any]:
    """PEFT's ``adapter_config.json`` for ``lora`` on the Hugging Face model ``base``."""
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base, "r": int(lora.rank),
            "lora_alpha": float(lora.alpha), "lora_dropout": float(lora.dropout),
            "target_modules": sorted(LORA_TARGETS[m] for m in lora.modules()), "bias": "none",
            "fan_in_fan_out": False, "use_rslora": False, "use_dora": False, "init_lora_weights": True,
            "modules_to_save": None, "inference_mode": True}


def write_peft(out_dir: Path, tensors: dict[str, torch.Tensor], config: dict[str, Any]) -> list[Path]:
    """Write ``adapter_model.safetensors`` and ``adapter_config.json`` into ``out_dir`` (existing)."""
    from safetensors.torch import save_file

    wpath, cpath = out_dir / "adapter_model.safetensors", out_dir / "adapter_config.json"
    save_file(tensors, str(wpath), metadata={"format": "pt"})
    cpath.write_text(json.dumps(config, indent=1))
    return [cpath, wpath]


def export_peft(step_dir: Path, out_dir: Path, mode: int = 0o700) -> list[Path]:
    """A LoRA run's checkpoint as a PEFT adapter directory; returns the files written."""
    import dataclasses

    from xirang_hpc.checkpoint import layout as ckpt_layout
    from xirang_hpc.config.schema import FinetuneConfig
    from xirang_hpc.weights.export import load_full

    ckpt_layout.verify(step_dir)
    state = ckpt_layout.read_state(step_dir)
    ft = state["config"].get("finetune") or {}
    if not trains_adapters(ft):
        raise ValueError(f"{step_dir}: not a LoRA run (finetune.method={ft.get('method', 'full')}, no adapters); "
                         "--format peft exports adapters only")
    lora = FinetuneConfig(method="lora", lora=LoraConfig(**ft.get("lora", {}))).lora
    names = {f.name for f in dataclasses.fields(ModelConfig)} - {"init_from"}
    mcfg = ModelConfig(**{k: v for k, v in state["config"]["model"].items() if k in names})
    adapters = {k.removeprefix("model."): v for k, v in load_full(step_dir, "model.").items()
                if k.endswith((".lora_A.weight", ".lora_B.weight"))}
    if not adapters:
        raise ValueError(f"{step_dir}: no adapter tensors in this checkpoint")
    ckpt_layout.make_dir(out_dir, mode)
    init_from = state["config"]["model"].get("init_from")
    base = str((base_model_dir(init_from) if init_from else None) or init_from or "")  # an adapter's own base
    return write_peft(out_dir, to_peft_state(adapters, mcfg), adapter_config(lora, base))


def init_adapters_from_peft(model: torch.nn.Module, path: str | Path, cfg: ModelConfig) -> int:
    """Fill this rank's LoRA adapters of ``model`` from a PEFT adapter directory; returns the tensors set.

    ``model`` may be a plain GPT, one pipeline stage of it, or hold DTensor parameters (TP/FSDP2): every rank
    reads the (small) adapter file and copies its own region. A tensor the adapter lacks, one of another shape
    (an adapter of another base or rank) or one our targets have no place for is refused by name, before any
    adapter is touched.
    """
    from safetensors.torch import load_file

    from xirang_hpc.models.lora import is_lora_param
    from xirang_hpc.weights.errors import WeightsError
    from xirang_hpc.weights.hf_import import _clean, local_region

    source = Path(str(path)) / PEFT_WEIGHTS
    tensors = load_file(str(source))  # safetensors: tensors only, nothing executed
    params = [(_clean(n), p) for n, p in model.named_parameters() if is_lora_param(_clean(n))]
    if not params:
        raise WeightsError(f"{path}: this model has no LoRA adapters to load a PEFT adapter into "
                           "(finetune.method=lora)")
    try:
        ours = from_peft_state(tensors, cfg, {n: tuple(p.shape) for n, p in params})
    except ValueError as exc:
        raise WeightsError(f"{source}: {exc}") from None
    # Every layer's adapters of the targeted modules (a pipeline stage holds only some layers).
    tmap = tensor_map(cfg)
    targets = {n.split(".", 2)[2].rsplit(".lora_", 1)[0] for n, _ in params}  # layers.3.attn.q.lora_A -> attn.q
    known = {_peft_key(f"layers.{i}.{m}.lora_{k}.weight", tmap)[0] for i in range(cfg.n_layer) for m in targets
             for k in "AB"}
    extra = sorted(k for k in tensors if k not in known)
    if extra:
        raise WeightsError(f"{source}: {len(extra)} adapter tensor(s) this model has no place for, e.g. {extra[:3]}; "
                           "the adapter targets modules finetune.lora.target_modules does not")
    with torch.no_grad():
        for name, p in params:
            local, offset, shape = local_region(p)
            if local.numel():
                region = ours[name][tuple(slice(o, o + s) for o, s in zip(offset, shape, strict=True))]
                local.copy_(region.to(local.dtype))
                liveness.tick("weight import")  # a long import that still reads is no hang
    return len(params)
