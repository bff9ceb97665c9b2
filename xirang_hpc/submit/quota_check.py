"""The quota check ``xirang-train`` makes before it submits to Slurm.

It states the account's quota (``GrpTRES`` cpu / gres/gpu), the user association's ``MaxJobs`` /
``MaxSubmitJobs``, the QOS's per-user limits, the current use and whether this job fits now. Refused
before anything is written: an account or QOS that does not exist (the valid ones are listed), a user
without an association (with the ``sacctmgr`` line for the admin), a job that asks more than a limit
(it would pend forever; Slurm even shows it with reason ``None``) or one over ``MaxSubmitJobs``
(sbatch would refuse it). A job that must wait is submitted, with a line saying why.

When slurmdbd (or its database) is down the check says it cannot see the quota and the launch goes
on: slurmctld keeps the associations and limits in its own cache and still enforces them at
submission (a bad account or QOS is still refused by sbatch), so submitting loses nothing, while
refusing would turn a database outage into a training outage. A cluster without accounting has no
quotas: one line says so.
"""

from __future__ import annotations

import os
import pwd
from typing import Any

from xirang_hpc.config.errors import ConfigError
from xirang_hpc.config.schema import XirangConfig
from xirang_hpc.slurm.accounting import AccountingDown, SlurmDB, SlurmQueryError
from xirang_hpc.slurm.quotas import Fit, QuotaError, Request, check_fit, resolve_association
from xirang_hpc.slurm.request import SlurmRequest


class QuotaRefused(ConfigError):
    """A Slurm submission refused before anything was written (exit 2); the message is the whole story."""

    def __init__(self, field: str, value: Any, message: str) -> None:
        self.field, self.value, self.fix = field, value, message
        ValueError.__init__(self, message)


def current_user() -> str:
    """The submitting user's name (Slurm's associations are per user name)."""
    return pwd.getpwuid(os.getuid()).pw_name


def job_request(cfg: XirangConfig, tasks: int = 1, request: SlurmRequest | None = None) -> Request:
    """What the job asks Slurm for in total (spare nodes included), and in which partition (``tasks``: array
    tasks submitted; ``request``: the job's :class:`SlurmRequest`, built from ``cfg`` when not given)."""
    r = request or SlurmRequest.from_cluster(cfg.cluster, cfg.train.priority)
    return Request(cpus=r.total_cpus, gpus=r.total_gpus, nodes=r.nodes, partition=r.partition, tasks=tasks)


def check_quota(cfg: XirangConfig, db: SlurmDB | None = None, user: str | None = None,
                tasks: int = 1) -> tuple[list[str], Fit | None]:
    """(lines to print, verdict) for a Slurm launch of ``cfg`` (``tasks`` array tasks of it);
    :class:`QuotaRefused` when Slurm would not run it."""
    db = db or SlurmDB()
    user = user or current_user()
    try:
        if not db.accounting_enabled():
            return ["quota: this cluster keeps no accounting (AccountingStorageType=accounting_storage/none): "
                    "no quotas to check"], None
    except SlurmQueryError as exc:
        return [f"quota: cannot ask slurmctld ({exc}); submitting without a quota check"], None
    request = SlurmRequest.from_cluster(cfg.cluster, cfg.train.priority)
    qos = request.qos or None
    req = job_request(cfg, tasks, request)
    try:
        assocs, qos_list = db.associations(), db.qos()
        defaults = db.default_accounts()
    except AccountingDown as exc:
        return [f"quota: cannot check the quota: {exc}. Submitting anyway: slurmctld enforces the limits from "
                "its cache, and `xirang-status RUN` will say why the job waits"], None
    except SlurmQueryError as exc:
        return [f"quota: cannot check the quota ({exc}); submitting anyway"], None
    try:
        charge = resolve_association(assocs, qos_list, user, cfg.cluster.account, qos, defaults.get(user),
                                     db.cluster)
    except QuotaError as exc:
        field = "cluster.qos" if "QOS" in str(exc).split(";")[0] else "cluster.account"
        raise QuotaRefused(field, cfg.cluster.account, f"refused before submission: {exc}") from None
    try:
        jobs, nodes = db.jobs(), db.nodes()
    except SlurmQueryError as exc:
        return [f"quota: cannot read squeue/sinfo ({exc}); submitting without a quota check"], None
    fit = check_fit(charge, req, jobs, nodes)
    head = f"quota (cluster {db.cluster}, account {charge.account}, QOS {charge.qos})"
    lines = [f"{head}: {fit.lines[0].removeprefix('quota: ')}"] + [f"  {x}" for x in fit.lines[1:]]
    if fit.verdict == "never":
        raise QuotaRefused("cluster", cfg.cluster.name,
                           "refused before submission: this job can never run under the quota\n" + "\n".join(lines)
                           + "\nfix: ask for less (cluster.nodes / tasks_per_node / cpus_per_task / gpus_per_node), "
                           "use another account (cluster.account) or QOS (cluster.qos), or ask the admin to raise "
                           "the limit (sacctmgr modify ...)")
    return lines, fit
