"""``xirang-plan target.*``: from "this loss (or tokens, or FLOPs) by this date within this budget" to a launchable run.

    xirang-plan model=llama3-8b cluster=h100-ib cluster.nodes=64 target.loss=2.0 target.deadline=30d
    xirang-plan ... target.compute=1e23 target.budget='$500000' cluster.price_per_gpu_hour=2.5

Steps: the scaling law (the user's fit beside the data, :func:`law_for`, else the published one with a
warning) gives the compute-optimal parameters N and tokens D; :func:`~xirang_hpc.planner.scaling.model_shape`
turns N into a model in the style of ``model=`` (vocab from the data's tokenizer when it has more
tokens); the batch and learning rate come from DeepSeek LLM's compute laws; the existing planner
(:func:`~xirang_hpc.planner.auto.plan_for`, the same search ``xirang-plan`` and ``parallel=auto`` run)
picks the layout and predicts the step time on ``cluster.nodes`` nodes, or on fewer when a deadline
leaves room; wall time, GPU-hours and cost follow, and the ``xirang-train`` command that launches it.
A target the deadline or the budget cannot meet is refused with the binding constraint, by how much,
and what the constraint does allow.
"""

from __future__ import annotations

import dataclasses
import math
import shlex
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from xirang_hpc.config.errors import ConfigError
from xirang_hpc.config.schema import ModelConfig, XirangConfig
from xirang_hpc.config.schema.target import deadline_seconds, parse_budget
from xirang_hpc.config.validate import check_runnable, tokenizer_vocab_size, validate
from xirang_hpc.planner.auto import apply_plan, plan_for, problem_of, runnable_space
from xirang_hpc.planner.cost import Estimate
from xirang_hpc.planner.formulas import model_params
from xirang_hpc.planner.scaling import (
    CHINCHILLA,
    CHINCHILLA_RANGE,
    FIT_FILE,
    ScalingError,
    ScalingLaw,
    data_fingerprint,
    default_warning,
    extrapolation,
    fit_range,
    global_batch_for,
    learning_rate,
    load_fit,
    model_shape,
)
from xirang_hpc.planner.search import search

INDEX = "index.json"  # a prepared data directory's index (xirang_hpc.data.prepare.INDEX)


class TargetError(ValueError):
    """A target no plan meets: the message names the binding constraint, by how much, and what it allows."""


@dataclass
class TargetPlan:
    """Everything ``xirang-plan target.*`` answers."""

    law: ScalingLaw
    law_note: str  # where the law came from (a warning for the published one)
    ask: str  # the target as given
    compute: float  # FLOPs, 6ND of the planned model
    params: int  # the planned model's parameters
    tokens: int  # training tokens (steps x batch x seq)
    loss: float  # predicted final validation loss
    loss_interval: tuple[float, float] | None
    model: ModelConfig
    global_batch: int
    steps: int
    lr: float
    nodes: int
    estimate: Estimate
    wall_s: float
    gpu_hours: float
    cost: float | None
    deadline_s: float | None
    command: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    search_seconds: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready."""
        m = self.model
        return {
            "target": self.ask, "law": {k: v for k, v in self.law.to_dict().items() if k != "samples"},
            "law_note": self.law_note, "compute_flops": self.compute, "params": self.params, "tokens": self.tokens,
            "predicted_loss": self.loss, "loss_interval": self.loss_interval,
            "model": {"n_layer": m.n_layer, "d_model": m.d_model, "n_head": m.n_head, "n_kv_head": m.n_kv_head,
                      "d_ff": m.ffn_dim, "vocab_size": m.vocab_size, "seq_len": m.seq_len},
            "global_batch": self.global_batch, "steps": self.steps, "lr": self.lr, "nodes": self.nodes,
            "plan": self.estimate.to_dict(), "step_time_s": self.estimate.step_time, "wall_s": self.wall_s,
            "gpu_hours": self.gpu_hours, "cost": self.cost, "deadline_s": self.deadline_s,
            "command": shlex.join(self.command), "notes": self.notes, "search_seconds": self.search_seconds,
        }


# ---- the law ------------------------------------------------------------------------------------------

def read_index(cfg: XirangConfig) -> dict[str, Any] | None:
    """The prepared data's ``index.json``, or None when the data is not prepared yet."""
    import json

    path = Path(cfg.data.out_dir).expanduser() / INDEX
    try:
        return dict(json.loads(path.read_text()))
    except (OSError, ValueError):
        return None


Span = tuple[tuple[float, float], tuple[float, float]]  # (parameters, tokens) ranges of the runs behind a law


def law_for(cfg: XirangConfig) -> tuple[ScalingLaw, str, Span | None]:
    """(law, note, the parameter and token ranges of the runs it was fitted on): ``target.fit``, else
    ``<data.out_dir>/scaling_fit.json`` (checked against the data's fingerprint), else the published law with
    its warning and Hoffmann et al.'s ranges."""
    index = read_index(cfg)
    fp = data_fingerprint(index) if index is not None else None
    if cfg.target.fit:
        path = Path(cfg.target.fit).expanduser()
        if not path.is_file():
            raise ConfigError("target.fit", cfg.target.fit, "no such file; give the scaling_fit.json that "
                              "xirang-plan --fit-scaling wrote, or leave target.fit empty")
    else:
        path = Path(cfg.data.out_dir).expanduser() / FIT_FILE
        if not path.is_file():
            return CHINCHILLA, default_warning(), CHINCHILLA_RANGE
    law, points = load_fit(path, fp)
    return law, f"scaling law fitted on {len(points)} runs of this data ({path})", fit_range(points) if points else None


# ---- the plan -----------------------------------------------------------------------------------------

def _template(cfg: XirangConfig) -> ModelConfig:
    """``model=`` with the vocabulary the data's tokenizer needs (padded to a multiple of 128, as Megatron
    pads it, so that tensor parallelism divides it) when that is more than ``model.vocab_size``."""
    m = cfg.model
    n = tokenizer_vocab_size(cfg.data.tokenizer, cfg.data.vocab_size or m.vocab_size)
    if n > m.vocab_size:
        m = dataclasses.replace(m, vocab_size=-(-n // 128) * 128)
    return m


def _devices_per_node(cfg: XirangConfig) -> int:
    return cfg.cluster.gpus_per_node or cfg.cluster.tasks_per_node


def _amount(cfg: XirangConfig, law: ScalingLaw) -> tuple[str, float, float]:
    """(the ask, N, D) from target.loss / tokens / compute."""
    t = cfg.target
    if t.loss is not None:
        c = law.compute_for_loss(float(t.loss))
        n, d = law.optimal(c)
        return f"target.loss={t.loss:g}", n, d
    if t.tokens is not None:
        n, _ = law.optimal_for_tokens(float(t.tokens))
        return f"target.tokens={t.tokens:g}", n, float(t.tokens)
    assert t.compute is not None
    n, d = law.optimal(float(t.compute))
    return f"target.compute={t.compute:g}", n, d


def _tokens_for(cfg: XirangConfig, law: ScalingLaw, n: float, d_opt: float) -> float:
    """Training tokens for the shaped model of ``n`` parameters (not exactly the law's N): the same FLOPs for
    target.compute, the tokens where its loss meets target.loss, the given tokens for target.tokens."""
    t = cfg.target
    if t.compute is not None:
        return float(t.compute) / (6.0 * n)
    if t.loss is not None:
        rest = float(t.loss) - law.E - law.A / n**law.alpha  # what B / D^beta may still add
        return (law.B / rest) ** (1.0 / law.beta) if rest > 0 else d_opt
    return d_opt


def _configured(cfg: XirangConfig, model: ModelConfig, nodes: int, batch: int, steps: int, lr: float) -> XirangConfig:
    # The configured warmup when it is a small part of the run (or a fraction of it), else a tenth of the steps.
    ws = cfg.train.warmup_steps
    warmup = ws if cfg.train.warmup_frac or steps > 10 * ws else steps // 10
    train = dataclasses.replace(cfg.train, global_batch=batch, max_steps=steps, lr=lr, warmup_steps=warmup,
                                grad_accum=1)
    return dataclasses.replace(cfg, model=model, train=train, cluster=dataclasses.replace(cfg.cluster, nodes=nodes),
                               parallel=dataclasses.replace(cfg.parallel, auto=False))


def _search(cfg: XirangConfig, probe: bool = False) -> tuple[Estimate | None, float, str]:
    """The planner's best plan for ``cfg`` (None when nothing fits), its search time, and why nothing fits.

    ``probe``: a narrower search (ZeRO-1/3, selective or full recompute, no interleaving, micro-batches up
    to 4) whose step time only sizes the node count; the plan shown always comes from the full search.
    """
    if probe:
        space = dataclasses.replace(runnable_space(cfg), zero=(1, 3), recompute=("selective", "full"),
                                    max_interleave=1, max_micro=4)
        res = search(problem_of(cfg), space)
        if res.ranked:
            return res.ranked[0], res.seconds, ""
    res = plan_for(cfg)
    if not res.ranked:
        return None, res.seconds, res.limit or "no layout fits in memory"
    return res.ranked[0], res.seconds, ""


def _size(n: float) -> str:
    for unit, v in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= v:
            return f"{n / v:.3g}{unit}"
    return f"{n:.3g}"


def _amount_str(x: float) -> str:
    """Thousands separated; three significant digits below 100 (a CPU run's fraction of a rank-hour)."""
    return f"{x:,.0f}" if x >= 100 else f"{x:.3g}"


def _hours(s: float) -> str:
    if s < 3600:
        return f"{s / 60:.1f} min"
    if s < 3 * 86400:
        return f"{s / 3600:.1f} h"
    return f"{s / 86400:.1f} days"


def plan_target(cfg: XirangConfig, overrides: Sequence[str] = ()) -> TargetPlan:
    """Plan ``cfg.target``; ``overrides``: the command line's own, carried into the xirang-train command."""
    t = cfg.target
    law, note, span = law_for(cfg)
    deadline = deadline_seconds(t.deadline) if t.deadline else None
    budget = parse_budget(t.budget) if t.budget else None
    price = cfg.cluster.price_per_gpu_hour or None
    if budget is not None and budget[1] == "money" and price is None:
        raise ConfigError("target.budget", t.budget, "a budget in money needs the price of a GPU-hour: set "
                          "cluster.price_per_gpu_hour=..., or give the budget in GPU-hours (target.budget=5000)")
    if t.loss is None and t.tokens is None and t.compute is None:
        if deadline is None:
            raise ConfigError("target.loss", None, "say how much to train: target.loss=, target.tokens= or "
                              "target.compute= (FLOPs), or give target.deadline= for the most the deadline allows")
        c = deadline_compute(cfg, law, deadline)
        try:
            plan = plan_target(dataclasses.replace(cfg, target=dataclasses.replace(t, compute=c)), overrides)
        except TargetError:  # the estimate overshot (the batch, and so the layout, moves with the budget)
            c *= 0.9
            plan = plan_target(dataclasses.replace(cfg, target=dataclasses.replace(t, compute=c)), overrides)
        plan.ask = f"target.deadline={t.deadline} (deadline-optimal: {c:.3g} FLOPs)"
        return plan
    ask, n_want, d_want = _amount(cfg, law)
    template = _template(cfg)
    model = model_shape(n_want, template)
    n = model_params(model)
    model = dataclasses.replace(model, name=f"plan-{_size(n).lower()}")
    d_want = _tokens_for(cfg, law, n, d_want)
    compute = 6.0 * n * d_want
    batch = global_batch_for(compute, model.seq_len)
    steps = max(1, math.ceil(d_want / (batch * model.seq_len)))
    tokens = steps * batch * model.seq_len
    lr = learning_rate(compute)
    max_nodes = cfg.cluster.nodes
    per_node = _devices_per_node(cfg)

    def at(nodes: int, probe: bool = False) -> tuple[XirangConfig, Estimate | None, float, str]:
        c = _configured(cfg, model, nodes, batch, steps, lr)
        est, secs, why = _search(c, probe)
        return c, est, secs, why

    # With a deadline, a quick probe on all nodes sizes the node count; the full search runs where it lands.
    c_max, est, searched, why = at(max_nodes, probe=deadline is not None)
    if est is None:
        raise TargetError(f"{ask}: the planned {_size(n)}-parameter model ({model.n_layer} layers x "
                          f"{model.d_model}) fits no layout on cluster.nodes={max_nodes}: {why}")
    wall = steps * est.step_time
    chosen = max_nodes
    if deadline is not None:
        # The fewest nodes (a power of two, or all of them) that meet the deadline: estimated from the
        # probe's throughput on all nodes, then checked with the full search (more nodes while it misses).
        cand = 1 << max(0, math.ceil(math.log2(max(1.0, max_nodes * wall / deadline))))
        found = None
        while found is None:
            cand = min(cand, max_nodes)
            c_try, e_try, s_try, _ = at(cand)
            searched += s_try
            if e_try is not None and (steps * e_try.step_time <= deadline or cand == max_nodes):
                found = (cand, c_try, e_try)
            cand *= 2
        chosen, c_max, est = found
        wall = steps * est.step_time
        if wall > deadline:
            need = wall / deadline
            c_dead = compute / need  # what the cluster trains by the deadline at this throughput
            raise TargetError(
                f"{ask}: the deadline binds: {_hours(wall)} on all {max_nodes} nodes of cluster.nodes "
                f"({est.plan.label()}, {est.step_time:.3g} s/step x {steps:,} steps) against {_hours(deadline)} "
                f"allowed: the deadline needs {need:.2g}x the nodes (about cluster.nodes="
                f"{math.ceil(max_nodes * need)} if throughput scaled linearly). By the deadline these nodes train "
                f"about {c_dead:.3g} FLOPs: predicted loss {law.optimal_loss(c_dead):.4g} "
                f"(target.compute={c_dead:.3g})")
    c_cfg = c_max
    gpu_hours = wall / 3600.0 * chosen * per_node
    cost = gpu_hours * price if price is not None else None
    if budget is not None:
        have = budget[0] if budget[1] == "gpu_hours" else budget[0] / float(price or 1.0)
        if gpu_hours > have:
            need = gpu_hours / have
            c_b = compute / need
            spent = f"{gpu_hours:,.0f} GPU-hours" + (f" ({cost:,.0f} at {price:g}/GPU-hour)" if cost else "")
            raise TargetError(
                f"{ask}: the budget binds: the plan needs {spent} on {chosen} nodes, the budget "
                f"target.budget={t.budget} covers {have:,.0f} GPU-hours: it needs {need:.2g}x the budget. The "
                f"budget trains about {c_b:.3g} FLOPs: predicted loss {law.optimal_loss(c_b):.4g} "
                f"(target.compute={c_b:.3g})")
    final = validate(apply_plan(c_cfg, est.plan))
    check_runnable(final)  # the command below is one xirang-train accepts
    loss = law.loss(n, tokens)
    plan = TargetPlan(law=law, law_note=note, ask=ask, compute=6.0 * n * tokens, params=n, tokens=tokens, loss=loss,
                      loss_interval=law.spread(lambda lw: lw.loss(n, tokens)), model=model, global_batch=batch,
                      steps=steps, lr=lr, nodes=chosen, estimate=est, wall_s=wall, gpu_hours=gpu_hours, cost=cost,
                      deadline_s=deadline, search_seconds=searched)
    plan.command = train_command(final, overrides)
    if t.loss is not None and (iv := law.interval("E")) is not None:
        plan.notes.append(f"irreducible loss E={law.E:.4g}, 95% interval [{iv[0]:.4g}, {iv[1]:.4g}]")
    whose = "the runs of Hoffmann et al. 2022" if law.default else "the fit's runs"
    if span is not None and (far := extrapolation(span, n, tokens, whose)) is not None:
        plan.notes.append(far)
    return plan


def deadline_compute(cfg: XirangConfig, law: ScalingLaw, deadline: float, rounds: int = 4) -> float:
    """The most compute ``cluster.nodes`` nodes train by ``deadline`` seconds: the compute-optimal model of a
    budget is shaped and probed (the planner's quick search), and the budget rescaled by deadline / wall
    time until it agrees within 10% (wall time grows about linearly in the budget at a fixed cluster)."""
    c = 1e21
    template = _template(cfg)
    for _ in range(rounds):
        n_opt, d = law.optimal(c)
        model = model_shape(n_opt, template)
        n = model_params(model)
        batch = global_batch_for(6.0 * n * d, model.seq_len)
        steps = max(1, math.ceil(d / (batch * model.seq_len)))
        est, _, why = _search(_configured(cfg, model, cfg.cluster.nodes, batch, steps, learning_rate(c)), probe=True)
        if est is None:
            raise TargetError(f"target.deadline={cfg.target.deadline}: the {_size(n)}-parameter model of "
                              f"{c:.3g} FLOPs fits no layout on cluster.nodes={cfg.cluster.nodes}: {why}")
        ratio = deadline / (steps * est.step_time)
        c *= ratio
        if abs(ratio - 1) < 0.1:
            break
    return c


# The fields the command sets; the user's own overrides of them are replaced.
_SET = ("model.n_layer", "model.d_model", "model.n_head", "model.n_kv_head", "model.d_ff", "model.d_head",
        "model.vocab_size", "model.name", "model.init_from", "cluster.nodes", "train.global_batch", "train.max_steps",
        "train.lr", "train.warmup_steps", "train.grad_accum", "parallel.auto")


def train_command(cfg: XirangConfig, overrides: Sequence[str]) -> list[str]:
    """The ``xirang-train`` command line that trains ``cfg``: the user's overrides (less ``target.*`` and the
    fields set here), then the model shape, nodes, schedule and layout."""
    par_fields = ("dp", "tp", "pp", "zero", "data_parallel", "optimizer_sharding", "dp_replicate", "microbatches",
                  "schedule", "virtual_stages", "recompute", "sequence_parallel")
    keep = []
    for o in overrides:
        key = o.partition("=")[0].lstrip("+~")
        if key.startswith("target.") or key == "target" or key in _SET or key.startswith("parallel"):
            continue
        keep.append(o)
    m, tr, p = cfg.model, cfg.train, cfg.parallel
    ours = [f"model.name={m.name}", f"model.n_layer={m.n_layer}", f"model.d_model={m.d_model}",
            f"model.n_head={m.n_head}", f"model.n_kv_head={m.n_kv_head}", f"model.d_ff={m.d_ff}",
            f"model.vocab_size={m.vocab_size}", f"cluster.nodes={cfg.cluster.nodes}",
            f"train.global_batch={tr.global_batch}", f"train.max_steps={tr.max_steps}", f"train.lr={tr.lr:.3g}",
            # a user's train.warmup_frac (kept above) sets the warm-up instead: a fixed one would contradict it
            *([] if tr.warmup_frac else [f"train.warmup_steps={tr.warmup_steps}"]), f"train.grad_accum={tr.grad_accum}"]
    for name in par_fields:
        v = getattr(p, name)
        ours.append(f"parallel.{name}={str(v).lower() if isinstance(v, bool) else v}")
    return ["xirang-train", *keep, *ours]


def render(tp: TargetPlan) -> str:
    """The human answer."""
    m, e = tp.model, tp.estimate
    iv = f" (95% interval {tp.loss_interval[0]:.4g} to {tp.loss_interval[1]:.4g})" if tp.loss_interval else ""
    lines = [] if tp.law.default else [f"law          {tp.law_note}"]  # the default's warning goes to stderr
    lines += [
        f"target       {tp.ask}",
        f"law          {tp.law.describe()}",
        f"model        {_size(tp.params)} parameters: {m.n_layer} layers x d_model {m.d_model}, {m.n_head} heads "
        f"({m.n_kv_head} key/value), MLP {m.ffn_dim} ({m.mlp}), vocab {m.vocab_size}, seq {m.seq_len}",
        f"data         {_size(tp.tokens)} tokens = {tp.steps:,} steps x {tp.global_batch} sequences x {m.seq_len} "
        f"({tp.tokens / tp.params:.1f} tokens/parameter); {tp.compute:.3g} FLOPs (6ND)",
        f"loss         predicted {tp.loss:.4g}{iv}",
        f"schedule     lr {tp.lr:.3g} (DeepSeek LLM's compute law), global batch {tp.global_batch}",
        f"layout       {e.plan.label().strip()} on {tp.nodes} node(s): {e.step_time:.3g} s/step, "
        f"{e.tokens_per_s:,.0f} tokens/s, MFU {100 * e.mfu:.1f}%, {e.peak_memory / 1024**3:.1f} GiB/rank",
        f"time         {_hours(tp.wall_s)} of training"
        + (f" (deadline {_hours(tp.deadline_s)})" if tp.deadline_s else "") + " before restarts and evaluation",
        f"cost         {_amount_str(tp.gpu_hours)} GPU-hours" + (f" = {_amount_str(tp.cost)} at the cluster's price"
                                                         if tp.cost is not None
                                                         else " (set cluster.price_per_gpu_hour for money)"),
        f"launch       {shlex.join(tp.command)}",
    ]
    lines += [f"note         {x}" for x in tp.notes]
    return "\n".join(lines)


# ---- --fit-scaling ------------------------------------------------------------------------------------

SWEEP_NAME = "scaling"  # train.name of the sweep's runs when the command line names none


def sweep_name(cfg: XirangConfig) -> str:
    """The sweep's ``train.name``: the configured one, or ``scaling`` for the default name."""
    return SWEEP_NAME if cfg.train.name == "default" else cfg.train.name


def sweep_commands(cfg: XirangConfig, overrides: Sequence[str] = (),
                   budgets: Sequence[float] | None = None, sizes: Sequence[float] | None = None) -> list[list[str]]:
    """The IsoFLOP sweep as ``xirang-train -m`` commands, one per model size, each a Hydra multirun (one array
    job on Slurm) over the step counts of the budgets: ``budgets`` x ``sizes`` runs (default
    :data:`~xirang_hpc.planner.scaling.SWEEP_BUDGETS` x :data:`~xirang_hpc.planner.scaling.SWEEP_SIZES`), on
    the configured data, tokenizer, batch and model style. Every run evaluates at its last step and warms up
    over :data:`~xirang_hpc.planner.scaling.SWEEP_WARMUP_FRAC` of its steps (the user's ``train.warmup_frac``
    when given; a fixed ``train.warmup_steps`` is left out: it would be a different share of each run)."""
    from xirang_hpc.planner.scaling import SWEEP_BUDGETS, SWEEP_SIZES, SWEEP_WARMUP_FRAC, isoflop_grid

    budgets = tuple(budgets or SWEEP_BUDGETS)
    sizes = tuple(sizes or SWEEP_SIZES)
    template = _template(cfg)
    batch, seq = cfg.train.global_batch, template.seq_len
    keep = [o for o in overrides if not o.partition("=")[0].lstrip("+~").startswith(("target", "model.", "train.name",
                                                                                      "train.max_steps",
                                                                                      "train.warmup_steps"))]
    if not any(o.partition("=")[0].lstrip("+~") == "train.warmup_frac" for o in keep):
        keep.append(f"train.warmup_frac={SWEEP_WARMUP_FRAC}")
    out = []
    grid = isoflop_grid(budgets, len(sizes), min(sizes), max(sizes))
    for n in sorted({round(r[1]) for r in grid}):
        m = model_shape(n, template, name=f"{sweep_name(cfg)}-{_size(n).lower()}")
        steps = sorted({max(10, round(c / (6.0 * model_params(m)) / (batch * seq))) for c, nn, _ in grid
                        if round(nn) == n})
        out.append(["xirang-train", "-m", f"train.name={sweep_name(cfg)}", *keep, f"model.name={m.name}",
                    f"model.n_layer={m.n_layer}", f"model.d_model={m.d_model}", f"model.n_head={m.n_head}",
                    f"model.n_kv_head={m.n_kv_head}", f"model.d_ff={m.d_ff}", f"model.vocab_size={m.vocab_size}",
                    f"train.max_steps={','.join(str(s) for s in steps)}"])
    return out


def fit_scaling(cfg: XirangConfig, overrides: Sequence[str] = (), bootstrap: int = 200) -> tuple[str, int]:
    """``xirang-plan --fit-scaling``: (report, exit status). Without finished sweep runs: the sweep to run
    (exit 0). With failed ones: refused with the list (2). Else the fit, stored as
    ``<data.out_dir>/scaling_fit.json`` with the data's fingerprint."""
    from xirang_hpc.planner.scaling import save_fit
    from xirang_hpc.planner.scaling_fit import check_points, fit
    from xirang_hpc.runs.scaling import describe_failed, sweep_runs

    name = sweep_name(cfg)
    root = Path(cfg.train.runs_root).expanduser()
    runs = sweep_runs(root, name)
    cmds = "\n".join("  " + shlex.join(c) for c in sweep_commands(cfg, overrides))
    if runs.failed:
        raise ScalingError(f"{len(runs.failed)} run(s) of the sweep {name!r} under {root} failed:\n"
                           f"{describe_failed(runs)}\nfix the cause and rerun its command (a run resumes), or remove "
                           "its directory; then rerun xirang-plan --fit-scaling")
    if not runs.points:
        return (f"no finished runs of the sweep {name!r} under {root} yet. Run the IsoFLOP sweep (each command is one "
                f"multirun; on Slurm one array job):\n{cmds}\nthen rerun xirang-plan --fit-scaling with the same "
                "overrides to fit the scaling law.", 0)
    if runs.unfinished:
        raise ScalingError(f"{len(runs.unfinished)} run(s) of the sweep {name!r} have not finished:\n"
                           + "\n".join("  " + u for u in runs.unfinished)
                           + "\nwait for them (xirang-status), then rerun xirang-plan --fit-scaling")
    check_points(runs.points)
    index = read_index(cfg)
    if index is None:
        raise ConfigError("data.out_dir", cfg.data.out_dir, "no prepared data (index.json) here: the fit is stored "
                          "beside the data it was fitted on; give the data the sweep trained on")
    law = fit(runs.points, bootstrap=bootstrap, source=f"fit of {len(runs.points)} runs of the sweep {name!r}")
    path = save_fit(Path(cfg.data.out_dir).expanduser() / FIT_FILE, law, runs.points, data_fingerprint(index),
                    extra={"sweep": name, "runs_root": str(root)})
    lines = [f"fitted {law.describe()}", f"on {len(runs.points)} runs of the sweep {name!r}; stored in {path}",
             "xirang-plan target.loss=... now plans with it (on this data)"]
    return "\n".join(lines), 0


def main(cfg: XirangConfig, fit_only: bool, as_json: bool) -> int:
    """``xirang-plan`` with a target, or ``--fit-scaling``: print the answer; the exit status."""
    import json
    import sys

    from hydra.core.hydra_config import HydraConfig

    overrides = list(HydraConfig.get().overrides.task) if HydraConfig.initialized() else []
    if fit_only:
        report, code = fit_scaling(cfg, overrides)
        print(report, flush=True)
        return code
    tp = plan_target(cfg, overrides)
    if tp.law.default:
        print(tp.law_note, file=sys.stderr, flush=True)
    print(json.dumps(tp.to_dict(), indent=2) if as_json else render(tp), flush=True)
    return 0
