"""What ``tools/slurm-testbed`` would start: its generated configuration (``conf`` writes it, starts nothing).

The slurm-tier tests rely on these settings (accounting, QOS enforcement, cgroup tracking, preemption,
ports inside the block, per-testbed node names); a change that drops one fails here, in seconds,
instead of as a confusing end-to-end failure.
"""

from __future__ import annotations

import os
import stat
import subprocess
from pathlib import Path

import pytest

from xirang_hpc.runtime.topology import PORT_BASE, PORT_SPAN

SCRIPT = Path(__file__).resolve().parents[1] / "tools" / "slurm-testbed"


def _conf(tmp_path: Path, *args: str, **env: str) -> Path:
    d = tmp_path / "tb"
    full = {**{k: v for k, v in os.environ.items() if not k.startswith("XIRANG_SLURM_")},
            "XIRANG_SLURM_DIR": str(d), "XIRANG_SLURM_PORT": "17100", **env}
    out = subprocess.run(["bash", str(SCRIPT), "conf", *args], capture_output=True, text=True, env=full, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().endswith(f"SLURM_CONF={d / 'slurm.conf'}"), out.stdout
    return d


def _keys(path: Path) -> dict[str, str]:
    keys: dict[str, str] = {}
    for line in path.read_text().splitlines():
        if line and not line.startswith("#") and not line.startswith(("NodeName=", "PartitionName=")):
            k, _, v = line.partition("=")
            keys[k] = v
    return keys


def _lines(path: Path, prefix: str) -> list[str]:
    return [ln for ln in path.read_text().splitlines() if ln.startswith(prefix)]


def test_default_is_accounting_cgroup_and_partition_preemption(tmp_path):
    d = _conf(tmp_path)
    k = _keys(d / "slurm.conf")
    assert k["AccountingStorageType"] == "accounting_storage/slurmdbd"
    assert k["AccountingStorageEnforce"] == "associations,limits,qos"
    assert k["AccountingStoragePass"] == str(d / "run" / "munge.socket")  # else clients use the system munge
    assert k["PriorityType"] == "priority/multifactor"
    assert k["JobAcctGatherType"] == "jobacct_gather/linux"
    assert (k["ProctrackType"], k["TaskPlugin"]) == ("proctrack/cgroup", "task/cgroup")
    assert (k["PreemptType"], k["PreemptMode"]) == ("preempt/partition_prio", "REQUEUE")
    assert "preempt_send_user_signal" in k["SlurmctldParameters"]
    cg = _keys(d / "cgroup.conf")
    assert cg["CgroupPlugin"] == "cgroup/v1" and cg["ConstrainCores"] == "no"
    dbd = d / "slurmdbd.conf"
    assert stat.S_IMODE(dbd.stat().st_mode) == 0o600  # it holds the database password
    dk = _keys(dbd)
    assert int(dk["DbdPort"]) == int(k["AccountingStoragePort"]) == 17108
    assert int(dk["StoragePort"]) == 17109 and dk["StoragePass"]
    assert stat.S_IMODE(d.stat().st_mode) == 0o700
    nodes = _lines(d / "slurm.conf", "NodeName=")
    assert [n.split()[0] for n in nodes] == ["NodeName=n1", "NodeName=n2"]
    ports = [int(k["SlurmctldPort"])] + [int(n.split("Port=")[1].split()[0]) for n in nodes]
    assert ports == [17100, 17101, 17102]
    parts = _lines(d / "slurm.conf", "PartitionName=")
    assert "PartitionName=low" in parts[0] and "PriorityTier=1 " in parts[0] and "PreemptMode=REQUEUE" in parts[0]
    assert "PartitionName=high" in parts[1] and "PriorityTier=10" in parts[1]


def test_options_qos_preemption_no_accounting_node_prefix(tmp_path):
    d = _conf(tmp_path, XIRANG_SLURM_PREEMPT="qos", XIRANG_SLURM_NODE_PREFIX="tb")
    assert _keys(d / "slurm.conf")["PreemptType"] == "preempt/qos"
    assert [n.split()[0] for n in _lines(d / "slurm.conf", "NodeName=")] == ["NodeName=tb1", "NodeName=tb2"]
    d2 = _conf(tmp_path / "2", XIRANG_SLURM_ACCOUNTING="0", XIRANG_SLURM_PROCTRACK="linuxproc")
    k = _keys(d2 / "slurm.conf")
    assert k["AccountingStorageType"] == "accounting_storage/none" and "PriorityType" not in k
    assert k["ProctrackType"] == "proctrack/linuxproc" and not (d2 / "slurmdbd.conf").exists()


def test_two_clusters_share_one_slurmdbd_with_distinct_nodes_and_ports(tmp_path):
    d = _conf(tmp_path, "--clusters", "alpha,beta")
    a, b = _keys(d / "alpha.conf"), _keys(d / "beta.conf")
    assert (a["ClusterName"], b["ClusterName"]) == ("alpha", "beta")
    assert a["AccountingStoragePort"] == b["AccountingStoragePort"] == "17108"
    assert (a["SlurmctldPort"], b["SlurmctldPort"]) == ("17100", "17110")
    assert a["StateSaveLocation"] != b["StateSaveLocation"]
    assert (d / "slurm.conf").read_text() == (d / "alpha.conf").read_text()  # the default SLURM_CONF
    names = [n.split()[0] for f in ("alpha.conf", "beta.conf") for n in _lines(d / f, "NodeName=")]
    assert names == ["NodeName=a1", "NodeName=a2", "NodeName=b1", "NodeName=b2"]


def _srun_ports(conf: Path) -> range:
    lo, hi = _keys(conf)["SrunPortRange"].split("-")
    return range(int(lo), int(hi) + 1)


def test_side_by_side_clusters_give_their_sruns_disjoint_ports_outside_the_ephemeral_range(tmp_path):
    """Slurm 22.05's srun acts on any slurmctld message that reaches its port, whatever its job id: the clusters
    that run side by side on one host (CI's two testbeds, the two-cluster testbed) must not hand out each
    other's srun ports, nor ports the kernel gives to anyone (a late message to an ended srun's port would
    reach whoever holds it now)."""
    ranges = []
    for port in ("16817", "16917"):  # CI's two testbeds, as single clusters and as two clusters
        one = _conf(tmp_path / port, XIRANG_SLURM_PORT=port)
        two = _conf(tmp_path / f"{port}-2", "--clusters", "alpha,beta", XIRANG_SLURM_PORT=port)
        assert _srun_ports(one / "slurm.conf") == _srun_ports(two / "alpha.conf")
        ranges += [_srun_ports(two / "alpha.conf"), _srun_ports(two / "beta.conf")]
    lo, hi = (int(x) for x in Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    for i, r in enumerate(ranges):
        assert len(r) >= 1000 and (r.stop <= lo or r.start > hi), (r, lo, hi)
        assert r.start >= PORT_BASE + PORT_SPAN  # above the job rendezvous ports
        for other in ranges[i + 1 :]:
            assert not set(r) & set(other), (r, other)


@pytest.mark.parametrize("env,args,says", [
    ({"XIRANG_SLURM_PREEMPT": "both"}, (), "use partition or qos"),
    ({"XIRANG_SLURM_ACCOUNTING": "0"}, ("--clusters", "alpha,beta"), "need accounting"),
    ({}, ("--clusters", "alpha,apple"), "'a' repeats"),
    ({}, ("--clusters", "Alpha"), "lower-case"),
])
def test_bad_settings_are_refused_naming_the_value(tmp_path, env, args, says):
    full = {**{k: v for k, v in os.environ.items() if not k.startswith("XIRANG_SLURM_")},
            "XIRANG_SLURM_DIR": str(tmp_path / "tb"), **env}
    out = subprocess.run(["bash", str(SCRIPT), "conf", *args], capture_output=True, text=True, env=full, timeout=300)
    assert out.returncode != 0 and says in out.stderr, out.stderr
    assert not (tmp_path / "tb").exists()
