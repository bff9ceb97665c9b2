"""xirang_hpc.launch"""
