"""Text rendering of :func:`xirang_hpc.runs.status.run_status` results."""

from __future__ import annotations

import time
from typing import Any


def fmt_duration(seconds: float | None) -> str:
    """``H:MM:SS`` or ``-``."""
    if seconds is None:
        return "-"
    s = int(max(0, seconds))
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


def _or(v: object) -> str:
    """A value, or ``-`` when the run's files do not say (no heartbeats: the monitor was off)."""
    return "-" if v is None else str(v)


def _num(v: float | None, fmt: str) -> str:
    return "-" if v is None else format(v, fmt)


def fit(text: object, width: int, right: bool = False) -> str:
    """``text`` in exactly ``width`` columns: padded, or cut with ``~`` at the end so columns never shift."""
    t = str(text)
    if len(t) > width:
        t = t[: width - 1] + "~"
    return t.rjust(width) if right else t.ljust(width)


# The one-line-per-run table: (header, width, right-aligned); the last column (run, cause) is free.
ARRAY_COLUMNS = (("task", 13, False), ("state", 14, False), ("step", 13, True), ("loss", 9, True),
                 ("tok/s", 10, True), ("ETA", 9, True), ("requeues", 9, True))


def progress(step: int, total: int, tty: bool, width: int = 30) -> str:
    """A bar on a terminal, plain ``step N/M (P%)`` in logs."""
    if not total:
        return f"step {step}"
    frac = min(1.0, step / total)
    if tty:
        fill = int(round(frac * width))
        return f"[{'#' * fill}{'.' * (width - fill)}] {100 * frac:5.1f}%  step {step}/{total}"
    return f"step {step}/{total} ({100 * frac:.1f}%)"


def budget_text(b: dict[str, Any]) -> str:
    """The requeue budget per fault class: ``failures 1 used, 4 left (5 + 1/day)``."""
    names = {"failures": "failures", "preemptions": "preemptions", "timeouts": "time limits"}
    parts = []
    for cls, c in b["classes"].items():
        if c["left"] is None:
            parts.append(f"{names[cls]} {c['used']} used, no limit")
        else:
            parts.append(f"{names[cls]} {c['used']} used, {c['left']} left ({c['burst']} + {c['per_day']:g}/day)")
    cap = f"  | max_requeues {b['max_requeues']} (deprecated)" if b.get("max_requeues") is not None else ""
    return "requeues: " + "; ".join(parts) + f" over {b['days']:.1f} day(s)" + cap


def render_run(s: dict[str, Any], tty: bool = False) -> str:
    """The multi-line view of one run."""
    mfu = "n/a" if s["mfu"] is None else f"{100 * s['mfu']:.1f}%"
    lines = [
        f"run       {s['run_dir']}  (model {_or(s['model'])}, {_or(s['world_size'])} ranks on {_or(s['num_nodes'])} "
        "node(s))",
        f"job       {_or(s['job_id'])} [{_or(s['executor'])}]  {s['state']}"
        + (f" ({s['state_reason']})" if s.get("state_reason") not in (None, "", "None") else "")
        + f"  | requeues {s['requeues']}",
        *([f"budget    {budget_text(s['requeue_budget'])}"] if s.get("requeue_budget") else []),
        f"progress  {progress(s['step'], s['total_steps'], tty)}",
        f"loss      {_num(s['loss'], '.4f')}  (val {_num(s['val_loss'], '.4f')} @ step {s['val_step']})"
        f"  | {_num(s['tokens_per_s'], ',.0f')} tok/s  | {_num(s['tflops'], '.3f')} TFLOP/s  | MFU {mfu}"
        f"  | ETA {fmt_duration(s['eta_s'])}",
    ]
    c = s["checkpoint"]
    ck = f"step {c['step']}, {fmt_duration(c['age_s'])} ago  ({c['path']})" if c and c.get("path") else "none"
    for bad in (c or {}).get("corrupt", []):
        ck += f"\n          step {bad['step']} CORRUPT: {bad['reason']}"
    lines.append(f"ckpt      {ck}")
    ev = s.get("eval")
    if ev:  # <run>/eval.json (xirang_hpc/eval)
        lines.append(f"eval      val loss {ev['val_loss']:.4f}, perplexity {ev['perplexity']:.2f} @ step {ev['step']}"
                     f"{'' if ev.get('passed', True) else '  (FAILED the eval.max_val_loss gate)'}"
                     f"  | sample {ev.get('sample', '')[:40]!r}"
                     + (f"  | of {s['eval_run']}" if s.get("eval_run") else ""))
    h = s.get("harness")
    if h:  # <run>/harness.json (lm-evaluation-harness, eval.harness_tasks)
        lines.append(f"harness   {harness_text(h.get('metrics', {}))} @ step {h.get('step')}")
    if s.get("pipeline"):  # xirang-pipeline chain
        pl = s["pipeline"]
        lines.append(f"pipeline  {pl['status']}: " + " -> ".join(
            f"{r['stage']} {r['status']}" + (f" ({r['job_id']})" if r.get("job_id") else "") for r in pl["stages"]))
    if s["nodes"]:
        lines.append(f"{fit('node', 15)} {fit('ranks', 11)} {fit('steps', 11)} {fit('phases', 21)} "
                     f"{fit('beat', 6, True)} {fit('cpu%', 6, True)} {fit('rss MB', 9, True)}  gpu")
        for n in s["nodes"]:
            gpu = "-" if n["gpu_util"] is None else f"{n['gpu_util']:.0f}% {n['gpu_mem_mb']:,.0f} MB {n['gpu_name']}"
            steps = f"{min(n['steps'])}-{max(n['steps'])}" if min(n["steps"]) != max(n["steps"]) else str(n["steps"][0])
            beat, cpu = format(n["beat_age_s"], ".0f") + "s", format(n["cpu_pct"], ".0f")
            rss = format(n["rss_mb"], ",.0f")
            lines.append(f"{fit(n['node'], 15)} {fit(','.join(map(str, n['ranks'])), 11)} {fit(steps, 11)} "
                         f"{fit(','.join(sorted(set(n['phases']))), 21)} {fit(beat, 6, True)} "
                         f"{fit(cpu, 6, True)} {fit(rss, 9, True)}  {gpu}")
    lines.append(f"events    last {len(s['events'])} of {s['n_events']}")
    for e in s["events"]:
        lines.append(f"  {time.strftime('%H:%M:%S', time.localtime(e.get('time', 0)))}  {e.get('kind', '?'):<12} "
                     f"{e.get('reason', '')}")
    return "\n".join(lines)


def _row_note(s: dict[str, Any]) -> str:
    """The last column: a failed run's cause, else the last event."""
    reason = s.get("state_reason")
    if s["state"] not in ("RUNNING", "COMPLETED") and reason not in (None, "", "None"):
        return str(reason)[:100]
    return str(s["events"][-1].get("reason", ""))[:60] if s["events"] else ""


def render_array(rows: list[dict[str, Any]]) -> str:
    """One line per run (array tasks in task order, or every run under a runs root), fixed-width columns."""
    head = " ".join(fit(h, w, r) for h, w, r in ARRAY_COLUMNS)
    out = [f"{head}  run: cause or last event"]
    for s in rows:
        total = f"/{s['total_steps']}" if s["total_steps"] else ""
        cells = (s["job_id"] if s["job_id"] is not None else "-", s["state"], f"{s['step']}{total}",
                 _num(s["loss"], ".4f"), _num(s["tokens_per_s"], ",.0f"), fmt_duration(s["eta_s"]), s["requeues"])
        line = " ".join(fit(c, w, r) for c, (_, w, r) in zip(cells, ARRAY_COLUMNS))
        note = _row_note(s)
        out.append(f"{line}  {s['run_dir'].rsplit('/', 1)[-1]}" + (f": {note}" if note else ""))
    return "\n".join(out)


def harness_text(metrics: dict[str, dict[str, float]]) -> str:
    """lm-evaluation-harness metrics on one line: ``task metric value, ... | task ...`` (no stderr)."""
    return " | ".join(f"{t} " + ", ".join(f"{m} {v:.4f}" for m, v in ms.items() if not m.endswith("_stderr"))
                      for t, ms in metrics.items())
