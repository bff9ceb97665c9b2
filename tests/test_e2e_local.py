"""The embedded run, end to end: xirang-train -> submitit local executor -> 4 gloo ranks."""

from __future__ import annotations

import json
import stat

import pytest
from conftest import TrainedRun
from parallel_harness import free_port

from xirang_hpc.runtime.dist import RendezvousError, init_distributed
from xirang_hpc.runtime.topology import Topology


@pytest.mark.slow
def test_short_embedded_run(trained_run: TrainedRun) -> None:
    """The session's trained run is the embedded default launched by ``xirang-train``: what it printed and left."""
    out, n = trained_run.stdout, trained_run.steps
    assert "4 ranks on 2 node(s)" in out
    for step in range(trained_run.log_every, n + 1, trained_run.log_every):
        assert f"step {step:>5}/{n} | loss" in out
    assert "tok/s" in out and "ETA" in out
    summary = out[out.index(f"done: {n} steps this session ({n} of {n} steps) on 4 ranks"):]
    assert "validation loss" in summary and "tokens/s" in summary and "run directory" in summary

    run = trained_run.run
    assert [p.name for p in run.parent.iterdir()] == [run.name]  # one run, one directory
    assert stat.S_IMODE(run.stat().st_mode) == 0o700
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    vals = [row["val_loss"] for row in rows if "val_loss" in row]
    assert len(vals) == 2
    assert vals[1] < 0.7 * vals[0], vals
    # Four real processes ran: submitit wrote a log per task.
    logs = list((run / "submitit").glob("*_log.out"))
    assert len(logs) == 4, logs


def test_rendezvous_timeout_names_missing_ranks() -> None:
    topo = Topology(rank=0, world_size=3, local_rank=0, local_world_size=3, node_id=0, num_nodes=1,
                    node_name="vnode0", master_addr="127.0.0.1", master_port=free_port(), job_id="t", source="local")
    with pytest.raises(RendezvousError, match=r"ranks \[1, 2\] of 3 never arrived"):
        init_distributed(topo, "gloo", timeout_s=1.5)
