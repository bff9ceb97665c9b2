"""Chat fine-tuning data: rendering against transformers, loss masks, bad records, packing without contamination.

The reference for rendering is transformers' own ``apply_chat_template`` on a tokenizer built here (a tiny
``tokenizers`` BPE wrapped in ``PreTrainedTokenizerFast`` and saved with ``save_pretrained``; nothing is
downloaded). Packing is checked against the same samples run one by one, unpadded.
"""

from __future__ import annotations

import dataclasses
import json
import random
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch

from xirang_hpc.config.errors import ConfigError
from xirang_hpc.config.schema import DataConfig, ModelConfig
from xirang_hpc.data.chat import DEFAULT_CHAT_TEMPLATE, ChatRenderer, template_sha256
from xirang_hpc.data.dataset import IGNORE_INDEX, ChatSamples
from xirang_hpc.data.prepare import CorpusError, prepare, train_bpe, verify
from xirang_hpc.data.tokenizer import ByteTokenizer, HFTokenizer
from xirang_hpc.models.gpt import GPT, lm_loss
from xirang_hpc.models.loss import chunked_lm_loss

WORDS = "the cat sat on a mat while dogs ran far away from home and never came back".split()


def conversation(rng: random.Random, turns: int | None = None, words: int | None = None) -> list[dict[str, str]]:
    """A random conversation: an optional system turn, then user/assistant pairs (sometimes a tool turn)."""
    msgs = [{"role": "system", "content": "Be brief."}] if rng.random() < 0.5 else []
    for _ in range(turns or rng.randint(1, 3)):
        msgs.append({"role": "user", "content": " ".join(rng.choices(WORDS, k=rng.randint(2, 8)))})
        if rng.random() < 0.2:
            msgs.append({"role": "tool", "content": "{\"ok\": true}"})
        msgs.append({"role": "assistant", "content": " ".join(rng.choices(WORDS, k=words or rng.randint(1, 12)))})
    return msgs


def write_jsonl(path: Path, convs: list[list[dict[str, str]]]) -> Path:
    """One ``{"messages": ...}`` record per line."""
    path.write_text("".join(json.dumps({"messages": c}) + "\n" for c in convs))
    return path


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny BPE trained here, wrapped in transformers' PreTrainedTokenizerFast with the default chat template."""
    from transformers import PreTrainedTokenizerFast

    rng = random.Random(1)
    texts = [" ".join(rng.choices(WORDS, k=30)) for _ in range(200)] + ["<|im_start|>user\n<|im_end|>\n"] * 5
    tok = train_bpe(iter(texts), 300)
    out = tmp_path_factory.mktemp("hf-tok")
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", chat_template=DEFAULT_CHAT_TEMPLATE)
    fast.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def chat_corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    rng = random.Random(0)
    d = tmp_path_factory.mktemp("chat")
    write_jsonl(d / "chat.jsonl", [conversation(rng) for _ in range(120)])
    return d / "chat.jsonl"


def test_default_template_renders_like_transformers(hf_dir: Path) -> None:
    """Our render of the tokenizer's own chat_template: the same text and ids as apply_chat_template."""
    from transformers import AutoTokenizer

    ref = AutoTokenizer.from_pretrained(hf_dir)
    tok = HFTokenizer(hf_dir / "tokenizer.json")
    r = ChatRenderer.for_tokenizer(tok, str(hf_dir), "assistant")
    assert r.template == ref.chat_template
    rng = random.Random(3)
    for _ in range(20):
        msgs = conversation(rng)
        assert r.render(msgs) == ref.apply_chat_template(msgs, tokenize=False)
        assert r.render(msgs, add_generation_prompt=True) == ref.apply_chat_template(
            msgs, tokenize=False, add_generation_prompt=True)
        want = ref.apply_chat_template(msgs, tokenize=True)
        want = want["input_ids"] if isinstance(want, dict) or hasattr(want, "keys") else want
        assert r.sample(msgs, "rec").ids.tolist() == list(want)


def test_own_template_of_the_tokenizer_dir_is_used(hf_dir: Path, tmp_path: Path) -> None:
    """A directory with another chat_template (bos/eos tokens, Llama-2 style) renders with that one, as transformers."""
    from transformers import AutoTokenizer

    own = ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'assistant' %}{{ m['content'] + eos_token }}"
           "{% else %}{{ '[' + m['role'] + '] ' + m['content'] + '\n' }}{% endif %}{% endfor %}")
    cfg = json.loads((hf_dir / "tokenizer_config.json").read_text())
    cfg.update(chat_template=own, bos_token="<|endoftext|>")
    d = tmp_path / "own"
    d.mkdir()
    (d / "tokenizer.json").write_bytes((hf_dir / "tokenizer.json").read_bytes())
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    ref = AutoTokenizer.from_pretrained(d)
    r = ChatRenderer.for_tokenizer(HFTokenizer(d / "tokenizer.json"), str(d), "assistant")
    msgs = conversation(random.Random(5), turns=2)
    assert r.sha256 == template_sha256(own) != template_sha256(DEFAULT_CHAT_TEMPLATE)
    assert r.render(msgs) == ref.apply_chat_template(msgs, tokenize=False)


@pytest.mark.parametrize("train_on", ["assistant", "last", "all"])
def test_loss_mask_learns_what_train_on_says(hf_dir: Path, train_on: str) -> None:
    tok = HFTokenizer(hf_dir / "tokenizer.json")
    r = ChatRenderer.for_tokenizer(tok, str(hf_dir), train_on)
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "the cat"},
            {"role": "assistant", "content": "sat on a mat"}, {"role": "user", "content": "dogs"},
            {"role": "assistant", "content": "ran far away"}]
    s = r.sample(msgs, "rec")
    learned = tok.decode(s.ids[s.mask == 1])
    if train_on == "assistant":
        assert learned == "sat on a mat<|im_end|>\nran far away<|im_end|>\n"
    elif train_on == "last":
        assert learned == "ran far away<|im_end|>\n"
    else:
        assert s.mask.all()


def test_byte_tokenizer_masks_by_utf8_bytes() -> None:
    r = ChatRenderer(ByteTokenizer(), DEFAULT_CHAT_TEMPLATE, "assistant")
    s = r.sample([{"role": "user", "content": "ça?"}, {"role": "assistant", "content": "très bien"}], "rec")
    assert bytes(s.ids[s.mask == 1].astype(np.uint8)).decode() == "très bien<|im_end|>\n"


def test_prepare_chat_stores_masks_and_template_sha(chat_corpus: Path, hf_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    index = prepare(str(chat_corpus), out, val_fraction=0.2, tokenizer=str(hf_dir), fmt="chat", progress=None)
    sha = template_sha256(DEFAULT_CHAT_TEMPLATE)
    assert index["format"] == "chat" and index["chat_template_sha256"] == sha
    assert sum(index["samples"].values()) == 120
    shard = index["splits"]["train"][0]
    with h5py.File(out / shard["file"], "r") as f:
        assert f.attrs["chat_template_sha256"] == sha
        tokens, mask, offsets = f["tokens"][:], f["loss_mask"][:], f["offsets"][:]
    assert len(tokens) == len(mask) == offsets[-1] and 0 < mask.sum() < len(mask)
    assert shard["n_learned"] == int(mask.sum())
    verify(out)
    with h5py.File(out / shard["file"], "r+") as f:  # a flipped mask bit is caught
        f["loss_mask"][0] = 1 - f["loss_mask"][0]
    with pytest.raises(CorpusError, match="loss_mask checksum"):
        verify(out)


@pytest.mark.parametrize("bad,match", [
    ({"messages": [{"role": "robot", "content": "hi"}, {"role": "assistant", "content": "x"}]},
     "unknown role 'robot'; use one of system, user, assistant, tool"),
    ({"messages": [{"role": "user", "content": "hi"}]}, "no assistant turn"),
    ({"x": 1}, "no 'messages' list"),
])
def test_bad_record_names_file_line_and_fix(tmp_path: Path, bad: dict, match: str) -> None:
    rng = random.Random(2)
    path = tmp_path / "c.jsonl"
    lines = [json.dumps({"messages": conversation(rng)}) for _ in range(5)]
    lines.insert(3, json.dumps(bad))
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(CorpusError) as e:
        prepare(str(path), tmp_path / "out", val_fraction=0.3, fmt="chat", progress=None)
    msg = str(e.value)
    assert f"{path}:4" in msg and match in msg and "\n" not in msg
    assert "data.on_bad_record=skip" in msg
    index = prepare(str(path), tmp_path / "out2", val_fraction=0.3, fmt="chat", on_bad_record="skip", progress=None)
    assert sum(index["samples"].values()) == 5 and index["skipped_records"]["total"] == 1


def test_template_that_fails_names_the_record(hf_dir: Path, tmp_path: Path) -> None:
    d = tmp_path / "tok"
    d.mkdir()
    (d / "tokenizer.json").write_bytes((hf_dir / "tokenizer.json").read_bytes())
    tpl = ("{% for m in messages %}{% if m['role'] == 'tool' %}{{ raise_exception('tool turns are not supported') }}"
           "{% endif %}{{ m['role'] + ': ' + m['content'] + '\n' }}{% endfor %}")
    (d / "tokenizer_config.json").write_text(json.dumps({"chat_template": tpl}))
    convs = [[{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]] * 3
    convs.insert(1, [{"role": "user", "content": "a"}, {"role": "tool", "content": "{}"},
                     {"role": "assistant", "content": "b"}])
    path = write_jsonl(tmp_path / "c.jsonl", convs)
    with pytest.raises(CorpusError, match=rf"{path}:2: the chat template fails to render this record "
                                          r"\(TemplateError: tool turns are not supported\)"):
        prepare(str(path), tmp_path / "out", val_fraction=0.3, tokenizer=str(d), fmt="chat", progress=None)


def test_config_refuses_chat_fields_on_text_and_unknown_values() -> None:
    with pytest.raises(ConfigError, match="data.packing"):
        DataConfig(packing=True)
    with pytest.raises(ConfigError, match="data.train_on"):
        DataConfig(format="chat", train_on="user")
    with pytest.raises(ConfigError, match="data.overlong"):
        DataConfig(format="chat", overlong="wrap")


# ---- packing --------------------------------------------------------------------------------------------------
def _samples(n: int, seed: int, vocab: int, lo: int = 3, hi: int = 14) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        length = int(rng.integers(lo, hi))
        ids = rng.integers(0, vocab, length)
        mask = (rng.random(length) < 0.6).astype(np.uint8)
        mask[-1] = 1
        out.append((ids, mask))
    return out


def _write_chat_dir(out: Path, samples: list[tuple[np.ndarray, np.ndarray]]) -> Path:
    """A prepared chat directory holding exactly ``samples`` (the same layout prepare writes)."""
    from xirang_hpc.data.prepare import _write_index
    from xirang_hpc.data.prepare_chat import _ChatShardWriter

    out.mkdir(parents=True, exist_ok=True)
    splits = {}
    for split in ("train", "val"):
        w = _ChatShardWriter(out, split, 1 << 20, {"format": "chat"}, np.uint16)
        for ids, m in samples:
            w.add(ids, m)
        splits[split] = w.close()
    _write_index(out, {"format": "chat", "splits": splits})
    return out


MODEL = dict(name="t", n_layer=2, n_head=4, d_model=32, d_ff=64, seq_len=32, vocab_size=64)


@pytest.mark.parametrize("pos", ["rope", "learned"])
def test_packed_batch_equals_samples_one_by_one(tmp_path: Path, pos: str) -> None:
    """Loss and every gradient of a packed batch equal the same samples run one by one, unpadded (fp32, 1e-5)."""
    samples = _samples(14, 0, 64)
    data = ChatSamples(_write_chat_dir(tmp_path, samples), "train", 32, packing=True)
    x, y, p, n = data.batch(0, 0, 4)
    assert p is not None and (p == 0).sum() > 4, "several samples share a row"
    torch.manual_seed(0)
    model = GPT(ModelConfig(**MODEL, pos=pos), seed=1)
    loss = lm_loss(model(x, position_ids=p), y, float(n))
    loss.backward()
    packed_grads = {k: v.grad.clone() for k, v in model.named_parameters()}
    model.zero_grad()
    # the same samples, each alone and unpadded: the rows' samples in order
    rows = [data._row_samples(g) for g in range(4)]
    ref = torch.zeros(())
    for i in (i for r in rows for i in r):
        ids = torch.as_tensor(data._ids[i])[None]  # (1, L)
        tgt = torch.where(torch.as_tensor(data._masks[i][1:])[None], ids[:, 1:], IGNORE_INDEX)
        ref = ref + lm_loss(model(ids[:, :-1]), tgt, float(n))
    ref.backward()
    assert n == sum(int(data._masks[i][1:].sum()) for r in rows for i in r)
    torch.testing.assert_close(loss, ref, rtol=0, atol=1e-5)
    for k, v in model.named_parameters():
        torch.testing.assert_close(packed_grads[k], v.grad, rtol=0, atol=1e-5, msg=k)


def test_padded_rows_hold_one_sample_and_pads_are_ignored(tmp_path: Path) -> None:
    samples = _samples(10, 1, 64)
    data = ChatSamples(_write_chat_dir(tmp_path, samples), "train", 32, packing=False)
    x, y, p, n = data.batch(0, 0, 4)
    assert p is None
    for r in range(4):
        (i,) = data._row_samples(r)
        length = len(data._ids[i]) - 1
        assert (y[r, length:] == IGNORE_INDEX).all() and (x[r, length:] == 0).all()
    model = GPT(ModelConfig(**MODEL, pos="rope"), seed=1)
    # the padded row's loss is the per-sample sum over learned tokens: pads change nothing
    (i,) = data._row_samples(0)
    ids = torch.as_tensor(data._ids[i])[None]
    tgt = torch.where(torch.as_tensor(data._masks[i][1:])[None], ids[:, 1:], IGNORE_INDEX)
    torch.testing.assert_close(lm_loss(model(x[:1]), y[:1], 1.0), lm_loss(model(ids[:, :-1]), tgt, 1.0),
                               rtol=0, atol=1e-5)


def test_packed_samples_do_not_see_each_other(tmp_path: Path) -> None:
    """Perturb one sample's tokens: the other samples of the same packed row keep their logits (bitwise)."""
    samples = _samples(12, 2, 64)
    data = ChatSamples(_write_chat_dir(tmp_path, samples), "train", 32, packing=True)
    x, _, p, _ = data.batch(0, 0, 2)
    starts = (p[0] == 0).nonzero().flatten().tolist()
    assert len(starts) >= 3
    a, b = starts[1], starts[2]  # the second sample of row 0
    model = GPT(ModelConfig(**MODEL, pos="rope"), seed=3).eval()
    with torch.no_grad():
        before = model(x, position_ids=p)
        x2 = x.clone()
        x2[0, a:b] = (x2[0, a:b] + 7) % 64
        after = model(x2, position_ids=p)
    assert not torch.equal(before[0, a:b], after[0, a:b]), "the perturbed sample's logits change"
    keep = torch.ones(x.shape[1], dtype=torch.bool)
    keep[a:b] = False
    torch.testing.assert_close(after[0, keep], before[0, keep], rtol=0, atol=1e-6)
    torch.testing.assert_close(after[1], before[1], rtol=0, atol=0)
    # and without the mask (plain causal attention over the row) the later samples would see it
    with torch.no_grad():
        leak = model(x2) - model(x)
    assert leak[0, b:].abs().max() > 1e-4


def test_chunked_loss_ignores_masked_targets() -> None:
    """The chunked head + loss with ignored targets: the plain loss's value and gradients, any denominator."""
    torch.manual_seed(0)
    h = torch.randn(3, 10, 16, requires_grad=True)
    w = torch.randn(40, 16, requires_grad=True)
    y = torch.randint(0, 40, (3, 10))
    y[torch.rand(3, 10) < 0.4] = IGNORE_INDEX
    for denom in (None, 7.0):
        got = chunked_lm_loss(h, w, y, 4, denom)
        gh, gw = torch.autograd.grad(got, (h, w))
        want = lm_loss(h @ w.t(), y, denom)
        wh, ww = torch.autograd.grad(want, (h, w))
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(gh, wh, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(gw, ww, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("overlong", ["truncate", "drop"])
def test_overlong_samples_are_cut_or_dropped_and_counted(tmp_path: Path, overlong: str) -> None:
    samples = _samples(8, 4, 64) + _samples(3, 5, 64, lo=40, hi=50)
    data = ChatSamples(_write_chat_dir(tmp_path, samples), "train", 32, packing=True, overlong=overlong)
    if overlong == "truncate":
        assert data.summary["truncated"] + data.summary["left_out_nothing_to_learn"] == 3
        assert max(len(a) for a in data._ids) == 33
    else:
        assert data.summary["dropped"] == 3 and data.summary["samples"] == 8
    for g in range(6):  # every row fits
        x, y, p = data.row(g)
        assert len(x) == 32


def test_packing_fills_rows(tmp_path: Path) -> None:
    """First-fit packing wastes little: most positions of packed rows are real tokens, far more than padded rows."""
    samples = _samples(400, 6, 64, lo=3, hi=30)
    d = _write_chat_dir(tmp_path, samples)
    fill = {}
    for packing in (False, True):
        data = ChatSamples(d, "train", 64, packing=packing)
        real = sum(int(data._slots[i]) for g in range(50) for i in data._row_samples(g))
        fill[packing] = real / (50 * 64)
    assert fill[True] > 0.9 and fill[True] > 2 * fill[False]


def test_trainer_loss_is_a_mean_over_the_global_batch_learned_tokens(tmp_path: Path) -> None:
    """Grad accumulation (unequal learned tokens per microbatch) and packing: the same losses and norms as one
    microbatch; a per-microbatch mean would weigh tokens unequally and differ."""
    import parallel_harness as H

    d = _write_chat_dir(tmp_path / "d", _samples(60, 7, 64, lo=3, hi=20))
    runs = []
    for accum, chunk in ((1, 0), (4, 0), (2, 24)):
        cfg = H.make_cfg(1, {}, steps=2, model={**MODEL, "name": "test", "pos": "rope", "vocab_size": 256},
                         train={"grad_accum": accum, "loss_chunk_tokens": chunk})
        cfg = dataclasses.replace(cfg, data=DataConfig(format="chat", packing=True))
        runs.append(H.run_layout(cfg, H.topology(0, 1, 0), d, steps=2))
    for r in runs[1:]:
        np.testing.assert_allclose(r["losses"], runs[0]["losses"], rtol=1e-5)
        np.testing.assert_allclose(r["norms"], runs[0]["norms"], rtol=1e-5)


def test_packing_with_sequence_parallel_is_refused_naming_the_field() -> None:
    import parallel_harness as H

    with pytest.raises(ConfigError, match="data.packing.*sequence_parallel"):
        H.make_cfg(2, H.LAYOUTS["tp2sp"], data=DataConfig(format="chat", packing=True))
    H.make_cfg(2, H.LAYOUTS["tp2sp"], data=DataConfig(format="chat"))  # padded rows: plain causal attention


def test_heldout_eval_of_chat_data_is_the_mean_over_learned_tokens(tmp_path: Path) -> None:
    from xirang_hpc.config.schema import EvalConfig
    from xirang_hpc.eval.evaluate import heldout_loss
    from xirang_hpc.weights.load import LoadedModel

    d = _write_chat_dir(tmp_path, _samples(12, 8, 64))
    cfg = ModelConfig(**MODEL, pos="rope")
    model = GPT(cfg, seed=2).eval()
    loss, tokens = heldout_loss(LoadedModel(model, cfg, "test"), d, EvalConfig(batches=2, batch_size=3))
    data = ChatSamples(d, "val", 32, seed=EvalConfig().seed)
    want_sum, want_n = 0.0, 0
    with torch.no_grad():
        for i in (i for g in range(6) for i in data._row_samples(g)):
            ids = torch.as_tensor(data._ids[i])[None]
            tgt = torch.where(torch.as_tensor(data._masks[i][1:])[None], ids[:, 1:], IGNORE_INDEX)
            want_sum += float(lm_loss(model(ids[:, :-1]), tgt, 1.0))
            want_n += int((tgt != IGNORE_INDEX).sum())
    assert tokens == want_n
    assert loss == pytest.approx(want_sum / want_n, rel=1e-5)


def _prepare_cli(argv: list[str], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
                 ) -> tuple[object, str, str]:
    """``xirang-prepare ARGV...`` in this process: (exit code, stdout, stderr)."""
    import sys

    from hydra.core.global_hydra import GlobalHydra

    from xirang_hpc.cli import prepare as prepare_cli

    monkeypatch.setattr(sys, "argv", ["xirang-prepare", *argv])
    code: object = 0
    try:
        prepare_cli.main()
    except SystemExit as exc:
        code = exc.code
    finally:
        GlobalHydra.instance().clear()
    out = capsys.readouterr()
    return code, out.out, out.err


def test_prepare_cli_counts_overlong_samples_and_names_bad_records(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    rng = random.Random(9)
    convs = [conversation(rng, turns=1, words=2) for _ in range(30)] + [conversation(rng, turns=3, words=60)] * 4
    path = write_jsonl(tmp_path / "c.jsonl", convs)
    common = [f"data.corpus={path}", "data.format=chat", "data.val_fraction=0.2", "model.seq_len=256"]
    code, out, _ = _prepare_cli([*common, f"data.out_dir={tmp_path / 'a'}", "data.overlong=drop"], monkeypatch,
                                capsys)
    assert code in (0, None)
    assert "4 longer than model.seq_len+1=257 tokens, left out (data.overlong=drop)" in out
    with path.open("a") as f:
        f.write(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    code, _, err = _prepare_cli([*common, f"data.out_dir={tmp_path / 'b'}"], monkeypatch, capsys)
    lines = [ln for ln in err.splitlines() if ln.startswith("xirang-prepare: error:")]
    assert code == 2 and len(lines) == 1
    assert f"{path}:35: the conversation has no assistant turn" in lines[0]


@pytest.mark.parametrize("own", [False, True])
def test_a_run_serves_chat_with_the_template_it_was_trained_on(chat_corpus: Path, hf_dir: Path, tmp_path: Path,
                                                               own: bool) -> None:
    """The data's template goes into the run dir at job start; the served chat prompt is the training render."""
    from xirang_hpc.data.tokenizer import TokenizerError, install_run_tokenizer, load_run_tokenizer
    from xirang_hpc.serve.openai_api import chat_prompt

    spec = str(hf_dir) if own else "byte"
    out = tmp_path / "data"
    prepare(str(chat_corpus), out, val_fraction=0.2, tokenizer=spec, fmt="chat", progress=None)
    verify(out)
    run = tmp_path / "run"
    run.mkdir()
    install_run_tokenizer(out, run)
    tok = load_run_tokenizer(run)
    msgs = [{"role": "user", "content": "the cat"}]
    text, stops = chat_prompt(tok, msgs)
    renderer = ChatRenderer.for_tokenizer(HFTokenizer(hf_dir / "tokenizer.json") if own else ByteTokenizer(), spec,
                                          "assistant")
    assert text == renderer.render(msgs, add_generation_prompt=True)
    assert text.endswith("<|im_start|>assistant\n")
    assert stops == ([] if own else ["<|im_end|>"])
    other = tmp_path / "other"  # the same run dir with data of another template is refused
    prepare(str(chat_corpus), other, val_fraction=0.2, tokenizer=spec, fmt="chat", progress=None)
    rec = json.loads((other / "chat_template.json").read_text())
    rec["template"] += "{{ '' }}"
    (other / "chat_template.json").write_text(json.dumps(rec))
    with pytest.raises(CorpusError, match="chat_template.json fails its checksum"):
        verify(other)
    with pytest.raises(TokenizerError, match="another chat template"):
        install_run_tokenizer(other, run)


def test_text_runs_keep_the_simple_chat_prompt(tmp_path: Path) -> None:
    from xirang_hpc.data.tokenizer import install_run_tokenizer, load_run_tokenizer
    from xirang_hpc.serve.openai_api import SIMPLE_CHAT_STOP, chat_prompt, simple_chat_prompt

    corpus = tmp_path / "c"
    corpus.mkdir()
    for i in range(3):
        (corpus / f"{i}.txt").write_text("some text here\n" * 20)
    prepare(str(corpus), tmp_path / "d", val_fraction=0.3, progress=None)
    run = tmp_path / "run"
    run.mkdir()
    install_run_tokenizer(tmp_path / "d", run)
    msgs = [{"role": "user", "content": "hi"}]
    assert chat_prompt(load_run_tokenizer(run), msgs) == (simple_chat_prompt(msgs), [SIMPLE_CHAT_STOP])


@pytest.mark.parametrize("overlong", ["truncate", "drop"])
def test_a_window_no_sample_can_learn_in_is_refused_at_launch(tmp_path: Path, overlong: str) -> None:
    """The launch applies the ranks' rule before any queue wait: a window every sample overflows, with nothing
    to learn in what is left (drop, or a cut before the reply), is refused naming model.seq_len."""
    from xirang_hpc.data.prepare_chat import check_chat_window

    long_replies = []
    for ids, _ in _samples(6, 7, 64, lo=40, hi=50):
        mask = np.zeros(len(ids), dtype=np.uint8)
        mask[-5:] = 1  # the reply is at the end: a cut at 32 tokens leaves nothing to learn
        long_replies.append((ids, mask))
    data = _write_chat_dir(tmp_path / "long", long_replies)
    with pytest.raises(CorpusError, match=r"no sample to learn from at seq_len=32 .* use a larger model.seq_len"):
        check_chat_window(data, 32, overlong)
    with pytest.raises(CorpusError, match="no sample to learn from at seq_len=32"):  # the ranks say the same
        ChatSamples(data, "train", 32, overlong=overlong)
    check_chat_window(data, 64, overlong)  # a window they fit passes
    check_chat_window(_write_chat_dir(tmp_path / "mixed", [*long_replies, *_samples(2, 1, 64)]), 32, overlong)


def test_an_export_carries_the_chat_template_the_run_learned(hf_dir: Path, tmp_path: Path) -> None:
    """``xirang-ckpt export --format hf`` of a chat fine-tune: transformers renders prompts as the training data."""
    import shutil

    from transformers import AutoTokenizer

    from xirang_hpc.data.tokenizer import CHAT_TEMPLATE_FILE
    from xirang_hpc.weights.hf import _tokenizer_files

    run, out = tmp_path / "run", tmp_path / "hf"
    run.mkdir()
    out.mkdir()
    shutil.copyfile(hf_dir / "tokenizer.json", run / "tokenizer.json")
    tok = HFTokenizer(run / "tokenizer.json")
    r = ChatRenderer.for_tokenizer(tok, str(hf_dir), "assistant")
    (run / CHAT_TEMPLATE_FILE).write_text(json.dumps({"template": r.template, "special_tokens": r.special,
                                                      "stop": [], "sha256": r.sha256}))
    _tokenizer_files(run, out)
    theirs = AutoTokenizer.from_pretrained(out)
    msgs = conversation(random.Random(4))
    assert theirs.apply_chat_template(msgs, tokenize=False) == r.render(msgs)
    (run / CHAT_TEMPLATE_FILE).unlink()  # a plain-text run: no template is made up
    _tokenizer_files(run, out)
    assert "chat_template" not in json.loads((out / "tokenizer_config.json").read_text())
