"""Byte-level tokenizer: vocab 256, needs no files, round-trips any UTF-8 text exactly."""

from __future__ import annotations

import numpy as np


class ByteTokenizer:
    """Token i is byte i."""

    name = "byte"
    vocab_size = 256

    def encode(self, text: str) -> np.ndarray:
        """text -> uint8 token array."""
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).copy()

    def decode(self, tokens: np.ndarray | list[int]) -> str:
        """tokens -> text; invalid UTF-8 sequences (possible mid-generation) are replaced."""
        return bytes(int(t) & 0xFF for t in tokens).decode("utf-8", errors="replace")
