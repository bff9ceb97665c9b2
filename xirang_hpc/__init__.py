"""xirang-hpc: large-model training on Slurm clusters, made boring."""

__version__ = "0.1.0"
