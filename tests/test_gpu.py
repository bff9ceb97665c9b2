"""The GPU path: nccl, bf16 autocast, flash attention, NVML in xirang-status. Skipped without CUDA.

Run by ``benchmarks/gpu_check.sh`` on a GPU machine (``pytest -m gpu``); on CPU-only machines every
test here is skipped with the reason.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (torch.cuda.is_available() is False)"),
]
ROOT = Path(__file__).resolve().parents[1]


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    return env


def test_flash_attention_kernel_accepts_our_attention() -> None:
    """SDPA restricted to the flash backend runs our (grouped-query) attention in bf16: no math fallback."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from xirang_hpc.config.schema import ModelConfig
    from xirang_hpc.models.gpt import GPT

    cfg = ModelConfig(name="t", n_layer=2, n_head=8, n_kv_head=2, d_model=512, d_ff=1024, seq_len=256,
                      norm="rmsnorm", mlp="swiglu", pos="rope", bias=False)
    model = GPT(cfg).cuda()
    x = torch.randint(0, 256, (2, 256), device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        ref = model(x).float()
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):  # raises if flash cannot take the call
            out = model(x).float()
        with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION]):
            eff = model(x).float()
    torch.testing.assert_close(out, ref, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(eff, ref, rtol=2e-2, atol=2e-2)


def test_nccl_bf16_training_run_with_nvml_status(tmp_path: Path) -> None:
    """A real xirang-train job on one GPU: nccl, precision=auto -> bf16, loss falls, NVML figures in status."""
    runs = tmp_path / "runs"
    cmd = [sys.executable, "-m", "xirang_hpc.cli.train", "model=tiny-gqa", "cluster.nodes=1",
           "cluster.tasks_per_node=1", "cluster.gpus_per_node=1", "cluster.backend=nccl", "parallel.pp=1",
           "train.max_steps=40", "train.global_batch=16", "train.warmup_steps=5", "train.log_every=5",
           "checkpoint.every_steps=20", f"train.runs_root={runs}", f"data.out_dir={tmp_path / 'data'}",
           f"data.corpus={_stdlib_email()}"]
    res = subprocess.run(cmd, cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    run = next(p for p in runs.iterdir() if (p / "metrics.jsonl").is_file())
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in rows if "loss" in r]
    assert losses and all(map(lambda v: v == v, losses)) and losses[-1] < losses[0]
    text = res.stdout + res.stderr
    assert "nccl" in text and "bf16" in text, "the run log names the backend and the precision it resolved"
    beats = [json.loads(p.read_text()) for p in (run / "heartbeats").glob("rank-*.json")]
    assert beats and "gpu_name" in beats[0] and beats[0]["gpu_mem_mb"] > 0, beats
    st = subprocess.run([sys.executable, "-m", "xirang_hpc.cli.status", str(run)], env=_env(),
                        capture_output=True, text=True, timeout=600)
    assert st.returncode == 0 and beats[0]["gpu_name"] in st.stdout, st.stdout + st.stderr


def _stdlib_email() -> str:
    import sysconfig

    return str(Path(sysconfig.get_paths()["stdlib"]) / "email")


def test_the_device_decision_on_a_gpu() -> None:
    """auto takes CUDA; the backend is nccl with gloo beside it; bf16 resolves on it."""
    from xirang_hpc.runtime.device import Device, decide
    from xirang_hpc.runtime.precision import resolve

    dev = decide("auto", 0)
    assert dev.type == "cuda" and dev.index == 0 and dev.backend() == "cpu:gloo,cuda:nccl"
    assert resolve("auto", dev.torch) == "bf16" and decide("auto", 0, backend="gloo") == Device("cpu")


def test_serving_and_eval_run_on_the_gpu_and_agree_with_the_cpu(tmp_path: Path) -> None:
    """The engine on the GPU (serve.device=auto) generates the CPU's greedy tokens; the KV cache sits on the GPU."""
    from xirang_hpc.config.schema import ModelConfig
    from xirang_hpc.models.gpt import GPT
    from xirang_hpc.serve.engine import Engine
    from xirang_hpc.weights.load import LoadedModel

    torch.manual_seed(0)
    cfg = ModelConfig(name="t", n_layer=2, n_head=4, n_kv_head=2, d_model=64, d_ff=128, seq_len=64,
                      norm="rmsnorm", mlp="swiglu", pos="rope", bias=False)
    cpu = LoadedModel(model=GPT(cfg), cfg=cfg, source="test")
    gpu = LoadedModel(model=GPT(cfg), cfg=cfg, source="test")
    gpu.model.load_state_dict(cpu.model.state_dict())
    assert gpu.place("auto").type == "cuda"
    prompts = [[1, 2, 3, 4], [5, 6, 7]]
    outs = []
    for loaded in (cpu, gpu):
        engine = Engine(loaded.model, cfg.seq_len, max_batch=2).start()
        try:
            outs.append(engine.generate(prompts, 12, temperature=0.0))
        finally:
            engine.stop()
    assert outs[0] == outs[1]
    assert Engine(gpu.model, cfg.seq_len, max_batch=2).cache.k[0].device.type == "cuda"


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs (this machine has fewer)")
def test_two_rank_fsdp_job_on_two_gpus(tmp_path: Path) -> None:
    """A real 2-rank job, one GPU each: nccl, the mesh and FSDP2 on CUDA, loss falls."""
    runs = tmp_path / "runs"
    cmd = [sys.executable, "-m", "xirang_hpc.cli.train", "model=tiny-gqa", "cluster.nodes=1",
           "cluster.tasks_per_node=2", "cluster.gpus_per_node=2", "cluster.backend=auto", "cluster.device=cuda",
           "parallel=fsdp", "parallel.dp=2", "train.max_steps=20", "train.global_batch=16", "train.log_every=5",
           "checkpoint.every_steps=10", f"train.runs_root={runs}", f"data.out_dir={tmp_path / 'data'}",
           f"data.corpus={_stdlib_email()}"]
    res = subprocess.run(cmd, cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    run = next(p for p in runs.iterdir() if (p / "metrics.jsonl").is_file())
    losses = [json.loads(x)["loss"] for x in (run / "metrics.jsonl").read_text().splitlines() if '"loss"' in x]
    assert losses and losses[-1] < losses[0]
    assert "cuda:nccl" in res.stdout + res.stderr


def test_compiled_blocks_and_fused_adamw_on_the_gpu(tmp_path: Path) -> None:
    """train.compile (Triton kernels, the start-up probe on CUDA) and train.optimizer_impl=fused on one GPU:
    the eager, default-AdamW run's losses within 1e-4 (fp32), with compiled graphs made and the fused kernel."""
    sys.path.insert(0, str(ROOT / "tests"))
    import dataclasses

    import parallel_harness as H
    from torch._dynamo.utils import counters

    from xirang_hpc.data.prepare import prepare
    from xirang_hpc.runtime.trainer import Trainer

    data = tmp_path / "data"
    prepare(_stdlib_email(), data, val_fraction=0.2)
    runs = {}
    for name, train in {"eager": {}, "accel": {"compile": True, "optimizer_impl": "fused"}}.items():
        cfg = H.make_cfg(1, {}, steps=6, train={"precision": "fp32", **train})
        cfg = dataclasses.replace(cfg, cluster=dataclasses.replace(cfg.cluster, backend="auto"))
        topo = dataclasses.replace(H.topology(0, 1, 0), device="cuda:0")
        graphs = counters["stats"]["unique_graphs"]
        tr = Trainer(cfg, topo, tmp_path / name, data, log=lambda s: None)
        assert tr.layout.device.type == "cuda"
        runs[name] = [tr.train_step(s)[0] for s in range(6)]
        runs[name + "_graphs"] = counters["stats"]["unique_graphs"] - graphs
        runs[name + "_fused"] = tr.opt.defaults["fused"]
    assert runs["accel_graphs"] > 1 and runs["eager_graphs"] == 0  # the probe's graph, then the blocks'
    assert runs["accel_fused"] is True
    torch.testing.assert_close(runs["accel"], runs["eager"], rtol=1e-4, atol=0)


def test_fp8_training_follows_bf16(tmp_path: Path) -> None:
    """train.precision=fp8 (torchao float8 linears, rowwise scales) on a GPU with float8 matmuls: the linear
    layers are converted (not the head), and 20 steps' losses stay within 5% of the same run in bf16."""
    from xirang_hpc.runtime.device import decide

    dev = decide("auto", 0)
    if not dev.supports_fp8():
        pytest.skip(f"needs compute capability >= 8.9 for float8 matmuls; this GPU is {dev.describe()}")
    pytest.importorskip("torchao.float8", reason="torchao is not installed (pip install 'xirang-hpc[fp8]')")
    sys.path.insert(0, str(ROOT / "tests"))
    import dataclasses

    import parallel_harness as H
    from torchao.float8.float8_linear import Float8Linear

    from xirang_hpc.data.prepare import prepare
    from xirang_hpc.runtime.trainer import Trainer

    data = tmp_path / "data"
    prepare(_stdlib_email(), data, val_fraction=0.2)
    model = {"n_layer": 2, "n_head": 4, "n_kv_head": 2, "d_model": 256, "d_ff": 512, "norm": "rmsnorm",
             "mlp": "swiglu", "pos": "rope", "bias": False}
    losses = {}
    for precision in ("bf16", "fp8"):
        cfg = H.make_cfg(1, {}, steps=20, model=model, train={"precision": precision})
        cfg = dataclasses.replace(cfg, cluster=dataclasses.replace(cfg.cluster, backend="auto"))
        topo = dataclasses.replace(H.topology(0, 1, 0), device="cuda:0")
        tr = Trainer(cfg, topo, tmp_path / precision, data, log=lambda s: None)
        fp8 = [n for n, m in tr.pm.model.named_modules() if isinstance(m, Float8Linear)]
        assert (len(fp8) > 0) == (precision == "fp8") and not any(n.endswith("head") for n in fp8), fp8
        losses[precision] = [tr.train_step(s)[0] for s in range(20)]
    assert all(v == v for v in losses["fp8"]) and losses["fp8"][-1] < losses["fp8"][0]
    torch.testing.assert_close(torch.tensor(losses["fp8"]), torch.tensor(losses["bf16"]), rtol=0.05, atol=0.0)
