"""train.precision=fp8: the config, the refusals and which linear layers it converts, on this CPU machine.

Float8 training itself needs a GPU with float8 matmuls and is tested there only
(``tests/test_gpu.py::test_fp8_training_follows_bf16``, run by ``benchmarks/gpu_check.sh``); nothing here
emulates it. The device's capability is a stand-in in the refusal test, as ``tests/test_device.py`` stands
in for accelerators: the rule is checked, not a GPU.
"""

from __future__ import annotations

from pathlib import Path

import parallel_harness as H
import pytest
import torch

from xirang_hpc.config.errors import ConfigError
from xirang_hpc.config.schema import FinetuneConfig, ModelConfig, TrainConfig
from xirang_hpc.models.gpt import GPT
from xirang_hpc.runtime.device import Device
from xirang_hpc.runtime.precision import check_fp8, fp8_eligible, fp8_filter, resolve
from xirang_hpc.runtime.trainer import Trainer


def test_fp8_is_a_precision_and_resolves_to_itself() -> None:
    assert TrainConfig(precision="fp8").precision == "fp8"
    assert resolve("fp8", torch.device("cpu")) == "fp8"
    with pytest.raises(ConfigError, match="choose auto, fp32, bf16 or fp8"):
        TrainConfig(precision="fp16")


def test_the_cpu_is_refused_at_start_up_naming_it(email_data: Path, tmp_path: Path) -> None:
    """A rank whose device is the CPU stops before training, with one line naming the field, the CPU and the fix."""
    cfg = H.make_cfg(1, {}, train={"precision": "fp8"})
    with pytest.raises(ConfigError) as err:
        Trainer(cfg, H.topology(0, 1, 0), tmp_path, email_data, log=lambda s: None)
    msg = str(err.value)
    assert msg.startswith("invalid config train.precision='fp8'") and "\n" not in msg
    assert "the CPU" in msg and "compute capability >= 8.9" in msg and "train.precision=bf16" in msg


@pytest.mark.parametrize("cap,ok", [((8, 0), False), ((8, 6), False), ((8, 9), True), ((9, 0), True),
                                    ((10, 0), True), (None, False)])
def test_capability_rule_names_what_the_device_has(monkeypatch: pytest.MonkeyPatch, cap: tuple | None,
                                                   ok: bool) -> None:
    """CUDA compute capability >= 8.9 (Ada, Hopper, Blackwell) has float8 matmuls; an A100 (8.0) or a ROCm /
    other accelerator (no NVIDIA capability) is refused with what it has."""
    monkeypatch.setattr(Device, "capability", lambda self: cap)
    monkeypatch.setattr(Device, "name", lambda self: "Stand-in GPU")
    dev = Device("cuda", 0)
    assert dev.supports_fp8() is ok
    if ok:
        check_fp8(dev)
        return
    with pytest.raises(ConfigError) as err:
        check_fp8(dev)
    want = f"cuda:0 (Stand-in GPU, compute capability {cap[0]}.{cap[1]})" if cap else "cuda:0 (Stand-in GPU)"
    assert want in str(err.value)


def test_linear_layers_converted_skip_the_head_and_unaligned_dims() -> None:
    """torchtitan's filter: every nn.Linear but the output head, both dims multiples of 16."""
    cfg = ModelConfig(name="t", n_layer=2, n_head=4, n_kv_head=2, d_model=64, d_ff=96, vocab_size=128, seq_len=16,
                      norm="rmsnorm", mlp="swiglu", pos="rope", bias=False)
    with torch.device("meta"):
        model = GPT(cfg)
    names = [n for n, m in model.named_modules() if fp8_eligible(m, n)]
    linears = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    assert "head" in linears and "head" not in names
    assert names == [n for n in linears if n != "head"] and len(names) == 2 * 7  # q, k, v, o, gate, up, down
    odd = ModelConfig(name="t", n_layer=1, n_head=4, d_model=64, d_ff=100, vocab_size=128, seq_len=16,
                      norm="rmsnorm", mlp="swiglu", pos="rope", bias=False)
    with torch.device("meta"):
        model = GPT(odd)
    names = [n for n, m in model.named_modules() if fp8_eligible(m, n)]
    assert names and not any(n.split(".")[-1] in ("gate", "up", "down", "w1", "w2", "w3") for n in names), names


def test_moe_routers_and_experts_stay_out_of_float8() -> None:
    """torchtitan's MoE filter: the router's top-k selection stays on bf16 scores; the stacked experts are not
    nn.Linear. The shared expert's linears and attention are converted."""
    cfg = ModelConfig(name="t", n_layer=2, n_head=4, d_model=64, vocab_size=128, seq_len=16, norm="rmsnorm",
                      mlp="swiglu", pos="rope", bias=False, moe_experts=16, moe_top_k=2, moe_ffn_hidden=32,
                      moe_shared_ffn_hidden=48)
    with torch.device("meta"):
        model = GPT(cfg)
    keep = fp8_filter(model)
    names = [n for n, m in model.named_modules() if keep(m, n)]
    routers = [n for n, m in model.named_modules() if n.endswith("mlp.gate")]
    assert routers and fp8_eligible(dict(model.named_modules())[routers[0]], routers[0])  # 64 x 16: aligned
    assert not set(routers) & set(names)
    assert any(n.endswith("mlp.shared.gate") for n in names) and any(n.endswith("attn.q") for n in names), names


def test_fp8_with_tensor_parallelism_or_lora_is_refused_by_name() -> None:
    with pytest.raises(ConfigError, match="parallel.tp=1"):
        H.make_cfg(2, {"tp": 2, "pp": 1, "dp": 1}, train={"precision": "fp8"})
    with pytest.raises(ConfigError, match="LoRA"):
        H.make_cfg(1, {}, train={"precision": "fp8"}, finetune=FinetuneConfig(method="lora"))
