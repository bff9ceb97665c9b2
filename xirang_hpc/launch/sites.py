"""Several Slurm clusters as one: placement on the site that starts a job soonest, and moving a run.

Built on Slurm's own multi-cluster operation (clusters registered in one slurmdbd, ``-M <cluster>``):

- :func:`place` asks every site of ``cluster.sites`` for its expected start with
  ``sbatch --test-only -M <site>`` (one tiny call, :func:`test_only`), and picks one by
  ``cluster.site_policy``: ``earliest`` start; ``quota`` (most free CPUs in the account's GrpTRES
  limit on that site, earliest start among equals); ``stay`` (the current site unless another starts
  the job more than ``cluster.site_stay_s`` sooner). A site that does not answer is left out with a
  warning naming it; no site answering raises :class:`NoSiteAvailable` (nothing is submitted). A site
  name slurmdbd does not know is refused, listing the registered ones.
- :func:`copy_run` moves a run to another site's run root when the sites do not share a filesystem:
  the newest checkpoint that verifies at the source (plus the steps it references) is copied under a
  temporary name, verified against its manifest's checksums at the destination, and only then renamed
  into place; the run's records follow. A copy interrupted at any point leaves only a temporary
  (``step_N.tmp-copy-...``) that nothing loads and the next start removes.
- :func:`should_migrate` is the trigger: a run preempted on its site moves when its requeue there
  would wait longer than ``cluster.site_migrate_wait_s`` and another site starts it sooner.
  :func:`migrate_at_preemption` is the job's own move (called by the batch script's supervisor at a
  preemption; the current site's wait from :func:`held_until`, the preemptor's end);
  :func:`migrate` the same by hand for a run already requeued.

The choice and its evidence (expected start per site) go to ``events.jsonl`` (kind ``placement``);
a copy records its step, bytes and seconds (kind ``migrate_copy``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as dt
import json
import os
import re
import shutil
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from xirang_hpc.checkpoint.naming import committed_steps, step_dir_name
from xirang_hpc.config.errors import ConfigError
from xirang_hpc.config.schema import ClusterConfig, SiteConfig, XirangConfig
from xirang_hpc.config.validate import scheduling_class
from xirang_hpc.monitor.events import append_event
from xirang_hpc.monitor.slurmdb import Caller, Result, call

# `sbatch --test-only` (Slurm 22.05, recorded on the two-cluster testbed):
#   sbatch: Job 3 to start at 2026-11-30T18:30:06 using 1 processors on nodes sa1 in partition low
_TEST_ONLY_RE = re.compile(r"Job (?P<job>\d+) to start at (?P<start>\S+) using (?P<cpus>\d+) processors on "
                           r"nodes (?P<nodes>\S+) in partition (?P<partition>\S+)")
_UNKNOWN_RE = re.compile(r"No cluster '(?P<name>[^']+)' known by database")
TEST_ONLY_TIMEOUT_S = 30.0
CKPT_DIR = "checkpoints"
# Never copied with a run's records: its per-site Slurm state (job ownership, submitit folders, logs).
# The per-restart rank markers (ranks/) belong to the old site's job ids and restart counts.
_NOT_RECORDS = {CKPT_DIR, "submitit", "slurm", "job.json", ".submit.lock", "ranks", "slurm_job.json"}


def _layout() -> Any:
    """``checkpoint.layout``, imported when a copy needs it: it pulls in torch, which takes seconds (more
    on a loaded node), and the decision at a preemption runs inside the grace time without it."""
    from xirang_hpc.checkpoint import layout

    return layout


def _corrupt() -> type[Exception]:
    from xirang_hpc.checkpoint.storage import CheckpointCorruptError

    return CheckpointCorruptError


class NoSiteAvailable(ConfigError):
    """No site of ``cluster.sites`` answered: nothing was submitted."""


class CopyError(RuntimeError):
    """A run could not be copied to another site (nothing usable there; the run stays where it was)."""


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
    sc = site_cluster(c, site)
    partition, qos = scheduling_class(sc, priority)
    argv = ["sbatch", "--test-only", f"--clusters={site.name}", f"--nodes={sc.nodes}",
            f"--ntasks-per-node={sc.tasks_per_node}", f"--cpus-per-task={sc.cpus_per_task}", f"--time={sc.time_min}"]
    if partition:
        argv.append(f"--partition={partition}")
    if qos:
        argv.append(f"--qos={qos}")
    if sc.account:
        argv.append(f"--account={sc.account}")
    if sc.gpus_per_node:
        argv.append(f"--gpus-per-node={sc.gpus_per_node}")
    return [*argv, "--output=/dev/null", "--wrap=true"]


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


def _slurm_time(text: str) -> float | None:
    try:
        return dt.datetime.strptime(text, "%Y-%m-%dT%H:%M:%S").timestamp()
    except ValueError:
        return None


def hostnames(expr: str, run: Caller = call) -> list[str]:
    """A Slurm hostlist (``sa[1-2]``) -> names (``scontrol show hostnames``); [] for ``(null)``/empty."""
    if not expr or expr in ("(null)", "N/A"):
        return []
    r = run(["scontrol", "show", "hostnames", expr])
    return r.out.split() if r.rc == 0 else []


def held_until(site: str, nodes: Sequence[str], job_id: str, run: Caller = call) -> tuple[float | None, list[str]]:
    """When the jobs that take ``nodes`` from a preempted job on ``site`` end, and their ids.

    At a preemption ``sbatch --test-only`` is no guide to the requeue's start: the preempted job still
    holds its nodes and the job that preempts it is pending, so Slurm's will-run test answers "now".
    The preemptor is visible in ``squeue --start``: a pending job scheduled onto the preempted job's
    nodes (SCHEDNODES) or already running there. The requeue cannot start on those nodes before it
    ends (its start + time limit); ``inf`` for a job without a limit; None when none is found.
    """
    from xirang_hpc.runtime.slurmctl import parse_duration

    r = run(["squeue", "-M", site, "-h", "-t", "PENDING,RUNNING", "-o", "%i|%S|%l|%Y|%N|%T"])
    if r.rc != 0:
        return None, []
    mine, latest, who = set(nodes), None, []
    for line in r.out.splitlines():
        parts = line.strip().split("|")
        if len(parts) != 6 or parts[0] == job_id:
            continue
        jid, start, limit, sched, alloc, state = parts
        on = hostnames(sched if state == "PENDING" else alloc, run)
        begin = _slurm_time(start)
        if not mine & set(on) or begin is None:
            continue
        dur = parse_duration(limit)
        end = float("inf") if dur is None else begin + dur
        latest = end if latest is None else max(latest, end)
        who.append(jid)
    return latest, who


def record_placement(run_dir: Path, p: Placement, **fields: Any) -> dict[str, Any]:
    """Append the choice and its evidence to ``events.jsonl`` (kind ``placement``)."""
    return append_event(run_dir, "placement", p.reason, site=p.site.name, policy=p.policy,
                        estimates=p.evidence(), warnings=p.warnings, **fields)


def site_run_dir(run_dir: Path, runs_root: str | Path, site: SiteConfig) -> Path:
    """Where ``run_dir`` (under ``runs_root``) lives on ``site``: the same name under the site's run root."""
    if not site.run_root:
        return run_dir
    root = Path(runs_root).expanduser().absolute()
    rel = run_dir.relative_to(root) if run_dir.is_relative_to(root) else Path(run_dir.name)
    return Path(site.run_root).expanduser().absolute() / rel


def should_migrate(current: str, p: Placement, wait_limit_s: float) -> bool:
    """Move a preempted run: its requeue on ``current`` waits longer than ``wait_limit_s`` (or ``current``
    does not answer) and the placement chose another site."""
    if p.site.name == current:
        return False
    here = next((e for e in p.estimates if e.site == current), None)
    return here is None or not here.alive or (here.wait_s or 0.0) > wait_limit_s


# ---- copying a run to another site ---------------------------------------------------------------------------


@dataclass
class CopyResult:
    """What a verified copy moved: the step, bytes and files of checkpoint data, and how long it took."""

    step: int | None
    bytes: int
    files: int
    seconds: float
    dst: str


def newest_good_step(ckpt_root: Path) -> int | None:
    """The newest committed step whose files (and referenced steps) match their manifest checksums."""
    for step in sorted(committed_steps(ckpt_root), reverse=True):
        try:
            _layout().verify(ckpt_root / step_dir_name(step))
            return step
        except _corrupt():
            continue
    return None


def _steps_needed(ckpt_root: Path, step: int) -> list[str]:
    """``step`` and every step it references (dedup), references first."""
    order: list[str] = []

    def visit(name: str) -> None:
        if name in order:
            return
        for ref in _layout().read_manifest(ckpt_root / name).get("refs", []):
            visit(Path(ref).name)
        order.append(name)

    visit(step_dir_name(step))
    return order


Copier = Callable[[Path, Path], Any]


def _copy_step(src: Path, dst_root: Path, copier: Copier) -> tuple[int, int]:
    """Copy one committed step dir under a temporary name, verify it there, then rename it into place."""
    final = dst_root / src.name
    if final.is_dir():
        try:
            _layout().verify(final)
            return 0, 0  # already there and good (an earlier copy of a referenced step)
        except _corrupt():
            pass
    tmp = dst_root / f"{src.name}.tmp-copy-{os.getpid()}-{time.time_ns()}"
    tmp.mkdir(mode=0o700)
    nbytes = nfiles = 0
    try:
        manifest = _layout().read_manifest(src)
        # The manifest last: a temporary without it is visibly unfinished.
        names = sorted(manifest["files"]) + [_layout().MANIFEST]
        for name in names:
            copier(src / name, tmp / name)
            nbytes += (tmp / name).stat().st_size
            nfiles += 1
        _layout().verify(tmp)
    except (OSError, _corrupt()) as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        raise CopyError(f"copy of {src} to {dst_root} failed verification or I/O ({exc}); nothing was used, "
                        "the run stays where it was") from exc
    _layout().fsync_path(tmp)
    if final.exists():
        shutil.rmtree(final)
    os.rename(tmp, final)
    _layout().fsync_path(dst_root)
    return nbytes, nfiles


def _copy_records(src_run: Path, dst_run: Path) -> None:
    """The run's records (events, metrics, config, ...) next to the copied checkpoint; each file is written
    under a temporary name and renamed, so a record is whole or absent."""
    for p in sorted(src_run.iterdir()):
        if p.name in _NOT_RECORDS or p.name.startswith("."):
            continue
        target = dst_run / p.name
        if p.is_dir():
            shutil.copytree(p, target, dirs_exist_ok=True)
        elif p.is_file():
            tmp = dst_run / f".{p.name}.copy-{os.getpid()}"
            shutil.copy2(p, tmp)
            os.replace(tmp, target)


def copy_run(src_run: Path, dst_run: Path, copier: Copier = shutil.copyfile,
             clock: Callable[[], float] = time.monotonic) -> CopyResult:
    """Copy the newest good checkpoint of ``src_run`` and its records into ``dst_run`` (verified).

    The destination's ``latest`` moves only after every copied file matched its manifest checksum; an
    error or a kill at any point leaves at most a temporary the next start removes. The copy's step,
    bytes and seconds are appended to both runs' ``events.jsonl`` (kind ``migrate_copy``).
    """
    t0 = clock()
    src_ckpt, dst_ckpt = src_run / CKPT_DIR, dst_run / CKPT_DIR
    step = newest_good_step(src_ckpt)
    _layout().make_dir(dst_run, 0o700)
    nbytes = nfiles = 0
    if step is not None:
        _layout().make_dir(dst_ckpt, 0o700)
        _layout().cleanup_leftovers(dst_ckpt)
        for name in _steps_needed(src_ckpt, step):
            b, f = _copy_step(src_ckpt / name, dst_ckpt, copier)
            nbytes, nfiles = nbytes + b, nfiles + f
        _layout().verify(dst_ckpt / step_dir_name(step))
        _layout().write_latest(dst_ckpt, step)
    _copy_records(src_run, dst_run)
    res = CopyResult(step, nbytes, nfiles, clock() - t0, str(dst_run))
    for run_dir in (src_run, dst_run):
        append_event(run_dir, "migrate_copy", "checkpoint copied and verified", step=step, bytes=nbytes,
                     files=nfiles, seconds=round(res.seconds, 3), src=str(src_run), dst=str(dst_run))
    return res


# ---- submission -----------------------------------------------------------------------------------------------


def apply_site(cfg: XirangConfig, site: SiteConfig) -> XirangConfig:
    """``cfg`` as submitted to ``site``: its partition/account/QOS, and its run root when it has one."""
    over = {k: getattr(site, k) for k in ("partition", "account", "qos") if getattr(site, k)}
    cluster = dataclasses.replace(cfg.cluster, **over)
    train = dataclasses.replace(cfg.train, runs_root=site.run_root) if site.run_root else cfg.train
    return dataclasses.replace(cfg, cluster=cluster, train=train)


def place_for_launch(cfg: XirangConfig, run: Caller | None = None, out: Callable[[str], None] = print,
                     warn: Callable[[str], None] | None = None) -> tuple[XirangConfig, Placement | None]:
    """``xirang-train`` with ``cluster.sites``: choose the site, print the choice and its evidence, return the
    config as submitted there. Without sites: ``cfg`` unchanged and no placement."""
    if not cfg.cluster.sites:
        return cfg, None
    p = place(cfg, run=run)
    for w in p.warnings:
        (warn or out)(f"warning: {w}")
    out(p.describe())
    return apply_site(cfg, p.site), p


# ---- the run's site and moving it -----------------------------------------------------------------------------

SITE_FILE = "site.json"


def write_site_state(run_dir: Path, cfg: XirangConfig, data_dir: Path, site: str, job_id: str,
                     run_at: Path | None = None) -> dict[str, Any]:
    """``<run>/site.json``: the site the run is on, its job there, where its run directory is now
    (``run_at``, default ``run_dir``), the config and data to resubmit it elsewhere, and the run's
    history across sites (appended, oldest first)."""
    old = read_site_state(run_dir) or {}
    at = str(run_at or run_dir)
    history = [*old.get("history", []), {"site": site, "job": job_id, "run_dir": at, "time": time.time()}]
    state = {"site": site, "job": job_id, "run_dir": at, "data_dir": str(data_dir),
             "config": dataclasses.asdict(cfg), "history": history}
    tmp = run_dir / f".{SITE_FILE}.{os.getpid()}.tmp"
    tmp.write_text(json.dumps(state, indent=1, default=str))
    os.chmod(tmp, 0o600)
    os.replace(tmp, run_dir / SITE_FILE)
    return state


def read_site_state(run_dir: Path) -> dict[str, Any] | None:
    """The run's ``site.json`` (None for a run placed on one cluster only, or unreadable)."""
    try:
        return json.loads((run_dir / SITE_FILE).read_text())
    except (OSError, ValueError):
        return None


def cancel_on(site: str, job_id: str, run: Caller = call) -> Result:
    """``scancel -M <site> <job>`` (the run's pending requeue on the site it leaves)."""
    return run(["scancel", "-M", site, job_id])


def _default_submit(c: XirangConfig, d: Path, data: Path, site: str,
                    handover: tuple[str, str | None] | None = None) -> Any:
    from xirang_hpc.job.training import run_training
    from xirang_hpc.launch.slurm import submit as slurm_submit

    return slurm_submit(c, d, data, run_training, dataclasses.asdict(c), str(d), str(data), site=site,
                        handover=handover)


def _move(run_dir: Path, state: dict[str, Any], cfg: XirangConfig, p: Placement, current: str,
          submit: Callable[..., Any], before_submit: Callable[[], Any] | None = None,
          handover: tuple[str, str | None] | None = None, **why: Any) -> dict[str, Any]:
    """Copy (when the target has its own run root), then submit on the target site; record it all."""
    target = p.site
    t0 = time.monotonic()
    runs_root = Path(site_of(cfg.cluster, current).run_root or cfg.train.runs_root)
    dst = site_run_dir(run_dir, runs_root, target) if target.run_root else run_dir
    record_placement(run_dir, p, moving_from=current, **why)
    copied = None
    if dst != run_dir:  # the target site has its own run root: copy and verify before the job starts there
        copied = copy_run(run_dir, dst)  # CopyError: nothing cancelled or submitted, the run stays on `current`
    if before_submit is not None:
        before_submit()
    new_cfg = apply_site(cfg, target)
    job = submit(new_cfg, dst, Path(state["data_dir"]), target.name, **({"handover": handover} if handover else {}))
    job_id = str(getattr(job, "job_id", job))
    # The new site's state carries the history; the old run dir points at where the run went.
    write_site_state(dst, new_cfg, Path(state["data_dir"]), target.name, job_id)
    if dst != run_dir:
        write_site_state(run_dir, cfg, Path(state["data_dir"]), target.name, job_id, run_at=dst)
    facts = {"from": current, "to": target.name, "job": job_id, "dst": str(dst),
             "copy_s": round(copied.seconds, 3) if copied else 0.0, "copy_bytes": copied.bytes if copied else 0,
             "step": copied.step if copied else None, "seconds": round(time.monotonic() - t0, 3),
             "estimates": p.evidence(), **why}
    for d in {run_dir, dst}:
        append_event(d, "migrate", p.reason, **facts)
    return facts


def migrate(run_dir: Path, run: Caller | None = None, submit: Callable[..., Any] | None = None,
            force_site: str | None = None, out: Callable[[str], None] = print,
            now: Callable[[], float] = time.time) -> dict[str, Any] | None:
    """Move a preempted (requeued, pending) run to the site where it starts soonest.

    Placement runs with the run's current site as ``current``; the run moves when
    :func:`should_migrate` says so with ``cluster.site_migrate_wait_s`` (or to ``force_site``).
    The newest good checkpoint and the records are copied and verified first (without a shared
    filesystem), then the pending job on the old site is cancelled and the job submitted on the new
    site. A failed copy raises :class:`CopyError` before anything is cancelled or submitted: the run
    keeps its place in the old site's queue. Returns the move's facts, or None when the run stays.
    """
    state, cfg = _load_state(run_dir)
    current = state["site"]
    p = place(cfg, current=current, run=run, now=now)
    if force_site:
        p = dataclasses.replace(p, site=site_of(cfg.cluster, force_site), reason=f"forced to {force_site}")
    elif not should_migrate(current, p, cfg.cluster.site_migrate_wait_s):
        out(f"run stays on {current}: {p.reason}")
        return None
    facts = _move(run_dir, state, cfg, p, current, submit or _default_submit,
                  before_submit=lambda: cancel_on(current, str(state["job"]), run or call), trigger="command")
    out(f"moved run from {current} to {p.site.name} (job {facts['job']}, {facts['dst']}); copy "
        f"{facts['copy_bytes']} bytes in {facts['copy_s']:.2f}s")
    return facts


def _load_state(run_dir: Path) -> tuple[dict[str, Any], XirangConfig]:
    from omegaconf import OmegaConf

    from xirang_hpc.config.validate import load_config

    state = read_site_state(run_dir)
    if state is None:
        raise ConfigError("run", str(run_dir), f"has no {SITE_FILE}: it was not placed on several sites "
                                                "(list them in cluster.sites)")
    return state, load_config(OmegaConf.create(state["config"]))


# Job-specific variables a job submitted from inside another job must not inherit (sbatch exports the
# environment): a stale SLURM_RESTART_COUNT or array id would give the new job a wrong identity.
_KEEP_ENV = {"SLURM_CONF"}


@contextlib.contextmanager
def _clean_job_env() -> Iterator[None]:
    saved = {k: v for k, v in os.environ.items()
             if k.startswith(("SLURM_", "SBATCH_", "SUBMITIT_", "XIRANG_INJOB")) and k not in _KEEP_ENV}
    for k in saved:
        del os.environ[k]
    try:
        yield
    finally:
        os.environ.update(saved)


def migrate_at_preemption(run_dir: Path, job_id: str, current: str, nodes: Sequence[str],
                          run: Caller | None = None, submit: Callable[..., Any] | None = None,
                          now: Callable[[], float] = time.time,
                          before_submit: Callable[[], Any] | None = None) -> dict[str, Any] | None:
    """The job's own move at a preemption (called by the batch script's supervisor, launch/supervise.py).

    Places the run again with ``current`` as its site. ``current``'s expected start is the later of
    ``sbatch --test-only`` and the end of the jobs that take the preempted job's ``nodes``
    (:func:`held_until`). When that wait exceeds ``cluster.site_migrate_wait_s`` and another site starts
    the run sooner, the newest good checkpoint is copied and verified (separate run roots) and the run is
    submitted there (``sbatch -M``) by this job, which is then not requeued: the caller cancels it. The
    decision and its evidence (expected start per site, the preempting jobs, copy bytes and seconds) go
    to ``events.jsonl`` (kinds ``placement``/``migrate``, or ``migrate_check`` when the run stays).
    Returns the move's facts, or None when the run stays (the caller requeues it here as usual).
    Raises :class:`CopyError`/:class:`ConfigError` when the move failed before anything was submitted.
    ``before_submit`` runs after the verified copy, right before the submission (the supervisor makes its
    own job non-requeueable there, so Slurm's preemption cannot requeue it beside the moved run).
    """
    state, cfg = _load_state(run_dir)
    if not cfg.cluster.site_auto_migrate:
        return None
    caller = run or call
    estimates = gather(cfg, run, now)
    until, preemptors = held_until(current, nodes, job_id, caller)
    t = now()
    for e in estimates:
        if e.site == current and e.alive and until is not None and until > (e.start or 0.0):
            e.start = until if until != float("inf") else t + 365 * 86400.0
            e.wait_s = max(0.0, e.start - t)
            e.error = f"nodes held by job(s) {','.join(preemptors)}"
    p = choose(cfg.cluster.sites, estimates, cfg.cluster.site_policy, current, cfg.cluster.site_stay_s)
    limit = cfg.cluster.site_migrate_wait_s
    if not should_migrate(current, p, limit):
        append_event(run_dir, "migrate_check", f"stays on {current}: {p.reason}", site=current, job=job_id,
                     estimates=p.evidence(), preempted_by=preemptors, site_migrate_wait_s=limit)
        return None
    with _clean_job_env():
        return _move(run_dir, state, cfg, p, current, submit or _default_submit, handover=(job_id, current),
                     before_submit=before_submit, trigger="preemption", preempted_by=preemptors, old_job=job_id,
                     site_migrate_wait_s=limit)


def main(argv: list[str] | None = None) -> int:
    """``python -m xirang_hpc.launch.sites migrate RUN_DIR [--to SITE]``: move a preempted run now."""
    import argparse
    import sys

    ap = argparse.ArgumentParser(prog="python -m xirang_hpc.launch.sites", description=main.__doc__)
    ap.add_argument("action", choices=["migrate"])
    ap.add_argument("run_dir", type=Path)
    ap.add_argument("--to", default=None, help="move to this site whatever the placement says")
    a = ap.parse_args(argv)
    try:
        migrate(a.run_dir.absolute(), force_site=a.to)
    except (ConfigError, CopyError) as exc:
        print(f"xirang: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
