"""Fault localization over one snapshot of heartbeats: pure logic, no I/O, no clock.

:func:`assess` turns the heartbeats of every rank, plus what the local process table says
about the ranks on this host, into findings:

- ``dead``: a rank's process is gone before it finished. When several are gone (a killed rank
  makes its peers' collectives fail), the *primary* one is the rank that left no exit record
  (killed by a signal, OOM, segfault); if all left one, the earliest to exit. The others get an
  ``peer_exit`` finding (not a fault of their node).
- ``unresponsive``: a rank on another host whose heartbeat thread went silent for ``stale_s``.
- ``hang``: every live rank has stopped moving for its phase's bound (:func:`hang_bound`). A rank
  moves when it enters a new phase or ticks (:mod:`xirang_hpc.runtime.liveness`: a save wrote a
  tensor, an evaluation finished a batch). The bounds, per phase:

  ============  =====================================================  ==========================
  label         phases                                                 bound
  ============  =====================================================  ==========================
  step          data/forward/backward/optimizer/comm, >= 2 timed steps  max(hang_min_s, hang_k x
                                                                       median step time) <= hang_s
  saving        checkpoint (the save ticks per tensor written)          as ``step``, between ticks
  eval          eval (ticks per batch)                                  as ``step``, between ticks
  first-step    a step phase before 2 steps are timed (warm-up,         hang_s
                compilation, the first batch's data preparation)
  start         start-up and anything unmeasured (restore, initial      hang_s
                evaluation before any timed step)
  ============  =====================================================  ==========================

  Start-up is covered from before the weight import and the checkpoint restore: the ranks heartbeat
  from there (phase ``start``, then ``restore`` while a checkpoint loads, ticking per tensor read).

  Defaults (``MonitorConfig``): hang_k=20, hang_min_s=10 s, hang_s=300 s, so a hang inside
  training is named after max(10 s, 20 x the step time). Requiring *every* rank to be still is
  what keeps a slow-but-moving job quiet: while one rank crawls through its phases (throttled,
  stopped and resumed, writing a large checkpoint) its peers wait in a collective for longer
  than their own bound, but the crawling rank moves. In a synchronous job a real hang stops
  every rank within one step, so it costs at most a step of latency.

  The culprit is chosen as (1) a rank whose process is stopped or whose heartbeat thread is
  silent (frozen process, lost node), else (2) the rank behind the others (fewer collectives
  issued, lower step, or outside the ``comm`` phase others announced, or a phase the majority
  is not in: stuck before the collective), else (3) the rank that stalled first (a
  collective/network hang where no rank stands out). The cause names what the culprit did not
  reach, from the per-rank count of collectives issued on the world group (``coll_seq``) or else
  the (step, phase) positions: ``rank 3 (node n1, pid 4242) did not reach collective #57 (the
  grad-norm / loss all-reduce of step 19) that rank(s) 0, 1, 2 wait in`` or ``... did not reach
  the gradient all-reduce of step 19 that rank(s) 0, 1, 2 wait in; it is in forward of step 19``.
- ``hang`` by collective progress (:func:`collective_findings`, ``collective_s`` =
  ``monitor.collective_timeout_s``), checked first and independent of the step time: on some process
  group, the ranks that entered collective #n (c10d's per-group count, in each heartbeat's ``colls``)
  have waited ``collective_s`` since the first of them did, and a member that has not entered it is
  either *frozen* (its process is stopped, or its heartbeat silent for ``stale_s``) or *still* (alive,
  but no phase change, liveness tick, CPU use of its training thread or collective issued for its
  bound: ``collective_s`` in a timed step, a save or an evaluation; ``hang_s`` at start-up and in the
  first step, where a rank may wait without CPU for compilation workers or storage). It is the culprit;
  the others are named as waiting, with what they wait in. A still rank inside a collective or a pipeline
  stage transfer of its own (``coll_in``: a wait the groups' counts do not show) waits too. A still rank
  that itself leads a group whose laggards it waits for is a waiter, not a culprit (the chain is followed
  to its end); a frozen one is a culprit wherever it is. A rank that computes, however long its step, is
  busy and never a culprit here: a slow step, a straggler that still works, a save or an evaluation that
  ticks stay quiet.
- ``straggler``: a rank whose local work per step (its data phase, before any collective) exceeds
  ``k`` x the median over ranks, and by at least ``min_s``. Report only. Limit: slowness inside
  forward/backward is invisible here (every rank waits at DDP's collectives for the slowest).
"""

from __future__ import annotations

import statistics
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from xirang_hpc.monitor.heartbeat import decode_members

# Phases announced right before a standalone collective (the signal consensus all-reduce): a rank
# in one waits for its peers, so a hang culprit is never one of them while another rank is elsewhere.
COLLECTIVE_PHASES = ("comm",)
# Process states from the local process table (None: the rank is on another host).
ALIVE, STOPPED, GONE = "alive", "stopped", "gone"


@dataclass(frozen=True)
class Thresholds:
    """The watchdog's knobs (from ``MonitorConfig``)."""

    hang_s: float = 300.0
    stale_s: float = 10.0
    straggler_k: float = 2.0
    straggler_min_s: float = 0.05
    straggler_window: int = 5
    hang_k: float = 0.0
    hang_min_s: float = 10.0
    collective_s: float = 0.0  # the collective rule (0: off); MonitorConfig.collective_timeout_s


# A training step's phases (and the stop-signal consensus between steps): once a rank has timed
# steps, a stall in one of them is measured against its step time (hang_k).
STEP_PHASES = ("data", "forward", "backward", "optimizer", "comm")
# Long phases that tick as they advance: measured between ticks against the same bound as a step.
TICKING_PHASES = {"checkpoint": "saving", "eval": "eval"}
# What the ranks waiting in a phase wait for: the collective a missing rank did not reach.
COLLECTIVE_OF = {"data": "start", "forward": "forward (DDP buffer broadcast / FSDP all-gather)",
                 "backward": "gradient all-reduce", "optimizer": "grad-norm / loss all-reduce",
                 "comm": "stop-signal consensus all-reduce", "eval": "evaluation all-reduce",
                 "checkpoint": "checkpoint save collective", "start": "start-up collective",
                 "restore": "checkpoint restore collective"}


def bound_phase(hb: dict[str, Any], th: Thresholds) -> str:
    """Which bound applies to this rank now: step | saving | eval | first-step | start (see the module doc)."""
    phase = hb.get("phase")
    timed = th.hang_k > 0 and bool(hb.get("step_s")) and int(hb.get("timed_steps", 0)) >= 2
    if phase in STEP_PHASES:
        return "step" if timed else "first-step"
    if phase in TICKING_PHASES and timed:
        return TICKING_PHASES[str(phase)]
    return "start"


def hang_bound(hb: dict[str, Any], th: Thresholds) -> float:
    """Seconds without moving (new phase or tick) after which this rank counts as stalled."""
    if bound_phase(hb, th) in ("step", "saving", "eval"):
        return min(th.hang_s, max(th.hang_min_s, th.hang_k * float(hb["step_s"])))
    return th.hang_s


def last_move(hb: dict[str, Any]) -> float:
    """When the rank last moved: entered its phase or ticked inside it."""
    return max(float(hb["progress"]), float(hb.get("active") or 0.0))


@dataclass
class Finding:
    """One detection, ready to become an event."""

    kind: str
    rank: int
    node: str
    phase: str
    step: int
    cause: str
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def reason(self) -> str:
        """One line for humans."""
        return f"rank {self.rank} on {self.node} ({self.phase}, step {self.step}): {self.kind}: {self.cause}"


@dataclass
class WatchState:
    """What has been reported already, so each fault yields one event."""

    dead_primary: int | None = None
    gone: set[int] = field(default_factory=set)
    unresponsive: set[int] = field(default_factory=set)
    hang: bool = False
    straggling: set[int] = field(default_factory=set)


def _finding(kind: str, hb: dict[str, Any], cause: str, **extra: Any) -> Finding:
    return Finding(kind, int(hb["rank"]), str(hb.get("node", "?")), str(hb.get("phase", "?")),
                   int(hb.get("step", 0)), cause, dict(extra))


def leaving(hb: dict[str, Any]) -> bool:
    """The rank has finished (``done``) or is leaving on a stop it agreed on with every rank (phase ``exit``:
    requeue, time limit, stop). Neither its silence nor its end is a fault: a process that takes long to
    tear down on a loaded node is not hung, and Slurm's own kill after its grace time is not a death."""
    return bool(hb.get("done")) or hb.get("phase") == "exit"


def _dead(beats: dict[int, dict[str, Any]], probes: dict[int, str | None], st: WatchState) -> list[Finding]:
    new = [r for r, hb in beats.items() if probes.get(r) == GONE and not leaving(hb) and r not in st.gone]
    if not new:
        return []
    st.gone.update(new)
    out = []
    if st.dead_primary is None:
        silent = [r for r in new if not beats[r].get("exited")]
        primary = min(silent) if silent else min(new, key=lambda r: beats[r].get("exit_time", 0.0))
        st.dead_primary = primary
        cause = ("process gone without an exit record: killed by a signal (kill -9, OOM killer) or crashed in "
                 "native code" if not beats[primary].get("exited") else
                 (f"process exited with an error: {beats[primary]['error']}" if beats[primary].get("error") else
                  "process exited with an error before finishing (see its log)"))
        out.append(_finding("dead", beats[primary], cause, pid=beats[primary].get("pid")))
    for r in sorted(new):
        if r != st.dead_primary:
            cause = f"exited after rank {st.dead_primary} died (its collectives failed)"
            out.append(_finding("peer_exit", beats[r], cause, pid=beats[r].get("pid")))
    return out


def _culprits(beats: dict[int, dict[str, Any]], probes: dict[int, str | None], now: float,
              th: Thresholds) -> list[tuple[int, str]]:
    frozen = [(r, "process is stopped (SIGSTOP, a debugger or a freezer cgroup); its heartbeat thread stopped "
               f"{now - hb['beat']:.0f}s ago") for r, hb in beats.items() if probes.get(r) == STOPPED]
    if frozen:
        return frozen
    silent = [(r, f"heartbeat thread silent for {now - hb['beat']:.0f}s: process frozen, node lost or "
               "filesystem stalled") for r, hb in beats.items() if now - hb["beat"] > th.stale_s]
    if silent:
        return silent
    seqs = {r: hb.get("coll_seq") for r, hb in beats.items()}
    if all(isinstance(v, int) for v in seqs.values()) and len(set(seqs.values())) > 1:
        lo_seq = min(seqs.values())  # type: ignore[type-var]
        return [(r, "behind the others in issued collectives: stuck in local work (data loading, compute, I/O) "
                 "before the collective") for r, v in seqs.items() if v == lo_seq]
    steps = {r: int(hb.get("step", 0)) for r, hb in beats.items()}
    lo, hi = min(steps.values()), max(steps.values())
    if lo < hi:
        return [(r, f"at step {lo} while others reached step {hi}: stuck in local work before the collective")
                for r, s in steps.items() if s == lo]
    waiting = [r for r, hb in beats.items() if hb.get("phase") in COLLECTIVE_PHASES]
    if waiting and len(waiting) < len(beats):
        # Ranks that announced a collective wait for the others, whatever the majority.
        return [(r, f"in phase '{hb.get('phase')}' while {len(waiting)} rank(s) wait in a collective "
                 f"('{beats[waiting[0]].get('phase')}'): stuck before entering it (data loading, compute, I/O)")
                for r, hb in beats.items() if hb.get("phase") not in COLLECTIVE_PHASES]
    phases = Counter(str(hb.get("phase")) for hb in beats.values())
    if len(phases) > 1:
        common = phases.most_common(1)[0][0]
        return [(r, f"in phase '{hb.get('phase')}' while {phases[common]} rank(s) wait in '{common}': stuck "
                 "before entering the collective (data loading, compute, I/O)")
                for r, hb in beats.items() if hb.get("phase") != common]
    first = min(beats, key=lambda r: beats[r]["progress"])
    return [(first, f"every rank stalled in '{beats[first].get('phase')}': a collective or network hang; "
             f"rank {first} stalled first")]


def _stragglers(beats: dict[int, dict[str, Any]], th: Thresholds, st: WatchState) -> list[Finding]:
    timed = {r: hb["local_s"] for r, hb in beats.items()
             if hb.get("timed_steps", 0) >= th.straggler_window and not leaving(hb)}
    if len(timed) < 2:
        return []
    med = statistics.median(timed.values())
    out = []
    for r, t in timed.items():
        slow = t > th.straggler_k * med and t - med > th.straggler_min_s
        if slow and r not in st.straggling:
            st.straggling.add(r)
            hb = beats[r]
            out.append(_finding(
                "straggler", hb,
                f"local work (data phase) takes {t:.3f}s per step vs a median of {med:.3f}s over ranks "
                f"({t / max(med, 1e-9):.1f}x > k={th.straggler_k:g}): slow device, throttling, a noisy "
                "neighbour or slow data loading", local_s=t, median_local_s=med, step_s=hb.get("step_s")))
        elif not slow:
            st.straggling.discard(r)
    return out


def _frozen(hb: dict[str, Any], probe: str | None, now: float, th: Thresholds) -> str | None:
    """Why this rank's process cannot be moving (stopped, heartbeat silent), or None."""
    if probe == STOPPED:
        return (f"process is stopped (SIGSTOP, a debugger or a freezer cgroup); its heartbeat thread stopped "
                f"{now - float(hb['beat']):.0f}s ago")
    if now - float(hb["beat"]) > th.stale_s:
        return (f"heartbeat thread silent for {now - float(hb['beat']):.0f}s: process frozen, node lost or "
                "filesystem stalled")
    return None


def last_motion(hb: dict[str, Any]) -> float:
    """When the rank last showed any motion: a phase, a tick, CPU use of its training thread, a collective issued."""
    colls = hb.get("colls") or {}
    return max([last_move(hb), float(hb.get("busy") or 0.0)] + [float(e.get("since", 0.0)) for e in colls.values()])


def still_bound(hb: dict[str, Any], th: Thresholds) -> float:
    """How long an alive rank may show no motion while its peers wait for it: ``collective_s`` once steps are
    timed (a step, a save, an evaluation), ``hang_s`` at start-up and in the first step."""
    timed = int(hb.get("timed_steps", 0)) >= 2
    if timed and hb.get("phase") in (*STEP_PHASES, *TICKING_PHASES):
        return th.collective_s
    return max(th.collective_s, th.hang_s)


def _waits_in(hb: dict[str, Any]) -> str:
    cur = hb.get("coll_in")
    if cur:
        return f"the {cur.get('what')} of step {hb.get('step')}"
    return f"the {COLLECTIVE_OF.get(str(hb.get('phase')), str(hb.get('phase')))} of step {hb.get('step')}"


@dataclass(frozen=True)
class GroupWait:
    """On one process group: the members that entered collective #``seq`` (``leaders``, the first at ``t0``)
    and those that have not (``laggards``)."""

    t0: float
    group: str
    seq: int
    leaders: list[int]
    laggards: list[int]


def collective_waits(beats: dict[int, dict[str, Any]]
                     ) -> tuple[list[GroupWait], set[int], dict[str, dict[int, int]], dict[str, list[int]]]:
    """Every group whose members are not all at the same count, oldest wait first; the ranks that lead one
    (waiting); each group's counts and members. Groups a member does not report (gone, leaving, not yet
    beating with it) are left out: nothing to compare."""
    seqs: dict[str, dict[int, int]] = {}
    since: dict[str, dict[int, float]] = {}
    members: dict[str, list[int]] = {}
    for r, hb in beats.items():
        for name, e in (hb.get("colls") or {}).items():
            members.setdefault(name, decode_members(e))
            seqs.setdefault(name, {})[r] = int(e["seq"])
            since.setdefault(name, {})[r] = float(e["since"])
    waits: list[GroupWait] = []
    waiting: set[int] = set()
    for name, ranks in members.items():
        if len(ranks) < 2 or any(m not in seqs[name] for m in ranks):
            continue
        top = max(seqs[name][m] for m in ranks)
        leaders = [m for m in ranks if seqs[name][m] == top]
        laggards = [m for m in ranks if seqs[name][m] < top]
        if laggards:
            waits.append(GroupWait(min(since[name][m] for m in leaders), name, top, leaders, laggards))
            waiting.update(leaders)
    waits.sort(key=lambda w: (w.t0, w.group))
    return waits, waiting, seqs, members


def collective_findings(beats: dict[int, dict[str, Any]], probes: dict[int, str | None], now: float,
                        th: Thresholds) -> list[Finding]:
    """The collective rule (module doc): ``hang`` findings for the ranks that did not enter a collective their
    peers entered ``collective_s`` ago and are frozen or still; [] when none (or the rule is off)."""
    if th.collective_s <= 0:
        return []
    waits, waiting, seqs, members = collective_waits(beats)
    # Per culprit, every group where it lags and its peers have waited long enough: the earliest names it.
    due: dict[int, list[tuple[float, str, int, list[int]]]] = {}
    for w in waits:
        if now - w.t0 < th.collective_s:
            continue
        for y in w.laggards:
            due.setdefault(y, []).append((w.t0, w.group, w.seq, w.leaders))
    culprits: dict[int, str] = {}
    for y in sorted(due):
        hb = beats[y]
        why = _frozen(hb, probes.get(y), now, th)
        if why is None:
            still = now - last_motion(hb)
            # Inside a collective or a pipeline transfer of its own (``coll_in``), it waits for another rank too.
            if y in waiting or hb.get("coll_in") or still < still_bound(hb, th):
                continue  # it works, or it waits for another rank itself: the chain goes on from there
            why = (f"alive but still for {still:.0f}s (no phase change, liveness tick, CPU use of its training "
                   f"thread or collective issued): blocked in local work (I/O, a lock, a sleep) before the "
                   "collective")
        culprits[y] = why
    out: list[Finding] = []
    for y, why in culprits.items():
        hb, groups = beats[y], due[y]
        t0, name, top, leaders = groups[0]
        direct = sorted({r for g in groups for r in g[3]})
        lead = beats[leaders[0]]
        who = f"rank {y} (node {hb.get('node', '?')}, pid {hb.get('pid', '?')})"
        span = f"{len(members[name])} ranks" if len(members[name]) > 3 else \
            f"ranks {', '.join(map(str, members[name]))}"
        more = "".join(f"; also #{g[2]} on group {g[1]}, entered by rank(s) {', '.join(map(str, g[3]))}"
                       for g in groups[1:])
        cause = (f"{who} did not reach collective #{top} on process group {name} ({span}), which rank(s) "
                 f"{', '.join(map(str, leaders))} entered {now - t0:.1f}s ago and wait in ({_waits_in(lead)}){more}; "
                 f"it issued #{seqs[name][y]} and is in {hb.get('phase')} of step {hb.get('step')}; {why}")
        states = {str(r): f"step {b.get('step')} {b.get('phase')}" for r, b in beats.items()}
        # Waiting: the ranks inside a collective some member has not entered (directly on the culprit, or on a
        # rank that waits for it); the rest of the job is named in ``states``.
        blocked = sorted((waiting | set(direct)) - set(culprits))
        out.append(_finding("hang", hb, cause, detector="collective", group=name, seq=top, waiting=blocked,
                            waiting_direct=direct, waiting_since=round(t0, 3), waiting_in=_waits_in(lead),
                            stalled_ranks=sorted(set(blocked) | {y}), states=states,
                            stalled_s=round(now - t0, 1), bound_s=th.collective_s,
                            bound_phase=bound_phase(hb, th), pid=hb.get("pid"), coll_seq=hb.get("coll_seq")))
    return out


def assess(beats: dict[int, dict[str, Any]], probes: dict[int, str | None], now: float, th: Thresholds,
           st: WatchState) -> list[Finding]:
    """New findings for this snapshot; ``st`` remembers what was reported."""
    out = _dead(beats, probes, st)
    if st.dead_primary is not None or st.hang:
        return out
    live = {r: hb for r, hb in beats.items() if not leaving(hb) and probes.get(r) != GONE}
    for r, hb in live.items():
        if probes.get(r) is None and now - hb["beat"] > th.stale_s and r not in st.unresponsive:
            st.unresponsive.add(r)
            out.append(_finding("unresponsive", hb, f"heartbeat silent for {now - hb['beat']:.0f}s on another host: "
                                "process frozen, node lost or filesystem stalled"))
    coll = collective_findings(live, probes, now, th)
    if coll:  # named by collective progress, whatever the step time
        st.hang = True
        return out + coll
    stalled = sorted(r for r, hb in live.items() if now - last_move(hb) > hang_bound(hb, th))
    # A job is hung when no rank moves: a rank still crawling (throttled, writing a large save) keeps
    # its waiting peers from being a false alarm. A frozen rank stops the others within a step.
    if stalled and len(stalled) == len(live):
        st.hang = True
        states = {str(r): f"step {hb.get('step')} {hb.get('phase')}" + (f" #{hb['coll_seq']}" if "coll_seq" in hb
                                                                         else "") for r, hb in live.items()}
        for r, cause in _culprits(live, probes, now, th):
            hb = live[r]
            out.append(_finding("hang", hb, f"{did_not_reach(r, live)}; {cause}", stalled_ranks=stalled,
                                states=states, stalled_s=round(now - last_move(hb), 1),
                                bound_s=round(hang_bound(hb, th), 1), bound_phase=bound_phase(hb, th),
                                pid=hb.get("pid"), coll_seq=hb.get("coll_seq")))
        return out
    return out + _stragglers(live, th, st)


# Order of the phases inside a step: a rank in an earlier phase of the same step is behind.
PHASE_ORDER = {"data": 0, "forward": 1, "backward": 2, "optimizer": 3, "comm": 4, "eval": 5, "checkpoint": 6}


def _position(hb: dict[str, Any]) -> tuple[int, int]:
    return int(hb.get("step", 0)), PHASE_ORDER.get(str(hb.get("phase")), -1)


def did_not_reach(r: int, beats: dict[int, dict[str, Any]]) -> str:
    """``rank R (node N, pid P) did not reach <the collective / step the others wait in>``.

    Behind in issued collectives (``coll_seq``, the world group's count) or in (step, phase): it
    did not reach where the most advanced ranks wait. Level with them: it did not complete it.
    """
    hb = beats[r]
    who = f"rank {r} (node {hb.get('node', '?')}, pid {hb.get('pid', '?')})"
    where = f"it is in {hb.get('phase')} of step {hb.get('step')}"
    others = {q: b for q, b in beats.items() if q != r}
    if not others:
        return f"{who} did not reach the end of its {hb.get('phase')} of step {hb.get('step')}"
    seqs = {q: b.get("coll_seq") for q, b in beats.items()}
    counted = all(isinstance(v, int) for v in seqs.values())

    def what(b: dict[str, Any]) -> str:
        return f"the {COLLECTIVE_OF.get(str(b.get('phase')), str(b.get('phase')))} of step {b.get('step')}"

    if counted and seqs[r] < max(seqs.values()):  # type: ignore[operator,type-var]
        top = max(seqs.values())  # type: ignore[type-var]
        waiters = sorted(q for q, v in seqs.items() if v == top)
        return (f"{who} did not reach collective #{top} ({what(beats[waiters[0]])}) that rank(s) "
                f"{', '.join(map(str, waiters))} wait in; it issued #{seqs[r]} and {where}")
    lead = max(_position(b) for b in others.values())
    if _position(hb) < lead:
        waiters = sorted(q for q, b in others.items() if _position(b) == lead)
        return (f"{who} did not reach {what(beats[waiters[0]])} that rank(s) {', '.join(map(str, waiters))} "
                f"wait in; {where}")
    return f"{who} did not reach the end of {what(hb)}, which every rank entered"
