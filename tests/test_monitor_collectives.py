"""The collective rule of the watchdog (monitor/detect.py ``collective_findings``) and the heartbeat fields it
reads (``colls``, ``coll_in``, ``busy``), without processes: heartbeats as the monitor writes them, a real
thread that computes or sleeps for the CPU sampling, the config's refusal of a bad bound."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from xirang_hpc.config.errors import ConfigError
from xirang_hpc.config.schema import MonitorConfig
from xirang_hpc.monitor.detect import ALIVE, STOPPED, Thresholds, WatchState, assess, collective_findings
from xirang_hpc.monitor.heartbeat import Heartbeat, decode_members, encode_members, read_json
from xirang_hpc.runtime import liveness
from xirang_hpc.runtime.testpoint import ALL_RANKS, parse_slow, slow_phase

NOW = 10_000.0
TH = Thresholds(hang_s=300, stale_s=10, hang_k=20, hang_min_s=10, collective_s=10)
TIMED = {"step_s": 60.0, "timed_steps": 3, "local_s": 0.01}


def beat(rank: int, seq: int, since: float, phase: str = "backward", step: int = 7, **kw: object) -> dict:
    """A heartbeat of a 4-rank job with one world group, as Heartbeat.snapshot writes it."""
    row = {"rank": rank, "node": f"n{rank // 2}", "pid": 100 + rank, "step": step, "phase": phase,
           "progress": since, "beat": NOW - 0.3, "busy": since,
           "colls": {"0": {"seq": seq, "since": since, **encode_members([0, 1, 2, 3])}}, **TIMED}
    row.update(kw)
    return row


def waiting_on_3(wait_s: float, still_s: float = 40, **r3: object) -> dict[int, dict]:
    """Ranks 0-2 entered collective #58 ``wait_s`` ago; rank 3 is at #57, in forward, still for ``still_s``."""
    beats = {r: beat(r, 58, NOW - wait_s, coll_in={"what": "grad-norm / loss all-reduce", "since": NOW - wait_s})
             for r in range(3)}
    beats[3] = beat(3, 57, NOW - still_s, phase="forward", **r3)
    return beats


def test_members_round_trip_compactly() -> None:
    assert encode_members(list(range(0, 4096, 2))) == {"span": [0, 4096, 2]}
    assert encode_members([0, 1, 5]) == {"ranks": [0, 1, 5]}
    for ranks in ([3, 7], list(range(16)), [0, 2, 3], [5]):
        assert decode_members(encode_members(ranks)) == ranks


def test_stopped_rank_is_named_collective_s_after_its_peers_entered_whatever_the_step_time() -> None:
    probes = {0: ALIVE, 1: ALIVE, 2: ALIVE, 3: STOPPED}
    assert collective_findings(waiting_on_3(9.5), probes, NOW, TH) == []  # not yet: 9.5 s < 10 s
    fs = collective_findings(waiting_on_3(10.5), probes, NOW, TH)
    assert [(f.kind, f.rank, f.node) for f in fs] == [("hang", 3, "n1")]
    f = fs[0]
    assert f.cause.startswith("rank 3 (node n1, pid 103) did not reach collective #58 on process group 0 (4 ranks)")
    assert "rank(s) 0, 1, 2 entered 10.5s ago" in f.cause and "grad-norm / loss all-reduce" in f.cause
    assert "it issued #57" in f.cause and "process is stopped" in f.cause
    assert f.extra["waiting"] == [0, 1, 2] and f.extra["detector"] == "collective" and f.extra["bound_s"] == 10
    # Steps of 60 s: the step-multiple bound would be 300 s; assess names it now, through the collective rule.
    st = WatchState()
    assert [(x.kind, x.rank) for x in assess(waiting_on_3(10.5), probes, NOW, TH, st)] == [("hang", 3)] and st.hang
    # Off (0): only the step-multiple rule, which at these step times waits far longer.
    off = Thresholds(hang_s=300, stale_s=10, hang_k=20, hang_min_s=10, collective_s=0)
    assert assess(waiting_on_3(10.5), probes, NOW, off, WatchState()) == []


def test_a_silent_heartbeat_on_another_host_is_frozen_too() -> None:
    probes = {r: None for r in range(4)}  # every rank elsewhere: only the heartbeats speak
    # Rank 3 beats and computes (its peers cannot tell a long step from a hang, and need not)...
    assert collective_findings(waiting_on_3(12, beat=NOW - 0.5, busy=NOW - 1), probes, NOW, TH) == []
    # ... then its heartbeat stops with everything else in it (SIGSTOP on another host, a lost node).
    fs = collective_findings(waiting_on_3(12, beat=NOW - 11, busy=NOW - 11.5), probes, NOW, TH)
    assert [f.rank for f in fs] == [3] and "heartbeat thread silent for 11s" in fs[0].cause


def test_a_rank_that_moves_is_never_named_however_long_its_peers_wait() -> None:
    probes = {r: ALIVE for r in range(4)}
    # Computing (its training thread used the CPU a moment ago), 50 s behind its peers: a straggler, no hang.
    assert collective_findings(waiting_on_3(50, busy=NOW - 0.5), probes, NOW, TH) == []
    # Crawling through phases (a new one 6 s ago), or ticking (a save that writes), or issuing other collectives.
    assert collective_findings(waiting_on_3(50, progress=NOW - 6, busy=NOW - 30), probes, NOW, TH) == []
    assert collective_findings(waiting_on_3(50, busy=NOW - 30, active=NOW - 2), probes, NOW, TH) == []
    # Still for 30 s (no phase, tick, CPU or collective) in a timed step: blocked in local work -> named.
    fs = collective_findings(waiting_on_3(50, busy=NOW - 30), probes, NOW, TH)
    assert [f.rank for f in fs] == [3] and "alive but still for 30s" in fs[0].cause


def test_start_up_and_the_first_step_give_a_still_rank_hang_s() -> None:
    # Before two steps are timed a rank may wait without CPU (compilation workers, storage): hang_s applies to
    # a still rank there; a stopped one is named after collective_s all the same.
    untimed = {"timed_steps": 0, "step_s": None}
    probes = {r: ALIVE for r in range(4)}
    assert collective_findings(waiting_on_3(50, busy=NOW - 40, **untimed), probes, NOW, TH) == []
    fs = collective_findings(waiting_on_3(310, still_s=305, **untimed), probes, NOW, TH)
    assert [f.rank for f in fs] == [3]
    fs = collective_findings(waiting_on_3(11, **untimed), {**probes, 3: STOPPED}, NOW, TH)
    assert [f.rank for f in fs] == [3] and fs[0].extra["bound_phase"] == "first-step"


def test_the_chain_is_followed_to_the_rank_nobody_waits_for() -> None:
    # Ranks 0, 1 wait in world #58 for 2 and 3; 2 and 3 (a pair group "1") are in #5 of their group, which 3
    # entered and 2 did not: 3 waits for 2 there. 2 is the culprit; 3 is waiting, not named.
    beats = waiting_on_3(20, busy=NOW - 20)
    beats[2] = beat(2, 57, NOW - 40, phase="forward", busy=NOW - 20)
    for r, seq, since in ((2, 4, NOW - 40), (3, 5, NOW - 20)):
        beats[r]["colls"]["1"] = {"seq": seq, "since": since, **encode_members([2, 3])}
    fs = collective_findings(beats, {r: ALIVE for r in range(4)}, NOW, TH)
    assert [f.rank for f in fs] == [2], [f.cause for f in fs]
    # Waiting: 0 and 1 (in world #58), and 3, which lags in world but waits for 2 in their pair group.
    assert fs[0].extra["waiting"] == [0, 1, 3] and fs[0].extra["waiting_direct"] == [0, 1, 3], fs[0].extra
    # A stopped rank is a culprit even where it leads a group (frozen is not waiting).
    fs = collective_findings(beats, {0: ALIVE, 1: ALIVE, 2: ALIVE, 3: STOPPED}, NOW, TH)
    assert sorted(f.rank for f in fs) == [2, 3]


def test_a_rank_blocked_in_a_transfer_of_its_own_waits_and_is_not_named() -> None:
    """Pipeline stages: rank 3 lags in the world group but is blocked in its stage's send/receive with a slow
    neighbour (a wait the groups' counts do not see, marked ``coll_in``): it waits, it is not the hang. Stopped
    there, it is named all the same."""
    probes = {r: ALIVE for r in range(4)}
    waits = waiting_on_3(30, busy=NOW - 30, coll_in={"what": "pipeline stage send/receive", "since": NOW - 25})
    assert collective_findings(waits, probes, NOW, TH) == []
    fs = collective_findings(waits, {**probes, 3: STOPPED}, NOW, TH)
    assert [f.rank for f in fs] == [3] and "process is stopped" in fs[0].cause


def test_pipeline_schedules_mark_their_transfer_waits() -> None:
    """The schedules' wait for a stage's sends and receives runs inside ``liveness.collective``."""
    from torch.distributed.pipelining import schedules

    from xirang_hpc.runtime.pipeline import _mark_stage_waits

    _mark_stage_waits()
    _mark_stage_waits()  # once: not wrapped twice
    seen = []
    wrapped = schedules._wait_batch_p2p
    assert wrapped.marks_liveness
    inner = wrapped.__closure__[0].cell_contents if wrapped.__closure__ else None
    assert not getattr(inner, "marks_liveness", False)
    fake = type("W", (), {"wait": lambda self: seen.append(liveness.inside())})
    wrapped([fake()])
    assert seen and seen[0][0] == "pipeline stage send/receive" and liveness.inside() is None


def test_a_member_not_reporting_the_group_is_no_evidence() -> None:
    beats = waiting_on_3(50)
    del beats[3]["colls"]
    assert collective_findings(beats, {0: ALIVE, 1: ALIVE, 2: ALIVE, 3: STOPPED}, NOW, TH) == []


def test_heartbeat_records_entry_exit_and_cpu_use_of_the_training_thread(tmp_path: Path) -> None:
    seq = {"n": 5}
    results: dict[str, dict] = {}

    def train() -> None:  # a real thread: the heartbeat samples *its* CPU clock
        hb = Heartbeat(tmp_path / "rank-0.json", {"rank": 0}, interval_s=0.05,
                       progress_fn=lambda: {"0": (seq["n"], [0, 1, 2, 3])}, inside_fn=liveness.inside)
        hb.write()
        t_end = time.time() + 0.3
        while time.time() < t_end:  # computing
            sum(i * i for i in range(2000))
        hb.write()
        results["busy"] = read_json(hb.path)
        time.sleep(0.4)  # asleep: no CPU
        hb.write()
        results["asleep"] = read_json(hb.path)
        seq["n"] = 6
        with liveness.collective("grad-norm / loss all-reduce"):
            hb.write()
            results["inside"] = read_json(hb.path)
        hb.write()
        results["outside"] = read_json(hb.path)

    t = threading.Thread(target=train)
    t.start()
    t.join()
    busy, asleep, inside, outside = (results[k] for k in ("busy", "asleep", "inside", "outside"))
    assert busy["busy"] >= busy["beat"] - 0.01  # seen computing at the last sample
    assert asleep["busy"] == busy["busy"] and asleep["beat"] - asleep["busy"] >= 0.35  # no CPU while asleep
    assert busy["colls"]["0"] == {"seq": 5, "since": busy["colls"]["0"]["since"], "span": [0, 4, 1]}
    assert inside["colls"]["0"]["seq"] == 6 and inside["colls"]["0"]["since"] > asleep["beat"]  # entered anew
    assert inside["coll_in"]["what"] == "grad-norm / loss all-reduce" and "coll_in" not in outside  # exited
    assert outside["colls"]["0"]["since"] == inside["colls"]["0"]["since"]  # no new collective since


def test_collective_timeout_is_checked_by_name() -> None:
    assert MonitorConfig().collective_timeout_s == 10.0
    MonitorConfig(collective_timeout_s=0)  # off
    for bad in (-1.0, 1.0):  # negative; under 2 x heartbeat_s (the sampling of entries)
        with pytest.raises(ConfigError, match="monitor.collective_timeout_s"):
            MonitorConfig(collective_timeout_s=bad)


def test_slow_step_on_every_rank() -> None:
    spec = "rank=all,s=0.01,phases=forward"
    assert parse_slow(spec).rank == ALL_RANKS
    env = {"XIRANG_TESTPOINT_SLOW": spec}
    assert all(slow_phase(r, "forward", 3, env) == 0.01 for r in (0, 5)) and slow_phase(0, "data", 3, env) == 0


def test_groups_the_job_counts_itself_are_counted_at_entry() -> None:
    # The hierarchical all-reduce's node barrier is shared memory, invisible to c10d: it counts itself.
    name = f"shm-test-{time.monotonic_ns()}"
    assert name not in liveness.counts()
    for n in (1, 2):
        with liveness.collective("node shared-memory barrier", group=name, ranks=[2, 3]):
            assert liveness.counts()[name] == (n, [2, 3])  # entered: counted before the wait
            assert liveness.inside()[0] == "node shared-memory barrier"
    assert liveness.inside() is None and liveness.counts()[name] == (2, [2, 3])
