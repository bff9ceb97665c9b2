"""Reading corpora: text files, JSONL and Parquet, streamed document by document with their split.

Files are chosen by extension (a directory may mix kinds; ``data.corpus`` may be one file). Text
files go to the train or val split by a hash of their relative path, records by a hash of
``path:line`` (JSONL) or ``path:row`` (Parquet), so adding data never moves other documents between
splits. Bad records (not JSON, not an object, a missing or empty text field) fail with ``file:line``
or, under ``data.on_bad_record=skip``, are counted by reason. Also here: the progress line
(files, MB, tokens/s, ETA) that reading and encoding update.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
import sysconfig
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

TEXT_SUFFIXES = (".py", ".txt", ".md", ".rst", ".json", ".yaml", ".yml", ".c", ".h", ".toml", ".cfg")
JSONL_SUFFIXES = (".jsonl", ".ndjson")
PARQUET_SUFFIXES = (".parquet",)
# Documents are encoded in batches of about this many characters (the library spreads a batch over the cores).


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
    special: list[Path] = field(default_factory=list)  # FIFOs, sockets, devices: skipped, never opened

    @property
    def all_files(self) -> list[Path]:
        """Every usable file, text then record files."""
        return self.files + self.records


def resolve_corpus(corpus: str) -> Path:
    """``stdlib`` means this interpreter's standard library sources; anything else is a path."""
    if corpus == "stdlib":
        return Path(sysconfig.get_paths()["stdlib"])
    return Path(corpus).expanduser()


def _iter_candidates(root: Path, stdlib: bool, unlisted: list[tuple[Path, str]] | None = None) -> Iterator[Path]:
    """The corpus files to consider, in a stable order; directories that cannot be listed go to ``unlisted``."""
    if root.is_file():
        yield root
        return
    suffixes = TEXT_SUFFIXES + JSONL_SUFFIXES + PARQUET_SUFFIXES

    def onerror(exc: OSError) -> None:
        if unlisted is not None:
            unlisted.append((Path(exc.filename or root), exc.strerror or str(exc)))

    for dirpath, dirnames, filenames in os.walk(root, onerror=onerror):
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
    if not (root.is_dir() or root.is_file()):
        raise CorpusError(f"corpus {str(root)!r} is not a regular file or a directory (a FIFO, socket or device); "
                          "point data.corpus= at a text directory or file")
    if not os.access(root, os.R_OK):
        raise CorpusError(f"corpus {str(root)!r} is not readable by this user; check its permissions")
    scan = CorpusScan()
    for path in _iter_candidates(root, stdlib=corpus == "stdlib", unlisted=scan.unreadable):
        # Only regular files are opened: a FIFO would block the read forever, a device never end.
        try:
            mode = path.stat().st_mode
        except OSError as exc:  # e.g. a dangling symbolic link
            scan.unreadable.append((path, exc.strerror or str(exc)))
            continue
        if not stat.S_ISREG(mode):
            scan.special.append(path)
            continue
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
    if scan.unreadable and scan.all_files:  # a corpus read in part would train on less than it says
        shown = ", ".join(f"{p} ({why})" for p, why in scan.unreadable[:5])
        more = f" and {len(scan.unreadable) - 5} more" if len(scan.unreadable) > 5 else ""
        raise CorpusError(
            f"corpus {str(root)!r}: {len(scan.unreadable)} file(s) or director(ies) cannot be read by this user "
            f"(uid {os.getuid()}): {shown}{more}; make them readable (chmod a+r, or a+rx for a directory) or "
            "move them out of data.corpus"
        )
    if not scan.all_files:
        detail = []
        if scan.binary:
            detail.append(f"{len(scan.binary)} binary/non-UTF-8 file(s), e.g. {scan.binary[0]}")
        if scan.unreadable:
            p, why = scan.unreadable[0]
            detail.append(f"{len(scan.unreadable)} unreadable file(s), e.g. {p}: {why}")
        if scan.special:
            detail.append(f"{len(scan.special)} special file(s) (FIFO, socket, device), e.g. {scan.special[0]}")
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
    bad_chat: int = 0  # data.format=chat: unknown role, no assistant turn, a template that fails on it

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


def json_lines(path: Path, policy: str, stats: RecordStats,
               on_bytes: Callable[[int], None] | None = None) -> Iterator[tuple[int, str, Any]]:
    """``(line, where, record)`` for each non-blank line of a JSONL file (``where`` = ``path:line``); a line that is not
    JSON is a bad record under ``policy`` (``data.on_bad_record``). ``on_bytes`` sees each line's size."""
    with path.open("rb") as f:
        for lineno, raw in enumerate(f, 1):
            if on_bytes is not None:
                on_bytes(len(raw))
            if not raw.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                rec = json.loads(raw)
            except (ValueError, UnicodeDecodeError) as exc:
                _bad(policy, stats, "not_json", where, f"line is not valid JSON ({str(exc).splitlines()[0]})")
                continue
            yield lineno, where, rec


def _jsonl_docs(path: Path, rel: str, field_name: str, policy: str, stats: RecordStats,
                split_of: Callable[[str], str], progress: _Progress) -> Iterator[Doc]:
    for lineno, where, rec in json_lines(path, policy, stats, lambda n: progress.update(nbytes=n)):
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




# ---- chat records ---------------------------------------------------------------------------------
CHAT_FIELD = "messages"


@dataclass
class ChatRecord:
    """One conversation: its messages, split and where it came from (``file:line`` / ``file: row n``)."""

    messages: Any
    split: str
    where: str


def iter_chat_records(scan: CorpusScan, root: Path, on_bad_record: str = "fail", val_fraction: float = 0.01,
                      split_seed: int = 0, stats: RecordStats | None = None) -> Iterator[ChatRecord]:
    """Every conversation (a ``messages`` list) of the corpus's JSONL and Parquet files, with its split.

    The messages themselves are checked where they are rendered (:mod:`xirang_hpc.data.chat`).
    """
    stats = stats if stats is not None else RecordStats()
    if scan.files:
        raise CorpusError(f"{scan.files[0]}: data.format=chat reads JSONL or Parquet records with a "
                          f"{CHAT_FIELD!r} list, not text files; move the text files out of data.corpus or use "
                          "data.format=text")

    def rel_of(p: Path) -> str:
        return str(p.relative_to(root)) if root.is_dir() else p.name

    def split_of(key: str) -> str:
        return "val" if _split_score(key, split_seed) < val_fraction else "train"

    for path in scan.records:
        rel = rel_of(path)
        if file_kind(path) == "jsonl":
            for lineno, where, rec in json_lines(path, on_bad_record, stats):
                if not isinstance(rec, dict) or CHAT_FIELD not in rec:
                    _bad(on_bad_record, stats, "missing_field", where,
                         f"record has no {CHAT_FIELD!r} list of {{role, content}} messages")
                    continue
                yield ChatRecord(rec[CHAT_FIELD], split_of(f"{rel}:{lineno}"), where)
            continue
        import pyarrow as pa
        import pyarrow.parquet as pq

        try:
            pf = pq.ParquetFile(path)
        except (pa.ArrowException, OSError) as exc:
            raise CorpusError(f"{path}: not a readable Parquet file ({exc}); fix or remove it") from None
        if CHAT_FIELD not in pf.schema_arrow.names:
            raise CorpusError(f"{path}: Parquet file has no column {CHAT_FIELD!r} (its columns: "
                              f"{', '.join(pf.schema_arrow.names)}); data.format=chat needs a list of "
                              "{role, content} structs per row")
        row = 0
        for batch in pf.iter_batches(batch_size=1024, columns=[CHAT_FIELD]):
            for messages in batch.column(0).to_pylist():
                yield ChatRecord(messages, split_of(f"{rel}:{row}"), f"{path}: row {row}")
                row += 1
