"""``bench_planner.py --local``: calibrated predictions vs real runs of every runnable layout (4 CPU ranks)."""

from __future__ import annotations

import os
import statistics
import time
from pathlib import Path

from xirang_hpc.config.schema import ModelConfig, TrainConfig, XirangConfig
from xirang_hpc.config.validate import validate
from xirang_hpc.planner.local_check import candidates, load_cluster, measure

MODELS = {
    "tiny": {"name": "tiny", "n_layer": 4, "n_head": 4, "d_model": 64, "d_ff": 256, "seq_len": 64},  # conf/model/tiny
    "small": {"name": "small", "n_layer": 4, "n_head": 4, "d_model": 256, "d_ff": 1024, "seq_len": 64},
}
BATCH = {"tiny": 32, "small": 16}


def base_config(preset: Path, model: str) -> XirangConfig:
    """Model + calibrated cluster + a short train section, parallel=auto."""
    cfg = XirangConfig(model=ModelConfig(**MODELS[model]), cluster=load_cluster(preset),
                       train=TrainConfig(max_steps=10, global_batch=BATCH[model], warmup_steps=2, eval_batches=1,
                                         log_every=1000))
    return validate(cfg)


def run_local(preset: Path, models: list[str], steps: int) -> None:
    """Print, per model, the predicted-vs-measured table and the planner's choice vs the best measured."""
    print(f"## bench_planner --local: preset {preset}, {steps} timed steps per layout, "
          f"load average at start {os.getloadavg()[0]:.1f}")
    for model in models:
        cfg = base_config(preset, model)
        cands = candidates(cfg)
        t0 = time.time()
        rounds: dict[str, list[float]] = {}
        meas = measure([(n, c) for n, _, c in cands], cfg.cluster.nodes, cfg.cluster.tasks_per_node, steps, rounds=3,
                       spread=rounds)
        print(f"\n### model {model} ({MODELS[model]}), global batch {BATCH[model]} "
              f"({time.time() - t0:.0f} s, load average {os.getloadavg()[0]:.1f})\n")
        print("| layout | plan | predicted step | measured step (rounds) | error | predicted peak/rank | "
              "measured peak/rank | error |")
        print("|---|---|---|---|---|---|---|---|")
        terr, merr = [], []
        for name, est, _ in cands:
            ms, mm = meas[name]
            te, me = est.step_time / ms - 1, est.peak_memory / mm - 1
            terr.append(abs(te))
            merr.append(abs(me))
            print(f"| {name} | {est.plan.label()} | {1e3 * est.step_time:.1f} ms | {1e3 * ms:.1f} ms "
                  f"({'/'.join(f'{1e3 * r:.0f}' for r in rounds[name])}) | "
                  f"{100 * te:+.0f}% | {est.peak_memory / 2**20:.0f} MiB | {mm / 2**20:.0f} MiB | {100 * me:+.0f}% |")
        choice = cands[0][0]
        best = min(meas, key=lambda k: meas[k][0])
        gap = meas[choice][0] / meas[best][0] - 1
        print(f"\nstep time |error| mean {100 * statistics.mean(terr):.0f}%, max {100 * max(terr):.0f}% "
              f"(target 25%); peak memory |error| mean {100 * statistics.mean(merr):.0f}%, "
              f"max {100 * max(merr):.0f}% (target 20%)")
        print(f"planner's choice {choice} measured {1e3 * meas[choice][0]:.1f} ms; best measured {best} "
              f"{1e3 * meas[best][0]:.1f} ms; choice is {100 * gap:+.1f}% (target within 10%)")
