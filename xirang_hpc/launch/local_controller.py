"""Deprecated: ``python -m xirang_hpc.launch.local_controller`` runs :mod:`xirang_hpc.local.controller`
(batch scripts written by earlier versions, for one release)."""

from xirang_hpc.local.controller import main

if __name__ == "__main__":
    import sys

    sys.exit(main(sys.argv[1:]))
