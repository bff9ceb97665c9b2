"""xirang_hpc.models"""
