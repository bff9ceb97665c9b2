"""Placement: every site's expected start (``sbatch --test-only -M``), the policy's choice, the config as
submitted there."""

from __future__ import annotations

import dataclasses
import datetime as dt
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from xirang_hpc.config.errors import ConfigError
from xirang_hpc.config.schema import ClusterConfig, SiteConfig, XirangConfig
from xirang_hpc.monitor.events import append_event
from xirang_hpc.slurm.accounting import Caller, Result, call
from xirang_hpc.slurm.request import SlurmRequest

# `sbatch --test-only` (Slurm 22.05, recorded on the two-cluster testbed):
#   sbatch: Job 3 to start at 2026-11-30T18:30:06 using 1 processors on nodes sa1 in partition low
_TEST_ONLY_RE = re.compile(r"Job (?P<job>\d+) to start at (?P<start>\S+) using (?P<cpus>\d+) processors on "
                           r"nodes (?P<nodes>\S+) in partition (?P<partition>\S+)")
_UNKNOWN_RE = re.compile(r"No cluster '(?P<name>[^']+)' known by database")
TEST_ONLY_TIMEOUT_S = 30.0


class NoSiteAvailable(ConfigError):
    """No site of ``cluster.sites`` answered: nothing was submitted."""


@dataclass
class Estimate:
    """One site's answer: expected start (Unix seconds) or why it has none."""

    site: str
    start: float | None = None
    wait_s: float | None = None
    nodes: str = ""
    partition: str = ""
    free_cpus: float | None = None
    error: str = ""

    @property
    def alive(self) -> bool:
        """The site answered with an expected start."""
        return self.start is not None


@dataclass
class Placement:
    """The chosen site, the policy, every site's estimate and the warnings about dead sites."""

    site: SiteConfig
    policy: str
    reason: str
    estimates: list[Estimate] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    def evidence(self) -> list[dict[str, Any]]:
        """The estimates as JSON rows (for events.jsonl and --json)."""
        return [dataclasses.asdict(e) for e in self.estimates]

    def describe(self) -> str:
        """Human-readable lines: the choice, then one line per site."""
        lines = [f"placement: site {self.site.name} ({self.policy}: {self.reason})"]
        for e in self.estimates:
            if e.alive:
                quota = "" if e.free_cpus is None else f", free quota {_cpus(e.free_cpus)} CPUs"
                lines.append(f"  {e.site}: starts in {e.wait_s:.0f}s on {e.nodes} ({e.partition}){quota}")
            else:
                lines.append(f"  {e.site}: no answer ({e.error})")
        return "\n".join(lines)


def _cpus(v: float) -> str:
    return "unlimited" if v == float("inf") else f"{v:.0f}"


def site_cluster(c: ClusterConfig, site: SiteConfig) -> ClusterConfig:
    """The cluster config as submitted to ``site``: its partition/account/QOS replace the shared ones."""
    over = {k: getattr(site, k) for k in ("partition", "account", "qos") if getattr(site, k)}
    return dataclasses.replace(c, sites=[], **over)


def site_of(c: ClusterConfig, name: str) -> SiteConfig:
    """The site called ``name``; a name not in ``cluster.sites`` is refused, listing them."""
    for s in c.sites:
        if s.name == name:
            return s
    raise ConfigError("cluster.sites", name,
                      f"not a site of cluster {c.name!r}; its sites: {[s.name for s in c.sites]}")


def test_only_argv(c: ClusterConfig, site: SiteConfig, priority: str = "normal") -> list[str]:
    """``sbatch --test-only -M <site>`` with the job's shape, partition, QOS, account and time limit."""
    req = SlurmRequest.from_cluster(site_cluster(c, site), priority, cluster=site.name)
    return ["sbatch", "--test-only", *req.sbatch_args(), "--output=/dev/null", "--wrap=true"]


def test_only(argv: list[str]) -> Result:
    """Run one ``sbatch --test-only`` (the only subprocess of placement; tests pass recorded answers)."""
    return call(argv, timeout_s=TEST_ONLY_TIMEOUT_S)


def parse_test_only(site: str, r: Result, now: float) -> Estimate:
    """An :class:`Estimate` from ``sbatch --test-only``'s answer (it prints on stderr)."""
    text = f"{r.err}\n{r.out}"
    m = _TEST_ONLY_RE.search(text)
    if r.rc == 0 and m:
        # Slurm prints the controller's local time without a zone; the controller runs here or in our zone.
        start = dt.datetime.strptime(m.group("start"), "%Y-%m-%dT%H:%M:%S").timestamp()
        return Estimate(site, start, max(0.0, start - now), m.group("nodes"), m.group("partition"))
    u = _UNKNOWN_RE.search(text)
    if u:
        raise ConfigError("cluster.sites", site, "is not a cluster registered in slurmdbd (sacctmgr show cluster); "
                                                 "use the name the site's admin registered")
    err = " ".join(ln.strip() for ln in text.strip().splitlines()[-2:]) or f"exit {r.rc}"
    return Estimate(site, error=err)


def registered_clusters(run: Caller = call) -> list[str] | None:
    """Cluster names slurmdbd knows (``sacctmgr show cluster``); None when it does not answer."""
    r = run(["sacctmgr", "-n", "-P", "show", "cluster", "format=cluster"])
    names = [ln.strip() for ln in r.out.splitlines() if ln.strip()]
    return names if r.rc == 0 and names else None


def check_registered(c: ClusterConfig, registered: list[str] | None) -> None:
    """Refuse a site slurmdbd does not know, before anything is submitted, naming the registered ones."""
    if registered is None:
        return
    for s in c.sites:
        if s.name not in registered:
            raise ConfigError(f"cluster.sites[{s.name}].name", s.name,
                              f"slurmdbd knows the clusters {registered} (sacctmgr show cluster); use one of them "
                              "or ask the admin to register it (sacctmgr add cluster)")


def free_quota_cpus(site: SiteConfig, account: str | None, run: Caller = call) -> float | None:
    """CPUs ``account`` may still use on ``site``: its GrpTRES cpu limit minus its running and pending jobs'
    CPUs (``inf`` without a limit; None when the site does not answer)."""
    if not account:
        return float("inf")
    a = run(["sacctmgr", "-n", "-P", "show", "assoc", f"cluster={site.name}", f"account={account}",
             "format=User,GrpTRES"])
    if a.rc != 0:
        return None
    limit = float("inf")
    for ln in a.out.splitlines():
        user, _, tres = ln.partition("|")
        m = re.search(r"(?:^|,)cpu=(\d+)", tres)
        if not user.strip() and m:  # the account's own row (no user) carries the group limit
            limit = float(m.group(1))
    q = run(["squeue", "-M", site.name, "-h", "-A", account, "-t", "RUNNING,PENDING", "-o", "%C"])
    if q.rc != 0:
        return None
    used = sum(int(t) for t in q.out.split() if t.isdigit())
    return limit - used


def choose(sites: Sequence[SiteConfig], estimates: Sequence[Estimate], policy: str, current: str | None = None,
           stay_s: float = 600.0) -> Placement:
    """Pick a site from the estimates (pure; :func:`place` gathers them)."""
    by_name = {s.name: s for s in sites}
    warnings = [f"site {e.site} does not answer ({e.error}); placing the job on the other sites"
                for e in estimates if not e.alive]
    alive = [e for e in estimates if e.alive]
    if not alive:
        raise NoSiteAvailable("cluster.sites", [s.name for s in sites],
                              "no site answered `sbatch --test-only` (" + "; ".join(f"{e.site}: {e.error}" for e in
                                                                                      estimates)
                              + "); nothing was submitted. Check the sites' slurmctld (sinfo -M all)")
    earliest = min(alive, key=lambda e: (e.start, e.site))
    if policy == "quota":
        best = max(alive, key=lambda e: (e.free_cpus if e.free_cpus is not None else -1.0, -e.start, e.site))
        reason = (f"most free quota ({_cpus(best.free_cpus)} CPUs)" if best.free_cpus is not None
                  else "earliest start (quota unknown)")
        return Placement(by_name[best.site], policy, reason, list(estimates), warnings)
    if policy == "stay" and current:
        here = next((e for e in alive if e.site == current), None)
        if here is not None:
            saved = here.start - earliest.start
            if saved <= stay_s:
                return Placement(by_name[current], policy, f"stays: another site saves {saved:.0f}s <= "
                                 f"site_stay_s={stay_s:.0f}s", list(estimates), warnings)
            return Placement(by_name[earliest.site], policy, f"moves: starts {saved:.0f}s sooner than on {current} "
                             f"(> site_stay_s={stay_s:.0f}s)", list(estimates), warnings)
    return Placement(by_name[earliest.site], policy, f"earliest start, in {earliest.wait_s:.0f}s",
                     list(estimates), warnings)


def place(cfg: XirangConfig, current: str | None = None, run: Caller | None = None,
          now: Callable[[], float] = time.time) -> Placement:
    """Ask every site of ``cfg.cluster.sites`` for its expected start and choose one by the site policy."""
    c = cfg.cluster
    if not c.sites:
        raise ConfigError("cluster.sites", [], "list the sites (Slurm clusters) to place the job on")
    return choose(c.sites, gather(cfg, run, now), c.site_policy, current, c.site_stay_s)


def gather(cfg: XirangConfig, run: Caller | None = None, now: Callable[[], float] = time.time) -> list[Estimate]:
    """Every site's :class:`Estimate` for the job (``sbatch --test-only -M``; free quota under ``quota``)."""
    c = cfg.cluster
    caller = run or call
    check_registered(c, registered_clusters(caller))
    ask = run or test_only
    estimates = []
    for s in c.sites:
        e = parse_test_only(s.name, ask(test_only_argv(c, s, cfg.train.priority)), now())
        if e.alive and c.site_policy == "quota":
            e.free_cpus = free_quota_cpus(s, site_cluster(c, s).account, caller)
        estimates.append(e)
    return estimates


def record_placement(run_dir: Path, p: Placement, **fields: Any) -> dict[str, Any]:
    """Append the choice and its evidence to ``events.jsonl`` (kind ``placement``)."""
    return append_event(run_dir, "placement", p.reason, site=p.site.name, policy=p.policy,
                        estimates=p.evidence(), warnings=p.warnings, **fields)


def apply_site(cfg: XirangConfig, site: SiteConfig) -> XirangConfig:
    """``cfg`` as submitted to ``site``: its partition/account/QOS, and its run root when it has one."""
    over = {k: getattr(site, k) for k in ("partition", "account", "qos") if getattr(site, k)}
    cluster = dataclasses.replace(cfg.cluster, **over)
    train = dataclasses.replace(cfg.train, runs_root=site.run_root) if site.run_root else cfg.train
    return dataclasses.replace(cfg, cluster=cluster, train=train)


# A move at a preemption (decision, copy, submission on the other site) took 19 s at moderate load and over
# 30 s at load average 20 on a 2-core node: below this grace time a run may be requeued where it was instead.
MOVE_GRACE_S = 60


def grace_warning(c: ClusterConfig, site: SiteConfig, run: Caller = call) -> str | None:
    """A warning when ``site``'s partition for the job preempts with less than :data:`MOVE_GRACE_S` of grace
    time while ``cluster.site_auto_migrate`` is on (``scontrol -M <site> show partition``); None when the
    grace is enough, the partition does not preempt, or Slurm does not answer (best effort)."""
    if not c.site_auto_migrate or len(c.sites) < 2:
        return None
    partition = site_cluster(c, site).partition
    r = run(["scontrol", "-M", site.name, "-o", "show", "partition", *([partition] if partition else [])])
    if r.rc != 0:
        return None
    rows = [dict(kv.split("=", 1) for kv in line.split() if "=" in kv)
            for line in r.out.splitlines() if line.startswith("PartitionName=")]
    want = (lambda x: x.get("PartitionName") == partition) if partition else (lambda x: x.get("Default") == "YES")
    row = next((x for x in rows if want(x)), None)
    if row is None or row.get("PreemptMode", "OFF").upper().startswith("OFF"):
        return None
    try:
        grace = int(row.get("GraceTime", "0"))
    except ValueError:
        return None
    if grace >= MOVE_GRACE_S:
        return None
    return (f"partition {row['PartitionName']} on site {site.name} gives a preempted job GraceTime={grace}s: "
            f"moving the run to another site at a preemption takes about 20-30 s, so with less than "
            f"{MOVE_GRACE_S}s it may be requeued on {site.name} instead (sysadmins: GraceTime={MOVE_GRACE_S} on "
            "preemptible partitions; users: cluster.site_auto_migrate=false to leave moves to the migrate command)")


def place_for_launch(cfg: XirangConfig, run: Caller | None = None, out: Callable[[str], None] = print,
                     warn: Callable[[str], None] | None = None) -> tuple[XirangConfig, Placement | None]:
    """``xirang-train`` with ``cluster.sites``: choose the site, print the choice and its evidence, return the
    config as submitted there. Without sites: ``cfg`` unchanged and no placement."""
    if not cfg.cluster.sites:
        return cfg, None
    p = place(cfg, run=run)
    grace = grace_warning(cfg.cluster, p.site, run or call)
    if grace:
        p.warnings.append(grace)
    for w in p.warnings:
        (warn or out)(f"warning: {w}")
    out(p.describe())
    return apply_site(cfg, p.site), p


# ---- the run's site and moving it -----------------------------------------------------------------------------
