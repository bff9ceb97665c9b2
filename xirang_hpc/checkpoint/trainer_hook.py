"""The trainer hook: restore at fit start, save every ``checkpoint.every_steps`` (async), save at the end.

Resume is exact because the data position is the step (sampling is a pure function of
(seed, step)), the LR is a function of the step, and model, optimizer and every rank's RNG
states are restored bitwise.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from pathlib import Path
from typing import Any

import torch.distributed as dist

from xirang_hpc.checkpoint import extra as ckpt_extra
from xirang_hpc.checkpoint import layout as ckpt_layout
from xirang_hpc.checkpoint import state as ckpt_state
from xirang_hpc.checkpoint.errors import CheckpointWriteError
from xirang_hpc.checkpoint.manager import CheckpointManager, LoadResult, SaveRecord
from xirang_hpc.checkpoint.memory import MemoryRecord, MemoryStore
from xirang_hpc.checkpoint.naming import memory_root
from xirang_hpc.checkpoint.retention import RetentionPolicy
from xirang_hpc.checkpoint.snapshot import restore_rng
from xirang_hpc.checkpoint.tuner import IntervalTuner, read_history
from xirang_hpc.config.schema import XirangConfig
from xirang_hpc.runtime.hooks import EventSink, Loop, NullEventSink, TrainerHook
from xirang_hpc.runtime.schedule import lr_at
from xirang_hpc.runtime.topology import Topology

log = logging.getLogger(__name__)
STARTS = "starts.jsonl"


class CheckpointHook(TrainerHook):
    """Checkpoint restore/save for the training loop (:class:`~xirang_hpc.runtime.hooks.Loop`)."""

    def __init__(self, cfg: XirangConfig, topo: Topology, run_dir: Path, events: EventSink | None = None) -> None:
        self.cfg, self.topo, self.run_dir = cfg, topo, Path(run_dir)
        # The run's event log (the job passes it): every commit is recorded there, surviving pruning.
        self.events: EventSink = NullEventSink() if events is None else events
        self.mgr: CheckpointManager | None = None
        self.group: Any = None
        self.every = cfg.checkpoint.every_steps
        # Recovery from memory (checkpoint/memory.py): how often the node-local copy is refreshed.
        c = cfg.checkpoint
        self.mem_every = (c.memory_every_steps or c.every_steps) if c.in_memory else 0
        self.memory: MemoryStore | None = None
        self.last_saved = -1
        self.last_mem = -1
        self._sd_cache = ckpt_state.TensorStateCache()
        self._metrics = ckpt_state.MetricsHistory()  # metrics.jsonl read incrementally, save by save
        self.tuner: IntervalTuner | None = None
        self._last_step_t: float | None = None
        self._step_times: list[float] = []

    # ---- helpers -----------------------------------------------------------------------
    # ---- hook points -------------------------------------------------------------------
    def on_fit_start(self, trainer: Loop) -> None:
        """Make the checkpoint group and manager, clean leftovers, restore the newest good checkpoint."""
        c = self.cfg.checkpoint
        if dist.is_initialized() and self.topo.world_size > 1:
            # Background saves must never share a communicator with training.
            self.group = dist.new_group(backend="gloo")
        if c.in_memory:
            self.memory = MemoryStore(memory_root(self.topo.job_id, self.run_dir, c.memory_dir),
                                      node=self.topo.node_name, rank=self.topo.rank, world_size=self.topo.world_size,
                                      group=self.group)
        self.mgr = CheckpointManager(
            self.run_dir / "checkpoints", rank=self.topo.rank, world_size=self.topo.world_size, group=self.group,
            compression=c.compression, dedup=c.dedup, dir_mode=c.dir_mode, async_save=c.async_save,
            retention=RetentionPolicy(c.keep_last, c.keep_every, tuple(c.pinned)), verify_checksums=c.verify_checksums,
            on_commit=self._committed if self.topo.rank == 0 else None, memory=self.memory,
            on_memory=self._kept_in_memory if self.topo.rank == 0 else None, on_failure=self._save_failed)
        self.mgr.cleanup_leftovers()
        restored = self.restore(trainer)
        if self.topo.rank == 0:
            with (self.mgr.root / STARTS).open("a") as f:
                f.write(json.dumps({"time": time.time(), "step": restored}) + "\n")
        if c.auto_interval:
            self.tuner = IntervalTuner(mtbf_s=c.mtbf_hours * 3600, history=read_history(self.mgr.root))
        self.last_saved = self.last_mem = restored

    def _committed(self, rec: SaveRecord, path: Path) -> None:
        """Rank 0, after a commit: record it in events.jsonl (the history survives retention pruning)."""
        self.events.append("checkpoint", f"step {rec.step} committed", step=rec.step, path=str(path),
                           stall_s=round(rec.stall_s, 4), persist_s=round(rec.persist_s, 4), new_bytes=rec.new_bytes)

    def _save_failed(self, exc: CheckpointWriteError) -> None:
        """Every rank, as soon as a save failed on the storage (from the background writer): the cause on
        stderr (the batch step's log, also when the run directory's filesystem is the full one) and, from
        rank 0, a ``save_failed`` event. The run stops at its next save or at its end, where every rank
        meets the error together; the failed step's temporary directory is already gone, and no committed
        checkpoint was touched."""
        print(f"xirang: error: {exc.strerror}", file=sys.stderr, flush=True)
        if self.topo.rank == 0:
            try:
                self.events.append("save_failed", exc.cause, host=self.topo.node_name, **exc.fields())
            except OSError as log_exc:  # the event log may sit on the same full/read-only filesystem
                print(f"xirang: could not record the save failure in events.jsonl: {log_exc}", file=sys.stderr,
                      flush=True)
        exc.reported = True

    def _kept_in_memory(self, rec: MemoryRecord) -> None:
        """Rank 0, after each in-memory save (every rank holds its bundle and a replica)."""
        self.events.append("memory_checkpoint", f"step {rec.step} kept in memory", step=rec.step,
                           bytes=rec.bytes, replica_bytes=rec.replica_bytes, seconds=round(rec.seconds, 4))

    def _event(self, kind: str, reason: str, **fields: Any) -> None:
        if self.topo.rank == 0:
            self.events.append(kind, reason, **fields)

    def _load(self, trainer: Loop) -> tuple[LoadResult | None, dict[str, Any], list[dict[str, Any]]]:
        """The newest checkpoint: from memory when it is usable (see checkpoint/memory.py), else from disk.

        The tensor template is built only once something is to be loaded: building it initialises the
        optimizer's state (torch takes one zero-gradient step, AdamW's step counter reads 1), which on a
        fresh start would make the run differ from the same config without ``checkpoint.in_memory``.
        """
        assert self.mgr is not None
        fs_steps = self.mgr.candidates()
        if self.memory is None and not fs_steps:
            return None, {}, []
        # The monitor's heartbeat says so: a rank stopped or blocked in the load is named in the restore.
        trainer.phase("restore")
        built: list[tuple[dict[str, Any], list[dict[str, Any]]]] = []

        def template() -> dict[str, Any]:
            if not built:
                built.append(ckpt_state.tensor_state(trainer.model, trainer.opt))
            return built[0][0]

        reason = ""
        if self.memory is not None:
            got = self.mgr.load_memory(template, fs_steps[0] if fs_steps else None)
            if isinstance(got, LoadResult):
                self._event("restore", f"step {got.step} from memory ({got.received_bytes} bytes moved from "
                            "other nodes)", source="memory", step=got.step, local_bytes=got.local_bytes,
                            received_bytes=got.received_bytes)
                return got, built[0][0], built[0][1]
            reason = got
        if not fs_steps:
            return None, {}, []
        tensors = template()
        res = self.mgr.load(tensors)
        self._report_skipped(res.step if res is not None else None)
        if res is None:
            self._none_usable(trainer)
        if res is not None:
            self._event("restore", f"step {res.step} from the filesystem" + (f" ({reason})" if reason else ""),
                        source="filesystem", step=res.step, **({"memory": reason} if reason else {}))
        return res, tensors, built[0][1]

    def _none_usable(self, trainer: Loop) -> None:
        """Checkpoints exist, none verifies: refuse (``checkpoint.on_no_valid=refuse``) or start fresh on purpose.

        No tensor was copied (each step is verified whole before any rank reads it), so the model is
        its fresh init; the optimizer state the template initialised is dropped, so a fresh start is
        the same as one with no checkpoints at all.
        """
        assert self.mgr is not None
        why = "; ".join(f"step {s}: {r}" for s, r in self.mgr.last_skipped)
        if self.cfg.checkpoint.on_no_valid != "fresh":
            raise ckpt_layout.CheckpointCorruptError(
                f"no checkpoint under {self.mgr.root} is usable ({why}); nothing was loaded. Repair or move them "
                "(xirang-ckpt verify names each file), or set checkpoint.on_no_valid=fresh to start from a fresh "
                "init on purpose")
        if type(trainer.opt).__module__.startswith("torch.optim"):  # torch's own: a zero-gradient step made it
            trainer.opt.state.clear()
        self._event("fresh_start", f"no checkpoint is usable ({why}); starting from a fresh init "
                    "(checkpoint.on_no_valid=fresh)", skipped=[s for s, _ in self.mgr.last_skipped])
        if self.topo.rank == 0:
            trainer.log("checkpoint: no usable checkpoint; starting from a fresh init (checkpoint.on_no_valid=fresh)")

    def restore(self, trainer: Loop) -> int:
        """Load the newest good checkpoint into the trainer; returns its step (0 when none)."""
        res, tensors, groups = self._load(trainer)
        if res is None:
            return 0
        ckpt_state.apply_tensor_state(trainer.model, trainer.opt, tensors, res.state["param_groups"], groups)
        ckpt_state.restore_run_state(trainer, res.state)
        if res.rank_state is not None:
            restore_rng(res.rank_state["rng"])
        elif self.topo.rank == 0:
            trainer.log("checkpoint: saved under another world size; RNG states not restored")
        extra = getattr(trainer, "extra_state", {})  # per-rank hook state, e.g. local-SGD averaging
        missing = set(extra) - set(ckpt_extra.restore(extra, res.path, res.rank_state, self.topo.rank))
        if missing and self.topo.rank == 0:
            trainer.log(f"checkpoint: no saved state for {sorted(missing)} in {res.path}; starting it fresh")
        if self.topo.rank == 0:
            ckpt_state.rewrite_metrics(Path(trainer.metrics_path), res.state.get("metrics", []))
            trainer.log(f"checkpoint: resumed from {res.path} (step {res.step}, {res.source})")
        return res.step

    def _report_skipped(self, used: int | None) -> None:
        """Rank 0: one ``checkpoint_skipped`` event per step the load found unusable, with the step used instead."""
        if self.topo.rank != 0 or self.mgr is None:
            return
        for step, reason in self.mgr.last_skipped:
            path = self.mgr.root / ckpt_layout.step_dir_name(step)
            self.events.append("checkpoint_skipped", reason, step=step, path=str(path), used_step=used)

    def _save(self, trainer: Loop, block: bool, to_disk: bool = True, to_memory: bool = False) -> int:
        assert self.mgr is not None
        step = trainer.state.step
        extra = getattr(trainer, "extra_state", {})
        if extra:  # per-rank extra tensors are fresh objects at every save: nothing to cache
            tensors, groups = ckpt_state.tensor_state(trainer.model, trainer.opt)
            static = False
        else:
            tensors, groups, static = self._sd_cache.get(trainer.model, trainer.opt)
        state = ckpt_state.run_state_json(trainer, lr_at(max(step - 1, 0), self.cfg.train), self._metrics)
        state["param_groups"] = groups
        extra_tensors, extra_json = ckpt_extra.save_parts(extra, self.topo.rank)
        tensors.update(extra_tensors)
        rank_state = {**ckpt_state.rank_state_json(trainer), **({"extra": extra_json} if extra_json else {})}
        self.mgr.save(step, tensors, state=state, rank_state=rank_state,
                      info={"layout": ckpt_state.layout_json(trainer)}, block=block, to_disk=to_disk,
                      to_memory=to_memory, static=static)
        if to_disk:
            self.last_saved = step
        if to_memory:
            self.last_mem = step
        return step

    def save_now(self, trainer: Loop) -> int | None:
        """Synchronous save of the current step (used by the stop-signal path); returns the step."""
        if self.mgr is None or trainer.state.step == 0:
            return None
        if trainer.state.step != self.last_saved:
            self._save(trainer, block=True)
        self.mgr.wait()
        return trainer.state.step

    def on_step_end(self, trainer: Loop, metrics: dict[str, float]) -> None:
        """Save every ``every_steps`` steps (asynchronously when configured)."""
        now = time.perf_counter()
        if self._last_step_t is not None:
            self._step_times.append(now - self._last_step_t)
        self._last_step_t = now
        step = trainer.state.step
        disk = step % self.every == 0 and step != self.last_saved
        memory = self.mem_every > 0 and (disk or step % self.mem_every == 0) and step != self.last_mem
        if disk or memory:
            trainer.phase("checkpoint")
            self._save(trainer, block=False, to_disk=disk, to_memory=memory)
            if disk:
                self._retune()
            self._last_step_t = time.perf_counter()  # the stall is not step time

    def _retune(self) -> None:
        if self.tuner is None or not self._step_times or self.mgr is None:
            return
        hist = [r for r in self.mgr.history if r.persist_s > 0]
        if not hist:
            return
        self.tuner.observe(stall_s=hist[-1].stall_s, persist_s=hist[-1].persist_s,
                           step_s=sorted(self._step_times)[len(self._step_times) // 2])
        self.every = self.tuner.interval_steps()

    def on_fit_end(self, trainer: Loop, summary: dict[str, object]) -> None:
        """Final save (synchronous), and wait for any save still in flight."""
        if self.mgr is None:
            return
        trainer.phase("checkpoint")  # the final save and the wait for one in flight (they tick as they write)
        if trainer.state.step > 0 and trainer.state.step != self.last_saved:
            self._save(trainer, block=True)
        self.mgr.wait()
        if self.memory is not None:  # the run is on disk and finished: the node-local copy has done its job
            if self.group is not None:
                dist.barrier(group=self.group)
            self.memory.remove_node_dir()
        if self.group is not None:
            dist.destroy_process_group(self.group)
            self.group = None
