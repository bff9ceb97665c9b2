"""Named API keys (serve.keys_file): who may call which served run, /metrics behind a key, the access record.

A real aiohttp server on a real socket around a tiny random GPT; keys files written with real modes and owners.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from aiohttp import ClientSession
from aiohttp.test_utils import TestServer

from xirang_hpc.config.errors import ConfigError
from xirang_hpc.config.schema import ModelConfig, ServeConfig
from xirang_hpc.models.gpt import GPT
from xirang_hpc.serve.engine import Engine
from xirang_hpc.serve.keys import Keys
from xirang_hpc.serve.run import check_exposure
from xirang_hpc.serve.server import Access, Limits, Server
from xirang_hpc.weights.load import LoadedModel

CFG = ModelConfig(name="t", n_layer=1, n_head=2, d_model=16, seq_len=16)
ALICE, BOB = "alice-" + "a" * 20, "bob-" + "b" * 20


def _keys_file(tmp_path: Path, doc: Any, mode: int = 0o600) -> Path:
    p = tmp_path / "keys.json"
    p.write_text(doc if isinstance(doc, str) else json.dumps(doc))
    p.chmod(mode)
    return p


def _two_keys(tmp_path: Path) -> Path:
    # alice may use runs exp-*; bob (stored as a digest only) may use another run.
    return _keys_file(tmp_path, {"keys": [
        {"name": "alice", "key": ALICE, "runs": ["exp-*"]},
        {"name": "bob", "sha256": hashlib.sha256(BOB.encode()).hexdigest(), "runs": ["other"]}]})


async def _serve(keys: Keys, metrics_public: bool, fn: Any) -> list[Access]:
    torch.manual_seed(0)
    loaded = LoadedModel(GPT(CFG).eval(), CFG, "random-init")
    engine = Engine(loaded.model, CFG.seq_len, 4).start()
    seen: list[Access] = []
    server = Server(loaded, engine, Limits(16, 4), model_id="exp-1", keys=keys, metrics_public=metrics_public,
                    on_access=seen.append)
    ts = TestServer(server.app(), host="127.0.0.1")
    await ts.start_server()
    try:
        async with ClientSession() as s:
            await fn(s, str(ts.make_url("")).rstrip("/"))
    finally:
        await ts.close()
        engine.stop()
    return seen


def _bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def test_each_key_reaches_only_its_runs_and_the_access_record_names_it(tmp_path: Path) -> None:
    keys = Keys.load(_two_keys(tmp_path))

    async def go(s: ClientSession, url: str) -> None:
        body = {"model": "exp-1", "prompt": "hi", "max_tokens": 1}
        async with s.post(f"{url}/v1/completions", json=body, headers=_bearer(ALICE)) as r:
            assert r.status == 200
        async with s.post(f"{url}/v1/completions", json=body, headers=_bearer(BOB)) as r:
            err = (await r.json())["error"]
            assert r.status == 403 and "'bob' may not use the model 'exp-1'" in err["message"]
        async with s.get(f"{url}/v1/models", headers=_bearer("not-a-key-" + "x" * 20)) as r:
            assert r.status == 401
        async with s.get(f"{url}/v1/models") as r:
            assert r.status == 401
        async with s.get(f"{url}/metrics") as r:  # behind a key by default
            assert r.status == 401
        async with s.get(f"{url}/metrics", headers=_bearer(ALICE)) as r:
            assert r.status == 200 and "xirang_serve" in await r.text()
        async with s.get(f"{url}/health") as r:  # liveness probes need none
            assert r.status == 200

    seen = asyncio.run(_serve(keys, False, go))
    assert [(a.path, a.status, a.key) for a in seen] == [
        ("/v1/completions", 200, "alice"), ("/v1/completions", 403, "bob"), ("/v1/models", 401, None),
        ("/v1/models", 401, None), ("/metrics", 401, None), ("/metrics", 200, "alice")]
    assert all(ALICE not in repr(a) and BOB not in repr(a) for a in seen)  # names, never the keys


def test_metrics_public_opens_only_the_metrics(tmp_path: Path) -> None:
    keys = Keys.load(_two_keys(tmp_path))

    async def go(s: ClientSession, url: str) -> None:
        async with s.get(f"{url}/metrics") as r:
            assert r.status == 200
        async with s.get(f"{url}/v1/models") as r:
            assert r.status == 401

    asyncio.run(_serve(keys, True, go))


def test_the_single_token_is_a_key_for_every_run_beside_the_file(tmp_path: Path) -> None:
    keys = Keys.load(_two_keys(tmp_path), token="tok-" + "t" * 20)
    assert keys.match("Bearer tok-" + "t" * 20).name == "token"
    assert keys.match("Bearer " + ALICE).name == "alice" and keys.match("Basic " + ALICE) is None
    assert keys.match("") is None and not Keys.from_token(None)


@pytest.mark.parametrize(("doc", "mode", "message"), [
    ({"keys": [{"name": "a", "key": ALICE, "runs": ["*"]}]}, 0o644, r"mode 0644.*chmod 600"),
    ({"keys": [{"name": "a", "key": ALICE, "runs": ["*"]}]}, 0o660, r"mode 0660"),
    ("{not json", 0o600, r"is not JSON"),
    ({"keys": []}, 0o600, r'needs \{"keys"'),
    ({"keys": [{"key": ALICE, "runs": ["*"]}]}, 0o600, r"keys\[0\].*non-empty 'name'"),
    ({"keys": [{"name": "a", "key": "short", "runs": ["*"]}]}, 0o600, r"'a' is shorter than 16.*openssl rand"),
    ({"keys": [{"name": "a", "sha256": "abc", "runs": ["*"]}]}, 0o600, r"64 hex digits"),
    ({"keys": [{"name": "a", "runs": ["*"]}]}, 0o600, r"needs 'key'.*or 'sha256'"),
    ({"keys": [{"name": "a", "key": ALICE}]}, 0o600, r"needs 'runs'"),
    ({"keys": [{"name": "a", "key": ALICE, "runs": ["*"]}, {"name": "a", "key": BOB, "runs": ["*"]}]}, 0o600,
     r"keys\[1\].*'a' is used twice"),
])
def test_a_bad_keys_file_is_refused_by_name(tmp_path: Path, doc: Any, mode: int, message: str) -> None:
    path = _keys_file(tmp_path, doc, mode)
    with pytest.raises(ConfigError, match=message) as e:
        Keys.load(path)
    assert "serve.keys_file" in str(e.value)
    with pytest.raises(ConfigError, match=message):  # and before anything is served
        check_exposure(ServeConfig(host="0.0.0.0", keys_file=str(path)), None)


def test_a_keys_file_of_another_owner_is_refused(tmp_path: Path) -> None:
    if os.getuid() != 0:
        pytest.skip("needs root to give the file to another owner")
    path = _two_keys(tmp_path)
    os.chown(path, 65534, -1)
    with pytest.raises(ConfigError, match=r"belongs to uid 65534, not to you"):
        Keys.load(path)


def test_a_keys_file_lets_a_server_listen_beyond_loopback(tmp_path: Path) -> None:
    check_exposure(ServeConfig(host="0.0.0.0", keys_file=str(_two_keys(tmp_path))), None)
    with pytest.raises(ConfigError, match=r"serve.host.*needs keys"):
        check_exposure(ServeConfig(host="0.0.0.0"), None)
