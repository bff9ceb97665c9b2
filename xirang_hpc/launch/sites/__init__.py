"""Deprecated: ``python -m xirang_hpc.launch.sites`` runs :mod:`xirang_hpc.submit.sites` (one release)."""
