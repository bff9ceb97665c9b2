"""LoRA adapters: the module arithmetic, the frozen base, and PEFT's own code as the reference.

A small Llama (GQA) is built with transformers' config classes and ``save_pretrained`` (nothing downloaded);
our model loads it, adapters go on, and peft loads our exported adapters onto transformers' model: the
logits agree within 1e-4. So does the merged model (``W + scale * B @ A``) that transformers loads.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from xirang_hpc.config.errors import ConfigError
from xirang_hpc.config.schema import LoraConfig, ModelConfig
from xirang_hpc.models.gpt import GPT
from xirang_hpc.models.lora import LoRALinear, apply_lora, is_lora_param, lora_state, merged_state

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
TOL = 1e-4
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("llama")
    torch.manual_seed(3)
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=128, rope_theta=10000.0,
                                   max_position_embeddings=32, rms_norm_eps=1e-5, bos_token_id=None,
                                   eos_token_id=None)
    transformers.LlamaForCausalLM(cfg).save_pretrained(path)
    return path


def _ours(path: Path, lora: LoraConfig) -> GPT:
    from xirang_hpc.weights.load import load_hf

    model = load_hf(path).model
    apply_lora(model, lora)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():  # non-zero B: the update must show in the logits
        for n, p in model.named_parameters():
            if is_lora_param(n):
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    return model.eval()


def test_adapter_starts_as_its_base_and_only_adapters_train() -> None:
    torch.manual_seed(0)
    cfg = ModelConfig(n_layer=2, n_head=2, d_model=32, vocab_size=64, seq_len=16, mlp="swiglu", norm="rmsnorm",
                      pos="rope", bias=False)
    with torch.device("meta"):
        model = GPT(cfg)
    done = apply_lora(model, LoraConfig(rank=4, alpha=8.0, target_modules=ALL))
    assert len(done) == 2 * 7
    model.materialize("cpu", seed=1)
    base = GPT(cfg, seed=1)
    x = torch.randint(0, 64, (2, 16))
    assert torch.equal(model(x), base(x))  # B starts at zero
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(is_lora_param(n) for n in trainable)
    assert len(trainable) == 2 * 7 * 2
    lin = model.layers["0"].attn.q
    assert isinstance(lin, LoRALinear) and lin.lora_A.weight.abs().sum() > 0
    model(x).sum().backward()
    assert all(p.grad is None for n, p in model.named_parameters() if not is_lora_param(n))
    assert lin.lora_B.weight.grad is not None and lin.lora_B.weight.grad.abs().sum() > 0


def test_target_modules_naming_no_module_lists_the_valid_ones() -> None:
    with pytest.raises(ConfigError) as err:
        LoraConfig(target_modules=["q_proj", "qkv"])
    msg = str(err.value)
    assert "finetune.lora.target_modules" in msg and "qkv" in msg and "gate_proj" in msg and "down_proj" in msg


def test_a_model_lacking_the_module_is_refused_by_name() -> None:
    cfg = ModelConfig(n_layer=1, n_head=2, d_model=32, vocab_size=64, seq_len=16, mlp="gelu")
    with torch.device("meta"):
        model = GPT(cfg)
    with pytest.raises(ValueError, match=r"gate_proj \(mlp.gate\) is not a linear layer.*it has: q_proj"):
        apply_lora(model, LoraConfig(target_modules=["gate_proj"]))


def test_peft_loads_our_adapters_onto_transformers_with_equal_logits(llama_dir: Path, tmp_path: Path) -> None:
    from xirang_hpc.weights.peft import adapter_config, to_peft_state, write_peft

    lora = LoraConfig(rank=4, alpha=8.0, target_modules=ALL)
    ours = _ours(llama_dir, lora)
    out = tmp_path / "adapter"
    out.mkdir()
    write_peft(out, to_peft_state(lora_state(ours), ours.cfg), adapter_config(lora, str(llama_dir)))
    base = transformers.LlamaForCausalLM.from_pretrained(llama_dir, dtype=torch.float32)
    x = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        plain = base(x).logits
        theirs = peft.PeftModel.from_pretrained(base, out).eval()(x).logits
        mine = ours(x)
    assert (mine - plain).abs().max().item() > 1e-2  # the adapters change the output
    assert (mine - theirs).abs().max().item() <= TOL


def test_merged_model_loads_in_transformers_with_equal_logits(llama_dir: Path, tmp_path: Path) -> None:
    from xirang_hpc.weights.hf import hf_config_for, to_hf_state, write_hf_weights

    lora = LoraConfig(rank=2, alpha=4.0, target_modules=["q_proj", "k_proj", "v_proj", "down_proj"])
    ours = _ours(llama_dir, lora)
    base = {n: p.detach() for n, p in ours.named_parameters() if not is_lora_param(n)}
    merged = merged_state(base, lora_state(ours), lora.scale)
    out = tmp_path / "merged"
    out.mkdir()
    write_hf_weights(to_hf_state(merged, ours.cfg), out, 1 << 30)
    import json

    (out / "config.json").write_text(json.dumps(hf_config_for(ours.cfg, torch.float32)))
    x = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        theirs = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)(x).logits
        assert (ours(x) - theirs).abs().max().item() <= TOL


def test_an_adapter_for_another_base_names_the_tensor_and_shapes(llama_dir: Path) -> None:
    from xirang_hpc.weights.peft import from_peft_state, to_peft_state

    lora = LoraConfig(rank=4, alpha=8.0, target_modules=["q_proj", "v_proj"])
    ours = _ours(llama_dir, lora)
    state = lora_state(ours)
    peft_sd = to_peft_state(state, ours.cfg)
    back = from_peft_state(peft_sd, ours.cfg, {k: tuple(v.shape) for k, v in state.items()})
    assert all(torch.equal(back[k], state[k]) for k in state)  # the rotary row permutation round-trips
    key = "base_model.model.model.layers.0.self_attn.v_proj.lora_B.weight"
    peft_sd[key] = torch.zeros(48, 4)
    with pytest.raises(ValueError, match=r"v_proj.lora_B.weight has shape \(48, 4\), this model needs \(32, 4\)"):
        from_peft_state(peft_sd, ours.cfg, {k: tuple(v.shape) for k, v in state.items()})
