"""``xirang-status --queue --sites``: every Slurm cluster of one slurmdbd side by side. Each site is asked with
``-M <site>`` (``cluster=<site>`` for sacctmgr); the answers here mimic Slurm 22.05 on the two-cluster testbed
(alpha full: one 2-node job and one pending; beta idle; sshare prints a ``CLUSTER:`` banner under -M)."""

from __future__ import annotations

import pytest

from xirang_hpc.slurm.accounting import Result, on_cluster
from xirang_hpc.slurm.queue import gather_sites, render_sites

SQUEUE = {"alpha": "20|root|proja|normal|low|RUNNING|None|16|2|N/A|0:17|30:00|2026-11-30T21:41:13|"
                   "2026-11-30T21:41:12|sa[1-2]|(null)|fill\n"
                   "21|root|proja|normal|low|PENDING|Resources|2|1|N/A|0:00|30:00|N/A|2026-11-30T21:41:20|||"
                   "xirang-default\n",
          "beta": ""}
SINFO = {"alpha": "sa1|low*|allocated|8/0/0/8|none\nsa2|low*|allocated|8/0/0/8|none\n",
         "beta": "sb1|low*|idle|0/8/0/8|none\nsb2|low*|idle|0/8/0/8|none\n"}
ASSOC = "{c}|proja||||1|cpu=24|||||||normal\n{c}|proja|root|||1||||||||normal\n"


class Sites:
    """Answers per cluster; every call must name its cluster (-M or cluster=)."""

    def __init__(self, dead: str = "") -> None:
        self.calls: list[list[str]] = []
        self.dead = dead

    def __call__(self, argv: list[str]) -> Result:
        self.calls.append(argv)
        if argv[0] == "sacctmgr":
            if argv[4] != "assoc":
                return Result(0, "", "")
            site = next(a.split("=", 1)[1] for a in argv if a.startswith("cluster="))
            return Result(0, ASSOC.format(c=site), "")
        assert argv[1] == "-M", argv  # the site, never the default cluster
        site = argv[2]
        if site == self.dead:
            return Result(1, "", f"{argv[0]}: error: Unable to contact slurm controller (connect failure)")
        cmd = argv[0]
        if cmd == "scontrol":
            return Result(0, f"ClusterName = {site}\nAccountingStorageType = accounting_storage/slurmdbd\n"
                             "AccountingStorageEnforce = associations,limits,qos\n", "")
        if cmd == "sinfo":
            return Result(0, SINFO[site], "")
        if cmd == "squeue":
            return Result(0, SQUEUE[site], "")
        if cmd == "sshare":
            return Result(0, f"CLUSTER: {site}\nproja||1|1.0|0|0.0|1.0\n", "")
        return Result(0, "", "")


def test_on_cluster_aims_every_client_and_drops_the_banner():
    seen = []

    def run(argv):
        seen.append(argv)
        return Result(0, "CLUSTER: beta\nroot|\n", "")

    r = on_cluster(run, "beta")(["sshare", "-n", "-P"])
    assert seen == [["sshare", "-M", "beta", "-n", "-P"]] and r.out == "root|\n"
    on_cluster(run, "beta")(["sacctmgr", "-n", "show", "qos"])
    assert seen[-1] == ["sacctmgr", "-n", "show", "qos"]  # sacctmgr names the cluster in its query


def test_every_site_side_by_side_with_nodes_jobs_and_quota():
    fake = Sites()
    m = gather_sites(["alpha", "beta"], "root", run=fake, now=1.0e9)
    rows = {r["site"]: r for r in m["summary"]}
    assert rows["alpha"] | {"quotas": None, "errors": None} == {
        "site": "alpha", "answers": True, "nodes": 2, "busy": 2, "idle": 0, "down": 0, "cpus_alloc": 16,
        "cpus_total": 16, "running": 1, "pending": 1, "quotas": None, "errors": None}
    assert rows["alpha"]["quotas"] == [{"account": "proja", "cpu_used": 16, "cpu_limit": 24, "gpu_used": 0,
                                        "gpu_limit": None}]
    assert rows["beta"]["busy"] == 0 and rows["beta"]["idle"] == 2 and rows["beta"]["running"] == 0
    assert rows["beta"]["quotas"][0]["cpu_used"] == 0
    text = render_sites(m)
    lines = text.splitlines()
    assert lines[1].split()[:2] == ["SITE", "NODES"]
    assert lines[2].split()[:8] == ["alpha", "2", "2", "0", "0", "16/16", "1", "1"] and "proja 16/24" in lines[2]
    assert lines[3].split()[:8] == ["beta", "2", "0", "2", "0", "0/16", "0", "0"]
    assert "site alpha" in text and "site beta" in text


def test_a_dead_site_is_named_and_the_others_still_shown():
    m = gather_sites(["alpha", "beta"], "root", run=Sites(dead="beta"), now=1.0e9)
    rows = {r["site"]: r for r in m["summary"]}
    assert rows["alpha"]["answers"] and not rows["beta"]["answers"]
    line = next(ln for ln in render_sites(m).splitlines() if ln.startswith("beta"))
    assert "no answer" in line and "Unable to contact slurm controller" in line


@pytest.mark.parametrize("argv, msg", [(["--sites", "alpha"], "--sites goes with --queue")])
def test_sites_without_queue_is_refused(argv, msg, capsys):
    from xirang_hpc.cli.status import main

    assert main(argv) == 2 and msg in capsys.readouterr().err
