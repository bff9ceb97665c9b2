"""One set of Slurm job states (xirang_hpc/slurm/states.py) read by every decision that depends on a state:
the run lock, the launcher's wait, ``xirang-status``'s "finished", the requeue history and restart counts.
Each case below is one where two copies of the sets used to disagree."""

from __future__ import annotations

from pathlib import Path

from xirang_hpc.cli.status import _finished
from xirang_hpc.monitor.requeues import previous_state
from xirang_hpc.slurm import states
from xirang_hpc.slurm.commands import Result
from xirang_hpc.slurm.jobs import slurm_state
from xirang_hpc.submit import slurm as launch_slurm

# Slurm 22.05's job states (src/common/slurm_protocol_defs.c job_state_string, and the flags squeue prints
# as states).
SLURM_STATES = {"PENDING", "RUNNING", "SUSPENDED", "COMPLETED", "CANCELLED", "FAILED", "TIMEOUT", "NODE_FAIL",
                "PREEMPTED", "BOOT_FAIL", "DEADLINE", "OUT_OF_MEMORY", "CONFIGURING", "COMPLETING", "RESIZING",
                "REQUEUED", "REQUEUE_FED", "REQUEUE_HOLD", "RESV_DEL_HOLD", "SPECIAL_EXIT", "SIGNALING",
                "STAGE_OUT", "STOPPED", "REVOKED"}


def test_every_slurm_state_is_live_or_ended_and_never_both() -> None:
    assert not states.LIVE & states.ENDED
    assert states.LIVE | states.ENDED == SLURM_STATES
    assert states.REQUEUED <= states.LIVE and states.BATCH_GONE <= states.ENDED
    assert states.ENDED_ON_REQUEST <= states.ENDED
    assert states.base("CANCELLED by 1000") == "CANCELLED" and states.has_ended("CANCELLED by 0")
    assert states.base("") == "" and not states.is_live("") and not states.has_ended("")


def test_a_requeue_hold_counts_as_a_restart() -> None:
    # sacct -D of a job held on requeue (scontrol requeuehold, then released): two starts, one restart.
    # ("REQUEUE_HOLD".startswith("REQUEUED") is False: the count used to say 0.)
    row = ("7|x|root|proja|normal|low|{}|0:0|00:00:03|2026-11-30T17:48:16|2026-11-30T17:48:16|"
           "2026-11-30T17:48:19|2|q[1-2]|2|6|None\n")
    sacct = row.format("REQUEUE_HOLD") + row.format("COMPLETED")
    got = slurm_state("7", lambda argv: {"squeue": "", "sacct": sacct}.get(argv[0]))
    assert (got["state"], got["restarts"]) == ("COMPLETED", "1")


def test_the_previous_start_is_read_past_the_running_one() -> None:
    out = ("7|REQUEUE_HOLD|2026-11-30T17:48:16\n7|PREEMPTED|2026-11-30T17:49:00\n"
           "7|RUNNING|2026-11-30T17:50:00\n")
    assert previous_state("7", lambda argv: Result(0, out, "")) == "PREEMPTED"
    # A start that has not ended (here one suspended) is not "the previous start".
    out = "7|CANCELLED by 0|2026-11-30T17:48:16\n7|SUSPENDED|2026-11-30T17:50:00\n"
    assert previous_state("7", lambda argv: Result(0, out, "")) == "CANCELLED"


def test_watch_ends_on_every_ended_state() -> None:
    # xirang-status --watch stops once every run's job has ended: a job that failed to boot or passed its
    # deadline has ended too (the old list of "terminal" states lacked both and the watch never ended).
    for state in ("BOOT_FAIL", "DEADLINE", "PREEMPTED", "CANCELLED"):
        assert _finished({"state": state})
    assert not _finished({"runs": [{"state": "COMPLETED"}, {"state": "COMPLETING"}]})


def test_waiting_for_a_job_ends_when_it_was_preempted_for_good(monkeypatch) -> None:
    # PreemptMode=CANCEL ends a preempted job as PREEMPTED: the launcher's wait returns (it used to wait
    # until Slurm forgot the job).
    seen: list[str] = []
    monkeypatch.setattr(launch_slurm, "job_state", lambda job, cluster=None: seen.append(job) or "PREEMPTED")
    assert launch_slurm.wait_for("9", poll_s=0.0, timeout_s=60) == "PREEMPTED"
    assert len(seen) == 2  # two polls: a requeue in flight passes through brief states


def test_no_module_keeps_its_own_state_list() -> None:
    # The sets live in xirang_hpc/slurm/states.py only: a literal list of job states elsewhere is drift.
    root = Path(__file__).resolve().parents[1] / "xirang_hpc"
    offenders = []
    for path in root.rglob("*.py"):
        if path.name == "states.py" and path.parent.name == "slurm":
            continue
        text = path.read_text()
        offenders += [f"{path.relative_to(root)}: {pair}" for pair in
                      ('"COMPLETED", "FAILED"', '"CANCELLED", "TIMEOUT"', '"PENDING", "RUNNING"') if pair in text]
    assert not offenders, offenders


def test_only_the_slurm_room_runs_slurm_commands() -> None:
    # Every Slurm client command goes through xirang_hpc/slurm/commands.call (injectable): no module elsewhere
    # starts one with subprocess.
    import re

    root = Path(__file__).resolve().parents[1] / "xirang_hpc"
    direct = re.compile(r"subprocess\.(run|Popen|call|check_output|check_call)\(\s*\[\s*\"(sbatch|srun|squeue|sacct|"
                        r"sacctmgr|scontrol|scancel|sinfo|sshare|sprio|salloc)\"")
    offenders = [str(p.relative_to(root)) for p in root.rglob("*.py")
                 if p.parent.name != "slurm" and direct.search(p.read_text())]
    assert not offenders, offenders
