"""Shared fixtures: a tiny prepared corpus and Hydra composition helpers."""

from __future__ import annotations

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig

from xirang_hpc.launch.hydra_setup import register_configs

CONF_DIR = str(Path(__file__).resolve().parents[1] / "xirang_hpc" / "conf")
TIERS = ("unit", "slow", "slurm")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Every test belongs to exactly one tier: a test not marked ``slow`` or ``slurm`` is ``unit``."""
    for item in items:
        tiers = [t for t in TIERS if item.get_closest_marker(t) is not None]
        if not tiers:
            item.add_marker(pytest.mark.unit)
        elif "slurm" in tiers and "slow" in tiers:
            raise pytest.UsageError(f"{item.nodeid}: marked both slow and slurm; a test has one tier")


def compose_cfg(overrides: list[str] | None = None) -> DictConfig:
    """Compose the root config exactly as xirang-train does."""
    register_configs()
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        return compose(config_name="config", overrides=overrides or [])


@pytest.fixture
def small_corpus(tmp_path: Path) -> Path:
    """A corpus of a few text files (a few KB) with a nested directory."""
    root = tmp_path / "corpus"
    (root / "pkg").mkdir(parents=True)
    for i in range(12):
        body = "".join(f"def f{i}_{j}(x):\n    return x * {j} + {i}\n\n" for j in range(40))
        (root / ("pkg" if i % 2 else "") / f"mod{i}.py").write_text(body)
    return root


@pytest.fixture(scope="session")
def stdlib_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The default corpus (this interpreter's stdlib), prepared once per test session."""
    from xirang_hpc.data.prepare import prepare

    out = tmp_path_factory.mktemp("stdlib-bytes")
    prepare("stdlib", out)
    return out


@pytest.fixture(scope="session")
def email_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small real corpus for the parallel-layout tests: the stdlib ``email`` package (~1 MB), byte-tokenized."""
    import sysconfig

    from xirang_hpc.data.prepare import prepare

    out = tmp_path_factory.mktemp("email-bytes")
    prepare(str(Path(sysconfig.get_paths()["stdlib"]) / "email"), out, val_fraction=0.2)
    return out
