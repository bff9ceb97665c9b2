"""The error every weights path raises: one line naming the path and the fix."""

from __future__ import annotations


class WeightsError(RuntimeError):
    """Weights cannot be found or do not fit the model; the message names the path and the fix."""
