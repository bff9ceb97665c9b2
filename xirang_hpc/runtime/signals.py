"""Stop signals inside the job: every rank agrees, saves, one requeue, every rank leaves.

Slurm warns a job with SIGUSR2 (``--signal=USR2@delay``: time limit, or preemption with
``preempt_send_user_signal``) and ends it with SIGTERM (preemption without a user signal, time
limit, ``scancel``). The handler only records the signal; the decision happens at the next step
boundary, where one all-reduce (MAX) of a flag makes every rank see the same verdict even if the
signal reached only some of them: a stop is never half-agreed. Then:

1. every rank saves its shard through the checkpoint hook (if the save cannot finish within the
   grace time, the last periodic checkpoint stands: checkpoints are committed atomically);
2. rank 0 asks Slurm why (:func:`~xirang_hpc.slurm.control.classify_stop`: ``PreemptTime``,
   ``TimeLimit``/``RunTime``), applies the requeue policy, logs the verdict, and requeues
   ``ARRAYJOBID_TASKID`` or the job id with ``scontrol requeue`` (only the task of an array, never the whole array);
3. **every** rank exits (none is left behind holding the allocation): :data:`EXIT_REQUEUED`
   (submitit's local requeue code, so the local executor reruns the job too) or
   :data:`EXIT_STOPPED` when the policy said no.

This hook replaces submitit's own USR2/SIGTERM handlers in every rank, so there is exactly one
requeue manager.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import psutil
import torch
import torch.distributed as dist

from xirang_hpc.config.schema import XirangConfig
from xirang_hpc.runtime.early_signals import _early, capture_early  # noqa: F401 - capture_early re-exported
from xirang_hpc.runtime.hooks import EventSink, Loop, NullEventSink, TrainerHook
from xirang_hpc.runtime.markers import mark_start, read_stop_cause
from xirang_hpc.runtime.policy import History, decide
from xirang_hpc.runtime.topology import Topology
from xirang_hpc.slurm import control

EXIT_REQUEUED = 144  # submitit.local.local.LOCAL_REQUEUE_RETURN_CODE
EXIT_STOPPED = 3
_CODES = {"SIGUSR2": 1, "SIGTERM": 2}
_NAMES = {v: k for k, v in _CODES.items()}


def requeue_floor_tasks(cfg: XirangConfig) -> int | None:
    """The ``NumTasks`` that lets the requeued job start on ``requeue.min_nodes`` nodes (in-job restart with a
    floor below ``cluster.nodes``: the job was submitted with that node range), else None."""
    r, c = cfg.requeue, cfg.cluster
    if r.max_restarts_in_job <= 0:
        return None
    return control.floor_tasks(r.min_nodes, c.nodes + c.spare_nodes, c.tasks_per_node)


def exit_process(code: int) -> None:
    """Leave the process (a tiny function so tests can observe the exit instead)."""
    sys.stdout.flush()
    sys.exit(code)


def restart_count(topo: Topology, events: EventSink, env: Mapping[str, str]) -> int:
    """How often this run was requeued: Slurm's ``SLURM_RESTART_COUNT``, else our own event log."""
    if topo.source == "slurm":
        return control.restart_count(env)
    return events.count("requeue")


class StopSignalHook(TrainerHook):
    """Signal consensus, save-on-stop, requeue and exit; see the module docstring."""

    def __init__(self, cfg: XirangConfig, topo: Topology, run_dir: Path,
                 events: EventSink | None = None,
                 env: Mapping[str, str] | None = None,
                 exit_fn: Callable[[int], None] = exit_process,
                 save_fn: Callable[[Loop], int | None] | None = None,
                 job_info: Callable[[str], dict[str, str]] = control.job_info,
                 requeue_fn: Callable[[str], object] | None = None,
                 start_now_fn: Callable[..., object] = control.after_requeue,
                 no_requeue_fn: Callable[[str], None] = control.no_requeue) -> None:
        self.cfg, self.topo, self.run_dir = cfg, topo, run_dir
        # The run's event log, handed in by the job (the runtime does not know where it lives).
        self.events: EventSink = NullEventSink() if events is None else events
        self.env = os.environ if env is None else env
        self.exit_fn, self.save_fn = exit_fn, save_fn
        self.job_info, self.start_now_fn = job_info, start_now_fn
        # A job Slurm requeued by itself meanwhile (its preemption's grace time ended) counts as requeued; the
        # requeue runs only under Slurm, where self.restarts is SLURM_RESTART_COUNT.
        self.requeue_fn = requeue_fn or (lambda target: control.requeue(target, restarts=self.restarts,
                                                                        info=self.job_info))
        self.no_requeue_fn = no_requeue_fn
        self.received: list[tuple[str, float]] = []
        self.restarts = restart_count(topo, self.events, self.env)
        self.first_step_logged = False
        self.start_step = 0
        self.proc_start = psutil.Process().create_time()

    # -- signals -------------------------------------------------------------------------------
    def install(self) -> None:
        """Take over SIGUSR2 and SIGTERM (replacing submitit's handlers)."""
        for sig in (signal.SIGUSR2, signal.SIGTERM):
            signal.signal(sig, self._on_signal)
        self.received.extend(_early)
        _early.clear()
        mark_start(self.run_dir, self.restarts, self.topo.rank, self.topo.node_name)

    def installed(self) -> StopSignalHook:
        """:meth:`install`, then return self (for one-line registration)."""
        self.install()
        return self

    def _on_signal(self, signum: int, frame: Any) -> None:
        # Only record: the decision waits for the step boundary (no collective in a handler).
        self.received.append((signal.Signals(signum).name, time.time()))

    def _local_code(self) -> int:
        return max((_CODES.get(name, 0) for name, _ in self.received), default=0)

    def _agree(self, code: int) -> int:
        if self.topo.world_size == 1 or not dist.is_initialized():
            return code
        flag = torch.tensor([code], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return int(flag.item())

    def _event(self, kind: str, reason: str, **fields: Any) -> None:
        if self.topo.rank == 0:
            self.events.append(kind, reason, job=self.topo.job_id, restart=self.restarts, **fields)

    # -- hook points ---------------------------------------------------------------------------
    def on_fit_start(self, trainer: Loop) -> None:
        self.start_step = trainer.state.step
        self._event("start", f"restart {self.restarts}", step=trainer.state.step, node=self.topo.node_name,
                    world_size=self.topo.world_size, nodes=self.topo.num_nodes)

    def on_step_end(self, trainer: Loop, metrics: dict[str, float]) -> None:
        if not self.first_step_logged:
            self.first_step_logged = True
            now = time.time()
            self._event("first_step", "first step after (re)start", step=trainer.state.step,
                        restored_step=self.start_step, since_process_start_s=round(now - self.proc_start, 3))
        # Announce the collective, so a hang in it is reported in "comm", not in the phase before it.
        self._announce(trainer, "comm")
        code = self._agree(self._local_code())
        if code:
            self.stop(trainer, _NAMES[code])

    def _announce(self, trainer: Loop, phase: str) -> None:
        """Tell the monitor (``trainer.phase``) that this rank enters ``phase``; only when a collective follows."""
        if self.topo.world_size > 1:
            trainer.phase(phase)

    def on_fit_end(self, trainer: Loop, summary: dict[str, object]) -> None:
        if trainer.state.step >= self.cfg.train.end_step:
            self._event("exit", "completed", final=True, status="completed", step=trainer.state.step)

    # -- the stop sequence ---------------------------------------------------------------------
    def stop(self, trainer: Loop, signame: str) -> None:
        """Save on every rank, decide and requeue on rank 0, exit on every rank."""
        trainer.request_stop()
        t_signal = min((t for _, t in self.received), default=time.time())
        step = trainer.state.step
        # The save is a checkpoint phase: the goodput record's block ends at the saved step (the steps since the
        # last record were kept, not spent saving) and the watchdog sees a save, not a stalled step.
        trainer.phase("checkpoint")
        saved = self.save_fn(trainer) if self.save_fn is not None else None
        t_durable = time.time()
        self._announce(trainer, "comm")
        self._agree(0)  # barrier: every shard is durable before anyone requeues
        code = EXIT_STOPPED
        if self.topo.rank == 0:
            code = self._decide_and_requeue(signame, step, saved, t_signal, t_durable)
        if self.topo.world_size > 1 and dist.is_initialized():
            buf = torch.tensor([code], dtype=torch.int32)
            dist.broadcast(buf, src=0)
            code = int(buf.item())
        print(f"rank {self.topo.rank}: stopping at step {step} after {signame} "
              f"({'requeued' if code == EXIT_REQUEUED else 'not requeued'}); exit {code}", flush=True)
        # Tell the monitor this rank is leaving: its teardown (slow on a loaded node) is not a hang.
        trainer.phase("exit")
        self.exit_fn(code)

    def _decide_and_requeue(self, signame: str, step: int, saved: int | None, t_signal: float,
                            t_durable: float) -> int:
        in_slurm = self.topo.source == "slurm"
        stop = dict(signal=signame, step=step, saved_step=saved, node=self.topo.node_name,
                    signal_to_durable_s=round(t_durable - t_signal, 3) if saved is not None else None)
        try:
            if in_slurm:
                target = control.requeue_target(self.env)
                told = read_stop_cause(self.run_dir, self.restarts)
                if told is not None and signame == "SIGUSR2":  # the batch script's guard signalled us, saying why
                    cause = control.StopCause(*told)
                else:
                    cause = control.classify_stop(self.job_info(self.env["SLURM_JOB_ID"]), signame,
                                                   self.cfg.cluster.signal_delay_s)
            else:
                target, cause = self.topo.job_id, control.StopCause(
                    "preemption" if signame == "SIGUSR2" else "terminated", f"{signame} outside Slurm")
            self._event("stop", cause.reason, detail=cause.detail, **stop)
            verdict = decide(cause.reason, self.restarts, self.cfg.requeue, History.of(self.events.rows(), time.time()))
            if not verdict.requeue:
                if in_slurm and cause.reason == "preemption":
                    # The run ends here: if its ranks are still leaving when the grace time ends, Slurm's
                    # preemption would requeue the job by itself and train on past this final status.
                    try:
                        self.no_requeue_fn(target)
                    except control.SlurmCommandError as exc:
                        print(f"xirang: warning: could not make job {target} non-requeueable: {exc}",
                              file=sys.stderr, flush=True)
                self._event("exit", cause.reason, final=True, status=verdict.final_status, why=verdict.why, step=step)
                print(f"xirang: not requeued: {verdict.why} (final status {verdict.final_status})", flush=True)
                return EXIT_STOPPED
            multi_site = bool(self.cfg.cluster.sites) and self.cfg.cluster.site_auto_migrate
            if in_slurm and cause.reason == "preemption" and multi_site:
                # Several sites: the batch script's supervisor (batch/supervise.py) decides after the ranks
                # are gone whether the run moves to another site or is requeued here; it alone acts.
                self._event("handover", cause.reason, why="the supervisor places the run again (cluster.sites)",
                            target=target, step=step)
                return EXIT_REQUEUED
            # Requeued from here, at once: a preemption's grace time or the time limit ends the job soon, and a
            # loaded node's ranks can take longer than that to leave. The begin time is set ahead by the
            # ranks-leaving margin, since the job leaves its nodes only when its last rank has exited.
            tasks = requeue_floor_tasks(self.cfg) if in_slurm else None
            if in_slurm:
                self.requeue_fn(target)
                start = bool(verdict.start_now or verdict.backoff_s)
                if start or tasks:
                    self.start_now_fn(target, verdict.backoff_s, start=start, tasks=tasks,
                                      margin_s=control.start_margin_s(self.env, ranks_leaving=True))
            self._event("requeue", cause.reason, why=verdict.why, target=target, step=step,
                        start_now=verdict.start_now, backoff_s=verdict.backoff_s, num_tasks=tasks)
            self._event("exit", "requeued", final=False, status="requeued", step=step)
            return EXIT_REQUEUED
        except control.SlurmCommandError as exc:
            self._event("exit", "requeue_failed", final=True, status="requeue_failed", error=str(exc), step=step)
            print(f"xirang: error: {exc}", file=sys.stderr, flush=True)
            return EXIT_STOPPED


def find_saver(hooks: list[TrainerHook]) -> Callable[[Loop], int | None] | None:
    """The checkpoint hook's synchronous save (``save_now(trainer) -> step``), when one is registered."""
    for h in hooks:
        fn = getattr(h, "save_now", None)
        if callable(fn):
            return fn
    return None
