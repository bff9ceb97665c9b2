"""The file HDF5 writes a checkpoint shard through: a failed write is recorded here, never shown to HDF5.

HDF5 (2.0, through h5py 3.16) does not survive a write error on its own file: with small datasets the
data sits in its caches, ``ENOSPC`` first appears when the file is closed, the close fails half-way
("Can't decrement id ref count") and leaves the file open inside the library, and the process then dies
of SIGSEGV, in that close or at interpreter exit. A full disk killed every rank of a run that way
before anything could name the cause.

So the writer hands h5py this object (h5py's ``fileobj`` driver) instead of a path. The first failed
``pwrite``/``ftruncate`` is kept in :attr:`GuardedFile.error`; from then on nothing more goes to the
disk, while HDF5 sees every call succeed: what it writes after the failure is kept in memory (its own
metadata, which it may read back; data past :data:`KEEP_AFTER_FAILURE` bytes is dropped, the file is
discarded anyway), so the close completes normally and the caller raises the recorded error itself.
Reads and writes go straight to the descriptor with ``pread``/``pwrite`` (no Python buffering; a
large shard is one system call, as with HDF5's own driver).
"""

from __future__ import annotations

import os
from pathlib import Path

# Bytes written after a failure are kept (so HDF5 can read back its metadata) up to this size per call;
# larger writes are raw tensor data of a file that will be removed.
KEEP_AFTER_FAILURE = 16 << 20


class GuardedFile:
    """A new file at ``path`` (truncated), for ``h5py.File(GuardedFile(path), "w")``."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0), 0o644)
        self.pos = 0
        self.size = 0
        self.error: OSError | None = None
        # (offset, bytes) that HDF5 wrote after the failure, overlaid on what the disk holds when it reads.
        self._kept: list[tuple[int, bytes]] = []

    # ---- the calls h5py's fileobj driver makes --------------------------------------------
    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        """Move the position (HDF5 seeks before every read and write)."""
        base = {os.SEEK_SET: 0, os.SEEK_CUR: self.pos, os.SEEK_END: self.size}[whence]
        self.pos = base + offset
        return self.pos

    def tell(self) -> int:
        """The position."""
        return self.pos

    def write(self, data: bytes | bytearray | memoryview) -> int:
        """Write at the position; after a failure, keep the bytes instead. Always reports every byte written."""
        mv = memoryview(data).cast("B")
        n, done = len(mv), 0
        if self.error is None:
            try:
                while done < n:
                    done += os.pwrite(self.fd, mv[done:], self.pos + done)
            except OSError as exc:
                self._failed(exc)
        if done < n and n - done <= KEEP_AFTER_FAILURE:
            self._kept.append((self.pos + done, bytes(mv[done:])))
        self.pos += n
        self.size = max(self.size, self.pos)
        return n

    def readinto(self, buf: bytearray | memoryview) -> int:
        """Read at the position (what was written after a failure from memory; zeros past the end)."""
        mv = memoryview(buf).cast("B")
        n = len(mv)
        got = os.preadv(self.fd, [mv], self.pos) if n else 0
        if got < n:
            mv[got:] = bytes(n - got)
        for off, kept in self._kept:
            lo, hi = max(off, self.pos), min(off + len(kept), self.pos + n)
            if lo < hi:
                mv[lo - self.pos:hi - self.pos] = kept[lo - off:hi - off]
        self.pos += n
        return n

    def read(self, size: int = -1) -> bytes:
        """``size`` bytes from the position."""
        buf = bytearray(max(0, self.size - self.pos) if size < 0 else size)
        self.readinto(buf)
        return bytes(buf)

    def truncate(self, size: int | None = None) -> int:
        """Set the file's length (HDF5 does at close); after a failure only the length it believes in."""
        size = self.pos if size is None else size
        if self.error is None:
            try:
                os.ftruncate(self.fd, size)
            except OSError as exc:
                self._failed(exc)
        self.size = size
        return size

    def flush(self) -> None:
        """Nothing is buffered here."""

    # ---- for the writer --------------------------------------------------------------------
    def _failed(self, exc: OSError) -> None:
        self.error = OSError(exc.errno, exc.strerror, str(self.path)) if exc.filename is None else exc

    def close(self) -> None:
        """Close the descriptor (after h5py closed the HDF5 file)."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
