"""Requeue policy, Slurm record parsing, timeout-vs-preemption, requeue targets, and the
"scontrol missing" error: pure logic plus a real subprocess with a PATH lacking scontrol."""

from __future__ import annotations

import pytest
from conftest import compose_cfg

from xirang_hpc.config.errors import ConfigError
from xirang_hpc.config.schema import RequeueConfig
from xirang_hpc.config.validate import load_config
from xirang_hpc.runtime.policy import History, budget_left, decide
from xirang_hpc.slurm import control

# A real `scontrol show job -o` line from the testbed (job preempted by a `high` job), trimmed.
PREEMPTED = ("JobId=7 JobName=xirang-pre UserId=root(0) JobState=RUNNING Reason=None Requeue=1 Restarts=0 "
             "RunTime=00:00:18 TimeLimit=00:30:00 TimeMin=N/A SubmitTime=2026-11-29T21:25:54 "
             "PreemptEligibleTime=2026-11-29T21:25:54 PreemptTime=2026-11-29T21:26:12 Partition=low")
TIMED_OUT = PREEMPTED.replace("PreemptTime=2026-11-29T21:26:12", "PreemptTime=None").replace(
    "RunTime=00:00:18 TimeLimit=00:30:00", "RunTime=00:29:02 TimeLimit=00:30:00")


def test_parse_job_and_durations():
    info = control.parse_job(PREEMPTED)
    assert info["JobState"] == "RUNNING" and info["PreemptTime"] == "2026-11-29T21:26:12"
    assert control.parse_duration("00:30:00") == 1800
    assert control.parse_duration("1-02:00:05") == 93605
    assert control.parse_duration("05:07") == 307
    assert control.parse_duration("UNLIMITED") is None


def test_classify_preemption_from_preempt_time():
    cause = control.classify_stop(control.parse_job(PREEMPTED), "SIGUSR2", signal_delay_s=90)
    assert cause.reason == "preemption" and "PreemptTime=2026-11-29T21:26:12" in cause.detail


def test_classify_timeout_from_time_limit_and_run_time():
    cause = control.classify_stop(control.parse_job(TIMED_OUT), "SIGUSR2", signal_delay_s=60)
    assert cause.reason == "timeout"
    # The same record with time left far beyond the warning window is not a timeout.
    early = TIMED_OUT.replace("RunTime=00:29:02", "RunTime=00:10:00")
    assert control.classify_stop(control.parse_job(early), "SIGUSR2", 60).reason == "preemption"
    # SIGTERM alone, neither preempted nor near the limit (scancel): not requeued by policy.
    assert control.classify_stop(control.parse_job(early), "SIGTERM", 60).reason == "terminated"
    # SIGTERM-only sites (pain point 6): a preemption still reads as preemption.
    assert control.classify_stop(control.parse_job(PREEMPTED), "SIGTERM", 60).reason == "preemption"
    # SIGTERM because the batch script ended under the ranks (killed: ExitCode 0:9), not a cancel.
    for state in ("COMPLETED", "FAILED"):
        gone = early.replace("JobState=RUNNING", f"JobState={state}")
        cause = control.classify_stop(control.parse_job(gone), "SIGTERM", 60)
        assert cause.reason == "infra_failure" and "the batch step is gone" in cause.detail, cause
    for state in ("CANCELLED", "COMPLETING"):  # scancel: COMPLETING while its processes are being ended
        cancelled = early.replace("JobState=RUNNING", f"JobState={state}")
        assert control.classify_stop(control.parse_job(cancelled), "SIGTERM", 60).reason == "terminated"
    # COMPLETING with the batch script killed by a signal: gone (a cancel leaves the script alive: it ignores
    # SIGTERM, and one that exits by itself has no signal in its exit code).
    killed = early.replace("JobState=RUNNING", "JobState=COMPLETING")
    killed = killed.replace("ExitCode=0:0", "ExitCode=0:9") if "ExitCode=" in killed else killed + " ExitCode=0:9"
    assert control.classify_stop(control.parse_job(killed), "SIGTERM", 60).reason == "infra_failure"
    exited = killed.replace("ExitCode=0:9", "ExitCode=143:0")
    assert control.classify_stop(control.parse_job(exited), "SIGTERM", 60).reason == "terminated"


def test_restart_count_is_slurms_count_of_earlier_starts():
    assert control.restart_count({"SLURM_RESTART_COUNT": "3"}) == 3
    assert control.restart_count({"SLURM_RESTART_COUNT": ""}) == 0  # set but empty: a first start
    assert control.restart_count({}) == 0  # outside Slurm


def test_requeue_target_names_the_array_task_not_the_array():
    env = {"SLURM_JOB_ID": "118", "SLURM_ARRAY_JOB_ID": "115", "SLURM_ARRAY_TASK_ID": "3"}
    assert control.requeue_target(env) == "115_3"
    assert control.requeue_target({"SLURM_JOB_ID": "42"}) == "42"
    with pytest.raises(control.SlurmCommandError, match="not inside a Slurm job"):
        control.requeue_target({})


def test_policy_switches_limits_and_backoff():
    p = RequeueConfig(max_requeues=2, backoff_s=30, start_now=True)
    d = decide("preemption", 0, p)
    assert d.requeue and d.backoff_s == 30 and d.start_now and d.final_status == "requeued"
    assert decide("preemption", 1, p).backoff_s == 60
    over = decide("timeout", 2, p)
    assert not over.requeue and over.final_status == "max_requeues_exceeded"
    assert "max_requeues=2 reached after 2 requeue(s)" in over.why
    assert not decide("nonzero_exit", 0, p).requeue  # off by default
    assert decide("nonzero_exit", 0, RequeueConfig(on_nonzero_exit=True)).requeue
    assert not decide("node_failure", 0, RequeueConfig(enabled=False)).requeue
    assert decide("terminated", 0, p).final_status == "stopped_terminated"
    with pytest.raises(ValueError, match="unknown stop reason 'cosmic_ray'"):
        decide("cosmic_ray", 0, p)
    # Out of memory repeats on any node with the same layout: a failure of the job's own, not requeued by default.
    assert not decide("oom", 0, p).requeue and decide("oom", 0, p).final_status == "stopped_oom"
    # The job's machinery failed (driver, step launch, batch script): governed by the node-failure switch.
    assert decide("infra_failure", 0, p).requeue and not decide("infra_failure", 0,
                                                                 RequeueConfig(on_node_failure=False)).requeue


@pytest.mark.parametrize("preset", ["default", "testbed", "never", "site-strict"])
def test_requeue_presets_compose(preset):
    cfg = load_config(compose_cfg([f"requeue={preset}"]))
    assert cfg.requeue.max_requeues is None  # no preset uses the deprecated total cap
    r = cfg.requeue  # validation sets every rate left at null
    assert all(v is not None and v >= 0 for v in (r.failures_per_day, r.preemptions_per_day, r.timeouts_per_day))


def _requeues(*reasons: str, start: float = 0.0) -> list[dict]:
    return [{"time": start, "kind": "start", "reason": "launch"}] + [
        {"time": start + 60.0 * (i + 1), "kind": "requeue", "reason": r} for i, r in enumerate(reasons)]


def test_budgets_are_rates_per_class_so_a_long_run_keeps_recovering_and_a_crash_loop_ends():
    p = RequeueConfig(failures_per_day=1.0, preemptions_per_day=24.0, timeouts_per_day=2.0, budget_burst=5)
    day = 86400.0
    # A crash loop: five node failures in five minutes spend the burst; the sixth ends the run, by name.
    loop = History.of(_requeues(*["node_failure"] * 5), now=360.0)
    assert loop.used == {"failures": 5, "preemptions": 0, "timeouts": 0}
    d = decide("infra_failure", 5, p, loop)  # the same class: failures
    assert not d.requeue and d.final_status == "requeue_budget_exceeded"
    assert "requeue budget for failures spent: 5 requeue(s)" in d.why and "requeue.failures_per_day=1" in d.why
    # ... while the other classes keep their own budgets.
    assert decide("preemption", 5, p, loop).requeue and decide("timeout", 5, p, loop).requeue
    # Sixty days at the fleet's rate: 60 failures, 120 time limits and 300 preemptions (415 requeues; the old
    # default ended a run after 5 in all) stay within budget, and the status counts what is left.
    events = _requeues(*(["node_failure"] * 60 + ["timeout"] * 120 + ["preemption"] * 300))
    long = History.of(events, now=60 * day)
    assert round(long.days, 6) == 60.0
    for reason in ("node_failure", "timeout", "preemption"):
        assert decide(reason, 480, p, long).requeue, reason
    left = budget_left(p, long)
    assert (left["failures"].used, left["failures"].allowed, left["failures"].left) == (60, 65, 5)
    assert (left["timeouts"].allowed, left["preemptions"].allowed) == (125, 1445)
    # The deprecated total cap still applies on top when set.
    assert decide("preemption", 3, RequeueConfig(max_requeues=3), long).final_status == "max_requeues_exceeded"


def test_default_rates_follow_the_run_size_and_allocation_length():
    """null rates are set at validation: failures at 2x Llama 3's unplanned rate for the node count (at least
    1 a day), time limits at 2x the allocations a day holds; an explicit rate is kept."""
    small = load_config(compose_cfg([]))
    assert small.requeue.failures_per_day == 1.0 and small.requeue.preemptions_per_day == 24.0
    assert small.requeue.timeouts_per_day == round(2 * 1440 / small.cluster.time_min, 2)
    big = RequeueConfig().with_default_rates(nodes=2048, time_min=1440)
    assert big.failures_per_day == round(2 * 419 / 54, 2) and big.timeouts_per_day == 2.0  # 15.52: 2x 7.76 a day
    assert RequeueConfig(failures_per_day=0.5).with_default_rates(2048, 60).failures_per_day == 0.5
    for bad in ("requeue.failures_per_day=-1", "requeue.budget_burst=-1", "requeue.timeouts_per_day=nan"):
        with pytest.raises(ConfigError, match=bad.split("=")[0]):
            load_config(compose_cfg([bad]))


def test_missing_scontrol_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(control.SlurmCommandError, match="scontrol not found on PATH.*requeue.enabled=false"):
        control.requeue("42")


def test_sbatch_parameters_and_scheduling_classes():
    from xirang_hpc.submit.slurm import sbatch_parameters

    cfg = load_config(compose_cfg(["cluster=testbed", "cluster.min_time_min=10", "cluster.account=proj"]))
    p = sbatch_parameters(cfg.cluster)
    assert p["partition"] == "high" and p["nodes"] == 2 and p["ntasks_per_node"] == 2
    assert p["additional_parameters"] == {"requeue": True, "time_min": 10} and p["account"] == "proj"
    assert sbatch_parameters(cfg.cluster, "exploratory")["partition"] == "low"
    plain = load_config(compose_cfg(["cluster=testbed"])).cluster
    assert "time_min" not in sbatch_parameters(plain)["additional_parameters"]
    assert sbatch_parameters(plain, "exploratory")["additional_parameters"]["time_min"] == 30 // 4
    bare = load_config(compose_cfg(["cluster=slurm"]))
    with pytest.raises(ConfigError, match="names no scavenger partition/QOS"):
        sbatch_parameters(bare.cluster, "exploratory")
    # --time-min shorter than the USR2 warning: the job could get the signal as it starts.
    short = load_config(compose_cfg(["cluster=testbed", "cluster.min_time_min=1"])).cluster
    with pytest.raises(ConfigError, match="cluster.min_time_min=1.*signal_delay_s=60 s.*min_time_min=2 or more"):
        sbatch_parameters(short)
    quick = load_config(compose_cfg(["cluster=testbed", "cluster.time_min=4", "cluster.signal_delay_s=90"])).cluster
    assert sbatch_parameters(quick, "exploratory")["additional_parameters"]["time_min"] == 2  # not 4 // 4
    late = load_config(compose_cfg(["cluster=testbed", "cluster.min_time_min=99"]))
    with pytest.raises(ConfigError, match="cluster.min_time_min=99"):
        sbatch_parameters(late.cluster)
    with pytest.raises(ConfigError, match="train.priority"):
        load_config(compose_cfg(["train.priority=urgent"]))


@pytest.mark.parametrize("preset, classes", [
    # normal, high, exploratory -> (partition, qos)
    ("testbed", {"normal": ("high", None), "exploratory": ("low", None)}),
    ("testbed-qos", {"normal": ("low", "normal"), "high": ("low", "high"), "exploratory": ("low", "scavenger")}),
    ("site-qos", {"normal": ("gpu", "normal"), "high": ("gpu", "high"), "exploratory": ("gpu", "scavenger")}),
    ("site-partitions", {"normal": ("gpu", None), "high": ("urgent", None), "exploratory": ("preempt", None)}),
])
def test_priority_maps_to_the_partition_or_qos_the_preset_names(preset, classes):
    from xirang_hpc.submit.slurm import sbatch_parameters

    for priority in ("normal", "high", "exploratory"):
        over = [f"cluster={preset}", f"train.priority={priority}"]
        cfg = load_config(compose_cfg(over))
        if priority not in classes:  # the preset has no such class: refused, naming the fields to set
            with pytest.raises(ConfigError, match=f"names no {priority} partition/QOS; set cluster.{priority}_"):
                sbatch_parameters(cfg.cluster, cfg.train.priority)
            continue
        p = sbatch_parameters(cfg.cluster, cfg.train.priority)
        assert (p.get("partition"), p.get("qos")) == classes[priority], (preset, priority, p)
        # Only exploratory work gets a default --time-min: it is requeued anyway, so any gap will do.
        assert ("time_min" in p["additional_parameters"]) == (priority == "exploratory")


@pytest.mark.parametrize("field", ["qos", "high_qos", "scavenger_qos"])
def test_a_qos_the_preset_does_not_define_is_refused_naming_the_valid_ones(field):
    with pytest.raises(ConfigError) as err:
        load_config(compose_cfg(["cluster=testbed-qos", f"cluster.{field}=hihg"]))
    msg = str(err.value)
    assert f"cluster.{field}" in msg and "hihg" in msg and "['normal', 'high', 'scavenger']" in msg, msg
    # A site that adds the QOS lists it too; then it passes.
    cfg = load_config(compose_cfg(["cluster=testbed-qos", f"cluster.{field}=urgent",
                                   "cluster.qos_names=[normal,high,scavenger,urgent]"]))
    assert getattr(cfg.cluster, field) == "urgent"


def test_a_qos_slurm_does_not_know_is_refused_before_submission():
    from xirang_hpc.submit.slurm import check_site_qos

    c = load_config(compose_cfg(["cluster=testbed-qos"])).cluster
    site = ["normal", "high"]  # what `sacctmgr show qos` lists on a site without a scavenger QOS
    check_site_qos(c, "high", site)
    check_site_qos(c, "exploratory", None)  # accounting does not answer: sbatch judges
    with pytest.raises(ConfigError) as err:
        check_site_qos(c, "exploratory", site)
    msg = str(err.value)
    assert "cluster.scavenger_qos" in msg and "scavenger" in msg and "['normal', 'high']" in msg, msg
    assert "sacctmgr add qos scavenger" in msg


def test_site_qos_names_reads_sacctmgr_or_says_unknown(tmp_path, monkeypatch):
    """A real subprocess: a sacctmgr on PATH that answers, one that fails (no accounting), none at all."""
    import os

    from xirang_hpc.submit.slurm import site_qos_names

    tool = tmp_path / "sacctmgr"
    tool.write_text("#!/bin/sh\nprintf 'normal\\nhigh\\nscavenger\\n'\n")
    tool.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}/usr/bin:/bin")
    assert site_qos_names() == ["normal", "high", "scavenger"]
    tool.write_text("#!/bin/sh\necho 'sacctmgr: error: Problem talking to the database' >&2; exit 1\n")
    assert site_qos_names() is None
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    assert site_qos_names() is None


def test_sweep_points_must_share_one_resource_set():
    from xirang_hpc.submit.sweep import check_same_resources

    ov = [["cluster.nodes=1"], ["cluster.nodes=2"]]
    cfgs = [load_config(compose_cfg(["cluster=testbed", "parallel.pp=1", *o])) for o in ov]
    with pytest.raises(ConfigError, match=r"cluster.nodes=2.*one Slurm array with one resource set"):
        check_same_resources(cfgs, ov)
    same = [load_config(compose_cfg(["cluster=testbed", f"train.lr={lr}"])) for lr in (1e-3, 3e-4)]
    check_same_resources(same, [["train.lr=1e-3"], ["train.lr=3e-4"]])  # no error


def test_rank_markers_name_ranks_that_never_exited(tmp_path):
    from xirang_hpc.runtime.markers import mark_exit, mark_start, missing_ranks, rank_pid

    for r, node in enumerate(["n1", "n1", "n2", "n2"]):
        mark_start(tmp_path, 1, r, node)
    for r in (0, 1, 2):
        mark_exit(tmp_path, 1, r)
    assert missing_ranks(tmp_path, 1) == [(3, "n2")]
    assert rank_pid(tmp_path, 1, 3) == __import__("os").getpid()
    assert missing_ranks(tmp_path, 0) == []  # a restart that never started


def test_exclusion_refuses_a_node_name_that_is_not_a_hostname():
    """Node names go into an ``scontrol update`` line: anything odd is refused before any call."""
    calls: list[list[str]] = []
    with pytest.raises(control.SlurmCommandError, match="not a Slurm node name"):
        control.after_requeue("1", exclude=["n1; rm -rf /"], start=False, run=calls.append)
    assert calls == []


def test_after_requeue_excludes_then_sets_a_future_start_and_retries_while_not_yet_pending():
    """Both updates come from the job itself: ExcNodeList first, StartTime ahead by max(backoff, margin)."""
    calls: list[list[str]] = []
    refusals = iter([True, True, False, False])

    def run(args: list[str]) -> str:
        calls.append(args)
        if next(refusals):
            raise control.SlurmCommandError("scontrol update failed (exit 1): Job is no longer pending execution")
        return ""
    applied = control.after_requeue("7_2", 0, exclude=["n1", "n3"], margin_s=5, run=run, sleep=lambda s: None)
    assert applied == ["update jobid=7_2 ExcNodeList=n1,n3", "update jobid=7_2 StartTime=now+5"]
    assert len(calls) == 4  # two refusals of the first update, retried
    assert control.after_requeue("7", 30, margin_s=5, run=lambda a: "") == ["update jobid=7 StartTime=now+30"]


def test_a_requeued_job_with_a_node_floor_asks_for_the_floors_task_count_before_it_may_start():
    """requeue.min_nodes below the allocation: NumTasks = floor x tasks per node, set before StartTime."""
    assert control.floor_tasks(1, 2, 2) == 2
    assert control.floor_tasks(6, 9, 4) == 24  # 8 nodes + 1 spare, shrink to 6
    assert control.floor_tasks(0, 2, 2) is None and control.floor_tasks(2, 2, 2) is None
    applied = control.after_requeue("7", 0, exclude=["n2"], tasks=2, margin_s=5, run=lambda a: "")
    assert applied == ["update jobid=7 NumTasks=2", "update jobid=7 ExcNodeList=n2", "update jobid=7 StartTime=now+5"]
    assert control.after_requeue("7", start=False, tasks=2, run=lambda a: "") == ["update jobid=7 NumTasks=2"]


def test_the_stop_hook_asks_for_the_floor_only_with_in_job_restart_and_a_floor_below_the_nodes():
    from conftest import compose_cfg

    from xirang_hpc.config.validate import load_config
    from xirang_hpc.runtime.signals import requeue_floor_tasks

    base = ["cluster=testbed", "cluster.nodes=2", "cluster.tasks_per_node=2", "parallel.pp=1", "parallel.tp=1"]
    assert requeue_floor_tasks(load_config(compose_cfg([*base, "requeue.min_nodes=1"]))) == 2
    assert requeue_floor_tasks(load_config(compose_cfg([*base, "requeue.min_nodes=0"]))) is None
    assert requeue_floor_tasks(load_config(compose_cfg([*base, "requeue.min_nodes=1",
                                                        "requeue.max_restarts_in_job=0"]))) is None


def test_after_requeue_gives_up_after_retry_s_and_raises_other_errors_at_once():
    """A refusal that outlasts retry_s, or any other scontrol error, is raised (the caller logs it)."""
    def refuse(args: list[str]) -> str:
        raise control.SlurmCommandError("Job is no longer pending execution")
    with pytest.raises(control.SlurmCommandError, match="pending"):
        control.after_requeue("7", exclude=["n1"], run=refuse, retry_s=1.0, sleep=lambda s: None)
    calls: list[list[str]] = []

    def denied(args: list[str]) -> str:
        calls.append(args)
        raise control.SlurmCommandError("Access/permission denied")
    with pytest.raises(control.SlurmCommandError, match="denied"):
        control.after_requeue("7", run=denied, sleep=lambda s: None)
    assert len(calls) == 1


def test_start_margin_from_the_environment_is_checked():
    """XIRANG_REQUEUE_START_MARGIN_S: whole seconds >= 1, else an error that names the variable."""
    assert control.start_margin_s({}) == control.START_MARGIN_S
    assert control.start_margin_s({"XIRANG_REQUEUE_START_MARGIN_S": "30"}) == 30
    for bad in ("0", "-3", "2.5", "soon"):
        with pytest.raises(control.SlurmCommandError, match="XIRANG_REQUEUE_START_MARGIN_S"):
            control.start_margin_s({"XIRANG_REQUEUE_START_MARGIN_S": bad})


def _fake_scontrol(states: dict[str, str], exc: str = "(null)"):
    """Canned ``scontrol`` answers for a 4-node partition ``low`` = n[1-4] (the logic under test is ours)."""
    def run(args: list[str], timeout_s: float = 30.0) -> str:
        if args[:2] == ["show", "job"]:
            return f"JobId=7 JobState=RUNNING ExcNodeList={exc} NumNodes=1"
        if args[:2] == ["show", "partition"]:
            return "PartitionName=low Nodes=n[1-4] TotalNodes=4"
        if args[:2] == ["show", "hostnames"]:
            return "\n".join(["n1", "n2", "n3", "n4"] if args[2] == "n[1-4]" else args[2].split(","))
        if args[:2] == ["show", "node"]:
            return "\n".join(f"NodeName={n} Arch=x86_64 State={s} Partitions=low" for n, s in states.items())
        raise AssertionError(args)
    return run


def test_exclusion_adds_failed_nodes_to_earlier_ones_but_never_strands_the_job(monkeypatch):
    from xirang_hpc.batch.supervise import exclusion

    healthy = {"n1": "IDLE", "n2": "DOWN+NOT_RESPONDING", "n3": "IDLE", "n4": "MIXED"}
    monkeypatch.setattr(control, "run_scontrol", _fake_scontrol(healthy, exc="n3"))
    assert exclusion("7", ["n1"], 1, "low") == ["n1", "n3"]  # n4 is left: the union is applied
    assert exclusion("7", ["n1"], 2, "low") == []  # n2 is down: excluding n1 + n3 leaves 1 node for 2
    drained = {**healthy, "n4": "IDLE+DRAIN"}
    monkeypatch.setattr(control, "run_scontrol", _fake_scontrol(drained, exc="n3"))
    assert exclusion("7", ["n1"], 1, "low") == []  # nothing usable would be left

    def broken(args: list[str], timeout_s: float = 30.0) -> str:
        raise control.SlurmCommandError("scontrol failed")
    monkeypatch.setattr(control, "run_scontrol", broken)
    assert exclusion("7", ["n1"], 1, "low") == []  # no exclusion; the requeue still happens


def test_status_says_how_much_requeue_budget_is_left(tmp_path):
    """``xirang-status RUN`` counts each class's requeues against its budget as the run's policy sets it."""
    import dataclasses
    import json
    import time

    from xirang_hpc.runs.render import render_run
    from xirang_hpc.runs.status import run_status

    cfg = load_config(compose_cfg(["requeue.failures_per_day=2", "requeue.budget_burst=3"]))
    (tmp_path / "config.json").write_text(json.dumps({"config": dataclasses.asdict(cfg)}))
    now = time.time()
    rows = _requeues("node_failure", "oom", "preemption", start=now - 86400.0)  # started a day ago
    (tmp_path / "events.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    s = run_status(tmp_path, now=now, run=lambda *a, **k: "")
    b = s["requeue_budget"]["classes"]
    assert (b["failures"]["used"], b["failures"]["allowed"], b["failures"]["left"]) == (2, 5, 3)  # 3 + 2 x 1 day
    assert (b["preemptions"]["used"], b["timeouts"]["used"]) == (1, 0)
    text = render_run(s)
    assert "failures 2 used, 3 left (3 + 2/day)" in text and "preemptions 1 used" in text, text
    (tmp_path / "config.json").write_text(json.dumps({"config": {**dataclasses.asdict(cfg),
                                                                  "requeue": {"enabled": False}}}))
    assert run_status(tmp_path, now=now, run=lambda *a, **k: "")["requeue_budget"] is None


def test_the_deprecated_total_cap_warns_at_launch():
    from xirang_hpc.cli.train import deprecation_notes

    assert deprecation_notes(load_config(compose_cfg([]))) == []
    (note,) = deprecation_notes(load_config(compose_cfg(["requeue.max_requeues=4"])))
    assert "requeue.max_requeues=4 is deprecated" in note and "requeue.failures_per_day" in note
