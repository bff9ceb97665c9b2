"""The one device decision (runtime/device.py): what each rank computes on, and everything taking it from there."""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from xirang_hpc.config.errors import ConfigError
from xirang_hpc.runtime.device import Device, decide
from xirang_hpc.runtime.dist import pick_backend
from xirang_hpc.runtime.parallel_dims import Layout
from xirang_hpc.runtime.precision import resolve
from xirang_hpc.runtime.topology import Topology

ROOT = Path(__file__).resolve().parents[1]


def fake_accelerator(kind: str | None, count: int = 1) -> SimpleNamespace:
    """A stand-in for ``torch.accelerator``: ``kind`` devices (None: no accelerator)."""
    return SimpleNamespace(is_available=lambda: kind is not None,
                           current_accelerator=lambda: torch.device(kind) if kind else None,
                           device_count=lambda: count)


def test_auto_takes_the_accelerator_torch_finds_else_the_cpu() -> None:
    assert decide("auto", 0, accel=fake_accelerator(None)) == Device("cpu")
    assert decide("auto", 5, accel=fake_accelerator("cuda", 4)) == Device("cuda", 1)  # local rank 5 of 4 GPUs
    assert decide("auto", 2, accel=fake_accelerator("xpu", 8)) == Device("xpu", 2)
    assert decide("auto", 0, backend="gloo", accel=fake_accelerator("cuda", 4)) == Device("cpu")  # gloo: CPU
    assert decide("cpu", 3, accel=fake_accelerator("cuda", 4)) == Device("cpu")
    assert decide("cuda", 3, accel=fake_accelerator("cuda", 2)) == Device("cuda", 1)


def test_a_device_that_is_not_there_is_refused_by_name() -> None:
    with pytest.raises(ConfigError, match=r"cluster.device.*this node has no accelerator; use cluster.device=auto"):
        decide("cuda", 0, accel=fake_accelerator(None))
    with pytest.raises(ConfigError, match=r"serve.device.*this node has cuda"):
        decide("npu", 0, accel=fake_accelerator("cuda"), field="serve.device")
    with pytest.raises(ConfigError, match="cluster.device"):
        decide("CUDA:0", 0, accel=fake_accelerator("cuda"))


def test_the_backend_follows_the_device() -> None:
    assert Device("cpu").backend() == "gloo"
    # An accelerator's group has gloo beside its collective library, for CPU-side collectives.
    assert Device("cuda", 0).backend() == "cpu:gloo,cuda:nccl"
    assert Device("xpu", 0).backend() == "cpu:gloo,xpu:xccl"
    assert Device("cuda", 0).backend("gloo") == "gloo"
    with pytest.raises(ConfigError, match=r"cluster.backend.*needs an accelerator"):
        Device("cpu").backend("nccl")
    with pytest.raises(ConfigError, match=r"cluster.device.*no distributed backend for device type 'abacus'"):
        Device("abacus", 0).backend()
    assert pick_backend("auto", "cpu") == "gloo" and pick_backend("auto", "cuda:3") == "cpu:gloo,cuda:nccl"


def test_parse_and_print_round_trip() -> None:
    for text in ("cpu", "cuda:0", "xpu:7", "npu:1"):
        assert str(Device.parse(text)) == text
    assert Device.parse("cuda:2").torch == torch.device("cuda", 2) and not Device("cpu").is_accelerator


def test_the_layout_carries_the_rank_s_device_and_precision_follows_it() -> None:
    from xirang_hpc.config.schema import ParallelConfig

    topo = Topology(rank=0, world_size=1, local_rank=0, local_world_size=1, node_id=0, num_nodes=1,
                    node_name="n0", master_addr="127.0.0.1", master_port=29500, job_id="t", source="single",
                    device="cuda:1")
    layout = Layout.for_job(ParallelConfig(dp=1, tp=1, pp=1, microbatches=1), topo)
    assert layout.device == Device("cuda", 1) and layout.device.torch == torch.device("cuda", 1)
    assert resolve("auto", layout.device.torch) == "bf16" and resolve("auto", torch.device("cpu")) == "fp32"
    assert resolve("auto", Device("xpu", 0).torch) == "bf16"


def test_serving_and_eval_place_the_model_by_the_same_decision() -> None:
    from xirang_hpc.config.schema import ModelConfig
    from xirang_hpc.models.gpt import GPT
    from xirang_hpc.serve.engine import Engine
    from xirang_hpc.weights.load import LoadedModel

    cfg = ModelConfig(name="t", n_layer=1, n_head=2, d_model=16, d_ff=32, seq_len=16)
    loaded = LoadedModel(model=GPT(cfg), cfg=cfg, source="test")
    assert loaded.place("auto") == decide("auto")
    assert loaded.place("cpu") == Device("cpu") and next(loaded.model.parameters()).device.type == "cpu"
    if not torch.accelerator.is_available():
        with pytest.raises(ConfigError, match=r"eval.device.*no accelerator"):
            loaded.place("cuda", field="eval.device")
    engine = Engine(loaded.model, cfg.seq_len, max_batch=2)
    assert engine.device == next(loaded.model.parameters()).device and engine.cache is not None
    assert engine.cache.device == engine.device


# Where an accelerator may be named: the device module; the environment record (CUDA/cuDNN/NCCL versions);
# the fork server (a process that initialised CUDA cannot fork ranks that use it).
ALLOWED = {"xirang_hpc/runtime/device.py", "xirang_hpc/monitor/environment.py", "xirang_hpc/local/preload.py",
           "xirang_hpc/config/schema/cluster.py"}  # (and the config field's list of valid backends)
NAMED = re.compile(r"torch\.cuda\b|[\"']cuda[\"']|\.cuda\(|[\"']nccl[\"']")


def test_no_device_type_is_named_outside_the_device_module() -> None:
    """Every consumer takes the device from the one decision: no module picks CUDA (or nccl) by itself."""
    found = []
    for path in sorted((ROOT / "xirang_hpc").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel in ALLOWED:
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if NAMED.search(line.split("#", 1)[0]):
                found.append(f"{rel}:{n}: {line.strip()}")
    assert not found, "device types named outside runtime/device.py:\n" + "\n".join(found)
