"""xirang_hpc.monitor"""
