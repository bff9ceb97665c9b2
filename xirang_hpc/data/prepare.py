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
unfinished preparation and is redone.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import sys
import sysconfig
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import h5py
import numpy as np

from xirang_hpc.data.tokenizer import (
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

log = logging.getLogger(__name__)

INDEX = "index.json"
TEXT_SUFFIXES = (".py", ".txt", ".md", ".rst", ".json", ".yaml", ".yml", ".c", ".h", ".toml", ".cfg")
JSONL_SUFFIXES = (".jsonl", ".ndjson")
PARQUET_SUFFIXES = (".parquet",)
# Documents are encoded in batches of about this many characters (the library spreads a batch over the cores).
BATCH_CHARS = 4 << 20
BATCH_DOCS = 4096


class CorpusError(ValueError):
    """The corpus cannot be turned into training data; the message says why and what to do."""


def file_kind(path: Path) -> str:
    """``text``, ``jsonl`` or ``parquet``, by the file name's extension."""
    name = path.name.lower()
    if name.endswith(JSONL_SUFFIXES):
        return "jsonl"
    if name.endswith(PARQUET_SUFFIXES):
        return "parquet"
    return "text"


@dataclass
class CorpusScan:
    """What a scan of the corpus found (``files``: text files; ``records``: JSONL and Parquet files)."""

    files: list[Path] = field(default_factory=list)
    records: list[Path] = field(default_factory=list)
    binary: list[Path] = field(default_factory=list)
    unreadable: list[tuple[Path, str]] = field(default_factory=list)

    @property
    def all_files(self) -> list[Path]:
        """Every usable file, text then record files."""
        return self.files + self.records


def resolve_corpus(corpus: str) -> Path:
    """``stdlib`` means this interpreter's standard library sources; anything else is a path."""
    if corpus == "stdlib":
        return Path(sysconfig.get_paths()["stdlib"])
    return Path(corpus).expanduser()


def _iter_candidates(root: Path, stdlib: bool) -> Iterator[Path]:
    if root.is_file():
        yield root
        return
    suffixes = TEXT_SUFFIXES + JSONL_SUFFIXES + PARQUET_SUFFIXES
    for dirpath, dirnames, filenames in os.walk(root):
        # Deterministic order; third-party packages are not part of the stdlib corpus.
        dirnames[:] = sorted(d for d in dirnames if not (stdlib and d in ("site-packages", "__pycache__")))
        for name in sorted(filenames):
            if stdlib and not name.endswith(".py"):
                continue
            if not stdlib and not name.lower().endswith(suffixes):
                continue
            yield Path(dirpath) / name


def scan_corpus(corpus: str) -> CorpusScan:
    """List usable files; binary (NUL bytes / not UTF-8) and unreadable text files are set aside.

    JSONL and Parquet files are only checked for being readable here; their records are checked
    while they are streamed.
    """
    root = resolve_corpus(corpus)
    if not root.exists():
        raise CorpusError(f"corpus {str(root)!r} does not exist; point data.corpus= at a text directory")
    if not os.access(root, os.R_OK):
        raise CorpusError(f"corpus {str(root)!r} is not readable by this user; check its permissions")
    scan = CorpusScan()
    for path in _iter_candidates(root, stdlib=corpus == "stdlib"):
        if file_kind(path) != "text":
            try:
                with path.open("rb") as f:
                    empty = not f.read(1)
            except OSError as exc:
                scan.unreadable.append((path, exc.strerror or str(exc)))
                continue
            if not empty:
                scan.records.append(path)
            continue
        try:
            raw = path.read_bytes()
        except OSError as exc:
            scan.unreadable.append((path, exc.strerror or str(exc)))
            continue
        if not raw.strip():
            continue
        if b"\x00" in raw:
            scan.binary.append(path)
            continue
        try:
            raw.decode("utf-8")
        except UnicodeDecodeError:
            scan.binary.append(path)
            continue
        scan.files.append(path)
    if not scan.all_files:
        detail = []
        if scan.binary:
            detail.append(f"{len(scan.binary)} binary/non-UTF-8 file(s), e.g. {scan.binary[0]}")
        if scan.unreadable:
            p, why = scan.unreadable[0]
            detail.append(f"{len(scan.unreadable)} unreadable file(s), e.g. {p}: {why}")
        found = "; ".join(detail) if detail else "no non-empty text files"
        raise CorpusError(
            f"corpus {str(root)!r} has no usable text ({found}); text files ending in "
            f"{', '.join(TEXT_SUFFIXES)}, JSONL ({', '.join(JSONL_SUFFIXES)}) and Parquet (.parquet) are used"
        )
    return scan


def _split_score(rel: str, seed: int) -> float:
    h = hashlib.sha256(f"{seed}:{rel}".encode()).digest()
    return int.from_bytes(h[:8], "big") / 2**64


def assign_splits(rels: list[str], val_fraction: float, seed: int) -> list[str]:
    """'train' or 'val' per file, by a hash of its relative path; each split gets >= 1 file."""
    scores = [_split_score(r, seed) for r in rels]
    splits = ["val" if sc < val_fraction else "train" for sc in scores]
    if len(rels) >= 2:
        # Small corpora: the hash may leave a split empty; move the nearest file over.
        if "val" not in splits:
            splits[min(range(len(rels)), key=scores.__getitem__)] = "val"
        if "train" not in splits:
            splits[max(range(len(rels)), key=scores.__getitem__)] = "train"
    return splits


# ---- documents ------------------------------------------------------------------------------------
@dataclass
class Doc:
    """One document: its text, split, and the file it came from."""

    text: str
    split: str
    source: Path


@dataclass
class RecordStats:
    """Records set aside under ``data.on_bad_record=skip``, by reason (written to index.json)."""

    not_json: int = 0
    not_object: int = 0
    missing_field: int = 0
    empty_text: int = 0

    def as_dict(self) -> dict[str, int]:
        """Counts by reason plus the total."""
        d = dict(self.__dict__)
        d["total"] = sum(d.values())
        return d


class _Progress:
    """One progress line on stderr: files, MB, tokens/s, ETA (rewritten in place on a terminal)."""

    def __init__(self, phase: str, n_files: int, total_bytes: int, stream: IO[str] | None, every_s: float = 2.0):
        self.phase, self.n_files, self.total = phase, n_files, max(total_bytes, 1)
        self.stream = stream
        self.tty = bool(stream is not None and getattr(stream, "isatty", lambda: False)())
        self.every_s = every_s if self.tty else max(every_s, 10.0)
        self.t0 = self.last = time.perf_counter()
        self.files = self.bytes = self.tokens = 0

    def update(self, files: int = 0, nbytes: int = 0, tokens: int = 0) -> None:
        self.files += files
        self.bytes += nbytes
        self.tokens += tokens
        now = time.perf_counter()
        if self.stream is not None and now - self.last >= self.every_s:
            self.last = now
            self._show(final=False)

    def _show(self, final: bool) -> None:
        assert self.stream is not None
        dt = max(time.perf_counter() - self.t0, 1e-9)
        frac = min(self.bytes / self.total, 1.0)
        eta = "done" if final else (f"ETA {_hms(dt * (1 - frac) / frac)}" if frac > 0 else "ETA ?")
        line = (f"xirang-prepare {self.phase}: {self.files}/{self.n_files} files, "
                f"{self.bytes / 1e6:,.1f}/{self.total / 1e6:,.1f} MB, ")
        if self.tokens:
            line += f"{self.tokens:,} tokens, {self.tokens / dt:,.0f} tokens/s, "
        line += f"{self.bytes / 1e6 / dt:,.2f} MB/s, {eta}"
        if self.tty:
            self.stream.write("\r" + line + ("\n" if final else ""))
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self.stream is not None:
            self._show(final=True)


def _hms(s: float) -> str:
    s = int(s)
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


def _bad(policy: str, stats: RecordStats, reason: str, where: str, msg: str) -> None:
    """Fail on a bad record (naming file:line), or count it under ``data.on_bad_record=skip``."""
    if policy == "fail":
        raise CorpusError(f"{where}: {msg}; fix the record or set data.on_bad_record=skip to skip such records")
    setattr(stats, reason, getattr(stats, reason) + 1)


def _record_text(rec: Any, field_name: str, where: str, policy: str, stats: RecordStats) -> str | None:
    if not isinstance(rec, dict):
        _bad(policy, stats, "not_object", where, f"record is a JSON {type(rec).__name__}, not an object")
        return None
    if field_name not in rec or rec[field_name] is None:
        keys = ", ".join(sorted(map(str, rec))[:10]) or "none"
        _bad(policy, stats, "missing_field", where,
             f"record has no {field_name!r} field (its fields: {keys}); set data.text_field= to the text field")
        return None
    text = rec[field_name]
    if not isinstance(text, str):
        _bad(policy, stats, "missing_field", where,
             f"field {field_name!r} is a {type(text).__name__}, not a string")
        return None
    if not text.strip():
        _bad(policy, stats, "empty_text", where, f"field {field_name!r} is empty")
        return None
    return text


def _jsonl_docs(path: Path, rel: str, field_name: str, policy: str, stats: RecordStats,
                split_of: Callable[[str], str], progress: _Progress) -> Iterator[Doc]:
    with path.open("rb") as f:
        for lineno, raw in enumerate(f, 1):
            progress.update(nbytes=len(raw))
            if not raw.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                rec = json.loads(raw)
            except (ValueError, UnicodeDecodeError) as exc:
                _bad(policy, stats, "not_json", where, f"line is not valid JSON ({str(exc).splitlines()[0]})")
                continue
            text = _record_text(rec, field_name, where, policy, stats)
            if text is not None:
                yield Doc(text, split_of(f"{rel}:{lineno}"), path)


def _parquet_docs(path: Path, rel: str, field_name: str, policy: str, stats: RecordStats,
                  split_of: Callable[[str], str], progress: _Progress) -> Iterator[Doc]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as exc:
        raise CorpusError(f"{path}: not a readable Parquet file ({exc}); fix or remove it") from None
    names = pf.schema_arrow.names
    if field_name not in names:
        raise CorpusError(f"{path}: Parquet file has no column {field_name!r} (its columns: {', '.join(names)}); "
                          "set data.text_field= to the text column")
    typ = pf.schema_arrow.field(field_name).type
    if not (pa.types.is_string(typ) or pa.types.is_large_string(typ)):
        raise CorpusError(f"{path}: column {field_name!r} is {typ}, not a string column; "
                          "set data.text_field= to the text column")
    size, rows = path.stat().st_size, max(pf.metadata.num_rows, 1)
    row = 0
    batches = pf.iter_batches(batch_size=1024, columns=[field_name])
    while True:
        try:
            batch = next(batches, None)
        except (pa.ArrowException, OSError) as exc:
            raise CorpusError(f"{path}: unreadable Parquet data after row {row} ({exc}); fix or remove it") from None
        if batch is None:
            break
        texts = batch.column(0).to_pylist()
        progress.update(nbytes=size * len(texts) // rows)
        for text in texts:
            where = f"{path}: row {row}"
            if text is None:
                _bad(policy, stats, "missing_field", where, f"column {field_name!r} is null")
            elif not text.strip():
                _bad(policy, stats, "empty_text", where, f"column {field_name!r} is empty")
            else:
                yield Doc(text, split_of(f"{rel}:{row}"), path)
            row += 1


def iter_documents(scan: CorpusScan, root: Path, text_field: str = "text", on_bad_record: str = "fail",
                   val_fraction: float = 0.01, split_seed: int = 0, stats: RecordStats | None = None,
                   progress: _Progress | None = None) -> Iterator[Doc]:
    """Every document of the corpus with its split, streamed file by file."""
    stats = stats if stats is not None else RecordStats()
    progress = progress if progress is not None else _Progress("read", 0, 1, None)

    def rel_of(p: Path) -> str:
        return str(p.relative_to(root)) if root.is_dir() else p.name

    def split_of(key: str) -> str:
        return "val" if _split_score(key, split_seed) < val_fraction else "train"

    if root.is_file() and scan.files:  # one text file: its last val_fraction (from a line start) is val
        data = scan.files[0].read_text(encoding="utf-8")
        progress.update(files=1, nbytes=len(data.encode("utf-8")))
        cut = data.find("\n", int(len(data) * (1 - val_fraction))) + 1 or len(data)
        yield Doc(data[:cut], "train", root)
        if data[cut:].strip():
            yield Doc(data[cut:], "val", root)
        return
    text_rels = [rel_of(p) for p in scan.files]
    for path, split in zip(scan.files, assign_splits(text_rels, val_fraction, split_seed)):
        data = path.read_text(encoding="utf-8")
        progress.update(files=1, nbytes=len(data.encode("utf-8")))
        yield Doc(data, split, path)
    for path in scan.records:
        reader = _jsonl_docs if file_kind(path) == "jsonl" else _parquet_docs
        yield from reader(path, rel_of(path), text_field, on_bad_record, stats, split_of, progress)
        progress.update(files=1)


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
) -> dict[str, object]:
    """Tokenize ``corpus`` into shards under ``out_dir``; returns the index (also in index.json).

    ``tokenizer``: ``byte``, ``bpe`` (trained here on the train split, ``vocab_size`` tokens), a
    tokenizer.json path or an HF model dir. ``progress``: where the progress line goes (None: nowhere).
    """
    if isinstance(progress, str):  # resolved per call: pytest and the CLIs swap sys.stderr
        progress = sys.stderr
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / INDEX).unlink(missing_ok=True)
    (out / TOKENIZER_FILE).unlink(missing_ok=True)
    for old in out.glob("*.h5"):
        old.unlink()
    if on_bad_record not in ("fail", "skip"):
        raise CorpusError(f"data.on_bad_record={on_bad_record!r}: choose fail or skip")
    if tokenizer == "bpe" and vocab_size < 257:
        raise CorpusError(f"data.vocab_size={vocab_size}: a byte-level BPE needs at least 257 tokens "
                          "(256 bytes + <|endoftext|>); set data.vocab_size=...")
    scan = scan_corpus(corpus)
    root = resolve_corpus(corpus)
    if root.is_dir() and not scan.records and len(scan.files) < 2:
        raise CorpusError(
            f"corpus {str(root)!r} has {len(scan.files)} usable file; a train/val split needs at least 2 "
            "text files (or JSONL/Parquet records)"
        )
    n_files = len(scan.all_files)
    total_bytes = sum(p.stat().st_size for p in scan.all_files)

    def docs(stats: RecordStats | None = None, prog: _Progress | None = None) -> Iterator[Doc]:
        return iter_documents(scan, root, text_field, on_bad_record, val_fraction, split_seed, stats, prog)

    tok = _make_tokenizer(tokenizer, vocab_size, out, docs, n_files, total_bytes, progress)
    info = tokenizer_info(tok)
    if tok.tokenizer_json is not None:
        info["file"] = TOKENIZER_FILE
        info["sha256"] = file_sha256(out / TOKENIZER_FILE)
        info["spec"] = "bpe" if tokenizer == "bpe" else str(Path(tokenizer).expanduser().absolute())
        if tokenizer == "bpe":
            info["requested_vocab_size"] = vocab_size
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
        "skipped_binary": len(scan.binary),
        "skipped_unreadable": len(scan.unreadable),
        "skipped_records": stats.as_dict(),
        "on_bad_record": on_bad_record,
        "splits": {s: w.close() for s, w in writers.items()},
    }
    for s in ("train", "val"):
        index[f"{s}_tokens"] = sum(int(x["n_tokens"]) for x in index["splits"][s])
    tmp = out / (INDEX + ".tmp")
    tmp.write_text(json.dumps(index, indent=1))
    os.replace(tmp, out / INDEX)
    log.info(
        "prepared %s: %d train tokens, %d val tokens (%d files; skipped %d binary, %d unreadable, %d records)",
        out, index["train_tokens"], index["val_tokens"], n_files, len(scan.binary),
        len(scan.unreadable), stats.as_dict()["total"],
    )
    return index


def prepare_data(d: Any, out_dir: str | Path | None = None,
                 progress: IO[str] | None | str = "stderr") -> dict[str, object]:
    """:func:`prepare` with the options of a ``DataConfig`` (``data.*``)."""
    return prepare(d.corpus, out_dir if out_dir is not None else d.out_dir, d.val_fraction, d.shard_tokens,
                   d.split_seed, tokenizer=d.tokenizer, vocab_size=d.vocab_size, text_field=d.text_field,
                   on_bad_record=d.on_bad_record, progress=progress)


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
        return None
    want = f"{d.tokenizer} (data.vocab_size={d.vocab_size})" if d.tokenizer == "bpe" else d.tokenizer
    return (f"{out_dir} was prepared with tokenizer {index.get('tokenizer')} ({have}), not data.tokenizer={want}; "
            "set data.out_dir= to another directory or rerun xirang-prepare")


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
    tok = index.get("tokenizer_info") or {}
    if tok.get("file") and file_sha256(Path(out_dir) / tok["file"]) != tok.get("sha256"):
        raise CorpusError(f"{Path(out_dir) / tok['file']} fails its checksum; rerun xirang-prepare")
