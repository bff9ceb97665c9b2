"""Batched generation: one loop decodes every active request together (continuous batching).

Each iteration admits waiting requests (up to ``max_batch``), gives each new request its slot
in a key/value cache (:mod:`xirang_hpc.serve.kvcache`), fills the new slots with one forward over
their prompts (right-padded, all new requests together), then runs *one* batched decode step (one
token per active request, attending over its cached prefix) and appends one token to each;
finished requests leave at once and new ones join at the next iteration. Sequences longer than
``model.seq_len`` keep their last ``seq_len`` tokens (sliding window: the window is re-encoded,
as learned positions are absolute). Without a cache (``kv_cache=False``, or a module that is not
a whole GPT) every step re-runs all windows, right-padded: attention is causal, so a row's last
real position never sees the padding.
Either way each row is decoded exactly as it would be alone (tests compare).

Sampling is per request: ``temperature <= 0`` is greedy; otherwise softmax(logits / T) over the
``top_k`` largest logits (0 = all) and, with ``top_p < 1``, the smallest set of most likely tokens
whose probability reaches ``top_p`` (nucleus sampling), drawn with the request's own seeded
generator, so a given (prompt, seed) gives the same text whatever else is in the batch.

A request ends after ``max_tokens`` tokens (``finish_reason`` "length"), on its end-of-sequence
token or when its ``stop_when`` predicate says so ("stop"; the EOS token itself is not part of the
output), or when it is cancelled (a client that went away; "cancelled").
"""

from __future__ import annotations

import contextlib
import logging
import queue
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from xirang_hpc.models.gpt import GPT
from xirang_hpc.serve.adapters import AdapterSet
from xirang_hpc.serve.kvcache import KVCache

log = logging.getLogger(__name__)


@dataclass
class GenRequest:
    """One generation request (token ids in, token ids out)."""

    prompt: list[int]
    max_tokens: int
    temperature: float = 0.0
    top_k: int = 0
    seed: int | None = None
    # Called from the engine thread: on_token(token) per new token; on_done(tokens, error) once.
    on_token: Callable[[int], None] | None = None
    on_done: Callable[[list[int], BaseException | None], None] | None = None
    top_p: float = 1.0
    eos_id: int | None = None  # this token ends the request (and is not emitted)
    # Called from the engine thread with the output so far after each token; True ends the request.
    stop_when: Callable[[list[int]], bool] | None = None
    cancelled: bool = False  # set from any thread (cancel()); the engine drops the request at its next step
    finish_reason: str | None = None  # "length", "stop" or "cancelled" once finished
    out: list[int] = field(default_factory=list)
    gen: torch.Generator | None = None
    t_submit: float = 0.0
    slot: int = -1  # KV-cache slot while active
    cached: int = 0  # tokens of this request in its slot
    adapter: int = 0  # the served LoRA adapter this request uses (serve/adapters.py; 0: the base model)


def sample_next(logits: torch.Tensor, temperature: float, top_k: int, gen: torch.Generator | None,
                top_p: float = 1.0) -> int:
    """One token from a (V,) logits row: greedy at ``temperature <= 0``, else top-k / top-p sampling."""
    return sample_rows(logits[None], [temperature], [top_k], [top_p], [gen])[0]


def sample_rows(logits: torch.Tensor, temperature: list[float], top_k: list[int], top_p: list[float],
                gens: list[torch.Generator | None]) -> list[int]:
    """One token per row of (B, V) logits, each row with its own sampling parameters and generator.

    Row b: greedy at ``temperature[b] <= 0``; otherwise softmax(logits / T) restricted to the
    ``top_k[b]`` largest logits (0 = all) and, with ``top_p[b] < 1``,
    to the most likely tokens until their mass reaches top_p (at least one). The draw is one
    uniform number from the row's own generator mapped through the row's cumulative distribution
    (inverse-CDF sampling), so a row's token depends only on its logits, parameters and generator,
    never on the other rows: a (prompt, seed) gives the same text in any batch. All rows are
    filtered in a handful of batched tensor operations (one top-k), which is what makes a decode
    step of 32 rows cheap; only the uniform draws are per row.
    """
    greedy_tok = logits.argmax(dim=-1)  # (B,)
    sampled = [i for i, t in enumerate(temperature) if t > 0]
    if not sampled:
        return greedy_tok.tolist()
    v = logits.shape[-1]
    rows = torch.tensor(sampled)
    temps = torch.tensor([temperature[i] for i in sampled], dtype=torch.float32)
    scaled = logits.index_select(0, rows).float() / temps[:, None]  # (b, V)
    ks = [top_k[i] if 0 < top_k[i] < v else v for i in sampled]
    # Only the largest k of any row can be drawn: rank that many (a partial sort; all V when a row has no top_k).
    ranked, order = torch.topk(scaled, max(ks), dim=-1)  # (b, K) descending: column 0 is the most likely
    beyond = torch.arange(ranked.shape[1])[None, :] >= torch.tensor(ks)[:, None]  # ranks past the row's own k
    probs = torch.softmax(ranked.masked_fill(beyond, float("-inf")), dim=-1)
    ps = torch.tensor([top_p[i] for i in sampled], dtype=torch.float32)[:, None]  # (b, 1)
    if bool((ps < 1.0).any()):
        # Nucleus: drop a token once the mass ranked above it already reaches top_p (the first stays).
        before = torch.cumsum(probs, dim=-1) - probs
        probs = probs.masked_fill((before >= ps) & (ps < 1.0), 0.0)
    cdf = torch.cumsum(probs, dim=-1)  # (b, K), unnormalised after the nucleus cut
    u = torch.cat([torch.rand(1, generator=gens[i], dtype=torch.float64) for i in sampled])
    target = (u * cdf[:, -1].double())[:, None].to(cdf.dtype)  # (b, 1)
    # First rank whose cumulative mass exceeds the target: zero-probability ranks are never chosen.
    pick = torch.searchsorted(cdf, target, right=True).clamp_(max=ranked.shape[1] - 1)  # (b, 1)
    out = greedy_tok.tolist()
    for i, tok in zip(sampled, order.gather(1, pick).flatten().tolist()):
        out[i] = tok
    return out


class Engine:
    """Owns the model and the generation loop (a background thread); thread-safe :meth:`submit`."""

    def __init__(self, model: nn.Module, seq_len: int, max_batch: int = 16, kv_cache: bool = True,
                 adapters: AdapterSet | None = None) -> None:
        self.model, self.seq_len, self.max_batch = model.eval(), seq_len, max_batch
        self.adapters = adapters  # several LoRA adapters on this model: each row of a pass uses its request's
        # Where the model's weights are (serve/run.py placed them by the one device decision): inputs go there,
        # each step's last-position logits come back to the host for sampling.
        self.device = next(model.parameters()).device
        # KV cache: a whole GPT only (a pipeline stage or another module decodes by full recompute).
        use = kv_cache and isinstance(model, GPT) and model.tok_emb is not None and model.head is not None
        self.cache: KVCache | None = KVCache(model, max_batch) if use else None
        self._free = list(range(max_batch))
        self._queue: queue.Queue[GenRequest] = queue.Queue()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.stats = {"requests": 0, "tokens": 0, "forward_passes": 0, "batched_rows": 0, "max_batch_seen": 0}
        # Called from the engine thread after every step: (sequences advanced, tokens emitted, seconds).
        self.on_step: Callable[[int, int, float], None] | None = None

    # ---- lifecycle ----------------------------------------------------------------------
    def start(self) -> Engine:
        """Start the loop thread (idempotent)."""
        if self._thread is None:
            self._stop.clear()  # a stopped engine starts again with what was queued since
            self._thread = threading.Thread(target=self._loop, name="xirang-engine", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        """Stop the loop; requests still queued fail with RuntimeError."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
            self._thread = None
        while not self._queue.empty():
            self._finish(self._queue.get_nowait(), RuntimeError("server shutting down"))

    def submit(self, req: GenRequest) -> GenRequest:
        """Queue a request; its ``on_done`` fires from the engine thread when it completes."""
        if req.seed is None:
            req.seed = random.randrange(2**31)
        req.gen = torch.Generator().manual_seed(int(req.seed))
        req.t_submit = time.perf_counter()
        self._queue.put(req)
        return req

    @staticmethod
    def cancel(req: GenRequest) -> None:
        """Drop ``req`` at the engine's next step (its ``on_done`` still fires, with what it has)."""
        req.cancelled = True

    def generate(self, prompts: list[list[int]], max_tokens: int, temperature: float = 0.0, top_k: int = 0,
                 seed: int | None = 0) -> list[list[int]]:
        """Synchronous helper (eval, tests): generate for several prompts in one batch."""
        done = threading.Event()
        results: list[list[int] | BaseException] = [[] for _ in prompts]
        left = [len(prompts)]
        lock = threading.Lock()

        def finisher(i: int) -> Callable[[list[int], BaseException | None], None]:
            def fn(tokens: list[int], err: BaseException | None) -> None:
                results[i] = err if err is not None else tokens
                with lock:
                    left[0] -= 1
                    if left[0] == 0:
                        done.set()
            return fn

        if not prompts:
            return []
        self.start()
        for i, p in enumerate(prompts):
            self.submit(GenRequest(list(p), max_tokens, temperature, top_k, seed, on_done=finisher(i)))
        done.wait()
        for r in results:
            if isinstance(r, BaseException):
                raise r
        return results  # type: ignore[return-value]

    # ---- the loop -----------------------------------------------------------------------
    def _finish(self, req: GenRequest, err: BaseException | None = None) -> None:
        if req.finish_reason is None:
            req.finish_reason = "cancelled" if req.cancelled else "length"
        if req.slot >= 0:
            self._free.append(req.slot)
            req.slot = -1
        if req.on_done is not None:
            try:
                req.on_done(list(req.out), err)
            except Exception:  # noqa: BLE001 - a broken callback must not kill the loop
                log.exception("on_done callback failed")

    def _admit(self, active: list[GenRequest]) -> None:
        block = not active
        while len(active) < self.max_batch:
            try:
                req = self._queue.get(timeout=0.05) if block else self._queue.get_nowait()
            except queue.Empty:
                return
            block = False
            self.stats["requests"] += 1
            if req.max_tokens <= 0 or req.cancelled:
                self._finish(req)
            else:
                req.slot, req.cached = self._free.pop(), 0
                active.append(req)

    def _emit_all(self, reqs: list[GenRequest], logits: torch.Tensor) -> None:
        """Sample one token per request from its (B, V) logits row and hand each to its request."""
        logits = logits.float().cpu()  # (B, V): sampling and the requests' generators live on the host
        toks = sample_rows(logits, [r.temperature for r in reqs], [r.top_k for r in reqs],
                           [r.top_p for r in reqs], [r.gen for r in reqs])
        for r, tok in zip(reqs, toks):
            self._emit(r, tok)

    def _emit(self, r: GenRequest, tok: int) -> None:
        if r.eos_id is not None and tok == r.eos_id:
            r.finish_reason = "stop"
            return
        r.out.append(tok)
        self.stats["tokens"] += 1
        if r.on_token is not None:
            r.on_token(tok)
        if r.stop_when is not None and r.stop_when(r.out):
            r.finish_reason = "stop"

    def _rows(self, reqs: list[GenRequest]) -> contextlib.AbstractContextManager[None]:
        """The adapters of a pass's rows, in row order (nothing to set without served adapters)."""
        if self.adapters is None:
            return contextlib.nullcontext()
        return self.adapters.rows([r.adapter for r in reqs])

    @torch.inference_mode()
    def step(self, active: list[GenRequest]) -> None:
        """One new token for every active sequence."""
        if self.cache is None:
            return self.step_recompute(active)
        decode = [r for r in active if 0 < r.cached < self.seq_len and len(r.prompt) + len(r.out) == r.cached + 1]
        decode.sort(key=lambda r: r.slot)  # consecutive slots let the cache be read without a copy
        in_decode = {id(r) for r in decode}
        fill = [r for r in active if id(r) not in in_decode]
        if fill:  # new requests, and windows sliding past seq_len: (re)fill their slots in one forward
            seqs = [(r.prompt + r.out)[-self.seq_len:] for r in fill]
            lens = [len(s) for s in seqs]
            x = torch.zeros(len(seqs), max(lens), dtype=torch.long)
            for i, s in enumerate(seqs):
                x[i, : len(s)] = torch.tensor(s, dtype=torch.long)
            # Right padding: a row's pad positions land in its own slot past its length, where no query
            # looks (keys j <= the query's position) until the row's next real token overwrites them.
            slots = torch.tensor([r.slot for r in fill])
            with self._rows(fill):
                logits = self.cache.forward(x, slots, torch.zeros(len(fill), dtype=torch.long))
            last = logits[torch.arange(len(fill), device=logits.device),
                          torch.tensor(lens, device=logits.device) - 1]  # (B, V) at each row's last token
            self.stats["forward_passes"] += 1
            self.stats["batched_rows"] += len(fill)
            for r, seq in zip(fill, seqs):
                r.cached = len(seq) if len(r.prompt) + len(r.out) < self.seq_len else 0
            self._emit_all(fill, last)
        if decode:
            last = torch.tensor([[(r.prompt + r.out)[-1]] for r in decode], dtype=torch.long)
            with self._rows(decode):
                logits = self.cache.forward(last, torch.tensor([r.slot for r in decode]),
                                            torch.tensor([r.cached for r in decode]))
            self.stats["forward_passes"] += 1
            self.stats["batched_rows"] += len(decode)
            self.stats["max_batch_seen"] = max(self.stats["max_batch_seen"], len(decode))
            for r in decode:
                r.cached += 1
            self._emit_all(decode, logits[:, -1])

    @torch.inference_mode()
    def step_recompute(self, active: list[GenRequest]) -> None:
        """One forward pass over every active sequence's whole window; one new token each."""
        seqs = [(r.prompt + r.out)[-self.seq_len:] for r in active]
        lens = [len(s) for s in seqs]
        width = max(lens)
        x = torch.zeros(len(seqs), width, dtype=torch.long)  # right padding, invisible to causal attention
        for i, s in enumerate(seqs):
            x[i, : len(s)] = torch.tensor(s, dtype=torch.long)
        with self._rows(active):
            logits = self.model(x.to(self.device))  # (B, T, V)
        last = logits[torch.arange(len(seqs), device=logits.device), torch.tensor(lens, device=logits.device) - 1]
        self.stats["forward_passes"] += 1
        self.stats["batched_rows"] += len(seqs)
        self.stats["max_batch_seen"] = max(self.stats["max_batch_seen"], len(seqs))
        self._emit_all(active, last)

    def _loop(self) -> None:
        active: list[GenRequest] = []
        while not self._stop.is_set():
            self._admit(active)
            if not active:
                continue
            live = [r for r in active if not r.cancelled]
            if len(live) < len(active):
                for r in active:
                    if r.cancelled:
                        self._finish(r)
                active[:] = live
                if not active:
                    continue
            t0, tokens0 = time.perf_counter(), self.stats["tokens"]
            try:
                self.step(active)
            except Exception as exc:  # noqa: BLE001 - fail these requests, keep serving
                log.exception("generation step failed")
                for r in active:
                    self._finish(r, exc)
                active.clear()
                continue
            if self.on_step is not None:
                try:
                    self.on_step(len(active), self.stats["tokens"] - tokens0, time.perf_counter() - t0)
                except Exception:  # noqa: BLE001 - metrics must not stop generation
                    log.exception("on_step hook failed")
            still = []
            for r in active:
                if r.finish_reason is not None or len(r.out) >= r.max_tokens:
                    self._finish(r)
                else:
                    still.append(r)
            active[:] = still
        for r in active:
            self._finish(r, RuntimeError("server shutting down"))
