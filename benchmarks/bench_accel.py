"""Compiled blocks and the optimizer kernels on the CPU: tokens/s, compile time cold and warm, trainer overhead.

One process (no process group), a small Llama-family model (RMSNorm, SwiGLU, rotary, grouped-query
attention), the stdlib ``email`` package byte-tokenized as data. Every measurement runs in a fresh
interpreter, so compile state never carries over except through the on-disk cache:

1. tokens/s of our trainer step, eager vs ``train.compile=true`` (median step time after the first steps);
2. compile time, cold (an empty per-user cache directory) and warm (the same directory again, as an
   in-job restart or a requeue finds it): the start-up (build and the first steps, beyond what steady
   steps take) of the compiled trainer minus that of the eager one;
3. our trainer step vs a plain PyTorch loop of the same model (AdamW, ``clip_grad_norm_``, the same
   batches), with the same compile setting (each block's forward through ``torch.compile``);
4. ``train.optimizer_impl`` auto / foreach / fused: tokens/s (eager).

The warm measurements run in ``--rounds`` interleaved rounds (the order reversed every other round) and
the ratios are medians of the per-round ratios, so load from elsewhere on the machine hits both sides.
Prints each figure and the ratios. ``--quick``: 8 steps, one round (about 1-2 minutes on 2 cores).

Run:  python benchmarks/bench_accel.py [--quick] [--steps 16] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
LLAMA = {"name": "llama-small", "n_layer": 4, "n_head": 8, "n_kv_head": 2, "d_model": 128, "d_ff": 384,
         "seq_len": 128, "norm": "rmsnorm", "mlp": "swiglu", "pos": "rope", "bias": False, "rope_theta": 500000.0}
TRAIN = {"global_batch": 8, "grad_clip": 1.0, "warmup_steps": 2, "eval_batches": 1, "log_every": 1000}


def _child(kind: str, compile_: bool, impl: str, steps: int, data: str) -> dict[str, Any]:
    """One measurement in this (fresh) process: per-step wall times of ``steps`` steps."""
    sys.path.insert(0, str(ROOT / "tests"))
    import parallel_harness as H
    import torch

    from xirang_hpc.data.dataset import TokenWindows
    from xirang_hpc.models.gpt import GPT, lm_loss
    from xirang_hpc.runtime.compile import apply_compile, configure_cache
    from xirang_hpc.runtime.data_parallel import build_optimizer
    from xirang_hpc.runtime.schedule import lr_at
    from xirang_hpc.runtime.trainer import Trainer

    torch.set_num_threads(int(os.environ.get("BENCH_THREADS", "2")))
    cfg = H.make_cfg(1, {}, steps, model=LLAMA, train={**TRAIN, "compile": compile_, "optimizer_impl": impl})
    t = cfg.train
    times: list[float] = []
    t_build = time.perf_counter()
    with tempfile.TemporaryDirectory() as run_dir:
        if kind == "trainer":
            tr = Trainer(cfg, H.topology(0, 1, 0), Path(run_dir), Path(data), log=lambda s: None)
            step = lambda s: tr.train_step(s, reduce_loss=False)  # noqa: E731 - as Trainer.fit runs unlogged steps
        else:  # the textbook loop, same model, init, batches, optimizer and compile setting
            configure_cache()
            model = GPT(cfg.model, seed=t.seed)
            if compile_:
                apply_compile(model)
            opt = build_optimizer(model, t)
            windows = TokenWindows(Path(data), "train", cfg.model.seq_len)

            def step(s: int) -> None:
                x, y = windows.batch(t.seed, s, t.global_batch, 0, 1)
                for g in opt.param_groups:
                    g["lr"] = lr_at(s, t)
                loss = lm_loss(model(x), y)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip)
                opt.step()
                opt.zero_grad(set_to_none=True)
        build_s = time.perf_counter() - t_build
        for s in range(steps):
            t0 = time.perf_counter()
            step(s)
            times.append(time.perf_counter() - t0)
    return {"times": times, "build_s": build_s}


def run_child(kind: str, compile_: bool, impl: str, steps: int, data: Path, cache: Path) -> dict[str, Any]:
    """:func:`_child` in a fresh interpreter whose user cache directory is ``cache``."""
    env = {k: v for k, v in os.environ.items() if k not in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")}
    env["XDG_CACHE_HOME"] = str(cache)
    args = [sys.executable, __file__, "--child", json.dumps([kind, compile_, impl, steps, str(data)])]
    out = subprocess.run(args, capture_output=True, text=True, env=env, timeout=900)
    if out.returncode != 0:
        raise RuntimeError(f"{kind} compile={compile_} failed:\n{out.stderr[-4000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def steady(times: list[float], skip: int) -> float:
    """Median step time after the first ``skip`` steps (compiling, allocator warm-up)."""
    return statistics.median(times[skip:])


def main() -> None:
    """Run the measurements and print the figures and ratios."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer steps, one round (a smoke run, ~2 min on 2 cores)")
    ap.add_argument("--steps", type=int, default=0, help="steps per measurement (default 16, --quick 8)")
    ap.add_argument("--rounds", type=int, default=0, help="rounds of the warm measurements (default 3, --quick 1)")
    ap.add_argument("--child", default="", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        print(json.dumps(_child(*json.loads(a.child))))
        return
    steps = a.steps or (8 if a.quick else 16)
    rounds = a.rounds or (1 if a.quick else 3)
    skip = 3  # steps 0-2: compiling (the first forward and backward) and warm-up
    tokens = TRAIN["global_batch"] * LLAMA["seq_len"]
    runs = {"trainer-eager": ("trainer", False, "auto"), "trainer-compiled": ("trainer", True, "auto"),
            "plain-eager": ("plain", False, "auto"), "plain-compiled": ("plain", True, "auto"),
            "trainer-foreach": ("trainer", False, "foreach"), "trainer-fused": ("trainer", False, "fused")}
    res: dict[str, list[dict[str, Any]]] = {k: [] for k in runs}
    with tempfile.TemporaryDirectory() as tmp:
        from xirang_hpc.data.prepare import prepare

        data = Path(tmp) / "data"
        prepare(str(Path(sysconfig.get_paths()["stdlib"]) / "email"), data, val_fraction=0.2)
        cache = Path(tmp) / "cache"  # starts empty: the first compiled run is cold, every later one warm
        cold = run_child("trainer", True, "auto", steps, data, cache)
        for rnd in range(rounds):  # the warm measurements interleaved, the order reversed every other round
            for name in list(runs) if rnd % 2 == 0 else list(runs)[::-1]:
                t0 = time.perf_counter()
                res[name].append(run_child(*runs[name], steps, data, cache))
                print(f"  round {rnd} {name}: {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)

    def tps(r: dict[str, Any]) -> float:
        return tokens / steady(r["times"], skip)

    def to_steady(r: dict[str, Any]) -> float:  # build + the first steps beyond steady ones: start-up cost
        return r["build_s"] + sum(r["times"][:skip]) - skip * steady(r["times"], skip)

    def med(name: str, f: Any = tps) -> float:
        return statistics.median(f(r) for r in res[name])

    def ratio(a_: str, b: str) -> str:
        per = [tps(x) / tps(y) for x, y in zip(res[a_], res[b], strict=True)]
        return f"{statistics.median(per):.3f}" + (f" (rounds {min(per):.3f}-{max(per):.3f})" if len(per) > 1 else "")

    print(f"model {LLAMA['name']}: {LLAMA['n_layer']} layers, d_model {LLAMA['d_model']}, GQA "
          f"{LLAMA['n_head']}/{LLAMA['n_kv_head']}, seq {LLAMA['seq_len']}, batch {TRAIN['global_batch']}; "
          f"{steps} steps per process, median step of {skip}..{steps - 1}; {rounds} round(s); torch threads "
          f"{os.environ.get('BENCH_THREADS', '2')}")
    for k in runs:
        print(f"{k:20s} {med(k):>9,.0f} tok/s   start-up beyond steady steps {med(k, to_steady):6.2f} s")
    eager0 = med("trainer-eager", to_steady)
    c_cold, c_warm = to_steady(cold) - eager0, med("trainer-compiled", to_steady) - eager0
    print(f"compile time (start-up minus eager start-up): cold cache {c_cold:.2f} s, warm cache {c_warm:.2f} s")
    print(f"compiled / eager tok/s (trainer):        {ratio('trainer-compiled', 'trainer-eager')}")
    print(f"compiled / eager tok/s (plain loop):     {ratio('plain-compiled', 'plain-eager')}")
    print(f"trainer / plain loop tok/s, eager:       {ratio('trainer-eager', 'plain-eager')}")
    print(f"trainer / plain loop tok/s, compiled:    {ratio('trainer-compiled', 'plain-compiled')}")
    print(f"optimizer foreach / auto tok/s (eager):  {ratio('trainer-foreach', 'trainer-eager')}")
    print(f"optimizer fused / auto tok/s (eager):    {ratio('trainer-fused', 'trainer-eager')}")


if __name__ == "__main__":
    main()
