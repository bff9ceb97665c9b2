"""Who did what to a run: ``audit.jsonl`` in the run, the user's own trail, and syslog.

The commands write it themselves, so a record exists even when the job never starts: a launch (with
the command line and the job id), a cancel by the launcher, a requeue by the supervisor, a fork, an
export, a prune or pin of checkpoints, a server's start and stop. Each record names who (uid, user
name, host), when, what, the run and the Slurm job. Records are appended with one ``write`` on an
``O_APPEND`` descriptor (writers never interleave) and the files are never rewritten by this package.

A user can edit files they own, so the run's file is the user's and the team's view; the copy sent to
the system log (``syslog``, facility ``LOG_AUTHPRIV``, read by the site's journald or rsyslog and not
writable by users) is the record an administrator can trust. ``xirang-status RUN --audit`` prints the
run's file.
"""

from __future__ import annotations

import json
import os
import pwd
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from xirang_hpc.files import record_mode

AUDIT_FILE = "audit.jsonl"


def _syslog(line: str) -> None:
    """One line to the system log (best effort: a node without a syslog socket drops it)."""
    try:
        import syslog

        syslog.openlog("xirang-hpc", 0, syslog.LOG_AUTHPRIV)
        syslog.syslog(syslog.LOG_INFO, line)
    except OSError:
        pass


def _user() -> str:
    try:
        return pwd.getpwuid(os.getuid()).pw_name
    except KeyError:
        return str(os.getuid())


def user_file() -> Path:
    """The user's own trail: every action of this user on any run, in any runs root.

    It lives in the user's state directory (``$XDG_STATE_HOME/xirang-hpc``, by default
    ``~/.local/state/xirang-hpc``), not in a runs root, which holds runs and nothing else.
    """
    state = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(state) / "xirang-hpc" / AUDIT_FILE


def _append(path: Path, line: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, record_mode())
    try:
        os.write(fd, line)
    finally:
        os.close(fd)


def record(run_dir: Path | str, action: str, job: str | None = None, *, to_syslog: Callable[[str], None] = _syslog,
           **details: Any) -> dict[str, Any]:
    """Append one action on ``run_dir`` to its ``audit.jsonl``, the user's own trail and syslog.

    Never raises for a trail it cannot write (a run directory shared read-only with this user: the user's
    own trail and syslog still get it).
    """
    run = Path(run_dir).absolute()
    row: dict[str, Any] = {"time": time.time(), "uid": os.getuid(), "user": _user(), "host": socket.gethostname(),
                           "action": action, "run": str(run), "job": job or os.environ.get("SLURM_JOB_ID"),
                           **details}
    line = (json.dumps(row, default=str) + "\n").encode()
    for path in (run / AUDIT_FILE, user_file()):
        try:
            if path.parent != run:
                path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            _append(path, line)
        except OSError:
            continue
    to_syslog(f"user={row['user']} uid={row['uid']} action={action} run={run} job={row['job']} "
              + " ".join(f"{k}={v}" for k, v in details.items()))
    return row


def read(run_dir: Path | str) -> list[dict[str, Any]]:
    """The run's audit records, oldest first (a torn last line is skipped)."""
    path = Path(run_dir) / AUDIT_FILE
    rows = []
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return []
    for line in text.splitlines():
        try:
            rows.append(json.loads(line))
        except ValueError:
            continue
    return rows


def render(rows: list[dict[str, Any]]) -> str:
    """One line per record: when, who, what, job, details."""
    if not rows:
        return "no audit records"
    out = []
    for r in rows:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(r.get("time", 0)))
        extra = {k: v for k, v in r.items() if k not in ("time", "uid", "user", "host", "action", "run", "job")}
        out.append(f"{when}  {r.get('user')}({r.get('uid')})@{r.get('host')}  {r.get('action'):<8} "
                   f"job={r.get('job') or '-'}" + "".join(f"  {k}={v}" for k, v in extra.items()))
    return "\n".join(out)
