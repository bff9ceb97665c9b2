"""xirang_hpc.checkpoint"""
