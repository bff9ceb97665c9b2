"""Node grouping for the hierarchical all-reduce, from the Topology (never from hostnames).

For the data-parallel group a DDP module reduces over, the ranks are split by node
(``Topology.node_id``: ``SLURM_NODEID`` on Slurm, the virtual nodes of ``cluster=local``).
With ``m`` nodes holding ``k`` ranks of the group each, local index ``j`` of every node forms one
*cross-node* subgroup: the k subgroups are the k parallel inter-node flows of Horovod's
hierarchical all-reduce. Subgroup creation is collective over the whole world (every rank calls
``new_group`` for every subgroup in the same order), so several dp groups (under tp or pp) work.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from xirang_hpc.runtime.device import Device
from xirang_hpc.runtime.topology import Topology

if TYPE_CHECKING:
    from xirang_hpc.runtime.parallel_dims import ParallelDims


class CommLayoutError(ValueError):
    """The data-parallel group cannot be split into equal node groups."""


@dataclass
class CommLayout:
    """This rank's place in the two-level (node, local index) view of its data-parallel group."""

    group: Any  # the data-parallel ProcessGroup (DDP's), or None for a single process
    group_ranks: list[int]
    num_nodes: int  # m: nodes the group spans
    local: int  # k: ranks of the group per node
    node_index: int  # which of the m nodes this rank is on
    local_index: int  # j: this rank's index among the group's ranks on its node
    node_id: int  # Topology.node_id of this rank's node
    token: str  # names this communicator's shared-memory segments
    cross_group: Any = None  # ProcessGroup of the same-j peers on the other nodes (None if m == 1)
    intra_group: Any = None  # ProcessGroup of this node's ranks (NCCL only; CPU uses shared memory)
    intra_ranks: list[int] = field(default_factory=list)

    @property
    def size(self) -> int:
        """p = m x k ranks in the group."""
        return self.num_nodes * self.local


def split_by_node(members: list[tuple[int, int, int]]) -> list[list[int]]:
    """``[(global rank, node_id, local_rank)]`` -> ranks per node (nodes sorted, ranks by local rank).

    Raises :class:`CommLayoutError` if the nodes hold different numbers of the group's ranks.
    """
    by_node: dict[int, list[tuple[int, int]]] = {}
    for rank, node, local in members:
        by_node.setdefault(node, []).append((local, rank))
    rows = [[r for _, r in sorted(by_node[n])] for n in sorted(by_node)]
    counts = {len(r) for r in rows}
    if len(counts) != 1:
        detail = ", ".join(f"node {n}: {len(by_node[n])}" for n in sorted(by_node))
        raise CommLayoutError(
            f"the hierarchical all-reduce needs the same number of data-parallel ranks on every node ({detail}); "
            "use comm.hierarchical=false or a layout with equal ranks per node")
    return rows


def build_layout(topo: Topology, group: Any = None, placement: Sequence[tuple[int, int]] | None = None) -> CommLayout:
    """Collective over the world: build the node groups for ``group`` (default: the world).

    ``placement[rank] = (node_id, local_rank)`` is the job's gathered placement (the trainer's
    :class:`~xirang_hpc.runtime.parallel_dims.Layout` passes it, the same one its mesh uses); only
    standalone callers (benchmarks, tests) leave it out, and then it is gathered here.
    """
    accelerated = Device.parse(topo.device).is_accelerator
    if not dist.is_initialized():
        return CommLayout(group=None, group_ranks=[0], num_nodes=1, local=1, node_index=0, local_index=0,
                          node_id=topo.node_id, token=uuid.uuid4().hex[:12], intra_ranks=[0])
    group = group if group is not None else dist.group.WORLD
    mine = tuple(dist.get_process_group_ranks(group))
    world = dist.get_world_size()
    info: list[Any] = [None] * world
    if placement is None:
        dist.all_gather_object(info, (topo.node_id, topo.local_rank, mine, uuid.uuid4().hex[:12]))
    else:  # where ranks sit is known; only the group memberships and segment names are exchanged
        if len(placement) != world:
            raise CommLayoutError(f"placement lists {len(placement)} ranks, the world has {world}")
        dist.all_gather_object(info, (mine, uuid.uuid4().hex[:12]))
        info = [(placement[r][0], placement[r][1], *info[r]) for r in range(world)]
    me = dist.get_rank()
    groups = sorted({tuple(i[2]) for i in info})
    layout: CommLayout | None = None
    for g in groups:
        rows = split_by_node([(r, info[r][0], info[r][1]) for r in g])
        m, k = len(rows), len(rows[0])
        token = info[g[0]][3]
        cross = [dist.new_group([rows[n][j] for n in range(m)]) if m > 1 else None for j in range(k)]
        # Node-local groups for an accelerator's collective library (the default group's, runtime/device.py);
        # on the CPU the node's ranks meet in shared memory instead.
        intra = [dist.new_group(row) if accelerated and k > 1 else None for row in rows]
        if g != mine:
            continue
        for n, row in enumerate(rows):
            if me in row:
                j = row.index(me)
                layout = CommLayout(group=group, group_ranks=list(g), num_nodes=m, local=k, node_index=n, local_index=j,
                                    node_id=topo.node_id, token=token, cross_group=cross[j], intra_group=intra[n],
                                    intra_ranks=row)
    assert layout is not None, "this rank is not in its own data-parallel group"
    return layout


def fsdp_node_note(dims: ParallelDims, nodes: Sequence[tuple[int, int]]) -> str | None:
    """How FSDP2/HSDP's own collectives map onto nodes, for ``dims`` placed on ``nodes[rank] = (node, local)``.

    HSDP is the hierarchical all-reduce by construction when every shard group lies inside one node:
    the gradient reduce-scatter (and the next forward's all-gather) stay on the node, and only each
    rank's 1/dp_shard shard is all-reduced across nodes, by dp_shard parallel replicate groups, the
    same k flows as the DDP hook. So for FSDP the hook is not installed; instead this says whether
    the mesh already has that shape, and if shard groups span nodes, the override that fixes it.
    Returns ``None`` when the data-parallel group lives on one node (nothing crosses a node link).
    """
    nodes = list(nodes)
    order = dims.placement(nodes)
    shard_groups: dict[tuple[int, int, int], list[int]] = {}
    dp_nodes: dict[tuple[int, int], set[int]] = {}
    for pos, rank in enumerate(order):
        c = dims.coords(pos)
        shard_groups.setdefault((c["pp"], c["dp_replicate"], c["tp"]), []).append(rank)
        dp_nodes.setdefault((c["pp"], c["tp"]), set()).add(nodes[rank][0])
    spanned = max(len(s) for s in dp_nodes.values())
    if spanned <= 1:
        return None
    crossing = [g for g in shard_groups.values() if len({nodes[r][0] for r in g}) > 1]
    if crossing:
        return (f"FSDP shard groups span nodes (e.g. ranks {crossing[0]}): every reduce-scatter and all-gather "
                f"crosses the inter-node link. Set parallel.dp_replicate={spanned} (HSDP: shard inside each "
                f"node, all-reduce the shards across the {spanned} nodes) to keep them on the node")
    return (f"HSDP is hierarchical by construction: shard groups of {dims.dp_shard} rank(s) inside each node "
            f"(reduce-scatter / all-gather stay on the node), {dims.dp_shard} parallel cross-node replicate "
            f"group(s) all-reduce 1/{dims.dp_shard} of the gradient each")
