"""The one way the platform runs a Slurm client command: :func:`call`, argv in, :class:`Result` out.

Every query and action in :mod:`xirang_hpc.slurm` takes a ``run``/``Caller`` parameter defaulting to
:func:`call`, so that tests pass recorded outputs (tests/data/slurm/) or a fake cluster instead; nothing
else in the package starts ``sbatch``, ``squeue``, ``sacct``, ``scontrol``, ``scancel`` and the rest.
It never raises: a missing client is exit 127, a client that does not answer in time exit 124, each
with a message in ``err`` that says so.
"""

from __future__ import annotations

import subprocess
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Result:
    """What a command did: exit code, stdout, stderr (127: not installed, 126: not runnable, 124: timed out)."""

    rc: int
    out: str
    err: str


Caller = Callable[[list[str]], Result]


def call(argv: list[str], timeout_s: float = 20.0) -> Result:
    """Run ``argv`` (a Slurm client command) and return what it did; never raises."""
    try:
        r = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, check=False)
    except FileNotFoundError:
        return Result(127, "", f"{argv[0]}: command not found (install the Slurm client)")
    except OSError as exc:  # found but not runnable (permissions, a broken binary)
        return Result(126, "", f"{argv[0]}: cannot be run ({exc.strerror or exc})")
    except subprocess.TimeoutExpired:
        return Result(124, "", f"{argv[0]} timed out after {timeout_s:.0f}s")
    return Result(r.returncode, r.stdout, r.stderr)
