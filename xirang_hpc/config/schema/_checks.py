"""Checks shared by the group schemas."""

from __future__ import annotations

import dataclasses
import math

from xirang_hpc.config.errors import ConfigError


def check_finite(group: str, obj: object) -> None:
    """Refuse NaN and infinities in every float field of ``obj`` (also inside lists and dicts).

    ``nan <= 0`` is False, so without this a NaN slips through every range check below.
    """
    for f in dataclasses.fields(obj):  # type: ignore[arg-type]
        value = getattr(obj, f.name)
        if isinstance(value, dict):
            items = list(value.items())
        elif isinstance(value, list):
            items = list(enumerate(value))
        else:
            items = [(None, value)]
        for key, v in items:
            if isinstance(v, float) and not math.isfinite(v):
                where = f"{group}.{f.name}" + (f"[{key!r}]" if key is not None else "")
                raise ConfigError(where, v, "must be a finite number (not NaN or infinity)")


def check_positive(group: str, name: str, value: float, fix: str = "use a value > 0") -> None:
    """Refuse ``value <= 0`` for ``group.name``, saying how to fix it."""
    if value <= 0:
        raise ConfigError(f"{group}.{name}", value, f"must be positive; {fix}")
