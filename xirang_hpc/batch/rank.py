"""``python -m xirang_hpc.batch.rank --config job_config.json``: one rank of a hand-submitted job.

The rendered sbatch script (``xirang-sbatch``) runs this under ``srun``; it calls the same job
function submitit runs, with the config ``xirang-sbatch`` validated and wrote.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from xirang_hpc.job.entry import train_job


def main(argv: list[str] | None = None) -> None:
    """Run this rank's share of the training job."""
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--config", type=Path, required=True)
    a = ap.parse_args(argv)
    payload = json.loads(a.config.read_text())
    train_job(payload["config"], payload["run_dir"], payload["data_dir"])


if __name__ == "__main__":
    main()
