"""Chat records -> token ids + per-token loss masks, rendered with a chat template.

A chat record (a JSONL line or a Parquet row) holds ``messages``: a list of ``{"role", "content"}`` with
roles ``system``, ``user``, ``assistant`` and ``tool``. It is rendered to text with a Jinja chat template,
the same way transformers' ``apply_chat_template`` renders it (a sandboxed Jinja environment with
``trim_blocks`` and ``lstrip_blocks``, the messages as ``messages``, ``add_generation_prompt``, the
tokenizer's special tokens as ``bos_token``/``eos_token``), and the text is tokenized as a whole (so the
ids equal ``apply_chat_template(messages, tokenize=True)``).

The template is the ``chat_template`` of an HF tokenizer directory (``tokenizer_config.json``, or
``chat_template.jinja`` beside it), else :data:`DEFAULT_CHAT_TEMPLATE` (ChatML-style turns; for the byte
tokenizer and a trained BPE, whose ``<|im_start|>``/``<|im_end|>`` markers are then plain text).

Which tokens are learned (``data.train_on``): ``assistant``: every assistant turn's content and its end
marker (not the ``<|im_start|>assistant`` header that the prompt would supply at inference); ``last``: the
last assistant turn's only; ``all``: every token. A turn's span is found by rendering the conversation
up to the turn with ``add_generation_prompt=True`` (where the reply starts) and up to and including it
(where it ends); a template whose renderings are not prefixes of each other cannot be masked and is refused.
A token is learned when its first character lies in a learned span.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

ROLES = ("system", "user", "assistant", "tool")
TRAIN_ON = ("assistant", "all", "last")

#: The template for tokenizers that bring none (byte, a trained BPE): ChatML turns.
DEFAULT_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


class ChatError(ValueError):
    """A chat record cannot be rendered or learned from; the message names the record and the fix."""


def template_sha256(template: str) -> str:
    """Hex sha256 of a chat template's text (recorded in every shard and the index)."""
    return hashlib.sha256(template.encode("utf-8")).hexdigest()


def hf_dir_chat_template(tokenizer_spec: str) -> str | None:
    """The ``chat_template`` an HF tokenizer directory names (tokenizer_config.json or chat_template.jinja)."""
    p = Path(tokenizer_spec).expanduser()
    d = p if p.is_dir() else p.parent
    jinja = d / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    try:
        tpl = json.loads((d / "tokenizer_config.json").read_text(encoding="utf-8")).get("chat_template")
    except (OSError, ValueError, AttributeError):
        return None
    if isinstance(tpl, list):  # named templates: the "default" one
        tpl = next((t.get("template") for t in tpl if isinstance(t, dict) and t.get("name") == "default"), None)
    return tpl if isinstance(tpl, str) and tpl else None


def _special_tokens(tokenizer_spec: str) -> dict[str, str]:
    """``bos_token``/``eos_token`` an HF directory names (templates use them), as transformers passes them."""
    out: dict[str, str] = {}
    p = Path(tokenizer_spec).expanduser()
    d = p if p.is_dir() else p.parent
    try:
        cfg = json.loads((d / "tokenizer_config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return out
    for key in ("bos_token", "eos_token", "pad_token", "unk_token"):
        v = cfg.get(key)
        if isinstance(v, dict):
            v = v.get("content")
        if isinstance(v, str):
            out[key] = v
    return out


@dataclass
class ChatSample:
    """One rendered conversation: token ids and which of them are learned (1) or context (0)."""

    ids: np.ndarray
    mask: np.ndarray  # uint8, same length as ids


class ChatRenderer:
    """Render chat records with one template and tokenizer; mask the tokens ``train_on`` does not learn."""

    def __init__(self, tok: Any, template: str, train_on: str = "assistant",
                 special_tokens: dict[str, str] | None = None) -> None:
        from jinja2.exceptions import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        if train_on not in TRAIN_ON:
            raise ChatError(f"data.train_on={train_on!r}: choose one of {', '.join(TRAIN_ON)}")
        self.tok, self.template, self.train_on = tok, template, train_on
        self.sha256 = template_sha256(template)
        self.special = dict(special_tokens or {})
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)

        def raise_exception(message: str) -> None:  # what transformers offers templates
            raise TemplateError(message)

        env.globals["raise_exception"] = raise_exception
        try:
            self._tpl = env.from_string(template)
        except TemplateError as exc:
            raise ChatError(f"the chat template does not parse ({exc}); fix the tokenizer's chat_template") from None

    @classmethod
    def for_tokenizer(cls, tok: Any, tokenizer_spec: str, train_on: str) -> ChatRenderer:
        """The tokenizer directory's own chat template when it has one, else :data:`DEFAULT_CHAT_TEMPLATE`."""
        tpl = hf_dir_chat_template(tokenizer_spec) if tokenizer_spec not in ("byte", "bpe") else None
        special = _special_tokens(tokenizer_spec) if tpl is not None else {}
        return cls(tok, tpl or DEFAULT_CHAT_TEMPLATE, train_on, special)

    def render(self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = False) -> str:
        """The template's text for ``messages`` (what ``apply_chat_template(..., tokenize=False)`` returns)."""
        return self._tpl.render(messages=list(messages), add_generation_prompt=add_generation_prompt,
                                **self.special)

    def sample(self, messages: Sequence[dict[str, Any]], where: str) -> ChatSample:
        """Token ids and loss mask of one conversation; :class:`ChatError` naming ``where`` when it is bad."""
        check_messages(messages, where)
        try:
            text = self.render(messages)
            spans = self._learned_spans(messages, text, where)
        except ChatError:
            raise
        except Exception as exc:  # noqa: BLE001 - a template may raise anything (TemplateError, TypeError ...)
            why = str(exc).splitlines()[0] if str(exc) else ""
            raise ChatError(f"{where}: the chat template fails to render this record ({type(exc).__name__}: "
                            f"{why}); fix the record or the template") from None
        ids, starts = self._encode_with_offsets(text)
        if self.train_on == "all":
            mask = np.ones(len(ids), dtype=np.uint8)
        else:
            mask = np.zeros(len(ids), dtype=np.uint8)
            for a, b in spans:
                mask[(starts >= a) & (starts < b)] = 1
        if not mask.any():
            raise ChatError(f"{where}: no token of an assistant turn survives tokenization; fix the record")
        return ChatSample(ids, mask)

    def _learned_spans(self, messages: Sequence[dict[str, Any]], text: str, where: str) -> list[tuple[int, int]]:
        """Character spans of the learned assistant replies in ``text``."""
        turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
        if self.train_on == "last":
            turns = turns[-1:]
        spans = []
        for i in turns:
            head = self.render(messages[:i], add_generation_prompt=True)
            upto = self.render(messages[: i + 1])
            if not (text.startswith(upto) and upto.startswith(head)) or len(upto) <= len(head):
                raise ChatError(f"{where}: the chat template does not render conversations as prefixes of each "
                                f"other (assistant turn {i}), so its replies cannot be masked; use a template that "
                                "appends turns, or data.train_on=all")
            spans.append((len(head), len(upto)))
        return spans

    def _encode_with_offsets(self, text: str) -> tuple[np.ndarray, np.ndarray]:
        """(ids, the character offset where each token starts) of the whole text."""
        backend = getattr(self.tok, "backend", None)
        if backend is not None:  # an HF tokenizers.Tokenizer: its own offsets
            enc = backend.encode(text, add_special_tokens=False)
            ids = np.asarray(enc.ids, dtype=np.int64)
            starts = np.asarray([o[0] for o in enc.offsets], dtype=np.int64)
            return ids, starts
        ids = np.asarray(self.tok.encode(text), dtype=np.int64)  # bytes: token i is byte i
        # character index of each byte: a character of k UTF-8 bytes repeats its index k times
        lens = np.fromiter((len(c.encode("utf-8")) for c in text), dtype=np.int64, count=len(text))
        starts = np.repeat(np.arange(len(text), dtype=np.int64), lens)
        return ids, starts


def check_messages(messages: Any, where: str) -> None:
    """A clear :class:`ChatError` naming ``where`` for a record that is not a conversation we can learn."""
    if not isinstance(messages, list) or not messages:
        raise ChatError(f"{where}: 'messages' is not a non-empty list of {{role, content}} objects; fix the record")
    for k, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise ChatError(f"{where}: message {k} is not an object with 'role' and 'content'; fix the record")
        if m["role"] not in ROLES:
            raise ChatError(f"{where}: message {k} has unknown role {m['role']!r}; use one of {', '.join(ROLES)}")
        if not isinstance(m["content"], str):
            raise ChatError(f"{where}: message {k} content is a {type(m['content']).__name__}, not a string; "
                            "fix the record")
    if not any(m["role"] == "assistant" for m in messages):
        raise ChatError(f"{where}: the conversation has no assistant turn, so nothing would be learned; "
                        "add an assistant reply or remove the record")
