"""Every config group composes and validates; bad configs fail with field, value and fix."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from conftest import CONF_DIR, compose_cfg

from xirang_hpc.config.errors import ConfigError
from xirang_hpc.config.schema import GROUPS, XirangConfig
from xirang_hpc.config.validate import load_config


def _options(group: str) -> list[str]:
    return sorted(p.stem for p in (Path(CONF_DIR) / group).glob("*.yaml"))


@pytest.mark.parametrize("group", sorted(GROUPS))
def test_every_option_of_every_group_composes_and_validates(group: str) -> None:
    options = _options(group)
    assert options, f"conf/{group}/ has no presets"
    for opt in options:
        # Real clusters have hundreds of ranks: give them a batch that divides.
        extra = ["train.global_batch=4096"] if group == "cluster" else []
        # Mixture-of-experts presets train data-parallel only in this build (validation refuses pp/tp for them),
        # so they compose with the FSDP layout instead of the embedded dp2 x pp2 default.
        if group == "model" and "moe_experts:" in (Path(CONF_DIR) / group / f"{opt}.yaml").read_text():
            extra = ["parallel=fsdp"]
        cfg = load_config(compose_cfg([f"{group}={opt}", *extra]))
        assert isinstance(cfg, XirangConfig)
        assert isinstance(getattr(cfg, group), GROUPS[group])


def test_default_is_the_embedded_run() -> None:
    cfg = load_config(compose_cfg())
    assert cfg.model.name == "tiny"
    assert cfg.cluster.executor == "local"
    assert cfg.cluster.world_size == 4 and cfg.cluster.nodes == 2
    assert cfg.parallel.dp * cfg.parallel.tp * cfg.parallel.pp == 4
    # The embedded default is a hybrid layout (issue 3): data x pipeline parallel.
    assert cfg.parallel.dp == 2 and cfg.parallel.pp == 2


@pytest.mark.parametrize("model", ["gpt2-small", "gpt-1.3b", "gpt-7b", "llama-7b", "gpt-175b"])
def test_big_model_presets_validate_on_a_slurm_cluster(model: str) -> None:
    cfg = load_config(compose_cfg([f"model={model}", "cluster=slurm", "cluster.nodes=2", "train.global_batch=64"]))
    assert cfg.parallel.dp * cfg.parallel.pp * cfg.parallel.tp == 16


@pytest.mark.parametrize(
    "overrides, field, words",
    [
        (["parallel.tp=3"], "parallel.tp", ["n_head=4", "tp"]),
        (["parallel.pp=5"], "parallel.pp", ["n_layer=4"]),
        (["parallel.dp=3"], "parallel.dp", ["world size 4"]),
        (["parallel.tp=4"], "parallel.tp", ["tasks_per_node=2"]),
        (["train.global_batch=30"], "train.global_batch", ["multiple of 8"]),
        (["train.lr=-1"], "train.lr", ["positive"]),
        (["model.d_model=66"], "model.d_model", ["n_head=4"]),
        (["parallel.recompute=sometimes"], "parallel.recompute", ["none, selective or full"]),
        (["checkpoint.keep_last=0"], "checkpoint.keep_last", ["at least 1"]),
        (["data.val_fraction=0.9"], "data.val_fraction", ["(0, 0.5)"]),
        (["train.warmup_steps=500"], "train.warmup_steps", ["max_steps", "train.warmup_frac"]),
        (["train.warmup_frac=1.5"], "train.warmup_frac", ["[0, 1)", "0.2"]),
    ],
)
def test_bad_config_names_field_value_and_fix(overrides: list[str], field: str, words: list[str]) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(compose_cfg(overrides))
    assert err.value.field == field
    msg = str(err.value)
    assert field in msg
    for w in words:
        assert w in msg, msg


def test_type_errors_are_caught_at_composition() -> None:
    with pytest.raises(Exception, match="tp"):
        compose_cfg(["parallel.tp=two"])


def _cli(args: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    exe = Path(sys.executable).parent / "xirang-train"
    return subprocess.run([str(exe), *args], cwd=cwd, capture_output=True, text=True, timeout=600)


def test_cli_rejects_bad_tp_before_anything_starts(tmp_path: Path) -> None:
    r = _cli(["parallel.tp=3", f"train.runs_root={tmp_path}/runs", f"data.out_dir={tmp_path}/data"], tmp_path)
    assert r.returncode != 0
    assert "parallel.tp=3" in r.stderr and "n_head=4" in r.stderr
    # Nothing was created: no run directory, no data, no submitit folder.
    assert not (tmp_path / "runs").exists() and not (tmp_path / "data").exists()


def test_cli_prints_composed_config(tmp_path: Path) -> None:
    r = _cli(["--cfg", "job"], tmp_path)
    assert r.returncode == 0, r.stderr
    for key in ("model:", "cluster:", "parallel:", "train:", "checkpoint:", "requeue:", "data:", "name: tiny"):
        assert key in r.stdout


@pytest.mark.parametrize("overrides", [
    ["train.lr=1e-3"], ["train.loggers=[jsonl,tensorboard]"], ["train.wait=true"], ["train.mlflow_uri=file:/tmp/m"],
    ["checkpoint.pinned=[5]"], ["model.n_layer=6", "train.seed=7"],
    ["parallel.tp=2", "parallel.sequence_parallel=true"],
    ["train.wait=null"], ["model.moe_experts=4", "model.mlp=swiglu"], ["serve.duration_s=1.5"],
])
def test_value_overrides_on_the_composed_defaults_equal_hydras_compose(overrides: list[str]) -> None:
    """The tests' shortcut for value-only overrides (conftest._values_over_base) gives what Hydra composes."""
    from conftest import CONF_DIR, _values_over_base
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from xirang_hpc.submit.hydra_setup import register_configs

    fast = _values_over_base(tuple(overrides))
    assert fast is not None, "not a value-only override list"
    register_configs()
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        ref = compose(config_name="config", overrides=overrides)
    assert OmegaConf.to_yaml(fast) == OmegaConf.to_yaml(ref)


@pytest.mark.parametrize("overrides", [["model=tiny"], ["+train.stepz=3"], ["~train.seed"], ["train.lr=1e-3,2e-3"],
                                       ["train.stepz=3"], ["train.lr=abc"]])
def test_group_choices_additions_sweeps_and_bad_values_are_left_to_hydra(overrides: list[str]) -> None:
    from conftest import _values_over_base

    assert _values_over_base(tuple(overrides)) is None
