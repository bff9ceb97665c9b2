"""The local executor's job controller, tied to the ``xirang-train`` that follows it.

submitit's local executor starts a *controller* process (``submitit.local._local``) that starts the ranks,
waits for them and sends the time-limit signal. Started as submitit starts it, the controller shares the
launcher's process group and outlives it:

- Ctrl-C in a terminal reaches the launcher *and* the controller, which dies printing KeyboardInterrupt
  tracebacks and kills the ranks without a final checkpoint;
- SIGTERM or SIGKILL of the launcher (a ``timeout``, a parent process, a closed session) leaves the ranks
  training in the background with nobody following them.

So :func:`start` runs the controller in a session of its own (terminal signals reach the launcher only,
which stops the job in order: :func:`stop_gracefully`), and :class:`Controller` watches the launcher when
one follows the job (``XIRANG_LAUNCHER_PID``): when it is gone, the ranks get SIGTERM, which they take at
the next step boundary (final checkpoint, then exit), and an event says why. A launch with
``train.wait=false`` leaves on purpose and is not watched.
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from submitit.local import local as _sl

WATCH_ENV = "XIRANG_LAUNCHER_PID"
# How long the ranks have, after the launcher is gone, to save and leave before they are killed.
GRACE_ENV = "XIRANG_STOP_GRACE_S"
DEFAULT_GRACE_S = 120.0


def start(folder: Path, command: str, *, tasks_per_node: int, timeout_min: float, signal_delay_s: int,
          cuda_devices: str = "", stderr_to_stdout: bool = False, watch_pid: int | None = None,
          grace_s: float = DEFAULT_GRACE_S, rank_env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    """Start the controller as submitit's ``start_controller`` does, in its own session, watching ``watch_pid``.

    ``rank_env``: variables the tasks start with (``ClusterConfig.rank_environment``).
    """
    env = {**os.environ, **(rank_env or {})}
    env.update(
        SUBMITIT_LOCAL_NTASKS=str(tasks_per_node),
        SUBMITIT_LOCAL_COMMAND=command,
        SUBMITIT_LOCAL_TIMEOUT_S=str(int(60 * timeout_min)),
        SUBMITIT_LOCAL_SIGNAL_DELAY_S=str(int(signal_delay_s)),
        SUBMITIT_LOCAL_NODEID="0",
        SUBMITIT_LOCAL_JOB_NUM_NODES="1",
        SUBMITIT_STDERR_TO_STDOUT="1" if stderr_to_stdout else "",
        SUBMITIT_EXECUTOR="local",
        CUDA_VISIBLE_DEVICES=cuda_devices,
        SUBMITIT_LOCAL_WITH_SHELL="",
    )
    env.pop(WATCH_ENV, None)
    if watch_pid is not None:
        env[WATCH_ENV] = str(watch_pid)
        env[GRACE_ENV] = str(grace_s)
    cmd = [sys.executable, "-m", "xirang_hpc.local.controller", str(folder)]
    return subprocess.Popen(cmd, env=env, start_new_session=True)


class LocalExecutor(_sl.LocalExecutor):
    """submitit's local executor with this module's controller (own session; the launcher watched)."""

    def __init__(self, folder: Path, python: str | None = None, watch_pid: int | None = None,
                 grace_s: float = DEFAULT_GRACE_S, rank_env: dict[str, str] | None = None) -> None:
        super().__init__(folder=folder, python=python)
        self.watch_pid, self.grace_s, self.rank_env = watch_pid, grace_s, dict(rank_env or {})

    def _submit_command(self, command: str) -> _sl.LocalJob[Any]:
        p = self.parameters
        ntasks = p.get("tasks_per_node", 1)
        n_gpus, visible = p.get("gpus_per_node", 0), p.get("visible_gpus", ())
        gpus = range(n_gpus) if visible == () else visible[:n_gpus]
        if p.get("setup"):
            raise ValueError("the local executor's 'setup' commands are not supported")
        process = start(self.folder, command, tasks_per_node=ntasks, timeout_min=p.get("timeout_min", 2.0),
                        signal_delay_s=p.get("signal_delay_s", 30), cuda_devices=",".join(str(k) for k in gpus),
                        stderr_to_stdout=p.get("stderr_to_stdout", False), watch_pid=self.watch_pid,
                        grace_s=self.grace_s, rank_env=self.rank_env)
        return _sl.LocalJob(folder=self.folder, job_id=str(process.pid), process=process, tasks=list(range(ntasks)))


def stop_gracefully(job: _sl.LocalJob[Any]) -> None:
    """Ask the job's ranks to stop at the next step boundary (SIGTERM through the controller: final checkpoint)."""
    proc = getattr(job, "_process", None)
    if proc is not None and proc.poll() is None:
        proc.send_signal(signal.SIGTERM)


def launcher_alive(pid: int, parent: int) -> bool:
    """Whether the launcher ``pid`` still runs: it is this process's parent, so a changed parent means it is gone
    (immune to pid reuse)."""
    return parent == pid


class Controller(_sl.Controller):
    """submitit's controller, quiet on cancel (no KeyboardInterrupt traceback) and watching its launcher."""

    def __init__(self, folder: Path) -> None:
        super().__init__(folder)
        watch = os.environ.get(WATCH_ENV, "")
        self.watch_pid = int(watch) if watch.isdigit() else None
        self.grace_s = float(os.environ.get(GRACE_ENV, DEFAULT_GRACE_S))
        self.gone_at: float | None = None

    def _launcher_gone(self) -> None:
        """The launcher died: SIGTERM to the ranks (they save and leave), an event saying why."""
        self.gone_at = time.time()
        msg = (f"the launcher (xirang-train, pid {self.watch_pid}) is gone; stopping the job at the next step "
               f"after a final checkpoint")
        print(f"xirang local controller: {msg}", file=sys.stderr, flush=True)
        try:
            from xirang_hpc.monitor.events import append_event

            append_event(self.folder.parent, "launcher_gone", msg, pid=self.watch_pid, job=self.pid)
        except OSError:
            pass
        self._forward_signal(signal.SIGTERM)

    def wait(self, freq: int = 24) -> list[int | None]:
        """submitit's wait (time-limit signal included), also watching the launcher."""
        timeout, almost = freq * self.timeout_s, freq * (self.timeout_s - self.signal_delay_s)
        for step in range(timeout):
            codes = [t.poll() for t in self.tasks]
            if all(c is not None for c in codes):
                return codes
            if step == almost:
                self._forward_signal(_sl.LocalJobEnvironment._usr_sig())
            if self.watch_pid is not None and self.gone_at is None and step % max(1, freq // 4) == 0 \
                    and not launcher_alive(self.watch_pid, os.getppid()):
                self._launcher_gone()
            if self.gone_at is not None and time.time() - self.gone_at > self.grace_s:
                print("xirang local controller: the ranks did not stop in time; killing them", file=sys.stderr,
                      flush=True)
                return codes  # run()'s finally kills the tasks
            time.sleep(1.0 / freq)
        return [t.poll() for t in self.tasks]


def main(argv: list[str]) -> int:
    """Run the controller for the submitit folder ``argv[0]``; a cancel (SIGINT) ends it without a traceback."""
    if len(argv) != 1:
        print(f"usage: python -m xirang_hpc.local.controller <submitit folder> (got {shlex.join(argv)})",
              file=sys.stderr)
        return 2
    controller = Controller(Path(argv[0]))
    try:
        controller.run()
    except KeyboardInterrupt:  # LocalJob.cancel(): run()'s finally has killed the tasks
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
