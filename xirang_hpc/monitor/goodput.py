"""Goodput of a run: how much of the time it held (or was seen running) went into training that was kept.

The definitions follow Google's ml-goodput-measurement (``BadputType``) so that figures compare:
goodput = productive step time / total time; badput by cause. Inputs, all from the run directory:

- ``steps.jsonl`` (written by rank 0's :class:`~xirang_hpc.monitor.goodput_hook.GoodputHook`): one
  ``session`` row per process start (start-up, restore/set-up and initial evaluation seconds, the step
  it restored), ``block`` rows of consecutive steps (their wall and monotonic end, seconds in total and
  in the data, eval and checkpoint phases, the median step), one ``end`` row when the loop finished.
  Blocks end at every checkpoint step, after a session's first step, after an evaluation and at least
  every :data:`FLUSH_S` seconds: a kill loses at most that much of the record, and a restore always
  falls on a block boundary, so kept and lost steps are told apart exactly.
- ``events.jsonl``: what ended each start (``dead``, ``hang``, ``stop`` with its reason, ``failure``, a
  supervisor's ``restart``...), which names each disruption and its detection latency.
- Slurm accounting (``sacct -D`` through :mod:`xirang_hpc.slurm.accounting`) for the allocated wall time
  and the queue wait; without it those buckets are reported as unknown and the total is the time the
  records cover (``basis: observed``), never a guess.

Per-step rows are not written to ``events.jsonl`` on purpose: the requeue policy rereads that file at
every fault, and a million step rows would slow it down.

Buckets (seconds; they add up to ``total_s``): ``productive`` (kept step time outside data, eval and
save), ``startup`` (process start to the loop's set-up, plus a session's first step beyond the ideal
step: imports, rendezvous, model build, warm-up), ``restore`` (checkpoint load and set-up of a resumed
start), ``data_loading`` (time a step waited in its data phase), ``checkpoint_save`` (time the loop was
blocked saving, incl. the save before a stop), ``eval``, ``lost_progress`` (steps after the checkpoint a
later start resumed from: recomputed), ``hang_detection`` (last step to the ``hang`` event), ``recovery``
(the fault to the next process start inside an allocation: teardown, requeue, relaunch), ``other``
(whatever the allocation held that none of these explains). ``queue_wait`` is reported separately
(scheduling goodput), as ml-goodput-measurement keeps scheduling out of the job's goodput.
"""

from __future__ import annotations

import bisect
import json
import math
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

from xirang_hpc.monitor.events import EVENTS_FILE

STEPS_FILE = "steps.jsonl"
# At least this often the hook writes the open block: what a kill -9 can take from the record.
FLUSH_S = 60.0
# Events carry wall-clock times, a session's records monotonic ones mapped to the wall clock: a fault seen within
# this long before the session's last record (a rank killed right after it wrote a step, and the watchdog's
# next look) still ends that session.
CLOCK_SLACK_S = 0.5
BUCKETS = ("productive", "startup", "restore", "data_loading", "checkpoint_save", "eval", "lost_progress",
           "hang_detection", "recovery", "other")
# Event kinds that say how a start ended (the first one after its last step names the disruption).
FAULT_KINDS = ("hang", "dead", "unresponsive", "abort", "failure", "stop", "restart", "requeue", "supervisor_died",
               "launcher_gone", "save_failed", "restart_refused", "step_launch_failed", "migrate")
WINDOWS = {"last_hour": 3600.0, "last_day": 86400.0}


class GoodputInputError(ValueError):
    """The run directory has no goodput record (no ``steps.jsonl``), so nothing can be computed."""


@dataclass
class Lines:
    """The JSON objects of a JSONL file and how many of its lines were not one (torn, interleaved, foreign)."""

    rows: list[dict[str, Any]]
    bad: int = 0
    bad_examples: list[int] = field(default_factory=list)  # 1-based line numbers, the first few


def read_lines(path: Path) -> Lines:
    """Parse ``path``: one bulk parse when every line is whole (the common case, ~2x faster), else line by line,
    counting what is skipped."""
    if not path.exists():
        return Lines([])
    text = path.read_text(errors="replace")
    lines = [ln for ln in text.split("\n") if ln.strip()]
    try:
        rows = json.loads("[" + ",".join(lines) + "]")
        if all(isinstance(r, dict) for r in rows):
            return Lines(rows)
    except json.JSONDecodeError:
        pass
    out = Lines([])
    for i, ln in enumerate(text.split("\n"), 1):
        if not ln.strip():
            continue
        try:
            row = json.loads(ln)
        except json.JSONDecodeError:
            row = None
        if isinstance(row, dict):
            out.rows.append(row)
        else:
            out.bad += 1
            if len(out.bad_examples) < 5:
                out.bad_examples.append(i)
    return out


@dataclass
class Allocation:
    """One run of a Slurm job (a requeued job has one per start): Unix seconds."""

    job: str
    submit: float
    start: float
    end: float
    state: str = ""
    account: str = ""
    user: str = ""
    nodes: int = 0


@dataclass
class Span:
    """An interval of wall time and how its seconds split into buckets (they may sum to less than its length:
    the rest is ``other``)."""

    t0: float
    t1: float
    parts: dict[str, float]


@dataclass
class Session:
    """One process start of rank 0, as ``steps.jsonl`` records it."""

    pid: Any
    host: str
    job: str
    fit_wall: float
    fit_mono: float
    startup_s: float
    setup_s: float
    eval_s: float
    restored: int
    blocks: list[dict[str, Any]] = field(default_factory=list)
    end: dict[str, Any] | None = None

    def wall(self, mono: float) -> float:
        """A monotonic reading of this process as wall time (anchored at fit start: immune to clock jumps)."""
        return self.fit_wall + (mono - self.fit_mono)

    @property
    def proc_start(self) -> float:
        """When the process started (wall)."""
        return self.fit_wall - self.startup_s

    @property
    def last_step(self) -> int:
        """The last step this start recorded (its restored step when it recorded none)."""
        return int(self.blocks[-1]["b"]) if self.blocks else self.restored

    @property
    def last_time(self) -> float:
        """Wall time of its last record."""
        if self.end is not None:
            return self.wall(float(self.end["mono"]))
        if self.blocks:
            return self.wall(float(self.blocks[-1]["mono"]))
        return self.fit_wall + self.setup_s + self.eval_s


def sessions_of(rows: Iterable[dict[str, Any]]) -> tuple[list[Session], int]:
    """Sessions in file order with their blocks; also how many block/end rows named no session (skipped)."""
    sessions: list[Session] = []
    by_pid: dict[Any, Session] = {}
    orphans = 0
    for r in rows:
        kind = r.get("kind", "block")
        if kind == "session":
            s = Session(pid=r.get("pid"), host=str(r.get("host", "")), job=str(r.get("job", "")),
                        fit_wall=float(r["time"]), fit_mono=float(r["mono"]), startup_s=float(r.get("startup_s", 0)),
                        setup_s=float(r.get("setup_s", 0)), eval_s=float(r.get("eval_s", 0)),
                        restored=int(r.get("step", 0)))
            sessions.append(s)
            by_pid[s.pid] = s
            continue
        s = by_pid.get(r.get("pid"))
        if s is None:
            orphans += 1
        elif kind == "end":
            s.end = r
        else:
            s.blocks.append(r)
    return sessions, orphans


def ideal_step_s(sessions: Sequence[Session]) -> float:
    """ml-goodput-measurement's ideal step time: the median step (here the step-weighted median of each block's
    median compute time; a session's first step, which carries warm-up, is left out)."""
    pairs = sorted((float(b["med"]), int(b["b"]) - int(b["a"]) + 1) for s in sessions for b in s.blocks[1:]
                   if b.get("med") is not None)
    if not pairs:
        pairs = sorted((float(b["med"]), 1) for s in sessions for b in s.blocks if b.get("med") is not None)
    if not pairs:
        return 0.0
    half, seen = sum(n for _, n in pairs) / 2, 0
    for med, n in pairs:
        seen += n
        if seen >= half:
            return med
    return pairs[-1][0]


def _fault_events(events: Sequence[dict[str, Any]]) -> tuple[list[float], list[dict[str, Any]]]:
    rows = sorted((e for e in events if e.get("kind") in FAULT_KINDS and isinstance(e.get("time"), (int, float))),
                  key=lambda e: float(e["time"]))
    return [float(e["time"]) for e in rows], rows


def _cause(found: list[dict[str, Any]]) -> tuple[str, str]:
    """(cause, detail) of a disruption from the events between two starts (the most specific kind wins)."""
    for kind in ("hang", "dead", "unresponsive", "stop", "failure", "save_failed", "supervisor_died", "launcher_gone",
                 "abort", "restart", "requeue", "migrate"):
        for e in found:
            if e.get("kind") == kind:
                name = str(e.get("reason")) if kind in ("stop", "failure", "requeue") else kind
                return name, str(e.get("cause") or e.get("detail") or e.get("reason") or "")
    return "unknown", "no event names it (a kill that left no record)"


def _seen(t_last: float, t_next: float, t: float) -> float:
    """When a start's fault was seen, within its end: an event stamped before its last record (two clocks) is at
    that record; one written after the next start began (a late watchdog) says the fault came before that start,
    not when: the time since the last record is then counted as recovery, not guessed."""
    return t_last if t < t_last or t > t_next else t


def _intersect(t0: float, t1: float, allocs: Sequence[tuple[float, float]]) -> float:
    """Seconds of [t0, t1] inside the (sorted, disjoint) allocations."""
    return sum(max(0.0, min(t1, b) - max(t0, a)) for a, b in allocs)


def _union(intervals: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for a, b in sorted(intervals):
        if b <= a:
            continue
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


@dataclass
class Timeline:
    """What :func:`timeline` derives from the records: spans, disruptions, what was flagged."""

    spans: list[Span]
    disruptions: list[dict[str, Any]]
    covered: list[tuple[float, float]]  # what the records cover (the observed basis)
    negative_spans: list[dict[str, Any]]
    ideal_step_s: float
    last_step: int
    steps_done: int  # distinct steps kept


def timeline(sessions: Sequence[Session], events: Sequence[dict[str, Any]]) -> Timeline:
    """Every second the records account for, as spans with their buckets (see the module docstring)."""
    ideal = ideal_step_s(sessions)
    spans: list[Span] = []
    disruptions: list[dict[str, Any]] = []
    negative: list[dict[str, Any]] = []
    covered: list[tuple[float, float]] = []
    ftimes, fevents = _fault_events(events)
    pids = {s.pid for s in sessions if s.pid is not None}  # fault events naming a start belong to it
    # A step executed in start i is kept when no later start resumed from an earlier step (the last execution of a
    # step is the one that counts): the limit of start i is the lowest step any later start restored.
    limits: list[float] = [math.inf] * len(sessions)
    low = math.inf
    for i in range(len(sessions) - 1, -1, -1):
        limits[i] = low
        low = min(low, sessions[i].restored)
    for i, s in enumerate(sessions):
        t_fit = s.fit_wall
        t_loop = t_fit + s.setup_s + s.eval_s
        spans.append(Span(s.proc_start, t_fit, {"startup": s.startup_s}))
        spans.append(Span(t_fit, t_loop, {"restore" if s.restored > 0 else "startup": s.setup_s, "eval": s.eval_s}))
        covered.append((s.proc_start, t_loop))
        prev_mono = s.fit_mono + s.setup_s + s.eval_s
        limit = limits[i]
        lost_here = 0.0
        for j, b in enumerate(s.blocks):
            m1, dur = float(b["mono"]), float(b["dur"])
            t1 = s.wall(m1)
            data, ev, save = float(b.get("data", 0)), float(b.get("eval", 0)), float(b.get("save", 0))
            work = max(0.0, dur - data - ev - save)
            a, z = int(b["a"]), int(b["b"])
            n = z - a + 1
            kept_n = n if z <= limit else (0 if a > limit else int(limit) - a + 1)
            warm = 0.0
            if j == 0 and ideal > 0 and n == 1:  # the first step's excess over the ideal step: warm-up (startup)
                warm = max(0.0, work - ideal)
                work -= warm
            kept = work * kept_n / n
            lost_here += work - kept
            spans.append(Span(t1 - dur, t1, {"productive": kept, "lost_progress": work - kept, "startup": warm,
                                             "data_loading": data, "eval": ev, "checkpoint_save": save}))
            covered.append((t1 - dur, t1))
            # A block that starts before the previous one ended: records overlap. Both ends are written rounded to
            # the microsecond, so a gap of a few microseconds either way is rounding, not an overlap.
            if m1 - dur < prev_mono - 1e-5:
                negative.append({"where": STEPS_FILE, "session_pid": s.pid, "step": a,
                                 "seconds": round(m1 - dur - prev_mono, 6)})
            prev_mono = m1
        t_last = s.last_time
        if s.end is not None:  # the loop finished: its final evaluation; what follows is not a disruption
            t_end = s.wall(float(s.end["mono"]))
            ev = float(s.end.get("eval_s", 0))
            spans.append(Span(t_end - ev, t_end, {"eval": ev}))
            covered.append((t_end - ev, t_end))
            # The final save (after the loop) ends with the run's ``exit`` event.
            done = [e for e in events if e.get("kind") == "exit" and e.get("status") == "completed"
                    and t_end <= float(e.get("time", 0)) <= t_end + 3600]
            if done:
                t_exit = float(done[0]["time"])
                spans.append(Span(t_end, t_exit, {"checkpoint_save": t_exit - t_end}))
                covered.append((t_end, t_exit))
            continue
        nxt = sessions[i + 1] if i + 1 < len(sessions) else None
        t_next = nxt.proc_start if nxt is not None else math.inf
        if nxt is not None and t_next < t_last:  # the next start seems to begin before this one ended: two clocks
            negative.append({"where": "between starts", "session_pid": s.pid, "next_pid": nxt.pid,
                             "seconds": round(t_next - t_last, 6)})
            t_next = t_last
        since = max(s.proc_start, t_last - CLOCK_SLACK_S)
        lo, hi = bisect.bisect_right(ftimes, since), bisect.bisect_left(ftimes, t_next)
        # A fault event naming a start's process (the watchdog's ``dead`` of rank 0) is that start's, whenever it
        # was written: a loaded machine's watchdog may write it after the next start began.
        found = sorted([e for e in fevents[lo:hi] if e.get("pid") in (None, s.pid) or e.get("pid") not in pids]
                       + [e for e in fevents[:lo] + fevents[hi:] if s.pid is not None and e.get("pid") == s.pid],
                       key=lambda e: float(e["time"]))
        if nxt is None and not found:
            continue  # the newest start, still running (or ended without a word yet)
        cause, detail = _cause(found)
        parts: dict[str, float] = {}
        seen = partial(_seen, t_last, t_next)
        t_fault = seen(float(found[0]["time"])) if found else t_last
        stop = next((e for e in found if e.get("kind") == "stop"), None)
        hang = next((e for e in found if e.get("kind") == "hang"), None)
        if hang is not None:
            t_fault = seen(float(hang["time"]))
            parts["hang_detection"] = t_fault - t_last
        elif stop is not None and stop.get("saved_step") is not None:
            t_fault = seen(float(stop["time"]))
            parts["checkpoint_save"] = t_fault - t_last  # the save before the stop, then the exit
        elif found and limit <= s.last_step:
            # Work after the last record (at most FLUSH_S of it) until the fault was seen: past the checkpoint the
            # next start resumed from, so it was lost.
            parts["lost_progress"] = t_fault - t_last
            lost_here += t_fault - t_last
        spans.append(Span(t_last, t_fault, parts))
        covered.append((t_last, t_fault))
        reached = max([s.last_step] + [int(e["step"]) for e in found if isinstance(e.get("step"), int)])
        lost_steps = max(0, reached - int(limit)) if limit != math.inf else 0
        row: dict[str, Any] = {"time": t_fault, "cause": cause, "detail": detail, "job": s.job,
                               "step_reached": reached, "restored_step": None if nxt is None else nxt.restored,
                               "lost_steps": lost_steps, "lost_s": lost_here,
                               "detection_s": parts.get("hang_detection", 0.0), "recovery_s": None}
        if nxt is not None:
            gap = max(0.0, t_next - t_fault)
            spans.append(Span(t_fault, t_fault + gap, {"recovery": gap}))
            covered.append((t_fault, t_fault + gap))
            # Recovery as people quote it: fault to the next start's first step (start-up and restore included).
            first = nxt.wall(float(nxt.blocks[0]["mono"]) - float(nxt.blocks[0]["dur"])) if nxt.blocks else None
            row["recovery_s"] = None if first is None else max(0.0, first - t_fault)
        disruptions.append(row)
    kept_steps = 0
    for i, s in enumerate(sessions):
        for b in s.blocks:
            a, z = int(b["a"]), int(b["b"])
            kept_steps += max(0, min(z, limits[i]) - a + 1)
    last = max((s.last_step for s in sessions), default=0)
    return Timeline(spans, disruptions, _union(covered), negative, ideal, last, int(kept_steps))


def slurm_allocations(job_ids: Sequence[str], history: Callable[[Sequence[str]], list[Any]] | None = None
                      ) -> list[Allocation] | None:
    """The runs of ``job_ids`` from sacct, or None when there is no accounting to ask (local jobs, no sacct,
    slurmdbd down): then allocated time and queue wait are unknown, not guessed."""
    jobs = sorted({j for j in job_ids if j and j.replace("_", "").isdigit()})
    if not jobs:
        return None
    from xirang_hpc.slurm.accounting import SlurmDB, SlurmQueryError

    try:
        recs = (history or SlurmDB().history)(jobs)
    except (SlurmQueryError, OSError):
        return None
    out = []
    for r in recs:
        start, end, submit = _sacct_time(r.start), _sacct_time(r.end), _sacct_time(r.submit)
        if start is None:
            continue  # never started (pending)
        out.append(Allocation(job=r.job_id, submit=submit if submit is not None else start, start=start,
                              end=end if end is not None else time.time(), state=r.state, account=r.account,
                              user=r.user, nodes=r.nnodes))
    return out or None


def _sacct_time(text: str) -> float | None:
    """sacct's ``2026-01-02T03:04:05`` (local time) as Unix seconds; None for Unknown/None."""
    try:
        return time.mktime(time.strptime(text.strip(), "%Y-%m-%dT%H:%M:%S"))
    except ValueError:
        return None


def _sum(spans: Sequence[Span], w0: float, w1: float) -> dict[str, float]:
    """Bucket seconds of the spans inside [w0, w1] (a span partly inside counts in proportion)."""
    out = dict.fromkeys(BUCKETS, 0.0)
    for sp in spans:
        length = sp.t1 - sp.t0
        if length <= 0 or sp.t1 <= w0 or sp.t0 >= w1:
            continue
        frac = 1.0 if (sp.t0 >= w0 and sp.t1 <= w1) else (min(sp.t1, w1) - max(sp.t0, w0)) / length
        for k, v in sp.parts.items():
            out[k] += v * frac
    return out


def breakdown(tl: Timeline, allocs: list[Allocation] | None, w0: float = -math.inf, w1: float = math.inf
              ) -> dict[str, Any]:
    """Goodput and badput by cause over [w0, w1] (the whole run by default)."""
    parts = _sum(tl.spans, w0, w1)
    unknown: list[str] = []
    if allocs is not None:
        alloc = _union((a.start, a.end) for a in allocs)
        total = sum(max(0.0, min(b, w1) - max(a, w0)) for a, b in alloc)
        # The part of each recovery outside every allocation was spent pending in the queue (a requeue): queue
        # wait, which is reported on its own.
        outside = sum(sp.parts["recovery"] - _intersect(sp.t0, sp.t1, alloc) for sp in tl.spans
                      if sp.parts.get("recovery") and sp.t1 > sp.t0 and sp.t1 > w0 and sp.t0 < w1)
        parts["recovery"] = max(0.0, parts["recovery"] - outside)
        queue = 0.0
        prev_end: dict[str, float] = {}
        for a in sorted(allocs, key=lambda x: x.start):
            eligible = max(a.submit, prev_end.get(a.job.split("_")[0], -math.inf))
            queue += max(0.0, min(a.start, w1) - max(eligible, w0))
            prev_end[a.job.split("_")[0]] = a.end
        basis = "allocation"
    else:
        total = sum(max(0.0, min(b, w1) - max(a, w0)) for a, b in tl.covered)
        queue = None
        basis = "observed"
        unknown = ["allocated", "queue_wait", "other (time the allocation held outside the records)"]
    known = sum(v for k, v in parts.items() if k != "other")
    parts["other"] = max(0.0, total - known)
    over = known - total
    out: dict[str, Any] = {
        "basis": basis, "total_s": total, "allocated_s": total if allocs is not None else None,
        "productive_s": parts["productive"], "goodput": parts["productive"] / total if total > 0 else None,
        "badput_s": {k: v for k, v in parts.items() if k != "productive"},
        "queue_wait_s": queue,
        "scheduling_goodput": (total / (total + queue)) if queue is not None and total + queue > 0 else None,
        "unknown": unknown,
    }
    if over > 1e-3 * max(total, 1.0):  # the records claim more time than the allocation held: a clock problem
        out["overcounted_s"] = over
    return out


@dataclass
class RunRecord:
    """A run directory's goodput inputs, parsed: the timeline, the allocations (None: no accounting), bad lines."""

    run_dir: Path
    sessions: list[Session]
    timeline: Timeline
    allocations: list[Allocation] | None
    bad_lines: dict[str, int]
    bad_line_numbers: dict[str, list[int]]


def load_run(run_dir: Path | str, allocations: list[Allocation] | None | str = "sacct",
             history: Callable[[Sequence[str]], list[Any]] | None = None) -> RunRecord:
    """Parse a run directory's records; ``allocations="sacct"`` asks Slurm about the run's jobs (``history``
    stands in for ``SlurmDB().history`` in tests), None means no accounting, a list is used as given."""
    run_dir = Path(run_dir)
    if not (run_dir / STEPS_FILE).exists():
        raise GoodputInputError(f"{run_dir}: no {STEPS_FILE}: the run never reached its first step, or was trained "
                                "by a version that did not record goodput")
    steps = read_lines(run_dir / STEPS_FILE)
    ev = read_lines(run_dir / EVENTS_FILE)
    sessions, orphans = sessions_of(steps.rows)
    tl = timeline(sessions, ev.rows)
    if allocations == "sacct":
        jobs = [s.job for s in sessions] + [str(e.get("job")) for e in ev.rows if e.get("kind") == "submit"]
        allocs = slurm_allocations(jobs, history)
    else:
        allocs = allocations  # type: ignore[assignment]
    return RunRecord(run_dir, sessions, tl, allocs, {STEPS_FILE: steps.bad + orphans, EVENTS_FILE: ev.bad},
                     {STEPS_FILE: steps.bad_examples, EVENTS_FILE: ev.bad_examples})


def report(rec: RunRecord, now: float | None = None) -> dict[str, Any]:
    """The goodput report of a parsed run: the whole run, the rolling windows, disruptions, MTBF, what was flagged."""
    tl, allocs = rec.timeline, rec.allocations
    now = time.time() if now is None else now
    out = breakdown(tl, allocs)
    n = len(tl.disruptions)
    out.update({
        "run": str(rec.run_dir), "starts": len(rec.sessions), "last_step": tl.last_step, "steps_kept": tl.steps_done,
        "ideal_step_s": tl.ideal_step_s, "disruptions": n, "mtbf_s": out["total_s"] / n if n else None,
        "disruption_list": tl.disruptions,
        "windows": {name: breakdown(tl, allocs, now - length, now) for name, length in WINDOWS.items()},
        "bad_lines": rec.bad_lines, "bad_line_numbers": rec.bad_line_numbers,
        "negative_spans": tl.negative_spans,
    })
    if allocs is not None:
        out["allocations"] = [a.__dict__ for a in allocs]
    return out


def run_goodput(run_dir: Path | str, now: float | None = None, allocations: list[Allocation] | None | str = "sacct",
                history: Callable[[Sequence[str]], list[Any]] | None = None) -> dict[str, Any]:
    """The goodput report of one run directory (:func:`load_run`, then :func:`report`)."""
    return report(load_run(run_dir, allocations, history), now)


def _owner(path: Path) -> str:
    import pwd

    try:
        return pwd.getpwuid(path.stat().st_uid).pw_name
    except (KeyError, OSError):
        return "?"


def fleet(runs: Sequence[Path], since: float, until: float,
          history: Callable[[Sequence[str]], list[Any]] | None = None) -> dict[str, Any]:
    """Goodput of every run in ``runs`` over [since, until], summed per account (from sacct; ``local`` without
    accounting) and user: seconds per bucket, goodput, the top causes of badput. Runs without a goodput record
    are listed as skipped."""
    groups: dict[tuple[str, str], dict[str, Any]] = {}
    skipped: list[str] = []
    for run in runs:
        try:
            rec = load_run(run, history=history)
        except GoodputInputError:
            skipped.append(str(run))
            continue
        b = breakdown(rec.timeline, rec.allocations, since, until)
        if not b["total_s"]:
            continue
        allocs = rec.allocations or []
        key = (allocs[0].account if allocs and allocs[0].account else "local",
               allocs[0].user if allocs and allocs[0].user else _owner(run))
        g = groups.setdefault(key, {"account": key[0], "user": key[1], "runs": 0, "total_s": 0.0,
                                    "productive_s": 0.0, "badput_s": dict.fromkeys(BUCKETS[1:], 0.0),
                                    "queue_wait_s": 0.0, "unknown": set()})
        g["runs"] += 1
        g["total_s"] += b["total_s"]
        g["productive_s"] += b["productive_s"]
        for k, v in b["badput_s"].items():
            g["badput_s"][k] += v
        g["queue_wait_s"] += b["queue_wait_s"] or 0.0
        g["unknown"].update(b["unknown"])
    rows = []
    for g in groups.values():
        g["goodput"] = g["productive_s"] / g["total_s"] if g["total_s"] else None
        g["top_causes"] = [k for k, v in sorted(g["badput_s"].items(), key=lambda kv: -kv[1]) if v > 0][:3]
        g["unknown"] = sorted(g["unknown"])
        rows.append(g)
    rows.sort(key=lambda g: (g["account"], g["user"]))
    return {"since": since, "until": until, "groups": rows, "skipped": skipped}


def prometheus_text(view: dict[str, Any]) -> str:
    """The fleet view as Prometheus gauges (node_exporter's textfile collector format)."""
    out = ["# HELP xirang_goodput_ratio Productive step time over total time, per account and user.",
           "# TYPE xirang_goodput_ratio gauge",
           "# HELP xirang_badput_seconds Time lost by cause over the window, per account and user.",
           "# TYPE xirang_badput_seconds gauge"]
    for g in view["groups"]:
        lab = f'account="{g["account"]}",user="{g["user"]}"'
        if g["goodput"] is not None:
            out.append(f"xirang_goodput_ratio{{{lab}}} {g['goodput']:.6f}")
        for k, v in g["badput_s"].items():
            out.append(f'xirang_badput_seconds{{{lab},cause="{k}"}} {v:.3f}')
    return "\n".join(out) + "\n"
