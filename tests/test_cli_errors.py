"""Bad input on the command line: one ``PROG: error: ...`` line naming the field or file and the fix, exit status 2,
no traceback and no hang, for every entry point that composes the config with Hydra."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

BIN = Path(sys.executable).parent
HYDRA_APPS = {"xirang-train": "train_cli", "xirang-prepare": "prepare_cli", "xirang-plan": "plan_cli",
              "xirang-sbatch": "sbatch", "xirang-pipeline": "pipeline_cli"}


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}
    return env


def run_cli(*argv: str, cwd: Path | None = None, timeout: float = 120, user: int | None = None,
            env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """An installed console script, as a user runs it (a hang fails the test at ``timeout``)."""
    return subprocess.run([str(BIN / argv[0]), *argv[1:]], capture_output=True, text=True, timeout=timeout,
                          cwd=cwd, user=user, env=env or _env())


def _in_process(cmd: str, argv: list[str], monkeypatch: pytest.MonkeyPatch,
                capsys: pytest.CaptureFixture[str]) -> tuple[object, str, str]:
    """``CMD ARGV...`` through its console entry point, in this process: (exit code, stdout, stderr)."""
    from hydra.core.global_hydra import GlobalHydra

    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    monkeypatch.setattr(sys, "argv", [cmd, *argv])
    mod = importlib.import_module(f"xirang_hpc.launch.{HYDRA_APPS[cmd]}")
    try:
        with pytest.raises(SystemExit) as exc:
            mod.main()
    finally:
        GlobalHydra.instance().clear()
    out = capsys.readouterr()
    return exc.value.code, out.out, out.err


def _one_error_line(err: str, cmd: str) -> str:
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"{cmd}: error: "), err
    assert "Traceback" not in err and "HYDRA_FULL_ERROR" not in err and "+train" not in err, err
    return lines[0]


@pytest.mark.parametrize("cmd", sorted(HYDRA_APPS))
def test_unknown_field_names_the_nearest_one(cmd: str, monkeypatch: pytest.MonkeyPatch,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = _in_process(cmd, ["train.stepz=3"], monkeypatch, capsys)
    line = _one_error_line(err, cmd)
    assert code == 2
    assert "train.stepz" in line and "did you mean train.max_steps" in line, line


@pytest.mark.parametrize("cmd", sorted(HYDRA_APPS))
def test_bad_group_option_lists_the_options(cmd: str, monkeypatch: pytest.MonkeyPatch,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = _in_process(cmd, ["model=doesnotexist"], monkeypatch, capsys)
    line = _one_error_line(err, cmd)
    assert code == 2
    assert "model='doesnotexist'" in line and "available: " in line and "gpt2-small" in line and "tiny" in line


@pytest.mark.parametrize("argv, expect", [
    (["train.steps=abc"], ["train.steps", "did you mean train.max_steps"]),
    (["train.max_steps=abc"], ["train.max_steps='abc'", "set train.max_steps= to an integer"]),
    (["train.wait=maybe"], ["train.wait='maybe'", "true or false"]),
    (["max_steps=5"], ["did you mean train.max_steps"]),
    (["trian.max_steps=5"], ["'trian.max_steps=5'", "did you mean train"]),
    (["model=gpt2small"], ["did you mean model=gpt2-small"]),
    (["+train.stepz=3"], ["train.stepz", "did you mean train.max_steps"]),
    (["nonsense"], ["cannot parse the override 'nonsense'"]),
    (["-m", "train.stepz=1,2"], ["train.stepz", "did you mean train.max_steps"]),
    (["--cfg", "job", "model.nlayer=2"], ["model.nlayer", "did you mean model.n_layer"]),
])
def test_composition_errors_are_one_line_exit_2(argv: list[str], expect: list[str], monkeypatch: pytest.MonkeyPatch,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = _in_process("xirang-train", argv, monkeypatch, capsys)
    line = _one_error_line(err, "xirang-train")
    assert code == 2, err
    for e in expect:
        assert e in line, line


def test_installed_command_refuses_an_unknown_field_without_a_traceback(tmp_path: Path) -> None:
    r = run_cli("xirang-train", "train.stepz=3", cwd=tmp_path)
    assert r.returncode == 2, r.stderr
    line = _one_error_line(r.stderr, "xirang-train")
    assert "did you mean train.max_steps" in line
    assert not list(tmp_path.iterdir())  # nothing written


def test_plan_exits_2_when_no_layout_fits(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    monkeypatch.setattr(sys, "argv", ["xirang-plan", "model=gpt-175b", "cluster.nodes=1"])
    from hydra.core.global_hydra import GlobalHydra

    from xirang_hpc.launch import plan_cli

    try:
        with pytest.raises(SystemExit) as exc:
            plan_cli.main()
    finally:
        GlobalHydra.instance().clear()
    out = capsys.readouterr()
    assert exc.value.code == 2  # the help's "2 a bad config or no layout fits"
    assert "no plan fits in memory" in out.out  # the report still says why
    line = _one_error_line(out.err, "xirang-plan")
    assert "no layout of model gpt-175b fits" in line and "cluster.nodes" in line


def test_ckpt_refusals_exit_2_as_its_help_says(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from xirang_hpc.launch.ckpt_cli import main

    assert main(["verify", str(tmp_path / "nope")]) == 2
    assert "is not a run directory" in _one_error_line(capsys.readouterr().err, "xirang-ckpt")
    (tmp_path / "run" / "checkpoints").mkdir(parents=True)
    assert main(["verify", str(tmp_path / "run")]) == 2
    assert "no checkpoints under" in _one_error_line(capsys.readouterr().err, "xirang-ckpt")
    assert main(["verify", str(tmp_path / "run"), "--step", "4"]) == 2
    assert "no checkpoints under" in _one_error_line(capsys.readouterr().err, "xirang-ckpt")
    assert main(["pin", str(tmp_path / "run")]) == 2
    assert "pin needs --step" in _one_error_line(capsys.readouterr().err, "xirang-ckpt")
