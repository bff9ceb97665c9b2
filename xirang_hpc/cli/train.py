"""``xirang-train``: compose and validate the config, then submit the job and follow it.

Nothing is submitted and no process is started until the whole config has validated.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import hydra
import submitit
from omegaconf import DictConfig

from xirang_hpc.cli.help import maybe_print_help, setup_logging
from xirang_hpc.config.errors import ConfigError
from xirang_hpc.config.schema import XirangConfig
from xirang_hpc.data.prepare import CorpusError, ensure_prepared
from xirang_hpc.data.prepare_chat import check_chat_window
from xirang_hpc.job.entry import train_job
from xirang_hpc.monitor import audit
from xirang_hpc.submit.autoplan import record_measured
from xirang_hpc.submit.executors import make_executor
from xirang_hpc.submit.hydra_setup import register_configs, run_app
from xirang_hpc.submit.launch import prepare_launch
from xirang_hpc.submit.preflight import complete_message, corrupt_message, open_run_dir, preflight
from xirang_hpc.submit.runlock import RunBusyError, claim, record_owner, submission_lock
from xirang_hpc.submit.slurm import SubmissionError

log = logging.getLogger("xirang.train")


def config_refusal(trace: str) -> str | None:
    """The ``ConfigError`` message a failed job's traceback ends with, if that is how a rank stopped, else None."""
    tag = f"{ConfigError.__module__}.{ConfigError.__name__}: "
    lines = [ln for ln in trace.splitlines() if ln.startswith(tag)]
    return lines[-1].removeprefix(tag) if lines else None


def _fail(msg: str, code: int = 2) -> None:
    print(f"xirang-train: error: {msg}", file=sys.stderr, flush=True)
    sys.exit(code)


def _follow(job: submitit.Job, poll_s: float = 0.5) -> None:
    """Echo rank 0's output while the job runs (local executor logs go to files).

    On a terminal the step lines become one progress line updated in place (runs/progress.py);
    elsewhere (pipes, Slurm logs, tests) every line is printed as logged.
    """
    from xirang_hpc.runs.progress import make_echo

    path = Path(job.paths.stdout)
    pos, pending = 0, b""
    echo = make_echo(sys.stdout)
    try:
        while True:
            done = job.done()
            if path.exists():
                with path.open("rb") as f:
                    f.seek(pos)
                    chunk = f.read()
                    pos += len(chunk)
                # Only whole lines: a step line cut in two by a poll would be neither parsed nor echoed right.
                pending += chunk
                lines = pending.split(b"\n")
                pending = lines.pop()
                if done and pending:
                    lines.append(pending)
                for line in lines:
                    text = line.decode(errors="replace").rstrip("\r")
                    # submitit's own bookkeeping lines are noise for users.
                    if "submitit" not in text:
                        echo.line(text)
            if done:
                return
            time.sleep(poll_s)
    finally:
        echo.close()


class _LauncherStop(BaseException):
    """The launcher was told to stop (Ctrl-C, SIGTERM, SIGHUP) while following a local job."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _raise_stop(signum: int, frame: Any) -> None:
    raise _LauncherStop(signum)


@contextlib.contextmanager
def _stop_signals() -> Iterator[None]:
    """Turn Ctrl-C, SIGTERM and SIGHUP into :class:`_LauncherStop` while the launcher follows its job."""
    sigs = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    before = {s: signal.signal(s, _raise_stop) for s in sigs}
    try:
        yield
    finally:
        for s, handler in before.items():
            signal.signal(s, handler)


def _stop_local(job: submitit.Job, run_dir: Path, signum: int, grace_s: float) -> None:
    """Stop a followed local job in order, then leave with ``128 + signum`` and one line.

    The ranks get SIGTERM and take it at their next step boundary (a final checkpoint, then exit); a second
    Ctrl-C/SIGTERM, or ranks still running after ``grace_s``, cancel the job at once (the newest checkpoint
    stands). After SIGHUP the terminal is gone, so nothing more is echoed.
    """
    from xirang_hpc.local.controller import stop_gracefully
    from xirang_hpc.monitor.events import append_event, read_events

    name, t0 = signal.Signals(signum).name, time.time()
    quiet = signum == signal.SIGHUP
    if not quiet:
        print(f"\nxirang-train: {name}: stopping job {job.job_id} at the next step, after a final checkpoint "
              f"(again to stop at once) ...", file=sys.stderr, flush=True)
    append_event(run_dir, "launcher_stop", f"xirang-train got {name}: stopping the job after a final checkpoint",
                 signal=name, job=str(job.job_id), pid=os.getpid())
    audit.record(run_dir, "cancel", str(job.job_id), by=f"xirang-train got {name}")
    stop_gracefully(job)
    forced = False
    try:
        with _stop_signals():
            deadline = t0 + grace_s
            while not job.done() and time.time() < deadline:
                time.sleep(0.2)
    except _LauncherStop:
        pass
    if not job.done():
        forced = True
        job.cancel()
        with contextlib.suppress(_LauncherStop), _stop_signals():
            end = time.time() + 10
            while not job.done() and time.time() < end:
                time.sleep(0.2)
    stops = [e for e in read_events(run_dir) if e.get("kind") == "stop" and e.get("time", 0) >= t0 - 1]
    saved = stops[-1].get("saved_step") if stops else None
    if saved is not None:
        where = f"stopped at step {stops[-1].get('step')} with a checkpoint at step {saved}"
    elif forced:
        where = "cancelled before it could save (the newest checkpoint stands)"
    else:
        where = "stopped (the newest checkpoint stands)"
    if not quiet:
        print(f"xirang-train: {name}: job {job.job_id} {where}; the same command resumes it",
              file=sys.stderr, flush=True)
    sys.exit(128 + signum)


def format_summary(s: dict[str, Any]) -> str:
    """The end-of-run summary: this session's steps and throughput, and where the run stands."""
    ratio = s["final_val_loss"] / s["initial_val_loss"]
    run_steps, end = s["steps"], s.get("end_step", s["steps"])
    ran = s.get("session_steps", run_steps)
    start = s.get("start_step", run_steps - ran)
    where = f"steps {start} -> {run_steps} of {end}" if start else f"{run_steps} of {end} steps"
    lines = [
        "=" * 72,
        f"done: {ran} steps this session ({where}) on {s['world_size']} ranks in {s['train_seconds']:.1f}s",
        f"  validation loss  {s['initial_val_loss']:.4f} -> {s['final_val_loss']:.4f} "
        f"({100 * ratio:.1f}% of initial)",
        f"  throughput       {s['tokens_per_s']:,.0f} tokens/s over this session's steps" if ran
        else "  throughput       n/a (no step ran in this session)",
    ]
    return "\n".join(lines)


def _print_summary(s: dict[str, Any]) -> None:
    print(format_summary(s))
    print(f"  run directory    {s['run_dir']}")
    print("=" * 72, flush=True)


def deprecation_notes(cfg: XirangConfig) -> list[str]:
    """Warnings for deprecated fields the config still sets (they keep working for one release)."""
    notes = []
    if cfg.requeue.max_requeues is not None:
        notes.append(f"xirang-train: warning: requeue.max_requeues={cfg.requeue.max_requeues} is deprecated: it "
                     "caps all requeues together and ends a long run after that many faults; the budgets are "
                     "rates per class now (requeue.failures_per_day, preemptions_per_day, timeouts_per_day, "
                     "budget_burst). It still applies on top of them.")
    return notes


def launch(cfg: XirangConfig) -> dict[str, Any] | None:
    """Submit the training job for a validated config; follow it when ``train.wait``.

    Nothing is written or started when :func:`preflight` refuses (``PreflightError``) or finds the
    run already complete (then it says so and returns None).
    """
    for note in deprecation_notes(cfg):
        print(note, file=sys.stderr, flush=True)
    status = preflight(cfg)
    if status.complete:
        print(complete_message(cfg, status), flush=True)
        return None
    if (damaged := corrupt_message(status)) is not None:
        print(damaged, file=sys.stderr, flush=True)
    placement = None
    if cfg.cluster.sites:  # several clusters: the one that starts the job soonest (submit/sites/)
        from xirang_hpc.submit.sites import place_for_launch

        cfg, placement = place_for_launch(cfg, warn=lambda w: print(w, file=sys.stderr, flush=True))
    if cfg.cluster.executor == "slurm":  # the account's quota and use, before anything is written
        from xirang_hpc.submit.quota_check import check_quota

        db = None
        if placement is not None:  # the chosen site's associations, jobs and nodes (-M), not the default cluster's
            from xirang_hpc.slurm.accounting import SlurmDB, call, on_cluster

            db = SlurmDB(run=on_cluster(call, placement.site.name), cluster=placement.site.name)
        print("\n".join(check_quota(cfg, db=db)[0]), flush=True)
    # First: data that cannot be used leaves no run directory behind.
    data_dir = ensure_prepared(cfg.data, cfg.data.out_dir)
    check_chat_window(data_dir, cfg.model.seq_len, cfg.data.overlong)  # chat data: a window that can learn
    run_dir = open_run_dir(cfg)
    if cfg.cluster.executor == "slurm":  # submit and return; train.wait=true blocks
        from xirang_hpc.submit.slurm import launch_slurm

        if placement is None:
            return launch_slurm(cfg, run_dir, data_dir, train_job)
        from xirang_hpc.submit.sites import record_placement, write_site_state

        record_placement(run_dir, placement)
        site = placement.site.name
        res = launch_slurm(cfg, run_dir, data_dir, train_job, site=site,
                           on_submit=lambda job: write_site_state(run_dir, cfg, data_dir, site, str(job.job_id)))
        return res
    # A launcher that follows the job is watched by it: should it die, the job stops after a final checkpoint.
    executor = make_executor(cfg.cluster, run_dir / "submitit",
                             watch_pid=None if cfg.train.wait is False else os.getpid())
    executor.update_parameters(name=f"xirang-{cfg.train.name}")
    with submission_lock(run_dir):  # one job per run directory (submit/runlock.py)
        claim(run_dir, "local", cfg.train.after_active)
        job = executor.submit(train_job, dataclasses.asdict(cfg), str(run_dir), str(data_dir))
        record_owner(run_dir, "local", str(job.job_id), pid=int(job.job_id))
    audit.record(run_dir, "launch", str(job.job_id), cluster=cfg.cluster.name, argv=sys.argv[1:])
    print(f"submitted job {job.job_id} ({cfg.cluster.name}: {cfg.cluster.nodes} node(s) x "
          f"{cfg.cluster.tasks_per_node} ranks) | run dir {run_dir}", flush=True)
    if cfg.train.wait is False:
        print(f"follow it with: tail -f {job.paths.stdout}", flush=True)
        return None
    try:
        with _stop_signals():
            _follow(job)
        results = job.results()
    except _LauncherStop as stop:
        _stop_local(job, run_dir, stop.signum, grace_s=max(60.0, float(cfg.cluster.signal_delay_s)))
    except submitit.core.utils.FailedJobError as exc:
        refusal = config_refusal(str(exc))
        if refusal is not None:  # a rank refused its config at start-up (train.compile's probe, ...): that line
            _fail(f"job {job.job_id} refused: {refusal} (logs: {Path(job.paths.stdout).parent})", 1)
        _fail(f"job {job.job_id} failed:\n{exc}\nlogs: {Path(job.paths.stdout).parent}", 1)
    summary = results[0]
    _print_summary(summary)
    return summary


@hydra.main(version_base="1.3", config_path="../conf", config_name="config")
def _app(dcfg: DictConfig) -> None:
    try:
        ln = prepare_launch(dcfg, auto_plan=True, report_complete=True)
        if ln.status.complete:
            print(complete_message(ln.cfg, ln.status), flush=True)
            return
        cfg = ln.cfg
    except ConfigError as exc:
        _fail(str(exc))
    try:
        record_measured(cfg, launch(cfg))  # parallel=auto: measured tokens/s next to the prediction
    except (CorpusError, RunBusyError, ConfigError, SubmissionError) as exc:
        _fail(str(exc))


def main() -> None:
    """Console entry point."""
    maybe_print_help("xirang-train", sys.argv[1:])
    setup_logging(logging.WARNING)
    if "--wait" in sys.argv:  # block until a Slurm job ends (same as train.wait=true)
        sys.argv = [a for a in sys.argv if a != "--wait"] + ["train.wait=true"]
    register_configs()
    run_app("xirang-train", _app)


if __name__ == "__main__":
    main()
