"""What ``xirang-status`` knows about a run, gathered from its directory (and Slurm when present).

Sources, all optional: ``heartbeats/`` (session, per-rank heartbeats), ``metrics.jsonl``
(rank 0's training rows), ``events.jsonl`` (faults, requeues, exits), ``checkpoints/``
(``step_N`` directories, ``latest``) and the job state (the process table for the local
executor, squeue/sacct/scontrol for Slurm). :func:`run_status` returns a JSON-ready dict.
"""

from __future__ import annotations

import dataclasses
import re
import shutil
import socket
import time
from pathlib import Path
from typing import Any

from xirang_hpc.checkpoint.layout import newest_good
from xirang_hpc.checkpoint.naming import committed_steps, step_dir_name
from xirang_hpc.config.schema import RequeueConfig
from xirang_hpc.monitor.events import FAULT_KINDS, read_events, read_jsonl
from xirang_hpc.monitor.flops import mfu, peak_for_device
from xirang_hpc.monitor.heartbeat import HEARTBEAT_DIR, SESSION_FILE, SESSIONS_LOG, read_heartbeats, read_json
from xirang_hpc.runs.chain import PIPELINE_FILE, chain_status, eval_dir
from xirang_hpc.runtime.policy import History, budget_left
from xirang_hpc.runtime.process_identity import is_running
from xirang_hpc.slurm.jobs import Runner, run_cmd, slurm_state

# Files and directories only a run directory has: the trainer's, the monitor's, the launcher's (submitit
# logs, the events log), the checkpoint manager's, the rank markers, a rollback fork's record.
RUN_MARKERS = ("metrics.jsonl", HEARTBEAT_DIR, "events.jsonl", "checkpoints", "submitit", "ranks",
               "config.json", "forked_from.json")
# A traceback's last line: ``ValueError: ...``, ``torch.distributed.DistBackendError: ...``.
_EXC_LINE = re.compile(r"^([A-Za-z_][\w.]*(Error|Exception|Interrupt|Exit|Failure))(: .*)?$")


# The launcher's map of array task -> run directory (submit/slurm.py): in a sweep's own submitit folder
# (<runs_root>/sweeps/<name>-<hash>/submitit) it names other directories; that folder is not a run.
RUN_DIR_MAP = "xirang_run_dirs.json"


def is_run_dir(path: Path) -> bool:
    """A directory a launch or a training job has written to (also one that failed before its first step)."""
    if not path.is_dir():
        return False
    found = [m for m in RUN_MARKERS if (path / m).exists()]
    if found == ["submitit"]:
        mapping = read_json(path / "submitit" / RUN_DIR_MAP)
        if mapping and all(Path(d).absolute() != path.absolute() for d in mapping.values()):
            return False
    return bool(found)


def log_cause(run_dir: Path) -> dict[str, str] | None:
    """The newest exception in the job's submitit logs (``submitit/*_log.err``): ``{"cause", "log"}``.

    A run that failed before its first step (bad data, rendezvous, import error) leaves only this.
    """
    logs = sorted((run_dir / "submitit").glob("*_log.err"), key=lambda p: p.stat().st_mtime, reverse=True)
    newest_job = logs[0].name.split("_")[0] if logs else ""
    for log in [p for p in logs if p.name.split("_")[0] == newest_job][:64]:  # the last attempt's tasks
        try:
            lines = log.read_text(errors="replace").splitlines()
        except OSError:
            continue
        for line in reversed(lines):
            m = _EXC_LINE.match(line.strip())
            if m and m.group(1) not in ("SystemExit",):
                return {"cause": line.strip()[:300], "log": str(log)}
    return None


def _submitted(events: list[dict[str, Any]]) -> dict[str, Any]:
    """A stand-in session for a job that has not started training yet: its id from the last ``submit`` event."""
    subs = [e for e in events if e.get("kind") == "submit" and e.get("job")]
    if not subs:
        return {}
    # Only Slurm submissions log a ``submit`` event (submit/slurm.py, submit/sweep.py, cli/pipeline.py).
    return {"job_id": str(subs[-1]["job"]), "source": "slurm", "started": float(subs[-1].get("time", 0))}


def checkpoints(run_dir: Path) -> list[dict[str, Any]]:
    """Committed checkpoints ``checkpoints/step_N``, oldest first, with their mtimes."""
    root = run_dir / "checkpoints"
    out = []
    for step in committed_steps(root):
        path = root / step_dir_name(step)
        try:
            out.append({"step": step, "path": str(path), "time": path.stat().st_mtime})
        except FileNotFoundError:  # pruned by retention since the listing
            continue
    return out


def _job_state(session: dict[str, Any], beats: dict[int, dict[str, Any]], events: list[dict[str, Any]],
               now: float, run: Runner) -> dict[str, Any]:
    """State from the scheduler when it answers, else derived from the run's own files."""
    job = str(session.get("job_id", ""))
    if session.get("source") == "slurm" and job:
        info = slurm_state(job, run)
        # squeue did not list the job: it ended, or slurmctld does not answer (sacct, from slurmdbd, still may).
        down = controller_down_since(events, run) if info.get("source") != "squeue" else None
        if down is not None:  # say so: the state below is only what accounting or the run's own files show
            known = info or _derived_state(session, beats, events, now)
            note = "slurmctld does not answer" + (f" since {time.strftime('%H:%M:%S', time.localtime(down))}"
                                                   if down else "")
            why = known.get("reason")
            return {**known, "reason": f"{note}; {known['state']} per {known['source']}"
                    + (f": {why}" if why else ""), "controller_down": True}
        if info:
            return info
    return _derived_state(session, beats, events, now)


def controller_down_since(events: list[dict[str, Any]], run: Runner) -> float | None:
    """None when slurmctld answers ``scontrol ping`` (or Slurm's clients are not installed here); else when the
    run's events first saw it not answering (0.0 when they did not)."""
    if shutil.which("scontrol") is None:
        return None
    ping = run(["scontrol", "ping"])
    if ping is not None and " is UP" in ping:
        return None
    seen = [float(e["time"]) for e in events if e.get("controller_down")]
    return min(seen) if seen else 0.0


def _derived_state(session: dict[str, Any], beats: dict[int, dict[str, Any]], events: list[dict[str, Any]],
                   now: float) -> dict[str, Any]:
    """The state the run's own files show (process table, heartbeats, events), without the scheduler."""
    job = str(session.get("job_id", ""))
    here = socket.gethostname()
    local = [hb for hb in beats.values() if hb.get("host") == here]
    started = float(session.get("started", 0))
    if session.get("source") == "local" and session.get("host") == here and job.isdigit() \
            and is_running(int(job), session.get("job_start_ticks"), started):
        return {"state": "RUNNING", "source": "process table"}
    if any(is_running(int(hb["pid"]), hb.get("start_ticks"), float(hb.get("started", 0))) for hb in local):
        return {"state": "RUNNING", "source": "process table"}
    # Ranks on other hosts: a fresh heartbeat means running (their thread beats every second or so).
    if any(now - hb.get("beat", 0) < 30 for hb in beats.values() if hb.get("host") != here):
        return {"state": "RUNNING", "source": "heartbeats"}
    since = [e for e in events if e.get("time", 0) >= started]
    final = [e for e in since if e.get("kind") == "exit" and "status" in e]
    if final:
        st = str(final[-1]["status"]).upper()
        return {"state": "REQUEUED" if st == "REQUEUED" else st, "source": "events", "reason": final[-1]["reason"]}
    if beats and all(hb.get("done") for hb in beats.values()):
        return {"state": "COMPLETED", "source": "heartbeats"}
    faults = [e for e in since if e.get("kind") in FAULT_KINDS]
    if faults:
        return {"state": "FAILED", "source": "events", "reason": faults[0]["reason"]}
    if beats:
        return {"state": "FAILED", "source": "heartbeats", "reason": "ranks exited before finishing"}
    return {"state": "UNKNOWN", "source": "none"}


def _with_cause(job: dict[str, Any], run_dir: Path, has_session: bool) -> dict[str, Any]:
    """A failed run names its cause: the job log's exception when the run's own files give none, or when they
    say only that a rank exited with an error (the watchdog saw the exit, the log has the error)."""
    if job["state"] == "FAILED" and "exited with an error" in str(job.get("reason") or ""):
        found = log_cause(run_dir)
        if found:
            return {**job, "reason": f"{job['reason']}: {found['cause']}", "log": found["log"]}
    if (job["state"] == "FAILED" and job.get("source") == "heartbeats") or job["state"] == "UNKNOWN":
        found = log_cause(run_dir)
        if found:
            if job["state"] == "FAILED":
                reason = f"ranks exited before finishing: {found['cause']}"
            elif has_session:
                reason = found["cause"]
            else:
                reason = f"failed before training started: {found['cause']}"
            return {**job, "state": "FAILED", "reason": reason, "source": "job log", "log": found["log"]}
        if job["state"] == "UNKNOWN" and not has_session:
            return {**job, "reason": "no job record, heartbeat or log: never started, or its files were removed"}
    return job


def _nodes(beats: dict[int, dict[str, Any]], now: float) -> list[dict[str, Any]]:
    nodes: dict[str, dict[str, Any]] = {}
    for r, hb in beats.items():
        n = nodes.setdefault(str(hb.get("node", "?")), {"node": str(hb.get("node", "?")), "ranks": [], "steps": [],
                                                        "phases": [], "cpu_pct": 0.0, "rss_mb": 0.0, "beat_age_s": 0.0,
                                                        "gpu_util": [], "gpu_mem_mb": 0.0, "gpu_name": None})
        n["ranks"].append(r)
        n["steps"].append(int(hb.get("step", 0)))
        n["phases"].append(str(hb.get("phase")))
        n["cpu_pct"] += float(hb.get("cpu_pct", 0.0))
        n["rss_mb"] += float(hb.get("rss_mb", 0.0))
        n["beat_age_s"] = max(n["beat_age_s"], now - float(hb.get("beat", now)))
        if "gpu_util" in hb:
            n["gpu_util"].append(float(hb["gpu_util"]))
            n["gpu_mem_mb"] += float(hb.get("gpu_mem_mb", 0.0))
            n["gpu_name"] = hb.get("gpu_name")
    for n in nodes.values():
        n["gpu_util"] = sum(n["gpu_util"]) / len(n["gpu_util"]) if n["gpu_util"] else None
    return sorted(nodes.values(), key=lambda n: n["node"])


def run_status(run_dir: Path | str, now: float | None = None, run: Runner = run_cmd,
               n_events: int = 12) -> dict[str, Any]:
    """Everything ``xirang-status`` shows for one run directory (the last ``n_events`` events: enough for one
    preemption from the stop to the rerun's first step, ~10 events)."""
    run_dir = Path(run_dir).absolute()
    now = time.time() if now is None else now
    hdir = run_dir / HEARTBEAT_DIR
    session = read_json(hdir / SESSION_FILE) or {}
    sessions = read_jsonl(hdir / SESSIONS_LOG)
    beats = read_heartbeats(run_dir, session.get("session")) if session else {}
    events = read_events(run_dir)
    rows = read_jsonl(run_dir / "metrics.jsonl")
    train = [r for r in rows if "loss" in r]
    val = [r for r in rows if "val_loss" in r]
    last = train[-1] if train else {}
    step = max([int(last.get("step", 0))] + [int(hb.get("step", 0)) for hb in beats.values()])
    cfg = (read_json(run_dir / "config.json") or {}).get("config") or {}  # every training start writes it
    train_cfg = cfg.get("train", {})
    total = int(session.get("max_steps", 0) or train_cfg.get("extend_to") or train_cfg.get("max_steps", 0) or 0)
    tok_s = float(last.get("tokens_per_s", 0.0))
    fpt = float(session.get("flops_per_token", 0.0))
    peak = float(session.get("peak_tflops", 0.0)) or max(
        [peak_for_device(str(hb.get("gpu_name", ""))) for hb in beats.values()] + [0.0])
    who = session or _submitted(events)
    job = _with_cause(_job_state(who, beats, events, now, run), run_dir, bool(session))
    if job["state"] == "UNKNOWN":
        job = _from_files(job, run_dir, val, total)
    # A failed save is the cause, not the ranks' exit that followed it (gloo errors, "killed by a signal").
    started = float(who.get("started", 0) or 0)
    save_failed = [e for e in events if e.get("kind") == "save_failed" and e.get("time", 0) >= started]
    if save_failed and job["state"] not in ("RUNNING", "COMPLETED"):
        job = {**job, "reason": save_failed[-1].get("error") or save_failed[-1].get("reason"),
               "source": "events"}
    # Requeues are what Slurm counts (Restarts, SLURM_RESTART_COUNT) and what the event log records; a
    # plain rerun or resume of the same run (a new session) is not one.
    requeue_events = [e for e in events if e.get("kind") == "requeue"]
    requeues = max(len(requeue_events), int(session.get("restart_count", 0) or 0),
                   int(job.get("restarts", 0) or 0), 0)
    tokens_per_step = int(session.get("global_batch", 0)) * int(session.get("seq_len", 0))
    eta = None
    if job["state"] == "RUNNING" and tok_s > 0 and total:
        eta = max(0, total - step) * tokens_per_step / tok_s
    ckpts = checkpoints(run_dir)
    ckpt = dict(ckpts[-1], age_s=now - ckpts[-1]["time"]) if ckpts else None
    if ckpts:  # the newest loadable one (the quick verification every launch makes), and newer damaged ones
        good, bad = newest_good(run_dir / "checkpoints")
        mine = [c for c in ckpts if c["step"] == good]
        ckpt = dict(mine[0], age_s=now - mine[0]["time"]) if mine else None
        if bad:
            ckpt = {**(ckpt or {"step": None}), "corrupt": [{"step": b, "reason": why} for b, why in bad]}
            if job["state"] == "COMPLETED":  # trained to the end, but the result is not on disk intact
                job = {**job, "state": "FAILED", "source": "checkpoints",
                       "reason": f"final checkpoint step {bad[0][0]} fails verification; relaunch the same "
                                 f"command to train it again from "
                                 f"{'step ' + str(good) if good is not None else 'step 0'}"}
    job_id = who.get("job_id") or _log_job_id(run_dir)
    budget = requeue_budget(cfg, events, now)
    evals = eval_dir(run_dir)  # a pipeline with a preference stage evaluates its DPO run
    return {
        "run_dir": str(run_dir), "job_id": job_id, "executor": who.get("source"),
        "state": job["state"], "state_source": job.get("source"), "state_reason": job.get("reason"),
        "requeues": requeues, "requeue_budget": budget, "sessions": len(sessions),
        "world_size": session.get("world_size"),
        "num_nodes": session.get("num_nodes"), "model": session.get("model") or cfg.get("model", {}).get("name"),
        "step": step, "total_steps": total, "loss": last.get("loss"),
        "val_loss": val[-1]["val_loss"] if val else None, "val_step": val[-1]["step"] if val else None,
        "tokens_per_s": tok_s or None, "tflops": tok_s * fpt / 1e12 if tok_s and fpt else None,
        "mfu": mfu(tok_s, fpt, int(session.get("devices", 0)), peak), "eta_s": eta,
        "checkpoint": ckpt, "nodes": _nodes(beats, now), "events": events[-n_events:], "n_events": len(events),
        "time": now, "eval": read_json(evals / "eval.json"),
        "eval_run": str(evals) if evals.resolve() != run_dir.resolve() else None,
        "harness": read_json(evals / "harness.json"), "pipeline": _pipeline(run_dir),
    }


def requeue_budget(cfg: dict[str, Any], events: list[dict[str, Any]], now: float) -> dict[str, Any] | None:
    """Each fault class's requeue budget as the run's policy (its ``config.json``) and events stand now: used,
    allowed by now, left and the rate; None when requeues are off or the config is not recorded."""
    req, cluster = cfg.get("requeue"), cfg.get("cluster") or {}
    if not isinstance(req, dict) or not req.get("enabled", True):
        return None
    known = {f.name for f in dataclasses.fields(RequeueConfig)}
    try:
        policy = RequeueConfig(**{k: v for k, v in req.items() if k in known}).with_default_rates(
            int(cluster.get("nodes", 1)) + int(cluster.get("spare_nodes", 0)), int(cluster.get("time_min", 60)))
    except (TypeError, ValueError):  # a config.json written by hand or by another version
        return None
    history = History.of(events, now)
    return {"days": history.days, "max_requeues": policy.max_requeues,
            "classes": {c: {"used": b.used, "allowed": b.allowed, "left": b.left, "per_day": b.per_day,
                            "burst": b.burst} for c, b in budget_left(policy, history).items()}}


def _pipeline(run_dir: Path) -> dict[str, Any] | None:
    """The xirang-pipeline chain of this run, if it was started by one."""
    if not (run_dir / PIPELINE_FILE).is_file():
        return None
    try:
        return chain_status(run_dir)
    except (OSError, ValueError, KeyError):
        return None


def _from_files(job: dict[str, Any], run_dir: Path, val: list[dict[str, Any]], total: int) -> dict[str, Any]:
    """No scheduler, heartbeat or event says anything (monitor off, or a fork): what the files show."""
    if total and val and int(val[-1].get("step", -1)) >= total:  # the trainer's final evaluation at max_steps
        return {"state": "COMPLETED", "source": "metrics", "reason": f"final evaluation at step {total}"}
    forked = read_json(run_dir / "forked_from.json")
    if forked:
        return {**job, "reason": f"fork of {forked.get('run')} at step {forked.get('step')}; not trained to the end "
                                 "here (train it with train.run_dir=<this directory>)"}
    return job


def _log_job_id(run_dir: Path) -> str | None:
    """The job id in the newest submitit log name (``<job>_<task>_log.err``), for a run without a session."""
    logs = sorted((run_dir / "submitit").glob("*_log.*"), key=lambda p: p.stat().st_mtime)
    return logs[-1].name.split("_")[0] if logs else None


def task_key(row: dict[str, Any]) -> tuple[int, int, int, str]:
    """Sort key for status rows: array tasks by (array id, task index) numerically, then the rest by name."""
    m = re.fullmatch(r"(\d+)(?:_(\d+))?", str(row.get("job_id") or ""))
    if m:
        return (0, int(m.group(1)), int(m.group(2) or -1), str(row.get("run_dir")))
    return (1, 0, 0, f"{row.get('job_id') or ''}|{row.get('run_dir')}")


def find_runs(root: Path, job_id: str | None = None) -> list[Path]:
    """Run directories under ``root`` (one level), optionally those of ``job_id`` or its array tasks."""
    if not root.is_dir():
        return []
    out = []
    for p in sorted(root.iterdir()):
        if p.name.startswith(".") or not is_run_dir(p):
            continue
        if job_id is not None:
            jobs = {str(s.get("job_id")) for s in read_jsonl(p / HEARTBEAT_DIR / SESSIONS_LOG)}
            jobs |= {str(e["job"]) for e in read_events(p) if e.get("kind") == "submit" and e.get("job")}
            jobs |= {str(j) for j in [_log_job_id(p)] if j}
            if not any(j == job_id or j.startswith(job_id + "_") for j in jobs):
                continue
        out.append(p)
    return out
