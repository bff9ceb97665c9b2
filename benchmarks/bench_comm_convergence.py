#!/usr/bin/env python3
"""Budget mode's cost in quality: validation loss with cross-node sync every H steps vs every step.

    .venv/bin/python benchmarks/bench_comm_convergence.py --steps 200 --periods 1 8 -- data.out_dir=/tmp/xirang-data

Runs the real ``xirang-train`` (submitit local executor, 2 virtual nodes x 2 gloo ranks, pure data
parallelism so DDP carries the hierarchical hook) once per ``comm.sync_period`` with everything
else equal (model=tiny, same seed and data), and prints each run's final validation loss and its
ratio to H=1. Target: H=8 within 3% of H=1.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path


def run(period: int, steps: int, outer: str, runs_root: Path, extra: list[str]) -> dict[str, float]:
    """One ``xirang-train`` run; returns initial and final val loss and tokens/s."""
    exe = Path(sys.executable).parent / "xirang-train"
    args = [str(exe), "parallel.pp=1", "parallel.tp=1", "parallel.microbatches=1", f"train.max_steps={steps}",
            f"train.log_every={steps}", "checkpoint.enabled=false", "monitor.enabled=false",
            f"comm.sync_period={period}", f"comm.outer_optimizer={outer}", f"train.runs_root={runs_root}", *extra]
    r = subprocess.run(args, capture_output=True, text=True, timeout=3600)
    if r.returncode != 0:
        raise RuntimeError(f"H={period} failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    m = re.search(r"validation loss\s+([\d.]+) -> ([\d.]+)", r.stdout)
    tok = re.search(r"throughput\s+([\d,]+) tokens/s", r.stdout)
    assert m and tok, r.stdout[-2000:]
    run_dir = next(p for p in runs_root.iterdir() if p.is_dir())
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    vals = [row["val_loss"] for row in rows if "val_loss" in row]
    return {"initial": float(m.group(1)), "final": float(vals[-1]),
            "tokens_per_s": float(tok.group(1).replace(",", ""))}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--periods", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--outer", default="average", choices=["average", "nesterov"])
    ap.add_argument("overrides", nargs="*", help="extra xirang-train overrides (e.g. data.out_dir=...)")
    a = ap.parse_args()
    res = {}
    with tempfile.TemporaryDirectory(prefix="xirang-conv-") as tmp:
        for h in a.periods:
            res[h] = run(h, a.steps, a.outer, Path(tmp) / f"H{h}", a.overrides)
            print(f"H={h:<3} val loss {res[h]['initial']:.4f} -> {res[h]['final']:.4f}   "
                  f"{res[h]['tokens_per_s']:,.0f} tok/s", flush=True)
    base = res[a.periods[0]]["final"]
    print(f"\nmodel=tiny, {a.steps} steps, 2 virtual nodes x 2 ranks, outer={a.outer}")
    print(f"{'H':>4} {'final val loss':>15} {'vs H=' + str(a.periods[0]):>10}")
    for h, r in res.items():
        print(f"{h:>4} {r['final']:>15.4f} {r['final'] / base - 1:>+10.2%}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
