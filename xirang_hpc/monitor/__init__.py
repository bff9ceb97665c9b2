"""Heartbeats, hang/fault localization, status and metrics.

Hang detection is adaptive and per phase (k x the step time, between the ticks of long saves and
evaluations; see :mod:`xirang_hpc.monitor.detect`).

Importing this package must stay cheap (no torch): the watchdog runs as a small separate
process and ``xirang-status`` runs on login nodes.
"""
