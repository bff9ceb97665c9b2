"""``parallel=auto`` at launch: the planner picks the layout, ``plan.json`` records prediction and measurement."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from xirang_hpc.config.schema import XirangConfig
from xirang_hpc.planner.auto import PLAN_FILE, announce, choose, write_plan
from xirang_hpc.submit.rundir import make_private_dir, run_dir_for


def record_measured(cfg: XirangConfig, summary: dict[str, Any] | None, say: Callable[[str], None] = print) -> None:
    """With ``parallel.auto``: add the measured tokens/s to ``plan.json``, print it next to the prediction."""
    path = run_dir_for(cfg) / PLAN_FILE
    if not cfg.parallel.auto or not summary or not summary.get("tokens_per_s") or not path.exists():
        return
    record = json.loads(path.read_text())
    measured = float(summary["tokens_per_s"])
    predicted = float(record["predicted"]["tokens_per_s"])
    tokens = cfg.train.global_batch * cfg.model.seq_len
    record["measured"] = {"tokens_per_s": measured, "predicted_over_measured": predicted / measured,
                          "step_s": tokens / measured,
                          "predicted_step_s": float(record["predicted"]["time_s"]["total"])}
    write_plan(path.parent, record)
    say(f"parallel=auto: predicted {predicted:,.0f} tokens/s, measured {measured:,.0f} tokens/s "
        f"(prediction {100 * (predicted / measured - 1):+.0f}%)")


def plan_at_launch(cfg: XirangConfig, say: Callable[[str], None] = print) -> XirangConfig:
    """xirang-train's hook: with ``parallel.auto`` choose the layout, announce it, write plan.json."""
    if not cfg.parallel.auto:
        return cfg
    new, record = choose(cfg)
    announce(record, say)
    write_plan(make_private_dir(run_dir_for(new), new.checkpoint.dir_mode), record)
    return new
