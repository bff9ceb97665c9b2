"""Scaling laws: the published law against the Chinchilla paper's table, the fit's cost, the target plan's answer time.

    python benchmarks/bench_scaling.py            # everything (full-grid fit with 200 bootstrap refits)
    python benchmarks/bench_scaling.py --quick    # table check, one fit with 20 refits, one timing each
    python benchmarks/bench_scaling.py --runs RUNS_ROOT --sweep NAME --heldout RUN_DIR [RUN_DIR ...]
        # the fit of a real sweep's finished runs (as xirang-plan --fit-scaling fits them), and its prediction of
        # each held-out run (a larger model trained for real) against the run's measured final validation loss

1. Table check: the compute-optimal N and D of the default law at each FLOP budget of Hoffmann et al.'s
   Table 3, against Table 3's N and D. The default splits compute as their Approach 1 (Table 2: both
   exponents 0.50) at Chinchilla's 20 tokens per parameter; printed beside it, the closed-form optimum of
   the eq. (10) coefficients (exponent a = beta/(alpha+beta) = 0.45) and of Besiroglu et al.'s 2024 refit
   of the same data (a = 0.513), which show what the exponent alone does over nine decades.
2. Fit: Hoffmann's full grid (4,500 L-BFGS starts) plus bootstrap refits on a synthetic 5 x 4 sweep.
3. Answer time: ``xirang-plan target.loss=...`` (the search included) beside the plain
   ``xirang-plan`` of a fixed model on the same cluster, wall seconds side by side, and their ratio.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from xirang_hpc.planner.scaling import CHINCHILLA, Point, ScalingLaw
from xirang_hpc.planner.scaling_fit import fit

# Hoffmann et al. 2022, Table 3 ("Estimated optimal training FLOPs and training tokens for various model
# sizes", Approach 1): (parameters, FLOPs, tokens).
TABLE3 = [(400e6, 1.92e19, 8.0e9), (1e9, 1.21e20, 20.2e9), (10e9, 1.23e22, 205.1e9), (67e9, 5.76e23, 1.5e12),
          (175e9, 3.85e24, 3.7e12), (280e9, 9.90e24, 5.9e12), (520e9, 3.43e25, 11.0e12), (1e12, 1.27e26, 21.2e12),
          (10e12, 1.30e28, 216.2e12)]


# Besiroglu, Erdil, Barnett and You, "Chinchilla Scaling: A replication attempt" (Epoch AI, 2024,
# arXiv:2404.10102), their Approach 3 refit of Hoffmann et al.'s data: E, A, B, alpha, beta.
BESIROGLU = ScalingLaw(E=1.8172, A=482.01, B=2085.43, alpha=0.3478, beta=0.3658)


def _devs(law: ScalingLaw) -> list[tuple[float, float]]:
    return [(law.optimal(c)[0] / n - 1, law.optimal(c)[1] / d - 1) for n, c, d in TABLE3]


def table_check() -> None:
    law = CHINCHILLA
    eq10 = dataclasses.replace(CHINCHILLA, tokens_per_param=0.0)
    print("1. Chinchilla table check: the default law's compute-optimal N and D vs Hoffmann et al. Table 3")
    print(f"   {'FLOPs':>9} {'Table 3 N':>10} {'default N':>10} {'dev':>7} {'Table 3 D':>10} {'default D':>10} "
          f"{'dev':>7} | {'eq.(10) N':>9} {'refit N':>8}")
    rows = zip(TABLE3, _devs(law), _devs(eq10), _devs(BESIROGLU), strict=True)
    for (n, c, d), (dn, dd), (en, _), (bn, _) in rows:
        ln, ld = law.optimal(c)
        print(f"   {c:9.3g} {n:10.3g} {ln:10.3g} {100 * dn:+6.1f}% {d:10.3g} {ld:10.3g} {100 * dd:+6.1f}% | "
              f"{100 * en:+8.1f}% {100 * bn:+7.1f}%")
    for name, lw in (("default (Approach 1 split, 20 tokens/parameter)", law), ("eq. (10) closed form", eq10),
                     ("Besiroglu et al. refit, closed form", BESIROGLU)):
        devs = [max(abs(a), abs(b)) for a, b in _devs(lw)]
        within = sum(x <= 0.10 for x in devs)
        print(f"   {name}: N and D within 10% at {within} of {len(devs)} budgets; max |deviation| "
              f"{100 * max(devs):.1f}%")


def fit_check(quick: bool) -> None:
    truth = ScalingLaw(E=1.8, A=300.0, B=800.0, alpha=0.35, beta=0.30)
    rng = np.random.default_rng(0)
    pts = [Point(n, d, truth.loss(n, d) * float(np.exp(rng.normal(0, 0.003))))
           for n in (1e6, 2e6, 4e6, 8e6, 16e6) for d in (2e7, 8e7, 3.2e8, 1.28e9)]
    boot = 20 if quick else 200
    t0 = time.perf_counter()
    law = fit(pts, bootstrap=boot)
    dt = time.perf_counter() - t0
    n, d = 64e6, 5.12e9  # 4x the largest size and tokens of the sweep
    print(f"2. fit: 20 points, 4500 starts + {boot} bootstrap refits in {dt:.1f} s wall")
    print(f"   {law.describe()}")
    iv = law.spread(lambda lw: lw.loss(n, d))
    span = f"95% interval {iv[0]:.4f} to {iv[1]:.4f}" if iv else "no interval"
    print(f"   4x extrapolation: predicted {law.loss(n, d):.4f} ({span}), truth {truth.loss(n, d):.4f}, "
          f"error {100 * (law.loss(n, d) / truth.loss(n, d) - 1):+.2f}%")


def real_check(root: Path, sweep: str, heldout: list[Path]) -> None:
    """Fit the sweep's runs as ``xirang-plan --fit-scaling`` does and predict each held-out run."""
    from xirang_hpc.runs.scaling import run_point, sweep_runs

    runs = sweep_runs(root, sweep)
    if runs.failed or runs.unfinished or not runs.points:
        raise SystemExit(f"sweep {sweep!r} under {root}: {len(runs.points)} finished, {len(runs.failed)} failed, "
                         f"{len(runs.unfinished)} unfinished")
    t0 = time.perf_counter()
    law = fit(runs.points, bootstrap=200)
    print(f"4. fit of {len(runs.points)} real runs ({time.perf_counter() - t0:.1f} s): {law.describe()}")
    largest = max(p.params for p in runs.points)
    for d in heldout:
        got = run_point(d)
        if isinstance(got, str):
            raise SystemExit(f"held-out run {d}: {got}")
        pred = law.loss(got.params, got.tokens)
        iv = law.spread(lambda lw, g=got: lw.loss(g.params, g.tokens))
        span = f"95% interval {iv[0]:.4f} to {iv[1]:.4f}" if iv else "no interval"
        print(f"   held-out {d.name}: N={got.params:,.0f} ({got.params / largest:.2f}x the largest fitted) "
              f"D={got.tokens:,.0f}: predicted {pred:.4f} ({span}), measured {got.loss:.4f}, error "
              f"{100 * (pred / got.loss - 1):+.2f}%")


def _wall(args: list[str], reps: int) -> float:
    exe = Path(sys.executable).parent / "xirang-plan"
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        r = subprocess.run([str(exe), *args], capture_output=True, text=True, env=dict(os.environ), timeout=600)
        best = min(best, time.perf_counter() - t0)
        assert r.returncode == 0, r.stderr[-2000:]
    return best


def answer_time(quick: bool) -> None:
    reps = 1 if quick else 3
    cluster = ["cluster=h100-ib", "cluster.nodes=64"]
    target = _wall(["model=llama3-8b", *cluster, "target.loss=2.1", "target.deadline=30d"], reps)
    base = _wall(["--top", "1", "model=llama3-8b", *cluster, "train.global_batch=512"], reps)
    print(f"3. answer time (best of {reps}, wall): xirang-plan target.loss=2.1 target.deadline=30d {target:.2f} s | "
          f"plain xirang-plan model=llama3-8b {base:.2f} s | ratio {target / base:.2f}; load average "
          f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="one fit with 20 refits, one timing each")
    ap.add_argument("--runs", type=Path, help="runs root of a finished sweep: fit it and predict --heldout")
    ap.add_argument("--sweep", default="scaling", help="the sweep's train.name (its run directories' prefix)")
    ap.add_argument("--heldout", type=Path, nargs="*", default=[], help="run directories of larger models")
    opts = ap.parse_args()
    if opts.runs:
        real_check(opts.runs, opts.sweep, opts.heldout)
        return
    table_check()
    fit_check(opts.quick)
    answer_time(opts.quick)


if __name__ == "__main__":
    main()
