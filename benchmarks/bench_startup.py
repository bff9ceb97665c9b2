"""One Slurm-style rank from its first line to its last step: start-up imports with the collector paused vs plain.

    python benchmarks/bench_startup.py [--repeats 5] [--steps 30] [--model tiny]

A Slurm task is a fresh interpreter (``cluster.preload`` forks local ranks only). Each repeat runs the same
single-rank training job twice, in fresh interpreters, in alternating order, through the job function a Slurm
rank runs (``xirang_hpc.job.entry.train_job``, as ``python -m xirang_hpc.batch.rank`` calls it) under a
torchrun-style environment of one rank:

- ours: the job as shipped: the training stack (torch, ``torch._dynamo``, DTensor, DCP, h5py and the package)
  is imported with Python's cyclic garbage collector paused and ends in the permanent generation
  (``xirang_hpc/runtime/startup.py``);
- baseline: the same job with those imports done plainly (the start-up helper replaced by
  ``importlib.import_module``), as any script that imports torch at its top does.

Each run is its own run directory (a fresh ``train.runs_root``), so both train ``--steps`` steps from scratch on
the same prepared corpus. Printed: medians of the rank's CPU time (user + system), wall time, the seconds
CPython spent in collections (timed by a ``gc.callbacks`` hook in both), the number of full collections, the
longest single collection during the run, and what one full collection costs the rank after its last step
(timed there: what any full collection during training would pause the rank for; in a job, one rank's pause
holds every rank at the next collective); the ratio is the baseline's over ours.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Run in the rank's interpreter before the job: time every collection (both variants), and for the baseline
# replace the start-up helper with plain imports. The report goes to the file named by argv[2].
RANK = """
import gc, json, sys, time
spent, starts, full, longest = [0.0], [0.0], [0], [0.0]
def timer(phase, info):
    if phase == "start":
        starts[0] = time.perf_counter()
        full[0] += info["generation"] == 2
    else:
        took = time.perf_counter() - starts[0]
        spent[0] += took
        longest[0] = max(longest[0], took)
gc.callbacks.append(timer)
if sys.argv[3] == "plain":
    import importlib
    import xirang_hpc.runtime.startup as startup
    def plain(names):
        for name in names:
            importlib.import_module(name)
        return []
    startup.import_paused = plain
from xirang_hpc.batch.rank import main
main(["--config", sys.argv[1]])
gc.callbacks.clear()
t = time.perf_counter()
gc.collect()  # what any full collection during training costs this rank from now on
after_ms = (time.perf_counter() - t) * 1000
with open(sys.argv[2], "w") as f:
    json.dump({"gc_s": spent[0], "full": full[0], "longest_ms": longest[0] * 1000, "full_after_ms": after_ms}, f)
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _job_file(work: Path, name: str, steps: int, model: str) -> Path:
    """A validated single-rank config with its own runs root, and the prepared corpus, as xirang-sbatch writes."""
    from hydra import compose, initialize_config_dir

    from xirang_hpc.cli.sbatch import CONFIG_FILE, write_job_files
    from xirang_hpc.cli.train import _ensure_data
    from xirang_hpc.config.validate import check_runnable, load_config
    from xirang_hpc.submit.hydra_setup import register_configs
    from xirang_hpc.submit.preflight import open_run_dir

    register_configs()
    overrides = [f"model={model}", "cluster.nodes=1", "cluster.tasks_per_node=1", "parallel.pp=1",
                 f"train.max_steps={steps}", f"train.warmup_steps={min(steps, 5)}", f"train.runs_root={work / name}",
                 f"data.out_dir={work / 'data'}"]
    with initialize_config_dir(config_dir=str(ROOT / "xirang_hpc" / "conf"), version_base="1.3"):
        cfg = load_config(compose(config_name="config", overrides=overrides))
    check_runnable(cfg)
    run_dir = open_run_dir(cfg)
    write_job_files(cfg, run_dir, _ensure_data(cfg))
    return run_dir / CONFIG_FILE


def _run(job: Path, variant: str, work: Path) -> dict[str, float]:
    env = {**os.environ, "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
           "GROUP_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port())}
    report = work / f"report-{variant}.json"
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-c", RANK, str(job), str(report), variant], env=env, check=True,
                   stdout=subprocess.DEVNULL, timeout=1800)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {"cpu_s": cpu, "wall_s": wall, **json.loads(report.read_text())}


def main() -> None:
    """Run both variants ``--repeats`` times, alternating, and print medians and ratios."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--model", default="tiny")
    a = ap.parse_args()
    results: dict[str, list[dict[str, float]]] = {"paused": [], "plain": []}
    with tempfile.TemporaryDirectory(prefix="xirang-bench-startup-") as tmp:
        work = Path(tmp)
        for i in range(a.repeats):
            order = ("paused", "plain") if i % 2 == 0 else ("plain", "paused")
            for variant in order:
                job = _job_file(work, f"runs-{variant}-{i}", a.steps, a.model)
                results[variant].append(_run(job, variant, work))
    print(f"one rank, model={a.model}, {a.steps} steps, {a.repeats} repeats (medians); "
          f"{os.cpu_count()} CPUs, Python {sys.version.split()[0]}")
    print(f"{'':>26} {'CPU s':>8} {'wall s':>8} {'in GC s':>8} {'full GCs':>9} {'longest GC ms':>14} "
          f"{'full GC after, ms':>18}")
    med = {v: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for v, rs in results.items()}
    for variant, label in (("paused", "ours (collector paused)"), ("plain", "baseline (plain imports)")):
        m = med[variant]
        print(f"{label:>26} {m['cpu_s']:8.2f} {m['wall_s']:8.2f} {m['gc_s']:8.2f} {m['full']:9.0f} "
              f"{m['longest_ms']:14.1f} {m['full_after_ms']:18.1f}")
    print(f"ratio baseline/ours: CPU {med['plain']['cpu_s'] / med['paused']['cpu_s']:.2f}x, "
          f"wall {med['plain']['wall_s'] / med['paused']['wall_s']:.2f}x; "
          f"CPU saved per rank start {med['plain']['cpu_s'] - med['paused']['cpu_s']:.2f} s")


if __name__ == "__main__":
    main()
