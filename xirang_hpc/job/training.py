"""The training job's entry function: what every rank runs, on Slurm or on the local executor.

Launch code hands this function a plain dict (the validated config) and the run directory;
nothing else of the launcher crosses into the job. This module is the one place that knows
every feature plugged into the loop: the runtime below it only knows the hook interface.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path
from typing import Any

import torch.distributed as dist
from omegaconf import OmegaConf

from xirang_hpc.checkpoint.errors import CheckpointWriteError
from xirang_hpc.checkpoint.identity import read_identity, write_identity
from xirang_hpc.checkpoint.rollback import fork_for_resume
from xirang_hpc.checkpoint.trainer_hook import CheckpointHook
from xirang_hpc.config.elastic import for_environment
from xirang_hpc.config.errors import ConfigError
from xirang_hpc.config.schema import XirangConfig
from xirang_hpc.config.validate import check_runnable, load_config
from xirang_hpc.data.tokenizer import install_run_tokenizer
from xirang_hpc.files import private_by_default
from xirang_hpc.monitor import environment
from xirang_hpc.monitor.events import EventLog
from xirang_hpc.monitor.goodput_hook import GoodputHook
from xirang_hpc.monitor.requeues import record_unlogged_requeue
from xirang_hpc.monitor.tracking import TrackingHook
from xirang_hpc.monitor.trainer_hook import MonitorHook
from xirang_hpc.runtime import dist as xdist
from xirang_hpc.runtime.comm.install import CommTrainerHook
from xirang_hpc.runtime.device import accelerator_stack
from xirang_hpc.runtime.dpo import ReferenceHook
from xirang_hpc.runtime.hooks import TrainerHook
from xirang_hpc.runtime.signals import StopSignalHook, capture_early, find_saver
from xirang_hpc.runtime.topology import Topology
from xirang_hpc.runtime.trainer import Trainer
from xirang_hpc.weights.load import InitFromHook


def _say(msg: str) -> None:
    print(msg, flush=True)


def build_hooks(cfg: XirangConfig, topo: Topology, run_dir: Path) -> list[TrainerHook]:
    """The trainer's hooks, in order: goodput's timing, heartbeats, weight import, comm, checkpoint, monitoring,
    stop signals.

    Each feature adds its hook here (one line each) so the loop itself stays small.
    """
    # Goodput's record first: it times the restore the hooks below do, and closes each step before the save.
    hooks: list[TrainerHook] = [GoodputHook(topo, run_dir)]
    monitor = MonitorHook(cfg, topo, run_dir) if cfg.monitor.enabled else None
    if monitor is not None:  # heartbeats, stack dumps and the node watchdog from here on: the weight import and
        hooks.append(monitor.start_hook())  # the restore below are watched like a training step
    if cfg.model.init_from:  # exported weights first, so a checkpoint restore (next hooks) wins
        hooks.append(InitFromHook(cfg.model.init_from))
    if cfg.finetune.method == "dpo":  # the reference = the start: after the weight import, before any restore
        hooks.append(ReferenceHook())
    # Hierarchical all-reduce / bandwidth budget on plain DDP. Before the checkpoint hook, so a
    # restore can fill ``trainer.extra_state["comm"]`` and a save sees the step's averaging done.
    hooks.append(CommTrainerHook(cfg.comm))
    if cfg.checkpoint.enabled:  # restore, periodic async save, final save
        hooks.append(CheckpointHook(cfg, topo, run_dir, events=EventLog(run_dir)))
    if monitor is not None:  # phases and steps into the heartbeat; the session record with the step restored
        hooks.append(monitor)
    # config.json, TFLOP/s / MFU / memory in the metrics rows, train.loggers (TensorBoard, MLflow). After the
    # checkpoint hook: it resolves a train.resume_from fork and rewinds metrics.jsonl before this one reads it.
    hooks.append(TrackingHook(cfg, topo, run_dir))
    # Stop signals -> consensus -> save (through the checkpoint hook above) -> requeue -> exit.
    hooks.append(StopSignalHook(cfg, topo, run_dir, events=EventLog(run_dir), save_fn=find_saver(hooks)).installed())
    return hooks


def resolve_fork(cfg: XirangConfig, topo: Topology, run_dir: Path) -> Path:
    """``train.resume_from``: the run directory this start trains in, forked once by rank 0 and told to every rank.

    Resolved before any hook or the trainer is built, so that everything the start writes (events, checkpoints,
    metrics, heartbeats, stop markers, goodput records) goes to the fork and the original history stays untouched.
    A requeued start of the same config finds the same fork (``forks.json``).
    """
    step = cfg.train.resume_from
    if step < 0:
        return run_dir
    target: str | None = None
    if topo.rank == 0:
        try:
            target = str(fork_for_resume(run_dir, step, cfg.checkpoint.dir_mode))
        except Exception as exc:  # noqa: BLE001 - told to every rank first, then every rank raises
            target = f"error: {exc}"
    if dist.is_initialized() and topo.world_size > 1:
        box = [target]
        dist.broadcast_object_list(box, src=0)
        target = box[0]
    assert target is not None
    if target.startswith("error: "):  # every rank stops with rank 0's reason (no rank left waiting)
        raise FileNotFoundError(target.removeprefix("error: "))
    new = Path(target)
    if new != run_dir and topo.rank == 0:
        if read_identity(new) is None:  # the fork records what it trains (lr etc. may differ)
            write_identity(new, cfg, forked_from=str(run_dir), fork_step=step)
        _say(f"checkpoint: train.resume_from={step} forked {run_dir} -> {new}; the original history is untouched")
    return new


def report_save_failure(exc: CheckpointWriteError, topo: Topology, run_dir: Path, hooks: list[TrainerHook]) -> None:
    """Name a failed save everywhere it is looked for: stderr (one line, before the peers' noise),
    this rank's heartbeat (the watchdog's ``dead`` event quotes it) and, from rank 0, ``events.jsonl``.
    A failure the checkpoint hook already reported from the background writer is not logged twice."""
    if not exc.reported:
        print(f"xirang: error: {exc.strerror}", file=sys.stderr, flush=True)
    for h in hooks:
        hb = getattr(h, "hb", None)
        if isinstance(h, MonitorHook) and hb is not None:
            hb.ident["error"] = exc.strerror
    if topo.rank == 0 and not exc.reported:
        try:
            EventLog(run_dir).append("save_failed", exc.cause, host=topo.node_name, **exc.fields())
        except OSError as log_exc:  # the event log may sit on the same full/read-only filesystem
            print(f"xirang: could not record the save failure in events.jsonl: {log_exc}", file=sys.stderr,
                  flush=True)


def log_unlogged_requeue(run_dir: Path) -> None:
    """A requeue Slurm, submitit or an admin did without the job logging it goes into ``events.jsonl`` now."""
    try:
        ev = record_unlogged_requeue(run_dir, os.environ)
    except (OSError, ValueError) as exc:  # bookkeeping only: never stops the job
        print(f"xirang: could not check how the previous start ended: {exc}", file=sys.stderr, flush=True)
        return
    if ev is not None:
        print(f"xirang: the previous start was requeued by {ev['source']} ({ev['reason']}, sacct State="
              f"{ev['slurm_state']}); recorded in events.jsonl", flush=True)


def run_training(cfg_dict: dict[str, Any], run_dir: str, data_dir: str) -> dict[str, Any]:
    """Train on this rank; returns the summary on rank 0 and ``{}`` elsewhere."""
    capture_early()  # a preemption during start-up, rendezvous or checkpoint load is acted on, not lost
    # An in-job restart on fewer nodes ($XIRANG_NODES) trains the same global batch on a shrunk layout.
    cfg = for_environment(load_config(OmegaConf.create(cfg_dict)), os.environ)
    private_by_default(cfg.train.share_group)  # what the ranks create: private, or the group's
    check_runnable(cfg)
    # Every rank, before the rendezvous, so a mismatch fails all of them alike; the copy is atomic.
    tok = install_run_tokenizer(data_dir, run_dir)
    if tok.vocab_size > cfg.model.vocab_size:
        raise ConfigError("model.vocab_size", cfg.model.vocab_size,
                          f"the data in {data_dir} uses tokenizer {tok.name} with {tok.vocab_size} tokens; "
                          f"set model.vocab_size={tok.vocab_size} or more")

    def _logging(topo: Topology) -> None:
        logging.basicConfig(
            level=logging.INFO, stream=sys.stdout,
            format=f"%(asctime)s rank{topo.rank}/{topo.node_name} %(levelname)s %(name)s: %(message)s",
        )

    topo = xdist.start_job(cfg.cluster, rendezvous_dir=Path(run_dir), before_join=_logging)
    run_dir = str(resolve_fork(cfg, topo, Path(run_dir)))
    if topo.rank == 0 and topo.source == "slurm":
        log_unlogged_requeue(Path(run_dir))
    if topo.rank == 0:  # what exactly trains this run: versions, code revision, hosts, container
        environment.record(Path(run_dir), EventLog(run_dir), accelerators=accelerator_stack)
    hooks: list[TrainerHook] = []
    try:
        hooks = build_hooks(cfg, topo, Path(run_dir))
        summary = Trainer(cfg, topo, Path(run_dir), Path(data_dir), log=_say, hooks=hooks).fit()
    except CheckpointWriteError as exc:
        report_save_failure(exc, topo, Path(run_dir), hooks)
        raise
    finally:
        xdist.shutdown()
    return summary if topo.rank == 0 else {}
