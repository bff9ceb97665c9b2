"""Quotas, pending reasons, sacct history and the queue view on outputs recorded from a real cluster.

tests/data/slurm/*.json were recorded by tests/data/slurm/record.py on the accounting testbed
(tools/slurm-testbed: slurmdbd + MariaDB, accounts proja/projb, QOS normal/high/scavenger) with
account proja limited to GrpTRES=cpu=4, user root in proja to MaxJobs=3 MaxSubmit=5, QOS scavenger
to MaxJobsPU=1, and jobs: 10 (proja, 2 CPUs, running), 12 (proja, 4 CPUs, AssocGrpCpuLimit), 13 (proja,
6 CPUs: can never run; Slurm shows reason None), 14/15 (scavenger, one running, one
QOSMaxJobsPerUserLimit), 17 (DependencyNeverSatisfied), 18 (BeginTime); 8 finished after one
requeue, 9 failed with exit code 3. ``dbd_down`` is the same cluster with slurmdbd stopped.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from xirang_hpc.config.validate import load_config
from xirang_hpc.slurm.accounting import AccountingDown, HistJob, Result, SlurmDB, gpus_of, parse_rows, parse_tres
from xirang_hpc.slurm.jobs import slurm_state
from xirang_hpc.slurm.queue import gather, node_class, plot_utilization, render_queue, utilization
from xirang_hpc.slurm.quotas import QuotaError, Request, check_fit, explain_reason, resolve_association
from xirang_hpc.submit.quota_check import QuotaRefused, check_quota

DATA = Path(__file__).parent / "data" / "slurm"


def recorded(name: str, patch: dict[str, Result] | None = None):
    """A caller that answers with the recorded outputs (an unrecorded command fails like a missing one)."""
    rec = json.loads((DATA / f"{name}.json").read_text())

    def caller(argv: list[str]) -> Result:
        key = " ".join(argv)
        if patch and argv[0] in patch:
            return patch[argv[0]]
        r = rec.get(key)
        return Result(**r) if r else Result(127, "", f"not recorded: {key}")
    return caller


def runner(name: str):
    """The same outputs through jobstate's runner (stdout or None); ``squeue -j`` answered from ``squeue --all``."""
    call = recorded(name)
    db = SlurmDB(run=call)

    def run(argv: list[str]) -> str | None:
        if argv[:2] == ["squeue", "-h"] and "-j" in argv:
            jid = argv[argv.index("-j") + 1]
            return "".join(f"{j.state}|{j.reason}\n" for j in db.jobs() if j.job_id == jid)
        if argv[0] == "scontrol" and argv[1:3] == ["show", "job"]:
            return None
        r = call(argv)
        return r.out if r.rc == 0 else None
    return run


@pytest.fixture()
def busy() -> SlurmDB:
    return SlurmDB(run=recorded("busy"))


def test_parsers_read_parsable_output() -> None:
    assert parse_tres("cpu=4,gres/gpu=2,mem=4000M") == {"cpu": 4, "gres/gpu": 2, "mem": 4000}
    assert parse_tres("") == {}
    assert parse_rows("a|b|c|d\n\n", ["x", "y", "z"]) == [{"x": "a", "y": "b", "z": "c|d"}]
    assert gpus_of("gres:gpu:2") == 2 and gpus_of("gres/gpu:a100:4") == 4 and gpus_of("N/A") == 0
    assert node_class("mixed") == "busy" and node_class("drained*") == "drained" and node_class("down*") == "down"
    assert node_class("idle") == "idle" and node_class("allocated") == "busy"


def test_recorded_cluster_parses(busy: SlurmDB) -> None:
    assert busy.accounting_enabled() and busy.cluster == "xirang-testbed"
    proja = next(a for a in busy.associations() if a.account == "proja" and not a.user)
    root = next(a for a in busy.associations() if a.account == "proja" and a.user == "root")
    assert proja.grp_tres == {"cpu": 4} and (root.max_jobs, root.max_submit) == (3, 5)
    assert root.qos == ["high", "normal", "scavenger"] and root.default_qos == "normal"
    scav = next(q for q in busy.qos() if q.name == "scavenger")
    assert scav.max_jobs_pu == 1 and scav.preempt_mode == "requeue"
    jobs = {j.job_id: j for j in busy.jobs()}
    assert jobs["12"].reason == "AssocGrpCpuLimit" and jobs["12"].cpus == 4 and jobs["10"].state == "RUNNING"
    assert {n.name for n in busy.nodes()} == {"q1", "q2"}
    assert any(s.user == "root" and s.fairshare is not None for s in busy.shares())


def test_pending_reasons_in_words(busy: SlurmDB) -> None:
    jobs, assocs, qos, nodes = busy.jobs(), busy.associations(), busy.qos(), busy.nodes()
    words = {j.job_id: explain_reason(j, jobs, assocs, qos, nodes) for j in jobs if j.state == "PENDING"}
    assert words["12"] == "account proja uses 2 of its 4 CPUs; this job waits for 4"
    assert "asks for 6: it can never start; scancel 13" in words["13"]  # Slurm itself says only "None"
    assert words["15"] == "user root runs 1 jobs under QOS scavenger, which allows 1 per user (MaxJobsPerUser)"
    assert "can never start" in words["17"]
    assert words["18"].startswith("not eligible before 2026-")
    # Without slurmdbd (no limits known) the reason is still said in words, without numbers.
    assert "CPU quota" in explain_reason(jobs[[j.job_id for j in jobs].index("12")], jobs)


def test_history_of_a_job_that_left_squeue() -> None:
    done = slurm_state("8", runner("busy"))
    assert done["source"] == "sacct" and done["state"] == "COMPLETED" and done["restarts"] == "1"
    assert done["exit_code"] == "0:0" and done["nodes"] == "q[1-2]" and done["num_nodes"] == "2"
    assert int(done["cpu_seconds"]) > 0 and "1 restart(s)" in done["reason"]
    failed = slurm_state("9", runner("busy"))
    assert (failed["state"], failed["exit_code"], failed["restarts"]) == ("FAILED", "3:0", "0")
    pending = slurm_state("12", runner("busy"))
    assert pending["reason"] == "AssocGrpCpuLimit: account proja uses 2 of its 4 CPUs; this job waits for 4"
    assert slurm_state("8", runner("dbd_down")) == {}  # sacct down, squeue forgot it: nothing invented


def test_fit_now_wait_never(busy: SlurmDB) -> None:
    assocs, qos, jobs, nodes = busy.associations(), busy.qos(), busy.jobs(), busy.nodes()
    ch = resolve_association(assocs, qos, "root", None, None, "proja", "xirang-testbed")
    assert (ch.account, ch.qos) == ("proja", "normal")
    assert check_fit(ch, Request(cpus=2, partition="low"), jobs, nodes).verdict == "now"
    wait = check_fit(ch, Request(cpus=3, partition="low"), jobs, nodes)
    assert wait.verdict == "wait" and wait.reasons == ["AssocGrpCpuLimit"]
    assert "account proja (GrpTRES) uses 2 of its 4 CPUs; this job waits for 3" in wait.lines[-1]
    never = check_fit(ch, Request(cpus=6, partition="low"), jobs, nodes)
    assert never.verdict == "never" and "allows 4 CPUs; this job asks for 6" in never.lines[-1]
    # root has 3 jobs submitted in proja and may have 5 (MaxSubmitJobs): an array of 3 more is refused.
    over = check_fit(ch, Request(cpus=1, partition="low", tasks=3), jobs, nodes)
    assert over.verdict == "never" and "MaxSubmitJobs=5, this submission adds 3" in over.lines[-1]
    assert check_fit(ch, Request(cpus=1, partition="low", tasks=2), jobs, nodes).verdict == "now"
    # The scavenger QOS allows one running job per user, and root runs one: a second waits.
    sc = resolve_association(assocs, qos, "root", "projb", "scavenger", "proja", "xirang-testbed")
    assert check_fit(sc, Request(cpus=1, partition="low"), jobs, nodes).reasons == ["QOSMaxJobsPerUserLimit"]
    # projb has no quota and 5 of 8 CPUs are idle: 6 CPUs fit the quota but wait for resources.
    pb = resolve_association(assocs, qos, "root", "projb", None, "proja", "xirang-testbed")
    res = check_fit(pb, Request(cpus=6, partition="low"), jobs, nodes)
    assert res.reasons == ["Resources"] and "5 of 8 CPUs idle" in res.lines[-1]


def test_bad_account_qos_user_are_refused_with_the_valid_ones(busy: SlurmDB) -> None:
    assocs, qos = busy.associations(), busy.qos()
    with pytest.raises(QuotaError, match=r"'projx' does not exist .* may submit to: proja, projb, root"):
        resolve_association(assocs, qos, "root", "projx", None, "proja", "xirang-testbed")
    with pytest.raises(QuotaError, match=r"QOS 'gold' does not exist.*valid QOS: normal, high, scavenger"):
        resolve_association(assocs, qos, "root", "proja", "gold", "proja", "xirang-testbed")
    with pytest.raises(QuotaError, match=r"no association with account 'proja'.*sacctmgr -i add user xirang17200 "
                                         r"Account=proja Cluster=xirang-testbed"):
        resolve_association(assocs, qos, "xirang17200", "proja", None, "projb", "xirang-testbed")
    with pytest.raises(QuotaError, match=r"user 'alice' has no Slurm association.*sacctmgr -i add user alice "
                                         r"Account=<account> Cluster=xirang-testbed \(accounts: proja, projb\)"):
        resolve_association(assocs, qos, "alice", None, None, None, "xirang-testbed")


def _cfg(*over: str):
    from hydra import compose, initialize_config_module

    from xirang_hpc.submit.hydra_setup import register_configs

    register_configs()
    with initialize_config_module(version_base="1.3", config_module="xirang_hpc.conf"):
        over = ("cluster=testbed", "parallel.pp=1", "parallel.tp=1", *over)
        return load_config(compose(config_name="config", overrides=list(over)))


def test_train_quota_check_states_refuses_and_survives_a_dbd_outage() -> None:
    # cluster=testbed: 2 nodes x 2 ranks x 1 CPU in partition high, charged to root's default account proja.
    lines, fit = check_quota(_cfg("cluster.tasks_per_node=1", "cluster.nodes=1", "cluster.cpus_per_task=2"),
                             SlurmDB(run=recorded("busy")), user="root")
    assert fit is not None and fit.verdict == "now" and "fits now: 2 CPUs within the quota" in lines[-1]
    assert lines[0].startswith("quota (cluster xirang-testbed, account proja, QOS normal): account proja: 4 CPUs")
    lines, fit = check_quota(_cfg(), SlurmDB(run=recorded("busy")), user="root")  # 4 CPUs, proja uses 2 of 4
    assert fit.verdict == "wait" and lines[-1].endswith(
        "will wait (AssocGrpCpuLimit): account proja (GrpTRES) uses 2 of its 4 CPUs; this job waits for 4")
    with pytest.raises(QuotaRefused, match=r"can never run under the quota(.|\n)*allows 4 CPUs; this job asks for 8"):
        check_quota(_cfg("cluster.cpus_per_task=2"), SlurmDB(run=recorded("busy")), user="root")
    with pytest.raises(QuotaRefused, match=r"valid QOS: normal, high, scavenger") as e:
        check_quota(_cfg("cluster.qos=gold"), SlurmDB(run=recorded("busy")), user="root")
    assert e.value.field == "cluster.qos"
    lines, fit = check_quota(_cfg("cluster.account=projx"), SlurmDB(run=recorded("dbd_down")), user="root")
    assert fit is None and "cannot check the quota: slurmdbd does not answer" in lines[0]
    assert "Submitting anyway" in lines[0]
    off = Result(0, "AccountingStorageType   = accounting_storage/none\nClusterName = c\n", "")
    lines, fit = check_quota(_cfg(), SlurmDB(run=recorded("busy", {"scontrol": off})), user="root")
    assert fit is None and "keeps no accounting" in lines[0]
    with pytest.raises(AccountingDown):
        SlurmDB(run=recorded("dbd_down")).qos()


def test_queue_view_busy_and_dbd_down(tmp_path: Path) -> None:
    from datetime import datetime

    now = datetime.fromisoformat("2026-11-30T17:53:20").timestamp()  # just after the recording (sacct's local time)
    snap = gather(SlurmDB(run=recorded("busy")), "root", now=now)
    text = render_queue(snap)
    assert "accounting: slurmdbd answers (enforce associations,limits,qos)" in text
    assert "AssocGrpCpuLimit: account proja uses 2 of its 4 CPUs; this job waits for 4" in text
    assert [p["name"] for p in snap["partitions"]] == ["low", "high"] and snap["partitions"][0]["default"]
    q = {(r["account"], r["user"]): r for r in snap["quotas"]}
    assert (q[("proja", "")]["cpu_used"], q[("proja", "")]["cpu_limit"]) == (2, 4)
    assert (q[("proja", "root")]["max_jobs"], q[("proja", "root")]["max_submit"]) == (3, 5)
    assert any(f["user"] == "xirang17200" for f in snap["fairshare"])
    assert snap["utilization"]["capacity_cpus"] == 8 and snap["utilization"]["jobs"] >= 2
    json.dumps(snap)
    info = plot_utilization(snap, tmp_path / "q.png")
    assert (tmp_path / "q.png").stat().st_size > 1000 and info["points"] == 60
    down = gather(SlurmDB(run=recorded("dbd_down")), "root", now=now)
    text = render_queue(down)
    assert "slurmdbd DOWN" in text and "Connection refused" in text
    assert "AssocGrpCpuLimit" in text and "q1" in text  # squeue and sinfo still shown
    assert down["utilization"] is None and down["quotas"] == [] and down["fairshare"]


def test_utilization_counts_only_the_window() -> None:
    def h(start: str, end: str, cpus: int) -> HistJob:
        return HistJob("1", "x", "u", "a", "q", "p", "COMPLETED", "0:0", "", "", start, end, 1, "n1", cpus, 0, "")

    from datetime import datetime
    now = datetime.fromisoformat("2026-01-01T12:00:00").timestamp()
    u = utilization([h("2026-01-01T10:00:00", "2026-01-01T11:30:00", 4),  # half inside
                     h("2026-01-01T11:50:00", "Unknown", 8)], 8, now)  # running for 10 minutes
    assert u["cpu_seconds"] == 1800 * 4 + 600 * 8
    assert u["fraction"] == round((1800 * 4 + 600 * 8) / (8 * 3600), 4)
    assert u["series"][-1][1] == 1.0 and u["series"][0][1] == 0.5


def test_status_queue_cli_plain_json_watch_and_no_slurm(monkeypatch, capsys, tmp_path: Path) -> None:
    import xirang_hpc.slurm.accounting as accounting
    from xirang_hpc.cli import status as status_cli

    answers = {"name": "busy"}

    class Recorded(SlurmDB):
        def __init__(self) -> None:
            super().__init__(run=recorded(answers["name"]) if answers["name"] else
                             (lambda argv: Result(127, "", f"{argv[0]}: command not found")))

    monkeypatch.setattr(accounting, "SlurmDB", Recorded)
    assert status_cli.main(["--queue"]) == 0
    out = capsys.readouterr().out
    assert "JOBS: 2 running, 5 pending" in out and "QUOTAS (accounts, and user " in out
    assert status_cli.main(["--queue", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["cluster"] == "xirang-testbed"
    sleeps: list[float] = []

    def sleep(s: float) -> None:  # --watch refreshes until Ctrl-C
        sleeps.append(s)
        if len(sleeps) == 2:
            raise KeyboardInterrupt
    monkeypatch.setattr(status_cli.time, "sleep", sleep)
    assert status_cli.main(["--queue", "--watch", "--interval", "3"]) == 0
    assert capsys.readouterr().out.count("cluster xirang-testbed") == 2 and sleeps == [3.0, 3.0]
    assert status_cli.main(["--queue", "--plot", str(tmp_path / "u.png")]) == 0
    assert "60 points" in capsys.readouterr().out and (tmp_path / "u.png").exists()
    answers["name"] = ""
    assert status_cli.main(["--queue"]) == 2
    assert "no Slurm answers here: scontrol show config failed" in capsys.readouterr().err
