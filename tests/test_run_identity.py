"""A run directory holds one run: mismatched launches are refused before anything is written or started,
finished runs start nothing, ``train.extend_to`` extends, and unwritable paths are named up front.

The launches are the real ``xirang-train`` (submitit local executor, one gloo rank) on a real run
directory; read-only and full file systems are real tmpfs mounts (root ignores permission bits).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from conftest import compose_cfg

from xirang_hpc.cli.train import format_summary
from xirang_hpc.config.validate import load_config
from xirang_hpc.submit.preflight import PreflightError, check_paths, checkpoint_bytes, preflight

EXE = Path(sys.executable).parent / "xirang-train"
# One rank, a few steps, a checkpoint every 2 steps: the smallest real run.
SMALL = ["cluster.nodes=1", "cluster.tasks_per_node=1", "parallel.pp=1", "parallel.microbatches=1",
         "train.max_steps=4", "train.warmup_steps=1", "train.global_batch=8", "train.log_every=2",
         "train.eval_batches=1", "checkpoint.every_steps=2", "monitor.enabled=false"]


def _train(run: Path, data: Path, *over: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(EXE), *SMALL, f"train.run_dir={run}", f"data.out_dir={data}", *over],
                          cwd=run.parent, capture_output=True, text=True, timeout=600)


def _snapshot(root: Path) -> dict[str, tuple[int, int]]:
    """Every file under ``root`` with its size and mtime: any write shows up."""
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory, email_data: Path) -> tuple[Path, Path]:
    """A finished 4-step run (checkpoints at steps 2 and 4)."""
    run = tmp_path_factory.mktemp("identity") / "run"
    r = _train(run, email_data)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert sorted(p.name for p in (run / "checkpoints").glob("step_*")) == ["step_2", "step_4"]
    return run, email_data


@pytest.mark.slow
def test_shape_change_is_refused_before_anything_is_written(trained: tuple[Path, Path]) -> None:
    run, data = trained
    ident = json.loads((run / "identity.json").read_text())
    assert ident["model"]["d_model"] == 64 and ident["data"]["tokenizer"] == "byte"
    before = _snapshot(run)
    r = _train(run, data, "model.d_model=32")
    assert r.returncode == 2, r.stdout[-3000:] + r.stderr[-3000:]
    assert "model.d_model: the run has 64, this launch has 32" in r.stderr
    assert "a new run directory" in r.stderr and "Traceback" not in r.stderr
    assert "submitted job" not in r.stdout  # no rank started
    assert _snapshot(run) == before  # checkpoints, metrics, logs: untouched


@pytest.mark.slow
def test_run_without_identity_file_is_checked_against_its_checkpoint(trained: tuple[Path, Path]) -> None:
    # A run made before identity.json existed: the config in its newest checkpoint identifies it.
    run, data = trained
    ident = run / "identity.json"
    saved = ident.read_bytes()
    ident.unlink()
    try:
        before = _snapshot(run)
        r = _train(run, data, "model.n_layer=2")
        assert r.returncode == 2, r.stdout[-3000:] + r.stderr[-3000:]
        assert "model.n_layer: the run has 4, this launch has 2" in r.stderr
        assert "checkpoint step 4" in r.stderr
        assert _snapshot(run) == before
    finally:
        ident.write_bytes(saved)


@pytest.mark.slow
def test_finished_run_starts_nothing(trained: tuple[Path, Path]) -> None:
    run, data = trained
    before = _snapshot(run)
    r = _train(run, data)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "is complete: its last checkpoint is step 4 of 4" in r.stdout
    assert "train.extend_to=" in r.stdout and "submitted job" not in r.stdout
    assert _snapshot(run) == before


@pytest.mark.slow
def test_more_steps_on_a_run_points_to_extend_to(trained: tuple[Path, Path]) -> None:
    run, data = trained
    before = _snapshot(run)
    r = _train(run, data, "train.max_steps=8")
    assert r.returncode == 2
    assert "train.max_steps: the run has 4, this launch has 8" in r.stderr
    assert "train.extend_to=8" in r.stderr and "train.resume_from=STEP (steps [2, 4])" in r.stderr
    assert _snapshot(run) == before


@pytest.mark.slow
def test_extend_to_resumes_and_reports_this_session(trained: tuple[Path, Path]) -> None:
    run, data = trained
    r = _train(run, data, "train.extend_to=6")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "checkpoint: resumed from" in r.stdout and "step_4 (step 4, filesystem)" in r.stdout
    assert "done: 2 steps this session (steps 4 -> 6 of 6)" in r.stdout
    assert "step_6" in {p.name for p in (run / "checkpoints").glob("step_*")}
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    lrs = {row["step"]: row["lr"] for row in rows if "lr" in row}
    cfg = load_config(compose_cfg(SMALL))
    assert lrs[6] == pytest.approx(cfg.train.lr * cfg.train.min_lr_ratio)  # past max_steps: the final LR
    # The same command again: complete at the new end.
    again = _train(run, data, "train.extend_to=6")
    assert again.returncode == 0 and "is complete: its last checkpoint is step 6 of 6" in again.stdout


@pytest.mark.slow
def test_finished_run_with_a_damaged_final_checkpoint_is_repaired(email_data: Path, tmp_path: Path) -> None:
    """The final checkpoint truncated (as a disk fault leaves it): the run is not complete. xirang-status says
    so, the launch names the damaged step and resumes from the newest good one, and the step it writes
    again is bitwise the one the uninterrupted run wrote. (Its own run: the module's is extended by others.)"""
    from test_checkpoint_resume import saved_tensors

    from xirang_hpc.checkpoint import layout as ckpt_layout

    data, run = email_data, tmp_path / "run"
    first = _train(run, data)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    want = saved_tensors(run / "checkpoints" / "step_4")
    h5 = run / "checkpoints" / "step_4" / "rank_0.h5"
    with h5.open("r+b") as f:
        f.truncate(h5.stat().st_size - 100)
    status = subprocess.run([str(EXE.parent / "xirang-status"), str(run)], capture_output=True, text=True,
                            timeout=120)
    assert "FAILED" in status.stdout and "final checkpoint step 4 fails verification" in status.stdout, status.stdout
    assert "step 4 CORRUPT" in status.stdout and "ckpt      step 2" in status.stdout
    r = _train(run, data)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "is complete" not in r.stdout
    assert f"checkpoint step 4 of {run} fails verification: {h5}: size" in r.stderr
    assert "resuming from step 2, the newest good checkpoint" in r.stderr
    assert "step_2 (step 2, filesystem)" in r.stdout
    ckpt_layout.verify(run / "checkpoints" / "step_4")  # written again, whole
    got = saved_tensors(run / "checkpoints" / "step_4")
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    again = _train(run, data)
    assert again.returncode == 0 and "is complete: its last checkpoint is step 4 of 4" in again.stdout


@pytest.mark.slow
def test_a_checkpoint_of_another_model_is_never_overwritten(email_data: Path, tmp_path: Path) -> None:
    """identity.json says d_model=32 (it was replaced), the checkpoints hold d_model=64: the job refuses,
    naming the tensor and both shapes; it does not fall back, start from step 0 or re-save over them."""
    from xirang_hpc.checkpoint.identity import write_identity

    data, run = email_data, tmp_path / "run"
    first = _train(run, data)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    (run / "identity.json").unlink()
    write_identity(run, load_config(compose_cfg([*SMALL, f"train.run_dir={run}", f"data.out_dir={data}",
                                                 "model.d_model=32"])))
    before = _snapshot(run / "checkpoints")
    r = _train(run, data, "model.d_model=32", "train.extend_to=6")  # past its end: the job must load step 4
    assert r.returncode != 0, r.stdout[-3000:] + r.stderr[-3000:]
    out = r.stdout + r.stderr
    assert "step_4 holds another model (model." in out and "nothing was loaded, nothing deleted" in out, out[-3000:]
    assert "falling back" not in out
    assert _snapshot(run / "checkpoints") == before


def test_fork_may_change_optimisation_but_not_the_model(tmp_path: Path) -> None:
    from xirang_hpc.checkpoint.identity import write_identity

    run = tmp_path / "run"
    run.mkdir()
    write_identity(run, load_config(compose_cfg([f"train.run_dir={run}"])))
    (run / "checkpoints" / "step_2").mkdir(parents=True)
    # train.resume_from forks: a new LR is what forks are for...
    st = preflight(load_config(compose_cfg([f"train.run_dir={run}", "train.resume_from=2", "train.lr=1e-4"])))
    assert not st.complete
    # ...but its checkpoints could not load into another shape.
    with pytest.raises(PreflightError, match=r"model.n_head: the run has 4, this launch has 2"):
        preflight(load_config(compose_cfg([f"train.run_dir={run}", "train.resume_from=2", "model.n_head=2"])))
    with pytest.raises(PreflightError, match="train.lr: the run has 0.003, this launch has 0.0001"):
        preflight(load_config(compose_cfg([f"train.run_dir={run}", "train.lr=1e-4"])))
    # ...and only from a step the run has, refused before anything is written.
    with pytest.raises(PreflightError, match=r"train.resume_from=3: .* has no checkpoint for step 3 \(it has \[2\]\)"):
        preflight(load_config(compose_cfg([f"train.run_dir={run}", "train.resume_from=3"])))


def test_unreadable_identity_is_named(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    (run / "identity.json").write_text("{not json")
    with pytest.raises(PreflightError, match=r"identity.json cannot be read .*nothing was started"):
        preflight(load_config(compose_cfg([f"train.run_dir={run}"])))


# ---- writable paths: real read-only and full file systems ------------------------------------------

@pytest.fixture
def mounts(tmp_path: Path) -> Iterator[dict[str, Path]]:
    """A read-only tmpfs and a 1 MiB tmpfs (needs root and mount(2); skipped elsewhere)."""
    ro, tiny = tmp_path / "ro", tmp_path / "tiny"
    ro.mkdir()
    tiny.mkdir()
    done: list[Path] = []
    try:
        for path, opts in ((ro, "ro,size=1m"), (tiny, "size=1m")):
            r = subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(path)], capture_output=True)
            if r.returncode:
                pytest.skip(f"cannot mount tmpfs here: {r.stderr.decode().strip()}")
            done.append(path)
        yield {"ro": ro, "tiny": tiny}
    finally:
        for path in done:
            subprocess.run(["umount", str(path)], check=False)


def _cfg(*over: str):  # noqa: ANN202 - a XirangConfig
    return load_config(compose_cfg([*SMALL, *over]))


def test_read_only_run_dir_is_named(mounts: dict[str, Path], tmp_path: Path) -> None:
    with pytest.raises(PreflightError, match=r"run directory .*/ro/run is not writable .*read-only file system"):
        preflight(_cfg(f"train.run_dir={mounts['ro']}/run", f"data.out_dir={tmp_path}/d"))
    with pytest.raises(PreflightError, match=r"runs root .*/ro/runs is not writable.*read-only"):
        preflight(_cfg(f"train.runs_root={mounts['ro']}/runs", f"data.out_dir={tmp_path}/d"))
    with pytest.raises(PreflightError, match=r"data directory .*/ro/data is not writable.*read-only"):
        preflight(_cfg(f"train.run_dir={tmp_path}/run", f"data.out_dir={mounts['ro']}/data"))
    assert not (tmp_path / "run").exists()


def test_read_only_checkpoint_dir_is_named(tmp_path: Path) -> None:
    run = tmp_path / "run"
    ck = run / "checkpoints"
    ck.mkdir(parents=True)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(ck)], capture_output=True)
    if r.returncode:
        pytest.skip(f"cannot mount tmpfs here: {r.stderr.decode().strip()}")
    try:
        cfg = _cfg(f"train.run_dir={run}", f"data.out_dir={tmp_path}/d")
        with pytest.raises(PreflightError, match=r"checkpoint directory .*/run/checkpoints is not writable.*read-only"):
            check_paths(cfg, run)
    finally:
        subprocess.run(["umount", str(ck)], check=False)


def test_kernel_filesystem_is_named(tmp_path: Path) -> None:
    # /proc/sys refuses new entries even to root.
    with pytest.raises(PreflightError, match=r"run directory /proc/sys/run is not writable"):
        preflight(_cfg("train.run_dir=/proc/sys/run", f"data.out_dir={tmp_path}/d"))


def test_no_space_for_one_checkpoint(mounts: dict[str, Path], tmp_path: Path) -> None:
    cfg = _cfg(f"train.run_dir={mounts['tiny']}/run", f"data.out_dir={tmp_path}/d")
    need = checkpoint_bytes(cfg)
    assert need > 1 << 20  # the tiny model's checkpoint does not fit in 1 MiB
    with pytest.raises(PreflightError, match=r"checkpoint directory .*only 1.0 MiB free.*needs about 2.7 MiB"):
        preflight(cfg)
    # Without checkpoints nothing large is written: accepted.
    preflight(_cfg(f"train.run_dir={mounts['tiny']}/run", f"data.out_dir={tmp_path}/d", "checkpoint.enabled=false"))


@pytest.mark.slow
def test_read_only_run_dir_fails_before_submission_from_the_cli(mounts: dict[str, Path], email_data: Path) -> None:
    r = _train(mounts["ro"] / "run", email_data)
    assert r.returncode == 2, r.stdout[-2000:] + r.stderr[-2000:]
    assert "is not writable" in r.stderr and "read-only file system" in r.stderr
    assert "Traceback" not in r.stderr and "submitted job" not in r.stdout


# ---- summaries ---------------------------------------------------------------------------------------

def _summary(**kw: object) -> dict[str, object]:
    base = {"initial_val_loss": 5.0, "final_val_loss": 4.0, "steps": 80, "end_step": 80, "start_step": 60,
            "session_steps": 20, "world_size": 4, "train_seconds": 7.1, "tokens_per_s": 5770.0, "run_dir": "/r"}
    return {**base, **kw}


def test_summary_counts_this_session() -> None:
    text = format_summary(_summary())
    assert "done: 20 steps this session (steps 60 -> 80 of 80) on 4 ranks in 7.1s" in text
    assert "5,770 tokens/s over this session's steps" in text
    fresh = format_summary(_summary(start_step=0, session_steps=80))
    assert "done: 80 steps this session (80 of 80 steps)" in fresh
    idle = format_summary(_summary(start_step=80, session_steps=0, tokens_per_s=0.0, train_seconds=0.0))
    assert "done: 0 steps this session" in idle and "n/a (no step ran in this session)" in idle


def test_ro_probe_leaves_nothing(tmp_path: Path) -> None:
    check_paths(_cfg(f"train.run_dir={tmp_path}/run", f"data.out_dir={tmp_path}/d"), tmp_path / "run")
    assert os.listdir(tmp_path) == []


def test_a_layout_that_cannot_fit_the_gpus_is_refused_before_the_queue(tmp_path: Path) -> None:
    """Llama 3 8B under FSDP at a 131,072-token window on one H100 node, no recompute: ~700 GiB of activations
    per GPU, refused naming the window and the ways to fit; the preset's own 2,048-token window fits."""
    base = [f"train.run_dir={tmp_path / 'run'}", "model=llama3-8b", "cluster=h100-ib", "cluster.nodes=1",
            "parallel=fsdp", "parallel.pp=1", "parallel.tp=1", "parallel.microbatches=1", "train.global_batch=8",
            "checkpoint.enabled=false"]  # (and no 90 GiB checkpoint to find room for here)
    with pytest.raises(PreflightError, match=r"needs ~\d+\.\d GiB per GPU and a h100 has 80 GiB "
                                             r"\(activations .*parallel.recompute=full") as refused:
        preflight(load_config(compose_cfg([*base, "model.seq_len=131072"])))
    assert refused.value.field == "model.seq_len"
    assert not (tmp_path / "run").exists()  # nothing written
    preflight(load_config(compose_cfg([*base, "model.seq_len=2048"])))  # the preset's own window fits


def test_a_memory_dir_on_disk_is_refused(tmp_path: Path) -> None:
    from xirang_hpc.submit.preflight import check_memory_dir, filesystem_type

    mounts = tmp_path / "mounts"
    mounts.write_text(f"tmpfs /dev/shm tmpfs rw 0 0\n/dev/sda1 / ext4 rw 0 0\n/dev/sdb {tmp_path} xfs rw 0 0\n")
    assert filesystem_type(Path("/dev/shm"), mounts) == "tmpfs" and filesystem_type(tmp_path / "x", mounts) == "xfs"
    disk = tmp_path / "copies"
    disk.mkdir()
    cfg = load_config(compose_cfg(["checkpoint.in_memory=true", f"checkpoint.memory_dir={disk}"]))
    with pytest.raises(PreflightError, match=r"checkpoint.memory_dir=.* is on a xfs filesystem, not in memory"):
        check_memory_dir(cfg, mounts)
    check_memory_dir(load_config(compose_cfg(["checkpoint.in_memory=true", "checkpoint.memory_dir=/dev/shm"])),
                     mounts)


@pytest.mark.unit
def test_a_checkpoint_mode_that_lets_the_group_or_others_write_is_refused() -> None:
    """``checkpoint.dir_mode`` that would let another user replace a checkpoint is refused naming the field;
    an owner-only or group-readable mode is taken."""
    from xirang_hpc.config.errors import ConfigError

    for mode in (0o777, 0o770, 0o702):
        with pytest.raises(ConfigError, match=r"checkpoint.dir_mode.*(group or others write|0o700)"):
            load_config(compose_cfg([f"checkpoint.dir_mode={mode}"]))
    assert load_config(compose_cfg(["checkpoint.dir_mode=488"])).checkpoint.dir_mode == 0o750
