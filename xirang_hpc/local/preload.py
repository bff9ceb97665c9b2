"""Local ranks forked from one process that has imported torch: the local executor's start-up, shared.

A fresh interpreter per rank imports torch, ``torch.distributed.checkpoint``, ``torch._dynamo`` (which torch
imports on a rank's first optimizer step) and the package: about 4 s of CPU each, before its first line of
work, and on a small machine every rank of a local run pays it at the same time. With ``cluster.preload``
(the default) submitit's local executor starts each task through this module instead of ``python``:

- the task's process is a small *client* (standard library only). The first client of a job starts one
  *fork server* for the job (a new session; it imports what a rank needs, once) and every client asks it
  for a rank: the server forks a child that takes the client's arguments, environment, working directory
  and standard streams (passed over the socket), and runs ``python -m submitit.core._submit ...`` in it
  as the interpreter would;
- the client stands for its rank: it forwards the signals it gets (the controller's SIGUSR2 before the
  time limit, SIGTERM/SIGINT on cancel) to the child, and leaves with the child's exit code, or is killed
  by the signal that killed the child, so submitit sees what it would have seen. A client killed with
  SIGKILL closes its socket, and the server kills its child the same way;
- nothing is lost when the server cannot serve (it died, or forking is unsafe because CUDA is already
  initialized in it): the client then ``exec``-s the interpreter with the task's command, the plain start.

The server's socket lives in the job's submitit folder (inside the private run directory), or in a private
temporary directory when that path is too long for a socket; the server also checks the peer's user id.
It leaves when it has no rank alive and no client connected for ``IDLE_EXIT_S`` (``XIRANG_PRELOAD_IDLE_S``).
``XIRANG_PRELOAD_MODULES`` (comma-separated) replaces the list of modules it imports.
"""

from __future__ import annotations

import contextlib
import fcntl
import gc
import json
import os
import selectors
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from xirang_hpc.runtime.startup import TRAINING_STACK, import_paused

# What a rank imports before its first step (an import that fails here is simply done again by the rank).
PRELOAD = (*TRAINING_STACK, "submitit", "submitit.core.submission", "xirang_hpc.job.entry", "xirang_hpc.job.training",
           "xirang_hpc.checkpoint.manager")
# Signals a client passes on to its rank (SIGKILL and SIGSTOP cannot be caught: the server handles a
# killed client; a stopped client leaves its rank running, as a stopped parent would).
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2,
             signal.SIGCONT, signal.SIGALRM)
IDLE_EXIT_S = float(os.environ.get("XIRANG_PRELOAD_IDLE_S", "30"))
# A server that is not listening this long after its start is given up (the clients start their rank plainly).
SERVER_START_S = 600.0
_SUN_PATH_MAX = 107  # sockaddr_un.sun_path holds 108 bytes, the terminating NUL included


def command(python: str | None = None) -> str:
    """The ``python`` command for submitit's local executor that starts tasks through the fork server."""
    import shlex

    return f"{shlex.quote(python or sys.executable)} -m xirang_hpc.local.preload"


# ---- wire format: length-prefixed JSON messages, the standard streams as SCM_RIGHTS on the request ----

def _send(sock: socket.socket, msg: dict[str, Any], fds: list[int] | None = None) -> None:
    data = json.dumps(msg).encode()
    frame = struct.pack("!I", len(data)) + data
    if fds:
        socket.send_fds(sock, [frame], fds)
    else:
        sock.sendall(frame)


def _recv(sock: socket.socket, with_fds: int = 0) -> tuple[dict[str, Any] | None, list[int]]:
    """One message (None at end of stream) and the descriptors that came with it."""
    fds: list[int] = []
    if with_fds:
        head, fds, _flags, _addr = socket.recv_fds(sock, 4, with_fds)
    else:
        head = sock.recv(4, socket.MSG_WAITALL)
    if len(head) < 4:
        head += sock.recv(4 - len(head), socket.MSG_WAITALL) if head else b""
    if len(head) < 4:
        for fd in fds:
            os.close(fd)
        return None, []
    (n,) = struct.unpack("!I", head)
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            return None, fds
        data += chunk
    return json.loads(data), fds


# ---- where a job's server listens ----

def socket_path(folder: str, job_id: str) -> Path:
    """The server's socket for job ``job_id`` whose submitit folder is ``folder``."""
    path = Path(folder).resolve() / f".preload-{job_id}.sock"
    if len(os.fsencode(path)) <= _SUN_PATH_MAX:
        return path
    # Too long for a socket: a private directory of its own, named after the folder so every task finds it.
    import hashlib

    key = hashlib.sha256(os.fsencode(path)).hexdigest()[:16]
    root = Path(tempfile.gettempdir()) / f"xirang-preload-{os.getuid()}"
    root.mkdir(mode=0o700, exist_ok=True)
    if root.stat().st_uid != os.getuid() or root.stat().st_mode & 0o077:
        raise PermissionError(f"{root} is not private to this user")
    return root / f"{key}.sock"


# ---- client ----

def _plain_exec(argv: list[str]) -> None:
    """The start the executor would have made without the fork server."""
    os.execv(sys.executable, [sys.executable, *argv])


def _connect(path: Path) -> socket.socket | None:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.connect(str(path))
        return s
    except OSError:
        s.close()
        return None


def _connect_or_start(path: Path, ntasks: int) -> socket.socket | None:
    """A connection to the job's server, started by this client when there is none (one client at a time
    holds the lock while it starts it, so a job has one server). None: no server could be started."""
    s = _connect(path)
    if s is not None:
        return s
    with open(f"{path}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        s = _connect(path)
        if s is not None:
            return s
        with contextlib.suppress(FileNotFoundError):
            path.unlink()  # a socket left by a server that died
        server = subprocess.Popen([sys.executable, "-m", "xirang_hpc.local.preload", "--serve", str(path),
                                   str(ntasks)], start_new_session=True, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + SERVER_START_S
        while time.monotonic() < deadline:
            s = _connect(path)
            if s is not None or server.poll() is not None:
                return s
            time.sleep(0.05)
        server.kill()
        return None


def client(argv: list[str]) -> None:
    """Run one task through the job's fork server (the task's process is this client); falls back to the plain
    start when no server can take it."""
    job_id = os.environ.get("SUBMITIT_LOCAL_JOB_ID")
    if not job_id or _python_args(argv) is None:  # not a submitit task: nothing to share
        _plain_exec(argv)
    try:
        path = socket_path(argv[-1], job_id)
        sock = _connect_or_start(path, int(os.environ.get("SUBMITIT_LOCAL_NTASKS", "1")))
    except OSError as exc:
        print(f"xirang preload: {exc}; starting this rank plainly", file=sys.stderr, flush=True)
        sock = None
    if sock is None:
        _plain_exec(argv)
    # Signals that come before the rank exists are kept and passed on once it does.
    rank: list[int] = []
    early: list[int] = []

    def forward(signum: int, _frame: Any) -> None:
        if not rank:
            early.append(signum)
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(rank[0], signum)

    old = {sig: signal.signal(sig, forward) for sig in FORWARDED}
    umask = os.umask(0o077)
    os.umask(umask)
    request = {"argv": argv, "env": dict(os.environ), "cwd": os.getcwd(), "umask": umask,
               "cpus": sorted(os.sched_getaffinity(0))}
    try:
        _send(sock, request, [0, 1, 2])
        reply, _ = _recv(sock)
    except OSError:  # the server went away before it forked the rank
        reply = None
    if reply is None or "pid" not in reply:  # the server refused or died before forking: nothing ran yet
        why = (reply or {}).get("error", "the fork server closed the connection")
        print(f"xirang preload: {why}; starting this rank plainly", file=sys.stderr, flush=True)
        for sig, handler in old.items():
            signal.signal(sig, handler)
        for sig in early:
            os.kill(os.getpid(), sig)
        _plain_exec(argv)
    rank.append(int(reply["pid"]))
    for sig in early:
        forward(sig, None)
    try:
        done, _ = _recv(sock)
    except OSError:
        done = None
    code = 1 if done is None else int(done["returncode"])  # None: the server died with the rank unreported
    if code < 0:  # killed by a signal: so is its client
        if -code not in (signal.SIGKILL, signal.SIGSTOP):  # these two always have their default action
            signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    sys.exit(code)


# ---- server ----

def _peer_uid(conn: socket.socket) -> int:
    creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return struct.unpack("3i", creds)[1]  # struct ucred: pid, uid, gid


def _python_args(argv: list[str]) -> tuple[bool, str, list[str]] | None:
    """``[-u] -m module args...`` -> (unbuffered, module, args); None for any other interpreter command line."""
    unbuffered = False
    i = 0
    while i < len(argv) and argv[i] == "-u":
        unbuffered, i = True, i + 1
    if i + 1 < len(argv) and argv[i] == "-m":
        return unbuffered, argv[i + 1], argv[i + 2:]
    return None


def _run_child(request: dict[str, Any], fds: list[int], keep_closed: list[int]) -> None:
    """In the forked child: become the task (streams, directory, environment, arguments, fresh random
    state), run its module as ``python -m`` does, leave as the interpreter would. Never returns."""
    code = 1
    try:
        for fd in keep_closed:
            with contextlib.suppress(OSError):
                os.close(fd)
        # The dispositions a fresh interpreter starts with: SIGINT raises KeyboardInterrupt (so a controller's
        # SIGINT still runs the rank's cleanup), SIGPIPE is ignored, the rest default.
        for sig in (*FORWARDED, signal.SIGCHLD):
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGPIPE, signal.SIG_IGN)
        for i, fd in enumerate(fds):
            os.dup2(fd, i)
            os.close(fd)
        os.chdir(request["cwd"])
        os.umask(int(request.get("umask", 0o077)))  # the rank's files are made as its client's would be
        if request.get("cpus"):  # and it runs on the CPUs its client was given (taskset, a site's binding)
            os.sched_setaffinity(0, request["cpus"])
        os.environ.clear()
        os.environ.update(request["env"])
        unbuffered, module, args = _python_args(request["argv"])  # type: ignore[misc]
        import io

        # New standard streams over the client's descriptors, unbuffered under -u as submitit asks for.
        sys.stdin = io.TextIOWrapper(io.FileIO(0, "r", closefd=False))
        for name, fd in (("stdout", 1), ("stderr", 2)):
            raw = io.FileIO(fd, "w", closefd=False)
            stream = io.TextIOWrapper(raw if unbuffered else io.BufferedWriter(raw), write_through=unbuffered,
                                      line_buffering=not unbuffered and os.isatty(fd), errors="backslashreplace")
            setattr(sys, name, stream)
        gc.enable()
        import random

        random.seed()  # a fresh interpreter seeds from the OS, not from its parent's state
        if "numpy" in sys.modules:
            sys.modules["numpy"].random.seed()
        import runpy

        sys.argv = [module, *args]
        interrupted = False
        try:
            runpy.run_module(module, run_name="__main__", alter_sys=True)
            code = 0
        except KeyboardInterrupt:  # the interpreter prints it, cleans up, and dies of SIGINT
            import traceback

            traceback.print_exc()
            code, interrupted = 1, True
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
            if exc.code is not None and not isinstance(exc.code, int):
                print(exc.code, file=sys.stderr)
        except BaseException:  # noqa: BLE001 - what the interpreter prints for an uncaught exception
            import traceback

            traceback.print_exc()
            code = 1
        import atexit
        import threading

        threading._shutdown()  # type: ignore[attr-defined]  # the interpreter waits for non-daemon threads,
        atexit._run_exitfuncs()  # then runs the exit handlers; os._exit below skips both
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        if interrupted:
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGINT)
    finally:
        os._exit(code)


def _returncode(status: int) -> int:
    """A wait status as ``subprocess`` reports it: the exit code, or minus the signal."""
    return -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)


def serve(path: Path, ntasks: int) -> None:
    """The fork server of one job: import what a rank needs, listen at ``path``, fork one rank per request,
    report its exit code to its client; leave when idle."""
    # The recipe of Python's gc.freeze() for a pre-fork server: no collection while importing (no freed holes
    # in the shared pages), freeze before forking, so that what was imported stays out of the ranks'
    # collections (and their copy-on-write pages).
    # XIRANG_PRELOAD_MODULES (comma-separated) replaces the list, e.g. to add the module of one's own model.
    names = [m for m in os.environ.get("XIRANG_PRELOAD_MODULES", ",".join(PRELOAD)).split(",") if m]
    gc.disable()  # and kept off after the imports: the server makes little; each rank enables it again
    failed = import_paused(names)
    for name, exc in failed:
        print(f"xirang preload: cannot preload {name}: {exc}", file=sys.stderr, flush=True)
    if failed:  # a forked rank would import a half-imported module again; it starts plainly and says why
        return
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():  # a forked child could not use CUDA: do not serve
        print("xirang preload: CUDA is initialized in the fork server; ranks start plainly", file=sys.stderr)
        return
    old = os.umask(0o077)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        listener.bind(str(path))
    finally:
        os.umask(old)
    listener.listen(max(ntasks, 8))
    sel = selectors.DefaultSelector()
    sel.register(listener, selectors.EVENT_READ)
    children: dict[int, socket.socket] = {}  # pid -> its client's connection
    pending: set[socket.socket] = set()  # connected, request not yet read
    idle_since = time.monotonic()
    try:
        while True:
            for key, _ in sel.select(timeout=0.1):
                conn = key.fileobj
                if conn is listener:
                    c, _ = listener.accept()
                    if _peer_uid(c) != os.getuid():
                        c.close()
                        continue
                    pending.add(c)
                    sel.register(c, selectors.EVENT_READ)
                    continue
                assert isinstance(conn, socket.socket)
                if conn in pending:
                    pending.discard(conn)
                    conn.settimeout(30)  # a client sends its request at once: one that stalls is dropped
                    try:
                        request, fds = _recv(conn, with_fds=3)
                    except OSError:
                        request, fds = None, []
                    conn.settimeout(None)
                    if request is None or len(fds) != 3 or _python_args(request.get("argv", [])) is None:
                        for fd in fds:
                            os.close(fd)
                        with contextlib.suppress(OSError):
                            _send(conn, {"error": "the fork server cannot run this command"})
                        sel.unregister(conn)
                        conn.close()
                        continue
                    # What the child must not keep: the server's socket, selector and connections.
                    others = [listener.fileno(), sel.fileno(), conn.fileno(),  # type: ignore[attr-defined]
                              *(c.fileno() for c in children.values()), *(c.fileno() for c in pending)]
                    pid = os.fork()
                    if pid == 0:
                        _run_child(request, fds, others)
                    for fd in fds:
                        os.close(fd)
                    children[pid] = conn
                    try:
                        _send(conn, {"pid": pid})
                    except OSError:  # the client is gone already: so is its rank
                        os.kill(pid, signal.SIGKILL)
                else:  # a client with a rank: readable means it is gone (killed): so is its rank
                    for pid, c in list(children.items()):
                        if c is conn:
                            with contextlib.suppress(ProcessLookupError):
                                os.kill(pid, signal.SIGKILL)
                            sel.unregister(conn)
                            break
            while children:
                pid, status = os.waitpid(-1, os.WNOHANG)
                if pid == 0:
                    break
                conn = children.pop(pid, None)
                if conn is not None:
                    with contextlib.suppress(OSError):
                        _send(conn, {"returncode": _returncode(status)})
                    with contextlib.suppress(KeyError, ValueError):
                        sel.unregister(conn)
                    conn.close()
            if children or pending:
                idle_since = time.monotonic()
            elif time.monotonic() - idle_since > IDLE_EXIT_S:
                return
    finally:
        with contextlib.suppress(FileNotFoundError):
            if path.is_socket():
                path.unlink()
        listener.close()


def main() -> None:
    """``python -m xirang_hpc.local.preload [-u] -m module args``: a task (client);
    ``--serve PATH NTASKS``: a job's fork server."""
    if len(sys.argv) >= 4 and sys.argv[1] == "--serve":
        serve(Path(sys.argv[2]), int(sys.argv[3]))
        return
    client(sys.argv[1:])


if __name__ == "__main__":
    main()
