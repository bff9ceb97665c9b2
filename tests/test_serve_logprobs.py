"""``/v1/completions`` as evaluation harnesses use it, through the official ``openai`` client: batches of prompts
(token ids or text), ``echo``, legacy ``logprobs`` (token_logprobs, top_logprobs, tokens, text_offset),
``max_tokens`` 0 and 1; and the served tokenizer (``/tokenize``, ``/detokenize``, ``/tokenizer_info``).

Log-probabilities are checked against the model's own forward (log-softmax of its logits, computed here),
generated tokens against ``/v1/generate``'s greedy decoding, batches against the same prompts sent alone.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import openai
import pytest
import torch
from test_serve_api import _loaded
from test_serve_openai import MODEL, TOK, Served, served

PROMPTS = [[104, 105, 33, 10, 32], [100, 101, 102], list(range(60, 80))]


@pytest.fixture(scope="module")
def srv() -> Iterator[Served]:
    with served() as s:
        yield s


def reference(ids: list[int]) -> torch.Tensor:
    """log p(next token) at every position of ``ids``, from the model's forward alone: (len, vocab)."""
    model = _loaded().model
    with torch.inference_mode():
        return torch.log_softmax(model(torch.tensor([ids])).float(), dim=-1)[0]


def post(url: str, body: dict[str, Any], token: str | None = None) -> tuple[int, Any]:
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {token}"} if token else {})}
    req = urllib.request.Request(url, json.dumps(body).encode(), headers)
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_echo_logprobs_of_a_batch_equal_the_models_own_forward(srv: Served) -> None:
    r = srv.client().completions.create(model=MODEL, prompt=PROMPTS, max_tokens=1, temperature=0, logprobs=3,
                                        echo=True)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert r.usage.prompt_tokens == sum(map(len, PROMPTS)) and r.usage.completion_tokens == 3
    for ids, c in zip(PROMPTS, r.choices, strict=True):
        ref = reference(ids)
        greedy = int(ref[-1].argmax())
        lp = c.logprobs
        full = ids + [greedy]
        assert lp.tokens == [TOK.decode([t]) for t in full]
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        want = [float(ref[i - 1, full[i]]) for i in range(1, len(full))]
        assert lp.token_logprobs[1:] == pytest.approx(want, abs=1e-5)
        assert lp.text_offset == [len(TOK.decode(full[:i])) for i in range(len(full))]
        assert c.text == TOK.decode(full)  # the echoed prompt, then the greedy token
        for i in range(1, len(full)):
            top = lp.top_logprobs[i]
            best = ref[i - 1].topk(3)
            assert 1 <= len(top) <= 3
            assert max(top.values()) == pytest.approx(float(best.values[0]), abs=1e-5)
            assert TOK.decode([int(best.indices[0])]) in top
        # What lm-evaluation-harness reads as is_greedy: the last token is the model's argmax.
        assert lp.token_logprobs[-1] == max(lp.top_logprobs[-1].values())


def test_the_greedy_token_equals_generate_and_a_batch_equals_its_prompts_alone(srv: Served) -> None:
    client = srv.client()
    texts = ["def f(x):", "import os\n", "hello"]
    batch = client.completions.create(model=MODEL, prompt=texts, max_tokens=7, temperature=0)
    for i, t in enumerate(texts):
        alone = client.completions.create(model=MODEL, prompt=t, max_tokens=7, temperature=0).choices[0].text
        assert batch.choices[i].text == alone
        _, gen = post(f"{srv.url}/v1/generate", {"prompt": t, "max_tokens": 1})
        one = client.completions.create(model=MODEL, prompt=t, max_tokens=1, temperature=0, logprobs=1)
        assert one.choices[0].text == gen["text"]  # the scoring forward's argmax is the engine's greedy token


def test_logprobs_of_generated_tokens_without_echo(srv: Served) -> None:
    ids = PROMPTS[0]
    c = srv.client().completions.create(model=MODEL, prompt=ids, max_tokens=5, temperature=0,
                                        logprobs=1).choices[0]
    out: list[int] = []
    for _ in range(5):  # greedy decoding by the model's forward alone
        out.append(int(reference(ids + out)[-1].argmax()))
    assert c.text == TOK.decode(out)
    ref = reference(ids + out)
    assert c.logprobs.tokens == [TOK.decode([t]) for t in out]
    assert c.logprobs.token_logprobs == pytest.approx([float(ref[len(ids) + i - 1, t]) for i, t in enumerate(out)],
                                                      abs=1e-5)
    assert c.logprobs.text_offset[0] == len(TOK.decode(ids))  # offsets into prompt + completion, as OpenAI's


def test_max_tokens_zero_with_echo_scores_the_prompt_alone(srv: Served) -> None:
    before = srv.running.engine.stats["requests"]
    r = srv.client().completions.create(model=MODEL, prompt="abc", max_tokens=0, echo=True, logprobs=0)
    c = r.choices[0]
    assert c.text == "abc" and r.usage.completion_tokens == 0 and c.finish_reason == "length"
    ref = reference([97, 98, 99])
    assert c.logprobs.token_logprobs[1:] == pytest.approx([float(ref[0, 98]), float(ref[1, 99])], abs=1e-5)
    assert c.logprobs.top_logprobs[1:] == [{}, {}]
    echo_only = srv.client().completions.create(model=MODEL, prompt=["ab", "cd"], max_tokens=0, echo=True)
    assert [x.text for x in echo_only.choices] == ["ab", "cd"] and echo_only.choices[0].logprobs is None
    assert srv.running.engine.stats["requests"] == before  # scoring needs no generation loop


def test_scoring_longer_than_the_context_is_refused(srv: Served) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        srv.client().completions.create(model=MODEL, prompt=list(range(30)), max_tokens=5, logprobs=1)
    assert e.value.code == "context_length_exceeded" and "context of 32 tokens" in e.value.message


def test_the_served_tokenizer_round_trips_and_needs_the_key() -> None:
    with served(token="s3cret") as s:
        assert post(f"{s.url}/tokenize", {"prompt": "héllo"})[0] == 401
        status, t = post(f"{s.url}/tokenize", {"prompt": "héllo", "add_special_tokens": False}, "s3cret")
        assert status == 200 and t["tokens"] == [int(x) for x in TOK.encode("héllo")] and t["count"] == 6
        status, d = post(f"{s.url}/detokenize", {"tokens": t["tokens"]}, "s3cret")
        assert status == 200 and d["prompt"] == "héllo"
        status, err = post(f"{s.url}/detokenize", {"tokens": [1, 999]}, "s3cret")
        assert status == 400 and err["error"]["param"] == "tokens"
        req = urllib.request.Request(f"{s.url}/tokenizer_info", headers={"Authorization": "Bearer s3cret"})
        with urllib.request.urlopen(req, timeout=60) as r:
            info = json.loads(r.read())
        assert "eos_token" in info and info["eos_token"] is None and info["max_model_len"] == 32


def test_lm_evals_local_completions_model_scores_and_generates_through_the_server(srv: Served) -> None:
    """lm_eval's own ``local-completions`` client (remote tokenizer, batches of 3): log-likelihoods equal the
    model's forward, is_greedy agrees with the argmax, and generate_until equals the greedy decoding."""
    from lm_eval.api.instance import Instance
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    lm = LocalCompletionsAPI(base_url=f"{srv.url}/v1/completions", model=MODEL, tokenizer_backend="remote",
                             max_length=32, batch_size=3, max_retries=1)
    pairs = [("def f(x):", " return"), ("import o", "s"), ("hello", " world"), ("ab", "c")]
    reqs = [Instance("loglikelihood", {}, pair, i) for i, pair in enumerate(pairs)]
    got = lm.loglikelihood(reqs, disable_tqdm=True)
    for (ctx, cont), (ll, greedy) in zip(pairs, got, strict=True):
        c, k = [int(t) for t in TOK.encode(ctx)], [int(t) for t in TOK.encode(cont)]
        ref = reference(c + k)
        rows = ref[len(c) - 1: len(c) + len(k) - 1]
        assert ll == pytest.approx(sum(float(rows[i, t]) for i, t in enumerate(k)), abs=1e-4)
        assert greedy == all(int(rows[i].argmax()) == t for i, t in enumerate(k))
    gen = lm.generate_until([Instance("generate_until", {}, ("def f(x):", {"until": ["\n"], "max_gen_toks": 6}), 0)],
                            disable_tqdm=True)
    ids = [int(t) for t in TOK.encode("def f(x):")]
    out: list[int] = []
    for _ in range(6):
        out.append(int(reference(ids + out)[-1].argmax()))
    assert gen == [TOK.decode(out).split("\n")[0]]
