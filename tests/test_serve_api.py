"""The HTTP API in-process (real aiohttp server on a real socket, a real tiny GPT with random weights).

Bad input -> 400 naming the problem; token auth; health and model info; concurrent requests are
decoded together and each gets exactly what it would get alone; streaming equals non-streaming.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
import torch
from aiohttp import ClientSession
from aiohttp.test_utils import TestServer

from xirang_hpc.config.schema import ModelConfig
from xirang_hpc.data.tokenizer import ByteTokenizer
from xirang_hpc.models.gpt import GPT
from xirang_hpc.serve.engine import Engine
from xirang_hpc.serve.server import Limits, Server
from xirang_hpc.weights.load import LoadedModel

CFG = ModelConfig(name="t", n_layer=2, n_head=2, d_model=32, seq_len=32)


def _loaded() -> LoadedModel:
    torch.manual_seed(0)
    return LoadedModel(GPT(CFG).eval(), CFG, "random-init")


async def _with_server(fn: Any, token: str | None = None, max_batch: int = 8) -> Any:
    loaded = _loaded()
    engine = Engine(loaded.model, CFG.seq_len, max_batch).start()
    server = Server(loaded, engine, Limits(max_prompt_tokens=32, max_new_tokens=40), token)
    ts = TestServer(server.app(), host="127.0.0.1")
    await ts.start_server()
    try:
        async with ClientSession() as s:
            return await fn(s, str(ts.make_url("")).rstrip("/"), engine)
    finally:
        await ts.close()
        engine.stop()


def run(fn: Any, **kw: Any) -> Any:
    return asyncio.run(_with_server(fn, **kw))


BAD = [
    (b"{not json", "not valid JSON"),
    (b"[1, 2]", "must be a JSON object"),
    (json.dumps({"prompt": "x" * 33}).encode(), "33 tokens, more than the limit of 32"),
    (json.dumps({"prompt": "x" * 100_000}).encode(), "too large"),
    (json.dumps({"prompt": "hi", "max_tokens": -1}).encode(), "'max_tokens'=-1 is out of range"),
    (json.dumps({"prompt": "hi", "max_tokens": 41}).encode(), "'max_tokens'=41 is out of range"),
    (json.dumps({"prompt": "hi", "max_tokens": "5"}).encode(), "'max_tokens' must be an integer"),
    (json.dumps({"prompt": "hi", "max_tokens": 2.5}).encode(), "'max_tokens' must be an integer"),
    (json.dumps({"prompt": 5}).encode(), "'prompt' must be a string"),
    (json.dumps({"max_tokens": 3}).encode(), "'prompt' must be a string"),
    (json.dumps({"prompt": ""}).encode(), "'prompt' is empty"),
    (json.dumps({"prompt": "hi", "temperature": -0.5}).encode(), "'temperature' must be a finite number >= 0"),
    (json.dumps({"prompt": "hi", "temperature": "hot"}).encode(), "'temperature' must be a finite number"),
    (json.dumps({"prompt": "hi", "top_k": -3}).encode(), "'top_k'=-3 is out of range"),
    (json.dumps({"prompt": "hi", "seed": -1}).encode(), "'seed'=-1 is out of range"),
    (json.dumps({"prompt": "hi", "stream": "yes"}).encode(), "'stream' must be true or false"),
    (json.dumps({"prompt": "hi", "max_token": 5}).encode(), "unknown field(s) ['max_token']"),
]


def test_every_bad_input_gets_a_400_with_its_message_and_the_server_keeps_serving() -> None:
    async def go(s: ClientSession, url: str, engine: Engine) -> None:
        for body, words in BAD:
            async with s.post(f"{url}/v1/generate", data=body, headers={"Content-Type": "application/json"}) as r:
                assert r.status == 400, (body[:60], r.status, await r.text())
                msg = (await r.json())["error"]
                assert words in msg, (body[:60], msg)
        async with s.post(f"{url}/v1/generate", json={"prompt": "hi", "max_tokens": 3}) as r:
            assert r.status == 200
            assert (await r.json())["completion_tokens"] == 3
        assert engine.stats["requests"] == 1  # no bad request reached the engine

    run(go)


def test_health_and_model_info() -> None:
    async def go(s: ClientSession, url: str, engine: Engine) -> None:
        async with s.get(f"{url}/health") as r:
            assert r.status == 200 and (await r.json())["status"] == "ok"
        async with s.get(f"{url}/v1/model") as r:
            info = await r.json()
        assert info["model"]["d_model"] == 32 and info["model"]["n_layer"] == 2
        assert info["params"] == sum(p.numel() for p in GPT(CFG).parameters())
        assert info["limits"] == {"max_prompt_tokens": 32, "max_new_tokens": 40}
        assert info["tokenizer"] == "byte" and info["source"] == "random-init"

    run(go)


def test_bearer_token_guards_the_api_but_not_health() -> None:
    async def go(s: ClientSession, url: str, engine: Engine) -> None:
        body = {"prompt": "hi", "max_tokens": 1}
        async with s.post(f"{url}/v1/generate", json=body) as r:
            assert r.status == 401 and "bearer token" in (await r.json())["error"]
        async with s.post(f"{url}/v1/generate", json=body, headers={"Authorization": "Bearer wrong"}) as r:
            assert r.status == 401
        async with s.get(f"{url}/v1/model") as r:
            assert r.status == 401
        async with s.post(f"{url}/v1/generate", json=body, headers={"Authorization": "Bearer s3cret"}) as r:
            assert r.status == 200
        async with s.get(f"{url}/health") as r:
            assert r.status == 200

    run(go, token="s3cret")


def _alone(prompt: str, n: int, temperature: float, top_k: int, seed: int) -> str:
    """The same request decoded by itself, in a fresh engine (batch of one)."""
    loaded = _loaded()
    eng = Engine(loaded.model, CFG.seq_len, max_batch=1)
    try:
        out = eng.generate([list(ByteTokenizer().encode(prompt))], n, temperature, top_k, seed)[0]
    finally:
        eng.stop()
    return ByteTokenizer().decode(out)


def test_concurrent_requests_are_batched_and_each_equals_its_solo_result() -> None:
    # Different prompt lengths and lengths past the context (32) exercise padding and the sliding window.
    reqs = [{"prompt": "def f(x):"[: 3 + i], "max_tokens": 30 + i, "temperature": (0.0 if i % 2 else 0.8),
             "top_k": (0 if i % 3 else 5), "seed": 100 + i} for i in range(8)]

    async def go(s: ClientSession, url: str, engine: Engine) -> list[dict[str, Any]]:
        async def one(body: dict[str, Any]) -> dict[str, Any]:
            async with s.post(f"{url}/v1/generate", json=body) as r:
                assert r.status == 200, await r.text()
                return await r.json()
        out = await asyncio.gather(*(one(b) for b in reqs))
        assert engine.stats["max_batch_seen"] > 1, engine.stats  # really decoded together
        assert engine.stats["forward_passes"] < sum(b["max_tokens"] for b in reqs)
        return out

    results = run(go)
    for body, res in zip(reqs, results):
        assert res["seed"] == body["seed"] and res["completion_tokens"] == body["max_tokens"]
        solo = _alone(body["prompt"], body["max_tokens"], body["temperature"], body["top_k"], body["seed"])
        assert res["text"] == solo, body


def test_streaming_yields_the_same_tokens_as_a_plain_request() -> None:
    body = {"prompt": "class ", "max_tokens": 12, "temperature": 0.7, "seed": 7}

    async def go(s: ClientSession, url: str, engine: Engine) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        async with s.post(f"{url}/v1/generate", json={**body, "stream": True}) as r:
            assert r.status == 200 and r.headers["Content-Type"].startswith("application/x-ndjson")
            lines = [json.loads(line) for line in (await r.text()).splitlines()]
        async with s.post(f"{url}/v1/generate", json=body) as r:
            plain = await r.json()
        return lines, plain

    lines, plain = run(go)
    assert len(lines) == 13 and lines[-1]["done"] is True
    assert bytes(x["token"] for x in lines[:-1]).decode("utf-8", "replace") == plain["text"] == lines[-1]["text"]


def test_zero_max_tokens_returns_empty_text_and_seeded_sampling_repeats() -> None:
    async def go(s: ClientSession, url: str, engine: Engine) -> list[dict[str, Any]]:
        out = []
        for body in ({"prompt": "x", "max_tokens": 0}, {"prompt": "x", "max_tokens": 10, "temperature": 1.0, "seed": 3},
                     {"prompt": "x", "max_tokens": 10, "temperature": 1.0, "seed": 3},
                     {"prompt": "x", "max_tokens": 10, "temperature": 1.0, "seed": 4}):
            async with s.post(f"{url}/v1/generate", json=body) as r:
                out.append(await r.json())
        return out

    empty, a, b, c = run(go)
    assert empty["text"] == "" and empty["completion_tokens"] == 0
    assert a["text"] == b["text"] and a["text"] != c["text"]


@pytest.mark.parametrize("top_k", [1, 3])
def test_top_k_restricts_sampling(top_k: int) -> None:
    from xirang_hpc.serve.engine import sample_next

    logits = torch.tensor([0.0, 5.0, 4.0, 3.0, -1.0])
    g = torch.Generator().manual_seed(0)
    picks = {sample_next(logits, 2.0, top_k, g) for _ in range(200)}
    assert picks == ({1} if top_k == 1 else {1, 2, 3})
    assert sample_next(logits, 0.0, 0, None) == 1  # greedy


@pytest.mark.parametrize("pos", ["learned", "rope"])
def test_kv_cache_decoding_equals_full_recompute_past_the_context_window(pos: str) -> None:
    cfg = ModelConfig(name="t", n_layer=2, n_head=2, d_model=32, seq_len=16, pos=pos)
    torch.manual_seed(3)
    model = GPT(cfg).eval()
    prompts = [[1, 2, 3], list(range(40, 52)), [7] * 16, [9]]  # 16 = a full window; 3 + 20 > 16 slides
    outs = {}
    for kv, batch in ((True, 4), (True, 1), (False, 4)):
        eng = Engine(model, cfg.seq_len, batch, kv_cache=kv)
        try:
            outs[(kv, batch)] = eng.generate(prompts, 20, temperature=0.0)
            if kv:
                assert eng.cache is not None
        finally:
            eng.stop()
    # Reference: the plain model over the last seq_len tokens, one token at a time.
    ref = []
    for p in prompts:
        seq = list(p)
        for _ in range(20):
            with torch.no_grad():
                seq.append(int(model(torch.tensor([seq[-16:]]))[0, -1].argmax()))
        ref.append(seq[len(p):])
    assert outs[(True, 4)] == outs[(True, 1)] == outs[(False, 4)] == ref


def test_the_info_file_is_never_seen_torn(tmp_path) -> None:
    # A client (a script, `xirang-status`, the tests) waits for the info file to appear and reads it at once:
    # each write must replace the file whole, never leave it empty or half-written (once seen under load).
    import os
    import stat
    import threading

    from xirang_hpc.serve.run import write_info

    info = tmp_path / "serve.json"
    body = {"url": "http://127.0.0.1:1", "status": "serving", "pad": "x" * 200_000}
    done, torn, reads = threading.Event(), [], [0]

    def reader() -> None:
        while not done.is_set():
            try:
                text = info.read_text()
            except FileNotFoundError:
                continue
            reads[0] += 1
            try:
                json.loads(text)
            except ValueError:
                torn.append(len(text))

    t = threading.Thread(target=reader)
    t.start()
    try:
        for i in range(300):
            write_info(info, {**body, "i": i})
    finally:
        done.set()
        t.join()
    assert reads[0] > 0 and not torn, f"{len(torn)} of {reads[0]} reads saw a torn file"
    assert json.loads(info.read_text())["i"] == 299
    assert stat.S_IMODE(os.stat(info).st_mode) == 0o600  # it may name the endpoint: the owner's only


def test_a_server_reachable_from_other_machines_needs_a_token():
    from xirang_hpc.config.errors import ConfigError
    from xirang_hpc.config.schema import ServeConfig
    from xirang_hpc.serve.run import check_exposure

    for host in ("0.0.0.0", "10.1.2.3", "::", "node7"):
        with pytest.raises(ConfigError, match=r"serve.host.*needs keys: set serve.keys_file, or \$XIRANG_SERVE_TOKEN"):
            check_exposure(ServeConfig(host=host), None)
        check_exposure(ServeConfig(host=host), "secret")
    for host in ("127.0.0.1", "::1", "[::1]", "localhost"):
        check_exposure(ServeConfig(host=host), None)


def test_responses_name_no_absolute_path():
    from xirang_hpc.serve.server import public_source

    assert public_source("/home/alice/runs/default-tiny-abc/checkpoints/step_40") == "checkpoints/step_40"
    assert public_source("random-init") == "random-init"
