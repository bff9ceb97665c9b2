"""``model.init_from=<Hugging Face dir>``: each rank reads only its own regions, lazily.

A Hugging Face directory holds ``model.safetensors`` or shards listed in ``model.safetensors.index.json``.
For every parameter this rank holds (a pipeline stage holds only its own layers), the region it owns
is worked out: the whole tensor for a plain parameter; for a DTensor (tensor parallel, FSDP2, both)
the local shard's global offset and shape. That region is mapped through
:func:`xirang_hpc.weights.hf.tensor_map` (transposed GPT-2 ``Conv1D``, fused ``c_attn``, rotary row
permutation inside heads) to the Hugging Face rows and columns that hold it, and only those are read
with safetensors' lazy slices (``safe_open(...).get_slice(name)[rows, cols]``). Stacked experts
(``mlp.w1`` / ``w3`` / ``w2``, (E, out, in)) come from one Hugging Face tensor per expert: a rank whose
shard holds experts [e0, e1) (FSDP2 shards dim 0) opens only those experts' tensors. No rank ever holds a
whole tensor that is sharded, nor the whole model.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from xirang_hpc.config.hf import hf_family, read_hf_config
from xirang_hpc.config.schema import ModelConfig
from xirang_hpc.models.lora import is_lora_param
from xirang_hpc.runtime import liveness
from xirang_hpc.weights.errors import WeightsError
from xirang_hpc.weights.hf import IGNORED_HF_SUFFIXES, Src, expected_hf_shapes, hf_rows_for, tensor_map

#: What opens a safetensors file lazily (a module attribute so tests can record what each rank reads).
safe_open: Any = None


def _safe_open(path: str) -> Any:
    global safe_open
    if safe_open is None:
        from safetensors import safe_open as so

        safe_open = so
    return safe_open(path, framework="pt")


class HFImportError(WeightsError):
    """A Hugging Face directory that does not fit the model; names the file or tensor and the fix."""


class HFCheckpoint:
    """The tensors of a Hugging Face directory, by name, opened lazily (headers only until read)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path).expanduser().absolute()
        index = self.path / "model.safetensors.index.json"
        single = self.path / "model.safetensors"
        if index.is_file():
            try:
                weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
            except (ValueError, KeyError) as exc:
                raise HFImportError(f"{index}: not a safetensors index (no weight_map: {exc})") from None
            for f in sorted(set(weight_map.values())):
                if not (self.path / f).is_file():
                    raise HFImportError(f"{index} lists shard file {f}, which is missing from {self.path}; "
                                        "copy the complete model directory")
            self.files = {k: self.path / f for k, f in weight_map.items()}
        elif single.is_file():
            self.files = {}
            with _safe_open(str(single)) as f:
                self.files = {k: single for k in f.keys()}
        else:
            raise HFImportError(f"{self.path}: neither model.safetensors nor model.safetensors.index.json; "
                                "only safetensors weights are read (save with safe_serialization=True)")
        self._open: dict[Path, Any] = {}

    def handle(self, name: str) -> Any:
        """The open safetensors file holding ``name``."""
        if name not in self.files:
            raise HFImportError(f"{self.path}: tensor {name} is missing; the model config needs it")
        p = self.files[name]
        if p not in self._open:
            self._open[p] = _safe_open(str(p)).__enter__()
        return self._open[p]

    def shape(self, name: str) -> tuple[int, ...]:
        """Shape from the file header (no data read)."""
        return tuple(self.handle(name).get_slice(name).get_shape())

    def read(self, name: str, index: tuple[slice, ...]) -> torch.Tensor:
        """The region ``index`` of tensor ``name`` (only those bytes are read)."""
        return self.handle(name).get_slice(name)[index]

    def close(self) -> None:
        """Close every open file."""
        for h in self._open.values():
            h.__exit__(None, None, None)
        self._open.clear()


def _runs(sorted_idx: list[int]) -> list[tuple[int, int]]:
    """Maximal [start, stop) runs of consecutive integers."""
    runs: list[tuple[int, int]] = []
    for i in sorted_idx:
        if runs and runs[-1][1] == i:
            runs[-1] = (runs[-1][0], i + 1)
        else:
            runs.append((i, i + 1))
    return runs


def read_region(ckpt: HFCheckpoint, src: Src, full_shape: tuple[int, ...], offset: tuple[int, ...],
                shape: tuple[int, ...]) -> torch.Tensor:
    """Our tensor's region [offset, offset+shape) of a tensor whose full shape is ``full_shape``."""
    if src.experts:  # stacked experts: our dim 0 picks the HF tensors, dims 1 and 2 are a region of each
        inner = tuple(slice(o, o + n) for o, n in zip(offset[1:], shape[1:], strict=True))
        return torch.stack([ckpt.read(src.hf.format(e=e), inner)
                            for e in range(offset[0], offset[0] + shape[0])])  # (experts here, out, in)
    rows = range(offset[0], offset[0] + shape[0])
    need = hf_rows_for(src, rows, full_shape[0])  # HF output-dim indices, in our row order
    order = sorted(need)
    cols = slice(offset[1], offset[1] + shape[1]) if len(shape) > 1 else None
    parts = []
    for a, b in _runs(order):
        if cols is None:
            parts.append(ckpt.read(src.hf, (slice(a, b),)))
        elif src.transpose:  # HF (in, out): our rows are its columns
            parts.append(ckpt.read(src.hf, (cols, slice(a, b))).T)
        else:
            parts.append(ckpt.read(src.hf, (slice(a, b), cols)))
    data = torch.cat(parts) if len(parts) > 1 else parts[0]
    if order != need:
        pos = {h: i for i, h in enumerate(order)}
        data = data[torch.tensor([pos[h] for h in need])]
    return data


def local_region(p: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...], tuple[int, ...]]:
    """(local tensor to fill, global offset, local shape) of a parameter, sharded (DTensor) or not."""
    if isinstance(p, DTensor):
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
        local = p.to_local()
        if tuple(local.shape) != tuple(shape):
            raise HFImportError(f"local shard shape {tuple(local.shape)} != computed {tuple(shape)}")
        return local, tuple(offset), tuple(shape)
    return p, (0,) * p.dim(), tuple(p.shape)


def _clean(name: str) -> str:
    # Wrappers (activation checkpointing, torch.compile) insert these into parameter names.
    return name.replace("_checkpoint_wrapped_module.", "").replace("_orig_mod.", "")


def check_hf_shapes(ckpt: HFCheckpoint, cfg: ModelConfig, tmap: dict[str, Src], names: list[str]) -> None:
    """Every HF tensor the given parameters need exists with the shape ``cfg`` implies (headers only)."""
    want = expected_hf_shapes(cfg, tmap)
    for hf in sorted({h for n in names for h in tmap[n].expert_names()}):
        got = ckpt.shape(hf)
        exp = want[hf]
        ok = got == exp or (hf == "transformer.wpe.weight" and got[1:] == exp[1:] and got[0] >= exp[0])
        if not ok:
            ours = [n for n in names if hf in tmap[n].expert_names()]
            raise HFImportError(f"{ckpt.path}: tensor {hf} has shape {got}, the model config needs {exp} "
                                f"(for {', '.join(ours)}); use the model config the weights were saved with")


def check_expert_counts(ckpt: HFCheckpoint, tmap: dict[str, Src], names: list[str],
                        shapes: dict[str, tuple[int, ...]]) -> None:
    """Each stacked expert tensor finds exactly as many experts in the directory as the config has (names only)."""
    for n in names:
        src = tmap[n]
        if not src.experts:
            continue
        prefix, _, suffix = src.hf.partition("{e}")
        found = {k.removeprefix(prefix).removesuffix(suffix) for k in ckpt.files
                 if k.startswith(prefix) and k.endswith(suffix)}
        count = len({e for e in found if e.isdigit()})
        if count != src.experts:
            ours = shapes[n]
            one = ckpt.shape(src.hf.format(e=0)) if src.hf.format(e=0) in ckpt.files else ours[1:]
            raise HFImportError(f"{ckpt.path}: {src.hf.format(e='*')} holds {count} expert(s), stacked "
                                f"{(count, *one)}, but {n} needs {ours} (model.moe_experts={src.experts}); use the "
                                "model config the weights were saved with")


def init_model_from_hf(model: nn.Module, path: str | Path, cfg: ModelConfig) -> int:
    """Fill this rank's parameters of ``model`` from a Hugging Face directory; returns tensors set.

    ``model`` may be a plain GPT, one pipeline stage of it, or hold DTensor parameters (TP/FSDP2).
    """
    ckpt = HFCheckpoint(path)
    try:
        family = hf_family(read_hf_config(path), str(Path(path) / "config.json"))
        try:
            tmap = tensor_map(cfg, family)
        except ValueError as exc:
            raise HFImportError(f"{ckpt.path}: {exc}") from None
        full = _full_shapes(cfg)
        params = [(_clean(n), p) for n, p in model.named_parameters() if not is_lora_param(_clean(n))]
        check_expert_counts(ckpt, tmap, [n for n, _ in params if n in tmap], full)
        known = {h for s in tmap.values() for h in s.expert_names()}
        unknown = sorted(k for k in ckpt.files if k not in known
                         and not k.endswith(IGNORED_HF_SUFFIXES)
                         and not (cfg.tie_embeddings and k == "lm_head.weight"))  # a tied copy some save
        if unknown:
            raise HFImportError(f"{ckpt.path}: {len(unknown)} tensor(s) our model has no place for, e.g. "
                                f"{unknown[:3]}; the model config does not match the weights")
        # Tied head: listed once (named_parameters). LoRA adapters are not base weights: they keep their own start.
        missing = [n for n, _ in params if n not in tmap]
        if missing:
            raise HFImportError(f"parameters {missing[:3]} have no Hugging Face source")
        check_hf_shapes(ckpt, cfg, tmap, [n for n, _ in params])
        with torch.no_grad():
            for name, p in params:
                local, offset, shape = local_region(p)
                if local.numel() == 0:
                    continue
                region = read_region(ckpt, tmap[name], full[name], offset, shape)
                local.copy_(region.to(local.dtype))
                liveness.tick("weight import")  # a long import that still reads is no hang
        return len(params)
    finally:
        ckpt.close()


def _full_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    from xirang_hpc.weights.hf import param_shapes

    return param_shapes(cfg)
