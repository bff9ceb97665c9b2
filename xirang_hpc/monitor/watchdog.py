"""The watchdog: a small process per node, independent of the ranks' main threads.

Started by each node's local rank 0 (``python -m xirang_hpc.monitor.watchdog``), so it keeps
working while every rank is blocked in a collective, stopped, or killed. The watchdog of the
first node (the *leader*) reads every heartbeat, runs :func:`xirang_hpc.monitor.detect.assess`
and appends events to ``run_dir/events.jsonl``. On a hang or a dead rank it writes
``heartbeats/ABORT.json``; then every node's watchdog makes its local ranks dump their Python
stacks (the ``monitor.stack_signal``, registered with faulthandler, into ``run_dir/stacks/``) and
kills them, so the job ends and the requeue policy can exclude the failed node.

Hang bounds (:mod:`xirang_hpc.monitor.detect` has the table): ``monitor.hang_k`` = 20 x the median
step time, at least ``monitor.hang_min_s`` = 10 s, inside a timed training step and between the
liveness ticks of a checkpoint save or an evaluation; ``monitor.hang_s`` = 300 s for the first
step and start-up (watched from before the weight import and the checkpoint restore: the ranks
heartbeat from there). A hang needs every rank to be still; the event names the rank that did not
reach the collective or step the others wait in (``rank 3 (node n1, pid 4242) did not reach ...``).

Before that rule, the collective rule (``monitor.collective_timeout_s``, 10 s): a rank that has not
entered a collective its peers entered that long ago and is stopped, silent or still is named, with the
ranks waiting for it, whatever the step time and whatever the phase: a rank stopped in the checkpoint
restore is named like one stopped in a step (the module doc of :mod:`xirang_hpc.monitor.detect`).

A watchdog exits when its node's ranks are gone. Limit: a rank frozen on *another* host cannot
be signalled from here; its node's own watchdog does that.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import psutil

from xirang_hpc.files import write_json_atomic
from xirang_hpc.monitor.detect import ALIVE, GONE, STOPPED, Thresholds, WatchState, assess
from xirang_hpc.monitor.events import append_event
from xirang_hpc.monitor.heartbeat import (
    ABORT_FILE,
    HEARTBEAT_DIR,
    STACKS_DIR,
    dump_complete,
    read_heartbeats,
    read_json,
    stack_file,
)
from xirang_hpc.runtime.process_identity import is_same

ABORT_KINDS = {"hang": "abort_on_hang", "dead": "abort_on_dead"}
# A gap this long between two rounds of a loop that polls every ``poll_s`` means the watchdog itself did not run
# (the machine paused or starved it, or the wall clock stepped): the heartbeats it now reads are stale by that
# gap for reasons that are not the ranks'. It judges again only after ``RESYNC_S``, when they have beaten anew.
PAUSE_GAP_S = 5.0
RESYNC_S = 5.0


def probe(hb: dict[str, Any], host: str) -> str | None:
    """State of the rank's process if it runs on this host: alive | stopped | gone; None elsewhere."""
    if hb.get("host") != host:
        return None
    try:
        p = psutil.Process(int(hb["pid"]))
        # A recycled pid belongs to another process: told by its start since boot, which a wall-clock step
        # does not move (runtime/process_identity.py).
        if not is_same(p, hb.get("start_ticks"), float(hb.get("started", 0))):
            return GONE
        status = p.status()
    except (psutil.NoSuchProcess, psutil.AccessDenied, KeyError, ValueError):
        return GONE
    if status in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD):
        return GONE
    if status in (psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP):
        return STOPPED
    return ALIVE


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except OSError:
        pass


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return -1


def _complete(path: Path, offset: int, hb: dict[str, Any]) -> bool:
    """:func:`dump_complete` on what ``path`` gained past ``offset`` (False when it cannot be read)."""
    try:
        with path.open("rb") as f:
            f.seek(max(offset, 0))
            return bool(dump_complete(f.read().decode("utf-8", "replace"), hb))
    except OSError:
        return False


def dump_and_kill(ranks: list[dict[str, Any]], stack_sig: int, host: str, stacks_dir: Path | None = None,
                  grace_s: float = 1.0, settle_s: float = 0.5, max_wait_s: float = 15.0, resume_s: float = 0.5,
                  send: Callable[[int, int], None] = _signal,
                  look: Callable[[dict[str, Any]], str | None] | None = None,
                  clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep,
                  ) -> list[int]:
    """Make each live local rank dump its stacks, resume stopped ones so they can, then SIGKILL all.

    A stopped rank is resumed first and signalled ``resume_s`` later: faulthandler's handler reads the other
    threads' frames while they run (it cannot stop them), and on SIGCONT every thread of the rank wakes at once
    (its heartbeat thread with a beat overdue); a dump sent with the SIGCONT read a frame in the middle of a
    change (``line ??? in __exit__``) and ended there. ``resume_s`` later the threads are back in their waits.

    The kill waits for the dumps, not for a fixed time: faulthandler writes from the rank's signal handler,
    which runs only when the rank is next scheduled (a stopped rank after its SIGCONT), and on a loaded machine
    that can be seconds away; a kill in the middle of the dump leaves a stack file cut after a frame or two.
    So after ``grace_s`` the watchdog waits until each signalled rank's ``stacks_dir/rank-N.txt`` holds the whole
    dump (:func:`~xirang_hpc.monitor.heartbeat.dump_complete`: the main thread's outermost frame, which the rank
    named in its heartbeat), or the rank is gone, for at most ``max_wait_s`` in all. A dump can pause for
    seconds between two writes on a loaded machine, so a quiet file is not taken for a finished one; only for a
    rank whose heartbeat names no end does the file's having grown and then not changed for ``settle_s`` end
    the wait. Without ``stacks_dir`` it waits ``grace_s``. Returns the ranks that were signalled.
    """
    look = look or (lambda hb: probe(hb, host))
    hit: dict[int, dict[str, Any]] = {}
    files = {}
    states = {int(hb["rank"]): (hb, look(hb)) for hb in ranks}
    stopped = [hb for hb, state in states.values() if state == STOPPED]
    for hb in stopped:
        send(int(hb["pid"]), signal.SIGCONT)
    if stopped:
        sleep(resume_s)  # its threads settle back into their waits before the dump reads their frames
    for rank, (hb, state) in states.items():
        if state in (ALIVE, STOPPED):
            if stacks_dir is not None:
                path = stack_file(stacks_dir, rank)
                files[rank] = (path, _size(path))  # what an earlier dump (or the header) left there
            send(int(hb["pid"]), stack_sig)
            hit[rank] = hb
    if hit:
        t0 = clock()
        sleep(grace_s)
        last = {rank: (size, clock()) for rank, (_, size) in files.items()}
        named = {rank: dump_complete("", hit[rank]) is not None for rank in files}  # the rank named its dump's end
        read = {rank: before for rank, (_, before) in files.items()}  # the size at the last look at the content
        pending = set(files)
        while pending and clock() - t0 < max_wait_s:
            for rank in sorted(pending):
                path, before = files[rank]
                size, now = _size(path), clock()
                if named[rank] and size > read[rank]:  # new bytes: is the main thread's outermost frame among them?
                    read[rank] = size
                    if _complete(path, before, hit[rank]):
                        pending.discard(rank)  # the dump is whole
                        continue
                if size != last[rank][0]:
                    last[rank] = (size, now)  # still writing
                elif (not named[rank] and size > before and now - last[rank][1] >= settle_s) or look(hit[rank]) == GONE:
                    pending.discard(rank)  # (no end named) written and quiet since, or nothing left to wait for
            if pending:
                sleep(0.1)
    for hb in hit.values():
        send(int(hb["pid"]), signal.SIGKILL)
    return list(hit)


def thresholds_for(cfg: Mapping[str, Any]) -> Thresholds:
    """The detection thresholds from the monitor config (as the dict the watchdog process receives)."""
    return Thresholds(hang_s=cfg["hang_s"], stale_s=cfg["stale_s"], straggler_k=cfg["straggler_k"],
                      straggler_min_s=cfg["straggler_min_s"], straggler_window=cfg["straggler_window"],
                      hang_k=cfg.get("hang_k", 0.0), hang_min_s=cfg.get("hang_min_s", 10.0),
                      collective_s=cfg.get("collective_timeout_s", 0.0))


class Watchdog:
    """One node's watchdog loop (see the module docstring)."""

    def __init__(self, run_dir: Path, session: str, node: str, leader: bool, cfg: dict[str, Any],
                 poll_s: float = 0.5) -> None:
        self.run_dir, self.session, self.node, self.leader, self.cfg = run_dir, session, node, leader, cfg
        self.poll_s = poll_s
        self.host = socket.gethostname()
        self.th = thresholds_for(cfg)
        self.state = WatchState()
        self.stack_sig = int(getattr(signal, cfg.get("stack_signal", "SIGQUIT")))
        self.abort_path = run_dir / HEARTBEAT_DIR / ABORT_FILE
        self.aborted = False
        self._last_round: float | None = None
        self._judge_after = 0.0

    def _log(self, msg: str) -> None:
        print(f"{time.strftime('%H:%M:%S')} watchdog[{self.node}]: {msg}", flush=True)

    def check(self, now: float) -> dict[int, dict[str, Any]]:
        """One round: detect (leader), then enforce an abort (every node). Returns the heartbeats seen."""
        beats = read_heartbeats(self.run_dir, self.session)
        probes = {r: probe(hb, self.host) for r, hb in beats.items()}
        abort = read_json(self.abort_path)
        if abort is not None and abort.get("session") != self.session:
            abort = None  # left by an earlier attempt
        if self._last_round is not None and abs(now - self._last_round) > max(PAUSE_GAP_S, 10 * self.poll_s):
            self._log(f"no round for {now - self._last_round:.0f}s (this machine paused or starved us, or the clock "
                      f"stepped): judging again in {RESYNC_S:.0f}s, once the ranks have beaten anew")
            self._judge_after = now + RESYNC_S
        self._last_round = now
        # Once an abort is under way the deaths are ours: stop assessing.
        if self.leader and abort is None and now >= self._judge_after:
            for f in assess(beats, probes, now, self.th, self.state):
                ev = append_event(self.run_dir, f.kind, f.reason, rank=f.rank, node=f.node, phase=f.phase,
                                  step=f.step, cause=f.cause, session=self.session, **f.extra)
                self._log(ev["reason"])
                flag = ABORT_KINDS.get(f.kind)
                if flag and self.cfg.get(flag, True) and abort is None:
                    write_json_atomic(self.abort_path, {"session": self.session, "time": now, "kind": f.kind,
                                                        "rank": f.rank, "node": f.node, "reason": f.reason})
                    abort = read_json(self.abort_path)
        if abort is not None and not self.aborted:
            self.aborted = True
            mine = [hb for hb in beats.values() if hb.get("node") == self.node]
            hit = dump_and_kill(mine, self.stack_sig, self.host, self.run_dir / STACKS_DIR)
            self._log(f"abort ({abort.get('kind')}: rank {abort.get('rank')}): dumped stacks of and killed ranks {hit}")
            if self.leader:
                append_event(self.run_dir, "abort", f"job aborted after {abort.get('kind')} of rank "
                             f"{abort.get('rank')} on {abort.get('node')}", node=abort.get("node"),
                             rank=abort.get("rank"), stacks=str(self.run_dir / STACKS_DIR), session=self.session)
        return beats

    def run(self, first_beat_timeout_s: float = 300.0) -> None:
        """Loop until this node's ranks have all exited."""
        t0, seen = time.time(), False
        while True:
            beats = self.check(time.time())
            mine = [hb for hb in beats.values() if hb.get("node") == self.node and hb.get("host") == self.host]
            if mine:
                seen = True
                if all(probe(hb, self.host) == GONE for hb in mine):
                    self.check(time.time())  # last look: a death seen by this round is reported
                    return
            elif time.time() - t0 > first_beat_timeout_s:
                return
            elif seen:
                return
            time.sleep(self.poll_s)


def spawn(run_dir: Path, session: str, node: str, leader: bool, cfg: dict[str, Any]) -> int:
    """Start this node's watchdog as a detached process; returns its pid."""
    import subprocess

    log = (run_dir / HEARTBEAT_DIR / f"watchdog-{node}.log").open("a")
    cmd = [sys.executable, "-m", "xirang_hpc.monitor.watchdog", str(run_dir), "--session", session, "--node", node,
           "--config", json.dumps(cfg)] + (["--leader"] if leader else [])
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            start_new_session=True)
    log.close()
    return proc.pid


def main(argv: list[str] | None = None) -> None:
    """``python -m xirang_hpc.monitor.watchdog RUN_DIR --session S --node N [--leader] --config JSON``."""
    ap = argparse.ArgumentParser(prog="xirang-watchdog")
    ap.add_argument("run_dir", type=Path)
    ap.add_argument("--session", required=True)
    ap.add_argument("--node", required=True)
    ap.add_argument("--leader", action="store_true")
    ap.add_argument("--config", required=True, help="MonitorConfig fields as JSON")
    ap.add_argument("--poll", type=float, default=0.5)
    a = ap.parse_args(argv)
    Watchdog(a.run_dir, a.session, a.node, a.leader, json.loads(a.config), a.poll).run()


if __name__ == "__main__":
    main()
