"""The OpenAI-compatible API, driven by the official ``openai`` client against the real server.

The server (engine thread + aiohttp on 127.0.0.1, port 0, started by ``serve.run.start_server`` as
``xirang-serve`` does) runs in a background event loop and serves the tiny random-init GPT of
tests/test_serve_api.py. Covered: completions and chat, greedy equal to ``/v1/generate``, streaming
equal to non-streaming, usage counts, stop strings and EOS, ``models.list``, the client's typed
errors, ``/metrics`` read with prometheus_client's parser, a client leaving mid-stream, and
half-sent requests closed by the read timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families
from test_serve_api import CFG, _loaded

from xirang_hpc.config.schema import ServeConfig
from xirang_hpc.data.tokenizer import ByteTokenizer
from xirang_hpc.serve.engine import sample_next
from xirang_hpc.serve.openai_api import SIMPLE_CHAT_STOP, final_text, settled_text, simple_chat_prompt
from xirang_hpc.serve.run import Running, model_id_for, start_server
from xirang_hpc.weights.load import LoadedModel

MODEL = "tiny-run"
TOK = ByteTokenizer()


class Served:
    """``start_server`` in a background event loop (the sync openai client needs its own thread)."""

    def __init__(self, token: str | None = None, tokenizer: Any = None, loaded: LoadedModel | None = None,
                 **scfg: Any) -> None:
        kw = {"port": 0, "max_batch": 8, "max_prompt_tokens": 64, "max_new_tokens": 40, "model_name": MODEL, **scfg}
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="test-server-loop", daemon=True)
        self.thread.start()
        starting = start_server(loaded or _loaded(), ServeConfig(**kw), token, tokenizer)
        fut = asyncio.run_coroutine_threadsafe(starting, self.loop)
        self.running: Running = fut.result(timeout=600)
        self.url = self.running.url

    def client(self, api_key: str = "unused") -> openai.OpenAI:
        # No retries: a retried request would hide (and double-count) what the server answered.
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=api_key, max_retries=0, timeout=600)

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self.running.stop(), self.loop).result(timeout=300)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=30)
        self.loop.close()


@contextlib.contextmanager
def served(**kw: Any) -> Iterator[Served]:
    s = Served(**kw)
    try:
        yield s
    finally:
        s.close()


@pytest.fixture(scope="module")
def srv() -> Iterator[Served]:
    with served() as s:
        yield s


def post(url: str, body: Any, headers: dict[str, str] | None = None) -> tuple[int, Any]:
    """A plain HTTP POST (no client library): status and JSON body."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=600) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def get_text(url: str, headers: dict[str, str] | None = None) -> str:
    with urllib.request.urlopen(urllib.request.Request(url, headers=headers or {}), timeout=600) as r:
        return r.read().decode()


def generate(s: Served, prompt: str, max_tokens: int, **kw: Any) -> dict[str, Any]:
    """The server's own endpoint, for reference."""
    status, body = post(f"{s.url}/v1/generate", {"prompt": prompt, "max_tokens": max_tokens, **kw})
    assert status == 200, body
    return body


# ---- completions ----------------------------------------------------------------------------


def test_greedy_completion_equals_the_generate_endpoint_with_consistent_usage(srv: Served) -> None:
    client = srv.client()
    t0 = time.time()
    for prompt, n in (("def f(x):", 20), ("hello", 40), ("é", 1)):
        c = client.completions.create(model=MODEL, prompt=prompt, max_tokens=n, temperature=0)
        ref = generate(srv, prompt, n, temperature=0)
        assert c.choices[0].text == ref["text"], prompt
        assert c.choices[0].finish_reason == "length" and c.choices[0].index == 0
        assert c.usage.prompt_tokens == len(TOK.encode(prompt)) == ref["prompt_tokens"]
        assert c.usage.completion_tokens == n == ref["completion_tokens"]
        assert c.usage.total_tokens == c.usage.prompt_tokens + n
        assert c.id.startswith("cmpl-") and c.object == "text_completion" and c.model == MODEL
        assert t0 - 1 <= c.created <= time.time() + 1
    # Token ids work as a prompt too, and give the same text as the string.
    ids = [int(t) for t in TOK.encode("def f(x):")]
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=20, temperature=0)
    assert by_ids.choices[0].text == generate(srv, "def f(x):", 20, temperature=0)["text"]
    ids2 = client.completions.create(model=MODEL, prompt=ids, max_tokens=20, temperature=0)
    assert ids2.id != by_ids.id


def _stream_text(stream: Any, chat: bool = False) -> tuple[str, list[Any]]:
    chunks = list(stream)
    pieces = []
    for ch in chunks:
        for choice in ch.choices:
            piece = choice.delta.content if chat else choice.text
            pieces.append(piece or "")
    return "".join(pieces), chunks


@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 0.9, "top_p": 0.8, "seed": 11}])
def test_streamed_completion_adds_up_to_the_plain_one(srv: Served, sampling: dict[str, Any]) -> None:
    client = srv.client()
    plain = client.completions.create(model=MODEL, prompt="def f(x):", max_tokens=30, **sampling)
    text, chunks = _stream_text(client.completions.create(model=MODEL, prompt="def f(x):", max_tokens=30,
                                                          stream=True, stream_options={"include_usage": True},
                                                          **sampling))
    assert text == plain.choices[0].text
    assert len({c.id for c in chunks}) == 1 and chunks[0].id.startswith("cmpl-")
    finishes = [ch.finish_reason for c in chunks for ch in c.choices if ch.finish_reason]
    assert finishes == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.model_dump() == plain.usage.model_dump()
    assert len(chunks) > 3  # really streamed in pieces


def test_stream_is_server_sent_events_ending_with_done(srv: Served) -> None:
    req = urllib.request.Request(f"{srv.url}/v1/completions", headers={"Content-Type": "application/json"},
                                 data=json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 5,
                                                  "temperature": 0, "stream": True}).encode())
    with urllib.request.urlopen(req, timeout=600) as r:
        assert r.headers["Content-Type"].startswith("text/event-stream")
        raw = r.read().decode()
    events = [e for e in raw.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events) and events[-1] == "data: [DONE]"
    last = json.loads(events[-2][len("data: "):])
    assert last["choices"][0]["finish_reason"] == "length" and last["object"] == "text_completion"


def test_stop_strings_cut_the_text_and_end_generation(srv: Served) -> None:
    client = srv.client()
    full = client.completions.create(model=MODEL, prompt="def f(x):", max_tokens=40, temperature=0).choices[0].text
    # A two-character stop string from the middle of the greedy text (printable ASCII, first occurrence).
    i = next(i for i in range(3, len(full) - 2) if full[i:i + 2].isascii() and full[i:i + 2].isprintable())
    stop = full[i:i + 2]
    cut = full[: full.find(stop)]
    c = client.completions.create(model=MODEL, prompt="def f(x):", max_tokens=40, temperature=0, stop=[stop, "zzz"])
    assert c.choices[0].text == cut and c.choices[0].finish_reason == "stop"
    # Generation ended with the token that completed the stop string.
    ref_ids = srv.running.engine.generate([[int(t) for t in TOK.encode("def f(x):")]], 40)[0]
    k = next(n for n in range(1, 41) if stop in TOK.decode(ref_ids[:n]))
    assert c.usage.completion_tokens == k < 40
    text, chunks = _stream_text(client.completions.create(model=MODEL, prompt="def f(x):", max_tokens=40,
                                                          temperature=0, stop=stop, stream=True))
    assert text == cut and chunks[-1].choices[0].finish_reason == "stop"


def test_settled_text_never_sends_what_a_later_token_changes() -> None:
    # Multi-byte characters split across tokens, invalid bytes, and stop strings split across tokens.
    g = torch.Generator().manual_seed(0)
    alphabet = list(b"ab<|\n") + list("é€".encode()) + [0xFF, 0xC3]
    for trial in range(200):
        out = [alphabet[int(i)] for i in torch.randint(len(alphabet), (30,), generator=g)]
        stop = [["\n<|"], ["b<", "€a"], []][trial % 3]
        sent = ""
        for n in range(1, len(out) + 1):
            settled = settled_text(TOK, out[:n], stop)
            assert settled.startswith(sent), (out[:n], stop)
            sent = settled
            if final_text(TOK, out[:n], stop)[1]:
                break
        final, _ = final_text(TOK, out[:n], stop)
        assert final.startswith(sent) and not any(s in final for s in stop)


# ---- chat ----------------------------------------------------------------------------------------


MESSAGES = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "def"}]


def test_chat_uses_the_simple_template_and_equals_generate_on_it(srv: Served) -> None:
    client = srv.client()
    prompt = simple_chat_prompt(MESSAGES)
    assert prompt == "<|system|>\nYou write Python.\n<|user|>\ndef\n<|assistant|>\n"
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=24, temperature=0)
    ref = generate(srv, prompt, 24, temperature=0)["text"]
    assert r.choices[0].message.content == ref.split(SIMPLE_CHAT_STOP)[0]
    assert r.choices[0].message.role == "assistant" and r.object == "chat.completion"
    assert r.id.startswith("chatcmpl-") and r.model == MODEL
    assert r.usage.prompt_tokens == len(TOK.encode(prompt))
    text, chunks = _stream_text(client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=24,
                                                               temperature=0, stream=True), chat=True)
    assert text == r.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].object == "chat.completion.chunk"
    assert chunks[-1].choices[0].finish_reason == r.choices[0].finish_reason
    # Text content parts are the same message.
    parts = [MESSAGES[0], {"role": "user", "content": [{"type": "text", "text": "de"}, {"type": "text", "text": "f"}]}]
    again = client.chat.completions.create(model=MODEL, messages=parts, max_tokens=24, temperature=0)
    assert again.choices[0].message.content == r.choices[0].message.content


class TemplateTokenizer(ByteTokenizer):
    """A byte tokenizer with its own chat template and an end-of-sequence token."""

    chat_template = "### {role}: {content}"

    def __init__(self, eos_id: int | None) -> None:
        self.eos_id = eos_id

    def apply_chat_template(self, messages: list[dict[str, str]], tokenize: bool = True,
                            add_generation_prompt: bool = False) -> str:
        assert tokenize is False and add_generation_prompt is True
        return "".join(f"### {m['role']}: {m['content']}\n" for m in messages) + "### assistant:"


def test_a_tokenizers_chat_template_and_eos_token_are_used() -> None:
    rendered = TemplateTokenizer(None).apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    with served() as plain:
        ref_ids = plain.running.engine.generate([[int(t) for t in TOK.encode(rendered)]], 30)[0]
    eos = next(t for t in ref_ids[3:] if t < 128)  # an ASCII token a few steps in: becomes the EOS token
    k = ref_ids.index(eos)
    with served(tokenizer=TemplateTokenizer(eos)) as s:
        client = s.client()
        r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=30, temperature=0)
        assert r.usage.prompt_tokens == len(rendered.encode())
        assert r.choices[0].message.content == TOK.decode(ref_ids[:k])  # the EOS token is not part of the text
        assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens == k
        text, _ = _stream_text(client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=30,
                                                              temperature=0, stream=True), chat=True)
        assert text == r.choices[0].message.content


def test_a_bpe_run_tokenizer_counts_its_own_tokens_and_streams_the_same_text(tmp_path: Path) -> None:
    from test_tokenizer import _backend

    from xirang_hpc.config.schema import ModelConfig
    from xirang_hpc.data.tokenizer import HFTokenizer
    from xirang_hpc.models.gpt import GPT

    _backend().save(str(tmp_path / "tokenizer.json"))  # a byte-level BPE trained by the tokenizers library
    tok = HFTokenizer(tmp_path / "tokenizer.json")
    cfg = ModelConfig(name="bpe", n_layer=2, n_head=2, d_model=32, seq_len=32, vocab_size=tok.vocab_size)
    torch.manual_seed(0)
    # No tokenizer passed to the server: it uses the one that came with the weights.
    with served(loaded=LoadedModel(GPT(cfg).eval(), cfg, "random-init", tokenizer=tok)) as s:
        client = s.client()
        prompt = "Document 3: word1 val=3 ünïcode 🙂"
        ids = [int(t) for t in tok.encode(prompt)]
        c = client.completions.create(model=MODEL, prompt=prompt, max_tokens=20, temperature=0)
        assert c.usage.prompt_tokens == len(ids) < len(prompt.encode())  # BPE tokens, not bytes
        ref = s.running.engine.generate([ids], 20)[0]
        expected = ref[: ref.index(tok.eos_id)] if tok.eos_id in ref else ref  # the EOS token ends a reply
        assert c.choices[0].text == tok.decode(expected) and c.usage.completion_tokens == len(expected)
        for seed in (1, 2, 3):
            kw = {"model": MODEL, "prompt": prompt, "max_tokens": 20, "temperature": 1.0, "seed": seed}
            plain = client.completions.create(**kw)
            text, _ = _stream_text(client.completions.create(**kw, stream=True))
            assert text == plain.choices[0].text


# ---- models and errors --------------------------------------------------------------------------


def test_models_list_and_retrieve(srv: Served) -> None:
    client = srv.client()
    assert [m.id for m in client.models.list()] == [MODEL]
    assert client.models.retrieve(MODEL).owned_by == "xirang"
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("gpt-4")
    assert e.value.code == "model_not_found"


BAD_COMPLETIONS: list[tuple[dict[str, Any], str, str]] = [
    ({"max_tokens": 0}, "max_tokens", "'max_tokens'=0 is out of range"),
    ({"max_tokens": -5}, "max_tokens", "out of range"),
    ({"max_tokens": 41}, "max_tokens", "serve.max_new_tokens"),
    ({"max_tokens": "5"}, "max_tokens", "must be an integer"),
    ({"prompt": "x" * 65}, "prompt", "65 tokens, more than the limit of 64"),
    ({"prompt": ""}, "prompt", "empty"),
    ({"prompt": [1, 999]}, "prompt", "vocabulary"),
    ({"prompt": {"text": "hi"}}, "prompt", "must be a string"),
    ({"n": 2}, "n", "one choice per prompt"),
    ({"temperature": 2.5}, "temperature", "out of range"),
    ({"temperature": "hot"}, "temperature", "must be a number"),
    ({"top_p": 0}, "top_p", "0.0 < top_p"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop", "1 to 4"),
    ({"stop": 7}, "stop", "'stop' must be"),
    ({"seed": -1}, "seed", "out of range"),
    ({"stream": "yes"}, "stream", "true or false"),
    ({"logprobs": 6}, "logprobs", "out of range"),
    ({"max_tokens": 0, "echo": False}, "max_tokens", "0 only with echo=true"),
    ({"echo": "yes"}, "echo", "true or false"),
    ({"prompt": ["hi", 3]}, "prompt", "'prompt[1]' must be"),
    ({"prompt": ["hi", "yo"], "stream": True}, "stream", "one prompt without echo or logprobs"),
    ({"bogus": 1}, "bogus", "unknown or unsupported field(s) ['bogus']"),
]


def test_bad_parameters_raise_the_clients_bad_request_error(srv: Served) -> None:
    client = srv.client()
    before = srv.running.engine.stats["requests"]
    for extra, param, words in BAD_COMPLETIONS:
        body = {"model": MODEL, "prompt": "hi", "max_tokens": 3, **extra}
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(**{k: body[k] for k in ("model", "prompt")}, extra_body=body)
        assert e.value.status_code == 400 and e.value.param == param, (extra, e.value.body)
        assert words in e.value.message, (extra, e.value.message)
        assert e.value.type == "invalid_request_error"
    for messages, param in (([], "messages"), ([{"role": "wizard", "content": "x"}], "messages[0].role"),
                            ([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}],
                             "messages[0].content"),
                            ([{"role": "user", "content": "x" * 70}], "messages")):
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=MODEL, messages=messages)
        assert e.value.param == param, e.value.body
    # Not JSON at all: still OpenAI's error shape.
    status, body = post(f"{srv.url}/v1/completions", b"{not json")
    assert status == 400 and set(body["error"]) == {"message", "type", "param", "code"}
    assert "not valid JSON" in body["error"]["message"]
    assert srv.running.engine.stats["requests"] == before  # nothing bad reached the engine
    ok = client.completions.create(model=MODEL, prompt="hi", max_tokens=2)
    assert ok.usage.completion_tokens == 2


def test_unknown_model_is_the_clients_not_found_error(srv: Served) -> None:
    client = srv.client()
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="gpt-3.5-turbo-instruct", prompt="hi", max_tokens=2)
    assert e.value.status_code == 404 and e.value.code == "model_not_found" and MODEL in e.value.message
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=MESSAGES, max_tokens=2)


def test_bearer_token_errors_are_the_clients_authentication_error() -> None:
    with served(token="s3cret") as s:
        with pytest.raises(openai.AuthenticationError) as e:
            s.client(api_key="wrong").completions.create(model=MODEL, prompt="hi", max_tokens=2)
        assert e.value.status_code == 401 and e.value.code == "invalid_api_key"
        # No Authorization header at all (the client always sends one): OpenAI's shape too.
        status, body = post(f"{s.url}/v1/chat/completions", {"model": MODEL, "messages": MESSAGES})
        assert status == 401 and body["error"]["code"] == "invalid_api_key" and "bearer" in body["error"]["message"]
        with pytest.raises(openai.AuthenticationError):
            s.client(api_key="wrong").models.list()
        ok = s.client(api_key="s3cret")
        assert ok.completions.create(model=MODEL, prompt="hi", max_tokens=2).usage.completion_tokens == 2
        assert [m.id for m in ok.models.list()] == [MODEL]
        # The existing endpoint keeps its own error shape; /metrics needs the token too, /health none.
        status, body = post(f"{s.url}/v1/generate", {"prompt": "hi"})
        assert status == 401 and "bearer token" in body["error"]
        with pytest.raises(urllib.error.HTTPError, match="401"):
            get_text(f"{s.url}/metrics")
        assert "xirang_serve_requests_total" in get_text(f"{s.url}/metrics", {"Authorization": "Bearer s3cret"})
        assert get_text(f"{s.url}/health")


# ---- metrics -------------------------------------------------------------------------------------


def scrape(s: Served) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """/metrics through prometheus_client's own parser: {(sample name, sorted labels): value}."""
    out = {}
    for fam in text_string_to_metric_families(get_text(f"{s.url}/metrics")):
        for smp in fam.samples:
            out[(smp.name, tuple(sorted(smp.labels.items())))] = smp.value
    return out


def test_metrics_count_requests_latencies_batches_and_tokens() -> None:
    with served() as s:
        client = s.client()
        sizes = [5, 7, 9]
        for n in sizes:
            client.completions.create(model=MODEL, prompt="hi", max_tokens=n, temperature=0)
        _stream_text(client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=6, temperature=0,
                                                    stream=True), chat=True)
        with pytest.raises(openai.BadRequestError):
            client.completions.create(model=MODEL, prompt="hi", max_tokens=0)
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model="nope", prompt="hi", max_tokens=1)
        m = scrape(s)

    def req(endpoint: str, status: str) -> float:
        return m.get(("xirang_serve_requests_total", (("endpoint", endpoint), ("status", status))), 0.0)

    assert req("/v1/completions", "200") == 3
    assert req("/v1/completions", "400") == 1 and req("/v1/completions", "404") == 1
    assert req("/v1/chat/completions", "200") == 1
    lat = m[("xirang_serve_request_latency_seconds_count", (("endpoint", "/v1/completions"),))]
    assert lat == 5
    chat_tokens = m[("xirang_serve_generated_tokens_total", ())] - sum(sizes)
    assert 1 <= chat_tokens <= 6  # the chat reply: at most its max_tokens (a stop string may end it early)
    tokens = m[("xirang_serve_generated_tokens_total", ())]
    assert m[("xirang_serve_batch_size_count", ())] >= sum(sizes) and m[("xirang_serve_batch_size_sum", ())] == tokens
    assert m[("xirang_serve_tokens_per_second", ())] > 0
    assert m[("xirang_serve_active_requests", ())] == 0


# ---- robustness ----------------------------------------------------------------------------------


def settled(s: Served, limit_s: float = 120) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Metrics once no request is in flight any more (a cancelled request leaves at the next engine step)."""
    deadline = time.monotonic() + limit_s
    while (m := scrape(s))[("xirang_serve_active_requests", ())] != 0:
        assert time.monotonic() < deadline, "a request is still in flight"
        time.sleep(0.1)
    return m


def test_a_client_leaving_mid_stream_is_one_log_line_and_the_server_stays_healthy(
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    with served(max_new_tokens=4000) as s:
        body = json.dumps({"model": MODEL, "prompt": "def", "max_tokens": 4000, "temperature": 0, "stream": True})
        with socket.create_connection((s.running.host, s.running.port), timeout=600) as sock:
            sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         f"Content-Length: {len(body)}\r\n\r\n{body}".encode())
            got = b""
            while got.count(b"data: ") < 3:  # a few chunks arrived: the generation is under way
                got += sock.recv(4096)
            assert got.startswith(b"HTTP/1.1 200")
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            m = scrape(s)
            if m.get(("xirang_serve_requests_total", (("endpoint", "/v1/completions"), ("status", "499")))):
                break
            time.sleep(0.2)
        else:
            pytest.fail("the disconnect was never recorded")
        m = settled(s)
        assert m[("xirang_serve_generated_tokens_total", ())] < 4000  # the generation was cancelled
        ok = s.client().completions.create(model=MODEL, prompt="hi", max_tokens=3)
        assert ok.usage.completion_tokens == 3
    gone = [r for r in caplog.records if "went away mid-stream" in r.getMessage()]
    assert len(gone) == 1 and gone[0].exc_info is None, [r.getMessage() for r in gone]
    assert not [r for r in caplog.records if r.exc_info or r.levelno >= logging.ERROR], \
        [(r.name, r.getMessage()) for r in caplog.records if r.exc_info or r.levelno >= logging.ERROR]


def test_a_client_leaving_before_a_plain_reply_cancels_its_generation(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING)
    with served(max_new_tokens=4000) as s:
        body = json.dumps({"model": MODEL, "prompt": "def", "max_tokens": 4000, "temperature": 0})
        with socket.create_connection((s.running.host, s.running.port), timeout=600) as sock:
            sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         f"Content-Length: {len(body)}\r\n\r\n{body}".encode())
            deadline = time.monotonic() + 120
            while scrape(s)[("xirang_serve_active_requests", ())] < 1:  # the request reached the engine
                assert time.monotonic() < deadline
                time.sleep(0.05)
        while not scrape(s).get(("xirang_serve_requests_total", (("endpoint", "/v1/completions"), ("status", "499")))):
            assert time.monotonic() < deadline, "the disconnect was never noticed"
            time.sleep(0.2)
        assert settled(s)[("xirang_serve_generated_tokens_total", ())] < 4000  # the generation was cancelled
    gone = [r for r in caplog.records if "went away before its reply" in r.getMessage()]
    assert len(gone) == 1 and gone[0].exc_info is None


def _read_until_closed(sock: socket.socket, limit_s: float) -> tuple[bytes, float]:
    t0 = time.monotonic()
    sock.settimeout(limit_s)
    got = b""
    while True:
        chunk = sock.recv(4096)
        if not chunk:
            return got, time.monotonic() - t0
        got += chunk


def test_half_sent_requests_are_closed_after_the_read_timeout(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING)
    with served(read_timeout_s=1.0) as s:
        addr = (s.running.host, s.running.port)
        before = s.running.engine.stats["requests"]
        # Headers complete, body promised (200 bytes) but only partly sent.
        with socket.create_connection(addr, timeout=600) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 200\r\n\r\n{\"model\": \"tiny-run\", ")
            got, waited = _read_until_closed(sock, 600)  # the server closes it; 600 s is our own safety net
        head, _, body = got.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 408"), got[:200]
        assert json.loads(body)["error"]["code"] == "request_timeout"
        assert waited >= 0.9  # not before the read timeout; how soon after is the machine's speed
        # Headers never finished: the connection is closed, without a reply.
        with socket.create_connection(addr, timeout=600) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Le")
            got, _ = _read_until_closed(sock, 600)
        assert got == b""  # closed by the server (our own 600 s limit would raise instead)
        assert s.running.engine.stats["requests"] == before  # neither reached the engine
        assert s.client().completions.create(model=MODEL, prompt="hi", max_tokens=2).usage.completion_tokens == 2
    assert any("no complete body within 1 s" in r.getMessage() for r in caplog.records)


# ---- pieces --------------------------------------------------------------------------------------


def test_model_id_is_the_run_directory_name(tmp_path: Path) -> None:
    run = tmp_path / "exp-tiny-3f2a"
    (run / "checkpoints" / "step_8").mkdir(parents=True)
    loaded = _loaded()

    def named(source: Path, **kw: Any) -> str:
        return model_id_for(LoadedModel(loaded.model, CFG, str(source)), ServeConfig(**kw))

    assert named(run / "checkpoints" / "step_8") == "exp-tiny-3f2a"
    assert named(run) == "exp-tiny-3f2a"
    assert named(run / "export" / "step_8" / "model.safetensors") == "exp-tiny-3f2a"
    assert named(tmp_path / "w" / "model.safetensors") == CFG.name  # loose weights: the preset's name
    assert named(run, model_name="mine") == "mine"


def test_top_p_keeps_only_the_nucleus_and_one_leaves_sampling_unchanged() -> None:
    logits = torch.tensor([3.0, 2.9, 0.0, -1.0, -2.0])  # p ~ [0.49, 0.45, 0.02, ...]
    g = torch.Generator().manual_seed(0)
    assert {sample_next(logits, 1.0, 0, g, top_p=0.9) for _ in range(300)} == {0, 1}
    assert {sample_next(logits, 1.0, 0, g, top_p=0.3) for _ in range(50)} == {0}
    a = [sample_next(logits, 1.0, 0, torch.Generator().manual_seed(s)) for s in range(50)]
    b = [sample_next(logits, 1.0, 0, torch.Generator().manual_seed(s), top_p=1.0) for s in range(50)]
    assert a == b and len(set(a)) > 2


def test_new_requests_are_prefilled_together_in_one_forward() -> None:
    from xirang_hpc.serve.engine import Engine, GenRequest

    loaded = _loaded()
    prompts = [[1, 2, 3], list(range(40, 52)), [7] * 20, [9]]
    eng = Engine(loaded.model, CFG.seq_len, max_batch=4)
    left = threading.Semaphore(0)
    reqs = [eng.submit(GenRequest(p, 1, on_done=lambda out, err: left.release())) for p in prompts]
    eng.start()  # all four are queued before the loop runs: admitted together
    try:
        for _ in prompts:
            assert left.acquire(timeout=600)
        assert eng.stats["forward_passes"] == 1 and eng.stats["batched_rows"] == 4  # one padded prefill
    finally:
        eng.stop()
    first = [r.out for r in reqs]
    for p, tok in zip(prompts, first):  # each equals the plain model on that prompt alone
        with torch.no_grad():
            assert tok == [int(loaded.model(torch.tensor([p]))[0, -1].argmax())]


def test_read_timeout_must_be_positive() -> None:
    from xirang_hpc.config.errors import ConfigError

    for bad in (0.0, -1.0):
        with pytest.raises(ConfigError, match="serve.read_timeout_s"):
            ServeConfig(read_timeout_s=bad)
