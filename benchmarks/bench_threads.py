"""OpenMP's wait policy for a rank: passive vs active threads, on a quiet and on a loaded machine.

One rank of the embedded default model trained by ``xirang-train`` itself (the local executor, one node x one
task, ``cluster.threads_per_rank=2``), each run a fresh job and run directory, with
``cluster.omp_wait_policy=passive`` (the default: OpenMP threads sleep between parallel regions) and ``=active``
(they spin, libgomp's own default). "loaded": while ``--load`` busy-loop processes run beside it (a node shared
with other work: another job's ranks, data loaders, a login node's users). Rounds interleave the four cases (the
order reversed every other round), so a drift of the machine's state falls on both policies; tokens/s is the
job's own ``throughput`` line (its steps, start-up excluded) and the ratios are medians of per-round ratios.

Run:  python benchmarks/bench_threads.py [--steps 60] [--rounds 3] [--load 4]
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BIN = Path(sys.executable).parent
POLICIES = ("passive", "active")


def train(workdir: Path, name: str, policy: str, steps: int) -> float:
    """One single-rank training job with ``policy``; its tokens/s."""
    cmd = [str(BIN / "xirang-train"), "cluster.nodes=1", "cluster.tasks_per_node=1", "cluster.threads_per_rank=2",
           "parallel.dp=1", "parallel.pp=1", f"cluster.omp_wait_policy={policy}", f"train.max_steps={steps}",
           f"train.run_dir={workdir / name}", "checkpoint.enabled=false", f"train.eval_every={10 * steps}",
           "train.warmup_frac=0.1"]
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}  # the job sets it, as on a cluster
    r = subprocess.run(cmd, cwd=workdir, env=env, capture_output=True, text=True, timeout=1800)
    out = r.stdout + r.stderr
    m = re.search(r"throughput\s+([\d,]+) tokens/s", out)
    if r.returncode != 0 or m is None:
        raise SystemExit(f"{' '.join(cmd)} failed (exit {r.returncode}):\n{out[-3000:]}")
    return float(m.group(1).replace(",", ""))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=60, help="training steps per job")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds")
    ap.add_argument("--load", type=int, default=4, help="busy-loop processes beside the loaded runs")
    a = ap.parse_args()
    res: dict[tuple[str, str], list[float]] = {(c, p): [] for c in ("quiet", "loaded") for p in POLICIES}
    print(f"one rank of the embedded default, 2 threads, {a.steps} steps per job; loaded = {a.load} busy loops; "
          f"{os.cpu_count()} CPUs; {a.rounds} round(s)", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        train(work, "warm-up", "passive", 10)  # prepares the embedded data once, outside the timings
        n = 0
        for rnd in range(a.rounds):
            for cond in ("quiet", "loaded") if rnd % 2 == 0 else ("loaded", "quiet"):
                busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(a.load)] \
                    if cond == "loaded" else []
                try:
                    time.sleep(1.0 if busy else 0.0)
                    for pol in POLICIES if rnd % 2 == 0 else POLICIES[::-1]:
                        n += 1
                        tps = train(work, f"run-{n}", pol, a.steps)
                        res[(cond, pol)].append(tps)
                        print(f"  round {rnd} {cond:6s} {pol:7s} {tps:>10,.0f} tok/s  (load average "
                              f"{os.getloadavg()[0]:.1f})", flush=True)
                finally:
                    for p in busy:
                        p.kill()
                        p.wait()
    for cond in ("quiet", "loaded"):
        ratios = [p / q for p, q in zip(res[(cond, "passive")], res[(cond, "active")], strict=True)]
        print(f"{cond}: passive {statistics.median(res[(cond, 'passive')]):,.0f} tok/s, active "
              f"{statistics.median(res[(cond, 'active')]):,.0f} tok/s; passive / active "
              f"{statistics.median(ratios):.2f}x (rounds {min(ratios):.2f}-{max(ratios):.2f})")


if __name__ == "__main__":
    main()
