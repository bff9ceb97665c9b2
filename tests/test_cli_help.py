"""Every entry point's ``--help`` against golden files (regenerate: XIRANG_UPDATE_GOLDEN=1 pytest this file),
and Hydra's ``--info``/``--cfg`` and xirang-prepare's result printed once."""

from __future__ import annotations

import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from xirang_hpc.launch.cli_help import COMMANDS

GOLDEN = Path(__file__).parent / "golden"
BIN = Path(sys.executable).parent
ENV = {**os.environ, "COLUMNS": "100"}  # argparse wraps to the terminal width


def _run(*argv: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(BIN / argv[0]), *argv[1:]], capture_output=True, text=True, timeout=300,
                          env=ENV, cwd=cwd)


@pytest.mark.parametrize("cmd", sorted(COMMANDS))
def test_help_matches_golden(cmd: str) -> None:
    r = _run(cmd, "--help")
    assert r.returncode == 0, r.stderr
    golden = GOLDEN / f"help_{cmd.removeprefix('xirang-')}.txt"
    if os.environ.get("XIRANG_UPDATE_GOLDEN"):
        golden.write_text(r.stdout)
    assert r.stdout == golden.read_text(), f"{cmd} --help changed; regenerate with XIRANG_UPDATE_GOLDEN=1"
    # What a new user needs: what it does, its own flags, examples, where the config is.
    text = r.stdout
    assert "examples:" in text and text.count(f"  {cmd}") >= 3
    assert "Hydra" not in text.split("options:")[0]  # not Hydra's generic help
    if COMMANDS[cmd].hydra:
        assert "Config groups (xirang_hpc/conf/" in text and "model:" in text
        for flag, _ in COMMANDS[cmd].flags:
            assert flag in text


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


@pytest.mark.parametrize("cmd", ["xirang-train", "xirang-prepare", "xirang-plan"])
def test_info_prints_each_line_once(cmd: str) -> None:
    r = _run(cmd, "--info")
    assert r.returncode == 0, r.stderr
    out = r.stdout + r.stderr
    assert "Installed Hydra Plugins" in out and out.count("Installed Hydra Plugins") == 1, out[:2000]
    assert "DEBUG:hydra" not in out


def test_cfg_job_prints_once() -> None:
    r = _run("xirang-train", "--cfg", "job")
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("d_model:") == 1 and r.stdout.count("max_steps:") == 1


def test_prepare_reports_once(tmp_path: Path, small_corpus: Path) -> None:
    r = _run("xirang-prepare", f"data.corpus={small_corpus}", f"data.out_dir={tmp_path}/out", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    out = r.stdout + r.stderr
    assert out.count("prepared ") == 1, out
