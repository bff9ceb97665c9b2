"""``xirang-status --plot``: loss and throughput against step, requeues and checkpoints marked."""

from __future__ import annotations

import bisect
from pathlib import Path
from typing import Any

from xirang_hpc.monitor.events import read_events
from xirang_hpc.monitor.heartbeat import HEARTBEAT_DIR, SESSIONS_LOG
from xirang_hpc.monitor.status import checkpoints, read_jsonl


def requeue_steps(run_dir: Path, rows: list[dict[str, Any]]) -> list[int]:
    """Steps at which the run restarted: each session after the first, and each requeue event
    (placed at the last logged step before it)."""
    sessions = read_jsonl(run_dir / HEARTBEAT_DIR / SESSIONS_LOG)
    steps = {int(s.get("start_step", 0)) for s in sessions[1:]}
    timed = sorted((float(r["time"]), int(r["step"])) for r in rows if "time" in r and "step" in r)
    times = [t for t, _ in timed]
    for ev in read_events(run_dir):
        if ev.get("kind") == "requeue":
            if "step" in ev:
                steps.add(int(ev["step"]))
            elif timed:
                i = bisect.bisect_right(times, float(ev.get("time", 0)))
                steps.add(timed[i - 1][1] if i else 0)
    return sorted(steps)


def plot_run(run_dir: Path | str, out: Path | str) -> dict[str, Any]:
    """Write the PNG; returns what was drawn (the marker steps read back from the figure)."""
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
        ax_loss.plot([r["step"] for r in val], [r["val_loss"] for r in val], "o--", label="val loss")
    ax_tput.plot([r["step"] for r in train], [r.get("tokens_per_s", 0) for r in train], color="tab:green")
    ax_loss.set_ylabel("loss")
    ax_tput.set_ylabel("tokens/s")
    ax_tput.set_xlabel("step")
    req = requeue_steps(run_dir, rows)
    ck = sorted({c["step"] for c in checkpoints(run_dir)}
                | {int(e["step"]) for e in read_events(run_dir) if e.get("kind") == "checkpoint" and "step" in e})
    for ax in (ax_loss, ax_tput):
        for i, s in enumerate(req):
            ax.axvline(s, color="tab:red", linestyle="-", gid="requeue", label="requeue" if i == 0 else None)
        for i, s in enumerate(ck):
            ax.axvline(s, color="tab:gray", linestyle=":", gid="checkpoint", label="checkpoint" if i == 0 else None)
    ax_loss.legend(loc="upper right")
    ax_loss.set_title(run_dir.name)
    fig.tight_layout()
    drawn = {g: sorted({int(ln.get_xdata()[0]) for ln in ax_loss.lines if ln.get_gid() == g})
             for g in ("requeue", "checkpoint")}
    fig.savefig(out, dpi=90)
    plt.close(fig)
    return {"path": str(out), "requeue_steps": drawn["requeue"], "checkpoint_steps": drawn["checkpoint"],
            "points": len(train)}
