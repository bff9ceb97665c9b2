"""One request per job (xirang_hpc/slurm/request.py): every submission path -- the training job, a pipeline
stage, the placement estimate, the quota check -- asks Slurm for the same shape. Each test is a case where a
path used to keep its own mapping and had drifted."""

from __future__ import annotations

from pathlib import Path

from conftest import compose_cfg

from xirang_hpc.cli.pipeline import _stage_executor
from xirang_hpc.config.validate import load_config
from xirang_hpc.slurm.request import SlurmRequest
from xirang_hpc.submit import sites
from xirang_hpc.submit.quota_check import job_request
from xirang_hpc.submit.slurm import sbatch_parameters

SHAPE = ["cluster.nodes=2", "cluster.spare_nodes=1", "cluster.tasks_per_node=2", "cluster.cpus_per_task=3",
         "cluster.mem_gb=1.5", "cluster.constraint=ib", "cluster.exclude=bad1"]


def _cfg(*over: str):
    return load_config(compose_cfg(["cluster=testbed-sites", *SHAPE, *over]))


def test_the_placement_estimate_asks_for_the_spare_nodes_memory_and_constraint_too():
    # An estimate for 2 nodes where the job asks for 3 (2 + 1 spare) and 1.5 GB each on `ib` nodes says "now"
    # on a site that cannot start it.
    cfg = _cfg()
    argv = sites.test_only_argv(cfg.cluster, cfg.cluster.sites[1])
    assert argv[:3] == ["sbatch", "--test-only", "--clusters=beta"]
    for opt in ("--nodes=3", "--ntasks-per-node=2", "--cpus-per-task=3", "--mem=1536M", "--constraint=ib",
                "--exclude=bad1"):
        assert opt in argv, (opt, argv)


def test_the_quota_check_counts_the_spare_nodes():
    req = job_request(_cfg())
    assert (req.nodes, req.cpus) == (3, 3 * 2 * 3)  # the allocation Slurm charges, spare node included


def test_a_pipeline_stage_job_keeps_the_memory_constraint_and_scheduling_class(tmp_path: Path):
    cfg = _cfg("train.priority=exploratory", "+cluster.scavenger_partition=low", "+cluster.scavenger_qos=scavenger")
    p = _stage_executor(cfg, tmp_path / "eval", "eval", dep="41").parameters
    assert (p["nodes"], p["ntasks_per_node"], p["cpus_per_task"]) == (1, 1, 3)
    assert p["mem"] == "1536M" and p["constraint"] == "ib" and p["exclude"] == "bad1"
    train = sbatch_parameters(cfg.cluster, "exploratory")
    assert (p["partition"], p.get("qos")) == (train["partition"], train.get("qos"))
    extra = p["additional_parameters"]
    assert extra["dependency"] == "afterok:41" and "requeue" not in extra and "time_min" not in extra


def test_every_path_reads_one_request():
    cfg = _cfg()
    r = SlurmRequest.from_cluster(cfg.cluster, cfg.train.priority)
    train = sbatch_parameters(cfg.cluster, cfg.train.priority)
    assert (train["nodes"], train["mem"], train["constraint"]) == (r.nodes, f"{r.mem_mb}M", r.constraint)
    assert job_request(cfg).cpus == r.total_cpus
    assert r.stage().nodes == 1 and r.stage().mem_mb == r.mem_mb
