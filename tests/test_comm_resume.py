"""Budget mode (local SGD, H=4, DiLoCo outer step) resumes exactly through the real job function.

4 spawned ranks on 2 virtual nodes x 2 (pure dp, so DDP with the hierarchical hook), calling
``xirang_hpc.runtime.job.run_training``: 20 steps straight vs 10 steps (stopped at a step
boundary mid-period, as a preemption would) + resume + 10. Between syncs the replicas on the two
nodes differ, so the checkpoint must carry every rank's own parameters, optimizer moments and
averaging state (``trainer.extra_state["comm"]`` -> ``extra.rank<r>.*``); the final checkpoints
are compared bitwise.
"""

from __future__ import annotations

import dataclasses
import json
import multiprocessing as mp
import os
import uuid
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from conftest import compose_cfg

from xirang_hpc.checkpoint.storage import HDF5StorageReader, read_metadata
from xirang_hpc.config.validate import load_config

PURE_DP = ["parallel.tp=1", "parallel.pp=1", "parallel.microbatches=1", "comm.sync_period=4",
           "comm.outer_optimizer=nesterov", "comm.bucket=0.25"]


def _rank_main(rank: int, world: int, job: str, cfg: dict, run_dir: str, data_dir: str, stop_at: int) -> None:
    os.environ.update(SUBMITIT_LOCAL_GLOBALID=str(rank), SUBMITIT_LOCAL_LOCALID=str(rank),
                      SUBMITIT_LOCAL_NTASKS=str(world), SUBMITIT_LOCAL_JOB_ID=job)
    from xirang_hpc.runtime import job as jobmod
    from xirang_hpc.runtime.trainer import TrainerHook

    if stop_at:
        class StopAt(TrainerHook):  # what a preemption signal does: stop at a step boundary
            def on_step_end(self, trainer, metrics):
                if trainer.state.step >= stop_at:
                    trainer.stop_requested = True

        real = jobmod.build_hooks
        jobmod.build_hooks = lambda *a: [*real(*a), StopAt()]
    jobmod.run_training(cfg, run_dir, data_dir)


def run_job(cfg: dict, run_dir: Path, data_dir: Path, stop_at: int = 0, world: int = 4) -> None:
    run_dir.mkdir(mode=0o700, parents=True, exist_ok=True)  # the launcher makes it in real runs
    ctx = mp.get_context("spawn")
    job = f"comm-resume-{uuid.uuid4().hex[:8]}"
    procs = [ctx.Process(target=_rank_main, args=(r, world, job, cfg, str(run_dir), str(data_dir), stop_at))
             for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(300)
    codes = [p.exitcode for p in procs]
    for p in procs:
        if p.is_alive():
            p.kill()
    assert codes == [0] * world, f"ranks exited with {codes}"


def make_cfg(data_dir: Path, run_dir: Path) -> dict:
    over = ["model=tiny", "cluster=local", "train.max_steps=20", "train.global_batch=8", "train.warmup_steps=2",
            "train.eval_batches=1", "train.log_every=5", "checkpoint.every_steps=10", "checkpoint.keep_last=10",
            "monitor.enabled=false", f"data.out_dir={data_dir}", f"train.run_dir={run_dir}", *PURE_DP]
    return dataclasses.asdict(load_config(compose_cfg(over)))


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
