"""``xirang-status --plot``: loss and throughput against step, requeues and checkpoints marked.

What is drawn is what was measured: validation loss as points at the steps it was evaluated
(joined only between regular evaluations, never across a gap), throughput on an axis from zero,
every checkpoint ever committed (from ``events.jsonl``; pruned ones drawn fainter), and the
requeues the event log records.
"""

from __future__ import annotations

import bisect
from pathlib import Path
from typing import Any

from xirang_hpc.monitor.events import read_events
from xirang_hpc.runs.status import checkpoints, read_jsonl


def requeue_steps(run_dir: Path, rows: list[dict[str, Any]]) -> list[int]:
    """Steps of the ``requeue`` events (an event without a step lands at the last logged step before it).

    A plain rerun or resume is not a requeue and is not marked.
    """
    steps: set[int] = set()
    timed = sorted((float(r["time"]), int(r["step"])) for r in rows if "time" in r and "step" in r)
    times = [t for t, _ in timed]
    for ev in read_events(run_dir):
        if ev.get("kind") == "requeue":
            if isinstance(ev.get("step"), int):
                steps.add(int(ev["step"]))
            elif timed:
                i = bisect.bisect_right(times, float(ev.get("time", 0)))
                steps.add(timed[i - 1][1] if i else 0)
    return sorted(steps)


def checkpoint_history(run_dir: Path) -> tuple[list[int], list[int]]:
    """(every step ever committed, those since pruned): ``checkpoint`` events plus what is on disk."""
    on_disk = {c["step"] for c in checkpoints(run_dir)}
    ever = on_disk | {int(e["step"]) for e in read_events(run_dir)
                      if e.get("kind") == "checkpoint" and isinstance(e.get("step"), int)}
    return sorted(ever), sorted(ever - on_disk)


def val_segments(steps: list[int]) -> list[tuple[int, int]]:
    """Pairs of consecutive evaluations to join with a line: only gaps no wider than the usual interval.

    Two evaluations (start and end only) stay two points: a line between them would invent a curve.
    """
    if len(steps) < 3:
        return []
    gaps = [b - a for a, b in zip(steps, steps[1:])]
    usual = sorted(gaps)[(len(gaps) - 1) // 2]
    return [(a, b) for a, b in zip(steps, steps[1:]) if 0 < b - a <= usual]


def draw_val(ax: Any, val: list[dict[str, Any]], color: str | None = None, label: str = "val loss") -> Any:
    """Validation loss: a marker per evaluation, segments between regular ones; returns the marker artist."""
    by_step = {int(r["step"]): float(r["val_loss"]) for r in val}  # a re-evaluated step keeps its last value
    steps = sorted(by_step)
    pts = ax.plot(steps, [by_step[s] for s in steps], "o", color=color, label=label, gid="val_points")[0]
    for a, b in val_segments(steps):
        ax.plot([a, b], [by_step[a], by_step[b]], "-", color=pts.get_color(), alpha=0.6, gid="val_segment")
    return pts


def plot_run(run_dir: Path | str, out: Path | str) -> dict[str, Any]:
    """Write the PNG; returns what was drawn (read back from the figure's artists)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run_dir, out = Path(run_dir), Path(out)
    rows = read_jsonl(run_dir / "metrics.jsonl")
    train = [r for r in rows if "loss" in r]
    val = [r for r in rows if "val_loss" in r]
    fig, (ax_loss, ax_tput) = plt.subplots(2, 1, sharex=True, figsize=(9, 6))
    ax_loss.plot([r["step"] for r in train], [r["loss"] for r in train], label="train loss")
    if val:
        draw_val(ax_loss, val, color="tab:orange")
    ax_tput.plot([r["step"] for r in train], [r.get("tokens_per_s", 0) for r in train], color="tab:green")
    ax_tput.set_ylim(bottom=0)  # a ratio: the axis starts at zero
    ax_loss.set_ylabel("loss")
    ax_tput.set_ylabel("tokens/s")
    ax_tput.set_xlabel("step")
    req = requeue_steps(run_dir, rows)
    ever, pruned = checkpoint_history(run_dir)
    for ax in (ax_loss, ax_tput):
        for i, s in enumerate(req):
            ax.axvline(s, color="tab:red", linestyle="-", gid="requeue", label="requeue" if i == 0 else None)
        kept = [s for s in ever if s not in pruned]
        for i, s in enumerate(kept):
            ax.axvline(s, color="tab:gray", linestyle=":", gid="checkpoint", label="checkpoint" if i == 0 else None)
        for i, s in enumerate(pruned):
            ax.axvline(s, color="tab:gray", linestyle="--", alpha=0.3, linewidth=0.8, gid="checkpoint_pruned",
                       label="checkpoint (pruned)" if i == 0 else None)
    ax_loss.legend(loc="upper right")
    ax_loss.set_title(run_dir.name)
    fig.tight_layout()
    drawn = {g: sorted({int(ln.get_xdata()[0]) for ln in ax_loss.lines if ln.get_gid() == g})
             for g in ("requeue", "checkpoint", "checkpoint_pruned")}
    val_pts = [ln for ln in ax_loss.lines if ln.get_gid() == "val_points"]
    info = {
        "path": str(out), "requeue_steps": drawn["requeue"],
        "checkpoint_steps": sorted(drawn["checkpoint"] + drawn["checkpoint_pruned"]),
        "pruned_checkpoint_steps": drawn["checkpoint_pruned"], "points": len(train),
        "val_points": [int(x) for x in val_pts[0].get_xdata()] if val_pts else [],
        "val_segments": [tuple(int(x) for x in ln.get_xdata()) for ln in ax_loss.lines
                         if ln.get_gid() == "val_segment"],
        "tokens_per_s_ylim": [float(v) for v in ax_tput.get_ylim()],
    }
    fig.savefig(out, dpi=90)
    plt.close(fig)
    return info
