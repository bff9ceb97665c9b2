"""Preemption cost on the Slurm testbed: work lost, signal -> durable checkpoint, restart -> first step.

Submits one 2-node x 2-rank tiny-GPT job to the preemptible `low` partition, preempts it K times
with `high` jobs that fill both nodes, and reads the run's event log. Side by side with the same
run's numbers, the baseline "periodic checkpoints only, no save on the stop signal" (what a job
without our handler gets: Slurm kills it after GraceTime and the rerun resumes from the last
periodic checkpoint) is computed from the same stop steps: lost = stop step mod checkpoint.every_steps.

    tools/slurm-testbed start   # then
    SLURM_CONF=/tmp/xirang-slurm/slurm.conf python benchmarks/bench_slurm_requeue.py --preemptions 3
"""

from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from xirang_hpc.monitor.events import read_events


def _ev(run: Path, kind: str) -> list[dict]:
    return [e for e in read_events(run) if e.get("kind") == kind]


def _wait(pred, timeout: float) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return
        time.sleep(0.3)
    raise TimeoutError("benchmark run did not progress")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preemptions", type=int, default=3)
    ap.add_argument("--every", type=int, default=25, help="checkpoint.every_steps")
    ap.add_argument("--steps", type=int, default=120)
    ap.add_argument("--data", default="data/stdlib-bytes")
    ap.add_argument("--no-start-now", action="store_true", help="Slurm's own BeginTime delay after a requeue")
    a = ap.parse_args()
    runs = Path(tempfile.mkdtemp(prefix="bench-slurm-"))
    cmd = [sys.executable, "-c", "from xirang_hpc.cli.train import main; main()", "cluster=testbed",
           "requeue=testbed", f"requeue.budget_burst={a.preemptions + 1}", "train.priority=exploratory",
           f"train.max_steps={a.steps}", "train.warmup_steps=2", "train.log_every=1", "train.eval_batches=2",
           "parallel.pp=1",
           f"checkpoint.every_steps={a.every}", f"requeue.start_now={not a.no_start_now}",
           f"data.out_dir={Path(a.data).absolute()}", f"train.runs_root={runs}"]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    run = Path(re.search(r"run dir (\S+)", out).group(1))
    for k in range(a.preemptions):
        # Preempt 7 steps after each (re)start, so the stop step is not a checkpoint step.
        _wait(lambda k=k: any(e["restart"] == k for e in _ev(run, "start")), 400)
        base = next(e["step"] for e in _ev(run, "start") if e["restart"] == k)
        _wait(lambda b=base: _progress(run) >= b + 7, 300)
        subprocess.run(["sbatch", "-p", "high", "-N2", "--ntasks-per-node=8", "-o", "/dev/null", "--wrap", "sleep 1"],
                       check=True, capture_output=True)
        _wait(lambda k=k: any(e["restart"] == k for e in _ev(run, "requeue")), 120)
    _wait(lambda: any(e.get("final") for e in _ev(run, "exit")), 900)
    stops, starts, firsts, requeues = _ev(run, "stop"), _ev(run, "start"), _ev(run, "first_step"), _ev(run, "requeue")
    rows = []
    for i, s in enumerate(stops):
        nxt = next(e for e in starts if e["restart"] == i + 1)
        first = next(e for e in firsts if e["restart"] == i + 1)
        rows.append({
            "stop_step": s["step"], "resumed_at": nxt["step"], "lost": s["step"] - nxt["step"],
            "baseline_lost": s["step"] % a.every, "sig_to_durable": s["signal_to_durable_s"],
            "proc_to_first_step": first["since_process_start_s"],
            "requeue_to_first_step": first["time"] - requeues[i]["time"],
        })
    print("| preemption | stop step | resumed at | steps lost (ours) | steps lost (periodic only) | "
          "signal -> durable ckpt (s) | process start -> first step (s) | requeue -> first step (s) |")
    print("|---|---|---|---|---|---|---|---|")
    for i, r in enumerate(rows):
        print(f"| {i + 1} | {r['stop_step']} | {r['resumed_at']} | {r['lost']} | {r['baseline_lost']} | "
              f"{r['sig_to_durable']:.2f} | {r['proc_to_first_step']:.1f} | {r['requeue_to_first_step']:.1f} |")
    med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    print(f"| median | | | {med['lost']} | {med['baseline_lost']} | {med['sig_to_durable']:.2f} | "
          f"{med['proc_to_first_step']:.1f} | {med['requeue_to_first_step']:.1f} |")
    print(f"final status: {[e['status'] for e in _ev(run, 'exit') if e.get('final')]}; run dir {run}")


def _progress(run: Path) -> int:
    steps = [e.get("step", 0) for e in read_events(run)]
    metrics = run / "metrics.jsonl"
    if metrics.exists():
        import json

        steps += [json.loads(line).get("step", 0) for line in metrics.read_text().splitlines() if line.strip()]
    return max(steps, default=0)


if __name__ == "__main__":
    main()
