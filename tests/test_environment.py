"""The run's environment record: what is in it, what a change of environment says, --env and --env-diff."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from xirang_hpc.cli.status import main as status_main
from xirang_hpc.monitor import environment
from xirang_hpc.monitor.events import EventLog, read_events
from xirang_hpc.runtime.device import accelerator_stack
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
                              run=_runner("abc123", True), call=lambda argv: Result(0, "slurm 22.05.8\n", ""),
                              accelerators=accelerator_stack)
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
    monkeypatch.setattr(environment, "collect", lambda e=None, **kw: real(env, run=_runner("aaa", False),
                                                                     call=lambda argv: Result(127, "", "")))
    environment.record(tmp_path, EventLog(tmp_path))
    assert json.loads((tmp_path / environment.ENV_FILE).read_text())["xirang_hpc"]["revision"]["commit"] == "aaa"
    env["SLURM_JOB_ID"] = "2"  # a requeue: another job id, same environment
    environment.record(tmp_path, EventLog(tmp_path))
    assert not [e for e in read_events(tmp_path) if e["kind"] == "environment_changed"]
    monkeypatch.setattr(environment, "collect", lambda e=None, **kw: real(env, run=_runner("bbb", True),
                                                                     call=lambda argv: Result(127, "", "")))
    environment.record(tmp_path, EventLog(tmp_path))
    (ev,) = [e for e in read_events(tmp_path) if e["kind"] == "environment_changed"]
    assert ev["keys"] == ["xirang_hpc.revision.commit", "xirang_hpc.revision.dirty"]
    assert "xirang_hpc.revision.commit: aaa -> bbb" in ev["reason"]


def test_status_prints_the_record_and_the_difference_of_two_runs(tmp_path, capsys) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    for d, commit in ((a, "aaa"), (b, "bbb")):
        d.mkdir()
        rec = environment.collect({}, run=_runner(commit, False), call=lambda argv: Result(127, "", ""),
                                  accelerators=accelerator_stack)
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


def test_the_audit_trail_names_who_did_what_in_the_run_the_users_trail_and_syslog(tmp_path, capsys,
                                                                                     monkeypatch) -> None:
    import os

    from xirang_hpc.monitor import audit

    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    run = tmp_path / "runs" / "exp"
    run.mkdir(parents=True)
    sent: list[str] = []
    audit.record(run, "launch", "123", to_syslog=sent.append, argv=["model=tiny"])
    audit.record(run, "export", to_syslog=sent.append, step=4, format="hf")
    rows = audit.read(run)
    assert [r["action"] for r in rows] == ["launch", "export"]
    assert rows[0]["job"] == "123" and rows[0]["uid"] == os.getuid() and rows[0]["argv"] == ["model=tiny"]
    assert rows[0]["run"] == str(run) and rows[1]["step"] == 4
    assert [json.loads(x)["action"] for x in audit.user_file().read_text().splitlines()] == \
        ["launch", "export"]
    assert len(sent) == 2 and "action=launch" in sent[0] and f"run={run}" in sent[0] and "job=123" in sent[0]
    assert (run / audit.AUDIT_FILE).stat().st_mode & 0o777 == 0o600
    assert audit.user_file() == tmp_path / "state" / "xirang-hpc" / "audit.jsonl"
    assert [p.name for p in (tmp_path / "runs").iterdir()] == ["exp"]  # the runs root holds runs only
    assert status_main([str(run), "--audit"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 2 and "launch" in out[0] and "job=123" in out[0] and "format=hf" in out[1]


def test_an_export_and_a_fork_are_audited(tmp_path) -> None:
    from xirang_hpc.checkpoint.manager import CheckpointManager
    from xirang_hpc.cli.ckpt import main as ckpt_main
    from xirang_hpc.monitor import audit

    run = tmp_path / "exp"
    CheckpointManager(run / "checkpoints", async_save=False).save(2, {"model": {"w": torch.ones(2)}},
                                                                  state={"step": 2})
    assert ckpt_main(["rollback", str(run), "--step", "2", "--to", str(tmp_path / "fork")]) == 0
    assert ckpt_main(["prune", str(run), "--dry-run"]) == 0
    rows = audit.read(run)
    assert [(r["action"], r["step"], r["to"]) for r in rows] == [("fork", 2, str(tmp_path / "fork"))]


def test_a_tracking_server_that_does_not_answer_is_refused_at_launch() -> None:
    import socket

    import pytest

    from xirang_hpc.config.errors import ConfigError
    from xirang_hpc.config.schema import XirangConfig
    from xirang_hpc.submit.preflight import check_tracking

    cfg = XirangConfig()
    cfg.train.loggers = ["jsonl", "mlflow"]
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cfg.train.mlflow_uri = f"http://127.0.0.1:{port}"
    with pytest.raises(ConfigError, match=r"train.mlflow_uri.*does not answer from this node .*refused"):
        check_tracking(cfg, timeout_s=2.0)
    check_tracking(cfg, probe=lambda uri, t: None)  # answered
    cfg.train.loggers = ["jsonl"]
    check_tracking(cfg)  # not logged to: not probed


def test_a_hang_bound_that_would_abort_healthy_starts_is_refused() -> None:
    import pytest

    from xirang_hpc.config.errors import ConfigError
    from xirang_hpc.config.schema.monitor import MonitorConfig

    with pytest.raises(ConfigError, match=r"monitor.hang_s.*under 5 s aborts healthy jobs"):
        MonitorConfig(hang_s=1)
    MonitorConfig(hang_s=8)
