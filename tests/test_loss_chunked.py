"""The chunked head + loss equals the plain one (values and gradients), never holding the full logits."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from xirang_hpc.config.errors import ConfigError
from xirang_hpc.config.schema import ModelConfig, TrainConfig
from xirang_hpc.models.gpt import GPT, lm_loss
from xirang_hpc.models.loss import chunked_lm_loss

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("chunk", [1, 5, 21, 10_000])
def test_values_and_gradients_equal_the_plain_loss(chunk: int) -> None:
    g = torch.Generator().manual_seed(0)
    h = torch.randn(3, 7, 16, generator=g, requires_grad=True)  # (B, T, C)
    w = torch.randn(50, 16, generator=g, requires_grad=True)  # (V, C)
    y = torch.randint(0, 50, (3, 7), generator=g)
    want = lm_loss(F.linear(h, w), y)
    (3.0 * want).backward()  # an upstream gradient other than 1 is carried through
    gh, gw = h.grad.clone(), w.grad.clone()
    h.grad = w.grad = None
    got = chunked_lm_loss(h, w, y, chunk)
    (3.0 * got).backward()
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    torch.testing.assert_close(h.grad, gh, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(w.grad, gw, rtol=1e-5, atol=1e-6)
    with torch.no_grad():  # evaluation: the loss alone
        torch.testing.assert_close(chunked_lm_loss(h, w, y, chunk), want.detach(), rtol=1e-6, atol=0)


def test_a_model_given_targets_returns_the_loss_and_trains_the_same() -> None:
    cfg = ModelConfig(n_layer=2, n_head=2, d_model=16, d_ff=32, vocab_size=64, seq_len=12, tie_embeddings=True)
    plain, fused = GPT(cfg, seed=3), GPT(cfg, seed=3)
    fused.loss_chunk = 5  # 24 tokens: chunks of 5 and a last one of 4
    x = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(1))
    y = torch.roll(x, -1, dims=1)
    a, b = lm_loss(plain(x), y), fused(x, targets=y)
    assert b.shape == (1,) and fused(x).shape == (2, 12, 64), "without targets the head still gives logits"
    a.backward()
    b.backward()
    torch.testing.assert_close(b[0], a, rtol=1e-6, atol=0)
    for (name, p), q in zip(plain.named_parameters(), fused.parameters(), strict=True):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-5, atol=1e-6, msg=name)  # tied head: both paths


def test_under_bf16_autocast_it_stays_close_to_the_plain_loss() -> None:
    g = torch.Generator().manual_seed(2)
    h = torch.randn(4, 8, 32, generator=g)
    w = torch.randn(100, 32, generator=g) * 0.1
    y = torch.randint(0, 100, (4, 8), generator=g)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want, got = lm_loss(F.linear(h, w), y), chunked_lm_loss(h, w, y, 7)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-3, atol=0)


def test_peak_memory_is_one_chunk_of_logits() -> None:
    """The autograd graph keeps no (tokens, vocab) tensor: what is saved is the size of h and the weight."""
    h = torch.randn(256, 8, requires_grad=True)
    w = torch.randn(1000, 8, requires_grad=True)
    y = torch.randint(0, 1000, (256,))
    saved: list[torch.Size] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(t.shape)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        chunked_lm_loss(h, w, y, 32)
    assert saved and all(s.numel() <= 1000 * 8 for s in saved), saved  # never 256 x 1000
    saved.clear()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        lm_loss(F.linear(h, w), y)
    assert any(s.numel() >= 256 * 1000 for s in saved), "the plain path does hold the logits"


def test_a_negative_chunk_is_refused_by_name() -> None:
    with pytest.raises(ConfigError, match="train.loss_chunk_tokens"):
        dataclasses.replace(TrainConfig(), loss_chunk_tokens=-1)
