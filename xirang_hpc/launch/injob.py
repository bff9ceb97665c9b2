"""Deprecated: ``python -m xirang_hpc.launch.injob`` runs :mod:`xirang_hpc.batch.injob`
(batch scripts written by earlier versions, for one release)."""

from xirang_hpc.batch.injob import main

if __name__ == "__main__":
    main()
