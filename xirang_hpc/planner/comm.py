"""Alpha-beta communication costs with separate intra- and inter-node links.

Costs (anchors.md, "Communication"), p = k ranks/node x m nodes, n bytes, a = latency, b = s/byte:
- flat ring all-reduce:   2(p-1)*a + 2(p-1)/p * n * b  (b of the slowest link the ring crosses);
- hierarchical all-reduce (Horovod/NCCL-style): intra-node reduce-scatter, inter-node all-reduce
  among same-local-rank peers (all local ranks in parallel), intra-node all-gather:
  2(k-1)*a_l + 2(k-1)/k * n * b_l + 2(m-1)*a_g + 2(m-1)/m * (n/k) * b_g.
- NCCL's pipelined multi-channel ring (``pipelined_ring``; the sharded stages' all-gathers and
  reduce-scatters on GPUs): 2(p-m)*a_l + 2(m-1)*a_g + 2(p-1)/p * n * max((k-1)/k * b_l, b_g/k), the
  slowest link's time, since the ring's NVLink and network hops carry their chunks at the same time.
- all-to-all (``all_to_all``; expert parallelism's token dispatch and combine), pairwise exchange
  (Thakur, Rabenseifner and Gropp, "Optimization of Collective Communication Operations in MPICH",
  IJHPCA 2005, Sec. 4.5): (p-1)*a + (p-1)/p * n * b, each rank sending n/p bytes to every other rank;
  with k of the p ranks on each node the NVLink and network shares move at the same time.
Inter-node bandwidth is a per-node figure shared by the ``flows`` ranks of a node that talk across
nodes at the same time (e.g. the 8 data-parallel groups of a node with tp=8).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from xirang_hpc.planner.hardware import Hardware


@dataclass(frozen=True)
class Links:
    """Latency (s) and seconds-per-byte of the two link classes, for one rank."""

    a_intra: float
    b_intra: float
    a_inter: float
    b_inter_node: float  # seconds per byte through one node's NICs (all flows together)
    nics: int = 1  # a single flow uses at most one NIC

    @classmethod
    def of(cls, hw: Hardware) -> Links:
        """Links of a hardware preset."""
        return cls(hw.intra_latency_us * 1e-6, 1.0 / (hw.intra_bw_gbs * 1e9),
                   hw.inter_latency_us * 1e-6, 1.0 / (hw.inter_bw_gbs * 1e9), max(1, hw.inter_nics))

    def b_inter(self, flows: int) -> float:
        """Seconds per byte for one of ``flows`` concurrent cross-node streams from a node."""
        return self.b_inter_node * max(flows, self.nics)


def ring_allreduce(n: float, p: int, a: float, b: float) -> float:
    """Flat ring: 2(p-1)a + 2(p-1)/p * n * b."""
    if p <= 1 or n <= 0:
        return 0.0
    return 2 * (p - 1) * a + 2 * (p - 1) / p * n * b


def hierarchical_allreduce(n: float, k: int, m: int, links: Links, flows: int) -> float:
    """Reduce-scatter in the node, all-reduce across m nodes on n/k bytes, all-gather in the node."""
    intra = ring_allreduce(n, k, links.a_intra, links.b_intra)
    inter = ring_allreduce(n / max(k, 1), m, links.a_inter, links.b_inter(flows))
    return intra + inter


def group_allreduce(n: float, k: int, m: int, links: Links, flows: int) -> tuple[float, str]:
    """Best of flat ring and hierarchical for a group of k ranks on each of m nodes.

    Returns (seconds, algorithm). A flat ring ordered by node pushes 2(p-1)/p*n through each NIC
    on one flow per group; the hierarchical one sends n/k per local rank on k flows in parallel.
    """
    p = k * m
    if p <= 1:
        return 0.0, "none"
    if m == 1:
        return ring_allreduce(n, k, links.a_intra, links.b_intra), "ring-intra"
    flat = ring_allreduce(n, p, links.a_inter, links.b_inter(flows // max(k, 1) or 1))
    if k == 1:
        return flat, "ring-inter"
    hier = hierarchical_allreduce(n, k, m, links, flows)
    return (hier, "hierarchical") if hier <= flat else (flat, "ring-inter")


def pipelined_ring(n: float, k: int, m: int, links: Links, flows: int, channels: int = 0) -> float:
    """All-reduce-equivalent time of NCCL's ring over a group of k ranks on each of m nodes (half of it for an
    all-gather or a reduce-scatter): 2(p-m)a_l + 2(m-1)a_g + 2(p-1)/p * n * max((k-1)/k * b_l, b_g / k).

    NCCL builds one ring per channel, each leaving a node through its own NIC (one per GPU on DGX-class
    nodes), and moves the data in chunks along every ring at once, so a ring's intra-node hops (NVLink) and
    inter-node hops (network) run concurrently: the slowest link sets the time, not their sum (nccl-tests
    ``doc/PERFORMANCE.md``: "The bus bandwidth should reflect the speed of the hardware bottleneck: NVLink,
    PCI, QPI, or network"). Each rank sends 2(p-1)/p * n: on NVLink in the (k-1)/k of the channels whose
    next rank is on its node, through its NIC (b_g = ``b_inter(flows)``, one of ``flows`` streams of the node)
    in the 1/k that leave it. Latency as NCCL's own tuning model counts a ring's steps (``src/graph/tuning.cc``,
    ``ncclTopoTuneModel``): 2(m-1) of the 2(p-1) steps cross nodes and pay the network's latency, the others
    NVLink's. One rank per node (k = 1) or one node (m = 1): the flat ring.

    ``channels`` (0 = k) is how many of a node's NICs the collective's rings actually leave it through: every link
    of a ring carries the whole (p-1)/p * n, so with c rings (channels) on c NICs each NIC carries 1/c of it, and a
    collective whose rings share fewer NICs than the node has ranks crosses nodes at b_g / c instead of b_g / k
    (c = 1: one NIC carries everything, a single ring's bandwidth).
    """
    p = k * m
    if p <= 1 or n <= 0:
        return 0.0
    if m == 1:
        return ring_allreduce(n, k, links.a_intra, links.b_intra)
    c = min(k, channels) if channels > 0 else k
    per_byte = max((k - 1) / k * links.b_intra, links.b_inter(flows) / c)
    return 2 * (p - m) * links.a_intra + 2 * (m - 1) * links.a_inter + 2 * (p - 1) / p * n * per_byte


def all_to_all(n: float, k: int, m: int, links: Links, flows: int, inter_n: float | None = None) -> float:
    """All-to-all of ``n`` bytes per rank over a group of k ranks on each of m nodes (n/p bytes to each peer).

    Pairwise exchange (Thakur et al. 2005): p - 1 steps, (p-1)/p * n bytes out of each rank. Of the p - 1
    peers, k - 1 share the rank's node (NVLink) and p - k do not (its share of the node's NICs, one of
    ``flows`` streams leaving the node at once); the two kinds of transfer proceed concurrently (NCCL issues
    an all-to-all as grouped point-to-point sends), so the slower sets the time. Latency: one step per peer,
    at the latency of that peer's link. One node (m = 1): the intra-node exchange alone.
    ``inter_n``: the bytes that leave the node when the dispatcher sends less than the (p-k)/p * n a uniform
    exchange does (:func:`node_dedup_share`); what crosses the network is then forwarded inside the target
    node, so every copy crosses NVLink: (p-1)/p * n there.
    """
    p = k * m
    if p <= 1 or n <= 0:
        return 0.0
    intra = ((k - 1) if inter_n is None else (p - 1)) / p * n * links.b_intra
    inter = ((p - k) / p * n if inter_n is None else inter_n) * links.b_inter(flows) if m > 1 else 0.0
    return (k - 1) * links.a_intra + (p - k) * links.a_inter + max(intra, inter)


def node_dedup_share(experts: int, top_k: int, nodes: int) -> float:
    """Copies of a token that cross the network per routed copy, when a dispatcher sends each token once to
    every other node holding at least one of its top_k experts and forwards it there over NVLink (DeepSeek-V3
    technical report, 2024, Sec. 3.2.2; DeepEP's "normal" kernels, NVLink and RDMA forwarding), instead of
    once per expert. Experts spread evenly over ``nodes``, routing uniform without replacement: a given other
    node holds none of the token's experts with probability C(E - E/m, k) / C(E, k), so the expected
    nodes reached are (m-1) * (1 - that), against (m-1)/m * k copies without deduplication.
    """
    if nodes <= 1:
        return 0.0
    per_node = experts // nodes
    miss = math.comb(experts - per_node, top_k) / math.comb(experts, top_k)
    return (nodes - 1) * (1.0 - miss) / ((nodes - 1) / nodes * top_k)


def p2p(n: float, inter_node: bool, links: Links, flows: int) -> float:
    """One point-to-point send of n bytes between pipeline stages."""
    if n <= 0:
        return 0.0
    if inter_node:
        return links.a_inter + n * links.b_inter(flows)
    return links.a_intra + n * links.b_intra
