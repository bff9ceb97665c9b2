"""In-job observation: heartbeats, hang/fault localization, the watchdog, the events log, metrics
trackers and resource readings.

Hang detection is adaptive and per phase (k x the step time, between the ticks of long saves and
evaluations; see :mod:`xirang_hpc.monitor.detect`). What people read of a run (``xirang-status``,
comparisons, plots) is :mod:`xirang_hpc.runs`; Slurm's own views are :mod:`xirang_hpc.slurm`.

Importing this package must stay cheap (no torch): the watchdog runs as a small separate
process and ``xirang-status`` runs on login nodes.
"""
