"""xirang-pipeline with a preference stage: prepare (chat) -> train (SFT) -> export -> dpo -> eval (harness) -> serve.

A tiny Llama directory with its own BPE tokenizer and chat template is fine-tuned on conversations (LoRA or full),
its result exported as a Hugging Face directory (the LoRA adapters merged into the base), preference-tuned with DPO
from there, evaluated with lm-evaluation-harness and served (the DPO adapter over the exported model), all on the
local executor with real stages; the same chain on Slurm is six dependent jobs (a fake ``sbatch`` records them).
A chain whose stages disagree is refused before anything runs, naming the fields.
"""

from __future__ import annotations

import json
import math
import os
import random
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import torch
from conftest import compose_cfg, fake_slurm_bin
from omegaconf import OmegaConf

from xirang_hpc.config.errors import ConfigError
from xirang_hpc.config.schema import XirangConfig
from xirang_hpc.config.validate import load_config
from xirang_hpc.runs.chain import DPO_ADAPTER, DPO_RUN, PREFERENCE_STAGES, SFT_MODEL
from xirang_hpc.submit.preference import preference_config

transformers = pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
WORDS = "the cat sat on a mat while dogs ran far away from home and never came back".split()


def make_chat_model(path: Path) -> Path:
    """A Llama directory as users bring it, with a BPE tokenizer.json and a chat template (ChatML)."""
    from transformers import PreTrainedTokenizerFast

    from xirang_hpc.data.chat import DEFAULT_CHAT_TEMPLATE
    from xirang_hpc.data.prepare import train_bpe

    rng = random.Random(1)
    texts = [" ".join(rng.choices(WORDS, k=30)) for _ in range(200)] + ["<|im_start|>user\n<|im_end|>\n"] * 5
    fast = PreTrainedTokenizerFast(tokenizer_object=train_bpe(iter(texts), 300), eos_token="<|endoftext|>",
                                   pad_token="<|endoftext|>", chat_template=DEFAULT_CHAT_TEMPLATE)
    fast.save_pretrained(path)
    torch.manual_seed(3)
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=320, max_position_embeddings=128,
                                   rms_norm_eps=1e-5, bos_token_id=None, eos_token_id=fast.eos_token_id)
    transformers.LlamaForCausalLM(cfg).save_pretrained(path)
    return path


def write_corpora(root: Path) -> tuple[Path, Path]:
    """Conversations (``messages``) for the fine-tune and preference pairs (string and chat) for DPO."""
    rng = random.Random(0)
    chats, pairs = root / "chats.jsonl", root / "pairs.jsonl"
    with chats.open("w") as f:
        for _ in range(160):
            q = " ".join(rng.choices(WORDS, k=rng.randint(2, 6)))
            f.write(json.dumps({"messages": [{"role": "user", "content": q},
                                             {"role": "assistant", "content": q.split()[0] + " " + q}]}) + "\n")
    with pairs.open("w") as f:
        for i in range(80):
            q = " ".join(rng.choices(WORDS, k=rng.randint(2, 5)))
            good, bad = " " + q.split()[0] + " " + q, " " + " ".join(rng.choices(WORDS, k=4))
            if i % 2:
                f.write(json.dumps({"prompt": q, "chosen": good, "rejected": bad}) + "\n")
            else:
                f.write(json.dumps({"prompt": [{"role": "user", "content": q}],
                                    "chosen": [{"role": "assistant", "content": good}],
                                    "rejected": [{"role": "assistant", "content": bad}]}) + "\n")
    return chats, pairs


@pytest.fixture(scope="module")
def chain_inputs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    """(model directory, chat corpus, pairs corpus), made once for the module."""
    root = tmp_path_factory.mktemp("chain-inputs")
    return (make_chat_model(root / "my-llama"), *write_corpora(root))


def chain_overrides(tmp: Path, model: Path, chats: Path, pairs: Path) -> list[str]:
    """The chain on one local rank: the fine-tune, then DPO, on the same model and layout."""
    return [f"model.init_from={model}", "model.seq_len=96", f"data.tokenizer={model}", "data.format=chat",
            f"data.corpus={chats}", f"data.out_dir={tmp}/data/chat", "data.packing=true",
            f"preference.corpus={pairs}", f"preference.out_dir={tmp}/data/pairs", "cluster.nodes=1",
            "cluster.tasks_per_node=1", "parallel.pp=1", "parallel.microbatches=1", "train.global_batch=8",
            "train.max_steps=8", "train.warmup_steps=2", "train.log_every=1", "train.lr=3e-3",
            f"train.runs_root={tmp}/runs"]


def load_as_cli(argv: list[str]) -> XirangConfig:
    """The config as the command line composes it (the overrides known, so the model shape comes from init_from)."""
    d = compose_cfg(argv)
    OmegaConf.set_struct(d, False)
    d["hydra"] = {"overrides": {"task": list(argv)}}
    return load_config(d)


# ---- refusals: a chain whose stages disagree --------------------------------------------------------------
def _pref(tmp: Path, inputs: tuple[Path, Path, Path], *extra: str) -> None:
    model, chats, pairs = inputs
    cfg = load_as_cli([*chain_overrides(tmp, model, chats, pairs), *extra])
    preference_config(cfg, tmp / "runs" / "r")


@pytest.mark.parametrize(("extra", "field", "says"), [
    (["finetune.method=dpo", "data.format=pairs", "data.packing=false"], "finetune.method/data.format",
     "supervised fine-tune before DPO"),
    (["preference.out_dir=DATA"], "preference.out_dir", "same directory as data.out_dir"),
    (["parallel.tp=2", "cluster.tasks_per_node=2"], "parallel.tp", "finetune.method=dpo runs on one process"),
    (["train.warmup_steps=6", "preference.steps=4"], "train.warmup_steps", "the DPO run takes"),
])
def test_a_chain_whose_stages_disagree_is_refused_naming_the_fields(tmp_path: Path,
                                                                    chain_inputs: tuple[Path, Path, Path],
                                                                    extra: list[str], field: str, says: str) -> None:
    extra = [e.replace("DATA", f"{tmp_path}/data/chat") for e in extra]
    with pytest.raises(ConfigError) as err:
        _pref(tmp_path, chain_inputs, *extra)
    assert err.value.field == field, err.value
    assert says in str(err.value) and "preference (DPO) stage" in str(err.value)


def test_a_preference_stage_without_pairs_is_refused(tmp_path: Path, chain_inputs: tuple[Path, Path, Path]) -> None:
    model, chats, _ = chain_inputs
    with pytest.raises(ConfigError) as err:  # the chat data where the pairs belong
        _pref(tmp_path, chain_inputs, f"preference.corpus={chats}")
    assert err.value.field == "preference.corpus"
    assert f"{chats}:1 is a chat conversation (messages), not a preference pair" in str(err.value)
    assert "lacks prompt, chosen, rejected" in str(err.value)
    with pytest.raises(ConfigError, match="no such file or directory"):
        _pref(tmp_path, chain_inputs, f"preference.corpus={tmp_path}/missing.jsonl")
    with pytest.raises(ConfigError) as err:  # DPO settings, no pairs at all
        load_config(compose_cfg(["preference.beta=0.3"]))
    assert err.value.field == "preference.corpus" and "needs pairs data" in str(err.value)
    with pytest.raises(ConfigError) as err:  # no Hugging Face model to hand over and serve the adapter on
        cfg = load_config(compose_cfg([f"preference.corpus={chain_inputs[2]}", f"preference.out_dir={tmp_path}/p"]))
        preference_config(cfg, tmp_path / "run")
    assert err.value.field == "model.init_from"


def test_the_pipeline_refuses_before_any_stage_runs(tmp_path: Path, chain_inputs: tuple[Path, Path, Path]) -> None:
    model, chats, pairs = chain_inputs
    argv = [*chain_overrides(tmp_path, model, chats, pairs), f"preference.corpus={chats}"]
    r = subprocess.run([str(BIN / "xirang-pipeline"), *argv], cwd=tmp_path, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "xirang-pipeline: error: invalid config preference.corpus=" in r.stderr
    assert "not a preference pair" in r.stderr
    assert not (tmp_path / "runs").exists() and not (tmp_path / "data").exists()  # nothing written


# ---- the chain on Slurm: six dependent jobs ---------------------------------------------------------------
FAKE_SBATCH = r'''#!{python}
"""Fake Slurm client: sbatch answers increasing job ids and logs the batch script; the rest answers like Slurm."""
import json, os, sys
name, args = os.path.basename(sys.argv[0]), sys.argv[1:]
log = os.environ["FAKE_SLURM_LOG"]
entry = {{"cmd": name, "args": args}}
if name == "sbatch":
    entry["script"] = open(args[-1]).read()
    n = sum(1 for line in open(log) if '"cmd": "sbatch"' in line)
    print(f"Submitted batch job {{5000 + n}}")
elif name == "scontrol" and args[:2] == ["show", "job"]:
    print("JobId=5000 JobState=PENDING ExcNodeList=(null)")
with open(log, "a") as f:
    f.write(json.dumps(entry) + "\n")
'''


@pytest.fixture
def fake_sbatch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    return fake_slurm_bin(tmp_path, monkeypatch, FAKE_SBATCH)


def test_on_slurm_the_chain_is_six_dependent_jobs(fake_sbatch: Path, tmp_path: Path,
                                                  chain_inputs: tuple[Path, Path, Path]) -> None:
    from xirang_hpc.cli.pipeline import launch_slurm_chain
    from xirang_hpc.runs.chain import chain_status, format_chain
    from xirang_hpc.submit.preflight import open_run_dir

    model, chats, pairs = chain_inputs
    cfg = load_as_cli(["cluster=testbed", *chain_overrides(tmp_path, model, chats, pairs), "cluster.tasks_per_node=2",
                       "preference.lora=true", "finetune.method=lora"])
    run = open_run_dir(cfg)
    pref = preference_config(cfg, run)
    stages = launch_slurm_chain(cfg, run, None, pref)

    assert [s["stage"] for s in stages] == list(PREFERENCE_STAGES)
    ids = [s["job_id"] for s in stages]
    assert ids == [str(5000 + i) for i in range(6)]
    assert [s["depends_on"] for s in stages] == [None, *ids[:5]]
    scripts = [c["script"] for c in [json.loads(x) for x in fake_sbatch.read_text().splitlines()]
               if c["cmd"] == "sbatch"]
    assert len(scripts) == 6
    for i, script in enumerate(scripts[1:], 1):  # each after the previous one, cancelled when it fails
        assert f"#SBATCH --dependency=afterok:{ids[i - 1]}" in script and "#SBATCH --kill-on-invalid-dep=yes" in script
    names = [next(x for x in s.splitlines() if x.startswith("#SBATCH --job-name=")) for s in scripts]
    assert [n.rsplit("-", 1)[1] for n in names] == list(PREFERENCE_STAGES)
    # The two training jobs are full training jobs (every rank, the requeue supervisor), in their own run dirs.
    dpo_run = run / DPO_RUN
    for script in (scripts[1], scripts[3]):
        assert "#SBATCH --ntasks-per-node=2" in script and "xirang_hpc.batch.supervise" in script
    assert str(dpo_run / "submitit") in scripts[3]
    pickled = list((dpo_run / "submitit").glob("*_submitted.pkl"))
    assert len(pickled) == 1 and b"dpo_stage" in pickled[0].read_bytes()
    job = json.loads((dpo_run / "slurm_job.json").read_text())
    assert job["nodes"] == cfg.cluster.nodes
    ident = json.loads((dpo_run / "identity.json").read_text())
    assert ident["model"]["init_from"] == str(run / SFT_MODEL) and ident["finetune"]["method"] == "dpo"
    assert ident["data"]["format"] == "pairs" and ident["finetune"]["dpo"]["lora"] is True
    chain = chain_status(run, slurm_state=lambda job: "PENDING")
    assert [r["stage"] for r in chain["stages"]] == list(PREFERENCE_STAGES) and chain["status"] == "pending"
    assert f"dpo      pending    job {ids[3]} after {ids[2]}" in format_chain(chain)


# ---- the whole chain on the local executor ----------------------------------------------------------------
def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:  # noqa: S310 - the test's own server on 127.0.0.1
        return json.loads(r.read())


@pytest.mark.slow
@pytest.mark.parametrize("method", ["lora", "full"])
def test_the_local_chain_fine_tunes_prefers_evaluates_and_serves(tmp_path: Path,
                                                                 chain_inputs: tuple[Path, Path, Path],
                                                                 method: str) -> None:
    from xirang_hpc.checkpoint import layout as ckpt_layout
    from xirang_hpc.weights.load import find_step_dir, load_checkpoint, load_hf

    model, chats, pairs = chain_inputs
    lora = method == "lora"
    argv = [*chain_overrides(tmp_path, model, chats, pairs), f"finetune.method={method}",
            f"preference.lora={str(lora).lower()}", "preference.beta=0.5", "preference.steps=6",
            "preference.lr=1e-2", "'eval.harness_tasks=[xirang_heldout_mc]'", "eval.harness_limit=8",
            "eval.batches=2", "serve.port=0", "serve.duration_s=45"]
    env = {**os.environ, "XIRANG_SERVE_TOKEN": ""}
    proc = subprocess.Popen(" ".join([str(BIN / "xirang-pipeline"), *argv]), shell=True, cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    reply, models, info = None, None, None
    deadline = time.monotonic() + 1500
    while proc.poll() is None and time.monotonic() < deadline:
        runs = list((tmp_path / "runs").glob("*/serve.json")) if (tmp_path / "runs").exists() else []
        info = json.loads(runs[0].read_text()) if runs else None
        if info and info.get("status") == "serving" and reply is None:
            served = DPO_ADAPTER if lora else info["model"]
            with urllib.request.urlopen(info["url"] + "/v1/models", timeout=60) as r:  # noqa: S310
                models = [m["id"] for m in json.loads(r.read())["data"]]
            reply = _post(info["url"] + "/v1/chat/completions",
                          {"model": served, "max_tokens": 8, "temperature": 0,
                           "messages": [{"role": "user", "content": "the cat sat"}]})
        time.sleep(1)
    out = proc.communicate(timeout=300)[0]
    assert proc.returncode == 0, out[-6000:]
    (run,) = (tmp_path / "runs").iterdir()
    assert f"pipeline {run} (local): completed" in out

    # The chain and its records.
    pipe = json.loads((run / "pipeline.json").read_text())
    assert [s["stage"] for s in pipe["stages"]] == list(PREFERENCE_STAGES)
    for s in PREFERENCE_STAGES:
        assert json.loads((run / "pipeline" / f"{s}.json").read_text())["status"] == "completed", s
    # SFT: the fine-tune's checkpoint (adapters only for LoRA).
    sft_step = find_step_dir(run)
    assert sft_step.name == "step_8"
    sft_state = ckpt_layout.read_state(sft_step)
    assert sft_state["config"]["finetune"]["method"] == method and sft_state["config"]["data"]["format"] == "chat"
    # Export: the fine-tuned model as a Hugging Face directory, LoRA merged into the base; it moved from the base.
    exported = run / SFT_MODEL
    rec = json.loads((exported / "xirang_export.json").read_text())
    assert rec["source"] == str(sft_step) and rec["merged_lora"] is lora
    base, sft = load_hf(model).model.state_dict(), load_hf(exported).model.state_dict()
    assert base.keys() == sft.keys()
    moved = [k for k in base if not torch.equal(base[k], sft[k])]
    assert moved and (not lora or all(k.endswith(("attn.q.weight", "attn.v.weight")) for k in moved)), moved
    # DPO: its own run, started from the exported SFT model, which is also its reference (loss log 2 at step 1).
    dpo_run = run / DPO_RUN
    dpo_step = find_step_dir(dpo_run)
    dpo_state = ckpt_layout.read_state(dpo_step)
    assert dpo_step.name == "step_6"
    assert dpo_state["config"]["model"]["init_from"] == str(exported)
    assert dpo_state["config"]["finetune"]["method"] == "dpo" and dpo_state["config"]["data"]["format"] == "pairs"
    assert dpo_state["config"]["finetune"]["dpo"] == {"beta": 0.5, "loss": "sigmoid", "lora": lora}
    rows = [json.loads(x) for x in (dpo_run / "metrics.jsonl").read_text().splitlines() if x.strip()]
    first = next(r for r in rows if "loss" in r and r.get("step") == 1)
    assert first["loss"] == pytest.approx(math.log(2), abs=1e-5) and "rewards/margins" in first
    final = load_checkpoint(dpo_run).model.state_dict()
    changed = [k for k in sft if not torch.equal(sft[k], final[k])]
    assert changed, "DPO changed nothing"
    if lora:  # fresh adapters on the SFT model: only their targets moved from it
        assert all(k.endswith(("attn.q.weight", "attn.v.weight")) for k in changed), changed
    # Eval: the DPO model, lm-evaluation-harness included, recorded in the DPO run and shown by the chain.
    ev = json.loads((dpo_run / "eval.json").read_text())
    assert ev["step"] == 6 and ev["passed"] is True
    acc = ev["harness"]["metrics"]["xirang_heldout_mc"]["acc"]
    assert 0.0 <= acc <= 1.0 and (dpo_run / "harness.json").is_file()
    status = subprocess.run([str(BIN / "xirang-pipeline"), "--status", str(run)], capture_output=True, text=True)
    assert status.returncode == 0 and f"val loss {ev['val_loss']:.4f}" in status.stdout
    assert "harness xirang_heldout_mc acc" in status.stdout
    view = subprocess.run([str(BIN / "xirang-status"), str(run)], capture_output=True, text=True).stdout
    assert f"eval      val loss {ev['val_loss']:.4f}, perplexity {ev['perplexity']:.2f} @ step 6" in view, view
    assert f"| of {dpo_run}" in view and "harness   xirang_heldout_mc acc" in view
    assert ("pipeline  completed: " + " -> ".join(f"{s} completed" for s in PREFERENCE_STAGES)) in view
    # Serve: the final model answered a chat request (the DPO adapter over the exported model, for LoRA).
    assert reply is not None, out[-4000:]
    assert isinstance(reply["choices"][0]["message"]["content"], str) and reply["usage"]["completion_tokens"] > 0
    assert info is not None
    if lora:
        assert models is not None and DPO_ADAPTER in models and info["adapters"] == [DPO_ADAPTER]
        assert info["source"] == str(exported)
        assert json.loads((dpo_run / "adapter" / "adapter_config.json").read_text())["base_model_name_or_path"] \
            == str(exported)
    else:
        assert info["source"].startswith(str(dpo_run))
    served = json.loads((run / "serve.json").read_text())
    assert served["status"] == "stopped"
    if not lora:
        return
    # Again: nothing is trained or exported twice; eval and serve run on what is there.
    again = subprocess.run(" ".join([str(BIN / "xirang-pipeline"), *argv, "serve.duration_s=1"]), shell=True,
                           cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert again.returncode == 0, again.stdout[-4000:] + again.stderr[-3000:]
    assert f"run {run} is complete: its last checkpoint is step 8 of 8" in again.stdout
    assert f"run {dpo_run} is complete: its last checkpoint is step 6 of 6" in again.stdout
    assert "(kept: already exported)" in again.stdout and "| loss" not in again.stdout
    assert f"pipeline {run} (local): completed" in again.stdout
    assert json.loads((exported / "xirang_export.json").read_text()) == rec


@pytest.mark.slow
def test_docs_fine_tuning_chain(tmp_path: Path, chain_inputs: tuple[Path, Path, Path]) -> None:
    """The chain on the fine-tuning page, as written (two ranks): the adapter answers, the chain completes."""
    from test_hf_roundtrip import doc_block

    model, chats, pairs = chain_inputs
    script = doc_block("models-and-fine-tuning.md", "## The fine-tuning chain in one pipeline")
    env = {k: v for k, v in os.environ.items() if k != "XIRANG_SERVE_TOKEN"}
    env.update(MODEL=str(model), CHATS=str(chats), PAIRS=str(pairs), PATH=f"{BIN}{os.pathsep}{os.environ['PATH']}")
    r = subprocess.run(["bash", "-e", "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=2400)
    assert r.returncode == 0, r.stdout[-5000:] + r.stderr[-3000:]
    out = r.stdout
    models = next(x for x in out.splitlines() if x.startswith("models: "))
    assert "'dpo'" in models and "'hf-sft-model'" in models, models  # the adapter, and the base's own id
    assert any(x.startswith("reply: ") for x in out.splitlines())
    run = tmp_path / "runs" / "chain"
    assert out.splitlines()[-7] == "pipeline runs/chain (local): completed"  # --status, as the page runs it
    assert "step    20/20" in out and "step    10/10" in out  # the fine-tune, then DPO
    for stage in PREFERENCE_STAGES:
        assert any(x.startswith(f"  {stage:<8} completed") for x in out.splitlines()[-6:]), stage
    assert "harness xirang_heldout_mc acc" in out
    assert json.loads((run / "dpo" / "adapter" / "adapter_config.json").read_text())["base_model_name_or_path"] \
        == str(run / SFT_MODEL)
