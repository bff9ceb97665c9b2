"""Slurm's scheduler and accounting views as plain data: sacctmgr, sacct, sshare, squeue, sinfo, scontrol.

One tiny function runs a command (:func:`call`); everything else parses the machine-readable output
(``--parsable2``/``-P``: fields separated by ``|``, no trailing one; squeue/sinfo with ``|`` in their
format), so the parsers are tested on outputs recorded from a real cluster (tests/data/slurm/).
Field lists are fixed here and rows are read by position, because sacctmgr's headers differ from the
names it takes (``DefaultQOS`` prints ``Def QOS``).

sacctmgr and sacct talk to slurmdbd: when it (or its MariaDB) is down they fail and
:class:`AccountingDown` says so; squeue, sinfo, sshare and scontrol answer from slurmctld and keep
working. A cluster without accounting (``AccountingStorageType=accounting_storage/none``) has no
associations, QOS limits or history: :func:`accounting_enabled` tells.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from xirang_hpc.slurm.commands import Caller, Result, call  # noqa: F401 - re-exported: the runner callers pass

# The clients that take ``-M <cluster>`` (sacctmgr takes ``cluster=<name>`` in its query instead).
_PER_CLUSTER = ("squeue", "sinfo", "scontrol", "sshare", "sacct")


def on_cluster(run: Caller, cluster: str) -> Caller:
    """``run`` aimed at one Slurm cluster of several registered in one slurmdbd: ``-M <cluster>`` for the
    clients that take it, and the ``CLUSTER: <name>`` banner some print with it (sshare) dropped, so the
    parsers see the same text as on the default cluster."""

    def aimed(argv: list[str]) -> Result:
        if argv and argv[0] in _PER_CLUSTER and "-M" not in argv:
            argv = [argv[0], "-M", cluster, *argv[1:]]
        r = run(argv)
        out = "".join(ln for ln in r.out.splitlines(keepends=True) if not ln.startswith("CLUSTER: "))
        return Result(r.rc, out, r.err)

    return aimed


class SlurmQueryError(RuntimeError):
    """A Slurm command failed; the message names the command and quotes its error."""


class AccountingDown(SlurmQueryError):
    """slurmdbd (or the database behind it) does not answer: no associations, QOS or history now."""


# What sacct/sacctmgr print when slurmdbd or MariaDB is unreachable (Slurm 22.05, recorded).
_DB_DOWN = ("Connection refused", "Problem talking to the database", "persistent connection",
            "Unable to connect to database", "slurmdbd", "Database settings not recorded")


def _check(argv: list[str], r: Result) -> str:
    if r.rc == 0:
        return r.out
    err = " ".join(line.strip() for line in r.err.strip().splitlines()[-2:]) or f"exit {r.rc}"
    if argv[0] in ("sacct", "sacctmgr") and any(m in r.err for m in _DB_DOWN):
        raise AccountingDown(f"slurmdbd does not answer ({argv[0]}: {err}); quotas, QOS and job history "
                             "are unknown until it (and its database) is back")
    raise SlurmQueryError(f"{' '.join(argv[:3])} failed: {err}")


def parse_rows(text: str, fields: Sequence[str]) -> list[dict[str, str]]:
    """``|``-separated lines without a header -> one dict per line keyed by ``fields``.

    The last field takes any extra ``|`` (a job name may contain one).
    """
    rows = []
    for line in text.splitlines():
        if not line.strip():
            continue
        parts = line.split("|", len(fields) - 1)
        parts += [""] * (len(fields) - len(parts))
        rows.append(dict(zip(fields, parts)))
    return rows


def parse_tres(text: str) -> dict[str, int]:
    """``cpu=4,gres/gpu=2,mem=4000M`` -> ``{"cpu": 4, "gres/gpu": 2, "mem": 4000}`` (limits are counts)."""
    out: dict[str, int] = {}
    for item in text.split(","):
        k, sep, v = item.partition("=")
        if not sep or not k:
            continue
        num = "".join(ch for ch in v if ch.isdigit())
        if num:
            out[k.strip()] = int(num)
    return out


def parse_int(text: str) -> int | None:
    """A limit column: empty (no limit) -> None."""
    text = text.strip()
    return int(text) if text.isdigit() else None


def parse_config(text: str) -> dict[str, str]:
    """``scontrol show config`` (``Key = Value`` lines) -> dict."""
    out: dict[str, str] = {}
    for line in text.splitlines():
        k, sep, v = line.partition("=")
        if sep and k.strip() and " " not in k.strip():
            out[k.strip()] = v.strip()
    return out


def gpus_of(gres: str) -> int:
    """GPUs per node from squeue's ``%b`` (``gres:gpu:2``, ``gres/gpu:a100:4``, ``N/A``)."""
    total = 0
    for item in gres.split(","):
        if "gpu" not in item:
            continue
        last = item.rsplit(":", 1)[-1]
        total += int(last) if last.isdigit() else 1
    return total


@dataclass
class Assoc:
    """One association: an account (``user == ""``) or a user within an account, with its limits."""

    cluster: str
    account: str
    user: str
    partition: str
    parent: str
    shares: str
    grp_tres: dict[str, int]
    grp_jobs: int | None
    grp_submit: int | None
    max_jobs: int | None
    max_submit: int | None
    max_tres: dict[str, int]  # per job
    qos: list[str]
    default_qos: str


@dataclass
class Qos:
    """A QOS and its limits."""

    name: str
    priority: int
    preempt: list[str]
    preempt_mode: str
    grp_tres: dict[str, int]
    max_tres: dict[str, int]  # per job
    max_tres_pu: dict[str, int]  # per user
    max_jobs_pu: int | None
    max_submit_pu: int | None
    max_wall: str


@dataclass
class QueueJob:
    """A job squeue knows (running, pending, completing)."""

    job_id: str
    user: str
    account: str
    qos: str
    partition: str
    state: str
    reason: str
    cpus: int
    nodes: int
    gpus: int  # whole job
    time_used: str
    time_limit: str
    start: str
    submit: str
    nodelist: str
    dependency: str
    name: str


@dataclass
class Node:
    """One node in one partition (sinfo lists a node once per partition)."""

    name: str
    partition: str
    state: str
    cpus_alloc: int
    cpus_idle: int
    cpus_total: int
    reason: str


@dataclass
class Share:
    """One sshare line: an account (``user == ""``) or a user in it."""

    account: str
    user: str
    raw_shares: str
    norm_shares: float
    raw_usage: int
    effective_usage: float
    fairshare: float | None


@dataclass
class HistJob:
    """One sacct record (one per run of the job with ``-D``: a requeued job has several)."""

    job_id: str
    name: str
    user: str
    account: str
    qos: str
    partition: str
    state: str
    exit_code: str
    elapsed: str
    submit: str
    start: str
    end: str
    nnodes: int
    nodelist: str
    cpus: int
    cpu_seconds: int
    reason: str


# ---- the commands and their fields -------------------------------------------------------------

ASSOC_FIELDS = ("Cluster", "Account", "User", "Partition", "ParentName", "Share", "GrpTRES", "GrpJobs",
                "GrpSubmit", "MaxJobs", "MaxSubmit", "MaxTRES", "QOS", "DefaultQOS")
QOS_FIELDS = ("Name", "Priority", "Preempt", "PreemptMode", "GrpTRES", "MaxTRES", "MaxTRESPU", "MaxJobsPU",
              "MaxSubmitPU", "MaxWall")
SQUEUE_FIELDS = ("id", "user", "account", "qos", "partition", "state", "reason", "cpus", "nodes", "gres",
                 "used", "limit", "start", "submit", "nodelist", "dependency", "name")
SQUEUE_FORMAT = "%i|%u|%a|%q|%P|%T|%r|%C|%D|%b|%M|%l|%S|%V|%N|%E|%j"
SINFO_FIELDS = ("node", "partition", "state", "cpus", "reason")
SINFO_FORMAT = "%N|%P|%T|%C|%E"
SSHARE_FIELDS = ("Account", "User", "RawShares", "NormShares", "RawUsage", "EffectvUsage", "FairShare")
SACCT_FIELDS = ("JobID", "JobName", "User", "Account", "QOS", "Partition", "State", "ExitCode", "Elapsed",
                "Submit", "Start", "End", "NNodes", "NodeList", "AllocCPUS", "CPUTimeRAW", "Reason")


def commands(cluster: str = "") -> dict[str, list[str]]:
    """Every query this module makes, by name (the recorder in tests/data/slurm uses the same argv)."""
    where = [f"cluster={cluster}"] if cluster else []
    return {
        "config": ["scontrol", "show", "config"],
        "assoc": ["sacctmgr", "-n", "-P", "show", "assoc", *where, f"format={','.join(ASSOC_FIELDS)}"],
        "qos": ["sacctmgr", "-n", "-P", "show", "qos", f"format={','.join(QOS_FIELDS)}"],
        "accounts": ["sacctmgr", "-n", "-P", "show", "account", "format=Account"],
        "users": ["sacctmgr", "-n", "-P", "show", "user", "format=User,DefaultAccount"],
        "squeue": ["squeue", "--all", "-h", "-o", SQUEUE_FORMAT],
        "sinfo": ["sinfo", "-h", "-N", "-o", SINFO_FORMAT],
        "sshare": ["sshare", "-n", "-P", "-a", "-o", ",".join(SSHARE_FIELDS)],
    }


def sacct_argv(job_ids: Sequence[str] = (), since: str = "now-1hour", all_users: bool = True) -> list[str]:
    """sacct for the given jobs (any age), or every job that ran since ``since``; one line per run (-D)."""
    argv = ["sacct", "-n", "-P", "-X", "-D", f"--format={','.join(SACCT_FIELDS)}"]
    if job_ids:
        argv += ["-j", ",".join(job_ids)]
    else:
        argv += ["-S", since, "-E", "now"] + (["-a"] if all_users else [])
    return argv


def _f(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None


def _i(text: str, default: int = 0) -> int:
    return int(text) if text.strip().isdigit() else default


@dataclass
class SlurmDB:
    """Slurm's views through one caller (real commands by default, recorded outputs in tests)."""

    run: Caller = call
    cluster: str = ""
    _config: dict[str, str] | None = field(default=None, repr=False)

    def _out(self, argv: list[str]) -> str:
        return _check(argv, self.run(argv))

    def config(self) -> dict[str, str]:
        """slurmctld's configuration (``scontrol show config``), read once."""
        if self._config is None:
            self._config = parse_config(self._out(commands()["config"]))
            self.cluster = self.cluster or self._config.get("ClusterName", "")
        return self._config

    def accounting_enabled(self) -> bool:
        """Whether the cluster keeps accounting (slurmdbd): without it there are no quotas or history."""
        return "accounting_storage/none" not in self.config().get("AccountingStorageType", "accounting_storage/none")

    def enforced(self) -> str:
        """``AccountingStorageEnforce`` (e.g. ``associations,limits,qos``; ``none``)."""
        return self.config().get("AccountingStorageEnforce", "none")

    def associations(self) -> list[Assoc]:
        """Every association of this cluster (accounts and users, with limits)."""
        self.config()
        rows = parse_rows(self._out(commands(self.cluster)["assoc"]), ASSOC_FIELDS)
        return [Assoc(cluster=r["Cluster"], account=r["Account"], user=r["User"], partition=r["Partition"],
                      parent=r["ParentName"], shares=r["Share"], grp_tres=parse_tres(r["GrpTRES"]),
                      grp_jobs=parse_int(r["GrpJobs"]), grp_submit=parse_int(r["GrpSubmit"]),
                      max_jobs=parse_int(r["MaxJobs"]), max_submit=parse_int(r["MaxSubmit"]),
                      max_tres=parse_tres(r["MaxTRES"]), qos=[q for q in r["QOS"].split(",") if q],
                      default_qos=r["DefaultQOS"]) for r in rows]

    def qos(self) -> list[Qos]:
        """Every QOS and its limits."""
        rows = parse_rows(self._out(commands()["qos"]), QOS_FIELDS)
        return [Qos(name=r["Name"], priority=_i(r["Priority"]), preempt=[p for p in r["Preempt"].split(",") if p],
                    preempt_mode=r["PreemptMode"], grp_tres=parse_tres(r["GrpTRES"]), max_tres=parse_tres(r["MaxTRES"]),
                    max_tres_pu=parse_tres(r["MaxTRESPU"]), max_jobs_pu=parse_int(r["MaxJobsPU"]),
                    max_submit_pu=parse_int(r["MaxSubmitPU"]), max_wall=r["MaxWall"]) for r in rows]

    def accounts(self) -> list[str]:
        """Names of every account in the database."""
        return [r["Account"] for r in parse_rows(self._out(commands()["accounts"]), ("Account",))]

    def default_accounts(self) -> dict[str, str]:
        """user -> default account."""
        rows = parse_rows(self._out(commands()["users"]), ("User", "DefaultAccount"))
        return {r["User"]: r["DefaultAccount"] for r in rows}

    def jobs(self) -> list[QueueJob]:
        """Every job in squeue (all users, all partitions)."""
        out = []
        for r in parse_rows(self._out(commands()["squeue"]), SQUEUE_FIELDS):
            nodes = _i(r["nodes"], 1)
            out.append(QueueJob(job_id=r["id"], user=r["user"], account=r["account"], qos=r["qos"],
                                partition=r["partition"], state=r["state"], reason=r["reason"], cpus=_i(r["cpus"]),
                                nodes=nodes, gpus=gpus_of(r["gres"]) * nodes, time_used=r["used"],
                                time_limit=r["limit"], start=r["start"], submit=r["submit"], nodelist=r["nodelist"],
                                dependency=r["dependency"], name=r["name"]))
        return out

    def nodes(self) -> list[Node]:
        """Every node, once per partition it is in (``low*``: the default partition keeps its star)."""
        out = []
        for r in parse_rows(self._out(commands()["sinfo"]), SINFO_FIELDS):
            alloc, idle, _other, total = ([_i(x) for x in r["cpus"].split("/")] + [0, 0, 0, 0])[:4]
            out.append(Node(name=r["node"], partition=r["partition"], state=r["state"], cpus_alloc=alloc,
                            cpus_idle=idle, cpus_total=total, reason=r["reason"] if r["reason"] != "none" else ""))
        return out

    def shares(self) -> list[Share]:
        """Fair-share figures per account and user (``sshare -a``; answers without slurmdbd)."""
        out = []
        for r in parse_rows(self._out(commands()["sshare"]), SSHARE_FIELDS):
            out.append(Share(account=r["Account"].strip(), user=r["User"], raw_shares=r["RawShares"],
                             norm_shares=_f(r["NormShares"]) or 0.0, raw_usage=_i(r["RawUsage"]),
                             effective_usage=_f(r["EffectvUsage"]) or 0.0, fairshare=_f(r["FairShare"])))
        return out

    def history(self, job_ids: Sequence[str] = (), since: str = "now-1hour") -> list[HistJob]:
        """sacct records: of ``job_ids`` (any age), else of every job since ``since``."""
        argv = sacct_argv(job_ids, since)
        out = []
        for r in parse_rows(self._out(argv), SACCT_FIELDS):
            out.append(HistJob(job_id=r["JobID"], name=r["JobName"], user=r["User"], account=r["Account"],
                               qos=r["QOS"], partition=r["Partition"], state=r["State"], exit_code=r["ExitCode"],
                               elapsed=r["Elapsed"], submit=r["Submit"], start=r["Start"], end=r["End"],
                               nnodes=_i(r["NNodes"]), nodelist=r["NodeList"], cpus=_i(r["AllocCPUS"]),
                               cpu_seconds=_i(r["CPUTimeRAW"]), reason=r["Reason"]))
        return out


def as_dict(obj: Any) -> Any:
    """A dataclass (or a list of them) as JSON-ready data."""
    import dataclasses

    if isinstance(obj, list):
        return [as_dict(o) for o in obj]
    return dataclasses.asdict(obj) if dataclasses.is_dataclass(obj) else obj


def qos_names(run: Callable[..., Result] = call, timeout_s: float = 10.0) -> list[str] | None:
    """The QOS names the cluster's accounting defines (``sacctmgr show qos``); None when it does not answer
    (no sacctmgr, accounting_storage/none, slurmdbd down)."""
    r = run(["sacctmgr", "-n", "-P", "show", "qos", "format=name"], timeout_s=timeout_s)
    names = [line.strip() for line in r.out.splitlines() if line.strip()]
    return names if r.rc == 0 and names else None
