"""Mixed precision: bf16 autocast on GPU, plain fp32 on CPU by default (``train.precision``).

- ``auto``: bf16 autocast when the model runs on an accelerator (runtime/device.py), fp32 on the CPU.
- ``fp32``: no autocast at all; the forward is left untouched (bitwise the plain fp32 run).
- ``bf16``: ``torch.autocast(device_type, dtype=torch.bfloat16)`` around the forward. Parameters,
  gradients and optimizer state stay fp32 (the autocast recipe: only the matmul-class ops run in
  bf16); under FSDP2 the blocks' weights are gathered in bf16 and their gradients reduced in fp32
  (:func:`xirang_hpc.runtime.data_parallel.block_precision`). CPU autocast supports bf16 too, which is
  how it is tested here.
- ``fp8``: bf16 autocast as above, and the linear layers' matmuls in float8 through torchao's float8
  training (``torchao.float8.convert_to_float8_training`` with the ``rowwise`` recipe: per-row scales of
  the activations and per-column scales of the weights, computed dynamically in every pass), applied as
  torchtitan applies it: to every ``nn.Linear`` but the output head and the mixture-of-experts routers
  (torchtitan's MoE configs filter ``output`` and ``router.gate``: top-k selection on float8 scores would
  change which experts a token goes to), and only where both of its dimensions are multiples of 16
  (float8 tensor-core GEMMs need them; torchtitan's ``Float8LinearConverter`` filters the same way). The
  experts themselves are stacked parameters, not ``nn.Linear``, and stay in bf16. Only where the device
  has float8 matmuls (a CUDA GPU of compute capability >= 8.9: :meth:`Device.supports_fp8`); anywhere
  else the run is refused at start-up, naming the device found. Tested on a GPU only
  (``tests/test_gpu.py``), never emulated.

The loss is always computed in fp32: :func:`xirang_hpc.models.gpt.lm_loss` casts the logits
before the cross-entropy, outside the autocast region.

The autocast wraps the *root* module's ``forward`` on the instance (as recompute wraps the
blocks'), so every caller is covered without code paths of its own: DDP and FSDP2 (which call
the module), pipeline stages (the schedule calls the stage module) and evaluation; parameter
names do not change.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch import nn

from xirang_hpc.config.errors import ConfigError
from xirang_hpc.models.moe import MoE
from xirang_hpc.runtime.device import FP8_MIN_CAPABILITY, Device

MODES = ("auto", "fp32", "bf16", "fp8")
FP8_RECIPE = "rowwise"
FP8_DIM_MULTIPLE = 16  # both dims of a converted linear layer (float8 GEMM alignment)
HEAD = "head"  # the output projection (models/gpt.py): kept in bf16


def resolve(mode: str, device: torch.device) -> str:
    """The effective precision (``fp32``, ``bf16`` or ``fp8``) of ``mode`` on ``device``."""
    if mode not in MODES:
        raise ValueError(f"train.precision {mode!r}: choose one of {MODES}")
    if mode == "auto":
        return "fp32" if device.type == "cpu" else "bf16"
    return mode


def apply_autocast(model: nn.Module, mode: str, device: torch.device) -> str:
    """Run ``model``'s forward under bf16 autocast when ``mode`` resolves to bf16 or fp8; returns the resolved
    mode."""
    eff = resolve(mode, device)
    if eff == "fp32":
        return eff
    forward = model.forward

    @functools.wraps(forward)
    def run(*args: object, **kw: object) -> torch.Tensor:
        with torch.autocast(device_type=device.type, dtype=torch.bfloat16):
            return forward(*args, **kw)

    model.forward = run  # type: ignore[method-assign]
    return eff


def check_fp8(device: Device) -> None:
    """Refuse ``train.precision=fp8`` on a device without float8 matmuls, naming what was found."""
    if not device.supports_fp8():
        need = ".".join(map(str, FP8_MIN_CAPABILITY))
        raise ConfigError("train.precision", "fp8",
                          f"needs float8 matmuls: a CUDA GPU of compute capability >= {need} (Ada, Hopper or newer); "
                          f"this rank's device is {device.describe()}; use train.precision=bf16")


def fp8_eligible(module: nn.Module, fqn: str) -> bool:
    """Whether ``convert_to_float8_training`` should convert the linear layer at ``fqn``: not the output head,
    and both of its dimensions multiples of 16 (torchtitan's filter)."""
    if not isinstance(module, nn.Linear):
        return False
    if fqn == HEAD or fqn.endswith("." + HEAD):
        return False
    return module.in_features % FP8_DIM_MULTIPLE == 0 and module.out_features % FP8_DIM_MULTIPLE == 0


def fp8_filter(model: nn.Module) -> Callable[[nn.Module, str], bool]:
    """:func:`fp8_eligible`, less ``model``'s mixture-of-experts routers."""
    routers = {id(m.gate) for m in model.modules() if isinstance(m, MoE)}

    def keep(module: nn.Module, fqn: str) -> bool:
        return id(module) not in routers and fp8_eligible(module, fqn)

    return keep


def apply_float8(model: nn.Module, device: Device) -> list[str]:
    """Swap ``model``'s eligible linear layers for torchao's ``Float8Linear`` (rowwise recipe); returns their
    names. Refuses a device without float8 matmuls, and a missing torchao, by name."""
    check_fp8(device)
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except ImportError:
        raise ConfigError("train.precision", "fp8", "needs torchao's float8 training: pip install torchao "
                          "(or pip install 'xirang-hpc[fp8]'), or use train.precision=bf16") from None
    keep = fp8_filter(model)
    names = [n for n, m in model.named_modules() if keep(m, n)]
    convert_to_float8_training(model, module_filter_fn=keep,
                               config=Float8LinearConfig.from_recipe_name(FP8_RECIPE))
    return names
