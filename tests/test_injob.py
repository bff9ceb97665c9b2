"""In-job restart: the shrunk layout, the node choice, the step command and the driver's decisions.

The driver runs here with a stand-in for ``srun`` (a function that plays one attempt: it writes the
rank markers and the watchdog's events a real attempt writes, into a real run directory) and a
real event log; the real ``srun`` steps are in tests/test_injob_slurm.py.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest
from conftest import compose_cfg

from xirang_hpc.batch import injob
from xirang_hpc.batch.injob import choose_nodes, drive, run_step, srun_command
from xirang_hpc.config.elastic import for_environment, shrink, shrink_options
from xirang_hpc.config.errors import ConfigError
from xirang_hpc.config.validate import load_config
from xirang_hpc.monitor.events import append_event, read_events
from xirang_hpc.runtime.markers import mark_exit, mark_start
from xirang_hpc.slurm.commands import Result
from xirang_hpc.submit.slurm import make_slurm_executor, sbatch_parameters, write_job_file


@pytest.fixture(autouse=True)
def _no_accounting(monkeypatch: pytest.MonkeyPatch) -> None:
    """The driver asks sacct whether a failed step ran out of memory; these tests have no Slurm job to ask about."""
    monkeypatch.setattr(injob, "oom_nodes", lambda *a, **k: [])


def _cfg(*overrides: str):
    return load_config(compose_cfg(["parallel.pp=1", "parallel.tp=1", *overrides]))


def test_shrink_keeps_the_global_batch_through_accumulation():
    cfg = _cfg("cluster.nodes=2", "cluster.tasks_per_node=2", "train.global_batch=32")
    small = shrink(cfg, 1)
    assert (small.cluster.nodes, small.parallel.dp, small.train.grad_accum) == (1, 2, 2)
    assert small.train.global_batch == 32 and cfg.parallel.dp == 4 and cfg.train.grad_accum == 1
    assert shrink(cfg, 2) is cfg
    assert for_environment(cfg, {"XIRANG_NODES": "1"}).parallel.dp == 2
    assert for_environment(cfg, {}) is cfg


def test_shrink_refuses_a_layout_that_cannot_fit_and_names_why():
    cfg = _cfg("cluster.nodes=2", "cluster.tasks_per_node=2", "parallel.pp=2", "parallel.tp=2")
    with pytest.raises(ConfigError, match="do not fit on 1 node"):
        shrink(cfg, 1)
    assert shrink_options(cfg) == []
    three = _cfg("cluster.nodes=3", "cluster.tasks_per_node=2", "train.global_batch=48")
    with pytest.raises(ConfigError, match="whole factor"):
        shrink(three, 2)  # dp 6 -> 4: grad_accum would be 1.5
    assert shrink_options(three) == [1]
    assert shrink_options(_cfg("cluster.nodes=4", "cluster.tasks_per_node=1", "train.global_batch=32",
                               "requeue.min_nodes=2")) == [2]
    with pytest.raises(ConfigError, match="XIRANG_NODES"):
        for_environment(cfg, {"XIRANG_NODES": "two"})


def test_spare_nodes_need_in_job_restart_and_are_allocated():
    assert _cfg().requeue.max_restarts_in_job == 2  # on in the default policy
    with pytest.raises(ConfigError, match="cluster.spare_nodes"):
        _cfg("cluster=testbed", "cluster.spare_nodes=1", "requeue.max_restarts_in_job=0")
    cfg = _cfg("cluster=testbed", "cluster.spare_nodes=1", "requeue.max_restarts_in_job=1")
    assert sbatch_parameters(cfg.cluster)["nodes"] == 3


def test_the_batch_script_hands_the_job_to_the_driver(tmp_path):
    cfg = _cfg("cluster=testbed", "requeue.max_restarts_in_job=2")
    script = make_slurm_executor(cfg.cluster, tmp_path, requeue=cfg.requeue)._make_submission_file_text("cmd", "7")
    driver = script.index("-m xirang_hpc.batch.injob --map")
    assert "#SBATCH --no-kill" in script and script.index("exit $?", driver) < script.index("srun --unbuffered")
    plain = make_slurm_executor(cfg.cluster, tmp_path, requeue=_cfg("cluster=testbed", "requeue=testbed").requeue)
    text = plain._make_submission_file_text("cmd", "7")
    assert "--no-kill" not in text and "xirang_hpc.batch.injob" not in text


def test_choose_nodes_prefers_the_same_layout_then_the_largest_shrink():
    assert choose_nodes(["n1", "n2", "n3"], 2, [1]).nodes == ["n1", "n2"]
    plan = choose_nodes(["n3"], 2, [1])
    assert plan.nodes == ["n3"] and plan.shrunk
    assert choose_nodes(["n1", "n2", "n3"], 4, [1, 2]).nodes == ["n1", "n2"]
    assert choose_nodes(["n1"], 2, []) is None


def test_srun_command_places_the_step_and_appends_to_the_logs(tmp_path):
    job = {"tasks_per_node": 2, "srun_args": ["--cpu-bind=none"]}
    cmd = srun_command(job, tmp_path, ["n2", "n3"], 1, "/py", {})
    assert cmd[:2] == ["srun", "--unbuffered"] and "--open-mode=append" in cmd and "--overlap" in cmd
    assert {"--nodes=2", "--ntasks=4", "--ntasks-per-node=2", "--nodelist=n2,n3", "--cpu-bind=none"} <= set(cmd)
    assert cmd[-5:] == ["/py", "-u", "-m", "submitit.core._submit", str(tmp_path)]
    first = srun_command(job, tmp_path, ["n1"], 0, "/py", {"SLURM_ARRAY_TASK_ID": "3"})
    assert "--overlap" not in first and str(tmp_path / "%A_%a_%t_log.out") in first


class Attempts:
    """Plays one ``srun`` attempt per call: ranks start; the scripted fault (if any) is logged."""

    def __init__(self, run_dir: Path, faults: list[str | None]) -> None:
        self.run_dir, self.faults, self.calls = run_dir, faults, []

    def __call__(self, cmd: list[str], env: dict[str, str], run_dir: Path, since: float) -> int:
        nodes = next(a for a in cmd if a.startswith("--nodelist=")).split("=", 1)[1].split(",")
        self.calls.append((nodes, env["XIRANG_NODES"], env["XIRANG_INJOB_ATTEMPT"]))
        for i, node in enumerate(nodes):
            mark_start(run_dir, 0, i, node)
        fault = self.faults[len(self.calls) - 1]
        if fault is None:
            for i in range(len(nodes)):
                mark_exit(run_dir, 0, i)
            return 0
        if fault == "exception":
            for i in range(len(nodes)):
                mark_exit(run_dir, 0, i)
            return 1
        append_event(run_dir, "dead", f"rank 1 on {fault}", rank=1, node=fault)
        append_event(run_dir, "abort", "job aborted", node=fault)
        return 137


def _run_dir(tmp_path: Path, *overrides: str) -> Path:
    cfg = _cfg("cluster=testbed", *overrides)
    run = tmp_path / "run"
    run.mkdir()
    write_job_file(cfg, run)
    return run


def test_driver_restarts_on_a_spare_then_shrinks_then_gives_up(tmp_path):
    run = _run_dir(tmp_path, "requeue.max_restarts_in_job=3", "cluster.spare_nodes=1")
    play = Attempts(run, ["n1", "n3", "n2"])
    rc = drive(run, tmp_path / "sub", {"SLURM_JOB_ID": "5"}, step=play, allocation=lambda _: ["n1", "n2", "n3"],
               preempted=lambda _: None)
    assert rc == 137
    assert play.calls == [(["n1", "n2"], "2", "0"), (["n2", "n3"], "2", "1"), (["n2"], "1", "2")]
    restarts = [e for e in read_events(run) if e["kind"] == "restart"]
    assert [(e["node"], e["nodes"], e["shrunk"], e["attempt"]) for e in restarts] == [
        ("n1", ["n2", "n3"], False, 1), ("n3", ["n2"], True, 2)]
    assert all(e["reason"].startswith("dead: rank 1 on") and e["fault_time"] for e in restarts)
    refused = [e for e in read_events(run) if e["kind"] == "restart_refused"]
    assert len(refused) == 1 and "too few healthy nodes" in refused[0]["reason"] and refused[0]["node"] == "n2"
    # Earlier attempts' markers were moved aside; the last attempt's stay for the supervisor.
    assert sorted(p.name for p in (run / "ranks").iterdir()) == ["r0", "r0-attempt0", "r0-attempt1"]


def test_driver_respects_max_restarts_and_leaves_plain_errors_to_the_policy(tmp_path):
    run = _run_dir(tmp_path, "requeue.max_restarts_in_job=1")
    play = Attempts(run, ["n2", "n1"])
    assert drive(run, tmp_path, {}, step=play, allocation=lambda _: ["n1", "n2"]) == 137
    assert [c[0] for c in play.calls] == [["n1", "n2"], ["n1"]]
    refused = [e for e in read_events(run) if e["kind"] == "restart_refused"]
    assert "max_restarts_in_job=1 reached" in refused[0]["reason"]

    (tmp_path / "b").mkdir()
    run2 = _run_dir(tmp_path / "b", "requeue.max_restarts_in_job=3")
    play2 = Attempts(run2, ["exception"])
    assert drive(run2, tmp_path, {}, step=play2, allocation=lambda _: ["n1", "n2"]) == 1
    assert len(play2.calls) == 1 and not [e for e in read_events(run2) if e["kind"].startswith("restart")]


def test_driver_does_not_restart_after_a_save_failed_on_the_storage(tmp_path):
    run = _run_dir(tmp_path, "requeue.max_restarts_in_job=3", "cluster.spare_nodes=1")

    def full_disk(cmd, env, run_dir, since):
        for i, node in enumerate(("n1", "n2")):
            mark_start(run_dir, 0, i, node)
            mark_exit(run_dir, 0, i)
        append_event(run_dir, "save_failed", "no space left on the device", errno=28, errno_name="ENOSPC",
                     error="checkpoint save of step 4 failed: no space left on the device (ENOSPC)")
        append_event(run_dir, "dead", "rank 0 on n1: dead: process exited with an error", rank=0, node="n1")
        append_event(run_dir, "abort", "job aborted", node="n1")
        return 1

    assert drive(run, tmp_path, {}, step=full_disk, allocation=lambda _: ["n1", "n2", "n3"]) == 1
    assert not [e for e in read_events(run) if e["kind"] == "restart"]
    (refused,) = [e for e in read_events(run) if e["kind"] == "restart_refused"]
    assert refused["cause"] == "save_failed" and "no space left" in refused["reason"]


def test_driver_does_not_restart_a_job_that_stopped_itself(tmp_path):
    run = _run_dir(tmp_path, "requeue.max_restarts_in_job=3")

    def preempted(cmd, env, run_dir, since):
        append_event(run_dir, "exit", "requeued", final=False, status="requeued", restart=0)
        return 144

    assert drive(run, tmp_path, {}, step=preempted, allocation=lambda _: ["n1", "n2"]) == 144
    # Preempted while the ranks were starting (no handler yet): ranks died without exiting, Slurm has
    # a PreemptTime; that is the supervisor's preemption, not a node to exclude.
    play = Attempts(run, ["n2"])
    env = {"SLURM_JOB_ID": "9", "SLURM_RESTART_COUNT": "1"}
    assert drive(run, tmp_path, env, step=play, allocation=lambda _: ["n1", "n2"],
                 preempted=lambda job: "2026-11-30T18:00:00" if job == "9" else None) == 137
    assert len(play.calls) == 1
    assert json.loads((run / "slurm_job.json").read_text())["shrink_to"] == [1]
    assert not [e for e in read_events(run) if e["kind"].startswith("restart")]


def test_min_nodes_lets_a_drained_job_start_shrunk_and_a_floor_the_layout_misses_is_refused(tmp_path):
    cfg = _cfg("cluster=testbed", "requeue.max_restarts_in_job=1", "requeue.min_nodes=1")
    text = make_slurm_executor(cfg.cluster, tmp_path, requeue=cfg.requeue)._make_submission_file_text("cmd", "7")
    assert "#SBATCH --nodes=1-2" in text
    run = _run_dir(tmp_path, "requeue.max_restarts_in_job=1", "requeue.min_nodes=1")
    assert json.loads((run / "slurm_job.json").read_text())["min_alloc_nodes"] == 1
    # Allocated one node only (the other drained): the first attempt already runs the shrunk layout.
    play = Attempts(run, [None])
    assert drive(run, tmp_path, {}, step=play, allocation=lambda _: ["n2"]) == 0
    assert play.calls == [(["n2"], "1", "0")]
    four = _cfg("cluster=testbed", "cluster.nodes=4", "cluster.tasks_per_node=1", "requeue.max_restarts_in_job=1",
                "requeue.min_nodes=3")
    (tmp_path / "c").mkdir()
    with pytest.raises(ConfigError, match=r"requeue.min_nodes=3.*shrinks only to \[1, 2\]"):
        write_job_file(four, tmp_path / "c")


def test_the_driver_removes_the_jobs_memory_copies_here_and_on_the_healthy_nodes(tmp_path):
    from xirang_hpc.batch.injob import release_memory
    from xirang_hpc.checkpoint.naming import memory_root

    run = _run_dir(tmp_path, "requeue.max_restarts_in_job=1", "checkpoint.in_memory=true",
                   f"checkpoint.memory_dir={tmp_path / 'shm'}")
    root = memory_root("77", run, str(tmp_path / "shm"))
    (root / "n1" / "step_5").mkdir(parents=True)
    append_event(run, "dead", "rank 2 on n2", rank=2, node="n2")
    calls = []
    env = {"SLURM_JOB_ID": "77", "SLURMD_NODENAME": "n1", "SLURM_JOB_NODELIST": "n[1-3]"}
    def srun(argv, **kw):
        calls.append(argv)
        return Result(0, "", "")

    got = release_memory(run, env, allocation=lambda _: ["n1", "n2", "n3"], run=srun)
    assert got == root
    assert not root.exists()
    # The lost node n2 is left out (an srun step there would hang); n3 gets one rm step.
    assert calls == [["srun", "--overlap", "--mem=0", "--nodes=1", "--ntasks-per-node=1", "--nodelist=n3", "rm", "-rf",
                      str(root)]]
    (tmp_path / "off").mkdir()
    off = _run_dir(tmp_path / "off")
    assert release_memory(off, env, allocation=lambda _: ["n1"], run=srun) is None


def test_a_step_that_outlives_a_dead_rank_is_ended_and_older_faults_are_ignored(tmp_path):
    """After a node loss the survivors may fail on their own (gloo: connection reset) before the watchdog
    aborts them: only a ``dead`` event is written, and ``srun`` would wait minutes for the lost node's tasks.
    The driver ends such a step ``grace_s`` after the dead rank; a fault of an earlier attempt ends nothing."""
    sleeper = [sys.executable, "-c", "import time; time.sleep(float(__import__('sys').argv[1]))"]
    append_event(tmp_path, "dead", "rank 2 on n2 (backward, step 11): dead", rank=2, node="n2")
    since = time.time() + 0.01
    t0 = time.monotonic()
    assert run_step([*sleeper, "1.5"], {}, tmp_path, since, grace_s=0.2, poll_s=0.05) == 0  # ran to its end
    assert time.monotonic() - t0 >= 1.5
    time.sleep(0.05)
    append_event(tmp_path, "dead", "rank 2 on n2 (backward, step 11): dead", rank=2, node="n2")
    t0 = time.monotonic()
    rc = run_step([*sleeper, "600"], {}, tmp_path, since, grace_s=0.2, poll_s=0.05)
    assert rc == -15 and time.monotonic() - t0 < 60  # SIGTERM'd after the grace, not after 600 s


def test_the_batch_steps_own_processes_do_not_import_torch() -> None:
    """The in-job restart driver, the requeue supervisor, the node watchdog, the rank entry and the fork-server
    client run beside (or before) the ranks on every start of a job: none of them pays torch's ~2 s of import
    CPU, which would also delay a restart inside the allocation."""
    import subprocess

    mods = ["xirang_hpc.batch.injob", "xirang_hpc.batch.supervise", "xirang_hpc.monitor.watchdog",
            "xirang_hpc.batch.rank", "xirang_hpc.local.preload"]
    code = (f"import sys\nfor m in {mods!r}: __import__(m)\n"
            "print(sorted(m for m in ('torch', 'h5py') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", out.stdout


def test_a_failed_step_launch_is_retried_with_backoff_then_left_to_the_policy(tmp_path):
    """srun ends before any rank started, saying it could not reach slurmctld or create the step: launched again
    after 2, 4, 8 ... s while the retry time lasts; a launch that then works goes on; retries that run out are an
    infrastructure failure; a plain failure (no such words from srun) is not retried."""
    run = _run_dir(tmp_path, "requeue.max_restarts_in_job=1")
    folder = tmp_path / "sub"
    folder.mkdir()
    clock, slept = [1000.0], []

    def sleep(s: float) -> None:
        slept.append(s)
        clock[0] += s

    def srun_says(line: str):
        def step(cmd, env, run_dir, since):
            with (folder / f"{env['SLURM_JOB_ID']}_0_log.err").open("a") as f:  # the batch log, where srun writes
                f.write(f"{line}\n")
            return 1
        return step

    down = srun_says("srun: error: Unable to confirm allocation for job 5: Unable to contact slurm controller "
                     "(connect failure)")
    calls = []

    def step(cmd, env, run_dir, since):  # two launches fail, the third trains to the end
        calls.append(since)
        if len(calls) < 3:
            return down(cmd, env, run_dir, since)
        mark_start(run_dir, 0, 0, "n1")
        mark_exit(run_dir, 0, 0)
        return 0

    outcome: dict[str, str] = {}
    kw = dict(allocation=lambda _: ["n1", "n2"], outcome=outcome, sleep=sleep, clock=lambda: clock[0],
              preempted=lambda _: None)
    assert drive(run, folder, {"SLURM_JOB_ID": "5"}, step=step, answers=lambda: True, **kw) == 0
    assert slept == [2.0, 4.0] and outcome == {}
    failed = [e for e in read_events(run) if e["kind"] == "step_launch_failed"]
    assert [(e["reason"], e["retry"], e["controller_down"]) for e in failed] == [
        ("slurmctld does not answer", 1, True), ("slurmctld does not answer", 2, True)]

    (tmp_path / "b").mkdir()
    run2 = _run_dir(tmp_path / "b", "requeue.max_restarts_in_job=1")
    slept.clear()
    env = {"SLURM_JOB_ID": "6", "XIRANG_LAUNCH_RETRY_S": "100"}
    busy = srun_says("srun: error: Unable to create step for job 6: Job step creation temporarily disabled")
    assert drive(run2, folder, env, step=busy, answers=lambda: True, **kw) == 1
    assert slept == [2.0, 4.0, 8.0, 16.0, 32.0, 60.0] and outcome["cause"] == "infra_failure"
    refused = [e for e in read_events(run2) if e["kind"] == "restart_refused"]
    assert "srun could not start the step: srun: error: Unable to create step" in refused[0]["reason"], refused

    (tmp_path / "c").mkdir()
    run3 = _run_dir(tmp_path / "c", "requeue.max_restarts_in_job=1")
    slept.clear()
    outcome.clear()
    crash = srun_says("srun: error: n1: task 0: Exited with exit code 1")
    assert drive(run3, folder, {"SLURM_JOB_ID": "7"}, step=crash, answers=lambda: False, **kw) == 1
    assert slept == [] and outcome == {}

    # Slurm refuses the step itself (a request no node can meet): not retried for ten minutes, not requeued;
    # the run stops at once with srun's words and the fields to fix.
    (tmp_path / "d").mkdir()
    run4 = _run_dir(tmp_path / "d", "requeue.max_restarts_in_job=1")
    refuse = srun_says("srun: error: Unable to create step for job 8: Requested node configuration is not "
                       "available")
    assert drive(run4, folder, {"SLURM_JOB_ID": "8"}, step=refuse, answers=lambda: True, **kw) == 1
    assert slept == [] and outcome["cause"] == "launch_refused", outcome
    assert "Requested node configuration is not available" in outcome["detail"]
    assert "cluster.tasks_per_node" in outcome["detail"]
    from xirang_hpc.config.schema import RequeueConfig
    from xirang_hpc.runtime.policy import decide

    verdict = decide("launch_refused", 0, RequeueConfig())
    assert not verdict.requeue and "refused the same way" in verdict.why, verdict


def test_an_oom_kill_is_named_with_the_limit_and_no_node_is_excluded(tmp_path):
    """srun's and slurmstepd's words on an OOM kill: no in-job restart elsewhere (the same layout runs out again on
    any node), the cause for the supervisor is ``oom`` with the limit and the ways to fit."""
    from xirang_hpc.batch.supervise import oom_nodes, oom_nodes_in

    text = ("srun: error: n2: task 1: Out Of Memory\n"
            "slurmstepd-n2: error: Detected 1 oom-kill event(s) in StepId=7.0. Some of your processes may have been "
            "killed by the cgroup out-of-memory handler.\nsrun: error: n1: task 0: Exited with exit code 1\n")
    assert oom_nodes_in(text) == ["n2"] and oom_nodes_in("srun: error: n1: task 0: Exited with exit code 1") == []

    sacct = Result(0, "7|OUT_OF_MEMORY|n[1-2]\n7.batch|CANCELLED|n1\n7.0|OUT_OF_MEMORY|n2\n", "")
    assert oom_nodes("7", run=lambda *a, **k: sacct, tries=1) == ["n2"]

    run = _run_dir(tmp_path, "requeue.max_restarts_in_job=2", "cluster.spare_nodes=1", "cluster.mem_gb=2")
    folder = tmp_path / "sub"
    folder.mkdir()

    def step(cmd, env, run_dir, since):
        mark_start(run_dir, 0, 0, "n1")
        mark_start(run_dir, 0, 1, "n2")
        append_event(run_dir, "dead", "rank 1 on n2: killed by a signal", rank=1, node="n2")
        (folder / "7_0_log.err").write_text(text)
        return 137

    outcome: dict[str, str] = {}
    assert drive(run, folder, {"SLURM_JOB_ID": "7"}, step=step, allocation=lambda _: ["n1", "n2", "n3"],
                 outcome=outcome, preempted=lambda _: None) == 137
    assert outcome["cause"] == "oom" and "cluster.mem_gb=2 GB" in outcome["detail"], outcome
    assert "train.grad_accum" in outcome["detail"] and "not excluded" in outcome["detail"]
    assert not [e for e in read_events(run) if e["kind"] == "restart"]


def test_the_guard_leaves_a_job_slurm_is_ending_to_its_ranks(tmp_path, monkeypatch):
    """The driver killed by Slurm's SIGTERM (scancel, time limit) or a cancelled job is not a dead supervisor: the
    guard logs nothing and signals nothing; a driver killed otherwise is named and the policy applied."""
    run = _run_dir(tmp_path, "requeue.max_restarts_in_job=1")
    calls = []
    monkeypatch.setattr(injob, "job_state", lambda job: "CANCELLED" if job == "8" else "RUNNING")
    assert injob.guard(143, run, {"SLURM_JOB_ID": "9"}, run=lambda *a, **k: calls.append(a)) == 143
    assert injob.guard(137, run, {"SLURM_JOB_ID": "8"}, run=lambda *a, **k: calls.append(a)) == 137
    assert calls == [] and not [e for e in read_events(run) if e["kind"] == "supervisor_died"]
