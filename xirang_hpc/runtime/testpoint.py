"""Test points: a pause at a named stage of the job, so an end-to-end test can preempt it exactly there.

Only tests set ``XIRANG_TESTPOINT``; unset (every real run) :func:`pause` is one dictionary lookup.
Format: comma-separated ``STAGE@RESTART[#N]=SECONDS`` -- pause ``SECONDS`` at the ``N``-th (default:
every) arrival at ``STAGE`` in a process of the run's ``RESTART``-th start (``SLURM_RESTART_COUNT``).
On arrival the process first touches ``$XIRANG_TESTPOINT_DIR/STAGE@RESTART.<pid>``, so the test knows
the job is there. Stages: ``rendezvous`` (ranks > 0 before checking in: rank 0 waits in the
rendezvous), ``load`` (before a checkpoint's tensors are read), ``save`` (in the background save,
files written but the step not yet committed), ``step`` (after each training step and its hooks:
a run that lasts long without more work, e.g. one that must meet its time limit).
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from pathlib import Path

ENV = "XIRANG_TESTPOINT"
DIR_ENV = "XIRANG_TESTPOINT_DIR"
_arrivals: dict[str, int] = {}


def parse(spec: str) -> dict[tuple[str, int], tuple[int, float]]:
    """``"load@1=60,save@0#2=90"`` -> {(stage, restart): (nth or 0 for every, seconds)}."""
    out: dict[tuple[str, int], tuple[int, float]] = {}
    for item in filter(None, (s.strip() for s in spec.split(","))):
        where, seconds = item.split("=", 1)
        stage, _, rest = where.partition("@")
        restart, _, nth = rest.partition("#")
        out[(stage, int(restart or 0))] = (int(nth or 0), float(seconds))
    return out


def pause(stage: str, env: Mapping[str, str] | None = None) -> float:
    """Sleep when ``XIRANG_TESTPOINT`` names ``stage`` for this restart; returns the seconds slept."""
    env = os.environ if env is None else env
    spec = env.get(ENV)
    if not spec:
        return 0.0
    restart = int(env.get("SLURM_RESTART_COUNT", "0") or 0)
    nth, seconds = parse(spec).get((stage, restart), (-1, 0.0))
    if nth < 0:
        return 0.0
    _arrivals[stage] = _arrivals.get(stage, 0) + 1
    if nth and _arrivals[stage] != nth:
        return 0.0
    if env.get(DIR_ENV):
        Path(env[DIR_ENV], f"{stage}@{restart}.{os.getpid()}").touch()
    time.sleep(seconds)
    return seconds
