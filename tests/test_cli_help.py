"""Every entry point's ``--help`` against golden files (regenerate: XIRANG_UPDATE_GOLDEN=1 pytest this file),
and Hydra's ``--info``/``--cfg`` and xirang-prepare's result printed once."""

from __future__ import annotations

import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from xirang_hpc.cli.help import COMMANDS

GOLDEN = Path(__file__).parent / "golden"
BIN = Path(sys.executable).parent
ENV = {**os.environ, "COLUMNS": "100"}  # argparse wraps to the terminal width


def _run(*argv: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(BIN / argv[0]), *argv[1:]], capture_output=True, text=True, timeout=300,
                          env=ENV, cwd=cwd)


ENTRY = {"xirang-train": "cli.train", "xirang-prepare": "cli.prepare", "xirang-plan": "cli.plan",
         "xirang-sbatch": "cli.sbatch", "xirang-pipeline": "cli.pipeline", "xirang-status": "cli.status",
         "xirang-serve": "cli.serve", "xirang-ckpt": "cli.ckpt", "xirang-eval": "cli.eval"}


def _help_in_process(cmd: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> str:
    """``CMD --help`` through the console entry point itself, in this process (the fast tier)."""
    import importlib

    monkeypatch.setenv("COLUMNS", "100")
    monkeypatch.setattr(sys, "argv", [cmd, "--help"])
    mod = importlib.import_module(f"xirang_hpc.{ENTRY[cmd]}")
    with pytest.raises(SystemExit) as exc:
        mod.main(["--help"]) if not COMMANDS[cmd].hydra else mod.main()
    assert exc.value.code in (0, None)
    return capsys.readouterr().out


@pytest.mark.parametrize("cmd", sorted(COMMANDS))
def test_help_matches_golden(cmd: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    text = _help_in_process(cmd, monkeypatch, capsys)
    golden = GOLDEN / f"help_{cmd.removeprefix('xirang-')}.txt"
    if os.environ.get("XIRANG_UPDATE_GOLDEN"):
        golden.write_text(text)
    assert text == golden.read_text(), f"{cmd} --help changed; regenerate with XIRANG_UPDATE_GOLDEN=1"
    # What a new user needs: what it does, its own flags, examples, where the config is.
    assert "examples:" in text and text.count(f"  {cmd}") >= 3
    assert "Hydra" not in text.split("options:")[0]  # not Hydra's generic help
    if COMMANDS[cmd].hydra:
        assert "Config groups (xirang_hpc/conf/" in text and "model:" in text
        for flag, _ in COMMANDS[cmd].flags:
            assert flag in text


@pytest.mark.slow
@pytest.mark.parametrize("cmd", sorted(COMMANDS))
def test_installed_command_prints_the_same_help(cmd: str) -> None:
    """... and answers without importing torch (seconds of CPU): Python's own import log (-X importtime, on
    stderr) lists every module the command imported."""
    r = subprocess.run([str(BIN / cmd), "--help"], capture_output=True, text=True, timeout=300,
                       env={**ENV, "PYTHONPROFILEIMPORTTIME": "1"})
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout == (GOLDEN / f"help_{cmd.removeprefix('xirang-')}.txt").read_text()
    imported = {line.rsplit("|", 1)[-1].strip() for line in r.stderr.splitlines() if line.startswith("import time:")}
    assert "xirang_hpc" in imported and "torch" not in imported, sorted(m for m in imported if "torch" in m)[:5]


@pytest.mark.slow
def test_own_flags_are_listed() -> None:
    assert "--wait" in _run("xirang-train", "-h").stdout
    plan = _run("xirang-plan", "--help").stdout
    for flag in ("--json", "--top N", "--runnable", "--layout SPEC", "--calibrate", "--out FILE"):
        assert flag in plan
    assert "--out FILE" in _run("xirang-sbatch", "--help").stdout
    assert "--status RUN_DIR" in _run("xirang-pipeline", "--help").stdout


def _repeated(text: str) -> list[str]:
    lines = [line for line in text.splitlines() if line.strip() and set(line.strip()) - set("=-*")]
    return [line for line, n in Counter(lines).items() if n > 1]


@pytest.mark.slow
@pytest.mark.parametrize("cmd", ["xirang-train", "xirang-prepare", "xirang-plan"])
def test_info_prints_each_line_once(cmd: str) -> None:
    r = _run(cmd, "--info")
    assert r.returncode == 0, r.stderr
    out = r.stdout + r.stderr
    assert "Installed Hydra Plugins" in out and out.count("Installed Hydra Plugins") == 1, out[:2000]
    assert "DEBUG:hydra" not in out


@pytest.mark.slow
def test_cfg_job_prints_once() -> None:
    r = _run("xirang-train", "--cfg", "job")
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("d_model:") == 1 and r.stdout.count("max_steps:") == 1


@pytest.mark.slow
def test_prepare_reports_once(tmp_path: Path, small_corpus: Path) -> None:
    r = _run("xirang-prepare", f"data.corpus={small_corpus}", f"data.out_dir={tmp_path}/out", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    out = r.stdout + r.stderr
    assert out.count("prepared ") == 1, out
