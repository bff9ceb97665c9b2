"""Record the outputs of every query in xirang_hpc/slurm/accounting.py on a real cluster (SLURM_CONF set).

    python tests/data/slurm/record.py NAME [JOBID ...]   ->  tests/data/slurm/NAME.json

The unit tests replay them (``{" ".join(argv): {"rc", "out", "err"}}``); each JOBID adds its ``sacct -j``.
"""

import dataclasses
import json
import sys
from pathlib import Path

from xirang_hpc.slurm.accounting import SlurmDB, call, commands, sacct_argv

name, job_ids = sys.argv[1], sys.argv[2:]
cluster = SlurmDB().config().get("ClusterName", "")
argvs = list(commands().values()) + [commands(cluster)["assoc"], sacct_argv()]
argvs += [sacct_argv([j]) for j in job_ids]
rec = {" ".join(a): dataclasses.asdict(call(a)) for a in argvs}
out = Path(__file__).with_name(f"{name}.json")
out.write_text(json.dumps(rec, indent=1) + "\n")
print(f"wrote {out} ({len(rec)} commands)")
