"""The target group: what ``xirang-plan`` plans for instead of a fixed model (``target.loss=2.1 ...``).

Exactly one of ``loss``, ``tokens`` or ``compute`` says how much to train; ``deadline`` and ``budget``
bound the plan. Nothing here changes a training run: only xirang-plan reads it
(xirang_hpc/submit/plan_target.py).
"""

from __future__ import annotations

import datetime as _dt
import math
import re
from dataclasses import dataclass

from xirang_hpc.config.errors import ConfigError

_DURATION = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*(s|m|min|h|d|w)\s*$", re.IGNORECASE)
_UNIT_S = {"s": 1.0, "m": 60.0, "min": 60.0, "h": 3600.0, "d": 86400.0, "w": 7 * 86400.0}
_MONEY = re.compile(r"^\s*(?:\$\s*([0-9]*\.?[0-9]+)|([0-9]*\.?[0-9]+)\s*(\$|[A-Za-z]{3}))\s*$")
_GPU_H = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*(gpuh|gpu-h|gpu_hours|h)?\s*$", re.IGNORECASE)


def deadline_seconds(text: str, now: _dt.datetime | None = None) -> float:
    """Seconds until ``text``: a duration (``90m``, ``36h``, ``14d``, ``2w``) or a date/time
    (``2027-01-31``, ``2027-01-31T18:00``, local time). ConfigError naming target.deadline otherwise."""
    m = _DURATION.match(str(text))
    if m:
        secs = float(m.group(1)) * _UNIT_S[m.group(2).lower()]
    else:
        try:
            when = _dt.datetime.fromisoformat(str(text).strip())
        except ValueError:
            raise ConfigError("target.deadline", text, "give a duration (90m, 36h, 14d, 2w) or a date "
                              "(2027-01-31 or 2027-01-31T18:00)") from None
        now = now or _dt.datetime.now(when.tzinfo)
        secs = (when - now).total_seconds()
    if not secs > 0:
        raise ConfigError("target.deadline", text, "the deadline is not in the future; give a later date or a "
                          "positive duration")
    return secs


def parse_budget(text: str) -> tuple[float, str]:
    """``(amount, kind)``: kind ``gpu_hours`` for a plain number (or ``5000gpuh``), ``money`` for ``$20000``,
    ``20000$`` or ``20000usd`` (any three-letter currency; priced with cluster.price_per_gpu_hour)."""
    m = _MONEY.match(str(text))
    if m and (m.group(3) is None or m.group(3) == "$" or m.group(3).lower() not in ("gpu",)):
        amount, kind = float(m.group(1) or m.group(2)), "money"
    else:
        g = _GPU_H.match(str(text))
        if not g:
            raise ConfigError("target.budget", text, "give GPU-hours (5000 or 5000gpuh) or money ($20000, "
                              "20000usd; needs cluster.price_per_gpu_hour)")
        amount, kind = float(g.group(1)), "gpu_hours"
    if not (amount > 0 and math.isfinite(amount)):
        raise ConfigError("target.budget", text, "use an amount > 0")
    return amount, kind


@dataclass
class TargetConfig:
    """A training target for ``xirang-plan``: how much to train, by when, for how much."""

    # How much: the validation loss to reach, the training tokens to use, or the FLOPs to spend (one of them).
    loss: float | None = None
    tokens: float | None = None
    compute: float | None = None
    # By when: a duration (36h, 14d) or a date (2027-01-31); "" = no deadline.
    deadline: str = ""
    # For how much: GPU-hours (5000) or money ($20000, 20000usd: needs cluster.price_per_gpu_hour); "" = none.
    budget: str = ""
    # The scaling fit to plan with; "" = <data.out_dir>/scaling_fit.json when it exists, else the published law.
    fit: str = ""

    def __post_init__(self) -> None:
        given = [k for k in ("loss", "tokens", "compute") if getattr(self, k) is not None]
        if len(given) > 1:
            raise ConfigError(f"target.{given[1]}", getattr(self, given[1]),
                              f"give one of target.loss, target.tokens or target.compute, not {' and '.join(given)}")
        for k in given:
            v = float(getattr(self, k))
            if not (v > 0 and math.isfinite(v)):
                raise ConfigError(f"target.{k}", getattr(self, k), "use a finite value > 0")
        if self.deadline:
            deadline_seconds(self.deadline)
        if self.budget:
            parse_budget(self.budget)

    @property
    def active(self) -> bool:
        """Whether a target was given (xirang-plan then plans from it; a deadline alone asks for the most
        compute it allows)."""
        amount = any(getattr(self, k) is not None for k in ("loss", "tokens", "compute"))
        return amount or bool(self.deadline or self.budget)  # a budget alone is refused there, not ignored
