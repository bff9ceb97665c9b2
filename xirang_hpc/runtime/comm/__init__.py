"""Topology-aware gradient communication: hierarchical all-reduce hook, bucket tuning, bandwidth budget."""

from xirang_hpc.runtime.comm.install import CommState, CommTrainerHook, install_comm

__all__ = ["CommState", "CommTrainerHook", "install_comm"]
