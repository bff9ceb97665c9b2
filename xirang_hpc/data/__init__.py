"""xirang_hpc.data"""
