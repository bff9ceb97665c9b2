"""``xirang-plan``: rank parallel plans for a model on a cluster, or calibrate the cluster.

    xirang-plan model=gpt-175b cluster=a100-80gb-ib cluster.nodes=192 train.global_batch=1536
    xirang-plan --json --top 3 model=gpt-7b cluster=h100-ib
    xirang-plan --calibrate cluster=local [--out conf/cluster/local-calibrated.yaml] [--rounds N]
    xirang-plan --layout tp=8,pp=16,dp=64,mbs=1,v=4,zero=1,recompute=selective,sp=true model=llama3-405b ...
    xirang-plan --layout config parallel=dp2xtp2    # the layout of the parallel group, as xirang-train runs it
    xirang-plan --goodput model=llama3-405b cluster=h100-ib cluster.nodes=2048 goodput.days=54 [goodput.KEY=VALUE]
    xirang-plan model=llama3-8b cluster=h100-ib cluster.nodes=64 target.loss=2.0 target.deadline=30d
    xirang-plan --fit-scaling [data=...]            # the sweep to run, then the scaling law from its runs

The same Hydra config groups as xirang-train; the parallel group is ignored (the planner chooses it).
Every ranked plan is one this build's runtime runs (the search is vetoed by config validation, as
``parallel=auto``'s); ``--runnable``, which used to ask for that, is accepted and changes nothing.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
from pathlib import Path
from typing import Any

import hydra
from omegaconf import DictConfig

from xirang_hpc.cli.help import maybe_print_help
from xirang_hpc.config.errors import ConfigError
from xirang_hpc.config.schema import ClusterConfig, XirangConfig
from xirang_hpc.config.validate import to_typed
from xirang_hpc.submit.hydra_setup import register_configs, run_app

_OPTS: argparse.Namespace = argparse.Namespace(json=False, top=5, runnable=False, calibrate=False, out="", layout="",
                                               rounds=None, goodput=False, sim={},
                                               fit_scaling=False)


def _fail(msg: str, code: int = 2) -> None:
    print(f"xirang-plan: error: {msg}", file=sys.stderr, flush=True)
    sys.exit(code)


def typed_config(dcfg: DictConfig) -> XirangConfig:
    """Typed config without the cross-group layout checks (the layout is what we are choosing); the same
    conversion as every other command (``model.init_from`` applied, unknown fields refused)."""
    return to_typed(dcfg)


def plan(cfg: XirangConfig, as_json: bool, top: int) -> str:
    """The ranked plans for ``cfg`` (all runnable) as text or JSON."""
    return plan_result(cfg, as_json, top)[0]


def plan_result(cfg: XirangConfig, as_json: bool, top: int) -> tuple[str, str | None]:
    """(:func:`plan`'s report, why no layout fits or None when one does)."""
    from xirang_hpc.planner.auto import plan_for
    from xirang_hpc.planner.report import render, to_json

    res = plan_for(cfg)
    report = json.dumps(to_json(res, top), indent=2) if as_json else render(res, top)
    why = None
    if not res.ranked:
        why = (f"no layout of model {cfg.model.name} fits {res.problem.hw.mem_gb:g} GiB per rank on "
               f"{res.problem.world} ranks with train.global_batch={cfg.train.global_batch}: "
               + (res.limit or "use more nodes (cluster.nodes=), a device with more memory, or a smaller model "
                  "or batch"))
    return report, why


def evaluate_layout(cfg: XirangConfig, spec: str, as_json: bool) -> str:
    """One given layout's breakdown, fit and rank among the searched plans."""
    from xirang_hpc.planner.auto import problem_of, runnable_space
    from xirang_hpc.planner.evaluate import evaluate, parse_layout, plan_from_config
    from xirang_hpc.planner.report import render_evaluation

    pb = problem_of(cfg)
    plan = plan_from_config(cfg) if spec == "config" else parse_layout(spec, pb)
    ev = evaluate(pb, plan, runnable_space(cfg))
    if as_json:
        return json.dumps(dict(ev.estimate.to_dict(), rank=ev.rank, fitting=len(ev.searched.ranked),
                               slower_than_best=ev.slower_than_best), indent=2)
    return render_evaluation(ev)


def calibrate(cfg: XirangConfig, out: str, rounds: int | None = None) -> Path:
    """Measure the cluster and save a preset; returns its path. ``rounds``: rounds of probe runs (CPU
    clusters; default ``planner.defaults.PROBE_ROUNDS``)."""
    from xirang_hpc.planner.calibrate import write_preset
    from xirang_hpc.submit.rundir import make_private_dir

    name = f"{cfg.cluster.name}-calibrated"
    path = Path(out) if out else Path("conf") / "cluster" / f"{name}.yaml"
    work = make_private_dir(Path(cfg.train.runs_root).expanduser().absolute() / "calibrate")
    print(f"calibrating {cfg.cluster.name}: {cfg.cluster.nodes} node(s) x {cfg.cluster.tasks_per_node} ranks ...",
          flush=True)
    fields = run_calibration(cfg.cluster, work / "submitit", rounds)
    for k, v in sorted(fields.items()):
        print(f"  {k:20s} {v:.6g}")
    write_preset(cfg.cluster, fields, path, path.stem, rounds=rounds)
    print(f"wrote {path}; use it with cluster={path.stem}", flush=True)
    return path


def run_calibration(cluster: ClusterConfig, folder: Path, rounds: int | None = None) -> dict[str, float]:
    """Submit :func:`~xirang_hpc.planner.calibrate.calibration_job` to the cluster; rank 0's figures."""
    from xirang_hpc.planner.calibrate import calibration_job
    from xirang_hpc.submit.executors import make_executor

    ex = make_executor(cluster, folder, watch_pid=os.getpid())  # locally: ends with xirang-plan
    ex.update_parameters(name="xirang-calibrate")
    job = ex.submit(calibration_job, dataclasses.asdict(cluster), str(folder), cluster.gpus_per_node == 0, rounds)
    return job.results()[0]


# goodput.KEY: (default, meaning); "" defaults come from the config or the planner (goodput_inputs).
GOODPUT_KEYS: dict[str, str] = {
    "days": "days of wall time simulated (default 30)",
    "seeds": "Monte Carlo repetitions (default 32); goodput.seed the first seed (default 0)",
    "seed": "the random seed (default 0)",
    "spares": "spare nodes of the configured setting (default cluster.spare_nodes)",
    "step_s": "seconds per step (default: the planner's recommended layout)",
    "shrink_nodes": "nodes a lost node takes out of a shrunk restart with no spare left (default: one "
                    "data-parallel replica of the planner's layout; 0 = requeue instead)",
    "interval_s": "compute between checkpoints (default checkpoint.every_steps x step_s)",
    "memory_every_s": "compute between in-memory copies (default checkpoint.memory_every_steps, else 1, x step_s)",
    "hardware_per_node_day": "interruptions per node per day: GPU and host hardware (default Llama 3's)",
    "network_per_node_day": "... network switch, cable, NIC (default Llama 3's)",
    "software_per_node_day": "... software bugs, NCCL timeouts (default Llama 3's)",
    "planned_per_node_day": "... planned maintenance, preemption (default Llama 3's)",
    "startup_s": "process start -> first step (default 7.3, measured)",
    "requeue_recovery_s": "fault -> requeued job's processes start (default 19.6, measured)",
    "requeue_hold_s": "Slurm's hold of a requeued job (default 146, 0 with requeue.start_now=true)",
    "queue_wait_s": "pending time of a (re)queued job (default 0)",
    "injob_recovery_s": "fault -> first step of an in-job restart (default 10.8, measured)",
    "memory_restore_s": "restore from memory instead of the checkpoint load (default 0.4, measured)",
    "checkpoint_bytes": "one checkpoint's size (default 12 bytes per parameter of the model)",
    "stall_gbps": "snapshot rate per GPU (default 13.4, measured)",
    "write_gbps": "write rate per node (default 1.31, measured)",
    "read_gbps": "read rate per node (default 3.55, measured)",
    "fs_gbps": "the file system's aggregate bandwidth, 0 = no limit (default 0)",
    "synchronous": "1 = the training waits for each write (default: not checkpoint.async_save)",
    "snapshot_s": "the stall per checkpoint, instead of the scaled one",
    "write_s": "the write until durable, instead of the scaled one",
    "load_s": "the checkpoint load, instead of the scaled one",
    "exclude_on_restart": "1 = every in-job restart leaves the culprit's node, software faults too, as this "
                          "build's driver does (default 1); 0 = a software fault restarts on the same nodes",
}


def _sim_value(key: str, text: str) -> float:
    """One ``goodput.KEY=VALUE``'s number; unknown keys and non-numbers are refused by name."""
    if key not in GOODPUT_KEYS:
        import difflib

        near = difflib.get_close_matches(key, GOODPUT_KEYS, n=3)
        raise ConfigError(f"goodput.{key}", text, "unknown simulator input; "
                          + (f"did you mean {', '.join('goodput.' + k for k in near)}? " if near else "")
                          + "xirang-plan --help lists them (docs/parallel-and-planning.md)")
    try:
        v = float(text)
    except ValueError:
        raise ConfigError(f"goodput.{key}", text, "use a number") from None
    if not math.isfinite(v):
        raise ConfigError(f"goodput.{key}", text, "use a finite number")
    return v


def configured_policy(cfg: XirangConfig) -> str:
    """The recovery policy ``cfg`` runs: requeue, in-job (restarts in the allocation) or in-job+memory."""
    if cfg.requeue.max_restarts_in_job == 0:
        return "requeue"
    return "in-job+memory" if cfg.checkpoint.in_memory else "in-job"


def goodput_inputs(cfg: XirangConfig, sim: dict[str, str]) -> tuple[Any, float]:
    """The simulator's scenario for ``cfg`` and the ``goodput.*`` inputs, and the step time: size from
    ``cluster``, checkpoint size from ``model`` (as the launcher sizes it), step time from the planner's
    recommended layout, interval and spares from ``checkpoint`` and ``cluster``, hold from ``requeue``."""
    from xirang_hpc.planner.goodput_sim import CheckpointCosts, FailureModel, RecoveryCosts, Scenario
    from xirang_hpc.submit.preflight import checkpoint_bytes

    v = {k: _sim_value(k, t) for k, t in sim.items()}
    for k in ("seeds", "seed", "spares", "shrink_nodes"):
        if k in v and v[k] != int(v[k]):
            raise ConfigError(f"goodput.{k}", sim[k], "use a whole number")
    c = cfg.cluster
    nodes, per_node = c.nodes, c.gpus_per_node or c.tasks_per_node
    step, shrink = v.get("step_s"), v.get("shrink_nodes")
    if step is None or shrink is None:
        from xirang_hpc.planner.auto import plan_for

        res = plan_for(cfg)
        if res.ranked:
            best = res.best
            step = best.step_time if step is None else step
            # A shrunk restart drops the data-parallel replica of the lost node: tp x pp GPUs.
            shrink = -(-best.plan.tp * best.plan.pp // per_node) if shrink is None else shrink
        elif step is None:
            raise ConfigError("goodput.step_s", None, f"no layout of model {cfg.model.name} fits this cluster, so "
                              "the planner gives no step time; give it (goodput.step_s=SECONDS)")
    if shrink is None or cfg.requeue.min_nodes >= nodes or shrink >= nodes:
        shrink = 0  # no layout known, shrinking forbidden, or one replica is the whole job: a requeue
    if step <= 0:
        raise ConfigError("goodput.step_s", step, "use a positive step time in seconds")
    llama = FailureModel.llama3()
    failures = FailureModel(**{k: v.get(k, getattr(llama, k)) for k in
                               ("hardware_per_node_day", "network_per_node_day", "software_per_node_day",
                                "planned_per_node_day")},
                            source=llama.source if not any(k.endswith("_per_node_day") for k in v) else "given")
    base = RecoveryCosts(requeue_hold_s=0.0 if cfg.requeue.start_now else RecoveryCosts.requeue_hold_s)
    costs = RecoveryCosts(**{f: v.get(f, getattr(base, f)) for f in base.__dataclass_fields__})
    sync = bool(v.get("synchronous", 0.0 if cfg.checkpoint.async_save else 1.0))
    ck = CheckpointCosts.from_bytes(v.get("checkpoint_bytes", float(checkpoint_bytes(cfg))), nodes * per_node, nodes,
                                    **{k: v[k] for k in ("stall_gbps", "write_gbps", "read_gbps", "fs_gbps") if k in v},
                                    synchronous=sync)
    ck = CheckpointCosts(snapshot_s=v.get("snapshot_s", ck.snapshot_s), write_s=v.get("write_s", ck.write_s),
                         load_s=v.get("load_s", ck.load_s), synchronous=sync, bytes_total=ck.bytes_total)
    mem_steps = cfg.checkpoint.memory_every_steps or 1
    sc = Scenario(nodes=nodes, gpus_per_node=per_node, days=v.get("days", 30.0), failures=failures, costs=costs,
                  checkpoint=ck, interval_s=v.get("interval_s", cfg.checkpoint.every_steps * step),
                  memory_every_s=v.get("memory_every_s", mem_steps * step), spares=int(v.get("spares", c.spare_nodes)),
                  seeds=int(v.get("seeds", 32)), seed=int(v.get("seed", 0)), shrink_nodes=int(shrink),
                  min_nodes=max(1, cfg.requeue.min_nodes), exclude_on_restart=bool(v.get("exclude_on_restart", 1.0)))
    return sc, step


def goodput(cfg: XirangConfig, sim: dict[str, str], as_json: bool) -> str:
    """``--goodput``: the simulated effective training time per recovery policy and the recommendation."""
    from xirang_hpc.planner.goodput_advice import recommend
    from xirang_hpc.planner.goodput_report import render

    sc, step = goodput_inputs(cfg, sim)
    rec = recommend(sc, configured_policy(cfg))
    # The simulator lets every policy restart as often as it needs; today's budgets end a run sooner.
    conf = rec.configured
    if conf is not None and conf.policy != "requeue" and conf.restarts_in_job_max > cfg.requeue.max_restarts_in_job:
        rec.notes.append(f"as configured, an allocation needs up to {conf.restarts_in_job_max} in-job restarts "
                         f"but requeue.max_restarts_in_job={cfg.requeue.max_restarts_in_job}: the rest become "
                         "requeues (the row assumes no limit)")
    r = cfg.requeue.with_default_rates(cfg.cluster.nodes + cfg.cluster.spare_nodes, cfg.cluster.time_min)
    if conf is not None and r.enabled and r.max_requeues is not None and conf.requeues_max > r.max_requeues:
        rec.notes.append(f"as configured, the run needs up to {conf.requeues_max} requeues over "
                         f"{sc.days:g} days but requeue.max_requeues={r.max_requeues} (deprecated): it would end "
                         "max_requeues_exceeded first (the row assumes no limit)")
    if conf is not None and r.enabled:
        for field, need in conf.needed_rates(sc.days, r.budget_burst).items():
            if need > getattr(r, field):
                rec.notes.append(f"as configured, the run needs requeue.{field}={need:g} over {sc.days:g} days but "
                                 f"it is {getattr(r, field):g}: it would end requeue_budget_exceeded first "
                                 "(the row assumes no limit)")
    if as_json:
        return json.dumps(dict(rec.to_dict(), step_s=step), indent=2, default=str)
    return render(rec, step)


@hydra.main(version_base="1.3", config_path="../conf", config_name="config")
def _app(dcfg: DictConfig) -> None:
    try:
        cfg = typed_config(dcfg)
        if _OPTS.fit_scaling or cfg.target.active:  # plan from a target, or fit its scaling law
            from xirang_hpc.submit import plan_target

            sys.exit(plan_target.main(cfg, _OPTS.fit_scaling, _OPTS.json))
        if _OPTS.calibrate:
            calibrate(cfg, _OPTS.out, _OPTS.rounds)
        elif _OPTS.goodput:
            print(goodput(cfg, _OPTS.sim, _OPTS.json), flush=True)
        elif _OPTS.layout:
            print(evaluate_layout(cfg, _OPTS.layout, _OPTS.json), flush=True)
        else:
            report, why = plan_result(cfg, _OPTS.json, _OPTS.top)
            print(report, flush=True)
            if why is not None:
                _fail(why)
    except (ConfigError, ValueError) as exc:  # also a target no plan meets (plan_target.TargetError)
        _fail(str(exc))


def parse_flags(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """Split our ``--flags`` from Hydra's ``key=value`` overrides."""
    ap = argparse.ArgumentParser(prog="xirang-plan", add_help=False)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--top", type=int, default=5)
    ap.add_argument("--runnable", action="store_true")  # no-op: every ranked plan is runnable
    ap.add_argument("--calibrate", action="store_true")
    ap.add_argument("--out", default="")
    ap.add_argument("--layout", default="")
    ap.add_argument("--rounds", type=_positive, default=None)
    ap.add_argument("--goodput", action="store_true")
    ap.add_argument("--fit-scaling", action="store_true")
    opts, rest = ap.parse_known_args(argv)
    # goodput.KEY=VALUE are the simulator's inputs, not config fields: kept from Hydra.
    opts.sim = dict(a.removeprefix("goodput.").split("=", 1) for a in rest if a.startswith("goodput.") and "=" in a)
    return opts, [a for a in rest if not (a.startswith("goodput.") and "=" in a)]


def _positive(text: str) -> int:
    """``--rounds``: a whole number >= 1 (argparse reports the error with the flag's name)."""
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be a whole number >= 1, got {text!r}")
    return n


def main() -> None:
    """Console entry point."""
    global _OPTS
    maybe_print_help("xirang-plan", sys.argv[1:])
    _OPTS, rest = parse_flags(sys.argv[1:])
    if _OPTS.rounds is not None and not _OPTS.calibrate:
        _fail("--rounds applies to --calibrate only")
    if _OPTS.sim and not _OPTS.goodput:
        _fail(f"goodput.{next(iter(_OPTS.sim))}= applies to --goodput only")
    sys.argv = [sys.argv[0], *rest]
    register_configs()
    run_app("xirang-plan", _app)
