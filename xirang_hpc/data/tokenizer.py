"""The one tokenizer API of xirang-hpc: preparation, training, eval, serving and export all use it.

- :class:`ByteTokenizer`: vocab 256, needs no files, round-trips any UTF-8 text exactly (the default).
- :class:`HFTokenizer`: a ``tokenizer.json`` of the Hugging Face ``tokenizers`` library (a BPE that
  ``xirang-prepare data.tokenizer=bpe`` trained, or one a user brings: the file or an HF model dir).

Where a tokenizer lives:
- ``<data_dir>/tokenizer.json`` + ``index.json`` (kind, vocab size, sha256): :func:`load_data_tokenizer`;
- ``<run_dir>/tokenizer.json``, copied there when the job starts (:func:`install_run_tokenizer`):
  :func:`load_run_tokenizer` is what eval, serving and export read. No file means bytes.
- ``chat_template.json`` beside them (chat data): the template the run was fine-tuned with, its special
  tokens and stop strings; :func:`load_run_tokenizer` gives the tokenizer an ``apply_chat_template`` with it,
  so serving prompts a chat model exactly as it was trained.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import numpy as np

from xirang_hpc.files import record_mode

TOKENIZER_FILE = "tokenizer.json"
CHAT_TEMPLATE_FILE = "chat_template.json"
EOT = "<|endoftext|>"
# End-of-text tokens of common tokenizer families, tried when a tokenizer does not name its own.
_EOS_CANDIDATES = (EOT, "</s>", "<|end_of_text|>", "<eos>", "<|eot_id|>", "[SEP]")


class TokenizerError(ValueError):
    """A tokenizer cannot be loaded or does not match; the message names the file and the fix."""


@runtime_checkable
class Tokenizer(Protocol):
    """What every tokenizer offers (``tokenizer_json``: path of its tokenizer.json, None for bytes)."""

    name: str
    vocab_size: int
    eos_id: int | None
    tokenizer_json: str | None

    def encode(self, text: str) -> list[int] | np.ndarray:
        """text -> token ids."""
        ...

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        """token ids -> text."""
        ...


class ByteTokenizer:
    """Token i is byte i."""

    name = "byte"
    vocab_size = 256
    eos_id: int | None = None
    tokenizer_json: str | None = None

    def encode(self, text: str) -> np.ndarray:
        """text -> uint8 token array."""
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).copy()

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        """Several texts at once (same as :meth:`encode` on each)."""
        return [self.encode(t) for t in texts]

    def decode(self, tokens: Sequence[int] | np.ndarray) -> str:
        """tokens -> text; invalid UTF-8 sequences (possible mid-generation) are replaced."""
        return bytes(int(t) & 0xFF for t in tokens).decode("utf-8", errors="replace")


def file_sha256(path: str | Path) -> str:
    """Hex sha256 of a file's bytes."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def token_dtype(vocab_size: int) -> type[np.unsignedinteger[Any]]:
    """The smallest unsigned dtype that holds every id of a vocabulary (shards store this)."""
    if vocab_size <= 1 << 8:
        return np.uint8
    if vocab_size <= 1 << 16:
        return np.uint16
    return np.uint32


class HFTokenizer:
    """A ``tokenizers.Tokenizer`` loaded from a tokenizer.json.

    ``name`` is derived from the file's content (model type, vocab size, sha256 prefix), so the same
    tokenizer has the same name in the data directory, the run directory and an export.
    """

    def __init__(self, path: str | Path, eos_token: str | None = None) -> None:
        from tokenizers import Tokenizer as _HF

        p = Path(path).expanduser().absolute()
        try:
            self._tok = _HF.from_file(str(p))
            kind = str(json.loads(p.read_text(encoding="utf-8")).get("model", {}).get("type") or "hf")
        except Exception as exc:  # noqa: BLE001 - tokenizers raises plain Exceptions for bad files
            raise TokenizerError(f"{p} is not a readable tokenizer.json ({str(exc).splitlines()[0]}); "
                                 "save one with tokenizers' Tokenizer.save() or save_pretrained()") from None
        self.tokenizer_json: str | None = str(p)
        self.sha256 = file_sha256(p)
        self.vocab_size: int = int(self._tok.get_vocab_size(with_added_tokens=True))
        self.kind = kind.lower()
        self.name: str = f"{self.kind}-{self.vocab_size}-{self.sha256[:12]}"
        self.eos_id: int | None = None
        for cand in ((eos_token,) if eos_token else ()) + _EOS_CANDIDATES:
            tid = self._tok.token_to_id(cand)
            if tid is not None:
                self.eos_id = int(tid)
                break
        self._dtype = token_dtype(self.vocab_size)

    @property
    def backend(self) -> Any:
        """The wrapped ``tokenizers.Tokenizer``."""
        return self._tok

    def encode(self, text: str) -> np.ndarray:
        """text -> token ids (no special tokens added)."""
        return np.asarray(self._tok.encode(text, add_special_tokens=False).ids, dtype=self._dtype)

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        """Several texts at once, in parallel over the cores (the library's ``encode_batch_fast``)."""
        fast = getattr(self._tok, "encode_batch_fast", None) or self._tok.encode_batch
        return [np.asarray(e.ids, dtype=self._dtype) for e in fast(list(texts), add_special_tokens=False)]

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        """token ids -> text; special tokens (the end-of-text marker) are kept visible."""
        return self._tok.decode([int(t) for t in ids], skip_special_tokens=False)

    def info(self) -> dict[str, Any]:
        """What index.json, /v1/model and the run record say about this tokenizer."""
        return {"name": self.name, "kind": self.kind, "vocab_size": self.vocab_size, "sha256": self.sha256,
                "eos_id": self.eos_id}


def tokenizer_info(tok: Tokenizer) -> dict[str, Any]:
    """name, kind, vocab size, sha256 (None for bytes) and end-of-text id of any tokenizer."""
    if isinstance(tok, HFTokenizer):
        return tok.info()
    return {"name": tok.name, "kind": tok.name, "vocab_size": tok.vocab_size,
            "sha256": None, "eos_id": tok.eos_id}


def encode_batch(tok: Tokenizer, texts: Sequence[str]) -> list[np.ndarray]:
    """Encode several texts with the tokenizer's batch path when it has one."""
    fn = getattr(tok, "encode_batch", None)
    if fn is not None:
        return list(fn(texts))
    return [np.asarray(tok.encode(t)) for t in texts]


def _hf_dir_eos(d: Path) -> str | None:
    """The eos token an HF model dir names in tokenizer_config.json / special_tokens_map.json."""
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        try:
            eos = json.loads((d / name).read_text(encoding="utf-8")).get("eos_token")
        except (OSError, ValueError, AttributeError):
            continue
        if isinstance(eos, dict):
            eos = eos.get("content")
        if isinstance(eos, str) and eos:
            return eos
    return None


def resolve_tokenizer_file(spec: str) -> Path:
    """The tokenizer.json a spec names: the file itself, or ``<dir>/tokenizer.json`` of an HF model dir."""
    p = Path(spec).expanduser()
    if p.is_dir():
        if not (p / TOKENIZER_FILE).is_file():
            raise TokenizerError(
                f"data.tokenizer={spec!r} is a directory without {TOKENIZER_FILE}; point it at a tokenizer.json "
                "or an HF model dir saved with save_pretrained() (a 'fast' tokenizer)")
        return (p / TOKENIZER_FILE).absolute()
    if p.is_file():
        return p.absolute()
    raise TokenizerError(f"data.tokenizer={spec!r}: no such file or directory; use 'byte', 'bpe' "
                         "(trained by xirang-prepare), a tokenizer.json path or an HF model dir")


def load_tokenizer(spec: str) -> Tokenizer:
    """``"byte"``, a tokenizer.json path, or an HF model dir holding tokenizer.json."""
    if spec == "byte":
        return ByteTokenizer()
    if spec == "bpe":
        raise TokenizerError("data.tokenizer=bpe is trained by xirang-prepare on the corpus; load the result "
                             "from the prepared data (load_data_tokenizer) or pass its tokenizer.json path")
    f = resolve_tokenizer_file(spec)
    return HFTokenizer(f, eos_token=_hf_dir_eos(f.parent))


def load_data_tokenizer(data_dir: str | Path) -> Tokenizer:
    """The tokenizer a prepared data dir records in index.json (bytes when it records none)."""
    d = Path(data_dir)
    try:
        index = json.loads((d / "index.json").read_text())
    except OSError:
        raise TokenizerError(f"{d} holds no prepared data (no index.json); run xirang-prepare first") from None
    tok = index.get("tokenizer_info") or {}
    if not tok.get("file"):
        return ByteTokenizer()
    hf = HFTokenizer(d / tok["file"])
    if tok.get("sha256") and hf.sha256 != tok["sha256"]:
        raise TokenizerError(f"{d / tok['file']} changed since the data was prepared (sha256 {hf.sha256[:12]} "
                             f"!= {tok['sha256'][:12]} in index.json); rerun xirang-prepare")
    if tok.get("eos_id") is not None:
        hf.eos_id = int(tok["eos_id"])
    return hf


def load_run_tokenizer(run_dir: str | Path) -> Tokenizer:
    """The tokenizer a run trained with: ``<run_dir>/tokenizer.json``, else bytes (with its chat template, if any)."""
    f = Path(run_dir) / TOKENIZER_FILE
    tok: Tokenizer = HFTokenizer(f) if f.is_file() else ByteTokenizer()
    chat = Path(run_dir) / CHAT_TEMPLATE_FILE
    if chat.is_file():
        attach_chat_template(tok, json.loads(chat.read_text(encoding="utf-8")))
    return tok


def attach_chat_template(tok: Tokenizer, record: dict[str, Any]) -> Tokenizer:
    """Give ``tok`` the ``chat_template``/``apply_chat_template`` of a ``chat_template.json`` record (in place).

    ``apply_chat_template(messages, tokenize=False, add_generation_prompt=False)`` as Hugging Face tokenizers
    have it; ``chat_stop``: the strings that end a reply under this template (the default template's
    ``<|im_end|>``, which byte and BPE vocabularies hold as plain text, not as one end token).
    """
    from xirang_hpc.data.chat import ChatRenderer

    renderer = ChatRenderer(tok, str(record["template"]), "all", dict(record.get("special_tokens") or {}))

    def apply_chat_template(messages: list[dict[str, Any]], tokenize: bool = False,
                            add_generation_prompt: bool = False) -> str | list[int]:
        text = renderer.render(messages, add_generation_prompt=add_generation_prompt)
        return [int(t) for t in tok.encode(text)] if tokenize else text

    t: Any = tok
    t.chat_template = renderer.template
    t.chat_stop = list(record.get("stop") or [])
    t.apply_chat_template = apply_chat_template
    return tok


def copy_tokenizer_file(src: str | Path, dst_dir: str | Path) -> Path:
    """Copy a tokenizer.json into ``dst_dir`` atomically (owner-only), returning the new path."""
    dst = Path(dst_dir) / TOKENIZER_FILE
    tmp = dst.with_name(f".{TOKENIZER_FILE}.tmp-{os.getpid()}")
    shutil.copyfile(src, tmp)
    os.chmod(tmp, record_mode())
    os.replace(tmp, dst)
    return dst


def install_run_tokenizer(data_dir: str | Path, run_dir: str | Path) -> Tokenizer:
    """At job start: put the data's tokenizer.json into the run dir; refuse a run dir trained otherwise.

    A run directory keeps one tokenizer for life: resuming it with data of another tokenizer would
    silently reinterpret every token id, so that is an error naming both.
    """
    tok = load_data_tokenizer(data_dir)
    run_file = Path(run_dir) / TOKENIZER_FILE
    have = file_sha256(run_file) if run_file.is_file() else None
    want = tok.sha256 if isinstance(tok, HFTokenizer) else None
    if have is not None and have != want:
        raise TokenizerError(
            f"run dir {run_dir} was trained with tokenizer {have[:12]} ({run_file}) but the data in {data_dir} "
            f"uses {tok.name}; use the data it was trained on, or a new run (train.run_dir=...)")
    if want is not None and have is None:
        if any((Path(run_dir) / "checkpoints").glob("step_*")):
            raise TokenizerError(
                f"run dir {run_dir} has checkpoints trained with the byte tokenizer but the data in {data_dir} "
                f"uses {tok.name}; use a new run (train.run_dir=...)")
        copy_tokenizer_file(tok.tokenizer_json, run_dir)  # type: ignore[arg-type]
    _install_chat_template(Path(data_dir), Path(run_dir))
    return load_run_tokenizer(run_dir)


def _install_chat_template(data_dir: Path, run_dir: Path) -> None:
    """Copy chat data's ``chat_template.json`` into the run dir; refuse a run dir fine-tuned with another one."""
    src, dst = data_dir / CHAT_TEMPLATE_FILE, run_dir / CHAT_TEMPLATE_FILE
    if not src.is_file():
        return
    if dst.is_file():
        if file_sha256(dst) != file_sha256(src):
            raise TokenizerError(f"run dir {run_dir} was fine-tuned with another chat template ({dst}) than the data "
                                 f"in {data_dir}; use the data it was trained on, or a new run (train.run_dir=...)")
        return
    tmp = dst.with_name(f".{CHAT_TEMPLATE_FILE}.tmp-{os.getpid()}")
    shutil.copyfile(src, tmp)
    os.chmod(tmp, record_mode())
    os.replace(tmp, dst)


class StreamDecoder:
    """Text of a growing token sequence, piece by piece (for streamed generation).

    Each :meth:`push` returns the new text since the last call; characters that may still change
    (an incomplete UTF-8 sequence shows as U+FFFD at the end) are held back until the next token.
    """

    def __init__(self, tok: Tokenizer) -> None:
        self.tok, self.ids, self.sent = tok, [], ""

    def push(self, token: int) -> str:
        """Add one token; the text it completes."""
        self.ids.append(int(token))
        text = self.tok.decode(self.ids)
        stable = text.rstrip("\ufffd")
        if not stable.startswith(self.sent):  # a decoder rewrote earlier text: wait for the final text
            return ""
        new, self.sent = stable[len(self.sent):], stable
        return new
