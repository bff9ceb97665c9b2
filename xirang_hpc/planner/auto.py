"""``parallel=auto``: plan at launch, restricted to what this build's runtime can run.

The capability set is not a hand-kept list: a plan is allowed when it can be written into
``ParallelConfig`` (interleaving v > 1 = ``schedule=interleaved, virtual_stages=v``; ZeRO stage =
``parallel.zero``, every stage with any tp and pp) and the resulting config passes :func:`validate`
and :func:`check_runnable`. When the runtime learns a layout, the planner follows. ``xirang-plan``
ranks through the same filter, so every plan it shows runs.

Micro-batches: with pp > 1 the plan's m microbatches go to ``parallel.microbatches``; with pp = 1
they become ``train.grad_accum`` (the data-parallel trainer accumulates over them).
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

from xirang_hpc.config.errors import ConfigError
from xirang_hpc.config.schema import XirangConfig
from xirang_hpc.config.validate import check_runnable, validate
from xirang_hpc.files import write_json_atomic
from xirang_hpc.planner.cost import Estimate, Plan, Problem
from xirang_hpc.planner.formulas import Shape
from xirang_hpc.planner.hardware import hardware_for, with_precision
from xirang_hpc.planner.search import Result, Space, search

log = logging.getLogger("xirang.plan")
PLAN_FILE = "plan.json"


def problem_of(cfg: XirangConfig) -> Problem:
    """The planning problem a config describes."""
    c = cfg.cluster
    hw = with_precision(hardware_for(c), cfg.train.precision)
    return Problem(Shape.from_model(cfg.model), hw, c.nodes, c.tasks_per_node, cfg.train.global_batch)


def expressible(plan: Plan, cfg: XirangConfig | None = None) -> bool:
    """Every ZeRO stage composes with tp and pp (``parallel.zero``); interleaving needs a pipeline. What the
    runtime refuses beyond that (expert parallelism with tp or pp, say) the validation of the written config
    says (:func:`runtime_allows`)."""
    return plan.v == 1 or plan.pp > 1


def apply_plan(cfg: XirangConfig, plan: Plan) -> XirangConfig:
    """``cfg`` with the plan's degrees written in (not validated)."""
    if not expressible(plan, cfg):
        raise ValueError(f"plan {plan.label()} cannot be expressed in ParallelConfig (interleaving without pp)")
    m = cfg.train.global_batch // (plan.dp * plan.micro)
    par = dataclasses.replace(
        cfg.parallel, dp=plan.dp, tp=plan.tp, pp=plan.pp, cp=plan.cp, zero=plan.zero,
        data_parallel="fsdp" if plan.zero >= 2 else "ddp", optimizer_sharding=plan.zero >= 1, dp_replicate=1,
        microbatches=m if plan.pp > 1 else 1,
        schedule="interleaved" if plan.v > 1 else ("gpipe" if plan.schedule == "gpipe" else "1f1b"),
        virtual_stages=plan.v if plan.v > 1 else cfg.parallel.virtual_stages, recompute=plan.recompute,
        sequence_parallel=plan.sp, ep=plan.ep)
    train = dataclasses.replace(cfg.train, grad_accum=1 if plan.pp > 1 else m)
    return dataclasses.replace(cfg, parallel=par, train=train)


def runtime_allows(cfg: XirangConfig) -> Callable[[Plan], bool]:
    """Predicate: the runtime of this build can run ``plan`` for ``cfg``."""
    cache: dict[tuple[int, ...], bool] = {}

    def ok(plan: Plan) -> bool:
        if not expressible(plan, cfg):
            return False
        if plan.pp > 1 and cfg.train.global_batch // (plan.dp * plan.micro) < plan.pp:
            return False  # torch's 1F1B needs at least as many microbatches as stages
        if plan.tp > 1 and cfg.model.moe_experts:
            # The runtime keeps every expert whole on each tp rank (only the attention is split); the cost
            # model splits experts over tp or draws ep from tp*dp ranks (Megatron-Core), so such a plan
            # would be priced as another layout than the one that runs. Not proposed.
            return False
        key = (plan.dp, plan.cp, plan.tp, plan.pp, plan.ep, plan.v, plan.zero, plan.sp,
               ("none", "selective", "full").index(plan.recompute))
        if key not in cache:
            try:
                c2 = apply_plan(cfg, dataclasses.replace(plan, micro=cfg.train.global_batch // plan.dp))
                check_runnable(validate(c2))
                cache[key] = True
            except ConfigError:
                cache[key] = False
        return cache[key]

    return ok


def runnable_space(cfg: XirangConfig) -> Space:
    """The search space of ``cfg``: every knob, vetoed by :func:`runtime_allows`.

    A config error that no layout can cure (a bad ``train.*`` or ``data.*`` value) is raised here,
    naming its field, instead of surfacing as "no plan fits".
    """
    world, batch = cfg.cluster.world_size, cfg.train.global_batch
    dp = math.gcd(world, batch)  # a layout that tiles the batch (best effort: the checks stop at the first error)
    try:
        check_runnable(validate(apply_plan(cfg, Plan(dp=dp, tp=1, pp=world // dp, micro=batch // dp))))
    except ConfigError as exc:
        if not (exc.field.startswith("parallel.") or exc.field in ("train.global_batch", "train.grad_accum")):
            raise
    return Space(allow=runtime_allows(cfg))


def plan_for(cfg: XirangConfig) -> Result:
    """Search the plans for ``cfg``: only layouts this runtime runs are ranked."""
    return search(problem_of(cfg), runnable_space(cfg))


def choose(cfg: XirangConfig) -> tuple[XirangConfig, dict[str, Any]]:
    """Fill in ``cfg.parallel`` from the best runnable plan; returns the new config and the record."""
    res = plan_for(cfg)
    if not res.ranked:
        raise ConfigError("parallel.auto", True,
                          f"no runnable plan fits {res.problem.hw.mem_gb:g} GiB per rank for "
                          f"train.global_batch={cfg.train.global_batch} on {res.problem.world} ranks; "
                          "lower the batch or the model size, or set the layout by hand")
    best: Estimate = res.best
    new = validate(apply_plan(cfg, best.plan))
    record = {"predicted": best.to_dict(), "hardware": dataclasses.asdict(res.problem.hw),
              "evaluated": res.evaluated, "search_seconds": res.seconds, "runnable_only": True}
    return new, record


def announce(record: dict[str, Any], say: Callable[[str], None] = print) -> None:
    """Log the chosen plan and its predicted figures."""
    p = record["predicted"]
    mem = p["memory_gib"]
    say(f"parallel=auto chose {p['label']} ({record['evaluated']} plans in {1e3 * record['search_seconds']:.0f} ms): "
        f"predicted {p['time_s']['total']:.3f} s/step, {p['tokens_per_s']:,.0f} tokens/s, "
        f"{mem['total']:.2f} GiB/rank on {record['hardware']['name']}")


def write_plan(run_dir: Path, record: dict[str, Any]) -> Path:
    """Store the prediction as ``run_dir/plan.json`` (0600)."""
    path = Path(run_dir) / PLAN_FILE
    write_json_atomic(path, record, indent=2, sort_keys=True)
    return path
