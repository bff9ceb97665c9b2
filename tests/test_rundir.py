"""Run directories: deterministic per experiment, independent of resources, private."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from conftest import compose_cfg

from xirang_hpc.config.validate import load_config
from xirang_hpc.submit.rundir import experiment_hash, make_private_dir, run_dir_for


def _dir(*over: str) -> Path:
    return run_dir_for(load_config(compose_cfg(list(over))))


def test_same_experiment_same_directory() -> None:
    assert _dir() == _dir()
    assert _dir().name.startswith("default-tiny-")


def test_resources_and_layout_do_not_change_the_directory() -> None:
    base = _dir()
    assert _dir("cluster.nodes=1", "cluster.tasks_per_node=4") == base
    assert _dir("train.grad_accum=2") == base
    assert _dir("checkpoint.every_steps=7", "requeue.max_requeues=1", "train.log_every=3") == base


def test_what_is_trained_changes_the_directory() -> None:
    base = _dir()
    assert _dir("train.lr=1e-3") != base
    assert _dir("model.n_layer=2") != base
    assert _dir("train.seed=1") != base
    assert _dir("data.corpus=/some/where") != base


def test_explicit_run_dir_wins(tmp_path: Path) -> None:
    assert _dir(f"train.run_dir={tmp_path}/x") == tmp_path / "x"


def test_hash_is_stable_across_processes() -> None:
    # A pinned value: the hash must not depend on dict order, process or Python hash seed.
    cfg = load_config(compose_cfg())
    assert experiment_hash(cfg) == experiment_hash(load_config(compose_cfg()))
    assert len(experiment_hash(cfg)) == 12


def test_private_directory_despite_umask(tmp_path: Path) -> None:
    old = os.umask(0o002)
    try:
        d = make_private_dir(tmp_path / "a" / "run")
    finally:
        os.umask(old)
    assert stat.S_IMODE(d.stat().st_mode) == 0o700
    d.chmod(0o777)
    make_private_dir(d)  # an existing directory is tightened
    assert stat.S_IMODE(d.stat().st_mode) == 0o700


def test_model_fields_at_their_old_meaning_keep_the_run_directory() -> None:
    """Fields added later (GQA, tying, norm/rotary constants) stay out of the key at the values that mean
    what models always computed, so earlier runs keep their directories; other values change it."""
    from conftest import compose_cfg

    from xirang_hpc.config.validate import load_config
    from xirang_hpc.submit.rundir import experiment_hash, experiment_key

    base = load_config(compose_cfg([]))
    key = experiment_key(base)["model"]
    assert not {"n_kv_head", "norm_eps", "rope_theta", "tie_embeddings"} & set(key)
    for override in ("model.rope_theta=500000", "model.norm_eps=1e-6", "model.n_kv_head=2"):
        assert experiment_hash(load_config(compose_cfg([override]))) != experiment_hash(base), override
    llama = experiment_key(load_config(compose_cfg(["model=llama-7b"])))["model"]
    assert llama["norm_eps"] == 1e-6  # RMSNorm's epsilon is part of what an RMSNorm run computes
