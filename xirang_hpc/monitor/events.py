"""``run_dir/events.jsonl``: one JSON object per line, shared with the requeue policy.

Every event has at least ``time`` (Unix seconds), ``kind`` and ``reason``. The monitor writes
``dead``, ``hang``, ``unresponsive`` and ``straggler`` events with ``rank``, ``node``, ``phase``,
``step`` and ``cause``; the Slurm requeue helper appends its own kinds to the same file and
reads the failed nodes back (:func:`failed_nodes`).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from xirang_hpc.files import record_mode
from xirang_hpc.monitor import audit

EVENTS_FILE = "events.jsonl"
# Kinds whose ``node`` should be excluded when the job is requeued.
FAULT_KINDS = ("dead", "hang")
# A checkpoint save that failed on one of these (``save_failed``'s ``errno_name``) failed on the storage, not
# on a node: a full disk, a quota, a read-only or forbidden directory. Every node sees the same filesystem,
# so neither a requeue nor an in-job restart elsewhere fixes it. (EIO may be a node's own disk or link: not here.)
STORAGE_ERRNOS = ("ENOSPC", "EDQUOT", "EROFS", "EACCES", "EPERM")


def append_event(run_dir: Path | str, kind: str, reason: str, **fields: Any) -> dict[str, Any]:
    """Append one event; a single ``write`` on an ``O_APPEND`` descriptor, so writers do not interleave."""
    row: dict[str, Any] = {"time": time.time(), "kind": kind, "reason": reason, **fields}
    line = (json.dumps(row, sort_keys=False, default=str) + "\n").encode()
    fd = os.open(Path(run_dir) / EVENTS_FILE, os.O_WRONLY | os.O_APPEND | os.O_CREAT, record_mode())
    try:
        os.write(fd, line)
    finally:
        os.close(fd)
    return row


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """Rows of a JSONL file, oldest first; a torn or foreign line is skipped, not fatal."""
    if not path.exists():
        return []
    return _rows(path.read_text(errors="replace"))


def _rows(text: str) -> list[dict[str, Any]]:
    """The JSON objects of ``text``'s lines; a torn or foreign line is skipped."""
    rows = []
    for line in text.splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(row, dict):
            rows.append(row)
    return rows


def read_events(run_dir: Path | str) -> list[dict[str, Any]]:
    """All events of a run, oldest first."""
    return read_jsonl(Path(run_dir) / EVENTS_FILE)


class EventTail:
    """New events of a run as they are appended: each :meth:`read` parses only the bytes written since the
    previous one (a driver polling twice a second does not reread the whole file), and a line still being
    written is left for the next read."""

    def __init__(self, run_dir: Path | str) -> None:
        self.path = Path(run_dir) / EVENTS_FILE
        self.offset = 0

    def read(self) -> list[dict[str, Any]]:
        """Events appended since the last call, oldest first."""
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except FileNotFoundError:
            return []
        end = data.rfind(b"\n") + 1  # only whole lines: a torn tail is read again next time
        self.offset += end
        return _rows(data[:end].decode(errors="replace"))


def failed_nodes(run_dir: Path | str, since: float = 0.0) -> list[str]:
    """Nodes named by fault events (dead rank, hang culprit) at or after ``since``, in first-seen order."""
    nodes: list[str] = []
    for ev in read_events(run_dir):
        if ev.get("kind") in FAULT_KINDS and ev.get("time", 0) >= since and ev.get("node"):
            if ev["node"] not in nodes:
                nodes.append(ev["node"])
    return nodes


def storage_failure(run_dir: Path | str, since: float = 0.0) -> dict[str, Any] | None:
    """The newest ``save_failed`` event at or after ``since`` that names a storage condition
    (:data:`STORAGE_ERRNOS`), or None: the ranks then stopped because the checkpoint storage is full or
    unwritable, whatever the watchdog says of the rank that exited first."""
    found = [e for e in read_events(run_dir) if e.get("kind") == "save_failed" and e.get("time", 0) >= since
             and e.get("errno_name") in STORAGE_ERRNOS]
    return found[-1] if found else None


class EventLog:
    """The event log of one run as an event sink (``runtime.hooks.EventSink``) for the runtime."""

    def __init__(self, run_dir: Path | str) -> None:
        self.run_dir = Path(run_dir)

    def append(self, kind: str, reason: str, **fields: Any) -> dict[str, Any]:
        """Append one event to ``<run>/events.jsonl``; a requeue by the ranks also goes to the audit trail."""
        row = append_event(self.run_dir, kind, reason, **fields)
        if kind == "requeue":
            audit.record(self.run_dir, "requeue", fields.get("target") or fields.get("job"), reason=reason,
                         why=fields.get("why"), step=fields.get("step"), by="the job's ranks")
        return row

    def count(self, kind: str) -> int:
        """How many events of ``kind`` the log holds."""
        return sum(1 for e in read_events(self.run_dir) if e.get("kind") == kind)

    def rows(self) -> list[dict[str, Any]]:
        """Every event of ``<run>/events.jsonl``, oldest first."""
        return read_events(self.run_dir)
