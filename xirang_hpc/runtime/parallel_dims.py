"""The one object that says how ranks are split: pipeline x data (replicate x shard) x context x tensor.

``ParallelDims`` is validated on construction and builds a named ``DeviceMesh`` with the
dimensions ``("pp", "dp_replicate", "dp_shard", "tp")`` (row-major, tp innermost, as in
torchtitan), and ``("pp", "dp_replicate", "dp_shard", "cp", "tp")`` with context parallelism
(cp > 1): a cp group sits between dp and tp, so with tp it stays as close as the node allows.
The gradient reduction runs over dp x cp together (flattened ``dp_cp``), since each cp rank saw
only part of every sequence; FSDP2 shards over ``dp_shard_cp``.

Placement is topology-aware: the ranks are first sorted by (node, local rank), so
consecutive mesh positions are on the same node. With tp innermost and ``tp`` dividing the
ranks per node, every tp group stays inside a node (the bandwidth-hungry collective on the
fast links) while dp and pp groups span nodes. This holds even when the launcher numbers
ranks cyclically across nodes, because the mesh is built from the gathered (node, local rank)
pairs, not from the global rank numbers.

It is passed explicitly to everything that needs a group; there are no process-group globals.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from xirang_hpc.config.schema import ParallelConfig
from xirang_hpc.config.validate import resolve_zero
from xirang_hpc.runtime.device import CPU, Device
from xirang_hpc.runtime.topology import Topology

log = logging.getLogger(__name__)

MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "tp")
#: The mesh dimensions with context parallelism (cp > 1).
CP_MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")


class LayoutError(ValueError):
    """The parallel layout does not fit the world or the topology."""


@dataclass(frozen=True)
class ParallelDims:
    """Degrees of each kind of parallelism; their product is the world size."""

    pp: int
    dp_replicate: int
    dp_shard: int
    tp: int
    world_size: int
    cp: int = 1  # context parallel: ranks sharing each sequence (mesh dimension only when > 1)
    ep: int = 1  # expert-parallel degree, taken from the dp ranks (not a mesh dimension of its own)

    def __post_init__(self) -> None:
        for name in ("pp", "dp_replicate", "dp_shard", "tp", "cp", "world_size", "ep"):
            if getattr(self, name) < 1:
                raise LayoutError(f"parallel degree {name}={getattr(self, name)} must be >= 1")
        hsdp = self.dp_replicate > 1 and self.dp_shard > 1  # then ep groups must lie inside one shard group
        if self.dp % self.ep or (hsdp and self.dp_shard % self.ep):
            raise LayoutError(f"ep={self.ep} must divide the data-parallel degree dp={self.dp} (and, with "
                              f"replicate groups, dp_shard={self.dp_shard})")
        if self.ep > 1 and self.cp > 1:  # validation refuses both on a MoE model; the mesh has no place for both
            raise LayoutError(f"ep={self.ep} with cp={self.cp}: expert and context parallelism do not combine")
        if self.pp * self.dp * self.cp * self.tp != self.world_size:
            cp = f" x cp={self.cp}" if self.cp > 1 else ""
            raise LayoutError(
                f"pp={self.pp} x dp_replicate={self.dp_replicate} x dp_shard={self.dp_shard}{cp} x tp={self.tp} "
                f"= {self.pp * self.dp * self.cp * self.tp} ranks, but the world has {self.world_size}"
            )

    @classmethod
    def from_config(cls, p: ParallelConfig, world_size: int) -> ParallelDims:
        """Degrees from a validated :class:`ParallelConfig`.

        ``parallel.dp`` is resolved once, by ``config.validate.validate``; an unresolved ``-1`` here
        means the config skipped validation, which would let two places derive dp differently.
        """
        if p.dp < 1:
            raise LayoutError(f"parallel.dp={p.dp} is unresolved; load the config through "
                              "xirang_hpc.config.validate (load_config or validate), which derives it once")
        dp = p.dp
        if resolve_zero(p).data_parallel == "fsdp":  # ZeRO-2/3
            rep = max(1, p.dp_replicate)
            if dp % rep:
                raise LayoutError(f"parallel.dp_replicate={rep} must divide dp={dp}")
            return cls(pp=p.pp, dp_replicate=rep, dp_shard=dp // rep, tp=p.tp, world_size=world_size, cp=p.cp,
                       ep=p.ep)
        return cls(pp=p.pp, dp_replicate=dp, dp_shard=1, tp=p.tp, world_size=world_size, cp=p.cp, ep=p.ep)

    @property
    def dp(self) -> int:
        """Total data-parallel degree (replicas x shards)."""
        return self.dp_replicate * self.dp_shard

    @property
    def dp_cp(self) -> int:
        """Ranks that reduce one gradient together: data-parallel replicas x context-parallel shards."""
        return self.dp * self.cp

    @property
    def dim_names(self) -> tuple[str, ...]:
        """The mesh's dimension names: :data:`MESH_DIMS`, or :data:`CP_MESH_DIMS` with cp > 1."""
        return CP_MESH_DIMS if self.cp > 1 else MESH_DIMS

    @property
    def shape(self) -> tuple[int, ...]:
        """Mesh shape in :attr:`dim_names` order."""
        if self.cp > 1:
            return (self.pp, self.dp_replicate, self.dp_shard, self.cp, self.tp)
        return (self.pp, self.dp_replicate, self.dp_shard, self.tp)

    def coords(self, position: int) -> dict[str, int]:
        """Mesh coordinates of the rank at ``position`` in placement order (``cp`` is 0 without cp)."""
        out = {"cp": 0}
        for name, size in reversed(list(zip(self.dim_names, self.shape))):
            out[name] = position % size
            position //= size
        out["dp"] = out["dp_replicate"] * self.dp_shard + out["dp_shard"]
        return out

    def placement(self, nodes: list[tuple[int, int]]) -> list[int]:
        """Global ranks in mesh order, given ``nodes[rank] = (node_id, local_rank)``.

        Raises :class:`LayoutError` if a tp group would span two nodes.
        """
        if len(nodes) != self.world_size:
            raise LayoutError(f"topology has {len(nodes)} ranks, layout needs {self.world_size}")
        order = sorted(range(len(nodes)), key=lambda r: nodes[r])
        for start in range(0, len(order), self.tp):
            group_nodes = {nodes[r][0] for r in order[start : start + self.tp]}
            if len(group_nodes) > 1:
                raise LayoutError(
                    f"tp={self.tp} group of ranks {order[start : start + self.tp]} would span nodes "
                    f"{sorted(group_nodes)}; choose tp dividing the ranks per node"
                )
        return order

    def table(self, nodes: list[tuple[int, int]]) -> list[dict[str, int]]:
        """One row per global rank: node, local rank, pp stage, dp rank, tp rank."""
        order = self.placement(nodes)
        rows = []
        for pos, rank in enumerate(order):
            c = self.coords(pos)
            rows.append({"rank": rank, "node": nodes[rank][0], "local_rank": nodes[rank][1],
                         "pp": c["pp"], "dp": c["dp"], "cp": c["cp"], "tp": c["tp"]})
        return sorted(rows, key=lambda r: r["rank"])

    def build_mesh(self, topo: Topology, device_type: str = CPU,
                   log_fn: Callable[[str], None] | None = None,
                   nodes: list[tuple[int, int]] | None = None) -> DeviceMesh | None:
        """Build the named mesh on every rank (collective); ``None`` for a single process.

        ``nodes`` is the gathered placement (:func:`gather_nodes`; a :class:`Layout` carries it),
        gathered here only when not given. Also creates the flattened ``dp`` dimension
        (replicate x shard), and logs the rank -> placement table once, on rank 0.
        """
        if self.world_size == 1 and not dist.is_initialized():
            return None
        nodes = gather_nodes(topo) if nodes is None else list(nodes)
        order = self.placement(nodes)
        mesh_tensor = torch.tensor(order, dtype=torch.int).view(self.shape)
        mesh = DeviceMesh(device_type, mesh_tensor, mesh_dim_names=self.dim_names)
        dp_mesh(mesh)
        if self.cp > 1:  # the gradient-reduction meshes of context parallelism, flattened once on every rank
            dp_cp_mesh(mesh)
            dp_shard_cp_mesh(mesh)
        if dist.get_rank() == 0:
            (log_fn or log.info)(format_table(self, self.table(nodes)))
        return mesh


@dataclass(frozen=True)
class Layout:
    """The job's parallel layout, derived once: degrees, where every rank sits, and the layout choices.

    ``dims`` (pp x dp_replicate x dp_shard x tp) come from the validated ``cfg.parallel``;
    ``placement[rank] = (node_id, local_rank)`` is gathered once per job and shared by the mesh,
    the gradient-communication node groups and the FSDP note; ``parallel`` keeps the choices that
    are not degrees (ddp/fsdp, schedule, microbatches, recompute, sequence parallel, ZeRO-1).
    Everything that builds the parallel model reads the layout from here, not from the config.
    """

    dims: ParallelDims
    placement: tuple[tuple[int, int], ...]
    parallel: ParallelConfig = field(repr=False)
    device: Device = Device("cpu")  # this rank's device (topo.device): the mesh, the model, the batches

    @classmethod
    def for_job(cls, p: ParallelConfig, topo: Topology) -> Layout:
        """Collective: the layout of the running job (one all-gather of the placement)."""
        dims = ParallelDims.from_config(p, topo.world_size)
        return cls(dims=dims, placement=tuple(gather_nodes(topo)), parallel=p, device=Device.parse(topo.device))

    @property
    def zero(self) -> int:
        """ZeRO stage over dp: ``parallel.zero``, derived from the older fields when left at -1."""
        return resolve_zero(self.parallel).zero

    @property
    def virtual_stages(self) -> int:
        """Pipeline model chunks per rank: ``parallel.virtual_stages`` under interleaved 1F1B, else 1."""
        return self.parallel.virtual_stages if self.parallel.schedule == "interleaved" else 1

    def build_mesh(self, topo: Topology, log_fn: Callable[[str], None] | None = None) -> DeviceMesh | None:
        """The named mesh for this layout's placement, on its device (collective; ``None`` for a single process)."""
        return self.dims.build_mesh(topo, self.device.type, log_fn=log_fn, nodes=list(self.placement))


def gather_nodes(topo: Topology) -> list[tuple[int, int]]:
    """``[(node_id, local_rank)]`` of every rank (collective); this rank's alone for a single process."""
    if topo.world_size == 1 and not dist.is_initialized():
        return [(topo.node_id, topo.local_rank)]
    gathered: list[tuple[int, int] | None] = [None] * topo.world_size
    dist.all_gather_object(gathered, (topo.node_id, topo.local_rank))
    return [tuple(x) for x in gathered]  # type: ignore[misc]


def format_table(dims: ParallelDims, rows: list[dict[str, int]]) -> str:
    """Human-readable placement table."""
    if dims.cp > 1:
        head = (f"layout pp={dims.pp} dp={dims.dp} (replicate {dims.dp_replicate} x shard {dims.dp_shard}) "
                f"cp={dims.cp} tp={dims.tp}\n rank  node  local  pp  dp  cp  tp")
        lines = [f"{r['rank']:>5} {r['node']:>5} {r['local_rank']:>6} {r['pp']:>3} {r['dp']:>3} {r['cp']:>3} "
                 f"{r['tp']:>3}" for r in rows]
        return "\n".join([head, *lines])
    head = (f"layout pp={dims.pp} dp={dims.dp} (replicate {dims.dp_replicate} x shard {dims.dp_shard}) "
            f"tp={dims.tp}" + (f" ep={dims.ep} (of the dp ranks)" if dims.ep > 1 else "")
            + "\n rank  node  local  pp  dp  tp")
    lines = [f"{r['rank']:>5} {r['node']:>5} {r['local_rank']:>6} {r['pp']:>3} {r['dp']:>3} {r['tp']:>3}" for r in rows]
    return "\n".join([head, *lines])


def mesh_coords(dims: ParallelDims, mesh: DeviceMesh | None) -> dict[str, int]:
    """This rank's coordinates (all zeros for a single process)."""
    if mesh is None:
        return {"pp": 0, "dp_replicate": 0, "dp_shard": 0, "cp": 0, "tp": 0, "dp": 0}
    c = {"cp": 0} | {name: mesh.get_local_rank(name) for name in dims.dim_names}
    c["dp"] = c["dp_replicate"] * dims.dp_shard + c["dp_shard"]
    return c


def expert_mesh(mesh: DeviceMesh, dims: ParallelDims) -> DeviceMesh:
    """The 3-D ``("erep", "efsdp", "ep")`` mesh of this rank's expert groups (collective: every rank builds all).

    The data-parallel ranks of each (pp, tp) position, in flattened dp order, are cut into blocks of ``ep``
    consecutive ranks: a block is one expert-parallel group (tokens are exchanged inside it; consecutive dp
    ranks share a node first, so the all-to-all stays on the fast links when ep fits a node), and the ranks
    at the same position of every block (``edp`` = erep x efsdp, dp/ep of them) hold the same experts and
    reduce their gradients together. Under HSDP (``ep`` divides ``dp_shard``, each block inside one replicate
    group) ``erep`` is the replicate degree and ``efsdp`` the dp_shard/ep blocks of a replicate group, over
    which FSDP2 shards the experts (torchtitan's rule ``dp_shard * cp * tp == efsdp * ep``); otherwise
    ``erep`` is 1 and ``efsdp`` = dp/ep (replicas under DDP, FSDP2 shards under FSDP2 without replicate
    groups). As torchtitan's, the expert mesh is the dp mesh re-cut, not a dimension of the dense mesh, so FSDP
    and the dense data parallelism keep their groups; ``erep``, ``efsdp`` and ``ep`` share one root mesh,
    which FSDP2 needs to shard the ``ep`` DTensors over ``efsdp``.
    """
    ranks = mesh.mesh  # (pp, dp_replicate, dp_shard, tp) global ranks
    erep = dims.dp_replicate if dims.dp_shard % dims.ep == 0 else 1
    # (pp, tp, dp): dp flattened replicate-major as dp_mesh() flattens it (index r*dp_shard + s), then cut into
    # (erep, efsdp, ep) blocks: s = b*ep + j puts rank (r, s) at [r, b, j] when ep divides dp_shard.
    by_dp = ranks.permute(0, 3, 1, 2).reshape(dims.pp, dims.tp, erep, dims.dp // (dims.ep * erep), dims.ep)
    full = DeviceMesh(mesh.device_type, by_dp, mesh_dim_names=("pp", "tp", "erep", "efsdp", "ep"))
    return full["erep", "efsdp", "ep"]


def dp_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The flattened data-parallel (replicate x shard) 1-D mesh; created once, then cached by torch."""
    return mesh["dp_replicate", "dp_shard"]._flatten("dp")


def dp_cp_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The flattened gradient-reduction mesh: dp (replicate x shard) x cp; the dp mesh when there is no cp."""
    if "cp" not in (mesh.mesh_dim_names or ()):
        return dp_mesh(mesh)
    return mesh["dp_replicate", "dp_shard", "cp"]._flatten("dp_cp")


def dp_shard_cp_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """FSDP2's shard mesh under context parallelism: dp_shard x cp flattened (each cp rank holds a shard)."""
    return mesh["dp_shard", "cp"]._flatten("dp_shard_cp")
