"""Job state from Slurm's client commands, through one tiny subprocess function.

Every query degrades to ``{}`` when the command is missing (a laptop, a container without
Slurm, the local executor) or fails (``sacct`` without accounting).
"""

from __future__ import annotations

import subprocess
from collections.abc import Callable

Runner = Callable[[list[str]], "str | None"]


def run_cmd(argv: list[str], timeout_s: float = 10.0) -> str | None:
    """stdout of ``argv`` when it exits 0; None when it is missing, fails or times out."""
    try:
        r = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return r.stdout if r.returncode == 0 else None


def parse_scontrol(text: str) -> dict[str, str]:
    """``Key=Value`` pairs of ``scontrol show job`` output."""
    out: dict[str, str] = {}
    for tok in text.split():
        if "=" in tok:
            k, _, v = tok.partition("=")
            out.setdefault(k, v)
    return out


def slurm_state(job_id: str, run: Runner = run_cmd) -> dict[str, str]:
    """``{"state", "reason"?, "restarts"?, "source"}`` for a Slurm job id, or ``{}`` if Slurm does not know it."""
    out = run(["squeue", "-h", "-j", job_id, "-o", "%T|%r"])
    if out and out.strip():
        state, _, reason = out.strip().splitlines()[0].partition("|")
        info = {"state": state, "reason": reason, "source": "squeue"}
        sc = run(["scontrol", "show", "job", job_id])
        if sc:
            info["restarts"] = parse_scontrol(sc).get("Restarts", "0")
        return info
    out = run(["sacct", "-n", "-X", "-P", "-j", job_id, "-o", "State,ExitCode"])
    if out and out.strip():
        state, _, code = out.strip().splitlines()[-1].partition("|")
        return {"state": state.split()[0], "exit_code": code, "source": "sacct"}
    sc = run(["scontrol", "show", "job", job_id])
    if sc:
        kv = parse_scontrol(sc)
        if "JobState" in kv:
            return {"state": kv["JobState"], "reason": kv.get("Reason", ""), "restarts": kv.get("Restarts", "0"),
                    "source": "scontrol"}
    return {}
