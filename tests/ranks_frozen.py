"""Imported last by the test ranks' fork server (``tests/ranks.py``, ``PRELOAD``): every object the server has
imported goes to the permanent generation, so the ranks' garbage collections skip it (and leave its shared
pages alone), as Python's ``gc.freeze()`` documentation advises for a pre-fork server; the collector, paused
by ``ranks_paused`` for the imports, runs again (in the ranks, which inherit it)."""

import gc

gc.freeze()
gc.enable()
