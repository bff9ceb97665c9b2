"""Checkpoint interval from measured costs and the failure rate (Young/Daly), and a fault simulator.

Young (1974): T = sqrt(2*delta*M). Daly (2006, "A higher order estimate of the optimum
checkpoint interval for restart dumps", FGCS 22): T = sqrt(2*delta*M) * (1 + sqrt(delta/(2M))/3
+ (delta/(2M))/9) - delta for delta < 2M, else T = M; delta = checkpoint cost, M = mean time
between failures. For an asynchronous save delta is the training stall (the blocking part), and
T is bounded below by the persist time, because a save waits for the previous one to commit.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


def daly_interval(delta: float, mtbf: float) -> float:
    """Daly's higher-order optimum compute time between checkpoints (seconds)."""
    if delta <= 0:
        return 0.0
    if delta >= 2 * mtbf:
        return mtbf
    r = delta / (2 * mtbf)
    return math.sqrt(2 * delta * mtbf) * (1 + math.sqrt(r) / 3 + r / 9) - delta


def young_interval(delta: float, mtbf: float) -> float:
    """Young's first-order optimum."""
    return math.sqrt(2 * delta * mtbf)


def expected_waste(interval: float, delta: float, mtbf: float, restart: float = 0.0) -> float:
    """Expected fraction of wall time not spent on useful work (first-order model).

    Checkpoint overhead delta/(T+delta) plus, per failure (rate 1/M), half an interval of lost
    work plus the restart.
    """
    if interval <= 0:
        return 1.0
    return min(1.0, delta / (interval + delta) + ((interval + delta) / 2 + restart) / mtbf)


def read_history(root: Path) -> list[float]:
    """Start times (epoch s) of every (re)start of the run, from ``checkpoints/starts.jsonl``."""
    p = Path(root) / "starts.jsonl"
    if not p.exists():
        return []
    return [json.loads(x)["time"] for x in p.read_text().splitlines() if x.strip()]


@dataclass
class IntervalTuner:
    """Adapts the interval as stall/persist/step-time measurements arrive (exponential moving averages)."""

    mtbf_s: float
    history: list[float] = field(default_factory=list)
    restart_s: float = 0.0
    smoothing: float = 0.5
    stall_s: float | None = None
    persist_s: float | None = None
    step_s: float | None = None

    def _ema(self, old: float | None, new: float) -> float:
        return new if old is None else (1 - self.smoothing) * old + self.smoothing * new

    def observe(self, stall_s: float, persist_s: float, step_s: float) -> None:
        """Fold in one save's measured stall and persist time and the current step time."""
        self.stall_s = self._ema(self.stall_s, stall_s)
        self.persist_s = self._ema(self.persist_s, persist_s)
        self.step_s = self._ema(self.step_s, step_s)

    def mtbf(self) -> tuple[float, str]:
        """MTBF and where it came from: the run's restarts (>= 2 interruptions seen) or config."""
        if len(self.history) >= 3:
            span = max(self.history) - min(self.history)
            if span > 0:
                return span / (len(self.history) - 1), f"run history ({len(self.history) - 1} interruptions)"
        return self.mtbf_s, "config (checkpoint.mtbf_hours)"

    def interval_s(self) -> float:
        """Daly's interval for the measured stall, never below the persist time."""
        m, _ = self.mtbf()
        return max(daly_interval(self.stall_s or 0.0, m), self.persist_s or 0.0)

    def interval_steps(self) -> int:
        """The interval in optimizer steps (at least 1)."""
        if not self.step_s:
            return 1
        return max(1, round(self.interval_s() / self.step_s))

    def recommendation(self) -> dict[str, Any]:
        """Inputs, interval and expected waste, for ``xirang-ckpt interval``."""
        m, source = self.mtbf()
        t = self.interval_s()
        return {"stall_s": self.stall_s, "persist_s": self.persist_s, "step_s": self.step_s,
                "mtbf_s": m, "mtbf_source": source, "restart_s": self.restart_s,
                "daly_interval_s": daly_interval(self.stall_s or 0.0, m), "interval_s": t,
                "interval_steps": self.interval_steps(),
                "expected_waste_pct": 100 * expected_waste(t, self.stall_s or 0.0, m, self.restart_s)}


def simulate_waste(interval: float, delta: float, mtbf: float, work: float, restart: float = 0.0,
                   persist: float = 0.0, seed: int = 0, trials: int = 200) -> float:
    """Monte-Carlo waste fraction: exponential failures at ``mtbf``, a checkpoint after every
    ``interval`` s of work costing ``delta`` s of stall, durable ``persist`` s later; a failure
    rolls back to the last durable checkpoint and costs ``restart`` s."""
    rng = random.Random(seed)
    total_wall = 0.0
    for _ in range(trials):
        done, wall = 0.0, 0.0
        durable = 0.0  # work saved durably
        next_fail = rng.expovariate(1 / mtbf)
        while done < work:
            seg = min(interval, work - done)
            end = wall + seg + (delta if done + seg < work else 0.0)
            if end <= next_fail:
                wall, done = end, done + seg
                if done < work:
                    if wall + persist <= next_fail:
                        durable = done
            else:
                wall = next_fail + restart
                done = durable
                next_fail = wall + rng.expovariate(1 / mtbf)
        total_wall += wall
    return 1 - work * trials / total_wall
