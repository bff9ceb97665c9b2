"""Slurm, in one room: the only code that runs Slurm's client commands and reads their output.

Torch-free and above ``config/`` only, so the login node, the batch step and the ranks all use it:

- :mod:`.commands`: the one command runner (``call``: argv -> exit code, stdout, stderr; never raises);
- :mod:`.states`: Slurm's job states and the sets the platform decides by (live, terminal, requeued);
- :mod:`.control`: ``scontrol`` from inside a job (requeue, hold, the job's own record, stop classification);
- :mod:`.accounting`: sacctmgr, sacct, sshare, squeue, sinfo as plain data (``SlurmDB``);
- :mod:`.quotas`: associations, QOS and limits: fits now, waits or never fits;
- :mod:`.queue`: the queue view of ``xirang-status --queue``;
- :mod:`.jobs`: one job's state and history in words.
"""
