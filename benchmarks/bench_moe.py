"""Mixture-of-experts block, forward+backward tokens/s: ours (models/moe.py) vs transformers' Qwen3MoeSparseMoeBlock.

Both blocks hold the same weights (ours copied from transformers'), run in this process with the
same torch threads, fp32 on CPU, on the same random input; one iteration is forward, a sum-of-squares
loss and backward (input and all weights get gradients). Outputs are checked equal first.

- ours: one argsort of the flat top-k expert ids groups the (token, choice) slots by expert, each
  expert runs on its contiguous slice, one index_add scatters the weighted outputs back;
- transformers: a one-hot expert mask and, per hit expert, a ``torch.where`` over it, a gather
  and an index_add (its default "eager" experts implementation).

Printed per case (experts, top-k): median seconds per iteration over ``--repeats`` timed runs,
tokens/s of each, and the ratio ours/theirs.

    python benchmarks/bench_moe.py [--hidden 512 --ffn 256 --tokens 2048 --repeats 5]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from xirang_hpc.config.schema import ModelConfig
from xirang_hpc.models.moe import MoE

CASES = [(8, 2), (8, 8), (64, 2), (64, 8)]


def _pair(experts: int, top_k: int, hidden: int, ffn: int) -> tuple[MoE, torch.nn.Module]:
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    hc = Qwen3MoeConfig(hidden_size=hidden, num_experts=experts, num_experts_per_tok=top_k,
                        moe_intermediate_size=ffn, norm_topk_prob=True)
    theirs = Qwen3MoeSparseMoeBlock(hc).float()
    for p in theirs.parameters():
        torch.nn.init.normal_(p, std=0.02)
    cfg = ModelConfig(name="bench", d_model=hidden, n_head=8, norm="rmsnorm", mlp="swiglu", pos="rope", bias=False,
                      moe_experts=experts, moe_top_k=top_k, moe_ffn_hidden=ffn, moe_norm_topk=True)
    ours = MoE(cfg)
    with torch.no_grad():
        ours.gate.weight.copy_(theirs.gate.weight)
        gate, up = theirs.experts.gate_up_proj.chunk(2, dim=1)  # (E, ffn, d) each
        ours.w1.copy_(gate)
        ours.w3.copy_(up)
        ours.w2.copy_(theirs.experts.down_proj)
    return ours, theirs


def _time(block: torch.nn.Module, x: torch.Tensor, repeats: int, warmup: int = 2) -> float:
    """Median seconds of one forward+backward."""
    times = []
    for i in range(warmup + repeats):
        xi = x.detach().requires_grad_(True)
        t0 = time.perf_counter()
        block(xi).pow(2).sum().backward()
        dt = time.perf_counter() - t0
        block.zero_grad(set_to_none=True)
        if i >= warmup:
            times.append(dt)
    return statistics.median(times)


def main() -> None:
    """Run every case and print the side-by-side table."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--ffn", type=int, default=256)
    ap.add_argument("--tokens", type=int, default=2048, help="tokens per iteration (batch 4 x tokens/4)")
    ap.add_argument("--repeats", type=int, default=5)
    a = ap.parse_args()
    torch.manual_seed(0)
    print(f"MoE block fwd+bwd, fp32 CPU, {torch.get_num_threads()} threads, hidden {a.hidden}, expert ffn {a.ffn}, "
          f"{a.tokens} tokens, median of {a.repeats}, torch {torch.__version__}")
    print("experts | top-k | ours s | theirs s | ours tok/s | theirs tok/s | ours/theirs")
    for experts, top_k in CASES:
        ours, theirs = _pair(experts, top_k, a.hidden, a.ffn)
        x = torch.randn(4, a.tokens // 4, a.hidden)
        with torch.no_grad():
            torch.testing.assert_close(ours(x), theirs(x), atol=1e-4, rtol=1e-4)
        t_ours, t_theirs = _time(ours, x, a.repeats), _time(theirs, x, a.repeats)
        print(f"{experts:7d} | {top_k:5d} | {t_ours:6.3f} | {t_theirs:8.3f} | {a.tokens / t_ours:10.0f} | "
              f"{a.tokens / t_theirs:12.0f} | {t_theirs / t_ours:10.2f}x")


if __name__ == "__main__":
    main()
