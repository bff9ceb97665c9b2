"""The GPT model: shapes, gradients, causality, presets' sizes, and stage splitting."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import compose_cfg

from xirang_hpc.config.schema import ModelConfig
from xirang_hpc.config.validate import load_config
from xirang_hpc.models.gpt import GPT, lm_loss, num_params


def _tiny(**kw: object) -> ModelConfig:
    base = dict(name="t", n_layer=2, n_head=4, d_model=32, d_ff=64, seq_len=16)
    base.update(kw)
    return ModelConfig(**base)  # type: ignore[arg-type]


@pytest.mark.parametrize("variant", [{}, {"norm": "rmsnorm", "mlp": "swiglu", "pos": "rope", "bias": False}])
def test_forward_backward(variant: dict[str, object]) -> None:
    torch.manual_seed(0)
    m = GPT(_tiny(**variant))
    x = torch.randint(0, 256, (3, 16))
    logits = m(x)
    assert logits.shape == (3, 16, 256)
    loss = lm_loss(logits, torch.randint(0, 256, (3, 16)))
    # A fresh model predicts roughly uniformly over the byte vocabulary.
    assert abs(loss.item() - math.log(256)) < 0.1
    loss.backward()
    for name, p in m.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
        assert p.grad.abs().sum() > 0, f"{name} got no gradient"


@pytest.mark.parametrize("pos", ["learned", "rope"])
def test_attention_is_causal(pos: str) -> None:
    torch.manual_seed(0)
    m = GPT(_tiny(pos=pos)).eval()
    x = torch.randint(0, 256, (1, 16))
    y = x.clone()
    y[0, 10:] = (y[0, 10:] + 1) % 256  # change only the future
    with torch.no_grad():
        a, b = m(x), m(y)
    assert torch.equal(a[0, :10], b[0, :10])
    assert not torch.allclose(a[0, 10:], b[0, 10:])


def test_separate_projections_and_splittable_blocks() -> None:
    m = GPT(_tiny(mlp="swiglu"))
    names = {n for n, _ in m.named_modules()}
    for part in ("attn.q", "attn.k", "attn.v", "attn.o", "mlp.up", "mlp.gate", "mlp.down"):
        assert f"layers.0.{part}" in names
    full = {n: p.detach().clone() for n, p in m.state_dict().items()}
    # A pipeline stage keeps some blocks; parameter names (FQNs) are unchanged.
    del m.layers["0"]
    m.tok_emb = None
    m.pos_emb = None
    assert set(m.state_dict()) <= set(full)
    h = torch.randn(2, 16, 32)  # hidden states from the previous stage
    assert m(h).shape == (2, 16, 256)


def test_a_stage_split_composes_to_the_full_model() -> None:
    torch.manual_seed(0)
    full = GPT(_tiny(n_layer=4)).eval()
    first, second = GPT(_tiny(n_layer=4)).eval(), GPT(_tiny(n_layer=4)).eval()
    first.load_state_dict(full.state_dict())
    second.load_state_dict(full.state_dict())
    for i in ("2", "3"):
        del first.layers[i]
    first.norm, first.head = None, None
    for i in ("0", "1"):
        del second.layers[i]
    second.tok_emb, second.pos_emb = None, None
    x = torch.randint(0, 256, (2, 16))
    with torch.no_grad():
        assert torch.allclose(second(first(x)), full(x), atol=1e-6)


def test_gpt2_small_preset_has_124m_parameters() -> None:
    cfg = load_config(compose_cfg(["model=gpt2-small", "cluster=slurm"])).model
    with torch.device("meta"):
        m = GPT(cfg)
    # GPT-2 small ties embeddings (124M); untied head and padded vocab add 38.6M here.
    n = num_params(m) - cfg.vocab_size * cfg.d_model
    assert 123_000_000 < n < 125_500_000, n


def test_llama_7b_preset_has_about_7b_parameters() -> None:
    cfg = load_config(compose_cfg(["model=llama-7b", "cluster=slurm"])).model
    with torch.device("meta"):
        n = num_params(GPT(cfg))
    assert 6.6e9 < n < 6.9e9, n


def test_grouped_query_attention_equals_multi_head_with_shared_kv() -> None:
    """GQA with n_kv_head=2 is exactly MHA whose k/v heads are copies within each group of query heads."""
    torch.manual_seed(0)
    gqa = GPT(_tiny(n_kv_head=2, norm="rmsnorm", mlp="swiglu", pos="rope", bias=False)).eval()
    mha = GPT(_tiny(norm="rmsnorm", mlp="swiglu", pos="rope", bias=False)).eval()
    hd = 32 // 4
    sd = gqa.state_dict()
    for name, t in list(sd.items()):
        if name.endswith(("attn.k.weight", "attn.v.weight")):  # (n_kv*hd, C) -> (n_head*hd, C)
            assert t.shape == (2 * hd, 32)
            sd[name] = t.view(2, hd, 32).repeat_interleave(2, dim=0).reshape(4 * hd, 32)
    mha.load_state_dict(sd)
    x = torch.randint(0, 256, (2, 16))
    with torch.no_grad():
        torch.testing.assert_close(gqa(x), mha(x), rtol=0, atol=1e-6)
    assert num_params(gqa) < num_params(mha)


def test_tied_embeddings_share_one_parameter() -> None:
    m = GPT(_tiny(tie_embeddings=True))
    assert m.head.weight is m.tok_emb.weight
    untied = GPT(_tiny())
    assert num_params(untied) - num_params(m) == 256 * 32
    lm_loss(m(torch.randint(0, 256, (2, 16))), torch.randint(0, 256, (2, 16))).backward()
    assert m.tok_emb.weight.grad is not None  # the head's gradient lands on the shared weight


@pytest.mark.parametrize("overrides,field,words", [
    (["model=tiny-gqa", "model.n_kv_head=3"], "model.n_kv_head", "must divide model.n_head=4"),
    (["model=tiny-gqa", "model.n_kv_head=1", "cluster.tasks_per_node=2", "parallel.tp=2", "parallel.pp=1"],
     "parallel.tp", "must divide model.n_kv_head=1"),
    (["model.tie_embeddings=true", "parallel.pp=2"], "model.tie_embeddings", "use parallel.pp=1"),
])
def test_gqa_and_tying_refused_with_the_fix(overrides: list[str], field: str, words: str) -> None:
    from xirang_hpc.config.errors import ConfigError

    with pytest.raises(ConfigError) as e:
        load_config(compose_cfg(overrides))
    assert field in str(e.value) and words in str(e.value)


@pytest.mark.parametrize("preset,billions", [("llama3-8b", 8.03), ("llama3-70b", 70.55)])
def test_llama3_presets_have_the_published_size(preset: str, billions: float) -> None:
    """Meta's model cards: 8.03B and 70.55B parameters (GQA with 8 kv heads, vocab 128256)."""
    cfg = load_config(compose_cfg([f"model={preset}"])).model
    assert cfg.n_kv_head == 8 and cfg.vocab_size == 128256 and cfg.rope_theta == 500000.0
    from xirang_hpc.models.gpt import full_model_params

    assert abs(full_model_params(cfg) / 1e9 - billions) < 0.01


# Published parameter counts (model cards / HF pages): Qwen2.5-7B 7.61B, Qwen3-8B 8.19B, Llama 3.1 8B 8.03B,
# Mistral 7B v0.3 7.25B, Llama 3.1 405B 405.85B.
NEW_PRESETS = [("qwen2.5-7b", 7.62), ("qwen3-8b", 8.19), ("llama3.1-8b", 8.03), ("mistral-7b", 7.25),
               ("llama3-405b", 405.85)]


@pytest.mark.parametrize("preset,billions", NEW_PRESETS)
def test_hf_family_presets_compose_and_count(preset: str, billions: float) -> None:
    """Each preset composes under Hydra and has its published size (model and planner formula agree exactly)."""
    from xirang_hpc.models.gpt import full_model_params
    from xirang_hpc.planner.formulas import model_params

    cfg = load_config(compose_cfg([f"model={preset}"])).model
    n = full_model_params(cfg)
    assert abs(n / 1e9 - billions) < 0.01, n
    assert model_params(cfg) == n
    if preset.startswith("qwen2"):
        assert cfg.attn_qkv_bias and not cfg.qk_norm
    if preset.startswith("qwen3"):
        assert cfg.qk_norm and cfg.head_dim == 128
    if preset.startswith("llama3"):
        assert (cfg.rope_scaling, cfg.rope_factor, cfg.rope_original_max_pos) == ("llama3", 8.0, 8192)


@pytest.mark.slow
def test_hf_family_presets_plan(tmp_path) -> None:
    """xirang-plan plans each preset on 16 H100 nodes (one command per preset, as a user types it)."""
    import subprocess
    import sys
    from pathlib import Path

    exe = Path(sys.executable).parent / "xirang-plan"
    for preset, _ in NEW_PRESETS:
        cfg = load_config(compose_cfg([f"model={preset}"])).model
        r = subprocess.run([str(exe), f"model={preset}", "cluster=h100-ib", "cluster.nodes=16",
                            "train.global_batch=256"], cwd=tmp_path, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr[-2000:]
        assert f"plans for {cfg.n_layer}x{cfg.d_model}" in r.stdout and "recommended" in r.stdout, preset


@pytest.mark.parametrize("fields", [{"attn_qkv_bias": True}, {"qk_norm": True, "d_head": 24},
                                    {"d_head": 8, "n_kv_head": 2}])
def test_planner_counts_biases_q_k_norms_and_decoupled_heads_exactly(fields: dict[str, object]) -> None:
    from xirang_hpc.models.gpt import full_model_params
    from xirang_hpc.planner.formulas import model_params

    cfg = _tiny(norm="rmsnorm", mlp="swiglu", pos="rope", bias=False, **fields)
    assert model_params(cfg) == full_model_params(cfg)


def test_decoupled_head_width_and_rope_scaling_run_and_refuse_bad_values() -> None:
    """Qwen3-style heads wider than d_model/n_head; llama3/linear rope; bad values named."""
    from xirang_hpc.config.errors import ConfigError

    m = GPT(_tiny(norm="rmsnorm", mlp="swiglu", pos="rope", bias=False, qk_norm=True, d_head=16))
    assert m.layers["0"].attn.q.weight.shape == (4 * 16, 32) and m.layers["0"].attn.o.weight.shape == (32, 64)
    assert m.layers["0"].attn.q_norm.weight.shape == (16,)
    assert m(torch.randint(0, 256, (1, 16))).shape == (1, 16, 256)
    plain = GPT(_tiny(norm="rmsnorm", mlp="swiglu", pos="rope", bias=False))
    lin = GPT(_tiny(norm="rmsnorm", mlp="swiglu", pos="rope", bias=False, rope_scaling="linear", rope_factor=2.0))
    # Linear scaling = positions / factor: position 2 of the scaled table is position 1 of the plain one.
    assert torch.allclose(lin.rope_cos[2], plain.rope_cos[1], atol=1e-6)
    for kw, field in [({"rope_scaling": "yarn"}, "model.rope_scaling"), ({"d_head": -1}, "model.d_head"),
                      ({"rope_scaling": "llama3", "rope_low_freq_factor": 4.0}, "model.rope_low_freq_factor"),
                      ({"qk_norm": True}, "model.qk_norm")]:
        with pytest.raises(ConfigError, match=field):
            _tiny(pos="rope", **kw)
