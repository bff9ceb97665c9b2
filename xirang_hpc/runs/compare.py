"""``xirang-status RUN_A RUN_B [...]``: several runs side by side.

Each run's config comes from ``<run>/config.json`` (written at every training start) or, for a
directory that never trained itself (``xirang-ckpt rollback --to``), from its newest checkpoint's
``state.json``. The comparison lists the config keys whose values differ, each run's progress and
final numbers, where a fork came from (``forked_from.json``), and with ``--plot`` overlays training
loss, validation loss (points where measured) and tokens/s by step.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

from xirang_hpc.checkpoint.naming import committed_steps, step_dir_name
from xirang_hpc.monitor.events import read_jsonl
from xirang_hpc.runs.render import fit

CONFIG_FILE = "config.json"
# Keys that name the run's own directory rather than the experiment.
PER_RUN_KEYS = ("train.run_dir",)


def run_config(run_dir: Path) -> tuple[dict[str, Any] | None, str]:
    """(the composed config, where it was read: ``config.json`` | ``checkpoint`` | ``none``)."""
    try:
        return json.loads((run_dir / CONFIG_FILE).read_text())["config"], CONFIG_FILE
    except (OSError, ValueError, KeyError):
        pass
    root = run_dir / "checkpoints"
    for step in reversed(committed_steps(root)):
        try:
            return json.loads((root / step_dir_name(step) / "state.json").read_text())["config"], "checkpoint"
        except (OSError, ValueError, KeyError):
            continue
    return None, "none"


def flat_values(obj: Any, prefix: str = "") -> dict[str, Any]:
    """Nested dicts -> ``{"model.n_layer": 2, ...}`` with the values as they are."""
    if isinstance(obj, dict):
        out: dict[str, Any] = {}
        for k, v in obj.items():
            out.update(flat_values(v, f"{prefix}{k}."))
        return out
    return {prefix[:-1]: obj}


def config_diff(configs: list[dict[str, Any] | None]) -> dict[str, list[Any]]:
    """Keys whose values differ between the runs (``None`` where a run lacks the key or its config)."""
    flats = [flat_values(c) if c is not None else {} for c in configs]
    keys = sorted(set().union(*flats)) if flats else []
    return {k: [f.get(k) for f in flats] for k in keys
            if k not in PER_RUN_KEYS and len({json.dumps(f.get(k), sort_keys=True) for f in flats}) > 1}


def summarize(run_dir: Path) -> dict[str, Any]:
    """One run's line in the comparison."""
    rows = read_jsonl(run_dir / "metrics.jsonl")
    train = [r for r in rows if "loss" in r]
    val = [r for r in rows if "val_loss" in r]
    cfg, source = run_config(run_dir)
    tput = [float(r["tokens_per_s"]) for r in train if r.get("tokens_per_s")]
    try:
        forked = json.loads((run_dir / "forked_from.json").read_text())
        forked = {"run": forked.get("run"), "step": forked.get("step")}
    except (OSError, ValueError):
        forked = None
    return {
        "run_dir": str(run_dir), "name": run_dir.name, "config_source": source,
        "steps": int(train[-1]["step"]) if train else 0,
        "total_steps": (cfg or {}).get("train", {}).get("extend_to") or (cfg or {}).get("train", {}).get("max_steps"),
        "loss": train[-1]["loss"] if train else None,
        "val_loss": val[-1]["val_loss"] if val else None, "val_step": val[-1]["step"] if val else None,
        "tokens_per_s_median": statistics.median(tput) if tput else None,
        "forked_from": forked, "_config": cfg,
    }


def compare(run_dirs: list[Path]) -> dict[str, Any]:
    """``{"runs": [...], "config_diff": {key: [value per run]}}`` (JSON-ready)."""
    runs = [summarize(Path(r).absolute()) for r in run_dirs]
    diff = config_diff([r.pop("_config") for r in runs])
    return {"runs": runs, "config_diff": diff}


def _num(v: float | None, fmt: str) -> str:
    return "-" if v is None else format(v, fmt)


def render_compare(c: dict[str, Any]) -> str:
    """Text: one fixed-width line per run, then the config differences."""
    names = [f"[{i}]" for i in range(len(c["runs"]))]
    cols = (("", 4, False), ("step", 13, True), ("loss", 9, True), ("val loss", 9, True), ("@step", 7, True),
            ("tok/s", 10, True))
    lines = [" ".join(fit(h, w, r) for h, w, r in cols) + "  run"]
    for tag, r in zip(names, c["runs"]):
        total = f"/{r['total_steps']}" if r["total_steps"] else ""
        cells = (tag, f"{r['steps']}{total}", _num(r["loss"], ".4f"), _num(r["val_loss"], ".4f"),
                 "-" if r["val_step"] is None else r["val_step"], _num(r["tokens_per_s_median"], ",.0f"))
        note = f"  (fork of {Path(r['forked_from']['run']).name} at step {r['forked_from']['step']})" \
            if r["forked_from"] else ""
        cfg = "" if r["config_source"] == CONFIG_FILE else f"  [config from {r['config_source']}]"
        lines.append(" ".join(fit(x, w, rr) for x, (_, w, rr) in zip(cells, cols)) + f"  {r['name']}{note}{cfg}")
    diff = c["config_diff"]
    if not diff:
        lines.append("config: identical")
    else:
        width = min(40, max(len(k) for k in diff))
        lines.append(f"config differences ({len(diff)}):")
        lines.append(fit("", width + 3) + " ".join(fit(n, 14) for n in names))
        for k, vals in diff.items():
            lines.append(f"  {fit(k, width)} " + " ".join(fit(json.dumps(v), 14) for v in vals))
    return "\n".join(lines)


def plot_compare(run_dirs: list[Path], out: Path | str, diff: dict[str, list[Any]] | None = None) -> dict[str, Any]:
    """Overlay loss, validation loss and tokens/s by step for several runs; returns what was drawn."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from xirang_hpc.runs.plot import draw_val

    out = Path(out)
    fig, (ax_loss, ax_val, ax_tput) = plt.subplots(3, 1, sharex=True, figsize=(10, 9))
    series: dict[str, int] = {}
    for i, run in enumerate(run_dirs):
        run = Path(run)
        rows = read_jsonl(run / "metrics.jsonl")
        train = [r for r in rows if "loss" in r]
        val = [r for r in rows if "val_loss" in r]
        color = f"C{i % 10}"
        label = f"[{i}] {run.name}"
        ax_loss.plot([r["step"] for r in train], [r["loss"] for r in train], color=color, label=label, gid=run.name)
        if val:
            draw_val(ax_val, val, color=color, label=label)
        ax_tput.plot([r["step"] for r in train], [r.get("tokens_per_s", 0) for r in train], color=color)
        forked = run / "forked_from.json"
        if forked.is_file():
            try:
                ax_loss.axvline(int(json.loads(forked.read_text())["step"]), color=color, linestyle=":", alpha=0.7)
            except (ValueError, KeyError):
                pass
        series[run.name] = len(train)
    ax_loss.set_ylabel("train loss")
    ax_val.set_ylabel("val loss")
    ax_tput.set_ylabel("tokens/s")
    ax_tput.set_ylim(bottom=0)
    ax_tput.set_xlabel("step")
    ax_loss.legend(loc="upper right", fontsize="small")
    if diff:
        text = "; ".join(f"{k}: {' vs '.join(json.dumps(v) for v in vals)}" for k, vals in list(diff.items())[:6])
        ax_loss.set_title(text if len(text) < 140 else text[:137] + "...", fontsize="small")
    fig.tight_layout()
    fig.savefig(out, dpi=90)
    plt.close(fig)
    return {"path": str(out), "series": series}
