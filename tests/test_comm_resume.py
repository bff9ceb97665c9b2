"""Budget mode (local SGD, H=4, DiLoCo outer step) resumes exactly through the real job function.

4 spawned ranks on 2 virtual nodes x 2 (pure dp, so DDP with the hierarchical hook), calling
``xirang_hpc.job.training.run_training``: 20 steps straight vs 10 steps (stopped at a step
boundary mid-period, as a preemption would) + resume + 10. Between syncs the replicas on the two
nodes differ, so the checkpoint must carry every rank's own parameters, optimizer moments and
averaging state (``trainer.extra_state["comm"]`` -> ``extra.rank<r>.*``); the final checkpoints
are compared bitwise.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from test_checkpoint_resume import make_cfg as ckpt_make_cfg
from test_checkpoint_resume import run_job  # the same spawned-ranks job runner

from xirang_hpc.checkpoint.storage import HDF5StorageReader, read_metadata

PURE_DP = ["parallel.tp=1", "parallel.pp=1", "parallel.microbatches=1", "comm.sync_period=4",
           "comm.outer_optimizer=nesterov", "comm.bucket=0.25"]


def make_cfg(data_dir: Path, run_dir: Path) -> dict:
    return ckpt_make_cfg(data_dir, run_dir, PURE_DP)


def saved_tensors(step_dir: Path) -> dict[str, torch.Tensor]:
    md = read_metadata(step_dir)
    sd = {k: torch.empty(tuple(m.size), dtype=m.properties.dtype) for k, m in md.state_dict_metadata.items()}
    dcp.load(sd, storage_reader=HDF5StorageReader(step_dir), no_dist=True)
    return sd


def _rank_json(step_dir: Path, r: int) -> dict:
    return json.loads((step_dir / f"rank_{r}.json").read_text())


@pytest.mark.slow
def test_budget_mode_resume_20_vs_10_plus_10(tmp_path: Path, stdlib_data: Path) -> None:
    full, split = tmp_path / "full", tmp_path / "split"
    run_job(make_cfg(stdlib_data, full), full, stdlib_data)
    run_job(make_cfg(stdlib_data, split), split, stdlib_data, stop_at=10)

    # Step 10 is mid-period (syncs after 4 and 8): the two nodes' replicas differ, each node agrees inside.
    s10 = saved_tensors(split / "checkpoints" / "step_10")
    local = [s10[f"extra.rank{r}.comm__local__params"] for r in range(4)]
    assert torch.equal(local[0], local[1]) and torch.equal(local[2], local[3])
    assert not torch.equal(local[0], local[2])
    assert "extra.rank3.comm__local__opt.exp_avg" in s10 and "extra.rank0.comm__averager__momentum" in s10
    for r in range(4):
        av = _rank_json(split / "checkpoints" / "step_10", r)["extra"]["comm"]["averager"]
        assert (av["period"], av["local_steps"], av["syncs"]) == (4, 2, 2)

    run_job(make_cfg(stdlib_data, split), split, stdlib_data)
    a, b = saved_tensors(full / "checkpoints" / "step_20"), saved_tensors(split / "checkpoints" / "step_20")
    assert a.keys() == b.keys() and any(k.startswith("extra.rank2.") for k in a)
    for k in a:
        assert torch.equal(a[k], b[k]), f"{k} differs after resume"
    for r in range(4):
        ja = _rank_json(full / "checkpoints" / "step_20", r)["extra"]["comm"]
        jb = _rank_json(split / "checkpoints" / "step_20", r)["extra"]["comm"]
        assert ja["averager"]["syncs"] == jb["averager"]["syncs"] == 5 and ja["steps"] == jb["steps"] == 20
        assert ja["internode_bytes"] == jb["internode_bytes"] > 0
