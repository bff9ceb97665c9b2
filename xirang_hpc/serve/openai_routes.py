"""The OpenAI-compatible routes of the server: ``/v1/completions``, ``/v1/chat/completions``, ``/v1/models``.

Request parsing and response shapes are :mod:`xirang_hpc.serve.openai_api` (no HTTP in it); this module is
the routes over the server's one transport (:class:`xirang_hpc.serve.server.Server`: the engine, streaming,
cancellation when a client leaves, keys), which mixes them in beside its native ``/v1/generate``. The requested
``model`` picks the base or one of the served LoRA adapters (:mod:`xirang_hpc.serve.adapters`).
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

from aiohttp import web

from xirang_hpc.serve import openai_api as oa
from xirang_hpc.serve.engine import GenRequest
from xirang_hpc.serve.openai_api import OpenAIError

# request[KEY_KEY] = the matched key (serve.keys_file), for checks that need the body (a served adapter's name).
KEY_KEY: Any = web.RequestKey("xirang_key", object) if hasattr(web, "RequestKey") else "xirang_key"


class OpenAIRoutes:
    """The OpenAI-compatible handlers; mixed into :class:`~xirang_hpc.serve.server.Server`, whose transport
    (``_submit``, ``_result``, ``_tokens``, ``_cancel_if_gone``), engine, tokenizer, limits, scorer and model
    ids they use."""

    model_id: str
    model_ids: list[str]
    started: float

    async def models(self, request: web.Request) -> web.Response:
        """``GET /v1/models``: the one served model."""
        return web.json_response({"object": "list", "data": [oa.model_card(m, self.started) for m in self.model_ids]})

    async def model_card(self, request: web.Request) -> web.Response:
        """``GET /v1/models/{model}``."""
        name = request.match_info["model"]
        if name not in self.model_ids:
            return self._unknown_model(name).response()
        return web.json_response(oa.model_card(name, self.started))

    def _unknown_model(self, name: str) -> OpenAIError:
        served = ", ".join(repr(m) for m in self.model_ids)
        return OpenAIError(404, f"the model {name!r} does not exist here; this server serves {served} "
                           "(GET /v1/models lists them)", "model", "model_not_found")

    def _model_of(self, request: web.Request, model: str) -> int:
        """The adapter index of the requested model (0: the base); refused when unknown or not the key's."""
        if model not in self.model_ids:
            raise self._unknown_model(model)
        index = self.model_ids.index(model)
        key = request.get(KEY_KEY)
        if index and key is not None and not key.may_serve(model):
            raise OpenAIError(403, f"the key {key.name!r} may not use the model {model!r} (its 'runs' in "
                              "serve.keys_file do not cover it)", "model", "permission_denied")
        return index

    async def completions(self, request: web.Request) -> web.StreamResponse:
        """``POST /v1/completions``."""
        return await self._openai(request, "completion")

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        """``POST /v1/chat/completions``."""
        return await self._openai(request, "chat")

    async def _openai(self, request: web.Request, kind: str) -> web.StreamResponse:
        try:
            body = oa.parse_json_body(await request.read())
            model = oa.requested_model(body)
            adapter = self._model_of(request, model)
            p = dataclasses.replace(oa.parse_openai(body, kind, self.limits, self.loaded.cfg.vocab_size, self.tok),
                                    model=model, adapter=adapter)
        except OpenAIError as exc:
            return exc.response()
        rid, created = oa.new_id(kind), oa.now()
        if kind == "completion" and (len(p.prompts) > 1 or p.echo or p.logprobs is not None or p.max_tokens == 0):
            return await self._complete_batch(request, p, rid, created)
        gen = GenRequest(p.prompt, p.max_tokens, p.temperature, p.top_k, p.seed, top_p=p.top_p, eos_id=self.eos_id,
                         stop_when=oa.stop_predicate(self.tok, p.stop), adapter=p.adapter)
        req, done, tokens_q = self._submit(gen, p.stream)
        if tokens_q is not None:
            return await self._sse(request, p, req, done, tokens_q, rid, created)
        try:
            out = await self._result(request, req, done)
        except Exception as exc:  # noqa: BLE001 - the engine failed this request
            return OpenAIError(500, f"generation failed: {exc}", code="generation_failed").response()
        if out is None:
            return web.Response(status=499)  # nobody is listening
        text, _ = oa.final_text(self.tok, out, p.stop)
        return web.json_response(oa.response_body(p, rid, created, p.model, text, _finish(req), len(out)))

    async def _complete_batch(self, request: web.Request, p: oa.OpenAIParams, rid: str, created: int
                              ) -> web.StreamResponse:
        """Completions of a batch of prompts, with ``echo`` and legacy ``logprobs`` (one choice per prompt).

        Greedy requests for at most one token (what evaluation harnesses send to score a continuation) are
        answered from one scoring forward over the prompts; others are generated by the engine (decoded
        together), then scored when logprobs or echo are asked for.
        """
        seq_len = self.loaded.cfg.seq_len
        want_scores = p.logprobs is not None
        if want_scores and any(len(ids) + p.max_tokens > seq_len for ids in p.prompts):
            return oa.bad(f"a prompt plus max_tokens={p.max_tokens} is longer than the model's context of {seq_len} "
                          "tokens, which logprobs scores in one pass; shorten the prompt or ask for fewer "
                          "tokens", "prompt", "context_length_exceeded").response()
        top = p.logprobs or 0
        scored: list[Any] | None = None
        outs: list[list[int]]
        finishes: list[str]
        if p.max_tokens == 0:
            outs, finishes = [[] for _ in p.prompts], ["length"] * len(p.prompts)
            if want_scores:
                scored = await asyncio.to_thread(self.scorer.score, p.prompts, top, p.adapter)
        elif p.max_tokens == 1 and p.temperature == 0 and not p.stop and all(len(x) <= seq_len for x in p.prompts):
            scored = await asyncio.to_thread(self.scorer.score, p.prompts, top, p.adapter)
            outs, finishes = [], []
            for s in scored:
                stop = self.eos_id is not None and s.next_id == self.eos_id
                outs.append([] if stop else [s.next_id])
                finishes.append("stop" if stop else "length")
        else:
            reqs = []
            for ids in p.prompts:
                gen = GenRequest(ids, p.max_tokens, p.temperature, p.top_k, p.seed, top_p=p.top_p,
                                 eos_id=self.eos_id, stop_when=oa.stop_predicate(self.tok, p.stop), adapter=p.adapter)
                reqs.append(self._submit(gen, False))
            outs, finishes = [], []
            try:
                for req, done, _ in reqs:
                    out = await self._result(request, req, done)
                    if out is None:
                        for other, _, _ in reqs:
                            self.engine.cancel(other)
                        return web.Response(status=499)  # nobody is listening
                    outs.append(out)
                    finishes.append(_finish(req))
            except Exception as exc:  # noqa: BLE001 - the engine failed this request
                return OpenAIError(500, f"generation failed: {exc}", code="generation_failed").response()
            if want_scores:
                scored = await asyncio.to_thread(self.scorer.score, [a + b for a, b in zip(p.prompts, outs,
                                                                                         strict=True)], top, p.adapter)
        choices = []
        for i, (ids, out, finish) in enumerate(zip(p.prompts, outs, finishes, strict=True)):
            text, _ = oa.final_text(self.tok, out, p.stop)
            logprobs = None
            if want_scores:
                assert scored is not None
                s, full = scored[i], ids + out
                lp: list[float | None] = [None, *s.token_logprobs]
                tops = [[], *s.top]
                if len(full) > len(s.token_logprobs) + 1:  # the greedy token from the prompt's own forward
                    lp.append(s.next_logprob)
                lp, tops = lp[: len(full)], tops[: len(full)]
                logprobs = oa.legacy_logprobs(self.tok, full, 0 if p.echo else len(ids), lp, tops)
            if p.echo:
                text = self.tok.decode(ids) + text
            choices.append({"index": i, "text": text, "logprobs": logprobs, "finish_reason": finish})
        return web.json_response(oa.completions_body(rid, created, p.model, choices,
                                                     sum(map(len, p.prompts)), sum(map(len, outs))))

    async def _sse(self, request: web.Request, p: oa.OpenAIParams, req: GenRequest, done: asyncio.Future[list[int]],
                   tokens_q: asyncio.Queue[int], rid: str, created: int) -> web.StreamResponse:
        """Stream as server-sent events: text pieces that add up to the non-streamed text, then ``[DONE]``."""
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        model, out, sent = p.model, [], ""
        with self._cancel_if_gone(request, req):
            if p.kind == "chat":  # OpenAI's first chat chunk carries the role
                await resp.write(oa.sse(oa.chunk_body(p, rid, created, model, "", None, first=True)))
            async for tok in self._tokens(request, req, done, tokens_q):
                out.append(tok)
                settled = oa.settled_text(self.tok, out, p.stop)
                if len(settled) > len(sent) and settled.startswith(sent):
                    await resp.write(oa.sse(oa.chunk_body(p, rid, created, model, settled[len(sent):], None)))
                    sent = settled
            try:
                final = await done
            except Exception as exc:  # noqa: BLE001 - the engine failed this request: an error event
                await resp.write(oa.sse(OpenAIError(500, f"generation failed: {exc}", code="generation_failed").body()))
            else:
                text, _ = oa.final_text(self.tok, final, p.stop)
                if len(text) > len(sent) and text.startswith(sent):
                    await resp.write(oa.sse(oa.chunk_body(p, rid, created, model, text[len(sent):], None)))
                await resp.write(oa.sse(oa.chunk_body(p, rid, created, model, None, _finish(req))))
                if p.include_usage:
                    await resp.write(oa.sse(oa.usage_chunk(p, rid, created, model, len(final))))
            await resp.write(oa.sse("[DONE]"))
            await resp.write_eof()
        return resp


def _finish(req: GenRequest) -> str:
    """OpenAI's finish_reason: ``stop`` (a stop string or EOS) or ``length`` (max_tokens reached)."""
    return "stop" if req.finish_reason == "stop" else "length"
