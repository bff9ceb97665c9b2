"""Array submission and requeue decisions against a fake Slurm: ``sbatch`` / ``scontrol`` scripts on PATH.

As submitit's own tests do, the Slurm client commands are replaced by small executables that
record their arguments (and the batch script) and answer like Slurm. Nothing runs: these check
what xirang *asks* Slurm to do. The same paths on a real cluster are covered by the testbed
tests (tests/test_slurm_e2e.py, tier ``slurm``).
"""

from __future__ import annotations

import json
import signal
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import committed_stub, compose_cfg, fake_slurm_bin

from xirang_hpc.batch.supervise import supervise
from xirang_hpc.config.validate import check_runnable, load_config
from xirang_hpc.monitor.events import read_events
from xirang_hpc.runtime.markers import mark_exit, mark_start
from xirang_hpc.submit.slurm import RUN_DIR_MAP
from xirang_hpc.submit.sweep import submit_array, sweep_folder

FAKE = r'''#!{python}
"""Fake Slurm client: log the call, answer like Slurm."""
import json, os, sys
name = os.path.basename(sys.argv[0])
args = sys.argv[1:]
entry = {{"cmd": name, "args": args}}
if name == "sbatch":
    entry["script"] = open(args[-1]).read()
with open(os.environ["FAKE_SLURM_LOG"], "a") as f:
    f.write(json.dumps(entry) + "\n")
if name == "scontrol" and args[0] == "requeue" and os.environ.get("FAKE_REQUEUE_REFUSED"):
    sys.exit(print(os.environ["FAKE_REQUEUE_REFUSED"], file=sys.stderr) or 1)
if name == "sbatch":
    print("Submitted batch job 4242")
elif name == "scontrol" and args[:2] == ["show", "job"]:
    print(os.environ.get("FAKE_SCONTROL_JOB", "JobId=4242 JobState=RUNNING ExcNodeList=(null)"))
elif name == "scontrol" and args[:2] == ["show", "hostnames"]:
    print("\n".join(a for a in args[2].split(",") if a))
elif name == "scontrol" and args[:2] == ["show", "partition"]:
    print("PartitionName=low Nodes=n1,n2,n3")
elif name == "scontrol" and args[:2] == ["show", "node"]:
    for n in ("n1", "n2", "n3"):
        print(f"NodeName={{n}} State=IDLE")
'''


@pytest.fixture(autouse=True)
def _sigterm_restored():
    """The supervisor ignores SIGTERM before it requeues (in the batch script it must outlive the requeue's);
    here it runs in the test process, whose later children would inherit the ignore: put it back."""
    before = signal.getsignal(signal.SIGTERM)
    yield
    signal.signal(signal.SIGTERM, before)


@pytest.fixture
def fake_slurm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A bin/ with fake Slurm client commands first on PATH; returns the call log."""
    return fake_slurm_bin(tmp_path, monkeypatch, FAKE)


def _calls(log: Path, cmd: str | None = None) -> list[dict]:
    rows = [json.loads(line) for line in log.read_text().splitlines()]
    return [r for r in rows if cmd is None or r["cmd"] == cmd]


def test_a_sweep_is_one_array_job_with_a_run_dir_per_task(fake_slurm: Path, tmp_path: Path,
                                                           small_corpus: Path) -> None:
    common = ["cluster=testbed", "requeue=testbed", f"train.runs_root={tmp_path}/runs", f"data.corpus={small_corpus}",
              f"data.out_dir={tmp_path}/data", "data.val_fraction=0.2", "cluster.array_parallelism=2"]
    overrides = [[*common, f"train.lr={lr}"] for lr in ("1e-3", "3e-4", "1e-4")]
    cfgs = [load_config(compose_cfg(o)) for o in overrides]
    for c in cfgs:
        check_runnable(c)
    array_id, run_dirs, tasks = submit_array(cfgs, overrides)

    assert array_id == "4242" and tasks == ["4242_0", "4242_1", "4242_2"]
    sbatch = _calls(fake_slurm, "sbatch")
    assert len(sbatch) == 1, "a sweep must be one sbatch call"
    script = sbatch[0]["script"]
    assert "#SBATCH --array=0-2%2" in script  # three tasks, at most array_parallelism at once
    assert f"#SBATCH --signal=USR2@{cfgs[0].cluster.signal_delay_s}" in script
    assert "#SBATCH --requeue" in script
    assert f"#SBATCH --nodes={cfgs[0].cluster.nodes}" in script
    assert "xirang_hpc.batch.supervise" in script  # the requeue supervisor runs after srun
    # One deterministic, private run directory per point, each knowing its policy and its task id.
    assert len(set(run_dirs)) == 3
    mapping = json.loads((sweep_folder(cfgs, overrides) / "submitit" / RUN_DIR_MAP).read_text())
    assert mapping == {str(i): str(d) for i, d in enumerate(run_dirs)}
    for i, d in enumerate(run_dirs):
        assert stat.S_IMODE(d.stat().st_mode) == 0o700
        job = json.loads((d / "slurm_job.json").read_text())
        assert job["requeue"]["start_now"] is True  # requeue=testbed
        (submit,) = [e for e in read_events(d) if e["kind"] == "submit"]
        assert (submit["job"], submit["array"], submit["task"]) == (f"4242_{i}", "4242", i)


def _run_dir(tmp_path: Path, **policy: object) -> Path:
    run = tmp_path / "run"
    run.mkdir()
    requeue = {"enabled": True, "max_requeues": 2, "on_preemption": True, "on_timeout": True,
               "on_node_failure": True, "on_nonzero_exit": False, "backoff_s": 0,
               "exclude_failed_nodes": False, "start_now": False, **policy}
    (run / "slurm_job.json").write_text(json.dumps({"requeue": requeue, "signal_delay_s": 90, "nodes": 2,
                                                    "partition": "low"}))
    return run


ARRAY_TASK = {"SLURM_JOB_ID": "4243", "SLURM_ARRAY_JOB_ID": "4242", "SLURM_ARRAY_TASK_ID": "1",
              "SLURM_RESTART_COUNT": "0"}


def test_a_lost_rank_requeues_only_its_array_task(fake_slurm: Path, tmp_path: Path) -> None:
    run = _run_dir(tmp_path)
    for rank, node in enumerate(("n1", "n1", "n2", "n2")):
        mark_start(run, 0, rank, node)
        if rank != 3:
            mark_exit(run, 0, rank)  # rank 3 on n2 died without unwinding (kill -9, OOM)
    assert supervise(137, run, dict(ARRAY_TASK)) == 137
    assert [c["args"] for c in _calls(fake_slurm, "scontrol") if c["args"][0] == "requeue"] == [["requeue", "4242_1"]]
    (failure,) = [e for e in read_events(run) if e["kind"] == "failure"]
    assert (failure["reason"], failure["ranks"], failure["nodes"]) == ("node_failure", [3], ["n2"])
    assert [e["status"] for e in read_events(run) if e["kind"] == "exit"] == ["requeued"]


def test_a_nonzero_exit_is_final_under_the_default_policy(fake_slurm: Path, tmp_path: Path) -> None:
    run = _run_dir(tmp_path)
    for rank in range(2):
        mark_start(run, 0, rank, "n1")
        mark_exit(run, 0, rank)
    assert supervise(1, run, dict(ARRAY_TASK)) == 1
    assert not [c for c in _calls(fake_slurm, "scontrol") if c["args"][0] == "requeue"]
    (final,) = [e for e in read_events(run) if e["kind"] == "exit"]
    assert final["final"] is True and final["reason"] == "nonzero_exit"


def test_a_save_that_failed_on_a_full_disk_blames_no_node_and_is_not_requeued(fake_slurm: Path,
                                                                              tmp_path: Path) -> None:
    from xirang_hpc.monitor.events import append_event

    # Even a policy that requeues every failure: a full checkpoint filesystem is the same after a requeue.
    run = _run_dir(tmp_path, on_nonzero_exit=True, exclude_failed_nodes=True)
    append_event(run, "start", "restart 0", restart=0)
    for rank, node in enumerate(("n1", "n1", "n2", "n2")):
        mark_start(run, 0, rank, node)
        if rank != 3:
            mark_exit(run, 0, rank)  # rank 3 was killed in the aftermath (the watchdog's abort)
    error = "checkpoint save of step 4 failed on rank 0: no space left on the device (ENOSPC) writing /c/step_4.tmp-x"
    append_event(run, "save_failed", "no space left on the device", step=4, file="/c/step_4.tmp-x", errno=28,
                 errno_name="ENOSPC", free_bytes=1024, needed_bytes=4096, cause="no space left on the device",
                 error=error)
    append_event(run, "dead", "rank 0 on n1: dead: process exited with an error", rank=0, node="n1")
    assert supervise(1, run, dict(ARRAY_TASK)) == 1
    assert not [c for c in _calls(fake_slurm, "scontrol") if c["args"][0] in ("requeue", "update")]
    (failure,) = [e for e in read_events(run) if e["kind"] == "failure"]
    assert (failure["reason"], failure["nodes"], failure["errno_name"]) == ("save_failed", [], "ENOSPC")
    assert (failure["free_bytes"], failure["needed_bytes"]) == (1024, 4096)
    (final,) = [e for e in read_events(run) if e["kind"] == "exit"]
    assert final["final"] is True and final["status"] == "stopped_save_failed"
    assert "no space left on the device" in final["why"] and "requeue would fail" in final["why"]
    assert not [e for e in read_events(run) if e.get("reason") == "node_failure"]


@pytest.mark.parametrize("restarts", [1, 0])
def test_a_refused_requeue_of_a_job_slurm_requeued_itself_is_no_failure(fake_slurm: Path, tmp_path: Path,
                                                                         monkeypatch, restarts: int) -> None:
    """Slurm refuses `scontrol requeue` of a job it requeued itself meanwhile (a preemption's grace time ended);
    with its Restarts past this start's, the run was requeued. Otherwise the refusal is the final status."""
    monkeypatch.setenv("FAKE_REQUEUE_REFUSED", "Job is pending execution for job 4243")
    monkeypatch.setenv("FAKE_SCONTROL_JOB", f"JobId=4243 JobState=COMPLETING Restarts={restarts}")
    run = _run_dir(tmp_path)
    for rank, node in enumerate(("n1", "n2")):
        mark_start(run, 0, rank, node)
    supervise(137, run, dict(ARRAY_TASK))
    exits = [(e["status"], e["final"]) for e in read_events(run) if e["kind"] == "exit"]
    if restarts:
        assert exits == [("requeued", False)], read_events(run)
        (update,) = [e for e in read_events(run) if e["kind"] == "requeue_update"]
        assert update["by"] == "slurm", update
    else:
        assert exits == [("requeued", False), ("requeue_failed", True)], read_events(run)
        assert "pending execution" in read_events(run)[-1]["error"]


def test_requeues_stop_at_max_requeues(fake_slurm: Path, tmp_path: Path) -> None:
    run = _run_dir(tmp_path, max_requeues=2)
    mark_start(run, 2, 0, "n1")  # third start (two requeues already), rank 0 lost
    assert supervise(137, run, {**ARRAY_TASK, "SLURM_RESTART_COUNT": "2"}) == 137
    assert not [c for c in _calls(fake_slurm, "scontrol") if c["args"][0] == "requeue"]
    (final,) = [e for e in read_events(run) if e["kind"] == "exit"]
    assert final["status"] == "max_requeues_exceeded"


def test_a_handed_over_preemption_is_requeued_by_the_supervisor_with_its_begin_time(
        fake_slurm: Path, tmp_path: Path) -> None:
    # The ranks saved step 30 and left; the supervisor requeues now that they are gone, then sets the begin
    # time ahead (start_now), and the requeue carries the step they stopped at.
    from xirang_hpc.monitor.events import append_event

    run = _run_dir(tmp_path, start_now=True)
    for rank in range(2):
        mark_start(run, 0, rank, "n1")
        mark_exit(run, 0, rank)
    append_event(run, "stop", "preemption", restart=0, step=30)
    append_event(run, "handover", "preemption", restart=0, step=30, target="4242_1")
    assert supervise(144, run, dict(ARRAY_TASK)) == 144
    acts = [c["args"] for c in _calls(fake_slurm, "scontrol") if c["args"][0] in ("requeue", "update")]
    assert acts[0] == ["requeue", "4242_1"] and acts[1][:2] == ["update", "jobid=4242_1"]
    assert acts[1][2].startswith("StartTime=now+"), acts
    (requeue,) = [e for e in read_events(run) if e["kind"] == "requeue"]
    assert (requeue["reason"], requeue["step"], requeue["target"]) == ("preemption", 30, "4242_1")
    assert [e["status"] for e in read_events(run) if e["kind"] == "exit"] == ["requeued"]
    assert not [e for e in read_events(run) if e["kind"] == "failure"]  # a preemption blames no node


def test_a_completed_step_is_recorded_without_asking_slurm(fake_slurm: Path, tmp_path: Path) -> None:
    run = _run_dir(tmp_path)
    assert supervise(0, run, dict(ARRAY_TASK)) == 0
    assert _calls(fake_slurm) == []
    (done,) = [e for e in read_events(run) if e["kind"] == "exit"]
    assert (done["status"], done["job"]) == ("completed", "4242_1")


def test_a_sweep_leaves_out_complete_runs_and_submits_nothing_when_all_are(
        fake_slurm: Path, tmp_path: Path, small_corpus: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from xirang_hpc.checkpoint.naming import step_dir_name
    from xirang_hpc.submit.preflight import open_run_dir

    common = ["cluster=testbed", "requeue=testbed", f"train.runs_root={tmp_path}/runs", f"data.corpus={small_corpus}",
              f"data.out_dir={tmp_path}/data", "data.val_fraction=0.2", "cluster.array_parallelism=2"]
    overrides = [[*common, f"train.lr={lr}"] for lr in ("1e-3", "3e-4", "1e-4")]
    cfgs = [load_config(compose_cfg(o)) for o in overrides]
    # The second point has finished: its run directory holds a committed checkpoint at its last step.
    done = open_run_dir(cfgs[1])
    committed_stub(done / "checkpoints" / step_dir_name(cfgs[1].train.end_step))

    array_id, run_dirs, tasks = submit_array(cfgs, overrides)
    assert array_id == "4242" and tasks == ["4242_0", None, "4242_1"]
    assert run_dirs[1] == done
    (sbatch,) = _calls(fake_slurm, "sbatch")
    assert "#SBATCH --array=0-1%2" in sbatch["script"]  # two tasks: the complete run is left out
    assert not [e for e in read_events(done) if e["kind"] == "submit"]
    assert f"run {done} is complete" in capsys.readouterr().out

    # Every point complete: nothing is submitted at all.
    for c, d in zip(cfgs, run_dirs):
        committed_stub(d / "checkpoints" / step_dir_name(c.train.end_step))
    assert submit_array(cfgs, overrides) == (None, run_dirs, [None, None, None])
    assert len(_calls(fake_slurm, "sbatch")) == 1


def test_a_pipeline_on_a_complete_run_submits_no_training_job(fake_slurm: Path, tmp_path: Path,
                                                              small_corpus: Path) -> None:
    from xirang_hpc.checkpoint.naming import step_dir_name
    from xirang_hpc.cli.pipeline import launch_slurm_chain
    from xirang_hpc.runs.chain import chain_status, format_chain
    from xirang_hpc.submit.preflight import open_run_dir, preflight

    cfg = load_config(compose_cfg(["cluster=testbed", f"train.runs_root={tmp_path}/runs",
                                   f"data.corpus={small_corpus}", f"data.out_dir={tmp_path}/data"]))
    run = open_run_dir(cfg)
    committed_stub(run / "checkpoints" / step_dir_name(cfg.train.end_step))
    status = preflight(cfg)
    assert status.complete
    stages = launch_slurm_chain(cfg, run, status.last_step)

    assert [s["stage"] for s in stages] == ["prepare", "train", "eval", "serve"]
    assert stages[1]["job_id"] is None
    assert stages[2]["depends_on"] == stages[0]["job_id"]  # eval waits for prepare directly
    names = [c["script"] for c in _calls(fake_slurm, "sbatch")]
    assert len(names) == 3 and not any("-train" in s for s in names)
    chain = chain_status(run, slurm_state=lambda job: "PENDING")
    train = chain["stages"][1]
    assert train["status"] == "completed" and "already complete" in train["detail"]
    assert "train    completed  not submitted" in format_chain(chain)


def test_submitting_a_job_does_not_import_torch(fake_slurm: Path, tmp_path: Path, small_corpus: Path) -> None:
    """``xirang-train`` to Slurm checks, prepares and submits without torch (seconds of import per submission):
    the job's function goes by reference (``job.entry.train_job``) and imports the training stack in the job."""
    probe = ("import atexit, sys\n"
             "atexit.register(lambda: print('torch imported:', 'torch' in sys.modules))\n"
             "from xirang_hpc.cli.train import main\n"
             "sys.argv = ['xirang-train', *sys.argv[1:]]\n"
             "main()\n")
    out = subprocess.run([sys.executable, "-c", probe, "cluster=testbed", "requeue=testbed",
                          f"train.runs_root={tmp_path}/runs", f"data.corpus={small_corpus}",
                          f"data.out_dir={tmp_path}/data", "data.val_fraction=0.2"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "submitted Slurm job 4242" in out.stdout, out.stdout
    assert out.stdout.rstrip().endswith("torch imported: False"), out.stdout
    # What was submitted names the job function by reference (read as bytes here, never unpickled).
    pickled = list((tmp_path / "runs").glob("*/submitit/*_submitted.pkl"))
    assert len(pickled) == 1, list((tmp_path / "runs").rglob("*"))
    assert b"xirang_hpc.job.entry" in pickled[0].read_bytes() and b"train_job" in pickled[0].read_bytes()
