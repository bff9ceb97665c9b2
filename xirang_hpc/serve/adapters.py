"""Several LoRA adapters served over one base model, each request choosing its own (``model`` of the OpenAI API).

``xirang-serve BASE --adapter NAME=DIR`` (``serve.adapters``) loads PEFT adapter directories (ours from
``xirang-ckpt export --format peft``, or anyone's) onto the base once. Every targeted linear layer becomes a
:class:`MultiLoRALinear` holding all adapters stacked, row 0 being "no adapter" (zeros): a batch mixes
requests of different adapters and of the base, and each row gets ``W x + s_i B_i A_i x`` for its own
adapter ``i`` (one gathered batched matmul per layer, as S-LoRA and Punica batch them). Ranks may differ: each
adapter is zero-padded to the largest rank, which changes no sum. The base weights are shared, never copied
or merged, so an adapter costs its own tensors only.

Which adapter each row uses is set per forward pass with :meth:`AdapterSet.rows`, in the calling thread
only (thread-local), so the engine's generation thread and the scoring of ``echo``/``logprobs`` requests
never see each other's rows.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from xirang_hpc.config.hf import PEFT_WEIGHTS, read_peft_config
from xirang_hpc.config.schema import ModelConfig
from xirang_hpc.config.schema.finetune import LORA_TARGETS, lora_target
from xirang_hpc.config.schema.serve import ADAPTER_NAME
from xirang_hpc.weights.errors import WeightsError


class AdapterSet:
    """The adapters served on one model: names (index 1..N; 0 is the base) and the rows of the current pass."""

    def __init__(self, names: Sequence[str]) -> None:
        self.names = list(names)
        self._local = threading.local()

    def index(self, name: str) -> int | None:
        """1-based index of the adapter ``name``; None when it is not one."""
        return self.names.index(name) + 1 if name in self.names else None

    @contextlib.contextmanager
    def rows(self, idx: Sequence[int]) -> Iterator[None]:
        """Inside the block, forward passes of this thread use adapter ``idx[b]`` for batch row ``b`` (0: none)."""
        prev = getattr(self._local, "idx", None)
        self._local.idx = torch.tensor(list(idx), dtype=torch.long) if any(idx) else None
        try:
            yield
        finally:
            self._local.idx = prev

    def current(self) -> torch.Tensor | None:
        """The row indices of this thread's pass, or None (every row the base)."""
        return getattr(self._local, "idx", None)


class MultiLoRALinear(nn.Module):
    """A frozen linear layer plus N stacked low-rank updates, one chosen per batch row."""

    def __init__(self, base: nn.Linear, a: torch.Tensor, b: torch.Tensor, scale: torch.Tensor,
                 adapters: AdapterSet) -> None:
        super().__init__()
        self.weight, self.bias = base.weight, base.bias
        # (N+1, r, in), (N+1, out, r), (N+1,): row 0 is zeros (the base); buffers, so .to(device) moves them.
        self.register_buffer("lora_A", a, persistent=False)
        self.register_buffer("lora_B", b, persistent=False)
        self.register_buffer("scale", scale, persistent=False)
        self.adapters = adapters

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (B, T, in) -> (B, T, out): ``W x + b`` plus, per row, its adapter's ``scale * B A x``."""
        y = F.linear(x, self.weight, self.bias)
        d = self.row_delta(x)
        return y if d is None else y + d

    def row_delta(self, x: torch.Tensor) -> torch.Tensor | None:
        """The adapters' part alone, x (B, T, in) -> (B, T, out); None when every row is the base (the KV
        cache's fused q/k/v projection adds it to its own product)."""
        idx = self.adapters.current()
        if idx is None:
            return None
        idx = idx.to(x.device)
        a = self.lora_A[idx].to(x.dtype)  # (B, r, in)
        b = self.lora_B[idx].to(x.dtype)  # (B, out, r)
        h = torch.bmm(x, a.transpose(1, 2))  # (B, T, r)
        return torch.bmm(h, b.transpose(1, 2)) * self.scale[idx].to(x.dtype).view(-1, 1, 1)


def _read_adapter(name: str, path: Path, cfg: ModelConfig) -> tuple[float, dict[str, torch.Tensor]]:
    """(scale, our adapter tensors by name) of one PEFT adapter directory, checked against ``cfg``'s shapes."""
    from safetensors.torch import load_file

    from xirang_hpc.config.errors import ConfigError
    from xirang_hpc.weights.hf import param_shapes
    from xirang_hpc.weights.peft import from_peft_state

    try:
        pc = read_peft_config(path)
    except ConfigError as exc:
        raise WeightsError(f"serve.adapters.{name}: {exc}") from None
    rank, targets = int(pc.get("r", 8)), [lora_target(str(t)) for t in pc["target_modules"]]
    shapes = param_shapes(cfg)
    expected = {}
    for i in range(cfg.n_layer):
        for m in targets:
            out_f, in_f = shapes[f"layers.{i}.{m}.weight"]
            expected[f"layers.{i}.{m}.lora_A.weight"] = (rank, in_f)
            expected[f"layers.{i}.{m}.lora_B.weight"] = (out_f, rank)
    try:
        tensors = from_peft_state(load_file(str(path / PEFT_WEIGHTS)), cfg, expected)
    except ValueError as exc:
        raise WeightsError(f"serve.adapters.{name} ({path}): {exc}") from None
    return float(pc.get("lora_alpha", 8)) / rank, tensors


def attach_adapters(model: nn.Module, cfg: ModelConfig, adapters: dict[str, str]) -> AdapterSet:
    """Load every PEFT adapter of ``adapters`` (name -> directory) onto ``model`` (a whole GPT, placed on its
    device) and return the set a request picks from. An adapter of another base (a tensor of another shape) is
    refused naming it and the tensor, before the model is changed."""
    names = list(adapters)
    for n in names:
        if not ADAPTER_NAME.match(n):
            raise WeightsError(f"serve.adapters: adapter name {n!r} must be letters, digits, '.', '_' or '-' "
                               "(it is what a request's model field says)")
    read = [_read_adapter(n, Path(adapters[n]).expanduser(), cfg) for n in names]
    aset = AdapterSet(names)
    device = next(model.parameters()).device
    for mod_name in LORA_TARGETS:
        for i, block in model.layers.items():  # type: ignore[union-attr]
            key = f"layers.{i}.{mod_name}"
            if not any(f"{key}.lora_A.weight" in t for _, t in read):
                continue
            parent_name, _, leaf = mod_name.rpartition(".")
            parent = block.get_submodule(parent_name)
            base = getattr(parent, leaf)
            r = max(t[f"{key}.lora_A.weight"].shape[0] for _, t in read if f"{key}.lora_A.weight" in t)
            a = torch.zeros(len(names) + 1, r, base.in_features)
            b = torch.zeros(len(names) + 1, base.out_features, r)
            scale = torch.zeros(len(names) + 1)
            for j, (s, t) in enumerate(read, start=1):
                if f"{key}.lora_A.weight" in t:
                    ta, tb = t[f"{key}.lora_A.weight"], t[f"{key}.lora_B.weight"]
                    a[j, : ta.shape[0]] = ta
                    b[j, :, : tb.shape[1]] = tb
                    scale[j] = s
            setattr(parent, leaf, MultiLoRALinear(base, a.to(device), b.to(device), scale.to(device), aset))
    return aset
