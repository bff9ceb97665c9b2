"""Prometheus metrics of the server (``GET /metrics``, text exposition format).

Each :class:`ServeMetrics` owns its registry, so several servers in one process (tests) never
share counters. What is measured:

- ``xirang_serve_requests_total{endpoint, status}``: every HTTP request, by route and status
  (499: the client went away before the reply was complete);
- ``xirang_serve_request_latency_seconds{endpoint}``: request latency, to the last streamed byte;
- ``xirang_serve_batch_size``: sequences advanced together per engine step (continuous batching);
- ``xirang_serve_generated_tokens_total`` and ``xirang_serve_tokens_per_second`` (generated tokens
  per second over the last ``window_s`` seconds, computed when scraped);
- ``xirang_serve_step_seconds``: engine step time; ``xirang_serve_active_requests``: requests
  being generated or waiting.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

# Latency buckets from 5 ms to 2 minutes (a long streamed reply on a CPU is tens of seconds).
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
STEP_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)
# request[STATUS_KEY] = the status to record instead of the response's (499: the client left mid-stream);
# a typed key where aiohttp has them (3.14+), which warns about plain string keys.
STATUS_KEY: Any = (web.RequestKey("xirang_metrics_status", int) if hasattr(web, "RequestKey")
                   else "xirang_metrics_status")


class ServeMetrics:
    """The server's metrics and the hooks that feed them."""

    def __init__(self, window_s: float = 10.0) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("xirang_serve_requests", "HTTP requests by endpoint and status",
                                ["endpoint", "status"], registry=r)
        self.latency = Histogram("xirang_serve_request_latency_seconds", "HTTP request latency (to the last byte)",
                                 ["endpoint"], buckets=LATENCY_BUCKETS, registry=r)
        self.batch = Histogram("xirang_serve_batch_size", "sequences decoded together per engine step",
                               buckets=BATCH_BUCKETS, registry=r)
        self.step = Histogram("xirang_serve_step_seconds", "engine step time", buckets=STEP_BUCKETS, registry=r)
        self.tokens = Counter("xirang_serve_generated_tokens", "generated tokens", registry=r)
        self.tps = Gauge("xirang_serve_tokens_per_second",
                         f"generated tokens per second over the last {window_s:g} s", registry=r)
        self.tps.set_function(self.tokens_per_second)
        self.active = Gauge("xirang_serve_active_requests", "generation requests in flight", registry=r)
        self.window_s = window_s
        self._recent: deque[tuple[float, int]] = deque()
        self._lock = threading.Lock()
        self._t0 = time.monotonic()

    def on_step(self, rows: int, tokens: int, seconds: float) -> None:
        """Engine hook (engine thread): one step advanced ``rows`` sequences and emitted ``tokens``."""
        self.batch.observe(rows)
        self.step.observe(seconds)
        if tokens:
            self.tokens.inc(tokens)
            now = time.monotonic()
            with self._lock:
                self._recent.append((now, tokens))
                self._trim(now)

    def _trim(self, now: float) -> None:
        while self._recent and self._recent[0][0] < now - self.window_s:
            self._recent.popleft()

    def tokens_per_second(self) -> float:
        """Generated tokens per second over the last window (shorter right after start-up)."""
        now = time.monotonic()
        with self._lock:
            self._trim(now)
            total = sum(n for _, n in self._recent)
        span = min(self.window_s, max(now - self._t0, 1e-3))
        return total / span

    @web.middleware
    async def middleware(self, request: web.Request,
                         handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> web.StreamResponse:
        """Count and time every request (outermost middleware: sees auth failures too)."""
        resource = getattr(request.match_info.route, "resource", None)
        # Route templates, never raw paths: a scan of random URLs must not create label values.
        endpoint = resource.canonical if resource is not None else "unmatched"
        t0 = time.perf_counter()
        status = 500
        try:
            resp = await handler(request)
            status = resp.status
            return resp
        except web.HTTPException as exc:
            status = exc.status
            raise
        except BaseException:
            status = 499 if request.transport is None or request.transport.is_closing() else 500
            raise
        finally:
            status = request.get(STATUS_KEY, status)
            self.requests.labels(endpoint, str(status)).inc()
            self.latency.labels(endpoint).observe(time.perf_counter() - t0)

    async def handler(self, request: web.Request) -> web.Response:
        """``GET /metrics``."""
        body = generate_latest(self.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})
