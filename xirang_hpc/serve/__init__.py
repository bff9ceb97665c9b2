"""xirang_hpc.serve"""
