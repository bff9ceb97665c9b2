"""``xirang-status [RUN_DIR | JOB_ID | RUN_A RUN_B ...]``: where a run (or a sweep) stands, from anywhere.

- a run directory: the full view (job state, requeues, progress, loss, tokens/s, MFU, ETA, last
  checkpoint, per-node resource use, recent events);
- a directory of run directories (a runs root, an array sweep's runs): one fixed-width line per run,
  array tasks in task order, failed runs with their cause;
- a job id: the runs under ``--runs-root`` launched by that job (array tasks ``ID_N`` included);
- two or more run directories: a comparison (config differences, progress, final numbers);
- ``--goodput``: where the run's time went: goodput, badput by cause, disruptions, MTBF, rolling
  windows (``--json``; ``--plot [PNG]`` draws its timeline and breakdown);
- ``--queue``: the cluster (partitions, nodes, jobs with pending reasons in words, quotas, fair share,
  utilization of the last hour from sacct).

``--watch`` refreshes (a progress bar on a terminal, plain lines in logs), ``--json`` prints
machine-readable output, ``--plot [PNG]`` writes loss and throughput against step (overlaid when
comparing runs).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from xirang_hpc.files import private_by_default
from xirang_hpc.runs.render import render_array, render_run
from xirang_hpc.runs.status import find_runs, is_run_dir, run_status, task_key
from xirang_hpc.slurm import states

JOB_ID = re.compile(r"\d+(_\d+)?")


class StatusError(Exception):
    """The argument names no run."""


def resolve(target: str, runs_root: Path) -> tuple[list[Path], bool]:
    """(run directories, whether to show one line each)."""
    p = Path(target).expanduser()
    if p.is_dir():
        if is_run_dir(p):
            return [p], False
        runs = find_runs(p)
        if runs:
            return runs, True
        raise StatusError(f"{p} is neither a run directory (no metrics.jsonl, events.jsonl, heartbeats/, "
                          "checkpoints/ or submitit/) nor a directory of runs")
    if p.exists():
        raise StatusError(f"{p} is a file, not a run directory")
    if not JOB_ID.fullmatch(target):
        raise StatusError(f"no such run directory: {p.absolute()} (pass a run directory, a directory of runs, "
                          "or a Slurm job id such as 1234 or 1234_5)")
    runs = find_runs(runs_root, target)
    if not runs:
        raise StatusError(f"no run directory for job {target!r} under {runs_root.absolute()}; "
                          "pass the run directory, or --runs-root where the runs live")
    return runs, len(runs) > 1


def _site_status(run: Path) -> dict[str, Any]:
    """A run placed on several sites (submit/sites/): its site, its history across sites, where it moved;
    Slurm is asked on that site (``-M <site>`` on squeue, sacct and scontrol: job ids are per cluster)."""
    from xirang_hpc.slurm.accounting import Result, on_cluster
    from xirang_hpc.slurm.jobs import run_cmd
    from xirang_hpc.submit.sites import read_site_state

    st = read_site_state(run)
    if st is None:
        return run_status(run)
    aimed = on_cluster(lambda argv: Result(0, out, "") if (out := run_cmd(argv)) is not None else Result(1, "", ""),
                       st["site"])

    def on_site(argv: list[str]) -> str | None:
        r = aimed(argv)
        return r.out if r.rc == 0 else None

    row = run_status(run, run=on_site)
    row["site"] = st["site"]
    row["site_history"] = [{"site": h["site"], "job": h["job"], "time": h["time"]} for h in st.get("history", [])]
    if st.get("run_dir") and Path(st["run_dir"]) != run.absolute():
        row["moved_to"] = st["run_dir"]
    return row


def snapshot(runs: list[Path], many: bool) -> dict[str, Any]:
    """Status of every run (``{"runs": [...]}`` for many, else the one run's dict)."""
    rows = [_site_status(r) for r in runs]
    return {"runs": sorted(rows, key=task_key)} if many else rows[0]


def render(snap: dict[str, Any], tty: bool) -> str:
    """Text for a snapshot (a run on several sites ends with its site line)."""
    text = render_array(snap["runs"]) if "runs" in snap else render_run(snap, tty)
    if "site" in snap:
        hist = " -> ".join(f"{h['site']} (job {h['job']})" for h in snap.get("site_history", []))
        text += f"\nsite: {snap['site']}; history: {hist}"
        if snap.get("moved_to"):
            text += f"\nthe run moved to {snap['site']}: {snap['moved_to']}"
    return text


def _finished(snap: dict[str, Any]) -> bool:
    rows = snap.get("runs", [snap])
    return all(states.has_ended(r["state"]) for r in rows)


def main(argv: list[str] | None = None) -> int:
    """Console entry point; returns the exit code (2: nothing found)."""
    private_by_default()  # plots and exports it writes are the user's own
    from xirang_hpc.cli.help import argparse_texts

    ap = argparse.ArgumentParser(prog="xirang-status", **argparse_texts("xirang-status"))  # type: ignore[arg-type]
    ap.add_argument("target", nargs="*", default=["runs"],
                    help="run directory, directory of runs, or job id; several run directories: compare them")
    ap.add_argument("--runs-root", type=Path, default=Path("runs"), help="where to look up a job id (default ./runs)")
    ap.add_argument("--watch", action="store_true", help="refresh until the run ends (Ctrl-C to stop)")
    ap.add_argument("--interval", type=float, default=5.0, help="seconds between refreshes with --watch")
    ap.add_argument("--json", action="store_true", help="machine-readable output")
    ap.add_argument("--plot", nargs="?", const="", default=None, metavar="PNG",
                    help="write loss/throughput vs step (default RUN_DIR/status.png)")
    ap.add_argument("--queue", action="store_true",
                    help="the cluster: partitions, nodes, jobs with pending reasons in words, quotas, fair share, "
                         "utilization of the last hour (with --plot: utilization over time, default queue.png)")
    ap.add_argument("--sites", default=None, metavar="A,B|all",
                    help="with --queue: these Slurm clusters (sites) side by side; 'all': every cluster slurmdbd "
                         "knows (sacctmgr show cluster)")
    ap.add_argument("--env", action="store_true",
                    help="the environment the run last started in: versions, code revision, hosts, container")
    ap.add_argument("--env-diff", action="store_true",
                    help="with two run directories: what differs between their environments")
    ap.add_argument("--audit", action="store_true",
                    help="who did what to the run: launches, cancels, requeues, forks, exports, servers")
    ap.add_argument("--goodput", action="store_true",
                    help="where the run's time went: goodput, badput by cause (start-up, restore, data, saves, eval, "
                         "lost steps, hang detection, recovery), disruptions and MTBF, the last hour and day "
                         "(with --plot: its timeline, default RUN_DIR/goodput.png)")
    ap.add_argument("--since", type=float, default=24.0, metavar="HOURS",
                    help="with --goodput --queue: the window, the last HOURS hours (default 24)")
    ap.add_argument("--prom", type=Path, default=None, metavar="FILE",
                    help="with --goodput --queue: also write Prometheus gauges to FILE (node_exporter textfile)")
    a = ap.parse_args(argv)
    if a.goodput and a.queue:
        return _goodput_fleet(a)
    if a.goodput:
        return _goodput(a)
    if a.env or a.env_diff:
        return _environment(a)
    if a.audit:
        return _audit(a)
    if a.sites is not None and not a.queue:
        print("xirang-status: error: --sites goes with --queue (xirang-status --queue --sites all)", file=sys.stderr)
        return 2
    if a.queue:
        return _queue(a)
    if len(a.target) > 1:
        return _compare(a)
    try:
        runs, many = resolve(a.target[0], a.runs_root)
    except StatusError as exc:
        print(f"xirang-status: error: {exc}", file=sys.stderr)
        return 2
    if a.plot is not None:
        from xirang_hpc.runs.plot import plot_run

        for r in runs:
            out = Path(a.plot) if a.plot and not many else r / "status.png"
            info = plot_run(r, out)
            if a.json:
                print(json.dumps(info))
                continue
            print(f"wrote {info['path']} ({info['points']} points, validation at {info['val_points']}, "
                  f"requeues at {info['requeue_steps']}, checkpoints at {info['checkpoint_steps']}"
                  + (f" (pruned since: {info['pruned_checkpoint_steps']})" if info["pruned_checkpoint_steps"] else "")
                  + ")")
        return 0
    tty = sys.stdout.isatty()
    ended = 0  # consecutive views in which every run looked ended
    while True:
        snap = snapshot(runs, many)
        if a.json:
            print(json.dumps(snap, default=str), flush=True)
        else:
            if a.watch and tty:
                print("\033[2J\033[H", end="")
            print(render(snap, tty), flush=True)
        # A requeue passes through states that look final (PREEMPTED, or the first run's record in sacct
        # before the job is pending again): --watch stops only when the next view agrees.
        ended = ended + 1 if _finished(snap) else 0
        if not a.watch or ended >= 2:
            return 0
        try:
            time.sleep(a.interval)
        except KeyboardInterrupt:
            return 0


def _goodput(a: argparse.Namespace) -> int:
    """``--goodput RUN``: the run's goodput report (text, --json, --plot)."""
    from xirang_hpc.monitor.goodput import GoodputInputError, load_run, report
    from xirang_hpc.runs.goodput import plot_goodput, render_goodput

    if len(a.target) != 1:
        print("xirang-status: error: --goodput takes one run directory (or job id)", file=sys.stderr)
        return 2
    try:
        runs, many = resolve(a.target[0], a.runs_root)
    except StatusError as exc:
        print(f"xirang-status: error: {exc}", file=sys.stderr)
        return 2
    if many:
        print(f"xirang-status: error: --goodput takes one run; {a.target[0]} holds {len(runs)} runs: name one of "
              f"them ({runs[0]})", file=sys.stderr)
        return 2
    try:
        rec = load_run(runs[0])
    except GoodputInputError as exc:
        print(f"xirang-status: error: {exc}", file=sys.stderr)
        return 2
    rep = report(rec)
    if a.plot is not None:
        rep["plot"] = plot_goodput(rec, rep, Path(a.plot) if a.plot else runs[0] / "goodput.png")
    if a.json:
        print(json.dumps(rep, default=str))
    else:
        print(render_goodput(rep))
        if "plot" in rep:
            print(f"wrote {rep['plot']['path']}")
    return 0


def _goodput_fleet(a: argparse.Namespace) -> int:
    """``--goodput --queue``: every run under --runs-root over the last --since hours, per account and user."""
    from xirang_hpc.files import write_bytes_atomic
    from xirang_hpc.monitor.goodput import fleet, prometheus_text
    from xirang_hpc.runs.goodput import render_fleet

    runs = find_runs(a.runs_root) if a.runs_root.is_dir() else []
    if not runs:
        print(f"xirang-status: error: no run directories under {a.runs_root.absolute()} (--runs-root)", file=sys.stderr)
        return 2
    now = time.time()
    view = fleet(runs, now - a.since * 3600, now)
    if a.prom is not None:
        write_bytes_atomic(a.prom, prometheus_text(view).encode(), mode=0o644)  # node_exporter reads it
    print(json.dumps(view) if a.json else render_fleet(view))
    return 0


def _audit(a: argparse.Namespace) -> int:
    """``--audit RUN``: the run's audit trail, oldest first."""
    from xirang_hpc.monitor import audit

    if len(a.target) != 1 or not Path(a.target[0]).is_dir():
        print("xirang-status: error: --audit takes one run directory", file=sys.stderr)
        return 2
    rows = audit.read(Path(a.target[0]))
    print("\n".join(json.dumps(r) for r in rows) if a.json else audit.render(rows))
    return 0


def _environment(a: argparse.Namespace) -> int:
    """``--env RUN`` (the record) and ``--env-diff RUN_A RUN_B`` (what differs)."""
    from xirang_hpc.monitor import environment

    want = 2 if a.env_diff else 1
    if len(a.target) != want:
        what = "--env-diff takes two run directories" if a.env_diff else "--env takes one run directory"
        print(f"xirang-status: error: {what}", file=sys.stderr)
        return 2
    records = []
    for t in a.target:
        rec = environment.read(Path(t))
        if rec is None:
            print(f"xirang-status: error: {t}: no {environment.ENV_FILE} (a run records it when it starts)",
                  file=sys.stderr)
            return 2
        records.append(rec)
    if a.env:
        print(json.dumps(records[0], indent=1) if a.json else "\n".join(
            f"{k}: {v}" for k, v in environment.flat(records[0]).items()))
        return 0
    changed = environment.diff(records[0], records[1])
    if a.json:
        print(json.dumps({k: list(v) for k, v in changed.items()}))
    else:
        print(environment.render_diff(a.target[0], a.target[1], changed))
    return 0


def _show_and_wait(a: argparse.Namespace, tty: bool, view: dict, render: Callable[[dict], str]) -> bool:
    """Print one queue view (JSON or text; under --watch on a terminal, over the last one) and, under --watch,
    wait --interval seconds. False when there is no next view (no --watch, or Ctrl-C)."""
    if a.json:
        print(json.dumps(view, default=str), flush=True)
    else:
        if a.watch and tty:
            print("\033[2J\033[H", end="")
        print(render(view), flush=True)
    if not a.watch:
        return False
    try:
        time.sleep(a.interval)
    except KeyboardInterrupt:
        return False
    return True


def _queue(a: argparse.Namespace) -> int:
    """``xirang-status --queue``: the cluster-wide view (plain, --json, --watch, --plot)."""
    from xirang_hpc.slurm.accounting import SlurmDB, SlurmQueryError
    from xirang_hpc.slurm.queue import gather, plot_utilization, render_queue
    from xirang_hpc.submit.quota_check import current_user

    tty = sys.stdout.isatty()
    if a.sites is not None:
        return _queue_sites(a, tty)
    while True:
        snap = gather(SlurmDB(), current_user())
        if not snap["nodes"] and not snap["jobs"] and snap["errors"]:
            print("xirang-status: error: no Slurm answers here: " + "; ".join(snap["errors"]), file=sys.stderr)
            return 2
        if a.plot is not None:
            try:
                info = plot_utilization(snap, Path(a.plot or "queue.png"))
            except SlurmQueryError as exc:
                print(f"xirang-status: error: {exc}", file=sys.stderr)
                return 2
            print(json.dumps(info) if a.json else
                  f"wrote {info['path']} ({info['points']} points, {100 * (info['fraction'] or 0):.1f}% over the "
                  "last hour)")
            return 0
        if not _show_and_wait(a, tty, snap, render_queue):
            return 0


def _queue_sites(a: argparse.Namespace, tty: bool) -> int:
    """``xirang-status --queue --sites A,B|all``: every site side by side, then each one's view."""
    from xirang_hpc.slurm.queue import gather_sites, render_sites
    from xirang_hpc.submit.quota_check import current_user
    from xirang_hpc.submit.sites import registered_clusters

    known = registered_clusters()
    names = known if a.sites == "all" else [n.strip() for n in a.sites.split(",") if n.strip()]
    if not names:
        print("xirang-status: error: --sites all: slurmdbd does not answer `sacctmgr show cluster`; name the "
              "sites (--sites alpha,beta)", file=sys.stderr)
        return 2
    unknown = [n for n in names if known is not None and n not in known]
    if unknown:
        print(f"xirang-status: error: --sites {','.join(unknown)}: not a cluster slurmdbd knows; registered: "
              f"{known}", file=sys.stderr)
        return 2
    while True:
        multi = gather_sites(names, current_user())
        if not any(r["answers"] for r in multi["summary"]):
            print("xirang-status: error: no site answers: " + "; ".join(
                f"{r['site']}: {'; '.join(r['errors'])}" for r in multi["summary"]), file=sys.stderr)
            return 2
        if not _show_and_wait(a, tty, multi, render_sites):
            return 0


def _compare(a: argparse.Namespace) -> int:
    """``xirang-status RUN_A RUN_B ...``: config differences and overlaid curves."""
    from xirang_hpc.runs.compare import compare, plot_compare, render_compare

    runs = []
    for t in a.target:
        p = Path(t).expanduser()
        if not p.is_dir():
            print(f"xirang-status: error: no such run directory: {p.absolute()}", file=sys.stderr)
            return 2
        if not is_run_dir(p):
            print(f"xirang-status: error: {p} is not a run directory (comparing needs run directories)",
                  file=sys.stderr)
            return 2
        runs.append(p)
    c = compare(runs)
    if a.plot is not None:
        c["plot"] = plot_compare(runs, Path(a.plot) if a.plot else Path("compare.png"), c["config_diff"])
    if a.json:
        print(json.dumps(c, default=str))
    else:
        print(render_compare(c))
        if "plot" in c:
            counts = ", ".join(f"{k}: {v} points" for k, v in c["plot"]["series"].items())
            print(f"wrote {c['plot']['path']} ({counts})")
    return 0


def cli() -> None:
    """setuptools console script."""
    sys.exit(main())


if __name__ == "__main__":
    cli()
