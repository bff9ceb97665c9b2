"""The simulator's advice: the recovery policies compared, the scans, and the recommendation.

:mod:`xirang_hpc.planner.goodput_sim` simulates one run under one policy (seconds per bucket, per setting
and seed); this module turns that into answers. Each policy is summarized as goodput with its 95% CI over
seeds and the share of each bucket (``PolicyResult``); the checkpoint interval is scanned around Daly's
(``scan_intervals``: the optimum and the flat region around it) and the spare count over a few choices
(``scan_spares``: each spare saves requeues but idles its GPUs); ``recommend`` simulates every policy at
Daly's interval and its best spare count, and recommends policy, interval and spares. All settings share
one trace of failures (common random numbers), so their differences are not noise between draws.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import numpy as np

from xirang_hpc.planner.goodput_sim import BUCKETS, DAY_S, POLICIES, Scenario, Trace, draw_trace, simulate


def _ci(x: np.ndarray) -> tuple[float, float]:
    """Mean and the half-width of its 95% confidence interval over seeds (normal approximation)."""
    n = x.size
    sd = float(x.std(ddof=1)) if n > 1 else 0.0
    return float(x.mean()), 1.96 * sd / math.sqrt(n)


@dataclass
class PolicyResult:
    """One policy at one setting: goodput with its 95% CI over seeds, and the share of each bucket (%)."""

    policy: str
    interval_s: float
    spares: int
    goodput_pct: float
    ci_pct: float
    breakdown_pct: dict[str, float]
    interruptions: float
    requeues: float
    # The budgets this run needs (the most over the seeds): every requeue (the deprecated requeue.max_requeues
    # counts them all), and requeue.max_restarts_in_job the in-job restarts of one allocation.
    requeues_max: int
    restarts_in_job_max: int
    shrink_nodes: int = 0  # > 0: with no spare left a lost node's replica is dropped; 0: a requeue
    # The requeue budget's rates this run needs (requeue.failures_per_day, requeue.preemptions_per_day): the
    # most requeues of each class over the seeds, less requeue.budget_burst, per day (``needed_rates``).
    failure_requeues_max: int = 0
    planned_requeues_max: int = 0

    def needed_rates(self, days: float, burst: int) -> dict[str, float]:
        """The rates ``requeue.failures_per_day`` and ``preemptions_per_day`` that let the run's most requeues of
        each class (over the seeds) through by its end, on top of ``burst`` (rounded up to 0.01 a day)."""
        def rate(n: int) -> float:
            return math.ceil(max(0, n - burst) / days * 100) / 100
        return {"failures_per_day": rate(self.failure_requeues_max),
                "preemptions_per_day": rate(self.planned_requeues_max)}

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready."""
        return asdict(self)


def summarize(sc: Scenario, policy: str, res: dict[str, np.ndarray], row: int, interval_s: float,
              spares: int) -> PolicyResult:
    """Row ``row`` of :func:`simulate`'s result as percentages of the allocated GPU time."""
    h = sc.days * DAY_S
    g, ci = _ci(res["goodput"][row] * 100)
    brk = {k: float(np.mean(res[k][row])) / h * 100 for k in BUCKETS}
    return PolicyResult(policy, interval_s, spares, g, ci, brk, float(res["interruptions"][row].mean()),
                        float(res["requeues"][row].mean()), int(res["requeues"][row].max()),
                        int(res["injob_max"][row].max()), 0 if policy == "requeue" else sc.shrink_nodes,
                        int((res["requeues"][row] - res["planned_requeues"][row]).max()),
                        int(res["planned_requeues"][row].max()))


INTERVAL_FACTORS = (0.25, 0.35, 0.5, 0.7, 1.0, 1.4, 2.0, 2.8, 4.0)
SPARE_CHOICES = (0, 1, 2, 4, 8, 16, 32, 64)


@dataclass
class IntervalScan:
    """Goodput over intervals around Daly's: the optimum and the flat region around it."""

    daly_s: float
    intervals_s: list[float]
    goodput_pct: list[float]
    best_s: float
    flat_s: tuple[float, float]  # the intervals within ``tolerance_pct`` of the best
    tolerance_pct: float

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready."""
        return asdict(self)


def scan_intervals(sc: Scenario, policy: str, trace: Trace, spares: int | None = None,
                   factors: tuple[float, ...] = INTERVAL_FACTORS, tolerance_pct: float = 0.1) -> IntervalScan:
    """Goodput at Daly's interval times each of ``factors`` (never below the save time), same failures for
    all. The flat region: every scanned interval within ``tolerance_pct`` points, or the CI of the best, of
    the best mean."""
    daly = float(sc.daly_s(policy))
    ivs = np.array(sorted({max(daly * f, 1e-3) for f in factors}))  # simulate() keeps them >= the save time
    res = simulate(sc, policy, trace, ivs, np.full(ivs.size, sc.spares if spares is None else spares))
    gp = res["goodput"] * 100  # (intervals, seeds)
    g = gp.mean(axis=1)
    best = int(np.argmax(g))
    tol = tolerance_pct
    if sc.seeds > 1:
        # Common random numbers: the settings share failures, so the paired differences' CI is what
        # separates an interval from the best.
        tol = max(tol, max(_ci(gp[i] - gp[best])[1] for i in range(ivs.size)))
    flat = ivs[g >= g[best] - tol]
    return IntervalScan(daly, ivs.tolist(), g.tolist(), float(ivs[best]), (float(flat.min()), float(flat.max())), tol)


def scan_spares(sc: Scenario, policy: str, trace: Trace, interval_s: float,
                choices: tuple[int, ...] = SPARE_CHOICES) -> tuple[int, list[int], list[float]]:
    """(the spare count with the highest goodput, the counts scanned, their goodput %): each spare saves
    requeues when nodes fail but idles its GPUs all along."""
    ch = np.array([c for c in choices if c <= max(1, sc.nodes)], dtype=float)
    res = simulate(sc, policy, trace, np.full(ch.size, interval_s), ch)
    g = res["goodput"].mean(axis=1) * 100
    return int(ch[int(np.argmax(g))]), [int(c) for c in ch], g.tolist()


@dataclass
class Recommendation:
    """The simulator's answer: each policy at its best spares and Daly's interval, the interval scan of the
    chosen policy, and the chosen policy, interval and spares."""

    scenario: dict[str, Any]
    results: list[PolicyResult]
    scan: IntervalScan
    spares_scan: dict[str, tuple[list[int], list[float]]]
    policy: str
    interval_s: float
    spares: int
    configured: PolicyResult | None = None
    notes: list[str] = field(default_factory=list)
    shrink_nodes: int = 0  # the recommended policy shrinks (> 0) or requeues when no spare is left

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready."""
        return {"scenario": self.scenario, "results": [r.to_dict() for r in self.results],
                "interval_scan": self.scan.to_dict(),
                "spares_scan": {p: {"spares": s, "goodput_pct": g} for p, (s, g) in self.spares_scan.items()},
                "recommended": {"policy": self.policy, "interval_s": self.interval_s, "spares": self.spares,
                                "shrink_when_no_spare": self.shrink_nodes > 0},
                "configured": self.configured.to_dict() if self.configured else None, "notes": self.notes}


def recommend(sc: Scenario, configured_policy: str | None = None) -> Recommendation:
    """Simulate every policy (in-job ones at their best spare count, all at Daly's interval), scan the
    interval of the best, and recommend policy, interval and spares. ``configured_policy``: also report the
    scenario's own interval and spares under that policy."""
    trace = draw_trace(sc)
    results, spares_scan = [], {}
    # With no spare left an in-job restart either shrinks (when the scenario may) or requeues: both are tried.
    variants = [sc] + ([replace(sc, shrink_nodes=0)] if sc.shrink_nodes else [])
    chosen: dict[str, Scenario] = {"requeue": sc}
    for p in POLICIES:
        daly = sc.daly_s(p)
        best_sp, best_g = 0, -1.0
        for v in variants if p != "requeue" else []:
            sp, counts, g = scan_spares(v, p, trace, daly)
            spares_scan[p + (" (shrinking)" if v.shrink_nodes else " (requeue when none left)")] = (counts, g)
            if max(g) > best_g:
                best_sp, best_g, chosen[p] = sp, max(g), v
        res = simulate(chosen[p], p, trace, np.array([daly]), np.array([best_sp]))
        results.append(summarize(chosen[p], p, res, 0, daly, best_sp))
    best = max(results, key=lambda r: r.goodput_pct)
    scan = scan_intervals(chosen[best.policy], best.policy, trace, best.spares)
    configured = None
    if configured_policy is not None:
        sp = 0 if configured_policy == "requeue" else sc.spares
        res = simulate(sc, configured_policy, trace, np.array([sc.interval_s]), np.array([sp]))
        configured = summarize(sc, configured_policy, res, 0, sc.interval_s, sp)
    # Daly's interval when it is in the flat region (a formula the run can recompute), else the optimum.
    daly = scan.daly_s
    lo, hi = scan.flat_s
    interval = daly if lo <= daly <= hi else scan.best_s
    notes = []
    if not lo <= daly <= hi:
        notes.append(f"Daly's interval {daly:.1f} s is outside the simulated optimum's flat region "
                     f"[{lo:.1f}, {hi:.1f}] s; the simulated optimum {scan.best_s:.1f} s is recommended")
    return Recommendation(scenario_dict(sc), results, scan, spares_scan, best.policy, interval, best.spares,
                          configured, notes, best.shrink_nodes)


def scenario_dict(sc: Scenario) -> dict[str, Any]:
    """The inputs, as reported."""
    d = asdict(sc)
    d["gpus"] = sc.gpus
    d["mtbf_s"] = sc.failures.mtbf_s(sc.nodes)
    d["mtbf_unplanned_s"] = sc.failures.mtbf_s(sc.nodes, True)
    d["expected_interruptions"] = sc.failures.total_per_node_day() * sc.nodes * sc.days
    d["daly_s"] = {p: sc.daly_s(p) for p in POLICIES}
    return d
