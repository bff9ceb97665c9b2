"""Job state from Slurm's client commands (through :func:`xirang_hpc.slurm.commands.call`).

Every query degrades to ``{}`` when the command is missing (a laptop, a container without
Slurm, the local executor) or fails (``sacct`` without accounting).
"""

from __future__ import annotations

from collections.abc import Callable

from xirang_hpc.slurm import states
from xirang_hpc.slurm.accounting import SlurmDB, SlurmQueryError
from xirang_hpc.slurm.commands import Result, call
from xirang_hpc.slurm.quotas import explain_reason

Runner = Callable[[list[str]], "str | None"]


def run_cmd(argv: list[str], timeout_s: float = 10.0) -> str | None:
    """stdout of ``argv`` when it exits 0; None when it is missing, fails or times out."""
    r = call(argv, timeout_s=timeout_s)
    return r.out if r.rc == 0 else None


def parse_scontrol(text: str) -> dict[str, str]:
    """``Key=Value`` pairs of ``scontrol show job`` output."""
    out: dict[str, str] = {}
    for tok in text.split():
        if "=" in tok:
            k, _, v = tok.partition("=")
            out.setdefault(k, v)
    return out


def _db(run: Runner) -> SlurmDB:
    """The accounting views through this module's runner (stdout or None)."""
    def caller(argv: list[str]) -> Result:
        out = run(argv)
        return Result(0, out, "") if out is not None else Result(1, "", f"{argv[0]} failed")
    return SlurmDB(run=caller)


def reason_in_words(job_id: str, run: Runner = run_cmd) -> str:
    """A pending job's reason with the numbers behind it (quota use and limits), '' when unknown."""
    db = _db(run)
    try:
        jobs = db.jobs()
    except SlurmQueryError:
        return ""
    job = next((j for j in jobs if j.job_id == job_id), None)
    if job is None or job.state != "PENDING":
        return ""
    assocs, qos, nodes = [], [], []
    try:  # limits live in slurmdbd; without it the reason is still said, without numbers
        assocs, qos = db.associations(), db.qos()
    except SlurmQueryError:
        pass
    try:
        nodes = db.nodes()
    except SlurmQueryError:
        pass
    return explain_reason(job, jobs, assocs, qos, nodes)


def user_name(uid: str) -> str:
    """``alice (uid 1000)`` for a uid Slurm printed; the uid alone when this host does not know it."""
    import pwd

    try:
        return f"{pwd.getpwuid(int(uid)).pw_name} (uid {uid})"
    except (KeyError, ValueError):
        return f"uid {uid}"


def history(job_id: str, run: Runner = run_cmd) -> dict[str, str]:
    """What sacct remembers of a job that left squeue: state, exit code, elapsed, restarts, nodes, CPU time."""
    try:
        recs = _db(run).history([job_id])
    except SlurmQueryError:
        return {}
    recs = [r for r in recs if r.job_id.split(".")[0] == job_id]
    if not recs:
        return {}
    last = recs[-1]
    restarts = sum(1 for r in recs[:-1] if states.base(r.state) in states.RESTARTED_FROM)
    cpu_s = sum(r.cpu_seconds for r in recs)
    words = (f"exit code {last.exit_code}, elapsed {last.elapsed}, {restarts} restart(s), "
             f"{last.nnodes} node(s) {last.nodelist}, CPU time {cpu_s // 3600}:{cpu_s // 60 % 60:02d}:{cpu_s % 60:02d}")
    # sacct says who cancelled: "CANCELLED by 1000" (a uid); a run's status names the user.
    if " by " in last.state:
        words = f"cancelled by {user_name(last.state.split(' by ', 1)[1].strip())}; {words}"
    return {"state": last.state.split()[0], "exit_code": last.exit_code, "elapsed": last.elapsed,
            "restarts": str(restarts), "nodes": last.nodelist, "num_nodes": str(last.nnodes),
            "cpu_seconds": str(cpu_s), "start": last.start, "end": last.end, "reason": words, "source": "sacct"}


def slurm_state(job_id: str, run: Runner = run_cmd) -> dict[str, str]:
    """``{"state", "reason"?, "restarts"?, "source"}`` for a Slurm job id, or ``{}`` if Slurm does not know it.

    squeue for a job it still lists (a pending reason said in words with its numbers), sacct for one
    that has left it (exit code, elapsed, restarts, nodes, CPU time), scontrol as the last resort.
    """
    out = run(["squeue", "-h", "-j", job_id, "-o", "%T|%r"])
    if out and out.strip():
        state, _, reason = out.strip().splitlines()[0].partition("|")
        info = {"state": state, "reason": reason, "source": "squeue"}
        if state == "PENDING":
            words = reason_in_words(job_id, run)
            if words:
                info["reason"] = f"{reason}: {words}"
        sc = run(["scontrol", "show", "job", job_id])
        if sc:
            info["restarts"] = parse_scontrol(sc).get("Restarts", "0")
        return info
    hist = history(job_id, run)
    if hist:
        return hist
    sc = run(["scontrol", "show", "job", job_id])
    if sc:
        kv = parse_scontrol(sc)
        if "JobState" in kv:
            return {"state": kv["JobState"], "reason": kv.get("Reason", ""), "restarts": kv.get("Restarts", "0"),
                    "source": "scontrol"}
    return {}


def live_steps(job_id: str, run: Callable[..., Result] = call) -> list[str]:
    """The job's running srun steps (``JOB.STEP``; not the batch or extern step); [] when squeue fails."""
    r = run(["squeue", "-h", "-s", "-j", job_id, "-o", "%i"], timeout_s=30)
    return [s for s in r.out.split() if s.rpartition(".")[2].isdigit()] if r.rc == 0 else []


def oom_step_nodes(job_id: str, run: Callable[..., Result] = call) -> list[str] | None:
    """The nodes of the job's steps that accounting records as ``OUT_OF_MEMORY`` (the cgroup's oom-kill count, as
    slurmstepd reported it), as sacct prints them (hostlists such as ``n[1-2]`` not expanded); None when sacct
    does not answer (no accounting)."""
    r = run(["sacct", "-j", job_id, "-n", "-P", "-o", "JobID,State,NodeList"], timeout_s=30)
    if r.rc != 0:
        return None
    nodes: list[str] = []
    for line in r.out.splitlines():
        jid, _, rest = line.partition("|")
        state, _, nodelist = rest.partition("|")
        if "." in jid and jid.rpartition(".")[2].isdigit() and state.startswith("OUT_OF_MEMORY"):
            nodes.append(nodelist)
    return nodes
