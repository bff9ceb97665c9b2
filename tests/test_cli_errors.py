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
HYDRA_APPS = {"xirang-train": "cli.train", "xirang-prepare": "cli.prepare", "xirang-plan": "cli.plan",
              "xirang-sbatch": "cli.sbatch", "xirang-pipeline": "cli.pipeline"}


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
    mod = importlib.import_module(f"xirang_hpc.{HYDRA_APPS[cmd]}")
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
    # the test-only slow-downs left the config for an environment variable: the refusal says which
    (["monitor.debug_slow_rank=3"], ["monitor.debug_slow_rank", "XIRANG_TESTPOINT_SLOW=rank=3"]),
    (["monitor.debug_slow_phases=[data,forward]"], ["XIRANG_TESTPOINT_SLOW=phases=data+forward"]),
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

    from xirang_hpc.cli import plan as plan_cli

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
    from xirang_hpc.cli.ckpt import main

    assert main(["verify", str(tmp_path / "nope")]) == 2
    assert "is not a run directory" in _one_error_line(capsys.readouterr().err, "xirang-ckpt")
    (tmp_path / "run" / "checkpoints").mkdir(parents=True)
    assert main(["verify", str(tmp_path / "run")]) == 2
    assert "no checkpoints under" in _one_error_line(capsys.readouterr().err, "xirang-ckpt")
    assert main(["verify", str(tmp_path / "run"), "--step", "4"]) == 2
    assert "no checkpoints under" in _one_error_line(capsys.readouterr().err, "xirang-ckpt")
    assert main(["pin", str(tmp_path / "run")]) == 2
    assert "pin needs --step" in _one_error_line(capsys.readouterr().err, "xirang-ckpt")


# ---- files the user cannot read or write ----------------------------------------------------------
# Tests run as root, and root reads and writes through permission bits. Dropping the two capabilities that let
# it (from the bounding set, so the command starts without them) makes the kernel refuse exactly as it refuses
# an ordinary user; as an ordinary user the permission bits alone do.
def _as_plain_user() -> list[str]:
    if os.geteuid() != 0:
        return []
    import shutil

    if shutil.which("setpriv") is None:
        pytest.skip("needs setpriv (util-linux) to run a command without root's file access")
    return ["setpriv", "--bounding-set=-dac_override,-dac_read_search", "--"]


def run_as_plain_user(*argv: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*_as_plain_user(), str(BIN / argv[0]), *argv[1:]], capture_output=True, text=True,
                          timeout=120, cwd=cwd, env=_env())


def _corpus(root: Path, n: int = 4) -> Path:
    root.mkdir(parents=True)
    for i in range(n):
        (root / f"m{i}.py").write_text("".join(f"def f{i}_{j}(x):\n    return x + {j}\n" for j in range(50)))
    return root


def test_unreadable_corpus_files_are_named_and_refused(tmp_path: Path) -> None:
    corpus = _corpus(tmp_path / "corpus")
    (corpus / "m1.py").chmod(0)
    (corpus / "sub").mkdir()
    (corpus / "sub" / "x.py").write_text("x = 1\n")
    (corpus / "sub").chmod(0)
    try:
        r = run_as_plain_user("xirang-prepare", f"data.corpus={corpus}", f"data.out_dir={tmp_path / 'out'}",
                              cwd=tmp_path)
    finally:
        (corpus / "sub").chmod(0o755)
    assert r.returncode == 2, r.stdout + r.stderr
    line = _one_error_line(r.stderr, "xirang-prepare")
    assert f"{corpus / 'm1.py'} (Permission denied)" in line and str(corpus / "sub") in line, line
    assert "2 file(s) or director(ies)" in line and "chmod a+r" in line and "data.corpus" in line
    assert not (tmp_path / "out" / "index.json").exists()


def test_unwritable_out_dir_is_one_line_naming_data_out_dir(tmp_path: Path) -> None:
    corpus = _corpus(tmp_path / "corpus")
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    out = ro / "data" / "prepared"
    r = run_as_plain_user("xirang-prepare", f"data.corpus={corpus}", f"data.out_dir={out}", cwd=tmp_path)
    assert r.returncode == 2, r.stdout + r.stderr
    line = _one_error_line(r.stderr, "xirang-prepare")
    assert str(out) in line and "set data.out_dir=" in line and "permission denied" in line, line
    # Its parent is a file: even root cannot create it.
    r = run_cli("xirang-prepare", f"data.corpus={corpus}", f"data.out_dir={corpus / 'm0.py' / 'out'}", cwd=tmp_path)
    assert r.returncode == 2, r.stdout + r.stderr
    line = _one_error_line(r.stderr, "xirang-prepare")
    assert str(corpus / "m0.py") in line and "not a directory" in line and "set data.out_dir=" in line, line


def test_prepare_names_data_out_dir_when_it_cannot_be_created(tmp_path: Path) -> None:
    from xirang_hpc.data.prepare import CorpusError, prepare

    corpus = _corpus(tmp_path / "corpus")
    with pytest.raises(CorpusError, match=r"data\.out_dir=.*m0\.py/out.*set data\.out_dir= to a writable"):
        prepare(str(corpus), corpus / "m0.py" / "out")


# ---- the exit codes every --help documents are the ones the command returns ------------------------------------
GOLDEN = Path(__file__).parent / "golden"


def documented_exit_codes(cmd: str) -> dict[int, str]:
    """``{code: meaning}`` from the ``Exit status:`` sentence of ``cmd --help`` (its golden text, which
    tests/test_cli_help.py holds equal to what the command prints)."""
    import re

    text = " ".join((GOLDEN / f"help_{cmd.removeprefix('xirang-')}.txt").read_text().split())
    m = re.search(r"Exit status: (.*?)\.(?: |$)", text)
    assert m, f"{cmd} --help documents no exit status"
    return {int(code): meaning.strip(" ,") for code, meaning in re.findall(r"(\d+) (.*?)(?=, \d+ |$)", m.group(1))}


def _success_and_refusal(cmd: str, tmp: Path) -> tuple[list[str], list[str]]:
    """(a command line that succeeds, one that is refused) of ``cmd``, each quick and without a cluster."""
    corpus = _corpus(tmp / "corpus")
    (tmp / "run" / "checkpoints").mkdir(parents=True)
    return {
        "xirang-train": (["--cfg", "job"], ["train.stepz=3"]),
        "xirang-prepare": ([f"data.corpus={corpus}", f"data.out_dir={tmp / 'data'}"], ["data.corpus=/nonexistent"]),
        "xirang-plan": ([], ["model=gpt-175b", "cluster.nodes=1"]),
        "xirang-sbatch": (["cluster=slurm", f"data.corpus={corpus}", f"data.out_dir={tmp / 'data'}",
                           f"train.runs_root={tmp / 'runs'}", "--out", str(tmp / "job.sbatch")],
                          ["cluster=slurm", "model=doesnotexist"]),
        "xirang-pipeline": (["--cfg", "job"], ["train.stepz=3"]),
        "xirang-eval": (["--cfg", "job"], ["train.stepz=3"]),
        "xirang-status": ([str(tmp / "run")], [str(tmp / "nonexistent")]),
        "xirang-serve": (["--help"], [str(tmp / "nonexistent")]),  # serving runs until stopped: its --help
        "xirang-ckpt": (["list", str(tmp / "run")], ["verify", str(tmp / "nonexistent")]),
    }[cmd]


@pytest.mark.slow
@pytest.mark.parametrize("cmd", sorted(f"xirang-{p.stem.removeprefix('help_')}" for p in GOLDEN.glob("help_*.txt")))
def test_documented_exit_codes_are_the_real_ones(cmd: str, tmp_path: Path) -> None:
    codes = documented_exit_codes(cmd)
    assert 0 in codes and 2 in codes, codes
    ok, bad = _success_and_refusal(cmd, tmp_path)
    r = run_cli(cmd, *ok, cwd=tmp_path)
    assert r.returncode == 0, f"{cmd} {' '.join(ok)}: {r.returncode} (help: 0 {codes[0]})\n{r.stderr[-2000:]}"
    r = run_cli(cmd, *bad, cwd=tmp_path)
    assert r.returncode == 2, f"{cmd} {' '.join(bad)}: {r.returncode} (help: 2 {codes[2]})\n{r.stderr[-2000:]}"
    assert "Traceback" not in r.stderr and f"{cmd}: error: " in r.stderr, r.stderr[-2000:]


def test_every_command_documents_its_exit_codes() -> None:
    from xirang_hpc.cli.help import COMMANDS

    assert {f"xirang-{p.stem.removeprefix('help_')}" for p in GOLDEN.glob("help_*.txt")} == set(COMMANDS)
    for cmd in COMMANDS:
        codes = documented_exit_codes(cmd)
        assert codes[0] and codes[2], (cmd, codes)
