"""Run the server: bind, record where it listens, serve until interrupted (or ``serve.duration_s``)."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aiohttp import web

from xirang_hpc.config.errors import ConfigError
from xirang_hpc.config.schema import ServeConfig
from xirang_hpc.files import write_json_atomic
from xirang_hpc.serve.engine import Engine
from xirang_hpc.serve.keys import Keys
from xirang_hpc.serve.server import Access, Limits, Server
from xirang_hpc.weights.load import LoadedModel


def limits_for(scfg: ServeConfig, seq_len: int) -> Limits:
    """Request limits: ``serve.max_prompt_tokens`` (0 = the model's context) and ``serve.max_new_tokens``."""
    return Limits(max_prompt_tokens=scfg.max_prompt_tokens or seq_len, max_new_tokens=scfg.max_new_tokens)


def write_info(path: Path, obj: dict[str, Any]) -> None:
    """Write the server's info file: readable by the owner only (it names the endpoint), and replaced whole,
    so a client that sees the file appear reads it complete."""
    write_json_atomic(path, obj, indent=1)


def model_id_for(loaded: LoadedModel, scfg: ServeConfig) -> str:
    """The model id of the OpenAI-compatible API: ``serve.model_name``, else the run directory's name.

    A checkpoint inside ``RUN/checkpoints/`` or weights exported to ``RUN/export/`` are named
    after ``RUN``; anything else after the model preset (``model.name``).
    """
    if scfg.model_name:
        return scfg.model_name
    parts = Path(loaded.source).parts
    for marker in ("checkpoints", "export"):
        if marker in parts:
            i = len(parts) - 1 - parts[::-1].index(marker)
            if i > 0:
                return parts[i - 1]
    if (Path(loaded.source) / "checkpoints").is_dir():
        return Path(loaded.source).name
    return loaded.cfg.name


@dataclass
class Running:
    """A started server: its runner (``await runner.cleanup()`` stops it), engine, server and URL."""

    runner: web.AppRunner
    engine: Engine
    server: Server
    url: str
    host: str
    port: int

    async def stop(self) -> None:
        """Stop listening, then stop the engine."""
        await self.runner.cleanup()
        self.engine.stop()


def server_keys(scfg: ServeConfig, token: str | None) -> Keys:
    """The keys the server accepts: ``serve.keys_file`` (checked: owner-only, well formed) plus the bearer token."""
    return Keys.load(scfg.keys_file, token) if scfg.keys_file else Keys.from_token(token)


def check_exposure(scfg: ServeConfig, token: str | None) -> None:
    """A server reachable beyond this machine needs keys: refuse ``serve.host`` off loopback without a keys file or
    a bearer token, and check the keys file itself."""
    if scfg.keys_file:
        server_keys(scfg, token)
    import ipaddress

    host = scfg.host.strip("[]")
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it may resolve to any interface
        loopback = False
    if not loopback and not token and not scfg.keys_file:
        raise ConfigError("serve.host", scfg.host,
                          f"a server reachable from other machines needs keys: set serve.keys_file, or "
                          f"${scfg.token_env} (serve.token_env), or serve on 127.0.0.1 and reach it through an "
                          "SSH tunnel")


async def start_server(loaded: LoadedModel, scfg: ServeConfig, token: str | None = None,
                       tokenizer: Any = None, on_access: Callable[[Access], None] | None = None) -> Running:
    """Start the engine and the HTTP server (in the running event loop) on ``scfg.host:scfg.port``."""
    check_exposure(scfg, token)
    keys = server_keys(scfg, token)
    loaded.place(scfg.device, field="serve.device")  # the one device decision (runtime/device.py)
    adapters = None
    if scfg.adapters:  # several LoRA adapters over the base, one per request (serve/adapters.py)
        from xirang_hpc.serve.adapters import attach_adapters

        adapters = attach_adapters(loaded.model, loaded.cfg, dict(scfg.adapters))
    engine = Engine(loaded.model, loaded.cfg.seq_len, scfg.max_batch, adapters=adapters).start()
    server = Server(loaded, engine, limits_for(scfg, loaded.cfg.seq_len), tokenizer=tokenizer,
                    model_id=model_id_for(loaded, scfg), read_timeout_s=scfg.read_timeout_s, keys=keys,
                    metrics_public=scfg.metrics_public, on_access=on_access)
    runner = web.AppRunner(server.app(), **server.runner_kwargs())
    await runner.setup()
    site = web.TCPSite(runner, scfg.host, scfg.port)
    try:
        await site.start()
    except BaseException:
        await runner.cleanup()
        engine.stop()
        raise
    host, port = runner.addresses[0][:2]
    return Running(runner, engine, server, f"http://{host}:{port}", host, port)


async def _serve(loaded: LoadedModel, scfg: ServeConfig, info_path: Path | None, token: str | None,
                 log: Any, on_access: Callable[[Access], None] | None) -> dict[str, Any]:
    running = await start_server(loaded, scfg, token, on_access=on_access)
    engine, host, port = running.engine, running.host, running.port
    auth = bool(running.server.keys)
    info = {"url": running.url, "host": host, "port": port, "pid": os.getpid(), "source": loaded.source,
            "step": loaded.step, "model": running.server.model_id, "auth": auth, "status": "serving"}
    if scfg.adapters:
        info["adapters"] = sorted(scfg.adapters)
    if info_path is not None:
        write_info(info_path, info)
    log(f"serving {loaded.source} as model {running.server.model_id!r}"
        + (f" with adapters {', '.join(repr(a) for a in scfg.adapters)}" if scfg.adapters else "")
        + f" on {info['url']} (POST /v1/generate, "
        "/v1/completions, /v1/chat/completions; GET /v1/models, /v1/model, /metrics, /health"
        f"{'; a key is required' if auth else ''})")
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
        await running.stop()
    info.update(status="stopped", stats=dict(engine.stats))
    if info_path is not None:
        write_info(info_path, info)
    return info


def serve(loaded: LoadedModel, scfg: ServeConfig, info_path: Path | None = None,
          log: Any = print, on_access: Callable[[Access], None] | None = None) -> dict[str, Any]:
    """Serve ``loaded`` over HTTP (blocking); keys come from ``serve.keys_file`` and ``$<serve.token_env>``.

    ``on_access`` gets every answered request (the access log, the audit trail)."""
    token = os.environ.get(scfg.token_env) or None if scfg.token_env else None
    return asyncio.run(_serve(loaded, scfg, info_path, token, log, on_access))
