"""Preference tuning (finetune.method=dpo on data.format=pairs): the loss and rewards against TRL's DPOTrainer,
the pairs' tokens and completion masks against TRL's tokenization, bad records, overlong pairs, the layouts
refused, the reference (a frozen start, or the base with the adapters disabled) and training on one process.

TRL's reference: a ``trl.DPOTrainer`` built on a tiny Llama (transformers' config class, ``save_pretrained``)
and a tiny BPE wrapped in ``PreTrainedTokenizerFast``; its own collated batch and its own loss computation
(``DPOTrainer._compute_loss``: policy and reference forwards, summed completion log-probs, sigmoid loss,
reward metrics). Nothing is downloaded.
"""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch

from xirang_hpc.config.errors import ConfigError
from xirang_hpc.config.schema import DataConfig, FinetuneConfig
from xirang_hpc.config.schema.finetune import DpoConfig
from xirang_hpc.data.chat import DEFAULT_CHAT_TEMPLATE, ChatRenderer
from xirang_hpc.data.dataset import IGNORE_INDEX, PairSamples
from xirang_hpc.data.pairs import PairEncoder, PairRecord
from xirang_hpc.data.prepare import CorpusError, prepare, train_bpe
from xirang_hpc.data.tokenizer import load_tokenizer
from xirang_hpc.models.dpo import completion_logps, dpo_terms

WORDS = "the cat sat on a mat while dogs ran far away from home and never came back".split()
DPO = FinetuneConfig(method="dpo")
PAIRS = DataConfig(format="pairs")


def random_pairs(n: int, seed: int) -> list[dict[str, str]]:
    """String pairs: a prompt, and two different replies (leading space: words stay words for the BPE)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        chosen = " " + " ".join(rng.choices(WORDS, k=rng.randint(1, 5)))
        rejected = chosen + " " + rng.choice(WORDS)
        out.append({"prompt": " ".join(rng.choices(WORDS, k=rng.randint(2, 6))), "chosen": chosen,
                    "rejected": rejected})
    return out


def write_pairs(path: Path, records: list[dict]) -> Path:
    """One JSON record per line."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


@pytest.fixture(scope="module")
def hf_tok(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny BPE in transformers' PreTrainedTokenizerFast (eos = pad = <|endoftext|>), with the default template."""
    from transformers import PreTrainedTokenizerFast

    rng = random.Random(1)
    texts = [" ".join(rng.choices(WORDS, k=30)) for _ in range(200)] + ["<|im_start|>user\n<|im_end|>\n"] * 5
    out = tmp_path_factory.mktemp("dpo-tok")
    fast = PreTrainedTokenizerFast(tokenizer_object=train_bpe(iter(texts), 300), eos_token="<|endoftext|>",
                                   pad_token="<|endoftext|>", chat_template=DEFAULT_CHAT_TEMPLATE)
    fast.save_pretrained(out)
    return out


def _llama_pair(root: Path, vocab: int) -> tuple[Path, Path]:
    """A tiny Llama (the reference) and a perturbed copy of it (the policy), saved as HF directories."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=4, vocab_size=vocab, max_position_embeddings=128,
                                   rms_norm_eps=1e-5, bos_token_id=None, eos_token_id=0, pad_token_id=0)
    ref = transformers.LlamaForCausalLM(cfg)
    ref.save_pretrained(root / "ref")
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(0.2 * torch.randn_like(p))
    ref.save_pretrained(root / "policy")
    return root / "policy", root / "ref"


def _trl_trainer(tmp: Path, policy: Path, ref: Path, tok_dir: Path, pairs: list[dict], beta: float):
    trl = pytest.importorskip("trl")
    datasets = pytest.importorskip("datasets")
    from transformers import AutoTokenizer, LlamaForCausalLM

    args = trl.DPOConfig(output_dir=str(tmp / "trl"), per_device_train_batch_size=len(pairs), report_to=[], beta=beta,
                         use_cpu=True, max_length=None, bf16=False)
    tr = trl.DPOTrainer(model=LlamaForCausalLM.from_pretrained(policy, dtype=torch.float32),
                        ref_model=LlamaForCausalLM.from_pretrained(ref, dtype=torch.float32), args=args,
                        train_dataset=datasets.Dataset.from_list(pairs),
                        processing_class=AutoTokenizer.from_pretrained(tok_dir))
    return tr


def _rows(ids: torch.Tensor, keep: torch.Tensor, mask: torch.Tensor) -> set[tuple[tuple[int, ...], tuple[int, ...]]]:
    return {(tuple(i[k.bool()].tolist()), tuple(m[k.bool()].tolist())) for i, k, m in zip(ids, keep, mask)}


@pytest.mark.slow
@pytest.mark.parametrize("conversational", [False, True])
def test_loss_rewards_and_margins_equal_trl(tmp_path: Path, hf_tok: Path, conversational: bool) -> None:
    """TRL's own batch through TRL's own loss vs our log-probs and loss on our model loaded from the same dirs;
    and our pair encoding gives TRL's tokens and completion masks."""
    from xirang_hpc.weights.load import load_hf

    beta = 0.5
    pairs: list[dict] = random_pairs(6, 3)
    if conversational:
        pairs = [{"prompt": [{"role": "user", "content": p["prompt"]}],
                  "chosen": [{"role": "assistant", "content": p["chosen"]}],
                  "rejected": [{"role": "assistant", "content": p["rejected"]}]} for p in pairs]
    tok = load_tokenizer(str(hf_tok))
    policy_dir, ref_dir = _llama_pair(tmp_path, tok.vocab_size)
    tr = _trl_trainer(tmp_path, policy_dir, ref_dir, hf_tok, pairs, beta)
    batch = next(iter(tr.get_train_dataloader()))
    ids, att, comp = batch["input_ids"], batch["attention_mask"], batch["completion_mask"]
    assert ids.shape[0] == 2 * len(pairs)

    # Our encoding of the same pairs: the same token rows and completion masks (as sets: TRL shuffles).
    enc = PairEncoder(tok, ChatRenderer.for_tokenizer(tok, str(hf_tok), "last"))
    ours = set()
    for k, p in enumerate(pairs):
        for s in enc.encode(PairRecord(p["prompt"], p["chosen"], p["rejected"], "train", f"pair {k}")):
            ours.add((tuple(s.ids.tolist()), tuple(s.mask.tolist())))
    assert ours == _rows(ids, att, comp)

    tr.model.train()  # TRL files the metrics under the model's mode
    trl_loss = float(tr._compute_loss(tr.model, batch, False))
    m = {k: v[-1] for k, v in tr._metrics["train"].items()}

    x, y = ids[:, :-1], torch.where(comp[:, 1:].bool(), ids[:, 1:], IGNORE_INDEX)
    with torch.no_grad():
        pi = completion_logps(load_hf(policy_dir).model.eval()(x), y)
        ref = completion_logps(load_hf(ref_dir).model.eval()(x), y)
    terms = dpo_terms(pi, ref, beta)
    assert abs(trl_loss - math.log(2)) > 1e-3  # policy and reference differ: a real comparison
    assert float(terms.loss) == pytest.approx(trl_loss, abs=1e-5)
    assert float(terms.chosen_rewards.mean()) == pytest.approx(m["rewards/chosen"], abs=1e-5)
    assert float(terms.rejected_rewards.mean()) == pytest.approx(m["rewards/rejected"], abs=1e-5)
    assert float(terms.margins.mean()) == pytest.approx(m["rewards/margins"], abs=1e-5)
    assert float(terms.accuracies.mean()) == pytest.approx(m["rewards/accuracies"], abs=1e-6)
    assert float(pi[: len(pairs)].mean()) == pytest.approx(m["logps/chosen"], abs=1e-4)


def test_dpo_terms_by_hand() -> None:
    pi = torch.tensor([-3.0, -5.0, -4.0, -4.5])  # chosen (2), then rejected (2)
    ref = torch.tensor([-3.5, -4.0, -4.0, -4.0])
    t = dpo_terms(pi, ref, 0.5)
    z = 0.5 * torch.tensor([(-3.0 + 3.5) - 0.0, (-5.0 + 4.0) - (-0.5)])
    assert float(t.loss) == pytest.approx(float(-torch.nn.functional.logsigmoid(z).mean()), abs=1e-7)
    assert t.chosen_rewards.tolist() == pytest.approx([0.25, -0.5])
    assert t.accuracies.tolist() == [1.0, 0.0]
    with pytest.raises(ValueError, match="sigmoid"):
        dpo_terms(pi, ref, 0.5, "hinge")


def test_completion_logps_count_only_learned_targets() -> None:
    logits = torch.randn(2, 5, 7, generator=torch.Generator().manual_seed(0))
    y = torch.tensor([[IGNORE_INDEX, IGNORE_INDEX, 3, 4, IGNORE_INDEX], [1, IGNORE_INDEX, IGNORE_INDEX, 2, 6]])
    lp = torch.log_softmax(logits, -1)
    want = [lp[0, 2, 3] + lp[0, 3, 4], lp[1, 0, 1] + lp[1, 3, 2] + lp[1, 4, 6]]
    assert completion_logps(logits, y).tolist() == pytest.approx([float(w) for w in want], abs=1e-6)


def test_prepared_pairs_hold_both_sequences_with_completion_masks(tmp_path: Path) -> None:
    recs = random_pairs(40, 5)
    write_pairs(tmp_path / "c" / "p.jsonl", recs)
    index = prepare(str(tmp_path / "c"), tmp_path / "d", fmt="pairs", val_fraction=0.2, progress=None)
    assert index["format"] == "pairs" and sum(index["pairs"].values()) == 40
    assert index["samples"] == {s: 2 * n for s, n in index["pairs"].items()}
    by_text = {r["prompt"] + r["chosen"]: r for r in recs}
    for shard in index["splits"]["train"]:
        with h5py.File(tmp_path / "d" / shard["file"]) as f:
            tokens, mask, off = f["tokens"][:], f["loss_mask"][:], f["offsets"][:]
        assert (len(off) - 1) % 2 == 0  # whole pairs per shard
        for k in range(0, len(off) - 1, 2):
            c, r = slice(off[k], off[k + 1]), slice(off[k + 1], off[k + 2])
            chosen = bytes(tokens[c][mask[c] == 1].tolist()).decode()
            prompt = bytes(tokens[c][mask[c] == 0].tolist()).decode()
            rec = by_text[prompt + chosen]  # byte tokenizer (no eos): prompt then reply, the reply learned
            assert bytes(tokens[r][mask[r] == 1].tolist()).decode() == rec["rejected"]
            assert bytes(tokens[r][mask[r] == 0].tolist()).decode() == rec["prompt"]


@pytest.mark.parametrize("bad,match", [
    ({"prompt": "hi", "chosen": "", "rejected": "no"}, "'chosen' is empty"),
    ({"prompt": "hi", "chosen": "yes", "rejected": "  "}, "'rejected' is empty"),
    ({"prompt": "hi", "chosen": [{"role": "assistant", "content": ""}], "rejected": "no"}, "'chosen' is empty"),
    ({"prompt": "hi", "chosen": "yes"}, "no 'rejected'"),
])
def test_bad_pair_names_file_and_line_or_is_skipped(tmp_path: Path, bad: dict, match: str) -> None:
    recs: list[dict] = [*random_pairs(20, 1), bad]
    f = write_pairs(tmp_path / "c" / "p.jsonl", recs)
    with pytest.raises(CorpusError, match=rf"{f}:21: .*{match}.*data.on_bad_record=skip"):
        prepare(str(tmp_path / "c"), tmp_path / "d", fmt="pairs", val_fraction=0.2, progress=None)
    index = prepare(str(tmp_path / "c"), tmp_path / "d", fmt="pairs", val_fraction=0.2, progress=None,
                    on_bad_record="skip")
    assert sum(index["pairs"].values()) == 20 and index["skipped_records"]["total"] == 1


def test_identical_replies_are_counted_and_warned(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    recs: list[dict] = [*random_pairs(20, 2), {"prompt": "p", "chosen": " same", "rejected": " same"}]
    f = write_pairs(tmp_path / "c" / "p.jsonl", recs)
    index = prepare(str(tmp_path / "c"), tmp_path / "d", fmt="pairs", val_fraction=0.2, progress=None)
    assert index["identical_pairs"] == 1 and sum(index["pairs"].values()) == 21
    err = capsys.readouterr().err
    assert "1 pair(s) with identical chosen and rejected replies" in err and f"{f}:21" in err


@pytest.mark.parametrize("overlong", ["truncate", "drop"])
def test_overlong_pairs_are_cut_or_dropped_and_a_long_prompt_leaves_nothing(tmp_path: Path, overlong: str) -> None:
    recs = [{"prompt": "p" * 5, "chosen": " c" * 3, "rejected": " r" * 3},       # 12 tokens: fits seq_len 16
            {"prompt": "p" * 10, "chosen": " c" * 6, "rejected": " r" * 2},      # chosen 22 tokens: cut or dropped
            {"prompt": "p" * 30, "chosen": " yes", "rejected": " no"}] * 20      # prompt > seq_len: nothing left
    write_pairs(tmp_path / "c" / "p.jsonl", recs)
    prepare(str(tmp_path / "c"), tmp_path / "d", fmt="pairs", val_fraction=0.3, progress=None)
    tr = PairSamples(tmp_path / "d", "train", 16, overlong)
    s = tr.summary
    n = {k: sum(PairSamples(tmp_path / "d", sp, 16, overlong).summary[k] for sp in ("train", "val"))
         for k in ("pairs", "truncated", "dropped", "left_out_nothing_to_learn")}
    if overlong == "truncate":
        assert n == {"pairs": 40, "truncated": 40, "dropped": 0, "left_out_nothing_to_learn": 20}
    else:
        assert n == {"pairs": 20, "truncated": 0, "dropped": 40, "left_out_nothing_to_learn": 0}
    x, y = tr.batch(0, 0, 2)
    assert x.shape == (4, 16) and s["pairs"] >= 1
    assert ((y[:2] != IGNORE_INDEX).sum(1) > 0).all() and ((y[2:] != IGNORE_INDEX).sum(1) > 0).all()


def test_batch_rows_are_chosen_then_rejected_and_split_over_ranks(tmp_path: Path) -> None:
    write_pairs(tmp_path / "c" / "p.jsonl", random_pairs(30, 4))
    prepare(str(tmp_path / "c"), tmp_path / "d", fmt="pairs", val_fraction=0.2, progress=None)
    data = PairSamples(tmp_path / "d", "train", 48)
    x, y = data.batch(0, 3, 4)
    halves = [data.batch(0, 3, 4, r, 2) for r in (0, 1)]
    assert torch.equal(torch.cat([halves[0][0][:2], halves[1][0][:2], halves[0][0][2:], halves[1][0][2:]]), x)
    for j in range(4):  # a pair's rows share the prompt (the targets before the first learned one)
        first_c = int((y[j] != IGNORE_INDEX).nonzero()[0])
        first_r = int((y[4 + j] != IGNORE_INDEX).nonzero()[0])
        assert first_c == first_r and torch.equal(x[j, :first_c], x[4 + j, :first_r])


def test_config_refuses_what_dpo_does_not_run() -> None:
    import parallel_harness as H

    with pytest.raises(ConfigError, match="finetune.dpo.loss.*sigmoid"):
        DpoConfig(loss="ipo")
    with pytest.raises(ConfigError, match="finetune.dpo.beta"):
        DpoConfig(beta=0.0)
    with pytest.raises(ConfigError, match="finetune.dpo.*method=dpo"):
        FinetuneConfig(dpo=DpoConfig(beta=0.2))
    with pytest.raises(ConfigError, match="data.packing"):
        DataConfig(format="pairs", packing=True)
    with pytest.raises(ConfigError, match="data.format.*finetune.method=dpo"):
        H.make_cfg(1, {}, data=PAIRS)
    with pytest.raises(ConfigError, match="finetune.method.*data.format=pairs"):
        H.make_cfg(1, {}, finetune=DPO)
    for field, layout in (("parallel.pp", H.LAYOUTS["pp2"]), ("parallel.tp", H.LAYOUTS["tp2"]),
                          ("parallel.data_parallel", {"data_parallel": "fsdp"})):
        with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
            H.make_cfg(2, layout, finetune=DPO, data=PAIRS)
    with pytest.raises(ConfigError, match="train.loss_chunk_tokens"):
        H.make_cfg(1, {}, finetune=DPO, data=PAIRS, train={"loss_chunk_tokens": 8})
    H.make_cfg(2, {}, finetune=DPO, data=PAIRS)  # dp2 with ddp runs


def test_adapters_disabled_is_the_base() -> None:
    from xirang_hpc.config.schema import LoraConfig, ModelConfig
    from xirang_hpc.models.gpt import GPT
    from xirang_hpc.models.lora import adapters_disabled, apply_lora

    cfg = ModelConfig(name="t", n_layer=2, n_head=4, d_model=32, d_ff=64, seq_len=16, vocab_size=64)
    base = GPT(cfg, seed=1).eval()
    model = GPT(cfg, seed=1).eval()
    apply_lora(model, LoraConfig(rank=2))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_()
    x = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (model(x) - base(x)).abs().max() > 1e-3
        with adapters_disabled(model):
            assert torch.equal(model(x), base(x))
        assert (model(x) - base(x)).abs().max() > 1e-3  # back on after the block


@pytest.fixture(scope="module")
def pair_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Byte-tokenized pairs where the chosen reply always says 'yes': learnable in a few steps."""
    tmp = tmp_path_factory.mktemp("dpo-data")
    rng = random.Random(0)
    recs = [{"prompt": " ".join(rng.choices(WORDS, k=3)), "chosen": " yes " + rng.choice(WORDS),
             "rejected": " no " + rng.choice(WORDS)} for _ in range(120)]
    write_pairs(tmp / "c" / "p.jsonl", recs)
    prepare(str(tmp / "c"), tmp / "d", fmt="pairs", val_fraction=0.1, progress=None)
    return tmp / "d"


@pytest.mark.parametrize("lora", [False, True])
def test_one_process_training_starts_at_log2_and_learns_the_preference(pair_data: Path, lora: bool) -> None:
    """Policy = reference at the start (loss log 2, rewards 0); the loss falls, the margin and accuracy rise,
    and the reference does not move."""
    import parallel_harness as H

    from xirang_hpc.runtime.trainer import Trainer

    ft = FinetuneConfig(method="dpo", dpo=DpoConfig(beta=0.5, lora=lora))
    cfg = H.make_cfg(1, {}, steps=8, model={"vocab_size": 256, "seq_len": 32, "n_layer": 2},
                     train={"lr": 1e-2, "grad_clip": 1.0}, finetune=ft, data=PAIRS)
    tr = Trainer(cfg, H.topology(0, 1, 0), pair_data, pair_data, log=lambda s: None)
    ref_before = None if tr.ref_model is None else {k: v.clone() for k, v in tr.ref_model.state_dict().items()}
    assert (tr.ref_model is None) == lora
    losses = []
    for s in range(8):
        losses.append(tr.train_step(s)[0])
        if s == 0:
            assert tr.dpo_metrics["rewards/margins"] == pytest.approx(0.0, abs=1e-6)
    assert losses[0] == pytest.approx(math.log(2), abs=1e-6)
    assert losses[-1] < 0.75 * losses[0]
    assert tr.dpo_metrics["rewards/margins"] > 0 and tr.dpo_metrics["rewards/accuracies"] > 0.5
    if ref_before is not None:
        assert all(torch.equal(v, tr.ref_model.state_dict()[k]) for k, v in ref_before.items())
    else:
        assert not any(p.requires_grad for n, p in tr.model.named_parameters() if "lora_" not in n)
    assert tr.evaluate() < math.log(2)


def test_grad_accumulation_gives_the_same_step(pair_data: Path) -> None:
    import parallel_harness as H

    runs = []
    for accum in (1, 2):
        cfg = H.make_cfg(1, {}, steps=2, model={"vocab_size": 256, "seq_len": 32, "n_layer": 2},
                         train={"lr": 1e-2, "grad_clip": 1.0, "grad_accum": accum}, finetune=DPO, data=PAIRS)
        runs.append(H.run_layout(cfg, H.topology(0, 1, 0), pair_data, steps=2))
    np.testing.assert_allclose(runs[1]["losses"], runs[0]["losses"], rtol=1e-5)
    np.testing.assert_allclose(runs[1]["norms"], runs[0]["norms"], rtol=1e-5)


def test_reference_hook_takes_the_imported_start(pair_data: Path) -> None:
    """The reference is refreshed from the model as the hooks before it left it (model.init_from)."""
    import parallel_harness as H

    from xirang_hpc.runtime.dpo import ReferenceHook
    from xirang_hpc.runtime.trainer import Trainer

    cfg = H.make_cfg(1, {}, steps=2, model={"vocab_size": 256, "seq_len": 32, "n_layer": 2}, finetune=DPO,
                     data=PAIRS)
    tr = Trainer(cfg, H.topology(0, 1, 0), pair_data, pair_data, log=lambda s: None)
    with torch.no_grad():
        for p in tr.model.parameters():
            p.add_(0.01)  # what an import does to the start
    assert tr.ref_model is not None
    assert not torch.equal(next(tr.ref_model.parameters()), next(tr.model.parameters()))
    ReferenceHook().on_fit_start(tr)
    assert all(torch.equal(a, b) for a, b in zip(tr.ref_model.parameters(), tr.model.parameters()))
    assert tr.train_step(0)[0] == pytest.approx(math.log(2), abs=1e-6)



@pytest.mark.slow
def test_dp2_run_from_an_hf_base_learns_and_resumes_bitwise(tmp_path: Path, pair_data: Path) -> None:
    """The real job on 2 gloo ranks (dp2) from a Llama directory: the first step's loss is log 2 (the reference is
    the imported start, not the seed's), the loss falls and the reward accuracy rises; 20 steps uninterrupted
    and 10 + resume + 10 save bitwise equal checkpoints and log the same losses (the resumed reference is the
    imported start again, not the restored policy)."""
    from test_checkpoint_resume import _losses, make_cfg, run_job, saved_tensors
    from test_lora_run import make_llama

    base = tmp_path / "base"
    make_llama(base)
    extra = ["finetune.method=dpo", "finetune.dpo.beta=0.5", "data.format=pairs", "train.lr=3e-3",
             "train.log_every=1", "cluster.nodes=1", "cluster.tasks_per_node=2", "parallel.tp=1", "parallel.pp=1",
             "parallel.microbatches=1", "model.norm=rmsnorm", "model.mlp=swiglu", "model.pos=rope",
             "model.bias=false", f"model.init_from={base}"]
    full, split = tmp_path / "full", tmp_path / "split"
    run_job(make_cfg(pair_data, full, extra), full, pair_data, world=2)
    run_job(make_cfg(pair_data, split, extra), split, pair_data, world=2, stop_at=10)
    run_job(make_cfg(pair_data, split, extra), split, pair_data, world=2)
    losses = _losses(full)
    assert losses[1] == pytest.approx(math.log(2), abs=1e-5)
    assert losses[20] < 0.5 * losses[1]
    rows = [json.loads(x) for x in (full / "metrics.jsonl").read_text().splitlines() if x.strip()]
    acc = {r["step"]: r["rewards/accuracies"] for r in rows if "rewards/accuracies" in r}
    assert acc[1] == 0.0 and acc[20] > 0.5  # ties at the start: no chosen reward beats its rejected one
    assert _losses(split) == losses
    a, b = saved_tensors(full / "checkpoints" / "step_20"), saved_tensors(split / "checkpoints" / "step_20")
    assert a.keys() == b.keys() and any(k.startswith("model.") for k in a)
    for k in a:
        assert torch.equal(a[k], b[k]), f"{k} differs after resume"


@pytest.mark.slow
def test_dp2_lora_run_checkpoints_adapters_and_exports_them_for_peft(tmp_path: Path, pair_data: Path) -> None:
    """finetune.dpo.lora=true on 2 ranks: the start is the base (loss log 2), the checkpoint holds the adapters
    only, and ``xirang-ckpt export --format peft`` gives an adapter peft loads with our logits (``--format hf
    --merge``: a whole model with the same logits)."""
    import subprocess
    import sys

    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    from test_checkpoint_resume import _losses, make_cfg, run_job, saved_tensors
    from test_lora_run import make_llama

    from xirang_hpc.config.schema import LoraConfig
    from xirang_hpc.models.lora import apply_lora
    from xirang_hpc.weights.load import load_hf

    base = tmp_path / "base"
    make_llama(base)
    extra = ["finetune.method=dpo", "finetune.dpo.lora=true", "finetune.dpo.beta=0.5", "finetune.lora.rank=4",
             "data.format=pairs", "train.lr=1e-2", "train.log_every=1", "train.max_steps=10", "cluster.nodes=1",
             "cluster.tasks_per_node=2", "parallel.tp=1", "parallel.pp=1", "parallel.microbatches=1",
             "model.norm=rmsnorm", "model.mlp=swiglu", "model.pos=rope", "model.bias=false",
             f"model.init_from={base}"]
    run = tmp_path / "run"
    run_job(make_cfg(pair_data, run, extra), run, pair_data, world=2)
    losses = _losses(run)
    assert losses[1] == pytest.approx(math.log(2), abs=1e-5) and losses[10] < losses[1]
    saved = saved_tensors(run / "checkpoints" / "step_10")
    models = [k for k in saved if k.startswith("model.")]
    assert models and all(k.endswith((".lora_A.weight", ".lora_B.weight")) for k in models)
    out = subprocess.run([str(Path(sys.executable).parent / "xirang-ckpt"), "export", str(run), "--format", "peft",
                          "--out", str(tmp_path / "adapter")], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    merged = subprocess.run([str(Path(sys.executable).parent / "xirang-ckpt"), "export", str(run), "--format", "hf",
                             "--merge", "--out", str(tmp_path / "merged")], capture_output=True, text=True)
    assert merged.returncode == 0, merged.stderr
    ours = load_hf(base).model
    apply_lora(ours, LoraConfig(rank=4))
    ours.load_state_dict({k.removeprefix("model."): v for k, v in saved.items() if k in models}, strict=False)
    x = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    hf_base = transformers.LlamaForCausalLM.from_pretrained(base, dtype=torch.float32)
    with torch.no_grad():
        mine, plain = ours.eval()(x), hf_base(x).logits
        theirs = peft.PeftModel.from_pretrained(hf_base, tmp_path / "adapter").eval()(x).logits
        whole = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32)(x).logits
    assert (mine - plain).abs().max().item() > 1e-4
    assert (mine - theirs).abs().max().item() <= 1e-4
    assert (mine - whole).abs().max().item() <= 1e-4


def test_a_bpe_trained_on_pairs_learns_their_words(tmp_path: Path) -> None:
    """data.tokenizer=bpe on pairs: trained on the pairs' text (string and chat), so a reply word is one token."""
    recs: list[dict] = random_pairs(60, 6)
    recs += [{"prompt": [{"role": "user", "content": "hi"}], "chosen": [{"role": "assistant", "content": " zebra"}],
              "rejected": " quokka"}] * 20
    write_pairs(tmp_path / "c" / "p.jsonl", recs)
    index = prepare(str(tmp_path / "c"), tmp_path / "d", fmt="pairs", val_fraction=0.2, progress=None,
                    tokenizer="bpe", vocab_size=400)
    tok = load_tokenizer(str(tmp_path / "d" / "tokenizer.json"))
    assert sum(index["pairs"].values()) == 80
    for word in (" zebra", " quokka", " home"):
        assert len(tok.encode(word)) == 1, word


def test_heldout_eval_of_pairs_is_the_mean_over_the_chosen_replies(pair_data: Path) -> None:
    from xirang_hpc.config.schema import EvalConfig, ModelConfig
    from xirang_hpc.eval.evaluate import heldout_loss
    from xirang_hpc.models.gpt import GPT, lm_loss
    from xirang_hpc.weights.load import LoadedModel

    cfg = ModelConfig(name="t", n_layer=2, n_head=4, d_model=32, d_ff=64, seq_len=32, vocab_size=256, pos="rope")
    model = GPT(cfg, seed=2).eval()
    ecfg = EvalConfig(batches=2, batch_size=3)
    loss, tokens = heldout_loss(LoadedModel(model, cfg, "test"), pair_data, ecfg)
    data = PairSamples(pair_data, "val", 32, seed=ecfg.seed)
    want_sum, want_n = 0.0, 0
    with torch.no_grad():
        for g in range(6):  # pairs 0..5 of the val sequence: batch i takes [3i, 3i + 3)
            ids, mask = (torch.as_tensor(a) for a in data._pairs[data._pair(g)][:2])
            tgt = torch.where(mask[1:], ids[1:], IGNORE_INDEX)[None]
            want_sum += float(lm_loss(model(ids[:-1][None]), tgt, 1.0))
            want_n += int((tgt != IGNORE_INDEX).sum())
    assert tokens == want_n
    assert loss == pytest.approx(want_sum / want_n, rel=1e-5)
