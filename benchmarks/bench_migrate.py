"""Moving a preempted run to another site vs waiting for its own: preemption on A -> first step again.

Two runs of the same tiny GPT (1 node x 2 ranks, checkpoint every 25 steps) start on site alpha of the
two-cluster testbed; each is preempted by a `high` job that fills alpha for ``--hold`` seconds.

- migrate: nobody intervenes; at the preemption the job itself (its batch script's supervisor) sees that
  alpha's nodes are held by the filler, copies its newest good checkpoint and records to beta's run root
  (verified against the manifest), submits on beta with ``sbatch -M beta`` and cancels itself on alpha; the
  time runs from the stop signal to the first step on beta, with the copy's share separated.
- wait (baseline, ``cluster.site_auto_migrate=false``): the other run is requeued on alpha and waits in its
  queue until the filler ends, as Slurm's own requeue does.

    XIRANG_SLURM_CLUSTERS=alpha,beta tools/slurm-testbed start   # then
    SLURM_CONF=<dir>/slurm.conf python benchmarks/bench_migrate.py --hold 120
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from xirang_hpc.monitor.events import read_events

TRAIN = [sys.executable, "-c", "from xirang_hpc.cli.train import main; main()"]


def _ev(run: Path, kind: str) -> list[dict]:
    return [e for e in read_events(run) if e.get("kind") == kind]


def _wait(pred, timeout: float):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        got = pred()
        if got:
            return got
        time.sleep(0.3)
    raise TimeoutError("benchmark run did not progress")


def _start(root: Path, data: Path, seed: int, auto: bool = True) -> Path:
    args = ["cluster=testbed-sites", "requeue=testbed", f"data.out_dir={data}", f"train.runs_root={root / 'alpha'}",
            f"cluster.sites.0.run_root={root / 'alpha'}", f"cluster.sites.1.run_root={root / 'beta'}",
            "train.warmup_steps=2", "train.log_every=1", "train.eval_batches=2", "parallel.pp=1", "parallel.tp=1",
            "train.max_steps=200", "checkpoint.every_steps=25", f"train.seed={seed}",
            f"cluster.site_auto_migrate={str(auto).lower()}"]
    out = subprocess.run(TRAIN + args, capture_output=True, text=True, check=True).stdout
    m = re.search(r"site (\w+):.*\| run dir (\S+)", out)
    assert m and m.group(1) == "alpha", out
    return Path(m.group(2))


def _preempt(run: Path, hold_s: int) -> str:
    _wait(lambda: _ev(run, "first_step"), 600)
    out = subprocess.run(["sbatch", "--parsable", "-M", "alpha", "-p", "high", "-N2", "--exclusive", "-t",
                          str(max(1, hold_s // 60 + 1)), "-o", "/dev/null", "--wrap", f"sleep {hold_s}"],
                         capture_output=True, text=True, check=True)
    _wait(lambda: _ev(run, "stop"), 600)
    return out.stdout.strip().split(";")[0]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hold", type=int, default=120, help="seconds the filler holds site alpha")
    ap.add_argument("--data", default="data/stdlib-bytes")
    a = ap.parse_args()
    data = Path(a.data).absolute()
    root = Path(tempfile.mkdtemp(prefix="bench-migrate-"))
    # Migrate.
    run = _start(root, data, 1)
    filler = _preempt(run, a.hold)
    stop = _ev(run, "stop")[0]["time"]
    moved = root / "beta" / run.name
    mig = _wait(lambda: moved.is_dir() and _ev(moved, "migrate"), 600)[0]
    first = _wait(lambda: [e for e in _ev(moved, "first_step") if e["time"] > mig["time"]], 900)[0]["time"]
    migrate_s, copy_s, copy_b = first - stop, mig["copy_s"], mig["copy_bytes"]
    subprocess.run(["scancel", "-M", "beta", mig["job"]], check=False)
    subprocess.run(["scancel", "-M", "alpha", filler], check=False)
    # Wait for A (baseline): the same preemption, the requeued job stays in alpha's queue.
    run2 = _start(root, data, 2, auto=False)
    filler2 = _preempt(run2, a.hold)
    stop2 = _ev(run2, "stop")[0]["time"]
    first2 = _wait(lambda: [e for e in _ev(run2, "first_step") if e["time"] > stop2], a.hold + 900)[0]["time"]
    wait_s = first2 - stop2
    subprocess.run(["scancel", "-M", "alpha", filler2], check=False)
    for j in _ev(run2, "submit"):
        subprocess.run(["scancel", "-M", "alpha", str(j["job"])], check=False)
    print(f"filler holds alpha {a.hold}s; checkpoint copied: {copy_b} bytes")
    print("| path | preemption -> first step (s) | of which copy + verify (s) |")
    print("|---|---|---|")
    print(f"| the job moves itself to beta (ours) | {migrate_s:.1f} | {copy_s:.2f} |")
    print(f"| wait for alpha (Slurm requeue) | {wait_s:.1f} | - |")
    print(f"ratio wait/migrate: {wait_s / migrate_s:.2f}x")


if __name__ == "__main__":
    main()
