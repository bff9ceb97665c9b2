"""xirang_hpc.planner"""
