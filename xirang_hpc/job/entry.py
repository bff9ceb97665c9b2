"""The job's function as the launcher submits it, importable without torch.

submitit sends a job's function by reference (module and name) and imports it where the job runs, so
the launcher never needs the training stack it names. ``train_job`` is that reference: ``xirang-train``,
sweeps and site moves submit it without importing torch (a submission takes a fraction of a second
instead of the seconds torch's import costs), and it imports :func:`training.run_training` inside the job.
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType
from typing import Any


def train_job(cfg_dict: dict[str, Any], run_dir: str, data_dir: str) -> dict[str, Any]:
    """Run :func:`xirang_hpc.job.training.run_training` on this rank (the summary on rank 0, ``{}`` elsewhere).

    Stop signals are captured first, before the seconds of importing torch and the training stack, so that a
    preemption then is ours to record and requeue (``runtime/early_signals.py``), not submitit's.
    """
    from xirang_hpc.runtime.early_signals import capture_early

    capture_early()
    return training_stack().run_training(cfg_dict, run_dir, data_dir)


def training_stack() -> ModuleType:
    """Import :mod:`xirang_hpc.job.training` and what a rank needs before its first step, with the garbage
    collector paused and what they made frozen (``runtime/startup.py`` says why)."""
    from xirang_hpc.runtime.startup import TRAINING_STACK, import_paused

    # The first failure is the cause: importing a module again after it failed half-way (torch._dynamo
    # registers its caches before it makes its cache directory) fails with an unrelated error.
    for name, exc in import_paused([*TRAINING_STACK, "xirang_hpc.job.training"]):
        cache = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
        if isinstance(exc, OSError) and cache and str(exc.filename or "").startswith(cache):
            exc.add_note(f"TORCHINDUCTOR_CACHE_DIR={cache} (torch's compile cache) cannot be made by this user: "
                         "unset it or point it at a directory of your own")
        exc.add_note(f"while importing {name} before the rank's first step")
        raise exc
    # By name: this module is what the submitting side imports (``.importlinter`` keeps torch out of it).
    return importlib.import_module("xirang_hpc.job.training")
