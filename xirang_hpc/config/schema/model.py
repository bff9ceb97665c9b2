"""The model group: the decoder-only transformer's shape."""

from __future__ import annotations

from dataclasses import dataclass

from omegaconf import MISSING

from xirang_hpc.config.errors import ConfigError
from xirang_hpc.config.hf import is_hf_dir, is_peft_dir
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
    # Biases on the q, k and v projections only (Qwen2; the output projection stays unbiased). ``bias``
    # puts biases everywhere (GPT-2) and implies these.
    attn_qkv_bias: bool = False
    # Width of one attention head; 0 = d_model/n_head. Qwen3 sets it explicitly (e.g. 128 with d_model
    # 1024 and 16 heads), so q/k/v are n_head*d_head wide and the output projection maps back to d_model.
    d_head: int = 0
    # RMSNorm of each query and key head over its d_head channels, before rotary (Qwen3).
    qk_norm: bool = False
    # Rotary frequency rescaling for long contexts: none | linear (positions / rope_factor) | llama3
    # (Llama 3.1: low frequencies / rope_factor, high ones kept, blended between the wavelengths
    # rope_original_max_pos / rope_low_freq_factor and rope_original_max_pos / rope_high_freq_factor).
    rope_scaling: str = "none"
    rope_factor: float = 1.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_pos: int = 8192
    # Weights to initialise from, for fine-tuning: an exported .safetensors file, or a Hugging Face model
    # directory (Llama, Mistral, Qwen2, Qwen3, GPT-2, Qwen3-MoE or Mixtral; its config.json fills model.*, see
    # xirang_hpc/config/hf.py).
    init_from: str | None = None
    # Mixture of experts (xirang_hpc/models/moe.py): 0 experts = a dense MLP in every block.
    moe_experts: int = 0
    moe_top_k: int = 2  # experts per token
    moe_ffn_hidden: int = 0  # one expert's SwiGLU width; 0 = the dense width (ffn_dim)
    moe_shared_ffn_hidden: int = 0  # width of a dense shared SwiGLU expert added to every token; 0 = none
    moe_score: str = "softmax"  # softmax | sigmoid: router scores, computed in fp32
    moe_norm_topk: bool = True  # renormalise the top-k weights to sum to one (Mixtral; Qwen3-MoE's norm_topk_prob)
    moe_balance: str = "aux_loss"  # aux_loss | bias | none
    moe_aux_coef: float = 0.01  # weight of the load-balancing loss (router_aux_loss_coef; aux_loss only)
    moe_bias_rate: float = 0.001  # expert-bias update speed per optimizer step (bias only)
    moe_every: int = 1  # every moe_every-th block is MoE (1 = all; 2 = blocks 1, 3, 5, ...)
    moe_first_dense: int = 0  # the first moe_first_dense blocks stay dense (DeepSeek's first_k_dense_replace)

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
        if self.d_head < 0:
            raise ConfigError("model.d_head", self.d_head, "use a positive head width, or 0 for d_model/n_head")
        if not self.d_head and self.d_model % self.n_head:
            raise ConfigError(
                "model.d_model", self.d_model, f"must be divisible by model.n_head={self.n_head} (or set model.d_head)"
            )
        if self.norm not in ("layernorm", "rmsnorm"):
            raise ConfigError("model.norm", self.norm, "choose layernorm or rmsnorm")
        if self.mlp not in ("gelu", "swiglu"):
            raise ConfigError("model.mlp", self.mlp, "choose gelu or swiglu")
        if self.pos not in ("learned", "rope"):
            raise ConfigError("model.pos", self.pos, "choose learned or rope")
        if self.pos == "rope" and self.head_dim % 2:
            raise ConfigError("model.pos", self.pos, "rope needs an even head dimension (d_head or d_model/n_head)")
        if self.rope_scaling not in ("none", "linear", "llama3"):
            raise ConfigError("model.rope_scaling", self.rope_scaling, "choose none, linear or llama3")
        if self.rope_scaling != "none":
            check_positive("model", "rope_factor", self.rope_factor)
        if self.rope_scaling == "llama3":
            check_positive("model", "rope_original_max_pos", self.rope_original_max_pos)
            if not 0 < self.rope_low_freq_factor < self.rope_high_freq_factor:
                raise ConfigError("model.rope_low_freq_factor", self.rope_low_freq_factor,
                                  f"llama3 rope scaling needs 0 < rope_low_freq_factor < rope_high_freq_factor="
                                  f"{self.rope_high_freq_factor}")
        if self.qk_norm and self.norm != "rmsnorm":
            raise ConfigError("model.qk_norm", self.qk_norm, "q/k norms are RMSNorms: use model.norm=rmsnorm")
        self._check_moe()
        if self.init_from and not str(self.init_from).endswith(".safetensors") and not is_hf_dir(self.init_from) \
                and not is_peft_dir(self.init_from):
            raise ConfigError("model.init_from", self.init_from,
                              "point it at a .safetensors file (xirang-ckpt export RUN --format safetensors), at a "
                              "Hugging Face model directory (config.json + model.safetensors or its index) or at a "
                              "PEFT LoRA adapter directory (adapter_config.json + adapter_model.safetensors)")

    def _check_moe(self) -> None:
        defaults = {"moe_top_k": 2, "moe_ffn_hidden": 0, "moe_shared_ffn_hidden": 0, "moe_score": "softmax",
                    "moe_norm_topk": True, "moe_balance": "aux_loss", "moe_aux_coef": 0.01, "moe_bias_rate": 0.001,
                    "moe_every": 1, "moe_first_dense": 0}
        if self.moe_experts < 0:
            raise ConfigError("model.moe_experts", self.moe_experts, "use a positive expert count, or 0 for dense")
        if self.moe_experts == 0:
            for name, default in defaults.items():
                if getattr(self, name) != default:
                    raise ConfigError(f"model.{name}", getattr(self, name),
                                      "is a mixture-of-experts setting but model.moe_experts=0 (dense); "
                                      "set model.moe_experts or drop it")
            return
        if self.mlp != "swiglu":
            raise ConfigError("model.mlp", self.mlp, "MoE experts are SwiGLU: set model.mlp=swiglu")
        if not 1 <= self.moe_top_k <= self.moe_experts:
            raise ConfigError("model.moe_top_k", self.moe_top_k,
                              f"must be between 1 and model.moe_experts={self.moe_experts}")
        for name in ("moe_ffn_hidden", "moe_shared_ffn_hidden", "moe_first_dense"):
            if getattr(self, name) < 0:
                raise ConfigError(f"model.{name}", getattr(self, name), "must be >= 0")
        if self.moe_every < 1:
            raise ConfigError("model.moe_every", self.moe_every, "must be >= 1 (1 = every block is MoE)")
        if not self.moe_layers:
            raise ConfigError("model.moe_first_dense", self.moe_first_dense,
                              f"with model.moe_every={self.moe_every} and model.n_layer={self.n_layer} no block is MoE")
        if self.moe_score not in ("softmax", "sigmoid"):
            raise ConfigError("model.moe_score", self.moe_score, "choose softmax or sigmoid")
        if self.moe_balance not in ("aux_loss", "bias", "none"):
            raise ConfigError("model.moe_balance", self.moe_balance, "choose aux_loss, bias or none")
        for name in ("moe_aux_coef", "moe_bias_rate"):
            if getattr(self, name) < 0:
                raise ConfigError(f"model.{name}", getattr(self, name), "must be >= 0")

    @property
    def moe_layers(self) -> tuple[int, ...]:
        """Indices of the blocks whose feed-forward is a mixture of experts (empty for a dense model)."""
        if not self.moe_experts:
            return ()
        return tuple(i for i in range(self.moe_first_dense, self.n_layer)
                     if (i - self.moe_first_dense) % self.moe_every == self.moe_every - 1)

    @property
    def moe_ffn_dim(self) -> int:
        """Hidden width of one expert."""
        return self.moe_ffn_hidden or self.ffn_dim

    @property
    def head_dim(self) -> int:
        """Width of one attention head (``d_head``, or d_model/n_head)."""
        return self.d_head or self.d_model // self.n_head

    @property
    def ffn_dim(self) -> int:
        """Hidden width of the MLP."""
        if self.d_ff:
            return self.d_ff
        if self.mlp == "swiglu":
            # LLaMA's 2/3 * 4d, rounded up to a multiple of 256 as in the paper's code.
            return 256 * ((int(8 * self.d_model / 3) + 255) // 256)
        return 4 * self.d_model
