"""Copying a run to another site's run root: the newest good checkpoint, verified against its manifest
at the destination before it is renamed into place, and the run's records."""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from xirang_hpc.checkpoint.naming import committed_steps, step_dir_name
from xirang_hpc.config.schema import SiteConfig
from xirang_hpc.monitor.events import append_event

CKPT_DIR = "checkpoints"
# Never copied with a run's records: its per-site Slurm state (job ownership, submitit folders, logs).
# The per-restart rank markers (ranks/) belong to the old site's job ids and restart counts.
_NOT_RECORDS = {CKPT_DIR, "submitit", "slurm", "job.json", ".submit.lock", "ranks", "slurm_job.json"}


def _layout() -> Any:
    """``checkpoint.layout``, imported when a copy needs it: it pulls in torch, which takes seconds (more
    on a loaded node), and the decision at a preemption runs inside the grace time without it."""
    from xirang_hpc.checkpoint import layout

    return layout


def _corrupt() -> type[Exception]:
    from xirang_hpc.checkpoint.integrity import CheckpointCorruptError

    return CheckpointCorruptError


class CopyError(RuntimeError):
    """A run could not be copied to another site (nothing usable there; the run stays where it was)."""


def site_run_dir(run_dir: Path, runs_root: str | Path, site: SiteConfig) -> Path:
    """Where ``run_dir`` (under ``runs_root``) lives on ``site``: the same name under the site's run root."""
    if not site.run_root:
        return run_dir
    root = Path(runs_root).expanduser().absolute()
    rel = run_dir.relative_to(root) if run_dir.is_relative_to(root) else Path(run_dir.name)
    return Path(site.run_root).expanduser().absolute() / rel


@dataclass
class CopyResult:
    """What a verified copy moved: the step, bytes and files of checkpoint data, and how long it took."""

    step: int | None
    bytes: int
    files: int
    seconds: float
    dst: str


def newest_good_step(ckpt_root: Path) -> int | None:
    """The newest committed step whose files (and referenced steps) match their manifest checksums."""
    for step in sorted(committed_steps(ckpt_root), reverse=True):
        try:
            _layout().verify(ckpt_root / step_dir_name(step))
            return step
        except _corrupt():
            continue
    return None


def _steps_needed(ckpt_root: Path, step: int) -> list[str]:
    """``step`` and every step it references (dedup), references first."""
    order: list[str] = []

    def visit(name: str) -> None:
        if name in order:
            return
        for ref in _layout().read_manifest(ckpt_root / name).get("refs", []):
            visit(Path(ref).name)
        order.append(name)

    visit(step_dir_name(step))
    return order


Copier = Callable[[Path, Path], Any]


def _copy_step(src: Path, dst_root: Path, copier: Copier) -> tuple[int, int]:
    """Copy one committed step dir under a temporary name, verify it there, then rename it into place."""
    final = dst_root / src.name
    if final.is_dir():
        try:
            _layout().verify(final)
            return 0, 0  # already there and good (an earlier copy of a referenced step)
        except _corrupt():
            pass
    tmp = dst_root / f"{src.name}.tmp-copy-{os.getpid()}-{time.time_ns()}"
    tmp.mkdir(mode=0o700)
    nbytes = nfiles = 0
    try:
        manifest = _layout().read_manifest(src)
        # The manifest last: a temporary without it is visibly unfinished.
        names = sorted(manifest["files"]) + [_layout().MANIFEST]
        for name in names:
            copier(src / name, tmp / name)
            nbytes += (tmp / name).stat().st_size
            nfiles += 1
        _layout().verify(tmp)
    except (OSError, _corrupt()) as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        raise CopyError(f"copy of {src} to {dst_root} failed verification or I/O ({exc}); nothing was used, "
                        "the run stays where it was") from exc
    _layout().fsync_path(tmp)
    if final.exists():
        shutil.rmtree(final)
    os.rename(tmp, final)
    _layout().fsync_path(dst_root)
    return nbytes, nfiles


def _copy_records(src_run: Path, dst_run: Path) -> None:
    """The run's records (events, metrics, config, ...) next to the copied checkpoint; each file is written
    under a temporary name and renamed, so a record is whole or absent."""
    for p in sorted(src_run.iterdir()):
        if p.name in _NOT_RECORDS or p.name.startswith("."):
            continue
        target = dst_run / p.name
        if p.is_dir():
            shutil.copytree(p, target, dirs_exist_ok=True)
        elif p.is_file():
            tmp = dst_run / f".{p.name}.copy-{os.getpid()}"
            shutil.copy2(p, tmp)
            os.replace(tmp, target)


def copy_run(src_run: Path, dst_run: Path, copier: Copier = shutil.copyfile,
             clock: Callable[[], float] = time.monotonic) -> CopyResult:
    """Copy the newest good checkpoint of ``src_run`` and its records into ``dst_run`` (verified).

    The destination's ``latest`` moves only after every copied file matched its manifest checksum; an
    error or a kill at any point leaves at most a temporary the next start removes. The copy's step,
    bytes and seconds are appended to both runs' ``events.jsonl`` (kind ``migrate_copy``).
    """
    t0 = clock()
    src_ckpt, dst_ckpt = src_run / CKPT_DIR, dst_run / CKPT_DIR
    step = newest_good_step(src_ckpt)
    _layout().make_dir(dst_run, 0o700)
    nbytes = nfiles = 0
    if step is not None:
        _layout().make_dir(dst_ckpt, 0o700)
        _layout().cleanup_leftovers(dst_ckpt)
        for name in _steps_needed(src_ckpt, step):
            b, f = _copy_step(src_ckpt / name, dst_ckpt, copier)
            nbytes, nfiles = nbytes + b, nfiles + f
        _layout().verify(dst_ckpt / step_dir_name(step))
        _layout().write_latest(dst_ckpt, step)
    _copy_records(src_run, dst_run)
    res = CopyResult(step, nbytes, nfiles, clock() - t0, str(dst_run))
    for run_dir in (src_run, dst_run):
        append_event(run_dir, "migrate_copy", "checkpoint copied and verified", step=step, bytes=nbytes,
                     files=nfiles, seconds=round(res.seconds, 3), src=str(src_run), dst=str(dst_run))
    return res
