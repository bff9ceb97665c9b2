"""Exhaustive search over parallel plans, with pruning, and the reasons runners-up lost.

Space: tp (divides the ranks of a node, heads, key/value heads, width, MLP width and vocab, as
config validation demands), pp (any count up to the layers that divides world/tp: stages need not
divide the layers, the split balances them), dp = world/(tp*pp) dividing the global batch,
micro-batch b (divides batch/dp), interleaving v (pp > 1, pp*v <= layers, m % pp == 0 as in
Megatron-LM), ZeRO stage 0-3, recompute none/selective/full, sequence parallel (tp > 1); for a MoE
model the expert parallel degree ep (divides the experts and the tp*dp ranks of a stage; cost.py); and for
long sequences of a dense model (``Space.cp_min_seq`` tokens or more) context parallelism cp (divides
world/(tp*pp), 2*cp divides the sequence; without pipeline stages or ZeRO-1, as the runtime runs it),
dp = world/(tp*pp*cp).

Pruning: (1) a (tp, pp, zero) whose weights+grads+optimizer alone exceed memory is skipped whole;
(2) for fixed everything else, memory grows with b, so the first b that does not fit ends that
loop; (3) without a capability veto, tp > 1 without sequence parallelism is skipped (same
predicted time or more, more memory). GPipe is never searched: it has the 1F1B bubble and more activation memory.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from xirang_hpc.planner.cost import Estimate, Plan, Problem, estimate
from xirang_hpc.planner.formulas import embedding_params, layer_expert_params, layer_params, state_bytes_per_param

RECOMPUTE = ("none", "selective", "full")


def divisors(n: int) -> list[int]:
    """Positive divisors of n, ascending."""
    small = [d for d in range(1, int(n**0.5) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


@dataclass
class Space:
    """Which knobs the search may turn (a capability set)."""

    tp: Iterable[int] | None = None  # None: all valid
    pp: Iterable[int] | None = None
    zero: tuple[int, ...] = (0, 1, 2, 3)
    recompute: tuple[str, ...] = RECOMPUTE
    sequence_parallel: tuple[bool, ...] = (False, True)
    max_interleave: int = 8
    max_micro: int = 64
    ep: Iterable[int] | None = None  # expert parallel degrees (MoE models); None: all valid
    cp: Iterable[int] | None = None  # None: every valid degree when the sequence is long (cp_min_seq), else 1
    cp_min_seq: int = 8192  # below this, a sequence's activations are small enough that cp only adds traffic
    allow: Callable[[Plan], bool] | None = None  # final veto, e.g. "the runtime can run it"


@dataclass
class Result:
    """Ranked plans and the bookkeeping of one search."""

    ranked: list[Estimate]  # plans that fit, fastest first
    oom: list[Estimate]  # fastest plans that did not fit
    evaluated: int
    seconds: float
    problem: Problem
    reasons: dict[int, str] = field(default_factory=dict)  # id(estimate) -> why it lost
    limit: str = ""  # when nothing was even evaluated: the memory limit that excluded everything

    @property
    def best(self) -> Estimate:
        """The recommended plan."""
        if not self.ranked:
            closest = "; ".join(f"{e.plan.label()}: {self.reasons[id(e)]}" for e in self.oom[:3])
            raise ValueError("no plan fits in memory: " + (closest or self.limit or "no valid layout"))
        return self.ranked[0]


def _tp_options(pb: Problem) -> list[int]:
    sh = pb.shape
    return [t for t in divisors(pb.per_node)
            if sh.heads % t == 0 and sh.n_kv % t == 0 and sh.hidden % t == 0 and sh.ffn % t == 0
            and sh.vocab % t == 0 and sh.expert_ffn % t == 0 and sh.shared_ffn % t == 0]


def ep_options(pb: Problem, t: int, d: int) -> list[int]:
    """Expert parallel degrees for a stage of t*d ranks: 1 for a dense model; for a MoE model every divisor of
    the expert count that also divides t*d (whole experts on each of ep ranks of the stage)."""
    if not pb.shape.experts:
        return [1]
    return [e for e in divisors(pb.shape.experts) if (t * d) % e == 0]


def _state_floor(pb: Problem, t: int, p: int, d: int, zero: int, ep: int = 1) -> float:
    """Bytes of weights+grads+optimizer on the first stage: a lower bound for any b, v, recompute."""
    hw, sh = pb.hw, pb.shape
    plan = Plan(dp=d, tp=t, pp=p, micro=1, zero=zero, ep=ep)
    w, g, o = state_bytes_per_param(zero, d, hw.weight_bytes, hw.grad_bytes, hw.optim_bytes)
    we, ge, oe = state_bytes_per_param(zero, plan.edp, hw.weight_bytes, hw.grad_bytes, hw.optim_bytes)
    le = layer_expert_params(sh)
    params = (sh.layers // p * (layer_params(sh) - le) + embedding_params(sh)) / t
    experts = sh.layers // p * le / (ep * plan.etp)
    return params * (w + g + o) + experts * (we + ge + oe)


def _pp_options(pb: Problem, t: int) -> list[int]:
    """Pipeline sizes for tensor degree ``t``: every divisor of world/t up to the layer count."""
    return [p for p in divisors(pb.world // t) if p <= pb.shape.layers] if pb.world % t == 0 else []


def _cp_options(pb: Problem, sp_: Space, t: int, p: int) -> list[int]:
    """Context-parallel degrees for (tp, pp): 1, and for long sequences of a dense model without pipeline stages
    every cp that divides world/(tp*pp) with 2*cp dividing the sequence (the runtime's load-balanced chunks)."""
    seq, rest = pb.shape.seq, pb.world // (t * p)
    if pb.shape.experts:  # cp runs MoE models at ep=1 only; the cost model's MoE terms have no cp (not proposed)
        return [1]
    if sp_.cp is not None:
        return [c for c in sp_.cp if rest % c == 0 and seq % (2 * c) == 0 and (c == 1 or p == 1)]
    if seq < sp_.cp_min_seq or p > 1:
        return [1]
    return [c for c in divisors(rest) if seq % (2 * c) == 0]


def search(pb: Problem, space: Space | None = None, keep_oom: int = 3) -> Result:
    """Every valid plan, estimated; returns them ranked by step time (fitting ones only)."""
    sp_ = space or Space()
    t0 = time.perf_counter()
    sh, world, batch = pb.shape, pb.world, pb.global_batch
    mem_cap = pb.hw.mem_gb * 1024.0**3
    tps = [t for t in _tp_options(pb) if sp_.tp is None or t in set(sp_.tp)]
    fits: list[Estimate] = []
    oom: list[Estimate] = []
    floors: list[tuple[float, str]] = []  # (state bytes, layout) of layouts skipped whole
    n = 0
    for t in tps:
        for p, cp in ((q, c) for q in _pp_options(pb, t) for c in _cp_options(pb, sp_, t, q)):
            if sp_.pp is not None and p not in set(sp_.pp):
                continue
            d = world // (t * p * cp)
            if batch % d:
                continue
            per_rank = batch // d
            micros = [b for b in divisors(per_rank) if b <= sp_.max_micro]
            vs = [1] + ([v for v in range(2, sp_.max_interleave + 1) if p * v <= sh.layers] if p > 1 else [])
            eps = [e for e in ep_options(pb, t, d) if sp_.ep is None or e in set(sp_.ep)]
            for zero, ep in ((z, e) for z in sp_.zero for e in eps):
                if zero and d * cp == 1 and Plan(dp=d, tp=t, pp=p, micro=1, ep=ep).edp == 1:
                    continue  # nothing to shard over
                if zero == 1 and cp > 1:
                    continue  # the runtime's ZeRO-1 shards over dp only (refused with cp)
                floor = _state_floor(pb, t, p, d * cp, zero, ep)  # FSDP shards over dp x cp
                if floor > mem_cap:
                    floors.append((floor, f"dp={d} tp={t} pp={p}{f' ep={ep}' if ep > 1 else ''}"
                                   f"{f' cp={cp}' if cp > 1 else ''} zero{zero}"))
                    continue
                for v in vs:
                    for rc in sp_.recompute:
                        for sq in sp_.sequence_parallel:
                            if sq and t == 1:
                                continue
                            if not sq and t > 1 and sp_.allow is None and True in sp_.sequence_parallel:
                                continue  # dominated: sequence parallel is no slower and uses less memory
                            for b in micros:
                                m = per_rank // b
                                if v > 1 and m % p:
                                    continue
                                plan = Plan(dp=d, tp=t, pp=p, micro=b, v=v, zero=zero, recompute=rc, sp=sq, ep=ep,
                                            cp=cp)
                                if sp_.allow is not None and not sp_.allow(plan):
                                    continue
                                est = estimate(pb, plan)
                                n += 1
                                if est.fits:
                                    fits.append(est)
                                else:
                                    oom.append(est)
                                    break  # larger micro-batches need more memory
    fits.sort(key=lambda e: (e.step_time * (1 + TIE_BREAK * complexity(e.plan)), e.peak_memory))
    oom.sort(key=lambda e: e.step_time)
    res = Result(ranked=fits, oom=oom[:keep_oom], evaluated=n, seconds=time.perf_counter() - t0, problem=pb)
    if not fits and not oom and floors:
        floor, label = min(floors)
        res.limit = (f"even the smallest layout state ({label}) needs {floor / 1024**3:.1f} GiB per rank for "
                     f"weights + gradients + optimizer alone, over the {pb.hw.mem_gb:g} GiB of a "
                     f"{pb.hw.name}: use more GPUs (cluster.nodes) or a device with more memory")
    if fits:
        for e in fits[1:]:
            res.reasons[id(e)] = why_lost(e, fits[0])
    for e in res.oom:
        res.reasons[id(e)] = (f"OOM: needs {e.peak_memory / 1024**3:.1f} GiB of {pb.hw.mem_gb:g} GiB "
                              f"({_largest(e.memory)} largest)")
    return res


TIE_BREAK = 0.002  # per feature: within model noise, prefer the plan with fewer moving parts


def complexity(pl: Plan) -> int:
    """How many non-default features a plan turns on (ZeRO-3 counts twice)."""
    return (min(pl.zero, 2) + (pl.recompute != "none") + pl.sp + (pl.v > 1) + (pl.tp > 1) + (pl.pp > 1)
            + (pl.ep > 1) + (pl.cp > 1))


def _largest(mem: dict[str, float]) -> str:
    return max((k for k in mem if k != "total"), key=lambda k: mem[k])


_GROUPS = {"compute": ("compute", "optimizer"), "TP communication": ("tp_comm",),
           "EP all-to-all": ("ep_comm",), "pipeline bubble": ("bubble",),
           "pipeline p2p": ("p2p",), "DP communication": ("dp_comm",), "CP K/V communication": ("cp_comm",)}


def why_lost(loser: Estimate, winner: Estimate) -> str:
    """Name the step-time component that grew most against the winner, with the figures."""
    deltas = {name: sum(loser.time[k] - winner.time[k] for k in keys) for name, keys in _GROUPS.items()}
    name = max(deltas, key=lambda k: deltas[k])
    slower = loser.step_time / winner.step_time - 1
    if deltas[name] <= 0:
        return f"ties ({100 * slower:+.1f}%)"
    cause = name
    if name == "compute" and loser.plan.recompute != winner.plan.recompute:
        cause = f"compute (recompute={loser.plan.recompute})"
    elif name == "compute" and loser.plan.micro != winner.plan.micro:
        cause = f"compute (micro-batch {loser.plan.micro} vs {winner.plan.micro})"
    return f"{cause} +{deltas[name]:.3g}s, net {100 * slower:+.1f}% step time"


def best_per_layout(res: Result, n: int = 8) -> list[Estimate]:
    """The fastest plan of each distinct (dp, cp, tp, pp, ep) layout, fastest layouts first."""
    seen: set[tuple[int, int, int, int, int]] = set()
    out: list[Estimate] = []
    for e in res.ranked:
        key = (e.plan.dp, e.plan.cp, e.plan.tp, e.plan.pp, e.plan.ep)
        if key not in seen:
            seen.add(key)
            out.append(e)
            if len(out) == n:
                break
    return out
