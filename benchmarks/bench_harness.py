"""lm-evaluation-harness wall time: against xirang-serve (``local-completions``) vs lm_eval's own ``hf`` backend.

The same model both ways: a run trained here (``xirang-train``, its own BPE tokenizer) and exported with
``xirang-ckpt export --format hf``; the same shipped local tasks (``xirang_heldout_mc``, ``xirang_heldout_gen``,
the run's held-out text), the same document limit, the same torch intra-op threads (the server in this process,
lm_eval's ``hf`` model in its child). Each side runs ``--repeat`` times; the median wall time of a whole
harness run (lm_eval's start-up included, and for the served side the server's start) is reported, with
the ratio served / hf and the metrics of both (they must agree).

    python benchmarks/bench_harness.py --threads 2 --limit 100 --repeat 3
    python benchmarks/bench_harness.py --run RUN_DIR --data DATA_DIR --hf HF_DIR   # an existing run and export
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
TASKS = ["xirang_heldout_mc", "xirang_heldout_gen"]


def _train(tmp: Path, steps: int, model: str) -> tuple[Path, Path, Path]:
    """A run with a BPE tokenizer, trained for ``steps`` steps on this package's sources, and its HF export."""
    args = [str(BIN / "xirang-train"), f"model={model}", "cluster.nodes=1", "cluster.tasks_per_node=1",
            "parallel.pp=1", f"train.max_steps={steps}", "train.warmup_steps=2", f"train.runs_root={tmp}/runs",
            f"data.out_dir={tmp}/data", f"data.corpus={ROOT / 'xirang_hpc'}", "data.tokenizer=bpe",
            "model.vocab_size=512"]
    subprocess.run(args, cwd=tmp, check=True, capture_output=True, text=True)
    (run,) = (tmp / "runs").iterdir()
    subprocess.run([str(BIN / "xirang-ckpt"), "export", str(run), "--format", "hf", "--out", str(tmp / "hf")],
                   check=True, capture_output=True, text=True)
    return run, tmp / "data", tmp / "hf"


def main() -> None:
    """Parse, build (or take) the run, time both back ends, print the table."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run", help="an existing run directory (default: train one here)")
    ap.add_argument("--data", help="its prepared data directory (with --run)")
    ap.add_argument("--hf", help="its `xirang-ckpt export --format hf` directory (with --run)")
    ap.add_argument("--model", default="tiny", help="model preset of the run trained here")
    ap.add_argument("--steps", type=int, default=20, help="training steps of the run trained here")
    ap.add_argument("--limit", type=int, default=100, help="documents per task")
    ap.add_argument("--batch", type=int, default=16, help="requests per batch (serve.max_batch; hf batch_size)")
    ap.add_argument("--threads", type=int, default=2, help="torch intra-op threads, both sides")
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()

    os.environ["OMP_NUM_THREADS"] = str(args.threads)  # lm_eval's hf child
    import torch

    torch.set_num_threads(args.threads)  # the server, in this process
    from xirang_hpc.config.schema import EvalConfig, ServeConfig
    from xirang_hpc.eval.harness import metrics_of, run_harness, run_lm_eval
    from xirang_hpc.weights.load import load_checkpoint

    with tempfile.TemporaryDirectory() as d:
        if args.run:
            run, data, hf = Path(args.run), Path(args.data), Path(args.hf)
        else:
            run, data, hf = _train(Path(d), args.steps, args.model)
        loaded = load_checkpoint(run)
        ecfg = EvalConfig(harness_tasks=TASKS, harness_limit=args.limit)
        scfg = ServeConfig(max_batch=args.batch)
        served, native = [], []
        ours = theirs = None
        for _ in range(args.repeat):
            t0 = time.perf_counter()
            ours = run_harness(run, data, ecfg, scfg, loaded)["metrics"]
            served.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            res = run_lm_eval({"model": "hf", "model_args": {"pretrained": str(hf), "dtype": "float32",
                                                             "device": "cpu"},
                               "tasks": TASKS, "include_path": [str(run / "harness" / "tasks")], "limit": args.limit,
                               "num_fewshot": 0, "batch_size": args.batch}, run)
            native.append(time.perf_counter() - t0)
            theirs = metrics_of(res["results"])
    s, n = statistics.median(served), statistics.median(native)
    print(f"model {loaded.cfg.name} ({loaded.cfg.n_layer} layers, d_model {loaded.cfg.d_model}, seq_len "
          f"{loaded.cfg.seq_len}, vocab {loaded.cfg.vocab_size}) | tasks {','.join(TASKS)} | limit {args.limit} | "
          f"batch {args.batch} | threads {args.threads} | repeat {args.repeat}")
    print(f"{'backend':<28} {'median s':>9}  runs")
    print(f"{'xirang-serve (local-compl.)':<28} {s:9.2f}  {', '.join(f'{x:.2f}' for x in served)}")
    print(f"{'lm_eval hf (transformers)':<28} {n:9.2f}  {', '.join(f'{x:.2f}' for x in native)}")
    print(f"ratio served / hf: {s / n:.2f}")
    print(f"metrics served: {ours}")
    print(f"metrics hf:     {theirs}")
    print(f"metrics equal: {ours == theirs}")


if __name__ == "__main__":
    main()
