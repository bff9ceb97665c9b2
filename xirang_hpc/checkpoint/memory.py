"""Recovery from memory: each rank's newest checkpoint shard in node-local tmpfs, plus a replica on another node.

With ``checkpoint.in_memory=true`` every save (and every ``checkpoint.memory_every_steps`` steps, which
may be more often than the filesystem checkpoint) also lands in host memory that outlives the
training processes but not the job (Gemini, SOSP'23)::

    /dev/shm/xirang-<user>-<jobid>/        0700, removed at job end (the in-job driver, the last fit end)
      <node>/step_N/                       one per node: what the ranks of that node hold
        rank_<i>.h5, rank_<i>.json         bundle i: rank i's DCP shard and its RNG JSON (same format as disk)
        metadata.json, state.json          part of bundle 0 (the DCP metadata, the run state)
        bundle_<i>.json                    written last: step, world size, size + xxh3-128 of each file

Rank ``i`` writes its bundle into its own node's directory (its *primary*) and sends it over the
checkpoint process group to ``replica_partners(...)[i]``, a rank of the next node, which writes it
into *its* node's directory. A single lost node therefore leaves every bundle on a surviving node.

On the restart (new processes, a new process group, maybe fewer nodes) each rank reports what its
own node's directory holds; the ranks agree on the newest step whose bundles are all somewhere
(:func:`decide`), move every bundle a node lacks over the process group (never by reading another
node's directory: on a real cluster it is another machine) and load it with the ordinary HDF5
reader, which reshards to any layout. The filesystem checkpoint is used instead when the memory
copy is incomplete, older than the newest filesystem step, or fails its checksum.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import xxhash

from xirang_hpc.checkpoint.collectives import GroupCollectives
from xirang_hpc.checkpoint.integrity import METADATA_FILE, checksum_file
from xirang_hpc.checkpoint.storage import HDF5StorageWriter
from xirang_hpc.files import write_bytes_atomic

log = logging.getLogger(__name__)

STATE = "state.json"  # same name as checkpoint.layout.STATE (layout imports storage only; kept local)
BUNDLE = "bundle_{}.json"
CHECKSUM = "xxh3_128"


# ---- where the replicas go (pure) ------------------------------------------------------------

def replica_partners(nodes: list[str]) -> list[int | None]:
    """For each rank (``nodes[i]`` = its node), the rank on the next node that holds its replica.

    Nodes are taken in order of first appearance; rank ``i``, the k-th rank of its node, sends to the
    (k mod n)-th rank of the next node (n = that node's ranks), so partners spread over the next
    node's ranks. One node only: None (memory copies survive dead processes, not a lost node).
    """
    order = list(dict.fromkeys(nodes))
    if len(order) < 2:
        return [None] * len(nodes)
    members = {n: [r for r, m in enumerate(nodes) if m == n] for n in order}
    out: list[int | None] = []
    for r, n in enumerate(nodes):
        k = members[n].index(r)
        nxt = members[order[(order.index(n) + 1) % len(order)]]
        out.append(nxt[k % len(nxt)])
    return out


def holders(nodes: list[str], partners: list[int | None]) -> dict[int, set[str]]:
    """Bundle (old rank) -> the nodes whose memory holds it (its own, its partner's)."""
    return {r: {nodes[r]} | ({nodes[p]} if p is not None else set()) for r, p in enumerate(partners)}


# ---- which source a restart uses (pure) ------------------------------------------------------

@dataclass
class Decision:
    """The outcome of :func:`decide`: a memory step and where each bundle is, or why not."""

    step: int | None
    world_size: int = 0
    sources: dict[int, list[int]] = field(default_factory=dict)  # bundle -> new ranks whose node holds it
    reason: str = ""


def decide(reports: list[dict[str, Any]], fs_step: int | None) -> Decision:
    """Pick the newest complete memory step, or say why the filesystem checkpoint is used.

    ``reports[r]`` is new rank r's view of its own node: ``{"node": name, "steps": {step: {bundle:
    manifest}}}``. A step is complete when each of its ``world_size`` bundles is held by some node;
    it is used only when not older than ``fs_step`` (the newest committed filesystem checkpoint).
    """
    by_step: dict[int, dict[int, list[int]]] = {}
    sizes: dict[int, int] = {}
    for r, rep in enumerate(reports):
        for step, bundles in rep.get("steps", {}).items():
            for b, man in bundles.items():
                by_step.setdefault(int(step), {}).setdefault(int(b), []).append(r)
                sizes[int(step)] = int(man["world_size"])
    if not by_step:
        return Decision(None, reason="no memory copy on the nodes of this attempt")
    incomplete = []
    for step in sorted(by_step, reverse=True):
        missing = sorted(set(range(sizes[step])) - set(by_step[step]))
        if missing:
            incomplete.append(f"step {step} lacks the shards of ranks {missing}")
            continue
        if fs_step is not None and step < fs_step:
            return Decision(None, reason=f"memory copy (step {step}) is older than the filesystem checkpoint "
                            f"(step {fs_step})" + (f"; {'; '.join(incomplete)}" if incomplete else ""))
        return Decision(step, sizes[step], {b: sorted(rs) for b, rs in sorted(by_step[step].items())})
    return Decision(None, reason="memory copy incomplete: " + "; ".join(incomplete))


def transfers(decision: Decision, nodes: list[str]) -> list[tuple[int, int, int]]:
    """``(bundle, source rank, destination rank)`` moves so every node of ``nodes`` holds every bundle.

    One receiver per node (its lowest rank) writes the bundle into the node's directory; the source
    is the lowest rank holding it.
    """
    node_ranks: dict[str, list[int]] = {}
    for r, n in enumerate(nodes):
        node_ranks.setdefault(n, []).append(r)
    out = []
    for b, src in sorted(decision.sources.items()):
        have = {nodes[r] for r in src}
        for n, ranks in node_ranks.items():
            if n not in have:
                out.append((b, src[0], ranks[0]))
    return out


# ---- the store -----------------------------------------------------------------------------

def _entry_of(data: memoryview | bytes) -> dict[str, Any]:
    return {"bytes": len(data), CHECKSUM: xxhash.xxh3_128(data).hexdigest()}


@dataclass
class MemoryRecord:
    """One memory save: this rank's bundle bytes, the replica bytes it received, seconds in the background."""

    step: int
    bytes: int = 0
    replica_bytes: int = 0
    seconds: float = 0.0


@dataclass
class Prepared:
    """A memory step ready to load: this node's directory now holds every bundle."""

    step: int
    path: Path
    checksums: dict[str, dict[str, Any]]
    local_bytes: int
    received_bytes: int
    world_size: int


class MemoryStore(GroupCollectives):
    """This rank's side of the in-memory checkpoint (see the module docstring)."""

    def __init__(self, root: Path, *, node: str, rank: int = 0, world_size: int = 1, group: Any = None,
                 clock: Callable[[], float] | None = None) -> None:
        self.root, self.node, self.rank, self.world_size, self.group = Path(root), node, rank, world_size, group
        self.clock = clock or time.perf_counter
        self.dir = self.root / node
        for d in (self.root, self.dir):
            d.mkdir(parents=True, exist_ok=True)
            os.chmod(d, 0o700)
        self.nodes: list[str] = self._gather(node)
        self.partners = replica_partners(self.nodes)

    # ---- collectives on the checkpoint group --------------------------------------------
    def _global(self, r: int) -> int:
        return dist.get_global_rank(self.group, r) if self.group is not None else r

    def _exchange(self, sends: list[tuple[int, int, torch.Tensor]],
                  recvs: list[tuple[int, int, int]]) -> list[torch.Tensor]:
        """Post every send ``(dst, tag, tensor)`` and receive ``(src, tag, nbytes)``; returns the received tensors."""
        work, out = [], []
        for src, tag, n in recvs:
            buf = torch.empty(n, dtype=torch.uint8)
            out.append(buf)
            work.append(dist.irecv(buf, src=self._global(src), group=self.group, tag=tag))
        for dst, tag, t in sends:
            work.append(dist.isend(t, dst=self._global(dst), group=self.group, tag=tag))
        for w in work:
            w.wait()
        return out

    # ---- save ---------------------------------------------------------------------------
    def step_dir(self, step: int) -> Path:
        """This node's directory for ``step``."""
        return self.dir / f"step_{step}"

    def _payload(self, d: Path, manifest: dict[str, Any]) -> torch.Tensor:
        """A bundle's files, concatenated in manifest order, as one uint8 tensor."""
        buf = bytearray(sum(e["bytes"] for e in manifest["files"].values()))
        view, off = memoryview(buf), 0
        for name, e in manifest["files"].items():
            with open(d / name, "rb", buffering=0) as f:
                n = f.readinto(view[off: off + e["bytes"]])
            if n != e["bytes"]:
                raise OSError(f"{d / name}: {n} bytes, expected {e['bytes']}")
            off += n
        return torch.frombuffer(buf, dtype=torch.uint8) if buf else torch.empty(0, dtype=torch.uint8)

    def _unpack(self, d: Path, manifest: dict[str, Any], data: torch.Tensor) -> None:
        """Write a received bundle into this node's ``d`` (checksummed), then its manifest."""
        view, off = memoryview(data.numpy()), 0
        for name, e in manifest["files"].items():
            part = view[off: off + e["bytes"]]
            got = _entry_of(part)
            if got != {"bytes": e["bytes"], CHECKSUM: e[CHECKSUM]}:
                raise OSError(f"bundle {manifest['bundle']} file {name}: received bytes fail their checksum")
            write_bytes_atomic(d / name, part)
            off += e["bytes"]
        write_bytes_atomic(d / BUNDLE.format(manifest["bundle"]), json.dumps(manifest).encode())

    def save(self, step: int, snap: dict[str, Any], state: dict[str, Any], rank_state: dict[str, Any]) -> MemoryRecord:
        """Write this rank's bundle into its node's memory and a replica to its partner (collective).

        A local failure (tmpfs full) on any rank is shared before the exchange, so every rank skips it
        together and the previous memory step stays; the error is raised on every rank.
        """
        t0 = self.clock()
        d = self.step_dir(step)
        d.mkdir(exist_ok=True)
        writer = HDF5StorageWriter(d, fsync=False)
        dcp.save(snap, storage_writer=writer, process_group=self.group)
        problem = None
        manifest: dict[str, Any] = {}
        try:
            files: dict[str, Any] = dict(writer.file_entries)
            own = f"rank_{self.rank}.json"
            write_bytes_atomic(d / own, json.dumps(rank_state).encode())
            files[own] = {"bytes": (d / own).stat().st_size, CHECKSUM: checksum_file(d / own)}
            if self.rank == 0:
                write_bytes_atomic(d / STATE, json.dumps(state).encode())
                for name in (METADATA_FILE, STATE):
                    files[name] = {"bytes": (d / name).stat().st_size, CHECKSUM: checksum_file(d / name)}
            manifest = {"step": step, "bundle": self.rank, "world_size": self.world_size, "node": self.node,
                        "files": files}
        except OSError as exc:
            problem = f"rank {self.rank} on {self.node}: {exc}"
        manifests = self._gather((manifest, problem))
        bad = [p for _, p in manifests if p]
        if bad:
            raise OSError(f"in-memory checkpoint step {step} not kept: {'; '.join(bad)}")
        rec = MemoryRecord(step, bytes=sum(e["bytes"] for e in manifest["files"].values()))
        partner = self.partners[self.rank]
        senders = [r for r, p in enumerate(self.partners) if p == self.rank]
        sends = [(partner, self.rank, self._payload(d, manifest))] if partner is not None else []
        recvs = [(r, r, sum(e["bytes"] for e in manifests[r][0]["files"].values())) for r in senders]
        got = self._exchange(sends, recvs) if self._distributed() else []
        for r, data in zip(senders, got):
            self._unpack(d, manifests[r][0], data)
            rec.replica_bytes += data.numel()
        write_bytes_atomic(d / BUNDLE.format(self.rank), json.dumps(manifest).encode())
        self._barrier()  # step N is complete on every node: older steps may go
        for old in self.dir.glob("step_*"):
            # Older steps only: a faster rank of this node may already be writing step N+1 here. (Stale
            # copies from before a restart are removed by prune() after the restore.)
            n = old.name.removeprefix("step_")
            if n.isdigit() and int(n) < step:
                shutil.rmtree(old, ignore_errors=True)
        rec.seconds = self.clock() - t0
        return rec

    # ---- restore ------------------------------------------------------------------------
    def report(self) -> dict[str, Any]:
        """What this node's directory holds: ``{"node", "steps": {step: {bundle: manifest}}}``."""
        steps: dict[int, dict[int, Any]] = {}
        for d in self.dir.glob("step_*"):
            try:
                step = int(d.name.removeprefix("step_"))
            except ValueError:
                continue
            for m in d.glob("bundle_*.json"):
                try:
                    man = json.loads(m.read_text())
                    steps.setdefault(step, {})[int(man["bundle"])] = man
                except (OSError, ValueError, KeyError) as exc:
                    log.warning("memory checkpoint: unreadable %s (%s); ignored", m, exc)
        return {"node": self.node, "steps": steps}

    def prepare(self, fs_step: int | None) -> Prepared | str:
        """Make this node's directory hold the newest usable memory step (collective).

        Returns the step to load, or the reason the filesystem is used (the same on every rank).
        """
        reports = self._gather(self.report())
        decision = decide(reports, fs_step)
        if decision.step is None:
            return decision.reason
        step = decision.step
        d = self.step_dir(step)
        moves = transfers(decision, self.nodes)
        mine = reports[self.rank]["steps"].get(step, {})
        sends, recvs, recv_mans = [], [], []
        problem = None
        for b, src, dst in moves:
            man = reports[src]["steps"][step][b]
            if src == self.rank:
                try:
                    sends.append((dst, b, self._payload(d, man)))
                except OSError as exc:
                    problem = f"rank {self.rank}: cannot read bundle {b}: {exc}"
            if dst == self.rank:
                recvs.append((src, b, sum(e["bytes"] for e in man["files"].values())))
                recv_mans.append(man)
        if any(self._gather(problem)):
            return "memory copy unreadable: " + "; ".join(p for p in self._gather(problem) if p)
        received = 0
        try:
            got = self._exchange(sends, recvs) if self._distributed() else []
            d.mkdir(parents=True, exist_ok=True)
            for man, data in zip(recv_mans, got):
                self._unpack(d, man, data)
                received += data.numel()
        except OSError as exc:
            problem = str(exc)
        problems = [p for p in self._gather(problem) if p]
        if problems:
            return "memory copy failed its checksum: " + "; ".join(problems)
        self._barrier()  # every node's directory is complete
        sums: dict[str, dict[str, Any]] = {}
        for b in range(decision.world_size):
            sums.update(json.loads((d / BUNDLE.format(b)).read_text())["files"])
        local = sum(e["bytes"] for b, man in mine.items() for e in man["files"].values())
        return Prepared(step, d, sums, local, received, decision.world_size)

    def prune(self, keep: int | None) -> None:
        """Drop this node's steps other than ``keep`` (after a restore: stale or partial copies must not
        mix with the next save's bundles). Collective: every rank has finished reading first."""
        self._barrier()
        for d in self.dir.glob("step_*"):
            if keep is None or d != self.step_dir(keep):
                shutil.rmtree(d, ignore_errors=True)
        self._barrier()

    def remove_node_dir(self) -> None:
        """Remove this node's memory (after the run finished); the job root once it is empty."""
        shutil.rmtree(self.dir, ignore_errors=True)
        try:
            self.root.rmdir()
        except OSError:
            pass
