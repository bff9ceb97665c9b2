"""What exactly trained this model: the run's environment, recorded at every start (``environment.json``).

Rank 0 writes it once the job has started: this package's version and code revision (the git commit and
whether the checkout had changes, when it runs from one), every installed distribution and its version
(what ``pip freeze`` lists, read from the interpreter's own metadata), Python, torch and, where present,
CUDA, cuDNN and NCCL, the job's hosts, the Slurm version and the container the ranks run in. A start in
another environment than the previous one is an ``environment_changed`` event naming what differs.
``xirang-status RUN --env`` prints the record, ``--env-diff RUN_A RUN_B`` what differs between two runs.

Reading it needs no torch (the login node); collecting imports torch, which the job has already loaded.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import platform
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from xirang_hpc.files import write_json_atomic
from xirang_hpc.slurm import commands
from xirang_hpc.slurm.commands import Caller

ENV_FILE = "environment.json"
# Variables container runtimes set inside a container: pyxis/enroot, Apptainer/Singularity, Docker/Podman.
_CONTAINER_VARS = ("SLURM_CONTAINER", "ENROOT_ROOTFS", "NVIDIA_PYTORCH_VERSION", "APPTAINER_CONTAINER",
                   "APPTAINER_NAME", "SINGULARITY_CONTAINER", "SINGULARITY_NAME", "container")

Runner = Callable[[list[str], Path], str | None]


def _run(argv: list[str], cwd: Path) -> str | None:
    """stdout of a short command, or None when it fails or is missing (never raises)."""
    try:
        out = subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def code_revision(run: Runner = _run) -> dict[str, Any] | None:
    """The git commit of this package's checkout and whether it had uncommitted changes (None outside one)."""
    root = Path(__file__).resolve().parents[2]
    commit = run(["git", "rev-parse", "HEAD"], root)
    if not commit:
        return None
    status = run(["git", "status", "--porcelain", "--untracked-files=no"], root)
    return {"commit": commit, "dirty": bool(status), "path": str(root)}


def packages() -> dict[str, str]:
    """Every distribution installed for this interpreter, name -> version (``pip freeze``'s list)."""
    out: dict[str, str] = {}
    for dist in importlib.metadata.distributions():
        name = dist.metadata["Name"]
        if name:
            out[name] = dist.version
    return dict(sorted(out.items(), key=lambda kv: kv[0].lower()))


def slurm_version(call: Caller = commands.call) -> str | None:
    """``sinfo --version`` (e.g. ``slurm 22.05.8``), or None without a Slurm client."""
    r = call(["sinfo", "--version"])
    return r.out.strip() if r.rc == 0 else None


def collect(env: dict[str, str] | None = None, run: Runner = _run, call: Caller = commands.call,
            accelerators: Callable[[], dict[str, Any]] | None = None) -> dict[str, Any]:
    """This process's environment as recorded in ``environment.json``.

    ``accelerators`` reports torch and the devices (the job passes :func:`xirang_hpc.runtime.device.accelerator_stack`;
    this module stays torch-free, so ``xirang-status --env`` on the login node never imports torch).
    """
    env = dict(os.environ) if env is None else env
    try:
        version = importlib.metadata.version("xirang-hpc")
    except importlib.metadata.PackageNotFoundError:
        version = None
    slurm = slurm_version(call) if env.get("SLURM_JOB_ID") else None
    container = {k: env[k] for k in _CONTAINER_VARS if env.get(k)}
    return {
        "xirang_hpc": {"version": version, "revision": code_revision(run)},
        "python": {"version": platform.python_version(), "implementation": platform.python_implementation(),
                   "executable": sys.executable},
        "platform": {"system": platform.system(), "release": platform.release(), "machine": platform.machine()},
        "accelerators": accelerators() if accelerators is not None else None,
        "hosts": {"this": platform.node(), "nodelist": env.get("SLURM_JOB_NODELIST"),
                  "nodes": env.get("SLURM_JOB_NUM_NODES")},
        "slurm": {"version": slurm, "cluster": env.get("SLURM_CLUSTER_NAME"), "job": env.get("SLURM_JOB_ID")},
        "container": container or None,
        "packages": packages(),
    }


def read(run_dir: Path) -> dict[str, Any] | None:
    """The run's recorded environment, or None when it has none."""
    try:
        return json.loads((Path(run_dir) / ENV_FILE).read_text())
    except (OSError, ValueError):
        return None


def flat(record: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"python": {"version": "3.11"}}`` -> ``{"python.version": "3.11"}`` (packages as ``packages.<name>``)."""
    out: dict[str, Any] = {}
    for k, v in record.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flat(v, f"{key}."))
        else:
            out[key] = v
    return out


# What changes with every start and says nothing of the environment.
_VOLATILE = ("hosts.", "slurm.job")


def diff(a: dict[str, Any], b: dict[str, Any], volatile: bool = False) -> dict[str, tuple[Any, Any]]:
    """Keys whose values differ between two records: key -> (a's, b's); the job id and hosts only if ``volatile``."""
    fa, fb = flat(a), flat(b)
    keys = sorted(set(fa) | set(fb))
    return {k: (fa.get(k), fb.get(k)) for k in keys
            if fa.get(k) != fb.get(k) and (volatile or not k.startswith(_VOLATILE))}


def record(run_dir: Path, events: Any = None, env: dict[str, str] | None = None,
           accelerators: Callable[[], dict[str, Any]] | None = None) -> dict[str, Any]:
    """Rank 0 at start: write ``environment.json``; an ``environment_changed`` event when it differs."""
    now = collect(env, accelerators=accelerators)
    before = read(run_dir)
    write_json_atomic(Path(run_dir) / ENV_FILE, now, indent=1)
    if before is not None and events is not None:
        changed = diff(before, now)
        if changed:
            shown = ", ".join(f"{k}: {a} -> {b}" for k, (a, b) in list(changed.items())[:8])
            events.append("environment_changed", f"this start runs in another environment ({shown}"
                          + (f", {len(changed) - 8} more" if len(changed) > 8 else "") + ")",
                          keys=sorted(changed))
    return now


def render_diff(name_a: str, name_b: str, changed: dict[str, tuple[Any, Any]]) -> str:
    """The lines ``xirang-status --env-diff`` prints."""
    if not changed:
        return f"same environment: {name_a} and {name_b}"
    width = max(len(k) for k in changed)
    lines = [f"{len(changed)} differences: {name_a} | {name_b}"]
    lines += [f"  {k:<{width}}  {a} | {b}" for k, (a, b) in changed.items()]
    return "\n".join(lines)
