"""Several Slurm clusters in one slurmdbd (``tools/slurm-testbed start --clusters alpha,beta``).

Starts nothing itself: runs when ``XIRANG_SLURM_CONF`` points at a testbed whose slurmdbd knows two or
more clusters, and skips otherwise (the single-cluster CI testbed). Real ``sbatch -M``: Slurm sends a
job to the cluster that offers the earliest start.
"""

from __future__ import annotations

import os
import re
import subprocess
import time

import pytest
from conftest import registered_clusters

pytestmark = pytest.mark.slurm


def _run(*args: str, env: dict[str, str], check: bool = True) -> str:
    out = subprocess.run(list(args), capture_output=True, text=True, env=env, timeout=300)
    assert not check or out.returncode == 0, f"{' '.join(args)}: {out.stdout}{out.stderr}"
    return out.stdout


@pytest.fixture(scope="module")
def clusters() -> tuple[dict[str, str], list[str]]:
    conf = os.environ.get("XIRANG_SLURM_CONF")
    if not conf:
        pytest.skip("no Slurm testbed (XIRANG_SLURM_CONF unset)")
    env = {**os.environ, "SLURM_CONF": conf}
    out, names = registered_clusters(conf)
    if out.returncode != 0 or len(names) < 2:
        pytest.skip(f"XIRANG_SLURM_CONF is not a multi-cluster testbed (clusters: {names or out.stderr.strip()}); "
                    "start one with `tools/slurm-testbed start --clusters alpha,beta`")
    return env, names


def _cpus(env: dict[str, str], cluster: str) -> int:
    out = _run("sinfo", "-M", cluster, "-h", "-p", "low", "-o", "%C", env=env)
    return int(out.strip().splitlines()[-1].split("/")[-1])  # allocated/idle/other/total


def test_sinfo_and_sacct_see_every_cluster(clusters):
    env, names = clusters
    out = _run("sinfo", "-M", "all", "-o", "%P %D", env=env)
    for name in names:
        assert f"CLUSTER: {name}" in out, out
    _run("sacct", "-M", "all", "-X", "-n", env=env)


def test_sbatch_to_several_clusters_goes_to_the_idle_one(clusters):
    env, names = clusters
    busy, idle = names[0], names[1]
    assert not _run("squeue", "-M", idle, "-h", env=env).strip().replace(f"CLUSTER: {idle}", "").strip(), \
        f"cluster {idle} must be idle for this test"
    filler = _run("sbatch", "--parsable", "-M", busy, "-p", "low", "-N2", f"-n{_cpus(env, busy)}", "-o", "/dev/null",
                  "--wrap", "sleep 300", env=env).strip().split(";")[0]
    try:
        deadline = time.monotonic() + 600  # a safety net: the wait ends when the job runs
        while "R" not in _run("squeue", "-M", busy, "-h", "-j", filler, "-o", "%t", env=env).split():
            assert time.monotonic() < deadline, "the filler job never started"
            time.sleep(1)
        out = _run("sbatch", "--parsable", "-M", ",".join([busy, idle]), "-p", "low", "-n1", "-o", "/dev/null",
                   "--wrap", "sleep 1", env=env).strip()
        m = re.fullmatch(r"(\d+);(\S+)", out)
        assert m, out
        assert m.group(2) == idle, f"job {m.group(1)} went to {m.group(2)} although {busy} is full and {idle} idle"
        deadline = time.monotonic() + 600
        while True:
            acct = _run("sacct", "-M", idle, "-X", "-n", "-P", "-j", m.group(1), "-o", "cluster,state", env=env)
            if "COMPLETED" in acct:
                break
            assert time.monotonic() < deadline, f"job {m.group(1)} on {idle}: {acct!r}"
            time.sleep(1)
        assert acct.split("|")[0] == idle, acct
    finally:
        _run("scancel", "-M", busy, filler, env=env, check=False)
