"""``xirang-status RUN --goodput``: the goodput report as text, and its plot (``--plot``).

The numbers come from :mod:`xirang_hpc.monitor.goodput`; this module only shows them.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from xirang_hpc.monitor.goodput import BUCKETS, RunRecord
from xirang_hpc.runs.render import fmt_duration

LABELS = {"productive": "productive steps", "startup": "start-up", "restore": "checkpoint restore",
          "data_loading": "data loading (blocking)", "checkpoint_save": "checkpoint save (blocking)",
          "eval": "evaluation", "lost_progress": "steps lost to disruptions", "hang_detection": "hang detection",
          "recovery": "recovery (fault to next start)", "other": "other"}
COLORS = {"productive": "tab:green", "startup": "tab:blue", "restore": "tab:cyan", "data_loading": "tab:olive",
          "checkpoint_save": "tab:purple", "eval": "tab:orange", "lost_progress": "tab:red",
          "hang_detection": "tab:pink", "recovery": "tab:brown", "other": "tab:gray"}


def _pct(part: float | None, total: float | None) -> str:
    return f"{100 * part / total:5.1f}%" if part is not None and total else "    ?"


def share(g: float | None) -> str:
    """A goodput fraction as a percentage ("?" when there is no time to divide by)."""
    return "?" if g is None else f"{100 * g:.1f}%"


def _secs(v: float | None) -> str:
    if v is None:
        return "unknown"
    return f"{v:.1f}s" if v < 60 else fmt_duration(v)


def render_goodput(r: dict[str, Any]) -> str:
    """The report in a few lines: goodput, each bucket, disruptions, windows, what was skipped or flagged."""
    total = r["total_s"]
    basis = ("allocated" if r["basis"] == "allocation" else
             "observed (no Slurm accounting: allocated time and queue wait unknown)")
    lines = [f"goodput of {r['run']}: {share(r['goodput'])} of {_secs(total)} {basis}"]
    values = {"productive": r["productive_s"], **r["badput_s"]}
    for k in BUCKETS:
        lines.append(f"  {LABELS[k]:<32} {_secs(values[k]):>10}  {_pct(values[k], total)}")
    if r["queue_wait_s"] is not None:
        lines.append(f"  queue wait (not in the total)    {_secs(r['queue_wait_s']):>10}  scheduling goodput "
                     f"{share(r['scheduling_goodput'])}")
    else:
        lines.append("  queue wait                          unknown  (no Slurm accounting for this run's jobs)")
    mtbf = f", MTBF {_secs(r['mtbf_s'])}" if r["mtbf_s"] is not None else ""
    lines.append(f"disruptions: {r['disruptions']}{mtbf}; {r['starts']} start(s), step {r['last_step']} reached, "
                 f"{r['steps_kept']} steps kept; ideal step {r['ideal_step_s']:.3f}s (median)")
    for i, d in enumerate(r["disruption_list"][-10:], max(1, len(r["disruption_list"]) - 9)):
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(d["time"]))
        back = "not resumed yet" if d["restored_step"] is None else f"resumed from step {d['restored_step']}"
        rec = "" if d["recovery_s"] is None else f", recovery {_secs(d['recovery_s'])} to the next first step"
        det = f", detected after {_secs(d['detection_s'])}" if d["detection_s"] else ""
        lines.append(f"  {i}. {when} {d['cause']} (job {d['job']}): step {d['step_reached']}, {back}, "
                     f"{d['lost_steps']} steps lost ({_secs(d['lost_s'])}){det}{rec}")
    win = ", ".join(f"{name.replace('_', ' ')} {share(w['goodput'])}" for name, w in r["windows"].items())
    lines.append(f"rolling: {win}")
    for name, n in r["bad_lines"].items():
        if n:
            at = ", ".join(str(x) for x in r["bad_line_numbers"].get(name, []))
            where = f"; lines {at}" if at else ""
            lines.append(f"skipped {n} unreadable line(s) of {name} (torn or interleaved{where})")
    if r["negative_spans"]:
        shown = "; ".join(f"{s['where']} {s['seconds']:+.3f}s" for s in r["negative_spans"][:3])
        lines.append(f"flagged {len(r['negative_spans'])} negative span(s) (clocks of different hosts disagree); "
                     f"counted as zero: {shown}")
    if r.get("overcounted_s"):
        lines.append(f"the records cover {_secs(r['overcounted_s'])} more than the allocation held (clock skew?)")
    return "\n".join(lines)


def plot_goodput(rec: RunRecord, r: dict[str, Any], out: Path | str) -> dict[str, Any]:
    """A PNG: the run's timeline coloured by what each span was, and the breakdown as bars; returns what was drawn."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out)
    spans = [sp for sp in rec.timeline.spans if sp.t1 > sp.t0]
    t0 = min((sp.t0 for sp in spans), default=0.0)
    fig, (ax_t, ax_b) = plt.subplots(2, 1, figsize=(10, 5.5), gridspec_kw={"height_ratios": [1, 2]})
    drawn: dict[str, int] = {}
    by_bucket: dict[str, list[tuple[float, float]]] = {}
    for sp in spans:
        main = max(sp.parts, key=lambda k: sp.parts[k]) if sp.parts and max(sp.parts.values()) > 0 else "other"
        by_bucket.setdefault(main, []).append(((sp.t0 - t0) / 3600, (sp.t1 - sp.t0) / 3600))
    for k in BUCKETS:
        if k in by_bucket:
            ax_t.broken_barh(by_bucket[k], (0, 1), color=COLORS[k], label=LABELS[k], gid=k)
            drawn[k] = len(by_bucket[k])
    for d in r["disruption_list"]:
        ax_t.axvline((d["time"] - t0) / 3600, color="black", linewidth=0.8, gid="disruption")
    ax_t.set_yticks([])
    ax_t.set_xlabel("hours since the first start")
    ax_t.set_title(f"{rec.run_dir.name}: goodput {share(r['goodput'])} ({r['basis']} basis), "
                   f"{r['disruptions']} disruption(s)")
    values = {"productive": r["productive_s"], **r["badput_s"]}
    total = r["total_s"] or 1.0
    names = [k for k in BUCKETS]
    ax_b.barh([LABELS[k] for k in names], [100 * values[k] / total for k in names],
              color=[COLORS[k] for k in names])
    ax_b.invert_yaxis()
    ax_b.set_xlim(0, 100)  # shares of the total: the axis is the whole
    ax_b.set_xlabel("% of total time")
    fig.tight_layout()
    fig.savefig(out, dpi=90)
    plt.close(fig)
    return {"path": str(out), "spans": drawn, "disruptions": len(r["disruption_list"]),
            "bars": {k: round(100 * values[k] / total, 3) for k in names}}


def render_fleet(view: dict[str, Any]) -> str:
    """``--goodput --queue``: one line per account and user, hours lost by cause, the top causes."""
    span = (view["until"] - view["since"]) / 3600
    lines = [f"goodput over the last {span:g} h, per account and user:",
             f"{'account':<14}{'user':<12}{'runs':>5}{'total h':>9}{'goodput':>9}  top causes of badput (h)"]
    for g in view["groups"]:
        top = ", ".join(f"{LABELS[k]} {g['badput_s'][k] / 3600:.2f}" for k in g["top_causes"]) or "-"
        lines.append(f"{g['account']:<14.14}{g['user']:<12.12}{g['runs']:>5}{g['total_s'] / 3600:>9.2f}"
                     f"{share(g['goodput']):>9}  {top}")
        if g["unknown"]:
            lines.append(f"{'':31}unknown (no Slurm accounting): {', '.join(g['unknown'])}")
    if view["skipped"]:
        lines.append(f"{len(view['skipped'])} run(s) without a goodput record (steps.jsonl): "
                     + ", ".join(view["skipped"][:3]))
    return "\n".join(lines)
