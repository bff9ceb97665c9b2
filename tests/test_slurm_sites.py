"""Several clusters as one, end to end on the two-cluster testbed (``tools/slurm-testbed start --clusters
alpha,beta``): placement with real ``sbatch --test-only -M``, a real preemption on alpha, the verified copy to
beta's run root by the job itself (at the preemption, from its batch script's supervisor) and the finish
there, bitwise identical to an uninterrupted run.

Runs when ``XIRANG_SLURM_CONF`` points at a testbed whose slurmdbd knows the clusters alpha and beta; skips
otherwise (the single-cluster CI testbed).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import numpy as np
import pytest
from conftest import registered_clusters, slurm_conf_env
from test_slurm_e2e import TRAIN, _ev, _final, _wait, _weights

from xirang_hpc.submit.sites import read_site_state

pytestmark = pytest.mark.slurm


@pytest.fixture(scope="module")
def two_sites() -> str:
    conf = os.environ.get("XIRANG_SLURM_CONF")
    if not conf:
        pytest.skip("no Slurm testbed (XIRANG_SLURM_CONF unset)")
    _, names = registered_clusters(conf)
    if not {"alpha", "beta"} <= set(names):
        pytest.skip(f"needs the clusters alpha and beta (have {names}); "
                    "start them with `tools/slurm-testbed start --clusters alpha,beta`")
    with slurm_conf_env(conf):
        yield conf


def _state(site: str, job: str) -> str:
    """The job's state on ``site`` ('' once it has left the queue)."""
    out = subprocess.run(["squeue", "-M", site, "-h", "-j", job, "-o", "%T"], capture_output=True, text=True).stdout
    states = [ln.strip() for ln in out.splitlines() if ln.strip() and not ln.startswith("CLUSTER")]
    return states[-1] if states else ""


def _fill(site: str, running: bool = True) -> str:
    """A `high` job on every node of ``site`` for 30 minutes: `low` jobs there wait (or are preempted).
    With ``running``, returns once it runs: a placement asked while it is still pending sees a free site."""
    out = subprocess.run(["sbatch", "--parsable", "-M", site, "-p", "high", "-N2", "--exclusive", "-t", "30",
                          "-o", "/dev/null", "--wrap", "sleep 1800"], capture_output=True, text=True, check=True)
    job = out.stdout.strip().split(";")[0]
    if running:
        _wait(lambda: _state(site, job) == "RUNNING", 300, f"the filler {job} to run on {site}")
    return job


def _cancel(site: str, job: str) -> None:
    """Cancel ``job`` and wait until it has left ``site``'s queue (a later test's preemption names the jobs
    on the nodes: a filler still completing would be among them)."""
    subprocess.run(["scancel", "-M", site, job], check=False)
    _wait(lambda: _state(site, job) in ("", "CANCELLED", "COMPLETED"), 300, f"job {job} to leave {site}")


def _args(data: Path, root: Path, steps: int) -> list[str]:
    return ["cluster=testbed-sites", "requeue=testbed", f"data.out_dir={data}", f"train.runs_root={root / 'alpha'}",
            f"cluster.sites.0.run_root={root / 'alpha'}", f"cluster.sites.1.run_root={root / 'beta'}",
            "train.warmup_steps=2", "train.log_every=10", "train.eval_batches=2", "parallel.pp=1", "parallel.tp=1",
            f"train.max_steps={steps}", "checkpoint.every_steps=25"]


def _submit(args: list[str], env: dict[str, str] | None = None) -> tuple[str, str, Path]:
    """Submit with ``xirang-train``; ``env`` adds to the submitting environment (sbatch exports it to the job, and
    the job to the one it submits on another site)."""
    out = subprocess.run(TRAIN + args, capture_output=True, text=True, timeout=300,
                         env={**os.environ, **env} if env else None)
    assert out.returncode == 0, out.stdout + out.stderr
    m = re.search(r"submitted Slurm job (\d+) \(testbed-sites, site (\w+):.*\| run dir (\S+)", out.stdout)
    assert m and "placement: site" in out.stdout, out.stdout
    # The quota check before submission is made on the chosen site (its associations and jobs, -M).
    assert f"quota (cluster {m.group(2)}, account proja" in out.stdout, out.stdout
    return m.group(1), m.group(2), Path(m.group(3))


def test_site_a_full_the_job_runs_on_b(two_sites, stdlib_data, tmp_path):
    # The run must still be live when the second launch asks for it: rank 0 sleeps 60 s in its step 1 (a
    # tiny run is otherwise over in seconds on a quiet box).
    args = _args(stdlib_data, tmp_path, 20)
    filler = _fill("alpha")
    try:
        job, site, run = _submit(args, env={"XIRANG_TESTPOINT_SLOW": "rank=0,steps=1,s=60"})
        assert site == "beta" and run.is_relative_to(tmp_path / "beta")
        # The same run again, from alpha's default SLURM_CONF: the run lock asks beta (-M) and sees job
        # `job` live there (alpha knows no such job, or another one with the same id).
        again = subprocess.run(TRAIN + args, capture_output=True, text=True, timeout=300)
        assert again.returncode != 0 and f"already has job {job} on cluster beta" in again.stderr, \
            again.stdout + again.stderr
        # One view of both sites: alpha full (the filler on both nodes), a job of ours on beta (a plain one: the
        # short training run may be over by now).
        marker = subprocess.run(["sbatch", "--parsable", "-M", "beta", "-p", "low", "-N1", "-t", "5", "-o", "/dev/null",
                                 "--wrap", "sleep 300"], capture_output=True, text=True, check=True
                                ).stdout.strip().split(";")[0]
        q = subprocess.run([*TRAIN[:2], "from xirang_hpc.cli.status import main; raise SystemExit(main())",
                            "--queue", "--sites", "all", "--json"], capture_output=True, text=True, timeout=300)
        assert q.returncode == 0, q.stdout + q.stderr
        view = json.loads(q.stdout)
        rows = {r["site"]: r for r in view["summary"]}
        assert {"alpha", "beta"} <= set(rows), rows
        assert rows["alpha"]["busy"] == 2 and rows["alpha"]["running"] >= 1, rows["alpha"]
        subprocess.run(["scancel", "-M", "beta", marker], check=False)
        jobs_on = {s["cluster"]: {j["job_id"] for j in s["jobs"]} for s in view["sites"]}
        assert marker in jobs_on["beta"] and filler in jobs_on["alpha"] and rows["beta"]["nodes"] == 2, view
        assert [q["account"] for q in rows["beta"]["quotas"]] == ["proja", "projb"], rows["beta"]
        placed = _ev(run, "placement")[0]
        est = {e["site"]: e for e in placed["estimates"]}
        assert est["alpha"]["wait_s"] > 600 and est["beta"]["wait_s"] < 60, est
        assert _final(run)["status"] == "completed"
        assert read_site_state(run)["site"] == "beta"
    finally:
        _cancel("alpha", filler)


def test_run_preempted_on_a_migrates_to_b_and_finishes_bitwise_identical(two_sites, stdlib_data, tmp_path):
    steps = 60
    # Rank 0 sleeps 0.5 s in every step, so that the preemption lands while the run trains, however fast the
    # box (60 tiny steps are otherwise over in seconds); the weights do not depend on it.
    args = _args(stdlib_data, tmp_path, steps)
    slow = {**os.environ, "XIRANG_TESTPOINT_SLOW": "rank=0,s=0.5"}
    # The uninterrupted reference: the same 1 x 2 layout and threads on the local executor, meanwhile.
    ref_cmd = [*TRAIN, *[a for a in args if not a.startswith(("cluster", "train.runs_root="))], "cluster=local",
               "cluster.nodes=1", "cluster.tasks_per_node=2", "cluster.threads_per_rank=1",
               f"train.runs_root={tmp_path / 'ref'}",
               "train.wait=true"]
    ref_proc = subprocess.Popen(ref_cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=slow)
    job, site, run = _submit(args, env=slow)
    assert site == "alpha"  # both idle: the first site
    _wait(lambda: _ev(run, "first_step", 0), 600, "the run to train on alpha")
    # The move must fit the preemption's grace time plus KillWait; the testbed's 20 s grace is short for a
    # heavily loaded 2-core box (a site would give 60 s or more), so alpha's `low` gets 60 s here.
    subprocess.run(["scontrol", "-M", "alpha", "update", "PartitionName=low", "GraceTime=60"], check=True)
    filler = _fill("alpha", running=False)  # preempts the run; its requeue would wait 30 minutes behind the filler
    moved = tmp_path / "beta" / run.name
    try:
        # Nobody intervenes: the job itself (its supervisor, at the preemption) copies the run to beta's run
        # root, verifies it and submits it there with `sbatch -M beta`; nothing is requeued on alpha.
        _wait(lambda: moved.is_dir() and _ev(moved, "migrate"), 600, "the run to move itself to beta")
        mig = _ev(moved, "migrate")[0]
        assert mig["trigger"] == "preemption" and mig["from"] == "alpha" and mig["to"] == "beta", mig
        assert mig["preempted_by"] == [filler], mig
        est = {e["site"]: e for e in mig["estimates"]}
        assert est["alpha"]["wait_s"] > mig["site_migrate_wait_s"] and est["beta"]["wait_s"] < 60, est
        assert mig["copy_bytes"] > 0 and mig["copy_s"] >= 0 and mig["step"] == _ev(run, "stop")[0]["saved_step"]
        assert _ev(run, "exit")[-1]["status"] == "migrated" and not _ev(run, "requeue")
        assert _final(moved)["status"] == "completed"
        assert [h["site"] for h in read_site_state(moved)["history"]] == ["alpha", "beta"]
        # The job on alpha ended for good, never requeued there: one record (-D lists every requeued run),
        # cancelled by itself (or ended by Slurm's grace time first), and nothing pending on alpha.
        st = subprocess.run(["sacct", "-M", "alpha", "-n", "-X", "-D", "-P", "-j", job, "-o", "State"],
                            capture_output=True, text=True).stdout.splitlines()
        assert len(st) == 1 and st[0].startswith(("CANCELLED", "PREEMPTED")), st
        left = subprocess.run(["squeue", "-M", "alpha", "-h", "-j", job], capture_output=True, text=True).stdout
        assert not left.strip(), left
    finally:
        _cancel("alpha", filler)
        grace = os.environ.get("XIRANG_SLURM_GRACE", "20")
        subprocess.run(["scontrol", "-M", "alpha", "update", "PartitionName=low", f"GraceTime={grace}"], check=False)
    ref_out = ref_proc.communicate(timeout=600)[0]
    assert ref_proc.returncode == 0, ref_out
    ref = Path(re.search(r"run dir (\S+)", ref_out).group(1))
    a, b = _weights(moved, steps), _weights(ref, steps)
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and np.array_equal(a[k], b[k]), f"{k} differs"


def test_sweep_spread_over_both_sites_one_array_each(two_sites, stdlib_data, tmp_path):
    args = [a for a in _args(stdlib_data, tmp_path, 10) if a != "checkpoint.every_steps=25"]
    out = subprocess.run([*TRAIN, "-m", *args, "cluster.site_sweep=spread", "train.lr=1e-3,3e-4"],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    m = re.search(r"submitted Slurm array job (\S+):", out.stdout)
    assert m, out.stdout
    arrays = dict(a.split(":") for a in m.group(1).split(","))
    assert set(arrays) == {"alpha", "beta"}, out.stdout  # both idle: one task on each
    runs = [Path(p) for p in re.findall(r"-> (\S+)", out.stdout)]
    assert len(runs) == 2
    for run in runs:
        st = read_site_state(run)
        assert run.is_relative_to(tmp_path / st["site"]), (run, st["site"])
        assert _ev(run, "submit")[0]["site"] == st["site"] and st["job"] == arrays[st["site"]]
        assert _final(run)["status"] == "completed"
        # The job ran on its site (Slurm's record there, -M) and ends there (its batch script outlives the
        # final event by a moment).
        def state(site=st["site"], job=st["job"]):
            rec = subprocess.run(["sacct", "-M", site, "-n", "-X", "-P", "-j", job, "-o", "State"],
                                 capture_output=True, text=True).stdout.split()
            return rec and rec[0] not in ("RUNNING", "COMPLETING", "PENDING") and rec[0]
        assert _wait(state, 300, f"job {st['job']} to end on {st['site']}") == "COMPLETED"
    split = json.loads(next((tmp_path / "alpha" / "sweeps").glob("*/sites.json")).read_text())
    assert sorted(r["site"] for r in split["split"]) == ["alpha", "beta"]
