"""``xirang-sbatch`` output against golden files (regenerate: XIRANG_UPDATE_GOLDEN=1 pytest this file).

The scripts are rendered from composed configs with fixed paths, so any change in the flag
mapping, the template or the supervisor wiring shows up as a diff here.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from conftest import compose_cfg

from xirang_hpc.cli.sbatch import render
from xirang_hpc.config.validate import load_config

GOLDEN = Path(__file__).parent / "golden"
CASES = {
    "sbatch_testbed.sbatch": ["cluster=testbed"],
    "sbatch_slurm_gpu.sbatch": [
        "cluster=slurm", "cluster.nodes=4", "cluster.partition=gpu", "cluster.qos=normal", "cluster.account=llm",
        "cluster.mem_gb=480", "cluster.constraint=h100", "cluster.exclude='node[07-08]'",
        "cluster.min_time_min=60",
        "cluster.setup=['module load cuda/12.4','source /opt/venv/bin/activate']",
        "cluster.srun_args=['--cpu-bind=none']",
        "train.name=pretrain", "model=gpt2-small", "train.global_batch=64"],
    "sbatch_qos_high.sbatch": ["cluster=site-qos", "train.priority=high", "cluster.account=llm", "train.name=urgent"],
    "sbatch_pyxis.sbatch": ["cluster=slurm", "cluster.container.image='nvcr.io#nvidia/pytorch:25.01-py3'",
                            "cluster.container.mounts=[/lustre/shared]", "cluster.container.python=python",
                            "train.runs_root=/scratch/runs", "data.out_dir=/scratch/data/stdlib-bytes"],
    "sbatch_apptainer.sbatch": ["cluster=slurm", "cluster.container.image=/images/train.sif",
                                "cluster.container.runtime=apptainer", "train.runs_root=/scratch/runs",
                                "data.out_dir=/scratch/data/stdlib-bytes"],
    "sbatch_exploratory.sbatch": ["cluster=testbed", "train.priority=exploratory", "cluster.time_min=120",
                                  "cluster.min_time_min=20", "train.name=explore"],
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_rendered_script_matches_golden(name, monkeypatch):
    from xirang_hpc.submit import slurm

    # What a container mounts besides the config's paths: this checkout and its environment, fixed here.
    monkeypatch.setattr(slurm, "environment_paths", lambda: ["/opt/xirang", "/opt/venv"])
    monkeypatch.setattr(os, "getcwd", lambda: "/scratch/work")
    cfg = load_config(compose_cfg(CASES[name]))
    text = render(cfg, Path("/scratch/runs/demo"), "/opt/venv/bin/python", "job.sbatch")
    golden = GOLDEN / name
    if os.environ.get("XIRANG_UPDATE_GOLDEN"):
        golden.write_text(text)
    assert text == golden.read_text()


def test_rendered_script_is_valid_bash_with_usr2_to_tasks():
    text = (GOLDEN / "sbatch_testbed.sbatch").read_text()
    assert "#SBATCH --signal=USR2@60" in text and "B:USR2" not in text  # tasks get the signal (pain point 2)
    assert subprocess.run(["bash", "-n"], input=text, text=True).returncode == 0
