"""Run the server: bind, record where it listens, serve until interrupted (or ``serve.duration_s``)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
from pathlib import Path
from typing import Any

from aiohttp import web

from xirang_hpc.config.schema import ServeConfig
from xirang_hpc.serve.engine import Engine
from xirang_hpc.serve.server import Limits, Server
from xirang_hpc.serve.weights import LoadedModel

SERVE_FILE = "serve.json"


def limits_for(scfg: ServeConfig, seq_len: int) -> Limits:
    """Request limits: ``serve.max_prompt_tokens`` (0 = the model's context) and ``serve.max_new_tokens``."""
    return Limits(max_prompt_tokens=scfg.max_prompt_tokens or seq_len, max_new_tokens=scfg.max_new_tokens)


def write_private_json(path: Path, obj: dict[str, Any]) -> None:
    """Write JSON readable by the owner only (it may name a token env var and the endpoint)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(obj, f, indent=1)


async def _serve(loaded: LoadedModel, scfg: ServeConfig, info_path: Path | None, token: str | None,
                 log: Any) -> dict[str, Any]:
    engine = Engine(loaded.model, loaded.cfg.seq_len, scfg.max_batch).start()
    server = Server(loaded, engine, limits_for(scfg, loaded.cfg.seq_len), token)
    runner = web.AppRunner(server.app(), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, scfg.host, scfg.port)
    await site.start()
    host, port = runner.addresses[0][:2]
    info = {"url": f"http://{host}:{port}", "host": host, "port": port, "pid": os.getpid(), "source": loaded.source,
            "step": loaded.step, "auth": bool(token), "status": "serving"}
    if info_path is not None:
        write_private_json(info_path, info)
    log(f"serving {loaded.source} on {info['url']} (POST /v1/generate, GET /v1/model, GET /health"
        f"{', bearer token required' if token else ''})")
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            loop.add_signal_handler(sig, stop.set)
        except (NotImplementedError, RuntimeError):  # not the main thread
            pass
    try:
        if scfg.duration_s > 0:
            try:
                await asyncio.wait_for(stop.wait(), timeout=scfg.duration_s)
            except asyncio.TimeoutError:
                pass
        else:
            await stop.wait()
    finally:
        await runner.cleanup()
        engine.stop()
    info.update(status="stopped", stats=dict(engine.stats))
    if info_path is not None:
        write_private_json(info_path, info)
    return info


def serve(loaded: LoadedModel, scfg: ServeConfig, info_path: Path | None = None,
          log: Any = print) -> dict[str, Any]:
    """Serve ``loaded`` over HTTP (blocking); the bearer token comes from ``$<serve.token_env>``."""
    token = os.environ.get(scfg.token_env) or None if scfg.token_env else None
    return asyncio.run(_serve(loaded, scfg, info_path, token, log))
