"""A short on-cluster microbenchmark that turns measured rates into a cluster preset.

Every rank of a job on the cluster (submitit, Slurm or the local executor's virtual nodes) runs:
- GEMMs of a transformer's shape (tokens x w by w x 4w) at two widths, all ranks at once, fitted to
  rate(w) = R * w/(w + w_half) -> ``peak_tflops`` (R), ``gemm_half_width`` (w_half);
- a streaming add (memory bandwidth) and a burst of tiny ops (per-kernel overhead);
- a grad-norm clip + AdamW step on 1M parameters (the update's cost per parameter);
- all-reduce inside each node and across nodes (same local rank), all groups at once, at two sizes,
  fitted to the ring's alpha-beta cost 2(p-1)a + 2(p-1)/p*n*b (anchors.md, "Communication").
Rank 0 returns the fitted ``cluster.hardware`` fields; :func:`write_preset` saves them as YAML.
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from omegaconf import OmegaConf

from xirang_hpc.config.schema import ClusterConfig
from xirang_hpc.planner.defaults import PROBE_ROUNDS

TOKENS = 512
WIDTHS = (32, 256)
SMALL, LARGE = 4 * 1024, 4 * 1024 * 1024  # all-reduce sizes in bytes
OPS_PER_LAYER = 15  # elementwise kernels in one layer's pass
ROUNDS = 5  # alternating rounds of each all-reduce measurement


def _timed(fn: Callable[[], Any], min_s: float = 0.15, min_reps: int = 3) -> float:
    """Median seconds per call of ``fn`` after a warm-up."""
    fn()
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < min_reps or time.perf_counter() - start < min_s:
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _gemm_rate(width: int) -> float:
    a, b = torch.randn(TOKENS, width), torch.randn(width, 4 * width)
    return 2.0 * TOKENS * width * 4 * width / _timed(lambda: a @ b, min_s=0.2)


def _gemm_rates(rounds: int = ROUNDS) -> list[float]:
    """FLOP/s per rank at each of WIDTHS: median over alternating rounds, then the mean over ranks.

    All ranks multiply at once, so a rank's rate is its share of the node's cores. The mean over ranks
    is that share; the slowest rank's figure (used before) measured a moment of scheduler unfairness
    and swung by a third between calibrations on a 2-core box.
    """
    per_width: list[list[float]] = [[] for _ in WIDTHS]
    for _ in range(rounds):
        for i, w in enumerate(WIDTHS):
            per_width[i].append(_gemm_rate(w))
    rates = torch.tensor([statistics.median(r) for r in per_width], dtype=torch.float64)
    if dist.is_initialized():
        dist.all_reduce(rates)
        rates /= dist.get_world_size()
    return [float(r) for r in rates]


OPTIM_PARAMS, OPTIM_TENSORS = 1 << 20, 8


def _optimizer_ns_per_param() -> float:
    """Nanoseconds per parameter of a grad-norm clip + AdamW step (the training step's update), all ranks at once.

    On CPU ranks Adam is bound by its arithmetic (sqrt, divide) on a core shared with other ranks,
    not by memory bandwidth: several times the bandwidth estimate, so it is measured.
    """
    params = [torch.nn.Parameter(torch.randn(OPTIM_PARAMS // OPTIM_TENSORS)) for _ in range(OPTIM_TENSORS)]
    for q in params:
        q.grad = torch.randn_like(q)
    opt = torch.optim.AdamW(params, lr=1e-4, weight_decay=0.1)

    def step() -> None:
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()

    return _timed(step, min_s=0.3) / OPTIM_PARAMS * 1e9


def bubble_exposed(ranks_per_node: int, cores_per_node: int) -> float:
    """Fraction of a pipeline bubble that costs wall time when ``ranks_per_node`` share the cores.

    With a core per rank (GPUs, or enough CPU cores) an idle stage's time is lost: 1. With twice as
    many ranks as cores or more, a stage waiting in the bubble hands its core to a rank with work, so
    the bubble costs nothing: 0. Linear in between.
    """
    if cores_per_node <= 0:
        return 1.0
    return min(1.0, max(0.0, 2.0 - ranks_per_node / cores_per_node))


def fit_saturation(w1: float, r1: float, w2: float, r2: float) -> tuple[float, float]:
    """(R, w_half) with r = R * w/(w + w_half) through two points (w1 < w2)."""
    q = r1 / r2
    denom = q * w2 - w1
    w_half = max(0.0, w1 * w2 * (1 - q) / denom) if denom > 0 else 0.0
    return r2 * (w2 + w_half) / w2, w_half


def fit_alpha_beta(p: int, n1: float, t1: float, n2: float, t2: float) -> tuple[float, float]:
    """(a seconds, b seconds/byte) of a ring all-reduce over p ranks from two (size, time) points."""
    steps = 2.0 * (p - 1)
    vol = steps / p
    b = max((t2 - t1) / (vol * (n2 - n1)), 1e-15)
    a = max((t1 - vol * n1 * b) / steps, 1e-7)
    return a, b


def _allreduce_time(group: dist.ProcessGroup, nbytes: int, reps: int = 8) -> float:
    """Median seconds of an all-reduce; a fixed count on every rank (collectives must match)."""
    x = torch.ones(nbytes // 4)
    dist.all_reduce(x, group=group)
    dist.barrier()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        dist.all_reduce(x, group=group)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _two_sizes(group: dist.ProcessGroup, rounds: int = ROUNDS) -> tuple[float, float]:
    """Median all-reduce seconds at SMALL and LARGE bytes (slowest rank), alternating sizes over rounds.

    One pass of each size swung 2-5x between calibrations on a loaded 2-core box; the median of
    alternating rounds is what the fit needs (load drift then hits both sizes alike).
    """
    small, large = [], []
    for _ in range(rounds):
        small.append(_agree(_allreduce_time(group, SMALL)))
        large.append(_agree(_allreduce_time(group, LARGE)))
    return statistics.median(small), statistics.median(large)


def _node_groups(world: int, per_node: int) -> tuple[list[Any], list[Any]]:
    """Every rank creates every group (new_group is collective): intra per node, inter per local rank."""
    nodes = world // per_node
    intra = [dist.new_group(list(range(n * per_node, (n + 1) * per_node))) for n in range(nodes)]
    inter = [dist.new_group([n * per_node + lr for n in range(nodes)]) for lr in range(per_node)]
    return intra, inter


def _agree(value: float) -> float:
    """The slowest rank's figure (rates are taken as the minimum over ranks)."""
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def measure(rank: int, world: int, per_node: int) -> dict[str, float]:
    """Run the microbenchmarks on this rank (process group up); returns fitted hardware fields."""
    out: dict[str, float] = {}
    dist.barrier()
    rates = _gemm_rates()
    peak, half = fit_saturation(WIDTHS[0], rates[0], WIDTHS[1], rates[1])
    out.update(peak_tflops=peak / 1e12, gemm_efficiency=1.0, gemm_half_width=half)
    x, y = torch.randn(4 * 1024 * 1024), torch.randn(4 * 1024 * 1024)
    # Best of the repeats, as STREAM reports: on a shared machine the median mostly measures the neighbours.
    best = min(_timed(lambda: torch.add(x, y), min_s=0.02, min_reps=1) for _ in range(15))
    bw = 3 * x.numel() * 4 / _agree(best)
    out["optimizer_ns_per_param"] = _agree(_optimizer_ns_per_param())
    small = torch.ones(8)
    per_op = _agree(_timed(lambda: [small.add(1.0) for _ in range(100)])) / 100
    out.update(mem_bw_gbs=bw / 1e9, kernel_overhead_us=per_op * OPS_PER_LAYER * 1e6, elementwise_traffic=1.0,
               dp_overlap=0.0)  # gloo DDP buckets: little overlap measured on a few cores
    nodes = world // per_node
    intra, inter = _node_groups(world, per_node) if world > 1 else ([], [])
    node, local = rank // per_node, rank % per_node
    if per_node > 1:
        t1, t2 = _two_sizes(intra[node])
        a, b = fit_alpha_beta(per_node, SMALL, t1, LARGE, t2)
        out.update(intra_latency_us=a * 1e6, intra_bw_gbs=1.0 / b / 1e9)
    if nodes > 1:
        # All local ranks cross at once, as the data-parallel groups of a node do in training.
        t1, t2 = _two_sizes(inter[local])
        a, b = fit_alpha_beta(nodes, SMALL, t1, LARGE, t2)
        out.update(inter_latency_us=a * 1e6, inter_bw_gbs=per_node / b / 1e9, inter_nics=1)
    try:
        import psutil

        out["mem_gb"] = psutil.virtual_memory().total / 1024**3 / per_node
    except ImportError:  # pragma: no cover - psutil is a dependency
        pass
    return out


def calibration_job(cluster: dict[str, Any], folder: str = "", overheads: bool = True,
                    rounds: int | None = None) -> dict[str, float]:
    """Job entry function: every rank measures; rank 0 returns the fitted fields.

    With ``overheads`` (CPU clusters) the runtime's fixed costs are probed too (planner/probe.py),
    using ``folder`` for a small prepared corpus, in ``rounds`` rounds of probe runs (default
    ``planner.defaults.PROBE_ROUNDS``).
    """
    from xirang_hpc.runtime import dist as xdist

    spec = ClusterConfig(**cluster)
    topo = xdist.start_job(spec)  # the same topology set-up (and check against the config) as the training job
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    local_nodes = spec.nodes if spec.executor == "local" else 1
    try:
        fields = measure(topo.rank, topo.world_size, topo.local_world_size)
        if overheads:  # CPU ranks share the node's cores; GPUs keep the preset's 1.0
            # Virtual nodes of the local executor share this machine's cores; a Slurm node has its own.
            fields["bubble_exposed"] = bubble_exposed(topo.local_world_size, max(1, cores // local_nodes))
        if overheads:
            from xirang_hpc.planner.hardware import PRESETS
            from xirang_hpc.planner.probe import measure_overheads

            base = PRESETS[cluster.get("gpu") or "cpu"]
            hw = base.scaled(**{k: type(getattr(base, k))(v) for k, v in fields.items()})
            fields.update(measure_overheads(hw, topo, Path(folder), rounds=rounds or PROBE_ROUNDS))
        dist.barrier()
    finally:
        xdist.shutdown()
    return fields if topo.rank == 0 else {}


def write_preset(cluster: ClusterConfig, fields: dict[str, float], path: Path, name: str,
                 rounds: int | None = None) -> Path:
    """Save ``cluster`` with the measured ``hardware`` block as a ``cluster/`` preset YAML (``rounds``: the
    rounds of probe runs it was measured with, when not the default, said in the header)."""
    data = dataclasses.asdict(cluster)
    data["name"] = name
    data["gpu"] = cluster.gpu or ("cpu" if cluster.gpus_per_node == 0 else "a100-80gb")
    data["hardware"] = {k: float(round(v, 6)) for k, v in sorted(fields.items())}
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    how = f", --rounds {rounds}" if rounds else ""
    header = (f"# Measured by `xirang-plan --calibrate` on {time.strftime('%Y-%m-%d %H:%M')} "
              f"({cluster.nodes} node(s) x {cluster.tasks_per_node} ranks{how}). Use: cluster={name}\n")
    path.write_text(header + OmegaConf.to_yaml(OmegaConf.create(data)))
    return path
