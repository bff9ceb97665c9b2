"""Scheduling policy end to end on the accounting testbed (``tools/slurm-testbed``: slurmdbd, QOS,
``priority/multifactor``, ``sched/backfill``): QOS preemption with requeue, fair share between two
accounts, and backfill of an idle fragment by a job with ``--time-min``.

Every wait is progress-based with minutes of timeout (slurmctld acts on ~1-30 s ticks, the decay
thread that books usage on PriorityCalcPeriod=1 min). The figures Slurm decided on (``sshare``,
``sprio``, ``squeue --start``) are printed; run with ``-s`` to see them.
"""

from __future__ import annotations

import re
import subprocess
from collections.abc import Iterator
from datetime import datetime

import pytest
from test_slurm_e2e import _base, _ev, _final, _submit, _wait, slurm  # noqa: F401  (slurm: the fixture)

# The testbed fixture (SLURM_CONF set for the module) is test_slurm_e2e's, used by every test here.
pytestmark = [pytest.mark.slurm, pytest.mark.usefixtures("slurm")]


def _sh(*argv: str, check: bool = True) -> str:
    out = subprocess.run(list(argv), capture_output=True, text=True, timeout=60)
    if check:
        assert out.returncode == 0, f"{' '.join(argv)}: {out.stderr}"
    return out.stdout


def _config(key: str) -> str:
    m = re.search(rf"^{key}\s*=\s*(\S+)", _sh("scontrol", "show", "config"), re.M)
    return m.group(1) if m else ""


def _cpus_per_node() -> int:
    return min(int(c) for c in _sh("sinfo", "-h", "-N", "-o", "%c").split())


def _sbatch(*args: str) -> str:
    job = _sh("sbatch", "--parsable", "-o", "/dev/null", *args).strip().split(";")[0]
    assert job.isdigit(), job
    return job


def _field(job: str, key: str) -> str:
    m = re.search(rf"\b{key}=(\S+)", _sh("scontrol", "show", "job", "-o", job, check=False))
    return m.group(1) if m else ""


def _state(job: str) -> str:
    return _field(job, "JobState")


def _queue() -> str:
    return _sh("squeue", "-o", "%.8i %.9P %.9q %.8a %.8T %.10l %.20S %R", check=False)


@pytest.fixture
def jobs() -> Iterator[list[str]]:
    """Job ids a test submits; all cancelled however the test ends, so the next test finds free nodes."""
    ids: list[str] = []
    yield ids
    if ids:
        subprocess.run(["scancel", *ids], check=False, capture_output=True)


def _accounting_or_skip() -> None:
    if "slurmdbd" not in _config("AccountingStorageType") or "multifactor" not in _config("PriorityType"):
        pytest.skip("needs the accounting testbed (slurmdbd + priority/multifactor): tools/slurm-testbed start "
                    "with XIRANG_SLURM_ACCOUNTING=1 (the default)")


def _idle_cluster() -> None:
    """Earlier tests' jobs (a requeued rerun, a cancelled job completing) would take the nodes first."""
    _wait(lambda: not _sh("squeue", "-h", "-o", "%i", check=False).split(), 600, f"an empty queue:\n{_queue()}",
          poll=2)


# --- QOS preemption -----------------------------------------------------------------------------

def test_qos_preemption_requeues_the_scavenger_run_which_resumes_where_it_stopped(stdlib_data, tmp_path, jobs):
    """cluster=testbed-qos (_base picks it on this testbed), train.priority=exploratory -> QOS scavenger; a
    QOS `high` job that needs every CPU preempts it (USR2, GraceTime, requeue) and the rerun resumes at the
    step it saved."""
    if _config("PreemptType") != "preempt/qos":
        pytest.skip("QOS preemption needs the testbed started with XIRANG_SLURM_PREEMPT=qos (Slurm takes one "
                    "PreemptType; .ci/run runs this test on such a testbed)")
    _idle_cluster()
    steps = 60
    job, run = _submit([*_base(stdlib_data, tmp_path / "runs"), f"train.max_steps={steps}",
                        "checkpoint.every_steps=25", "train.priority=exploratory"])
    jobs.append(job)
    assert _field(job, "QOS") == "scavenger" and _field(job, "Partition") == "low"
    _wait(lambda: _ev(run, "first_step", 0), 300, "training to start")
    cpus = _cpus_per_node()
    jobs.append(_sbatch("--qos=high", "-N2", f"--ntasks-per-node={cpus}", "--wrap", "sleep 2"))
    _wait(lambda: _ev(run, "requeue", 0), 180, "the preemption requeue")
    assert _final(run, timeout=600)["status"] == "completed"
    stops, starts = _ev(run, "stop"), _ev(run, "start")
    assert [(s["reason"], s["signal"]) for s in stops] == [("preemption", "SIGUSR2")], stops
    assert stops[0]["detail"].startswith("PreemptTime="), stops
    # Zero steps lost: the rerun resumed at the step where the preempted run stopped and saved.
    assert starts[1]["step"] == stops[0]["saved_step"] == stops[0]["step"] > 0, starts


# --- fair share ---------------------------------------------------------------------------------

def _sshare() -> tuple[str, dict[str, dict[str, float]]]:
    """(the table as printed, {account: {raw, effective, fairshare}}) for root's associations."""
    text = _sh("sshare", "-a", "-o", "Account,User,RawShares,NormShares,RawUsage,EffectvUsage,FairShare")
    rows = _sh("sshare", "-a", "-n", "-P", "-o", "Account,User,RawUsage,EffectvUsage,FairShare")
    out: dict[str, dict[str, float]] = {}
    for line in rows.splitlines():
        account, user, raw, eff, fs = (x.strip() for x in line.split("|"))
        if user == "root" and account in ("proja", "projb"):
            out[account] = {"raw": float(raw or 0), "effective": float(eff or 0), "fairshare": float(fs or 0)}
    return text, out


def test_fair_share_the_account_that_used_less_starts_first(jobs):
    """Account A has used the cluster; A and B then ask for the same whole cluster at the same time
    (A first, so age and job id favour A): B's job starts first, because of fair share alone."""
    _accounting_or_skip()
    _idle_cluster()
    before, share = _sshare()
    assert set(share) == {"proja", "projb"}, f"root needs associations with proja and projb:\n{before}"
    # A is the account that has used more already (earlier tests), so A's extra use only widens the gap.
    a, b = ("projb", "proja") if share["projb"]["raw"] > share["proja"]["raw"] else ("proja", "projb")
    cpus, whole = _cpus_per_node(), ["-N2", f"--ntasks-per-node={_cpus_per_node()}"]
    use = _sbatch(f"--account={a}", *whole, "--wrap", "sleep 20")
    jobs.append(use)
    _wait(lambda: _state(use) in ("COMPLETED", ""), 300, f"A's job to run and end:\n{_queue()}", poll=2)

    def a_ranks_below_b() -> bool:  # the decay thread books usage once per PriorityCalcPeriod
        s = _sshare()[1]
        return s[a]["raw"] > s[b]["raw"] and s[a]["fairshare"] < s[b]["fairshare"]
    _wait(a_ranks_below_b, 300, f"sshare to book A's usage:\n{_sshare()[0]}", poll=5)
    table, share = _sshare()
    print(f"\nfair share: A={a} has used the cluster (another {2 * cpus * 20} CPU-s just now), B={b}\n{table}")

    blocker = _sbatch(f"--account={a}", *whole, "--wrap", "sleep 600")
    jobs.append(blocker)
    _wait(lambda: _state(blocker) == "RUNNING", 300, f"the blocker to run:\n{_queue()}")
    job_a = _sbatch(f"--account={a}", *whole, "--wrap", "sleep 5")
    job_b = _sbatch(f"--account={b}", *whole, "--wrap", "sleep 5")
    jobs += [job_a, job_b]
    prio = _sh("sprio", "-l", "-j", f"{job_a},{job_b}")
    print(f"both pending behind the blocker:\n{prio}")
    rows = {r.split()[0]: r.split() for r in _sh("sprio", "-h", "-j", f"{job_a},{job_b}", "-o", "%i %Y %F")
            .splitlines()}
    assert int(rows[job_b][2]) > int(rows[job_a][2]), f"B's fair-share factor is not above A's:\n{prio}\n{table}"
    subprocess.run(["scancel", blocker], check=True)
    started = _wait(lambda: [j for j in (job_a, job_b) if _state(j) in ("RUNNING", "COMPLETING", "COMPLETED")],
                    300, f"one of A's and B's jobs to start:\n{_queue()}", poll=0.5)
    print(f"first to start: {'B' if started == [job_b] else 'A'}\n{_queue()}")
    assert started == [job_b], f"A's job {job_a} started before (or with) B's {job_b}:\n{_queue()}\n{table}"
    assert _state(job_a) == "PENDING"


# --- backfill -----------------------------------------------------------------------------------

def _expected_start(job: str) -> datetime | None:
    out = _sh("squeue", "-h", "--start", "-j", job, "-o", "%S", check=False).strip()
    try:
        return datetime.fromisoformat(out)
    except ValueError:  # N/A: the backfill scheduler has not planned it yet
        return None


def _minutes(limit: str) -> float:
    """Slurm's [D-]HH:MM:SS / MM:SS time limit in minutes."""
    days, _, hms = limit.rpartition("-")
    parts = [int(x) for x in hms.split(":")]
    while len(parts) < 3:
        parts.insert(0, 0)
    return int(days or 0) * 1440 + parts[0] * 60 + parts[1] + parts[2] / 60


def test_backfill_starts_a_time_min_job_in_the_gap_without_delaying_the_large_job(stdlib_data, tmp_path, jobs):
    """One node busy for 4 more minutes; a 2-node job waits for it. A xirang-train job asking for 10
    minutes with cluster.min_time_min=2 (sbatch --time-min) starts at once on the idle node, its limit
    cut to the gap, and the large job's expected start (``squeue --start``) does not move."""
    _idle_cluster()
    cpus = _cpus_per_node()
    blocker = _sbatch("-p", "low", "-N1", f"-n{cpus}", "--time=4", "--wrap", "sleep 600")
    jobs.append(blocker)
    _wait(lambda: _state(blocker) == "RUNNING", 300, f"the blocker to run:\n{_queue()}")
    large = _sbatch("-p", "low", "-N2", f"--ntasks-per-node={cpus}", "--time=2", "--wrap", "sleep 5")
    jobs.append(large)
    before = _wait(lambda: _expected_start(large), 300, f"backfill to plan the large job:\n{_queue()}")
    shown_before = _sh("squeue", "--start", "-j", large)
    job, run = _submit([*_base(stdlib_data, tmp_path / "runs"), "cluster.partition=low", "cluster.nodes=1",
                        "cluster.tasks_per_node=2", "cluster.time_min=10", "cluster.min_time_min=2",
                        "cluster.signal_delay_s=30",
                        "train.max_steps=100000", "checkpoint.every_steps=100000"])
    jobs.append(job)
    assert _field(job, "TimeMin") == "00:02:00", _sh("scontrol", "show", "job", job)
    _wait(lambda: _state(job) == "RUNNING", 300, f"backfill to start the small job:\n{_queue()}")
    started = datetime.fromisoformat(_field(job, "StartTime"))
    after = _expected_start(large)
    print(f"\nbefore the small job:\n{shown_before}\nafter it started at {started:%H:%M:%S} "
          f"(TimeLimit {_field(job, 'TimeLimit')}, asked 10 min, --time-min 2):\n{_sh('squeue', '--start')}\n"
          f"{_queue()}")
    assert _state(large) == "PENDING" and _state(blocker) == "RUNNING", _queue()
    assert after is not None and after <= before, f"the large job's start moved from {before} to {after}"
    # Backfill cut the limit to what fits before the large job starts: >= --time-min, < what was asked.
    limit = _minutes(_field(job, "TimeLimit"))
    assert 2 <= limit < 10 and started.timestamp() + 60 * limit <= before.timestamp() + 60, (limit, started, before)
