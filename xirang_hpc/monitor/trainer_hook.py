"""The monitor's trainer hook: heartbeats, stack-dump registration, the node's watchdog.

Runs on every rank. At fit start the ranks agree on a session id (a broadcast from rank 0), so
the watchdog ignores heartbeat files left by an earlier attempt; rank 0 records the session
(job id, requeue count, FLOPs per token) for ``xirang-status``; each node's local rank 0 starts
the node's watchdog process (:mod:`xirang_hpc.monitor.watchdog`).

Two hooks, one monitor: :meth:`MonitorHook.start_hook` is registered before the weight import and the
checkpoint restore, so heartbeats (with collective progress), the stack dump and the watchdog cover the
whole start-up: a rank stopped or blocked while it loads a checkpoint is named like one in a training
step (phase ``start``, then ``restore`` while the checkpoint loads; ``hang_s`` bounds a still rank
there, the collective rule names a frozen one after ``monitor.collective_timeout_s``). The
:class:`MonitorHook` itself comes after the restore: it records the session with the step the run
resumes from and sets the heartbeat's step to it.

Stack dumps: ``faulthandler.register(monitor.stack_signal)`` (SIGQUIT by default; SIGUSR2 and
SIGTERM belong to the requeue path) appends every thread's Python stack to
``run_dir/stacks/rank-N.txt``; faulthandler writes from its C signal handler, so it works while
the main thread is blocked inside a collective.
"""

from __future__ import annotations

import atexit
import faulthandler
import json
import os
import random
import signal
import socket
import time
from pathlib import Path
from typing import IO, Any

import torch
import torch.distributed as dist

from xirang_hpc.config.schema import MonitorConfig, XirangConfig
from xirang_hpc.files import make_dir, write_json_atomic
from xirang_hpc.monitor.flops import flops_per_token_for
from xirang_hpc.monitor.heartbeat import (
    SESSION_FILE,
    SESSIONS_LOG,
    STACKS_DIR,
    Heartbeat,
    heartbeat_dir,
    stack_end,
    stack_file,
)
from xirang_hpc.monitor.resources import ProcessSampler
from xirang_hpc.monitor.watchdog import spawn
from xirang_hpc.runtime import liveness, testpoint
from xirang_hpc.runtime.dist import collective_progress, collective_seq
from xirang_hpc.runtime.hooks import Loop, TrainerHook
from xirang_hpc.runtime.process_identity import start_ticks
from xirang_hpc.runtime.topology import Topology
from xirang_hpc.slurm import control


def _session_id(topo: Topology) -> str:
    """A random id chosen by rank 0 and broadcast to every rank."""
    token = torch.tensor([random.SystemRandom().getrandbits(62) if topo.rank == 0 else 0], dtype=torch.int64)
    if topo.world_size > 1 and dist.is_initialized():
        dist.broadcast(token, src=0)
    return f"{int(token.item()):x}"


class MonitorHook(TrainerHook):
    """Publish this rank's heartbeat; start the node watchdog; dump stacks on demand."""

    def __init__(self, cfg: XirangConfig, topo: Topology, run_dir: Path) -> None:
        self.cfg, self.m, self.topo, self.run_dir = cfg, cfg.monitor, topo, run_dir
        self.hb: Heartbeat | None = None
        self.session: str | None = None
        self._started: float | None = None  # when this start's session record was first written
        self._stack_file: IO[str] | None = None

    def _register_stacks(self, session: str) -> None:
        d = self.run_dir / STACKS_DIR
        make_dir(d)
        f = stack_file(d, self.topo.rank).open("a")
        f.write(f"=== rank {self.topo.rank} on {self.topo.node_name} pid {os.getpid()} session {session} "
                f"registered {time.strftime('%Y-%m-%d %H:%M:%S')} ===\n")
        f.flush()
        faulthandler.register(getattr(signal, self.m.stack_signal), file=f, all_threads=True, chain=False)
        self._stack_file = f

    def _record_session(self, trainer: Loop, session: str, final: bool = True) -> None:
        """Rank 0: ``session.json`` for ``xirang-status``. Before the restore (``final=False``) it names the start
        (``restoring``: ``start_step`` not known yet); after it, the step resumed from, also appended to
        ``sessions.jsonl`` (one row per start)."""
        c, t = self.cfg, self.topo
        row: dict[str, Any] = {
            "session": session, "job_id": t.job_id, "source": t.source, "started": time.time(),
            "restart_count": control.restart_count(),
            "world_size": t.world_size, "num_nodes": t.num_nodes, "start_step": trainer.state.step,
            "max_steps": c.train.end_step, "global_batch": c.train.global_batch, "seq_len": c.model.seq_len,
            "model": c.model.name, "flops_per_token": flops_per_token_for(c.model),
            "devices": t.world_size if c.cluster.gpus_per_node else 0, "peak_tflops": self.m.peak_tflops,
            "train_name": c.train.name, "host": socket.gethostname(), "pid": os.getpid(),
        }
        if t.source == "local" and str(t.job_id).isdigit():  # the local job's id is its controller's pid
            row["job_start_ticks"] = start_ticks(int(t.job_id))
        if not final:
            del row["start_step"]
            row["restoring"] = True
        elif self._started is not None:  # the record written before the restore: the same start
            row["started"] = self._started
        self._started = row["started"]
        hdir = heartbeat_dir(self.run_dir)
        write_json_atomic(hdir / SESSION_FILE, row)
        if final:
            with (hdir / SESSIONS_LOG).open("a") as f:
                f.write(json.dumps(row) + "\n")

    def start_hook(self) -> TrainerHook:
        """The hook that starts heartbeating: register it before the weight import and the checkpoint restore."""
        return _StartHook(self)

    def begin(self, trainer: Loop) -> None:
        """Agree on the session, register the stack dump, start heartbeating and the watchdog (once).

        Rank 0 writes a first session record at once, so ``xirang-status`` reads this start's heartbeats
        while it restores; :meth:`on_fit_start` completes it with the step the restore reached.
        """
        if self.hb is not None:
            return
        t = self.topo
        self.session = session = _session_id(t)
        hdir = heartbeat_dir(self.run_dir)
        if t.rank == 0:
            self._record_session(trainer, session, final=False)
        self._register_stacks(session)
        ident = {"rank": t.rank, "world_size": t.world_size, "local_rank": t.local_rank, "node": t.node_name,
                 "node_id": t.node_id, "pid": os.getpid(), "host": socket.gethostname(), "session": session,
                 "job_id": t.job_id, "started": time.time(), "start_ticks": start_ticks(os.getpid()),
                 **stack_end()}  # how its stack dump ends: the watchdog waits for that line before the kill
        if t.local_rank == 0:
            ident["watchdog_pid"] = spawn(self.run_dir, session, t.node_name, t.node_id == 0, _watchdog_cfg(self.m))
        gpu = t.local_rank if self.cfg.cluster.gpus_per_node else None
        track = self.m.collective_timeout_s > 0  # collective progress, for the watchdog's collective rule
        self.hb = Heartbeat(hdir / f"rank-{t.rank}.json", ident, self.m.heartbeat_s, self.m.straggler_window,
                            sampler=ProcessSampler(gpu_index=gpu), seq_fn=collective_seq,
                            progress_fn=_progress if track else None,
                            inside_fn=liveness.inside if track else None)
        self.hb.step = trainer.state.step
        self.hb.start()
        liveness.set_sink(self.hb.tick)  # restores, saves and evaluations report that they still move
        atexit.register(self._on_exit)

    def on_fit_start(self, trainer: Loop) -> None:
        """After the restore: the heartbeat's step and the session record hold the step the run resumes from."""
        self.begin(trainer)  # no start hook registered: heartbeats start here
        assert self.hb is not None and self.session is not None
        self.hb.step = trainer.state.step
        self.hb.mark_phase("start")  # the restore is over; the rest of the start-up until the first step
        if self.topo.rank == 0:
            self._record_session(trainer, self.session, final=True)

    def on_phase(self, trainer: Loop, phase: str) -> None:
        """Record the phase; a test's straggler (``XIRANG_TESTPOINT_SLOW``) sleeps on entering its slow phases."""
        if self.hb is None:
            return
        self.hb.mark_phase(phase)
        testpoint.slow_phase(self.topo.rank, phase, trainer.state.step)  # tests only: a straggler

    def on_step_end(self, trainer: Loop, metrics: dict[str, float]) -> None:
        """Count the step."""
        if self.hb is not None:
            self.hb.mark_step(trainer.state.step)

    def on_fit_end(self, trainer: Loop, summary: dict[str, object]) -> None:
        """Mark this rank done so its exit is not a fault."""
        if self.hb is not None:
            liveness.set_sink(None)
            self.hb.phase, self.hb.done = "done", True
            self.hb.stop()

    def _on_exit(self) -> None:
        # Runs at interpreter exit, also after an unhandled exception; a SIGKILL leaves no record.
        if self.hb is not None:
            self.hb.exited = True
            self.hb.ident["exit_time"] = time.time()
            try:
                self.hb.stop()
            except OSError:
                pass


class _StartHook(TrainerHook):
    """:meth:`MonitorHook.begin` before the model is built, so the build, the weight import and the checkpoint
    restore (the hooks after this one) are watched."""

    def __init__(self, monitor: MonitorHook) -> None:
        self.monitor = monitor

    def on_build_start(self, trainer: Loop) -> None:
        """Start heartbeating (phase ``start``) before the model, its layout and the data are built."""
        self.monitor.begin(trainer)

    def on_fit_start(self, trainer: Loop) -> None:
        """Start heartbeating (phase ``start``)."""
        self.monitor.begin(trainer)


def _progress() -> dict[str, tuple[int, list[int]]]:
    """Collectives entered per group: c10d's counts and those of the groups the job counts itself."""
    return {**collective_progress(), **liveness.counts()}


def _watchdog_cfg(m: MonitorConfig) -> dict[str, Any]:
    keys = ("hang_s", "hang_k", "hang_min_s", "collective_timeout_s", "stale_s", "straggler_k", "straggler_min_s",
            "straggler_window", "abort_on_hang", "abort_on_dead", "stack_signal")
    return {k: getattr(m, k) for k in keys}
