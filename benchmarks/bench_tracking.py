"""What experiment tracking costs rank 0 per logged row: metrics.jsonl alone (what the trainer always
writes) vs + TensorBoard vs + MLflow (file store in the run directory), through the real TrackingHook.

    python benchmarks/bench_tracking.py [--rows 300] [--repeats 3]

Each configuration logs the same training rows (9 scalars each, as the trainer's rows after the hook
adds TFLOP/s and memory) into a fresh run directory; medians over repeats. The ratio column is the
cost per row relative to jsonl alone; the training step between rows (log_every steps) is not timed.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from conftest import compose_cfg  # noqa: E402

from xirang_hpc.config.validate import load_config  # noqa: E402
from xirang_hpc.monitor.tracking import TrackingHook  # noqa: E402
from xirang_hpc.runtime.topology import Topology  # noqa: E402

TOPO = Topology(rank=0, world_size=1, local_rank=0, local_world_size=1, node_id=0, num_nodes=1, node_name="n0",
                master_addr="127.0.0.1", master_port=1, job_id="bench", source="local")


def one(loggers: str, rows: int) -> float:
    """Seconds per row: the hook's on_log plus the trainer's own jsonl append."""
    cfg = load_config(compose_cfg(["model=tiny", f"train.loggers=[{loggers}]", f"train.max_steps={rows}"]))
    with tempfile.TemporaryDirectory() as d:
        run = Path(d)
        trainer = SimpleNamespace(run_dir=run, state=SimpleNamespace(step=0))
        hook = TrackingHook(cfg, TOPO, run)
        hook.on_fit_start(trainer)
        path = run / "metrics.jsonl"
        t0 = time.perf_counter()
        for s in range(1, rows + 1):
            row = {"step": s, "loss": 5.0 / s, "grad_norm": 1.0, "lr": 1e-3, "tokens_per_s": 1e4, "time": time.time()}
            hook.on_log(trainer, row)
            with path.open("a") as f:  # what Trainer._record does after the hooks
                f.write(json.dumps(row) + "\n")
        dt = time.perf_counter() - t0
        hook.finished = True
        hook.close()
    return dt / rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=300)
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    confs = {"jsonl": "jsonl", "jsonl+tensorboard": "jsonl,tensorboard", "jsonl+mlflow": "jsonl,mlflow",
             "jsonl+tensorboard+mlflow": "jsonl,tensorboard,mlflow"}
    res = {name: statistics.median(one(v, a.rows) for _ in range(a.repeats)) for name, v in confs.items()}
    base = res["jsonl"]
    print(f"{'loggers':<26}{'ms/row':>10}{'vs jsonl':>10}")
    for name, t in res.items():
        print(f"{name:<26}{1e3 * t:>10.3f}{t / base:>9.1f}x")


if __name__ == "__main__":
    main()
