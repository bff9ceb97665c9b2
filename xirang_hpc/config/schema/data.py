"""The data group: the corpus, its tokenizer and where the prepared tokens live."""

from __future__ import annotations

from dataclasses import dataclass

from xirang_hpc.config.errors import ConfigError
from xirang_hpc.config.schema._checks import check_finite, check_positive


@dataclass
class DataConfig:
    """Token data. ``corpus=stdlib`` uses the running interpreter's standard-library sources.

    ``corpus``: a directory or one file; text files, JSONL (``.jsonl``) and Parquet (``.parquet``) by
    extension. ``tokenizer``: ``byte`` (vocab 256), ``bpe`` (a byte-level BPE of ``vocab_size`` tokens
    trained on the corpus; 0 = ``model.vocab_size``), or a tokenizer.json path / HF model dir.
    """

    corpus: str = "stdlib"
    out_dir: str = "data/stdlib-bytes"
    tokenizer: str = "byte"
    vocab_size: int = 0
    # JSONL key / Parquet column holding the text.
    text_field: str = "text"
    # A JSONL line that is not JSON, or a record without text: fail (naming file:line) | skip (counted).
    on_bad_record: str = "fail"
    val_fraction: float = 0.01
    # text: documents of text | chat: conversations (a "messages" list of {role, content}) rendered with the
    # tokenizer's chat template (or the default one), with per-token loss masks | pairs: preference pairs
    # ("prompt", "chosen", "rejected"; strings, or chat message lists) for finetune.method=dpo.
    format: str = "text"
    # chat: which tokens are learned: assistant (every assistant turn) | last (the last assistant turn) | all.
    train_on: str = "assistant"
    # chat: whole samples packed into model.seq_len rows (per-sample positions, block-diagonal attention);
    # false: one sample per row, padded (pads are masked from the loss).
    packing: bool = False
    # chat, pairs: a sample longer than model.seq_len + 1 tokens: truncate (keep its start) | drop (counted at
    # load); a pair is dropped whole, and left out when a cut leaves either reply no token.
    overlong: str = "truncate"
    shard_tokens: int = 16 * 1024 * 1024
    split_seed: int = 0

    def __post_init__(self) -> None:
        check_finite("data", self)
        if not self.tokenizer:
            raise ConfigError("data.tokenizer", self.tokenizer,
                              "use byte, bpe, a tokenizer.json path or an HF model dir")
        if self.vocab_size < 0:
            raise ConfigError("data.vocab_size", self.vocab_size, "use 0 (= model.vocab_size) or a size >= 257")
        if self.vocab_size and self.tokenizer != "bpe":  # byte is 256; a tokenizer.json brings its own size
            raise ConfigError("data.vocab_size", self.vocab_size,
                              f"only a trained tokenizer (data.tokenizer=bpe) takes a vocabulary size, not "
                              f"data.tokenizer={self.tokenizer}; leave data.vocab_size at 0")
        if self.on_bad_record not in ("fail", "skip"):
            raise ConfigError("data.on_bad_record", self.on_bad_record, "choose fail or skip")
        if not self.text_field:
            raise ConfigError("data.text_field", self.text_field, "name the JSONL field / Parquet column of the text")
        if not 0 < self.val_fraction < 0.5:
            raise ConfigError("data.val_fraction", self.val_fraction, "use a fraction in (0, 0.5)")
        check_positive("data", "shard_tokens", self.shard_tokens)
        if self.format not in ("text", "chat", "pairs"):
            raise ConfigError("data.format", self.format, "choose text, chat or pairs")
        if self.train_on not in ("assistant", "all", "last"):
            raise ConfigError("data.train_on", self.train_on, "choose assistant, all or last")
        if self.overlong not in ("truncate", "drop"):
            raise ConfigError("data.overlong", self.overlong, "choose truncate or drop")
        if self.format == "pairs":
            for name, default in (("train_on", "assistant"), ("packing", False)):
                if getattr(self, name) != default:
                    raise ConfigError(f"data.{name}", getattr(self, name),
                                      f"preference pairs learn only the completion, one pair per row; leave "
                                      f"data.{name} at {default}")
        elif self.format != "chat":
            for name, default in (("train_on", "assistant"), ("packing", False), ("overlong", "truncate")):
                if getattr(self, name) != default:
                    raise ConfigError(f"data.{name}", getattr(self, name),
                                      f"only chat data has samples to mask, pack or cut; set data.format=chat or "
                                      f"leave data.{name} at {default}")
