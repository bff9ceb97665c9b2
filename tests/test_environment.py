"""The run's environment record: what is in it, what a change of environment says, --env and --env-diff."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from xirang_hpc.launch.status_cli import main as status_main
from xirang_hpc.monitor import environment
from xirang_hpc.monitor.events import EventLog, read_events
from xirang_hpc.slurm.commands import Result


def _runner(commit: str, dirty: bool):
    def run(argv: list[str], cwd: Path) -> str | None:
        if argv[:2] == ["git", "rev-parse"]:
            return commit
        if argv[:2] == ["git", "status"]:
            return " M xirang_hpc/files.py" if dirty else ""
        return None
    return run


def test_the_record_names_versions_revision_packages_and_slurm() -> None:
    rec = environment.collect({"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "n[1-2]", "APPTAINER_CONTAINER": "img.sif"},
                              run=_runner("abc123", True), call=lambda argv: Result(0, "slurm 22.05.8\n", ""))
    assert rec["xirang_hpc"]["revision"]["commit"] == "abc123" and rec["xirang_hpc"]["revision"]["dirty"] is True
    assert rec["accelerators"]["torch"] == torch.__version__
    assert rec["packages"]["torch"] == torch.__version__.split("+")[0] or rec["packages"]["torch"] == torch.__version__
    assert "numpy" in {k.lower() for k in rec["packages"]}
    assert rec["slurm"] == {"version": "slurm 22.05.8", "cluster": None, "job": "7"}
    assert rec["hosts"]["nodelist"] == "n[1-2]" and rec["container"] == {"APPTAINER_CONTAINER": "img.sif"}
    outside = environment.collect({}, run=lambda argv, cwd: None, call=lambda argv: Result(127, "", ""))
    assert outside["xirang_hpc"]["revision"] is None and outside["slurm"]["version"] is None
    assert outside["container"] is None


def test_a_start_in_another_environment_is_an_event_naming_what_differs(tmp_path, monkeypatch) -> None:
    real = environment.collect
    env = {"SLURM_JOB_ID": "1"}
    monkeypatch.setattr(environment, "collect", lambda e=None: real(env, run=_runner("aaa", False),
                                                                     call=lambda argv: Result(127, "", "")))
    environment.record(tmp_path, EventLog(tmp_path))
    assert json.loads((tmp_path / environment.ENV_FILE).read_text())["xirang_hpc"]["revision"]["commit"] == "aaa"
    env["SLURM_JOB_ID"] = "2"  # a requeue: another job id, same environment
    environment.record(tmp_path, EventLog(tmp_path))
    assert not [e for e in read_events(tmp_path) if e["kind"] == "environment_changed"]
    monkeypatch.setattr(environment, "collect", lambda e=None: real(env, run=_runner("bbb", True),
                                                                     call=lambda argv: Result(127, "", "")))
    environment.record(tmp_path, EventLog(tmp_path))
    (ev,) = [e for e in read_events(tmp_path) if e["kind"] == "environment_changed"]
    assert ev["keys"] == ["xirang_hpc.revision.commit", "xirang_hpc.revision.dirty"]
    assert "xirang_hpc.revision.commit: aaa -> bbb" in ev["reason"]


def test_status_prints_the_record_and_the_difference_of_two_runs(tmp_path, capsys) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    for d, commit in ((a, "aaa"), (b, "bbb")):
        d.mkdir()
        rec = environment.collect({}, run=_runner(commit, False), call=lambda argv: Result(127, "", ""))
        (d / environment.ENV_FILE).write_text(json.dumps(rec))
    rec = json.loads((b / environment.ENV_FILE).read_text())
    rec["packages"]["torch"] = "9.9.9"
    (b / environment.ENV_FILE).write_text(json.dumps(rec))
    assert status_main([str(a), "--env"]) == 0
    out = capsys.readouterr().out
    assert "xirang_hpc.revision.commit: aaa" in out and f"accelerators.torch: {torch.__version__}" in out
    assert status_main([str(a), str(b), "--env-diff"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0] == f"2 differences: {a} | {b}"
    assert "packages.torch" in out and "9.9.9" in out and "xirang_hpc.revision.commit" in out
    assert status_main([str(a), str(a), "--env-diff"]) == 0
    assert capsys.readouterr().out.startswith("same environment")
    assert status_main([str(tmp_path), "--env"]) == 2
    assert "no environment.json" in capsys.readouterr().err
    assert status_main([str(a), "--env-diff"]) == 2
