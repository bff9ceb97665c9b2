"""Effective training time of a long run, simulated: goodput per recovery policy, checkpoint interval and spares.

A run of ``nodes`` x ``gpus_per_node`` GPUs (plus ``spares`` idle nodes) trains for ``days`` days of wall
time. Interruptions arrive as a Poisson process per class (hardware, network, software, planned), each at a
rate per node and day (``FailureModel``; the defaults are Llama 3's published interruption breakdown). Each
recovery policy pays its own measured costs (``RecoveryCosts``; the defaults are this build's, measured on
the testbed) and rolls back to its own copy of the state:

- ``requeue``: every unplanned interruption ends the job; it rolls back to the newest durable filesystem
  checkpoint, Slurm requeues it (``requeue_recovery_s``, then ``requeue_hold_s`` and ``queue_wait_s``) and the
  new allocation starts up (``startup_s`` + the checkpoint load);
- ``in-job``: the allocation is kept; a software fault restarts the ranks in place, a lost node is replaced
  by a spare (``injob_recovery_s`` + the checkpoint load, same rollback); with no spare left the allocation
  shrinks by the lost node's data-parallel replica (``Scenario.shrink_nodes``; progress slows by its share
  until the next requeue) or, where it may not, the job is requeued (a new allocation, all its spares free);
- ``in-job+memory``: as ``in-job``, but it rolls back to the newest complete in-memory copy (one every
  ``memory_every_s``) and restores it (``memory_restore_s``) instead of reading the filesystem.

A planned interruption (maintenance, preemption) is announced: the build saves on the signal (no progress
lost, one save's time) and the job is requeued, under every policy. Failures arrive only while the job holds
an allocation (start-up, recovery, training); a failure during a start-up or a recovery starts it again.

The state is checkpointed after every ``interval_s`` of compute: the training stalls ``stall_s`` (the
blocking snapshot) and the checkpoint is durable ``save_s`` later (the background write); a failure rolls
back to the newest durable one. When the checkpoint's size is given, stall, save and load are scaled from it
with this build's measured rates (``CheckpointCosts.from_bytes``).

Every second of the allocated GPU time falls in exactly one bucket: productive (progress kept at the end),
lost progress (computed, then rolled back), recovery (fault -> processes started again, incl. detection),
start-up (process start -> first step, incl. the checkpoint load), checkpoint stall, queue wait (requeue hold
+ pending; what ml-goodput-measurement calls scheduling goodput) and, with spares, the spares' idle time.
Goodput = productive / allocated GPU time. The simulation is vectorised over seeds and settings (numpy), so
a scan of intervals or spares costs one pass over the failures.

Checkpoint interval: Young (1974) sqrt(2*C*M) to first order, Daly (2006) to higher order
(``checkpoint.tuner.daly_interval``), C = the stall, M = the mean time between unplanned interruptions;
checked against the simulated optimum by a scan (``scan_intervals``).

The policies compared, the scans and the recommendation: :mod:`xirang_hpc.planner.goodput_advice`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace
from typing import Any

import numpy as np

from xirang_hpc.checkpoint.tuner import daly_interval
from xirang_hpc.config.errors import ConfigError
from xirang_hpc.config.fleet import (  # noqa: F401 - re-exported for the simulator's users
    LLAMA3_COUNTS,
    LLAMA3_DAYS,
    LLAMA3_GPUS,
    LLAMA3_GPUS_PER_NODE,
    LLAMA3_SOURCE,
    LLAMA3_STORAGE_GBPS,
)

POLICIES = ("requeue", "in-job", "in-job+memory")
CLASSES = ("hardware", "network", "software", "planned")
BUCKETS = ("productive", "lost", "recovery", "startup", "stall", "queue", "shrunk", "spares")
DAY_S = 86400.0

# Llama 3 405B's published interruption breakdown and storage (config/fleet.py says where each figure is from).


@dataclass(frozen=True)
class FailureModel:
    """Interruptions per node per day, by class (a Poisson process each, scaled by the node count)."""

    hardware_per_node_day: float
    network_per_node_day: float
    software_per_node_day: float
    planned_per_node_day: float
    source: str = ""

    def __post_init__(self) -> None:
        for c in CLASSES:
            v = getattr(self, f"{c}_per_node_day")
            if not math.isfinite(v) or v < 0:
                raise ConfigError(f"goodput.{c}_per_node_day", v, "use a rate >= 0 (interruptions per node per day)")
        if self.total_per_node_day() <= 0:
            raise ConfigError("goodput.hardware_per_node_day", 0.0,
                              "every failure rate (goodput.hardware/network/software/planned_per_node_day) is 0: "
                              "a run without interruptions has nothing to simulate; give at least one rate > 0")

    @classmethod
    def from_counts(cls, counts: dict[str, float], nodes: int, days: float, source: str = "") -> FailureModel:
        """Rates from interruption counts observed on ``nodes`` nodes over ``days`` days."""
        nd = nodes * days
        return cls(**{f"{c}_per_node_day": counts.get(c, 0) / nd for c in CLASSES}, source=source)

    @classmethod
    def llama3(cls) -> FailureModel:
        """Llama 3 405B's published breakdown (see ``LLAMA3_COUNTS``)."""
        return cls.from_counts(LLAMA3_COUNTS, LLAMA3_GPUS // LLAMA3_GPUS_PER_NODE, LLAMA3_DAYS, LLAMA3_SOURCE)

    def rates(self) -> np.ndarray:
        """Per-node-day rates in ``CLASSES`` order."""
        return np.array([getattr(self, f"{c}_per_node_day") for c in CLASSES])

    def total_per_node_day(self) -> float:
        """All classes together."""
        return float(self.rates().sum())

    def mtbf_s(self, nodes: int, unplanned_only: bool = False) -> float:
        """Mean time between interruptions of a job on ``nodes`` nodes (seconds); inf when none."""
        r = self.rates()
        rate = (r[:3].sum() if unplanned_only else r.sum()) * nodes / DAY_S
        return math.inf if rate <= 0 else float(1.0 / rate)


# This build's measured costs (benchmarks/RESULTS.md), the defaults of RecoveryCosts and CheckpointCosts.
MEASURED_SOURCES = {
    "startup_s": "process start -> first step of a requeued job, median of 3 preemptions "
                 "(RESULTS 'Slurm requeue: cost of a preemption', bench_slurm_requeue.py, 7.3 s)",
    "requeue_recovery_s": "fault -> the requeued job's processes start: 'in-job driver killed ... requeued' "
                          "fault -> first step 26.9 s (RESULTS 'Recovery per fault class') less the 7.3 s start-up",
    "requeue_hold_s": "Slurm's default restart delay with requeue.start_now=false: 161 s requeue -> first step "
                      "against 15 s with start_now (RESULTS 'Slurm requeue'); 0 with start_now",
    "queue_wait_s": "pending time of a requeued job: 0 on the testbed (nothing else queued); set your site's",
    "injob_recovery_s": "node lost -> first step of the in-job restart from the filesystem, 10.8 s "
                        "(RESULTS 'Recovery per fault class'; the kill -9 of a rank took 6.1 s, slurmctld down "
                        "22.0 s); the 2.8 MB checkpoint's load is negligible in it",
    "memory_restore_s": "restore from memory instead of the filesystem load: node lost -> first step 18.3 s from "
                        "memory against 17.9 s from the filesystem, same commit (RESULTS 'In-job restart from "
                        "memory'); the extra 0.4 s",
    "stall_gbps": "save stall per byte: 0.146 s per 1.96 GB (gpt2-small, RESULTS 'Checkpointing', "
                  "bench_checkpoint.py) = 13.4 GB/s per GPU",
    "write_gbps": "persist throughput 1.31 GB/s per node (RESULTS 'Checkpointing')",
    "read_gbps": "load with checksums 0.552 s per 1.96 GB = 3.55 GB/s per node (RESULTS 'Checkpointing')",
}


@dataclass(frozen=True)
class RecoveryCosts:
    """What an interruption costs each policy, in seconds (defaults: this build's measurements,
    ``MEASURED_SOURCES``)."""

    startup_s: float = 7.3
    requeue_recovery_s: float = 19.6
    requeue_hold_s: float = 146.0
    queue_wait_s: float = 0.0
    injob_recovery_s: float = 10.8
    memory_restore_s: float = 0.4

    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            if not math.isfinite(v) or v < 0:
                raise ConfigError(f"goodput.{f.name}", v, "a cost is a duration in seconds: use a value >= 0")


@dataclass(frozen=True)
class CheckpointCosts:
    """One checkpoint's costs (seconds): the snapshot each GPU takes of its shard (the training waits for
    it), the write of each node's share until durable (in the background unless ``synchronous``), the load."""

    snapshot_s: float
    write_s: float
    load_s: float
    synchronous: bool = False  # the training also waits for the write (no background save)
    bytes_total: float = 0.0  # the checkpoint's size when the costs were scaled from it

    def __post_init__(self) -> None:
        for name in ("snapshot_s", "write_s", "load_s", "bytes_total"):
            v = getattr(self, name)
            if not math.isfinite(v) or v < 0:
                raise ConfigError(f"goodput.{name}", v, "a checkpoint cost is >= 0 (seconds, or bytes)")

    @property
    def stall_s(self) -> float:
        """What the training waits per filesystem checkpoint."""
        return self.snapshot_s + (self.write_s if self.synchronous else 0.0)

    @property
    def save_s(self) -> float:
        """From the end of the stall until the checkpoint is durable."""
        return 0.0 if self.synchronous else self.write_s

    @classmethod
    def from_bytes(cls, bytes_total: float, gpus: int, nodes: int, stall_gbps: float = 13.4,
                   write_gbps: float = 1.31, read_gbps: float = 3.55, fs_gbps: float = 0.0,
                   synchronous: bool = False) -> CheckpointCosts:
        """Costs of a sharded checkpoint of ``bytes_total`` bytes: each GPU snapshots its share, each node
        writes and reads its share, all nodes at once; ``fs_gbps`` > 0 caps the file system's aggregate
        bandwidth. Defaults: this build's measured rates (``MEASURED_SOURCES``)."""
        for name, v in (("checkpoint_bytes", bytes_total), ("stall_gbps", stall_gbps), ("write_gbps", write_gbps),
                        ("read_gbps", read_gbps)):
            if not math.isfinite(v) or v <= 0:
                raise ConfigError(f"goodput.{name}", v, "use a value > 0")
        if not math.isfinite(fs_gbps) or fs_gbps < 0:
            raise ConfigError("goodput.fs_gbps", fs_gbps, "use 0 (no aggregate limit) or the file system's GB/s")
        gb = bytes_total / 1e9
        write, load = gb / nodes / write_gbps, gb / nodes / read_gbps
        if fs_gbps > 0:
            write, load = max(write, gb / fs_gbps), max(load, gb / fs_gbps)
        return cls(snapshot_s=gb / gpus / stall_gbps, write_s=write, load_s=load, synchronous=synchronous,
                   bytes_total=bytes_total)


@dataclass(frozen=True)
class Scenario:
    """One run to simulate: its size, length, failures, costs and checkpoint schedule."""

    nodes: int
    gpus_per_node: int
    days: float
    failures: FailureModel
    costs: RecoveryCosts
    checkpoint: CheckpointCosts
    interval_s: float  # compute between filesystem checkpoints
    memory_every_s: float  # compute between in-memory copies (in-job+memory)
    spares: int = 0
    # A lost node with no spare left: the in-job restart goes on without the data-parallel replica that
    # held it (``shrink_nodes`` nodes; the same global batch through more accumulation, so progress slows
    # by their share) as long as ``min_nodes`` remain; 0 = no shrinking, a requeue.
    shrink_nodes: int = 0
    min_nodes: int = 1
    memory_lag_s: float = -1.0  # a copy completes this long after its snapshot; < 0 = one memory interval
    # Every in-job restart takes the culprit's node out of the allocation, whatever the class (this build's
    # driver names a node, never a cause it could restart in place): a software fault uses a spare, or
    # shrinks, or requeues, like a lost node. False: a software fault restarts on the same nodes.
    exclude_on_restart: bool = False
    seeds: int = 32
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("nodes", "gpus_per_node", "seeds"):
            if getattr(self, name) < 1:
                raise ConfigError(f"goodput.{name}", getattr(self, name), "use a whole number >= 1")
        if self.spares < 0:
            raise ConfigError("goodput.spares", self.spares, "use 0 (no spare node) or more")
        if self.shrink_nodes < 0 or self.shrink_nodes >= self.nodes:
            raise ConfigError("goodput.shrink_nodes", self.shrink_nodes,
                              "use 0 (no shrinking) or the nodes of one data-parallel replica, fewer than the nodes")
        for name in ("days", "interval_s", "memory_every_s"):
            v = getattr(self, name)
            if not math.isfinite(v) or v <= 0:
                raise ConfigError(f"goodput.{name}", v, "use a positive number")

    @property
    def gpus(self) -> int:
        """GPUs that train (spares excluded)."""
        return self.nodes * self.gpus_per_node

    def daly_s(self, policy: str = "in-job") -> float:
        """Daly's interval for ``policy``'s stall per filesystem checkpoint (in-job+memory: the snapshot,
        written in the background) and the unplanned MTBF, never below the time until durable (a save waits
        for the previous one)."""
        ck = self.checkpoint
        stall, floor = (ck.snapshot_s, ck.write_s) if policy == "in-job+memory" else (ck.stall_s, ck.save_s)
        return max(daly_interval(stall, self.failures.mtbf_s(self.nodes, True)), floor, 1e-3)


@dataclass
class Trace:
    """Interruptions of each seed: wall-clock times (sorted, padded past the horizon) and classes."""

    times: np.ndarray  # (seeds, M) float
    classes: np.ndarray  # (seeds, M) int, index into CLASSES
    horizon_s: float


def draw_trace(sc: Scenario) -> Trace:
    """Poisson interruptions over the whole run for each seed; the same trace serves every policy and
    setting (common random numbers, so differences between settings are not noise between draws)."""
    rng = np.random.default_rng(sc.seed)
    h = sc.days * DAY_S
    per_class = sc.failures.rates() * sc.nodes * sc.days  # expected count per class over the run
    counts = rng.poisson(per_class.sum(), size=sc.seeds)
    m = max(1, int(counts.max()))
    times = np.full((sc.seeds, m), 2 * h + 1)
    classes = np.zeros((sc.seeds, m), dtype=np.int64)
    p = per_class / per_class.sum()
    for s, n in enumerate(counts):
        times[s, :n] = np.sort(rng.uniform(0.0, h, size=n))
        classes[s, :n] = rng.choice(len(CLASSES), size=n, p=p)
    return Trace(times, classes, h)


def fixed_trace(events: list[tuple[float, str]], horizon_s: float) -> Trace:
    """One seed's given interruptions, ``(wall-clock s, class)``: deterministic checks and replays."""
    for _, c in events:
        if c not in CLASSES:
            raise ConfigError("goodput.trace", c, f"a class is one of {', '.join(CLASSES)}")
    ev = sorted(events)
    m = max(1, len(ev))
    times = np.full((1, m), 2 * horizon_s + 1)
    classes = np.zeros((1, m), dtype=np.int64)
    for i, (t, c) in enumerate(ev):
        times[0, i], classes[0, i] = t, CLASSES.index(c)
    return Trace(times, classes, horizon_s)


def simulate(sc: Scenario, policy: str, trace: Trace, intervals: np.ndarray | None = None,
             spares: np.ndarray | None = None) -> dict[str, np.ndarray]:
    """Seconds per bucket, shape (settings, seeds), for ``policy`` under ``trace``; ``intervals`` and
    ``spares`` (one value per setting, broadcast together) default to the scenario's. Also returns the
    counts ``interruptions`` and ``requeues`` and ``goodput`` (productive / allocated GPU time)."""
    if policy not in POLICIES:
        raise ConfigError("goodput.policy", policy, f"choose one of {', '.join(POLICIES)}")
    iv = np.atleast_1d(np.asarray(sc.interval_s if intervals is None else intervals, dtype=float))
    sp = np.atleast_1d(np.asarray(sc.spares if spares is None else spares, dtype=float))
    iv, sp = np.broadcast_arrays(iv, sp)
    if (iv <= 0).any():
        raise ConfigError("goodput.interval_s", float(iv.min()), "use a positive interval")
    ck, co = sc.checkpoint, sc.costs
    k_n, s_n = iv.size, trace.times.shape[0]
    shape = (k_n, s_n)
    h = trace.horizon_s
    # A save waits for the previous one to be durable, so checkpoints come no closer than the save time.
    memory = policy == "in-job+memory"
    if memory:
        # One snapshot per memory interval (the stall); every q-th is also written to the filesystem, in the
        # background (checkpoint.in_memory saves from the snapshot), durable a write later.
        stall, save = ck.snapshot_s, ck.write_s
        m = np.full(shape, float(sc.memory_every_s))
        q = np.maximum(1.0, np.round(np.maximum(iv, save)[:, None] / m))
        lag = np.full(shape, float(sc.memory_lag_s if sc.memory_lag_s >= 0 else sc.memory_every_s))
    else:
        stall, save = ck.stall_s, ck.save_s
        m, q, lag = np.maximum(iv, save)[:, None] * np.ones(shape), np.ones(shape), np.zeros(shape)
    u = m + stall  # one cycle: compute, then the snapshot's stall
    spare0 = sp[:, None] * np.ones(shape)

    b = {k: np.zeros(shape) for k in BUCKETS}
    interruptions, requeues, planned_requeues = np.zeros(shape), np.zeros(shape), np.zeros(shape)
    t = np.zeros(shape)
    pend_stall, pend_rec, pend_queue = np.zeros(shape), np.zeros(shape), np.full(shape, float(co.queue_wait_s))
    over_rec, over_start = np.zeros(shape), np.full(shape, float(co.startup_s))
    spare = spare0.copy()
    mem_only = np.zeros(shape)  # progress restored from memory and not yet on the filesystem
    lost_nodes = np.zeros(shape)  # nodes a shrunk allocation trains without
    ptr = np.zeros(shape, dtype=np.int64)
    active = np.ones(shape, dtype=bool)
    # One padding column past the horizon, so that a pointer past the last interruption reads "none".
    times = np.hstack([trace.times, np.full((s_n, 1), 2 * h + 1)])  # (seeds, M + 1)
    classes = np.hstack([trace.classes, np.zeros((s_n, 1), dtype=np.int64)])
    n_ev = times.shape[1]
    # Row offsets so that one searchsorted finds every seed's next interruption (times are < 2h + 2).
    stride = 2 * h + 2
    flat = (times + stride * np.arange(s_n)[:, None]).ravel()
    injob_now, injob_max = np.zeros(shape), np.zeros(shape)  # in-job restarts in this allocation, most in one
    seed_ix = np.broadcast_to(np.arange(s_n)[None, :], shape)
    hold = co.requeue_hold_s
    for _ in range(n_ev + 2):
        if not active.any():
            break
        # 1. The time without an allocation: a graceful save's stall, the requeue, the queue (no failures hit).
        for pend, bucket in ((pend_stall, "stall"), (pend_rec, "recovery"), (pend_queue, "queue")):
            w = np.where(active, np.minimum(pend, h - t), 0.0)
            b[bucket] += w
            t += w
            pend -= w
        # 2. The next interruption while the job holds its allocation; those in between fell on nobody.
        found = np.searchsorted(flat, (t + stride * seed_ix).ravel(), side="left").reshape(shape) - seed_ix * n_ev
        ptr = np.maximum(ptr, found)  # a consumed interruption at exactly t is not met again
        f = times[seed_ix, ptr]
        cls = classes[seed_ix, ptr]
        ends = np.where(active, np.minimum(f, h), t)
        failed = active & (f < h)
        exposed = ends - t
        # 3. Recovery and start-up still owed are paid first; what is left of the span trains.
        paid_rec = np.minimum(over_rec, exposed)
        paid_start = np.minimum(over_start, exposed - paid_rec)
        b["recovery"] += paid_rec
        b["startup"] += paid_start
        over_rec -= paid_rec
        over_start -= paid_start
        run = np.where(active, exposed - paid_rec - paid_start, 0.0)
        k = np.floor(run / u)
        r = run - k * u
        comp = k * m + np.minimum(r, m)
        b["stall"] += k * stall + np.maximum(r - m, 0.0)
        # Newest durable filesystem checkpoint (cycle i, a multiple of q) and in-memory copy (cycle j).
        i_fs = np.clip(np.floor(np.floor((run - save) / u) / q) * q, 0, k)
        j_mem = np.clip(np.floor((run - lag) / u), 0, k)
        fs_kept = i_fs * m
        # Progress is counted in GPU-seconds at full size: on a shrunk allocation a second trains `cap` of one
        # and the rest is the `shrunk` bucket. mem_only is in the same units.
        cap = 1.0 - lost_nodes / sc.nodes
        b["shrunk"] += comp * (1.0 - cap)
        comp = comp * cap
        fs_back = np.where(i_fs >= 1, fs_kept * cap, -mem_only)  # progress kept by a filesystem rollback
        done = active & ~failed  # the horizon: the run ends with a final save, everything computed is kept
        b["productive"] += np.where(done, comp, 0.0)
        active &= failed
        ptr = np.where(failed, ptr + 1, ptr)
        t = ends
        if not failed.any():
            continue
        interruptions += failed
        planned = failed & (cls == CLASSES.index("planned"))
        node_lost = failed & ((cls == CLASSES.index("hardware")) | (cls == CLASSES.index("network")))
        if policy == "requeue":
            injob = np.zeros(shape, dtype=bool)
        else:
            has_spare = spare >= 1
            can_shrink = (sc.shrink_nodes > 0) & (sc.nodes - lost_nodes - sc.shrink_nodes >= sc.min_nodes)
            takes = (failed & ~planned) if sc.exclude_on_restart else node_lost  # the restart loses a node
            injob = failed & ~planned & (~takes | has_spare | can_shrink)
            spare = np.where(injob & takes & has_spare, spare - 1, spare)
            lost_nodes = np.where(injob & takes & ~has_spare, lost_nodes + sc.shrink_nodes, lost_nodes)
        req = failed & ~injob
        injob_now = np.where(req, 0.0, injob_now + injob)
        injob_max = np.maximum(injob_max, injob_now)
        # Planned: saved on the signal, everything kept. Requeue / in-job from the filesystem: the newest durable
        # checkpoint. In-job from memory: the newest complete copy.
        if memory:
            mem_kept = j_mem * m * cap
            kept = np.where(planned, comp, np.where(injob, mem_kept, fs_back))
            mem_only = np.where(injob, np.where(i_fs >= 1, mem_kept - fs_kept * cap, mem_only + mem_kept), 0.0)
            mem_only = np.where(failed, np.maximum(mem_only, 0.0), mem_only)
        else:
            kept = np.where(planned, comp, fs_back)
        b["productive"] += np.where(failed, kept, 0.0)
        b["lost"] += np.where(failed, comp - kept, 0.0)
        requeues += req
        planned_requeues += req & planned
        pend_stall += np.where(planned, ck.snapshot_s + ck.write_s, 0.0)
        pend_rec += np.where(req, co.requeue_recovery_s, 0.0)
        pend_queue += np.where(req, hold + co.queue_wait_s, 0.0)
        over_start = np.where(req, co.startup_s + ck.load_s, np.where(injob, 0.0, over_start))
        restore = co.memory_restore_s if memory else ck.load_s
        over_rec = np.where(injob, co.injob_recovery_s + restore, np.where(req, 0.0, over_rec))
        spare = np.where(req, spare0, spare)  # a new allocation: its spares are all free, no node missing
        lost_nodes = np.where(req, 0.0, lost_nodes)
    # The spares' GPUs are allocated and idle all along: a share of the GPU time that trains nothing.
    alloc = (sc.nodes + spare0) / sc.nodes  # allocated / training GPU time
    out = {k: b[k] / alloc for k in BUCKETS if k != "spares"}
    out["spares"] = h * (1 - 1 / alloc)
    out["goodput"] = out["productive"] / h
    out["interruptions"], out["requeues"], out["injob_max"] = interruptions, requeues, injob_max
    out["planned_requeues"] = planned_requeues
    return out


def llama3_405b(policy_costs: RecoveryCosts | None = None, seeds: int = 32) -> Scenario:
    """Llama 3 405B's published setting with the costs derived for it (docs/parallel-and-planning.md,
    "Effective training time: the simulator"):

    - failures: the published 466 interruptions in 54 days on 2,048 nodes of 8 H100 (``LLAMA3_COUNTS``);
    - checkpoint: 12 bytes per parameter (the planner's and the launcher's size: fp32 weights and AdamW
      moments) of 405.9 B parameters, 4.87 TB, written to Tectonic at its sustained 2 TB/s (Sec. 3.3.1),
      synchronously (the paper describes checkpoint writes saturating the storage in bursts, not an
      asynchronous snapshot), so the training stalls 2.4 s per save; read back at the same rate;
    - recovery: the paper gives no restart time; taken as 5 min of recovery plus 5 min of start-up for a
      requeue (10 min fault -> first step), 5 min for an in-job restart, no hold or queue (a dedicated
      cluster), i.e. 30-50x this build's testbed figures for 2,048 nodes' rendezvous and start-up;
    - step time 8.0 s (``xirang-plan model=llama3-405b cluster=h100-ib cluster.nodes=2048
      train.global_batch=2048``'s recommended layout), an in-memory copy every step.
    """
    bytes_total = 12 * 405_853_388_800  # formulas.model_params(llama3-405b), as xirang-plan computes it
    ck = CheckpointCosts.from_bytes(bytes_total, LLAMA3_GPUS, LLAMA3_GPUS // LLAMA3_GPUS_PER_NODE,
                                    fs_gbps=LLAMA3_STORAGE_GBPS, synchronous=True)
    costs = policy_costs or RecoveryCosts(startup_s=300.0, requeue_recovery_s=300.0, requeue_hold_s=0.0,
                                          queue_wait_s=0.0, injob_recovery_s=300.0, memory_restore_s=0.4)
    sc = Scenario(nodes=LLAMA3_GPUS // LLAMA3_GPUS_PER_NODE, gpus_per_node=LLAMA3_GPUS_PER_NODE, days=LLAMA3_DAYS,
                  failures=FailureModel.llama3(), costs=costs, checkpoint=ck, interval_s=1.0, memory_every_s=8.0,
                  seeds=seeds)
    return replace(sc, interval_s=sc.daly_s())


# Names that live in the modules built on this one, still importable from here.
_MOVED = {"Replay": "goodput_replay", "replay": "goodput_replay",
          **{n: "goodput_advice" for n in ("INTERVAL_FACTORS", "SPARE_CHOICES", "IntervalScan", "PolicyResult",
                                           "Recommendation", "recommend", "scan_intervals", "scan_spares",
                                           "scenario_dict", "summarize")}}


def __getattr__(name: str) -> Any:
    """The names of ``_MOVED`` (the replay in :mod:`xirang_hpc.planner.goodput_replay`; the comparison of
    policies, the scans and the recommendation in :mod:`xirang_hpc.planner.goodput_advice`), still importable
    from here. Looked up on first use: those modules import this one, so an import at the top would be circular."""
    if name in _MOVED:
        import importlib

        return getattr(importlib.import_module(f"xirang_hpc.planner.{_MOVED[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
