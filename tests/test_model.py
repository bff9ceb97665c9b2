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
