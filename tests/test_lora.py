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


# ---- a PEFT adapter as model.init_from: the base from its base_model_name_or_path, the adapter continued --------

TINY_LLAMA = ["model.norm=rmsnorm", "model.mlp=swiglu", "model.pos=rope", "model.bias=false"]


@pytest.fixture(scope="module")
def peft_adapter(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(base dir, adapter dir): a tiny-preset Llama and a LoRA adapter peft made on it (random, non-zero B)."""
    from test_lora_run import make_llama

    root = tmp_path_factory.mktemp("peft")
    make_llama(root / "base")
    base = transformers.LlamaForCausalLM.from_pretrained(root / "base", dtype=torch.float32)
    torch.manual_seed(7)
    cfg = peft.LoraConfig(r=4, lora_alpha=12, target_modules=["q_proj", "k_proj", "v_proj", "down_proj"],
                          lora_dropout=0.0, init_lora_weights=False)
    peft.get_peft_model(base, cfg).save_pretrained(root / "adapter")
    return root / "base", root / "adapter"


def _adapter_run(adapter: Path, *extra: str) -> object:
    from conftest import compose_cfg

    from xirang_hpc.config.validate import load_config

    return load_config(compose_cfg(["model=tiny", f"model.init_from={adapter}", "finetune.method=lora",
                                    *TINY_LLAMA, *extra]))


def test_a_peft_adapter_as_init_from_continues_it_with_peft_s_logits(peft_adapter: tuple[Path, Path]) -> None:
    """The adapter's shape becomes finetune.lora.*, its base model.*; the model the job builds and initialises
    from it computes what peft's PeftModel computes."""
    from types import SimpleNamespace

    from xirang_hpc.weights.load import InitFromHook

    base_dir, adapter = peft_adapter
    cfg = _adapter_run(adapter)
    lora = cfg.finetune.lora
    assert (lora.rank, lora.alpha, sorted(lora.modules())) == (4, 12.0, ["attn.k", "attn.q", "attn.v", "mlp.down"])
    assert cfg.model.init_from == str(adapter) and cfg.model.n_layer == 4
    model = GPT(cfg.model, seed=0)
    apply_lora(model, lora)
    logs: list[str] = []
    InitFromHook(str(adapter)).on_fit_start(SimpleNamespace(model=model, cfg=cfg, topo=SimpleNamespace(rank=0),
                                                            log=logs.append))
    assert logs and "tensors from" in logs[0]
    base = transformers.LlamaForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    x = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        plain = base(x).logits
        theirs = peft.PeftModel.from_pretrained(base, adapter).eval()(x).logits
        mine = model.eval()(x)
    assert (theirs - plain).abs().max().item() > 1e-2  # the adapter changes the output
    assert (mine - theirs).abs().max().item() <= TOL


def test_a_peft_adapter_that_cannot_be_continued_is_refused_by_name(peft_adapter: tuple[Path, Path],
                                                                    tmp_path: Path) -> None:
    import json
    import shutil

    from xirang_hpc.weights.errors import WeightsError
    from xirang_hpc.weights.peft import init_adapters_from_peft

    base_dir, adapter = peft_adapter
    with pytest.raises(ConfigError, match=r"finetune.method.*PEFT LoRA adapter.*merge it first"):
        _adapter_run(adapter, "finetune.method=full")

    def variant(name: str, **change: object) -> Path:
        d = tmp_path / name
        shutil.copytree(adapter, d)
        cfg = json.loads((d / "adapter_config.json").read_text())
        (d / "adapter_config.json").write_text(json.dumps({**cfg, **change}))
        return d

    with pytest.raises(ConfigError, match=r"use_dora.*not implemented"):
        _adapter_run(variant("dora", use_dora=True))
    with pytest.raises(ConfigError, match=r"model.init_from.*base_model_name_or_path 'meta-llama/x'.*nothing is "
                                          r"downloaded"):
        _adapter_run(variant("hub", base_model_name_or_path="meta-llama/x"))
    # The adapter decides its shape: a different rank on the command line is refused naming both.
    from xirang_hpc.config.hf import apply_peft_finetune

    with pytest.raises(ConfigError, match=r"finetune.lora.rank.*adapter.*has 4"):
        apply_peft_finetune({"method": "lora", "lora": {"rank": 8}}, adapter, ["finetune.lora.rank=8"])
    # An adapter for another base: the mismatching tensor is named, no adapter is touched.
    cfg = _adapter_run(adapter)
    model = GPT(cfg.model, seed=0)
    apply_lora(model, replace_targets(cfg.finetune.lora, ["q_proj", "k_proj", "v_proj", "down_proj"], rank=2))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with pytest.raises(WeightsError, match=r"q_proj.lora_A.weight has shape \(4, 64\), this model needs \(2, 64\)"):
        init_adapters_from_peft(model, adapter, cfg.model)
    assert all(torch.equal(before[n], p) for n, p in model.named_parameters())
    fewer = GPT(cfg.model, seed=0)  # targets the adapter trains beyond ours: refused naming them
    apply_lora(fewer, replace_targets(cfg.finetune.lora, ["q_proj", "k_proj", "v_proj"], rank=4))
    with pytest.raises(WeightsError, match=r"no place for, e.g. \['base_model.model.model.layers.0.mlp.down_proj"):
        init_adapters_from_peft(fewer, adapter, cfg.model)


def replace_targets(lora: LoraConfig, targets: list[str], rank: int) -> LoraConfig:
    import dataclasses

    return dataclasses.replace(lora, target_modules=targets, rank=rank)


def test_lora_runs_tensor_parallel_but_refuses_sequence_parallel_by_name() -> None:
    from conftest import compose_cfg

    from xirang_hpc.config.validate import check_runnable, load_config

    lora = ["finetune.method=lora", "cluster.nodes=1", "cluster.tasks_per_node=2", "parallel.tp=2", "parallel.pp=1",
            "parallel.microbatches=1"]
    check_runnable(load_config(compose_cfg(lora)))  # adapters sharded with their base layer (layout matrix)
    with pytest.raises(ConfigError, match=r"parallel.sequence_parallel.*not yet with LoRA"):
        check_runnable(load_config(compose_cfg([*lora, "parallel.sequence_parallel=true"])))
