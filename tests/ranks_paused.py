"""Imported first by the test ranks' fork server (``tests/ranks.py``, ``PRELOAD``): no cyclic collection while it
imports torch and the rest (``ranks_frozen``, imported last, freezes what they made and enables the collector
again), as a rank's own start-up does (``xirang_hpc/runtime/startup.py``)."""

import gc

gc.disable()
