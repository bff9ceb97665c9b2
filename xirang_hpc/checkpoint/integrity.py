"""The checkpoint files' integrity, without torch: checksums, verification against a manifest, fsync.

The launcher checks an existing run's checkpoints before it submits (``submit/preflight.py`` through
``checkpoint/layout.py``), so these live apart from the DCP storage in ``storage.py``, which needs torch.
"""

from __future__ import annotations

import hashlib
import mmap
import os
import threading
from pathlib import Path
from typing import Any

import xxhash

from xirang_hpc.runtime import liveness

METADATA_FILE = "metadata.json"


class CheckpointFormatError(RuntimeError):
    """A checkpoint file is missing, truncated or not what the metadata says."""


class CheckpointCorruptError(CheckpointFormatError):
    """A checkpoint failed verification; the message names the file and the problem."""


def _hasher(algo: str) -> Any:
    return xxhash.xxh3_128() if algo == "xxh3_128" else hashlib.new(algo)


def checksum_file(path: Path, algo: str = "xxh3_128", bufsize: int = 1 << 20) -> str:
    """Hex digest of a file (``xxh3_128`` by default; any hashlib name too).

    Hashed through a read-only ``mmap`` of the page cache: no copy into a user buffer, 2-3x faster
    than ``readinto`` here (0.07 vs 0.19 s for a 1.96 GB file). Empty files, and filesystems that
    refuse mmap, are streamed with ``readinto`` instead.
    """
    h = _hasher(algo)
    with open(path, "rb", buffering=0) as f:
        try:
            m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except (OSError, ValueError):  # ValueError: empty file
            m = None
        if m is not None:
            with m, memoryview(m) as view:
                for i in range(0, len(view), 64 << 20):
                    h.update(view[i : i + (64 << 20)])
                    liveness.tick("checkpoint checksum")
            return h.hexdigest()
        buf = bytearray(bufsize)
        view = memoryview(buf)
        while n := f.readinto(buf):
            h.update(view[:n])
            liveness.tick("checkpoint checksum")
    return h.hexdigest()


def verify_file(path: Path, entry: dict[str, Any]) -> None:
    """Check ``path`` against its manifest entry (size, then checksum); raises CheckpointCorruptError."""
    if not path.is_file():
        raise CheckpointCorruptError(f"{path}: listed in the manifest but missing")
    size = path.stat().st_size
    if size != entry["bytes"]:
        raise CheckpointCorruptError(f"{path}: size {size} bytes, manifest says {entry['bytes']} "
                                     "(truncated or altered)")
    algo = "xxh3_128" if "xxh3_128" in entry else "sha256"
    got = checksum_file(path, algo)
    if got != entry[algo]:
        raise CheckpointCorruptError(f"{path}: checksum ({algo}) {got[:16]}... does not match the manifest's "
                                     f"{entry[algo][:16]}... (corrupted)")


def sync_and_checksum(path: Path, fsync: bool = True) -> dict[str, Any]:
    """fsync ``path`` (in a thread) while hashing it from the page cache; its manifest entry.

    Same entry as ``layout.file_entry`` (size + xxh3-128 of the whole file), without paying
    the hash and the fsync one after the other.
    """
    t = threading.Thread(target=fsync_path, args=(path,), daemon=True) if fsync else None
    if t is not None:
        t.start()
    entry = {"bytes": path.stat().st_size, "xxh3_128": checksum_file(path)}
    if t is not None:
        t.join()
        fsync_path(path)  # cheap when the thread's fsync succeeded; raises here if the disk failed
    return entry


def fsync_path(path: Path) -> None:
    """fsync a file or directory."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
