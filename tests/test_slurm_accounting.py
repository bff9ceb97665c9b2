"""Quotas, pending reasons, sacct history and ``xirang-status --queue`` on the accounting testbed.

Needs ``tools/slurm-testbed start`` with accounting (slurmdbd + MariaDB, the default; CI exports
XIRANG_SLURM_CONF). Quotas are set with ``sacctmgr`` inside each test on account ``projb`` and
restored afterwards; the jobs are real ``xirang-train`` submissions and real ``sbatch`` fillers.
"""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import slurm_conf_env, slurm_conf_for
from test_slurm_e2e import _wait  # progress-aware: the limit counts from the testbed's last change

from xirang_hpc.monitor.events import append_event
from xirang_hpc.slurm.accounting import SlurmDB
from xirang_hpc.slurm.states import ENDED

pytestmark = pytest.mark.slurm
TRAIN = [sys.executable, "-c", "from xirang_hpc.cli.train import main; main()"]
STATUS = [sys.executable, "-c", "from xirang_hpc.cli.status import cli; cli()"]
ACCOUNT = "projb"


@pytest.fixture(scope="module")
def slurm(request: pytest.FixtureRequest) -> str:
    """SLURM_CONF of a running testbed with accounting."""
    conf = slurm_conf_for(request.path)
    if not conf:
        pytest.skip("no Slurm testbed: run `tools/slurm-testbed start` as root and export XIRANG_SLURM_CONF")
    with slurm_conf_env(conf):
        if not SlurmDB().accounting_enabled():
            pytest.skip("the testbed runs without accounting (XIRANG_SLURM_ACCOUNTING=0)")
        yield conf


def _sh(*argv: str) -> str:
    out = subprocess.run(list(argv), capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, f"{' '.join(argv)}: {out.stderr}"
    return out.stdout


@pytest.fixture()
def quota(slurm):
    """Set ``GrpTRES=cpu=N`` on account projb (``quota(N)``); the old limit and the tests' jobs go afterwards."""
    old = next(a for a in SlurmDB().associations() if a.account == ACCOUNT and not a.user).grp_tres.get("cpu")
    jobs: list[str] = []

    def set_cpus(n: int) -> list[str]:
        _sh("sacctmgr", "-i", "modify", "account", ACCOUNT, "set", f"GrpTRES=cpu={n}")
        return jobs
    yield set_cpus
    if jobs:
        subprocess.run(["scancel", *jobs], check=False)
    _sh("sacctmgr", "-i", "modify", "account", ACCOUNT, "set", f"GrpTRES=cpu={old if old is not None else -1}")


def _train(args: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(TRAIN + args, capture_output=True, text=True, timeout=300)


def _base(data: Path, runs: Path) -> list[str]:
    return ["cluster=testbed", f"cluster.account={ACCOUNT}", f"data.out_dir={data}", f"train.runs_root={runs}",
            "parallel.pp=1", "parallel.tp=1", "train.max_steps=20"]


def test_never_fitting_job_and_unknown_account_refused_before_submission(quota, stdlib_data, tmp_path):
    quota(2)
    runs = tmp_path / "runs"
    before = _sh("squeue", "-h", "-o", "%i").split()
    out = _train(_base(stdlib_data, runs))  # 2 nodes x 2 ranks x 1 CPU = 4 CPUs, the account allows 2
    assert out.returncode == 2, out.stdout + out.stderr
    assert "this job can never run under the quota" in out.stderr
    assert f"never fits: account {ACCOUNT} (GrpTRES) allows 2 CPUs; this job asks for 4" in out.stderr
    out = _train([*_base(stdlib_data, runs), "cluster.account=nosuch"])
    assert out.returncode == 2 and re.search(r"'nosuch' does not exist .* may submit to: .*proja, projb", out.stderr)
    out = _train([*_base(stdlib_data, runs), "cluster.qos=gold"])
    assert out.returncode == 2 and "valid QOS: " in out.stderr and "scavenger" in out.stderr, out.stderr
    # Nothing submitted: no job id the queue did not hold before (other tests' jobs may have left it meanwhile).
    assert not set(_sh("squeue", "-h", "-o", "%i").split()) - set(before)
    assert not list(runs.glob("*/events.jsonl"))  # and no run directory written


def test_waiting_job_said_in_words_by_train_status_and_queue(quota, stdlib_data, tmp_path):
    jobs = quota(4)
    filler = _sh("sbatch", "--parsable", "-A", ACCOUNT, "-n", "2", "-J", "filler", "-o", "/dev/null",
                 "--wrap", "sleep 600").strip()
    jobs.append(filler)
    _wait(lambda: _sh("squeue", "-h", "-j", filler, "-o", "%T").strip() == "RUNNING", 120, "the filler to run")
    out = _train(_base(stdlib_data, tmp_path / "runs"))  # 4 CPUs; the account uses 2 of its 4
    assert out.returncode == 0, out.stdout + out.stderr
    assert "quota (cluster " in out.stdout and f"account {ACCOUNT}: 4 CPUs" in out.stdout
    # projb is otherwise idle here (the other tests charge root's default account proja): 2 of 4 in use.
    assert (f"will wait (AssocGrpCpuLimit): account {ACCOUNT} (GrpTRES) uses 2 of its 4 CPUs; "
            "this job waits for 4") in out.stdout, out.stdout
    m = re.search(r"submitted Slurm job (\d+) .*\| run dir (\S+)", out.stdout)
    assert m, out.stdout
    job, run = m.group(1), Path(m.group(2))
    jobs.append(job)
    words = f"AssocGrpCpuLimit: account {ACCOUNT} uses 2 of its 4 CPUs; this job waits for 4"

    def status() -> str:
        s = subprocess.run([*STATUS, str(run)], capture_output=True, text=True, timeout=120).stdout
        return s if words in s else ""
    # Slurm names the quota once its scheduler has looked at the job (Priority/None before that).
    print(_wait(status, 180, "xirang-status to say the quota reason"))
    q = subprocess.run([*STATUS, "--queue"], capture_output=True, text=True, timeout=120)
    print(q.stdout)
    assert q.returncode == 0 and words in q.stdout
    row = next(line for line in q.stdout.splitlines() if line.startswith(f"{ACCOUNT}  ") and "(all)" in line)
    assert row.split()[2] == "2/4", row
    snap = json.loads(subprocess.run([*STATUS, "--queue", "--json"], capture_output=True, text=True,
                                     timeout=120).stdout)
    mine = next(j for j in snap["jobs"] if j["job_id"] == job)
    assert mine["reason"] == "AssocGrpCpuLimit" and mine["why"].endswith("this job waits for 4")
    assert any(n["class"] == "busy" for n in snap["nodes"]) and snap["partitions"]
    assert snap["accounting"] == "on" and snap["fairshare"] and snap["utilization"]["capacity_cpus"] > 0
    png = tmp_path / "queue.png"
    assert subprocess.run([*STATUS, "--queue", "--plot", str(png)], timeout=120).returncode == 0
    assert png.stat().st_size > 1000


def test_sacct_history_of_a_requeued_finished_job(slurm, tmp_path, caplog):
    job = _sh("sbatch", "--parsable", "-A", ACCOUNT, "-N", "2", "-n", "2", "--requeue", "-J", "hist",
              "-o", "/dev/null", "--wrap", "sleep 8").strip()
    _wait(lambda: _sh("squeue", "-h", "-j", job, "-o", "%T").strip() == "RUNNING", 120, "the job to run")
    _sh("scontrol", "requeue", job)
    # A requeued job sits in BeginTime for ~2 minutes: make it eligible 2 s ahead, as the product's requeue
    # does (slurm/control.after_requeue). Not "now": once, under CI load, Slurm relaunched the job in the
    # second of the requeue and its batch step failed at once (exit 1, elapsed 0), most likely on the job
    # credential that the requeue revoked (slurmd compares whole seconds).
    _wait(lambda: _sh("squeue", "-h", "-j", job, "-o", "%T").strip() == "PENDING", 120, "the requeued job to pend")
    subprocess.run(["scontrol", "update", f"jobid={job}", "StartTime=now+2"], check=False)
    _wait(lambda: not _sh("squeue", "-h", "-j", job, "-o", "%T").strip(), 240, "the job to leave squeue")
    run = tmp_path / "run"
    run.mkdir()
    append_event(run, "submit", "submitted", job=job, cluster="testbed")

    seen: list[dict] = [{}]

    def status() -> dict:
        s = json.loads(subprocess.run([*STATUS, str(run), "--json"], capture_output=True, text=True,
                                      timeout=120).stdout)
        seen[0] = s
        if s["state_source"] == "sacct" and s["state"] in ENDED and s["state"] != "COMPLETED":
            raise AssertionError(f"the job did not complete: {s['state']} ({s['state_reason']}); "
                                 f"sacct: {recorded()!r}")
        return s if s["state"] == "COMPLETED" and s["state_source"] == "sacct" else {}

    def recorded() -> str:  # what slurmdbd holds for the job: it changes while the end is being recorded
        return _sh("sacct", "-n", "-P", "-D", "-j", job, "-o", "JobID,State,End")
    s = _wait(status, 300, lambda: f"sacct to record the end; sacct: {recorded()!r}; xirang-status: {seen[0]}",
              progress=recorded)
    assert "exit code 0:0" in s["state_reason"] and "1 restart(s)" in s["state_reason"], s
    assert "2 node(s)" in s["state_reason"] and "CPU time" in s["state_reason"]
    text = subprocess.run([*STATUS, str(run)], capture_output=True, text=True, timeout=120).stdout
    assert "COMPLETED (exit code 0:0, elapsed" in text, text
    # submitit reads the same sacct: with accounting it answers, and logs no warning.
    import submitit

    caplog.set_level(logging.WARNING)
    assert submitit.SlurmJob(tmp_path / "sub", job).state == "COMPLETED"
    assert not [r for r in caplog.records if "sacct" in r.getMessage()]


def _cfg(*over: str):
    from hydra import compose, initialize_config_module

    from xirang_hpc.config.validate import load_config
    from xirang_hpc.submit.hydra_setup import register_configs

    register_configs()
    with initialize_config_module(version_base="1.3", config_module="xirang_hpc.conf"):
        over = ("cluster=testbed", "parallel.pp=1", "parallel.tp=1", *over)
        return load_config(compose(config_name="config", overrides=list(over)))


def test_user_without_association_gets_the_sacctmgr_line(slurm):
    from xirang_hpc.submit.quota_check import QuotaRefused, check_quota

    cluster = SlurmDB().config()["ClusterName"]
    with pytest.raises(QuotaRefused) as e:
        check_quota(_cfg(), SlurmDB(), user="alice")  # the real associations; no user alice among them
    assert f"sacctmgr -i add user alice Account=<account> Cluster={cluster}" in str(e.value)


def test_slurmdbd_down_status_says_so_and_train_goes_on(slurm, tmp_path):
    """slurmdbd stopped for real (the testbed's pid file), then started again as the testbed does."""
    from xirang_hpc.slurm.queue import gather, render_queue
    from xirang_hpc.submit.quota_check import check_quota

    pidfile = Path(slurm).parent / "run" / "slurmdbd.pid"
    if not pidfile.exists():
        pytest.skip(f"no slurmdbd pid file at {pidfile} (not a tools/slurm-testbed cluster)")
    filler = _sh("sbatch", "--parsable", "-A", ACCOUNT, "-n", "1", "-J", "while-dbd-down", "-o", "/dev/null",
                 "--wrap", "sleep 300").strip()
    pid = int(pidfile.read_text().split()[0])
    os.kill(pid, 15)
    try:
        _wait(lambda: subprocess.run(["sacctmgr", "-n", "-P", "show", "qos", "format=Name"], capture_output=True,
                                     timeout=60).returncode != 0, 60, "slurmdbd to stop answering")
        lines, fit = check_quota(_cfg(), SlurmDB(), user="root")
        assert fit is None and "cannot check the quota: slurmdbd does not answer" in lines[0], lines
        snap = gather(SlurmDB(), "root")
        text = render_queue(snap)
        print(text)
        assert snap["accounting"] == "down" and "slurmdbd DOWN" in text
        assert any(j["job_id"] == filler for j in snap["jobs"]) and snap["nodes"]  # squeue and sinfo still answer
    finally:
        subprocess.run(["scancel", filler], check=False)
        subprocess.run(["slurmdbd"], env={**os.environ, "SLURM_CONF": slurm}, check=True, timeout=60)
        _wait(lambda: subprocess.run(["sacctmgr", "-n", "-P", "show", "qos", "format=Name"], capture_output=True,
                                     timeout=60).returncode == 0, 120, "slurmdbd to answer again")
