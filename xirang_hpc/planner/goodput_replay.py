"""A measured run replayed through the goodput simulator (:mod:`xirang_hpc.planner.goodput_sim`): the run's own
faults, at the times they hit it, and its own measured costs, as one fixed trace on a small scenario. The
replay's buckets and goodput are what the simulator predicts for that run, to set beside what its records
measured (``benchmarks/bench_goodput.py``)."""

from __future__ import annotations

from dataclasses import dataclass, replace

from xirang_hpc.planner.goodput_sim import (
    BUCKETS,
    CLASSES,
    DAY_S,
    CheckpointCosts,
    FailureModel,
    RecoveryCosts,
    Scenario,
    fixed_trace,
    simulate,
)


@dataclass
class Replay:
    """One measured run replayed through the simulator: its own faults, its own measured costs."""

    policy: str
    horizon_s: float  # the replayed window: the first allocation's start to the end of the run's records
    faults: list[tuple[float, str]]  # (seconds into the window, class) of every fault that hit the job
    costs: RecoveryCosts
    checkpoint: CheckpointCosts
    interval_s: float  # compute between filesystem checkpoints
    memory_every_s: float  # compute between in-memory copies (in-job+memory)
    memory_lag_s: float = -1.0
    spares: int = 0  # idle nodes of the allocation an in-job restart moves to
    exclude_on_restart: bool = True  # as this build's in-job driver does (``Scenario.exclude_on_restart``)

    def scenario(self) -> Scenario:
        """A 2-node scenario, ``spares`` spare nodes, no shrinking (with no spare left a restart is a requeue),
        one seed: the trace is fixed, so the failure rates only name the classes. The window starts in the
        first allocation, so the pending time of each requeued job is counted as its hold (the simulator's
        ``queue_wait_s`` also delays the first start)."""
        rates = {c: 0.0 for c in CLASSES}
        for _, c in self.faults:
            rates[c] += 1.0
        if not self.faults:
            rates["software"] = 1.0
        fm = FailureModel.from_counts(rates, 2, self.horizon_s / DAY_S, source="the replayed run's own faults")
        costs = replace(self.costs, requeue_hold_s=self.costs.requeue_hold_s + self.costs.queue_wait_s,
                        queue_wait_s=0.0)
        return Scenario(nodes=2, gpus_per_node=1, days=self.horizon_s / DAY_S, failures=fm, costs=costs,
                        checkpoint=self.checkpoint, interval_s=self.interval_s, memory_every_s=self.memory_every_s,
                        memory_lag_s=self.memory_lag_s, spares=self.spares,
                        exclude_on_restart=self.exclude_on_restart, seeds=1)


def replay(r: Replay) -> dict[str, float]:
    """Seconds per bucket and the predicted goodput of a replayed run.

    ``goodput`` is productive over the allocated time, i.e. the window less the simulated queue wait (requeue
    hold and pending): the definition ``xirang-status --goodput`` measures, which reports queue wait apart
    from the total. ``goodput_window`` divides by the whole window instead (the simulator's own definition).
    Both are per second of wall time, as a run's records measure it: the spares' idle GPU time, which the
    simulator charges to the run, is left out (``spares`` is 0)."""
    sc = r.scenario()
    out = simulate(sc, r.policy, fixed_trace(r.faults, r.horizon_s))
    per_wall = (sc.nodes + sc.spares) / sc.nodes  # simulate() divides each bucket by the allocated GPU share
    res = {k: float(out[k][0, 0]) * per_wall for k in BUCKETS}
    res["spares"] = 0.0
    res["interruptions"] = float(out["interruptions"][0, 0])
    res["requeues"] = float(out["requeues"][0, 0])
    alloc = r.horizon_s - res["queue"]
    res["allocated"] = alloc
    res["goodput"] = res["productive"] / alloc if alloc > 0 else 0.0
    res["goodput_window"] = res["productive"] / r.horizon_s
    return res
