"""The commands (``xirang-train``, ``-plan``, ``-status``, ``-sbatch``, ``-pipeline``, ``-prepare``, ``-ckpt``,
``-eval``, ``-serve``): parse, hand over, print. Torch-free at import: the commands that need the
training stack (serving, evaluation, export, data loading, calibration) import it only after parsing,
through the named hand-overs in ``.importlinter``."""
