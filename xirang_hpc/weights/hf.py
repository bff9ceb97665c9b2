"""Hugging Face layouts: the one name map between our GPT and Llama / Mistral / Qwen2 / Qwen3 / GPT-2 /
Qwen3-MoE / Mixtral tensors, and export.

:func:`tensor_map` says, for each of our parameter names, which Hugging Face tensor holds it and how:

- ``transpose``: GPT-2's ``Conv1D`` stores weights as (in, out); ours are ``nn.Linear`` (out, in).
- ``offset``: GPT-2's ``c_attn`` fuses q | k | v along its output dimension; ours are three tensors,
  found at output offsets 0, d and 2d of the fused one (weight and bias).
- ``rope_heads``: our :func:`~xirang_hpc.models.gpt.apply_rope` rotates interleaved channel pairs
  (x[0::2], x[1::2], as Meta's Llama code); Hugging Face's Llama rotates halves (``rotate_half``). The
  q and k projection rows are permuted inside each head exactly as transformers'
  ``convert_llama_weights_to_hf`` ``permute`` does: HF row ``j*hd/2 + i`` of a head is our row
  ``2*i + j``. The permutation stays inside a head, so a tensor-parallel slice of whole heads is still
  a contiguous block of heads on both sides.
- ``experts``: our stacked expert tensors (``mlp.w1`` (E, ffn, d), ``mlp.w3`` (E, ffn, d), ``mlp.w2``
  (E, d, ffn)) are E separate Hugging Face tensors, one per expert (``hf`` holds ``{e}``): Qwen3-MoE's
  ``mlp.experts.{e}.gate_proj`` / ``up_proj`` / ``down_proj``, Mixtral's ``block_sparse_moe.experts.{e}.w1`` /
  ``w3`` / ``w2``. Our dim 0 is the expert index; dims 1 and 2 are that expert's (out, in) as stored.

Import reads *regions* through this map (:func:`hf_rows_for`, used by
:mod:`xirang_hpc.weights.hf_import`); export (:func:`export_hf`) assembles whole Hugging Face tensors from a
checkpoint of any layout (DCP full load) and writes ``config.json``, safetensors (sharded with an index
past ``max_shard_bytes``) and, for a run with a BPE tokenizer, the tokenizer files.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from xirang_hpc.checkpoint import layout as ckpt_layout
from xirang_hpc.config.hf import hf_family, model_fields_from_hf, sparse_layers
from xirang_hpc.config.schema import ModelConfig
from xirang_hpc.config.schema.finetune import trains_adapters

#: Hugging Face tensors that carry no learned state of ours (old checkpoints' buffers); skipped on import.
IGNORED_HF_SUFFIXES = (".attn.bias", ".attn.masked_bias", "rotary_emb.inv_freq")


@dataclass(frozen=True)
class Src:
    """Where one of our tensors lives in a Hugging Face checkpoint."""

    hf: str
    transpose: bool = False
    offset: int = 0  # along our dim 0 (= HF's output dim) inside a fused tensor
    rope_heads: int = 0  # >0: rows permuted inside each of this many heads (half <-> interleaved rotary)
    experts: int = 0  # >0: our dim 0 stacks this many HF tensors, named hf.format(e=expert)

    def expert_names(self) -> list[str]:
        """The Hugging Face tensor of each expert (``[hf]`` for a tensor that is not stacked)."""
        return [self.hf.format(e=e) for e in range(self.experts)] if self.experts else [self.hf]


#: Our family name -> (architecture, model_type) written on export.
EXPORT_ARCH = {"llama": ("LlamaForCausalLM", "llama"), "qwen2": ("Qwen2ForCausalLM", "qwen2"),
               "qwen3": ("Qwen3ForCausalLM", "qwen3"), "gpt2": ("GPT2LMHeadModel", "gpt2"),
               "qwen3_moe": ("Qwen3MoeForCausalLM", "qwen3_moe"), "mixtral": ("MixtralForCausalLM", "mixtral")}
#: Per-expert tensor names of each MoE family: (router, our w1, w3, w2) under ``model.layers.{i}.``.
MOE_NAMES = {"qwen3_moe": ("mlp.gate.weight", "mlp.experts.{e}.gate_proj.weight", "mlp.experts.{e}.up_proj.weight",
                           "mlp.experts.{e}.down_proj.weight"),
             "mixtral": ("block_sparse_moe.gate.weight", "block_sparse_moe.experts.{e}.w1.weight",
                         "block_sparse_moe.experts.{e}.w3.weight", "block_sparse_moe.experts.{e}.w2.weight")}


def _moe_family(cfg: ModelConfig) -> str:
    """``qwen3_moe`` (with q/k norms) or ``mixtral`` (without) for a mixture-of-experts ``cfg``, else why neither.

    A run imported from either comes back as the same architecture (q/k norms are what tells them apart); a
    native MoE run without q/k norms exports as Mixtral, with them as Qwen3-MoE.
    """
    if cfg.attn_qkv_bias:
        raise ValueError("model.attn_qkv_bias with model.moe_experts: Qwen2-MoE (q/k/v biases) is not supported; "
                         "export with --format safetensors instead")
    if cfg.moe_shared_ffn_hidden:
        raise ValueError(f"model.moe_shared_ffn_hidden={cfg.moe_shared_ffn_hidden}: neither Qwen3-MoE nor Mixtral "
                         "has an ungated shared expert; export with --format safetensors instead")
    if cfg.moe_score != "softmax":
        raise ValueError(f"model.moe_score={cfg.moe_score}: Qwen3-MoE and Mixtral route by softmax scores; export "
                         "with --format safetensors instead")
    if cfg.moe_balance == "bias":
        raise ValueError("model.moe_balance=bias: the learned expert-selection bias changes which experts are chosen "
                         "and neither Qwen3-MoE nor Mixtral has one; export with --format safetensors instead")
    if cfg.qk_norm:
        return "qwen3_moe"
    if len(cfg.moe_layers) != cfg.n_layer or not cfg.moe_norm_topk:
        what = ("dense blocks " + str(sorted(set(range(cfg.n_layer)) - set(cfg.moe_layers)))
                if len(cfg.moe_layers) != cfg.n_layer else "model.moe_norm_topk=false")
        raise ValueError(f"{what}: without q/k norms an MoE model exports as Mixtral, which routes every layer and "
                         "renormalises the top-k weights; export with --format safetensors instead")
    return "mixtral"


def family_of(cfg: ModelConfig) -> str:
    """The Hugging Face family that expresses ``cfg``, else why none does.

    rmsnorm/swiglu/rope without biases: ``llama`` (Mistral imports land here too: same layout), ``qwen2``
    with q/k/v biases, ``qwen3`` with q/k norms; layernorm/gelu/learned positions with biases: ``gpt2``;
    with experts, ``qwen3_moe`` or ``mixtral`` (:func:`_moe_family`).
    """
    if cfg.norm == "rmsnorm" and cfg.mlp == "swiglu" and cfg.pos == "rope" and not cfg.bias:
        if cfg.moe_experts:
            return _moe_family(cfg)
        if cfg.qk_norm and cfg.attn_qkv_bias:
            raise ValueError("model.qk_norm with model.attn_qkv_bias: no Hugging Face family has both (Qwen2 has "
                             "q/k/v biases, Qwen3 q/k norms); export with --format safetensors instead")
        if cfg.qk_norm:
            return "qwen3"
        return "qwen2" if cfg.attn_qkv_bias else "llama"
    if cfg.norm == "layernorm" and cfg.mlp == "gelu" and cfg.pos == "learned" and cfg.bias:
        if cfg.n_kv_head != cfg.n_head:
            raise ValueError(f"model.n_kv_head={cfg.n_kv_head} < n_head={cfg.n_head}: GPT-2 has no grouped-query "
                             "attention; a GPT-2 layout cannot express this model")
        if cfg.d_head or cfg.qk_norm or cfg.rope_scaling != "none":
            raise ValueError("model.d_head / qk_norm / rope_scaling: GPT-2 has none of these; export with "
                             "--format safetensors instead")
        return "gpt2"
    raise ValueError(
        f"no Hugging Face family expresses norm={cfg.norm}, mlp={cfg.mlp}, pos={cfg.pos}, bias={cfg.bias}: "
        "Llama needs rmsnorm + swiglu + rope without biases, GPT-2 needs layernorm + gelu + learned positions "
        "with biases; export with --format safetensors instead")


def tensor_map(cfg: ModelConfig, family: str | None = None) -> dict[str, Src]:
    """Our parameter name -> its Hugging Face source, for every parameter of ``cfg``'s full model."""
    fam = family or family_of(cfg)
    m: dict[str, Src] = {}
    d, kvd = cfg.d_model, cfg.n_kv_head * cfg.head_dim
    if fam != "gpt2":  # Llama, Mistral, Qwen2 and Qwen3 share Llama's tensor names
        m["tok_emb.weight"] = Src("model.embed_tokens.weight")
        for i in range(cfg.n_layer):
            a, b = f"layers.{i}.", f"model.layers.{i}."
            m[a + "attn_norm.weight"] = Src(b + "input_layernorm.weight")
            m[a + "attn.q.weight"] = Src(b + "self_attn.q_proj.weight", rope_heads=cfg.n_head)
            m[a + "attn.k.weight"] = Src(b + "self_attn.k_proj.weight", rope_heads=cfg.n_kv_head)
            m[a + "attn.v.weight"] = Src(b + "self_attn.v_proj.weight")
            if cfg.attn_qkv_bias:  # Qwen2: the bias rows follow their weight rows (same rotary permutation)
                m[a + "attn.q.bias"] = Src(b + "self_attn.q_proj.bias", rope_heads=cfg.n_head)
                m[a + "attn.k.bias"] = Src(b + "self_attn.k_proj.bias", rope_heads=cfg.n_kv_head)
                m[a + "attn.v.bias"] = Src(b + "self_attn.v_proj.bias")
            if cfg.qk_norm:
                # Qwen3: one (head_dim,) weight per norm, in HF's half-split channel order; ours normalises the
                # interleaved order, so the weight takes the same in-head permutation as one head of q rows.
                m[a + "attn.q_norm.weight"] = Src(b + "self_attn.q_norm.weight", rope_heads=1)
                m[a + "attn.k_norm.weight"] = Src(b + "self_attn.k_norm.weight", rope_heads=1)
            m[a + "attn.o.weight"] = Src(b + "self_attn.o_proj.weight")
            m[a + "mlp_norm.weight"] = Src(b + "post_attention_layernorm.weight")
            if i in cfg.moe_layers:
                if fam not in MOE_NAMES:
                    raise ValueError(f"the {fam} family has no experts; model.moe_experts={cfg.moe_experts} "
                                     "does not fit it")
                router, w1, w3, w2 = MOE_NAMES[fam]
                m[a + "mlp.gate.weight"] = Src(b + router)  # (E, d)
                for ours, theirs in (("w1", w1), ("w3", w3), ("w2", w2)):
                    m[a + f"mlp.{ours}"] = Src(b + theirs, experts=cfg.moe_experts)
                continue
            m[a + "mlp.gate.weight"] = Src(b + "mlp.gate_proj.weight")
            m[a + "mlp.up.weight"] = Src(b + "mlp.up_proj.weight")
            m[a + "mlp.down.weight"] = Src(b + "mlp.down_proj.weight")
        m["norm.weight"] = Src("model.norm.weight")
        m["head.weight"] = Src("model.embed_tokens.weight" if cfg.tie_embeddings else "lm_head.weight")
        return m
    m["tok_emb.weight"] = Src("transformer.wte.weight")
    m["pos_emb.weight"] = Src("transformer.wpe.weight")
    for i in range(cfg.n_layer):
        a, b = f"layers.{i}.", f"transformer.h.{i}."
        for ours, theirs in (("attn_norm", "ln_1"), ("mlp_norm", "ln_2")):
            m[a + ours + ".weight"] = Src(b + theirs + ".weight")
            m[a + ours + ".bias"] = Src(b + theirs + ".bias")
        for ours, off in (("q", 0), ("k", d), ("v", d + kvd)):
            m[a + f"attn.{ours}.weight"] = Src(b + "attn.c_attn.weight", transpose=True, offset=off)
            m[a + f"attn.{ours}.bias"] = Src(b + "attn.c_attn.bias", offset=off)
        for ours, theirs in (("attn.o", "attn.c_proj"), ("mlp.up", "mlp.c_fc"), ("mlp.down", "mlp.c_proj")):
            m[a + ours + ".weight"] = Src(b + theirs + ".weight", transpose=True)
            m[a + ours + ".bias"] = Src(b + theirs + ".bias")
    m["norm.weight"] = Src("transformer.ln_f.weight")
    m["norm.bias"] = Src("transformer.ln_f.bias")
    m["head.weight"] = Src("transformer.wte.weight" if cfg.tie_embeddings else "lm_head.weight")
    return m


def param_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Full shapes of every parameter of ``cfg``'s model (meta device: nothing allocated)."""
    from xirang_hpc.models.gpt import GPT

    with torch.device("meta"):
        model = GPT(cfg)
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


def expected_hf_shapes(cfg: ModelConfig, tmap: dict[str, Src] | None = None) -> dict[str, tuple[int, ...]]:
    """The Hugging Face tensor shapes ``cfg`` implies (fused tensors: summed output dims)."""
    tmap = tmap or tensor_map(cfg)
    shapes = param_shapes(cfg)
    out: dict[str, list[int]] = {}
    for name, src in tmap.items():
        s = list(shapes[name])
        if src.experts:  # one (out, in) tensor per expert
            out.update({hf: s[1:] for hf in src.expert_names()})
            continue
        rows = src.offset + s[0]
        hf = ([s[1], rows] if src.transpose else [rows, *s[1:]])
        cur = out.get(src.hf)
        if cur is None:
            out[src.hf] = hf
        else:  # a fused tensor: the output dimension is the furthest any part reaches
            od = 1 if src.transpose else 0
            cur[od] = max(cur[od], hf[od])
    return {k: tuple(v) for k, v in out.items()}


def hf_rows_for(src: Src, rows: range, n_rows_full: int) -> list[int]:
    """The HF output-dim indices holding our rows ``rows`` of a tensor with ``n_rows_full`` rows (in our order)."""
    if not src.rope_heads:
        return [src.offset + r for r in rows]
    hd = n_rows_full // src.rope_heads
    half = hd // 2
    out = []
    for r in rows:
        h, w = divmod(r, hd)
        i, j = divmod(w, 2)  # our row 2i+j of the head <- HF row j*hd/2 + i
        out.append(src.offset + h * hd + j * half + i)
    return out


def to_hf_state(full: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Whole Hugging Face tensors from our full (unsharded) state dict, through :func:`tensor_map`."""
    tmap = tensor_map(cfg)
    shapes = expected_hf_shapes(cfg, tmap)
    out: dict[str, torch.Tensor] = {}
    for name, src in tmap.items():
        t = full[name]
        if src.experts:
            out.update({hf: t[e] for e, hf in enumerate(src.expert_names())})  # (E, out, in) -> E x (out, in)
            continue
        if src.hf not in out:
            out[src.hf] = torch.empty(shapes[src.hf], dtype=t.dtype)
        idx = torch.tensor(hf_rows_for(src, range(t.shape[0]), t.shape[0]))
        dst = out[src.hf]
        if src.transpose:
            dst[:, idx] = t.T
        else:
            dst[idx] = t
    return out


def hf_config_for(cfg: ModelConfig, dtype: torch.dtype, vocab: dict[str, Any] | None = None) -> dict[str, Any]:
    """A transformers ``config.json`` for ``cfg`` (Llama, Qwen2, Qwen3, GPT-2, Qwen3-MoE or Mixtral family); checked
    by mapping it back."""
    fam = family_of(cfg)
    dt = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}[dtype]
    special = {k: v for k, v in (vocab or {}).items() if v is not None}
    if fam != "gpt2":
        arch, model_type = EXPORT_ARCH[fam]
        hf: dict[str, Any] = {
            "architectures": [arch], "model_type": model_type, "hidden_size": cfg.d_model,
            "intermediate_size": cfg.ffn_dim, "num_hidden_layers": cfg.n_layer,
            "num_attention_heads": cfg.n_head, "num_key_value_heads": cfg.n_kv_head, "head_dim": cfg.head_dim,
            "hidden_act": "silu", "max_position_embeddings": cfg.seq_len, "rms_norm_eps": cfg.norm_eps,
            "rope_theta": cfg.rope_theta, "rope_scaling": _rope_scaling_for(cfg),
            "attention_dropout": 0.0, "tie_word_embeddings": cfg.tie_embeddings, "vocab_size": cfg.vocab_size,
            "initializer_range": cfg.init_std, "use_cache": True, "torch_dtype": dt, **special,
        }
        if fam in ("llama", "qwen3"):
            hf["attention_bias"] = False
        if fam == "llama":
            hf["mlp_bias"] = False
        if fam in ("qwen2", "qwen3", "qwen3_moe"):
            hf.update(use_sliding_window=False, sliding_window=None)
        if fam in ("qwen3_moe", "mixtral"):
            hf.update(num_local_experts=cfg.moe_experts, num_experts_per_tok=cfg.moe_top_k,
                      router_aux_loss_coef=cfg.moe_aux_coef, output_router_logits=False)
        if fam == "qwen3_moe":
            # Every block not in moe_layers is dense (decoder_sparse_step 1): exact for any moe_every/first_dense.
            hf.update(num_experts=cfg.moe_experts, moe_intermediate_size=cfg.moe_ffn_dim,
                      norm_topk_prob=cfg.moe_norm_topk, decoder_sparse_step=1,
                      mlp_only_layers=[i for i in range(cfg.n_layer) if i not in cfg.moe_layers])
        if fam == "mixtral":
            hf.update(intermediate_size=cfg.moe_ffn_dim, router_jitter_noise=0.0, sliding_window=None)
    else:
        hf = {
            "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "n_embd": cfg.d_model,
            "n_inner": cfg.ffn_dim, "n_layer": cfg.n_layer, "n_head": cfg.n_head, "n_positions": cfg.seq_len,
            "n_ctx": cfg.seq_len, "activation_function": "gelu_new", "layer_norm_epsilon": cfg.norm_eps,
            "vocab_size": cfg.vocab_size, "tie_word_embeddings": cfg.tie_embeddings, "scale_attn_weights": True,
            "scale_attn_by_inverse_layer_idx": False, "reorder_and_upcast_attn": False, "resid_pdrop": 0.0,
            "embd_pdrop": 0.0, "attn_pdrop": 0.0, "initializer_range": cfg.init_std, "use_cache": True,
            # GPT2Config's own defaults (50256) lie outside a small vocabulary; the tokenizer's ids, if any, win.
            "bos_token_id": None, "eos_token_id": None, "torch_dtype": dt, **special,
        }
    back = model_fields_from_hf(hf)
    for k in ("n_layer", "n_head", "n_kv_head", "d_model", "vocab_size", "norm", "mlp", "pos", "bias", "head_dim",
              "attn_qkv_bias", "qk_norm", "rope_scaling", "rope_factor", "moe_experts", "moe_top_k", "moe_norm_topk"):
        if k == "head_dim":
            assert (back["d_head"] or back["d_model"] // back["n_head"]) == cfg.head_dim
            continue
        assert back[k] == getattr(cfg, k), (k, back[k], getattr(cfg, k))
    if cfg.moe_experts:
        assert sparse_layers(cfg.n_layer, back["moe_every"], back["moe_first_dense"]) == cfg.moe_layers
        assert (back["moe_ffn_hidden"] or back["d_ff"]) == cfg.moe_ffn_dim
    assert hf_family(hf, "export") == fam
    return hf


def _rope_scaling_for(cfg: ModelConfig) -> dict[str, Any] | None:
    """transformers' ``rope_scaling`` object for our rotary scaling fields (None: plain RoPE)."""
    if cfg.rope_scaling == "linear":
        return {"rope_type": "linear", "factor": cfg.rope_factor}
    if cfg.rope_scaling == "llama3":
        return {"rope_type": "llama3", "factor": cfg.rope_factor, "low_freq_factor": cfg.rope_low_freq_factor,
                "high_freq_factor": cfg.rope_high_freq_factor,
                "original_max_position_embeddings": cfg.rope_original_max_pos}
    return None


def _shards(tensors: dict[str, torch.Tensor], max_bytes: int) -> list[dict[str, torch.Tensor]]:
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for k, v in tensors.items():
        n = v.numel() * v.element_size()
        if shards[-1] and size + n > max_bytes:
            shards.append({})
            size = 0
        shards[-1][k] = v
        size += n
    return shards


def write_hf_weights(tensors: dict[str, torch.Tensor], out: Path, max_shard_bytes: int) -> list[Path]:
    """``model.safetensors``, or ``model-0000i-of-0000n.safetensors`` + ``model.safetensors.index.json``."""
    from safetensors.torch import save_file

    tensors = {k: v.contiguous() for k, v in tensors.items()}
    shards = _shards(tensors, max_shard_bytes)
    if len(shards) == 1:
        p = out / "model.safetensors"
        save_file(tensors, str(p), metadata={"format": "pt"})
        return [p]
    paths, weight_map = [], {}
    for i, sh in enumerate(shards, 1):
        p = out / f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(sh, str(p), metadata={"format": "pt"})
        paths.append(p)
        weight_map.update({k: p.name for k in sh})
    total = sum(v.numel() * v.element_size() for v in tensors.values())
    idx = out / "model.safetensors.index.json"
    idx.write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    return [*paths, idx]


def _tokenizer_files(run_dir: Path, out: Path) -> dict[str, Any]:
    """Copy the run's BPE tokenizer (if any) as tokenizer.json + tokenizer_config.json; its special ids.

    ``PreTrainedTokenizerFast`` reads tokenizer.json as it is; tokenizer_config.json names the class and
    the end-of-text token (also used as bos, as GPT-2 does) so ``AutoTokenizer.from_pretrained`` works.
    """
    try:
        from xirang_hpc.data.tokenizer import load_run_tokenizer
    except ImportError:  # a package without run tokenizers: byte-level runs only
        return {}
    tok = load_run_tokenizer(run_dir)
    tj = getattr(tok, "tokenizer_json", None)
    if not tj:
        return {}
    import shutil

    shutil.copyfile(tj, out / "tokenizer.json")
    data = json.loads((out / "tokenizer.json").read_text())
    by_id = {a["id"]: a["content"] for a in data.get("added_tokens", [])}
    vocab = (data.get("model") or {}).get("vocab") or {}
    if isinstance(vocab, dict):
        by_id.update({i: t for t, i in vocab.items() if i not in by_id})
    eos_id = getattr(tok, "eos_id", None)
    eos = by_id.get(eos_id) if eos_id is not None else None
    tc: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False}
    if eos is not None:
        tc.update(eos_token=eos, bos_token=eos)
    chat = getattr(tok, "chat_template", None)  # a chat fine-tune: the template it learned (chat_template.json)
    if chat:
        tc["chat_template"] = chat  # transformers' apply_chat_template renders it as our data did
    (out / "tokenizer_config.json").write_text(json.dumps(tc, indent=1))
    return {"eos_token_id": eos_id, "bos_token_id": eos_id} if eos is not None else {}


def merged_lora_weights(state: dict[str, Any], adapters: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A LoRA run's full weights: its base (the run's ``model.init_from``) with ``scale * B @ A`` added."""
    from xirang_hpc.config.hf import base_model_dir
    from xirang_hpc.config.schema import LoraConfig
    from xirang_hpc.models.lora import merged_state
    from xirang_hpc.weights.load import load_any

    init_from = state["config"]["model"].get("init_from")
    if not init_from:
        raise ValueError("this LoRA run records no model.init_from: no base to merge the adapters into")
    base_path = base_model_dir(init_from) or init_from  # a PEFT adapter's base, or the weights themselves
    base = {k: v.detach() for k, v in load_any(base_path).model.state_dict().items()}
    lora = LoraConfig(**state["config"]["finetune"].get("lora", {}))
    return merged_state(base, adapters, lora.scale)


def export_hf(step_dir: Path, out_dir: Path, dtype: str = "float32", max_shard_bytes: int = 5 * 2**30,
              mode: int = 0o700, merge: bool = False) -> list[Path]:
    """Write a transformers-loadable directory from a checkpoint of any layout; returns the files written.

    A LoRA run's checkpoint holds adapters only: ``merge`` adds them into the base weights of its
    ``model.init_from`` (``W + scale * B @ A``) and writes that whole model.
    """
    import dataclasses

    from xirang_hpc.weights.export import load_full, run_dir_of

    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16}
    if dtype not in dtypes:
        raise ValueError(f"--dtype {dtype!r}: choose float32 or bfloat16")
    ckpt_layout.verify(step_dir)
    state = ckpt_layout.read_state(step_dir)
    names = {f.name for f in dataclasses.fields(ModelConfig)} - {"init_from"}  # the source may be gone
    cfg = ModelConfig(**{k: v for k, v in state["config"]["model"].items() if k in names})
    family_of(cfg)  # refuse before reading any tensor
    full = {k.removeprefix("model."): v for k, v in load_full(step_dir, "model.").items()}
    if not full:
        raise ValueError(f"{step_dir}: no model tensors in this checkpoint")
    lora_run = trains_adapters(state["config"].get("finetune") or {})
    if lora_run and not merge:
        raise ValueError(f"{step_dir}: a LoRA run's checkpoint holds adapters only; export them with --format peft, "
                         "or a whole model with --format hf --merge")
    if merge and not lora_run:
        raise ValueError("--merge applies to LoRA runs (finetune.method=lora) only")
    if lora_run:
        full = merged_lora_weights(state, full)
    hf_state = {k: v.to(dtypes[dtype]) for k, v in to_hf_state(full, cfg).items()}
    ckpt_layout.make_dir(out_dir, mode)
    special = _tokenizer_files(run_dir_of(step_dir), out_dir)
    written = write_hf_weights(hf_state, out_dir, max_shard_bytes)
    cfg_path = out_dir / "config.json"
    cfg_path.write_text(json.dumps(hf_config_for(cfg, dtypes[dtype], special), indent=1))
    extra = [out_dir / n for n in ("tokenizer.json", "tokenizer_config.json") if (out_dir / n).is_file()]
    return [cfg_path, *written, *extra]
