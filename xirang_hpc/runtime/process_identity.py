"""Is a pid still the process we recorded? Told by its start time since boot, not by the wall clock.

A pid can be reused once its process is gone, so a record of "rank 0 is pid 1614" (a heartbeat, a run's
owner file) also keeps when that process started, and a later check compares. psutil's ``create_time()``
is boot time + start ticks, where boot time is derived from the wall clock: when the clock steps (NTP, or
a virtual machine resumed after the host paused it: +31 s seen on the CI machine), every process seems to
have started that much later, and a wall-clock comparison declared four healthy ranks dead at once. The
start in clock ticks since boot (``/proc/PID/stat``, field 22) does not move with the wall clock, so it is
what we record and compare; where it cannot be read (no ``/proc``), the wall-clock comparison remains.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import psutil

# Wall-clock slack for the fallback comparison (create_time is rounded to clock ticks).
WALL_SLACK_S = 1.0


def start_ticks(pid: int) -> int | None:
    """When ``pid`` started, in clock ticks since boot (Linux); None when it is gone or this is not Linux."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return None
    # "pid (comm) state ppid ...": comm may hold spaces and parentheses, so split after its last ")";
    # the fields from "state" (field 3) on, starttime is field 22.
    try:
        return int(stat[stat.rindex(b")") + 2:].split()[22 - 3])
    except (ValueError, IndexError):
        return None


def identity(pid: int) -> dict[str, Any]:
    """What to record beside a pid so that :func:`is_same` can tell it from a later process with that pid:
    ``start_ticks`` (boot-relative) and ``create_time`` (wall clock, the fallback)."""
    out: dict[str, Any] = {}
    ticks = start_ticks(pid)
    if ticks is not None:
        out["start_ticks"] = ticks
    try:
        out["create_time"] = psutil.Process(pid).create_time()
    except psutil.Error:
        pass
    return out


def is_same(proc: psutil.Process, ticks: int | None, started: float, exact: bool = False) -> bool:
    """``proc`` is the process recorded with start ``ticks`` (exact) or, when no ticks were recorded or none
    can be read now, one created no later than ``started`` (wall clock, +1 s; ``exact``: within 1 s of it)."""
    if ticks is not None:
        now = start_ticks(proc.pid)
        if now is not None:
            return now == ticks
    created = proc.create_time()
    return abs(created - started) < WALL_SLACK_S if exact else created <= started + WALL_SLACK_S


def is_running(pid: int, ticks: int | None, started: float, exact: bool = False) -> bool:
    """``pid`` is the recorded process (:func:`is_same`) and still runs (not gone, not a zombie)."""
    try:
        proc = psutil.Process(pid)
        return is_same(proc, ticks, started, exact) and proc.status() not in (psutil.STATUS_ZOMBIE,
                                                                              psutil.STATUS_DEAD)
    except (psutil.Error, ValueError):  # ValueError: not a valid pid (e.g. negative) in a record
        return False
