"""xirang_hpc.runtime"""
