"""Names of step directories under a checkpoint root, and which ones are committed.

Kept free of torch/h5py imports: ``xirang-status`` lists checkpoints and must start in well under
a second, so it reads these names without loading the storage layer.
"""

from __future__ import annotations

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
