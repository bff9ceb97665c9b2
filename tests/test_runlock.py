"""One job per run directory: the owner record, liveness from Slurm's job state (a fake ``scontrol``
on PATH here; the real testbed in test_slurm_e2e.py) or the local process, and real concurrent launches."""

from __future__ import annotations

import json
import os
import re
import signal
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

from xirang_hpc.submit.runlock import (
    RunBusyError,
    claim,
    live_owner,
    record_owner,
    submission_lock,
)

TRAIN = [sys.executable, "-c", "from xirang_hpc.cli.train import main; main()"]


@pytest.fixture
def fake_scontrol(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """A fake ``scontrol show job -o ID`` answering the state written to a file (or failing like Slurm)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    state = tmp_path / "state"
    script = bin_dir / "scontrol"
    script.write_text(f"""#!/bin/sh
s=$(cat {state})
if [ "$s" = gone ]; then echo "slurm_load_jobs error: Invalid job id specified" >&2; exit 1; fi
echo "JobId=$4 JobName=xirang-default JobState=$s Reason=None Restarts=0"
""")
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    return state


@pytest.mark.parametrize("slurm_state,busy", [("RUNNING", True), ("PENDING", True), ("REQUEUED", True),
                                              ("SUSPENDED", True), ("COMPLETED", False), ("CANCELLED", False),
                                              ("gone", False)])
def test_slurm_owner_is_live_only_in_a_live_state(tmp_path: Path, fake_scontrol: Path, slurm_state: str,
                                                  busy: bool) -> None:
    fake_scontrol.write_text(slurm_state)
    run = tmp_path / "run"
    run.mkdir()
    record_owner(run, "slurm", "4242")
    owner = live_owner(run)
    assert (owner is not None) == busy
    if busy:
        with pytest.raises(RunBusyError, match=r"already has job 4242 \(" + slurm_state) as e:
            claim(run, "slurm", after_active=False)
        assert "scancel 4242" in str(e.value) and "train.after_active=true" in str(e.value)
        assert claim(run, "slurm", after_active=True) == "4242"  # queued behind it instead
        with pytest.raises(RunBusyError, match="Slurm job only"):
            claim(run, "local", after_active=True)
    else:
        assert claim(run, "slurm", after_active=False) is None


def test_owner_on_another_cluster_is_looked_up_there(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Two clusters number their jobs independently: job 7 may be RUNNING on beta and unknown (or another
    # job) on the default cluster. The lookup must ask the owner's cluster with -M.
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text("""#!/bin/sh
if [ "$1" = "-M" ] && [ "$2" = "beta" ]; then echo "JobId=$6 JobState=RUNNING"; exit 0; fi
echo "slurm_load_jobs error: Invalid job id specified" >&2; exit 1
""")
    (bin_dir / "scontrol").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    run = tmp_path / "run"
    run.mkdir()
    record_owner(run, "slurm", "7", cluster="beta")
    with pytest.raises(RunBusyError, match=r"job 7 on cluster beta \(RUNNING") as e:
        claim(run, "slurm", after_active=False)
    assert "scancel -M beta 7" in str(e.value) and "squeue -M beta -j 7" in str(e.value)
    # The job submitting its own successor (a run moving between sites) hands the directory over.
    assert claim(run, "slurm", after_active=False, handover=("7", "beta")) is None
    with pytest.raises(RunBusyError):
        claim(run, "slurm", after_active=False, handover=("7", "alpha"))  # another cluster's job 7: not it
    record_owner(run, "slurm", "7")  # no cluster recorded: the default cluster does not know it
    assert live_owner(run) is None


def test_local_owner_dies_and_frees_the_directory(tmp_path: Path) -> None:
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        record_owner(tmp_path, "local", str(proc.pid), pid=proc.pid)
        assert live_owner(tmp_path)["state"] == "RUNNING"
        with pytest.raises(RunBusyError, match=f"kill {proc.pid}"):
            claim(tmp_path, "local", after_active=False)
    finally:
        proc.kill()
        proc.wait()
    assert live_owner(tmp_path) is None and claim(tmp_path, "local", after_active=False) is None


def _rewrite_owner(run_dir: Path, **fields: object) -> None:
    owner = json.loads((run_dir / "job.json").read_text())
    owner.update(fields)
    for k in [k for k, v in fields.items() if v is None]:
        del owner[k]
    (run_dir / "job.json").write_text(json.dumps(owner))


def test_a_reused_pid_is_not_the_owner(tmp_path: Path) -> None:
    record_owner(tmp_path, "local", str(os.getpid()), pid=os.getpid())
    ticks = json.loads((tmp_path / "job.json").read_text())["pid_start_ticks"]
    assert live_owner(tmp_path)["state"] == "RUNNING"
    _rewrite_owner(tmp_path, pid_start_ticks=ticks - 1)
    assert live_owner(tmp_path) is None  # same pid, other start since boot: another process
    _rewrite_owner(tmp_path, pid_start_ticks=None, pid_started=1.0)
    assert live_owner(tmp_path) is None  # a record without ticks (older, or no /proc): the wall-clock start


def test_a_wall_clock_step_keeps_the_owner(tmp_path: Path) -> None:
    """The wall clock stepped 31 s since the record (NTP, a paused VM resumed): psutil's create_time moves with
    it, the start since boot does not, so the live owner is still seen and a second launch refused."""
    record_owner(tmp_path, "local", str(os.getpid()), pid=os.getpid())
    started = json.loads((tmp_path / "job.json").read_text())["pid_started"]
    _rewrite_owner(tmp_path, pid_started=started - 31.0)
    assert live_owner(tmp_path)["state"] == "RUNNING"
    with pytest.raises(RunBusyError):
        claim(tmp_path, "local", after_active=False)


def test_submission_lock_serialises_check_and_record(tmp_path: Path) -> None:
    """Two launchers at once: the second waits for the first's record, then sees its live owner."""
    order: list[str] = []
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])

    def launcher(name: str) -> None:
        with submission_lock(tmp_path):
            try:
                claim(tmp_path, "local", after_active=False)
                time.sleep(0.5)  # the window a check-then-submit race would need
                record_owner(tmp_path, "local", str(alive.pid), pid=alive.pid)
                order.append(f"{name}:submitted")
            except RunBusyError:
                order.append(f"{name}:refused")

    try:
        threads = [threading.Thread(target=launcher, args=(n,)) for n in ("a", "b")]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
    finally:
        alive.kill()
        alive.wait()
    assert sorted(x.split(":")[1] for x in order) == ["refused", "submitted"], order


@pytest.mark.slow
def test_second_local_launch_of_a_running_run_is_refused(tmp_path: Path) -> None:
    """Real xirang-train launches: the second is refused with the first's job id before any rank starts;
    once the first is killed (kill -9) the directory is free again."""
    args = ["cluster.nodes=1", "cluster.tasks_per_node=1", "parallel.pp=1", "train.max_steps=100000",
            "train.wait=false", f"train.runs_root={tmp_path / 'runs'}", "data.corpus=" + _email(),
            f"data.out_dir={tmp_path / 'data'}", "checkpoint.enabled=false"]
    rc, out, err = _launch(args, tmp_path, "first")
    assert rc == 0, out + err
    job = re.search(r"submitted job (\d+)", out).group(1)
    try:
        rc, out, err = _launch(args, tmp_path, "second")
        assert rc == 2, out + err
        assert f"already has job {job} (RUNNING" in err and "submitted job" not in out
    finally:
        _kill_tree(int(job))
    rc, out, err = _launch(args, tmp_path, "third")
    assert rc == 0 and "submitted job" in out, out + err
    _kill_tree(int(re.search(r"submitted job (\d+)", out).group(1)))


def _launch(args: list[str], cwd: Path, name: str) -> tuple[int, str, str]:
    """Run xirang-train with its output in files: a local job it starts inherits (and keeps) its fds."""
    out, err = cwd / f"{name}.out", cwd / f"{name}.err"
    with out.open("w") as o, err.open("w") as e:
        rc = subprocess.run(TRAIN + args, stdout=o, stderr=e, stdin=subprocess.DEVNULL, timeout=600, cwd=cwd).returncode
    return rc, out.read_text(), err.read_text()


def _kill_tree(pid: int) -> None:
    proc = psutil.Process(pid)
    for p in [proc, *proc.children(recursive=True)]:
        p.send_signal(signal.SIGKILL)
    psutil.wait_procs([proc], timeout=60)


def _email() -> str:
    import sysconfig

    return str(Path(sysconfig.get_paths()["stdlib"]) / "email")
