"""Per-rank extra state in a checkpoint: ``trainer.extra_state`` (name -> object with ``state_dict``).

Hooks register objects whose state differs between ranks (e.g. the local-SGD averaging state of
``xirang_hpc.runtime.comm``: under a sync period H > 1 the replicas on different nodes differ
between syncs). Each rank's ``state_dict()`` is split into tensors, saved through DCP under keys
that name the rank (``extra.rank<r>.<name>__<path>``, so every rank writes its own), and the rest,
JSON with ``{"__tensor__": key}`` markers, saved in that rank's ``rank_<r>.json``. No pickle.

Restore loads this rank's tensors from the same checkpoint directory and calls
``load_state_dict``; a checkpoint without them (another world size, or saved before the object
existed) leaves the object as it is, and the caller logs it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

from xirang_hpc.checkpoint.storage import HDF5StorageReader, read_metadata

MARK = "__tensor__"


def _split(obj: Any, path: str, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(obj, torch.Tensor):
        tensors[path] = obj.detach()
        return {MARK: path}
    if isinstance(obj, dict):
        return {str(k): _split(v, f"{path}__{k}", tensors) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_split(v, f"{path}__{i}", tensors) for i, v in enumerate(obj)]
    return obj


def _join(obj: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(obj, dict):
        if set(obj) == {MARK}:
            return tensors[obj[MARK]]
        return {k: _join(v, tensors) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_join(v, tensors) for v in obj]
    return obj


def save_parts(extra: dict[str, Any], rank: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """(DCP tensors ``{"extra": {"rank<r>": {...}}}`` or ``{}``, JSON for this rank's ``rank_<r>.json``)."""
    tensors: dict[str, torch.Tensor] = {}
    plain = {name: _split(obj.state_dict(), name, tensors) for name, obj in extra.items()}
    return ({"extra": {f"rank{rank}": tensors}} if tensors else {}), plain


def restore(extra: dict[str, Any], step_dir: Path, rank_state: dict[str, Any] | None, rank: int) -> list[str]:
    """Load this rank's extra state from ``step_dir`` into ``extra``; returns the names restored (not collective)."""
    if not extra:
        return []
    saved = (rank_state or {}).get("extra") or {}
    md = read_metadata(Path(step_dir)).state_dict_metadata
    prefix = f"extra.rank{rank}."
    want: dict[str, torch.Tensor] = {}
    names = []
    for name in extra:
        if name not in saved:
            continue
        keys: dict[str, torch.Tensor] = {}
        _split_keys(saved[name], keys)
        if all(prefix + k in md for k in keys):
            for k in keys:
                m = md[prefix + k]
                want[k] = torch.empty(tuple(m.size), dtype=m.properties.dtype)
            names.append(name)
    if want:  # each rank reads only its own keys: no coordination needed
        dcp.load({"extra": {f"rank{rank}": want}}, storage_reader=HDF5StorageReader(step_dir), no_dist=True)
    for name in names:
        extra[name].load_state_dict(_join(saved[name], want))
    return names


def _split_keys(obj: Any, keys: dict[str, Any]) -> None:
    if isinstance(obj, dict):
        if set(obj) == {MARK}:
            keys[obj[MARK]] = None
            return
        for v in obj.values():
            _split_keys(v, keys)
    elif isinstance(obj, list):
        for v in obj:
            _split_keys(v, keys)
