"""Planner defaults that the command line shows: kept free of torch, so ``--help`` stays instant."""

# Rounds of calibration probe runs (median kept): one round's figures swung up to 2x between calibrations.
PROBE_ROUNDS = 3
