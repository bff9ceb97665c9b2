"""HDF5 StorageWriter/StorageReader for DCP: round trip, chunking, compression, JSON metadata, dedup refs."""

from __future__ import annotations

import json

import h5py
import pytest
import torch
import torch.distributed.checkpoint as dcp

from xirang_hpc.checkpoint.storage import (
    CheckpointFormatError,
    HDF5StorageReader,
    HDF5StorageWriter,
    chunk_hash,
    read_metadata,
    to_numpy,
)


def _state() -> dict:
    g = torch.Generator().manual_seed(0)
    return {
        "model": {"w": torch.randn(64, 32, generator=g), "b": torch.randn(32, generator=g),
                  "emb": torch.randn(16, 8, generator=g).to(torch.bfloat16)},
        "optim": {"step": torch.tensor(7.0), "ids": torch.arange(10, dtype=torch.int64)},
    }


def _zeros_like(sd: dict) -> dict:
    return {k: _zeros_like(v) if isinstance(v, dict) else torch.zeros_like(v) for k, v in sd.items()}


def _flat(sd: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in sd.items():
        out.update(_flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {prefix + k: v})
    return out


@pytest.mark.parametrize("compression", ["none", "lzf", "gzip", "zstd"])
def test_round_trip_bitwise_with_each_compression(tmp_path, compression):
    sd = _state()
    dcp.save(sd, storage_writer=HDF5StorageWriter(tmp_path, compression), no_dist=True)
    out = _zeros_like(sd)
    dcp.load(out, storage_reader=HDF5StorageReader(tmp_path), no_dist=True)
    for k, v in _flat(sd).items():
        got = _flat(out)[k]
        assert got.dtype == v.dtype and torch.equal(got, v), k
    with h5py.File(tmp_path / "rank_0.h5", "r", locking=False) as f:
        ds = f["model.w@0,0"]
        # Compressed: HDF5 chunk == the shard, filter as configured. Uncompressed: contiguous (the
        # dataset is the shard; a partial read touches only its hyperslab).
        assert ds.chunks == (None if compression == "none" else (64, 32))
        if compression == "zstd":  # a plugin filter: h5py names it by its registered id
            assert "32015" in ds._filters  # 32015: the registered HDF5 Zstandard filter id
        else:
            assert ds.compression == (None if compression == "none" else compression)


def test_metadata_is_json_and_no_pickle_files(tmp_path):
    dcp.save(_state(), storage_writer=HDF5StorageWriter(tmp_path), no_dist=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metadata.json", "rank_0.h5"]
    md = json.loads((tmp_path / "metadata.json").read_text())
    assert md["format"] == "xirang-hdf5-dcp"
    assert md["tensors"]["model.w"]["size"] == [64, 32]
    assert md["tensors"]["model.emb"]["props"]["dtype"] == "torch.bfloat16"
    assert read_metadata(tmp_path).state_dict_metadata["model.w"].size == torch.Size([64, 32])


def test_unreadable_metadata_names_the_file(tmp_path):
    (tmp_path / "metadata.json").write_text("{not json")
    with pytest.raises(CheckpointFormatError, match=r"metadata\.json is unreadable"):
        read_metadata(tmp_path)


def test_dedup_index_turns_identical_chunks_into_references(tmp_path):
    sd = _state()
    a, b = tmp_path / "step_1", tmp_path / "step_2"
    dcp.save(sd, storage_writer=HDF5StorageWriter(a, dedup_index={}), no_dist=True)
    index = {chunk_hash(to_numpy(sd["model"]["w"])): ("../step_1/rank_0.h5", "model.w@0,0")}
    sd["model"]["b"] += 1  # changed: must be written again
    w = HDF5StorageWriter(b, dedup_index=index)
    dcp.save(sd, storage_writer=w, no_dist=True)
    assert w.stats["ref_bytes"] == 64 * 32 * 4 and w.stats["ref_chunks"] == 1
    with h5py.File(b / "rank_0.h5", "r", locking=False) as f:
        assert "model.w@0,0" not in f and "model.b@0" in f
    out = _zeros_like(sd)
    dcp.load(out, storage_reader=HDF5StorageReader(b), no_dist=True)
    assert torch.equal(out["model"]["w"], sd["model"]["w"]) and torch.equal(out["model"]["b"], sd["model"]["b"])


def test_writer_checksums_its_file_while_syncing_it(tmp_path):
    """The manifest entry the writer hands over equals a fresh pass over the file on disk."""
    from xirang_hpc.checkpoint.layout import file_entry

    w = HDF5StorageWriter(tmp_path)
    dcp.save(_state(), storage_writer=w, no_dist=True)
    assert w.file_entries == {"rank_0.h5": file_entry(tmp_path / "rank_0.h5")}


def test_guarded_file_writes_a_normal_hdf5_file_and_keeps_a_failed_write_from_hdf5(tmp_path, monkeypatch):
    import errno
    import os

    import numpy as np

    from xirang_hpc.checkpoint import h5file
    from xirang_hpc.checkpoint.h5file import GuardedFile

    arr = np.arange(4096, dtype=np.float32)
    raw = GuardedFile(tmp_path / "ok.h5")
    with h5py.File(raw, "w", locking=False) as f:
        for i in range(50):
            f.create_dataset(f"d{i}", data=arr + i)
    raw.close()
    assert raw.error is None
    with h5py.File(tmp_path / "ok.h5", "r") as f:  # an ordinary HDF5 file, read through HDF5's own driver
        assert len(f) == 50 and np.array_equal(f["d49"][()], arr + 49)

    # The disk fills after 64 KiB: HDF5 still sees every write succeed and closes the file without an error.
    budget = [64 << 10]
    real_pwrite = os.pwrite

    def pwrite(fd, data, offset):
        if len(data) > budget[0]:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        budget[0] -= len(data)
        return real_pwrite(fd, data, offset)

    monkeypatch.setattr(h5file.os, "pwrite", pwrite)
    raw = GuardedFile(tmp_path / "full.h5")
    with h5py.File(raw, "w", locking=False) as f:
        for i in range(50):
            f.create_dataset(f"d{i}", data=arr + i)
            if raw.error is not None:
                break
        assert np.array_equal(f[f"d{i}"][()], arr + i)  # what it wrote after the failure reads back
    raw.close()
    assert raw.error is not None and raw.error.errno == errno.ENOSPC and raw.error.filename == str(tmp_path / "full.h5")
