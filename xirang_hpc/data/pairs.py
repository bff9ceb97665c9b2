"""Preference pairs (``data.format=pairs``) -> two token sequences per pair with completion-token masks.

A pair is a JSONL record with ``prompt``, ``chosen`` and ``rejected``:

- strings: the sequence is ``tokens(prompt) + tokens(reply)`` (plus the tokenizer's end-of-sequence token when
  it has one), the reply's tokens learned, as TRL tokenizes a non-conversational pair;
- chat: ``prompt`` a list of ``{role, content}`` messages (a string is one user message) and ``chosen`` /
  ``rejected`` lists ending in an assistant message (a string is that message); prompt + reply are rendered
  with the run's chat template as ``data.format=chat`` does, and only the final assistant turn is learned
  (:class:`~xirang_hpc.data.chat.ChatRenderer` with ``train_on=last``).

Only the completion's tokens count in the DPO log-probs. A pair whose chosen or rejected reply is empty is a
bad record (named ``file:line``, ``data.on_bad_record``); a pair whose replies are identical is kept (its
loss is the constant log 2 and its gradient zero) and counted, with a warning.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from xirang_hpc.data.chat import ChatError, ChatRenderer, ChatSample
from xirang_hpc.data.corpus import CorpusError, CorpusScan, RecordStats, _bad, _split_score, file_kind, json_lines

PAIR_FIELDS = ("prompt", "chosen", "rejected")


@dataclass
class PairRecord:
    """One preference pair as read: its fields, split and ``file:line``."""

    prompt: Any
    chosen: Any
    rejected: Any
    split: str
    where: str


def iter_pair_records(scan: CorpusScan, root: Path, on_bad_record: str = "fail", val_fraction: float = 0.01,
                      split_seed: int = 0, stats: RecordStats | None = None) -> Iterator[PairRecord]:
    """Every pair of the corpus's JSONL files, with its split (a pair never straddles train and val)."""
    stats = stats if stats is not None else RecordStats()
    other = [p for p in [*scan.files, *scan.records] if file_kind(p) != "jsonl"]
    if other:
        raise CorpusError(f"{other[0]}: data.format=pairs reads JSONL records with {', '.join(PAIR_FIELDS)}; "
                          "convert it to JSONL or move it out of data.corpus")
    for path in scan.records:
        rel = str(path.relative_to(root)) if root.is_dir() else path.name
        for lineno, where, rec in json_lines(path, on_bad_record, stats):
            if not isinstance(rec, dict):
                _bad(on_bad_record, stats, "not_object", where,
                     f"record is a JSON {type(rec).__name__}, not an object")
                continue
            missing = [k for k in PAIR_FIELDS if rec.get(k) is None]
            if missing:
                _bad(on_bad_record, stats, "missing_field", where,
                     f"pair has no {', '.join(repr(k) for k in missing)} (a pair needs {', '.join(PAIR_FIELDS)})")
                continue
            split = "val" if _split_score(f"{rel}:{lineno}", split_seed) < val_fraction else "train"
            yield PairRecord(rec["prompt"], rec["chosen"], rec["rejected"], split, where)


def _reply_text(reply: Any) -> str:
    """The content of a reply: a string, or the final assistant message of a list."""
    if isinstance(reply, str):
        return reply
    if isinstance(reply, list) and reply and isinstance(reply[-1], dict):
        return str(reply[-1].get("content") or "")
    return ""


def _as_messages(value: Any, role: str, name: str, where: str) -> list[dict[str, Any]]:
    if isinstance(value, str):
        return [{"role": role, "content": value}]
    if isinstance(value, dict):
        return [value]
    if isinstance(value, list):
        return list(value)
    raise ChatError(f"{where}: {name!r} is a {type(value).__name__}, not a string or a list of messages")


class PairEncoder:
    """Token ids + completion masks of both sequences of a pair, with one tokenizer and chat renderer."""

    def __init__(self, tok: Any, renderer: ChatRenderer) -> None:
        self.tok, self.renderer = tok, renderer

    def _plain(self, prompt: str, reply: str) -> ChatSample:
        p = np.asarray(self.tok.encode(prompt), dtype=np.int64)
        r = list(np.asarray(self.tok.encode(reply), dtype=np.int64))
        if getattr(self.tok, "eos_id", None) is not None:
            r.append(int(self.tok.eos_id))
        ids = np.concatenate([p, np.asarray(r, dtype=np.int64)])
        mask = np.concatenate([np.zeros(len(p), np.uint8), np.ones(len(r), np.uint8)])
        return ChatSample(ids, mask)

    def _chat(self, prompt: Any, reply: Any, name: str, where: str) -> ChatSample:
        msgs = _as_messages(prompt, "user", "prompt", where) + _as_messages(reply, "assistant", name, where)
        if not msgs or not isinstance(msgs[-1], dict) or msgs[-1].get("role") != "assistant":
            raise ChatError(f"{where}: {name!r} does not end with an assistant message; fix the record")
        return self.renderer.sample(msgs, f"{where} ({name})")

    def encode(self, rec: PairRecord) -> tuple[ChatSample, ChatSample]:
        """(chosen, rejected) samples; :class:`ChatError` naming the record when a reply is empty or malformed."""
        for name in ("chosen", "rejected"):
            if not _reply_text(getattr(rec, name)).strip():
                raise ChatError(f"{rec.where}: {name!r} is empty; a pair needs two non-empty replies")
        plain = all(isinstance(v, str) for v in (rec.prompt, rec.chosen, rec.rejected))
        if plain:
            return self._plain(rec.prompt, rec.chosen), self._plain(rec.prompt, rec.rejected)
        return (self._chat(rec.prompt, rec.chosen, "chosen", rec.where),
                self._chat(rec.prompt, rec.rejected, "rejected", rec.where))


def pair_text(rec: PairRecord, render: Callable[[list[dict[str, Any]]], str]) -> str:
    """The text of both sequences of a pair as they are tokenized (what a BPE trained on the corpus reads):
    plain ``prompt + reply`` for string pairs, else the conversations as ``render`` (the chat template) writes them."""
    if all(isinstance(v, str) for v in (rec.prompt, rec.chosen, rec.rejected)):
        return f"{rec.prompt}{rec.chosen}\n{rec.prompt}{rec.rejected}"
    prompt = _as_messages(rec.prompt, "user", "prompt", rec.where)
    return "".join(render(prompt + _as_messages(getattr(rec, k), "assistant", k, rec.where))
                   for k in ("chosen", "rejected"))


def identical(rec: PairRecord) -> bool:
    """Whether the chosen and rejected replies are the same (a pair that teaches nothing)."""
    return _reply_text(rec.chosen) == _reply_text(rec.rejected)
