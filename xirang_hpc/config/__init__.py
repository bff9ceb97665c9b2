"""xirang_hpc.config"""
