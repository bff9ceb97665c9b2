"""Deprecated: ``python -m xirang_hpc.launch.supervise`` runs :mod:`xirang_hpc.batch.supervise`
(batch scripts written by earlier versions, for one release)."""

from xirang_hpc.batch.supervise import main

if __name__ == "__main__":
    main()
