"""``xirang-pipeline``: prepare -> train -> eval -> serve from one composed config.

    xirang-pipeline [hydra overrides]            # e.g. cluster=testbed eval.max_val_loss=2.5
    xirang-pipeline --status RUN_DIR [--json]    # the whole chain, stage by stage

On Slurm (``cluster.executor=slurm``) the four stages are submitted at once as four jobs, each
depending on the previous one (``afterok``); the command prints the job ids and returns. On the
local executor they run in sequence here; a failing stage stops the chain (exit code 1).
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

import hydra
from omegaconf import DictConfig

from xirang_hpc.cli.help import maybe_print_help
from xirang_hpc.config.errors import ConfigError
from xirang_hpc.config.schema import XirangConfig
from xirang_hpc.eval.harness import check_tasks
from xirang_hpc.job.stages import STAGE_FNS, dpo_stage, serve_stage, train_stage
from xirang_hpc.monitor import audit
from xirang_hpc.runs.chain import (
    PREFERENCE_STAGES,
    STAGE_DIR,
    STAGES,
    chain_status,
    format_chain,
    stage_record,
    write_pipeline,
    write_stage,
)
from xirang_hpc.submit.hydra_setup import register_configs, run_app
from xirang_hpc.submit.launch import prepare_launch
from xirang_hpc.submit.preference import preference_config
from xirang_hpc.submit.preflight import corrupt_message, open_run_dir, preflight
from xirang_hpc.submit.rundir import run_dir_for


def _fail(msg: str, code: int = 2) -> None:
    print(f"xirang-pipeline: error: {msg}", file=sys.stderr, flush=True)
    sys.exit(code)


def _data_dir(cfg: XirangConfig) -> Path:
    return Path(cfg.data.out_dir).expanduser().absolute()


def _stage_executor(cfg: XirangConfig, folder: Path, name: str, dep: str | None) -> Any:
    """A one-task Slurm job for prepare/eval/serve, on the cluster's (normal) partition."""
    import submitit

    from xirang_hpc.slurm.request import SlurmRequest

    params = SlurmRequest.from_cluster(cfg.cluster, cfg.train.priority).stage().submitit_params(requeue=False)
    params["job_name"] = f"xirang-{cfg.train.name}-{name}"
    params["additional_parameters"].update(_dep_params(dep))
    ex = submitit.SlurmExecutor(folder=folder, max_num_timeout=0)
    ex.update_parameters(**params)
    return ex


def _dep_params(dep: str | None) -> dict[str, Any]:
    return {"dependency": f"afterok:{dep}", "kill_on_invalid_dep": "yes"} if dep else {}


def _submit_train(cfg: XirangConfig, run_dir: Path, data_dir: Path, dep: str, stage: str = "train",
                  pipeline_dir: Path | None = None) -> Any:
    """The training job exactly as xirang-train submits it (requeue supervisor included), plus the dependency.

    ``stage="dpo"``: the DPO run (``cfg`` its config, ``run_dir`` its own directory), recording its stage in the
    pipeline's run directory ``pipeline_dir``."""
    from xirang_hpc.monitor.events import append_event
    from xirang_hpc.submit import slurm

    folder = run_dir / "submitit"
    slurm.write_job_file(cfg, run_dir)
    slurm.write_run_dir_map(folder, [run_dir], array=False)
    ex = slurm.make_slurm_executor(cfg.cluster, folder, cfg.train.priority, paths=slurm.container_paths(cfg))
    extra = {**slurm.sbatch_parameters(cfg.cluster, cfg.train.priority)["additional_parameters"], **_dep_params(dep)}
    ex.update_parameters(job_name=f"xirang-{cfg.train.name}-{stage}", additional_parameters=extra)
    if stage == "dpo":
        assert pipeline_dir is not None
        job = ex.submit(dpo_stage, dataclasses.asdict(cfg), str(run_dir), str(data_dir), str(pipeline_dir))
    else:
        job = ex.submit(train_stage, dataclasses.asdict(cfg), str(run_dir), str(data_dir))
    append_event(run_dir, "submit", "submitted", job=str(job.job_id), cluster=cfg.cluster.name,
                 nodes=cfg.cluster.nodes, tasks_per_node=cfg.cluster.tasks_per_node, stage=stage)
    audit.record(run_dir, "launch", str(job.job_id), stage=stage, argv=sys.argv[1:])
    return job


def _done_note(step: int) -> str:
    return f"run already complete at step {step}; no training job submitted"


def launch_slurm_chain(cfg: XirangConfig, run_dir: Path, train_done_at: int | None = None,
                       pref: XirangConfig | None = None, pref_done_at: int | None = None) -> list[dict[str, Any]]:
    """Submit the stages as dependent Slurm jobs; returns the chain as recorded in pipeline.json.

    ``train_done_at``: the run is already complete at this step, so no training job is submitted
    (the stage is recorded as completed, and eval depends on prepare directly). ``pref``: the DPO run's config
    (:func:`preference_config`), for the chain with a preference stage; ``pref_done_at`` as ``train_done_at``
    for the DPO run.
    """
    data_dir, cfg_dict = _data_dir(cfg), dataclasses.asdict(cfg)
    pref_kw = {} if pref is None else {"pref": dataclasses.asdict(pref)}
    done = {"train": train_done_at, "dpo": pref_done_at}
    stages: list[dict[str, Any]] = []
    prev: str | None = None
    for name in STAGES if pref is None else PREFERENCE_STAGES:
        if done.get(name) is not None:
            write_stage(run_dir, name, "completed", note=_done_note(done[name]))
            stages.append({"stage": name, "job_id": None, "depends_on": None})
            write_pipeline(run_dir, "slurm", stages)
            continue
        if name == "train":
            assert prev is not None
            job = _submit_train(cfg, run_dir, data_dir, prev)
        elif name == "dpo":
            assert prev is not None and pref is not None
            pref_run = open_run_dir(pref)
            job = _submit_train(pref, pref_run, _data_dir(pref), prev, stage="dpo", pipeline_dir=run_dir)
        else:
            ex = _stage_executor(cfg, run_dir / STAGE_DIR / name, name, prev)
            kw = pref_kw if name in ("prepare", "eval", "serve") else {}
            job = ex.submit(STAGE_FNS[name], cfg_dict, str(run_dir), str(data_dir), **kw)
        stages.append({"stage": name, "job_id": str(job.job_id), "depends_on": prev,
                       "stdout": str(job.paths.stdout)})
        prev = str(job.job_id)
        write_pipeline(run_dir, "slurm", stages)  # after each submit: a partial chain is still visible
    return stages


def run_local_chain(cfg: XirangConfig, run_dir: Path, pref: XirangConfig | None = None) -> bool:
    """Run the stages in sequence on this machine; False (after recording why) when one fails.

    ``pref``: the DPO run's config (:func:`preference_config`), for the chain with a preference stage."""
    from xirang_hpc.cli.train import launch

    data_dir, cfg_dict = _data_dir(cfg), dataclasses.asdict(cfg)
    names = STAGES if pref is None else PREFERENCE_STAGES
    kw = {} if pref is None else {"pref": dataclasses.asdict(pref)}
    write_pipeline(run_dir, "local", [{"stage": s, "job_id": None, "depends_on": None} for s in names])
    for name in names:
        print(f"== pipeline stage {name}", flush=True)
        try:
            if name in ("train", "dpo"):  # the usual local launch (submitit local executor, all ranks), blocking
                run_cfg = cfg if name == "train" else pref
                assert run_cfg is not None
                with stage_record(run_dir, name, **({} if name == "train" else {"dpo_run": run_cfg.train.run_dir})):
                    launch(dataclasses.replace(run_cfg, train=dataclasses.replace(run_cfg.train, wait=True)))
            elif name == "serve":
                serve_stage(cfg_dict, str(run_dir), str(data_dir), log=lambda m: print(m, flush=True), **kw)
            elif name == "export":
                out = STAGE_FNS[name](cfg_dict, str(run_dir), str(data_dir))
                print(f"export: step {out['step']} of the train stage -> {out['model_dir']}"
                      + (" (LoRA adapters merged into the base)" if out["merged_lora"] else "")
                      + (" (kept: already exported)" if out["reused"] else ""), flush=True)
            else:
                out = STAGE_FNS[name](cfg_dict, str(run_dir), str(data_dir), **kw)
                if name == "eval":
                    print(f"eval: val loss {out['val_loss']:.4f} | perplexity {out['perplexity']:.2f} | "
                          f"sample {out['sample'][:60]!r}", flush=True)
        except (Exception, SystemExit) as exc:  # noqa: BLE001 - xirang-train's launch exits on failure
            if isinstance(exc, SystemExit) and exc.code in (0, None):
                continue
            if not (run_dir / STAGE_DIR / f"{name}.json").exists():
                write_stage(run_dir, name, "failed", error=str(exc))
            print(format_chain(chain_status(run_dir)), flush=True)
            return False
    print(format_chain(chain_status(run_dir)), flush=True)
    return True


@hydra.main(version_base="1.3", config_path="../conf", config_name="config")
def _app(dcfg: DictConfig) -> None:
    try:
        # A complete run is not trained again, but its other stages (eval, export, serve) still run.
        ln = prepare_launch(dcfg)
        cfg, status = ln.cfg, ln.status
        check_tasks(cfg.eval)  # a harness task that would need a download: refused before any stage runs
        # The preference stage's DPO run, checked against the train stage before anything is written or started.
        pref = preference_config(cfg, run_dir_for(cfg)) if cfg.preference.enabled else None
        pref_status = preflight(pref) if pref is not None else None
    except ConfigError as exc:
        _fail(str(exc))
    if (damaged := corrupt_message(status)) is not None:
        print(damaged, file=sys.stderr, flush=True)
    run_dir = open_run_dir(cfg)
    if pref is not None and run_dir != run_dir_for(cfg):  # train.resume_from forked the run: the chain lives there
        pref = preference_config(cfg, run_dir)
        pref_status = preflight(pref)
    if cfg.cluster.executor == "slurm":
        pref_done = pref_status.last_step if pref_status is not None and pref_status.complete else None
        stages = launch_slurm_chain(cfg, run_dir, status.last_step if status.complete else None, pref, pref_done)
        chain = " -> ".join(f"{s['stage']} ({s['job_id']})" for s in stages)
        print(f"submitted pipeline: {chain} | run dir {run_dir}", flush=True)
        print(f"follow it with: xirang-pipeline --status {run_dir}", flush=True)
        return
    if not run_local_chain(cfg, run_dir, pref):
        sys.exit(1)


def status_main(argv: list[str]) -> int:
    """``--status RUN_DIR [--json]``: print the chain; exit 1 when a stage failed."""
    run = Path(argv[0])
    try:
        chain = chain_status(run)
    except FileNotFoundError as exc:
        print(f"xirang-pipeline: error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(chain, indent=1) if "--json" in argv else format_chain(chain))
    return 1 if chain["status"].startswith("failed") else 0


def main() -> None:
    """Console entry point."""
    maybe_print_help("xirang-pipeline", sys.argv[1:])
    if len(sys.argv) > 1 and sys.argv[1] == "--status":
        if len(sys.argv) < 3:
            _fail("usage: xirang-pipeline --status RUN_DIR [--json]")
        sys.exit(status_main(sys.argv[2:]))
    register_configs()
    run_app("xirang-pipeline", _app)
