"""Per-rank start/exit markers: which ranks of a (re)start died without unwinding.

Each rank writes ``<run dir>/ranks/r<restart>/<rank>.start`` (its node) when it joins, and
``<rank>.exit`` from an ``atexit`` handler, which runs on a normal return, ``sys.exit`` and an
uncaught exception, but not on SIGKILL, the OOM killer or a lost node. The batch-script
supervisor reads the difference to name the failed ranks and nodes.
"""

from __future__ import annotations

import atexit
import os
from pathlib import Path

from xirang_hpc.files import write_bytes_atomic


def _dir(run_dir: Path, restart: int) -> Path:
    return Path(run_dir) / "ranks" / f"r{restart}"


def mark_start(run_dir: Path, restart: int, rank: int, node: str) -> None:
    """Record that ``rank`` started on ``node`` (file text: ``node pid``); arrange for its exit marker."""
    d = _dir(run_dir, restart)
    d.mkdir(parents=True, exist_ok=True)
    # Whole or absent (a rank killed while writing it leaves no empty marker for the supervisor to misread).
    write_bytes_atomic(d / f"{rank}.start", f"{node} {os.getpid()}".encode())
    atexit.register(mark_exit, run_dir, restart, rank)


def mark_exit(run_dir: Path, restart: int, rank: int) -> None:
    """Record that ``rank`` left through Python (return, exit or exception)."""
    d = _dir(run_dir, restart)
    if d.is_dir():
        (d / f"{rank}.exit").write_text("")


def missing_ranks(run_dir: Path, restart: int) -> list[tuple[int, str]]:
    """(rank, node) of ranks that started in ``restart`` and never wrote an exit marker."""
    d = _dir(run_dir, restart)
    if not d.is_dir():
        return []
    out = []
    for start in sorted(d.glob("*.start"), key=lambda p: int(p.stem)):
        if not (d / f"{start.stem}.exit").exists():
            out.append((int(start.stem), start.read_text().split()[0]))
    return out


def rank_pid(run_dir: Path, restart: int, rank: int) -> int | None:
    """The pid ``rank`` recorded in ``restart`` (None before it started)."""
    p = _dir(run_dir, restart) / f"{rank}.start"
    return int(p.read_text().split()[1]) if p.exists() else None


STOP_CAUSE = "stop_cause.json"


def write_stop_cause(run_dir: Path, restart: int, reason: str, detail: str) -> Path:
    """Tell the ranks of ``restart`` why the stop signal that follows was sent (read by rank 0's stop
    handler instead of asking Slurm: the batch script's guard signals the ranks itself)."""
    import json

    d = _dir(run_dir, restart)
    d.mkdir(parents=True, exist_ok=True)
    path = d / STOP_CAUSE
    write_bytes_atomic(path, json.dumps({"reason": reason, "detail": detail}).encode())
    return path


def read_stop_cause(run_dir: Path, restart: int) -> tuple[str, str] | None:
    """(reason, detail) written by :func:`write_stop_cause` for ``restart``, or None."""
    import json

    try:
        d = json.loads((_dir(run_dir, restart) / STOP_CAUSE).read_text())
        return str(d["reason"]), str(d["detail"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
