"""A save that fails on the storage names the cause: a real full tmpfs and a real read-only bind mount.

Needs root (mount); each test unmounts in its teardown.
"""

from __future__ import annotations

import errno
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from xirang_hpc.checkpoint.errors import CheckpointWriteError
from xirang_hpc.checkpoint.manager import CheckpointManager
from xirang_hpc.job.training import report_save_failure
from xirang_hpc.monitor.events import read_events
from xirang_hpc.runs.status import run_status

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="mounts a tmpfs / read-only bind mount: needs root")


def _sh(*args: str) -> None:
    subprocess.run(list(args), check=True, capture_output=True)


@pytest.fixture
def small_fs(tmp_path):
    """A 2 MiB tmpfs."""
    d = tmp_path / "small"
    d.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(d)], capture_output=True, text=True)
    if r.returncode != 0:  # root without CAP_SYS_ADMIN (an unprivileged container)
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip() or r.returncode}")
    yield d
    _sh("umount", str(d))


@pytest.fixture
def ro_bind(tmp_path):
    """A bind mount of a writable directory; call the returned function to make it read-only."""
    src, d = tmp_path / "src", tmp_path / "ro"
    src.mkdir()
    d.mkdir()
    _sh("mount", "--bind", str(src), str(d))
    yield d, lambda: _sh("mount", "-o", "remount,bind,ro", str(d))
    _sh("umount", str(d))


def _leftovers(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if ".tmp-" in p.name)


# A save of many small tensors into the full filesystem, in a child process: HDF5 buffers small datasets,
# so the write error first appears when the file is closed, and that close used to kill the process with
# SIGSEGV (a return code of -11 here, instead of the save's error).
_SAVE_SMALL_TENSORS = """
import sys, torch
from pathlib import Path
from xirang_hpc.checkpoint.manager import CheckpointManager
from xirang_hpc.checkpoint.storage import HDF5StorageWriter
root, how = Path(sys.argv[1]), sys.argv[2]
if how == "unchecked":  # as if the disk filled up after the free-space check (another job, another rank)
    HDF5StorageWriter._check_room = lambda self, plans: None
mgr = CheckpointManager(root, async_save=True, compression="lzf" if how == "lzf" else "none")
tensors = {f"t{i}": torch.randn(4096) for i in range(200)}  # 3.1 MiB in 16 KiB tensors
mgr.save(3, tensors, state={"step": 3})
try:
    mgr.wait()
except OSError as exc:
    print("SAVE FAILED:", type(exc).__name__, exc, flush=True)
mgr.save(4, {"w": torch.ones(16)}, state={"step": 4})  # a save that fits still commits
mgr.wait()
print("AFTER:", sorted(p.name for p in root.iterdir()), flush=True)
"""


@pytest.mark.slow  # real processes filling a real small filesystem
@pytest.mark.parametrize("how", ["checked", "unchecked", "lzf"])
def test_full_disk_never_crashes_the_writer(small_fs, how):
    root = small_fs / "ckpt"
    r = subprocess.run([sys.executable, "-X", "faulthandler", "-c", _SAVE_SMALL_TENSORS, str(root), how],
                       capture_output=True, text=True, timeout=300)
    out = r.stdout + r.stderr
    assert r.returncode == 0, f"the saving process died (rc {r.returncode}):\n{out[-4000:]}"
    assert "Fatal Python error" not in out and "Can't decrement id ref count" not in out, out[-4000:]
    (line,) = [ln for ln in r.stdout.splitlines() if ln.startswith("SAVE FAILED:")]
    assert "CheckpointWriteError" in line and "no space left on the device (ENOSPC)" in line, line
    assert "needs " in line and "bytes free there" in line and str(root / "step_3.tmp-") in line, line
    if how != "checked":  # the write itself failed: the rank's file is named
        assert "rank_0.h5" in line, line
    assert _leftovers(root) == [] and not (root / "step_3").exists()
    assert (root / "step_4").is_dir() and (root / "latest").read_text().strip() == "step_4"


def test_full_disk_names_file_errno_and_free_bytes_and_leaves_no_temporary(small_fs):
    root = small_fs / "ckpt"
    mgr = CheckpointManager(root, async_save=False)
    with pytest.raises(CheckpointWriteError) as info:
        mgr.save(5, {"w": torch.zeros(1024, 1024)}, state={"step": 5})  # 4 MiB into 2 MiB
    e = info.value
    assert e.errno == errno.ENOSPC and e.errno_name == "ENOSPC" and e.step == 5
    # Refused before anything was written: the step's directory is named, with what the save needs there.
    assert e.file.startswith(str(root / "step_5.tmp-")), e.file
    assert e.free_bytes is not None and e.free_bytes < 1024 * 1024 * 4 <= e.needed_bytes
    assert "no space left" in str(e) and "bytes free" in str(e) and "needs" in str(e) and "killed" not in str(e)
    assert _leftovers(root) == []
    # Nothing lost: a save that fits still commits afterwards.
    mgr.save(6, {"w": torch.zeros(16, 16)}, state={"step": 6})
    assert (root / "step_6").is_dir() and _leftovers(root) == []


def test_async_save_failure_surfaces_as_the_storage_error(small_fs):
    mgr = CheckpointManager(small_fs / "ckpt", async_save=True)
    mgr.save(1, {"w": torch.zeros(1024, 1024)})
    with pytest.raises(CheckpointWriteError, match="ENOSPC"):
        mgr.wait()
    assert _leftovers(small_fs / "ckpt") == []


def test_read_only_path_is_named(ro_bind):
    d, make_ro = ro_bind
    mgr = CheckpointManager(d / "ckpt", async_save=False)
    make_ro()
    with pytest.raises(CheckpointWriteError) as info:
        mgr.save(3, {"w": torch.ones(4)})
    e = info.value
    assert e.errno == errno.EROFS and "read-only" in str(e) and str(d / "ckpt" / "step_3.tmp-") in e.file


def test_failure_reaches_events_and_status_not_as_a_signal(small_fs, tmp_path, capsys):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    with pytest.raises(CheckpointWriteError) as info:
        CheckpointManager(small_fs / "ckpt", async_save=False).save(7, {"w": torch.zeros(1024, 1024)})
    report_save_failure(info.value, SimpleNamespace(rank=0, node_name="n1"), run_dir, hooks=[])
    assert "xirang: error: checkpoint save of step 7 failed" in capsys.readouterr().err
    ev = [e for e in read_events(run_dir) if e["kind"] == "save_failed"][-1]
    assert (ev["errno"], ev["errno_name"], ev["step"]) == (errno.ENOSPC, "ENOSPC", 7)
    assert ev["file"].startswith(str(small_fs / "ckpt" / "step_7.tmp-")) and isinstance(ev["free_bytes"], int)
    assert ev["needed_bytes"] >= 4 * 1024 * 1024 > ev["free_bytes"]
    status = run_status(run_dir)
    assert "no space left" in status["state_reason"] and "ENOSPC" in status["state_reason"], status


@pytest.mark.slow
def test_a_training_run_whose_checkpoints_fill_the_disk_stops_naming_the_cause(tmp_path, source_data):
    """The embedded default (4 ranks, async saves) with its checkpoints on a 4 MiB tmpfs: step 2 fits, step 4
    does not. No rank crashes, the cause is in events.jsonl and every rank's stderr, nothing is left half
    written, and the stop is a storage failure, not a dead node."""
    run = tmp_path / "run"
    ckpt = run / "checkpoints"
    ckpt.mkdir(parents=True)
    m = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(ckpt)], capture_output=True, text=True)
    if m.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {m.stderr.strip() or m.returncode}")
    try:
        r = subprocess.run([str(Path(sys.executable).parent / "xirang-train"), "train.max_steps=8",
                            "train.warmup_steps=1", "train.log_every=2", "checkpoint.every_steps=2",
                            f"train.run_dir={run}", f"data.out_dir={source_data}"],
                           cwd=tmp_path, capture_output=True, text=True, timeout=600,
                           env={**os.environ, "PYTHONFAULTHANDLER": "1"})  # a native crash prints its stack
        logs = r.stdout + r.stderr + "".join(p.read_text(errors="replace") for p in (run / "submitit").glob("*_log.*"))
        assert r.returncode != 0, logs[-3000:]
        assert "Fatal Python error" not in logs and "Can't decrement id ref count" not in logs, logs[-6000:]
        events = read_events(run)
        (failed,) = [e for e in events if e["kind"] == "save_failed"]
        assert (failed["step"], failed["errno_name"]) == (4, "ENOSPC") and "no space left" in failed["error"]
        assert failed["needed_bytes"] > failed["free_bytes"] >= 0
        # Every rank's log names it (the batch step's output), not only the event log.
        assert logs.count("xirang: error: checkpoint save of step 4 failed") >= 4, logs[-3000:]
        assert not [e for e in events if "native code" in e.get("reason", "") or e.get("reason") == "node_failure"]
        from xirang_hpc.monitor.events import storage_failure

        assert storage_failure(run) == failed  # what the Slurm supervisor and the in-job driver classify by
        assert _leftovers(ckpt) == [] and (ckpt / "step_2").is_dir() and not (ckpt / "step_4").exists()
        assert "no space left" in run_status(run)["state_reason"]
    finally:
        _sh("umount", str(ckpt))
