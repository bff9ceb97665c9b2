"""Planner benchmark: accuracy on the public rows, search time at 1,024 / 16,384 GPUs, and the
calibrated CPU model against real runs of every runnable layout on 4 local gloo ranks.

    python benchmarks/bench_planner.py [--repeats 5]
    xirang-plan --calibrate cluster=local --out /tmp/local-calibrated.yaml
    python benchmarks/bench_planner.py --local /tmp/local-calibrated.yaml [--steps 8]
    python benchmarks/bench_planner.py --moe   # the mixture-of-experts rows only, and a search with ep

``--local``: for model tiny and a small GPT (d 256, 4 layers), on 2 virtual nodes x 2 ranks, the
fastest plan the planner predicts for each runnable (dp, tp, pp, ZeRO) layout is trained for real
(Trainer, one gloo group, 1 thread per rank); per layout it prints predicted vs measured step time
(median over steps of the slowest rank) and peak RSS per rank (max over ranks), and the planner's
choice against the best measured layout.

Prints, for each Narayanan et al. SC21 Table 1 row, the predicted TFLOP/s/GPU of the published
configuration next to the published figure, and the recommended plan's speed-up over it (both
predicted); then the median wall time of a full search over GPT-3 175B on 1,024 and 16,384 A100s,
and over Llama 3.1 405B (126 layers: most pipeline sizes split it unevenly, all of them searched)
on 1,024 and 16,384 H100s.
The baselines for search time are published figures, not runs: DeepSpeed autotuning ~27 min of
trial runs, Alpa ~40 min of compilation, Calculon ~1 s per configuration (anchors.md).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from xirang_hpc.planner.cost import Plan, Problem, estimate
from xirang_hpc.planner.formulas import Shape
from xirang_hpc.planner.hardware import PRESETS
from xirang_hpc.planner.published import STACKS
from xirang_hpc.planner.search import search

ROWS = [
    (1.7, 24, 2304, 24, 1, 1, 32, 512, 137),
    (18.4, 48, 6144, 40, 8, 1, 256, 1024, 135),
    (145.6, 96, 12288, 80, 8, 8, 1536, 2304, 148),
    (1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 163),
]


def main() -> None:
    """Run both parts and print tables."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--local", default="", help="calibrated cluster preset YAML: run the local comparison only")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--models", default="tiny,small")
    ap.add_argument("--moe", action="store_true",
                    help="only the held-out mixture-of-experts rows and the search time with ep in the space")
    ap.add_argument("--fit", action="store_true",
                    help="refit the FSDP, Megatron-Core and DeepSpeed ZeRO-3 stacks' constants on the fit rows")
    args = ap.parse_args()
    if args.fit:
        from xirang_hpc.planner.published import fit_a100, fit_deepspeed_zero3, fit_h100, fit_megatron_core

        a100 = fit_a100()
        print("A100 FSDP:", {k: round(v, 3) for k, v in a100.items()})
        print("H100 FSDP:", {k: round(v, 3) for k, v in fit_h100(a100).items()})
        print("H100 Megatron-Core overlap:", {k: round(v, 3) for k, v in fit_megatron_core().items()})
        print("A100 DeepSpeed ZeRO-3:", {k: round(v, 3) for k, v in fit_deepspeed_zero3().items()})
        return
    if args.moe:
        moe_report(args.repeats)
        return
    if args.local:
        from bench_planner_local import run_local

        run_local(Path(args.local), args.models.split(","), args.steps)
        return
    # Megatron-LM 2021 materialized attention scores and recomputed whole blocks.
    hw = STACKS[("a100-80gb", "megatron2021")]
    print("| params | published TFLOP/s | predicted | error | recommended plan | predicted speed-up |")
    print("|---|---|---|---|---|---|")
    errs = []
    for params, a, h, nl, t, p, n, batch, ref in ROWS:
        sh = Shape(layers=nl, hidden=h, heads=a, seq=2048, vocab=51200, ffn=4 * h)
        pb = Problem(sh, hw, n // 8, 8, batch)
        pub = estimate(pb, Plan(dp=n // (t * p), tp=t, pp=p, micro=1, recompute="full"))
        best = search(pb).best
        err = pub.tflops_per_gpu / ref - 1
        errs.append(abs(err))
        print(f"| {params}B | {ref} | {pub.tflops_per_gpu:.1f} | {100 * err:+.1f}% | {best.plan.label()} | "
              f"{best.tokens_per_s / pub.tokens_per_s:.2f}x |")
    print(f"mean |error| {100 * statistics.mean(errs):.1f}%, max {100 * max(errs):.1f}%\n")
    validation_table()
    print("held-out mixture-of-experts rows, H100-80GB (out-of-sample, nothing fitted on them):")
    moe_report(1)
    print()
    gpt3 = Shape(layers=96, hidden=12288, heads=96, seq=2048, vocab=51200, ffn=4 * 12288)
    # Llama 3.1 405B (Meta 2024, table 3): GQA with 8 kv heads, SwiGLU 53248, untied 128256 vocab, 8K context, no
    # dropout.
    llama = Shape(layers=126, hidden=16384, heads=128, seq=8192, vocab=128256, ffn=53248, swiglu=True, bias=False,
                  learned_pos=False, kv_heads=8, tied=False, dropout=False)
    print("| model | GPUs | global batch | plans evaluated | median search time | target |")
    print("|---|---|---|---|---|---|")
    cases = [("GPT-3 175B", gpt3, hw, 1024, 1536, 1.0), ("GPT-3 175B", gpt3, hw, 16384, 1536, 10.0),
             ("GPT-3 175B", gpt3, hw, 16384, 16384, 10.0), ("Llama 3.1 405B", llama, PRESETS["h100"], 1024, 2048, 1.0),
             ("Llama 3.1 405B", llama, PRESETS["h100"], 16384, 2048, 10.0)]
    for name, sh, hw_, gpus, batch, target in cases:
        pb = Problem(sh, hw_, gpus // 8, 8, batch)
        times = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            res = search(pb)
            times.append(time.perf_counter() - t0)
        med = statistics.median(times)
        print(f"| {name} | {gpus} | {batch} | {res.evaluated} | {1e3 * med:.0f} ms | < {target:g} s "
              f"({target / med:.0f}x margin) |")


def moe_report(repeats: int) -> None:
    """The MoE rows (predicted with their per-term breakdown) and a search of Qwen3-235B-A22B on 256 H100s with
    ep in the space."""
    from xirang_hpc.planner.published import MOE_H100, _problem, hardware_for, plan_for, predict

    print("| row | published tokens/s/GPU | predicted | error | predicted step: compute / EP all-to-all / DP / "
          "other (s) |")
    print("|---|---|---|---|---|")
    errs = []
    for r in MOE_H100:
        est = estimate(_problem(r, hardware_for(r)), plan_for(r))
        t = est.time
        other = t["total"] - t["compute"] - t["ep_comm"] - t["dp_comm"]
        err = predict(r) / r.value - 1
        if not r.excluded:
            errs.append(abs(err))
        note = f" (excluded: {r.excluded})" if r.excluded else ""
        print(f"| {r.name}{note} | {r.value:g} | {predict(r):.0f} | {100 * err:+.1f}% | {t['compute']:.1f} / "
              f"{t['ep_comm']:.1f} / {t['dp_comm']:.1f} / {other:.1f} |")
    print(f"held-out MoE rows: mean |error| {100 * statistics.mean(errs):.1f}%, max {100 * max(errs):.1f}% "
          f"over {len(errs)} rows\n")
    sh = MOE_H100[0].shape
    pb = Problem(sh, hardware_for(MOE_H100[0]), 32, 8, 2048)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        res = search(pb)
        times.append(time.perf_counter() - t0)
    best = res.best
    print(f"search, Qwen3-235B-A22B on 256 H100 (ep in the space): {res.evaluated} plans in "
          f"{1e3 * statistics.median(times):.0f} ms (median of {repeats}); best {best.plan.label()}: "
          f"{best.tokens_per_s / 256:.0f} tokens/s/GPU predicted")


def validation_table() -> None:
    """Every published row (xirang_hpc/planner/published.py): the rows that set constants, then the held-out
    rows predicted without refitting, each group with its mean and max |error|."""
    from xirang_hpc.planner.published import ALL, is_original_held_out, plan_for, predict

    groups = [("fit", "rows that set the constants (in-sample)", lambda r: True),
              ("held-out", "held-out rows, A100-80GB (out-of-sample, nothing refitted)", lambda r: r.gpu != "h100"),
              ("held-out", "held-out rows, H100-80GB (out-of-sample, nothing refitted)", lambda r: r.gpu == "h100")]
    units = {"tflops": "TFLOP/s/GPU", "megatron_tflops": "model TFLOP/s/GPU", "model_tflops": "model TFLOP/s/GPU",
             "tokens_per_gpu": "tokens/s/GPU"}
    for role, title, keep in groups:
        rows = [r for r in ALL if r.role == role and keep(r)]
        print(f"{title}:\n| source | run | GPUs | metric | published | predicted | error |")
        print("|---|---|---|---|---|---|---|")
        errs: dict[str, list[float]] = {}
        for r in rows:
            pred = predict(r)
            err = pred / r.value - 1
            errs.setdefault(f"{r.source}, every row", []).append(err)
            if not r.excluded:
                errs.setdefault(r.source, []).append(err)
            if role == "held-out" and is_original_held_out(r) and not r.excluded:
                errs.setdefault("of these, the rows also held out before", []).append(err)
            note = f" (excluded: {r.excluded})" if r.excluded else ""
            note += f" [unpublished knobs: {plan_for(r).label()}]" if r.free_knobs else ""
            print(f"| {r.source} | {r.name}{note} | {r.gpus} | {units[r.metric]} | {r.value:g} | {pred:.0f} | "
                  f"{100 * err:+.1f}% |")
        errs = {k: v for k, v in errs.items() if not k.endswith(", every row") or len(v) != len(errs[k[:-11]])}
        for src, e in errs.items():
            print(f"{role} {src}: mean |error| {100 * statistics.mean(map(abs, e)):.1f}%, "
                  f"max {100 * max(map(abs, e)):.1f}% over {len(e)} rows")
        print()


if __name__ == "__main__":
    main()
