"""The one error type for bad configuration: it names the field, the value and the fix."""

from __future__ import annotations

from typing import Any


class ConfigError(ValueError):
    """A config value is invalid. ``str(err)`` reads ``field=value: problem; fix``."""

    def __init__(self, field: str, value: Any, fix: str) -> None:
        self.field = field
        self.value = value
        self.fix = fix
        super().__init__(f"invalid config {field}={value!r}: {fix}")


class UnknownFieldError(ConfigError):
    """A field the schema does not have (``+train.stepz=3``); the message names the nearest fields."""

    def __init__(self, field: str, value: Any, message: str) -> None:
        self.field, self.value, self.fix = field, value, message
        ValueError.__init__(self, message)
