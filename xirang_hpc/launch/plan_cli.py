"""``xirang-plan``: rank parallel plans for a model on a cluster, or calibrate the cluster.

    xirang-plan model=gpt-175b cluster=a100-80gb-ib cluster.nodes=192 train.global_batch=1536
    xirang-plan --json --top 3 model=gpt-7b cluster=h100-ib
    xirang-plan --calibrate cluster=local [--out conf/cluster/local-calibrated.yaml] [--rounds N]
    xirang-plan --layout tp=8,pp=16,dp=64,mbs=1,v=4,zero=1,recompute=selective,sp=true model=llama3-405b ...
    xirang-plan --layout config parallel=dp2xtp2    # the layout of the parallel group, as xirang-train runs it
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
import os
import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig

from xirang_hpc.config.errors import ConfigError
from xirang_hpc.config.schema import ClusterConfig, XirangConfig
from xirang_hpc.config.validate import to_typed
from xirang_hpc.launch.cli_help import maybe_print_help
from xirang_hpc.launch.hydra_setup import register_configs, run_app

_OPTS: argparse.Namespace = argparse.Namespace(json=False, top=5, runnable=False, calibrate=False, out="", layout="",
                                               rounds=None, fit_scaling=False)


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
    from xirang_hpc.launch.rundir import make_private_dir
    from xirang_hpc.planner.calibrate import write_preset

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
    from xirang_hpc.launch.executors import make_executor
    from xirang_hpc.planner.calibrate import calibration_job

    ex = make_executor(cluster, folder, watch_pid=os.getpid())  # locally: ends with xirang-plan
    ex.update_parameters(name="xirang-calibrate")
    job = ex.submit(calibration_job, dataclasses.asdict(cluster), str(folder), cluster.gpus_per_node == 0, rounds)
    return job.results()[0]


@hydra.main(version_base="1.3", config_path="../conf", config_name="config")
def _app(dcfg: DictConfig) -> None:
    try:
        cfg = typed_config(dcfg)
        if _OPTS.fit_scaling or cfg.target.active:  # plan from a target, or fit its scaling law
            from xirang_hpc.launch import plan_target

            sys.exit(plan_target.main(cfg, _OPTS.fit_scaling, _OPTS.json))
        if _OPTS.calibrate:
            calibrate(cfg, _OPTS.out, _OPTS.rounds)
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
    ap.add_argument("--fit-scaling", action="store_true")
    return ap.parse_known_args(argv)


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
    sys.argv = [sys.argv[0], *rest]
    register_configs()
    run_app("xirang-plan", _app)
