"""Corpus -> HDF5 token shards with a train/val split.

Layout of ``out_dir``::

    train_00000.h5, train_00001.h5, ...   dataset "tokens" (uint8 for bytes, uint16/uint32 for larger vocabs)
    val_00000.h5, ...
    tokenizer.json                        unless the tokenizer is ``byte``
    index.json                            shards, token counts, checksums, source, tokenizer, skipped records

Corpora: a directory (or one file) of text files, JSONL (``.jsonl``/``.ndjson``: one JSON object per
line, text in ``data.text_field``) and Parquet (``.parquet``: the same column), chosen by extension;
a directory may mix them. Everything is streamed: one text file, one JSONL line or one Parquet
record batch at a time, encoded in large batches (``encode_batch``, all cores).

Documents are separated by the tokenizer's end-of-text token (``<|endoftext|>`` for a trained BPE);
the byte tokenizer has none and separates them by a blank line, as it always has.

Every shard carries HDF5 attributes: tokenizer, vocab_size, source, n_tokens, sha256.
Text files go to the train or val split by a hash of their relative path, records by a hash of
``path:line`` (JSONL) or ``path:row`` (Parquet), so adding data never moves other documents between
splits; a corpus that is one text file gives its last ``val_fraction`` (from a line start) to val.
The index is written last, via rename: a directory without ``index.json`` is an
unfinished preparation and is redone. A preparation holds ``.prepare.lock`` (flock) on ``out_dir``: two
jobs preparing the same directory (two pipelines, a sweep, two users of one shared dataset) take turns,
and with :func:`ensure_prepared` the second finds the first one's data instead of writing over it.

Chat and preference-pair corpora (``data.format=chat``/``pairs``: samples with loss masks) are prepared by
:mod:`xirang_hpc.data.prepare_chat`, with this module's lock, tokenizer and index.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any

import h5py
import numpy as np

from xirang_hpc.data.corpus import (  # noqa: F401 - re-exported: the data API callers use
    JSONL_SUFFIXES,
    PARQUET_SUFFIXES,
    TEXT_SUFFIXES,
    ChatRecord,
    CorpusError,
    CorpusScan,
    Doc,
    RecordStats,
    _Progress,
    assign_splits,
    file_kind,
    iter_chat_records,
    iter_documents,
    resolve_corpus,
    scan_corpus,
)
from xirang_hpc.data.tokenizer import (
    CHAT_TEMPLATE_FILE,
    EOT,
    TOKENIZER_FILE,
    ByteTokenizer,
    HFTokenizer,
    Tokenizer,
    TokenizerError,
    copy_tokenizer_file,
    encode_batch,
    file_sha256,
    load_tokenizer,
    token_dtype,
    tokenizer_info,
)
from xirang_hpc.files import make_dir, record_mode

log = logging.getLogger(__name__)

INDEX = "index.json"
LOCK_FILE = ".prepare.lock"
BATCH_CHARS = 4 << 20
BATCH_DOCS = 4096


def encode_documents(tok: Tokenizer, docs: Iterator[Doc], batch_chars: int = BATCH_CHARS,
                     batch_docs: int = BATCH_DOCS) -> Iterator[tuple[Doc, np.ndarray]]:
    """(document, its tokens followed by the separator) for every document, encoded in large batches."""
    eos = tok.eos_id
    dtype = token_dtype(tok.vocab_size)
    sep = np.asarray([eos], dtype=dtype) if eos is not None else None
    batch: list[Doc] = []
    chars = 0

    def flush() -> Iterator[tuple[Doc, np.ndarray]]:
        # Bytes have no end-of-text token: a blank line separates documents, as it always has.
        texts = [d.text if sep is not None else d.text + "\n\n" for d in batch]
        for d, ids in zip(batch, encode_batch(tok, texts)):
            arr = np.asarray(ids, dtype=dtype)
            yield d, (np.concatenate([arr, sep]) if sep is not None else arr)

    for doc in docs:
        batch.append(doc)
        chars += len(doc.text)
        if chars >= batch_chars or len(batch) >= batch_docs:
            yield from flush()
            batch, chars = [], 0
    if batch:
        yield from flush()


def train_bpe(texts: Iterator[str], vocab_size: int) -> Any:
    """A byte-level BPE (``tokenizers``) trained on ``texts``, with ``<|endoftext|>`` as its special token."""
    from tokenizers import Tokenizer as _HF
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = _HF(models.BPE())
    # Byte-level: every string is representable (no unknown token) and decode(encode(s)) == s.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOT], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    return tok


class _ShardWriter:
    """Appends token arrays to fixed-size HDF5 shards of one split."""

    def __init__(self, out: Path, split: str, shard_tokens: int, attrs: dict[str, object]) -> None:
        self.out, self.split, self.shard_tokens, self.attrs = out, split, shard_tokens, attrs
        self.buf: list[np.ndarray] = []
        self.n = 0
        self.shards: list[dict[str, object]] = []

    def add(self, tokens: np.ndarray) -> None:
        self.buf.append(tokens)
        self.n += len(tokens)
        while self.n >= self.shard_tokens:
            allt = np.concatenate(self.buf)
            self._write(allt[: self.shard_tokens])
            rest = allt[self.shard_tokens :]
            self.buf, self.n = [rest], len(rest)

    def close(self) -> list[dict[str, object]]:
        if self.n:
            self._write(np.concatenate(self.buf))
        return self.shards

    def _write(self, tokens: np.ndarray) -> None:
        name = f"{self.split}_{len(self.shards):05d}.h5"
        digest = hashlib.sha256(tokens.tobytes()).hexdigest()
        with h5py.File(self.out / name, "w", locking=False) as f:
            # Chunked so random windows read only the chunks they touch.
            f.create_dataset("tokens", data=tokens, chunks=(min(len(tokens), 1 << 16),))
            f.attrs.update(self.attrs)
            f.attrs["split"] = self.split
            f.attrs["n_tokens"] = len(tokens)
            f.attrs["sha256"] = digest
        self.shards.append({"file": name, "n_tokens": int(len(tokens)), "sha256": digest})


def _make_tokenizer(spec: str, vocab_size: int, out: Path, docs: Callable[..., Iterator[Doc]],
                    n_files: int, total_bytes: int, stream: IO[str] | None) -> Tokenizer:
    """The tokenizer for ``spec``, with its tokenizer.json stored in ``out`` (bpe: trained here first)."""
    if spec == "byte":
        return ByteTokenizer()
    if spec == "bpe":
        prog = _Progress("train-bpe", n_files, total_bytes, stream)
        # The BPE learns from the train split only: validation text stays unseen.
        texts = (d.text for d in docs(RecordStats(), prog) if d.split == "train")
        _tmp = out / f".{TOKENIZER_FILE}.tmp"
        train_bpe(texts, vocab_size).save(str(_tmp))
        prog.close()
        os.replace(_tmp, out / TOKENIZER_FILE)
        return HFTokenizer(out / TOKENIZER_FILE)
    try:
        src = load_tokenizer(spec)
    except TokenizerError as exc:
        raise CorpusError(str(exc)) from None
    assert src.tokenizer_json is not None
    copy_tokenizer_file(src.tokenizer_json, out)
    tok = HFTokenizer(out / TOKENIZER_FILE)
    tok.eos_id = src.eos_id  # an HF dir may name its eos token in tokenizer_config.json
    return tok


def prepare(
    corpus: str,
    out_dir: str | Path,
    val_fraction: float = 0.01,
    shard_tokens: int = 16 * 1024 * 1024,
    split_seed: int = 0,
    tokenizer: str = "byte",
    vocab_size: int = 0,
    text_field: str = "text",
    on_bad_record: str = "fail",
    progress: IO[str] | None | str = "stderr",
    fmt: str = "text",
    train_on: str = "assistant",
) -> dict[str, object]:
    """Tokenize ``corpus`` into shards under ``out_dir``; returns the index (also in index.json).

    ``tokenizer``: ``byte``, ``bpe`` (trained here on the train split, ``vocab_size`` tokens), a
    tokenizer.json path or an HF model dir. ``progress``: where the progress line goes (None: nowhere).
    ``fmt``: ``text`` (documents) or ``chat`` (conversations, with loss masks chosen by ``train_on``).
    """
    with prepare_lock(out_dir):
        return _prepare(corpus, Path(out_dir), val_fraction, shard_tokens, split_seed, tokenizer, vocab_size,
                        text_field, on_bad_record, progress, fmt, train_on)


def _out_dir_error(out: Path, exc: OSError) -> CorpusError:
    return CorpusError(f"data.out_dir={str(out)!r} cannot be written ({exc.strerror or exc}: "
                       f"{exc.filename or out}); set data.out_dir= to a writable directory or fix its permissions")


@contextlib.contextmanager
def prepare_lock(out_dir: str | Path) -> Iterator[None]:
    """Hold the exclusive preparation lock of ``out_dir`` (created if needed), waiting for another holder.

    A lock file, not the index: a preparation that dies leaves no stale lock (the kernel drops a flock with
    its holder), and its half-written shards are redone by the next one, which finds no ``index.json``.
    """
    out = Path(out_dir)
    try:
        make_dir(out)  # private, or the share group's (its shards are the training data)
        fd = os.open(out / LOCK_FILE, os.O_CREAT | os.O_RDWR, record_mode())
    except OSError as exc:
        raise _out_dir_error(out, exc) from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"xirang-prepare: waiting for another preparation of {out} to finish ...", file=sys.stderr,
                  flush=True)
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def ensure_prepared(d: Any, out_dir: str | Path, progress: IO[str] | None | str = "stderr") -> Path:
    """``out_dir`` prepared as ``data.*`` (a ``DataConfig``) asks: prepared here unless a finished preparation
    is there already (made by another job while this one waited for the lock, too); data prepared with
    another tokenizer is refused (:class:`CorpusError`), never overwritten."""
    out = Path(out_dir).expanduser().absolute()
    if not is_prepared(out):
        with prepare_lock(out):
            if not is_prepared(out):
                print(f"preparing data from {d.corpus!r} into {out} (tokenizer {d.tokenizer}) ...", flush=True)
                _prepare(d.corpus, out, d.val_fraction, d.shard_tokens, d.split_seed, d.tokenizer, d.vocab_size,
                         d.text_field, d.on_bad_record, progress, *_chat_options(d))
                return out
    if (why := prepared_mismatch(d, out)) is not None:
        raise CorpusError(why)
    return out


def _prepare(corpus: str, out: Path, val_fraction: float, shard_tokens: int, split_seed: int, tokenizer: str,
             vocab_size: int, text_field: str, on_bad_record: str,
             progress: IO[str] | None | str, fmt: str = "text", train_on: str = "assistant") -> dict[str, object]:
    """:func:`prepare`, with the lock held."""
    if isinstance(progress, str):  # resolved per call: pytest and the CLIs swap sys.stderr
        progress = sys.stderr
    try:
        make_dir(out)
        (out / INDEX).unlink(missing_ok=True)
        (out / TOKENIZER_FILE).unlink(missing_ok=True)
        (out / CHAT_TEMPLATE_FILE).unlink(missing_ok=True)
        for old in out.glob("*.h5"):
            old.unlink()
        os.close(os.open(out / ".write-probe", os.O_CREAT | os.O_WRONLY, 0o600))
        os.unlink(out / ".write-probe")
    except OSError as exc:
        raise _out_dir_error(out, exc) from None
    if on_bad_record not in ("fail", "skip"):
        raise CorpusError(f"data.on_bad_record={on_bad_record!r}: choose fail or skip")
    if tokenizer == "bpe" and vocab_size < 257:
        raise CorpusError(f"data.vocab_size={vocab_size}: a byte-level BPE needs at least 257 tokens "
                          "(256 bytes + <|endoftext|>); set data.vocab_size=...")
    scan = scan_corpus(corpus)
    root = resolve_corpus(corpus)
    if scan.special:
        print(f"xirang-prepare: warning: skipped {len(scan.special)} special file(s) of the corpus (FIFOs, sockets, "
              f"devices: only regular files are read), e.g. {scan.special[0]}", file=sys.stderr, flush=True)
    if root.is_dir() and not scan.records and len(scan.files) < 2:
        raise CorpusError(
            f"corpus {str(root)!r} has {len(scan.files)} usable file; a train/val split needs at least 2 "
            "text files (or JSONL/Parquet records)"
        )
    n_files = len(scan.all_files)
    total_bytes = sum(p.stat().st_size for p in scan.all_files)

    if fmt in ("chat", "pairs"):
        # Imported here: that module builds on this one's tokenizer and index helpers.
        from xirang_hpc.data.prepare_chat import _prepare_chat

        return _prepare_chat(scan, root, out, val_fraction, shard_tokens, split_seed, tokenizer, vocab_size,
                             on_bad_record, progress, train_on, fmt)

    def docs(stats: RecordStats | None = None, prog: _Progress | None = None) -> Iterator[Doc]:
        return iter_documents(scan, root, text_field, on_bad_record, val_fraction, split_seed, stats, prog)

    tok = _make_tokenizer(tokenizer, vocab_size, out, docs, n_files, total_bytes, progress)
    info = _tokenizer_record(tok, tokenizer, vocab_size, out)
    attrs: dict[str, object] = {"tokenizer": tok.name, "vocab_size": tok.vocab_size, "source": str(root)}
    if info.get("sha256"):
        attrs["tokenizer_sha256"] = info["sha256"]
    writers = {s: _ShardWriter(out, s, shard_tokens, attrs) for s in ("train", "val")}
    stats = RecordStats()
    prog = _Progress("tokenize", n_files, total_bytes, progress)
    files: dict[str, set[Path]] = {"train": set(), "val": set()}
    n_docs = {"train": 0, "val": 0}
    for doc, ids in encode_documents(tok, docs(stats, prog)):
        writers[doc.split].add(ids)
        files[doc.split].add(doc.source)
        n_docs[doc.split] += 1
        prog.update(tokens=len(ids))
    prog.close()
    empty = [s for s in ("train", "val") if not n_docs[s]]
    if empty:
        raise CorpusError(f"corpus {str(root)!r} left the {empty[0]} split empty ({sum(n_docs.values())} documents, "
                          f"data.val_fraction={val_fraction}); add documents or adjust data.val_fraction")
    index: dict[str, Any] = {
        "tokenizer": tok.name,
        "vocab_size": tok.vocab_size,
        "tokenizer_info": info,
        "source": str(root),
        "text_field": text_field,
        "files": {s: len(files[s]) for s in ("train", "val")},
        "documents": n_docs,
        **_index_tail(scan, stats, on_bad_record, writers),
    }
    _write_index(out, index)
    log.info(
        "prepared %s: %d train tokens, %d val tokens (%d files; skipped %d binary, %d unreadable, %d records)",
        out, index["train_tokens"], index["val_tokens"], n_files, len(scan.binary),
        len(scan.unreadable), stats.as_dict()["total"],
    )
    return index


def _tokenizer_record(tok: Tokenizer, spec: str, vocab_size: int, out: Path) -> dict[str, Any]:
    """The index's ``tokenizer_info``: the tokenizer's own description, plus the file it was saved to (with its
    checksum), what ``data.tokenizer`` said and, for a trained BPE, the vocabulary size asked for."""
    info = tokenizer_info(tok)
    if tok.tokenizer_json is not None:
        info["file"] = TOKENIZER_FILE
        info["sha256"] = file_sha256(out / TOKENIZER_FILE)
        info["spec"] = "bpe" if spec == "bpe" else str(Path(spec).expanduser().absolute())
        if spec == "bpe":
            info["requested_vocab_size"] = vocab_size
    return info


def _index_tail(scan: CorpusScan, stats: RecordStats, on_bad_record: str, writers: dict[str, Any]) -> dict[str, Any]:
    """What every index ends with, whatever the format: what was skipped and why, and each split's shards
    (closing the writers: the last shard of each split is written here)."""
    return {"skipped_binary": len(scan.binary), "skipped_unreadable": len(scan.unreadable),
            "skipped_special": len(scan.special), "skipped_records": stats.as_dict(), "on_bad_record": on_bad_record,
            "splits": {s: w.close() for s, w in writers.items()}}


def _write_index(out: Path, index: dict[str, Any]) -> None:
    """Token totals per split, then index.json written last, by rename (its presence means finished)."""
    for s in ("train", "val"):
        index[f"{s}_tokens"] = sum(int(x["n_tokens"]) for x in index["splits"][s])
    tmp = out / (INDEX + ".tmp")
    tmp.write_text(json.dumps(index, indent=1))
    os.replace(tmp, out / INDEX)


def prepare_data(d: Any, out_dir: str | Path | None = None,
                 progress: IO[str] | None | str = "stderr") -> dict[str, object]:
    """:func:`prepare` with the options of a ``DataConfig`` (``data.*``)."""
    return prepare(d.corpus, out_dir if out_dir is not None else d.out_dir, d.val_fraction, d.shard_tokens,
                   d.split_seed, tokenizer=d.tokenizer, vocab_size=d.vocab_size, text_field=d.text_field,
                   on_bad_record=d.on_bad_record, progress=progress, fmt=_chat_options(d)[0],
                   train_on=_chat_options(d)[1])


def prepared_mismatch(d: Any, out_dir: str | Path) -> str | None:
    """Why the data already prepared in ``out_dir`` is not what ``data.*`` asks for (None: it is)."""
    try:
        index = load_index(out_dir)
    except CorpusError:
        return None
    info = index.get("tokenizer_info") or {"kind": index.get("tokenizer", "byte")}
    have = str(info.get("spec") or info.get("kind"))
    if d.tokenizer == "byte":
        ok = have == "byte"
    elif d.tokenizer == "bpe":
        ok = have == "bpe" and info.get("requested_vocab_size") == d.vocab_size
    else:
        try:
            from xirang_hpc.data.tokenizer import resolve_tokenizer_file

            ok = info.get("sha256") == file_sha256(resolve_tokenizer_file(d.tokenizer))
        except (TokenizerError, OSError):
            ok = False
    if ok:
        from xirang_hpc.data.prepare_chat import _chat_mismatch  # here: that module imports this one

        return _chat_mismatch(d, index, out_dir)
    want = f"{d.tokenizer} (data.vocab_size={d.vocab_size})" if d.tokenizer == "bpe" else d.tokenizer
    return (f"{out_dir} was prepared with tokenizer {index.get('tokenizer')} ({have}), not data.tokenizer={want}; "
            "set data.out_dir= to another directory or rerun xirang-prepare")


def _chat_options(d: Any) -> tuple[str, str]:
    """(``data.format``, ``data.train_on``) of a data config (text/assistant for objects that predate them)."""
    return getattr(d, "format", "text"), getattr(d, "train_on", "assistant")


def is_prepared(out_dir: str | Path) -> bool:
    """True when a finished preparation (index.json written last) exists."""
    return (Path(out_dir) / INDEX).is_file()


def load_index(out_dir: str | Path) -> dict[str, Any]:
    """Read index.json, with a clear error if preparation never finished."""
    p = Path(out_dir) / INDEX
    if not p.is_file():
        raise CorpusError(f"{out_dir} holds no prepared data (no {INDEX}); run xirang-prepare first")
    return json.loads(p.read_text())


def verify(out_dir: str | Path) -> None:
    """Recompute every shard's checksum against its attributes and the index."""
    index = load_index(out_dir)
    for split, shards in index["splits"].items():
        for s in shards:
            with h5py.File(Path(out_dir) / s["file"], "r", locking=False) as f:
                digest = hashlib.sha256(f["tokens"][:].tobytes()).hexdigest()
                if digest != s["sha256"] or f.attrs["sha256"] != digest:
                    raise CorpusError(f"{split} shard {s['file']} fails its checksum; rerun xirang-prepare")
                for key, ds in (("mask_sha256", "loss_mask"), ("offsets_sha256", "offsets")):
                    if key in s and (hashlib.sha256(f[ds][:].tobytes()).hexdigest() != s[key]
                                     or f.attrs[key] != s[key]):
                        raise CorpusError(f"{split} shard {s['file']} fails its {ds} checksum; rerun xirang-prepare")
    tok = index.get("tokenizer_info") or {}
    if tok.get("file") and file_sha256(Path(out_dir) / tok["file"]) != tok.get("sha256"):
        raise CorpusError(f"{Path(out_dir) / tok['file']} fails its checksum; rerun xirang-prepare")
    chat = index.get("chat_template_file") or {}
    if chat.get("file") and file_sha256(Path(out_dir) / chat["file"]) != chat.get("sha256"):
        raise CorpusError(f"{Path(out_dir) / chat['file']} fails its checksum; rerun xirang-prepare")
