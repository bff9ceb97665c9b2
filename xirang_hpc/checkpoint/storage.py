"""HDF5 storage for ``torch.distributed.checkpoint`` (DCP).

DCP's planners decide *what* each rank writes and reads (so resharding works unchanged); this
module decides *how* it lands on disk:

- every rank writes its chunks into its own file ``rank_<i>.h5``; one dataset per saved chunk,
  named ``<fqn>@<offsets>``, HDF5-chunked exactly like the shard (so a partial read touches
  only that shard), optionally lzf/gzip-compressed, or zstd through ``hdf5plugin``;
- the checkpoint's metadata is ``metadata.json`` (no pickle);
- loading reads only the hyperslab ``storage_offsets:+lengths`` each rank needs;
- uncompressed shards are stored contiguously (one dataset per shard is already "chunked like the
  shard"; HDF5's chunked path was 3-6x slower to write here), written straight from the host
  snapshot (``write_dataset``); compressed shards are HDF5-chunked exactly like the shard;
- each file is fsynced once, at the end, while its checksum for the manifest is computed from the
  page cache in parallel (:func:`sync_and_checksum`). (A flusher thread that ``fdatasync``ed every
  256 MiB during the write was slower on the shared ext4 disk: each call forces a journal commit.)
- files are opened with ``locking=False`` (one writer per file; NFS/Lustre locking often fails);
- HDF5 writes through a :class:`~xirang_hpc.checkpoint.h5file.GuardedFile`, so a full disk (or any
  write error) is never seen by HDF5, which crashed the process on it; the writer stops at the first
  failed write, removes its file and raises the ``OSError`` (:func:`no_room` names the bytes needed);
- before anything is written, the coordinator compares the bytes every rank's plan will write with the
  free space of the checkpoint's filesystem and refuses a save that cannot fit (uncompressed, no dedup);
- with a dedup index, a chunk whose hash matches one already on disk in an earlier checkpoint
  is stored as a reference (``../step_N/rank_i.h5`` + dataset) instead of a copy.

Nothing read can run code: DCP stores a non-tensor value as a "bytes" item and loads it with
an unpickling ``torch.load`` (weights not only). The writer refuses such items (the checkpoint
manager keeps non-tensor state out of the DCP state dict, as JSON), and the reader refuses a
checkpoint whose metadata lists one, and any file that its manifest does not list, before a single
tensor is read: every file a rank's plan needs is verified first (:meth:`HDF5StorageReader.prepare_local_plan`,
which DCP runs on every rank before any rank reads), so a failed check leaves the model untouched.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import torch
import xxhash
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    ReadItem,
    SavePlan,
    SavePlanner,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult
from torch.futures import Future

from xirang_hpc.checkpoint.errors import free_bytes
from xirang_hpc.checkpoint.h5file import GuardedFile
from xirang_hpc.checkpoint.integrity import (
    METADATA_FILE,
    CheckpointFormatError,
    fsync_path,
    sync_and_checksum,
    verify_file,
)
from xirang_hpc.config.schema import COMPRESSIONS
from xirang_hpc.runtime import liveness, testpoint

FORMAT_VERSION = 1
# HDF5 caps a chunk at 4 GiB; larger shards are split along dim 0.
_MAX_CHUNK_BYTES = 2**31
# dtypes numpy cannot hold are stored as same-width integers and viewed back on load.
_VIEW_AS = {torch.bfloat16: torch.int16}
for _name in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz"):
    if hasattr(torch, _name):
        _VIEW_AS[getattr(torch, _name)] = torch.uint8


def dtype_from_str(name: str) -> torch.dtype:
    """``"torch.float32"`` -> ``torch.float32``."""
    dt = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dt, torch.dtype):
        raise CheckpointFormatError(f"unknown dtype {name!r} in checkpoint metadata")
    return dt


def to_numpy(t: torch.Tensor) -> np.ndarray:
    """A CPU tensor as a numpy array (bfloat16/float8 viewed as integers of the same width)."""
    t = t.detach().cpu().contiguous()
    if t.dtype in _VIEW_AS:
        t = t.view(_VIEW_AS[t.dtype])
    return t.numpy()


def from_numpy(a: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    """Inverse of :func:`to_numpy`."""
    a = np.asarray(a)
    if not a.flags.c_contiguous or not a.flags.writeable:
        a = a.copy()  # np.ascontiguousarray would turn a 0-d array into 1-d
    t = torch.from_numpy(a)
    return t.view(dtype) if dtype in _VIEW_AS else t


def chunk_hash(a: np.ndarray) -> str:
    """Content hash of one chunk (dtype and shape included)."""
    h = xxhash.xxh3_128()
    h.update(f"{a.dtype.str}{a.shape}".encode())
    h.update(memoryview(np.ascontiguousarray(a)).cast("B"))
    return h.hexdigest()


def _filter(compression: str) -> dict[str, Any]:
    """h5py ``create_dataset`` keywords for a compression name (zstd level 3: fast, ~lz4-class speed)."""
    if compression == "zstd":
        plugin = _hdf5plugin()
        if plugin is None:
            raise CheckpointFormatError("checkpoint.compression=zstd needs the hdf5plugin package: "
                                        "pip install hdf5plugin")
        return dict(plugin.Zstd(clevel=3))
    return {"compression": compression}


def _hdf5plugin() -> Any:
    """``hdf5plugin`` (importing it registers the zstd filter with HDF5), or None when not installed."""
    try:
        import hdf5plugin
    except ImportError:  # pragma: no cover - a dependency; only a broken install lacks it
        return None
    return hdf5plugin


def write_dataset(f: h5py.File, name: str, arr: np.ndarray, compression: str = "none") -> None:
    """One shard as one dataset: contiguous and written in place from ``arr`` when uncompressed,
    otherwise HDF5-chunked like the shard (split on dim 0 past 2 GiB) with the filter."""
    chunks = _h5_chunks(arr.shape, arr.itemsize)
    if compression != "none" and chunks is not None:
        f.create_dataset(name, data=arr, chunks=chunks, **_filter(compression))
    elif chunks is None:  # 0-d or empty
        f.create_dataset(name, data=arr)
    else:
        ds = f.create_dataset(name, shape=arr.shape, dtype=arr.dtype)
        ds.write_direct(np.ascontiguousarray(arr))


# What HDF5 adds per dataset (object header, link) and per file (superblock, root group), for the free-space check.
_DATASET_OVERHEAD = 1024
_FILE_OVERHEAD = 64 << 10


def plan_bytes(plan: SavePlan) -> int:
    """Bytes of tensor data a rank's save plan writes (before compression and dedup)."""
    total = 0
    for item in plan.items:
        td = item.tensor_data
        if td is not None:
            itemsize = torch.empty((), dtype=td.properties.dtype).element_size()
            total += int(np.prod(tuple(td.chunk.sizes), dtype=np.int64)) * itemsize
    return total


def no_room(err: int, strerror: str, path: Path, needed: int, free: int | None) -> OSError:
    """The ``OSError`` of a save that does not fit: errno, the path, and the bytes needed and free there."""
    exc = OSError(err, strerror, str(path))
    exc.needed_bytes, exc.free_bytes = needed, free  # type: ignore[attr-defined]
    return exc


@dataclasses.dataclass(frozen=True)
class _FilePrefix:
    """Per-plan storage data: which file this rank writes."""

    file: str


def _dataset_name(index: MetadataIndex) -> str:
    offs = ",".join(str(o) for o in (index.offset or ()))
    return f"{index.fqn.replace('/', '%2F')}@{offs}"


def _h5_chunks(shape: tuple[int, ...], itemsize: int) -> tuple[int, ...] | None:
    """The HDF5 chunk shape for a shard: the shard itself (split on dim 0 past 2 GiB)."""
    if not shape or 0 in shape:
        return None
    rows = shape[0]
    row_bytes = itemsize * int(np.prod(shape[1:], dtype=np.int64))
    if row_bytes * rows > _MAX_CHUNK_BYTES:
        rows = max(1, _MAX_CHUNK_BYTES // max(1, row_bytes))
    return (rows, *shape[1:])


class HDF5StorageWriter(StorageWriter):
    """Writes a DCP checkpoint into ``path`` as per-rank HDF5 files plus ``metadata.json``.

    ``compression``: ``none`` | ``lzf`` | ``gzip`` | ``zstd``. ``dedup_index`` maps chunk hashes to
    ``(file relative to path, dataset)`` of identical chunks already on disk; when given, every
    written chunk is hashed and matches become references.
    """

    def __init__(self, path: str | os.PathLike, compression: str = "none",
                 dedup_index: Mapping[str, tuple[str, str]] | None = None, fsync: bool = True) -> None:
        super().__init__()
        if compression not in COMPRESSIONS:
            raise ValueError(f"compression={compression!r}: choose one of {', '.join(COMPRESSIONS)}")
        self.path = Path(path)
        self.compression = compression
        self.dedup_index = dict(dedup_index) if dedup_index is not None else None
        self.fsync = fsync
        self.is_coordinator = False
        # Filled by write_data: this rank's file's manifest entry by name (size + checksum, computed while
        # it was fsynced), and the bytes it wrote as new data vs. stored as references.
        self.file_entries: dict[str, dict[str, Any]] = {}
        self.stats = {"new_bytes": 0, "ref_bytes": 0, "chunks": 0, "ref_chunks": 0}

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        """Point the writer at a new directory (DCP calls this once per save)."""
        if checkpoint_id is not None:
            self.path = Path(checkpoint_id)

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        """Remember whether this rank writes the metadata."""
        self.is_coordinator = is_coordinator

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        """Nothing to add locally; the directory must exist."""
        self.path.mkdir(parents=True, exist_ok=True)
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        """Assign each rank's plan its own file, after checking that all of them fit on the filesystem."""
        self._check_room(plans)
        return [dataclasses.replace(p, storage_data=_FilePrefix(f"rank_{i}.h5")) for i, p in enumerate(plans)]

    def _check_room(self, plans: list[SavePlan]) -> None:
        """Coordinator, before any rank writes: refuse a save whose bytes exceed the free space (ENOSPC).

        Exact only for uncompressed saves without dedup references (compression and dedup write less
        than the plan says); those rely on the write itself failing cleanly (see :class:`GuardedFile`).
        """
        if self.compression != "none" or self.dedup_index:
            return
        free = free_bytes(self.path)
        if free is None:
            return
        needed = sum(plan_bytes(p) + _DATASET_OVERHEAD * len(p.items) + _FILE_OVERHEAD for p in plans)
        if needed > free:
            raise no_room(errno.ENOSPC, os.strerror(errno.ENOSPC), self.path, needed, free)

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        """Write this rank's items into its HDF5 file, fsync it, and describe each item.

        A failed write (full disk, quota, I/O error) stops the file at that item: the file is closed
        (HDF5 never saw the error), removed, and the error is raised with the bytes this rank needed.
        """
        fname = plan.storage_data.file
        results: list[WriteResult] = []
        fpath = self.path / fname
        raw = GuardedFile(fpath)
        try:
            with h5py.File(raw, "w", locking=False) as f:
                for item in plan.items:
                    testpoint.slow_item("save")  # tests only: a slow filesystem, for the hang watchdog's tests
                    info = self._write_item(f, fname, item, planner)
                    results.append(WriteResult(index=item.index, size_in_bytes=info["nbytes"], storage_data=info))
                    liveness.tick("checkpoint write")  # a long save that still writes is no hang
                    if raw.error is not None:
                        break
        finally:
            raw.close()
        if raw.error is not None:
            fpath.unlink(missing_ok=True)  # its space goes back at once (the event log may share the disk)
            e = raw.error
            raise no_room(e.errno or errno.EIO, e.strerror or str(e), fpath, plan_bytes(plan),
                          free_bytes(self.path)) from e
        self.file_entries[fname] = sync_and_checksum(fpath, self.fsync)
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(results)
        return fut

    def _write_item(self, f: h5py.File, fname: str, item: Any, planner: SavePlanner) -> dict[str, Any]:
        """Write one DCP item (or record a dedup reference); its storage info for the metadata."""
        name = _dataset_name(item.index)
        if item.type == WriteItemType.BYTE_IO:
            # DCP would torch.save the value and unpickle it on load (a full torch.load): code could run.
            raise TypeError(f"checkpoint item {item.index.fqn!r} is not a tensor; only tensors go through DCP "
                            "(non-tensor state is saved as JSON beside them), so nothing loaded is ever unpickled")
        tensor = planner.resolve_data(item)
        arr = to_numpy(tensor)
        info = {"file": fname, "ds": name, "kind": "tensor", "dtype": str(tensor.dtype), "nbytes": int(arr.nbytes)}
        self.stats["chunks"] += 1
        ref = None
        if self.dedup_index is not None and arr.nbytes > 0:
            info["hash"] = h = chunk_hash(arr)
            ref = self.dedup_index.get(h)
        if ref is not None:
            info["file"], info["ds"] = ref
            self.stats["ref_bytes"] += arr.nbytes
            self.stats["ref_chunks"] += 1
        else:
            write_dataset(f, name, arr, self.compression)
            self.stats["new_bytes"] += arr.nbytes
        return info

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Coordinator: write ``metadata.json`` (fsynced) describing every chunk of every rank."""
        storage = {}
        for rank_results in results:
            for wr in rank_results:
                storage[wr.index] = wr.storage_data
        metadata.storage_data = storage
        out = self.path / METADATA_FILE
        out.write_text(json.dumps(metadata_to_json(metadata), separators=(",", ":")))
        if self.fsync:
            fsync_path(out)
            fsync_path(self.path)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        """Any local path will do."""
        return True

    def storage_meta(self) -> StorageMeta | None:
        """Tell DCP which directory this checkpoint is."""
        return StorageMeta(checkpoint_id=str(self.path))


class HDF5StorageReader(StorageReader):
    """Reads a checkpoint written by :class:`HDF5StorageWriter`, one hyperslab per request.

    With ``checksums`` (file name relative to ``path`` -> manifest entry), every file this rank
    reads is read once into memory, verified, and parsed from there: the data that is loaded is
    exactly the data that was checked, and the verification costs no second pass over the disk.
    """

    def __init__(self, path: str | os.PathLike, checksums: dict[str, dict[str, Any]] | None = None) -> None:
        super().__init__()
        self.path = Path(path)
        self.checksums = checksums
        self.storage_data: dict[MetadataIndex, dict[str, Any]] = {}

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        """Point the reader at another directory."""
        if checkpoint_id is not None:
            self.path = Path(checkpoint_id)

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """Parse ``metadata.json``."""
        return read_metadata(self.path)

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        """Keep the per-chunk storage table."""
        self.storage_data = metadata.storage_data

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        """Verify every file this rank's plan reads, before any rank reads anything.

        DCP runs this on every rank while planning and gathers the failures, so a file that is
        unlisted in the manifest or fails its checksum stops the load on all ranks with no tensor
        copied: the model is exactly as it was (never half-loaded).
        """
        files: dict[str, None] = {}
        for req in plan.items:
            if req.type == LoadItemType.BYTE_IO:
                raise CheckpointFormatError(f"checkpoint {self.path}: {req.storage_index.fqn!r} is a pickled bytes "
                                            "item; a checkpoint we load holds tensors and JSON only")
            files[self.storage_data[req.storage_index]["file"]] = None
        if self.checksums is not None:
            for fname in files:
                fpath = Path(os.path.normpath(self.path / fname))
                if fname not in self.checksums:
                    raise CheckpointFormatError(f"checkpoint file {fpath} is named by the metadata but not listed "
                                                "in the manifest; refusing to read it")
                verify_file(fpath, self.checksums[fname])  # streamed: the file then sits in the page cache
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        """Nothing to change."""
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """Read exactly the hyperslabs this rank's plan asks for, grouped by file."""
        _hdf5plugin()  # zstd datasets need its filter registered before the reads (else a clear read error)
        by_file: dict[str, list[ReadItem]] = {}
        for req in plan.items:
            by_file.setdefault(self.storage_data[req.storage_index]["file"], []).append(req)
        for fname, reqs in by_file.items():
            fpath = Path(os.path.normpath(self.path / fname))  # dedup refs: step_N/../step_K/x -> step_K/x
            try:  # verified in prepare_local_plan, before any rank read anything
                f = h5py.File(fpath, "r", locking=False)
            except OSError as exc:
                raise CheckpointFormatError(f"cannot open checkpoint file {fpath}: {exc}") from exc
            with f:
                for req in reqs:
                    testpoint.slow_item("load")  # tests only: slow storage, for the hang watchdog's tests
                    info = self.storage_data[req.storage_index]
                    try:
                        ds = f[info["ds"]]
                        sel = tuple(slice(o, o + n) for o, n in zip(req.storage_offsets, req.lengths))
                        target = planner.resolve_tensor(req).detach()
                        if tuple(target.shape) != tuple(req.lengths):
                            raise CheckpointFormatError(
                                f"checkpoint file {fpath}: {info['ds']!r} slice has shape {tuple(req.lengths)}, "
                                f"expected {tuple(target.shape)}")
                        self._read_into(ds, sel, target, dtype_from_str(info["dtype"]))
                    except (KeyError, OSError, ValueError, TypeError) as exc:
                        raise CheckpointFormatError(
                            f"checkpoint file {fpath}: cannot read dataset {info['ds']!r}: {exc}") from exc
                    planner.commit_tensor(req, target)
                    liveness.tick("checkpoint read")  # a long restore that still reads is no hang
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    @staticmethod
    def _read_into(ds: h5py.Dataset, sel: tuple[slice, ...], target: torch.Tensor, dtype: torch.dtype) -> None:
        """Hyperslab ``sel`` of ``ds`` into ``target``: straight into its memory when it is a plain CPU tensor."""
        if sel and target.device.type == "cpu" and target.is_contiguous() and target.dtype == dtype:
            view = target.view(_VIEW_AS[dtype]) if dtype in _VIEW_AS else target
            out = view.numpy()
            if out.dtype == ds.dtype:
                ds.read_direct(out, source_sel=sel)
                return
        arr = ds[sel] if sel else ds[()]
        target.copy_(from_numpy(np.asarray(arr), dtype))

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        """Any local path will do."""
        return True


# ---- Metadata <-> JSON -------------------------------------------------------------------

def _props_to_json(p: TensorProperties) -> dict[str, Any]:
    return {"dtype": str(p.dtype), "requires_grad": p.requires_grad}


def metadata_to_json(md: Metadata) -> dict[str, Any]:
    """DCP :class:`Metadata` as plain JSON-able data."""
    tensors: dict[str, Any] = {}
    for fqn, sm in md.state_dict_metadata.items():
        if isinstance(sm, BytesStorageMetadata):
            tensors[fqn] = {"bytes": True}
        else:
            tensors[fqn] = {
                "props": _props_to_json(sm.properties),
                "size": list(sm.size),
                "chunks": [[list(c.offsets), list(c.sizes)] for c in sm.chunks],
            }
    storage = [
        {"fqn": idx.fqn, "offset": None if idx.offset is None else list(idx.offset), "info": info}
        for idx, info in (md.storage_data or {}).items()
    ]
    planner = md.planner_data
    if isinstance(planner, dict):
        planner = {k: list(v) if isinstance(v, tuple) else v for k, v in planner.items()}
    else:
        planner = None
    return {"format": "xirang-hdf5-dcp", "format_version": FORMAT_VERSION, "dcp_version": md.version,
            "tensors": tensors, "storage": storage, "planner_data": planner}


def metadata_from_json(d: dict[str, Any]) -> Metadata:
    """Inverse of :func:`metadata_to_json`."""
    sdm: dict[str, Any] = {}
    for fqn, e in d["tensors"].items():
        if e.get("bytes"):
            # DCP would unpickle it on load (a full torch.load); we never write one.
            raise ValueError(f"{fqn!r} is a pickled bytes item; a checkpoint we load holds tensors and JSON only "
                             "(a tampered or foreign checkpoint)")
        props = TensorProperties(dtype=dtype_from_str(e["props"]["dtype"]), requires_grad=e["props"]["requires_grad"])
        chunks = [ChunkStorageMetadata(offsets=torch.Size(o), sizes=torch.Size(s)) for o, s in e["chunks"]]
        sdm[fqn] = TensorStorageMetadata(properties=props, size=torch.Size(e["size"]), chunks=chunks)
    storage = {
        MetadataIndex(fqn=s["fqn"], offset=None if s["offset"] is None else torch.Size(s["offset"])): s["info"]
        for s in d["storage"]
    }
    planner = d.get("planner_data")
    if isinstance(planner, dict):
        planner = {k: tuple(v) if isinstance(v, list) else v for k, v in planner.items()}
    md = Metadata(state_dict_metadata=sdm, planner_data=planner, storage_data=storage)
    if d.get("dcp_version") is not None:
        md.version = d["dcp_version"]
    return md


def read_metadata(path: Path) -> Metadata:
    """Load ``path/metadata.json``; a missing or malformed file raises CheckpointFormatError naming it."""
    f = Path(path) / METADATA_FILE
    try:
        d = json.loads(f.read_text())
        if d.get("format") != "xirang-hdf5-dcp":
            raise ValueError("not a xirang HDF5 checkpoint")
        return metadata_from_json(d)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CheckpointFormatError(f"checkpoint metadata {f} is unreadable: {exc}") from exc
