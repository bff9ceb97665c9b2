"""A run's records as people read them: ``xirang-status`` (one run, an array, the queue's words), the
pipeline chain, run comparison, plots and the live progress line.

Read-only views over what the job wrote (events, metrics, heartbeats, checkpoints) and what Slurm says;
nothing here runs inside a rank. The in-job observation that writes those records is ``monitor/``.
"""
