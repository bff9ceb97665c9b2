"""Accelerators: train.compile (its cache and its start-up probe) and train.optimizer_impl.

The layout matrix (tests/test_parallel_matrix.py) checks compiled blocks and the foreach/fused AdamW in
DDP, FSDP2, TP and PP against the eager single process; here: the cache directory, the refusals, the
single-process optimizer kernels, and that a second process reuses the first one's compiled kernels.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import parallel_harness as H
import pytest
import torch

from xirang_hpc.config.errors import ConfigError
from xirang_hpc.runtime import compile as C
from xirang_hpc.runtime.data_parallel import adamw_impl, split_dtensor_groups
from xirang_hpc.runtime.trainer import Trainer

ROOT = Path(__file__).resolve().parents[1]


def test_cache_goes_to_a_private_directory_under_the_users_cache(tmp_path: Path) -> None:
    env = {"XDG_CACHE_HOME": str(tmp_path / "xdg")}
    dirs = C.configure_cache(env)
    assert dirs == {"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "xdg/xirang-hpc/inductor"),
                    "TRITON_CACHE_DIR": str(tmp_path / "xdg/xirang-hpc/triton")}
    assert env["TORCHINDUCTOR_CACHE_DIR"] == dirs["TORCHINDUCTOR_CACHE_DIR"]
    for d in (tmp_path / "xdg/xirang-hpc", *map(Path, dirs.values())):
        assert stat.S_IMODE(d.stat().st_mode) == 0o700, d


def test_cache_without_xdg_is_under_home_and_torchs_own_tmp_default_is_replaced(tmp_path: Path) -> None:
    # Importing torch._dynamo writes Inductor's node-local /tmp default into the environment: not the user's choice.
    env = {"HOME": str(tmp_path), "TORCHINDUCTOR_CACHE_DIR": C._torch_default_cache()}
    C.configure_cache(env)
    assert env["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / ".cache/xirang-hpc/inductor")


def test_cache_directories_set_by_the_user_are_kept(tmp_path: Path) -> None:
    env = {"XDG_CACHE_HOME": str(tmp_path), "TORCHINDUCTOR_CACHE_DIR": "/site/inductor",
           "TRITON_CACHE_DIR": "/site/triton"}
    assert C.configure_cache(env) == {"TORCHINDUCTOR_CACHE_DIR": "/site/inductor", "TRITON_CACHE_DIR": "/site/triton"}
    assert not (tmp_path / "xirang-hpc").exists()


@pytest.fixture
def no_cxx(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[None]:
    """A CPU node without a C++ compiler (and a fresh cache, so nothing compiled earlier can stand in)."""
    from torch._inductor import config

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    with config.patch({"cpp.cxx": (None, str(tmp_path / "no-such-g++"))}):
        yield


def test_no_cpp_compiler_is_refused_in_one_line_naming_train_compile(no_cxx: None) -> None:
    with pytest.raises(ConfigError) as err:
        C.probe(torch.device("cpu"))
    msg = str(err.value)
    assert msg.startswith("invalid config train.compile=True") and "\n" not in msg
    assert "C++ compiler" in msg and "train.compile=false" in msg


def test_trainer_refuses_compile_before_building_the_model(no_cxx: None, email_data: Path, tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    from xirang_hpc.runtime import parallelize as P

    built: list[int] = []
    monkeypatch.setattr(P, "GPT", lambda *a, **k: built.append(1))
    cfg = H.make_cfg(1, {}, train={"compile": True})
    with pytest.raises(ConfigError, match="train.compile"):
        Trainer(cfg, H.topology(0, 1, 0), tmp_path, email_data, log=lambda s: None)
    assert built == [], "refused before any model is built"


def test_a_rank_s_config_refusal_is_shown_as_its_one_line() -> None:
    from xirang_hpc.cli.train import config_refusal

    err = ConfigError("train.compile", True, "torch.compile cannot build kernels for cpu on this node; ...")
    trace = f"Traceback (most recent call last):\n  File ...\n{type(err).__module__}.ConfigError: {err}\n"
    assert config_refusal(trace) == str(err)
    assert config_refusal("Traceback ...\nRuntimeError: boom\n") is None




def test_compile_of_mixture_of_experts_models_refuses_selective_recompute_by_name() -> None:
    moe = {"mlp": "swiglu", "moe_experts": 4}
    with pytest.raises(ConfigError, match="train.compile.*parallel.recompute=selective"):
        H.make_cfg(1, {"recompute": "selective"}, model=moe, train={"compile": True})
    for recompute in ("none", "full"):  # compiled around the routing (the layout matrix runs them)
        assert H.make_cfg(1, {"recompute": recompute}, model=moe, train={"compile": True}).train.compile
    assert H.make_cfg(1, {"recompute": "selective"}, model=moe).parallel.recompute == "selective"  # eager


def test_optimizer_impl_keywords_and_the_fused_refusal() -> None:
    assert adamw_impl("auto", "cpu") == {}
    assert adamw_impl("foreach", "cpu") == {"foreach": True}
    assert adamw_impl("fused", "cpu") == {"fused": True}  # torch has a fused CPU AdamW
    with pytest.raises(ConfigError) as err:
        adamw_impl("fused", "lazy")  # a device type torch has no fused kernel for
    assert "train.optimizer_impl" in str(err.value) and "foreach" in str(err.value)
    with pytest.raises(ConfigError, match="train.optimizer_impl"):
        H.make_cfg(1, {}, train={"optimizer_impl": "apex"})


def test_dtensor_and_plain_parameters_go_to_separate_groups() -> None:
    from torch.distributed.tensor import DTensor

    class Fake(DTensor):  # isinstance is all the split looks at
        def __new__(cls) -> Fake:
            return torch.Tensor._make_subclass(cls, torch.zeros(1))  # type: ignore[return-value]

    a, b, d = torch.zeros(2), torch.zeros(3), Fake()
    groups = [{"params": [a, d, b], "weight_decay": 0.1}, {"params": [a], "weight_decay": 0.0}]
    out = split_dtensor_groups(groups)
    assert [[id(p) for p in g["params"]] for g in out] == [[id(d)], [id(a), id(b)], [id(a)]]
    assert [g["weight_decay"] for g in out] == [0.1, 0.1, 0.0]
    assert [g["origin_group"] for g in out] == [0, 0, 1]


def test_a_checkpoint_s_groups_fit_a_split_or_unsplit_optimizer_and_never_set_its_kernel() -> None:
    """Resuming with another train.optimizer_impl: the groups match through origin_group, the saved
    hyperparameters apply, the saved foreach/fused flags do not."""
    from xirang_hpc.checkpoint.state import _merge_groups

    plain = [{"params": [0, 1], "lr": 1.0, "weight_decay": 0.1, "fused": None, "foreach": None},
             {"params": [2], "lr": 1.0, "weight_decay": 0.0, "fused": None, "foreach": None}]
    split = [{"params": [0], "lr": 2.0, "weight_decay": 0.1, "fused": True, "foreach": None, "origin_group": 0},
             {"params": [1], "lr": 2.0, "weight_decay": 0.1, "fused": True, "foreach": None, "origin_group": 0},
             {"params": [2], "lr": 2.0, "weight_decay": 0.0, "fused": True, "foreach": None, "origin_group": 1}]
    saved_plain = [{**g, "lr": 0.5, "params": []} for g in plain]
    got = _merge_groups(saved_plain, split)  # an auto run resumed fused under tensor parallelism
    assert [g["params"] for g in got] == [[0], [1], [2]] and [g["lr"] for g in got] == [0.5] * 3
    assert [g["fused"] for g in got] == [True] * 3 and [g["weight_decay"] for g in got] == [0.1, 0.1, 0.0]
    got = _merge_groups([{**g, "lr": 0.25} for g in split], plain)  # and back
    assert [g["lr"] for g in got] == [0.25, 0.25] and [g["fused"] for g in got] == [None, None]
    with pytest.raises(ValueError, match="param groups"):
        _merge_groups(saved_plain[:1], plain)


def _run(email_data: Path, tmp_path: Path, impl: str, steps: int = 4) -> tuple[list[float], dict, Trainer]:
    cfg = H.make_cfg(1, {}, steps=steps, train={"optimizer_impl": impl})
    tr = Trainer(cfg, H.topology(0, 1, 0), tmp_path / impl, email_data, log=lambda s: None)
    losses = [tr.train_step(s)[0] for s in range(steps)]
    return losses, {n: p.detach().clone() for n, p in tr.model.named_parameters()}, tr


@pytest.mark.parametrize("impl", ["foreach", "fused"])
def test_optimizer_impl_trains_like_the_default(impl: str, email_data: Path, tmp_path: Path) -> None:
    want, want_params, _ = _run(email_data, tmp_path, "auto")
    got, got_params, tr = _run(email_data, tmp_path, impl)
    assert tr.opt.defaults[impl] is True and not tr.opt.defaults["foreach" if impl == "fused" else "fused"]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=0)
    for name, p in want_params.items():
        np.testing.assert_allclose(got_params[name].numpy(), p.numpy(), rtol=0, atol=1e-5, err_msg=name)


_CHILD = """
import json, sys
sys.path.insert(0, {tests!r})
from pathlib import Path
from torch._dynamo.utils import counters
import parallel_harness as H
r = H.reference(Path({data!r}), steps=2, train={{"compile": True}})
ind = counters["inductor"]
print("RESULT", json.dumps({{"losses": r["losses"], "graphs": r["graphs"], "hits": ind["fxgraph_cache_hit"],
                           "misses": ind["fxgraph_cache_miss"]}}))
"""


@pytest.mark.slow
def test_a_restart_reuses_the_first_starts_compiled_kernels(email_data: Path, tmp_path: Path) -> None:
    """Two fresh processes with the same user cache: the first compiles (cache misses, files in
    $XDG_CACHE_HOME/xirang-hpc/inductor), the second loads every graph from there (hits, no misses)."""
    env = {k: v for k, v in os.environ.items() if k not in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")}
    env["XDG_CACHE_HOME"] = str(tmp_path / "xdg")
    code = _CHILD.format(tests=str(ROOT / "tests"), data=str(email_data))
    runs = []
    for _ in range(2):
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600,
                             cwd=tmp_path)
        assert out.returncode == 0, out.stderr[-3000:]
        runs.append(json.loads(out.stdout.split("RESULT ", 1)[1]))
    cold, warm = runs
    assert cold["graphs"] > 0 and cold["misses"] > 0
    assert warm["misses"] == 0 and warm["hits"] >= cold["misses"], (cold, warm)
    assert warm["losses"] == cold["losses"]
    cache = tmp_path / "xdg/xirang-hpc/inductor"
    assert any(cache.rglob("*.so")), "compiled kernels are in the user's cache"
    assert stat.S_IMODE(cache.stat().st_mode) == 0o700


@pytest.mark.slow
def test_the_compiled_loss_equals_the_eager_one_and_a_new_denominator_compiles_nothing(tmp_path: Path,
                                                                                      monkeypatch) -> None:
    """train.compile compiles the loss too: the plain cross-entropy and the chunked head's per-chunk step give the
    eager values and gradients (masked targets, the last chunk shorter), and a denominator that changes every step
    (chat data) reuses the compiled graphs instead of compiling one per step."""
    from torch._dynamo.utils import counters

    from xirang_hpc.config.schema import ModelConfig
    from xirang_hpc.models.gpt import GPT
    from xirang_hpc.models.loss import IGNORE_INDEX, chunked_lm_loss

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    cfg = ModelConfig(n_layer=1, n_head=2, d_model=16, d_ff=32, vocab_size=64, seq_len=12)
    model = GPT(cfg, seed=0)
    C.apply_compile(model)
    assert model.loss_kernel is not None and model.loss_fn is not lm_loss_eager()
    g = torch.Generator().manual_seed(0)
    y = torch.randint(0, 64, (3, 7), generator=g)
    y[0, :4] = IGNORE_INDEX  # a prompt's targets: learned by neither path
    graphs = None
    for denom in (11.0, 13.0, 17.0):  # one new value per step
        h = torch.randn(3, 7, 16, generator=g, requires_grad=True)  # (B, T, C)
        w = torch.randn(64, 16, generator=g, requires_grad=True)  # (V, C)
        want = chunked_lm_loss(h, w, y, 5, denom)
        gh, gw = torch.autograd.grad(want, (h, w))
        got = chunked_lm_loss(h, w, y, 5, denom, model.loss_kernel)
        ch, cw = torch.autograd.grad(got, (h, w))
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(ch, gh, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(cw, gw, rtol=1e-5, atol=1e-6)
        logits = torch.randn(3, 7, 64, generator=g, requires_grad=True)
        torch.testing.assert_close(model.loss_fn(logits, y, denom), lm_loss_eager()(logits, y, denom),
                                   rtol=1e-5, atol=1e-6)
        if graphs is None:  # after the first step: every shape (full and short chunk) is compiled
            graphs = counters["stats"]["unique_graphs"]
            assert graphs > 0
    assert counters["stats"]["unique_graphs"] == graphs, "a new denominator compiled new graphs"


def lm_loss_eager():  # noqa: ANN201 - the eager plain loss, imported late (the module under test imports it too)
    from xirang_hpc.models.gpt import lm_loss

    return lm_loss
