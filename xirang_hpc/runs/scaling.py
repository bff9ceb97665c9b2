"""The points of a scaling fit from finished runs: each run's parameters, training tokens and final validation loss.

A run directory holds ``config.json`` (the composed config, written at every training start) and
``metrics.jsonl`` (rank 0's rows; the trainer evaluates at the start, every ``train.eval_every``
steps and at the last step). A run counts once its last step's ``val_loss`` row is there: its
parameters are :func:`~xirang_hpc.planner.formulas.model_params` of its model config, its tokens
the steps trained x ``train.global_batch`` x ``model.seq_len``. Anything else is unfinished, or
failed with the cause its job log names.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from xirang_hpc.config.schema import ModelConfig
from xirang_hpc.monitor.events import read_jsonl
from xirang_hpc.monitor.heartbeat import read_json
from xirang_hpc.planner.formulas import model_params
from xirang_hpc.planner.scaling import Point
from xirang_hpc.runs.status import is_run_dir, log_cause


@dataclass
class SweepRuns:
    """What the run directories of a sweep show."""

    points: list[Point] = field(default_factory=list)
    unfinished: list[str] = field(default_factory=list)  # run directories still short of their last step
    failed: list[tuple[str, str]] = field(default_factory=list)  # (run directory, cause)


def run_point(run_dir: Path) -> Point | str:
    """The run's point, or why it has none (a string)."""
    cfg = (read_json(run_dir / "config.json") or {}).get("config") or {}
    m, tr = cfg.get("model") or {}, cfg.get("train") or {}
    if not m or not tr:
        return "no config.json yet (not started)"
    known = {f.name for f in dataclasses.fields(ModelConfig)}
    try:
        model = ModelConfig(**{k: v for k, v in m.items() if k in known})
    except (TypeError, ValueError) as exc:
        return f"config.json's model is not readable: {exc}"
    last = int(tr.get("extend_to") or 0) or int(tr.get("max_steps") or 0)
    val = [r for r in read_jsonl(run_dir / "metrics.jsonl") if "val_loss" in r]
    final = [r for r in val if int(r.get("step", -1)) >= last > 0]
    if not final:
        return f"no validation loss at its last step {last} yet (last evaluated: " \
               f"{'step ' + str(val[-1]['step']) if val else 'never'})"
    loss = float(final[-1]["val_loss"])
    if not math.isfinite(loss):
        return f"its final validation loss is {loss} (diverged)"
    tokens = int(final[-1]["step"]) * int(tr.get("global_batch") or 0) * model.seq_len
    return Point(params=float(model_params(model)), tokens=float(tokens), loss=loss, run=str(run_dir))


def sweep_runs(root: Path, prefix: str) -> SweepRuns:
    """The run directories under ``root`` named ``<prefix>-*`` (the sweep's ``train.name``), read."""
    out = SweepRuns()
    if not root.is_dir():
        return out
    for d in sorted(p for p in root.iterdir() if p.name.startswith(prefix + "-") and is_run_dir(p)):
        got = run_point(d)
        if isinstance(got, Point):
            out.points.append(got)
            continue
        cause = log_cause(d)
        if cause is not None:
            out.failed.append((str(d), cause["cause"]))
        else:
            out.unfinished.append(f"{d}: {got}")
    return out


def describe_failed(runs: SweepRuns) -> str:
    """The failed runs, one line each."""
    return "\n".join(f"  {d}: {why}" for d, why in runs.failed)


def points_json(runs: SweepRuns) -> list[dict[str, Any]]:
    """The points, JSON-ready."""
    return [p.to_dict() for p in runs.points]
