"""On-disk layout of a run's checkpoints, and the atomic-commit primitives.

```
<run>/checkpoints/
  latest                    "step_N" (replaced atomically)
  step_N/                   committed: manifest.json exists and lists every other file
    rank_<i>.h5             tensors (one file per writing rank)
    rank_<i>.json           that rank's RNG states
    metadata.json           DCP metadata (JSON)
    state.json              step, tokens, config, layout, metrics, optimizer hyperparameters
    manifest.json           written last: xxh3-128 checksum + size of every file, referenced steps
  step_N.tmp-<id>/          being written; removed at the next start
```
A directory named ``step_N`` only ever appears by ``rename`` of a fully written, fsynced
temporary, so it is either complete or (after disk damage) detectably corrupt.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from xirang_hpc import files
from xirang_hpc.checkpoint.integrity import (
    METADATA_FILE,
    CheckpointCorruptError,
    checksum_file,
    fsync_path,
    verify_file,
)
from xirang_hpc.checkpoint.naming import STEP_RE, committed_steps, step_dir_name

MANIFEST = "manifest.json"
STATE = "state.json"
LATEST = "latest"
PINNED = "PINNED"
_TMP_RE = re.compile(r"^step_\d+\.(tmp|old)-")
# In a step directory but not in its manifest: the manifest itself and the pin marker (xirang-ckpt pin).
_NOT_LISTED = frozenset({MANIFEST, PINNED})


def make_dir(path: Path, mode: int) -> Path:
    """mkdir with exactly ``mode`` (whatever the umask; 0o2750 in the group when shared); parents too."""
    return files.make_dir(path, mode)


# xxh3-128 hashes at several GB/s (sha256 ran at 0.2-0.3 GB/s here), so verifying is cheap next to
# reading; it detects corruption, not tampering (the directories are private to the user).
CHECKSUM = "xxh3_128"


def file_entry(path: Path) -> dict[str, Any]:
    """Manifest entry of one file: size and checksum."""
    return {"bytes": path.stat().st_size, CHECKSUM: checksum_file(path)}


def write_json_durable(path: Path, obj: Any) -> None:
    """Write JSON and fsync it."""
    with path.open("w") as f:
        json.dump(obj, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())


def read_latest(root: Path) -> int | None:
    """The step the ``latest`` pointer names, or None."""
    try:
        m = STEP_RE.match((root / LATEST).read_text().strip())
    except OSError:
        return None
    return int(m.group(1)) if m else None


def write_latest(root: Path, step: int) -> None:
    """Point ``latest`` at ``step`` atomically (write temp, fsync, rename, fsync dir)."""
    tmp = root / f".{LATEST}.tmp-{os.getpid()}"
    tmp.write_text(step_dir_name(step) + "\n")
    fsync_path(tmp)
    os.replace(tmp, root / LATEST)
    fsync_path(root)


def cleanup_leftovers(root: Path) -> list[Path]:
    """Remove temporaries of saves that never committed (and half-swapped old dirs)."""
    removed = []
    if root.is_dir():
        for p in root.iterdir():
            if _TMP_RE.match(p.name) or p.name.startswith(f".{LATEST}.tmp-"):
                shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
                removed.append(p)
    return removed


def commit(tmp: Path, final: Path, files: dict[str, dict[str, Any]], refs: list[str], info: dict[str, Any]) -> None:
    """Write the manifest last, fsync everything, rename ``tmp`` -> ``final``, fsync the parent."""
    for name in files:
        fsync_path(tmp / name)
    manifest = {"files": files, "refs": sorted(refs), "committed_at": time.time(), **info}
    write_json_durable(tmp / MANIFEST, manifest)
    fsync_path(tmp)
    old = None
    if final.exists():
        # Re-saving a step (e.g. after a resume): swap the old copy out first.
        old = final.with_name(f"{final.name}.old-{os.getpid()}-{time.time_ns()}")
        os.rename(final, old)
    os.rename(tmp, final)
    fsync_path(final.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def read_manifest(step_dir: Path) -> dict[str, Any]:
    """Parse a step's manifest; a missing or malformed one raises CheckpointCorruptError."""
    path = step_dir / MANIFEST
    try:
        m = json.loads(path.read_text())
        if not isinstance(m.get("files"), dict):
            raise ValueError("no 'files' table")
        return m
    except (OSError, ValueError) as exc:
        raise CheckpointCorruptError(f"{path}: manifest missing or unreadable ({exc})") from exc


def verify(step_dir: Path, checksums: bool = True, _seen: set[Path] | None = None,
           skip_suffix: str | None = None) -> dict[str, Any]:
    """Check a committed step (and the steps it references); returns its manifest.

    Raises :class:`CheckpointCorruptError` naming the first bad file: missing, wrong size
    (truncated), or wrong checksum (garbage). Files ending in ``skip_suffix`` get the size check
    only (the loader verifies their checksums as it reads them).
    """
    seen = _seen if _seen is not None else set()
    m = read_manifest(step_dir)
    # The manifest lists every file a save writes: anything else in the directory was put there by
    # someone else, and nothing of a checkpoint is read unless it is listed.
    unlisted = sorted(q.name for q in step_dir.iterdir() if q.name not in m["files"] and q.name not in _NOT_LISTED)
    if unlisted:
        raise CheckpointCorruptError(f"{step_dir / unlisted[0]}: not listed in the manifest (not written by this "
                                     f"checkpoint{f'; {len(unlisted) - 1} more' if len(unlisted) > 1 else ''}); "
                                     "move it away to load this step")
    for name, e in m["files"].items():
        p = step_dir / name
        if checksums and not (skip_suffix and name.endswith(skip_suffix)):
            verify_file(p, e)
        else:
            _size_only(p, e)
    for ref in m.get("refs", []):
        rdir = (step_dir / ref).resolve()
        if rdir in seen:
            continue
        seen.add(rdir)
        if not rdir.is_dir():
            raise CheckpointCorruptError(f"{rdir}: referenced by {step_dir} (dedup) but missing")
        verify(rdir, checksums, seen, skip_suffix)
    return m


# The tensor files: a quick check reads their sizes only (the loader checksums what it reads).
TENSOR_SUFFIX = ".h5"


def verify_quick(step_dir: Path) -> dict[str, Any]:
    """The check every launch and every load makes: manifest, every listed file present at its size,
    the small JSON files checksummed, dedup references too. Cheap at any model size (no tensor file is
    read); garbage of the right size inside a tensor file is caught by the loader's checksums."""
    return verify(step_dir, checksums=True, skip_suffix=TENSOR_SUFFIX)


def newest_good(root: Path) -> tuple[int | None, list[tuple[int, str]]]:
    """(newest committed step that passes :func:`verify_quick`, the newer ones that fail it with why)."""
    bad: list[tuple[int, str]] = []
    for s in sorted(committed_steps(root), reverse=True):
        try:
            verify_quick(root / step_dir_name(s))
            return s, bad
        except CheckpointCorruptError as exc:
            bad.append((s, str(exc)))
    return None, bad


def expected_checksums(step_dir: Path) -> dict[str, dict[str, Any]]:
    """Manifest entries of every file a load of ``step_dir`` may read, keyed as the metadata names them
    (own files by name, dedup references as ``../step_K/name``)."""
    m = read_manifest(step_dir)
    out = dict(m["files"])
    for ref in m.get("refs", []):
        for name, e in read_manifest(step_dir / ref).get("files", {}).items():
            out[f"{ref}/{name}"] = e
    return out


def _size_only(p: Path, e: dict[str, Any]) -> None:
    if not p.is_file():
        raise CheckpointCorruptError(f"{p}: listed in the manifest but missing")
    if p.stat().st_size != e["bytes"]:
        raise CheckpointCorruptError(f"{p}: size {p.stat().st_size} bytes, manifest says {e['bytes']} "
                                     "(truncated or altered)")


def read_state(step_dir: Path) -> dict[str, Any]:
    """The step's ``state.json``."""
    return json.loads((step_dir / STATE).read_text())


def refs_of_metadata(step_dir: Path) -> list[str]:
    """Sibling step directories whose files this step's metadata references (dedup)."""
    md = json.loads((step_dir / METADATA_FILE).read_text())
    refs = {s["info"]["file"].split("/")[1] for s in md["storage"] if "/" in s["info"]["file"]}
    return [f"../{r}" for r in sorted(refs)]


def dedup_index(step_dir: Path) -> dict[str, tuple[str, str]]:
    """hash -> (file relative to a sibling step dir, dataset) for every hashed chunk of ``step_dir``."""
    md = json.loads((step_dir / METADATA_FILE).read_text())
    index: dict[str, tuple[str, str]] = {}
    for s in md["storage"]:
        info = s["info"]
        if "hash" in info:
            f = info["file"] if "/" in info["file"] else f"../{step_dir.name}/{info['file']}"
            index[info["hash"]] = (f, info["ds"])
    return index


@dataclass
class StepInfo:
    """One committed checkpoint, for listings."""

    step: int
    path: Path
    bytes: int
    committed_at: float
    world_size: int
    layout: dict[str, Any]
    refs: list[str]
    pinned: bool


def describe(root: Path) -> list[StepInfo]:
    """Every committed step with size (own files only), time, layout; unreadable ones get bytes=-1."""
    out = []
    for s in committed_steps(root):
        d = root / step_dir_name(s)
        try:
            m = read_manifest(d)
            size = sum(e["bytes"] for e in m["files"].values())
            out.append(StepInfo(s, d, size, m.get("committed_at", 0.0), m.get("world_size", 0),
                                m.get("layout", {}), m.get("refs", []), (d / PINNED).exists()))
        except CheckpointCorruptError:
            out.append(StepInfo(s, d, -1, 0.0, 0, {}, [], (d / PINNED).exists()))
    return out
