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

``--ranks 4 --layouts dp2xtp2,fsdp4``: the same questions on 4 real gloo rank processes (2 virtual nodes x 2,
1 torch thread each, ``xirang_hpc/runtime/local_ranks.py``) and a ~100M-parameter Llama-family model
(:data:`LLAMA_100M`; ``--model tiny`` for a smoke run), per layout:

1. tokens/s (the global batch's tokens / the median step time after ``--skip`` steps, a step ending when its
   slowest rank ends it) of our trainer, eager vs ``train.compile=true``;
2. compile time cold (an empty per-user cache directory for the layout) and warm, as above, from the ranks'
   start-up (build after the process group exists, and the first steps beyond steady ones; max over ranks);
3. our trainer vs a plain PyTorch loop of the same model, batches and compile setting, parallelised with
   torch's public APIs only: ``fsdp4`` ``fully_shard`` per block and the root over the 4 ranks; ``dp2xtp2``
   ``parallelize_module`` (``ColwiseParallel`` q/k/v and MLP gate/up, ``RowwiseParallel`` o and MLP down) over
   the tp mesh, and replication over dp by ``fully_shard`` on a (replicate 2, shard 1) mesh (HSDP with one
   shard: gradients all-reduced over dp; DDP's reducer does not take tensor-parallel DTensor parameters
   without swapping them for their local shards, which hides them from a global gradient norm). AdamW,
   the global gradient norm from ``get_total_norm`` per mesh and ``clip_grads_with_norm_``.

Every measurement is a fresh group of rank processes (``spawn``), so compile state carries over only through
the on-disk cache; rounds are interleaved and the ratios are medians of the per-round ratios.

``--moe``: the one-process measurements with a mixture of experts in every block (:data:`MOE`), compiled
around the routing as ``train.compile`` compiles such blocks.

Run:  python benchmarks/bench_accel.py --ranks 4 --layouts dp2xtp2,fsdp4 [--steps 6] [--rounds 2] [--eager-only]
      (3 rounds of the 100M model: about 27 minutes on 2 shared cores; ``--model tiny``: a few minutes)
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
LLAMA = {"name": "llama-small", "n_layer": 4, "n_head": 8, "n_kv_head": 2, "d_model": 128, "d_ff": 384,
         "seq_len": 128, "norm": "rmsnorm", "mlp": "swiglu", "pos": "rope", "bias": False, "rope_theta": 500000.0}
TRAIN = {"global_batch": 8, "grad_clip": 1.0, "warmup_steps": 2, "eval_batches": 1, "log_every": 1000}
# --moe: the same model with a mixture of 8 SwiGLU experts of width 256 (top-2, expert-bias balancing, so the
# plain loop's loss is the trainer's) in place of every block's MLP
MOE = {"moe_experts": 8, "moe_top_k": 2, "moe_ffn_hidden": 256, "moe_balance": "bias"}


def _child(kind: str, compile_: bool, impl: str, steps: int, data: str, moe: bool = False) -> dict[str, Any]:
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
    model = {**LLAMA, **MOE} if moe else LLAMA
    cfg = H.make_cfg(1, {}, steps, model=model, train={**TRAIN, "compile": compile_, "optimizer_impl": impl})
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


def run_child(kind: str, compile_: bool, impl: str, steps: int, data: Path, cache: Path,
              moe: bool = False) -> dict[str, Any]:
    """:func:`_child` in a fresh interpreter whose user cache directory is ``cache``."""
    env = {k: v for k, v in os.environ.items() if k not in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")}
    env["XDG_CACHE_HOME"] = str(cache)
    args = [sys.executable, __file__, "--child", json.dumps([kind, compile_, impl, steps, str(data), moe])]
    out = subprocess.run(args, capture_output=True, text=True, env=env, timeout=900)
    if out.returncode != 0:
        raise RuntimeError(f"{kind} compile={compile_} failed:\n{out.stderr[-4000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def steady(times: list[float], skip: int) -> float:
    """Median step time after the first ``skip`` steps (compiling, allocator warm-up)."""
    return statistics.median(times[skip:])

# ---- the 4-rank mode -------------------------------------------------------------------------------------------

#: A ~100M-parameter Llama-family model (16 x 6.3M in the blocks, 0.4M in the byte embedding and head): RMSNorm,
#: SwiGLU (8/3 d_model), rotary, grouped-query attention 12/4.
LLAMA_100M = {"name": "llama-100m", "n_layer": 16, "n_head": 12, "n_kv_head": 4, "d_model": 768, "d_ff": 2048,
              "seq_len": 128, "norm": "rmsnorm", "mlp": "swiglu", "pos": "rope", "bias": False,
              "rope_theta": 500000.0}
#: The same family, small enough for a smoke run of the 4-rank mode.
LLAMA_TINY = {**LLAMA_100M, "name": "llama-tiny", "n_layer": 2, "n_head": 4, "n_kv_head": 2, "d_model": 64,
              "d_ff": 128}
MODELS = {"100m": LLAMA_100M, "tiny": LLAMA_TINY}
RANK_LAYOUTS = ("dp2xtp2", "fsdp4")


def _rank_cfg(world: int, layout: str, compile_: bool, steps: int, model: dict[str, Any]) -> Any:
    """The validated config of one 4-rank measurement (the tests' harness builds it as the layout tests do)."""
    sys.path.insert(0, str(ROOT / "tests"))
    import parallel_harness as H

    return H.make_cfg(world, H.LAYOUTS[layout], steps, model=model, train={**TRAIN, "compile": compile_})


def _plain_parallel(cfg: Any, layout: str, compile_: bool, rank: int) -> tuple[Any, Any, Callable[..., Any], int, int]:
    """The plain-torch model of ``layout``: (model, AdamW, loss function, dp rank, dp size).

    Public torch APIs only: ``init_device_mesh``, ``parallelize_module`` with Colwise/RowwiseParallel,
    ``torch.compile`` of each block's forward and of the loss (after tensor parallelism, before FSDP2, so the
    redistributions are inside the graphs and FSDP2's hooks outside, as torchtitan orders them), ``fully_shard``.
    """
    import torch
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from xirang_hpc.models.gpt import GPT

    t = cfg.train
    model = GPT(cfg.model, seed=t.seed)  # the whole model on every rank, then sharded: the textbook order
    if layout == "fsdp4":
        dp_mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("dp",))
        dp_rank, dp_size = rank, 4
    elif layout == "dp2xtp2":
        mesh = init_device_mesh("cpu", (2, 1, 2), mesh_dim_names=("dp_replicate", "dp_shard", "tp"))
        plan = {"attn.q": ColwiseParallel(), "attn.k": ColwiseParallel(), "attn.v": ColwiseParallel(),
                "attn.o": RowwiseParallel(), "mlp.gate": ColwiseParallel(), "mlp.up": ColwiseParallel(),
                "mlp.down": RowwiseParallel()}
        for block in model.layers.values():
            parallelize_module(block, mesh["tp"], plan)  # type: ignore[arg-type]
        dp_mesh = mesh["dp_replicate", "dp_shard"]  # 2-D: HSDP, one shard per replica = replication over dp
        dp_rank, dp_size = mesh.get_coordinate()[0], 2  # type: ignore[index]
    else:
        raise ValueError(f"no plain loop for layout {layout}")

    def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))

    if compile_:
        for block in model.layers.values():
            block.forward = torch.compile(block.forward, fullgraph=True)  # type: ignore[method-assign]
        loss_fn = torch.compile(loss_fn, fullgraph=True)  # type: ignore[assignment]
    for block in model.layers.values():
        fully_shard(block, mesh=dp_mesh)
    fully_shard(model, mesh=dp_mesh)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": t.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=t.lr, betas=(t.beta1, t.beta2))
    return model, opt, loss_fn, dp_rank, dp_size


def _clip_global(params: list[Any], max_norm: float) -> Any:
    """``clip_grad_norm_`` over parameters on several meshes: ``get_total_norm`` per mesh (a DTensor norm reduced
    over its shards by ``full_tensor``), combined, then ``clip_grads_with_norm_``; returns the global norm."""
    import torch
    from torch.distributed.tensor import DTensor

    grads = [p.grad for p in params if p.grad is not None]
    by_mesh: dict[Any, list[Any]] = {}
    for g in grads:
        by_mesh.setdefault(g.device_mesh if isinstance(g, DTensor) else None, []).append(g)
    norms = []
    for gs in by_mesh.values():
        n = torch.nn.utils.get_total_norm(gs, 2.0)
        norms.append(n.full_tensor() if isinstance(n, DTensor) else n)
    total = torch.linalg.vector_norm(torch.stack(norms))
    for gs in by_mesh.values():  # one call per mesh: a multi-tensor kernel takes tensors of one mesh
        torch.nn.utils.clip_grads_with_norm_(gs, max_norm, total)
    return total


def _local_numel(p: Any) -> int:
    """Elements of ``p`` this rank stores (its DTensor shard)."""
    from torch.distributed.tensor import DTensor

    return (p.to_local() if isinstance(p, DTensor) else p).numel()


def _rank_worker(place: Any, queue: Any, kind: str, layout: str, compile_: bool, steps: int, data: str,
                 model: dict[str, Any]) -> None:
    """One rank of one measurement: build our trainer or the plain loop, time ``steps`` steps, report them."""
    import traceback

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    # torch warns on every plain-loop step that a norm over the 3-D (dp_replicate, dp_shard, tp) mesh reduces over
    # two of its dimensions one after the other; one of them has a single rank, so that costs nothing here.
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    try:
        from xirang_hpc.data.dataset import TokenWindows
        from xirang_hpc.runtime.schedule import lr_at
        from xirang_hpc.runtime.trainer import Trainer

        place.init_process_group("gloo")
        dist.barrier()  # the ranks' imports and start-up end at different times: the build is timed from here
        cfg = _rank_cfg(place.world_size, layout, compile_, steps, model)
        t = cfg.train
        times: list[float] = []
        norms: list[Any] = []  # the global gradient norm of every step (a float, or the plain loop's tensor)
        t_build = time.perf_counter()
        with tempfile.TemporaryDirectory() as run_dir:
            if kind == "trainer":
                tr = Trainer(cfg, place.topology("bench"), Path(run_dir), Path(data), log=lambda s: None)
                step = lambda s: tr.train_step(s, reduce_loss=False)[1]  # noqa: E731 - as Trainer.fit's unlogged steps
                n_params = sum(_local_numel(p) for p in tr.model.parameters())
            else:
                net, opt, loss_fn, dp_rank, dp_size = _plain_parallel(cfg, layout, compile_, place.rank)
                windows = TokenWindows(Path(data), "train", cfg.model.seq_len)
                params = list(net.parameters())
                n_params = sum(_local_numel(p) for p in params)

                def step(s: int) -> Any:
                    x, y = windows.batch(t.seed, s, t.global_batch, dp_rank, dp_size)
                    for g in opt.param_groups:
                        g["lr"] = lr_at(s, t)
                    loss = loss_fn(net(x), y)
                    loss.backward()
                    norm = _clip_global(params, t.grad_clip)
                    opt.step()
                    opt.zero_grad(set_to_none=True)
                    return norm
            build_s = time.perf_counter() - t_build
            for s in range(steps):
                t0 = time.perf_counter()
                norms.append(step(s))
                times.append(time.perf_counter() - t0)
            dist.barrier()
        queue.put((place.rank, {"times": times, "build_s": build_s, "n_params_rank": n_params,
                                "norms": [float(n) for n in norms]}))
    except Exception:  # report the failure to the parent instead of hanging it
        queue.put((place.rank, {"error": traceback.format_exc()}))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(kind: str, layout: str, compile_: bool, steps: int, data: Path, cache: Path, model: dict[str, Any],
              world: int = 4, timeout_s: float = 1800) -> list[dict[str, Any]]:
    """:func:`_rank_worker` on ``world`` fresh rank processes whose user cache directory is ``cache``; per rank."""
    from xirang_hpc.runtime.local_ranks import LocalRanks

    saved = dict(os.environ)
    for var in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR"):  # the cache follows XDG_CACHE_HOME alone
        os.environ.pop(var, None)
    os.environ["XDG_CACHE_HOME"] = str(cache)
    os.environ["OMP_NUM_THREADS"] = "1"
    out: list[dict[str, Any]] = [{}] * world
    try:
        with LocalRanks(_rank_worker, world, (kind, layout, compile_, steps, str(data), model), nodes=2,
                        timeout_s=timeout_s) as ranks:
            for _ in range(world):
                rank, res = ranks.get()
                if "error" in res:
                    raise RuntimeError(f"{kind} {layout} compile={compile_} rank {rank} failed:\n{res['error']}")
                out[rank] = res
    finally:
        os.environ.clear()
        os.environ.update(saved)
    return out


def _step_times(per_rank: list[dict[str, Any]]) -> list[float]:
    """Per step, the slowest rank's time (a step ends when every rank has ended it)."""
    return [max(r["times"][i] for r in per_rank) for i in range(len(per_rank[0]["times"]))]


def _profile(per_rank: list[dict[str, Any]]) -> str:
    """The build and every step's time (slowest rank), for the progress lines."""
    steps = " ".join(f"{x:.2f}" for x in _step_times(per_rank))
    return f"build {max(r['build_s'] for r in per_rank):.1f} s, steps {steps} s"


def main_ranks(a: argparse.Namespace) -> None:
    """The 4-rank mode: per layout, trainer and plain loop, eager and compiled; cold and warm compile time."""
    from xirang_hpc.models.gpt import full_model_params

    model = MODELS[a.model]
    layouts = [x for x in a.layouts.split(",") if x]
    for lay in layouts:
        if lay not in RANK_LAYOUTS:
            raise SystemExit(f"--layouts: {lay} is not one of {', '.join(RANK_LAYOUTS)}")
    if a.ranks != 4:
        raise SystemExit("--ranks: the layouts measured here (dp2xtp2, fsdp4) take 4 ranks")
    steps = a.steps or 6
    rounds = a.rounds or 2
    skip = a.skip
    if steps <= skip:
        raise SystemExit(f"--steps {steps} leaves no steady step after --skip {skip}")
    cfg = _rank_cfg(a.ranks, layouts[0], False, steps, model)
    n_params = full_model_params(cfg.model)
    tokens = TRAIN["global_batch"] * model["seq_len"]
    print(f"model {model['name']}: {n_params:,} parameters ({n_params / 1e6:.1f}M); {model['n_layer']} layers, "
          f"d_model {model['d_model']}, GQA {model['n_head']}/{model['n_kv_head']}, SwiGLU {model['d_ff']}, "
          f"vocab {cfg.model.vocab_size}, seq {model['seq_len']}, global batch {TRAIN['global_batch']} "
          f"({tokens} tokens/step); {a.ranks} ranks (2 virtual nodes x 2), gloo, 1 torch thread per rank; "
          f"{steps} steps per measurement, median step of {skip}..{steps - 1}; {rounds} round(s)", flush=True)
    modes = ("eager",) if a.eager_only else ("eager", "compiled")
    runs = {f"{kind}-{mode}": (kind, mode == "compiled") for kind in ("trainer", "plain") for mode in modes}
    res: dict[str, dict[str, list[list[dict[str, Any]]]]] = {lay: {k: [] for k in runs} for lay in layouts}
    cold: dict[str, list[dict[str, Any]]] = {}
    t_all = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        from xirang_hpc.data.prepare import prepare

        data = Path(tmp) / "data"
        prepare(str(Path(sysconfig.get_paths()["stdlib"]) / "email"), data, val_fraction=0.2)
        caches = {lay: Path(tmp) / f"cache-{lay}" for lay in layouts}  # empty: each layout's first compile is cold
        for lay in layouts if not a.eager_only else ():
            t0 = time.perf_counter()
            cold[lay] = run_ranks("trainer", lay, True, steps, data, caches[lay], model)
            print(f"  cold {lay} trainer-compiled: {time.perf_counter() - t0:.1f} s; {_profile(cold[lay])}",
                  file=sys.stderr, flush=True)
        order = [(lay, name) for lay in layouts for name in runs]
        for rnd in range(rounds):  # interleaved, the order reversed every other round
            for lay, name in order if rnd % 2 == 0 else order[::-1]:
                t0 = time.perf_counter()
                kind, compiled = runs[name]
                res[lay][name].append(run_ranks(kind, lay, compiled, steps, data, caches[lay], model))
                print(f"  round {rnd} {lay} {name}: {time.perf_counter() - t0:.1f} s; {_profile(res[lay][name][-1])}",
                      file=sys.stderr, flush=True)

    def step_s(r: list[dict[str, Any]]) -> float:
        return statistics.median(_step_times(r)[skip:])

    def tps(r: list[dict[str, Any]]) -> float:
        return tokens / step_s(r)

    def to_steady(r: list[dict[str, Any]]) -> float:  # build + the first steps beyond steady ones, slowest rank
        return max(x["build_s"] for x in r) + sum(_step_times(r)[:skip]) - skip * step_s(r)

    def med(lay: str, name: str, f: Any = tps) -> float:
        return statistics.median(f(r) for r in res[lay][name])

    def ratio(lay: str, a_: str, b: str) -> str:
        per = [tps(x) / tps(y) for x, y in zip(res[lay][a_], res[lay][b], strict=True)]
        return f"{statistics.median(per):.3f}" + (f" (rounds {min(per):.3f}-{max(per):.3f})" if len(per) > 1 else "")

    for lay in layouts:
        print(f"\n[{lay}] parameters per rank: trainer {res[lay]['trainer-eager'][0][0]['n_params_rank']:,}, "
              f"plain {res[lay]['plain-eager'][0][0]['n_params_rank']:,}")
        # The same init, batches and optimizer: the two loops' global gradient norms agree step for step.
        print(f"{lay} gradient norm of steps 0-2 (rank 0, round 0): " + "; ".join(
            f"{k} " + " ".join(f"{v:.6f}" for v in res[lay][k][0][0]["norms"][:3]) for k in runs))
        for k in runs:
            print(f"{lay} {k:18s} {med(lay, k):>9,.1f} tok/s  step {med(lay, k, step_s):6.2f} s  "
                  f"start-up beyond steady steps {med(lay, k, to_steady):6.1f} s")
        if a.eager_only:
            print(f"{lay} trainer / plain loop tok/s, eager:     {ratio(lay, 'trainer-eager', 'plain-eager')}"
                  "  (target >= 1.0)")
            continue
        eager0 = med(lay, "trainer-eager", to_steady)
        warm = med(lay, "trainer-compiled", to_steady) - eager0
        # The plain loop's graphs are its own (its loss function, no probe): its round-0 run is its first compile,
        # in the cache the trainer's runs filled; later rounds find its own graphs.
        plain = " / ".join(f"{to_steady(c) - to_steady(e):.1f}" for c, e in
                           zip(res[lay]["plain-compiled"], res[lay]["plain-eager"], strict=True))
        print(f"{lay} compile time (trainer start-up minus eager start-up): cold cache "
              f"{to_steady(cold[lay]) - eager0:.1f} s, warm cache {warm:.1f} s; plain loop per round "
              f"(round 0: its first compile) {plain} s")
        print(f"{lay} compiled / eager tok/s (trainer):      {ratio(lay, 'trainer-compiled', 'trainer-eager')}"
              "  (target >= 1.2)")
        print(f"{lay} compiled / eager tok/s (plain loop):   {ratio(lay, 'plain-compiled', 'plain-eager')}")
        print(f"{lay} trainer / plain loop tok/s, eager:     {ratio(lay, 'trainer-eager', 'plain-eager')}"
              "  (target >= 1.0)")
        print(f"{lay} trainer / plain loop tok/s, compiled:  {ratio(lay, 'trainer-compiled', 'plain-compiled')}"
              "  (target >= 1.0)")
    print(f"\n(total {time.perf_counter() - t_all:.0f} s)")


def main() -> None:
    """Run the measurements and print the figures and ratios."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer steps, one round (a smoke run, ~2 min on 2 cores)")
    ap.add_argument("--steps", type=int, default=0, help="steps per measurement (default 16, --quick 8; --ranks: 6)")
    ap.add_argument("--rounds", type=int, default=0,
                    help="rounds of the warm measurements (default 3, --quick 1; --ranks: 2)")
    ap.add_argument("--ranks", type=int, default=0, help="the multi-rank mode on this many ranks (4)")
    ap.add_argument("--layouts", default=",".join(RANK_LAYOUTS), help="multi-rank mode: layouts, comma-separated")
    ap.add_argument("--model", choices=sorted(MODELS), default="100m", help="multi-rank mode: the model")
    ap.add_argument("--skip", type=int, default=2, help="multi-rank mode: steps before the steady ones")
    ap.add_argument("--eager-only", action="store_true",
                    help="multi-rank mode: only the eager trainer and plain loop (no compile, no compile times)")
    ap.add_argument("--moe", action="store_true",
                    help="one-process mode: the model with 8 experts (top-2) in every block instead of a dense MLP")
    ap.add_argument("--child", default="", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        print(json.dumps(_child(*json.loads(a.child))))
        return
    if a.ranks:
        main_ranks(a)
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
        cold = run_child("trainer", True, "auto", steps, data, cache, a.moe)
        for rnd in range(rounds):  # the warm measurements interleaved, the order reversed every other round
            for name in list(runs) if rnd % 2 == 0 else list(runs)[::-1]:
                t0 = time.perf_counter()
                res[name].append(run_child(*runs[name], steps, data, cache, a.moe))
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
          f"{os.environ.get('BENCH_THREADS', '2')}"
          + (f"; MoE: {MOE['moe_experts']} experts of width {MOE['moe_ffn_hidden']}, top-{MOE['moe_top_k']}"
             if a.moe else ""))
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
