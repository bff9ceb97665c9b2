"""Hugging Face in and out: the "Bring your own model and data" commands of docs/models-and-fine-tuning.md,
run as written.

A small Llama (GQA) with its own BPE tokenizer, built by transformers/tokenizers here, is fine-tuned from
its directory on a JSONL corpus for 50 steps on 4 ranks (dp2 x tp2, real ``xirang-train``), exported with
``xirang-ckpt export --format hf`` and loaded by transformers in a process that cannot import xirang_hpc:
logits on held-out tokens equal ours, and greedy generation from our serving engine equals transformers'
``generate(do_sample=False)`` token for token. GPT-2 (tied, biased, learned positions) goes the same way
through a tensor-parallel run and a sharded bfloat16 export.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
TOL = 1e-4

# Runs in a fresh interpreter that cannot import this package: what a user of the export has.
HF_SIDE = r"""
import json, sys
sys.modules["xirang_hpc"] = None
import torch, transformers
d, req = sys.argv[1], json.loads(sys.argv[2])
model = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
model.generation_config.eos_token_id = None
with torch.no_grad():
    logits = model(torch.tensor(req["tokens"])).logits
    gen = model.generate(torch.tensor([req["prompt"]]), max_new_tokens=req["new"], do_sample=False,
                         pad_token_id=0)[0, len(req["prompt"]):]
out = {"logits": logits.tolist(), "generated": gen.tolist(), "class": type(model).__name__}
if req.get("tokenizer"):
    tok = transformers.AutoTokenizer.from_pretrained(d)
    out["encoded"] = tok(req["tokenizer"]).input_ids
print("RESULT " + json.dumps(out))
"""


def hf_side(d: Path, tokens: torch.Tensor, prompt: list[int], new: int, text: str | None = None) -> dict:
    """transformers' logits, greedy continuation (and tokenization of ``text``) for the directory ``d``."""
    req = json.dumps({"tokens": tokens.tolist(), "prompt": prompt, "new": new, "tokenizer": text})
    r = subprocess.run([sys.executable, "-c", HF_SIDE, str(d), req], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    line = next(x for x in r.stdout.splitlines() if x.startswith("RESULT "))
    return json.loads(line.removeprefix("RESULT "))


def our_greedy(model: torch.nn.Module, seq_len: int, prompt: list[int], new: int) -> list[int]:
    from xirang_hpc.serve.engine import Engine

    engine = Engine(model, seq_len, max_batch=1)
    try:
        return [int(t) for t in engine.generate([prompt], new, temperature=0.0)[0]]
    finally:
        engine.stop()


def doc_block(page: str, heading: str) -> str:
    """The first ```bash block under ``heading`` in the documentation page ``page`` (under docs/)."""
    text = (ROOT / "docs" / page).read_text()
    assert heading in text, f"no heading {heading!r} in docs/{page}"
    section = text.split(heading, 1)[1]
    m = re.search(r"```bash\n(.*?)```", section, flags=re.S)
    assert m, f"no bash block under {heading} in docs/{page}"
    return m.group(1)


DOCS = [f"Document {i}: " + " ".join(f"word{j % 17} val={i * j}" for j in range(30 + i % 50)) for i in range(600)]


def make_model_dir(path: Path) -> None:
    """A Llama-family model directory as users bring it: config, safetensors, tokenizer.json (BPE, </s>)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(DOCS, trainers.BpeTrainer(vocab_size=300, special_tokens=["</s>"], show_progress=False,
                                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>").save_pretrained(path)
    torch.manual_seed(3)
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=320, rope_theta=500000.0,
                                   max_position_embeddings=64, rms_norm_eps=1e-5, bos_token_id=None,
                                   eos_token_id=tok.token_to_id("</s>"))
    transformers.LlamaForCausalLM(cfg).save_pretrained(path, max_shard_size="100KB")


@pytest.mark.slow
def test_docs_fine_tune_with_lora(tmp_path: Path) -> None:
    """The LoRA commands of the page as written: the adapter peft loads and the merged model agree."""
    model_dir, corpus = tmp_path / "my-llama", tmp_path / "corpus.jsonl"
    make_model_dir(model_dir)
    corpus.write_text("".join(json.dumps({"id": i, "text": d}) + "\n" for i, d in enumerate(DOCS)))
    script = doc_block("models-and-fine-tuning.md", "## Fine-tune with LoRA")
    env = {**os.environ, "MODEL": str(model_dir), "CORPUS": str(corpus),
           "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"}
    r = subprocess.run(["bash", "-e", "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=1500)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    assert "step    30/30" in r.stdout and "lora: " in r.stdout
    assert "Document 7:" in r.stdout.splitlines()[-1]  # peft generated through our adapter and tokenizer

    from safetensors.torch import load_file

    run = tmp_path / "runs" / "lora"
    adapter = load_file(run / "adapter" / "adapter_model.safetensors")
    assert adapter and all(".lora_A." in k or ".lora_B." in k for k in adapter)
    assert {k.split(".")[-3] for k in adapter} == {"q_proj", "k_proj", "v_proj", "o_proj"}
    assert json.loads((run / "adapter" / "adapter_config.json").read_text())["r"] == 8
    peft = pytest.importorskip("peft")
    x = torch.randint(0, 300, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        base = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        plain = base(x).logits
        tuned = peft.PeftModel.from_pretrained(base, run / "adapter").eval()(x).logits
        merged = transformers.AutoModelForCausalLM.from_pretrained(run / "merged", dtype=torch.float32)(x).logits
    assert (tuned - plain).abs().max().item() > 1e-3  # the adapters trained
    assert (tuned - merged).abs().max().item() <= TOL


@pytest.mark.slow
def test_docs_preference_tuning_with_dpo(tmp_path: Path) -> None:
    """The DPO commands of the page as written, on string and chat pairs: the run trains its 20 steps and logs
    the reward metrics."""
    model_dir, pairs = tmp_path / "my-llama", tmp_path / "pairs.jsonl"
    make_model_dir(model_dir)
    recs: list[dict[str, object]] = []
    for i in range(60):
        prompt, good, bad = f"Document {i}:", f" word{i % 17} val={i}", f" word{(i + 5) % 17} val={-i}"
        if i % 2:
            recs.append({"prompt": prompt, "chosen": good, "rejected": bad})
        else:
            recs.append({"prompt": [{"role": "user", "content": prompt}],
                         "chosen": [{"role": "assistant", "content": good}],
                         "rejected": [{"role": "assistant", "content": bad}]})
    pairs.write_text("".join(json.dumps(r) + "\n" for r in recs))
    script = doc_block("models-and-fine-tuning.md", "## Preference tuning with DPO")
    env = {**os.environ, "MODEL": str(model_dir), "PAIRS": str(pairs),
           "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"}
    r = subprocess.run(["bash", "-e", "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=1500)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    assert "step    20/20" in r.stdout and "preference pairs: " in r.stdout
    last = json.loads(r.stdout.strip().splitlines()[-1])
    assert last["step"] == 20 and 0.0 <= last["rewards/accuracies"] <= 1.0
    rows = [json.loads(x) for x in (tmp_path / "runs" / "dpo" / "metrics.jsonl").read_text().splitlines()]
    first = next(x for x in rows if "loss" in x)
    assert "rewards/margins" in first


@pytest.mark.slow
def test_docs_bring_your_own_model_and_data(tmp_path: Path) -> None:
    model_dir, corpus = tmp_path / "my-llama", tmp_path / "corpus.jsonl"
    make_model_dir(model_dir)
    assert (model_dir / "model.safetensors.index.json").is_file()
    corpus.write_text("".join(json.dumps({"id": i, "text": d}) + "\n" for i, d in enumerate(DOCS)))
    script = doc_block("models-and-fine-tuning.md", "## Bring your own model and data")
    env = {**os.environ, "MODEL": str(model_dir), "CORPUS": str(corpus),
           "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"}
    r = subprocess.run(["bash", "-e", "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=1500)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    assert "4 ranks on 2 node(s)" in r.stdout and "step    50/50" in r.stdout
    assert f"model.init_from: 21 tensors from {model_dir}" in r.stdout
    assert "Document 7:" in r.stdout.splitlines()[-1]  # transformers decoded the generation with our tokenizer

    from xirang_hpc.data.dataset import TokenWindows
    from xirang_hpc.weights.load import load_checkpoint

    run, out = tmp_path / "runs" / "ft", tmp_path / "runs" / "ft" / "hf"
    assert {"config.json", "tokenizer.json", "tokenizer_config.json"} <= {p.name for p in out.iterdir()}
    ours = load_checkpoint(run)
    assert ours.step == 50 and ours.cfg.n_kv_head == 2 and ours.cfg.vocab_size == 320
    x, _ = TokenWindows(tmp_path / "data" / "ft", "val", ours.cfg.seq_len).batch(99, 0, 2)  # held-out tokens
    prompt = [int(t) for t in x[0, :8]]
    theirs = hf_side(out, x, prompt, 24, text="Document 7: word3")
    assert theirs["class"] == "LlamaForCausalLM"
    with torch.no_grad():
        diff = (ours.model(x) - torch.tensor(theirs["logits"])).abs().max().item()
    assert diff <= TOL
    assert our_greedy(ours.model, ours.cfg.seq_len, prompt, 24) == theirs["generated"]
    assert theirs["encoded"] == [int(t) for t in ours.tokenizer.encode("Document 7: word3")]
    # The fine-tune moved the weights away from the directory's (it trained, it did not just copy).
    from xirang_hpc.weights.load import load_hf

    with torch.no_grad():
        assert (load_hf(model_dir).model(x) - ours.model(x)).abs().max().item() > 1e-2


@pytest.mark.slow
def test_gpt2_tensor_parallel_run_exports_sharded_bfloat16_that_transformers_loads(tmp_path: Path) -> None:
    torch.manual_seed(4)
    hf_dir = tmp_path / "gpt2"
    transformers.GPT2LMHeadModel(transformers.GPT2Config(n_embd=64, n_head=4, n_layer=2, vocab_size=256,
                                                         n_positions=64)).save_pretrained(hf_dir)
    r = subprocess.run([str(BIN / "xirang-train"), f"model.init_from={hf_dir}", "model.seq_len=32",
                        "cluster.nodes=1", "cluster.tasks_per_node=2", "parallel.pp=1", "parallel.tp=2",
                        "train.max_steps=3", "train.warmup_steps=1", "train.global_batch=8", "train.eval_batches=1",
                        f"data.corpus={ROOT / 'xirang_hpc'}", "data.val_fraction=0.05", f"data.out_dir={tmp_path}/data",
                        f"train.run_dir={tmp_path}/run"],
                       cwd=tmp_path, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    shutil.rmtree(hf_dir)  # the trained run no longer needs the directory it started from
    out = tmp_path / "exp"
    e = subprocess.run([str(BIN / "xirang-ckpt"), "export", str(tmp_path / "run"), "--format", "hf", "--out", str(out),
                        "--dtype", "bfloat16", "--max-shard-mb", "0.05"], capture_output=True, text=True, timeout=600)
    assert e.returncode == 0, e.stderr
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["GPT2LMHeadModel"] and cfg["n_positions"] == 32 and cfg["tie_word_embeddings"]

    from safetensors import safe_open

    from xirang_hpc.weights.load import load_checkpoint

    f = next(iter(index["weight_map"].values()))
    with safe_open(str(out / f), framework="pt") as h:
        assert all(h.get_slice(k).get_dtype() == "BF16" for k in h.keys())
    ours = load_checkpoint(tmp_path / "run")
    with torch.no_grad():  # what the bfloat16 export holds, computed in fp32
        for p in ours.model.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    x = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(8))
    theirs = hf_side(out, x, [int(t) for t in x[0, :5]], 12)
    assert theirs["class"] == "GPT2LMHeadModel"
    with torch.no_grad():
        assert (ours.model(x) - torch.tensor(theirs["logits"])).abs().max().item() <= TOL
    assert our_greedy(ours.model, ours.cfg.seq_len, [int(t) for t in x[0, :5]], 12) == theirs["generated"]


def test_export_refuses_models_no_hugging_face_family_expresses() -> None:
    from xirang_hpc.config.schema import ModelConfig
    from xirang_hpc.weights.hf import family_of

    mixed = ModelConfig(name="m", norm="rmsnorm", mlp="gelu", pos="rope", bias=False)
    with pytest.raises(ValueError, match="no Hugging Face family expresses norm=rmsnorm, mlp=gelu.*safetensors"):
        family_of(mixed)
    gqa_gpt2 = ModelConfig(name="g", n_head=4, n_kv_head=2)
    with pytest.raises(ValueError, match="GPT-2 has no grouped-query attention"):
        family_of(gqa_gpt2)
    assert family_of(ModelConfig(name="t")) == "gpt2"
    assert family_of(ModelConfig(name="l", norm="rmsnorm", mlp="swiglu", pos="rope", bias=False)) == "llama"


def test_the_default_preset_exports_as_an_untied_gpt2_that_transformers_loads(tmp_path: Path) -> None:
    """model=tiny (layernorm, gelu, learned positions, biases, untied head) -> GPT-2 layout, same logits."""
    from xirang_hpc.config.schema import ModelConfig
    from xirang_hpc.models.gpt import GPT
    from xirang_hpc.weights.hf import hf_config_for, to_hf_state, write_hf_weights

    cfg = ModelConfig(name="tiny", n_layer=2, n_head=4, d_model=64, d_ff=256, seq_len=64)
    torch.manual_seed(0)
    ours = GPT(cfg).eval()
    hf_state = to_hf_state(ours.state_dict(), cfg)
    assert "lm_head.weight" in hf_state  # untied: the head travels on its own
    write_hf_weights(hf_state, tmp_path, 1 << 30)
    (tmp_path / "config.json").write_text(json.dumps(hf_config_for(cfg, torch.float32)))
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    x = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert (theirs(x).logits - ours(x)).abs().max().item() <= TOL


#: Our model fields for each Llama-like family export (small, GQA, perturbed norms and biases below).
FAMILY_FIELDS = {
    "LlamaForCausalLM": {},
    "llama31": {"rope_theta": 500000.0, "rope_scaling": "llama3", "rope_factor": 8.0, "rope_low_freq_factor": 1.0,
                "rope_high_freq_factor": 4.0, "rope_original_max_pos": 16},
    "llama-linear": {"rope_scaling": "linear", "rope_factor": 4.0},
    "Qwen2ForCausalLM": {"attn_qkv_bias": True, "rope_theta": 1e6},
    "qwen2-tied": {"attn_qkv_bias": True, "tie_embeddings": True},
    "Qwen3ForCausalLM": {"qk_norm": True, "d_head": 32, "rope_theta": 1e6},
    "qwen3-tied": {"qk_norm": True, "d_head": 32, "tie_embeddings": True},
}
EXPECTED_CLASS = {"llama31": "LlamaForCausalLM", "llama-linear": "LlamaForCausalLM", "qwen2-tied": "Qwen2ForCausalLM",
                  "qwen3-tied": "Qwen3ForCausalLM"}


@pytest.mark.parametrize("family", list(FAMILY_FIELDS))
def test_llama_like_models_export_as_their_family_with_equal_logits_and_greedy_text(tmp_path: Path,
                                                                                   family: str) -> None:
    """Our model -> config.json + safetensors -> transformers loads the right class; logits and greedy equal."""
    from xirang_hpc.config.schema import ModelConfig
    from xirang_hpc.models.gpt import GPT
    from xirang_hpc.weights.hf import hf_config_for, to_hf_state, write_hf_weights
    from xirang_hpc.weights.load import load_hf

    cfg = ModelConfig(name="m", n_layer=2, n_head=4, n_kv_head=2, d_model=64, d_ff=96, vocab_size=256, seq_len=64,
                      norm="rmsnorm", mlp="swiglu", pos="rope", bias=False, **FAMILY_FIELDS[family])
    torch.manual_seed(0)
    ours = GPT(cfg).eval()
    with torch.no_grad():  # norms start at one and biases at zero: perturb them so their layout is tested
        for p in ours.parameters():
            if p.dim() == 1:
                p.add_(0.3 * torch.randn_like(p))
    write_hf_weights(to_hf_state(ours.state_dict(), cfg), tmp_path, 1 << 30)
    (tmp_path / "config.json").write_text(json.dumps(hf_config_for(cfg, torch.float32)))
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    assert type(theirs).__name__ == EXPECTED_CLASS.get(family, family)
    x = torch.randint(0, 256, (2, 48), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert (theirs(x).logits - ours(x)).abs().max().item() <= TOL
    prompt = [int(t) for t in x[0, :6]]
    theirs.generation_config.eos_token_id = None
    gen = theirs.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False, pad_token_id=0)
    assert our_greedy(ours, cfg.seq_len, prompt, 16) == gen[0, len(prompt):].tolist()
    # And back in: the exported directory imports as the same model.
    back = load_hf(tmp_path)
    for k in FAMILY_FIELDS[family]:
        assert getattr(back.cfg, k) == getattr(cfg, k), k
    with torch.no_grad():
        assert (back.model(x) - ours(x)).abs().max().item() <= TOL


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_qwen_tensor_parallel_run_exports_with_the_cli_as_its_class(tmp_path: Path, family: str) -> None:
    """A Qwen directory fine-tuned on 2 ranks (tp2) -> ``xirang-ckpt export --format hf`` -> a fresh transformers
    process loads the right class: equal logits and greedy tokens equal to our serving engine's."""
    torch.manual_seed(6)
    hf_dir = tmp_path / family
    common = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=256, max_position_embeddings=64, rms_norm_eps=1e-5,
                  bos_token_id=None, eos_token_id=None)
    if family == "qwen2":
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**common))
    else:
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(head_dim=32, **common))
    model.save_pretrained(hf_dir)
    r = subprocess.run([str(BIN / "xirang-train"), f"model.init_from={hf_dir}", "model.seq_len=32",
                        "cluster.nodes=1", "cluster.tasks_per_node=2", "parallel.pp=1", "parallel.tp=2",
                        "train.max_steps=3", "train.warmup_steps=1", "train.global_batch=8", "train.eval_batches=1",
                        f"data.corpus={ROOT / 'xirang_hpc'}", "data.val_fraction=0.05", f"data.out_dir={tmp_path}/data",
                        f"train.run_dir={tmp_path}/run"],
                       cwd=tmp_path, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    out = tmp_path / "exp"
    e = subprocess.run([str(BIN / "xirang-ckpt"), "export", str(tmp_path / "run"), "--format", "hf", "--out", str(out)],
                       capture_output=True, text=True, timeout=600)
    assert e.returncode == 0, e.stderr
    cfg = json.loads((out / "config.json").read_text())
    want = {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}[family]
    assert cfg["architectures"] == [want]

    from xirang_hpc.weights.load import load_checkpoint

    ours = load_checkpoint(tmp_path / "run")
    assert ours.cfg.attn_qkv_bias == (family == "qwen2") and ours.cfg.qk_norm == (family == "qwen3")
    x = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(8))
    prompt = [int(t) for t in x[0, :5]]
    theirs = hf_side(out, x, prompt, 12)
    assert theirs["class"] == want
    with torch.no_grad():
        assert (ours.model(x) - torch.tensor(theirs["logits"])).abs().max().item() <= TOL
    assert our_greedy(ours.model, ours.cfg.seq_len, prompt, 12) == theirs["generated"]
