"""``python -m xirang_hpc.submit.sites migrate RUN_DIR [--to SITE]``: move a run to another site now."""

from xirang_hpc.submit.sites.moves import main

raise SystemExit(main())
