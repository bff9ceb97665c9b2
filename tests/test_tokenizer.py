"""Tokenizers and corpora users bring: a BPE trained by xirang-prepare, an existing tokenizer.json or HF
model dir, JSONL and Parquet corpora, every bad-input case, and a run that trains, evaluates, serves
and exports with its BPE end to end."""

from __future__ import annotations

import asyncio
import io
import json
import subprocess
import sys
import sysconfig
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import compose_cfg
from tokenizers import Tokenizer as HFBackend
from tokenizers import decoders, models, pre_tokenizers, trainers

from xirang_hpc.config.errors import ConfigError
from xirang_hpc.config.validate import load_config
from xirang_hpc.data.dataset import TokenWindows
from xirang_hpc.data.prepare import CorpusError, load_index, prepare, prepared_mismatch, verify
from xirang_hpc.data.tokenizer import (
    EOT,
    ByteTokenizer,
    HFTokenizer,
    StreamDecoder,
    Tokenizer,
    TokenizerError,
    file_sha256,
    install_run_tokenizer,
    load_data_tokenizer,
    load_run_tokenizer,
    load_tokenizer,
)
from xirang_hpc.submit.rundir import experiment_key, run_dir_for

BIN = Path(sys.executable).parent
EMAIL = Path(sysconfig.get_paths()["stdlib"]) / "email"
TEXT = "héllo wörld — 日本語 🙂\n\tdef f(x):  return x  \n\n"

DOCS = [f"Document {i}: " + " ".join(f"word{j % 17} val={i * j}" for j in range(30 + i)) + (" ünïcode 🙂" * (i % 3))
        for i in range(60)]


def _backend(special: str = EOT, vocab: int = 400) -> HFBackend:
    """A byte-level BPE built with the tokenizers library itself (what a user brings)."""
    tok = HFBackend(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=[special], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(DOCS * 2, trainer)
    return tok


@pytest.fixture
def tok_file(tmp_path: Path) -> Path:
    p = tmp_path / "mytok" / "tokenizer.json"
    p.parent.mkdir()
    _backend().save(str(p))
    return p


def _tokens(out: Path, split: str) -> np.ndarray:
    parts = []
    for s in load_index(out)["splits"][split]:
        with h5py.File(out / s["file"], "r") as f:
            parts.append(f["tokens"][:])
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)


def _docs_of(out: Path, eos: int) -> list[tuple[int, ...]]:
    """Every document's ids (split at the end-of-text token), both splits, sorted."""
    docs = []
    for split in ("train", "val"):
        ids = _tokens(out, split).tolist()
        assert ids[-1] == eos, "every document ends with the end-of-text token"
        cur: list[int] = []
        for t in ids:
            if t == eos:
                docs.append(tuple(cur))
                cur = []
            else:
                cur.append(t)
    return sorted(docs)


# ---- the API -------------------------------------------------------------------------------------
def test_bpe_is_trained_stored_recorded_and_round_trips(small_corpus: Path, tmp_path: Path) -> None:
    out = tmp_path / "bpe"
    err = io.StringIO()
    index = prepare(str(small_corpus), out, val_fraction=0.2, tokenizer="bpe", vocab_size=300, progress=err)
    info = index["tokenizer_info"]
    assert info["kind"] == "bpe" and info["file"] == "tokenizer.json" and 257 <= info["vocab_size"] <= 300
    assert info["sha256"] == file_sha256(out / "tokenizer.json") and info["requested_vocab_size"] == 300
    assert index["vocab_size"] == info["vocab_size"] and index["tokenizer"].startswith(f"bpe-{info['vocab_size']}-")
    tok = load_data_tokenizer(out)
    assert isinstance(tok, HFTokenizer) and isinstance(tok, Tokenizer)
    assert tok.name == index["tokenizer"] and tok.eos_id == tok.backend.token_to_id(EOT) == info["eos_id"]
    assert tok.decode(tok.encode(TEXT)) == TEXT  # byte-level: unseen characters round-trip too
    assert len(tok.encode("def f0_1(x):\n    return x * 1 + 0\n")) < 20, "the merges compress the corpus"
    # The shards are the files' texts, each followed by <|endoftext|>; ids fit the vocabulary (uint16).
    train = _tokens(out, "train")
    assert train.dtype == np.uint16 and int(train.max()) < tok.vocab_size
    texts = sorted(p.read_text() for p in small_corpus.rglob("*.py"))
    assert sorted(tok.decode(d) for d in _docs_of(out, tok.eos_id)) == texts
    with h5py.File(out / index["splits"]["train"][0]["file"], "r") as f:
        assert f.attrs["tokenizer"] == tok.name and f.attrs["tokenizer_sha256"] == info["sha256"]
    verify(out)
    # The progress line names files, MB, tokens/s and ends with "done".
    lines = err.getvalue().splitlines()
    assert any(ln.startswith("xirang-prepare train-bpe: 12/12 files") for ln in lines), lines
    assert any(ln.startswith("xirang-prepare tokenize: 12/12 files") and "tokens/s" in ln and " MB" in ln
               and ln.endswith("done") for ln in lines), lines
    # The training windows read the BPE ids.
    w = TokenWindows(out, "train", 16)
    assert int(w.batch(0, 0, 4)[0].max()) < tok.vocab_size
    # A changed tokenizer.json is caught.
    (out / "tokenizer.json").write_text((out / "tokenizer.json").read_text().replace('"<|endoftext|>"', '"<|eot|>"'))
    with pytest.raises(TokenizerError, match="changed since the data was prepared"):
        load_data_tokenizer(out)
    with pytest.raises(CorpusError, match="tokenizer.json fails its checksum"):
        verify(out)


def test_byte_stays_the_default_with_no_tokenizer_file(small_corpus: Path, tmp_path: Path) -> None:
    index = prepare(str(small_corpus), tmp_path / "b", val_fraction=0.2, progress=None)
    assert index["tokenizer"] == "byte" and index["vocab_size"] == 256
    assert not (tmp_path / "b" / "tokenizer.json").exists()
    assert isinstance(load_data_tokenizer(tmp_path / "b"), ByteTokenizer)
    assert isinstance(load_tokenizer("byte"), ByteTokenizer) and ByteTokenizer().tokenizer_json is None
    assert isinstance(ByteTokenizer(), Tokenizer) and ByteTokenizer().eos_id is None
    assert isinstance(load_run_tokenizer(tmp_path), ByteTokenizer)


def test_existing_tokenizer_json_is_used_as_is(small_corpus: Path, tmp_path: Path, tok_file: Path) -> None:
    out = tmp_path / "out"
    index = prepare(str(small_corpus), out, val_fraction=0.2, tokenizer=str(tok_file), progress=None)
    assert (out / "tokenizer.json").read_bytes() == tok_file.read_bytes()
    assert index["tokenizer_info"]["sha256"] == file_sha256(tok_file)
    assert index["tokenizer_info"]["spec"] == str(tok_file)
    ref = HFBackend.from_file(str(tok_file))
    eos = ref.token_to_id(EOT)
    expected = sorted(tuple(ref.encode(p.read_text(), add_special_tokens=False).ids)
                      for p in small_corpus.rglob("*.py"))
    assert _docs_of(out, eos) == expected
    assert load_tokenizer(str(tok_file)).name == load_data_tokenizer(out).name


def test_hf_model_dir_is_used_with_its_own_eos_token(small_corpus: Path, tmp_path: Path) -> None:
    from transformers import PreTrainedTokenizerFast

    hf_dir = tmp_path / "hf-model"
    PreTrainedTokenizerFast(tokenizer_object=_backend(special="</s>"), eos_token="</s>").save_pretrained(hf_dir)
    tok = load_tokenizer(str(hf_dir))
    ref = PreTrainedTokenizerFast.from_pretrained(hf_dir)
    assert tok.eos_id == ref.eos_token_id and tok.tokenizer_json == str(hf_dir / "tokenizer.json")
    assert list(tok.encode(TEXT)) == ref.encode(TEXT, add_special_tokens=False)
    assert tok.decode(tok.encode(TEXT)) == ref.decode(ref.encode(TEXT)) == TEXT
    out = tmp_path / "out"
    index = prepare(str(small_corpus), out, val_fraction=0.2, tokenizer=str(hf_dir), progress=None)
    assert index["tokenizer_info"]["eos_id"] == ref.eos_token_id
    assert load_data_tokenizer(out).eos_id == ref.eos_token_id
    assert len(_docs_of(out, ref.eos_token_id)) == 12
    with pytest.raises(TokenizerError, match="without tokenizer.json"):
        load_tokenizer(str(tmp_path))


# ---- corpora -------------------------------------------------------------------------------------
def _corpora(tmp_path: Path) -> dict[str, Path]:
    text = tmp_path / "text"
    text.mkdir()
    for i, d in enumerate(DOCS):
        (text / f"doc{i:03d}.txt").write_text(d)
    jsonl = tmp_path / "docs.jsonl"
    jsonl.write_text("".join(json.dumps({"id": i, "body": d}) + "\n" for i, d in enumerate(DOCS)))
    parquet = tmp_path / "docs.parquet"
    pq.write_table(pa.table({"id": list(range(len(DOCS))), "body": DOCS}), parquet, row_group_size=7)
    mixed = tmp_path / "mixed"
    (mixed / "sub").mkdir(parents=True)
    for i, d in enumerate(DOCS[:20]):
        (mixed / f"doc{i:03d}.txt").write_text(d)
    (mixed / "sub" / "b.jsonl").write_text("".join(json.dumps({"body": d}) + "\n" for d in DOCS[20:40]))
    pq.write_table(pa.table({"body": DOCS[40:]}), mixed / "c.parquet")
    return {"text": text, "jsonl": jsonl, "parquet": parquet, "mixed": mixed}


def test_jsonl_parquet_and_mixed_corpora_give_the_same_tokens_as_text(tmp_path: Path, tok_file: Path) -> None:
    eos = HFBackend.from_file(str(tok_file)).token_to_id(EOT)
    got = {}
    corpora = _corpora(tmp_path)
    for kind, corpus in corpora.items():
        out = tmp_path / f"out-{kind}"
        index = prepare(str(corpus), out, val_fraction=0.2, tokenizer=str(tok_file), text_field="body",
                        shard_tokens=2000, progress=None)
        assert index["documents"]["train"] + index["documents"]["val"] == len(DOCS)
        assert index["documents"]["val"] >= 1 and index["skipped_records"]["total"] == 0
        got[kind] = _docs_of(out, eos)
    assert got["jsonl"] == got["text"] == got["parquet"] == got["mixed"]
    # Byte tokens too: each record is its text plus the blank line a text file gets.
    byte_docs = {}
    for kind in ("text", "jsonl"):
        out = tmp_path / f"bytes-{kind}"
        prepare(str(corpora[kind]), out, val_fraction=0.2, text_field="body", progress=None)
        byte_docs[kind] = sorted((_tokens(out, "train").tobytes() + _tokens(out, "val").tobytes()).split(b"\n\n"))
    assert byte_docs["text"] == byte_docs["jsonl"]


def test_records_are_split_by_a_hash_of_their_position(tmp_path: Path) -> None:
    c = _corpora(tmp_path)
    a = prepare(str(c["jsonl"]), tmp_path / "a", val_fraction=0.2, text_field="body", progress=None)
    b = prepare(str(c["jsonl"]), tmp_path / "b", val_fraction=0.2, text_field="body", progress=None)
    assert a["splits"] == b["splits"] and 3 <= a["documents"]["val"] <= 25


def test_a_single_text_file_gives_its_tail_to_val(tmp_path: Path) -> None:
    p = tmp_path / "book.txt"
    text = "".join(f"line {i}: {DOCS[i % len(DOCS)]}\n" for i in range(400))
    p.write_text(text)
    out = tmp_path / "out"
    index = prepare(str(p), out, val_fraction=0.1, progress=None)
    train, val = _tokens(out, "train").tobytes().decode(), _tokens(out, "val").tobytes().decode()
    assert train.endswith("\n\n") and val.endswith("\n\n") and val.startswith("line ")
    assert train[:-2] + val[:-2] == text  # cut at a line start, each part + the blank-line separator
    assert 0.05 < len(val) / len(text) < 0.15 and index["documents"] == {"train": 1, "val": 1}


def test_a_corrupt_parquet_file_is_named(tmp_path: Path) -> None:
    p = tmp_path / "c.parquet"
    p.write_bytes(b"PAR1 this is not really parquet")
    with pytest.raises(CorpusError, match="c.parquet: not a readable Parquet file"):
        prepare(str(p), tmp_path / "out", progress=None)


# ---- bad input -----------------------------------------------------------------------------------
def _jsonl(tmp_path: Path, lines: list[str]) -> Path:
    p = tmp_path / "c.jsonl"
    p.write_text("\n".join(lines) + "\n")
    return p


GOOD = [json.dumps({"text": d}) for d in DOCS[:30]]


@pytest.mark.parametrize("bad, reason, message", [
    ('{"text": "unterminated', "not_json", "c.jsonl:3: line is not valid JSON"),
    ('{"title": "no text here", "lang": "en"}', "missing_field",
     "c.jsonl:3: record has no 'text' field (its fields: lang, title); set data.text_field="),
    ('{"text": "   "}', "empty_text", "c.jsonl:3: field 'text' is empty"),
    ('[1, 2, 3]', "not_object", "c.jsonl:3: record is a JSON list, not an object"),
])
def test_a_bad_jsonl_record_fails_naming_file_and_line_or_is_skipped_and_counted(
        tmp_path: Path, bad: str, reason: str, message: str) -> None:
    p = _jsonl(tmp_path, GOOD[:2] + [bad] + GOOD[2:])
    with pytest.raises(CorpusError) as ei:
        prepare(str(p), tmp_path / "out", val_fraction=0.2, progress=None)
    assert message in str(ei.value) and "data.on_bad_record=skip" in str(ei.value)
    assert not (tmp_path / "out" / "index.json").exists(), "a failed preparation leaves no index"
    index = prepare(str(p), tmp_path / "out", val_fraction=0.2, on_bad_record="skip", progress=None)
    assert index["skipped_records"][reason] == 1 and index["skipped_records"]["total"] == 1
    assert index["documents"]["train"] + index["documents"]["val"] == len(GOOD)
    assert json.loads((tmp_path / "out" / "index.json").read_text())["skipped_records"][reason] == 1


def test_parquet_without_the_text_column_names_the_columns_it_has(tmp_path: Path) -> None:
    p = tmp_path / "c.parquet"
    pq.write_table(pa.table({"id": [1, 2], "content": ["a b", "c d"]}), p)
    with pytest.raises(CorpusError, match=r"c.parquet: Parquet file has no column 'text' \(its columns: id, content\)"):
        prepare(str(p), tmp_path / "out", progress=None)
    pq.write_table(pa.table({"text": [1, 2]}), p)
    with pytest.raises(CorpusError, match="column 'text' is int64, not a string column"):
        prepare(str(p), tmp_path / "out", progress=None)
    pq.write_table(pa.table({"text": [d if i != 4 else None for i, d in enumerate(DOCS)]}), p)
    with pytest.raises(CorpusError, match="c.parquet: row 4: column 'text' is null"):
        prepare(str(p), tmp_path / "out", progress=None)
    index = prepare(str(p), tmp_path / "out", on_bad_record="skip", val_fraction=0.2, progress=None)
    assert index["skipped_records"]["missing_field"] == 1


def test_unknown_tokenizer_path_and_too_small_bpe_fail_clearly(small_corpus: Path, tmp_path: Path) -> None:
    with pytest.raises(CorpusError, match="data.tokenizer='/no/such/tok.json': no such file"):
        prepare(str(small_corpus), tmp_path / "o", tokenizer="/no/such/tok.json", progress=None)
    with pytest.raises(CorpusError, match="data.vocab_size=100: a byte-level BPE needs at least 257"):
        prepare(str(small_corpus), tmp_path / "o", tokenizer="bpe", vocab_size=100, progress=None)
    with pytest.raises(ConfigError, match="data.tokenizer='/no/such/tok.json'"):
        load_config(compose_cfg(["data.tokenizer=/no/such/tok.json"]))


def test_a_tokenizer_larger_than_the_model_is_refused_before_launch(tok_file: Path) -> None:
    n = HFBackend.from_file(str(tok_file)).get_vocab_size()
    with pytest.raises(ConfigError) as ei:
        load_config(compose_cfg([f"data.tokenizer={tok_file}"]))  # model=tiny: vocab_size 256
    msg = str(ei.value)
    assert f"has {n} tokens, more than model.vocab_size=256" in msg and f"set model.vocab_size={n}" in msg
    with pytest.raises(ConfigError, match="has 1024 tokens, more than model.vocab_size=512.*model.vocab_size=1024"):
        load_config(compose_cfg(["data.tokenizer=bpe", "data.vocab_size=1024", "model.vocab_size=512"]))
    with pytest.raises(ConfigError, match="data.vocab_size=256: a byte-level BPE needs at least 257"):
        load_config(compose_cfg(["data.tokenizer=bpe"]))  # data.vocab_size=0 -> model.vocab_size=256
    cfg = load_config(compose_cfg(["data.tokenizer=bpe", "model.vocab_size=512"]))
    assert cfg.data.vocab_size == 512
    assert load_config(compose_cfg([f"data.tokenizer={tok_file}", f"model.vocab_size={n}"])).data.tokenizer


def test_the_tokenizer_is_part_of_the_experiment_identity(tmp_path: Path, tok_file: Path) -> None:
    base = ["model.vocab_size=512"]
    byte = load_config(compose_cfg(base))
    # Byte runs keep the run-directory names they had: none of the new data fields enter their key.
    assert set(experiment_key(byte)["data"]) == {"corpus", "tokenizer", "val_fraction", "split_seed"}
    bpe = load_config(compose_cfg([*base, "data.tokenizer=bpe"]))
    bpe2 = load_config(compose_cfg([*base, "data.tokenizer=bpe", "data.vocab_size=400"]))
    f1 = load_config(compose_cfg([*base, f"data.tokenizer={tok_file}"]))
    copy = tmp_path / "copy.json"
    copy.write_bytes(tok_file.read_bytes())
    f1_copy = load_config(compose_cfg([*base, f"data.tokenizer={copy}"]))
    other = tmp_path / "other.json"
    _backend(vocab=380).save(str(other))
    f2 = load_config(compose_cfg([*base, f"data.tokenizer={other}"]))
    dirs = [run_dir_for(c) for c in (byte, bpe, bpe2, f1, f2)]
    assert len(set(dirs)) == 5, dirs
    assert run_dir_for(f1_copy) == run_dir_for(f1), "the same tokenizer.json at another path is the same run"
    assert experiment_key(f1)["data"]["tokenizer"] == {"kind": "file", "sha256": file_sha256(tok_file)}


def test_a_run_dir_keeps_its_tokenizer(small_corpus: Path, tmp_path: Path, tok_file: Path) -> None:
    bpe, byte, run = tmp_path / "bpe", tmp_path / "byte", tmp_path / "run"
    run.mkdir()
    prepare(str(small_corpus), bpe, val_fraction=0.2, tokenizer=str(tok_file), progress=None)
    prepare(str(small_corpus), byte, val_fraction=0.2, progress=None)
    tok = install_run_tokenizer(bpe, run)
    assert (run / "tokenizer.json").read_bytes() == tok_file.read_bytes() and tok.name == load_run_tokenizer(run).name
    assert oct((run / "tokenizer.json").stat().st_mode & 0o777) == "0o600"
    install_run_tokenizer(bpe, run)  # a restart with the same data is fine
    with pytest.raises(TokenizerError, match="was trained with tokenizer .* but the data .* uses byte"):
        install_run_tokenizer(byte, run)
    # Data prepared with another tokenizer than the config asks for is named, not silently used.
    d = load_config(compose_cfg(["model.vocab_size=512", "data.tokenizer=bpe"])).data
    assert "was prepared with tokenizer byte (byte), not data.tokenizer=bpe" in prepared_mismatch(d, byte)
    assert prepared_mismatch(load_config(compose_cfg([])).data, byte) is None


def test_xirang_train_refuses_data_prepared_with_another_tokenizer(small_corpus: Path, tmp_path: Path) -> None:
    prepare(str(small_corpus), tmp_path / "byte", val_fraction=0.2, progress=None)
    r = subprocess.run([str(BIN / "xirang-train"), "model.vocab_size=512", "data.tokenizer=bpe",
                        f"data.out_dir={tmp_path / 'byte'}", f"train.runs_root={tmp_path / 'runs'}",
                        "cluster.nodes=1", "cluster.tasks_per_node=1", "parallel.pp=1"],
                       cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert r.returncode == 2, r.stdout + r.stderr
    assert (f"{tmp_path / 'byte'} was prepared with tokenizer byte (byte), not data.tokenizer=bpe "
            "(data.vocab_size=512); set data.out_dir=") in r.stderr
    assert not (tmp_path / "runs").exists(), "nothing was submitted, no run directory made"


def test_stream_decoder_holds_back_incomplete_characters(tok_file: Path) -> None:
    for tok in (ByteTokenizer(), HFTokenizer(tok_file)):
        ids = [int(t) for t in tok.encode(TEXT)]
        dec = StreamDecoder(tok)
        pieces = [dec.push(t) for t in ids]
        assert "".join(pieces) == TEXT and all("\ufffd" not in p for p in pieces)


# ---- end to end ----------------------------------------------------------------------------------
@pytest.mark.slow
def test_a_run_trains_evaluates_serves_and_exports_with_its_bpe(tmp_path: Path) -> None:
    r = subprocess.run([str(BIN / "xirang-pipeline"), "model=tiny", "model.vocab_size=512", "data.tokenizer=bpe",
                        f"data.corpus={EMAIL}", f"data.out_dir={tmp_path}/data", "data.val_fraction=0.2",
                        "cluster.nodes=1", "cluster.tasks_per_node=2", "parallel.pp=1", "train.max_steps=10",
                        "train.warmup_steps=2", "train.log_every=5", "train.global_batch=8",
                        f"train.runs_root={tmp_path}/runs", "eval.batches=2", "eval.sample_tokens=24",
                        "serve.port=0", "serve.duration_s=1"],
                       cwd=tmp_path, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "xirang-prepare tokenize:" in r.stderr  # the progress line
    (run,) = (tmp_path / "runs").iterdir()
    data_tok = load_data_tokenizer(tmp_path / "data")
    assert isinstance(data_tok, HFTokenizer) and data_tok.vocab_size == 512
    assert file_sha256(run / "tokenizer.json") == data_tok.sha256, "the job copied the tokenizer into the run"
    ev = json.loads((run / "eval.json").read_text())
    assert ev["tokenizer"] == data_tok.name

    from xirang_hpc.eval.evaluate import sample
    from xirang_hpc.serve.engine import Engine
    from xirang_hpc.weights.load import load_any, load_checkpoint

    loaded = load_checkpoint(run)
    assert loaded.tokenizer.name == data_tok.name and loaded.step == 10
    engine = Engine(loaded.model, loaded.cfg.seq_len, max_batch=1)
    try:
        ids = engine.generate([[int(t) for t in data_tok.encode("def ")]], 24, temperature=0.0)[0]
    finally:
        engine.stop()
    assert ev["sample"] == data_tok.decode(ids) == sample(loaded, "def ", 24)

    info, plain, lines = asyncio.run(_serve(loaded))
    assert info["tokenizer"] == data_tok.name and info["tokenizer_info"]["sha256"] == data_tok.sha256
    assert info["tokenizer_info"]["vocab_size"] == 512
    assert plain["tokenizer"] == data_tok.name and plain["prompt_tokens"] == len(data_tok.encode("def "))
    assert plain["text"] == data_tok.decode(ids[:12])
    assert "".join(x["text"] for x in lines[:-1]) == lines[-1]["text"] == plain["text"]

    ex = subprocess.run([str(BIN / "xirang-ckpt"), "export", str(run), "--format", "safetensors"],
                        capture_output=True, text=True, timeout=300)
    assert ex.returncode == 0, ex.stderr
    (exp,) = (run / "export").iterdir()
    assert file_sha256(exp / "tokenizer.json") == data_tok.sha256
    assert json.loads((exp / "config.json").read_text())["tokenizer"]["name"] == data_tok.name
    assert load_any(exp / "model.safetensors").tokenizer.name == data_tok.name


async def _serve(loaded: Any) -> tuple[dict[str, Any], dict[str, Any], list[dict[str, Any]]]:
    from aiohttp import ClientSession
    from aiohttp.test_utils import TestServer

    from xirang_hpc.serve.engine import Engine
    from xirang_hpc.serve.server import Limits, Server

    engine = Engine(loaded.model, loaded.cfg.seq_len, 4).start()
    ts = TestServer(Server(loaded, engine, Limits(max_prompt_tokens=64, max_new_tokens=32)).app(), host="127.0.0.1")
    await ts.start_server()
    try:
        url = str(ts.make_url("")).rstrip("/")
        async with ClientSession() as s:
            async with s.get(f"{url}/v1/model") as r:
                info = await r.json()
            body = {"prompt": "def ", "max_tokens": 12}
            async with s.post(f"{url}/v1/generate", json=body) as r:
                plain = await r.json()
            async with s.post(f"{url}/v1/generate", json={**body, "stream": True}) as r:
                lines = [json.loads(x) for x in (await r.text()).splitlines()]
    finally:
        await ts.close()
        engine.stop()
    return info, plain, lines
