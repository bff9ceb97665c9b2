"""Register the schemas in Hydra's ConfigStore so YAML presets are type-checked at composition."""

from __future__ import annotations

from hydra.core.config_store import ConfigStore

from xirang_hpc.config.schema import XirangConfig

_REGISTERED = False


def register_configs() -> None:
    """Register the root schema (idempotent)."""
    global _REGISTERED
    if _REGISTERED:
        return
    ConfigStore.instance().store(name="xirang_schema", node=XirangConfig)
    from xirang_hpc.launch.sweep import register_launcher  # hydra/launcher=xirang: sweeps -> one array job

    register_launcher()
    _REGISTERED = True
