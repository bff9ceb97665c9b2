"""Evaluate one given layout: ``xirang-plan --layout tp=8,pp=16,dp=64,mbs=1,v=4,zero=1,recompute=selective,sp=true``.

The same estimate as the search (memory and step-time breakdown), whether it fits, and where it
ranks among the searched plans of the same problem. ``--layout config`` takes the layout from the
``parallel`` group (and ``train.grad_accum``) of the composed config, as ``xirang-train`` would run it.
"""

from __future__ import annotations

from dataclasses import dataclass

from xirang_hpc.config.schema import XirangConfig
from xirang_hpc.config.validate import resolve_zero
from xirang_hpc.planner.cost import Estimate, Plan, Problem, estimate
from xirang_hpc.planner.search import Result, Space, search

_KEYS = {"tp", "pp", "dp", "cp", "mbs", "v", "zero", "recompute", "sp", "schedule", "ep"}


def parse_layout(spec: str, pb: Problem) -> Plan:
    """A :class:`Plan` from ``key=value`` pairs; ``dp`` defaults to world/(tp*pp), ``mbs`` to 1."""
    fields: dict[str, str] = {}
    for part in filter(None, (x.strip() for x in spec.split(","))):
        key, sep, value = part.partition("=")
        if not sep or key not in _KEYS:
            raise ValueError(f"--layout: cannot read {part!r}; use key=value pairs with keys {sorted(_KEYS)}, "
                             "e.g. tp=8,pp=16,dp=64,mbs=1,v=4,zero=1,recompute=selective,sp=true "
                             "(cp=2 splits each sequence)")
        fields[key] = value
    try:
        tp, pp, cp = int(fields.get("tp", 1)), int(fields.get("pp", 1)), int(fields.get("cp", 1))
        dp = int(fields.get("dp", pb.world // (tp * pp * cp)))
        plan = Plan(dp=dp, tp=tp, pp=pp, micro=int(fields.get("mbs", 1)), v=int(fields.get("v", 1)),
                    zero=int(fields.get("zero", 0)), recompute=fields.get("recompute", "none"),
                    sp=fields.get("sp", "false").lower() in ("1", "true", "yes"),
                    schedule=fields.get("schedule", "1f1b"), ep=int(fields.get("ep", 1)), cp=cp)
    except ValueError as exc:
        raise ValueError(f"--layout {spec!r}: {exc}") from None
    check_plan(plan, pb)
    return plan


def plan_from_config(cfg: XirangConfig) -> Plan:
    """The layout ``cfg`` runs (the parallel group as validation resolved it)."""
    p, t = cfg.parallel, cfg.train
    dp = p.dp if p.dp > 0 else cfg.cluster.world_size // (p.tp * p.pp * p.cp)
    accum = p.microbatches * t.grad_accum
    zero = resolve_zero(p).zero
    v = p.virtual_stages if p.schedule == "interleaved" else 1
    return Plan(dp=dp, tp=p.tp, pp=p.pp, micro=t.global_batch // (dp * accum), v=v, zero=zero,
                recompute=p.recompute, sp=p.sequence_parallel, schedule="gpipe" if p.schedule == "gpipe" else "1f1b",
                cp=p.cp)


def check_plan(plan: Plan, pb: Problem) -> None:
    """Refuse a layout that does not tile this problem, naming the rule."""
    sh = pb.shape
    for name, n in (("heads", sh.heads), ("key/value heads", sh.n_kv), ("hidden", sh.hidden), ("ffn", sh.ffn)):
        if n % plan.tp:
            raise ValueError(f"tp={plan.tp} must divide the model's {name} ({n})")
    if plan.dp * plan.cp * plan.tp * plan.pp != pb.world:
        raise ValueError(f"dp*cp*tp*pp={plan.dp * plan.cp * plan.tp * plan.pp} must equal the {pb.world} GPUs "
                         f"({pb.nodes} nodes x {pb.per_node})")
    if plan.cp < 1 or sh.seq % (2 * plan.cp):
        raise ValueError(f"cp={plan.cp}: 2*cp must divide the sequence length {sh.seq}")
    if plan.pp * plan.v > sh.layers:
        raise ValueError(f"pp*v={plan.pp * plan.v} stages exceed the {sh.layers} layers")
    if pb.global_batch % (plan.dp * plan.micro):
        raise ValueError(f"global batch {pb.global_batch} is not a multiple of dp*mbs={plan.dp * plan.micro}")
    if plan.recompute not in ("none", "selective", "full") or plan.zero not in (0, 1, 2, 3):
        raise ValueError("recompute is none|selective|full and zero is 0..3")
    if plan.sp and plan.tp == 1:
        raise ValueError("sp=true (sequence parallelism) needs tp > 1")
    if plan.ep < 1 or (plan.ep > 1 and not sh.experts):
        raise ValueError(f"ep={plan.ep}: expert parallelism needs a mixture-of-experts model (model.moe_experts > 0); "
                         "use ep=1")
    if sh.experts and (sh.experts % plan.ep or (plan.tp * plan.dp) % plan.ep):
        ok = [e for e in range(1, sh.experts + 1) if sh.experts % e == 0 and (plan.tp * plan.dp) % e == 0]
        raise ValueError(f"ep={plan.ep} must divide the model's {sh.experts} experts and the tp*dp={plan.tp * plan.dp} "
                         f"ranks of a pipeline stage; choose ep from {ok}")


@dataclass
class Evaluation:
    """A given layout's estimate and its place among the searched plans."""

    estimate: Estimate
    rank: int | None  # 1 = as fast as the best fitting plan; None when it does not fit
    searched: Result

    @property
    def slower_than_best(self) -> float | None:
        """Step time over the recommended plan's, minus one (0.1 = 10% slower)."""
        if not self.searched.ranked:
            return None
        return self.estimate.step_time / self.searched.ranked[0].step_time - 1


def evaluate(pb: Problem, plan: Plan, space: Space | None = None) -> Evaluation:
    """Estimate ``plan`` and rank it among every fitting plan the search (over ``space``) finds."""
    est = estimate(pb, plan)
    res = search(pb, space)
    rank = None
    if est.fits:
        rank = 1 + sum(1 for e in res.ranked if e.step_time < est.step_time * (1 - 1e-9))
    return Evaluation(est, rank, res)
