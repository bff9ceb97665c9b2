"""Corpus directory -> HDF5 token shards with a train/val split.

Layout of ``out_dir``::

    train_00000.h5, train_00001.h5, ...   dataset "tokens" (uint8 for the byte tokenizer)
    val_00000.h5, ...
    index.json                            shards, token counts, checksums, source

Every shard carries HDF5 attributes: tokenizer, vocab_size, source, n_tokens, sha256.
Files go to the train or val split by a hash of their relative path, so adding a file to the
corpus never moves other files between splits. The index is written last, via rename: a
directory without ``index.json`` is an unfinished preparation and is redone.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import h5py
import numpy as np

from xirang_hpc.data.tokenizer import ByteTokenizer

log = logging.getLogger(__name__)

INDEX = "index.json"
TEXT_SUFFIXES = (".py", ".txt", ".md", ".rst", ".json", ".yaml", ".yml", ".c", ".h", ".toml", ".cfg")


class CorpusError(ValueError):
    """The corpus cannot be turned into training data; the message says why and what to do."""


@dataclass
class CorpusScan:
    """What a scan of the corpus found."""

    files: list[Path] = field(default_factory=list)
    binary: list[Path] = field(default_factory=list)
    unreadable: list[tuple[Path, str]] = field(default_factory=list)


def resolve_corpus(corpus: str) -> Path:
    """``stdlib`` means this interpreter's standard library sources; anything else is a path."""
    if corpus == "stdlib":
        return Path(sysconfig.get_paths()["stdlib"])
    return Path(corpus).expanduser()


def _iter_candidates(root: Path, stdlib: bool) -> Iterator[Path]:
    if root.is_file():
        yield root
        return
    for dirpath, dirnames, filenames in os.walk(root):
        # Deterministic order; third-party packages are not part of the stdlib corpus.
        dirnames[:] = sorted(d for d in dirnames if not (stdlib and d in ("site-packages", "__pycache__")))
        for name in sorted(filenames):
            if stdlib and not name.endswith(".py"):
                continue
            if not stdlib and not name.endswith(TEXT_SUFFIXES):
                continue
            yield Path(dirpath) / name


def scan_corpus(corpus: str) -> CorpusScan:
    """List usable text files; binary (NUL bytes / not UTF-8) and unreadable files are set aside."""
    root = resolve_corpus(corpus)
    if not root.exists():
        raise CorpusError(f"corpus {str(root)!r} does not exist; point data.corpus= at a text directory")
    if not os.access(root, os.R_OK):
        raise CorpusError(f"corpus {str(root)!r} is not readable by this user; check its permissions")
    scan = CorpusScan()
    for path in _iter_candidates(root, stdlib=corpus == "stdlib"):
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
    if not scan.files:
        detail = []
        if scan.binary:
            detail.append(f"{len(scan.binary)} binary/non-UTF-8 file(s), e.g. {scan.binary[0]}")
        if scan.unreadable:
            p, why = scan.unreadable[0]
            detail.append(f"{len(scan.unreadable)} unreadable file(s), e.g. {p}: {why}")
        found = "; ".join(detail) if detail else "no non-empty text files"
        raise CorpusError(
            f"corpus {str(root)!r} has no usable text ({found}); "
            f"text files ending in {', '.join(TEXT_SUFFIXES)} are used"
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


def prepare(
    corpus: str,
    out_dir: str | Path,
    val_fraction: float = 0.01,
    shard_tokens: int = 16 * 1024 * 1024,
    split_seed: int = 0,
) -> dict[str, object]:
    """Tokenize ``corpus`` into shards under ``out_dir``; returns the index (also in index.json)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / INDEX).unlink(missing_ok=True)
    for old in out.glob("*.h5"):
        old.unlink()
    scan = scan_corpus(corpus)
    root = resolve_corpus(corpus)
    tok = ByteTokenizer()
    attrs = {"tokenizer": tok.name, "vocab_size": tok.vocab_size, "source": str(root)}
    writers = {s: _ShardWriter(out, s, shard_tokens, attrs) for s in ("train", "val")}
    if len(scan.files) < 2:
        raise CorpusError(
            f"corpus {str(root)!r} has {len(scan.files)} usable file; a train/val split needs at least 2"
        )
    rels = [str(p.relative_to(root)) if root.is_dir() else p.name for p in scan.files]
    splits = assign_splits(rels, val_fraction, split_seed)
    counts = {"train": splits.count("train"), "val": splits.count("val")}
    for path, split in zip(scan.files, splits):
        # Files are separated by a blank line so windows see document boundaries.
        writers[split].add(tok.encode(path.read_text(encoding="utf-8") + "\n\n"))
    index = {
        "tokenizer": tok.name,
        "vocab_size": tok.vocab_size,
        "source": str(root),
        "files": counts,
        "skipped_binary": len(scan.binary),
        "skipped_unreadable": len(scan.unreadable),
        "splits": {s: w.close() for s, w in writers.items()},
    }
    for s in ("train", "val"):
        index[f"{s}_tokens"] = sum(int(x["n_tokens"]) for x in index["splits"][s])  # type: ignore[index]
    tmp = out / (INDEX + ".tmp")
    tmp.write_text(json.dumps(index, indent=1))
    os.replace(tmp, out / INDEX)
    log.info(
        "prepared %s: %d train tokens, %d val tokens (%d files; skipped %d binary, %d unreadable)",
        out, index["train_tokens"], index["val_tokens"], len(scan.files), len(scan.binary),
        len(scan.unreadable),
    )
    return index


def is_prepared(out_dir: str | Path) -> bool:
    """True when a finished preparation (index.json written last) exists."""
    return (Path(out_dir) / INDEX).is_file()


def load_index(out_dir: str | Path) -> dict[str, object]:
    """Read index.json, with a clear error if preparation never finished."""
    p = Path(out_dir) / INDEX
    if not p.is_file():
        raise CorpusError(f"{out_dir} holds no prepared data (no {INDEX}); run xirang-prepare first")
    return json.loads(p.read_text())


def verify(out_dir: str | Path) -> None:
    """Recompute every shard's checksum against its attributes and the index."""
    index = load_index(out_dir)
    for split, shards in index["splits"].items():  # type: ignore[union-attr]
        for s in shards:
            with h5py.File(Path(out_dir) / s["file"], "r", locking=False) as f:
                digest = hashlib.sha256(f["tokens"][:].tobytes()).hexdigest()
                if digest != s["sha256"] or f.attrs["sha256"] != digest:
                    raise CorpusError(f"{split} shard {s['file']} fails its checksum; rerun xirang-prepare")
