"""``xirang-status --queue``: the cluster as a user or a sysadmin needs to see it.

Partitions and nodes (busy/idle/down/drained), running and pending jobs with their reasons in words,
each account's quota use and the user's, fair-share factors (sshare), and utilization of the last
hour (sacct). Every section is gathered on its own: when slurmdbd or its database is down the view
says so and still shows what squeue, sinfo and sshare know (they answer from slurmctld).
"""

from __future__ import annotations

import time
from datetime import datetime
from pathlib import Path
from typing import Any

from xirang_hpc.slurm.accounting import (
    Assoc,
    Caller,
    HistJob,
    Node,
    Qos,
    QueueJob,
    SlurmDB,
    SlurmQueryError,
    call,
    on_cluster,
)
from xirang_hpc.slurm.quotas import ACTIVE, account_use, explain_reason, node_unusable, user_use


def node_class(state: str) -> str:
    """sinfo's node state -> busy | idle | down | drained."""
    s = state.lower().rstrip("*~#!%$@^-")
    if "drain" in s:
        return "drained"
    if node_unusable(s):
        return "down"
    if s.startswith(("alloc", "mix", "completing", "comp")):
        return "busy"
    return "idle" if s.startswith("idle") else s


def _ts(text: str) -> float | None:
    try:
        return datetime.fromisoformat(text).timestamp()
    except ValueError:
        return None


def utilization(hist: list[HistJob], capacity_cpus: int, now: float, window_s: float = 3600.0,
                buckets: int = 60) -> dict[str, Any]:
    """CPU utilization of the last ``window_s`` from sacct records: total and per bucket (a curve over time)."""
    t0 = now - window_s
    width = window_s / buckets
    used = [0.0] * buckets
    total, jobs = 0.0, set()
    for h in hist:
        start = _ts(h.start)
        if start is None or not h.cpus:
            continue
        end = _ts(h.end) or now  # a running job: up to now
        lo, hi = max(start, t0), min(end, now)
        if hi <= lo:
            continue
        jobs.add(h.job_id)
        total += (hi - lo) * h.cpus
        for b in range(int((lo - t0) // width), min(buckets, int((hi - t0) // width) + 1)):
            b_lo, b_hi = t0 + b * width, t0 + (b + 1) * width
            used[b] += max(0.0, min(hi, b_hi) - max(lo, b_lo)) * h.cpus
    cap = capacity_cpus * window_s
    return {"window_s": window_s, "capacity_cpus": capacity_cpus, "cpu_seconds": round(total, 1),
            "fraction": round(total / cap, 4) if cap else None, "jobs": len(jobs),
            "series": [[round(t0 + (b + 1) * width, 1), round(u / (capacity_cpus * width), 4) if capacity_cpus else 0.0]
                       for b, u in enumerate(used)]}


def _quota_rows(assocs: list[Assoc], jobs: list[QueueJob], user: str) -> list[dict[str, Any]]:
    rows = []
    for a in assocs:
        if a.partition or a.account == "root" or (a.user and a.user != user):
            continue
        use = account_use(jobs, a.account) if not a.user else user_use(jobs, a.user, a.account)
        rows.append({"account": a.account, "user": a.user, "cpu_used": use["cpu"], "cpu_limit": a.grp_tres.get("cpu"),
                     "gpu_used": use["gres/gpu"], "gpu_limit": a.grp_tres.get("gres/gpu"),
                     "running": use["jobs"] if not a.user else use["running"], "submitted": use["submitted"],
                     "max_jobs": a.max_jobs if a.user else a.grp_jobs,
                     "max_submit": a.max_submit if a.user else a.grp_submit, "qos": a.qos})
    return rows


def gather(db: SlurmDB, user: str, now: float | None = None) -> dict[str, Any]:
    """Everything ``--queue`` shows, JSON-ready; a section that cannot be read is named in ``errors``."""
    now = time.time() if now is None else now
    snap: dict[str, Any] = {"time": now, "errors": [], "accounting": "unknown", "cluster": "", "user": user}
    try:
        cfg = db.config()
        snap["cluster"] = cfg.get("ClusterName", "")
        snap["accounting"] = "on" if db.accounting_enabled() else "off"
        snap["enforce"] = db.enforced()
    except SlurmQueryError as exc:
        snap["errors"].append(str(exc))
    nodes: list[Node] = []
    jobs: list[QueueJob] = []
    assocs: list[Assoc] = []
    qos: list[Qos] = []
    for name, fn in (("sinfo", db.nodes), ("squeue", db.jobs)):
        try:
            if name == "sinfo":
                nodes = fn()  # type: ignore[assignment]
            else:
                jobs = fn()  # type: ignore[assignment]
        except SlurmQueryError as exc:
            snap["errors"].append(str(exc))
    if snap["accounting"] == "on":
        try:
            assocs, qos = db.associations(), db.qos()
        except SlurmQueryError as exc:
            snap["accounting"] = "down"
            snap["errors"].append(str(exc))
    parts: dict[str, dict[str, Any]] = {}
    for n in nodes:
        name = n.partition.rstrip("*")
        p = parts.setdefault(name, {"name": name, "default": n.partition.endswith("*"), "nodes": 0, "busy": 0,
                                    "idle": 0, "down": 0, "drained": 0, "cpus_alloc": 0, "cpus_total": 0})
        p["nodes"] += 1
        cls = node_class(n.state)
        p[cls] = p.get(cls, 0) + 1
        p["cpus_alloc"] += n.cpus_alloc
        p["cpus_total"] += n.cpus_total
    snap["partitions"] = list(parts.values())
    uniq = {n.name: n for n in nodes}
    snap["nodes"] = [{"name": n.name, "state": n.state, "class": node_class(n.state), "cpus_alloc": n.cpus_alloc,
                      "cpus_total": n.cpus_total, "reason": n.reason} for n in uniq.values()]
    snap["jobs"] = [{"job_id": j.job_id, "user": j.user, "account": j.account, "qos": j.qos, "partition": j.partition,
                     "state": j.state, "cpus": j.cpus, "gpus": j.gpus, "nodes": j.nodes, "time": j.time_used,
                     "nodelist": j.nodelist, "name": j.name, "reason": j.reason if j.state == "PENDING" else "",
                     "why": explain_reason(j, jobs, assocs, qos, nodes) if j.state == "PENDING" else ""}
                    for j in sorted(jobs, key=lambda j: (j.state not in ACTIVE, _job_num(j.job_id)))]
    snap["quotas"] = _quota_rows(assocs, jobs, user)
    snap["qos"] = [{"name": q.name, "priority": q.priority, "preempt": q.preempt, "preempt_mode": q.preempt_mode,
                    "max_jobs_pu": q.max_jobs_pu, "max_tres_pu": q.max_tres_pu, "grp_tres": q.grp_tres} for q in qos]
    try:
        snap["fairshare"] = [{"account": s.account, "user": s.user, "norm_shares": s.norm_shares,
                              "raw_usage": s.raw_usage, "effective_usage": s.effective_usage, "fairshare": s.fairshare}
                             for s in db.shares() if s.account != "root"]
    except SlurmQueryError as exc:
        snap["fairshare"] = []
        snap["errors"].append(str(exc))
    snap["utilization"] = None
    if snap["accounting"] == "on":
        try:
            hist = db.history(since="now-1hour")
            snap["utilization"] = utilization(hist, sum(n["cpus_total"] for n in snap["nodes"]), now)
        except SlurmQueryError as exc:
            snap["accounting"] = "down"
            snap["errors"].append(str(exc))
    return snap


def gather_sites(sites: list[str], user: str, run: Caller = call, now: float | None = None) -> dict[str, Any]:
    """:func:`gather` on every site (Slurm cluster, ``-M``) of ``sites``, plus a side-by-side summary row
    per site: nodes by state, running/pending jobs, the user's accounts' quota use there."""
    now = time.time() if now is None else now
    snaps = [gather(SlurmDB(run=on_cluster(run, s), cluster=s), user, now) for s in sites]
    for name, snap in zip(sites, snaps):
        snap["cluster"] = snap["cluster"] or name
    return {"time": now, "user": user, "sites": snaps, "summary": [site_summary(s) for s in snaps]}


def site_summary(s: dict[str, Any]) -> dict[str, Any]:
    """One site's row of the side-by-side view."""
    classes = [n["class"] for n in s["nodes"]]
    quota = [{"account": q["account"], "cpu_used": q["cpu_used"], "cpu_limit": q["cpu_limit"],
              "gpu_used": q["gpu_used"], "gpu_limit": q["gpu_limit"]} for q in s["quotas"] if not q["user"]]
    return {"site": s["cluster"], "answers": bool(s["nodes"] or s["jobs"]) or not s["errors"],
            "nodes": len(classes), "busy": classes.count("busy"), "idle": classes.count("idle"),
            "down": classes.count("down") + classes.count("drained"),
            "cpus_alloc": sum(n["cpus_alloc"] for n in s["nodes"]),
            "cpus_total": sum(n["cpus_total"] for n in s["nodes"]),
            "running": sum(1 for j in s["jobs"] if j["state"] in ACTIVE),
            "pending": sum(1 for j in s["jobs"] if j["state"] == "PENDING"), "quotas": quota,
            "errors": s["errors"]}


def render_sites(m: dict[str, Any]) -> str:
    """Every site side by side (one row each), then each site's full view."""
    when = datetime.fromtimestamp(m["time"]).strftime("%Y-%m-%d %H:%M:%S")
    out = [f"SITES  {when}"]
    out += _table(["SITE", "NODES", "BUSY", "IDLE", "DOWN", "CPUS(alloc/total)", "RUNNING", "PENDING",
                   "QUOTA CPUS(used/limit) per account"],
                  [[r["site"], r["nodes"], r["busy"], r["idle"], r["down"], f"{r['cpus_alloc']}/{r['cpus_total']}",
                    r["running"], r["pending"],
                    ", ".join(f"{q['account']} {_of(q['cpu_used'], q['cpu_limit'])}" for q in r["quotas"]) or "-"]
                   if r["answers"] else [r["site"], "-", "-", "-", "-", "-", "-", "-",
                                         "no answer: " + "; ".join(r["errors"])[:120]]
                   for r in m["summary"]])
    for s in m["sites"]:
        out += ["", "=" * 20 + f" site {s['cluster']} " + "=" * 20, render_queue(s)]
    return "\n".join(out)


def _job_num(job_id: str) -> tuple[int, str]:
    head = job_id.split("_")[0]
    return (int(head) if head.isdigit() else 0, job_id)


def _table(headers: list[str], rows: list[list[Any]]) -> list[str]:
    cells = [[("-" if v is None else str(v)) for v in r] for r in rows]
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(headers)]
    fmt = lambda r: "  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip()  # noqa: E731
    return [fmt(headers)] + [fmt(r) for r in cells]


def _why(j: dict[str, Any]) -> str:
    if j["reason"] in ("", "None"):
        return j["why"] or "-"
    return f"{j['reason']}: {j['why']}" if j["why"] else j["reason"]


def _of(used: int, limit: int | None) -> str:
    return f"{used}/{limit}" if limit is not None else f"{used}/-"


def render_queue(s: dict[str, Any]) -> str:
    """Plain fixed-width text of a :func:`gather` snapshot."""
    acct = {"on": f"slurmdbd answers (enforce {s.get('enforce', '?')})",
            "off": "off (accounting_storage/none: no quotas, no history)",
            "down": "slurmdbd DOWN: quotas, QOS and history unknown; squeue/sinfo/sshare below are current",
            "unknown": "unknown"}[s["accounting"]]
    when = datetime.fromtimestamp(s["time"]).strftime("%Y-%m-%d %H:%M:%S")
    out = [f"cluster {s['cluster'] or '?'}  {when}  accounting: {acct}"]
    for e in s["errors"]:
        out.append(f"  ! {e}")
    out.append("")
    out += _table(["PARTITION", "NODES", "BUSY", "IDLE", "DOWN", "DRAINED", "CPUS(alloc/total)"],
                  [[p["name"] + ("*" if p["default"] else ""), p["nodes"], p["busy"], p["idle"], p["down"],
                    p["drained"], f"{p['cpus_alloc']}/{p['cpus_total']}"] for p in s["partitions"]])
    out.append("")
    out += _table(["NODE", "STATE", "CPUS(alloc/total)", "REASON"],
                  [[n["name"], n["state"], f"{n['cpus_alloc']}/{n['cpus_total']}", n["reason"]] for n in s["nodes"]])
    run = [j for j in s["jobs"] if j["state"] in ACTIVE]
    pend = [j for j in s["jobs"] if j["state"] == "PENDING"]
    out += ["", f"JOBS: {len(run)} running, {len(pend)} pending"]
    if s["jobs"]:
        out += _table(["JOBID", "USER", "ACCOUNT", "QOS", "PARTITION", "STATE", "CPUS", "NODES", "TIME", "WHERE / WHY"],
                      [[j["job_id"], j["user"], j["account"], j["qos"], j["partition"], j["state"], j["cpus"],
                        j["nodes"], j["time"],
                        j["nodelist"] if j["state"] != "PENDING" else _why(j)]
                       for j in s["jobs"]])
    if s["quotas"]:
        out += ["", f"QUOTAS (accounts, and user {s['user']})"]
        out += _table(["ACCOUNT", "USER", "CPUS(used/limit)", "GPUS(used/limit)", "JOBS(run/max)",
                       "SUBMITTED(n/max)", "QOS"],
                      [[q["account"], q["user"] or "(all)", _of(q["cpu_used"], q["cpu_limit"]),
                        _of(q["gpu_used"], q["gpu_limit"]), _of(q["running"], q["max_jobs"]),
                        _of(q["submitted"], q["max_submit"]), ",".join(q["qos"])] for q in s["quotas"]])
    if s.get("qos"):
        out += ["", "QOS"]
        out += _table(["NAME", "PRIORITY", "PREEMPTS", "PREEMPT MODE", "MAX JOBS/USER", "MAX TRES/USER"],
                      [[q["name"], q["priority"], ",".join(q["preempt"]) or "-", q["preempt_mode"], q["max_jobs_pu"],
                        ",".join(f"{k}={v}" for k, v in q["max_tres_pu"].items()) or "-"] for q in s["qos"]])
    if s["fairshare"]:
        out += ["", "FAIR SHARE (sshare: lower usage -> higher factor -> earlier start)"]
        out += _table(["ACCOUNT", "USER", "NORM SHARES", "RAW USAGE", "EFFECTIVE USAGE", "FAIRSHARE"],
                      [[f["account"], f["user"] or "(all)", f"{f['norm_shares']:.3f}", f["raw_usage"],
                        f"{f['effective_usage']:.3f}", "-" if f["fairshare"] is None else f"{f['fairshare']:.3f}"]
                       for f in s["fairshare"]])
    u = s.get("utilization")
    out.append("")
    if u and u["fraction"] is not None:
        out.append(f"UTILIZATION last {u['window_s'] / 3600:.0f}h: {100 * u['fraction']:.1f}% of {u['capacity_cpus']} "
                   f"CPUs ({u['cpu_seconds'] / 3600:.2f} CPU-hours, {u['jobs']} job(s), from sacct)")
    else:
        out.append("UTILIZATION last 1h: unknown (needs sacct, i.e. slurmdbd)")
    return "\n".join(out)


def plot_utilization(s: dict[str, Any], out: Path) -> dict[str, Any]:
    """Draw the last hour's CPU utilization (per minute) from a snapshot; returns what was drawn."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    u = s.get("utilization")
    if not u:
        raise SlurmQueryError("no utilization to draw: sacct (slurmdbd) does not answer or accounting is off")
    xs = [(t - s["time"]) / 60 for t, _ in u["series"]]
    ys = [100 * f for _, f in u["series"]]
    fig, ax = plt.subplots(figsize=(8, 3.5))
    ax.step(xs, ys, where="pre")  # each point is the mean over the minute that ends at it
    ax.set_ylim(0, 105)
    ax.set_xlabel("minutes ago")
    ax.set_ylabel(f"CPU utilization (%) of {u['capacity_cpus']} CPUs")
    ax.set_title(f"{s['cluster']}: {100 * (u['fraction'] or 0):.1f}% over the last hour")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=90)
    plt.close(fig)
    return {"path": str(out), "points": len(xs), "fraction": u["fraction"]}
