"""The local executor's fork server (local/preload.py), with real processes, sockets and signals.

Each test runs clients as submitit's local controller does (``<command> -u -m <module> ... <folder>`` with
``SUBMITIT_LOCAL_*`` in the environment) on a small task module; the server preloads ``json`` only
(``XIRANG_PRELOAD_MODULES``), so the tests stay fast. The local runs of the suite (``xirang-train`` on
``cluster=local``) use the real preload list.
"""

from __future__ import annotations

import json
import os
import pwd
import signal
import stat
import subprocess
import textwrap
import time
from pathlib import Path

import pytest

from xirang_hpc.local import preload

TASK = textwrap.dedent('''
    import gc, json, os, random, signal, sys, time
    mode, folder = sys.argv[1], sys.argv[-1]
    k = os.environ.get("SUBMITIT_LOCAL_LOCALID", "0")
    def report(**extra):
        with open(os.path.join(folder, f"report-{k}.json"), "w") as f:
            mask = os.umask(0); os.umask(mask)
            json.dump({"pid": os.getpid(), "ppid": os.getppid(), "random": random.random(), "cwd": os.getcwd(),
                       "umask": mask, "cpus": sorted(os.sched_getaffinity(0)), "gc": gc.isenabled(),
                       "argv": sys.argv[1:], "localid": k, **extra}, f)
    if mode == "report":
        print("hello from", k)
        print("warning from", k, file=sys.stderr)
        report()
        sys.exit(int(os.environ.get("XR_CODE", "0")))
    if mode == "usr2":
        def on_usr2(signum, frame):
            print("got SIGUSR2", flush=True)
            sys.exit(3)
        signal.signal(signal.SIGUSR2, on_usr2)
    if mode == "raise":
        raise RuntimeError("task failed")
    report()
    try:
        while True:
            time.sleep(0.05)
    finally:  # runs when SIGINT raises KeyboardInterrupt, as in a fresh interpreter
        open(os.path.join(folder, f"finally-{k}"), "w").close()
''')


@pytest.fixture
def job(tmp_path: Path):
    """A fake local job: its folder, the task module on the path, and a starter for its clients."""
    (tmp_path / "xr_task.py").write_text(TASK)
    folder = tmp_path / "submitit"
    folder.mkdir(mode=0o700)
    started: list[subprocess.Popen] = []

    def client(mode: str, localid: int = 0, ntasks: int = 1, job_id: str = "4242", umask: int = 0o022,
               cpu0: bool = False, **env: str) -> subprocess.Popen:
        full = {**os.environ, "PYTHONPATH": str(tmp_path), "XIRANG_PRELOAD_MODULES": "json",
                "XIRANG_PRELOAD_IDLE_S": "2", "SUBMITIT_LOCAL_LOCALID": str(localid),
                "SUBMITIT_LOCAL_NTASKS": str(ntasks), "SUBMITIT_LOCAL_JOB_ID": job_id, **env}
        if not job_id:
            del full["SUBMITIT_LOCAL_JOB_ID"]
        out = open(folder / f"{localid}.out", "w")
        err = open(folder / f"{localid}.err", "w")
        # The controller's umask and CPU binding as a user's shell or a site might set them.
        cmd = ["taskset", "-c", "0", *preload.command().split(), "-u", "-m", "xr_task", mode, str(folder)]
        p = subprocess.Popen(cmd if cpu0 else cmd[3:], env=full, cwd=tmp_path, stdout=out, stderr=err,
                             umask=umask)
        out.close()
        err.close()
        started.append(p)
        return p

    yield folder, client
    for p in started:
        if p.poll() is None:
            p.kill()
            p.wait()


def _wait_for(path: Path, what: str, timeout_s: float = 120) -> dict:
    """The JSON a task wrote at ``path`` (``timeout_s``: a safety net against a hang)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if path.exists() and path.stat().st_size:
            return json.loads(path.read_text())
        time.sleep(0.05)
    raise AssertionError(f"no {what} after {timeout_s}s")


def _gone(pid: int, timeout_s: float = 120) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        with open(f"/proc/{pid}/stat") as f:  # a zombie is gone for our purpose (its parent reaps it)
            if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                return True
        time.sleep(0.05)
    return False


def test_the_ranks_of_a_job_are_forked_by_one_server_and_run_as_the_interpreter_would(job) -> None:
    folder, client = job
    clients = [client("report", k, ntasks=3, umask=0o027 if k == 1 else 0o022, cpu0=k == 2, XR_CODE=str(5 + k))
               for k in range(3)]
    codes = [c.wait(timeout=300) for c in clients]
    assert codes == [5, 6, 7]  # each client leaves with its rank's exit code
    reports = [json.loads((folder / f"report-{k}.json").read_text()) for k in range(3)]
    assert [r["localid"] for r in reports] == ["0", "1", "2"]  # each rank has its own client's environment
    assert all(r["pid"] != c.pid for r, c in zip(reports, clients, strict=True))  # forked: not the client
    assert len({r["ppid"] for r in reports}) == 1  # one server for the job
    assert len({r["random"] for r in reports}) == 3  # fresh random state, not the server's
    assert {r["cwd"] for r in reports} == {str(folder.parent)}
    assert all(r["argv"] == ["report", str(folder)] for r in reports)
    assert all(r["gc"] for r in reports)  # collections on, as in a fresh interpreter (the server froze its own)
    assert [r["umask"] for r in reports] == [0o022, 0o027, 0o022]  # each rank has its client's umask
    assert reports[2]["cpus"] == [0] and reports[0]["cpus"] == sorted(os.sched_getaffinity(0))  # and CPUs
    for k in range(3):  # the client's standard streams
        assert (folder / f"{k}.out").read_text() == f"hello from {k}\n"
        assert (folder / f"{k}.err").read_text() == f"warning from {k}\n"
    server = reports[0]["ppid"]
    assert _gone(server), "the server stays after its job (idle exit 2 s here)"
    assert not any(p.suffix == ".sock" for p in folder.iterdir()), "the server leaves its socket behind"


def test_an_uncaught_exception_is_printed_and_exits_1(job) -> None:
    folder, client = job
    assert client("raise").wait(timeout=300) == 1
    err = (folder / "0.err").read_text()
    assert "Traceback" in err and "RuntimeError: task failed" in err


def test_signals_go_to_the_rank_and_the_client_shares_its_fate(job) -> None:
    folder, client = job
    # The controller's SIGUSR2 before the time limit reaches the rank's handler; the client leaves with its code.
    c = client("usr2", 0, job_id="1")
    _wait_for(folder / "report-0.json", "rank start")
    c.send_signal(signal.SIGUSR2)
    assert c.wait(timeout=300) == 3
    assert "got SIGUSR2" in (folder / "0.out").read_text()
    # SIGTERM (cancel) kills a rank without a handler: its client dies of the same signal.
    c = client("sleep", 1, job_id="2")
    rank = _wait_for(folder / "report-1.json", "rank start")["pid"]
    c.send_signal(signal.SIGTERM)
    assert c.wait(timeout=300) == -signal.SIGTERM
    assert _gone(rank)
    # SIGINT (the controller's first step of a cancel) raises KeyboardInterrupt in the rank: its cleanup runs,
    # and it dies of SIGINT, as a fresh interpreter does.
    c = client("sleep", 3, job_id="4")
    _wait_for(folder / "report-3.json", "rank start")
    c.send_signal(signal.SIGINT)
    assert c.wait(timeout=300) == -signal.SIGINT
    assert (folder / "finally-3").exists()
    assert "KeyboardInterrupt" in (folder / "3.err").read_text()
    # A rank killed from outside (kill -9 of its pid, as a test or the hang watchdog does): the client too.
    c = client("sleep", 2, job_id="3")
    rank = _wait_for(folder / "report-2.json", "rank start")["pid"]
    os.kill(rank, signal.SIGKILL)
    assert c.wait(timeout=300) == -signal.SIGKILL


def test_a_client_killed_with_sigkill_takes_its_rank_with_it(job) -> None:
    folder, client = job
    c = client("sleep")
    rank = _wait_for(folder / "report-0.json", "rank start")["pid"]
    c.kill()
    c.wait(timeout=300)
    assert _gone(rank), "the rank of a killed client is still running"


def test_without_a_job_id_the_task_starts_plainly(job) -> None:
    folder, client = job
    c = client("report", job_id="")
    assert c.wait(timeout=300) == 0
    assert json.loads((folder / "report-0.json").read_text())["pid"] == c.pid  # exec'ed: the client is the rank


def test_the_servers_socket_is_private(job, tmp_path: Path) -> None:
    folder, client = job
    c = client("sleep", job_id="77")
    _wait_for(folder / "report-0.json", "rank start")
    sock = folder / ".preload-77.sock"
    assert stat.S_ISSOCK(sock.stat().st_mode) and stat.S_IMODE(sock.stat().st_mode) & 0o077 == 0
    if os.geteuid() == 0:  # another user cannot connect (and the server checks the peer's uid besides)
        nobody = pwd.getpwnam("nobody").pw_uid
        probe = ("import socket,sys; s=socket.socket(socket.AF_UNIX)\n"
                 "try:\n s.connect(sys.argv[1]); print('connected')\nexcept OSError as e: print(type(e).__name__)")
        os.chmod(tmp_path, 0o755)
        os.chmod(folder, 0o755)  # even with the folder open, the socket itself refuses
        r = subprocess.run(["/usr/bin/python3", "-c", probe, str(sock)], capture_output=True, text=True, timeout=300,
                           user=nobody)
        assert r.stdout.strip() == "PermissionError", r.stdout + r.stderr
    c.kill()


def test_a_folder_too_long_for_a_socket_gets_a_private_directory(tmp_path: Path) -> None:
    deep = tmp_path / ("d" * 60) / ("e" * 60)
    path = preload.socket_path(str(deep), "123")
    assert len(os.fsencode(path)) <= 107
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700 and path.parent.stat().st_uid == os.getuid()
    assert preload.socket_path(str(deep), "123") == path  # every task of the job finds the same one
    assert preload.socket_path(str(tmp_path), "123") == tmp_path.resolve() / ".preload-123.sock"


def test_the_local_executor_uses_the_fork_server_for_jobs_of_more_than_one_rank() -> None:
    from xirang_hpc.config.schema import ClusterConfig
    from xirang_hpc.submit.executors import local_python

    assert local_python(ClusterConfig(name="l", nodes=2, tasks_per_node=2)) == preload.command()
    assert local_python(ClusterConfig(name="l", nodes=2, tasks_per_node=2, preload=False)) is None
    assert local_python(ClusterConfig(name="l", nodes=1, tasks_per_node=1)) is None  # one rank starts plainly
