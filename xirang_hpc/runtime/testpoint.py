"""Test points: a pause at a named stage of the job, so an end-to-end test can preempt it exactly there.

Only tests set ``XIRANG_TESTPOINT``; unset (every real run) :func:`pause` is one dictionary lookup.
Format: comma-separated ``STAGE@RESTART[#N][/RANK]=SECONDS`` -- pause ``SECONDS`` at the ``N``-th (default:
every) arrival at ``STAGE`` in a process of the run's ``RESTART``-th start (``SLURM_RESTART_COUNT``); with
``/RANK``, only global rank ``RANK`` pauses (at the stages that know their rank: ``build``, ``load``), e.g. a rank the
test stops in the middle of a restore while its peers go on into the load's collectives.
On arrival the process first touches ``$XIRANG_TESTPOINT_DIR/STAGE@RESTART.<pid>``, so the test knows
the job is there. Stages: ``rendezvous`` (ranks > 0 before checking in: rank 0 waits in the
rendezvous), ``build`` (after the rendezvous, before the model is built), ``load`` (before a checkpoint's
tensors are read), ``save`` (in the background save,
files written but the step not yet committed), ``step`` (after each training step and its hooks:
a run that lasts long without more work, e.g. one that must meet its time limit).

Slow-downs (``XIRANG_TESTPOINT_SLOW``, also set only by tests and benchmarks): a straggler rank, a slow
checkpoint writer, a slow evaluation, for the watchdog's tests. Format: comma-separated ``KEY=VALUE``,
a list's items joined by ``+``:

- ``rank=R``, ``s=SECONDS``: global rank ``R`` (``rank=all``: every rank, a slow step rather than a
  straggler) sleeps ``SECONDS`` on entering each of ``phases`` (default ``data``) of the training steps
  ``steps`` (default every step; ``steps=0``: a slow first step);
- ``save_s=SECONDS``: every rank's checkpoint writer sleeps this long per tensor written (a slow filesystem);
- ``load_s=SECONDS``: every rank sleeps this long per tensor it reads in a checkpoint restore (slow storage);
- ``eval_s=SECONDS``: every rank sleeps this long per evaluation batch (a long evaluation).

E.g. ``rank=3,s=6,steps=8+9,phases=data+forward+backward+optimizer``, ``rank=all,s=60,phases=forward``
(60-s steps), ``rank=3,s=20,phases=restore`` (a rank late into the restore) or ``save_s=0.6,eval_s=1.0,load_s=0.5``.
The sleeps happen where the job reports that it still moves (a phase begins, a tensor is written or read,
an evaluation batch is done), so they look to the watchdog exactly like slow work. A spec is parsed once.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from xirang_hpc.slurm import control

ENV = "XIRANG_TESTPOINT"
DIR_ENV = "XIRANG_TESTPOINT_DIR"
SLOW_ENV = "XIRANG_TESTPOINT_SLOW"
_arrivals: dict[str, int] = {}
ALL_RANKS = -2  # ``rank=all`` in XIRANG_TESTPOINT_SLOW


ANY_RANK = -1  # a pause without ``/RANK``


def parse(spec: str) -> dict[tuple[str, int], tuple[int, float, int]]:
    """``"load@1=60,save@0#2=90,load@0/3=30"`` -> {(stage, restart): (nth or 0 for every, seconds, rank or
    ANY_RANK)}."""
    out: dict[tuple[str, int], tuple[int, float, int]] = {}
    for item in filter(None, (s.strip() for s in spec.split(","))):
        where, seconds = item.split("=", 1)
        stage, _, rest = where.partition("@")
        rest, _, rank = rest.partition("/")
        restart, _, nth = rest.partition("#")
        out[(stage, int(restart or 0))] = (int(nth or 0), float(seconds), int(rank) if rank else ANY_RANK)
    return out


def pause(stage: str, env: Mapping[str, str] | None = None, rank: int | None = None) -> float:
    """Sleep when ``XIRANG_TESTPOINT`` names ``stage`` for this restart (and ``rank``, when it names one);
    returns the seconds slept."""
    env = os.environ if env is None else env
    spec = env.get(ENV)
    if not spec:
        return 0.0
    restart = control.restart_count(env)
    nth, seconds, only = parse(spec).get((stage, restart), (-1, 0.0, ANY_RANK))
    if nth < 0 or (only != ANY_RANK and rank != only):
        return 0.0
    _arrivals[stage] = _arrivals.get(stage, 0) + 1
    if nth and _arrivals[stage] != nth:
        return 0.0
    if env.get(DIR_ENV):
        Path(env[DIR_ENV], f"{stage}@{restart}.{os.getpid()}").touch()
    time.sleep(seconds)
    return seconds


@dataclasses.dataclass(frozen=True)
class Slow:
    """A parsed ``XIRANG_TESTPOINT_SLOW``: the straggler (``rank`` < 0: none) and the per-item delays."""

    rank: int = -1  # ALL_RANKS: every rank
    s: float = 0.0
    steps: tuple[int, ...] = ()  # empty: every step
    phases: tuple[str, ...] = ("data",)
    save_s: float = 0.0
    eval_s: float = 0.0
    load_s: float = 0.0


@functools.lru_cache(maxsize=8)  # keyed by the spec itself: a test that changes the variable gets the new one
def parse_slow(spec: str) -> Slow:
    """``"rank=3,s=6,steps=8+9,phases=data+forward"`` -> :class:`Slow`; an unknown key is a ValueError."""
    keys = [f.name for f in dataclasses.fields(Slow)]
    values: dict[str, Any] = {}
    for item in filter(None, (x.strip() for x in spec.split(","))):
        key, eq, value = (x.strip() for x in item.partition("="))
        if not eq or key not in keys:
            raise ValueError(f"{SLOW_ENV}: cannot read {item!r}; write KEY=VALUE with KEY one of "
                             f"{', '.join(keys)} (a list's items joined by +)")
        parts = [v.strip() for v in value.split("+") if v.strip()]
        if key == "rank":
            values[key] = ALL_RANKS if value == "all" else int(value)
        elif key == "steps":
            values[key] = tuple(int(v) for v in parts)
        elif key == "phases":
            values[key] = tuple(parts)
        else:
            values[key] = float(value)
    return Slow(**values)


def _slow(env: Mapping[str, str] | None) -> Slow | None:
    spec = (os.environ if env is None else env).get(SLOW_ENV)
    return parse_slow(spec) if spec else None


def slow_phase(rank: int, phase: str, step: int, env: Mapping[str, str] | None = None) -> float:
    """The straggler sleeps on entering one of its slow phases in one of its slow steps; returns the seconds."""
    slow = _slow(env)
    if slow is None or (rank != slow.rank and slow.rank != ALL_RANKS) or slow.s <= 0 or phase not in slow.phases or \
            (slow.steps and step not in slow.steps):
        return 0.0
    time.sleep(slow.s)
    return slow.s


def slow_item(kind: str, env: Mapping[str, str] | None = None) -> float:
    """Sleep ``save_s`` per tensor written (``kind="save"``), ``load_s`` per tensor read in a restore (``"load"``)
    or ``eval_s`` per evaluation batch (``"eval"``)."""
    slow = _slow(env)
    seconds = 0.0 if slow is None else {"save": slow.save_s, "eval": slow.eval_s, "load": slow.load_s}[kind]
    if seconds > 0:
        time.sleep(seconds)
    return seconds
