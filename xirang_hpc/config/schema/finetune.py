"""The finetune group: how a model loaded from ``model.init_from`` is trained.

``method=full`` (the default) trains every parameter. ``method=lora`` (Hu et al. 2021) freezes the base
weights and trains a low-rank update ``(alpha / rank) * B @ A`` beside each targeted linear layer; the
checkpoints then hold only the adapters and their optimizer state, and ``xirang-ckpt export --format peft``
writes them as a PEFT adapter directory (see xirang_hpc/models/lora.py).

``method=dpo`` (Rafailov et al. 2023) tunes on preference pairs (``data.format=pairs``): the loss is
``-logsigmoid(beta * ((pi_c - pi_r) - (ref_c - ref_r)))`` over the summed log-probs of the completion tokens
of the chosen and rejected replies, under the policy and a frozen reference (the starting weights; with
``dpo.lora=true`` the policy is LoRA adapters on the frozen base and the reference is the base with the
adapters disabled). See xirang_hpc/models/dpo.py.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from xirang_hpc.config.errors import ConfigError

METHODS = ("full", "lora", "dpo")
#: The DPO losses implemented (TRL's ``loss_type`` names); others (hinge, ipo, ...) are refused.
DPO_LOSSES = ("sigmoid",)
#: Our linear layers (module name inside a block) and the Hugging Face / PEFT names for them.
LORA_TARGETS: dict[str, str] = {"attn.q": "q_proj", "attn.k": "k_proj", "attn.v": "v_proj", "attn.o": "o_proj",
                                "mlp.gate": "gate_proj", "mlp.up": "up_proj", "mlp.down": "down_proj"}


def lora_target(name: str) -> str:
    """Our block-relative module (``attn.q``) for a target name: ours (``attn.q``, ``q``) or PEFT's (``q_proj``).

    A ConfigError naming ``finetune.lora.target_modules`` and listing the valid names otherwise.
    """
    for ours, hf in LORA_TARGETS.items():
        if name in (ours, hf, ours.split(".")[1]):
            return ours
    valid = ", ".join(f"{hf} ({ours})" for ours, hf in LORA_TARGETS.items())
    raise ConfigError("finetune.lora.target_modules", name, f"names no linear layer; valid: {valid}")


def trains_adapters(finetune: Mapping[str, Any]) -> bool:
    """Whether a run's recorded ``finetune`` group (a plain dict, as checkpoints hold it) trained LoRA adapters:
    ``method=lora``, or ``method=dpo`` with ``dpo.lora``."""
    method = finetune.get("method", "full")
    return method == "lora" or (method == "dpo" and bool((finetune.get("dpo") or {}).get("lora")))


@dataclass
class LoraConfig:
    """The low-rank adapters of ``finetune.method=lora``."""

    rank: int = 8
    alpha: float = 16.0
    # Dropout on the adapter's input (training only). Non-zero draws differ between layouts.
    dropout: float = 0.0
    # PEFT names (q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj) or ours (attn.q, mlp.up).
    target_modules: list[str] = field(default_factory=lambda: ["q_proj", "v_proj"])

    def __post_init__(self) -> None:
        if int(self.rank) < 1:
            raise ConfigError("finetune.lora.rank", self.rank, "must be a positive integer")
        if not math.isfinite(float(self.alpha)) or float(self.alpha) <= 0:
            raise ConfigError("finetune.lora.alpha", self.alpha, "must be a positive finite number")
        if not 0.0 <= float(self.dropout) < 1.0:
            raise ConfigError("finetune.lora.dropout", self.dropout, "must be in [0, 1)")
        if not list(self.target_modules):
            raise ConfigError("finetune.lora.target_modules", self.target_modules, "name at least one module")
        for t in self.target_modules:
            lora_target(str(t))

    @property
    def scale(self) -> float:
        """The factor of the low-rank update: alpha / rank (PEFT's ``scaling``)."""
        return float(self.alpha) / int(self.rank)

    def modules(self) -> list[str]:
        """Our block-relative module names of ``target_modules``, in block order, without repeats."""
        want = {lora_target(str(t)) for t in self.target_modules}
        return [m for m in LORA_TARGETS if m in want]


@dataclass
class DpoConfig:
    """Direct preference optimisation (``finetune.method=dpo``) on ``data.format=pairs``."""

    # The inverse temperature of the implicit reward beta * (log pi - log ref).
    beta: float = 0.1
    # sigmoid: the DPO paper's loss (TRL's default loss_type); no other is implemented.
    loss: str = "sigmoid"
    # true: train LoRA adapters (finetune.lora.*); the reference is the base with the adapters disabled.
    lora: bool = False

    def __post_init__(self) -> None:
        if not math.isfinite(float(self.beta)) or float(self.beta) <= 0:
            raise ConfigError("finetune.dpo.beta", self.beta, "must be a positive finite number")
        if self.loss not in DPO_LOSSES:
            raise ConfigError("finetune.dpo.loss", self.loss,
                              f"only {', '.join(DPO_LOSSES)} is implemented (hinge, ipo, robust and TRL's other "
                              "loss types are not)")


@dataclass
class FinetuneConfig:
    """What is trained of the model and how: everything (``full``), low-rank adapters (``lora``), or preference
    tuning against a frozen reference (``dpo``)."""

    method: str = "full"
    lora: LoraConfig = field(default_factory=LoraConfig)
    dpo: DpoConfig = field(default_factory=DpoConfig)

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ConfigError("finetune.method", self.method, f"choose one of {', '.join(METHODS)}")
        if self.method != "dpo" and (self.dpo.lora or float(self.dpo.beta) != 0.1 or self.dpo.loss != "sigmoid"):
            raise ConfigError("finetune.dpo", "set", f"only finetune.method=dpo reads finetune.dpo.*, not "
                              f"finetune.method={self.method}")

    @property
    def adapters(self) -> bool:
        """Whether the run trains LoRA adapters on a frozen base (``method=lora``, or ``dpo`` with ``dpo.lora``)."""
        return self.method == "lora" or (self.method == "dpo" and bool(self.dpo.lora))
