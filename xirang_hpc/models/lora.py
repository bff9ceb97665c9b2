"""Low-rank adapters (LoRA, Hu et al. 2021) on the linear layers of a :class:`~xirang_hpc.models.gpt.GPT`.

:func:`apply_lora` swaps each targeted ``nn.Linear`` of every block for a :class:`LoRALinear`: the same
``weight`` (and ``bias``) under the same names (``layers.3.attn.q.weight``), so base weights load and
checkpoint exactly as before, plus ``lora_A`` (rank x in) and ``lora_B`` (out x rank) children. The output
is ``x W^T + b + (alpha / rank) * B(A(dropout(x)))``, PEFT's ``LoraLayer`` arithmetic, and every parameter
but the adapters is frozen (``requires_grad`` False: no gradient, no optimizer state, not in checkpoints).

Initial values (xirang_hpc/models/init.py, layout-independent like every parameter): B zero, so the adapted
model starts equal to its base; A normal with the standard deviation of PEFT's default uniform A
(``kaiming_uniform_(a=sqrt(5))``: +-1/sqrt(in), std 1/sqrt(3 in), for in = d_model).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from xirang_hpc.config.schema import ModelConfig
from xirang_hpc.config.schema.finetune import LORA_TARGETS, LoraConfig

LORA_SUFFIXES = (".lora_A.weight", ".lora_B.weight")


class LoRALinear(nn.Module):
    """A frozen linear layer (``weight``, ``bias`` as ``nn.Linear``'s) plus a trainable low-rank update."""

    def __init__(self, in_features: int, out_features: int, bias: bool, rank: int, scale: float,
                 dropout: float = 0.0) -> None:
        super().__init__()
        self.in_features, self.out_features, self.scale = in_features, out_features, scale
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None
        self.lora_A = nn.Linear(in_features, rank, bias=False)
        self.lora_B = nn.Linear(rank, out_features, bias=False)
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.disabled = False  # True inside :func:`adapters_disabled`: the base projection only

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (..., in) -> (..., out): the base projection plus ``scale * B(A(dropout(x)))``."""
        if self.disabled:
            return F.linear(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias) + self.lora_B(self.lora_A(self.dropout(x))) * self.scale

    def delta(self) -> torch.Tensor:
        """The weight update ``scale * B @ A`` (out, in) that :func:`merged_state` adds to ``weight``."""
        return (self.lora_B.weight @ self.lora_A.weight) * self.scale


@contextlib.contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[None]:
    """Run ``model`` as its base inside the block: every :class:`LoRALinear` skips its update (PEFT's
    ``disable_adapter``); the DPO reference of an adapter run."""
    mods = [m for m in model.modules() if isinstance(m, LoRALinear)]
    for m in mods:
        m.disabled = True
    try:
        yield
    finally:
        for m in mods:
            m.disabled = False


def _owner(block: nn.Module, rel: str) -> tuple[nn.Module, str]:
    parent_name, _, leaf = rel.rpartition(".")
    return block.get_submodule(parent_name), leaf


def apply_lora(model: nn.Module, cfg: LoraConfig) -> list[str]:
    """Put adapters on ``cfg.target_modules`` of every block of ``model`` (a GPT or a stage), freeze the rest.

    Works on a meta-device model (before materialisation) or a live one (the base values are kept).
    Returns the adapted module names. A ValueError when a target is missing from the model (a GELU MLP has
    no ``gate_proj``; a mixture-of-experts block has no dense MLP), naming it and listing what the model has.
    """
    wanted = cfg.modules()
    for p in model.parameters():
        p.requires_grad_(False)
    done: list[str] = []
    for idx, block in model.layers.items():  # type: ignore[union-attr]
        present = [m for m in LORA_TARGETS if isinstance(_get(block, m), nn.Linear)]
        for rel in wanted:
            lin = _get(block, rel)
            if not isinstance(lin, nn.Linear):
                have = ", ".join(f"{LORA_TARGETS[m]} ({m})" for m in present)
                raise ValueError(f"finetune.lora.target_modules: {LORA_TARGETS[rel]} ({rel}) is not a linear layer "
                                 f"of block {idx} of this model; it has: {have}")
            owner, leaf = _owner(block, rel)
            with torch.device(lin.weight.device):
                new = LoRALinear(lin.in_features, lin.out_features, lin.bias is not None, cfg.rank, cfg.scale,
                                 cfg.dropout)
            new.weight = nn.Parameter(lin.weight.detach(), requires_grad=False)
            if lin.bias is not None:
                new.bias = nn.Parameter(lin.bias.detach(), requires_grad=False)
            setattr(owner, leaf, new)
            done.append(f"layers.{idx}.{rel}")
    return done


def _get(block: nn.Module, rel: str) -> nn.Module | None:
    try:
        return block.get_submodule(rel)
    except AttributeError:
        return None


def is_lora_param(name: str) -> bool:
    """Whether parameter ``name`` is an adapter weight."""
    return name.endswith(LORA_SUFFIXES)


def lora_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The adapter tensors of a (one-process) model, by our parameter names."""
    return {n: p.detach() for n, p in model.named_parameters() if is_lora_param(n)}


def merged_state(base: dict[str, torch.Tensor], adapters: dict[str, torch.Tensor],
                 scale: float) -> dict[str, torch.Tensor]:
    """``base`` (our names) with each adapted weight replaced by ``W + scale * B @ A`` (fp32 arithmetic)."""
    out = dict(base)
    for name in adapters:
        if not name.endswith(".lora_A.weight"):
            continue
        mod = name.removesuffix(".lora_A.weight")
        a, b = adapters[name].float(), adapters[mod + ".lora_B.weight"].float()
        w = base[mod + ".weight"]
        out[mod + ".weight"] = (w.float() + scale * (b @ a)).to(w.dtype)
    return out


def lora_params(model_cfg: ModelConfig, lora: LoraConfig) -> int:
    """Adapter parameters of the whole model (not one rank's share), counted on the meta device."""
    from xirang_hpc.models.gpt import GPT

    with torch.device("meta"):
        model = GPT(model_cfg)
    apply_lora(model, lora)
    return sum(p.numel() for n, p in model.named_parameters() if is_lora_param(n))
