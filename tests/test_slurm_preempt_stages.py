"""Preemption at any moment of a job on the real (proctrack/cgroup) testbed, one stage per test.

Each stage is hit deterministically: a test point (``xirang_hpc.runtime.testpoint``, set through
``XIRANG_TESTPOINT`` in the submitting environment, which sbatch exports to the job) pauses the
ranks there and marks the arrival in a file; the test then submits a `high` job that preempts the
`low` one. Whoever requeues (the job's own handler, the supervisor, submitit, or Slurm itself once
the grace time is over) the job is requeued, ``events.jsonl`` holds the stop and the requeue with
the preemption's evidence (Slurm's ``PreemptTime``, or accounting's ``PREEMPTED`` state), and the
run finishes with the weights of an uninterrupted run, bitwise.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import numpy as np
import pytest
from test_slurm_e2e import TRAIN, _base, _ev, _final, _preempt, _submit, _wait, _weights, slurm  # noqa: F401

from xirang_hpc.monitor.events import read_events

pytestmark = [pytest.mark.slurm, pytest.mark.usefixtures("slurm")]
STEPS = 40
# 1 node x 2 ranks (dp2), one intra-op thread per rank on Slurm and in the reference alike.
LAYOUT = ["cluster.nodes=1", "cluster.tasks_per_node=2", "cluster.threads_per_rank=1", f"train.max_steps={STEPS}",
          "checkpoint.every_steps=10"]


@pytest.fixture(scope="module")
def reference(stdlib_data, tmp_path_factory) -> Path:
    """The uninterrupted run: the same layout on the local executor."""
    root = tmp_path_factory.mktemp("ref")
    args = [a for a in _base(stdlib_data, root) if not a.startswith("cluster=")]
    out = subprocess.run([*TRAIN, *args, "cluster=local", *LAYOUT, "train.wait=true"], capture_output=True,
                         text=True, timeout=900)
    assert out.returncode == 0, out.stdout + out.stderr
    return Path(re.search(r"run dir (\S+)", out.stdout).group(1))


def _submit_paused(stdlib_data: Path, tmp_path: Path, point: str, *extra: str) -> tuple[str, Path, Path]:
    """Submit the `low` job with the test point ``point`` (and the overrides ``extra``); returns (job id, run dir,
    marker dir)."""
    marks = tmp_path / "marks"
    marks.mkdir()
    env = {"XIRANG_TESTPOINT": point, "XIRANG_TESTPOINT_DIR": str(marks)}
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        job, run = _submit([*_base(stdlib_data, tmp_path / "runs"), *LAYOUT, "train.priority=exploratory", *extra])
    finally:
        for k, v in old.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
    return job, run, marks


def _arrived(marks: Path, stage: str) -> list[Path]:
    return sorted(marks.glob(f"{stage}.*"))


def _job(job: str) -> str:
    return subprocess.run(["scontrol", "show", "job", "-o", job], capture_output=True, text=True).stdout


def _start_when_requeued(job: str, restarts: int) -> None:
    """A requeue nobody in the job followed with ``StartTime`` (Slurm's own, submitit's) leaves the job in
    BeginTime for ~2 min; start it now, as a sysadmin may. A job already running again is left alone."""
    def settled() -> str | None:
        s = _job(job)
        m = re.search(r"Restarts=(\d+)", s)
        ready = "Reason=BeginTime" in s or "JobState=RUNNING" in s or "JobState=COMPLETED" in s
        return s if m and int(m.group(1)) >= restarts and ready else None

    info = _wait(settled, 600, f"job {job} requeued {restarts} time(s)")
    if "Reason=BeginTime" in info:
        subprocess.run(["scontrol", "update", f"JobId={job}", "StartTime=now"], capture_output=True, check=False)


def _assert_preempted_and_requeued(run: Path, restart: int) -> None:
    """events.jsonl has the stop (with Slurm's evidence of a preemption) and the requeue of ``restart``."""
    stops, requeues = _ev(run, "stop", restart), _ev(run, "requeue", restart)
    assert stops and requeues, read_events(run)
    evidence = [s.get("detail", "") for s in stops] + [f"sacct State={r.get('slurm_state')}" for r in requeues]
    assert any(d.startswith("PreemptTime=") or d == "sacct State=PREEMPTED" for d in evidence), read_events(run)
    assert {r["reason"] for r in requeues} == {"preemption"}, requeues
    assert not _ev(run, "failure", restart), read_events(run)  # a preemption, never blamed on a node


def _assert_bitwise(run: Path, ref: Path) -> None:
    a, b = _weights(run, STEPS), _weights(ref, STEPS)
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and np.array_equal(a[k], b[k]), f"{k} differs from the uninterrupted run"


def test_preempted_during_rendezvous(reference, stdlib_data, tmp_path):
    """Rank 1 holds back its check-in (rank 0 waits in the rendezvous) when the preemption comes."""
    job, run, marks = _submit_paused(stdlib_data, tmp_path, "rendezvous@0=120")
    _wait(lambda: _arrived(marks, "rendezvous@0"), 600, "the ranks to reach the rendezvous")
    _preempt("-N2", "--ntasks-per-node=8")
    _start_when_requeued(job, 1)
    final = _final(run, timeout=900)
    assert final["status"] == "completed", read_events(run)
    assert not _ev(run, "first_step", 0), "preempted too late: training had started"
    _assert_preempted_and_requeued(run, 0)
    assert _ev(run, "start", 1)[0]["step"] == 0
    _assert_bitwise(run, reference)


def test_preempted_during_the_checkpoint_load_of_a_restart(reference, stdlib_data, tmp_path):
    """Preempted once while training (the job saves and requeues itself), then again while the restart
    reads that checkpoint; the third start loads it and finishes. The first start pauses 1 s after each step: its
    40 steps take about half a second on a quiet machine, less than a loaded one may need to preempt it (it
    would then finish instead of being preempted)."""
    job, run, marks = _submit_paused(stdlib_data, tmp_path, "step@0=1,load@1=120")
    _wait(lambda: [e for e in _ev(run, "checkpoint") if e["step"] >= 10], 600, "a committed checkpoint")
    _preempt("-N2", "--ntasks-per-node=8")
    _wait(lambda: _ev(run, "requeue", 0), 600, "the first requeue")
    _wait(lambda: _arrived(marks, "load@1"), 600, "the restart to be loading its checkpoint")
    assert not _ev(run, "first_step", 1)
    _preempt("-N2", "--ntasks-per-node=8")
    _start_when_requeued(job, 2)
    final = _final(run, timeout=900)
    assert final["status"] == "completed", read_events(run)
    _assert_preempted_and_requeued(run, 0)
    _assert_preempted_and_requeued(run, 1)
    assert not _ev(run, "first_step", 1), "the load finished before the preemption: the stage was missed"
    saved = _ev(run, "stop", 0)[0]["saved_step"]
    assert _ev(run, "start", 2)[0]["step"] == saved, read_events(run)
    _assert_bitwise(run, reference)


def test_preempted_during_an_async_save(reference, stdlib_data, tmp_path):
    """The second periodic save (step 20) is written but not committed when the preemption comes; the
    stop handler's save waits for it until Slurm kills the job after the grace time. The half-done step is never
    used: the rerun removes it and resumes from step 10. A save that does not move for 10 s (the test point holds
    it without a tick) is a hang to the monitor once step times are known (``monitor.hang_k``): here it is bounded
    by ``monitor.hang_s`` (300 s) instead, so the preemption, not the monitor's abort, ends the job however
    slowly the machine brings the preemption (on a loaded one the abort came first)."""
    job, run, marks = _submit_paused(stdlib_data, tmp_path, "save@0#2=150", "monitor.hang_k=0")
    _wait(lambda: _arrived(marks, "save@0"), 600, "the second save to be in flight")
    ckpts = run / "checkpoints"
    assert any(p.name.startswith("step_20.tmp-") for p in ckpts.iterdir()), sorted(ckpts.iterdir())
    _preempt("-N2", "--ntasks-per-node=8")
    _start_when_requeued(job, 1)
    _wait(lambda: _ev(run, "start", 1), 600, "the rerun to start")
    # Never committed: no step_20 existed when the rerun looked, and its temporary files are gone.
    assert _ev(run, "start", 1)[0]["step"] == 10, read_events(run)
    assert not [e for e in _ev(run, "checkpoint", 0) if e["step"] == 20]
    final = _final(run, timeout=900)
    assert final["status"] == "completed", read_events(run)
    _assert_preempted_and_requeued(run, 0)
    assert not any(".tmp-" in p.name for p in ckpts.iterdir()), sorted(ckpts.iterdir())
    _assert_bitwise(run, reference)
