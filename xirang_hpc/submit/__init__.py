"""The login node: everything between a command line and a queued job, torch-free.

Run directories and their identity, preflight checks, the run lock, executors (Slurm through submitit,
the local fork server), sweeps and the Hydra launcher, ``parallel=auto`` and planning from a target,
quota checks, and placement on several sites. ``.importlinter`` keeps torch and h5py out, even indirectly.
"""
