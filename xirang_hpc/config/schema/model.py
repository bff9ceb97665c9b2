"""The model group: the decoder-only transformer's shape."""

from __future__ import annotations

from dataclasses import dataclass

from omegaconf import MISSING

from xirang_hpc.config.errors import ConfigError
from xirang_hpc.config.hf import is_hf_dir
from xirang_hpc.config.schema._checks import check_finite, check_positive


@dataclass
class ModelConfig:
    """Decoder-only transformer shape. ``d_ff=0`` means 4*d_model (or 8/3*d_model for swiglu)."""

    name: str = MISSING
    n_layer: int = 2
    n_head: int = 4
    # Key/value heads (grouped-query attention, Ainslie et al. 2023): each group of n_head/n_kv_head
    # query heads shares one key/value head. 0 = n_head (plain multi-head attention).
    n_kv_head: int = 0
    d_model: int = 128
    d_ff: int = 0
    vocab_size: int = 256
    seq_len: int = 128
    norm: str = "layernorm"  # layernorm | rmsnorm
    mlp: str = "gelu"  # gelu | swiglu
    pos: str = "learned"  # learned | rope
    bias: bool = True
    # Epsilon of every LayerNorm/RMSNorm (GPT-2 and Llama 2/3 use 1e-5).
    norm_eps: float = 1e-5
    # Rotary base frequency (10000 in the RoPE paper and Llama 2; 500000 in Llama 3).
    rope_theta: float = 10000.0
    # Share the token embedding with the output head (GPT-2 ties them; Llama 3 8B/70B do not).
    tie_embeddings: bool = False
    init_std: float = 0.02
    # Weights to initialise from, for fine-tuning: an exported .safetensors file, or a Hugging Face model
    # directory (Llama or GPT-2 family; its config.json fills model.*, see xirang_hpc/config/hf.py).
    init_from: str | None = None

    def __post_init__(self) -> None:
        check_finite("model", self)
        for name in ("n_layer", "n_head", "d_model", "vocab_size", "seq_len", "norm_eps", "rope_theta"):
            check_positive("model", name, getattr(self, name))
        if self.n_kv_head < 0:
            raise ConfigError("model.n_kv_head", self.n_kv_head, "use a positive count, or 0 for n_head")
        if self.n_kv_head == 0:
            self.n_kv_head = self.n_head
        if self.n_head % self.n_kv_head:
            ok = [d for d in range(1, self.n_head + 1) if self.n_head % d == 0]
            raise ConfigError("model.n_kv_head", self.n_kv_head,
                              f"must divide model.n_head={self.n_head} (each key/value head serves a whole group of "
                              f"query heads); choose from {ok}")
        if self.d_model % self.n_head:
            raise ConfigError(
                "model.d_model", self.d_model, f"must be divisible by model.n_head={self.n_head}"
            )
        if self.norm not in ("layernorm", "rmsnorm"):
            raise ConfigError("model.norm", self.norm, "choose layernorm or rmsnorm")
        if self.mlp not in ("gelu", "swiglu"):
            raise ConfigError("model.mlp", self.mlp, "choose gelu or swiglu")
        if self.pos not in ("learned", "rope"):
            raise ConfigError("model.pos", self.pos, "choose learned or rope")
        if self.pos == "rope" and (self.d_model // self.n_head) % 2:
            raise ConfigError("model.pos", self.pos, "rope needs an even head dimension (d_model/n_head)")
        if self.init_from and not str(self.init_from).endswith(".safetensors") and not is_hf_dir(self.init_from):
            raise ConfigError("model.init_from", self.init_from,
                              "point it at a .safetensors file (xirang-ckpt export RUN --format safetensors) or at a "
                              "Hugging Face model directory (config.json + model.safetensors or its index)")

    @property
    def head_dim(self) -> int:
        """Width of one attention head."""
        return self.d_model // self.n_head

    @property
    def ffn_dim(self) -> int:
        """Hidden width of the MLP."""
        if self.d_ff:
            return self.d_ff
        if self.mlp == "swiglu":
            # LLaMA's 2/3 * 4d, rounded up to a multiple of 256 as in the paper's code.
            return 256 * ((int(8 * self.d_model / 3) + 255) // 256)
        return 4 * self.d_model
