"""Hang detection time: the adaptive bound (defaults) vs the old fixed ``monitor.hang_s=300`` everywhere.

Local 4-rank tiny-GPT runs (2 virtual nodes x 2 ranks, gloo), submitted as ``xirang-train`` submits
them (submitit's LocalExecutor), one after another in one invocation: ``--runs`` with the defaults
(``hang_k=20``, ``hang_min_s=10``, ``hang_s=300``) and ``--fixed-runs`` with ``hang_k=0`` (the fixed
300 s bound of every phase, as before), both with the collective rule (``monitor.collective_timeout_s``)
off, so that each measures its own bound. Each run trains until every rank has timed ``--at`` steps,
then rank 3 (the second node) gets SIGSTOP; measured: SIGSTOP -> the watchdog's ``hang`` event
naming the rank (its time stamp in events.jsonl). Prints the median per mode and the ratio.

    python benchmarks/bench_hang.py --data data/stdlib-bytes     # ~10 min on 2 cores (the fixed run waits 300 s)
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import signal
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from hydra import compose, initialize_config_dir

from xirang_hpc.config.validate import load_config
from xirang_hpc.job.training import run_training
from xirang_hpc.monitor.events import read_events
from xirang_hpc.monitor.heartbeat import read_heartbeats
from xirang_hpc.submit.executors import make_executor
from xirang_hpc.submit.hydra_setup import register_configs
from xirang_hpc.submit.rundir import make_private_dir, run_dir_for

CONF_DIR = str(Path(__file__).resolve().parents[1] / "xirang_hpc" / "conf")
# The step-multiple rules are measured with the collective rule (monitor.collective_timeout_s, on by default)
# off, so each mode measures its own bound; the collective rule's own test runs 60-s steps
# (tests/test_monitor_hang.py).
MODES = {"adaptive": ["monitor.collective_timeout_s=0"],
         "fixed 300 s": ["monitor.hang_k=0", "monitor.hang_s=300", "monitor.collective_timeout_s=0"]}


def _cfg(overrides: list[str]) -> Any:
    register_configs()
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        return load_config(compose(config_name="config", overrides=overrides))


def _kill_all(job: Any, beats: dict[int, dict[str, Any]]) -> None:
    pids = {job._process.pid} | {int(b["pid"]) for b in beats.values()}
    pids |= {int(b["watchdog_pid"]) for b in beats.values() if "watchdog_pid" in b}
    for pid in pids:
        for sig in (signal.SIGCONT, signal.SIGKILL):
            try:
                os.kill(pid, sig)
            except OSError:
                pass


def one_run(mode: str, data: Path, root: Path, at: int, timeout_s: float) -> dict[str, Any]:
    """Train, SIGSTOP rank 3 once ``at`` steps are timed everywhere, wait for the hang event."""
    cfg = _cfg(["train.max_steps=100000", f"train.run_dir={root / f'{mode.split()[0]}-{time.time_ns()}'}",
                f"data.out_dir={data}", "train.log_every=10", "train.eval_batches=2", "cluster.time_min=15",
                *MODES[mode]])
    run_dir = make_private_dir(run_dir_for(cfg))
    job = make_executor(cfg.cluster, run_dir / "submitit").submit(
        run_training, dataclasses.asdict(cfg), str(run_dir), str(data))
    beats: dict[int, dict[str, Any]] = {}
    try:
        deadline = time.time() + 900
        while time.time() < deadline:
            beats = read_heartbeats(run_dir)
            if len(beats) == 4 and all(b["step"] >= at for b in beats.values()):
                break
            if job.done():
                raise RuntimeError(f"{mode}: job ended before step {at}: {job.exception()}")
            time.sleep(0.2)
        else:
            raise RuntimeError(f"{mode}: no step {at} in 900 s")
        pid = int(beats[3]["pid"])
        t_stop = time.time()
        os.kill(pid, signal.SIGSTOP)
        while time.time() < t_stop + timeout_s:
            ev = [e for e in read_events(run_dir) if e["kind"] == "hang"]
            if ev:
                e = ev[0]
                return {"mode": mode, "detect_s": e["time"] - t_stop, "rank": e["rank"], "bound_s": e.get("bound_s"),
                        "named": e["cause"].startswith(f"rank 3 (node vnode1, pid {pid}) did not reach"),
                        "cause": e["cause"]}
            time.sleep(0.1)
        raise RuntimeError(f"{mode}: no hang event {timeout_s} s after SIGSTOP")
    finally:
        _kill_all(job, read_heartbeats(run_dir) or beats)


def main() -> None:
    """Run the modes, print the rows and the ratio of the medians."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", default="data/stdlib-bytes")
    ap.add_argument("--runs", type=int, default=3, help="runs with the adaptive bound (the median is reported)")
    ap.add_argument("--fixed-runs", type=int, default=1, help="runs with the fixed 300 s bound")
    ap.add_argument("--at", type=int, default=8, help="SIGSTOP once every rank completed this many steps")
    a = ap.parse_args()
    data = Path(a.data).absolute()
    if not data.is_dir() or not any(data.iterdir()):
        raise SystemExit(f"--data {data}: no prepared data; run `xirang-prepare` (data.corpus=stdlib) first")
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-hang-") as tmp:
        for mode, n in (("adaptive", a.runs), ("fixed 300 s", a.fixed_runs)):
            for i in range(n):
                r = one_run(mode, data, Path(tmp), a.at, timeout_s=420)
                rows.append(r)
                print(f"{mode:12s} run {i + 1}: hang named {r['detect_s']:6.1f} s after SIGSTOP "
                      f"(bound {r['bound_s']} s, rank {r['rank']}, named: {r['named']})", flush=True)
    med = {m: statistics.median(r["detect_s"] for r in rows if r["mode"] == m) for m in MODES if
           any(r["mode"] == m for r in rows)}
    print("\n| bound | runs | SIGSTOP -> hang named (s, median) | vs fixed |")
    print("|---|---|---|---|")
    for m, v in med.items():
        ratio = f"{v / med['fixed 300 s']:.3f}x" if "fixed 300 s" in med else "n/a"
        print(f"| {m} | {sum(r['mode'] == m for r in rows)} | {v:.1f} | {ratio} |")
    print("\nexample cause:", rows[0]["cause"])


if __name__ == "__main__":
    main()
