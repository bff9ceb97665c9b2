"""The OpenAI-compatible request/response layer: validation, chat template, text of a generation.

``POST /v1/completions`` and ``POST /v1/chat/completions`` take OpenAI's request bodies and return
OpenAI's response shapes (or server-sent events with ``stream: true``); ``GET /v1/models`` lists the
one served model. The HTTP handlers live in :mod:`xirang_hpc.serve.server`; this module holds what
they share and what can be tested without a socket.

Tokenizer: the run's :class:`~xirang_hpc.data.tokenizer.Tokenizer` (``encode``, ``decode``,
``eos_id``: a token that ends a generation), optionally with a chat template (``chat_template`` set and an
``apply_chat_template(messages, tokenize=False, add_generation_prompt=True)`` method, as Hugging
Face tokenizers have). Without a chat template, messages are rendered by :func:`simple_chat_prompt`.
"""

from __future__ import annotations

import json
import math
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from xirang_hpc.data.tokenizer import Tokenizer

_MAX_SEED = 2**63 - 1
MAX_STOP = 4  # OpenAI's limit on stop sequences
MAX_LOGPROBS = 5  # OpenAI's limit on the legacy completions ``logprobs``
MAX_PROMPTS = 256  # prompts in one completions request (a batch)
CHAT_ROLES = ("system", "developer", "user", "assistant")
# The simple template's turn marker: a reply that starts the next turn ("\n<|user|>") ends there.
SIMPLE_CHAT_STOP = "\n<|"


class OpenAIError(Exception):
    """An error answered in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``."""

    TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error",
             408: "timeout_error", 500: "server_error"}

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict[str, Any]:
        """The JSON error object."""
        return {"error": {"message": self.message, "type": self.TYPES.get(self.status, "invalid_request_error"),
                          "param": self.param, "code": self.code}}

    def response(self) -> web.Response:
        """The HTTP response carrying it."""
        return web.json_response(self.body(), status=self.status)


def bad(message: str, param: str | None = None, code: str | None = None) -> OpenAIError:
    """A 400 naming the parameter."""
    return OpenAIError(400, message, param, code)


@dataclass
class Limits:
    """Request limits (from ServeConfig); shared by every endpoint."""

    max_prompt_tokens: int
    max_new_tokens: int


@dataclass
class OpenAIParams:
    """A validated completions or chat request."""

    kind: str  # "completion" | "chat"
    prompt: list[int]
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    stream: bool
    include_usage: bool
    stop: list[str] = field(default_factory=list)
    # Completions only: every prompt of a batch (``prompt`` is the first), the echoed prompt and the number of
    # alternatives per position in ``logprobs`` (None = no logprobs), OpenAI's legacy completions format.
    prompts: list[list[int]] = field(default_factory=list)
    echo: bool = False
    logprobs: int | None = None
    # The requested model: the base's id or a served adapter's name (serve/adapters.py), and that adapter's index.
    model: str = ""
    adapter: int = 0

    def __post_init__(self) -> None:
        if not self.prompts:
            self.prompts = [self.prompt]


# Fields each endpoint implements, and fields accepted only at their neutral value (OpenAI clients
# send some of them; anything else would silently change the meaning of the request).
_COMMON = {"model", "max_tokens", "temperature", "top_p", "top_k", "n", "stop", "seed", "stream",
           "stream_options", "user"}
_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "presence_penalty": (0, 0.0), "frequency_penalty": (0, 0.0), "logit_bias": ({},), "logprobs": (False,),
    "best_of": (1,), "suffix": ("",), "top_logprobs": (0,), "response_format": ({"type": "text"},),
    "tools": ([],), "tool_choice": ("none",), "parallel_tool_calls": (False, True), "store": (False,),
    "service_tier": ("auto", "default"),
}
COMPLETION_FIELDS = _COMMON | {"prompt", "echo", "logprobs", "best_of", "suffix", "logit_bias",
                               "presence_penalty", "frequency_penalty"}
CHAT_FIELDS = _COMMON | {"messages", "max_completion_tokens", "logprobs", "top_logprobs", "logit_bias",
                         "presence_penalty", "frequency_penalty", "response_format", "tools", "tool_choice",
                         "parallel_tool_calls", "store", "metadata", "service_tier"}


def json_object(raw: bytes, example: str) -> dict[str, Any]:
    """A request body as a JSON object; ValueError saying what is wrong (``example`` shows a good body)."""
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ValueError(f"request body is not valid JSON ({exc}); send a JSON object like {example}") from exc
    if not isinstance(body, dict):
        raise ValueError(f"request body must be a JSON object, got {type(body).__name__}")
    return body


def parse_json_body(raw: bytes) -> dict[str, Any]:
    """The request body as a JSON object, else a 400 saying what was wrong."""
    try:
        return json_object(raw, '{"model": "...", "prompt": "def ", "max_tokens": 16}')
    except ValueError as exc:
        raise bad(str(exc)) from exc


def requested_model(body: dict[str, Any]) -> str:
    """The ``model`` field (required by the OpenAI API)."""
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad(f"'model' must be the served model's id (a non-empty string; GET /v1/models lists it), "
                  f"got {model!r}", "model")
    return model


def _opt(body: dict[str, Any], name: str) -> Any:
    """A field's value, None when absent or null (OpenAI treats explicit null as 'not given')."""
    return body.get(name)


def _int(body: dict[str, Any], name: str, default: int | None, lo: int, hi: int, why: str = "") -> int | None:
    v = _opt(body, name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int):
        raise bad(f"'{name}' must be an integer, got {type(v).__name__} {v!r}", name)
    if not lo <= v <= hi:
        raise bad(f"'{name}'={v} is out of range; use {lo} <= {name} <= {hi}{why}", name)
    return v


def _num(body: dict[str, Any], name: str, default: float, lo: float, hi: float, lo_open: bool = False) -> float:
    v = _opt(body, name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise bad(f"'{name}' must be a number, got {type(v).__name__} {v!r}", name)
    if v > hi or v < lo or (lo_open and v == lo):
        lo_txt = f"{lo} < {name}" if lo_open else f"{lo} <= {name}"
        raise bad(f"'{name}'={v} is out of range; use {lo_txt} <= {hi}", name)
    return float(v)


def _check_fields(body: dict[str, Any], allowed: set[str], implemented: tuple[str, ...] = ()) -> None:
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise bad(f"unknown or unsupported field(s) {unknown}; this server accepts {sorted(allowed)}", unknown[0])
    for name, neutral in _NEUTRAL.items():
        if name in implemented:
            continue
        v = body.get(name)
        if name in body and v is not None and v not in neutral:
            raise bad(f"'{name}'={v!r} is not supported by this server; omit it (or send {neutral[0]!r})", name)


def _stop(body: dict[str, Any]) -> list[str]:
    v = _opt(body, "stop")
    if v is None:
        return []
    stops = [v] if isinstance(v, str) else v
    if (not isinstance(stops, list) or not 1 <= len(stops) <= MAX_STOP
            or not all(isinstance(s, str) and s for s in stops)):
        raise bad(f"'stop' must be a non-empty string or a list of 1 to {MAX_STOP} non-empty strings, got {v!r}",
                  "stop")
    return list(stops)


def _one_prompt(p: Any, tok: Tokenizer) -> list[int] | None:
    if isinstance(p, str):
        return [int(t) for t in tok.encode(p)]
    if isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
        return [int(t) for t in p]  # token ids
    return None


def _prompt_batch(body: dict[str, Any], tok: Tokenizer) -> list[list[int]]:
    """The completions ``prompt``: a string, token ids, or a list (a batch) of strings or of token-id lists."""
    p = body.get("prompt")
    single = _one_prompt(p, tok)
    if single is not None:
        return [single]  # a string ("" is refused as empty later) or one list of token ids
    if isinstance(p, list) and p and isinstance(p[0], (str, list)):
        if len(p) > MAX_PROMPTS:
            raise bad(f"'prompt' is a batch of {len(p)} prompts, more than {MAX_PROMPTS}; split it", "prompt")
        batch = []
        for i, x in enumerate(p):
            ids = _one_prompt(x, tok)
            if ids is None:
                raise bad(f"'prompt[{i}]' must be a string or a non-empty list of token ids, got {x!r:.60}",
                          "prompt")
            batch.append(ids)
        return batch
    raise bad("'prompt' must be a string, a list of token ids, or a list (a batch) of those, "
              f"got {type(p).__name__}", "prompt")


def simple_chat_prompt(messages: list[dict[str, str]]) -> str:
    """The built-in chat template: ``<|role|>\\ncontent\\n`` per message, then ``<|assistant|>\\n``."""
    return "".join(f"<|{m['role']}|>\n{m['content']}\n" for m in messages) + "<|assistant|>\n"


def has_chat_template(tok: Any) -> bool:
    """Whether the tokenizer brings its own chat template (Hugging Face style)."""
    return bool(getattr(tok, "chat_template", None)) and callable(getattr(tok, "apply_chat_template", None))


def _messages(body: dict[str, Any]) -> list[dict[str, str]]:
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise bad(f"'messages' must be a non-empty list of {{'role', 'content'}} objects, got {msgs!r}", "messages")
    out = []
    for i, m in enumerate(msgs):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad(f"'{where}' must be an object with 'role' and 'content', got {type(m).__name__}", where)
        role, content = m.get("role"), m.get("content")
        if role not in CHAT_ROLES:
            raise bad(f"'{where}.role'={role!r} is not supported; use one of {list(CHAT_ROLES)}", f"{where}.role")
        if isinstance(content, list):  # content parts: text only
            texts = []
            for j, part in enumerate(content):
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise bad(f"'{where}.content[{j}]' must be a text part {{'type': 'text', 'text': str}} "
                              f"(this model reads text only), got {part!r}", f"{where}.content")
                texts.append(part["text"])
            content = "".join(texts)
        if not isinstance(content, str):
            raise bad(f"'{where}.content' must be a string or a list of text parts, got {type(content).__name__}",
                      f"{where}.content")
        out.append({"role": role, "content": content})
    return out


def chat_prompt(tok: Any, messages: list[dict[str, str]]) -> tuple[str, list[str]]:
    """The prompt text for ``messages`` and the stop strings the template implies.

    The tokenizer's own chat template when it has one (its EOS token ends the reply, and the strings in its
    ``chat_stop``: a run fine-tuned on chat data serves with the template it learned); otherwise
    :func:`simple_chat_prompt`, whose replies also end where the model starts a new turn (``\\n<|``).
    """
    if has_chat_template(tok):
        return (str(tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)),
                list(getattr(tok, "chat_stop", None) or []))
    return simple_chat_prompt(messages), [SIMPLE_CHAT_STOP]


def parse_openai(body: dict[str, Any], kind: str, limits: Limits, vocab: int, tok: Any) -> OpenAIParams:
    """Validate a completions (``kind="completion"``) or chat (``"chat"``) body; a 400 names the field."""
    if kind == "completion":
        _check_fields(body, COMPLETION_FIELDS, implemented=("logprobs",))
    else:
        _check_fields(body, CHAT_FIELDS)
    extra_stop: list[str] = []
    if kind == "completion":
        batch, what = _prompt_batch(body, tok), "prompt"
    else:
        text, extra_stop = chat_prompt(tok, _messages(body))
        batch, what = [[int(t) for t in tok.encode(text)]], "messages"
    for ids in batch:
        if not ids:
            raise bad(f"'{what}' is empty; send at least one character", what)
        if len(ids) > limits.max_prompt_tokens:
            raise bad(f"'{what}' is {len(ids)} tokens, more than the limit of {limits.max_prompt_tokens} "
                      "(serve.max_prompt_tokens); shorten it", what, "context_length_exceeded")
        if min(ids) < 0 or max(ids) >= vocab:
            raise bad(f"'{what}' has token ids outside the model's vocabulary [0, {vocab})", what)
    ids = batch[0]
    echo, logprobs = False, None
    if kind == "completion":
        echo = _opt(body, "echo")
        if echo is not None and not isinstance(echo, bool):
            raise bad(f"'echo' must be true or false, got {echo!r}", "echo")
        echo = bool(echo)
        lp = _opt(body, "logprobs")
        logprobs = None if lp is None or lp is False else _int(body, "logprobs", None, 0, MAX_LOGPROBS)
    n = _int(body, "n", 1, 1, 1, " (this server returns one choice per prompt)")
    assert n == 1
    limit_why = " (serve.max_new_tokens)"
    if kind == "chat" and _opt(body, "max_completion_tokens") is not None:
        max_tokens = _int(body, "max_completion_tokens", None, 1, limits.max_new_tokens, limit_why)
    else:  # OpenAI's completions default is 16; chat replies may use the whole budget
        default = min(16, limits.max_new_tokens) if kind == "completion" else limits.max_new_tokens
        # max_tokens=0 with echo scores the prompt alone (OpenAI's legacy completions allow it).
        max_tokens = _int(body, "max_tokens", default, 0 if echo else 1, limits.max_new_tokens,
                          limit_why if echo else f"{limit_why}; 0 only with echo=true")
    temperature = _num(body, "temperature", 1.0, 0.0, 2.0)
    top_p = _num(body, "top_p", 1.0, 0.0, 1.0, lo_open=True)
    top_k = _int(body, "top_k", 0, 0, vocab)
    seed = _int(body, "seed", None, 0, _MAX_SEED)
    stream = _opt(body, "stream")
    if stream is not None and not isinstance(stream, bool):
        raise bad(f"'stream' must be true or false, got {stream!r}", "stream")
    opts = _opt(body, "stream_options")
    if opts is not None and (not isinstance(opts, dict) or set(opts) - {"include_usage", "include_obfuscation"}
                             or not isinstance(opts.get("include_usage", False), bool)):
        raise bad(f"'stream_options' must be {{'include_usage': bool}}, got {opts!r}", "stream_options")
    user = _opt(body, "user")
    if user is not None and not isinstance(user, str):
        raise bad(f"'user' must be a string, got {type(user).__name__}", "user")
    if stream and (len(batch) > 1 or echo or logprobs is not None):
        raise bad("'stream' is supported for one prompt without echo or logprobs; send stream=false", "stream")
    return OpenAIParams(kind, ids, int(max_tokens or 0), temperature, top_p, int(top_k or 0), seed, bool(stream),
                        bool((opts or {}).get("include_usage", False)), _stop(body) + extra_stop, batch, echo,
                        logprobs)


# ---- text of a generation ---------------------------------------------------------------------


def final_text(tok: Any, out: list[int], stop: list[str]) -> tuple[str, bool]:
    """The reply text for tokens ``out``: cut before the first stop string; and whether one was hit."""
    text = tok.decode(out)
    cuts = [i for i in (text.find(s) for s in stop) if i >= 0]
    return (text[: min(cuts)], True) if cuts else (text, False)


def stop_predicate(tok: Any, stop: list[str]) -> Any:
    """For the engine: True once the decoded output contains a stop string (None without stops)."""
    if not stop:
        return None
    return lambda out: final_text(tok, out, stop)[1]


def settled_text(tok: Any, out: list[int], stop: list[str]) -> str:
    """The part of the reply that can no longer change: what streaming may send so far.

    Holds back a trailing partial UTF-8 character (decoded as U+FFFD) and any tail that could be
    the start of a stop string, so the streamed pieces always add up to :func:`final_text`.
    """
    text, hit = final_text(tok, out, stop)
    if hit:
        return text
    text = text.rstrip("\ufffd")
    hold = 0
    for s in stop:
        for k in range(min(len(s) - 1, len(text)), hold, -1):
            if text.endswith(s[:k]):
                hold = k
                break
    return text[: len(text) - hold]


# ---- response shapes --------------------------------------------------------------------------


def new_id(kind: str) -> str:
    """``cmpl-...`` / ``chatcmpl-...``."""
    return ("cmpl-" if kind == "completion" else "chatcmpl-") + uuid.uuid4().hex


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    """OpenAI's usage object."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def response_body(p: OpenAIParams, rid: str, created: int, model: str, text: str, finish: str,
                  completion_tokens: int) -> dict[str, Any]:
    """The non-streaming response."""
    if p.kind == "completion":
        choice: dict[str, Any] = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
        obj = "text_completion"
    else:
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                  "finish_reason": finish}
        obj = "chat.completion"
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": [choice],
            "usage": usage(len(p.prompt), completion_tokens)}


def legacy_logprobs(tok: Any, ids: list[int], start: int, token_lp: list[float | None],
                    top: list[list[tuple[int, float]]]) -> dict[str, Any]:
    """OpenAI's legacy completions ``logprobs`` for positions ``start..len(ids)-1`` of ``ids``.

    ``token_lp[i]`` / ``top[i]``: the log-probability of ``ids[i]`` and the most likely (token, logprob)
    pairs at position ``i`` (None / empty at position 0, which nothing predicts). ``text_offset`` are character
    offsets into the decoded ``ids``; ``top_logprobs`` keys are token texts (the likelier one kept when two
    tokens decode alike).
    """
    tokens, offsets, lps, tops = [], [], [], []
    for i in range(start, len(ids)):
        tokens.append(tok.decode([ids[i]]))
        offsets.append(len(tok.decode(ids[:i])) if i else 0)
        lps.append(token_lp[i])
        if i == 0:
            tops.append(None)
            continue
        d: dict[str, float] = {}
        for t, lp in top[i]:
            d.setdefault(tok.decode([t]), lp)
        tops.append(d)
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}


def completions_body(rid: str, created: int, model: str, choices: list[dict[str, Any]], prompt_tokens: int,
                     completion_tokens: int) -> dict[str, Any]:
    """A non-streaming completions response with one choice per prompt (``index`` = the prompt's place)."""
    return {"id": rid, "object": "text_completion", "created": created, "model": model, "choices": choices,
            "usage": usage(prompt_tokens, completion_tokens)}


def chunk_body(p: OpenAIParams, rid: str, created: int, model: str, text: str | None,
               finish: str | None, first: bool = False) -> dict[str, Any]:
    """One streamed chunk (``text=None``: no content, e.g. the final finish_reason chunk)."""
    if p.kind == "completion":
        choice: dict[str, Any] = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
        obj = "text_completion"
    else:
        delta: dict[str, Any] = {"role": "assistant"} if first else {}
        if text is not None:
            delta["content"] = text
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        obj = "chat.completion.chunk"
    body: dict[str, Any] = {"id": rid, "object": obj, "created": created, "model": model, "choices": [choice]}
    if p.include_usage:
        body["usage"] = None
    return body


def usage_chunk(p: OpenAIParams, rid: str, created: int, model: str, completion_tokens: int) -> dict[str, Any]:
    """The last chunk with ``stream_options.include_usage``: no choices, the usage."""
    obj = "text_completion" if p.kind == "completion" else "chat.completion.chunk"
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": [],
            "usage": usage(len(p.prompt), completion_tokens)}


def sse(obj: Any) -> bytes:
    """One server-sent event carrying ``obj`` as JSON (``"[DONE]"`` verbatim)."""
    data = obj if isinstance(obj, str) else json.dumps(obj, separators=(",", ":"))
    return f"data: {data}\n\n".encode()


def model_card(model_id: str, created: float) -> dict[str, Any]:
    """One entry of ``GET /v1/models``."""
    return {"id": model_id, "object": "model", "created": int(created), "owned_by": "xirang"}


def now() -> int:
    """``created`` timestamps."""
    return int(time.time())
