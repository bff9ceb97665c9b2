"""Atomic manager: crash safety under kill -9, corruption fallback, snapshot semantics, retention, permissions."""

from __future__ import annotations

import logging
import os
import random
import signal
import stat
import time
from pathlib import Path

import pytest
import torch
from ranks import rank_context

from xirang_hpc.checkpoint import layout as ckpt_layout
from xirang_hpc.checkpoint.manager import CheckpointManager
from xirang_hpc.checkpoint.retention import RetentionPolicy, plan_prune


def _tensors(step: int) -> dict:
    # Every value encodes the step, so a mixed or half-written checkpoint cannot pass the check.
    return {"model": {"w": torch.full((128, 256), float(step)), "b": torch.arange(4096) + step},
            "optim": {"m": torch.full((64, 64), -float(step))}}


def _template() -> dict:
    return {"model": {"w": torch.zeros(128, 256), "b": torch.zeros(4096, dtype=torch.int64)},
            "optim": {"m": torch.zeros(64, 64)}}


def _assert_is_step(t: dict, step: int) -> None:
    assert torch.equal(t["model"]["w"], torch.full((128, 256), float(step)))
    assert torch.equal(t["model"]["b"], torch.arange(4096) + step)
    assert torch.equal(t["optim"]["m"], torch.full((64, 64), -float(step)))


def _saver(root: str, start: int, started) -> None:
    """Child process: save steps start+1, start+2, ... until killed."""
    mgr = CheckpointManager(Path(root), async_save=False, retention=RetentionPolicy(keep_last=2))
    step = start
    while True:
        step += 1
        mgr.save(step, _tensors(step), state={"step": step}, rank_state={"rank": 0, "step": step})
        started.set()


@pytest.mark.slow  # 50 real kill -9 of a saving process: seconds of CPU, a process tier test
def test_kill_minus_9_at_random_moments_never_leaves_a_bad_latest(tmp_path):
    """>= 50 trials: kill -9 the saver at a random moment; the newest committed checkpoint always verifies
    and loads exactly, leftovers are cleaned, and steps only move forward."""
    ctx = rank_context()
    rng = random.Random(5)
    root = tmp_path / "ckpt"
    last, mid_write, trials = 0, 0, 50
    for _ in range(trials):
        started = ctx.Event()
        p = ctx.Process(target=_saver, args=(str(root), last, started))
        p.start()
        assert started.wait(60), "saver never completed a first save"
        time.sleep(rng.uniform(0.0, 0.05))
        os.kill(p.pid, signal.SIGKILL)
        p.join()
        assert p.exitcode == -signal.SIGKILL
        mid_write += any(".tmp-" in q.name for q in root.iterdir())
        mgr = CheckpointManager(root, async_save=False)
        mgr.cleanup_leftovers()
        assert not any(".tmp-" in q.name for q in root.iterdir())
        t = _template()
        res = mgr.load(t)
        assert res is not None and res.skipped == []
        assert res.step == max(ckpt_layout.committed_steps(root)) and res.step > last
        ckpt_layout.verify(res.path)
        _assert_is_step(t, res.step)
        assert res.state == {"step": res.step} and res.rank_state == {"rank": 0, "step": res.step}
        last = res.step
    # The kills must really have landed in the middle of saves, or the test proves nothing.
    assert mid_write >= trials // 5, f"only {mid_write}/{trials} kills interrupted a save"


@pytest.fixture
def two_steps(tmp_path) -> tuple[CheckpointManager, Path]:
    mgr = CheckpointManager(tmp_path / "ckpt", async_save=False)
    for s in (1, 2):
        mgr.save(s, _tensors(s), state={"step": s})
    return mgr, tmp_path / "ckpt"


def test_truncated_shard_is_named_and_falls_back(two_steps, caplog):
    mgr, root = two_steps
    bad = root / "step_2" / "rank_0.h5"
    with bad.open("r+b") as f:
        f.truncate(bad.stat().st_size // 2)
    with pytest.raises(ckpt_layout.CheckpointCorruptError, match=r"step_2/rank_0\.h5: size \d+ bytes.*truncated"):
        ckpt_layout.verify(root / "step_2")
    t = _template()
    with caplog.at_level(logging.ERROR):
        res = mgr.load(t)
    assert res.step == 1 and res.skipped[0][0] == 2
    _assert_is_step(t, 1)
    assert "step_2/rank_0.h5" in caplog.text and "falling back" in caplog.text


def test_garbage_shard_is_named_and_falls_back(two_steps, caplog):
    mgr, root = two_steps
    bad = root / "step_2" / "rank_0.h5"
    bad.write_bytes(os.urandom(bad.stat().st_size))  # same size: only the checksum can tell
    t = _template()
    with caplog.at_level(logging.ERROR):
        res = mgr.load(t)
    assert res.step == 1
    _assert_is_step(t, 1)
    assert "step_2/rank_0.h5: checksum" in caplog.text
    corrupt = r"step_2/rank_0\.h5: checksum \(xxh3_128\) .* \(corrupted\)"
    with pytest.raises(ckpt_layout.CheckpointCorruptError, match=corrupt):
        mgr.load(_template(), step=2, fallback=False)


def test_missing_manifest_is_not_a_checkpoint(two_steps):
    mgr, root = two_steps
    (root / "step_2" / "manifest.json").unlink()
    t = _template()
    assert mgr.load(t).step == 1


def test_values_changed_after_save_returns_are_never_captured(tmp_path):
    mgr = CheckpointManager(tmp_path / "ckpt", async_save=True)
    t = _tensors(3)
    mgr.save(3, t, state={"step": 3})
    # Training goes on in place while the background thread persists.
    for v in (t["model"]["w"], t["model"]["b"], t["optim"]["m"]):
        v.add_(1000)
    mgr.wait()
    out = _template()
    assert mgr.load(out).step == 3
    _assert_is_step(out, 3)


def test_async_save_waits_for_the_previous_one(tmp_path):
    mgr = CheckpointManager(tmp_path / "ckpt", async_save=True)
    for s in range(1, 5):
        mgr.save(s, _tensors(s), state={"step": s})
    mgr.wait()
    assert ckpt_layout.committed_steps(tmp_path / "ckpt") == [2, 3, 4]  # keep_last=3 by default
    assert ckpt_layout.read_latest(tmp_path / "ckpt") == 4
    assert all(r.persist_s > 0 for r in mgr.history)


def test_retention_keeps_last_every_and_pinned(tmp_path):
    root = tmp_path / "ckpt"
    mgr = CheckpointManager(root, async_save=False, retention=RetentionPolicy(keep_last=2, keep_every=4, pinned=(3,)))
    for s in range(1, 10):
        mgr.save(s, _tensors(s))
        if s == 5:
            (root / "step_5" / ckpt_layout.PINNED).touch()
    assert ckpt_layout.committed_steps(root) == [3, 4, 5, 8, 9]
    keep, delete = plan_prune(root, RetentionPolicy(keep_last=1))
    assert keep == {5, 9} and delete == {3, 4, 8}


def test_a_damaged_step_takes_no_place_among_the_newest(tmp_path):
    """keep_last=2 with the newest step truncated: the two newest *loadable* steps stay, the damaged one goes
    (it cannot be loaded), and the loader falls back past it."""
    root = tmp_path / "ckpt"
    mgr = CheckpointManager(root, async_save=False, retention=RetentionPolicy(keep_last=2))
    for s in (1, 2, 3):
        mgr.save(s, _tensors(s))
    assert ckpt_layout.committed_steps(root) == [2, 3]
    h5 = root / "step_3" / "rank_0.h5"
    with h5.open("r+b") as f:
        f.truncate(h5.stat().st_size // 2)
    assert ckpt_layout.newest_good(root)[0] == 2
    keep, delete = plan_prune(root, RetentionPolicy(keep_last=2))
    assert keep == {2} and delete == {3}  # step 1 is gone already; step 3 does not count as one of the two
    mgr.save(4, _tensors(4))  # the next commit prunes by the same rule
    assert ckpt_layout.committed_steps(root) == [2, 4]
    out = _template()
    assert mgr.load(out).step == 4


def test_checkpoint_directories_are_private(tmp_path):
    root = tmp_path / "ckpt"
    mgr = CheckpointManager(root, async_save=False, dir_mode=0o750)
    mgr.save(1, _tensors(1))
    assert stat.S_IMODE(root.stat().st_mode) == 0o750
    assert stat.S_IMODE((root / "step_1").stat().st_mode) == 0o750
    mgr = CheckpointManager(tmp_path / "c2", async_save=False)
    mgr.save(1, _tensors(1))
    assert stat.S_IMODE((tmp_path / "c2" / "step_1").stat().st_mode) == 0o700


def test_dedup_frozen_half_stores_about_half(tmp_path):
    """Half the parameters frozen: the second checkpoint writes about half the bytes, and loads exactly."""
    root = tmp_path / "ckpt"
    mgr = CheckpointManager(root, async_save=False, dedup=True, retention=RetentionPolicy(keep_last=1))
    g = torch.Generator().manual_seed(1)
    frozen = {f"frozen{i}": torch.randn(256, 256, generator=g) for i in range(4)}
    live = {f"live{i}": torch.randn(256, 256, generator=g) for i in range(4)}
    first = mgr.save(1, {"model": {**frozen, **live}})
    for v in live.values():
        v.mul_(0.5)
    second = mgr.save(2, {"model": {**frozen, **live}})
    full = first.new_bytes
    assert first.ref_bytes == 0
    assert second.new_bytes / full == pytest.approx(0.5, abs=0.02)
    assert second.ref_bytes == full - second.new_bytes
    on_disk = (root / "step_2" / "rank_0.h5").stat().st_size
    assert on_disk < 0.6 * (root / "step_1" / "rank_0.h5").stat().st_size
    # keep_last=1, but step_1 holds data step_2 references: retention must keep it.
    assert ckpt_layout.committed_steps(root) == [1, 2]
    assert ckpt_layout.read_manifest(root / "step_2")["refs"] == ["../step_1"]
    out = {"model": {k: torch.zeros(256, 256) for k in [*frozen, *live]}}
    assert mgr.load(out).step == 2
    for k, v in {**frozen, **live}.items():
        assert torch.equal(out["model"][k], v), k


def test_corrupt_dedup_reference_is_caught_through_the_referencing_step(tmp_path, caplog):
    root = tmp_path / "ckpt"
    mgr = CheckpointManager(root, async_save=False, dedup=True)
    mgr.save(1, _tensors(1))
    t2 = _tensors(1)
    t2["optim"]["m"].fill_(-2.0)  # only this tensor changes; the rest of step 2 points into step 1
    rec = mgr.save(2, t2)
    assert rec.ref_bytes > 0 and ckpt_layout.read_manifest(root / "step_2")["refs"] == ["../step_1"]
    bad = root / "step_1" / "rank_0.h5"
    data = bytearray(bad.read_bytes())
    data[-100:] = b"\xff" * 100
    bad.write_bytes(bytes(data))
    caplog.clear()  # only what the load logs (the saves log at INFO when a worker's earlier test enabled it)
    with caplog.at_level(logging.ERROR):
        assert mgr.load(_template()) is None  # neither step is usable; nothing garbage was loaded
    ours = [r.getMessage() for r in caplog.records
            if r.name == "xirang_hpc.checkpoint.manager" and r.levelno >= logging.ERROR]
    assert len(ours) == 2 and all("ckpt/step_1/rank_0.h5: checksum" in m for m in ours)


def test_a_checkpoint_of_another_model_is_refused_never_skipped(tmp_path):
    """The newest step holds other shapes (another experiment's checkpoint in this run directory): the load
    refuses, naming the tensor and both shapes, instead of falling back past it (and later re-saving that
    step over it); nothing is deleted."""
    from xirang_hpc.checkpoint.errors import CheckpointMismatchError

    root = tmp_path / "ckpt"
    mgr = CheckpointManager(root, async_save=False)
    mgr.save(1, _tensors(1))
    other = {"model": {"w": torch.ones(64, 256), "b": torch.arange(4096)}, "optim": {"m": torch.zeros(64, 64)}}
    mgr.save(2, other)
    before = sorted(p.name for p in (root / "step_2").iterdir())
    with pytest.raises(CheckpointMismatchError, match=r"step_2 holds another model \(model.w is \[64, 256\] there, "
                                                      r"\[128, 256\] in this run's model\)"):
        mgr.load(_template())
    assert ckpt_layout.committed_steps(root) == [1, 2]
    assert sorted(p.name for p in (root / "step_2").iterdir()) == before
    ckpt_layout.verify(root / "step_2")


def test_a_peer_failing_during_the_load_is_not_blamed_on_the_checkpoint(two_steps, monkeypatch):
    """A communication error inside DCP's load (a peer died: gloo's "Connection closed by peer") is raised as such;
    the checkpoint is not skipped, no older one is loaded in its place, and a later load finds it intact."""
    from torch.distributed.checkpoint.api import CheckpointException

    from xirang_hpc.checkpoint import manager as mgr_mod
    from xirang_hpc.checkpoint.errors import CheckpointCommError, comm_failure

    mgr, root = two_steps
    gloo = RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer "
                        "[127.0.0.1]:4242")
    wrapped = CheckpointException("load failed", {1: (gloo, None)})
    assert comm_failure(wrapped).startswith("RuntimeError: [../third_party/gloo")
    assert comm_failure(CheckpointException("x", {0: (OSError(5, "Input/output error"), None)})) is None
    real_load = mgr_mod.dcp.load

    def peer_dies(*a, **k):
        raise wrapped

    monkeypatch.setattr(mgr_mod.dcp, "load", peer_dies)
    t = _template()
    with pytest.raises(CheckpointCommError, match=r"step_2 failed on rank 0 because a peer or the network failed"):
        mgr.load(t)
    assert mgr.last_skipped == []
    monkeypatch.setattr(mgr_mod.dcp, "load", real_load)
    res = mgr.load(t)
    assert res.step == 2 and not res.skipped
    _assert_is_step(t, 2)


def _plant_pickle(step_dir: Path, fqn: str, marker: Path) -> None:
    """The tamper a co-tenant with write access could make: ``fqn`` re-marked in metadata.json as a DCP
    bytes item read from a new HDF5 file holding a pickle, the manifest refreshed to match (its checksums
    are keyless, so anyone can recompute them)."""
    import json
    import pickle

    import h5py
    import numpy as np

    from xirang_hpc.checkpoint.integrity import checksum_file

    class Payload:
        def __reduce__(self):
            return (open, (str(marker), "w"))  # runs at unpickling: the marker file appears

    raw = pickle.dumps(Payload())
    with h5py.File(step_dir / "evil.h5", "w") as f:
        f.create_dataset("x", data=np.frombuffer(raw, dtype=np.uint8))
    md = json.loads((step_dir / "metadata.json").read_text())
    md["tensors"][fqn] = {"bytes": True}
    md["storage"] = [s for s in md["storage"] if s["fqn"] != fqn]
    md["storage"].append({"fqn": fqn, "offset": None,
                          "info": {"file": "evil.h5", "ds": "x", "kind": "bytes", "nbytes": len(raw)}})
    (step_dir / "metadata.json").write_text(json.dumps(md))
    man = ckpt_layout.read_manifest(step_dir)
    for name in ("evil.h5", "metadata.json"):
        p = step_dir / name
        man["files"][name] = {"bytes": p.stat().st_size, "xxh3_128": checksum_file(p)}
    (step_dir / ckpt_layout.MANIFEST).write_text(json.dumps(man))


def test_a_planted_pickle_in_a_checkpoint_never_runs(tmp_path):
    """A checkpoint whose metadata marks a tensor as a pickled bytes item (the manifest refreshed to match)
    is refused before anything is read: the payload never runs and no tensor is touched."""
    root = tmp_path / "ckpt"
    mgr = CheckpointManager(root, async_save=False)
    mgr.save(1, _tensors(1))
    marker = tmp_path / "payload-ran"
    _plant_pickle(root / "step_1", "optim.m", marker)
    ckpt_layout.verify(root / "step_1")  # the tamper passes the integrity check: only the format stops it
    t = _template()
    assert mgr.load(t) is None
    assert not marker.exists(), "the checkpoint's pickle was unpickled"
    assert "pickled bytes item" in mgr.last_skipped[0][1] and "optim.m" in mgr.last_skipped[0][1]
    assert all(torch.equal(v, _template()[g][k]) for g in t for k, v in t[g].items())


def test_a_file_the_manifest_does_not_list_is_refused(tmp_path):
    root = tmp_path / "ckpt"
    mgr = CheckpointManager(root, async_save=False)
    mgr.save(1, _tensors(1))
    mgr.save(2, _tensors(2))
    (root / "step_2" / "extra.h5").write_bytes(b"not ours")
    with pytest.raises(ckpt_layout.CheckpointCorruptError, match=r"step_2/extra.h5: not listed in the manifest"):
        ckpt_layout.verify_quick(root / "step_2")
    t = _template()
    res = mgr.load(t)
    assert res.step == 1 and res.skipped[0][0] == 2 and "extra.h5" in res.skipped[0][1]
    _assert_is_step(t, 1)
    (root / "step_2" / "extra.h5").unlink()
    (root / "step_2" / ckpt_layout.PINNED).touch()  # the pin marker is ours, not a stray file
    assert mgr.load(_template()).step == 2


def test_a_checkpoint_failing_on_its_second_file_leaves_the_model_untouched(tmp_path):
    """Every file a load reads is verified before any tensor is copied: step 2's own file is good, the
    step-1 file it references (dedup) is not; nothing of step 2 may have been copied in."""
    root = tmp_path / "ckpt"
    mgr = CheckpointManager(root, async_save=False, dedup=True)
    mgr.save(1, _tensors(1))
    t2 = _tensors(1)
    t2["model"]["w"].fill_(7.0)  # the first tensor read comes from step 2's own file ...
    mgr.save(2, t2)  # ... the others are references into step 1
    bad = root / "step_1" / "rank_0.h5"
    data = bytearray(bad.read_bytes())
    data[-100:] = b"\xff" * 100
    bad.write_bytes(bytes(data))
    t = _template()
    assert mgr.load(t) is None
    assert all(torch.equal(v, _template()[g][k]) for g in t for k, v in t[g].items()), "half-loaded"
