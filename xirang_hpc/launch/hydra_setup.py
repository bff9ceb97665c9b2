"""Everything Hydra must know before an entry point composes ``conf/config.yaml``."""

from __future__ import annotations

from xirang_hpc.config.store import register_schema
from xirang_hpc.launch.sweep import register_launcher


def register_configs() -> None:
    """Register the root schema and the xirang launcher (``hydra/launcher=xirang``: sweeps -> one array job).

    Idempotent; every entry point (and the tests' composition helper) calls it before composing.
    """
    register_schema()
    register_launcher()
