"""Chat and preference-pair corpora -> HDF5 sample shards (``data.format=chat`` / ``pairs``).

A conversation is rendered with the chat template into one sample: its tokens, a loss mask (1 = learned,
chosen by ``data.train_on``) and its place in the shard's ``offsets``; a preference pair is two consecutive
samples (chosen, then rejected) masked to the completion only (xirang_hpc/data/pairs.py). A sample (and a
pair) never straddles two shards. The chat template goes with the data (``chat_template.json``, checksummed
in the index), so serving renders prompts as training did.

The layout, the lock, the tokenizer and the index are :mod:`xirang_hpc.data.prepare`'s, which dispatches
here on ``data.format``. Also here: the check, at launch, that a window can learn from some sample.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import h5py
import numpy as np

from xirang_hpc.data.chat import ChatError, ChatRenderer
from xirang_hpc.data.corpus import CorpusError, CorpusScan, Doc, RecordStats, _Progress, iter_chat_records
from xirang_hpc.data.prepare import (
    _chat_options,
    _index_tail,
    _make_tokenizer,
    _tokenizer_record,
    _write_index,
    load_index,
)
from xirang_hpc.data.tokenizer import CHAT_TEMPLATE_FILE, ByteTokenizer, file_sha256, token_dtype

log = logging.getLogger(__name__)


class _ChatShardWriter:
    """Whole samples (tokens + loss mask + sample offsets) into HDF5 shards of one split; a sample never straddles two.

    Datasets per shard: ``tokens``, ``loss_mask`` (uint8, 1 = learned), ``offsets`` (int64, n_samples + 1:
    sample i is ``tokens[offsets[i]:offsets[i+1]]``); each has its sha256 in the attributes and the index.
    """

    def __init__(self, out: Path, split: str, shard_tokens: int, attrs: dict[str, object], dtype: Any) -> None:
        self.out, self.split, self.shard_tokens, self.attrs, self.dtype = out, split, shard_tokens, attrs, dtype
        self.ids: list[np.ndarray] = []
        self.masks: list[np.ndarray] = []
        self.n = 0
        self.shards: list[dict[str, object]] = []

    def add(self, ids: np.ndarray, mask: np.ndarray) -> None:
        self.add_group([(ids, mask)])

    def add_group(self, samples: list[tuple[np.ndarray, np.ndarray]]) -> None:
        """Samples kept together in one shard (a preference pair: chosen, then rejected)."""
        for ids, mask in samples:
            self.ids.append(ids.astype(self.dtype))
            self.masks.append(mask.astype(np.uint8))
            self.n += len(ids)
        if self.n >= self.shard_tokens:
            self._flush()

    def close(self) -> list[dict[str, object]]:
        if self.ids:
            self._flush()
        return self.shards

    def _flush(self) -> None:
        tokens, mask = np.concatenate(self.ids), np.concatenate(self.masks)
        offsets = np.concatenate([[0], np.cumsum([len(a) for a in self.ids])]).astype(np.int64)  # (n_samples+1,)
        name = f"{self.split}_{len(self.shards):05d}.h5"
        sums = {k: hashlib.sha256(a.tobytes()).hexdigest()
                for k, a in (("sha256", tokens), ("mask_sha256", mask), ("offsets_sha256", offsets))}
        tmp = self.out / f".{name}.tmp"
        with h5py.File(tmp, "w", locking=False) as f:
            f.create_dataset("tokens", data=tokens, chunks=(min(len(tokens), 1 << 16),))
            f.create_dataset("loss_mask", data=mask, chunks=(min(len(mask), 1 << 16),))
            f.create_dataset("offsets", data=offsets)
            f.attrs.update(self.attrs)
            f.attrs["split"] = self.split
            f.attrs["n_tokens"] = len(tokens)
            f.attrs["n_samples"] = len(offsets) - 1
            f.attrs.update(sums)
        os.replace(tmp, self.out / name)
        self.shards.append({"file": name, "n_tokens": int(len(tokens)), "n_samples": int(len(offsets) - 1),
                            "n_learned": int(mask.sum()), **sums})
        self.ids, self.masks, self.n = [], [], 0


def _prepare_chat(scan: CorpusScan, root: Path, out: Path, val_fraction: float, shard_tokens: int, split_seed: int,
                  tokenizer: str, vocab_size: int, on_bad_record: str, progress: IO[str] | None,
                  train_on: str, fmt: str = "chat") -> dict[str, object]:
    """``data.format=chat``: conversations rendered with the chat template, tokens + loss masks per sample.

    ``data.format=pairs``: each preference pair as two consecutive samples (chosen, then rejected) whose
    masks cover the completion only (xirang_hpc/data/pairs.py); a pair never straddles two shards.
    """
    from xirang_hpc.data.chat import DEFAULT_CHAT_TEMPLATE, hf_dir_chat_template
    from xirang_hpc.data.pairs import PairEncoder, PairRecord, identical, iter_pair_records, pair_text

    pairs = fmt == "pairs"
    if pairs:
        train_on = "last"  # the final assistant turn: the reply of the pair

    def records(stats: RecordStats | None = None) -> Iterator[Any]:
        if pairs:
            return iter_pair_records(scan, root, on_bad_record, val_fraction, split_seed, stats)
        return iter_chat_records(scan, root, on_bad_record, val_fraction, split_seed, stats)

    n_files = len(scan.all_files)
    total_bytes = sum(p.stat().st_size for p in scan.all_files)
    own = hf_dir_chat_template(tokenizer) if tokenizer not in ("byte", "bpe") else None

    def rendered(stats: RecordStats | None = None, prog: _Progress | None = None) -> Iterator[Doc]:
        # What a BPE trained here learns from: the train split's conversations as the template renders them.
        plain = ChatRenderer(ByteTokenizer(), own or DEFAULT_CHAT_TEMPLATE, "all")
        for r in records(RecordStats()):
            try:
                text = pair_text(r, plain.render) if isinstance(r, PairRecord) else plain.render(r.messages)
                yield Doc(text, r.split, Path(r.where))
            except Exception:  # noqa: BLE001, S112 - bad records are reported by the tokenizing pass below
                continue

    tok = _make_tokenizer(tokenizer, vocab_size, out, rendered, n_files, total_bytes, progress)
    renderer = ChatRenderer.for_tokenizer(tok, tokenizer, train_on)
    info = _tokenizer_record(tok, tokenizer, vocab_size, out)
    attrs: dict[str, object] = {"tokenizer": tok.name, "vocab_size": tok.vocab_size, "source": str(root),
                                "format": fmt, "train_on": train_on, "chat_template_sha256": renderer.sha256}
    if info.get("sha256"):
        attrs["tokenizer_sha256"] = info["sha256"]
    dtype = token_dtype(tok.vocab_size)
    writers = {s: _ChatShardWriter(out, s, shard_tokens, attrs, dtype) for s in ("train", "val")}
    stats = RecordStats()
    n = {"train": 0, "val": 0}
    lengths: list[int] = []
    prog = _Progress("tokenize", n_files, total_bytes, progress)
    encoder = PairEncoder(tok, renderer)
    same: list[str] = []  # pairs whose chosen and rejected replies are identical
    for rec in records(stats):
        try:
            samples = encoder.encode(rec) if pairs else (renderer.sample(rec.messages, rec.where),)
        except ChatError as exc:
            if on_bad_record == "fail":
                raise CorpusError(f"{exc} (or set data.on_bad_record=skip to skip such records)") from None
            stats.bad_chat += 1
            continue
        if pairs and identical(rec):
            same.append(rec.where)
        writers[rec.split].add_group([(x.ids, x.mask) for x in samples])
        n[rec.split] += 1
        for x in samples:
            lengths.append(len(x.ids))
            prog.update(tokens=len(x.ids))
    prog.update(files=n_files, nbytes=total_bytes)
    prog.close()
    if same:
        print(f"xirang-prepare: warning: {len(same)} pair(s) with identical chosen and rejected replies (they "
              f"teach nothing: loss log 2, no gradient), e.g. {same[0]}", file=sys.stderr, flush=True)
    empty = [s for s in ("train", "val") if not n[s]]
    if empty:
        what = "pairs" if pairs else "conversations"
        raise CorpusError(f"corpus {str(root)!r} left the {empty[0]} split empty ({sum(n.values())} {what}, "
                          f"data.val_fraction={val_fraction}); add conversations or adjust data.val_fraction")
    lens = np.asarray(lengths)
    # The template goes with the data (and from there into each run dir): serving prompts as training rendered.
    record = {"template": renderer.template, "special_tokens": renderer.special,
              "stop": [] if own else ["<|im_end|>"], "sha256": renderer.sha256}
    tmp = out / f".{CHAT_TEMPLATE_FILE}.tmp"
    tmp.write_text(json.dumps(record, indent=1))
    os.replace(tmp, out / CHAT_TEMPLATE_FILE)
    index: dict[str, Any] = {
        "format": fmt,
        "train_on": train_on,
        "chat_template_sha256": renderer.sha256,
        "chat_template": "tokenizer" if own else "default",
        "chat_template_file": {"file": CHAT_TEMPLATE_FILE, "sha256": file_sha256(out / CHAT_TEMPLATE_FILE)},
        "tokenizer": tok.name,
        "vocab_size": tok.vocab_size,
        "tokenizer_info": info,
        "source": str(root),
        "files": n_files,
        "documents": n,
        "samples": {s: 2 * v for s, v in n.items()} if pairs else n,
        **({"pairs": n, "identical_pairs": len(same)} if pairs else {}),
        "sample_tokens": {"min": int(lens.min()), "median": int(np.median(lens)), "max": int(lens.max()),
                          "p99": int(np.percentile(lens, 99))},
        **_index_tail(scan, stats, on_bad_record, writers),
    }
    _write_index(out, index)
    log.info("prepared %s data %s: %d train / %d val %s, %d bad records skipped", fmt, out, n["train"],
             n["val"], "pairs" if pairs else "conversations", stats.bad_chat)
    return index


def _chat_mismatch(d: Any, index: dict[str, Any], out_dir: str | Path) -> str | None:
    """Why prepared data of the right tokenizer is still not what ``data.format``/``data.train_on`` ask for."""
    have_fmt = index.get("format", "text")
    fmt, train_on = _chat_options(d)
    if have_fmt != fmt:
        return (f"{out_dir} was prepared as data.format={have_fmt}, not data.format={fmt}; set data.out_dir= "
                "to another directory or rerun xirang-prepare")
    if fmt == "pairs":
        train_on = "last"
    if fmt in ("chat", "pairs"):
        if index.get("train_on") != train_on:
            return (f"{out_dir} was prepared with data.train_on={index.get('train_on')}, not {train_on}; set "
                    "data.out_dir= to another directory or rerun xirang-prepare")
        from xirang_hpc.data.chat import DEFAULT_CHAT_TEMPLATE, hf_dir_chat_template, template_sha256

        own = hf_dir_chat_template(d.tokenizer) if d.tokenizer not in ("byte", "bpe") else None
        if index.get("chat_template_sha256") != template_sha256(own or DEFAULT_CHAT_TEMPLATE):
            return (f"{out_dir} was prepared with another chat template (sha256 "
                    f"{str(index.get('chat_template_sha256'))[:12]}); set data.out_dir= to another directory or "
                    "rerun xirang-prepare")
    return None


def no_learnable_sample(data_dir: Path, split: str, seq_len: int, overlong: str) -> CorpusError:
    """The refusal of a window no chat sample can be learned in (at launch and in the ranks alike)."""
    return CorpusError(f"{split} split in {data_dir} has no sample to learn from at seq_len={seq_len} "
                       f"(data.overlong={overlong}: every sample is longer, or loses its replies when cut); "
                       "use a larger model.seq_len")


def check_chat_window(data_dir: str | Path, seq_len: int, overlong: str = "truncate", split: str = "train") -> None:
    """At launch, before any queue wait: refuse a window no sample of ``split`` can be learned in (the same
    rule the ranks apply). Reads the samples' offsets only, and the loss masks only when every sample is
    longer than the window; text data passes."""
    data_dir = Path(data_dir)
    index = load_index(data_dir)
    if index.get("format") != "chat":
        return
    cut_learnable = False
    for s in index["splits"][split]:
        with h5py.File(data_dir / s["file"], "r", locking=False) as f:
            offsets = f["offsets"][:]
            lengths = np.diff(offsets)
            if ((lengths >= 2) & (lengths <= seq_len + 1)).any():
                return  # a whole sample fits (its reply is learned: records without one are refused)
            if overlong == "truncate" and not cut_learnable:
                mask = f["loss_mask"]
                cut_learnable = any(mask[a + 1 : a + seq_len + 1].any() for a in offsets[:-1][:1000])
    if cut_learnable:
        return
    raise no_learnable_sample(data_dir, split, seq_len, overlong)
