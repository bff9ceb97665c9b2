"""``python -m xirang_hpc.launch.sites migrate RUN_DIR [--to SITE]``: move a run to another site now."""

from xirang_hpc.launch.sites.moves import main

raise SystemExit(main())
