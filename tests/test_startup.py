"""A rank's start-up imports run without cyclic garbage collections and end frozen (runtime/startup.py)."""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys

import pytest

from xirang_hpc.runtime.startup import collector_paused, import_paused

# In a fresh interpreter: count the collections CPython runs while the job's training stack is imported.
COUNT_COLLECTIONS = """
import gc, json, sys
runs = []
gc.callbacks.append(lambda phase, info: runs.append(info["generation"]) if phase == "start" else None)
{setup}
print(json.dumps({{"runs": len(runs), "full": runs.count(2), "enabled": gc.isenabled(), "frozen": gc.get_freeze_count(),
                  "torch": "torch" in sys.modules, "dynamo": "torch._dynamo" in sys.modules}}))
"""


def _collections(setup: str) -> dict:
    out = subprocess.run([sys.executable, "-c", COUNT_COLLECTIONS.format(setup=setup)], capture_output=True,
                         text=True, check=True, timeout=600)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_the_job_imports_its_training_stack_without_a_collection_and_freezes_it() -> None:
    """What a rank imports before its first step (torch, torch._dynamo, DTensor, the training module) makes
    hundreds of thousands of objects: plainly imported, CPython collects dozens of times meanwhile; through the
    job's entry, no full one, and the objects end in the permanent generation, with the collector on again."""
    plain = _collections("import torch._dynamo, torch.distributed.checkpoint\nimport xirang_hpc.job.training")
    assert plain["runs"] > 20 and plain["full"] >= 1 and plain["frozen"] == 0, plain  # what the pause spares
    job = _collections("from xirang_hpc.job.entry import training_stack\ntraining_stack()")
    # None while importing; once the collector is back, the first allocations run a few young-generation
    # collections (the allocation counter grew meanwhile) over what was made since the freeze.
    assert job["full"] == 0 and job["runs"] < 10, job
    assert job["enabled"] and job["torch"] and job["dynamo"], job
    assert job["frozen"] > 200_000, job


def test_collector_paused_freezes_what_the_block_made_and_restores_the_collector() -> None:
    gc.unfreeze()  # conftest froze its imports: start from none frozen, and leave them frozen again below
    try:
        assert gc.isenabled()
        with collector_paused():
            assert not gc.isenabled()
            made = [[] for _ in range(1000)]
        assert gc.isenabled()
        assert gc.get_freeze_count() >= len(made)
        gc.disable()
        with collector_paused():
            pass
        assert not gc.isenabled(), "a collector that was off stays off"
    finally:
        gc.enable()
        gc.freeze()


def test_import_paused_names_the_modules_that_failed_and_imports_the_rest() -> None:
    failed = import_paused(["json", "xirang_hpc_no_such_module", "colorsys"])
    assert [name for name, _ in failed] == ["xirang_hpc_no_such_module"]
    assert isinstance(failed[0][1], ModuleNotFoundError)
    assert "colorsys" in sys.modules and gc.isenabled()


def test_a_rank_that_cannot_import_its_stack_says_why_not_what_a_second_import_says(tmp_path) -> None:
    """torch._dynamo makes its compile cache directory half-way through its import; when that fails (a cache
    path inherited from another user), the first error is the rank's error, named, and not the unrelated
    "already registered" of importing the half-imported module again."""
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    code = "from xirang_hpc.job.entry import training_stack\ntraining_stack()"
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(blocker / "cache")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode != 0
    assert "NotADirectoryError" in out.stderr and f"TORCHINDUCTOR_CACHE_DIR={blocker / 'cache'}" in out.stderr
    assert "while importing torch._dynamo" in out.stderr and "already registered" not in out.stderr, out.stderr


@pytest.mark.parametrize("module", ["xirang_hpc.job.entry", "xirang_hpc.local.preload"])
def test_startup_helpers_import_no_torch(module: str) -> None:
    """The job entry and the preload client load before anything heavy: importing them imports no torch."""
    out = _collections(f"import {module}")
    assert not out["torch"], out


def test_the_server_imports_its_stack_frozen_so_a_full_collection_is_short(tmp_path) -> None:
    """``xirang-serve`` imports torch and the serving stack under the paused collector: a full collection in the
    serving process then skips those objects (here: it fails on a path that holds no weights, after the
    imports, and leaves with exit 2)."""
    code = ("import gc, json, sys\nfrom xirang_hpc.cli.serve import main\n"
            f"try:\n    main([{str(tmp_path / 'none')!r}])\nexcept SystemExit as exc:\n    rc = exc.code\n"
            "print(json.dumps({'rc': rc, 'frozen': gc.get_freeze_count(), 'torch': 'torch' in sys.modules,"
            " 'enabled': gc.isenabled()}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=600)
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["rc"] == 2 and got["torch"] and got["enabled"], (got, out.stderr)
    assert got["frozen"] > 200_000, got
