"""Hugging Face model directories as ``model.init_from``: their ``config.json`` mapped onto ``model.*``.

Supported dense families: Llama (``LlamaForCausalLM``: RMSNorm, SwiGLU, RoPE, no biases, optional GQA and
tied embeddings, rope scaling ``linear`` or ``llama3``), Mistral (``MistralForCausalLM``: Llama's layout;
a ``sliding_window`` shorter than the sequence is refused), Qwen2 (``Qwen2ForCausalLM``: Llama plus q/k/v
biases), Qwen3 (``Qwen3ForCausalLM``: Llama plus per-head q/k RMSNorm and an explicit ``head_dim``) and
GPT-2 (``GPT2LMHeadModel``: LayerNorm with bias, tanh-GELU MLP, learned positions, biased projections,
tied head). Mixture-of-experts families: Qwen3-MoE (``Qwen3MoeForCausalLM``: Qwen3's attention, top-k
routed SwiGLU experts, optionally some dense layers through ``decoder_sparse_step`` / ``mlp_only_layers``)
and Mixtral (``MixtralForCausalLM``: Mistral's attention, every layer routed, top-k weights renormalised).
Anything these configs can say that our model does not implement is refused here, naming
the Hugging Face field and its value.

How the mapping meets Hydra (``model.init_from=<dir>``):

- No model preset on the command line (the default ``model=tiny`` is only a default): every shape field
  (layers, heads, kv heads, width, MLP width, vocabulary, norm, MLP, positions, bias, eps, rope base,
  tying) comes from the directory, ``model.name`` becomes ``<model_type>-<dir name>`` and
  ``model.seq_len`` the model's context length (``max_position_embeddings`` / ``n_positions``).
- A preset chosen explicitly (``model=llama3-8b``) is checked against the directory: a differing shape
  field is refused naming both values.
- An explicit ``model.<field>=`` override that differs from the directory is refused naming both
  values. ``model.seq_len`` (the training window) and ``model.name`` may always be set; GPT-2 refuses a
  window longer than its ``n_positions``.
- Where no command line is known (inside the job, which receives the already-filled config), every
  shape field must already agree with the directory.

A PEFT LoRA adapter directory (``adapter_config.json`` + ``adapter_model.safetensors``) is an
``init_from`` too: its ``base_model_name_or_path`` must be a local Hugging Face directory, which gives
``model.*`` as above; the adapter gives ``finetune.lora.*`` (rank, alpha, dropout, targets) and training
continues it (``finetune.method=lora``).

Pure JSON and dict work: no torch, so the launcher can run it before anything starts.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from xirang_hpc.config.errors import ConfigError

#: ``architectures`` value -> our family name.
SUPPORTED_ARCHITECTURES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "Qwen2ForCausalLM": "qwen2",
                           "Qwen3ForCausalLM": "qwen3", "GPT2LMHeadModel": "gpt2",
                           "Qwen3MoeForCausalLM": "qwen3_moe", "MixtralForCausalLM": "mixtral"}
#: Architectures refused with a reason of their own (their closest supported relative says what differs).
REFUSED_ARCHITECTURES = {
    "Qwen2MoeForCausalLM": "its shared expert is scaled by a learned sigmoid gate per token "
                           "(shared_expert_gate), which our shared expert does not have",
    "DeepseekV3ForCausalLM": "its grouped top-k routing (n_group, topk_group) and sigmoid scores with a routed "
                             "scaling factor are not implemented",
}
#: The mixture-of-experts families (routed experts in some or all layers).
MOE_FAMILIES = ("qwen3_moe", "mixtral")
#: Model fields a Hugging Face directory decides (``seq_len`` and ``name`` are handled separately).
SHAPE_FIELDS = ("n_layer", "n_head", "n_kv_head", "d_model", "d_ff", "vocab_size", "norm", "mlp", "pos", "bias",
                "norm_eps", "rope_theta", "tie_embeddings", "attn_qkv_bias", "d_head", "qk_norm", "rope_scaling",
                "rope_factor", "rope_low_freq_factor", "rope_high_freq_factor", "rope_original_max_pos",
                "moe_experts", "moe_top_k", "moe_ffn_hidden", "moe_shared_ffn_hidden", "moe_score", "moe_norm_topk",
                "moe_every", "moe_first_dense")
#: Training choices a Hugging Face directory suggests but the command line may change freely.
TRAINING_FIELDS = ("moe_aux_coef",)
#: ``model.moe_*`` of a dense model (the schema's defaults).
DENSE_MOE = {"moe_experts": 0, "moe_top_k": 2, "moe_ffn_hidden": 0, "moe_shared_ffn_hidden": 0, "moe_score": "softmax",
             "moe_norm_topk": True, "moe_every": 1, "moe_first_dense": 0}


class HFConfigError(ConfigError):
    """A Hugging Face config we cannot map; names the HF field (or file), its value and the fix."""


def is_hf_dir(path: str | Path | None) -> bool:
    """True when ``path`` is a directory holding a Hugging Face ``config.json``."""
    if not path:
        return False
    p = Path(str(path)).expanduser()
    return p.is_dir() and (p / "config.json").is_file()


def read_hf_config(path: str | Path) -> dict[str, Any]:
    """The parsed ``config.json`` of a Hugging Face model directory."""
    p = Path(str(path)).expanduser() / "config.json"
    try:
        cfg = json.loads(p.read_text())
    except (OSError, ValueError) as exc:
        raise HFConfigError("model.init_from", str(path), f"{p} is not a readable JSON config ({exc})") from None
    if not isinstance(cfg, dict):
        raise HFConfigError("model.init_from", str(path), f"{p} must hold a JSON object")
    return cfg


def check_hf_weights(path: str | Path) -> None:
    """Refuse a Hugging Face directory whose weights are not all there: ``model.safetensors``, or every shard file
    ``model.safetensors.index.json`` lists. File names and sizes only (no tensor is read), so the login node
    says it before a job waits in the queue to find it out."""
    d = Path(str(path)).expanduser()
    index = d / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            shards = sorted(set(weight_map.values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise HFConfigError("model.init_from", str(path),
                                f"{index} is not a safetensors index (a JSON object with a weight_map: {exc}); "
                                "copy the complete model directory again") from None
        missing = [f for f in shards if not (d / str(f)).is_file()]
        if missing:
            shown = ", ".join(map(str, missing[:5])) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
            raise HFConfigError("model.init_from", str(path),
                                f"{index} lists {len(missing)} of {len(shards)} shard file(s) missing from {d}: "
                                f"{shown}; copy the complete model directory (every model-*.safetensors)")
    elif not (d / "model.safetensors").is_file():
        raise HFConfigError("model.init_from", str(path),
                            f"{d} holds neither model.safetensors nor model.safetensors.index.json; only "
                            "safetensors weights are read (save with safe_serialization=True)")


def hf_family(hf: dict[str, Any], source: str) -> str:
    """``llama``, ``mistral``, ``qwen2``, ``qwen3``, ``gpt2``, ``qwen3_moe`` or ``mixtral`` from the config's
    ``architectures``; anything else is refused, naming what is supported."""
    archs = hf.get("architectures") or []
    known = [a for a in archs if a in SUPPORTED_ARCHITECTURES]
    refused = [a for a in archs if a in REFUSED_ARCHITECTURES]
    if not known and refused:
        raise HFConfigError(f"{source}: architectures", archs,
                            f"{refused[0]} is not supported: {REFUSED_ARCHITECTURES[refused[0]]}; supported: "
                            f"{sorted(SUPPORTED_ARCHITECTURES)}")
    if not known:
        raise HFConfigError(f"{source}: architectures", archs,
                            f"supported: {sorted(SUPPORTED_ARCHITECTURES)}; "
                            "convert the model to one of these, or train from a preset")
    return SUPPORTED_ARCHITECTURES[known[0]]


def _refuse(source: str, field: str, value: Any, why: str) -> None:
    raise HFConfigError(f"{source}: {field}", value, why)


#: Rotary scalings we implement (``rope_type`` -> our ``model.rope_scaling``); others are refused by name.
SUPPORTED_ROPE = {"default": "none", "linear": "linear", "llama3": "llama3"}


def _rope_fields(hf: dict[str, Any], source: str) -> dict[str, Any]:
    """``rope_theta`` and the ``rope_*`` scaling fields, from v5's ``rope_parameters`` or v4's ``rope_scaling``."""
    params = hf.get("rope_parameters")
    where = "rope_parameters"
    if not isinstance(params, dict):
        scaling = hf.get("rope_scaling")
        where = "rope_scaling"
        if scaling is not None and not isinstance(scaling, dict):
            _refuse(source, where, scaling, "expected an object with a rope_type")
        params = dict(scaling or {})
    theta = params.get("rope_theta", hf.get("rope_theta"))
    kind = params.get("rope_type", params.get("type", "default")) or "default"
    if kind not in SUPPORTED_ROPE:
        _refuse(source, f"{where}.rope_type", kind,
                f"supported rotary scalings: {sorted(SUPPORTED_ROPE)} (dynamic NTK, yarn, longrope and others "
                "are not implemented); use a model without it, or convert it")
    out: dict[str, Any] = {"rope_theta": float(theta if theta is not None else 10000.0),
                           "rope_scaling": SUPPORTED_ROPE[kind], "rope_factor": 1.0, "rope_low_freq_factor": 1.0,
                           "rope_high_freq_factor": 4.0, "rope_original_max_pos": 8192}
    if kind in ("linear", "llama3"):
        out["rope_factor"] = float(params.get("factor", 1.0))
    if kind == "llama3":
        try:
            out.update(rope_low_freq_factor=float(params["low_freq_factor"]),
                       rope_high_freq_factor=float(params["high_freq_factor"]),
                       rope_original_max_pos=int(params["original_max_position_embeddings"]))
        except KeyError as exc:
            _refuse(source, f"{where}.{exc.args[0]}", None, "llama3 rope scaling needs factor, low_freq_factor, "
                    "high_freq_factor and original_max_position_embeddings")
    return out


def _sliding_window(hf: dict[str, Any], family: str) -> int | None:
    """The attention window a config asks for, or None when every layer attends to the whole context."""
    window = hf.get("sliding_window")
    if window is None:
        return None
    if family in ("qwen2", "qwen3", "qwen3_moe"):
        # Qwen configs carry a window that only applies with use_sliding_window (or a sliding layer type).
        types = hf.get("layer_types") or []
        if not hf.get("use_sliding_window") and "sliding_attention" not in types:
            return None
    return int(window)


def _llama_fields(hf: dict[str, Any], source: str, family: str = "llama") -> dict[str, Any]:
    """Fields of the Llama-like families: Llama, Mistral (same layout), Qwen2 (q/k/v biases), Qwen3 (q/k norms)."""
    d, nh = int(hf["hidden_size"]), int(hf["num_attention_heads"])
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        _refuse(source, "hidden_act", act, f"only silu (SwiGLU) is implemented for the {family} family")
    # Qwen2 always biases q/k/v (and never o); elsewhere attention_bias biases o as well, which we do not.
    for name in ("attention_bias", "mlp_bias"):
        if hf.get(name) and not (family == "qwen2" and name == "attention_bias"):
            _refuse(source, name, hf[name], f"biased {'MLP' if name == 'mlp_bias' else 'output'} projections are "
                    f"not implemented for the {family} family (Qwen2's q/k/v-only biases are); use a model "
                    "without them")
    hd = int(hf.get("head_dim") or d // nh)
    if not hf.get("head_dim") and d % nh:
        _refuse(source, "hidden_size", d, f"must split into num_attention_heads={nh} heads (or set head_dim)")
    if hd % 2:
        _refuse(source, "head_dim", hd, "rotary embeddings need an even head width")
    if int(hf.get("pretraining_tp", 1) or 1) != 1:
        _refuse(source, "pretraining_tp", hf["pretraining_tp"], "only pretraining_tp=1 is implemented")
    eps = hf.get("rms_norm_eps")
    return {"n_layer": int(hf["num_hidden_layers"]), "n_head": nh,
            "n_kv_head": int(hf.get("num_key_value_heads") or nh), "d_model": d,
            "d_ff": int(hf["intermediate_size"]), "vocab_size": int(hf["vocab_size"]), "norm": "rmsnorm",
            "mlp": "swiglu", "pos": "rope", "bias": False, "norm_eps": float(1e-6 if eps is None else eps),
            "tie_embeddings": bool(hf.get("tie_word_embeddings", False)),
            "attn_qkv_bias": family == "qwen2", "qk_norm": family in ("qwen3", "qwen3_moe"),
            # 0 (d_model/n_head) unless the config decouples the head width, as Qwen3's small models do.
            "d_head": 0 if hd * nh == d else hd, **_rope_fields(hf, source),
            "seq_len": int(hf.get("max_position_embeddings", 2048)),
            "sliding_window": _sliding_window(hf, family), **_moe_fields(hf, source, family)}


def sparse_layers(n_layer: int, every: int, first_dense: int) -> tuple[int, ...]:
    """The MoE blocks of our ``model.moe_every`` / ``model.moe_first_dense`` rule (as ``ModelConfig.moe_layers``)."""
    return tuple(i for i in range(first_dense, n_layer) if (i - first_dense) % every == every - 1)


def _moe_fields(hf: dict[str, Any], source: str, family: str) -> dict[str, Any]:
    """``model.moe_*`` for a Qwen3-MoE or Mixtral config (a dense family's defaults otherwise)."""
    out: dict[str, Any] = {**DENSE_MOE, "moe_aux_coef": 0.01}
    if family not in MOE_FAMILIES:
        return out
    n = int(hf["num_hidden_layers"])
    # transformers 5 writes num_local_experts for both; Qwen3-MoE's own name (and 4.x's) is num_experts.
    experts = int(hf.get("num_local_experts") or hf.get("num_experts") or 0)
    top_k = int(hf.get("num_experts_per_tok", 2))
    out["moe_aux_coef"] = float(hf.get("router_aux_loss_coef", 0.001))
    if family == "mixtral":
        if experts < 1:
            _refuse(source, "num_local_experts", experts, "a Mixtral model needs at least one expert")
        jitter = float(hf.get("router_jitter_noise") or 0.0)
        if jitter:
            _refuse(source, "router_jitter_noise", jitter, "router jitter noise is not implemented; use 0.0")
        width = int(hf["intermediate_size"])  # Mixtral's experts are its only MLPs
        out.update(moe_experts=experts, moe_top_k=top_k, moe_ffn_hidden=width, moe_norm_topk=True)
        return out
    if experts < 1:  # no expert anywhere: every layer is Qwen3's dense MLP
        return out
    step = int(hf.get("decoder_sparse_step", 1) or 1)
    dense_only = sorted(int(i) for i in hf.get("mlp_only_layers") or [])
    # transformers' rule: layer i is sparse when it is not in mlp_only_layers and (i + 1) % decoder_sparse_step == 0.
    sparse = tuple(i for i in range(n) if i not in dense_only and (i + 1) % step == 0)
    if not sparse:
        return out
    rule = next(((every, first) for every in range(1, n + 1) for first in range(n)
                 if sparse_layers(n, every, first) == sparse), None)
    if rule is None:
        _refuse(source, "mlp_only_layers" if dense_only else "decoder_sparse_step", dense_only or step,
                f"sparse layers {list(sparse)} of {n}: our model places experts in every model.moe_every-th block "
                "after the first model.moe_first_dense, which cannot express this pattern")
    for name in ("shared_expert_intermediate_size", "n_shared_experts"):
        if hf.get(name):
            _refuse(source, name, hf[name], "a shared expert is not implemented for the Qwen3-MoE family")
    out.update(moe_experts=experts, moe_top_k=top_k, moe_ffn_hidden=int(hf["moe_intermediate_size"]),
               moe_norm_topk=bool(hf.get("norm_topk_prob", False)), moe_every=rule[0], moe_first_dense=rule[1])
    return out


def _gpt2_fields(hf: dict[str, Any], source: str) -> dict[str, Any]:
    act = hf.get("activation_function", "gelu_new")
    if act not in ("gelu_new", "gelu_pytorch_tanh"):
        _refuse(source, "activation_function", act, "only the tanh GELU (gelu_new) is implemented")
    checks = {"scale_attn_by_inverse_layer_idx": False, "reorder_and_upcast_attn": False,
              "add_cross_attention": False, "scale_attn_weights": True}
    for name, ok in checks.items():
        if bool(hf.get(name, ok)) != ok:
            _refuse(source, name, hf[name], f"only {name}={ok} is implemented")
    d = int(hf.get("n_embd", 768))
    return {"n_layer": int(hf.get("n_layer", 12)), "n_head": int(hf.get("n_head", 12)),
            "n_kv_head": int(hf.get("n_head", 12)), "d_model": d, "d_ff": int(hf.get("n_inner") or 4 * d),
            "vocab_size": int(hf.get("vocab_size", 50257)), "norm": "layernorm", "mlp": "gelu", "pos": "learned",
            "bias": True, "norm_eps": float(hf.get("layer_norm_epsilon", 1e-5)), "rope_theta": 10000.0,
            "tie_embeddings": bool(hf.get("tie_word_embeddings", True)), "attn_qkv_bias": False, "d_head": 0,
            "qk_norm": False, "rope_scaling": "none", "rope_factor": 1.0, "rope_low_freq_factor": 1.0,
            "rope_high_freq_factor": 4.0, "rope_original_max_pos": 8192,
            "seq_len": int(hf.get("n_positions", 1024)), "sliding_window": None, **DENSE_MOE, "moe_aux_coef": 0.01}


def model_fields_from_hf(hf: dict[str, Any], source: str = "config.json") -> dict[str, Any]:
    """Our ``model.*`` fields (plus ``seq_len`` = the context length) for a Hugging Face config."""
    family = hf_family(hf, source)
    try:
        return _gpt2_fields(hf, source) if family == "gpt2" else _llama_fields(hf, source, family)
    except KeyError as exc:
        raise HFConfigError(f"{source}: {exc.args[0]}", None, "missing from the config; is it a complete "
                            "Hugging Face config.json?") from None


def _override_keys(overrides: list[str]) -> tuple[set[str], bool]:
    """(explicitly set ``model.<field>`` names, whether a ``model=<preset>`` was chosen)."""
    fields, preset = set(), False
    for o in overrides:
        key = re.split(r"=", o.lstrip("+~"), maxsplit=1)[0].strip()
        if key == "model":
            preset = True
        elif key.startswith("model."):
            fields.add(key.removeprefix("model."))
    return fields, preset


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, float) or isinstance(b, float):
        return abs(float(a) - float(b)) <= 1e-12 * max(1.0, abs(float(b)))
    return a == b


def apply_hf_model(model: dict[str, Any], overrides: list[str] | None) -> dict[str, Any]:
    """``model`` (a plain dict of ``model.*``) with a Hugging Face ``init_from``'s fields filled or checked.

    ``overrides`` are the command line's Hydra overrides, or ``None`` when unknown (inside the job): then
    every shape field must already agree. Returns ``model`` unchanged when ``init_from`` is not an HF dir.
    """
    path = base_model_dir(model.get("init_from"))  # a PEFT adapter's base, or the HF directory itself
    if path is None:
        return model
    source = str(Path(str(path)).expanduser() / "config.json")
    check_hf_weights(path)
    hf = model_fields_from_hf(read_hf_config(path), source)
    context = hf.pop("seq_len")
    window = hf.pop("sliding_window")
    training = {k: hf.pop(k) for k in TRAINING_FIELDS}
    explicit, preset = _override_keys(overrides or [])
    check_all = overrides is None or preset
    out = dict(model)
    for name in SHAPE_FIELDS:
        ours = model.get(name)
        if name == "n_kv_head" and not ours:
            ours = model.get("n_head")
        if name == "d_ff" and not ours and model.get("d_model"):  # 0 = derived from d_model (schema.ModelConfig)
            dm = int(model["d_model"])
            ours = 256 * ((int(8 * dm / 3) + 255) // 256) if model.get("mlp") == "swiglu" else 4 * dm
        if (check_all or name in explicit) and ours is not None and not _same(ours, hf[name]):
            how = "chosen preset" if name not in explicit else "command line"
            raise HFConfigError(f"model.{name}", ours,
                                f"conflicts with the Hugging Face config {source} which gives {hf[name]!r} "
                                f"({how}); drop the override or the model preset to take the shape from the "
                                "directory, or point model.init_from at a matching model")
        out[name] = hf[name]
    if not check_all:
        if "seq_len" not in explicit:
            out["seq_len"] = context
        if "name" not in explicit:
            out["name"] = f"{hf_family_name(path)}"
    if overrides is not None and out["moe_experts"]:
        # The directory's router_aux_loss_coef, unless the command line says otherwise.
        out.update({k: v for k, v in training.items() if k not in explicit})
    if window is not None and int(out.get("seq_len") or context) > window:
        # Within the window, sliding-window attention is plain causal attention: exact, so allowed.
        raise HFConfigError(f"{source}: sliding_window", window,
                            f"shorter than the sequence length model.seq_len={out.get('seq_len') or context} "
                            "(sliding-window attention is not implemented); set model.seq_len <= "
                            f"{window}, or use a model with sliding_window null")
    if out["pos"] == "learned" and int(out.get("seq_len") or 0) > context:
        raise HFConfigError("model.seq_len", out["seq_len"],
                            f"longer than the GPT-2 model's n_positions={context} ({source}); "
                            f"use model.seq_len <= {context}")
    return out


def hf_family_name(path: str | Path) -> str:
    """The run-facing model name for an HF directory: ``hf-<dir name>`` (safe characters only)."""
    base = re.sub(r"[^A-Za-z0-9._-]+", "-", Path(str(path)).expanduser().resolve().name).strip("-") or "model"
    return f"hf-{base}"


# ---- PEFT LoRA adapters as init_from ------------------------------------------------------------------------

PEFT_CONFIG = "adapter_config.json"
PEFT_WEIGHTS = "adapter_model.safetensors"
#: PEFT LoRA options our adapters do not implement, with the value that means "off".
_PEFT_OFF = {"use_dora": False, "use_rslora": False, "fan_in_fan_out": False, "bias": "none", "lora_bias": False,
             "modules_to_save": None, "layers_to_transform": None, "rank_pattern": {}, "alpha_pattern": {},
             "layer_replication": None, "target_parameters": None}


def is_peft_dir(path: str | Path | None) -> bool:
    """True when ``path`` is a directory holding a PEFT adapter's ``adapter_config.json``."""
    if not path:
        return False
    p = Path(str(path)).expanduser()
    return p.is_dir() and (p / PEFT_CONFIG).is_file()


def read_peft_config(path: str | Path) -> dict[str, Any]:
    """A PEFT adapter's ``adapter_config.json``, refused naming the field when it is not a LoRA adapter we can
    continue (another PEFT method, DoRA, rsLoRA, per-layer ranks, trained biases or extra modules)."""
    d = Path(str(path)).expanduser()
    source = str(d / PEFT_CONFIG)
    try:
        cfg = json.loads((d / PEFT_CONFIG).read_text())
    except (OSError, ValueError) as exc:
        raise HFConfigError("model.init_from", str(path), f"{source} is not a readable JSON config ({exc})") from None
    if not isinstance(cfg, dict):
        raise HFConfigError("model.init_from", str(path), f"{source} must hold a JSON object")
    if cfg.get("peft_type") != "LORA":
        raise HFConfigError(f"{source}: peft_type", cfg.get("peft_type"),
                            "only LoRA adapters (peft_type LORA) can be an init_from")
    for key, off in _PEFT_OFF.items():
        value = cfg.get(key)
        if value is not None and value != off and value not in ([], {}):
            raise HFConfigError(f"{source}: {key}", value, f"is not implemented by our LoRA adapters (only {off!r})")
    targets = cfg.get("target_modules")
    if isinstance(targets, str) or not targets:
        raise HFConfigError(f"{source}: target_modules", targets,
                            "must list the module names (a regular expression is not supported)")
    if not (d / PEFT_WEIGHTS).is_file():
        raise HFConfigError("model.init_from", str(path), f"{d / PEFT_WEIGHTS} is missing: copy the whole adapter "
                            "directory (adapter_config.json + adapter_model.safetensors)")
    return cfg


def peft_base(path: str | Path) -> str:
    """The local Hugging Face directory a PEFT adapter was trained on (its ``base_model_name_or_path``)."""
    base = read_peft_config(path).get("base_model_name_or_path")
    if not base or not is_hf_dir(base):
        raise HFConfigError("model.init_from", str(path),
                            f"the adapter's base_model_name_or_path {base!r} ({Path(str(path)) / PEFT_CONFIG}) is "
                            "not a local Hugging Face model directory; nothing is downloaded: set it to the path of "
                            "a local copy of the base model")
    return str(base)


def base_model_dir(init_from: str | Path | None) -> str | None:
    """The Hugging Face directory behind ``model.init_from``: itself, a PEFT adapter's base, or None (not HF)."""
    if is_peft_dir(init_from):
        return peft_base(str(init_from))
    return str(init_from) if is_hf_dir(init_from) else None


def apply_peft_finetune(finetune: dict[str, Any], init_from: str | Path, overrides: list[str] | None
                        ) -> dict[str, Any]:
    """``finetune`` (a plain dict) with a PEFT adapter's LoRA shape: ``method=lora`` is required, rank, alpha,
    dropout and targets come from ``adapter_config.json`` (an explicit, different override is refused)."""
    pc = read_peft_config(init_from)
    source = str(Path(str(init_from)) / PEFT_CONFIG)
    out = dict(finetune or {})
    method = out.get("method", "full")
    if method != "lora":
        raise HFConfigError("finetune.method", method,
                            f"model.init_from={init_from} is a PEFT LoRA adapter: training continues it with "
                            "finetune.method=lora; to train every weight (or DPO) from it, merge it first (peft's "
                            "merge_and_unload, then save_pretrained) and point model.init_from at that directory")
    explicit = {re.split(r"=", o.lstrip("+~"), maxsplit=1)[0].strip() for o in overrides or []}
    lora = dict(out.get("lora") or {})
    from_adapter = {"rank": int(pc.get("r", 8)), "alpha": float(pc.get("lora_alpha", 8)),
                    "dropout": float(pc.get("lora_dropout", 0.0)), "target_modules": sorted(pc["target_modules"])}
    for name, value in from_adapter.items():
        key = f"finetune.lora.{name}"
        given = lora.get(name)
        same = (_targets(given) == _targets(value)) if name == "target_modules" and given is not None else \
            given == value
        if key in explicit and name != "dropout" and not same:
            raise HFConfigError(key, given, f"conflicts with the adapter {source}, which has {value!r}; drop the "
                                "override (the adapter decides its shape)")
        if key not in explicit or name != "dropout":
            lora[name] = value
    out["lora"] = lora
    return out


def _targets(names: Any) -> set[str]:
    """Target module names as one spelling: PEFT's ``q_proj``, ours ``attn.q`` and ``q`` are all ``q``."""
    return {str(n).removesuffix("_proj").rsplit(".", 1)[-1] for n in names}
