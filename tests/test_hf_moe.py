"""Mixture-of-experts models in and out of the Hugging Face layout: Qwen3-MoE and Mixtral.

Small random models are built by transformers' own config and model classes and saved with
``save_pretrained`` (one file, or a sharded index); nothing is downloaded. Imported, our logits equal
transformers' (fp32, max abs diff <= 1e-4) and our auxiliary loss equals transformers' ``aux_loss``
(``output_router_logits=True``, times ``router_aux_loss_coef``) on the same batch (<= 1e-5). Exported,
transformers loads the right class with equal logits and greedy tokens equal to our serving engine's.
Every refusal names the Hugging Face field, or the tensor and both shapes.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

from test_hf_roundtrip import our_greedy  # noqa: E402

from xirang_hpc.config.hf import HFConfigError, apply_hf_model, model_fields_from_hf  # noqa: E402
from xirang_hpc.config.schema import ModelConfig  # noqa: E402
from xirang_hpc.models.gpt import GPT  # noqa: E402
from xirang_hpc.weights.hf import family_of, hf_config_for, to_hf_state, write_hf_weights  # noqa: E402
from xirang_hpc.weights.hf_import import HFImportError  # noqa: E402
from xirang_hpc.weights.load import load_hf  # noqa: E402

TOL = 1e-4
AUX_TOL = 1e-5
VOCAB = 256
TOKENS = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(7))

#: name -> (config class, model class, fields beyond the common ones, save_pretrained max_shard_size).
MODELS: dict[str, tuple[str, str, dict[str, Any], str | None]] = {
    # Layer 0 dense (mlp_only_layers), 1-2 routed; renormalised top-2 of 8; Qwen3's decoupled head width.
    "qwen3moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                 {"num_experts": 8, "moe_intermediate_size": 16, "mlp_only_layers": [0], "norm_topk_prob": True,
                  "head_dim": 32, "num_hidden_layers": 3}, None),
    # Every second layer routed (decoder_sparse_step 2: layers 1 and 3), raw top-k weights, sharded files.
    "qwen3moe-step2": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                       {"num_experts": 4, "moe_intermediate_size": 24, "decoder_sparse_step": 2,
                        "norm_topk_prob": False, "num_hidden_layers": 4, "tie_word_embeddings": True}, "40KB"),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", {"num_local_experts": 4, "num_hidden_layers": 2}, "40KB"),
}


def make_moe(path: Path, name: str) -> Any:
    """A random model of ``MODELS[name]`` (hidden 64, 4 heads, 2 kv heads, vocab 256) saved to ``path``.

    Weights are redrawn wider than transformers' init (std 0.2) and 1-D ones perturbed, so routing
    differs between tokens and a wrong expert or channel order shows in the logits.
    """
    cname, mname, kw, shard = MODELS[name]
    torch.manual_seed(21)
    cfg = getattr(transformers, cname)(hidden_size=64, intermediate_size=48, num_attention_heads=4,
                                       num_key_value_heads=2, vocab_size=VOCAB, num_experts_per_tok=2,
                                       max_position_embeddings=64, rms_norm_eps=1e-5, router_aux_loss_coef=0.02,
                                       bos_token_id=None, eos_token_id=None, **kw)
    model = getattr(transformers, mname)(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(0.3 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.2)
    model.save_pretrained(path, **({"max_shard_size": shard} if shard else {}))
    return model


@pytest.fixture(scope="module")
def moe_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Any]]:
    """name -> (HF directory, the transformers model saved there)."""
    tmp = tmp_path_factory.mktemp("hfmoe")
    return {name: (tmp / name, make_moe(tmp / name, name)) for name in MODELS}


@pytest.mark.parametrize("name", list(MODELS))
def test_imported_logits_and_aux_loss_equal_transformers(moe_dirs, name: str) -> None:
    path, hf = moe_dirs[name]
    if MODELS[name][3]:
        assert (path / "model.safetensors.index.json").is_file()
    with torch.no_grad():
        ref = hf(TOKENS, output_router_logits=True)
    loaded = load_hf(path)
    with torch.no_grad():
        ours = loaded.model(TOKENS)
    assert (ours - ref.logits).abs().max().item() <= TOL
    aux = loaded.model.moe_aux_loss()
    assert aux is not None and ref.aux_loss is not None
    assert loaded.cfg.moe_aux_coef == pytest.approx(0.02)
    assert abs(aux.item() - 0.02 * ref.aux_loss.item()) <= AUX_TOL
    assert abs(aux.item() / 0.02 - ref.aux_loss.item()) <= AUX_TOL
    # transformers' training loss is cross-entropy + coef * aux_loss: the same sum from our pieces.
    with torch.no_grad():
        ref_loss = hf(TOKENS, labels=TOKENS, output_router_logits=True).loss
    ce = torch.nn.functional.cross_entropy(ours[:, :-1].reshape(-1, VOCAB), TOKENS[:, 1:].reshape(-1))
    assert abs((ce + aux).item() - ref_loss.item()) <= TOL


def test_config_fields_of_each_family(moe_dirs) -> None:
    c = load_hf(moe_dirs["qwen3moe"][0]).cfg
    assert (c.moe_experts, c.moe_top_k, c.moe_ffn_dim, c.moe_norm_topk, c.moe_layers, c.d_ff) == \
        (8, 2, 16, True, (1, 2), 48)
    assert c.qk_norm and c.head_dim == 32 and family_of(c) == "qwen3_moe"
    c = load_hf(moe_dirs["qwen3moe-step2"][0]).cfg
    assert (c.moe_experts, c.moe_ffn_dim, c.moe_norm_topk, c.moe_layers, c.tie_embeddings) == \
        (4, 24, False, (1, 3), True)
    c = load_hf(moe_dirs["mixtral"][0]).cfg
    assert (c.moe_experts, c.moe_ffn_dim, c.moe_norm_topk, c.moe_layers, c.qk_norm) == (4, 48, True, (0, 1), False)
    assert family_of(c) == "mixtral"


def test_command_line_may_change_the_aux_coefficient_but_not_the_expert_count(moe_dirs) -> None:
    path = str(moe_dirs["mixtral"][0])
    fields = apply_hf_model({"init_from": path, "moe_aux_coef": 0.5}, ["model.moe_aux_coef=0.5"])
    assert fields["moe_aux_coef"] == 0.5 and fields["moe_experts"] == 4
    assert apply_hf_model({"init_from": path, "moe_aux_coef": 0.5}, [])["moe_aux_coef"] == pytest.approx(0.02)
    with pytest.raises(HFConfigError, match=r"model.moe_experts.*8.*conflicts.*gives 4"):
        apply_hf_model({"init_from": path, "moe_experts": 8}, ["model.moe_experts=8"])
    with pytest.raises(HFConfigError, match=r"model.moe_top_k.*1.*gives 2"):
        apply_hf_model({"init_from": path, "moe_top_k": 1}, ["model.moe_top_k=1"])


def _qwen3moe(**kw: Any) -> dict[str, Any]:
    base = {"architectures": ["Qwen3MoeForCausalLM"], "hidden_size": 64, "num_attention_heads": 4,
            "num_key_value_heads": 2, "num_hidden_layers": 4, "intermediate_size": 48, "vocab_size": 256,
            "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16, "head_dim": 16}
    return {**base, **kw}


def _mixtral(**kw: Any) -> dict[str, Any]:
    base = {"architectures": ["MixtralForCausalLM"], "hidden_size": 64, "num_attention_heads": 4,
            "num_key_value_heads": 2, "num_hidden_layers": 2, "intermediate_size": 48, "vocab_size": 256,
            "num_local_experts": 4, "num_experts_per_tok": 2}
    return {**base, **kw}


@pytest.mark.parametrize("hf,field,message", [
    (_mixtral(router_jitter_noise=0.1), "router_jitter_noise", "not implemented"),
    (_qwen3moe(mlp_only_layers=[1]), "mlp_only_layers", r"sparse layers \[0, 2, 3\]"),
    (_qwen3moe(decoder_sparse_step=2, mlp_only_layers=[3]), "mlp_only_layers", r"sparse layers \[1\] of 4.*cannot"),
    (_qwen3moe(shared_expert_intermediate_size=32), "shared_expert_intermediate_size", "shared expert"),
    (_qwen3moe(architectures=["Qwen2MoeForCausalLM"]), "architectures", "shared_expert_gate"),
    (_mixtral(hidden_act="gelu"), "hidden_act", "only silu"),
    (_qwen3moe(attention_bias=True), "attention_bias", "not implemented"),
    (_mixtral(sliding_window=16), "sliding_window", "shorter than the sequence"),
])
def test_unimplemented_fields_are_refused_by_name(moe_dirs, tmp_path: Path, hf: dict[str, Any], field: str,
                                                  message: str) -> None:
    if field == "sliding_window":  # only refused against a sequence length: through a real directory
        d = tmp_path / "m"
        shutil.copytree(moe_dirs["mixtral"][0], d)
        cfg = json.loads((d / "config.json").read_text())
        (d / "config.json").write_text(json.dumps({**cfg, "sliding_window": 16}))
        with pytest.raises(HFConfigError, match=rf"sliding_window.*{message}"):
            apply_hf_model({"init_from": str(d)}, [])
        return
    with pytest.raises(HFConfigError, match=rf"{field}.*{message}"):
        model_fields_from_hf(hf)


def test_sparse_layer_patterns_map_to_moe_every_and_first_dense() -> None:
    f = model_fields_from_hf(_qwen3moe(num_hidden_layers=6, decoder_sparse_step=2))
    assert (f["moe_every"], f["moe_first_dense"]) == (2, 0)
    f = model_fields_from_hf(_qwen3moe(num_hidden_layers=6, mlp_only_layers=[0, 1]))
    assert (f["moe_every"], f["moe_first_dense"]) == (1, 2)
    f = model_fields_from_hf(_qwen3moe(num_hidden_layers=6, decoder_sparse_step=2, mlp_only_layers=[1]))
    cfg = ModelConfig(name="m", n_layer=6, mlp="swiglu", moe_experts=4, moe_every=f["moe_every"],
                      moe_first_dense=f["moe_first_dense"])
    assert cfg.moe_layers == (3, 5)
    # No experts at all: Qwen3's dense model under another name.
    f = model_fields_from_hf(_qwen3moe(num_experts=0))
    assert f["moe_experts"] == 0 and f["qk_norm"]


def test_expert_count_mismatch_names_the_tensor_and_both_shapes(moe_dirs, tmp_path: Path) -> None:
    d = tmp_path / "fewer"
    shutil.copytree(moe_dirs["qwen3moe"][0], d)
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(num_experts=6, num_local_experts=6)  # the weights hold 8 experts per layer
    (d / "config.json").write_text(json.dumps(cfg))
    want = (r"model\.layers\.1\.mlp\.experts\.\*\.gate_proj\.weight holds 8 expert\(s\), stacked \(8, 16, 64\), "
            r"but layers\.1\.mlp\.w1 needs \(6, 16, 64\)")
    with pytest.raises(HFImportError, match=want):
        load_hf(d)
    cfg.update(num_experts=10, num_local_experts=10)  # more experts than the weights hold
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(HFImportError, match=r"holds 8 expert.*stacked \(8, 16, 64\).*needs \(10, 16, 64\)"):
        load_hf(d)
    # An expert tensor of the wrong width: the tensor and both shapes named by the header check.
    from xirang_hpc.weights.hf_import import init_model_from_hf

    path = moe_dirs["qwen3moe"][0]
    fields = apply_hf_model({"init_from": str(path)}, [])
    wrong = ModelConfig(**{**{k: v for k, v in fields.items() if k != "init_from"}, "moe_ffn_hidden": 8})
    with pytest.raises(HFImportError, match=r"experts\.0\.down_proj\.weight has shape \(64, 16\), the model config "
                                            r"needs \(64, 8\) \(for layers\.1\.mlp\.w2\)"):
        init_model_from_hf(GPT.for_loading(wrong), path, wrong)


def _perturbed(cfg: ModelConfig, seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    m = GPT(cfg).eval()
    with torch.no_grad():
        for n, p in m.named_parameters():
            if p.dim() == 1:
                p.add_(0.3 * torch.randn_like(p))
            elif ".mlp." in n:  # wide routers and experts: tokens route differently
                p.normal_(0.0, 0.2)
    return m


#: Native MoE models and the architecture each exports as.
NATIVE = {
    "mixtral": ({}, "MixtralForCausalLM"),
    "qwen3moe": ({"qk_norm": True, "d_head": 32, "moe_first_dense": 1, "moe_every": 2, "moe_norm_topk": False,
                  "tie_embeddings": True}, "Qwen3MoeForCausalLM"),
}


def _native(kw: dict[str, Any]) -> ModelConfig:
    return ModelConfig(name="m", n_layer=4, n_head=4, n_kv_head=2, d_model=64, d_ff=96, vocab_size=VOCAB, seq_len=64,
                       norm="rmsnorm", mlp="swiglu", pos="rope", bias=False, moe_experts=4, moe_top_k=2,
                       moe_ffn_hidden=32, **kw)


@pytest.mark.slow  # transformers' from_pretrained and generate: seconds each
@pytest.mark.parametrize("name", list(NATIVE))
def test_native_moe_exports_as_its_architecture_with_equal_logits_and_greedy_tokens(tmp_path: Path,
                                                                                    name: str) -> None:
    kw, arch = NATIVE[name]
    cfg = _native(kw)
    ours = _perturbed(cfg)
    write_hf_weights(to_hf_state(ours.state_dict(), cfg), tmp_path, 60_000)  # sharded
    assert (tmp_path / "model.safetensors.index.json").is_file()
    (tmp_path / "config.json").write_text(json.dumps(hf_config_for(cfg, torch.float32)))
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    assert type(theirs).__name__ == arch
    x = TOKENS
    with torch.no_grad():
        ref = theirs(x, output_router_logits=True)
        assert (ref.logits - ours(x)).abs().max().item() <= TOL
    assert abs(ours.moe_aux_loss().item() - cfg.moe_aux_coef * ref.aux_loss.item()) <= AUX_TOL
    prompt = [int(t) for t in x[0, :6]]
    theirs.generation_config.eos_token_id = None
    gen = theirs.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False, pad_token_id=0)
    assert our_greedy(ours, cfg.seq_len, prompt, 16) == gen[0, len(prompt):].tolist()
    back = load_hf(tmp_path)  # and back in: the same model
    assert back.cfg.moe_layers == cfg.moe_layers and back.cfg.moe_norm_topk == cfg.moe_norm_topk
    with torch.no_grad():
        assert (back.model(x) - ours(x)).abs().max().item() <= TOL


@pytest.mark.parametrize("kw,message", [
    ({"moe_balance": "bias"}, "model.moe_balance=bias"),
    ({"moe_shared_ffn_hidden": 32}, "model.moe_shared_ffn_hidden=32"),
    ({"moe_score": "sigmoid"}, "model.moe_score=sigmoid"),
    ({"moe_first_dense": 1}, r"dense blocks \[0\].*Mixtral"),
    ({"moe_norm_topk": False}, "model.moe_norm_topk=false.*Mixtral"),
    ({"attn_qkv_bias": True}, "Qwen2-MoE"),
])
def test_export_refuses_moe_models_no_architecture_expresses(kw: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        family_of(_native(kw))


def test_a_bias_balanced_run_imports_from_a_qwen3_moe_directory(moe_dirs) -> None:
    """The balancing method is a training choice: bias balancing starts from the directory's weights (bias 0)."""
    from xirang_hpc.weights.hf_import import init_model_from_hf

    path, hf = moe_dirs["qwen3moe"]
    fields = apply_hf_model({"init_from": str(path), "moe_balance": "bias"}, ["model.moe_balance=bias"])
    cfg = ModelConfig(**{k: v for k, v in fields.items() if k != "init_from"})
    model = GPT.for_loading(cfg)
    init_model_from_hf(model, path, cfg)
    with torch.no_grad():
        assert (model.eval()(TOKENS) - hf(TOKENS).logits).abs().max().item() <= TOL
    with pytest.raises(ValueError, match="moe_balance=bias"):
        family_of(cfg)


@pytest.mark.slow
@pytest.mark.parametrize("name,layout,world", [("qwen3moe", "fsdp4", 4), ("qwen3moe-step2", "zero3dp2", 2),
                                               ("mixtral", "dp2", 2), ("mixtral", "dp2zero", 2),
                                               ("qwen3moe", "dp2xtp2", 4), ("qwen3moe", "ep2xfsdp2", 4),
                                               ("qwen3moe", "ep2xhsdp2x4", 8)])
def test_ranks_read_only_their_experts_and_match_transformers(moe_dirs, name: str, layout: str, world: int) -> None:
    """MoE imported data-parallel (DDP, ZeRO 1-2, or FSDP2 = ZeRO-3) and beside tensor parallelism. FSDP2
    shards every stacked expert tensor along its expert dimension: each of 4 ranks holds 2 of the 8 experts (of
    2 ranks, 2 of 4) and opens only those experts' tensors, reading exactly the elements it holds. Under DDP and
    ZeRO-1 (optimizer state sharded, weights whole), and under tp (the attention split, every expert whole on
    each tp rank), every rank reads every expert once. At ep2 under FSDP2 (efsdp) each rank reads the quarter of
    the experts it holds: its ep rank's half, of which its edp rank's half; under HSDP (2 replicate groups of 4
    ranks, ep2) the same quarter, whatever its replicate group."""
    from test_hf_import import TOKENS as WORKER_TOKENS
    from test_hf_import import _run

    path, hf = moe_dirs[name]
    with torch.no_grad():
        ref = hf(WORKER_TOKENS).logits  # the tokens each rank runs
    res = _run(world, layout, path)
    for r in res:
        assert (torch.from_numpy(r["logits"]) - ref).abs().max().item() <= TOL
        assert sum(int(torch.tensor(s).prod()) for _, s, _ in r["requests"]) == r["local_numel"]
    experts = MODELS[name][2].get("num_experts") or MODELS[name][2]["num_local_experts"]
    for rank, r in enumerate(res):
        read = {int(n.split(".experts.")[1].split(".")[0]) for n, _, _ in r["requests"] if ".experts." in n}
        if layout in ("fsdp4", "zero3dp2", "ep2xfsdp2", "ep2xhsdp2x4"):
            share = experts // 4 if layout == "ep2xhsdp2x4" else experts // world  # HSDP: shards over 4, twice
            # efsdp: dp rank = (replicate group x 4 +) efsdp rank x 2 + ep rank; ep rank e holds experts
            # [e*E/2, (e+1)*E/2), split over efsdp
            efsdp_rank = (rank % 4) // 2
            first = (rank % 2) * experts // 2 + efsdp_rank * share if layout.startswith("ep2x") else rank * share
            assert read == set(range(first, first + share)), (rank, read)
            routers = [(s, full) for n, s, full in r["requests"] if n.endswith("mlp.gate.weight")]
            assert routers and all(s == [share, full[1]] for s, full in routers)  # its experts' router rows
        else:
            assert read == set(range(experts))


def make_moe_dir_with_tokenizer(path: Path) -> Any:
    """A Qwen3-MoE directory as users bring it: config, sharded safetensors, tokenizer.json (BPE, </s>).

    4 layers, the first dense (``mlp_only_layers=[0]``), 8 experts of which each token takes 2.
    """
    from test_hf_roundtrip import DOCS
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(DOCS, trainers.BpeTrainer(vocab_size=300, special_tokens=["</s>"], show_progress=False,
                                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>").save_pretrained(path)
    torch.manual_seed(23)
    cfg = transformers.Qwen3MoeConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
                                      num_key_value_heads=2, head_dim=16, vocab_size=320, num_experts=8,
                                      num_experts_per_tok=2, moe_intermediate_size=32, mlp_only_layers=[0],
                                      norm_topk_prob=True, max_position_embeddings=64, rms_norm_eps=1e-5,
                                      router_aux_loss_coef=0.005, bos_token_id=None,
                                      eos_token_id=tok.token_to_id("</s>"))
    model = transformers.Qwen3MoeForCausalLM(cfg)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if ".mlp.gate." in n:  # a router that prefers different experts for different tokens
                p.normal_(0.0, 0.2)
    model.save_pretrained(path, max_shard_size="200KB")
    return model


@pytest.mark.slow
def test_docs_mixture_of_experts_fine_tune_round_trip(tmp_path: Path) -> None:
    """The docs' Qwen3-MoE commands as written: FSDP2 on 4 ranks, export, transformers loads Qwen3MoeForCausalLM;
    logits equal ours, greedy tokens equal our serving engine's, and the fine-tune moved the weights."""
    import os
    import subprocess

    from test_hf_roundtrip import BIN, DOCS, doc_block, hf_side

    from xirang_hpc.data.dataset import TokenWindows
    from xirang_hpc.weights.load import load_checkpoint

    model_dir, corpus = tmp_path / "my-moe", tmp_path / "corpus.jsonl"
    make_moe_dir_with_tokenizer(model_dir)
    assert (model_dir / "model.safetensors.index.json").is_file()
    corpus.write_text("".join(json.dumps({"id": i, "text": d}) + "\n" for i, d in enumerate(DOCS)))
    script = doc_block("models-and-fine-tuning.md", "### A mixture-of-experts model")
    env = {**os.environ, "MODEL": str(model_dir), "CORPUS": str(corpus),
           "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"}
    r = subprocess.run(["bash", "-e", "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=1500)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    assert "4 ranks on 2 node(s)" in r.stdout and "step    20/20" in r.stdout
    assert r.stdout.splitlines()[-1] == "Qwen3MoeForCausalLM 8 [0]"

    run, out = tmp_path / "runs" / "moe", tmp_path / "runs" / "moe" / "hf"
    exported = json.loads((out / "config.json").read_text())
    assert exported["architectures"] == ["Qwen3MoeForCausalLM"] and exported["router_aux_loss_coef"] == 0.005
    ours = load_checkpoint(run)
    assert ours.step == 20 and ours.cfg.moe_experts == 8 and ours.cfg.moe_layers == (1, 2, 3)
    # The directory's router_aux_loss_coef (0.005), not the schema's default (0.01).
    assert ours.cfg.moe_balance == "aux_loss" and ours.cfg.moe_aux_coef == 0.005
    x, _ = TokenWindows(tmp_path / "data" / "moe", "val", ours.cfg.seq_len).batch(99, 0, 2)  # held-out tokens
    prompt = [int(t) for t in x[0, :8]]
    theirs = hf_side(out, x, prompt, 24)
    assert theirs["class"] == "Qwen3MoeForCausalLM"
    with torch.no_grad():
        assert (ours.model(x) - torch.tensor(theirs["logits"])).abs().max().item() <= TOL
    assert our_greedy(ours.model, ours.cfg.seq_len, prompt, 24) == theirs["generated"]
    with torch.no_grad():
        assert (load_hf(model_dir).model(x) - ours.model(x)).abs().max().item() > 1e-2  # it trained


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["ddp", "ep2"])
def test_mixtral_run_exports_sharded_with_the_cli_and_serves_what_transformers_generates(moe_dirs, layout: str,
                                                                                          tmp_path: Path) -> None:
    """A Mixtral directory fine-tuned on 2 ranks (DDP, or expert parallel: each rank holds half the experts) ->
    ``xirang-ckpt export --format hf`` (sharded) -> a fresh transformers process loads MixtralForCausalLM: equal
    logits, greedy tokens equal to our engine's, and a real ``xirang-serve`` of the exported directory answers
    with the text of transformers' greedy tokens."""
    import subprocess

    from test_hf_roundtrip import BIN, ROOT, hf_side

    from xirang_hpc.weights.load import load_checkpoint

    hf_dir = moe_dirs["mixtral"][0]
    r = subprocess.run([str(BIN / "xirang-train"), f"model.init_from={hf_dir}", "model.seq_len=32",
                        "cluster.nodes=1", "cluster.tasks_per_node=2", "parallel.pp=1", "parallel.tp=1",
                        "train.max_steps=3", "train.warmup_steps=1", "train.global_batch=8", "train.eval_batches=1",
                        f"data.corpus={ROOT / 'xirang_hpc'}", "data.val_fraction=0.05", f"data.out_dir={tmp_path}/data",
                        f"train.run_dir={tmp_path}/run", *(["parallel.ep=2"] if layout == "ep2" else [])],
                       cwd=tmp_path, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    trained = json.loads((tmp_path / "run" / "config.json").read_text())["config"]["parallel"]
    assert trained["ep"] == (2 if layout == "ep2" else 1), trained
    out = tmp_path / "exp"
    e = subprocess.run([str(BIN / "xirang-ckpt"), "export", str(tmp_path / "run"), "--format", "hf", "--out", str(out),
                        "--max-shard-mb", "0.05"], capture_output=True, text=True, timeout=600)
    assert e.returncode == 0, e.stderr
    assert len(set(json.loads((out / "model.safetensors.index.json").read_text())["weight_map"].values())) > 1
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["MixtralForCausalLM"] and cfg["num_local_experts"] == 4
    ours = load_checkpoint(tmp_path / "run")
    x = torch.randint(0, VOCAB, (2, 32), generator=torch.Generator().manual_seed(8))
    prompt = [int(t) for t in x[0, :5]]
    theirs = hf_side(out, x, prompt, 12)
    assert theirs["class"] == "MixtralForCausalLM"
    with torch.no_grad():
        assert (ours.model(x) - torch.tensor(theirs["logits"])).abs().max().item() <= TOL
    assert our_greedy(ours.model, ours.cfg.seq_len, prompt, 12) == theirs["generated"]
    assert ours.step == 3 and ours.cfg.moe_experts == 4
    # The served directory (no tokenizer.json: bytes, as the 256-entry vocabulary) over HTTP, greedy.
    import signal

    from test_serve_roundtrip import _post, _start_server

    text = "def "
    want = hf_side(out, x, list(text.encode()), 12)["generated"]
    proc = _start_server(out, tmp_path / "serve.json")
    try:
        served = _post(json.loads((tmp_path / "serve.json").read_text())["url"],
                       {"prompt": text, "max_tokens": 12, "temperature": 0})
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=300)
    assert served["text"] == bytes(want).decode("utf-8", "replace")


@pytest.mark.slow
@pytest.mark.parametrize("name", ["qwen3moe", "mixtral"])
def test_expert_parallel_import_reads_only_this_ranks_experts(moe_dirs, name: str) -> None:
    """``model.init_from`` at ep2 on 2 real gloo ranks: each rank's logits are transformers', and each rank reads
    exactly the elements it holds: the dense tensors and its own half of the experts, never the other half."""
    from test_hf_import import TOKENS as IMPORT_TOKENS
    from test_hf_import import _run

    path, hf = moe_dirs[name]
    n_experts = MODELS[name][2].get("num_experts") or MODELS[name][2]["num_local_experts"]
    with torch.no_grad():
        ref = hf(IMPORT_TOKENS).logits
    res = _run(2, "ep2", path)
    for rank, r in enumerate(res):
        assert (torch.from_numpy(r["logits"]) - ref).abs().max().item() <= TOL
        assert sum(int(torch.tensor(s).prod()) for _, s, _ in r["requests"]) == r["local_numel"]
        experts = {int(n.split(".experts.")[1].split(".")[0]) for n, _, _ in r["requests"] if ".experts." in n}
        half = n_experts // 2
        assert experts == set(range(rank * half, (rank + 1) * half)), (rank, sorted(experts))
