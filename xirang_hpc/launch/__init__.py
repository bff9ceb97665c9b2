"""Forwarders for scripts written by earlier versions (one release): a queued or requeued job's batch script
may still run ``python -m xirang_hpc.launch.<module>``. The code lives in :mod:`xirang_hpc.cli`,
:mod:`xirang_hpc.submit`, :mod:`xirang_hpc.batch` and :mod:`xirang_hpc.local`."""
