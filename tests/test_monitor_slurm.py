"""``xirang-status`` on real Slurm jobs (the ``tools/slurm-testbed`` cluster; see tests/test_slurm_e2e.py).

- a job preempted once by a real ``high`` job, requeued (``requeue=testbed``: ``start_now``) and
  finished: state from squeue/scontrol, requeue count 1, the requeue event, the last checkpoint and
  its age, and ``--plot``'s requeue marker read back from the figure; then exported and served with a
  named key: the run's audit trail reads launch, requeue, export, serve, the request, serve_stop;
- a real array sweep: one line per task, a task held back by the array's parallelism limit shows
  PENDING (from squeue) before it has written anything but its ``submit`` event, then every task
  COMPLETED.

The testbed fixture and the submit/wait helpers are the Slurm end-to-end tests' own. Each job is
one rank of the tiny model; its steps are paced with ``XIRANG_TESTPOINT_SLOW`` (in the submitting
environment, which sbatch exports to the job) so the preemption
lands mid-run, and the running task is still running when it is looked at, on a fast or a slow machine.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest
from test_slurm_e2e import TRAIN, _base, _ev, _final, _preempt, _submit, _wait, slurm  # noqa: F401

from xirang_hpc.cli.status import main as status_main
from xirang_hpc.monitor.events import read_events
from xirang_hpc.runs.plot import plot_run
from xirang_hpc.runs.status import run_status

pytestmark = pytest.mark.slurm
ONE_RANK = ["cluster.nodes=1", "cluster.tasks_per_node=1"]


def _status(capsys, *args: str) -> str:
    capsys.readouterr()
    assert status_main(list(args)) == 0
    return capsys.readouterr().out


def test_status_of_a_preempted_requeued_then_finished_job(slurm, stdlib_data, tmp_path, capsys):  # noqa: F811
    steps = 40
    job, run = _submit([*_base(stdlib_data, tmp_path / "runs"), *ONE_RANK, "train.priority=exploratory",
                        f"train.max_steps={steps}", "checkpoint.every_steps=20"],
                       env={"XIRANG_TESTPOINT_SLOW": "rank=0,s=0.4"})
    _wait(lambda: _ev(run, "first_step", 0), 600, "training to start")
    live = json.loads(_status(capsys, str(run), "--json"))
    assert (live["job_id"], live["executor"], live["state"], live["state_source"]) == (job, "slurm", "RUNNING",
                                                                                        "squeue")
    assert live["requeues"] == 0 and live["total_steps"] == steps
    _preempt("-N2", "--ntasks-per-node=8")  # every CPU of the testbed, in `high`: the `low` job is preempted
    _wait(lambda: _ev(run, "requeue", 0), 600, "the requeue")
    assert _final(run, timeout=600)["status"] == "completed", read_events(run)
    stop_step = _ev(run, "requeue", 0)[0]["step"]
    assert 0 < stop_step < steps

    # The final event precedes the batch script's supervisor step: Slurm says RUNNING until that ends.
    _wait(lambda: run_status(run)["state"] == "COMPLETED", 600, f"Slurm to end job {job}")
    s = json.loads(_status(capsys, str(run), "--json"))
    # COMPLETED from squeue while the job is listed, then from sacct (the testbed keeps accounting), or from
    # scontrol (MinJobAge) where accounting is off; each also counts the restart.
    assert s["state"] == "COMPLETED" and s["state_source"] in ("squeue", "sacct", "scontrol"), s
    assert (s["requeues"], s["sessions"], s["step"], s["total_steps"]) == (1, 2, steps, steps)
    kinds = [e["kind"] for e in s["events"]]
    assert "requeue" in kinds, kinds
    req = next(e for e in s["events"] if e["kind"] == "requeue")
    assert (req["reason"], req["target"], req["step"]) == ("preemption", job, stop_step)
    # The age is counted from the commit, not from some other clock (which would show up as hours or
    # a negative age); 15 minutes leaves any busy machine's waits above room.
    assert s["checkpoint"]["step"] == steps and 0 <= s["checkpoint"]["age_s"] < 900, s["checkpoint"]

    text = _status(capsys, str(run))
    # With accounting, sacct's record follows the state: (exit code 0:0, elapsed ..., 1 restart(s), ...).
    assert re.search(rf"^job\s+{job} \[slurm\]\s+COMPLETED( \(exit code 0:0, .*1 restart\(s\).*\))?  \| requeues 1$",
                     text, re.M), text
    assert re.search(rf"^progress\s+step {steps}/{steps} \(100\.0%\)$", text, re.M), text
    assert re.search(rf"^ckpt\s+step {steps}, 0:0[0-1]:\d\d ago", text, re.M), text
    assert re.search(r"^\s+\d\d:\d\d:\d\d\s+requeue\s+preemption$", text, re.M), text

    # --plot: the requeue marker sits at the step where the preempted run stopped (and the rerun resumed).
    png = tmp_path / "status.png"
    out = _status(capsys, str(run), "--plot", str(png))
    assert f"requeues at [{stop_step}]" in out and png.read_bytes()[:4] == b"\x89PNG", out
    info = plot_run(run, tmp_path / "again.png")
    assert info["requeue_steps"] == [stop_step] and steps in info["checkpoint_steps"], info
    _export_serve_and_read_the_audit_trail(run, job, tmp_path, capsys)


def _export_serve_and_read_the_audit_trail(run: Path, job: str, tmp_path: Path, capsys) -> None:
    """After the requeued run: an export and a server with a named key; the run's audit trail has them all, in order,
    with the Slurm job, and the request under the key's name (never the key)."""
    import os
    import signal
    import sys
    import time
    import urllib.request

    from xirang_hpc.cli.ckpt import main as ckpt_main
    from xirang_hpc.monitor import audit

    assert ckpt_main(["export", str(run), "--format", "safetensors", "--out", str(tmp_path / "export")]) == 0
    key = "k" * 32
    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps({"keys": [{"name": "reviewer", "key": key, "runs": [run.name]}]}))
    keys.chmod(0o600)
    info = tmp_path / "serve.json"
    serve = Path(sys.executable).parent / "xirang-serve"
    proc = subprocess.Popen([str(serve), str(run), "--port", "0", "--info-file", str(info), "--keys-file", str(keys)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "XIRANG_SERVE_TOKEN": ""})
    try:
        deadline = time.monotonic() + 300  # a safety net against a hang
        while not info.exists():
            assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read() if proc.poll() else "slow"
            time.sleep(0.2)
        req = urllib.request.Request(f"{json.loads(info.read_text())['url']}/v1/models",
                                     headers={"Authorization": f"Bearer {key}"})
        with urllib.request.urlopen(req, timeout=300) as r:
            assert r.status == 200
    finally:
        proc.send_signal(signal.SIGTERM)
        out = proc.communicate(timeout=300)[0]
    assert "access 127.0.0.1 GET /v1/models 200 key=reviewer" in out, out
    rows = audit.read(run)
    assert [r["action"] for r in rows] == ["launch", "requeue", "export", "serve", "request", "serve_stop"], rows
    assert rows[0]["job"] == job and rows[1]["job"] == job and rows[1]["why"]
    assert rows[4]["key"] == "reviewer" and key not in (run / audit.AUDIT_FILE).read_text()
    capsys.readouterr()
    assert status_main([str(run), "--audit"]) == 0
    assert "requeue" in capsys.readouterr().out


def _lines(text: str) -> dict[str, list[str]]:
    """Rows of the one-line-per-task view, by task id."""
    rows = text.strip().splitlines()
    assert rows[0].split()[:3] == ["task", "state", "step"], text
    return {r.split()[0]: r.split() for r in rows[1:]}


def test_status_of_a_real_array_sweep_one_line_per_task(slurm, stdlib_data, tmp_path, capsys):  # noqa: F811
    runs_root = tmp_path / "runs"
    args = ["-m", "train.seed=1,2", *_base(stdlib_data, runs_root), *ONE_RANK, "cluster.array_parallelism=1",
            "train.max_steps=20"]
    out = subprocess.run(TRAIN + args, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "XIRANG_TESTPOINT_SLOW": "rank=0,s=0.3"})
    assert out.returncode == 0, out.stdout + out.stderr
    array = re.search(r"submitted Slurm array job (\d+): 2 task\(s\)", out.stdout).group(1)
    runs = [Path(p) for p in re.findall(r"-> (\S+)", out.stdout)]
    tasks = [f"{array}_0", f"{array}_1"]
    # array_parallelism=1: task 1 waits in the queue while task 0 trains; it has no metrics or heartbeats yet.
    _wait(lambda: _ev(runs[0], "first_step", 0), 600, "task 0 to train")
    rows = _lines(_status(capsys, array, "--runs-root", str(runs_root)))
    assert sorted(rows) == tasks, rows
    assert rows[tasks[0]][1] == "RUNNING" and rows[tasks[1]][1] == "PENDING", rows
    live = json.loads(_status(capsys, array, "--runs-root", str(runs_root), "--json"))["runs"]
    assert [(r["job_id"], r["state_source"]) for r in live] == [(tasks[0], "squeue"), (tasks[1], "squeue")]
    assert [f["status"] for f in (_final(r, timeout=600) for r in runs)] == ["completed", "completed"]
    # the batch script's supervisor step runs after the final event
    _wait(lambda: all(run_status(r)["state"] == "COMPLETED" for r in runs), 600, "Slurm to end both tasks")
    rows = _lines(_status(capsys, array, "--runs-root", str(runs_root)))
    assert {t: r[1:3] for t, r in rows.items()} == {t: ["COMPLETED", "20/20"] for t in tasks}, rows
    # the runs root's own listing (no job id) shows the same tasks
    assert sorted(_lines(_status(capsys, str(runs_root)))) == tasks
