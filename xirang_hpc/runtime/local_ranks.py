"""N rank processes on this machine: started with a launcher's environment, read, waited for, killed on failure.

For the tools that run a process group themselves instead of through a launcher (the planner's local
check, the benchmarks, the tests' harness). Each rank is a process of a multiprocessing context (``spawn``
by default: a fresh interpreter, as a launcher's rank is) that runs ``target(place, queue, *args)`` with
the variables torch.distributed's launchers set (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``LOCAL_WORLD_SIZE``, ``GROUP_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``) already in its environment.
Ranks are numbered node-major on ``nodes`` virtual nodes named ``vnodeN``, as the local executor makes
them. ``queue`` carries whatever the ranks report to the parent; :meth:`LocalRanks.get` returns the next
report, and a rank that died, or a group past its deadline, has every rank killed and raises.

::

    with LocalRanks(worker, world=4, args=(cfg,), nodes=2) as ranks:
        results = [ranks.get() for _ in range(4)]
    assert ranks.exit_codes == [0, 0, 0, 0]
"""

from __future__ import annotations

import dataclasses
import multiprocessing as mp
import os
import socket
import time
from collections.abc import Callable, Sequence
from multiprocessing.context import BaseContext
from multiprocessing.process import BaseProcess
from types import TracebackType
from typing import Any

from xirang_hpc.runtime.topology import Topology

__all__ = ["LocalRanks", "RankFailed", "RankPlace", "free_port", "join_ranks"]


class RankFailed(RuntimeError):
    """A rank exited with a non-zero code (or every rank exited with a report still awaited)."""


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on right now (for the rendezvous of one local group)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


@dataclasses.dataclass(frozen=True)
class RankPlace:
    """Where one rank sits in a local group: its rank, the group's size and nodes, the rendezvous address."""

    rank: int
    world_size: int
    nodes: int = 1
    master_addr: str = "127.0.0.1"
    master_port: int = 29500

    @property
    def per_node(self) -> int:
        """Ranks per virtual node."""
        return self.world_size // self.nodes

    @property
    def local_rank(self) -> int:
        """This rank's index on its node."""
        return self.rank % self.per_node

    @property
    def node_id(self) -> int:
        """This rank's virtual node (node-major numbering)."""
        return self.rank // self.per_node

    def env(self) -> dict[str, str]:
        """The variables a torch.distributed launcher gives this rank."""
        return {"RANK": str(self.rank), "WORLD_SIZE": str(self.world_size), "LOCAL_RANK": str(self.local_rank),
                "LOCAL_WORLD_SIZE": str(self.per_node), "GROUP_RANK": str(self.node_id),
                "MASTER_ADDR": self.master_addr, "MASTER_PORT": str(self.master_port)}

    def topology(self, job_id: str = "local-ranks") -> Topology:
        """This rank's :class:`Topology`, as the local executor's virtual nodes give it."""
        return Topology(rank=self.rank, world_size=self.world_size, local_rank=self.local_rank,
                        local_world_size=self.per_node, node_id=self.node_id, num_nodes=self.nodes,
                        node_name=f"vnode{self.node_id}", master_addr=self.master_addr,
                        master_port=self.master_port, job_id=job_id, source="local")

    def init_process_group(self, backend: str = "gloo", **kwargs: Any) -> None:
        """Join the group's default process group (TCP rendezvous at the master address)."""
        import torch.distributed as dist

        dist.init_process_group(backend, init_method=f"tcp://{self.master_addr}:{self.master_port}",
                                rank=self.rank, world_size=self.world_size, **kwargs)


def _rank_main(place: RankPlace, target: Callable[..., Any], args: tuple[Any, ...]) -> None:
    """Child side: the launcher's variables in the environment, then the target."""
    os.environ.update(place.env())
    target(place, *args)


def join_ranks(procs: Sequence[BaseProcess], timeout_s: float | None = 300) -> list[int | None]:
    """Wait for every started process, ``timeout_s`` in all (None: no limit), then kill any still alive;
    their exit codes (None for one that was still running)."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    for p in procs:
        p.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
    codes = [p.exitcode for p in procs]
    kill_ranks(procs)
    return codes


def kill_ranks(procs: Sequence[BaseProcess]) -> None:
    """SIGKILL every process still alive, and reap it."""
    for p in procs:
        if p.is_alive():
            p.kill()
    for p in procs:
        if p.pid is not None:
            p.join(5)


class LocalRanks:
    """``world`` rank processes of ``target(place, queue, *args)``; a context manager (starts on enter).

    ``nodes``: virtual nodes (``world`` must divide evenly). ``ctx``: the multiprocessing context (default
    ``spawn``; the tests pass their fork-server context). ``timeout_s``: the deadline of the whole group,
    a safety net against a hang (None: none); with ``per_report`` it runs again from each report, so a group
    that reports as it goes is stopped when it stops reporting, however long it runs in all. On leaving the
    block the ranks are waited for (``join_s``), and killed when the block raised or they outlived it;
    :attr:`exit_codes` has their codes then.
    """

    def __init__(self, target: Callable[..., Any], world: int, args: Sequence[Any] = (), *, nodes: int = 1,
                 ctx: BaseContext | None = None, master_port: int | None = None, timeout_s: float | None = None,
                 join_s: float = 60, per_report: bool = False) -> None:
        if world < 1 or nodes < 1 or world % nodes:
            raise ValueError(f"world={world} ranks do not split evenly over nodes={nodes}")
        self.ctx: Any = ctx or mp.get_context("spawn")
        self.queue = self.ctx.SimpleQueue()
        port = master_port or free_port()
        self.places = [RankPlace(r, world, nodes, master_port=port) for r in range(world)]
        self.procs: list[BaseProcess] = [
            self.ctx.Process(target=_rank_main, args=(pl, target, (self.queue, *args))) for pl in self.places]
        self.timeout_s, self.join_s, self.per_report = timeout_s, join_s, per_report
        self.deadline: float | None = None
        self.exit_codes: list[int | None] = []

    def start(self) -> LocalRanks:
        """Start every rank (the group's deadline runs from here)."""
        self.deadline = None if self.timeout_s is None else time.monotonic() + self.timeout_s
        for p in self.procs:
            p.start()
        return self

    def __enter__(self) -> LocalRanks:
        return self.start()

    def get(self, poll_s: float = 0.05) -> Any:
        """The next report on the queue; raises :class:`RankFailed` when a rank died (after the reports
        it sent were read) and TimeoutError past the deadline, having killed every rank."""
        while self.queue.empty():
            codes = [p.exitcode for p in self.procs]
            failed = [(r, c) for r, c in enumerate(codes) if c not in (None, 0)]
            if failed or all(c is not None for c in codes):
                if not self.queue.empty():  # a report that came in with the exit
                    break
                kill_ranks(self.procs)
                what = ", ".join(f"rank {r} exit code {c}" for r, c in failed) or "every rank exited"
                raise RankFailed(f"{what} (exit codes {codes})")
            if self.deadline is not None and time.monotonic() > self.deadline:
                kill_ranks(self.procs)
                since = "without a report" if self.per_report else "still running"
                raise TimeoutError(f"{len(self.procs)} ranks {since} after {self.timeout_s} s: killed")
            time.sleep(poll_s)
        report = self.queue.get()
        if self.per_report and self.timeout_s is not None:
            self.deadline = time.monotonic() + self.timeout_s
        return report

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if exc_type is not None:
            kill_ranks(self.procs)
        self.exit_codes = join_ranks(self.procs, self.join_s)
