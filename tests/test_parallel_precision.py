"""train.precision: auto = fp32 on CPU (bitwise the plain run), bf16 = autocast, loss in fp32.

CPU autocast supports bf16, so the bf16 path runs here for real. The CUDA path (auto -> bf16 under
nccl) cannot run on this machine (no GPU): only its resolution rule is checked, with a
``torch.device("cuda")`` object, which needs no GPU.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import parallel_harness as H
import pytest
import torch

from xirang_hpc.config.errors import ConfigError
from xirang_hpc.config.schema import ModelConfig, TrainConfig
from xirang_hpc.models.gpt import GPT, lm_loss
from xirang_hpc.runtime.precision import apply_autocast, resolve


@pytest.fixture(scope="module")
def fp32(email_data: Path) -> dict:
    return H.reference(email_data, steps=6, train={"precision": "fp32"})


def test_resolution_rule_and_bad_values() -> None:
    assert resolve("auto", torch.device("cpu")) == "fp32"
    assert resolve("auto", torch.device("cuda", 0)) == "bf16"  # GPU path: rule only (no GPU here)
    assert resolve("bf16", torch.device("cpu")) == "bf16" and resolve("fp32", torch.device("cuda")) == "fp32"
    with pytest.raises(ValueError, match="train.precision 'fp16'"):
        resolve("fp16", torch.device("cpu"))
    with pytest.raises(ConfigError, match="train.precision"):
        TrainConfig(precision="fp16")


def test_bf16_forward_is_autocast_and_loss_is_fp32() -> None:
    cfg = ModelConfig(name="t", n_layer=2, n_head=2, d_model=16, seq_len=8)
    x = torch.randint(0, 256, (2, 8))
    plain = GPT(cfg)
    assert apply_autocast(plain, "auto", torch.device("cpu")) == "fp32"
    assert "forward" not in vars(plain), "fp32 leaves the forward untouched"
    assert plain(x).dtype == torch.float32
    model = GPT(cfg)
    assert apply_autocast(model, "bf16", torch.device("cpu")) == "bf16"
    logits = model(x)
    assert logits.dtype == torch.bfloat16
    loss = lm_loss(logits, x)
    assert loss.dtype == torch.float32
    loss.backward()
    assert all(p.dtype == torch.float32 and p.grad.dtype == torch.float32 for p in model.parameters())


def test_auto_on_cpu_is_bitwise_fp32(email_data: Path, fp32: dict) -> None:
    auto = H.reference(email_data, steps=6)  # TrainConfig default: precision=auto
    assert auto["losses"] == fp32["losses"] and auto["norms"] == fp32["norms"] and auto["val"] == fp32["val"]
    for name, want in fp32["params"].items():
        np.testing.assert_array_equal(auto["params"][name], want, err_msg=name)


def test_bf16_trains_close_to_fp32_but_not_equal(email_data: Path, fp32: dict) -> None:
    bf16 = H.reference(email_data, steps=6, train={"precision": "bf16"})
    rel = [abs(a / b - 1) for a, b in zip(bf16["losses"], fp32["losses"])]
    assert max(rel) > 1e-6, "bf16 autocast must change the numbers"
    np.testing.assert_allclose(bf16["losses"], fp32["losses"], rtol=1e-2)
    np.testing.assert_allclose(bf16["val"], fp32["val"], rtol=1e-2)
    assert bf16["losses"][-1] < bf16["losses"][0] - 0.3, "it trains"
    assert bf16["val"] != fp32["val"]
