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
negative or too large ``max_tokens``, a negative temperature or top_k. With a token configured,
``/v1/*`` needs ``Authorization: Bearer <token>`` (401 otherwise).
"""

from __future__ import annotations

import asyncio
import codecs
import hmac
import json
import math
import time
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from xirang_hpc.data.tokenizer import ByteTokenizer
from xirang_hpc.serve.engine import Engine, GenRequest
from xirang_hpc.serve.weights import LoadedModel

_FIELDS = {"prompt", "max_tokens", "temperature", "top_k", "seed", "stream"}
_MAX_SEED = 2**63 - 1


class BadRequest(ValueError):
    """A request the server refuses with HTTP 400; the message says what to fix."""


@dataclass
class Limits:
    """Request limits (from ServeConfig)."""

    max_prompt_tokens: int
    max_new_tokens: int


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


def parse_generate(raw: bytes, limits: Limits, vocab: int, tok: ByteTokenizer) -> Params:
    """Validate a generate body; raises :class:`BadRequest` naming the field and the fix."""
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise BadRequest(f"request body is not valid JSON ({exc}); send a JSON object like "
                         '{"prompt": "def ", "max_tokens": 32}') from exc
    if not isinstance(body, dict):
        raise BadRequest(f"request body must be a JSON object, got {type(body).__name__}")
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


class Server:
    """The aiohttp application around one :class:`Engine`."""

    def __init__(self, loaded: LoadedModel, engine: Engine, limits: Limits, token: str | None = None) -> None:
        self.loaded, self.engine, self.limits, self.token = loaded, engine, limits, token or None
        self.tok = ByteTokenizer()
        self.started = time.time()

    def app(self) -> web.Application:
        """The web application (routes + auth middleware)."""
        # Bodies past this size are refused before parsing (as a 400, see generate()).
        max_body = max(1 << 16, 8 * self.limits.max_prompt_tokens + 4096)
        app = web.Application(client_max_size=max_body, middlewares=[self._auth])
        app.router.add_get("/health", self.health)
        app.router.add_get("/v1/model", self.model_info)
        app.router.add_post("/v1/generate", self.generate)
        return app

    @web.middleware
    async def _auth(self, request: web.Request, handler: Any) -> web.StreamResponse:
        if self.token and request.path.startswith("/v1/"):
            got = request.headers.get("Authorization", "")
            if not hmac.compare_digest(got.encode(), f"Bearer {self.token}".encode()):
                return _err(401, "missing or wrong bearer token; send 'Authorization: Bearer <token>'")
        return await handler(request)

    async def health(self, request: web.Request) -> web.Response:
        """Liveness."""
        return web.json_response({"status": "ok", "uptime_s": round(time.time() - self.started, 3)})

    async def model_info(self, request: web.Request) -> web.Response:
        """Model config, where the weights came from, limits and engine counters."""
        import dataclasses

        from xirang_hpc.models.gpt import num_params

        return web.json_response({
            "model": dataclasses.asdict(self.loaded.cfg), "source": self.loaded.source, "step": self.loaded.step,
            "params": num_params(self.loaded.model), "tokenizer": self.tok.name,
            "limits": dataclasses.asdict(self.limits), "max_batch": self.engine.max_batch, "stats": self.engine.stats,
        })

    async def generate(self, request: web.Request) -> web.StreamResponse:
        """Validate, queue into the engine, reply (or stream) when done."""
        try:
            raw = await request.read()
        except web.HTTPRequestEntityTooLarge:
            return _err(400, f"request body too large; prompts are limited to {self.limits.max_prompt_tokens} tokens")
        try:
            p = parse_generate(raw, self.limits, self.loaded.cfg.vocab_size, self.tok)
        except BadRequest as exc:
            return _err(400, str(exc))
        loop = asyncio.get_running_loop()
        done: asyncio.Future[list[int]] = loop.create_future()
        tokens_q: asyncio.Queue[int] | None = asyncio.Queue() if p.stream else None

        def on_done(tokens: list[int], err: BaseException | None) -> None:
            def settle() -> None:
                if done.done():
                    return
                done.set_exception(err) if err is not None else done.set_result(tokens)
            loop.call_soon_threadsafe(settle)

        on_token = (lambda t: loop.call_soon_threadsafe(tokens_q.put_nowait, t)) if tokens_q is not None else None
        t0 = time.perf_counter()
        req = self.engine.submit(GenRequest(p.prompt, p.max_tokens, p.temperature, p.top_k, p.seed,
                                            on_token=on_token, on_done=on_done))
        if tokens_q is not None:
            return await self._stream(request, req, done, tokens_q, t0)
        try:
            out = await done
        except Exception as exc:  # noqa: BLE001 - the engine failed this request
            return _err(500, f"generation failed: {exc}")
        return web.json_response({"text": self.tok.decode(out), "prompt_tokens": len(p.prompt),
                                  "completion_tokens": len(out), "seed": req.seed,
                                  "latency_s": round(time.perf_counter() - t0, 6)})

    async def _stream(self, request: web.Request, req: GenRequest, done: asyncio.Future[list[int]],
                      tokens_q: asyncio.Queue[int], t0: float) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
        await resp.prepare(request)
        dec = codecs.getincrementaldecoder("utf-8")(errors="replace")
        sent = 0
        while sent < req.max_tokens:
            getter = asyncio.ensure_future(tokens_q.get())
            await asyncio.wait({getter, done}, return_when=asyncio.FIRST_COMPLETED)
            if not getter.done():
                getter.cancel()
                if done.exception() is not None or tokens_q.empty():
                    break
                continue
            tok = getter.result()
            sent += 1
            await resp.write((json.dumps({"token": tok, "text": dec.decode(bytes([tok]))}) + "\n").encode())
        final: dict[str, Any] = {"done": True, "seed": req.seed, "latency_s": round(time.perf_counter() - t0, 6)}
        try:
            out = await done
            final.update(text=self.tok.decode(out), completion_tokens=len(out))
        except Exception as exc:  # noqa: BLE001
            final["error"] = f"generation failed: {exc}"
        await resp.write((json.dumps(final) + "\n").encode())
        await resp.write_eof()
        return resp
