"""Training throughput and MFU on one GPU: xirang's trainer vs a plain PyTorch loop of the same model.

Both sides train the same Llama-family model (~1.1B parameters, TinyLlama's shape: 22 layers,
d_model 2048, 32 query heads sharing 4 key/value heads, SwiGLU 5632, vocab 32000, sequence 2048), on the same token
batches, with bf16 autocast, fp32 master weights and AdamW, for ``--steps`` steps each in one run.
The plain loop is what a user writes by hand (model(x) -> cross-entropy -> backward -> clip ->
step); ours is :class:`xirang_hpc.runtime.trainer.Trainer` on a one-rank nccl process group
(the trainer's logging, checkpoint and monitoring hooks are not attached: this compares the step).
Tokens/s and MFU are medians over the steps after ``--warmup``; the ratio ours/plain is printed.

    python benchmarks/bench_gpu_train.py                # on a GPU (~2-3 min on an H100/H200)
    python benchmarks/bench_gpu_train.py --smoke        # tiny model on CPU: checks the code path only

Without a GPU (and without ``--smoke``) it prints why and exits 0.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from xirang_hpc.config.schema import (
    ClusterConfig,
    DataConfig,
    ModelConfig,
    ParallelConfig,
    TrainConfig,
    XirangConfig,
)
from xirang_hpc.config.validate import validate
from xirang_hpc.data.dataset import TokenWindows
from xirang_hpc.data.prepare import prepare
from xirang_hpc.models.gpt import GPT, full_model_params
from xirang_hpc.monitor.flops import flops_per_token_for, peak_for_device
from xirang_hpc.runtime.topology import Topology
from xirang_hpc.runtime.trainer import Trainer

# ~1.1B parameters, Llama-family (the shape of TinyLlama-1.1B: GQA, SwiGLU, RoPE, RMSNorm).
LLAMA_1B = dict(name="llama-1b", n_layer=22, n_head=32, n_kv_head=4, d_model=2048, d_ff=5632, vocab_size=32000,
                seq_len=2048, norm="rmsnorm", mlp="swiglu", pos="rope", bias=False, rope_theta=10000.0)
SMOKE = dict(name="smoke", n_layer=2, n_head=4, n_kv_head=2, d_model=64, d_ff=128, vocab_size=256, seq_len=32,
             norm="rmsnorm", mlp="swiglu", pos="rope", bias=False)


def make_cfg(model: dict, batch: int, steps: int) -> XirangConfig:
    """One rank, bf16 autocast on CUDA (precision=auto), no warmup schedule effects on speed."""
    cfg = XirangConfig(
        model=ModelConfig(**model),
        cluster=ClusterConfig(name="bench", nodes=1, tasks_per_node=1, gpus_per_node=1, backend="auto"),
        parallel=ParallelConfig(),
        train=TrainConfig(max_steps=steps, global_batch=batch, lr=3e-4, warmup_steps=0, log_every=1000),
        data=DataConfig(),
    )
    return validate(cfg)


def median_rate(times: list[float], tokens: int, warmup: int) -> float:
    """Median tokens/s over the steps after warmup."""
    kept = times[warmup:] or times
    return tokens / statistics.median(kept)


def run_ours(cfg: XirangConfig, data_dir: Path, steps: int, device: torch.device) -> list[float]:
    """Step times of xirang's Trainer (one rank)."""
    topo = Topology(rank=0, world_size=1, local_rank=0, local_world_size=1, node_id=0, num_nodes=1,
                    node_name="bench", master_addr="127.0.0.1", master_port=0, job_id="bench", source="local")
    times = []
    with tempfile.TemporaryDirectory() as run_dir:
        tr = Trainer(cfg, topo, Path(run_dir), data_dir, log=lambda s: None)
        for s in range(steps):
            sync(device)
            t0 = time.perf_counter()
            tr.train_step(s)
            sync(device)
            times.append(time.perf_counter() - t0)
        del tr
    return times


def run_plain(cfg: XirangConfig, data_dir: Path, steps: int, device: torch.device) -> list[float]:
    """Step times of a hand-written loop over the same model and batches."""
    torch.manual_seed(cfg.train.seed)
    model = GPT(cfg.model).to(device)
    t = cfg.train
    opt = torch.optim.AdamW(model.parameters(), lr=t.lr, betas=(t.beta1, t.beta2), weight_decay=t.weight_decay,
                            fused=device.type == "cuda")
    data = TokenWindows(data_dir, "train", cfg.model.seq_len)
    dtype = torch.bfloat16
    times = []
    for s in range(steps):
        x, y = data.batch(t.seed, s, t.global_batch, 0, 1)
        sync(device)
        t0 = time.perf_counter()
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with torch.autocast(device.type, dtype=dtype, enabled=device.type == "cuda"):
            logits = model(x)
        loss = F.cross_entropy(logits.float().view(-1, logits.shape[-1]), y.view(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync(device)
        times.append(time.perf_counter() - t0)
    del model, opt
    return times


def sync(device: torch.device) -> None:
    """Wait for queued GPU work, so wall time covers the step."""
    if device.type == "cuda":
        torch.cuda.synchronize()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--batch", type=int, default=8, help="sequences per step")
    ap.add_argument("--smoke", action="store_true", help="tiny model on CPU (checks the code path only)")
    ap.add_argument("--json", type=Path, help="also write the figures here")
    args = ap.parse_args(argv)
    if not args.smoke and not torch.cuda.is_available():
        print("bench_gpu_train: skipped: no CUDA device visible (torch.cuda.is_available() is False)")
        return 0
    device = torch.device("cpu" if args.smoke else "cuda", 0)
    model = SMOKE if args.smoke else LLAMA_1B
    cfg = make_cfg(model, args.batch, args.steps)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(0)
    dist.init_process_group(backend, rank=0, world_size=1)
    try:
        with tempfile.TemporaryDirectory() as data_tmp:
            data_dir = Path(data_tmp)
            # A real corpus, byte tokens (ids < 256 fit any vocab): the stdlib's email package (~1 MB).
            prepare(str(Path(sysconfig.get_paths()["stdlib"]) / "email"), data_dir, val_fraction=0.2)
            ours = run_ours(cfg, data_dir, args.steps, device)
            if device.type == "cuda":
                torch.cuda.empty_cache()
            plain = run_plain(cfg, data_dir, args.steps, device)
    finally:
        dist.destroy_process_group()
    tokens = args.batch * cfg.model.seq_len
    fpt = flops_per_token_for(cfg.model)
    name = torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu"
    peak = peak_for_device(name)
    warm = min(args.warmup, args.steps - 1)
    res = {"device": name, "params": full_model_params(cfg.model), "tokens_per_step": tokens,
           "ours_tok_s": median_rate(ours, tokens, warm), "plain_tok_s": median_rate(plain, tokens, warm)}
    res["ratio"] = res["ours_tok_s"] / res["plain_tok_s"]
    for k in ("ours", "plain"):
        res[f"{k}_mfu"] = res[f"{k}_tok_s"] * fpt / (peak * 1e12) if peak else None
    mfu = {k: f"{res[f'{k}_mfu']:.1%}" if res[f"{k}_mfu"] is not None else "n/a" for k in ("ours", "plain")}
    print(f"device {name}; model {cfg.model.name} {res['params'] / 1e9:.2f}B params; {tokens} tokens/step; "
          f"bf16 autocast={device.type == 'cuda'}; median of steps {warm}..{args.steps - 1}")
    print(f"{'':8}{'tokens/s':>12}{'MFU':>8}")
    print(f"{'xirang':8}{res['ours_tok_s']:12.0f}{mfu['ours']:>8}")
    print(f"{'plain':8}{res['plain_tok_s']:12.0f}{mfu['plain']:>8}")
    print(f"ratio xirang/plain: {res['ratio']:.3f}")
    if args.json:
        args.json.write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
