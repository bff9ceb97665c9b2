"""The local rank helper (``runtime/local_ranks.py``): a launcher's environment in every rank, the reports read
back, a rank that dies or a group that hangs killed with the cause raised. Ranks from the tests' fork server."""

from __future__ import annotations

import os
import time
from typing import Any

import pytest
from ranks import rank_context

from xirang_hpc.runtime.local_ranks import LocalRanks, RankFailed, RankPlace


def _report(place: RankPlace, queue: Any) -> None:
    keys = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT")
    queue.put((place.rank, {k: os.environ[k] for k in keys}, place.topology("t").node_name))


def _third_dies(place: RankPlace, queue: Any, sleep_s: float) -> None:
    if place.rank == 2:
        os._exit(3)
    time.sleep(sleep_s)  # the others would outlive the test: the helper kills them


def _reports_twice(place: RankPlace, queue: Any) -> None:
    queue.put(place.rank)
    time.sleep(0.2)  # the second report comes after the first has been read (or at least not before it)
    queue.put(place.rank)


def test_a_deadline_per_report_runs_again_from_each_report() -> None:
    """``per_report``: the limit is on silence, not on the group's total time; without it the deadline stays."""
    for per_report in (True, False):
        with LocalRanks(_reports_twice, 1, ctx=rank_context(), timeout_s=600, per_report=per_report) as ranks:
            d0 = ranks.deadline
            ranks.get()
            d1 = ranks.deadline
            ranks.get()
            d2 = ranks.deadline
        assert d0 is not None and d1 is not None and d2 is not None
        assert (d0 < d1 < d2) if per_report else (d0 == d1 == d2), (per_report, d0, d1, d2)


def test_ranks_get_a_launchers_environment_and_their_reports_come_back() -> None:
    with LocalRanks(_report, 4, nodes=2, ctx=rank_context(), timeout_s=120) as ranks:
        got = sorted(ranks.get() for _ in range(4))
    assert ranks.exit_codes == [0, 0, 0, 0]
    port = str(ranks.places[0].master_port)
    assert [(r, e["RANK"], e["WORLD_SIZE"], e["LOCAL_RANK"], e["LOCAL_WORLD_SIZE"], e["GROUP_RANK"], node)
            for r, e, node in got] == [(0, "0", "4", "0", "2", "0", "vnode0"), (1, "1", "4", "1", "2", "0", "vnode0"),
                                       (2, "2", "4", "0", "2", "1", "vnode1"), (3, "3", "4", "1", "2", "1", "vnode1")]
    assert {(e["MASTER_ADDR"], e["MASTER_PORT"]) for _, e, _ in got} == {("127.0.0.1", port)}


def test_a_dead_rank_is_named_and_the_others_are_killed() -> None:
    with pytest.raises(RankFailed, match="rank 2 exit code 3"), \
            LocalRanks(_third_dies, 3, (600,), ctx=rank_context(), timeout_s=120) as ranks:
        ranks.get()
    assert ranks.exit_codes[2] == 3 and all(c not in (None, 0) for c in ranks.exit_codes), ranks.exit_codes
    assert not any(p.is_alive() for p in ranks.procs)


def test_a_group_past_its_deadline_is_killed() -> None:
    t0 = time.monotonic()
    with pytest.raises(TimeoutError), LocalRanks(_third_dies, 2, (600,), ctx=rank_context(), timeout_s=3) as ranks:
        ranks.get()
    assert time.monotonic() - t0 < 120 and not any(p.is_alive() for p in ranks.procs)  # a safety net, not a bound
    with pytest.raises(ValueError, match="split evenly"):
        LocalRanks(_report, 3, nodes=2)
