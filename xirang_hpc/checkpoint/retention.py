"""Which checkpoints to keep: the last N, every K-th step, pinned ones, and whatever they reference."""

from __future__ import annotations

import logging
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from xirang_hpc.checkpoint.layout import (
    PINNED,
    CheckpointCorruptError,
    committed_steps,
    read_latest,
    read_manifest,
    step_dir_name,
    verify_quick,
)

log = logging.getLogger(__name__)


@dataclass
class RetentionPolicy:
    """``keep_last`` newest steps, every ``keep_every``-th step (0 = none), and ``pinned`` steps."""

    keep_last: int = 3
    keep_every: int = 0
    pinned: tuple[int, ...] = field(default_factory=tuple)


def steps_to_keep(steps: list[int], policy: RetentionPolicy, marked: set[int] | None = None,
                  bad: set[int] | None = None) -> set[int]:
    """The policy's choice among ``steps`` (``marked``: steps with a PINNED marker file; ``bad``: steps that fail
    verification, which never take one of the ``keep_last`` places of a loadable step)."""
    good = sorted(set(steps) - (bad or set()))
    keep = set(good[-policy.keep_last:]) if policy.keep_last > 0 else set()
    if policy.keep_every > 0:
        keep |= {s for s in steps if s % policy.keep_every == 0}
    keep |= set(policy.pinned) & set(steps)
    keep |= (marked or set()) & set(steps)
    return keep


def _referenced(root: Path, steps: set[int]) -> set[int]:
    """Steps whose files a kept step references (dedup), transitively."""
    out: set[int] = set()
    todo = list(steps)
    while todo:
        s = todo.pop()
        try:
            refs = read_manifest(root / step_dir_name(s)).get("refs", [])
        except CheckpointCorruptError:
            continue
        for r in refs:
            name = r.rsplit("/", 1)[-1]
            if name.startswith("step_") and name[5:].isdigit():
                n = int(name[5:])
                if n not in steps and n not in out:
                    out.add(n)
                    todo.append(n)
    return out


def plan_prune(root: Path, policy: RetentionPolicy) -> tuple[set[int], set[int]]:
    """(keep, delete) for the committed steps under ``root``; never deletes data a kept step references.

    A step that fails the quick verification (a truncated or missing file, a broken manifest) cannot be
    loaded: it is not counted among the ``keep_last`` newest and goes unless pinned or referenced.
    """
    steps = committed_steps(root)
    marked = {s for s in steps if (root / step_dir_name(s) / PINNED).exists()}
    bad, good = set(), 0
    for s in sorted(steps, reverse=True):  # only the newest are checked, until keep_last good ones are found
        if good >= policy.keep_last:
            break
        try:
            verify_quick(root / step_dir_name(s))
            good += 1
        except CheckpointCorruptError as exc:
            log.warning("retention: checkpoint %s fails verification (%s); not kept as one of the newest",
                        root / step_dir_name(s), exc)
            bad.add(s)
    keep = steps_to_keep(steps, policy, marked, bad)
    latest = read_latest(root)
    if latest is not None and latest in steps and latest not in bad:
        keep.add(latest)
    keep |= _referenced(root, keep)
    return keep, set(steps) - keep


def prune(root: Path, policy: RetentionPolicy, dry_run: bool = False) -> list[int]:
    """Delete the steps the policy drops; returns them (ascending)."""
    _, delete = plan_prune(root, policy)
    for s in sorted(delete):
        if not dry_run:
            shutil.rmtree(root / step_dir_name(s), ignore_errors=True)
            log.info("retention: removed checkpoint %s", root / step_dir_name(s))
    return sorted(delete)
