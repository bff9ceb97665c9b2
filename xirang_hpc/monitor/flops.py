"""Model FLOPs per token and MFU.

Training FLOPs per token without recomputation (Narayanan et al., SC21, "Efficient Large-Scale
Language Model Training on GPU Clusters Using Megatron-LM", eq. for F with factor 72 instead of
96): 72*l*h^2*(1 + s/(6h)) + 6*h*V, i.e. 6 x (weight-matrix multiply-adds per token) plus the
attention score/value products 12*l*h*s. Written here for general MLP widths: each weight matrix
of size m x n costs 6*m*n FLOPs per token (forward 2, backward 4). MFU counts model FLOPs only
(recomputation is not credited), following PaLM's definition.
"""

from __future__ import annotations

from typing import Any

# Dense bf16 peak TFLOP/s per device, from the vendors' datasheets (no sparsity).
PEAK_TFLOPS = {"A100": 312.0, "H100": 989.0, "H200": 989.0, "H800": 989.0, "A800": 312.0, "L40S": 362.0,
               "V100": 125.0, "MI250X": 383.0, "MI300X": 1307.0, "B200": 2250.0}


def flops_per_token(n_layer: int, d_model: int, seq_len: int, vocab_size: int, ffn_dim: int,
                    mlp: str = "gelu", kv_dim: int | None = None, q_dim: int | None = None) -> float:
    """Training FLOPs per token (forward + backward, no recomputation).

    ``kv_dim``: width of the key and value projections (n_kv_head * head_dim); grouped-query
    attention (Ainslie et al. 2023) makes it smaller than d_model. None = d_model.
    ``q_dim``: width of the query projection (n_head * head_dim), other than d_model when the head width
    is decoupled (Qwen3's small models). None = d_model.
    """
    h, l_ = d_model, n_layer
    kv = h if kv_dim is None else kv_dim
    q = h if q_dim is None else q_dim
    mlp_mats = 3 if mlp == "swiglu" else 2
    per_layer = 2 * h * q + 2 * h * kv + mlp_mats * h * ffn_dim  # Q and output, K and V projections, MLP
    return 6.0 * (l_ * per_layer + h * vocab_size) + 12.0 * l_ * q * seq_len


def flops_per_token_for(model: Any) -> float:
    """:func:`flops_per_token` for a ``ModelConfig``."""
    hd = getattr(model, "d_head", 0) or model.d_model // model.n_head
    kv_dim = getattr(model, "n_kv_head", model.n_head) * hd
    return flops_per_token(model.n_layer, model.d_model, model.seq_len, model.vocab_size, model.ffn_dim, model.mlp,
                           kv_dim, model.n_head * hd)


def peak_for_device(name: str) -> float:
    """Peak TFLOP/s for a GPU name as NVML reports it (``NVIDIA H100 80GB HBM3``), 0 if unknown."""
    up = name.upper()
    for key in sorted(PEAK_TFLOPS, key=len, reverse=True):
        if key in up:
            return PEAK_TFLOPS[key]
    return 0.0


def mfu(tokens_per_s: float, fpt: float, devices: int, peak_tflops: float) -> float | None:
    """Model FLOPs utilisation in [0, 1], or None when the peak is unknown."""
    if peak_tflops <= 0 or devices <= 0:
        return None
    return tokens_per_s * fpt / (devices * peak_tflops * 1e12)
