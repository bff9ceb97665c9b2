"""Real rank processes for tests, started without paying torch's import in every one.

A ``spawn``-ed rank is a fresh interpreter that imports torch, ``torch.distributed.checkpoint`` and
the package again: about 2.7 s of CPU before its first line of work, a large part of the suite's
CPU. :func:`rank_context` starts ranks from multiprocessing's fork server instead, one per test
process, which imports those modules once; every rank is a fork of that clean, single-threaded
server (never of the pytest process, whose threads make ``fork`` unsafe), so it is still a separate
process with its own process group, signals and exit code.

Two differences from ``spawn`` are mended here, so a rank behaves as one a launcher starts:

- a fork-server child inherits the server's environment, not the parent's at ``start()``.
  :class:`RankProcess` takes the parent's environment at ``start()`` and installs it in the child
  before the target runs;
- a fork-server child leaves with ``os._exit``, which skips ``atexit`` handlers (the product ends an
  MLflow run and flushes writers there). The child runs them after the target, as a normal
  interpreter exit does.
"""

from __future__ import annotations

import atexit
import multiprocessing as mp
import os
from collections.abc import Callable
from multiprocessing.context import ForkServerContext, ForkServerProcess
from typing import Any

from xirang_hpc.local.preload import PRELOAD as LOCAL_RANK_PRELOAD
from xirang_hpc.runtime.local_ranks import join_ranks

# Imported once by the fork server (an import that fails there is simply done again by the child): torch and
# what a rank imports on its first step (``torch._dynamo``, ~1 s of CPU: torch imports it lazily on the first
# optimizer step and meta-device init), and what unpickling a rank's target imports (its test module imports
# pytest, the conftest and Hydra's compose API, ~0.8 s); first ``ranks_paused`` pauses the garbage collector,
# last ``ranks_frozen`` freezes it all (gc.freeze) and enables it again.
PRELOAD = ["ranks_paused", *LOCAL_RANK_PRELOAD, "pytest", "hydra", "omegaconf", "xirang_hpc.submit.hydra_setup",
           "conftest", "ranks_frozen"]


def _in_env(env: dict[str, str], target: Callable[..., Any], args: tuple, kwargs: dict[str, Any]) -> Any:
    """Child side: the parent's environment of ``start()``, the target, then the ``atexit`` handlers."""
    os.environ.clear()
    os.environ.update(env)
    try:
        return target(*args, **kwargs)
    finally:
        atexit._run_exitfuncs()


class RankProcess(ForkServerProcess):
    """A fork-server process that runs its target in the parent's environment of ``start()``."""

    def start(self) -> None:
        self._args = (dict(os.environ), self._target, tuple(self._args), dict(self._kwargs))
        self._target, self._kwargs = _in_env, {}
        super().start()


class RankContext(ForkServerContext):
    """The fork-server context whose ``Process`` is :class:`RankProcess`."""

    Process = RankProcess


def rank_context() -> RankContext:
    """The context to start test ranks with (``ctx.Process``, ``ctx.Queue``, ``ctx.Event`` ...)."""
    mp.set_forkserver_preload(PRELOAD)  # before this process's server starts; later calls change nothing
    return RankContext()


def run_ranks(procs: list[mp.process.BaseProcess], timeout_s: float = 300) -> list[int | None]:
    """Start ``procs``, wait for them (``timeout_s`` in all, a safety net against a hang), kill any still
    alive; returns their exit codes (None for one that was still running). A group that reports back
    through a queue takes :class:`~xirang_hpc.runtime.local_ranks.LocalRanks` with ``ctx=rank_context()``."""
    for p in procs:
        p.start()
    return join_ranks(procs, timeout_s)
