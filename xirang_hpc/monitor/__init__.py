"""Heartbeats, hang/fault localization, status and metrics.

Importing this package must stay cheap (no torch): the watchdog runs as a small separate
process and ``xirang-status`` runs on login nodes.
"""
