"""What one submission costs the user's shell: ``xirang-train`` to Slurm vs a plain submitit script.

    python benchmarks/bench_submit.py [--repeats 5]

Slurm's client commands are small fake executables on PATH (they answer like ``sbatch`` and
``scontrol``), so what is timed is the submitting process alone, never the scheduler. Each repeat is a
fresh interpreter:

- ours: ``xirang-train cluster=testbed`` (Hydra composition, validation, the data check, the preflight of
  the run directory, the submission and its event log) into a fresh runs root, the data prepared once
  before timing;
- ours with torch imported first: the same command as it ran while the launcher imported the training
  stack (what the torch-free submission path saves);
- baseline: the submitit script users write, a training module that imports torch at the top and
  ``AutoExecutor(...).submit(train)``.

Wall time and CPU time (user + system of the child) are medians over the repeats; the ratio is the
baseline's over ours.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

FAKE = """#!{python}
import os, sys
name, args = os.path.basename(sys.argv[0]), sys.argv[1:]
if name == "sbatch":
    print("Submitted batch job 4242")
elif name == "scontrol" and args[:2] == ["show", "job"]:
    print("JobId=4242 JobState=PENDING ExcNodeList=(null)")
elif name == "scontrol" and args[:2] == ["show", "partition"]:
    print("PartitionName=low Nodes=n1,n2")
elif name == "scontrol" and args[:2] == ["show", "node"]:
    for n in ("n1", "n2"):
        print(f"NodeName={{n}} State=IDLE CPUTot=8 RealMemory=8000")
"""

XIRANG = "from xirang_hpc.cli.train import main; import sys; sys.argv[0] = 'xirang-train'; main()"
XIRANG_TORCH = "import torch; " + XIRANG

BASELINE = """import sys
import submitit
import torch


def train(lr: float) -> float:
    model = torch.nn.Linear(8, 8)
    return float(model.weight.sum()) * lr


ex = submitit.AutoExecutor(folder=sys.argv[1], cluster="slurm")
ex.update_parameters(nodes=2, tasks_per_node=2, cpus_per_task=1, timeout_min=60, slurm_partition="low")
job = ex.submit(train, 1e-3)
print("submitted", job.job_id)
"""


def timed(argv: list[str], env: dict[str, str]) -> tuple[float, float]:
    """(wall s, CPU s) of one child process, which must succeed."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    out = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=600)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if out.returncode != 0 or "4242" not in out.stdout:
        sys.exit(f"{argv[:3]} failed:\n{out.stdout}\n{out.stderr}")
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=5)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        root = Path(d)
        bin_dir, corpus = root / "bin", root / "corpus"
        bin_dir.mkdir()
        corpus.mkdir()
        for cmd in ("sbatch", "scontrol", "squeue", "sacct", "srun", "sinfo", "sacctmgr"):
            exe = bin_dir / cmd
            exe.write_text(FAKE.format(python=sys.executable))
            exe.chmod(0o755)
        for i in range(12):
            (corpus / f"mod{i}.py").write_text("".join(f"def f{i}_{j}(x):\n    return x * {j}\n\n" for j in range(40)))
        (root / "baseline.py").write_text(BASELINE)
        env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}
        env.pop("SLURM_CONF", None)

        def ours(code: str, i: int) -> list[str]:
            return [sys.executable, "-c", code, "cluster=testbed", "requeue=testbed",
                    f"train.runs_root={root}/runs-{len(code)}-{i}", f"data.corpus={corpus}",
                    f"data.out_dir={root}/data", "data.val_fraction=0.2"]

        timed(ours(XIRANG, -1), env)  # prepares the data once, outside the timing; warms the page cache
        timed([sys.executable, str(root / "baseline.py"), str(root / "sub-warm")], env)
        rows: dict[str, list[tuple[float, float]]] = {"ours": [], "ours, torch imported first": [],
                                                      "submitit script (baseline)": []}
        for i in range(a.repeats):  # interleaved, so that a noisy moment hits all three alike
            rows["ours"].append(timed(ours(XIRANG, i), env))
            rows["ours, torch imported first"].append(timed(ours(XIRANG_TORCH, i), env))
            rows["submitit script (baseline)"].append(
                timed([sys.executable, str(root / "baseline.py"), str(root / f"sub-{i}")], env))
    med = {k: (statistics.median(w for w, _ in v), statistics.median(c for _, c in v)) for k, v in rows.items()}
    base_w, base_c = med["submitit script (baseline)"]
    print(f"one submission to (fake) Slurm, medians of {a.repeats} fresh interpreters\n")
    print("| submitter | wall (s) | CPU (s) | baseline / this (wall) | baseline / this (CPU) |")
    print("|---|---|---|---|---|")
    for k, (w, c) in med.items():
        print(f"| {k} | {w:.2f} | {c:.2f} | {base_w / w:.2f}x | {base_c / c:.2f}x |")


if __name__ == "__main__":
    main()
