"""Everything Hydra must know before an entry point composes ``conf/config.yaml``, and how its entry points run.

:func:`run_app` runs a ``@hydra.main`` app so that a command line Hydra cannot compose (an unknown field, a
value of the wrong type, a config group option that does not exist, an override it cannot parse) is refused
like every other bad config: one ``PROG: error: ...`` line naming the field and the fix, exit status 2,
no traceback (``HYDRA_FULL_ERROR=1`` still gets Hydra's own report).
"""

from __future__ import annotations

import difflib
import os
import sys
from collections.abc import Callable
from typing import Any

from xirang_hpc.config.fields import bad_value, unknown_field
from xirang_hpc.config.store import register_schema
from xirang_hpc.submit.sweep import register_launcher


def register_configs() -> None:
    """Register the root schema and the xirang launcher (``hydra/launcher=xirang``: sweeps -> one array job).

    Idempotent; every entry point (and the tests' composition helper) calls it before composing.
    """
    register_schema()
    register_launcher()


# ---- composition errors --------------------------------------------------------------------------

def _override_value(argv: list[str], key: str) -> str | None:
    """The value the command line gave ``key`` (``train.steps=abc`` -> ``abc``), or None."""
    for arg in argv:
        k, eq, v = arg.partition("=")
        if eq and k.lstrip("+~") == key:
            return v
    return None


def _missing_option(exc: Any, value: str | None) -> str:
    group, _, option = str(exc.missing_cfg_file or "").rpartition("/")
    options = list(exc.options or [])
    if not group:  # not a group option (e.g. the primary config itself)
        return str(exc).splitlines()[0]
    close = difflib.get_close_matches(option, options, n=1, cutoff=0.5)
    hint = f"did you mean {group}={close[0]}? " if close else ""
    return (f"invalid config {group}={option!r}: no such {group} option; {hint}"
            f"available: {', '.join(options) or 'none'}")


def explain_composition_error(exc: BaseException, argv: list[str]) -> str | None:
    """One line for a config Hydra could not compose from ``argv``; None for any other exception."""
    from hydra.errors import ConfigCompositionException, MissingConfigException, OverrideParseException
    from omegaconf.errors import ConfigAttributeError, ConfigKeyError, OmegaConfBaseException

    if isinstance(exc, MissingConfigException):
        return _missing_option(exc, None)
    if isinstance(exc, OverrideParseException):
        lines = [ln for ln in str(exc).splitlines() if ln.strip() and not ln.startswith("See https://")]
        bad = [a for a in argv if not a.startswith("-") and "=" not in a]
        what = f"cannot parse the override {bad[0]!r}" if bad else "cannot parse an override"
        return f"{what}: {'; '.join(lines)}; write GROUP=OPTION or KEY=VALUE (--help lists them)"
    if isinstance(exc, ConfigCompositionException):
        cause = exc.__cause__
        if isinstance(cause, OmegaConfBaseException) and getattr(cause, "full_key", None):
            value = _override_value(argv, str(cause.full_key))
            if isinstance(cause, (ConfigAttributeError, ConfigKeyError)):
                return unknown_field(str(cause.full_key), value, argv)
            return bad_value(cause, value)
        lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip() and not ln.startswith("See https://")]
        return "; ".join(lines).replace("\\'", "'")
    return None


def run_app(prog: str, app: Callable[[], Any]) -> Any:
    """Call the ``@hydra.main``-decorated ``app``; a command line Hydra cannot compose exits 2 with one line.

    Hydra reports its exceptions itself (``run_and_report``: its raw text, exit 1); the composition
    errors are taken before it sees them. Exceptions of the app itself are Hydra's to report, as before.
    """
    from hydra._internal import utils as hydra_utils

    original = hydra_utils.run_and_report
    argv = sys.argv[1:]

    def run_and_report(func: Callable[[], Any]) -> Any:
        def guarded() -> Any:
            try:
                return func()
            except Exception as exc:
                msg = None if os.environ.get("HYDRA_FULL_ERROR") == "1" else explain_composition_error(exc, argv)
                if msg is None:
                    raise
                print(f"{prog}: error: {msg}", file=sys.stderr, flush=True)
                sys.exit(2)

        return original(guarded)

    hydra_utils.run_and_report = run_and_report
    try:
        return app()
    finally:
        hydra_utils.run_and_report = original
