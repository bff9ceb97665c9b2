"""The ranks in a container (``cluster.container.*``): what their ``srun`` step says and how each starts.

Production GPU clusters run training in containers. Two runtimes:

- **pyxis** (the Slurm SPANK plugin over enroot): the step itself enters the container, so the rank
  ``srun`` gains ``--container-image``, ``--container-mounts`` and ``--container-workdir``;
- **apptainer**: each task is wrapped, ``apptainer exec [--nv] --bind ... --pwd ... IMAGE python``.

Only the ranks are inside: the batch script, the in-job restart driver and the supervisor run on the host
(they query and steer Slurm). The host paths a rank needs are mounted at the same place: the runs root,
the data directory, this package's checkout and its Python environment, plus ``cluster.container.mounts``.
The same two functions feed every path that starts ranks (submitit's batch script, the in-job restart's
``srun`` steps, ``xirang-sbatch``), so a restart or a requeue starts its ranks the same way.
"""

from __future__ import annotations

from collections.abc import Sequence

from xirang_hpc.config.schema import ClusterConfig


def mounts(c: ClusterConfig, paths: Sequence[str]) -> list[str]:
    """``src:dst`` bind mounts: each of ``paths`` at the same place, then ``cluster.container.mounts``."""
    out: list[str] = []
    for p in [*paths, *c.container.mounts]:
        m = p if ":" in p else f"{p}:{p}"
        if m not in out:
            out.append(m)
    return out


def srun_args(c: ClusterConfig, paths: Sequence[str], workdir: str) -> list[str]:
    """Arguments the rank ``srun`` step gains (pyxis); none without a container or under apptainer."""
    ct = c.container
    if not ct.image or ct.runtime != "pyxis":
        return []
    return [f"--container-image={ct.image}", f"--container-mounts={','.join(mounts(c, paths))}",
            f"--container-workdir={workdir}"]


def rank_python(c: ClusterConfig, paths: Sequence[str], workdir: str, python: str) -> list[str]:
    """The command that starts a rank's interpreter: ``python`` itself, or wrapped by ``apptainer exec``."""
    ct = c.container
    inside = ct.python or python
    if not ct.image or ct.runtime != "apptainer":
        return [inside]
    return ["apptainer", "exec", *(["--nv"] if ct.nv else []), "--bind", ",".join(mounts(c, paths)),
            "--pwd", workdir, ct.image, inside]
