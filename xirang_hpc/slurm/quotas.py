"""Quotas and pending reasons in words: decisions over Slurm's data (:mod:`xirang_hpc.slurm.accounting`).

- :func:`resolve_association` finds the association a submission is charged to and refuses an
  account or QOS that does not exist (listing the valid ones) or a user without an association
  (with the ``sacctmgr`` line the admin must run);
- :func:`check_fit` states the quota (``GrpTRES`` cpu / gres/gpu of the account, ``MaxJobs`` /
  ``MaxSubmitJobs`` of the user association, the QOS's per-user limits), the current use, and
  whether a job fits now, must wait (and why), or can never run;
- :func:`explain_reason` turns squeue's pending reason into a sentence with the numbers behind it.

Use is counted from squeue (running jobs' CPUs/GPUs per account, the user's running and submitted
jobs per association), which is what slurmctld enforces; limits come from sacctmgr.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from xirang_hpc.slurm.accounting import Assoc, Node, Qos, QueueJob

# TRES a training job asks for, and how to say them.
TRES_WORDS = {"cpu": "CPUs", "gres/gpu": "GPUs", "node": "nodes"}
ACTIVE = ("RUNNING", "COMPLETING", "CONFIGURING", "SUSPENDED", "STOPPED")


class QuotaError(ValueError):
    """A submission Slurm would refuse or never run; the message has the numbers and the fix."""


@dataclass(frozen=True)
class Request:
    """What a job asks for in total."""

    cpus: int
    gpus: int = 0
    nodes: int = 1
    partition: str = ""
    tasks: int = 1  # jobs this submission adds (an array's tasks each count for MaxSubmitJobs)

    def tres(self) -> dict[str, int]:
        """The request as TRES counts."""
        return {"cpu": self.cpus, "gres/gpu": self.gpus, "node": self.nodes}


@dataclass
class Charge:
    """Where a submission is charged: the user association (and its account's) and the QOS."""

    user: str
    account: str
    qos: str
    user_assoc: Assoc
    account_assoc: Assoc | None
    qos_rec: Qos | None


@dataclass
class Fit:
    """Verdict on a job: ``now`` | ``wait`` | ``never``; ``lines`` say the quota, the use and why."""

    verdict: str
    lines: list[str] = field(default_factory=list)
    reasons: list[str] = field(default_factory=list)  # Slurm reason names the job will wait with


def sacctmgr_add_user(user: str, account: str, cluster: str) -> str:
    """The line an admin runs to let ``user`` submit to ``account``."""
    return f"sacctmgr -i add user {user} Account={account}" + (f" Cluster={cluster}" if cluster else "")


def resolve_association(assocs: Sequence[Assoc], qos_list: Sequence[Qos], user: str, account: str | None,
                        qos: str | None, default_account: str | None, cluster: str = "") -> Charge:
    """The association and QOS a submission by ``user`` will be charged to, or :class:`QuotaError`.

    ``account``/``qos`` None: Slurm's defaults (the user's default account, the association's default
    QOS, else ``normal``).
    """
    accounts = sorted({a.account for a in assocs})
    # A user's associations; partition-specific ones only where the user has no general one.
    mine = [a for a in assocs if a.user == user and not a.partition] or [a for a in assocs if a.user == user]
    if not mine:
        acct = account or "<account>"
        raise QuotaError(
            f"user {user!r} has no Slurm association on cluster {cluster or '?'}, and this cluster enforces "
            f"associations, so Slurm refuses every job of this user. Ask the admin to run: "
            f"{sacctmgr_add_user(user, acct, cluster)} (accounts: {', '.join(a for a in accounts if a != 'root')})")
    mine_names = sorted({a.account for a in mine})
    if account is None:
        account = default_account if default_account in mine_names else mine_names[0]
    if account not in accounts:
        raise QuotaError(f"cluster.account={account!r} does not exist on cluster {cluster or '?'}; user {user!r} "
                         f"may submit to: {', '.join(mine_names)} (set cluster.account to one of them)")
    if account not in mine_names:
        raise QuotaError(f"user {user!r} has no association with account {account!r}, so Slurm refuses the job; "
                         f"user {user!r} may submit to: {', '.join(mine_names)}. Or ask the admin to run: "
                         f"{sacctmgr_add_user(user, account, cluster)}")
    user_assoc = next(a for a in mine if a.account == account)
    account_assoc = next((a for a in assocs if a.account == account and not a.user and not a.partition), None)
    names = [q.name for q in qos_list]
    qos_name = qos or user_assoc.default_qos or ("normal" if "normal" in names else (user_assoc.qos or [""])[0])
    if qos_name not in names:
        raise QuotaError(f"QOS {qos_name!r} does not exist on this cluster; valid QOS: {', '.join(names)} "
                         f"(account {account} allows: {', '.join(user_assoc.qos) or 'none'})")
    if user_assoc.qos and qos_name not in user_assoc.qos:
        raise QuotaError(f"account {account!r} (user {user}) may not use QOS {qos_name!r}; it may use: "
                         f"{', '.join(user_assoc.qos)}. Or ask the admin to run: sacctmgr -i modify user {user} "
                         f"where account={account} set QOS+={qos_name}")
    qrec = next(q for q in qos_list if q.name == qos_name)
    return Charge(user=user, account=account, qos=qos_name, user_assoc=user_assoc, account_assoc=account_assoc,
                  qos_rec=qrec)


def account_use(jobs: Sequence[QueueJob], account: str) -> dict[str, int]:
    """TRES the account's running jobs hold now (what ``GrpTRES`` counts)."""
    run = [j for j in jobs if j.account == account and j.state in ACTIVE]
    return {"cpu": sum(j.cpus for j in run), "gres/gpu": sum(j.gpus for j in run), "node": sum(j.nodes for j in run),
            "jobs": len(run), "submitted": len([j for j in jobs if j.account == account])}


def user_use(jobs: Sequence[QueueJob], user: str, account: str | None = None, qos: str | None = None) -> dict[str, int]:
    """The user's running and submitted jobs (in one account, or under one QOS) and the TRES they hold."""
    mine = [j for j in jobs if j.user == user and (account is None or j.account == account)
            and (qos is None or j.qos == qos)]
    run = [j for j in mine if j.state in ACTIVE]
    return {"running": len(run), "submitted": len(mine), "cpu": sum(j.cpus for j in run),
            "gres/gpu": sum(j.gpus for j in run)}


def _limit_str(limits: dict[str, int]) -> str:
    shown = [f"{v} {TRES_WORDS.get(k, k)}" for k, v in limits.items() if k in TRES_WORDS]
    return ", ".join(shown) if shown else "no CPU/GPU limit"


def check_fit(charge: Charge, req: Request, jobs: Sequence[QueueJob], nodes: Sequence[Node]) -> Fit:
    """Whether a job of ``req`` charged to ``charge`` fits now, must wait, or can never run (with the numbers)."""
    ua, aa, q = charge.user_assoc, charge.account_assoc, charge.qos_rec
    acc = account_use(jobs, charge.account)
    mine = user_use(jobs, charge.user, charge.account)
    mine_q = user_use(jobs, charge.user, qos=charge.qos)
    want = req.tres()
    fit = Fit("now")
    grp = dict(aa.grp_tres) if aa else {}
    fit.lines.append(
        f"quota: account {charge.account}: {_limit_str(grp) if grp else 'no GrpTRES limit'}"
        + (f", GrpJobs={aa.grp_jobs}" if aa and aa.grp_jobs is not None else "")
        + f"; user {charge.user}: MaxJobs={_lim(ua.max_jobs)} MaxSubmitJobs={_lim(ua.max_submit)}"
        + (f", MaxTRES per job {_limit_str(ua.max_tres)}" if ua.max_tres else "")
        + f"; QOS {charge.qos}" + (f" (per user: {_qos_limits(q)})" if q and _qos_limits(q) else ""))
    fit.lines.append(
        f"in use: account {charge.account} runs {acc['jobs']} job(s) on {acc['cpu']} CPUs"
        + (f", {acc['gres/gpu']} GPUs" if acc["gres/gpu"] or grp.get("gres/gpu") else "")
        + f"; user {charge.user} has {mine['running']} running, {mine['submitted']} submitted in {charge.account}")
    never: list[str] = []
    wait: list[tuple[str, str]] = []
    for key in ("cpu", "gres/gpu", "node"):
        word, need = TRES_WORDS[key], want[key]
        if not need:
            continue
        for scope, lim, used, reason in (
                (f"account {charge.account} (GrpTRES)", grp.get(key), acc[key], _grp_reason(key)),
                (f"user {charge.user} in {charge.account} (GrpTRES)", ua.grp_tres.get(key), mine[key] if key != "node"
                 else 0, _grp_reason(key)),
                (f"QOS {charge.qos} per user (MaxTRESPerUser)", q.max_tres_pu.get(key) if q else None,
                 mine_q.get(key, 0), "QOSMaxCpuPerUserLimit" if key == "cpu" else "QOSMaxGRESPerUser"),
                (f"QOS {charge.qos} (GrpTRES)", q.grp_tres.get(key) if q else None, None, "QOSGrpCpuLimit")):
            if lim is None:
                continue
            if need > lim:
                never.append(f"{scope} allows {lim} {word}; this job asks for {need}")
            elif used is not None and used + need > lim:
                wait.append((reason, f"{scope} uses {used} of its {lim} {word}; this job waits for {need}"))
        for scope, lim in ((f"user {charge.user} in {charge.account} (MaxTRES per job)", ua.max_tres.get(key)),
                           (f"QOS {charge.qos} (MaxTRES per job)", q.max_tres.get(key) if q else None)):
            if lim is not None and need > lim:
                never.append(f"{scope} allows {lim} {word}; this job asks for {need}")
    adds = f"this submission adds {req.tasks}"
    if ua.max_submit is not None and mine["submitted"] + req.tasks > ua.max_submit:
        never.append(f"user {charge.user} has {mine['submitted']} jobs submitted in account {charge.account}, "
                     f"MaxSubmitJobs={ua.max_submit}, {adds}: Slurm refuses it until jobs end (or scancel some)")
    if q and q.max_submit_pu is not None and mine_q["submitted"] + req.tasks > q.max_submit_pu:
        never.append(f"user {charge.user} has {mine_q['submitted']} jobs submitted under QOS {charge.qos}, "
                     f"MaxSubmitJobsPerUser={q.max_submit_pu}, {adds}: Slurm refuses it until jobs end")
    if ua.max_jobs is not None and mine["running"] >= ua.max_jobs:
        wait.append(("AssocMaxJobsLimit", f"user {charge.user} runs {mine['running']} of MaxJobs={ua.max_jobs} "
                                          f"jobs in account {charge.account}"))
    if aa and aa.grp_jobs is not None and acc["jobs"] >= aa.grp_jobs:
        wait.append(("AssocGrpJobsLimit", f"account {charge.account} runs {acc['jobs']} of GrpJobs={aa.grp_jobs} jobs"))
    if q and q.max_jobs_pu is not None and mine_q["running"] >= q.max_jobs_pu:
        wait.append(("QOSMaxJobsPerUserLimit", f"user {charge.user} runs {mine_q['running']} jobs under QOS "
                                               f"{charge.qos}, MaxJobsPerUser={q.max_jobs_pu}"))
    if never:
        fit.verdict = "never"
        fit.lines += [f"never fits: {n}" for n in never]
        return fit
    part = [n for n in nodes if n.partition.rstrip("*") == req.partition
            or (not req.partition and n.partition.endswith("*"))]
    usable = [n for n in part if not node_unusable(n.state)]
    idle = sum(n.cpus_idle for n in usable)
    if wait:
        fit.verdict = "wait"
        fit.reasons = [r for r, _ in wait]
        fit.lines += [f"will wait ({r}): {why}" for r, why in wait]
    elif part and idle < req.cpus:
        fit.verdict = "wait"
        fit.reasons = ["Resources"]
        fit.lines.append(f"within quota; will wait for free CPUs (Resources): {idle} of "
                         f"{sum(n.cpus_total for n in usable)} CPUs idle in partition "
                         f"{part[0].partition.rstrip('*')}, this job needs {req.cpus}")
    else:
        fit.lines.append(f"fits now: {req.cpus} CPUs" + (f", {req.gpus} GPUs" if req.gpus else "")
                         + " within the quota" + (f"; {idle} CPUs idle" if part else ""))
    return fit


def _lim(v: int | None) -> str:
    return "none" if v is None else str(v)


def _qos_limits(q: Qos) -> str:
    parts = []
    if q.max_tres_pu:
        parts.append(_limit_str(q.max_tres_pu))
    if q.max_jobs_pu is not None:
        parts.append(f"MaxJobsPerUser={q.max_jobs_pu}")
    if q.max_submit_pu is not None:
        parts.append(f"MaxSubmitJobsPerUser={q.max_submit_pu}")
    return ", ".join(parts)


def _grp_reason(key: str) -> str:
    return {"cpu": "AssocGrpCpuLimit", "gres/gpu": "AssocGrpGRES", "node": "AssocGrpNodeLimit"}[key]


def node_unusable(state: str) -> bool:
    s = state.lower()
    return any(w in s for w in ("down", "drain", "fail", "maint", "unknown", "not_responding", "inval"))


# ---- pending reasons in words --------------------------------------------------------------------

PLAIN_REASONS = {
    "Priority": "other jobs have higher priority (fair share, QOS, age); it starts after them",
    "Resources": "waits for free nodes/CPUs",
    "BeginTime": "not eligible before its begin time (a requeued job waits about 2 minutes)",
    "Dependency": "waits for the job(s) it depends on to end",
    "DependencyNeverSatisfied": "a job it depends on failed: it can never start; scancel it",
    "ReqNodeNotAvail": "a node it needs is down, drained or reserved",
    "PartitionNodeLimit": "asks more nodes than the partition allows: it can never start",
    "PartitionTimeLimit": "asks more time than the partition allows: it can never start",
    "PartitionConfig": "asks more than the partition's nodes have (CPUs, memory, nodes): it can never start there",
    "PartitionDown": "its partition is down",
    "PartitionInactive": "its partition is inactive",
    "JobHeldUser": "held by its user (scontrol release JOBID)",
    "JobHeldAdmin": "held by an admin",
    "launch failed requeued held": "its launch failed; Slurm requeued and held it (scontrol release JOBID)",
    "Reservation": "waits for its reservation to start",
    "InvalidAccount": "its account does not exist or the user has no association with it",
    "InvalidQOS": "its QOS does not exist or is not allowed for its account",
    "QOSNotAllowed": "its QOS is not allowed for its account or partition",
    "NodeDown": "a node it needs is down",
    "BadConstraints": "its constraints (--constraint, memory, GPUs) match no node: it can never start",
    "Nodes_required_for_job_are_DOWN,_DRAINED_or_reserved_for_jobs_in_higher_priority_partitions":
        "its nodes are down, drained or held for higher-priority partitions",
    "None": "the scheduler has not examined it yet",
}


def explain_reason(job: QueueJob, jobs: Sequence[QueueJob], assocs: Sequence[Assoc] = (),
                   qos_list: Sequence[Qos] = (), nodes: Sequence[Node] = ()) -> str:
    """squeue's reason for a pending ``job`` in words, with the numbers behind quota reasons."""
    r = job.reason
    aa = next((a for a in assocs if a.account == job.account and not a.user and not a.partition), None)
    ua = next((a for a in assocs if a.account == job.account and a.user == job.user and not a.partition), None)
    q = next((x for x in qos_list if x.name == job.qos), None)
    grp_keys = {"AssocGrpCpuLimit": "cpu", "AssocGrpGRES": "gres/gpu", "AssocGrpNodeLimit": "node",
                "AssocGrpCPUMinutesLimit": None}
    for key, need in (("cpu", job.cpus), ("gres/gpu", job.gpus)):  # Slurm may say "None" or "Priority" here
        for scope, rec in ((f"account {job.account}", aa), (f"user {job.user} in {job.account}", ua)):
            lim = rec.grp_tres.get(key) if rec else None
            if lim is not None and need > lim:
                return (f"{scope} may use {lim} {TRES_WORDS[key]} (GrpTRES) and this job asks for {need}: it can "
                        f"never start; scancel {job.job_id}, or ask the admin to raise the limit")
    if r in grp_keys and grp_keys[r]:
        key = grp_keys[r]
        word = TRES_WORDS[key]
        need = {"cpu": job.cpus, "gres/gpu": job.gpus, "node": job.nodes}[key]
        for scope, rec, used in ((f"account {job.account}", aa, account_use(jobs, job.account)[key]),
                                 (f"user {job.user} in {job.account}", ua,
                                  user_use(jobs, job.user, job.account).get(key, 0))):
            lim = rec.grp_tres.get(key) if rec else None
            if lim is not None and used + need > lim:
                return f"{scope} uses {used} of its {lim} {word}; this job waits for {need}"
        return (f"account {job.account} has reached its {word[:-1]} quota (GrpTRES); this job waits for {need} "
                "(limits unknown: slurmdbd does not answer)")
    if r == "AssocGrpJobsLimit" and aa:
        return f"account {job.account} runs {account_use(jobs, job.account)['jobs']} of its GrpJobs={aa.grp_jobs} jobs"
    if r == "AssocMaxJobsLimit" and ua:
        run = user_use(jobs, job.user, job.account)["running"]
        return f"user {job.user} runs {run} of MaxJobs={ua.max_jobs} jobs in account {job.account}"
    if r == "QOSMaxJobsPerUserLimit":
        run = user_use(jobs, job.user, qos=job.qos)["running"]
        if q is None or q.max_jobs_pu is None:
            return f"user {job.user} runs {run} jobs under QOS {job.qos}, its per-user job limit (MaxJobsPerUser)"
        return (f"user {job.user} runs {run} jobs under QOS {job.qos}, which allows {q.max_jobs_pu} per user "
                "(MaxJobsPerUser)")
    if r in ("QOSMaxCpuPerUserLimit", "QOSMaxGRESPerUser"):
        key = "cpu" if "Cpu" in r else "gres/gpu"
        used = user_use(jobs, job.user, qos=job.qos)[key]
        lim = q.max_tres_pu.get(key) if q else None
        return (f"user {job.user} uses {used} of the {lim if lim is not None else '?'} {TRES_WORDS[key]} QOS "
                f"{job.qos} allows per user; this job waits for {job.cpus if key == 'cpu' else job.gpus}")
    if r == "QOSGrpCpuLimit":
        lim = q.grp_tres.get("cpu") if q else None
        used = sum(j.cpus for j in jobs if j.qos == job.qos and j.state in ACTIVE)
        return f"QOS {job.qos} uses {used} of its {lim if lim is not None else '?'} CPUs; this job waits for {job.cpus}"
    if r == "Resources" and nodes:
        part = [n for n in nodes if n.partition.rstrip("*") == job.partition and not node_unusable(n.state)]
        idle = sum(n.cpus_idle for n in part)
        return (f"waits for free CPUs: {idle} of {sum(n.cpus_total for n in part)} idle in partition {job.partition}, "
                f"it needs {job.cpus}")
    if r == "BeginTime" and job.start not in ("", "N/A"):
        return f"not eligible before {job.start} (its begin time: --begin, or Slurm's delay after a requeue)"
    if r == "Dependency" and job.dependency not in ("", "(null)"):
        return f"waits for its dependency {job.dependency}"
    if r == "Priority" and nodes:
        ahead = [j for j in jobs if j.state == "PENDING" and j.partition == job.partition and j.job_id != job.job_id
                 and j.reason in ("Resources", "Priority")]
        return (f"{len(ahead)} other pending job(s) in partition {job.partition} rank higher (fair share, QOS, "
                "age); it starts after them")
    if r.startswith("ReqNodeNotAvail"):
        return f"a node it needs is down, drained or reserved ({r})"
    return PLAIN_REASONS.get(r, f"Slurm reason {r}")
