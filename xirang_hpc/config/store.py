"""Register the schemas in Hydra's ConfigStore so YAML presets are type-checked at composition.

The Hydra launcher (``hydra/launcher=xirang``) is registered by ``launch/`` on top of this:
entry points call :func:`xirang_hpc.submit.hydra_setup.register_configs`.
"""

from __future__ import annotations

from hydra.core.config_store import ConfigStore

from xirang_hpc.config.schema import XirangConfig

_REGISTERED = False


def register_schema() -> None:
    """Register the root schema (idempotent)."""
    global _REGISTERED
    if _REGISTERED:
        return
    ConfigStore.instance().store(name="xirang_schema", node=XirangConfig)
    _REGISTERED = True
