"""Rollback: fork a new run directory from one checkpoint so the original history stays intact.

Checkpoint files are never modified in place (only created, renamed, deleted), so the fork
hard-links them (copying across filesystems). The steps the chosen one references (dedup)
come along, ``latest`` points at the chosen step, and ``metrics.jsonl`` is cut at that step.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

from xirang_hpc.checkpoint import layout as ckpt_layout
from xirang_hpc.files import make_dir, write_json_atomic

FORKS = "forks.json"
FORKED_FROM = "forked_from.json"


def _link_tree(src: Path, dst: Path, mode: int) -> None:
    ckpt_layout.make_dir(dst, mode)
    for p in src.iterdir():
        if p.is_file():
            try:
                os.link(p, dst / p.name)
            except OSError:
                shutil.copy2(p, dst / p.name)


def default_fork_dir(run_dir: Path, step: int) -> Path:
    """``<run>-from<step>-<UTC time>`` beside the original run."""
    return run_dir.parent / f"{run_dir.name}-from{step}-{time.strftime('%Y%m%dT%H%M%S', time.gmtime())}"


def fork_run(run_dir: Path, step: int, new_dir: Path | None = None, mode: int = 0o700) -> Path:
    """Create a new run directory whose only (newest) checkpoint is ``step`` of ``run_dir``."""
    run_dir = Path(run_dir)
    src_root = run_dir / "checkpoints"
    src = src_root / ckpt_layout.step_dir_name(step)
    if not src.is_dir():
        have = ckpt_layout.committed_steps(src_root)
        raise FileNotFoundError(f"{run_dir}: no checkpoint for step {step} (have {have})")
    ckpt_layout.verify(src)
    dst_run = Path(new_dir) if new_dir is not None else default_fork_dir(run_dir, step)
    if dst_run.exists() and any(dst_run.iterdir()):
        raise FileExistsError(f"{dst_run} already exists and is not empty; choose another --to")
    dst_root = ckpt_layout.make_dir(dst_run / "checkpoints", mode)
    make_dir(dst_run, mode)
    todo, done = [src], set()
    while todo:
        d = todo.pop()
        if d.name in done:
            continue
        done.add(d.name)
        _link_tree(d, dst_root / d.name, mode)
        todo += [(d / r).resolve() for r in ckpt_layout.read_manifest(d).get("refs", [])]
    ckpt_layout.write_latest(dst_root, step)
    metrics = run_dir / "metrics.jsonl"
    if metrics.exists():
        rows = [json.loads(x) for x in metrics.read_text().splitlines() if x.strip()]
        (dst_run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows if r.get("step", 0) <= step))
    (dst_run / FORKED_FROM).write_text(json.dumps({"run": str(run_dir), "step": step, "time": time.time()}))
    return dst_run


def forked_at(run_dir: Path) -> int | None:
    """The step ``run_dir`` was forked from (its ``forked_from.json``), or None for a run that is no fork."""
    try:
        return int(json.loads((run_dir / FORKED_FROM).read_text())["step"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def fork_for_resume(run_dir: Path, step: int, mode: int = 0o700) -> Path:
    """``train.resume_from=step``: the run directory to continue in (idempotent across requeues).

    If ``step`` is already the newest checkpoint, training continues in place. Otherwise the
    first call forks and records the fork in ``<run>/forks.json``; later calls (a requeued job
    with the same config) find that fork and continue there, and so does a call on the fork itself
    (the launch forks on the login node and hands the job the fork's directory).
    """
    root = Path(run_dir) / "checkpoints"
    if forked_at(Path(run_dir)) == step:  # the fork itself (made at launch): continue in it
        return Path(run_dir)
    steps = ckpt_layout.committed_steps(root)
    if step not in steps:
        raise FileNotFoundError(f"train.resume_from={step}: no checkpoint for that step under {root} (have {steps})")
    if step == steps[-1]:
        return Path(run_dir)
    forks_file = Path(run_dir) / FORKS
    forks = json.loads(forks_file.read_text()) if forks_file.exists() else {}
    prior = forks.get(str(step))
    if prior and Path(prior).is_dir():
        return Path(prior)
    new = fork_run(Path(run_dir), step, mode=mode)
    forks[str(step)] = str(new)
    write_json_atomic(forks_file, forks, indent=1)
    return new
