"""Stop signals that arrive before the stop handler exists, captured from the job function's first line.

Torch-free, so the job entry (``job/entry.py``) installs it before it imports the training stack: a
preemption during those seconds of imports would otherwise meet submitit's own USR2 handler, which
requeues the job on its own (unlogged, with Slurm's ~2 min hold before the rerun).
:meth:`xirang_hpc.runtime.signals.StopSignalHook.install` takes the captured signals over.
"""

from __future__ import annotations

import signal
import time
from typing import Any

# Stop signals received between the job function's first line and the hook's install (start-up,
# rendezvous, checkpoint load); the hook takes them over and acts at its first step boundary.
_early: list[tuple[str, float]] = []


def capture_early() -> None:
    """Record USR2/SIGTERM from now on, replacing submitit's handlers (its USR2 handler would requeue the
    job on its own, unlogged, and SIGTERM would be ignored); :meth:`StopSignalHook.install` takes over."""
    def record(signum: int, frame: Any) -> None:
        _early.append((signal.Signals(signum).name, time.time()))

    for sig in (signal.SIGUSR2, signal.SIGTERM):
        signal.signal(sig, record)
