"""Hydra discovers launcher plugins only under the ``hydra_plugins`` namespace; the logic lives in
:mod:`xirang_hpc.submit.sweep` (``hydra/launcher=xirang``: a Slurm sweep becomes one array job)."""

from xirang_hpc.submit.sweep import XirangLauncher as _XirangLauncher


class XirangLauncher(_XirangLauncher):
    """The registered plugin class (Hydra requires it to live in ``hydra_plugins``)."""
