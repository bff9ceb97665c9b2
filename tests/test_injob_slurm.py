"""In-job restart on a real Slurm cluster (``tools/slurm-testbed``: 2 nodes on this machine).

Each fault is real: ``kill -9`` of a rank, ``SIGSTOP`` of a rank, a node lost (its slurmd, its
slurmstepd and its ranks killed with SIGKILL). The job must recover inside its allocation -- same
job id, ``Restarts=0`` in Slurm, no requeue event -- and finish:

- on a spare node (``cluster.spare_nodes=1``) with bitwise the weights of an uninterrupted run;
- without a spare, on the remaining node with the layout shrunk (dp 4 -> 2, twice the gradient
  accumulation), the loss within rtol 1e-4 of the uninterrupted run at every step. The shrunk layout
  sums the gradients in another order, and the difference grows with every step trained after the
  restart, so with how many that is (where the fault lands): 1.6e-5 seen 60 steps on. A restore from a
  wrong step or with a wrong layout is off by 1e-3 or more.

The uninterrupted reference runs meanwhile on the local executor with the same layout and threads.
The jobs pause 0.2 s after each step (``test_slurm_e2e.PACED``: a fault injected after the first checkpoint
meets a run with steps left on a fast machine, in 40 steps instead of 80); the reference does not pause.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import psutil
import pytest
from test_slurm_e2e import (
    PACED,
    TRAIN,
    _ev,
    _final,
    _nodes,
    _submit,
    _wait,
    _weights,
    slurm,  # noqa: F401 - the testbed fixture, used through pytestmark
)

from xirang_hpc.checkpoint.naming import memory_root
from xirang_hpc.monitor.events import read_events
from xirang_hpc.runtime.markers import rank_pid

# The fixture exports SLURM_CONF of the running testbed (it starts one for root when CI did not).
pytestmark = [pytest.mark.slurm, pytest.mark.usefixtures("slurm")]


def _args(data: Path, runs: Path, *extra: str) -> list[str]:
    return ["cluster=testbed", "requeue=testbed", f"data.out_dir={data}", f"train.runs_root={runs}",
            "train.warmup_steps=2", "train.log_every=1", "train.eval_batches=2", "monitor.enabled=true",
            "parallel.pp=1", "parallel.tp=1", "cluster.threads_per_rank=1", "requeue.max_restarts_in_job=2", *extra]


def _reference(args: list[str], runs: Path) -> subprocess.Popen:
    """The same training, uninterrupted, on the local executor (virtual nodes, same layout)."""
    keep = [a for a in args if not a.startswith(("cluster=", "train.runs_root=", "requeue.max_restarts_in_job",
                                                 "cluster.spare_nodes"))]
    return subprocess.Popen([*TRAIN, *keep, "cluster=local", f"train.runs_root={runs}", "train.wait=true"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _reference_dir(proc: subprocess.Popen) -> Path:
    out = proc.communicate(timeout=600)[0]
    assert proc.returncode == 0, out
    return Path(re.search(r"run dir (\S+)", out).group(1))


def _losses(run_dir: Path) -> dict[int, float]:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    return {int(r["step"]): float(r["loss"]) for r in rows if "loss" in r and "step" in r}


def _after_checkpoint(run: Path, step: int = 10) -> None:
    latest = run / "checkpoints" / "latest"
    _wait(lambda: latest.exists() and int(latest.read_text().split("_")[-1]) >= step, 300, f"checkpoint {step}")


def _slurm_job(job: str) -> str:
    return subprocess.run(["scontrol", "show", "job", "-o", job], capture_output=True, text=True).stdout


def _recovered_inside(job: str, run: Path) -> list[dict]:
    """The job completed in its first allocation: no requeue, Slurm's restart count 0; the restarts."""
    final = _final(run, timeout=600)
    assert final["status"] == "completed", read_events(run)
    assert not _ev(run, "requeue") and not _ev(run, "failure"), read_events(run)
    assert all(e["job"] == job for e in _ev(run, "start"))
    assert "Restarts=0" in _slurm_job(job)
    return _ev(run, "restart")

def _lose_node_and_go_on_shrunk(job: str, run: Path, first: str, second: str) -> tuple[dict, dict]:
    """Lose ``second``; the job recovers inside its allocation on ``first`` alone (2 ranks): the restart
    and the new start events."""
    try:
        _lose_node(run, second)
        (restart,) = _recovered_inside(job, run)
    finally:
        _revive_node(second)
    assert restart["node"] == second and restart["nodes"] == [first] and restart["shrunk"], restart
    start = _ev(run, "start")[-1]
    assert (start["node"], start["nodes"], start["world_size"]) == (first, 1, 2), start
    return restart, start


def _same_losses_after(run: Path, ref: subprocess.Popen, resumed: int, steps: int) -> None:
    """Every step after ``resumed`` up to ``steps`` has the uninterrupted reference's loss (rtol 1e-4: see the
    module docstring)."""
    ours, theirs = _losses(run), _losses(_reference_dir(ref))
    after = [s for s in ours if s > resumed]
    assert after and after[-1] == steps, sorted(ours)
    np.testing.assert_allclose([ours[s] for s in after], [theirs[s] for s in after], rtol=1e-4)



def test_kill9_recovered_on_the_spare_node_bitwise(stdlib_data, tmp_path):
    """1 node x 2 ranks + 1 spare; kill -9 of rank 1: the ranks restart on the spare, same weights."""
    steps = 40
    args = _args(stdlib_data, tmp_path / "runs", "cluster.nodes=1", "cluster.spare_nodes=1",
                 f"train.max_steps={steps}", "checkpoint.every_steps=10")
    ref = _reference(args, tmp_path / "ref")
    job, run = _submit(args, env=PACED)
    _after_checkpoint(run)
    first = _ev(run, "start")[0]["node"]
    os.kill(_wait(lambda: rank_pid(run, 0, 1), 30, "rank 1's pid"), signal.SIGKILL)
    (restart,) = _recovered_inside(job, run)
    assert restart["node"] == first and restart["reason"].startswith("dead: rank 1") and not restart["shrunk"]
    second = _ev(run, "start")[-1]
    assert second["node"] != first and second["node"] in _nodes() and second["step"] % 10 == 0 < second["step"]
    a, b = _weights(run, steps), _weights(_reference_dir(ref), steps)
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and np.array_equal(a[k], b[k]), f"{k} differs"


def test_hung_rank_recovered_after_the_watchdog_names_it(stdlib_data, tmp_path):
    """SIGSTOP of rank 1 (1 node + 1 spare): the watchdog names the hang, the ranks restart on the spare."""
    args = _args(stdlib_data, tmp_path / "runs", "cluster.nodes=1", "cluster.spare_nodes=1", "train.max_steps=40",
                 "checkpoint.every_steps=10", "monitor.hang_s=8")
    job, run = _submit(args, env=PACED)
    _after_checkpoint(run)
    first = _ev(run, "start")[0]["node"]
    os.kill(_wait(lambda: rank_pid(run, 0, 1), 30, "rank 1's pid"), signal.SIGSTOP)
    (restart,) = _recovered_inside(job, run)
    hang = _ev(run, "hang")[0]
    assert (hang["rank"], hang["node"]) == (1, first) and "stopped" in hang["cause"], hang
    assert restart["node"] == first and restart["reason"].startswith("hang")
    assert _ev(run, "start")[-1]["node"] != first


def _lose_node(run: Path, node: str) -> None:
    """The node is gone: its slurmd, the job's slurmstepd on it and its ranks, all SIGKILLed at once."""
    ranks = [int(p.read_text().split()[1]) for p in (run / "ranks" / "r0").glob("*.start")
             if p.read_text().split()[0] == node]
    assert ranks, f"no rank on {node}"
    stepds = {psutil.Process(pid).ppid() for pid in ranks}
    assert all("slurmstepd" in psutil.Process(p).name() for p in stepds), stepds
    slurmd = int((Path(os.environ["SLURM_CONF"]).parent / "run" / f"slurmd-{node}.pid").read_text())
    for pid in (slurmd, *stepds, *ranks):
        os.kill(pid, signal.SIGKILL)


def _revive_node(node: str) -> None:
    subprocess.run(["slurmd", "-N", node, "-f", os.environ["SLURM_CONF"]], check=True)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        subprocess.run(["scontrol", "update", f"nodename={node}", "state=resume"], capture_output=True)
        state = subprocess.run(["sinfo", "-h", "-n", node, "-o", "%t"], capture_output=True, text=True).stdout
        if state.strip() in ("idle", "mix", "alloc"):
            return
        time.sleep(2)


def test_node_loss_continues_shrunk_with_the_same_loss_curve(stdlib_data, tmp_path):
    """2 nodes x 2 ranks, the second node lost: the job goes on on the first alone (dp 2, grad_accum 2), same losses."""
    first, second = _nodes()[:2]
    steps = 40
    args = _args(stdlib_data, tmp_path / "runs", f"train.max_steps={steps}", "checkpoint.every_steps=10")
    ref = _reference(args, tmp_path / "ref")
    job, run = _submit(args, env=PACED)
    _after_checkpoint(run)
    restart, start = _lose_node_and_go_on_shrunk(job, run, first, second)
    _same_losses_after(run, ref, start["step"], steps)


def test_requeued_job_with_a_drained_node_continues_shrunk(stdlib_data, tmp_path):
    """2 x 2 with requeue.min_nodes=1, preempted; the second node drained meanwhile. A requeued job keeps its
    first task count (NumTasks=4 pins it to 2 nodes: it would pend on ReqNodeNotAvail forever), so the job
    itself sets NumTasks=2 at its requeue: the rerun starts on the first node alone, with the layout shrunk,
    and the loss curve goes on as the uninterrupted run's."""
    first, second = _nodes()[:2]
    steps = 40
    common = _args(stdlib_data, tmp_path / "runs", f"train.max_steps={steps}", "checkpoint.every_steps=10")
    ref = _reference(common, tmp_path / "ref")
    job, run = _submit([*common, "requeue.min_nodes=1", "train.priority=exploratory"], env=PACED)
    assert "#SBATCH --nodes=1-2" in (run / "submitit" / f"{job}_submission.sh").read_text()
    _after_checkpoint(run)
    # A `high` job needing both nodes preempts ours; the second node is drained while it runs.
    high = subprocess.run(["sbatch", "--parsable", "-p", "high", "-N2", "--ntasks-per-node=8", "-o", "/dev/null",
                           "--wrap", "sleep 20"], check=True, capture_output=True, text=True).stdout.strip()
    try:
        _wait(lambda: _ev(run, "requeue", 0), 300, "the preemption's requeue")
        # Drain only once the preemptor holds both nodes (draining earlier would keep it pending forever).
        _wait(lambda: "JobState=RUNNING" in _slurm_job(high), 300, "the preempting job to run")
        subprocess.run(["scontrol", "update", f"nodename={second}", "state=drain", "reason=in-job-restart-test"],
                       check=True)
        final = _final(run, timeout=600)
        info = _slurm_job(job)
    finally:
        subprocess.run(["scontrol", "update", f"nodename={second}", "state=resume"], capture_output=True)
    assert final["status"] == "completed", read_events(run)
    assert _ev(run, "requeue", 0)[0]["num_tasks"] == 2, read_events(run)
    rerun = _ev(run, "start", 1)[0]
    assert (rerun["node"], rerun["nodes"], rerun["world_size"]) == (first, 1, 2), rerun
    assert "NumNodes=1 " in info and "Restarts=1" in info, info
    ours, theirs = _losses(run), _losses(_reference_dir(ref))
    after = [s for s in ours if s > rerun["step"]]
    assert rerun["step"] >= 10 and after and after[-1] == steps, (rerun, sorted(ours))
    np.testing.assert_allclose([ours[s] for s in after], [theirs[s] for s in after], rtol=1e-4)



def test_node_loss_restarts_from_the_newest_memory_copy(stdlib_data, tmp_path):
    """checkpoint.in_memory with a memory copy every step: after the second node is lost the survivor
    reloads the newest step from its node's memory (its own shards + the replicas of the lost node's),
    newer than the filesystem checkpoint; the job finishes shrunk with the reference's losses and weights."""
    first, second = _nodes()[:2]
    steps = 40
    args = _args(stdlib_data, tmp_path / "runs", f"train.max_steps={steps}", "checkpoint.every_steps=10",
                 "checkpoint.in_memory=true", "checkpoint.memory_every_steps=1")
    ref = _reference(args, tmp_path / "ref")
    job, run = _submit(args, env=PACED)
    _after_checkpoint(run)
    _wait(lambda: _losses(run) and max(_losses(run)) >= 15, 300, "step 15")
    reached = max(_losses(run))
    restart, start = _lose_node_and_go_on_shrunk(job, run, first, second)
    (restore,) = [e for e in _ev(run, "restore") if e["time"] > restart["time"]]
    assert restore["source"] == "memory" and restore["step"] == start["step"], restore
    # At least the newest memory copy recorded before the loss (a copy completes on every node, then rank 0
    # records it: a copy may complete and the loss come before its record), newer than the disk checkpoint;
    # steps lost are only those whose copy was still in flight. The losses after it match the reference.
    kept = [e["step"] for e in _ev(run, "memory_checkpoint") if e["time"] < restart["time"]]
    assert max(kept) <= start["step"] and start["step"] % 10, (start, kept, reached)
    assert restore["received_bytes"] == 0 < restore["local_bytes"]  # the survivor held the replicas itself
    _same_losses_after(run, ref, start["step"], steps)
    # The final model within rtol 1e-5 of the reference, as a whole (the shrunk layout sums gradients in
    # another order; near-zero entries driven by Adam's normalised noise differ elementwise by ~1e-6).
    a, b = _full_state(run, steps), _full_state(_reference_dir(ref), steps)  # 2 vs 4 ranks' files: full tensors
    names = sorted(k for k in b if k.startswith("model."))
    assert names and names == sorted(k for k in a if k.startswith("model."))
    va, vb = (np.concatenate([t[k].double().numpy().ravel() for k in names]) for t in (a, b))
    assert np.linalg.norm(va - vb) <= 1e-5 * np.linalg.norm(vb), np.linalg.norm(va - vb) / np.linalg.norm(vb)
    root = memory_root(job, run)
    queued = lambda: subprocess.run(["squeue", "-h", "-o", "%i"], capture_output=True, text=True).stdout.split()  # noqa: E731
    _wait(lambda: job not in queued(), 120, "the job to end")
    assert not root.exists(), sorted(root.rglob("*"))  # removed at job end, the lost node's copy too


def _full_state(run_dir: Path, step: int) -> dict:
    import torch
    import torch.distributed.checkpoint as dcp

    from xirang_hpc.checkpoint.storage import HDF5StorageReader, read_metadata

    d = run_dir / "checkpoints" / f"step_{step}"
    md = read_metadata(d)
    sd = {k: torch.empty(tuple(m.size), dtype=m.properties.dtype) for k, m in md.state_dict_metadata.items()}
    dcp.load(sd, storage_reader=HDF5StorageReader(d), no_dist=True)
    return sd


def test_cancelled_job_leaves_no_memory_copy(stdlib_data, tmp_path):
    """scancel ends the batch script before it frees the job's memory copies itself: the cluster's epilog
    (tools/slurm-epilog, configured by the testbed as a sysadmin would) removes them on every node."""
    args = _args(stdlib_data, tmp_path / "runs", "train.max_steps=5000", "checkpoint.every_steps=1000",
                 "checkpoint.in_memory=true", "checkpoint.memory_every_steps=1")
    job, run = _submit(args)
    root = memory_root(job, run)
    try:
        _wait(lambda: _ev(run, "memory_checkpoint"), 300, "a memory copy")
        assert list(root.glob("*/step_*")), sorted(root.rglob("*"))  # the copies outlive processes on purpose
    finally:
        subprocess.run(["scancel", job], check=True)
    _wait(lambda: "JobState=CANCELLED" in _slurm_job(job), 120, "the cancellation")
    _wait(lambda: not root.exists(), 120, "the epilog's cleanup")


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))


def _driver(run: Path) -> psutil.Process | None:
    """The batch step's in-job driver of ``run`` (not its guard)."""
    for p in psutil.process_iter(["cmdline"]):
        cmd = " ".join(p.info["cmdline"] or [])
        if "xirang_hpc.batch.injob" in cmd and str(run) in cmd and "--guard" not in cmd:
            return p
    return None


def test_driver_killed_the_ranks_save_and_the_policy_requeues(stdlib_data, tmp_path):
    """kill -9 of the in-job driver: the batch script's guard names it, the ranks save at once and the policy
    (requeue on an infrastructure failure) requeues the run, which resumes where it stopped and completes;
    nobody calls it a cancel or blames a node."""
    args = _args(stdlib_data, tmp_path / "runs", "cluster.nodes=1", "train.max_steps=40", "checkpoint.every_steps=10")
    job, run = _submit(args, env=PACED)
    _after_checkpoint(run)
    _wait(lambda: _driver(run), 30, "the in-job driver").kill()
    final = _final(run, timeout=600)
    assert final["status"] == "completed", read_events(run)
    (died,) = _ev(run, "supervisor_died", 0)
    assert "killed by SIGKILL" in died["reason"], died
    (stop,) = _ev(run, "stop", 0)
    assert stop["reason"] == "infra_failure" and stop["saved_step"] == stop["step"] > 0, stop
    (req,) = _ev(run, "requeue", 0)
    assert req["reason"] == "infra_failure", req
    assert not _ev(run, "failure") and not [e for e in _ev(run, "exit") if e.get("status") == "stopped_terminated"]
    assert _ev(run, "start", 1)[0]["step"] == stop["saved_step"]


def _slurmctld_pidfile() -> Path:
    conf = Path(os.environ["SLURM_CONF"])
    name = re.search(r"^ClusterName=(\S+)", conf.read_text(), re.M).group(1)
    return conf.parent / "run" / f"slurmctld-{name}.pid"


def test_a_rank_death_while_slurmctld_is_down_is_survived(stdlib_data, tmp_path):
    """slurmctld stopped, then rank 1 killed: the driver's new step cannot be launched ("Unable to confirm
    allocation"), so it is launched again with backoff, named as a controller outage in the events and in
    xirang-status; a second launch of the run refuses (it cannot tell whether the job is live); once slurmctld is
    back the step starts on the spare node and the run completes inside its allocation."""
    args = _args(stdlib_data, tmp_path / "runs", "cluster.nodes=1", "cluster.spare_nodes=1", "train.max_steps=40",
                 "checkpoint.every_steps=10")
    job, run = _submit(args, env=PACED)
    _after_checkpoint(run)
    pidfile = _slurmctld_pidfile()
    ctld = psutil.Process(int(pidfile.read_text()))
    victim = _wait(lambda: rank_pid(run, 0, 1), 30, "rank 1's pid")
    ctld.terminate()
    ctld.wait(60)
    try:
        os.kill(victim, signal.SIGKILL)
        failed = _wait(lambda: _ev(run, "step_launch_failed"), 180, "a failed step launch")
        assert failed[0]["controller_down"] and failed[0]["reason"] == "slurmctld does not answer", failed
        status = subprocess.run([str(Path(sys.executable).parent / "xirang-status"), str(run)], capture_output=True,
                                text=True, timeout=120)
        assert "slurmctld does not answer since" in status.stdout, status.stdout + status.stderr
        again = subprocess.run(TRAIN + args, capture_output=True, text=True, timeout=300)
        assert again.returncode == 2 and "Traceback" not in again.stderr, again.stdout + again.stderr
        assert f"cannot tell whether job {job}" in again.stderr and "does not answer" in again.stderr, again.stderr
    finally:
        subprocess.run(["slurmctld", "-f", os.environ["SLURM_CONF"]], check=True)
    (restart,) = _recovered_inside(job, run)
    assert restart["reason"].startswith("dead: rank 1"), restart
    assert _ev(run, "start")[-1]["node"] != _ev(run, "start")[0]["node"]


@pytest.mark.parametrize("in_job", [True, False], ids=["in-job-restart", "single-srun"])
def test_out_of_memory_is_named_with_the_limit_and_no_node_is_blamed(stdlib_data, tmp_path, in_job):
    """cluster.mem_gb too small for the ranks (the testbed's cgroups enforce --mem): the run stops as ``oom``,
    naming the limit and the ways to fit, with no node excluded and no requeue (the same layout would run out
    of memory again on any node) -- with the in-job driver and with a plain srun step."""
    mem = 0.35 if in_job else 0.2  # two ranks of the tiny model need ~0.7 GB, one ~0.35 GB
    args = _args(stdlib_data, tmp_path / "runs", "cluster.nodes=1", "train.max_steps=40", f"cluster.mem_gb={mem}",
                 # One rank for the plain srun step: a rank that outlives the store host (rank 0 killed before the
                 # rendezvous) waits for torch's TCPStore client to give up, ten minutes, before srun ends.
                 *([] if in_job else ["requeue.max_restarts_in_job=0", "cluster.tasks_per_node=1"]))
    job, run = _submit(args)
    final = _final(run, timeout=600)
    assert final["status"] == "stopped_oom", read_events(run)
    assert re.search(r"out of memory on [a-z]+\d", final["why"]) and f"cluster.mem_gb={mem} GB" in final["why"], final
    (failure,) = _ev(run, "failure")
    assert failure["reason"] == "oom", failure
    assert not _ev(run, "requeue") and not _ev(run, "restart")
    exc = _slurm_job(job)
    assert "ExcNodeList=(null)" in exc, exc



def test_batch_script_killed_the_ranks_tell_it_from_a_cancel(stdlib_data, tmp_path):
    """kill -9 of the batch script itself (nothing of it runs any more): Slurm ends the job under the ranks with
    SIGTERM; they tell that from scancel (the job reads COMPLETING with the script killed by a signal, ExitCode
    0:9; a cancel leaves the script alive: it ignores SIGTERM), save, and the policy requeues the run as an
    infrastructure failure; it resumes where it stopped and completes (test_cancelled_job_leaves_no_memory_copy
    checks that a cancel is still a cancel).

    Slurm's own race is taken out: srun forks a shepherd that SIGKILLs the step when srun dies first, and the batch
    step's cleanup SIGKILLs srun and its shepherd one after the other; on a loaded node the shepherd can act in
    between, and the ranks die before any SIGTERM (seen in CI: nothing saved after the last checkpoint, no
    requeue). The test holds the shepherd stopped (a stopped process dies of SIGKILL without running), so the
    ranks meet what they meet when the cleanup wins, the case this test is about."""
    args = _args(stdlib_data, tmp_path / "runs", "cluster.nodes=1", "train.max_steps=40", "checkpoint.every_steps=10")
    job, run = _submit(args, env=PACED)
    _after_checkpoint(run)
    # slurmd runs the script from its spool dir as job%05d/slurm_script.
    spooled = re.compile(rf"\bjob0*{job}/slurm_script\b")
    script = _wait(lambda: next((p for p in psutil.process_iter(["cmdline"])
                                 if spooled.search(" ".join(p.info["cmdline"] or []))), None),
                   30, "the batch script")

    def shepherds() -> list[psutil.Process]:  # srun's child that is srun too (the step's srun: a child of the driver)
        try:
            sruns = [p for p in script.children(recursive=True) if p.name() == "srun"]
            return [p for p in sruns if p.ppid() in {q.pid for q in sruns}]
        except psutil.NoSuchProcess:  # a process of the tree went away while it was read: look again
            return []

    held = _wait(shepherds, 30, "the step's srun and its shepherd")
    for p in held:
        p.suspend()
    script.kill()
    final = _final(run, timeout=600)
    assert final["status"] == "completed", read_events(run)
    (stop,) = _ev(run, "stop", 0)
    assert stop["reason"] == "infra_failure" and "the batch step is gone" in stop["detail"], stop
    assert stop["saved_step"] == stop["step"] > 0 and _ev(run, "start", 1)[0]["step"] == stop["saved_step"]
    (req,) = _ev(run, "requeue", 0)
    assert req["reason"] == "infra_failure", req


# Ranks in a container, through a fake ``apptainer`` on the job's PATH that records its arguments (with the
# job step and task) and runs the command after the image: no container runtime can be installed here.
FAKE = """#!/bin/sh
# A stand-in for apptainer: record, drop its own options and the image, run the command.
echo "job=$SLURM_JOB_ID step=$SLURM_STEP_ID task=$SLURM_PROCID host=$(hostname) args=$*" >> {log}
[ "$1" = exec ] && shift
while [ $# -gt 0 ]; do
  case "$1" in --nv) shift ;; --bind|--pwd) shift 2 ;; *) break ;; esac
done
shift
exec "$@"
"""


def test_every_rank_start_and_restart_goes_through_the_container_runtime(stdlib_data, tmp_path):
    bin_dir, log = tmp_path / "bin", tmp_path / "apptainer.log"
    bin_dir.mkdir()
    fake = bin_dir / "apptainer"
    fake.write_text(FAKE.format(log=log))
    fake.chmod(0o755)
    image = tmp_path / "train.sif"
    image.write_bytes(b"not a real image")
    args = _args(stdlib_data, tmp_path / "runs", "cluster.nodes=1", "cluster.spare_nodes=1", "train.max_steps=30",
                 "checkpoint.every_steps=10", f"cluster.container.image={image}", "cluster.container.runtime=apptainer",
                 "cluster.container.nv=false")
    job, run = _submit(args, env={**PACED, "PATH": f"{bin_dir}:{os.environ['PATH']}"})
    _after_checkpoint(run)
    os.kill(_wait(lambda: rank_pid(run, 0, 1), 30, "rank 1's pid"), signal.SIGKILL)
    (restart,) = _recovered_inside(job, run)
    lines = log.read_text().splitlines()
    steps = sorted({line.split()[1] for line in lines})
    assert len(steps) == 2, lines  # the first step and the restart's step, nothing else
    for step in steps:  # 2 ranks each, both wrapped, with the image, the mounts and the working directory
        mine = [line for line in lines if line.split()[1] == step]
        assert sorted(line.split()[2] for line in mine) == ["task=0", "task=1"], lines
        assert all(f"--bind {run.parent}:{run.parent}," in line and str(image) in line and "--nv" not in line
                   and f"{stdlib_data}:{stdlib_data}" in line and "submitit.core._submit" in line for line in mine)
    assert not [line for line in lines if "xirang_hpc.batch" in line or "xirang_hpc.launch" in line], \
        "host-side processes went in the container"
    assert restart["reason"].startswith("dead: rank 1")
