"""Atomic, optionally asynchronous checkpoints of a DCP state dict plus JSON side state.

Save = snapshot to host (the only part the caller waits for) + persist in a background
thread: write ``step_N.tmp-*`` through :class:`HDF5StorageWriter`, fsync, gather per-rank
checksums, write the manifest last, rename to ``step_N``, move ``latest``, apply retention.
All collectives run on the manager's own process group (a separate gloo group in training),
so a background save never shares a communicator with the training step.

Load = newest committed step that verifies (sizes + checksums of every file, recursively through
dedup references); a bad one is logged with the file that failed and the previous one is tried.
"""

from __future__ import annotations

import json
import logging
import queue
import shutil
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from xirang_hpc.checkpoint import layout as ckpt_layout
from xirang_hpc.checkpoint.collectives import GroupCollectives
from xirang_hpc.checkpoint.errors import (
    CheckpointCommError,
    CheckpointMismatchError,
    CheckpointWriteError,
    comm_failure,
    write_error,
)
from xirang_hpc.checkpoint.integrity import METADATA_FILE, CheckpointFormatError, verify_file
from xirang_hpc.checkpoint.memory import MemoryRecord, MemoryStore, Prepared
from xirang_hpc.checkpoint.retention import RetentionPolicy, prune
from xirang_hpc.checkpoint.snapshot import HostSnapshot
from xirang_hpc.checkpoint.storage import HDF5StorageReader, HDF5StorageWriter, read_metadata
from xirang_hpc.runtime import testpoint

log = logging.getLogger(__name__)
now: Callable[[], float] = time.perf_counter


@dataclass
class SaveRecord:
    """What one save cost: ``stall_s`` blocked the caller, ``persist_s`` ran in the background.

    ``persist_s`` ends when the checkpoint is durable and committed (``latest`` moved, every rank
    past the barrier); ``prune_s`` is the retention clean-up that follows, still in the background.
    """

    step: int
    stall_s: float
    persist_s: float = 0.0
    prune_s: float = 0.0
    new_bytes: int = 0
    ref_bytes: int = 0
    memory: MemoryRecord | None = None  # the in-memory copy, when this save kept one


@dataclass
class LoadResult:
    """A restored checkpoint: its step, directory, global JSON state and this rank's JSON (if any)."""

    step: int
    path: Path
    state: dict[str, Any]
    rank_state: dict[str, Any] | None
    skipped: list[tuple[int, str]] = field(default_factory=list)
    source: str = "filesystem"  # or "memory" (node-local memory + replicas, see checkpoint/memory.py)
    local_bytes: int = 0  # memory restores: bytes this node held, and bytes moved to it over the group
    received_bytes: int = 0


def _explain(exc: BaseException) -> str:
    """The underlying messages of a DCP failure (which wraps each rank's exception)."""
    if isinstance(exc, CheckpointException):
        return "; ".join(f"rank {r}: {e}" for r, (e, _) in sorted(exc.failures.items()))
    return str(exc)


def saved_model_shapes(step_dir: Path) -> dict[str, list[int]]:
    """Global shape of every model tensor a checkpoint holds, from its DCP metadata."""
    return {k: list(m.size) for k, m in read_metadata(step_dir).state_dict_metadata.items()
            if k.startswith("model.") and getattr(m, "size", None) is not None}


def shape_mismatch(saved: dict[str, list[int]], tensors: dict[str, Any]) -> str | None:
    """The first of this rank's model tensors whose saved global shape differs; None when they agree."""
    for name, t in (tensors.get("model") or {}).items():
        size = saved.get(f"model.{name}")
        if size is not None and hasattr(t, "shape") and size != list(t.shape):
            return f"model.{name} is {size} there, {list(t.shape)} in this run's model"
    return None


class CheckpointManager(GroupCollectives):
    """Saves and loads checkpoints under ``root`` (``<run>/checkpoints``) for one rank of a group."""

    def __init__(self, root: Path, *, rank: int = 0, world_size: int = 1, group: Any = None,
                 compression: str = "none", dedup: bool = False, dir_mode: int = 0o700,
                 retention: RetentionPolicy | None = None, async_save: bool = True,
                 verify_checksums: bool = True, on_commit: Callable[[SaveRecord, Path], None] | None = None,
                 memory: MemoryStore | None = None,
                 on_memory: Callable[[MemoryRecord], None] | None = None,
                 on_failure: Callable[[CheckpointWriteError], None] | None = None) -> None:
        self.root, self.rank, self.world_size, self.group = Path(root), rank, world_size, group
        # The in-memory copy (None = off); ``on_memory`` is called on every rank after each memory save.
        self.memory, self.on_memory = memory, on_memory
        # Called on rank 0 once a step is committed on every rank (the run's events.jsonl records it).
        self.on_commit = on_commit
        # Called on every rank as soon as a save failed on the storage, from the thread that wrote it (the
        # caller learns of it only at its next save or wait): the job names the cause at once.
        self.on_failure = on_failure
        self.compression, self.dedup, self.dir_mode = compression, dedup, dir_mode
        self.retention = retention or RetentionPolicy()
        self.async_save, self.verify_checksums = async_save, verify_checksums
        self.history: list[SaveRecord] = []
        # Steps the last load() skipped as unusable, (step, reason), also when nothing was loadable.
        self.last_skipped: list[tuple[int, str]] = []
        self._snap = HostSnapshot()
        # One persistent background thread: starting a thread per save made the caller wait for its
        # start-up handshake, and then for the GIL the new thread took (up to 10 ms on the tiny model).
        self._thread: threading.Thread | None = None
        self._jobs: queue.SimpleQueue[tuple[tuple[Any, ...], threading.Event]] = queue.SimpleQueue()
        self._done: threading.Event | None = None
        self._error: BaseException | None = None
        self._dedup_index: dict[str, tuple[str, str]] | None = None
        if rank == 0:
            ckpt_layout.make_dir(self.root, dir_mode)
        self._barrier()

    # ---- collectives on our own group ---------------------------------------------------
    def _bcast(self, obj: Any) -> Any:
        if not self._distributed():
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=dist.get_global_rank(self.group, 0) if self.group else 0,
                                   group=self.group)
        return box[0]

    # ---- save ---------------------------------------------------------------------------
    def cleanup_leftovers(self) -> list[Path]:
        """Rank 0 removes temporaries of saves that never committed; every rank waits."""
        removed = ckpt_layout.cleanup_leftovers(self.root) if self.rank == 0 else []
        for p in removed:
            log.warning("removed unfinished checkpoint %s", p)
        self._barrier()
        return removed

    def save(self, step: int, tensors: dict[str, Any], state: dict[str, Any] | None = None,
             rank_state: dict[str, Any] | None = None, info: dict[str, Any] | None = None,
             block: bool | None = None, to_disk: bool = True, to_memory: bool = False,
             static: bool = False) -> SaveRecord:
        """Checkpoint ``tensors`` (a DCP state dict) at ``step``; returns once the snapshot is taken.

        ``state``: JSON for ``state.json`` (rank 0's copy is written); ``rank_state``: this rank's
        JSON (RNG); ``info``: layout facts for the manifest. Waits for the previous save first.
        ``to_memory`` also keeps it in node-local memory with a replica on another node (needs
        ``memory``); ``to_disk=False`` keeps it only there. ``static``: ``tensors`` is the previous save's
        object with the same tensors (see :meth:`HostSnapshot.snapshot`).
        """
        self.wait()
        t0 = now()
        snap = self._snap.snapshot(tensors, static=static)
        rec = SaveRecord(step=step, stall_s=now() - t0)
        self.history.append(rec)
        args = (rec, snap, state or {}, rank_state or {}, info or {}, to_disk, to_memory and self.memory is not None)
        if (self.async_save if block is None else not block):
            if self._thread is None:
                self._thread = threading.Thread(target=self._worker, name="ckpt-persist", daemon=True)
                self._thread.start()
            self._done = threading.Event()
            self._jobs.put((args, self._done))
        else:
            self._persist_both(*args)
        return rec

    def wait(self) -> None:
        """Block until the background save (if any) has committed; re-raise its error."""
        if self._done is not None:
            self._done.wait()
            self._done = None
        if self._error is not None:
            err, self._error = self._error, None
            if isinstance(err, CheckpointWriteError):
                raise err
            raise RuntimeError(f"background checkpoint save failed: {err}") from err

    def _persist_both(self, rec: SaveRecord, snap: dict[str, Any], state: dict[str, Any],
                      rank_state: dict[str, Any], info: dict[str, Any], to_disk: bool, to_memory: bool) -> None:
        """Memory first (seconds-fast, the newest recovery point), then the durable filesystem checkpoint."""
        if to_memory:
            assert self.memory is not None
            try:
                rec.memory = self.memory.save(rec.step, snap, state, rank_state)
            except OSError as exc:  # e.g. tmpfs full: the filesystem checkpoint still protects the run
                log.warning("in-memory checkpoint of step %d failed: %s", rec.step, exc)
            else:
                if self.on_memory is not None:
                    self.on_memory(rec.memory)
        if to_disk:
            self._persist(rec, snap, state, rank_state, info)

    def _worker(self) -> None:
        """The background thread: persist each submitted save in order."""
        while True:
            args, done = self._jobs.get()
            try:
                self._persist_guarded(*args)
            finally:
                done.set()

    def _persist_guarded(self, *args: Any) -> None:
        try:
            self._persist_both(*args)
        except BaseException as exc:  # noqa: BLE001 - surfaced by wait()
            log.exception("background checkpoint save failed")
            self._error = exc

    def _index(self) -> dict[str, tuple[str, str]]:
        """Dedup index of the newest committed step (built from disk after a restart)."""
        if self._dedup_index is None:
            steps = ckpt_layout.committed_steps(self.root)
            try:
                last = self.root / ckpt_layout.step_dir_name(steps[-1]) if steps else None
                self._dedup_index = ckpt_layout.dedup_index(last) if last is not None else {}
            except (OSError, ValueError, KeyError) as exc:
                log.warning("dedup: cannot index step %s (%s); writing a full checkpoint", steps[-1], exc)
                self._dedup_index = {}
        return self._dedup_index

    def _persist(self, rec: SaveRecord, snap: dict[str, Any], state: dict[str, Any],
                 rank_state: dict[str, Any], info: dict[str, Any]) -> None:
        """Write, commit and prune one step; a storage failure becomes a :class:`CheckpointWriteError`.

        On any failure the step's temporary directory is removed (every rank, best effort), so no
        partial ``step_N.tmp-*`` is left behind for the next start to trip over.
        """
        tmp_box: list[Path] = []
        try:
            self._persist_steps(rec, snap, state, rank_state, info, tmp_box)
        except BaseException as exc:
            found = write_error(exc, rec.step, tmp_box[0] if tmp_box else self.root)  # free bytes before cleanup
            if tmp_box:
                shutil.rmtree(tmp_box[0], ignore_errors=True)
            if found is None:
                raise
            log.error("%s", found)
            if self.on_failure is not None:
                try:
                    self.on_failure(found)
                except Exception as cb_exc:  # noqa: BLE001 - the save's own error is the one to raise
                    log.warning("checkpoint step %d: failure callback failed: %s", rec.step, cb_exc)
            raise found from exc

    def _persist_steps(self, rec: SaveRecord, snap: dict[str, Any], state: dict[str, Any],
                       rank_state: dict[str, Any], info: dict[str, Any], tmp_box: list[Path]) -> None:
        t0 = now()
        name: str | tuple[int, str, str] | None = None
        if self.rank == 0:
            name = f"{ckpt_layout.step_dir_name(rec.step)}.tmp-{uuid.uuid4().hex[:10]}"
            try:
                ckpt_layout.make_dir(self.root / name, self.dir_mode)
            except OSError as exc:  # every rank fails alike (read-only, full), instead of waiting in the bcast
                name = (exc.errno or 0, str(exc.filename or self.root / name), exc.strerror or str(exc))
        got = self._bcast(name)
        if isinstance(got, (tuple, list)):
            raise OSError(got[0], got[2], got[1])
        tmp = self.root / got
        tmp_box.append(tmp)
        rank_json = f"rank_{self.rank}.json"
        ckpt_layout.write_json_durable(tmp / rank_json, rank_state)
        writer = HDF5StorageWriter(tmp, self.compression, self._index() if self.dedup else None)
        dcp.save(snap, storage_writer=writer, process_group=self.group)
        testpoint.pause("save")  # tests only: files written, the step not committed yet
        # The writer checksummed its file while fsyncing it (no second pass here).
        own = {rank_json: ckpt_layout.file_entry(tmp / rank_json), **writer.file_entries}
        gathered = self._gather((own, writer.stats))
        rec.new_bytes = sum(g[1]["new_bytes"] for g in gathered)
        rec.ref_bytes = sum(g[1]["ref_bytes"] for g in gathered)
        final = self.root / ckpt_layout.step_dir_name(rec.step)
        if self.rank == 0:
            ckpt_layout.write_json_durable(tmp / ckpt_layout.STATE, state)
            files = {ckpt_layout.STATE: ckpt_layout.file_entry(tmp / ckpt_layout.STATE),
                     METADATA_FILE: ckpt_layout.file_entry(tmp / METADATA_FILE)}
            for entries, _ in gathered:
                files.update(entries)
            meta = {"step": rec.step, "world_size": self.world_size, "new_bytes": rec.new_bytes,
                    "ref_bytes": rec.ref_bytes, "stall_s": rec.stall_s, "persist_s": now() - t0, **info}
            ckpt_layout.commit(tmp, final, files, ckpt_layout.refs_of_metadata(tmp), meta)
            ckpt_layout.write_latest(self.root, rec.step)
        self._barrier()
        rec.persist_s = now() - t0
        if self.rank == 0 and self.on_commit is not None:
            try:
                self.on_commit(rec, final)
            except OSError as exc:  # a full or read-only event log must not fail a durable checkpoint
                log.warning("checkpoint step %d: commit callback failed: %s", rec.step, exc)
        if self.dedup:
            self._dedup_index = ckpt_layout.dedup_index(final)
        if self.rank == 0:  # after the commit: deleting old steps is not on the durability path
            t1 = now()
            prune(self.root, self.retention)
            rec.prune_s = now() - t1
        log.info("checkpoint step %d committed to %s (stall %.3fs, persist %.3fs, prune %.3fs, %d new bytes)",
                 rec.step, final, rec.stall_s, rec.persist_s, rec.prune_s, rec.new_bytes)

    # ---- load ---------------------------------------------------------------------------
    def candidates(self) -> list[int]:
        """Committed steps, newest first (rank 0's view, shared with every rank)."""
        return self._bcast(sorted(ckpt_layout.committed_steps(self.root), reverse=True) if self.rank == 0 else None)

    def load_memory(self, tensors: dict[str, Any] | Callable[[], dict[str, Any]],
                    fs_step: int | None) -> LoadResult | str:
        """Load the newest in-memory step into ``tensors`` (collective); the reason when the filesystem must be used.

        Used when it is complete across the surviving nodes, not older than ``fs_step`` and every file
        it reads passes its checksum (see :mod:`xirang_hpc.checkpoint.memory`). ``tensors`` may be a
        function that builds the template: it is called only once a memory step is to be loaded, since
        building an optimizer's template initialises its state (a step taken on a fresh start).
        """
        if self.memory is None:
            return "checkpoint.in_memory is off"
        self.wait()
        got = self.memory.prepare(fs_step)
        if isinstance(got, str):
            self.memory.prune(None)
            return got
        if callable(tensors):
            tensors = tensors()
        problem = self._load_prepared(tensors, got)
        if problem is not None:
            self.memory.prune(None)
            return f"memory copy of step {got.step} not loadable: {problem}"
        rank_file = got.path / f"rank_{self.rank}.json"
        rank_state = json.loads(rank_file.read_text()) if self.rank < got.world_size else None
        res = LoadResult(got.step, got.path, ckpt_layout.read_state(got.path), rank_state, source="memory",
                         local_bytes=got.local_bytes, received_bytes=got.received_bytes)
        self.memory.prune(got.step)
        return res

    def _load_prepared(self, tensors: dict[str, Any], got: Prepared) -> str | None:
        """DCP load from a complete memory step; the problem in words (same on every rank) or None."""
        problem = None
        try:  # the small JSON files here; the reader checksums the tensor files it reads
            for name in (METADATA_FILE, ckpt_layout.STATE, f"rank_{self.rank}.json"):
                if name in got.checksums:
                    verify_file(got.path / name, got.checksums[name])
        except ckpt_layout.CheckpointCorruptError as exc:
            problem = str(exc)
        problems = [p for p in self._gather(problem) if p]
        if problems:
            return "; ".join(problems)
        try:
            dcp.load(tensors, storage_reader=HDF5StorageReader(got.path, got.checksums), process_group=self.group)
        except (Exception, CheckpointException) as exc:  # noqa: BLE001 - DCP wraps every rank's failure
            if (comm := comm_failure(exc)) is not None:
                raise CheckpointCommError(f"loading the in-memory copy of step {got.step} failed on rank {self.rank} "
                                          f"because a peer or the network failed ({comm})") from exc
            return _explain(exc)
        return None

    def load(self, tensors: dict[str, Any], step: int | None = None, fallback: bool = True) -> LoadResult | None:
        """Load the newest good checkpoint (or ``step``) into ``tensors`` in place.

        A checkpoint that fails verification or reading is logged with the failing file and
        skipped (``fallback``) or raised (:class:`CheckpointCorruptError`). Returns None when
        nothing loadable exists and no ``step`` was requested.
        """
        self.wait()
        order = self.candidates()
        if step is not None:
            if step not in order:
                raise FileNotFoundError(f"no checkpoint for step {step} under {self.root} (have {sorted(order)})")
            order = [step] if not fallback else [s for s in order if s <= step]
        skipped: list[tuple[int, str]] = []
        self.last_skipped = skipped
        for s in order:
            d = self.root / ckpt_layout.step_dir_name(s)
            problem, saved = None, {}
            if self.rank == 0:
                try:  # manifest, sizes, small files; the loader checksums the tensor files it reads
                    if self.verify_checksums:
                        ckpt_layout.verify_quick(d)
                    else:
                        ckpt_layout.verify(d, checksums=False)
                    saved = saved_model_shapes(d)
                except (ckpt_layout.CheckpointCorruptError, CheckpointFormatError) as exc:
                    problem = str(exc)
            problem, saved = self._bcast((problem, saved))
            # Each rank checks its own tensors (a pipeline stage holds only its layers); all decide together.
            others = [o for o in self._gather(shape_mismatch(saved, tensors) if problem is None else None) if o]
            if others:
                raise CheckpointMismatchError(
                    f"checkpoint {d} holds another model ({others[0]}); nothing was loaded, nothing deleted. "
                    "Train this config in a new run directory (drop train.run_dir), or move that "
                    "checkpoint away if it does not belong to this run")
            if problem is None:
                testpoint.pause("load", rank=self.rank)  # tests only: a restart in the middle of its checkpoint load
                try:
                    sums = ckpt_layout.expected_checksums(d) if self.verify_checksums else None
                    dcp.load(tensors, storage_reader=HDF5StorageReader(d, sums), process_group=self.group)
                except (Exception, CheckpointException) as exc:  # noqa: BLE001 - DCP wraps every rank's failure
                    if (comm := comm_failure(exc)) is not None:  # a peer died, not the checkpoint: never skip it
                        raise CheckpointCommError(
                            f"loading checkpoint {d} failed on rank {self.rank} because a peer or the network "
                            f"failed ({comm}); the checkpoint is not blamed and stays the one to resume from") from exc
                    problem = _explain(exc)
            if problem is None:
                rank_file = d / f"rank_{self.rank}.json"
                rank_state = json.loads(rank_file.read_text()) if rank_file.exists() else None
                return LoadResult(s, d, ckpt_layout.read_state(d), rank_state, skipped)
            if self.rank == 0:
                log.error("checkpoint %s is not usable: %s%s", d, problem,
                          "; falling back to the previous one" if fallback else "")
            skipped.append((s, problem))
            if not fallback:
                raise ckpt_layout.CheckpointCorruptError(problem)
        if step is not None:
            raise ckpt_layout.CheckpointCorruptError(f"no usable checkpoint at or before step {step}: {skipped}")
        return None
