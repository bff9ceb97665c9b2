"""Local runs on one machine: the fork server that starts ranks with the training stack already imported,
and the controller that plays Slurm's part (signals, time limit, end) for a local job."""
