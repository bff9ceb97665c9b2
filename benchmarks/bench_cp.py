"""Activation memory per rank and tokens/s of context parallelism (``parallel.cp``) for one long sequence.

For each cp degree, ``cp`` real gloo ranks build the model through the runtime's own ``parallelize`` (meta
build, the cp mesh dimension, DDP over the cp group) and train on one sequence of ``--seq`` tokens, each rank
on its load-balanced shard. Measured per rank:

- activation memory: the bytes autograd keeps for the backward during one forward (every saved tensor's
  storage counted once, through ``torch.autograd.graph.saved_tensors_hooks``): what cp divides, exact and
  free of allocator noise;
- peak resident memory of the rank's process above its size before the first forward (``ru_maxrss``);
- the median seconds of a forward + backward over ``--repeats``, and tokens/s of the whole sequence.

The same model and tokens at cp=1 are the baseline; the per-rank ratio against it is printed (the target
is ~1/cp + 15%). cp=1 calls SDPA with ``is_causal`` (its fused CPU kernel keeps no scores), cp > 1 with the
mask over the shards' true positions (the math path, scores kept): the figures include that difference.

    python benchmarks/bench_cp.py [--seq 4096 --cp 1 2 4 --layers 2 --d-model 128 --heads 4 --repeats 3]
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import time
from typing import Any

from _common import rss_mib, saved_storages


def _worker(place: Any, queue: Any, args: dict[str, Any]) -> None:
    import torch

    from xirang_hpc.config.schema import ClusterConfig, ModelConfig, ParallelConfig, TrainConfig, XirangConfig
    from xirang_hpc.config.validate import check_runnable, validate
    from xirang_hpc.models.gpt import lm_loss
    from xirang_hpc.runtime.parallel_dims import Layout
    from xirang_hpc.runtime.parallelize import parallelize

    torch.set_num_threads(1)
    place.init_process_group("gloo")
    cp, seq = place.world_size, args["seq"]
    cfg = validate(XirangConfig(
        model=ModelConfig(name="bench-cp", n_layer=args["layers"], n_head=args["heads"], d_model=args["d_model"],
                          d_ff=4 * args["d_model"], seq_len=seq, pos="rope", norm="rmsnorm", mlp="swiglu", bias=False),
        cluster=ClusterConfig(name="bench", nodes=1, tasks_per_node=cp, backend="gloo"),
        parallel=ParallelConfig(dp=1, cp=cp, pp=1), train=TrainConfig(global_batch=1, max_steps=1, warmup_steps=0)))
    check_runnable(cfg)
    topo = place.topology()
    layout = Layout.for_job(cfg.parallel, topo)
    pm = parallelize(cfg, layout, layout.build_mesh(topo))
    g = torch.Generator().manual_seed(0)  # the same sequence on every rank; each keeps its shard
    w = torch.randint(0, cfg.model.vocab_size, (1, seq + 1), generator=g)
    x, y = w[:, :-1], w[:, 1:]  # (1, seq) each
    if pm.seq_shards is not None:
        x, y = pm.seq_shards.shard(x), pm.seq_shards.shard(y)  # (1, seq/cp) each

    def step() -> None:
        lm_loss(pm.module(x), y).backward()
        pm.model.zero_grad(set_to_none=True)

    step()  # warm-up: allocator, DDP's first-iteration bookkeeping
    base = rss_mib()
    with saved_storages() as saved:
        loss = lm_loss(pm.module(x), y)
    loss.backward()
    pm.model.zero_grad(set_to_none=True)
    times = []
    for _ in range(args["repeats"]):
        torch.distributed.barrier()
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    queue.put({"rank": place.rank, "saved_mib": sum(saved.values()) / 2**20, "peak_mib": peak - base,
               "median_s": statistics.median(times)})
    torch.distributed.destroy_process_group()


def run(cp: int, args: dict[str, Any]) -> list[dict[str, Any]]:
    """``cp`` ranks on this machine; one report per rank."""
    from xirang_hpc.runtime.local_ranks import LocalRanks

    with LocalRanks(_worker, cp, (args,), timeout_s=900) as ranks:
        return sorted((ranks.get() for _ in range(cp)), key=lambda r: r["rank"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--cp", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", action="store_true", help="print the per-rank reports as JSON too")
    a = ap.parse_args()
    args = {"seq": a.seq, "layers": a.layers, "d_model": a.d_model, "heads": a.heads, "repeats": a.repeats}
    print(f"one sequence of {a.seq} tokens, {a.layers} layers x d_model {a.d_model} ({a.heads} heads), fp32, "
          "gloo ranks with 1 thread each")
    base: dict[str, float] = {}
    for cp in a.cp:
        reps = run(cp, args)
        saved = max(r["saved_mib"] for r in reps)
        peak = max(r["peak_mib"] for r in reps)
        step_s = max(r["median_s"] for r in reps)
        base = base or {"saved": saved, "peak": peak}
        print(f"cp={cp}: activations kept for backward {saved:8.1f} MiB/rank ({saved / base['saved']:.3f}x of cp=1) | "
              f"peak RSS above start {peak:8.1f} MiB/rank ({peak / max(base['peak'], 1e-9):.3f}x) | "
              f"step {step_s:.3f} s | {a.seq / step_s:,.0f} tokens/s")
        if a.json:
            print(json.dumps({"cp": cp, "ranks": reps}))


if __name__ == "__main__":
    main()
