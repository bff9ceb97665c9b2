"""What a config field's name or value should have been: the nearest fields of the schema, the type a field takes.

Used wherever a field named on the command line is not in the schema or its value does not fit (Hydra's
composition, :func:`~xirang_hpc.config.validate.load_config`), so every such refusal reads the same.
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import types
import typing
from collections.abc import Sequence
from typing import Any

from xirang_hpc.config.errors import UnknownFieldError


def override_of(argv: Sequence[str], key: str) -> str:
    """The override as written that sets ``key`` or a field below it (``trian`` -> ``trian.max_steps=1``)."""
    for arg in argv:
        k = arg.partition("=")[0].lstrip("+~")
        if k == key or k.startswith(key + "."):
            return arg
    return key


def _schema_at(path: list[str]) -> type | None:
    """The schema dataclass at ``path`` (``["train"]`` -> TrainConfig; ``[]`` -> XirangConfig), or None."""
    from xirang_hpc.config.schema import XirangConfig

    cls: Any = XirangConfig
    for part in path:
        if not dataclasses.is_dataclass(cls):
            return None
        try:
            cls = typing.get_type_hints(cls).get(part)
        except Exception:  # noqa: BLE001 - an annotation that does not resolve: no schema to name
            return None
    return cls if dataclasses.is_dataclass(cls) else None


def _type_name(tp: Any) -> str:
    """``int`` -> 'an integer', ``list[str]`` -> 'a list', ``str | None`` -> 'a string (or null)'."""
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    optional = type(None) in typing.get_args(tp)
    if typing.get_origin(tp) in (typing.Union, types.UnionType) and len(args) == 1:
        return _type_name(args[0]) + (" (or null)" if optional else "")
    origin = typing.get_origin(tp) or tp
    names = {int: "an integer", float: "a number", bool: "true or false", str: "a string", list: "a list",
             dict: "a mapping", tuple: "a list"}
    if typing.get_origin(tp) is typing.Literal:
        return "one of " + ", ".join(map(repr, typing.get_args(tp)))
    if isinstance(origin, type) and issubclass(origin, enum.Enum):
        return "one of " + ", ".join(m.name for m in origin)
    return names.get(origin, getattr(origin, "__name__", str(origin)))


# Fields the schema no longer has, by full key: (the default they had, the key that replaces them in the
# environment variable XIRANG_TESTPOINT_SLOW). They were test-only slow-downs; the variable is read by
# xirang_hpc/runtime/testpoint.py.
REMOVED: dict[str, tuple[Any, str]] = {
    "monitor.debug_slow_rank": (-1, "rank"),
    "monitor.debug_slow_s": (0.0, "s"),
    "monitor.debug_slow_steps": ([], "steps"),
    "monitor.debug_slow_phases": (["data"], "phases"),
    "monitor.debug_slow_save_s": (0.0, "save_s"),
    "monitor.debug_slow_eval_s": (0.0, "eval_s"),
}


def drop_removed(container: dict[str, Any]) -> None:
    """Drop the :data:`REMOVED` fields from a config dict in place; refuse one that asks for something.

    Every config written before they went carries them (a queued or requeued job's ``job_config.json``, a
    run's saved state): at their old default they asked for nothing, so such a config still loads. A
    non-default value raises :class:`~xirang_hpc.config.errors.UnknownFieldError` naming the field and the
    environment variable to use instead: ignoring it would run without the slow-down it asked for.
    """
    for key, (default, _) in REMOVED.items():
        group, _, name = key.rpartition(".")
        node = container.get(group)
        if isinstance(node, dict) and name in node:
            value = node.pop(name)
            if value != default:
                raise UnknownFieldError(key, value, _removed(key, value))


def _removed(full_key: str, value: Any) -> str:
    """The refusal of a :data:`REMOVED` field: what replaces it, with ``value`` (as set) written the new way."""
    if isinstance(value, (list, tuple)):
        shown = "+".join(map(str, value))
    else:  # a command line's text: [8,9] -> 8+9
        shown = str(value or "").strip().strip("[]").replace(",", "+").replace(" ", "")
    return (f"config field {full_key} no longer exists: the test-only slow-downs are set with the "
            f"environment variable XIRANG_TESTPOINT_SLOW (here XIRANG_TESTPOINT_SLOW={REMOVED[full_key][1]}="
            f"{shown or '...'}; its keys are rank, s, steps, phases, save_s, eval_s, load_s; see "
            f"xirang_hpc/runtime/testpoint.py)")


def unknown_field(full_key: str, value: str | None, argv: Sequence[str] = ()) -> str:
    """``PATH has no field NAME; did you mean ...?`` (the nearest fields at that level, else all of them)."""
    if full_key in REMOVED:
        return _removed(full_key, value if value is not None else override_of(argv, full_key).partition("=")[2])
    *parent, name = full_key.split(".")
    cls = _schema_at(parent)
    where = ".".join(parent) or "the config"
    shown = f"{full_key}={value!r}" if value is not None else repr(override_of(argv, full_key))
    if cls is None:
        return f"unknown config field {shown}: {where} has no field {name!r}; --cfg job lists every field"
    fields = [f.name for f in dataclasses.fields(cls)]
    prefix = ".".join(parent) + "." if parent else ""
    close = difflib.get_close_matches(name, fields, n=3, cutoff=0.5)
    if not parent:  # a group's field without its group (max_steps=3): that group's field
        below = [f"{g}.{name}" for g in fields if (sub := _schema_at([g])) is not None
                 and name in {f.name for f in dataclasses.fields(sub)}]
        close = below or difflib.get_close_matches(name, fields, n=3, cutoff=0.6)
    if close:
        hint = "did you mean " + " or ".join(prefix + c for c in close) + "?"
    else:
        hint = f"its fields are {', '.join(prefix + f for f in fields)}"
    return f"unknown config field {shown}: {where} has no field {name!r}; {hint}"


def bad_value(cause: Any, value: str | None) -> str:
    """An OmegaConf validation error (``cause``: its ``full_key`` and message) with the type the field takes."""
    full_key = str(cause.full_key)
    *parent, name = full_key.split(".")
    cls = _schema_at(parent)
    want = ""
    if cls is not None:
        try:
            tp = typing.get_type_hints(cls).get(name)
        except Exception:  # noqa: BLE001
            tp = None
        if tp is not None:
            want = _type_name(tp)
    problem = str(cause.msg if getattr(cause, "msg", None) else cause).splitlines()[0]
    fix = f"set {full_key}= to {want}" if want else f"set {full_key}= to a valid value"
    shown = value if value is not None else getattr(cause, "value", None)
    return f"invalid config {full_key}={shown!r}: {problem}; {fix}"
