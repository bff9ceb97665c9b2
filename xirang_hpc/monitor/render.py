"""Text rendering of :func:`xirang_hpc.monitor.status.run_status` results."""

from __future__ import annotations

import time
from typing import Any


def fmt_duration(seconds: float | None) -> str:
    """``H:MM:SS`` or ``-``."""
    if seconds is None:
        return "-"
    s = int(max(0, seconds))
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


def _num(v: float | None, fmt: str) -> str:
    return "-" if v is None else format(v, fmt)


def progress(step: int, total: int, tty: bool, width: int = 30) -> str:
    """A bar on a terminal, plain ``step N/M (P%)`` in logs."""
    if not total:
        return f"step {step}"
    frac = min(1.0, step / total)
    if tty:
        fill = int(round(frac * width))
        return f"[{'#' * fill}{'.' * (width - fill)}] {100 * frac:5.1f}%  step {step}/{total}"
    return f"step {step}/{total} ({100 * frac:.1f}%)"


def render_run(s: dict[str, Any], tty: bool = False) -> str:
    """The multi-line view of one run."""
    mfu = "n/a" if s["mfu"] is None else f"{100 * s['mfu']:.1f}%"
    lines = [
        f"run       {s['run_dir']}  (model {s['model']}, {s['world_size']} ranks on {s['num_nodes']} node(s))",
        f"job       {s['job_id']} [{s['executor']}]  {s['state']}"
        + (f" ({s['state_reason']})" if s.get("state_reason") not in (None, "", "None") else "")
        + f"  | requeues {s['requeues']}",
        f"progress  {progress(s['step'], s['total_steps'], tty)}",
        f"loss      {_num(s['loss'], '.4f')}  (val {_num(s['val_loss'], '.4f')} @ step {s['val_step']})"
        f"  | {_num(s['tokens_per_s'], ',.0f')} tok/s  | {_num(s['tflops'], '.3f')} TFLOP/s  | MFU {mfu}"
        f"  | ETA {fmt_duration(s['eta_s'])}",
    ]
    c = s["checkpoint"]
    ck = f"step {c['step']}, {fmt_duration(c['age_s'])} ago  ({c['path']})" if c else "none"
    lines.append(f"ckpt      {ck}")
    ev = s.get("eval")
    if ev:  # <run>/eval.json (xirang_hpc/eval)
        lines.append(f"eval      val loss {ev['val_loss']:.4f}, perplexity {ev['perplexity']:.2f} @ step {ev['step']}"
                     f"{'' if ev.get('passed', True) else '  (FAILED the eval.max_val_loss gate)'}"
                     f"  | sample {ev.get('sample', '')[:40]!r}")
    if s.get("pipeline"):  # xirang-pipeline chain
        pl = s["pipeline"]
        lines.append(f"pipeline  {pl['status']}: " + " -> ".join(
            f"{r['stage']} {r['status']}" + (f" ({r['job_id']})" if r.get("job_id") else "") for r in pl["stages"]))
    if s["nodes"]:
        lines.append(f"{'node':<10}{'ranks':<10}{'steps':<12}{'phases':<22}{'beat':>6}{'cpu%':>7}{'rss MB':>9}  gpu")
        for n in s["nodes"]:
            gpu = "-" if n["gpu_util"] is None else f"{n['gpu_util']:.0f}% {n['gpu_mem_mb']:,.0f} MB {n['gpu_name']}"
            steps = f"{min(n['steps'])}-{max(n['steps'])}" if min(n["steps"]) != max(n["steps"]) else str(n["steps"][0])
            lines.append(f"{n['node']:<10}{','.join(map(str, n['ranks'])):<10}{steps:<12}"
                         f"{','.join(sorted(set(n['phases']))):<22}{n['beat_age_s']:>5.0f}s{n['cpu_pct']:>7.0f}"
                         f"{n['rss_mb']:>9,.0f}  {gpu}")
    lines.append(f"events    last {len(s['events'])} of {s['n_events']}")
    for e in s["events"]:
        lines.append(f"  {time.strftime('%H:%M:%S', time.localtime(e.get('time', 0)))}  {e.get('kind', '?'):<12} "
                     f"{e.get('reason', '')}")
    return "\n".join(lines)


def render_array(rows: list[dict[str, Any]]) -> str:
    """One line per task (array sweeps, or every run under a runs root)."""
    out = [f"{'task':<14}{'state':<11}{'step':>12}{'loss':>9}{'tok/s':>10}{'ETA':>9}{'requeues':>9}  run / last event"]
    for s in rows:
        last = s["events"][-1]["reason"][:60] if s["events"] else ""
        out.append(f"{str(s['job_id']):<14}{s['state']:<11}{str(s['step']) + '/' + str(s['total_steps']):>12}"
                   f"{_num(s['loss'], '.4f'):>9}{_num(s['tokens_per_s'], ',.0f'):>10}{fmt_duration(s['eta_s']):>9}"
                   f"{s['requeues']:>9}  {s['run_dir'].rsplit('/', 1)[-1]}  {last}")
    return "\n".join(out)
