"""Small files that readers see whole: the one way this package replaces a record in place.

The records a run keeps beside its checkpoints (identity, owner lock, site, plan, heartbeats, pipeline
stages, memory-copy manifests, ...) are replaced atomically: written under a hidden temporary name of
this process and thread, then renamed over the old file, so a reader (another rank, ``xirang-status``, a
requeued job) sees the old file or the new one, never a torn one. Mode 0600: run directories are private.
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from typing import Any


def write_bytes_atomic(path: Path, data: bytes | memoryview, mode: int = 0o600) -> None:
    """Replace ``path`` with ``data`` atomically (temporary file in the same directory, then rename)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_json_atomic(path: Path, obj: Any, *, indent: int | None = None, sort_keys: bool = False,
                      default: Any = None) -> None:
    """Replace ``path`` with ``obj`` as JSON atomically (see :func:`write_bytes_atomic`); ``default`` as
    for :func:`json.dumps` (e.g. ``str`` for paths)."""
    text = json.dumps(obj, indent=indent, sort_keys=sort_keys, default=default)
    write_bytes_atomic(path, (text + "\n").encode())
