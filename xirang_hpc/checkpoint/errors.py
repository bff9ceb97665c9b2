"""A checkpoint save that failed on the storage: which file, which errno, how much space was left.

DCP wraps each rank's exception in a ``CheckpointException`` and h5py hides the file name inside
its message; :func:`write_error` digs the first ``OSError`` with an errno out of that and turns it
into a :class:`CheckpointWriteError` whose message and :meth:`~CheckpointWriteError.fields` say
what happened and what to do, so the log, ``events.jsonl`` and ``xirang-status`` name the cause.
"""

from __future__ import annotations

import errno as errno_mod
import os
import re
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint.api import CheckpointException

_H5_FILE = re.compile(r"filename = '([^']+)'")
_H5_ERRNO = re.compile(r"errno = (\d+)")
# errno -> (short cause, what to do)
_HINTS = {
    errno_mod.ENOSPC: ("no space left on the device", "free space or point checkpoint storage at a larger "
                       "filesystem (train.runs_root), or lower checkpoint.keep_last"),
    errno_mod.EDQUOT: ("disk quota exceeded", "free space in your quota or raise it, or lower checkpoint.keep_last"),
    errno_mod.EROFS: ("the filesystem is read-only", "use a writable run directory (train.runs_root)"),
    errno_mod.EACCES: ("permission denied", "make the run directory writable for this user"),
    errno_mod.EPERM: ("operation not permitted", "make the run directory writable for this user"),
    errno_mod.EIO: ("I/O error from the storage", "check the filesystem/its server; the node may need a drain"),
}


class CheckpointWriteError(OSError):
    """A save failed on the storage; ``file``, ``errno``, ``free_bytes``, ``needed_bytes`` (what the save
    needed there, when known) and ``rank`` say where and why. ``reported``: already in the events and on stderr."""

    def __init__(self, step: int, file: str, err: int, free_bytes: int | None, rank: int | None, detail: str,
                 needed_bytes: int | None = None) -> None:
        cause, fix = _HINTS.get(err, (os.strerror(err) if err else "write failed", "check the run directory"))
        free = f"{free_bytes} bytes free" if free_bytes is not None else "free space unknown"
        need = f"needs {needed_bytes} bytes ({needed_bytes / 2**20:.1f} MiB), " if needed_bytes is not None else ""
        who = f" on rank {rank}" if rank is not None else ""
        super().__init__(err, f"checkpoint save of step {step} failed{who}: {cause} "
                              f"({errno_mod.errorcode.get(err, err)}) writing {file}; {need}{free} there; {fix}")
        self.step, self.file, self.errno_name, self.free_bytes, self.rank = step, file, \
            errno_mod.errorcode.get(err, str(err)), free_bytes, rank
        self.needed_bytes = needed_bytes
        self.cause, self.detail = cause, detail
        self.reported = False

    def fields(self) -> dict[str, Any]:
        """JSON fields for the ``save_failed`` event."""
        return {"step": self.step, "file": self.file, "errno": self.errno, "errno_name": self.errno_name,
                "free_bytes": self.free_bytes, "needed_bytes": self.needed_bytes, "failed_rank": self.rank,
                "cause": self.cause, "error": self.strerror}


def free_bytes(path: Path) -> int | None:
    """Bytes available to this user on the filesystem holding ``path`` (its nearest existing parent)."""
    p = Path(path)
    while not p.exists() and p != p.parent:
        p = p.parent
    try:
        st = os.statvfs(p)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def _oserrors(exc: BaseException) -> list[tuple[OSError, int | None]]:
    """Every OSError inside ``exc`` (DCP's per-rank failures, causes, contexts), with the failing rank."""
    out: list[tuple[OSError, int | None]] = []
    seen: set[int] = set()
    todo: list[tuple[BaseException, int | None]] = [(exc, None)]
    while todo:
        e, rank = todo.pop(0)
        if id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, CheckpointException):
            todo.extend((inner, r) for r, (inner, _) in sorted(e.failures.items()))
        if isinstance(e, OSError):
            out.append((e, rank))
        for nxt in (e.__cause__, e.__context__):
            if nxt is not None:
                todo.append((nxt, rank))
    return out


def write_error(exc: BaseException, step: int, where: Path) -> CheckpointWriteError | None:
    """The storage failure behind ``exc`` as a :class:`CheckpointWriteError`, or None if it is not one."""
    for e, rank in _oserrors(exc):
        if isinstance(e, CheckpointWriteError):
            return e
        err = e.errno
        text = str(e)
        if not err:
            m = _H5_ERRNO.search(text)
            err = int(m.group(1)) if m else 0
        if not err:
            continue
        m = _H5_FILE.search(text)
        file = e.filename or (m.group(1) if m else str(where))
        # The storage writer attaches what it measured (see checkpoint/storage.py no_room); else measure now.
        free = getattr(e, "free_bytes", None)
        if free is None:
            free = free_bytes(Path(file).parent)
        return CheckpointWriteError(step, str(file), int(err), free, rank, text[:500], getattr(e, "needed_bytes", None))
    return None


class CheckpointMismatchError(RuntimeError):
    """A run directory's checkpoint holds another model (tensor shapes differ): not damage, not loadable.

    It is refused, never skipped: falling back past it (or starting fresh) would later re-save that step
    over another experiment's checkpoint.
    """


# What a collective says when a peer is gone (gloo, NCCL, the c10d store): the load failed, not the checkpoint.
_COMM_WORDS = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "ProcessGroupGloo",
               "ProcessGroupNCCL", "NCCL error", "c10d", "Socket Timeout", "DistNetworkError", "DistBackendError")


class CheckpointCommError(RuntimeError):
    """A checkpoint load failed because a peer rank or the network failed (not because the checkpoint is bad):
    the rank leaves and the job's failure handling takes over; the checkpoint stays a candidate."""


def comm_failure(exc: BaseException) -> str | None:
    """The message of a communication failure inside ``exc`` (DCP's per-rank failures, causes, contexts), or None
    when the failure is something else (a damaged or missing file, a shape)."""
    import torch.distributed as dist

    comm_types = tuple(t for t in (getattr(dist, "DistNetworkError", None), getattr(dist, "DistBackendError", None),
                                   getattr(dist, "DistStoreError", None)) if isinstance(t, type))
    seen: set[int] = set()
    todo: list[BaseException] = [exc]
    while todo:
        e = todo.pop(0)
        if id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, CheckpointException):  # its text repeats its failures': look at them instead
            todo.extend(err for err, _ in e.failures.values() if isinstance(err, BaseException))
            continue
        if (comm_types and isinstance(e, comm_types)) or (
                not isinstance(e, OSError) and any(w in str(e) for w in _COMM_WORDS)):
            return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        todo.extend(x for x in (e.__cause__, e.__context__) if x is not None)
    return None
