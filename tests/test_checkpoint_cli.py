"""xirang-ckpt list/inspect/verify/rollback/prune/pin/export/interval, and train.resume_from forking."""

from __future__ import annotations

import dataclasses
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from xirang_hpc.checkpoint import layout as ckpt_layout
from xirang_hpc.checkpoint.manager import CheckpointManager
from xirang_hpc.checkpoint.retention import RetentionPolicy
from xirang_hpc.checkpoint.rollback import fork_for_resume
from xirang_hpc.cli.ckpt import main
from xirang_hpc.config.schema import ModelConfig
from xirang_hpc.models.gpt import GPT

MODEL = ModelConfig(name="t", n_layer=1, n_head=2, d_model=16, d_ff=32, seq_len=16)


@pytest.fixture
def run(tmp_path) -> tuple[Path, GPT]:
    """A run directory with checkpoints at steps 1..3 of a tiny GPT, and metrics."""
    run = tmp_path / "run"
    torch.manual_seed(0)
    model = GPT(MODEL)
    mgr = CheckpointManager(run / "checkpoints", async_save=False, retention=RetentionPolicy(keep_last=5))
    rows = []
    for s in (1, 2, 3):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.01)
        rows.append({"step": s, "loss": 5.0 - s, "tokens_per_s": 1000.0})
        (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        cfg = {"model": dataclasses.asdict(MODEL), "train": {"global_batch": 4},
               "checkpoint": {"keep_last": 5, "mtbf_hours": 2.0}}
        mgr.save(s, {"model": model.state_dict()}, state={"step": s, "tokens_seen": 64 * s, "config": cfg,
                                                          "metrics": list(rows)},
                 info={"layout": {"dims": {"dp": 2, "tp": 1, "pp": 1}}})
    return run, model


def test_list_shows_steps_sizes_layout_and_latest(run, capsys):
    assert main(["list", str(run[0])]) == 0
    out = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in out[1:]] == ["1", "2", "3"]
    assert "latest" in out[3] and "dp2" in out[3] and "latest" not in out[2]


def test_inspect_prints_tensors(run, capsys):
    assert main(["inspect", str(run[0]), "--step", "2"]) == 0
    out = capsys.readouterr().out
    assert "step_2" in out and "tokens_seen  128" in out
    names = [line.split()[0] for line in out.splitlines() if "chunk(s)" in line]
    assert names and all(n.startswith("model.") for n in names)
    assert main(["inspect", str(run[0]), "--step", "9"]) == 2  # the help's "2 no such run, step or file"
    assert re.search(r"no checkpoint for step 9 .*have \[1, 2, 3\]", capsys.readouterr().err)


def test_verify_reports_the_bad_file_and_exit_code(run, capsys):
    root = run[0] / "checkpoints"
    assert main(["verify", str(run[0])]) == 0
    bad = root / "step_2" / "rank_0.h5"
    bad.write_bytes(b"\0" * bad.stat().st_size)
    assert main(["verify", str(run[0])]) == 2  # the help's "2 ... a corrupt checkpoint"
    cap = capsys.readouterr()
    assert "step 1: OK" in cap.out and "step 3: OK" in cap.out
    assert f"step 2: CORRUPT: {bad}: checksum" in cap.out
    assert "1 of 3 checkpoint(s)" in cap.err
    # --fast reads no tensor file: garbage of the right size passes it (the loader's checksums catch it) ...
    assert main(["verify", str(run[0]), "--fast"]) == 0
    # ... a truncated one does not.
    with bad.open("r+b") as f:
        f.truncate(bad.stat().st_size - 1)
    assert main(["verify", str(run[0]), "--fast", "--step", "2"]) == 2
    assert f"step 2: CORRUPT: {bad}: size" in capsys.readouterr().out


def test_verify_with_no_checkpoint_is_an_error(tmp_path, capsys):
    (tmp_path / "run" / "checkpoints").mkdir(parents=True)
    assert main(["verify", str(tmp_path / "run")]) == 2
    assert "no checkpoints under" in capsys.readouterr().err


def test_rollback_forks_and_keeps_history(run, tmp_path, capsys):
    src = run[0]
    new = tmp_path / "forked"
    assert main(["rollback", str(src), "--step", "2", "--to", str(new)]) == 0
    assert f"train.run_dir={new}" in capsys.readouterr().out
    assert ckpt_layout.committed_steps(src / "checkpoints") == [1, 2, 3]
    assert ckpt_layout.read_latest(src / "checkpoints") == 3
    assert ckpt_layout.committed_steps(new / "checkpoints") == [2] and ckpt_layout.read_latest(new / "checkpoints") == 2
    ckpt_layout.verify(new / "checkpoints" / "step_2")
    a, b = src / "checkpoints/step_2/rank_0.h5", new / "checkpoints/step_2/rank_0.h5"
    assert a.stat().st_ino == b.stat().st_ino  # hard-linked, not copied
    assert [json.loads(x)["step"] for x in (new / "metrics.jsonl").read_text().splitlines()] == [1, 2]
    assert main(["rollback", str(src), "--step", "2", "--to", str(new)]) == 2  # never overwrite a fork


def test_resume_from_forks_once_and_is_idempotent(run):
    src = run[0]
    assert fork_for_resume(src, 3) == src  # newest step: continue in place
    new = fork_for_resume(src, 1)
    assert new != src and ckpt_layout.committed_steps(new / "checkpoints") == [1]
    assert fork_for_resume(src, 1) == new  # a requeued job finds the same fork
    assert fork_for_resume(new, 1) == new  # the job handed the fork itself continues in it
    with pytest.raises(FileNotFoundError, match=r"train.resume_from=7: no checkpoint .*have \[1, 2, 3\]"):
        fork_for_resume(src, 7)


def test_a_launch_with_resume_from_hands_the_job_the_fork(run, capsys):
    """The fork is made at launch, once: the job, its batch step and everything they write use the fork's
    directory, and the run it forks from gains nothing but the fork's name in forks.json."""
    from conftest import compose_cfg

    from xirang_hpc.checkpoint.identity import read_identity
    from xirang_hpc.checkpoint.rollback import forked_at
    from xirang_hpc.config.validate import load_config
    from xirang_hpc.submit.preflight import open_run_dir

    src = run[0]
    before = sorted(p.name for p in src.iterdir())
    cfg = load_config(compose_cfg([f"train.run_dir={src}", "train.resume_from=2", "train.lr=1e-4"]))
    fork = open_run_dir(cfg)
    assert fork != src and forked_at(fork) == 2 and ckpt_layout.committed_steps(fork / "checkpoints") == [2]
    ident = read_identity(fork)
    assert ident is not None and ident["fork_step"] == 2 and ident["forked_from"] == str(src)
    assert ident["train"]["lr"] == 1e-4
    assert f"forked {src} -> {fork}" in capsys.readouterr().out
    assert sorted(p.name for p in src.iterdir()) == sorted([*before, "forks.json"])
    assert open_run_dir(cfg) == fork  # the same command again (or a requeue): the same fork
    assert len(list(src.parent.glob(f"{src.name}-from2-*"))) == 1


def test_prune_and_pin(run, capsys):
    root = run[0] / "checkpoints"
    assert main(["pin", str(run[0]), "--step", "1"]) == 0
    assert main(["prune", str(run[0]), "--keep-last", "1", "--dry-run"]) == 0
    assert ckpt_layout.committed_steps(root) == [1, 2, 3]
    assert main(["prune", str(run[0]), "--keep-last", "1"]) == 0
    assert ckpt_layout.committed_steps(root) == [1, 3]
    assert "removed: [2]" in capsys.readouterr().out


def test_export_safetensors_is_usable_outside(run, tmp_path, capsys):
    src, model = run
    out = tmp_path / "exp"
    assert main(["export", str(src), "--format", "safetensors", "--out", str(out)]) == 0
    weights = load_file(str(out / "model.safetensors"))
    ref = model.state_dict()
    assert weights.keys() == ref.keys()
    assert all(torch.equal(weights[k], ref[k]) for k in ref)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["step"] == 3 and cfg["model"]["d_model"] == 16
    fresh = GPT(ModelConfig(**cfg["model"]))
    fresh.load_state_dict(weights, strict=True)
    assert main(["export", str(src), "--format", "gguf"]) == 2
    assert "--format 'gguf' is not supported" in capsys.readouterr().err


def test_interval_prints_inputs_and_waste(run, capsys):
    # As a console script, end to end (once); the JSON form through the same main().
    p = subprocess.run([sys.executable, "-m", "xirang_hpc.cli.ckpt", "interval", str(run[0])],
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr
    assert "MTBF 2.00h from config" in p.stdout and "Daly interval" in p.stdout and "expected waste" in p.stdout
    capsys.readouterr()
    assert main(["interval", str(run[0]), "--json"]) == 0
    rec = json.loads(capsys.readouterr().out)
    assert rec["step_s"] == pytest.approx(64 / 1000)
    assert rec["interval_s"] >= rec["persist_s"]


def test_not_a_run_dir_is_a_clear_error(tmp_path, capsys):
    assert main(["list", str(tmp_path / "nope")]) == 2  # the help's "2 no such run, step or file"
    err = capsys.readouterr().err
    assert err.startswith("xirang-ckpt: error: ") and "is not a run directory" in err
