"""The goodput report of ``xirang-plan --goodput``: the simulated recommendation as a table and as overrides.

The simulation (:mod:`xirang_hpc.planner.goodput_sim`, its advice in :mod:`xirang_hpc.planner.goodput_advice`)
computes; this module only words its result.
"""

from __future__ import annotations

from xirang_hpc.config.schema import RequeueConfig
from xirang_hpc.config.schema.checkpoint import MIN_FAILURES_PER_DAY, PREEMPTIONS_PER_DAY
from xirang_hpc.planner.goodput_advice import Recommendation

# Table columns: bucket -> header.
_HEADERS = {"productive": "productive", "lost": "lost progress", "recovery": "recovery", "startup": "start-up",
            "stall": "ckpt stall", "queue": "queue wait", "shrunk": "shrunk", "spares": "spares idle"}


def render(rec: Recommendation, step_s: float | None = None) -> str:
    """The report as text: inputs, one row per policy, the interval scan and the recommendation."""
    s = rec.scenario
    fm, co, ck = s["failures"], s["costs"], s["checkpoint"]
    lines = [
        f"goodput of {s['gpus']:,} GPUs ({s['nodes']:,} nodes x {s['gpus_per_node']}) over {s['days']:g} days, "
        f"{s['seeds']} seeds",
        f"  failures/node/day  hardware {fm['hardware_per_node_day']:.3g}  network {fm['network_per_node_day']:.3g}  "
        f"software {fm['software_per_node_day']:.3g}  planned {fm['planned_per_node_day']:.3g}  "
        f"({s['expected_interruptions']:.0f} interruptions expected, MTBF {s['mtbf_s'] / 3600:.2f} h)",
    ]
    if fm.get("source"):
        lines.append(f"  failure source     {fm['source']}")
    lines += [
        "  costs (s)          " + "  ".join(f"{k.removesuffix('_s')} {v:g}" for k, v in co.items()),
        f"  checkpoint         {ck['bytes_total'] / 1e9:,.1f} GB: snapshot {ck['snapshot_s']:.3g} s, write "
        f"{ck['write_s']:.3g} s ({'synchronous' if ck['synchronous'] else 'in the background'}), load "
        f"{ck['load_s']:.3g} s",
        "  Daly's interval    " + ", ".join(f"{p} {v:.1f} s" for p, v in s["daly_s"].items()),
        "",
        "| policy | spares | no spare left | interval (s) | goodput (95% CI) | " + " | ".join(_HEADERS.values())
        + " | interruptions | requeues |",
        "|---" * (6 + len(_HEADERS) + 1) + "|",
    ]
    rows = list(rec.results) + ([rec.configured] if rec.configured else [])
    for i, r in enumerate(rows):
        name = r.policy + (" (as configured)" if i >= len(rec.results) else "")
        name = f"**{name}**" if r.policy == rec.policy and i < len(rec.results) else name
        left = "-" if r.policy == "requeue" else ("shrink" if r.shrink_nodes else "requeue")
        lines.append(f"| {name} | {r.spares} | {left} | {r.interval_s:.1f} | {r.goodput_pct:.2f}% +- {r.ci_pct:.2f} | "
                     + " | ".join(f"{r.breakdown_pct[k]:.2f}%" for k in _HEADERS)
                     + f" | {r.interruptions:.1f} | {r.requeues:.1f} |")
    sc = rec.scan
    lines += ["", f"interval scan ({rec.policy}): " + ", ".join(
        f"{iv:.1f} s {g:.2f}%" for iv, g in zip(sc.intervals_s, sc.goodput_pct, strict=True)),
        f"  simulated optimum {sc.best_s:.1f} s, flat region (within {sc.tolerance_pct:.2f} points) "
        f"{sc.flat_s[0]:.1f}-{sc.flat_s[1]:.1f} s; Daly {sc.daly_s:.1f} s "
        + ("inside it" if sc.flat_s[0] <= sc.daly_s <= sc.flat_s[1] else "outside it")]
    for p, (counts, g) in rec.spares_scan.items():
        lines.append(f"spares ({p}): " + ", ".join(f"{c} {v:.2f}%" for c, v in zip(counts, g, strict=True)))
    every = f" = checkpoint.every_steps={max(1, round(rec.interval_s / step_s))} at {step_s:.2f} s/step" \
        if step_s else ""
    lines += ["", f"recommended: {rec.policy}, a checkpoint every {rec.interval_s:.1f} s{every}, "
                  f"{rec.spares} spare node(s)"
                  + ("" if rec.policy == "requeue" else
                     ", with none left " + ("shrink" if rec.shrink_nodes else "requeue")),
          "  " + " ".join(policy_overrides(rec, step_s))]
    lines += [f"note: {n}" for n in rec.notes]
    return "\n".join(lines)


def policy_overrides(rec: Recommendation, step_s: float | None = None) -> list[str]:
    """The recommendation as xirang-train overrides."""
    r = next(x for x in rec.results if x.policy == rec.policy)
    out = {"requeue": ["requeue.max_restarts_in_job=0"],
           "in-job": [f"requeue.max_restarts_in_job={max(1, r.restarts_in_job_max)}", "checkpoint.in_memory=false"],
           "in-job+memory": [f"requeue.max_restarts_in_job={max(1, r.restarts_in_job_max)}",
                             "checkpoint.in_memory=true", "checkpoint.memory_every_steps=1"]}[rec.policy]
    # The requeue budget's rates this run needs, never below the defaults' floor (config/schema/checkpoint.py).
    need = r.needed_rates(float(rec.scenario["days"]), RequeueConfig.budget_burst)
    out += [f"requeue.failures_per_day={max(MIN_FAILURES_PER_DAY, need['failures_per_day']):g}",
            f"requeue.preemptions_per_day={max(PREEMPTIONS_PER_DAY, need['preemptions_per_day']):g}",
            f"cluster.spare_nodes={rec.spares}"]
    if rec.policy != "requeue" and not rec.shrink_nodes:
        out.append(f"requeue.min_nodes={rec.scenario['nodes']}")  # requeue rather than shrink
    if step_s:
        out.append(f"checkpoint.every_steps={max(1, round(rec.interval_s / step_s))}")
    return out
