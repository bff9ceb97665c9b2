"""A LoRA fine-tune through the real job function: base from a Hugging Face directory, adapters only in the
checkpoints, an exact resume, and exports that peft and transformers load with our logits.

A small Llama (the tiny preset's shapes, byte vocabulary) is built with transformers and ``save_pretrained``
(nothing downloaded).
20 steps uninterrupted vs 10 + resume + 10 on 2 gloo ranks (dp2): the saved adapters and their optimizer
state are bitwise equal, and the checkpoint holds nothing of the frozen base.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_checkpoint_resume import _losses, make_cfg, run_job, saved_tensors

from xirang_hpc.checkpoint import layout as ckpt_layout

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
BIN = Path(sys.executable).parent
LORA = ["finetune.method=lora", "finetune.lora.rank=4", "finetune.lora.alpha=8",
        "finetune.lora.target_modules=[q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj]",
        "train.lr=1e-2", "cluster.nodes=1", "cluster.tasks_per_node=2", "parallel.tp=1", "parallel.pp=1",
        "parallel.microbatches=1"]


def make_llama(path: Path) -> None:
    torch.manual_seed(5)
    # The shapes of the tiny preset the job composes (a directory's shapes must agree with the preset's).
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
                                   num_key_value_heads=4, vocab_size=256, max_position_embeddings=64,
                                   rms_norm_eps=1e-5, bos_token_id=None, eos_token_id=None)
    transformers.LlamaForCausalLM(cfg).save_pretrained(path)


@pytest.mark.slow
def test_lora_run_resumes_exactly_and_exports_for_peft_and_transformers(tmp_path: Path, stdlib_data: Path) -> None:
    base = tmp_path / "base"
    make_llama(base)
    extra = [*LORA, "model.norm=rmsnorm", "model.mlp=swiglu", "model.pos=rope", "model.bias=false",
             f"model.init_from={base}"]
    full, split = tmp_path / "full", tmp_path / "split"
    run_job(make_cfg(stdlib_data, full, extra), full, stdlib_data, world=2)
    run_job(make_cfg(stdlib_data, split, extra), split, stdlib_data, world=2, stop_at=10)
    assert ckpt_layout.committed_steps(split / "checkpoints") == [10]
    run_job(make_cfg(stdlib_data, split, extra), split, stdlib_data, world=2)
    a, b = saved_tensors(full / "checkpoints" / "step_20"), saved_tensors(split / "checkpoints" / "step_20")
    models = [k for k in a if k.startswith("model.")]
    assert models and all(k.endswith((".lora_A.weight", ".lora_B.weight")) for k in models)
    assert len(models) == 4 * 7 * 2  # 4 blocks x 7 linears x (A, B): no base weight saved
    assert any(k.startswith("optim.state.") and "lora_B" in k for k in a)
    assert not any(k.startswith("optim.") and "lora" not in k for k in a if "state" in k)
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), f"{k} differs after resume"
    assert _losses(full) == _losses(split)
    assert all(a[k].abs().sum() > 0 for k in models if "lora_B" in k)  # B trained away from zero

    from xirang_hpc.models.lora import apply_lora
    from xirang_hpc.weights.load import load_hf

    ckpt = subprocess.run([str(BIN / "xirang-ckpt"), "export", str(full), "--format", "peft", "--out",
                           str(tmp_path / "adapter")], capture_output=True, text=True)
    assert ckpt.returncode == 0, ckpt.stderr
    merged = subprocess.run([str(BIN / "xirang-ckpt"), "export", str(full), "--format", "hf", "--merge", "--out",
                             str(tmp_path / "merged")], capture_output=True, text=True)
    assert merged.returncode == 0, merged.stderr
    refused = subprocess.run([str(BIN / "xirang-ckpt"), "export", str(full), "--format", "hf", "--out",
                              str(tmp_path / "x")], capture_output=True, text=True)
    assert refused.returncode != 0 and "--format peft" in refused.stdout + refused.stderr

    ours = load_hf(base).model
    from xirang_hpc.config.schema import LoraConfig

    apply_lora(ours, LoraConfig(rank=4, alpha=8.0, target_modules=["q_proj", "k_proj", "v_proj", "o_proj",
                                                                   "gate_proj", "up_proj", "down_proj"]))
    ours.load_state_dict({k.removeprefix("model."): v for k, v in a.items() if k in models}, strict=False)
    x = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    hf_base = transformers.LlamaForCausalLM.from_pretrained(base, dtype=torch.float32)
    with torch.no_grad():
        mine = ours.eval()(x)
        plain = hf_base(x).logits
        theirs = peft.PeftModel.from_pretrained(hf_base, tmp_path / "adapter").eval()(x).logits
        whole = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32)(x).logits
    assert (mine - plain).abs().max().item() > 1e-3
    assert (mine - theirs).abs().max().item() <= 1e-4
    assert (mine - whole).abs().max().item() <= 1e-4
    # xirang-serve RUN and the eval stage load the run merged into its base (no adapter left to wrap).
    from xirang_hpc.weights.load import load_checkpoint

    loaded = load_checkpoint(full)
    assert loaded.step == 20 and not any("lora" in k for k in loaded.model.state_dict())
    with torch.no_grad():
        assert (loaded.model(x) - mine).abs().max().item() <= 1e-4


@pytest.mark.slow
def test_a_run_from_a_peft_adapter_starts_where_the_merged_model_starts(tmp_path: Path, stdlib_data: Path) -> None:
    """``model.init_from=<PEFT adapter dir>`` on 2 ranks: the first step's loss (the starting weights on the
    first batch) equals a full fine-tune's from the same adapter merged by peft, and differs from the bare
    base's; the run continues the adapter (adapters only in its checkpoint)."""
    base_dir, adapter, merged = tmp_path / "base", tmp_path / "adapter", tmp_path / "merged"
    make_llama(base_dir)
    torch.manual_seed(11)
    base = transformers.LlamaForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    cfg = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "up_proj"], init_lora_weights=False)
    tuned = peft.get_peft_model(base, cfg)
    tuned.save_pretrained(adapter)
    tuned.merge_and_unload().save_pretrained(merged)
    shape = ["model.norm=rmsnorm", "model.mlp=swiglu", "model.pos=rope", "model.bias=false", "cluster.nodes=1",
             "cluster.tasks_per_node=2", "train.max_steps=2", "train.log_every=1", "checkpoint.every_steps=2"]
    first = {}
    for name, extra in (("adapter", [f"model.init_from={adapter}", "finetune.method=lora"]),
                        ("merged", [f"model.init_from={merged}"]),
                        ("base", [f"model.init_from={base_dir}", "finetune.method=lora"])):
        run = tmp_path / f"run-{name}"
        job = make_cfg(stdlib_data, run, [*shape, *extra])
        if name == "adapter":
            assert job["finetune"]["lora"]["rank"] == 4 and job["finetune"]["lora"]["alpha"] == 8.0
        run_job(job, run, stdlib_data, world=2)
        first[name] = _losses(run)[1]
    assert abs(first["adapter"] - first["merged"]) <= 1e-5, first
    assert abs(first["adapter"] - first["base"]) > 1e-3, first
    saved = saved_tensors(tmp_path / "run-adapter" / "checkpoints" / "step_2")
    models = [k for k in saved if k.startswith("model.")]
    assert len(models) == 4 * 3 * 2 and all(".lora_" in k for k in models)
