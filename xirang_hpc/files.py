"""Small files that readers see whole: the one way this package replaces a record in place.

The records a run keeps beside its checkpoints (identity, owner lock, site, plan, heartbeats, pipeline
stages, memory-copy manifests, ...) are replaced atomically: written under a hidden temporary name of
this process and thread, then renamed over the old file, so a reader (another rank, ``xirang-status``, a
requeued job) sees the old file or the new one, never a torn one.

Private by default, shared by group on purpose: every command and job calls :func:`private_by_default`
once its config is known. Without ``train.share_group`` the process umask is 0o077 (everything any
library creates is the owner's only), records are 0600 and directories 0700. With it, the umask is
0o027, records 0640 and directories 0o2750 in that group (setgid: what is created inside inherits the
group): the group reads, never writes. The choice travels to the job's processes in the environment
(``XIRANG_SHARE_GROUP``), so ranks, requeued jobs and restarts create files alike.
"""

from __future__ import annotations

import grp
import json
import os
import threading
from pathlib import Path
from typing import Any

SHARE_ENV = "XIRANG_SHARE_GROUP"


def private_by_default(share_group: str = "") -> None:
    """Make everything this process (and its children) creates owner-only, or readable by ``share_group``."""
    if share_group:
        os.environ[SHARE_ENV] = share_group
        os.umask(0o027)
    else:
        os.environ.pop(SHARE_ENV, None)
        os.umask(0o077)


def share_group() -> str:
    """The group runs are shared with ("" = private)."""
    return os.environ.get(SHARE_ENV, "")


def record_mode() -> int:
    """Mode of a file we create: 0600, or 0640 when shared (never group-writable)."""
    return 0o640 if share_group() else 0o600


def dir_mode(private: int = 0o700) -> int:
    """Mode of a directory we create: ``private`` (0700), or 0o2750 when shared (setgid, group r-x)."""
    return 0o2750 if share_group() else private


def make_dir(path: Path, mode: int = 0o700) -> Path:
    """Create ``path`` and missing parents with :func:`dir_mode` (whatever the umask), in the share group
    when there is one; an existing ``path`` is set to that mode too (tightened or shared)."""
    path = Path(path)
    missing = [p for p in (path, *path.parents) if not p.exists()]
    path.mkdir(parents=True, exist_ok=True)
    group = share_group()
    gid = grp.getgrnam(group).gr_gid if group else -1
    for p in {path, *missing}:
        if gid != -1:
            os.chown(p, -1, gid)
        os.chmod(p, dir_mode(mode))
    return path


def write_bytes_atomic(path: Path, data: bytes | memoryview, mode: int | None = None) -> None:
    """Replace ``path`` with ``data`` atomically (temporary file in the same directory, then rename);
    ``mode`` defaults to :func:`record_mode`."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    mode = record_mode() if mode is None else mode
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    try:
        os.fchmod(fd, mode)  # the umask does not narrow it
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
