"""Deprecated: ``python -m xirang_hpc.launch.sites`` runs ``python -m xirang_hpc.submit.sites`` (one release)."""

from xirang_hpc.submit.sites.moves import main

raise SystemExit(main())
