"""A rank's start-up imports, with Python's cyclic garbage collector paused and what they made frozen.

Importing torch, ``torch._dynamo`` (sympy, ``torch.fx``), DTensor and ``torch.distributed.checkpoint`` makes
about 460,000 objects that live as long as the process. With the collector on, CPython runs collection after
collection over them while they are made (~0.7 s of the ~3 s of CPU the imports take here), and every later
full collection walks them all again. Pausing the collector for the imports and moving what they made to the
permanent generation (:func:`gc.freeze`) spares both; what that keeps alive is the import's own cyclic
garbage, ~6 MB. The preload fork server (``local/preload.py``) imports the same list the same way before it
forks local ranks; a Slurm task is a fresh interpreter, and the job function does it (``job/entry.py``).

Standard library only: the job entry calls it before anything heavy is imported.
"""

from __future__ import annotations

import contextlib
import gc
import importlib
from collections.abc import Iterable, Iterator

# What a rank imports before its first step: torch imports ``torch._dynamo`` itself on a rank's first optimizer
# step and in meta-device init, so importing it here costs nothing more and happens with the collector paused.
TRAINING_STACK = ("torch", "torch._dynamo", "torch.distributed", "torch.distributed.checkpoint", "h5py")


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """Run the block (imports) without cyclic collections, then freeze every object alive; the collector
    is enabled again afterwards if it was before."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        if was_enabled:
            gc.enable()


def import_paused(names: Iterable[str]) -> list[tuple[str, Exception]]:
    """Import ``names`` under :func:`collector_paused`; the modules that failed, with why (the caller decides:
    a rank imports them again where it needs them and reports a real failure there)."""
    failed: list[tuple[str, Exception]] = []
    with collector_paused():
        for name in names:
            try:
                importlib.import_module(name)
            except Exception as exc:  # noqa: BLE001 - reported to the caller
                failed.append((name, exc))
    return failed
