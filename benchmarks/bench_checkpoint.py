"""Checkpoint stall, persist throughput and load time: ours vs torch.save, DCP (sync and async), dd.

One run, one process, the same state (model + AdamW state) for every method; medians over
``--repeats`` after one untimed warm-up round. Stall = how long the training loop is blocked by
one save. Throughput = bytes of tensors / time until the checkpoint is durable (ours: fsync +
checksums + manifest + rename; dd: the same bytes, ``conv=fsync``, run back to back with ours).

    python benchmarks/bench_checkpoint.py --model gpt2-small --repeats 5 --dir /tmp/xirang-bench-ckpt
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import tempfile
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from omegaconf import OmegaConf

from xirang_hpc.checkpoint.manager import CheckpointManager
from xirang_hpc.checkpoint.retention import RetentionPolicy
from xirang_hpc.checkpoint.state import tensor_state
from xirang_hpc.config.schema import ModelConfig, TrainConfig
from xirang_hpc.models.gpt import GPT
from xirang_hpc.runtime.data_parallel import build_optimizer

CONF = Path(__file__).resolve().parents[1] / "xirang_hpc" / "conf" / "model"


def build_state(model_name: str) -> tuple[dict, int]:
    """Model + initialised AdamW state as a DCP state dict, and its size in bytes."""
    mc = ModelConfig(**OmegaConf.to_container(OmegaConf.load(CONF / f"{model_name}.yaml")))
    torch.manual_seed(0)
    model = GPT(mc)
    opt = build_optimizer(model, TrainConfig())
    state, _ = tensor_state(model, opt)
    nbytes = 0
    stack = [state]
    while stack:
        d = stack.pop()
        for v in d.values():
            if isinstance(v, dict):
                stack.append(v)
            elif isinstance(v, torch.Tensor):
                nbytes += v.numel() * v.element_size()
    return state, nbytes


def touch(state: dict) -> None:
    """A training step's worth of in-place change (so no run sees stale pages)."""
    with torch.no_grad():
        for v in state["model"].values():
            if v.is_floating_point():
                v.add_(1e-6)


def timed(fn, *a, **kw) -> float:
    t0 = time.perf_counter()
    fn(*a, **kw)
    return time.perf_counter() - t0


def fresh(path: Path) -> Path:
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    return path


def bench(args: argparse.Namespace) -> None:
    base = Path(args.dir or tempfile.mkdtemp(prefix="xirang-bench-ckpt-"))
    state, nbytes = build_state(args.model)
    gb = nbytes / 1e9
    print(f"state: {args.model} model + AdamW = {gb:.3f} GB; dir {base}; repeats {args.repeats}", flush=True)
    res: dict[str, list[float]] = {k: [] for k in (
        "torch.save", "dcp sync", "dcp async stall", "dcp async persist", "ours stall", "ours persist", "dd",
        "ours load", "ours load (no verify)", "dcp load")}
    ours = CheckpointManager(fresh(base / "ours"), async_save=True, retention=RetentionPolicy(keep_last=1))
    def run_dd() -> float:
        # Same bytes as the state, fsynced once at the end (what "durable" means for ours too).
        ddf = base / "dd.bin"
        cmd = ["dd", "if=/dev/zero", f"of={ddf}", "bs=1M", f"count={mib}", "conv=fsync", "status=none"]
        t = timed(subprocess.run, cmd, check=True) * nbytes / (mib << 20)
        ddf.unlink()
        return t

    def run_ours(step: int) -> tuple[float, float]:
        rec = ours.save(step, state, state={"step": step})
        ours.wait()
        return rec.stall_s, rec.persist_s

    mib = max(1, nbytes >> 20)
    # Warm-up round, not timed: every method's first call pays one-off costs (our host buffers are
    # allocated on the first save, DCP's planner caches, imports); the steady state is what a run sees.
    first_stall, _ = run_ours(1)
    torch.save(state, base / "warm.pt")
    (base / "warm.pt").unlink()
    dcp.save(state, checkpoint_id=str(fresh(base / "dcp")))
    dcp.async_save(state, checkpoint_id=str(fresh(base / "dcp_async"))).result()
    print(f"warm-up: our first save's stall (allocates the host buffers) {first_stall:.3f}s", flush=True)
    for r in range(args.repeats):
        touch(state)
        p = fresh(base / "torch") / "state.pt"
        res["torch.save"].append(timed(torch.save, state, p))
        shutil.rmtree(base / "torch")

        d = fresh(base / "dcp")
        res["dcp sync"].append(timed(dcp.save, state, checkpoint_id=str(d)))

        da = fresh(base / "dcp_async")
        t0 = time.perf_counter()
        fut = dcp.async_save(state, checkpoint_id=str(da))
        res["dcp async stall"].append(time.perf_counter() - t0)
        fut.result()
        res["dcp async persist"].append(time.perf_counter() - t0)
        shutil.rmtree(da)

        # ours and dd back to back, alternating which goes first (paired ratios see the same disk load).
        if r % 2:
            res["dd"].append(run_dd())
        stall, persist = run_ours(r + 2)
        res["ours stall"].append(stall)
        res["ours persist"].append(persist)
        if not r % 2:
            res["dd"].append(run_dd())

        res["ours load"].append(timed(ours.load, state))
        ours.verify_checksums = False
        res["ours load (no verify)"].append(timed(ours.load, state))
        ours.verify_checksums = True
        res["dcp load"].append(timed(dcp.load, state, checkpoint_id=str(d)))
        print(f"repeat {r + 1}: " + ", ".join(f"{k} {v[-1]:.3f}s" for k, v in res.items()), flush=True)
    med = {k: statistics.median(v) for k, v in res.items()}
    print()
    print(f"| measure (median of {args.repeats}, {gb:.2f} GB state) | time | vs baseline | target |")
    print("|---|---|---|---|")
    print(f"| stall: torch.save (sync) | {med['torch.save']:.3f} s | 1.00 | |")
    print(f"| stall: DCP FileSystemWriter (sync) | {med['dcp sync']:.3f} s | "
          f"{med['dcp sync'] / med['torch.save']:.2f} | |")
    print(f"| stall: dcp.async_save | {med['dcp async stall']:.3f} s | "
          f"{med['dcp async stall'] / med['torch.save']:.3f} | |")
    print(f"| **stall: ours (async, snapshot to host)** | {med['ours stall']:.3f} s | "
          f"**{med['ours stall'] / med['torch.save']:.3f}** | <= 0.10 of torch.save |")
    print(f"| persist: dd bs=1M conv=fsync (same bytes), GB/s | {gb / med['dd']:.2f} GB/s | 1.00 | |")
    print(f"| persist: dcp.async_save until durable, GB/s | {gb / med['dcp async persist']:.2f} GB/s | "
          f"{med['dd'] / med['dcp async persist']:.2f} | |")
    print(f"| **persist: ours (write+fsync+checksums+commit), GB/s** | {gb / med['ours persist']:.2f} GB/s | "
          f"**{med['dd'] / med['ours persist']:.2f}** | >= 0.70 of dd |")
    print(f"| load: DCP FileSystemReader | {med['dcp load']:.3f} s | 1.00 | |")
    print(f"| **load: ours (verify checksums)** | {med['ours load']:.3f} s | "
          f"**{med['ours load'] / med['dcp load']:.2f}** | <= 1.00 of DCP |")
    print(f"| load: ours (no verify) | {med['ours load (no verify)']:.3f} s | "
          f"{med['ours load (no verify)'] / med['dcp load']:.2f} | |")
    paired = {
        "stall ours/torch.save": [a / b for a, b in zip(res["ours stall"], res["torch.save"])],
        "stall ours/dcp.async_save": [a / b for a, b in zip(res["ours stall"], res["dcp async stall"])],
        "persist dd/ours (throughput vs dd)": [a / b for a, b in zip(res["dd"], res["ours persist"])],
        "load ours/dcp": [a / b for a, b in zip(res["ours load"], res["dcp load"])],
    }
    print()
    print("paired per-repeat ratios (median [min..max]): " + "; ".join(
        f"{k} {statistics.median(v):.3f} [{min(v):.3f}..{max(v):.3f}]" for k, v in paired.items()))
    if not args.keep:
        shutil.rmtree(base, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="gpt2-small", help="model preset under conf/model (default gpt2-small)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--dir", default=None, help="directory on the disk to measure (default: a new temp dir)")
    ap.add_argument("--keep", action="store_true", help="keep the files")
    args = ap.parse_args()
    warnings.filterwarnings("ignore")
    # dcp.async_save needs a process group; a single-rank gloo group (no collectives cross a wire).
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        bench(args)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
