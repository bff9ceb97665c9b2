"""End-to-end on a real Slurm cluster (``tools/slurm-testbed``: slurmctld + 2 slurmd on this machine).

CI (``.ci/run``) starts the testbeds and exports ``XIRANG_SLURM_CONF`` (and ``XIRANG_SLURM_CONF_B`` for the
files ``conftest.SLURM_FILES_B`` lists, which import this fixture); without it, a root user's
run starts the testbed here (it installs Slurm with apt-get if missing), anyone else skips.
Jobs are submitted with the real ``xirang-train``; preemption is a real ``high`` job; the crash is
a real ``kill -9``. Requeued jobs use the ``requeue=testbed`` policy (``start_now``), so they do
not sit two minutes in BeginTime.
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

import h5py
import numpy as np
import pytest
from conftest import slurm_conf_env, slurm_conf_for, testbed_held

from xirang_hpc.monitor.events import read_events
from xirang_hpc.runtime.markers import rank_pid
from xirang_hpc.slurm import control

pytestmark = pytest.mark.slurm
ROOT = Path(__file__).resolve().parents[1]
TRAIN = [sys.executable, "-c", "from xirang_hpc.cli.train import main; main()"]
# The first start of a job pauses 0.2 s after each step (the ``step`` test point): a run the test kills or stops
# after its first steps or checkpoint still has steps left then on a fast machine, without training many more
# steps than the test needs (restarts do not pause).
PACED = {"XIRANG_TESTPOINT": "step@0=0.2"}
# How often a wait looks at the testbed's progress (see _wait).
PROGRESS_EVERY_S = 5.0


@pytest.fixture(scope="module")
def slurm(request: pytest.FixtureRequest) -> str:
    """SLURM_CONF of the running testbed for this module (``conftest.slurm_conf_for``; started here when CI did
    not and we are root)."""
    conf = slurm_conf_for(request.path)
    if not conf:
        if os.geteuid() != 0:
            pytest.skip("no Slurm testbed: run `tools/slurm-testbed start` as root and export XIRANG_SLURM_CONF")
        out = subprocess.run([str(ROOT / "tools" / "slurm-testbed"), "start"], capture_output=True, text=True)
        assert out.returncode == 0, f"tools/slurm-testbed start failed:\n{out.stderr}"
        conf = out.stdout.strip().splitlines()[-1].split("=", 1)[1]
    with slurm_conf_env(conf):
        yield conf


def _nodes() -> list[str]:
    """The testbed's node names in order (n1 n2 by default; XIRANG_SLURM_NODE_PREFIX changes them)."""
    out = subprocess.run(["sinfo", "-h", "-N", "-o", "%N"], capture_output=True, text=True, check=True).stdout
    names = sorted(set(out.split()), key=lambda n: (len(n), n))
    assert len(names) >= 2, out
    return names


def test_a_second_testbed_on_our_node_names_or_ports_is_refused(slurm, tmp_path):
    """Two testbeds with the same node names share the cgroups ``slurm_<node>`` (stopping one would kill the
    other's jobs); one on our ports could not start. Both are refused before anything starts, naming the
    setting to change, and the running testbed is untouched."""
    node = _nodes()[0]
    port = int(re.search(r"^SlurmctldPort=(\d+)", Path(slurm).read_text(), re.M).group(1))
    env = {**os.environ, "XIRANG_SLURM_DIR": str(tmp_path / "tb"), "XIRANG_SLURM_ACCOUNTING": "0"}
    free = max(1024, port - 5000)  # a range no test testbed uses (node names are checked first anyway)
    cases = [({"XIRANG_SLURM_NODE_PREFIX": node.rstrip("0123456789"), "XIRANG_SLURM_PORT": str(free)},
              rf"node {node} is already served by another testbed.*XIRANG_SLURM_NODE_PREFIX"),
             ({"XIRANG_SLURM_NODE_PREFIX": "zz", "XIRANG_SLURM_PORT": str(port)},
              rf"port {port} .* is already in use; start with another XIRANG_SLURM_PORT")]
    for extra, says in cases:
        out = subprocess.run([str(ROOT / "tools" / "slurm-testbed"), "start"], env={**env, **extra},
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 1 and re.search(says, out.stderr), (extra, out.stderr)
        assert not (tmp_path / "tb").exists()
    # The running testbed's node still answers (its slurmd and cgroup were left alone).
    state = subprocess.run(["sinfo", "-h", "-n", node, "-o", "%T"], capture_output=True, text=True, check=True)
    assert state.stdout.strip() and not state.stdout.strip().startswith(("down", "unknown")), state.stdout


def _qos_preemption() -> bool:
    """The testbed runs with XIRANG_SLURM_PREEMPT=qos: a job's QOS, not its partition, decides preemption."""
    out = subprocess.run(["scontrol", "show", "config"], capture_output=True, text=True, check=True).stdout
    return re.search(r"^PreemptType\s*=\s*preempt/qos", out, re.M) is not None


def _base(data: Path, runs: Path) -> list[str]:
    # The preset for the testbed's preemption mode: exploratory is the `low` partition, or the scavenger QOS.
    cluster = "testbed-qos" if _qos_preemption() else "testbed"
    return [f"cluster={cluster}", "requeue=testbed", f"data.out_dir={data}", f"train.runs_root={runs}",
            "train.warmup_steps=2", "train.log_every=10", "train.eval_batches=2", "monitor.enabled=true",
            "parallel.pp=1", "parallel.tp=1"]


def _submit(args: list[str], env: dict[str, str] | None = None) -> tuple[str, Path]:
    """Submit with ``xirang-train``; ``env`` adds to the submitting environment (sbatch exports it to the job)."""
    out = subprocess.run(TRAIN + args, capture_output=True, text=True, timeout=300,
                         env={**os.environ, **env} if env else None)
    assert out.returncode == 0, out.stdout + out.stderr
    m = re.search(r"submitted Slurm job (\d+) .*\| run dir (\S+)", out.stdout)
    assert m, out.stdout
    return m.group(1), Path(m.group(2))


def _wait(pred, timeout: float, what: str, poll: float = 0.5, progress=None):
    """Poll ``pred`` until it returns something true; ``timeout`` is a safety net against a hang (minutes),
    never a speed requirement: the wait ends as soon as the awaited progress shows. The limit counts from
    the last change of ``progress`` (a function whose value changes while the awaited work advances; by
    default :func:`_activity`, the testbed's queue and the files its jobs write): a loaded machine that
    trains slowly is waited for, a stalled one is not. Six times ``timeout`` in all ends even a wait that
    keeps seeing changes (a job looping on requeues). ``progress`` (squeue, sinfo: processes and slurmctld
    calls) is looked at every ``PROGRESS_EVERY_S`` only: it moves a minutes-long limit, ``pred`` ends the wait."""
    progress = progress or _activity
    start = time.monotonic()
    deadline, last = start + timeout, progress()
    looked = start
    while time.monotonic() < min(deadline, start + 6 * timeout):
        got = pred()
        if got:
            return got
        time.sleep(poll)
        if time.monotonic() - looked >= PROGRESS_EVERY_S:
            looked = time.monotonic()
            if (now := progress()) != last:
                deadline, last = looked + timeout, now
    what = what() if callable(what) else what  # e.g. the events as they are now
    raise AssertionError(f"{timeout:.0f}s without progress waiting for {what}\n{_queue()}")


def _activity() -> tuple:
    """What changes while the testbed works: every job's state, and the sizes of the files its run writes
    (events, metrics, the ranks' logs next to the job's stdout in the run's ``submitit`` folder)."""
    out = subprocess.run(["squeue", "-h", "-O", "JobID:40,State:24,StdOut:1000"], capture_output=True,
                         text=True).stdout
    sizes = []
    for line in out.splitlines():
        parts = line.split()
        if len(parts) < 3:
            continue
        logs = Path(parts[2]).parent
        files = [*logs.glob("*_log.*"), logs.parent / "events.jsonl", logs.parent / "metrics.jsonl"] \
            if logs.is_dir() else []
        sizes += [(p.name, p.stat().st_size) for p in files if p.exists()]
    return out, tuple(sizes)


def _run_progress(run_dir: Path) -> tuple[int, ...]:
    """Sizes of the run's metrics and events files: they grow while it trains, restarts or requeues."""
    return tuple(p.stat().st_size if p.exists() else -1
                 for p in (run_dir / "metrics.jsonl", run_dir / "events.jsonl"))


def _queue() -> str:
    """Every job on the testbed with its state and reason, and the nodes' states: what a wait for a job that
    has not started reports, and what changes while the testbed schedules, starts and ends jobs."""
    q = subprocess.run(["squeue", "-h", "-o", "%i %P %T %C %R"], capture_output=True, text=True).stdout
    n = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %T %C"], capture_output=True, text=True).stdout
    return f"squeue:\n{q}sinfo (alloc/idle/other/total CPUs):\n{n}"


def _ev(run_dir: Path, kind: str, restart: int | None = None) -> list[dict]:
    return [e for e in read_events(run_dir)
            if e.get("kind") == kind and (restart is None or e.get("restart") == restart)]


def _final(run_dir: Path, timeout: float = 600) -> dict:
    def done():
        f = [e for e in _ev(run_dir, "exit") if e.get("final")]
        return f[-1] if f else None
    return _wait(done, timeout, lambda: f"the final exit of {run_dir.name}: {read_events(run_dir)[-3:]}",
                 progress=lambda: _run_progress(run_dir))


def _training(run_dir: Path, restart: int | None = 0) -> list[dict]:
    """Wait for the run's first step (of ``restart``; None: of any), as long as the queue or the run moves."""
    return _wait(lambda: _ev(run_dir, "first_step", restart), 600,
                 lambda: f"restart {restart} of {run_dir.name} to train: {read_events(run_dir)[-3:]}\n{_queue()}",
                 progress=lambda: (_queue(), _run_progress(run_dir)))


def _preempt(*args: str) -> None:
    """A `high` job (partition, or QOS under QOS preemption) that needs CPUs held by exploratory jobs: Slurm
    preempts them."""
    how = ["--qos=high"] if _qos_preemption() else ["-p", "high"]
    out = subprocess.run(["sbatch", "--parsable", *how, "-o", "/dev/null", *args, "--wrap", "sleep 2"],
                         capture_output=True, text=True, check=True)
    assert out.stdout.strip().isdigit(), out


def _datasets(h: h5py.File) -> list[str]:
    names: list[str] = []
    h.visititems(lambda n, o: names.append(n) if isinstance(o, h5py.Dataset) else None)
    return names


def _weights(run_dir: Path, step: int) -> dict[str, np.ndarray]:
    out: dict[str, np.ndarray] = {}
    for f in sorted((run_dir / "checkpoints" / f"step_{step}").glob("rank_*.h5")):
        with h5py.File(f, "r") as h:
            out.update({f"{f.name}/{n}": h[n][()] for n in _datasets(h)})
    assert out, f"no checkpoint at step {step} in {run_dir}"
    return out


def test_preempted_twice_finishes_bitwise_identical(slurm, stdlib_data, tmp_path):
    """2 nodes x 2 ranks, tp=2 x dp=2, preempted twice by `high` jobs: same final weights as no preemption.

    The first two starts pause 1 s after each step (the ``step`` test point), so the preemption, which lands a
    few seconds after the test sees training, meets a run that has steps left on any machine; the final start
    trains the rest at full speed (the uninterrupted reference never pauses)."""
    steps = 30
    common = [*_base(stdlib_data, tmp_path / "runs"), f"train.max_steps={steps}", "checkpoint.every_steps=25",
              "parallel.tp=2"]
    # The uninterrupted reference: the same 2 x 2 layout and threads on the local executor, meanwhile.
    ref_cmd = [*TRAIN, *[a for a in common if not a.startswith(("cluster=", "train.runs_root="))], "cluster=local",
               "cluster.threads_per_rank=1", f"train.runs_root={tmp_path / 'ref'}", "train.wait=true"]
    ref_proc = subprocess.Popen(ref_cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    job, run = _submit([*common, "train.priority=exploratory"],  # `low`: preemptible
                       env={"XIRANG_TESTPOINT": "step@0=1,step@1=1"})
    for restart in (0, 1):
        _training(run, restart)
        # All 8 CPUs of both nodes in `high`: they only fit once the `low` job is preempted.
        _preempt("-N2", "--ntasks-per-node=8")
        _wait(lambda r=restart: _ev(run, "requeue", r), 600, f"requeue {restart + 1}")
    assert _final(run)["status"] == "completed"
    ref_out = ref_proc.communicate(timeout=300)[0]
    assert ref_proc.returncode == 0, ref_out
    ref = Path(re.search(r"run dir (\S+)", ref_out).group(1))
    stops, starts = _ev(run, "stop"), _ev(run, "start")
    assert [s["reason"] for s in stops] == ["preemption", "preemption"]
    assert all(s["signal"] == "SIGUSR2" and s["detail"].startswith("PreemptTime=") for s in stops)
    # Zero steps lost: each rerun resumed at the step where the preempted run stopped and saved.
    assert [s["step"] for s in starts[1:]] == [s["saved_step"] for s in stops] == [s["step"] for s in stops]
    a, b = _weights(run, steps), _weights(ref, steps)
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and np.array_equal(a[k], b[k]), f"{k} differs"


def test_a_job_slurm_requeued_itself_counts_as_requeued(slurm, tmp_path):
    """A preemption's grace time can end while a job still decides whether to requeue (its ranks killed for a
    hang, its batch script choosing): Slurm's PreemptMode=REQUEUE brings the job back by itself and refuses our
    ``scontrol requeue`` ("Job is pending execution"). That job was requeued: no failure, no final status."""
    script = tmp_path / "hold.sh"
    script.write_text("#!/bin/bash\ntrap '' TERM\nsleep 600\n")  # deaf to the preemption's SIGTERM
    low = ["--qos=scavenger"] if _qos_preemption() else ["-p", "low"]
    out = subprocess.run(["sbatch", "--parsable", *low, "--requeue", "-N2", "--ntasks-per-node=8", "-o", "/dev/null",
                          str(script)], capture_output=True, text=True, check=True)
    job = out.stdout.strip().split(";")[0]
    try:
        _wait(lambda: control.job_info(job).get("JobState") == "RUNNING", 300, f"job {job} to run")
        _preempt("-N2", "--ntasks-per-node=8")
        _wait(lambda: int(control.job_info(job).get("Restarts", "0")) >= 1, 300, f"Slurm to requeue job {job}")
        assert control.requeue(job, restarts=0) is False  # refused, but Slurm had requeued it since restart 0
        with pytest.raises(control.SlurmCommandError, match="pending execution"):
            control.requeue(job, restarts=1)  # no requeue since restart 1: the refusal stands
        with pytest.raises(control.SlurmCommandError, match="pending execution"):
            control.requeue(job)  # nothing to compare with: the refusal stands
    finally:
        subprocess.run(["scancel", job], check=False)


def test_time_limit_usr2_requeue_then_finish(slurm, stdlib_data, tmp_path):
    """A 1-minute limit with USR2 10 s before it: told apart from preemption by Slurm's record.

    slurmctld acts on a ~30 s tick, so USR2 lands up to 30 s early (seen: 14 s into a 1-minute job with a
    30 s warning): with a 10 s warning it lands 20-50 s in, after the handlers exist. The first run pauses
    1.5 s after every step (the ``step`` test point, restart 0 only), so its 100 steps last at least 150 s on
    any machine and it must stop on the time limit, without training thousands of steps to get there. Once
    it has requeued, the test lifts the limit the way a sysadmin would (`scontrol update
    TimeLimit=UNLIMITED`), so the rerun (no pause) finishes however fast or loaded the machine is."""
    env = {"XIRANG_TESTPOINT": "step@0=1.5"}
    job, run = _submit([*_base(stdlib_data, tmp_path / "runs"), "cluster.nodes=1", "cluster.time_min=1",
                        "cluster.signal_delay_s=10", "train.max_steps=100", "train.log_every=50",
                        "checkpoint.every_steps=90", "requeue.max_requeues=8"], env=env)
    _wait(lambda: _ev(run, "requeue", 0), 600, "the time-limit requeue")
    subprocess.run(["scontrol", "update", f"JobId={job}", "TimeLimit=UNLIMITED"], check=True, capture_output=True)
    final = _final(run, timeout=900)
    assert final["status"] == "completed" and final["step"] == 100, read_events(run)
    stops = _ev(run, "stop")
    assert len(stops) == 1 and stops[0]["reason"] == "timeout", stops
    assert stops[0]["signal"] == "SIGUSR2" and "TimeLimit=00:01:00" in stops[0]["detail"], stops
    assert len(_ev(run, "requeue")) == 1
    # Zero steps lost: the rerun starts at the step the timed-out run saved on its way out.
    assert _ev(run, "start", 1)[0]["step"] == stops[0]["saved_step"] == stops[0]["step"] > 0


def test_array_sweep_only_the_preempted_task_reruns(slurm, stdlib_data, tmp_path):
    """4 tasks of one array (4 CPUs each: 2 per node); a `high` job on the second node preempts exactly one.

    The first start of each task pauses 0.5 s after each step (the ``step`` test point): its 80 steps last at
    least 40 s on any machine, so the second node's two tasks are still running when the preemption lands."""
    args = ["-m", "train.seed=1,2,3,4", *_base(stdlib_data, tmp_path / "runs"), "cluster.nodes=1",
            "cluster.tasks_per_node=1", "cluster.cpus_per_task=4", "train.priority=exploratory",
            "train.max_steps=80", "checkpoint.every_steps=50"]
    out = subprocess.run(TRAIN + args, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "XIRANG_TESTPOINT": "step@0=0.5"})
    assert out.returncode == 0, out.stdout + out.stderr
    assert re.search(r"submitted Slurm array job (\d+): 4 task\(s\)", out.stdout), out.stdout
    runs = [Path(p) for p in re.findall(r"-> (\S+)", out.stdout)]
    assert len(set(runs)) == 4
    # The 4 tasks fill both nodes: each starts when the testbed has the CPUs and trains at the machine's pace.
    # The limit counts from the last change of the queue or of any task's files, so only a stall fails.
    _wait(lambda: all(_ev(r, "first_step", 0) for r in runs), 600,
          lambda: f"all 4 tasks to train; events: {[read_events(r)[-2:] for r in runs]}\n{_queue()}",
          progress=lambda: (_queue(), [_run_progress(r) for r in runs]))
    _preempt("-N1", "-w", _nodes()[1], "-n1", "-c4")
    finals = [_final(r, timeout=600) for r in runs]
    assert [f["status"] for f in finals] == ["completed"] * 4
    requeued = [r for r in runs if _ev(r, "requeue")]
    assert len(requeued) == 1, [read_events(r) for r in runs]
    target = _ev(requeued[0], "requeue")[0]["target"]
    assert re.fullmatch(r"\d+_\d", target), target  # ARRAYJOBID_TASKID, never the whole array
    for r in runs:
        assert {e["restart"] for e in _ev(r, "start")} == ({0, 1} if r in requeued else {0})


def test_kill9_rank_policy_requeue_resumes_from_periodic_checkpoint(slurm, stdlib_data, tmp_path):
    """kill -9 of rank 3 (the second node): the supervisor requeues, the rerun resumes at a periodic checkpoint."""
    job, run = _submit([*_base(stdlib_data, tmp_path / "runs"), "train.max_steps=40", "checkpoint.every_steps=10"],
                       env=PACED)
    latest = run / "checkpoints" / "latest"
    _wait(lambda: latest.exists() and int(latest.read_text().split("_")[-1]) >= 10, 600, "a periodic checkpoint")
    pid = _wait(lambda: rank_pid(run, 0, 3), 600, "rank 3's pid")
    os.kill(pid, 9)
    final = _final(run, timeout=600)
    assert final["status"] == "completed", read_events(run)
    failure = _ev(run, "failure", 0)[0]
    assert failure["reason"] == "node_failure" and failure["node"] == _nodes()[1], failure
    assert _ev(run, "requeue", 0)[0]["reason"] == "node_failure"
    resumed = _ev(run, "start", 1)[0]["step"]
    assert resumed >= 10 and resumed % 10 == 0, resumed  # a periodic checkpoint, not a save-on-stop


def test_kill9_requeue_excludes_the_failed_node(slurm, stdlib_data, tmp_path):
    """1 node x 2 ranks, kill -9 of rank 1: the requeued job excludes that node and reruns on the other."""
    job, run = _submit([*_base(stdlib_data, tmp_path / "runs"), "cluster.nodes=1", "cluster.tasks_per_node=2",
                        "train.max_steps=30", "checkpoint.every_steps=10"], env=PACED)
    first = _training(run)[0]
    node = _ev(run, "start", 0)[0]["node"]
    assert node in _nodes(), first
    os.kill(_wait(lambda: rank_pid(run, 0, 1), 600, "rank 1's pid"), 9)
    final = _final(run, timeout=600)
    assert final["status"] == "completed", read_events(run)
    requeue = _ev(run, "requeue", 0)[0]
    assert requeue["reason"] == "node_failure" and requeue["excluded"] == [node], requeue
    rerun = _ev(run, "start", 1)[0]
    assert rerun["node"] != node, (node, rerun)  # Slurm placed the rerun on the healthy node
    info = subprocess.run(["scontrol", "show", "job", "-o", job], capture_output=True, text=True).stdout
    assert f"ExcNodeList={node}" in info and "Restarts=1" in info, info
    # Applied from inside the job right after the requeue (no process outlives the job, so this holds
    # under proctrack/cgroup); start_now: the rerun starts long before Slurm's ~2 min BeginTime hold.
    update = _ev(run, "requeue_update", 0)[0]
    assert any(a.startswith("update") and "StartTime=now+" in a for a in update["applied"]), update
    # Slurm's hold would put the start >= 121 s after the requeue; with the begin time set ahead by a few
    # seconds, the rerun starts at the next scheduler pass (sched_interval: 60 s by default, 2 s on the testbed).
    started = time.mktime(time.strptime(re.search(r"StartTime=(\S+)", info).group(1), "%Y-%m-%dT%H:%M:%S"))
    assert started - requeue["time"] < 100, (requeue, info)


def test_hang_is_aborted_and_the_requeue_excludes_the_hung_node(slurm, stdlib_data, tmp_path):
    """SIGSTOP of rank 1 in a 1-node job: the watchdog names it, aborts, and the rerun avoids that node."""
    job, run = _submit([*_base(stdlib_data, tmp_path / "runs"), "cluster.nodes=1", "cluster.tasks_per_node=2",
                        "train.max_steps=30", "checkpoint.every_steps=10", "monitor.hang_s=20"], env=PACED)
    _training(run)
    node = _ev(run, "start", 0)[0]["node"]
    os.kill(_wait(lambda: rank_pid(run, 0, 1), 600, "rank 1's pid"), signal.SIGSTOP)
    final = _final(run, timeout=600)
    assert final["status"] == "completed", read_events(run)
    hang = _ev(run, "hang")[0]
    assert (hang["rank"], hang["node"]) == (1, node) and "stopped" in hang["cause"], hang
    requeue = _ev(run, "requeue", 0)[0]
    assert requeue["excluded"] == [node], requeue
    assert _ev(run, "start", 1)[0]["node"] != node


def test_max_requeues_exceeded_gives_final_status(slurm, stdlib_data, tmp_path):
    job, run = _submit([*_base(stdlib_data, tmp_path / "runs"), "requeue.max_requeues=0", "train.max_steps=400",
                        "train.priority=exploratory"])
    _training(run, None)
    _preempt("-N2", "--ntasks-per-node=8")
    final = _final(run, timeout=600)
    assert final["status"] == "max_requeues_exceeded" and final["why"] == "max_requeues=0 reached after 0 requeue(s)"
    # The job ends and does not come back: FAILED when its ranks left within the grace time, PREEMPTED when
    # Slurm ended it at the grace time's end (the run made it non-requeueable, so it was not requeued).
    state = _wait(lambda: (s := subprocess.run(["scontrol", "show", "job", "-o", job], capture_output=True,
                                               text=True).stdout) and re.search(r"JobState=(FAILED|PREEMPTED)", s)
                  and s, 600, "FAILED or PREEMPTED")
    assert "Restarts=0" in state and "Requeue=0" in state and not _ev(run, "requeue")
    # The requeue summary the user reads.
    summary = json.dumps(final)
    assert "max_requeues" in summary


def test_a_class_past_its_requeue_budget_ends_the_run_by_name(slurm, stdlib_data, tmp_path):
    """The budget is a rate per fault class: with no preemption allowed (burst 0, rate 0) the first preemption
    ends the run with requeue_budget_exceeded, naming the class, while failures keep their own budget."""
    job, run = _submit([*_base(stdlib_data, tmp_path / "runs"), "requeue.budget_burst=0",
                        "requeue.preemptions_per_day=0", "train.max_steps=1000000", "train.priority=exploratory"])
    _training(run, None)
    _preempt("-N2", "--ntasks-per-node=8")
    final = _final(run, timeout=600)
    assert final["status"] == "requeue_budget_exceeded", final
    assert "requeue budget for preemptions spent: 0 requeue(s)" in final["why"], final
    assert "requeue.preemptions_per_day=0" in final["why"] and not _ev(run, "requeue")


def test_a_users_scancel_ends_the_run_and_it_does_not_come_back(slurm, stdlib_data, tmp_path):
    """``scancel JOB`` is the user's decision, not a fault: the ranks save, the run ends stopped_terminated
    under a policy that requeues everything else, and Slurm keeps the job cancelled."""
    job, run = _submit([*_base(stdlib_data, tmp_path / "runs"), "train.max_steps=1000000"])  # never done first
    _training(run, None)
    subprocess.run(["scancel", job], check=True)
    final = _final(run, timeout=300)
    assert final["status"] == "stopped_terminated", final
    state = _wait(lambda: (s := subprocess.run(["scontrol", "show", "job", "-o", job], capture_output=True,
                                               text=True).stdout) and re.search(r"JobState=CANCELLED", s)
                  and s, 300, "CANCELLED")
    assert "Restarts=0" in state, state
    time.sleep(10)  # a requeue, had one been made, would show by now: still cancelled, no second start
    again = subprocess.run(["scontrol", "show", "job", "-o", job], capture_output=True, text=True).stdout
    assert not again or "JobState=CANCELLED" in again, again
    assert not _ev(run, "requeue") and not _ev(run, "start", 1)


def test_wait_blocks_until_the_job_ends(slurm, stdlib_data, tmp_path):
    out = subprocess.run(TRAIN + [*_base(stdlib_data, tmp_path / "runs"), "cluster.nodes=1", "cluster.tasks_per_node=1",
                                  "train.max_steps=5", "--wait"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert re.search(r"job \d+ ended: Slurm state COMPLETED; run status completed", out.stdout), out.stdout


def test_second_submission_of_a_live_run_is_refused_or_queued_behind_it(slurm, stdlib_data, tmp_path):
    """One job per run directory on Slurm: refused with the job id while it is pending/running; with
    train.after_active=true queued behind it (afterany), and the queued job waits for it."""
    args = [*_base(stdlib_data, tmp_path / "runs"), "cluster.nodes=1", "cluster.tasks_per_node=1",
            "train.max_steps=400"]
    # Every CPU of both nodes held in `high` first: the run's job stays PENDING until the test is done with
    # it, so it cannot finish (and the run be complete) while a slow machine runs the next two commands.
    with testbed_held():
        _second_submission(args)


def _second_submission(args: list[str]) -> None:
    job, run = _submit(args)
    out = subprocess.run(TRAIN + args, capture_output=True, text=True, timeout=300)
    assert out.returncode == 2 and f"already has job {job} (" in out.stderr, out.stdout + out.stderr
    assert f"scancel {job}" in out.stderr and "submitted Slurm job" not in out.stdout
    job2, run2 = _submit([*args, "train.after_active=true"])
    assert run2 == run and job2 != job
    info = subprocess.run(["scontrol", "show", "job", "-o", job2], capture_output=True, text=True).stdout
    assert f"Dependency=afterany:{job}" in info and "JobState=PENDING" in info, info
    subprocess.run(["scancel", job2], check=False)
    subprocess.run(["scancel", job], check=False)
