"""Deprecated: ``python -m xirang_hpc.launch.job_entry`` runs :mod:`xirang_hpc.batch.rank`
(batch scripts written by earlier versions, for one release)."""

from xirang_hpc.batch.rank import main

if __name__ == "__main__":
    main()
