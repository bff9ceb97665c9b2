"""HTTP JSON API over the batched engine (aiohttp).

Endpoints:
- ``GET /health`` -> ``{"status": "ok"}`` (never needs the token: liveness probes);
- ``GET /v1/model`` -> model config, source checkpoint, limits and engine counters;
- ``POST /v1/generate`` with ``{"prompt": str, "max_tokens": int, "temperature": float, "top_k": int,
  "seed": int | null, "stream": bool}`` -> ``{"text", "prompt_tokens", "completion_tokens", "seed",
  "latency_s"}``; with ``stream: true`` the reply is NDJSON, one ``{"token", "text"}`` line per token
  and a final ``{"done": true, ...}`` line.

Every malformed request gets HTTP 400 with ``{"error": "<what is wrong and how to fix it>"}``:
invalid JSON, a non-object body, unknown or mistyped fields, an empty or oversized prompt, a
negative or too large ``max_tokens``, a negative temperature or top_k. With keys configured
(:mod:`xirang_hpc.serve.keys`: ``serve.keys_file`` and/or the single bearer token), ``/v1/*`` and
``/metrics`` (unless ``metrics_public``) need ``Authorization: Bearer <key>``: 401 for a missing or
unknown key, 403 for a key whose runs do not cover the served model. Every answered request
(``/health`` aside) goes to ``on_access`` with the key's name, never the key.

The OpenAI-compatible API (:mod:`xirang_hpc.serve.openai_api`): ``POST /v1/completions``,
``POST /v1/chat/completions`` (server-sent events with ``stream: true``), ``GET /v1/models`` and
``GET /v1/models/{id}``; completions also score (batches of prompts, ``echo``, legacy ``logprobs``,
``max_tokens`` 0: :mod:`xirang_hpc.serve.scoring`), and ``POST /tokenize``, ``POST /detokenize``,
``GET /tokenizer_info`` expose the served tokenizer as vLLM does; errors have OpenAI's shape
``{"error": {"message", "type", "param", "code"}}`` (400 bad parameters, 401 bearer token, 404 unknown model).
``GET /metrics`` is the Prometheus exposition (:mod:`xirang_hpc.serve.metrics`).

A request body that has not fully arrived ``read_timeout_s`` after the headers gets 408 and its
connection is closed; a client that goes away mid-stream cancels its generation (one log line).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import math
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aiohttp import web

from xirang_hpc.data.tokenizer import StreamDecoder, Tokenizer, tokenizer_info
from xirang_hpc.serve import openai_api as oa
from xirang_hpc.serve.engine import Engine, GenRequest
from xirang_hpc.serve.keys import Keys
from xirang_hpc.serve.metrics import STATUS_KEY, ServeMetrics
from xirang_hpc.serve.openai_api import Limits, OpenAIError
from xirang_hpc.serve.openai_routes import KEY_KEY, OpenAIRoutes
from xirang_hpc.serve.scoring import Scorer
from xirang_hpc.weights.load import LoadedModel

__all__ = ["BadRequest", "Limits", "Params", "Server", "parse_generate"]


log = logging.getLogger("xirang_hpc.serve")

_FIELDS = {"prompt", "max_tokens", "temperature", "top_k", "seed", "stream"}
_MAX_SEED = 2**63 - 1


class BadRequest(ValueError):
    """A request the server refuses with HTTP 400; the message says what to fix."""


@dataclass
class Params:
    """A validated generate request."""

    prompt: list[int]
    max_tokens: int
    temperature: float
    top_k: int
    seed: int | None
    stream: bool


def _int(body: dict[str, Any], name: str, default: int | None, lo: int, hi: int) -> int | None:
    v = body.get(name, default)
    if v is None and default is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        raise BadRequest(f"'{name}' must be an integer, got {type(v).__name__} {v!r}")
    if not lo <= v <= hi:
        raise BadRequest(f"'{name}'={v} is out of range; use {lo} <= {name} <= {hi}")
    return v


def parse_generate(raw: bytes, limits: Limits, vocab: int, tok: Tokenizer) -> Params:
    """Validate a generate body; raises :class:`BadRequest` naming the field and the fix."""
    try:
        body = oa.json_object(raw, '{"prompt": "def ", "max_tokens": 32}')
    except ValueError as exc:
        raise BadRequest(str(exc)) from exc
    unknown = sorted(set(body) - _FIELDS)
    if unknown:
        raise BadRequest(f"unknown field(s) {unknown}; allowed: {sorted(_FIELDS)}")
    prompt = body.get("prompt")
    if not isinstance(prompt, str):
        raise BadRequest(f"'prompt' must be a string, got {type(prompt).__name__}")
    ids = [int(t) for t in tok.encode(prompt)]
    if not ids:
        raise BadRequest("'prompt' is empty; send at least one character")
    if len(ids) > limits.max_prompt_tokens:
        raise BadRequest(f"'prompt' is {len(ids)} tokens, more than the limit of {limits.max_prompt_tokens} "
                         "(serve.max_prompt_tokens); shorten it")
    if max(ids) >= vocab:
        raise BadRequest(f"'prompt' has token ids >= the model's vocabulary ({vocab})")
    max_tokens = _int(body, "max_tokens", min(64, limits.max_new_tokens), 0, limits.max_new_tokens)
    top_k = _int(body, "top_k", 0, 0, vocab)
    seed = _int(body, "seed", None, 0, _MAX_SEED)
    temp = body.get("temperature", 0.0)
    if isinstance(temp, bool) or not isinstance(temp, (int, float)) or not math.isfinite(temp) or temp < 0:
        raise BadRequest(f"'temperature' must be a finite number >= 0 (0 = greedy), got {temp!r}")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise BadRequest(f"'stream' must be true or false, got {stream!r}")
    return Params(ids, int(max_tokens or 0), float(temp), int(top_k or 0), seed, stream)


def _err(status: int, msg: str) -> web.Response:
    return web.json_response({"error": msg}, status=status)


_TOKENIZER_PATHS = ("/tokenizer_info", "/tokenize", "/detokenize")


def _is_openai(path: str) -> bool:
    """Routes whose errors take OpenAI's shape."""
    return (path in ("/v1/completions", "/v1/chat/completions", "/v1/models", *_TOKENIZER_PATHS)
            or path.startswith("/v1/models/"))


def _error(path: str, status: int, msg: str, code: str | None = None) -> web.Response:
    """An error in the shape of the route's API."""
    return OpenAIError(status, msg, code=code).response() if _is_openai(path) else _err(status, msg)


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def public_source(source: str) -> str:
    """Where the weights came from, without this machine's directory layout: the last two parts of a path
    (``<run>/step_N`` reads ``checkpoints/step_N``; a Hugging Face dir its parent and name)."""
    p = Path(source)
    return "/".join(p.parts[-2:]) if p.is_absolute() else source


@dataclass(frozen=True)
class Access:
    """One answered request, for the access log and the audit trail: never the key, only its name."""

    peer: str
    method: str
    path: str
    status: int
    key: str | None


class Server(OpenAIRoutes):
    """The aiohttp application around one :class:`Engine`.

    ``tokenizer`` needs ``encode``/``decode`` (and optionally ``eos_id`` and a chat template; see
    :mod:`xirang_hpc.serve.openai_api`); the default is the byte tokenizer the models train on.
    ``model_id`` is the id of the OpenAI-compatible API (default: the model preset's name). The
    server feeds ``metrics`` (a fresh :class:`ServeMetrics` by default) from the engine's step hook.
    """

    def __init__(self, loaded: LoadedModel, engine: Engine, limits: Limits, token: str | None = None,
                 tokenizer: Any = None, model_id: str | None = None, read_timeout_s: float = 30.0,
                 metrics: ServeMetrics | None = None, keys: Keys | None = None, metrics_public: bool = False,
                 on_access: Callable[[Access], None] | None = None) -> None:
        self.loaded, self.engine, self.limits = loaded, engine, limits
        # Who may call: named keys (serve.keys_file) and/or the single bearer token; none = open (loopback only).
        self.keys = keys if keys is not None else Keys.from_token(token)
        self.metrics_public = metrics_public
        self.on_access = on_access
        # The run's own tokenizer (bytes, a trained BPE or a tokenizer.json), unless one is passed explicitly.
        self.tok: Tokenizer = tokenizer if tokenizer is not None else loaded.tokenizer
        self.eos_id: int | None = getattr(self.tok, "eos_id", None)
        self.model_id = model_id or loaded.cfg.name
        # Several LoRA adapters over this model (serve.adapters): each a model id of its own beside the base's.
        self.adapters = engine.adapters
        self.model_ids = [self.model_id, *(self.adapters.names if self.adapters is not None else [])]
        self.read_timeout_s = read_timeout_s
        self.metrics = metrics if metrics is not None else ServeMetrics()
        engine.on_step = self.metrics.on_step
        self.scorer = Scorer(loaded.model, engine.max_batch, self.adapters)
        self.started = time.time()

    def app(self) -> web.Application:
        """The web application (routes; metrics, auth and body-read middlewares, outermost first)."""
        # Bodies past this size are refused before parsing (as a 400, see _read_body()).
        max_body = max(1 << 16, 8 * self.limits.max_prompt_tokens + 4096)
        app = web.Application(client_max_size=max_body,
                              middlewares=[self.metrics.middleware, self._auth, self._read_body])
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.metrics.handler)
        app.router.add_get("/v1/model", self.model_info)
        app.router.add_post("/v1/generate", self.generate)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/v1/models/{model}", self.model_card)
        # The served tokenizer, as vLLM exposes it (lm-evaluation-harness's remote tokenizer reads these).
        app.router.add_get("/tokenizer_info", self.tokenizer_info)
        app.router.add_post("/tokenize", self.tokenize)
        app.router.add_post("/detokenize", self.detokenize)
        return app

    def runner_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for ``web.AppRunner``/``TestServer``.

        aiohttp's keep-alive timer runs from the moment a connection opens until a request's headers
        are complete, so setting it to the read timeout also closes connections whose headers
        trickle in (slowloris); bodies are timed by :meth:`_read_body`.
        """
        return {"access_log": None, "keepalive_timeout": self.read_timeout_s}

    def _guarded(self, path: str) -> bool:
        """Whether ``path`` needs a key: the API always, ``/metrics`` unless ``serve.metrics_public``."""
        return bool(self.keys) and (path.startswith("/v1/") or path in _TOKENIZER_PATHS
                                    or (path == "/metrics" and not self.metrics_public))

    @web.middleware
    async def _auth(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        key_name = None
        status = 500
        try:
            if self._guarded(request.path):
                key = self.keys.match(request.headers.get("Authorization", ""))
                if key is None:
                    status = 401
                    return _error(request.path, 401,
                                  "missing or unknown bearer token; send 'Authorization: Bearer <key>'",
                                  "invalid_api_key")
                key_name = key.name
                request[KEY_KEY] = key  # a served adapter is checked against it once the body names the model
                if not key.may_serve(self.model_id):
                    status = 403
                    return _error(request.path, 403, f"the key {key.name!r} may not use the model {self.model_id!r} "
                                  "(its 'runs' in serve.keys_file do not cover it)", "permission_denied")
            resp = await handler(request)
            status = resp.status
            return resp
        except web.HTTPException as exc:
            status = exc.status
            raise
        finally:
            if self.on_access is not None and request.path != "/health":
                self.on_access(Access(request.remote or "?", request.method, request.path,
                                      request.get(STATUS_KEY, status), key_name))

    @web.middleware
    async def _read_body(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        """Read a POST body whole, within ``read_timeout_s`` (handlers then get it from aiohttp's cache)."""
        if request.method == "POST":
            try:
                await asyncio.wait_for(request.read(), self.read_timeout_s)
            except asyncio.TimeoutError:
                return await self._close_slow(request)
            except web.HTTPRequestEntityTooLarge:
                return _error(request.path, 400, "request body too large; prompts are limited to "
                              f"{self.limits.max_prompt_tokens} tokens", "request_too_large")
        return await handler(request)

    async def _close_slow(self, request: web.Request) -> web.StreamResponse:
        """408 to a request whose body did not arrive in time, then close its connection."""
        peer = request.remote or "?"
        log.warning("closed a request from %s: %s %s sent no complete body within %.3g s (serve.read_timeout_s)",
                    peer, request.method, request.path, self.read_timeout_s)
        resp = _error(request.path, 408, f"request body did not arrive within {self.read_timeout_s:g} s; "
                      "send the whole body at once", "request_timeout")
        resp.force_close()
        await resp.prepare(request)
        await resp.write_eof()
        # Close now: aiohttp would otherwise linger, reading the rest of the body that never comes.
        request.protocol.force_close()
        return resp

    async def health(self, request: web.Request) -> web.Response:
        """Liveness."""
        return web.json_response({"status": "ok", "uptime_s": round(time.time() - self.started, 3)})

    async def model_info(self, request: web.Request) -> web.Response:
        """Model config, where the weights came from, limits and engine counters."""

        from xirang_hpc.models.gpt import num_params

        return web.json_response({
            "model": dataclasses.asdict(self.loaded.cfg), "source": public_source(self.loaded.source),
            "step": self.loaded.step,
            "params": num_params(self.loaded.model), "tokenizer": self.tok.name,
            "tokenizer_info": tokenizer_info(self.tok),
            "limits": dataclasses.asdict(self.limits), "max_batch": self.engine.max_batch, "stats": self.engine.stats,
        })

    async def generate(self, request: web.Request) -> web.StreamResponse:
        """Validate, queue into the engine, reply (or stream) when done."""
        raw = await request.read()  # already read (and timed) by _read_body
        try:
            p = parse_generate(raw, self.limits, self.loaded.cfg.vocab_size, self.tok)
        except BadRequest as exc:
            return _err(400, str(exc))
        t0 = time.perf_counter()
        req, done, tokens_q = self._submit(GenRequest(p.prompt, p.max_tokens, p.temperature, p.top_k, p.seed),
                                           p.stream)
        if tokens_q is not None:
            return await self._stream(request, req, done, tokens_q, t0)
        try:
            out = await self._result(request, req, done)
        except Exception as exc:  # noqa: BLE001 - the engine failed this request
            return _err(500, f"generation failed: {exc}")
        if out is None:
            return web.Response(status=499)  # nobody is listening
        return web.json_response({"text": self.tok.decode(out), "tokenizer": self.tok.name,
                                  "prompt_tokens": len(p.prompt),
                                  "completion_tokens": len(out), "seed": req.seed,
                                  "latency_s": round(time.perf_counter() - t0, 6)})

    async def _stream(self, request: web.Request, req: GenRequest, done: asyncio.Future[list[int]],
                      tokens_q: asyncio.Queue[int], t0: float) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
        await resp.prepare(request)
        dec = StreamDecoder(self.tok)
        with self._cancel_if_gone(request, req):
            async for tok in self._tokens(request, req, done, tokens_q):
                await resp.write((json.dumps({"token": tok, "text": dec.push(tok)}) + "\n").encode())
            final: dict[str, Any] = {"done": True, "tokenizer": self.tok.name, "seed": req.seed,
                                     "latency_s": round(time.perf_counter() - t0, 6)}
            try:
                out = await done
                final.update(text=self.tok.decode(out), completion_tokens=len(out))
            except Exception as exc:  # noqa: BLE001
                final["error"] = f"generation failed: {exc}"
            await resp.write((json.dumps(final) + "\n").encode())
            await resp.write_eof()
        return resp

    # ---- shared by the endpoints -----------------------------------------------------------
    def _submit(self, req: GenRequest, stream: bool
                ) -> tuple[GenRequest, asyncio.Future[list[int]], asyncio.Queue[int] | None]:
        """Queue ``req`` in the engine; its result arrives in the future (tokens in the queue if streaming)."""
        loop = asyncio.get_running_loop()
        done: asyncio.Future[list[int]] = loop.create_future()
        # Mark a failure as seen: a handler whose client left never awaits it (no "never retrieved" noise).
        done.add_done_callback(lambda f: f.cancelled() or f.exception())
        tokens_q: asyncio.Queue[int] | None = asyncio.Queue() if stream else None
        active = self.metrics.active

        def on_done(tokens: list[int], err: BaseException | None) -> None:
            active.dec()

            def settle() -> None:
                if done.done():
                    return
                done.set_exception(err) if err is not None else done.set_result(tokens)
            loop.call_soon_threadsafe(settle)

        req.on_done = on_done
        req.on_token = (lambda t: loop.call_soon_threadsafe(tokens_q.put_nowait, t)) if tokens_q is not None else None
        active.inc()
        return self.engine.submit(req), done, tokens_q

    async def _tokens(self, request: web.Request, req: GenRequest, done: asyncio.Future[list[int]],
                      tokens_q: asyncio.Queue[int]) -> Any:
        """Yield a streaming request's tokens as the engine makes them; stop when it is done.

        The engine calls on_token before on_done from one thread, in order, so once ``done`` is
        set every token is already in the queue. A closed connection raises ConnectionResetError.
        """
        while True:
            if not tokens_q.empty():
                yield tokens_q.get_nowait()
                continue
            if done.done():
                return
            if request.transport is None or request.transport.is_closing():
                raise ConnectionResetError("client closed the connection")
            getter = asyncio.ensure_future(tokens_q.get())
            try:
                await asyncio.wait({getter, done}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                if not getter.done():
                    getter.cancel()
            if getter.done() and not getter.cancelled():
                yield getter.result()

    async def _result(self, request: web.Request, req: GenRequest, done: asyncio.Future[list[int]]
                      ) -> list[int] | None:
        """A non-streaming request's tokens; None if its client closed the connection first.

        aiohttp does not cancel handlers when a client leaves, so look at the connection while
        waiting: a long generation nobody will read is cancelled instead of run to the end.
        """
        while True:
            await asyncio.wait({done}, timeout=0.25)
            if done.done():
                return done.result()
            if request.transport is None or request.transport.is_closing():
                self._gone(request, req, "before its reply")
                return None

    @contextlib.contextmanager
    def _cancel_if_gone(self, request: web.Request, req: GenRequest) -> Iterator[None]:
        """Around a streamed reply: a client that closed its connection cancels the generation (one
        log line, no traceback); a server shutting down cancels it too and lets the shutdown proceed."""
        try:
            yield
        except ConnectionError:
            self._gone(request, req)
        except asyncio.CancelledError:
            self.engine.cancel(req)
            raise

    def _gone(self, request: web.Request, req: GenRequest, when: str = "mid-stream") -> None:
        """The client closed its connection: cancel the generation, log one line."""
        self.engine.cancel(req)
        request[STATUS_KEY] = 499
        log.warning("client %s went away %s (%s %s) after %d of %d tokens; generation cancelled",
                    request.remote or "?", when, request.method, request.path, len(req.out), req.max_tokens)

    # ---- the served tokenizer (vLLM's /tokenize, /detokenize, /tokenizer_info) -----------------------
    def _special(self, tid: int | None) -> str | None:
        return None if tid is None else self.tok.decode([tid])

    async def tokenizer_info(self, request: web.Request) -> web.Response:
        """``GET /tokenizer_info``: the special tokens (text) and the model's context."""
        eos = self._special(self.eos_id)
        return web.json_response({"tokenizer": self.tok.name, "eos_token": eos, "bos_token": None,
                                  "pad_token": None, "eos_token_id": self.eos_id,
                                  "max_model_len": self.loaded.cfg.seq_len,
                                  "vocab_size": self.loaded.cfg.vocab_size,
                                  "chat_template": getattr(self.tok, "chat_template", None)})

    async def tokenize(self, request: web.Request) -> web.Response:
        """``POST /tokenize`` with ``{"prompt": str}`` -> ``{"tokens", "count", "max_model_len"}``."""
        try:
            body = oa.parse_json_body(await request.read())
            text = body.get("prompt")
            if not isinstance(text, str):
                raise oa.bad(f"'prompt' must be a string, got {type(text).__name__}", "prompt")
        except OpenAIError as exc:
            return exc.response()
        ids = [int(t) for t in self.tok.encode(text)]
        return web.json_response({"tokens": ids, "count": len(ids), "max_model_len": self.loaded.cfg.seq_len})

    async def detokenize(self, request: web.Request) -> web.Response:
        """``POST /detokenize`` with ``{"tokens": [int]}`` -> ``{"prompt": str}``."""
        try:
            body = oa.parse_json_body(await request.read())
            ids = body.get("tokens")
            vocab = self.loaded.cfg.vocab_size
            if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool)
                                                    and 0 <= t < vocab for t in ids):
                raise oa.bad(f"'tokens' must be a list of token ids in [0, {vocab})", "tokens")
        except OpenAIError as exc:
            return exc.response()
        return web.json_response({"prompt": self.tok.decode(ids)})
