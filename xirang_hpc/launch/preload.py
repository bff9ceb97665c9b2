"""Deprecated: ``python -m xirang_hpc.launch.preload`` runs :mod:`xirang_hpc.local.preload`
(batch scripts written by earlier versions, for one release)."""

from xirang_hpc.local.preload import main

if __name__ == "__main__":
    main()
