"""Model weights into one process: from a checkpoint of any training layout, or from safetensors.

- :func:`load_checkpoint` builds a plain :class:`GPT` from a run's checkpoint: the model config
  comes from the checkpoint's ``state.json``, the tensors go through DCP's load-time resharding
  (:func:`xirang_hpc.weights.export.load_full`), so a checkpoint written by dp x tp x pp ranks loads into a
  single unsharded process. Only the ``model`` entries are read (no optimizer state).
- :func:`load_hf` reads a Hugging Face model directory (:mod:`xirang_hpc.weights.hf_import`); ``InitFromHook``
  fills a (sharded) model from one, each rank reading only its own regions.
- :func:`load_safetensors` reads exported weights (``xirang-ckpt export --format safetensors``)
  plus their JSON config; :func:`init_model_from` copies such weights into a (possibly sharded)
  model for ``model.init_from=PATH.safetensors``; :class:`InitFromHook` does that at fit start,
  before the checkpoint hook, so a run's own checkpoint wins on restart.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from xirang_hpc.checkpoint import layout as ckpt_layout
from xirang_hpc.config.schema import ModelConfig
from xirang_hpc.config.schema.finetune import trains_adapters
from xirang_hpc.data.tokenizer import ByteTokenizer, Tokenizer, load_run_tokenizer, load_tokenizer
from xirang_hpc.models.gpt import GPT
from xirang_hpc.models.lora import is_lora_param
from xirang_hpc.runtime import liveness
from xirang_hpc.runtime.device import Device
from xirang_hpc.runtime.device import decide as decide_device
from xirang_hpc.runtime.hooks import Loop, TrainerHook
from xirang_hpc.weights.errors import WeightsError
from xirang_hpc.weights.export import load_full, run_dir_of

log = logging.getLogger(__name__)


@dataclass
class LoadedModel:
    """A model ready for inference, with where it came from."""

    model: GPT
    cfg: ModelConfig
    source: str
    step: int | None = None
    # The tokenizer the weights were trained with (<run>/tokenizer.json, or the one beside exported weights).
    tokenizer: Tokenizer = field(default_factory=ByteTokenizer)

    def place(self, requested: str = "auto", field: str = "serve.device") -> Device:
        """Move the model to the device ``requested`` resolves to (``auto``: the accelerator torch finds, else the
        CPU; runtime/device.py) and return it. ``field`` is the config field a refusal names."""
        dev = decide_device(requested, field=field)
        self.model.to(dev.torch)
        return dev


def model_config_from(d: dict[str, Any]) -> ModelConfig:
    """A :class:`ModelConfig` from a JSON dict (unknown keys are ignored, so newer exports load)."""
    # Not init_from: where a trained model's first weights came from (perhaps a directory gone since)
    # does not matter to loading it, and ModelConfig checks that path.
    names = {f.name for f in dataclasses.fields(ModelConfig)} - {"init_from"}
    return ModelConfig(**{k: v for k, v in d.items() if k in names})


def checkpoint_root(path: str | Path) -> Path:
    """``<run>/checkpoints`` for a run directory; the path itself for a checkpoints root."""
    p = Path(path).expanduser().absolute()
    if (p / "checkpoints").is_dir():
        return p / "checkpoints"
    if ckpt_layout.committed_steps(p):
        return p
    raise WeightsError(f"{p}: no checkpoints found (expected a run directory with checkpoints/step_N, "
                       "a checkpoints directory, or a step_N directory); train first, or pass the right path")


def find_step_dir(path: str | Path, step: int | None = None) -> Path:
    """The step directory to load: ``path`` itself if it is one, else ``step`` or the newest that verifies."""
    p = Path(path).expanduser().absolute()
    if (p / ckpt_layout.MANIFEST).is_file():
        ckpt_layout.verify(p)
        return p
    root = checkpoint_root(p)
    steps = ckpt_layout.committed_steps(root)
    if step is not None and step >= 0:
        if step not in steps:
            raise WeightsError(f"no checkpoint for step {step} under {root}; have steps {steps}")
        d = root / ckpt_layout.step_dir_name(step)
        ckpt_layout.verify(d)
        return d
    problems = []
    for s in reversed(steps):
        d = root / ckpt_layout.step_dir_name(s)
        try:
            ckpt_layout.verify(d)
            return d
        except ckpt_layout.CheckpointCorruptError as exc:
            log.error("skipping checkpoint %s: %s", d, exc)
            problems.append(str(exc))
    raise WeightsError(f"no usable checkpoint under {root}: {problems or 'none committed'}")


def load_checkpoint(path: str | Path, step: int | None = None) -> LoadedModel:
    """A single-process GPT from a run's checkpoint, whatever layout wrote it (DCP resharding)."""
    d = find_step_dir(path, step)
    state = ckpt_layout.read_state(d)
    cfg = model_config_from(state["config"]["model"])
    model = GPT.for_loading(cfg)  # allocated, not initialised: every tensor is loaded below
    # No process group: DCP loads in this one process and reassembles every saved shard.
    sd = {k.removeprefix("model."): v for k, v in load_full(d, "model.").items()}
    if trains_adapters(state["config"].get("finetune") or {}):
        # Adapters only: served and evaluated merged into the run's base (model.init_from), W + scale * B @ A.
        from xirang_hpc.weights.hf import merged_lora_weights

        try:
            sd = merged_lora_weights(state, sd)
        except (ValueError, OSError) as exc:
            raise WeightsError(f"{d}: a LoRA run's checkpoint holds adapters only and its base cannot be read "
                               f"({exc}); the base is model.init_from={state['config']['model'].get('init_from')}") \
                from exc
    check_fits(model.state_dict(), sd, str(d))
    model.load_state_dict(sd)
    model.eval()
    tok = _fitting_tokenizer(load_run_tokenizer(run_dir_of(d)), cfg, str(d))
    return LoadedModel(model, cfg, str(d), int(state["step"]), tok)


def _fitting_tokenizer(tok: Tokenizer, cfg: ModelConfig, source: str) -> Tokenizer:
    """``tok`` when its ids fit the model's embedding (a tokenizer.json beside the weights must)."""
    if tok.tokenizer_json is not None and tok.vocab_size > cfg.vocab_size:
        raise WeightsError(f"{source}: its tokenizer {tok.name} has {tok.vocab_size} tokens but the model only "
                           f"{cfg.vocab_size} embeddings; the tokenizer.json beside it belongs to another model")
    return tok


def _sibling_config(path: Path) -> Path | None:
    for cand in (path.with_suffix(".json"), path.parent / "config.json"):
        if cand.is_file():
            return cand
    return None


def load_safetensors(path: str | Path) -> tuple[dict[str, torch.Tensor], dict[str, Any] | None]:
    """(tensors, model config dict or None) from a safetensors file and its JSON config.

    The config is looked up in the file's metadata (key ``config``), then ``<stem>.json``, then
    ``config.json`` beside it; a ``{"model": {...}}`` wrapper is unwrapped.
    """
    from safetensors import safe_open
    from safetensors.torch import load_file

    p = Path(path).expanduser().absolute()
    if not p.is_file():
        raise WeightsError(f"{p}: no such weights file; export one with `xirang-ckpt export --format safetensors`")
    try:
        tensors = load_file(str(p))
        with safe_open(str(p), framework="pt") as f:
            meta = f.metadata() or {}
    except Exception as exc:  # noqa: BLE001 - safetensors raises several types for a bad file
        raise WeightsError(f"{p}: not a readable safetensors file ({exc})") from exc
    cfg: dict[str, Any] | None = None
    if "config" in meta:
        cfg = json.loads(meta["config"])
    elif (side := _sibling_config(p)) is not None:
        cfg = json.loads(side.read_text())
    if cfg is not None and isinstance(cfg.get("model"), dict):
        cfg = cfg["model"]
    return tensors, cfg


def load_exported(path: str | Path) -> LoadedModel:
    """A single-process GPT from exported safetensors weights and their JSON config."""
    tensors, cfg_dict = load_safetensors(path)
    if cfg_dict is None:
        raise WeightsError(f"{path}: no model config found (safetensors metadata 'config', "
                           f"{Path(path).with_suffix('.json').name} or config.json beside it)")
    cfg = model_config_from(cfg_dict)
    model = GPT.for_loading(cfg)  # allocated, not initialised: every tensor is loaded below
    check_fits(model.state_dict(), tensors, str(path))
    model.load_state_dict(tensors)
    model.eval()
    source = str(Path(path).absolute())
    return LoadedModel(model, cfg, source, tokenizer=_fitting_tokenizer(load_run_tokenizer(Path(source).parent), cfg,
                                                                        source))


def load_hf(path: str | Path) -> LoadedModel:
    """A single-process GPT from a Hugging Face model directory (Llama, Mistral, Qwen2, Qwen3, GPT-2, Qwen3-MoE
    or Mixtral family)."""
    from xirang_hpc.config.errors import ConfigError
    from xirang_hpc.config.hf import apply_hf_model
    from xirang_hpc.weights.hf_import import init_model_from_hf

    try:
        fields = apply_hf_model({"init_from": str(path)}, [])
    except ConfigError as exc:
        raise WeightsError(str(exc)) from None
    cfg = model_config_from(fields)
    model = GPT.for_loading(cfg)  # every tensor comes from the files: no random init to throw away
    init_model_from_hf(model, path, cfg)  # HFImportError is a WeightsError
    model.eval()
    source = str(Path(path).absolute())
    # Its own tokenizer.json (eos from tokenizer_config.json) when it has one, else bytes.
    tok: Tokenizer = load_tokenizer(source) if (Path(source) / "tokenizer.json").is_file() else ByteTokenizer()
    return LoadedModel(model, cfg, source, tokenizer=_fitting_tokenizer(tok, cfg, source))


def load_any(path: str | Path, step: int | None = None) -> LoadedModel:
    """A ``.safetensors`` file, a Hugging Face directory, a run directory, a checkpoints or a step directory."""
    from xirang_hpc.config.hf import is_hf_dir

    if str(path).endswith(".safetensors"):
        return load_exported(path)
    if is_hf_dir(path) and not (Path(path) / "checkpoints").is_dir():
        return load_hf(path)
    return load_checkpoint(path, step)


def check_fits(expected: dict[str, Any], got: dict[str, torch.Tensor], source: str) -> None:
    """Raise :class:`WeightsError` naming missing tensors and shape mismatches."""
    missing = sorted(set(expected) - set(got))
    if missing:
        raise WeightsError(f"{source}: missing {len(missing)} tensor(s) the model needs, e.g. {missing[:3]}; "
                           "was it exported from a model of this preset?")
    for k, v in expected.items():
        if tuple(v.shape) != tuple(got[k].shape):
            raise WeightsError(f"{source}: tensor {k} has shape {tuple(got[k].shape)}, the model preset needs "
                               f"{tuple(v.shape)}; choose the model preset the weights were exported from")


def init_model_from(model: nn.Module, path: str | Path) -> int:
    """Copy exported weights into ``model`` (plain, DDP-wrapped, TP/FSDP DTensors or a pipeline stage).

    Every rank reads the full file and keeps its own shard. Returns the number of tensors set.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

    tensors, _ = load_safetensors(path)
    liveness.tick("weight import")  # read; an import that still moves is no hang
    # Full (unsharded) shapes of this rank's parameters; a pipeline stage holds a subset of names.
    ours = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=False))
    adapters = {k for k in ours if is_lora_param(k) and k not in tensors}  # LoRA on a base: adapters start fresh
    ours = {k: v for k, v in ours.items() if k not in adapters}
    check_fits(ours, tensors, str(path))
    wanted = {k: tensors[k].to(ours[k].dtype) for k in ours}
    set_model_state_dict(model, wanted, options=StateDictOptions(full_state_dict=True, strict=not adapters))
    return len(wanted)


class InitFromHook(TrainerHook):
    """``model.init_from=``: load exported weights or a Hugging Face directory at fit start (before restore)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def on_fit_start(self, trainer: Loop) -> None:
        """Initialise the model from the weights; a later checkpoint restore overrides it."""
        from xirang_hpc.config.hf import is_hf_dir, is_peft_dir, peft_base

        if is_peft_dir(self.path):  # the adapter's base, then the adapter itself, continued
            from xirang_hpc.weights.hf_import import init_model_from_hf
            from xirang_hpc.weights.peft import init_adapters_from_peft

            n = init_model_from_hf(trainer.model, peft_base(self.path), trainer.cfg.model)
            n += init_adapters_from_peft(trainer.model, self.path, trainer.cfg.model)
        elif is_hf_dir(self.path):
            from xirang_hpc.weights.hf_import import init_model_from_hf

            n = init_model_from_hf(trainer.model, self.path, trainer.cfg.model)
        else:
            n = init_model_from(trainer.model, self.path)
        if trainer.topo.rank == 0:
            trainer.log(f"model.init_from: {n} tensors from {self.path}")
