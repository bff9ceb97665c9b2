"""How long ``xirang-status RUN --goodput`` takes to compute a long run's goodput from its records.

    python benchmarks/bench_goodput_compute.py [--steps 1000000] [--disruptions 1000] [--step-s 3] [--quick]

Builds a synthetic run directory as the recording hook would leave it (monitor/goodput_hook.py): ``steps.jsonl``
with a session row per start and blocks that end at every checkpoint, after each start's first step, after each
evaluation and at least every FLUSH_S seconds, and ``events.jsonl`` with a ``dead`` event per disruption (each start
is killed at a seeded random step and the next resumes from the last checkpoint, losing the steps since). Then it
times :func:`xirang_hpc.monitor.goodput.run_goodput` (parse both files, build the timeline, the breakdown, both rolling
windows), median of ``--repeats``, next to the baseline of only parsing ``steps.jsonl`` line by line with ``json``
(what any reader of the file pays). Target: < 2 s for 1,000,000 steps and 1,000 disruptions. ``--quick``: 100,000
steps and 100 disruptions. ``--per-step`` writes one block per step (the record of a run whose steps last longer
than FLUSH_S), the worst case for the file's size.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from xirang_hpc.monitor.goodput import FLUSH_S, STEPS_FILE, run_goodput  # noqa: E402


def build(run: Path, steps: int, disruptions: int, step_s: float, every: int, eval_every: int, per_step: bool,
          seed: int = 0) -> dict[str, int]:
    """Write the synthetic run; returns its row counts and the steps executed (kept + lost)."""
    rng = random.Random(seed)
    kills = sorted(rng.sample(range(every + 1, steps), disruptions))  # the step each start dies after
    rows: list[str] = []
    events: list[str] = []
    wall, restored, pid, executed = 1.8e9, 0, 1000, 0
    flush_steps = 1 if per_step else max(1, int(FLUSH_S // step_s))
    for k in [*kills, steps]:
        pid += 1
        startup, setup = 60.0, 30.0 if restored else 5.0
        fit = wall + startup
        mono = 100.0 + setup
        rows.append(json.dumps({"kind": "session", "pid": pid, "host": "n0", "job": "4242", "time": fit, "mono": 100.0,
                                "startup_s": startup, "setup_s": setup, "eval_s": 0.0, "step": restored}))
        a = restored + 1
        dur = data = ev = save = 0.0
        n_in = 0
        for s in range(restored + 1, k + 1):
            d = step_s * (1.5 if s == restored + 1 else 1.0)
            data_s, ev_s = 0.01, (20.0 if s % eval_every == 0 else 0.0)
            save_s = 2.0 if (s - 1) % every == 0 and s - 1 > restored else 0.0
            d += ev_s + save_s + data_s
            dur, data, ev, save, n_in = dur + d, data + data_s, ev + ev_s, save + save_s, n_in + 1
            mono += d
            executed += 1
            if s == restored + 1 or s % every == 0 or ev_s or n_in >= flush_steps or s == k:
                rows.append(json.dumps({"pid": pid, "a": a, "b": s, "time": fit + mono - 100.0, "mono": mono,
                                        "dur": dur, "data": data, "eval": ev, "save": save, "med": step_s}))
                a, dur, data, ev, save, n_in = s + 1, 0.0, 0.0, 0.0, 0.0, 0
        last = fit + mono - 100.0
        if k == steps:
            rows.append(json.dumps({"kind": "end", "pid": pid, "time": last, "mono": mono, "step": k, "eval_s": 0.0}))
            break
        events.append(json.dumps({"time": last + 5.0, "kind": "dead", "reason": f"rank 3 dead at step {k}",
                                  "cause": "killed", "step": k}))
        restored = (k // every) * every
        wall = last + 5.0 + 120.0  # detection, teardown and requeue before the next process starts
    (run / STEPS_FILE).write_text("\n".join(rows) + "\n")
    (run / "events.jsonl").write_text("\n".join(events) + "\n")
    return {"rows": len(rows), "events": len(events), "executed": executed}


def main() -> int:
    """Build the run, time the computation and the parse-only baseline, print both and their ratio."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=1_000_000)
    ap.add_argument("--disruptions", type=int, default=1000)
    ap.add_argument("--step-s", type=float, default=3.0, help="seconds per step of the synthetic run")
    ap.add_argument("--every", type=int, default=200, help="checkpoint interval in steps")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--per-step", action="store_true", help="one block per step (steps longer than FLUSH_S)")
    ap.add_argument("--quick", action="store_true", help="100,000 steps, 100 disruptions, one repeat")
    a = ap.parse_args()
    if a.quick:
        a.steps, a.disruptions, a.repeats = 100_000, 100, 1
    with tempfile.TemporaryDirectory() as d:
        run = Path(d)
        t = time.perf_counter()
        info = build(run, a.steps, a.disruptions, a.step_s, a.every, eval_every=1000, per_step=a.per_step)
        built = time.perf_counter() - t
        size = (run / STEPS_FILE).stat().st_size
        base, comp = [], []
        rep = {}
        for _ in range(a.repeats):
            t = time.perf_counter()
            for line in (run / STEPS_FILE).read_text().splitlines():
                json.loads(line)
            base.append(time.perf_counter() - t)
            t = time.perf_counter()
            rep = run_goodput(run, allocations=None, now=1.8e9 + 1e9)
            comp.append(time.perf_counter() - t)
    b, c = statistics.median(base), statistics.median(comp)
    print(f"synthetic run: {a.steps:,} steps ({info['executed']:,} executed), {info['events']:,} disruptions, "
          f"{info['rows']:,} rows in {STEPS_FILE} ({size / 1e6:.1f} MB; built in {built:.1f}s)")
    print(f"{'':34}{'seconds':>10}{'ratio':>8}")
    print(f"{'baseline: json per line of steps':34}{b:>10.3f}{1.0:>8.2f}")
    print(f"{'goodput (run_goodput, all of it)':34}{c:>10.3f}{c / b if b else 0:>8.2f}")
    target = "met" if c < 2.0 else "MISSED"
    print(f"target < 2 s for 1,000,000 steps / 1,000 disruptions: {c:.3f}s at {a.steps:,} / {a.disruptions:,} "
          f"({target if (a.steps, a.disruptions) == (1_000_000, 1000) else 'not the target size'})")
    print(f"result: goodput {100 * rep['goodput']:.2f}%, {rep['disruptions']} disruptions, "
          f"{rep['steps_kept']:,} steps kept, lost {rep['badput_s']['lost_progress'] / 3600:.1f} h")
    return 0


if __name__ == "__main__":
    sys.exit(main())
