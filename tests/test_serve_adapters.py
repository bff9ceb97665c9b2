"""Several LoRA adapters served over one base model, the request's ``model`` field choosing: checked against peft.

A tiny Llama is built with transformers (``save_pretrained``, nothing downloaded) and two LoRA adapters of
different ranks and targets are made on it with peft itself. ``xirang-serve BASE --adapter a1=DIR
--adapter a2=DIR`` (here ``start_server`` with ``serve.adapters``, as the command does) answers the official
openai client with, for each model id, the greedy text transformers' ``generate`` gives for the base and for
``PeftModel.from_pretrained(base, adapter)``; the same holds when requests of all three share one batch of the
engine, and for the log-probabilities of ``echo``/``logprobs`` scoring.
"""

from __future__ import annotations

import json
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
import torch
from test_lora_run import make_llama
from test_serve_openai import Served

from xirang_hpc.data.tokenizer import ByteTokenizer
from xirang_hpc.serve.engine import GenRequest
from xirang_hpc.weights.errors import WeightsError
from xirang_hpc.weights.load import load_hf

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
TOK = ByteTokenizer()
BASE = "base"
PROMPTS = ["def f(x):", "hello world", "import os"]
NEW = 12


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The base directory and two adapters peft made on it (random, non-zero B: each changes the output)."""
    root = tmp_path_factory.mktemp("adapters")
    make_llama(root / "base")
    out = {"base": root / "base"}
    for name, seed, cfg in (
            ("a1", 1, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)),
            ("a2", 2, peft.LoraConfig(r=2, lora_alpha=6, target_modules=["q_proj", "k_proj", "o_proj", "down_proj"],
                                      init_lora_weights=False))):
        torch.manual_seed(seed)
        base = transformers.LlamaForCausalLM.from_pretrained(out["base"], dtype=torch.float32)
        tuned = peft.get_peft_model(base, cfg)
        with torch.no_grad():  # peft's random B is tiny; a larger one makes each adapter's greedy text its own
            for n, p in tuned.named_parameters():
                if "lora_B" in n:
                    p.mul_(40.0)
        tuned.save_pretrained(root / name)
        out[name] = root / name
    return out


def _reference(dirs: dict[str, Path], model: str) -> torch.nn.Module:
    base = transformers.LlamaForCausalLM.from_pretrained(dirs["base"], dtype=torch.float32)
    return (base if model == BASE else peft.PeftModel.from_pretrained(base, dirs[model])).eval()


def _greedy(ref: torch.nn.Module, prompt: str) -> list[int]:
    ids = torch.tensor([[int(t) for t in TOK.encode(prompt)]])
    with torch.no_grad():
        out = ref.generate(ids, max_new_tokens=NEW, do_sample=False, attention_mask=torch.ones_like(ids))
    return [int(t) for t in out[0, ids.shape[1]:]]


@pytest.fixture(scope="module")
def expected(dirs: dict[str, Path]) -> dict[tuple[str, str], list[int]]:
    refs = {m: _reference(dirs, m) for m in (BASE, "a1", "a2")}
    return {(m, p): _greedy(refs[m], p) for m in refs for p in PROMPTS}


@pytest.fixture(scope="module")
def srv(dirs: dict[str, Path]) -> Iterator[Served]:
    s = Served(loaded=load_hf(dirs["base"]), tokenizer=TOK, model_name=BASE, max_new_tokens=NEW,
               adapters={"a1": str(dirs["a1"]), "a2": str(dirs["a2"])})
    try:
        yield s
    finally:
        s.close()


def test_each_model_id_answers_with_its_adapter_as_peft_does(srv: Served, expected: dict) -> None:
    client = srv.client()
    assert sorted(m.id for m in client.models.list().data) == ["a1", "a2", BASE]
    for (model, prompt), want in expected.items():
        c = client.completions.create(model=model, prompt=prompt, max_tokens=NEW, temperature=0)
        assert c.model == model
        assert c.choices[0].text == TOK.decode(want), (model, prompt)
    assert len({tuple(expected[(m, PROMPTS[0])]) for m in (BASE, "a1", "a2")}) == 3  # three different models


def test_requests_of_different_adapters_share_one_batch(srv: Served, expected: dict) -> None:
    """Queued before the engine's next admission, the nine requests are decoded together, each row with its
    own adapter (or none), and each gets its own model's tokens."""
    engine = srv.running.engine
    index = {BASE: 0, "a1": 1, "a2": 2}
    done = threading.Event()
    results: dict[tuple[str, str], list[int]] = {}
    lock = threading.Lock()

    def finisher(key: tuple[str, str]):  # noqa: ANN202 - a callback
        def fn(tokens: list[int], err: BaseException | None) -> None:
            with lock:
                results[key] = tokens if err is None else [-1]
                if len(results) == len(expected):
                    done.set()
        return fn

    seen = engine.stats["max_batch_seen"]
    engine.stop()  # stopped: the requests wait in its queue and are admitted together when it starts again
    for key in expected:
        model, prompt = key
        engine.submit(GenRequest([int(t) for t in TOK.encode(prompt)], NEW, adapter=index[model],
                                 on_done=finisher(key)))
    engine.start()
    assert done.wait(600)
    assert results == expected
    assert engine.stats["max_batch_seen"] >= max(seen, min(len(expected), engine.max_batch))


def test_scoring_uses_the_adapter_of_the_request(srv: Served, dirs: dict[str, Path]) -> None:
    """``echo`` + ``logprobs`` (what lm-evaluation-harness sends) score the prompt under the requested adapter."""
    ids = [int(t) for t in TOK.encode("def f(x): return x")]
    ref = _reference(dirs, "a2")
    with torch.no_grad():
        logp = torch.log_softmax(ref(torch.tensor([ids])).logits[0].float(), dim=-1)
    want = [logp[i - 1, ids[i]].item() for i in range(1, len(ids))]
    c = srv.client().completions.create(model="a2", prompt=ids, max_tokens=0, echo=True, logprobs=0)
    got = c.choices[0].logprobs.token_logprobs
    assert got[0] is None and max(abs(a - b) for a, b in zip(got[1:], want, strict=True)) <= 1e-4
    base = srv.client().completions.create(model=BASE, prompt=ids, max_tokens=0, echo=True, logprobs=0)
    assert max(abs(a - b) for a, b in zip(base.choices[0].logprobs.token_logprobs[1:], want, strict=True)) > 1e-3


def test_an_unknown_model_names_the_served_ones(srv: Served) -> None:
    with pytest.raises(openai.NotFoundError) as err:
        srv.client().completions.create(model="a3", prompt="x", max_tokens=1)
    assert "'a3' does not exist here" in str(err.value) and "'a1'" in str(err.value) and "'a2'" in str(err.value)


def test_an_adapter_that_does_not_fit_the_base_is_refused_by_name(dirs: dict[str, Path], tmp_path: Path) -> None:
    from xirang_hpc.config.errors import ConfigError
    from xirang_hpc.config.schema import ServeConfig
    from xirang_hpc.serve.adapters import attach_adapters

    other = tmp_path / "other"
    shutil.copytree(dirs["a1"], other)
    cfg = json.loads((other / "adapter_config.json").read_text())
    (other / "adapter_config.json").write_text(json.dumps({**cfg, "r": 8}))  # says rank 8, holds rank 4
    loaded = load_hf(dirs["base"])
    before = {n: p.detach().clone() for n, p in loaded.model.named_parameters()}
    with pytest.raises(WeightsError, match=r"serve.adapters.bad .*lora_A.weight has shape \(4, 64\), this model "
                                           r"needs \(8, 64\)"):
        attach_adapters(loaded.model, loaded.cfg, {"a1": str(dirs["a1"]), "bad": str(other)})
    assert all(torch.equal(before[n], p) for n, p in loaded.model.named_parameters())
    assert not any("MultiLoRA" in type(m).__name__ for m in loaded.model.modules())
    with pytest.raises(ConfigError, match=r"serve.adapters.x.*PEFT adapter directory"):
        ServeConfig(adapters={"x": str(tmp_path)})
