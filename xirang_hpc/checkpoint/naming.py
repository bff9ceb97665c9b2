"""Names of step directories under a checkpoint root, which ones are committed, and where a job's in-memory
checkpoints live.

Kept free of torch/h5py imports: ``xirang-status`` lists checkpoints and must start in well under
a second, so it reads these names without loading the storage layer; the in-job restart driver
(``batch/injob.py``, one per job in the batch step) finds the in-memory checkpoints to clean up
without importing torch (~2 s of CPU on every start of a job).
"""

from __future__ import annotations

import getpass
import hashlib
import re
from pathlib import Path

STEP_RE = re.compile(r"^step_(\d+)$")


def step_dir_name(step: int) -> str:
    """``step_<N>``."""
    return f"step_{step}"


def committed_steps(root: Path) -> list[int]:
    """Steps that have a committed directory (ascending). Says nothing about their health."""
    if not root.is_dir():
        return []
    out = []
    for p in root.iterdir():
        m = STEP_RE.match(p.name)
        if m and p.is_dir():
            out.append(int(m.group(1)))
    return sorted(out)


def memory_root(job_id: str, run_dir: Path, base: str = "") -> Path:
    """Where a job keeps its in-memory checkpoints: ``<base or /dev/shm>/xirang-<user>-<job>``, per job (a Slurm
    job id), or per run directory outside Slurm."""
    job = job_id if job_id.isdigit() else "local-" + hashlib.sha256(str(run_dir).encode()).hexdigest()[:12]
    return Path(base or "/dev/shm") / f"xirang-{getpass.getuser()}-{job}"
