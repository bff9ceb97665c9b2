"""``xirang-sbatch``: render a ready ``sbatch`` script from the same config ``xirang-train`` uses.

For users who submit by hand. The ``#SBATCH`` lines come from
:func:`xirang_hpc.submit.slurm.sbatch_parameters` (the executor's own mapping), the body from
``sbatch_templates/xirang.sbatch``; the validated config is written next to the run as JSON and
the job runs :mod:`xirang_hpc.batch.rank` on every rank, then the requeue supervisor.

    xirang-sbatch cluster=slurm cluster.partition=gpu model=gpt2-small [--out job.sbatch]
"""

from __future__ import annotations

import dataclasses
import json
import shlex
import string
import sys
from pathlib import Path
from typing import Any

import hydra
from omegaconf import DictConfig

from xirang_hpc.cli.help import maybe_print_help
from xirang_hpc.config.errors import ConfigError
from xirang_hpc.config.schema import XirangConfig
from xirang_hpc.slurm.request import setup_lines
from xirang_hpc.submit.hydra_setup import register_configs, run_app

# Inside the package (so a non-editable install has it); the repo's top-level sbatch_templates/ links here.
TEMPLATE = Path(__file__).resolve().parents[1] / "sbatch_templates" / "xirang.sbatch"
CONFIG_FILE = "job_config.json"


def _flag(key: str, value: Any) -> str:
    key = key.replace("_", "-")
    if value is True:
        return f"#SBATCH --{key}"
    return f"#SBATCH --{key}={shlex.quote(str(value))}"


def sbatch_lines(cfg: XirangConfig, run_dir: Path) -> list[str]:
    """The ``#SBATCH`` lines for ``cfg`` (same mapping as the executor; sorted, one per flag)."""
    from xirang_hpc.submit.slurm import sbatch_parameters

    p = sbatch_parameters(cfg.cluster, cfg.train.priority)
    flags: dict[str, Any] = {k: v for k, v in p.items() if k not in (
        "signal_delay_s", "array_parallelism", "stderr_to_stdout", "setup", "srun_args", "additional_parameters")}
    flags.update(p["additional_parameters"])
    flags["signal"] = f"USR2@{p['signal_delay_s']}"
    flags["job_name"] = f"xirang-{cfg.train.name}"
    flags["output"] = str(run_dir / "slurm" / "%j.out")
    flags["open_mode"] = "append"
    return [_flag(k, flags[k]) for k in sorted(flags)]


def render(cfg: XirangConfig, run_dir: Path, python: str, script_path: str = "job.sbatch",
           template: Path = TEMPLATE) -> str:
    """The sbatch script text for ``cfg`` running in ``run_dir`` with interpreter ``python``."""
    from xirang_hpc.submit.slurm import container_paths, rank_start

    c = cfg.cluster
    # The ranks: in the container when there is one; the supervisor below stays on the host.
    srun, rank_python = rank_start(c, container_paths(cfg), python)
    values = {
        "script_path": script_path,
        "signal_delay_s": c.signal_delay_s,
        "sbatch_lines": "\n".join(sbatch_lines(cfg, run_dir)),
        "setup": "\n".join(["# setup (the ranks' environment, cluster.setup)", *setup_lines(c)]),
        "run_dir": shlex.quote(str(run_dir)),
        "srun_args": "".join(f" {shlex.quote(a)}" for a in srun),
        "rank_python": " ".join(shlex.quote(a) for a in rank_python),
        "python": shlex.quote(python),
        "config_path": shlex.quote(str(run_dir / CONFIG_FILE)),
        "map_path": shlex.quote(str(run_dir / "slurm" / "run_dir.json")),
    }
    return string.Template(template.read_text()).substitute(values)


def write_job_files(cfg: XirangConfig, run_dir: Path, data_dir: Path) -> None:
    """What the rendered script reads: the config, the run-dir map and the supervisor's job file."""
    from xirang_hpc.submit.slurm import write_job_file

    (run_dir / "slurm").mkdir(parents=True, exist_ok=True)
    payload = {"config": dataclasses.asdict(cfg), "run_dir": str(run_dir), "data_dir": str(data_dir)}
    (run_dir / CONFIG_FILE).write_text(json.dumps(payload, indent=1))
    (run_dir / "slurm" / "run_dir.json").write_text(json.dumps({"": str(run_dir)}))
    write_job_file(cfg, run_dir)


_OUT: list[str] = []


@hydra.main(version_base="1.3", config_path="../conf", config_name="config")
def _app(dcfg: DictConfig) -> None:
    from xirang_hpc.data.prepare import ensure_prepared
    from xirang_hpc.submit.launch import prepare_launch
    from xirang_hpc.submit.preflight import open_run_dir

    try:
        cfg = prepare_launch(dcfg).cfg
        run_dir = open_run_dir(cfg)
        out = Path(_OUT[0]) if _OUT else run_dir / "job.sbatch"
        text = render(cfg, run_dir, sys.executable, str(out))
    except ConfigError as exc:
        print(f"xirang-sbatch: error: {exc}", file=sys.stderr)
        sys.exit(2)
    write_job_files(cfg, run_dir, ensure_prepared(cfg.data, cfg.data.out_dir))
    out.write_text(text)
    print(f"wrote {out}; submit it with: sbatch {out}", flush=True)


def main() -> None:
    """Console entry point; ``--out FILE`` chooses where the script goes (default: the run dir)."""
    argv = sys.argv[1:]
    maybe_print_help("xirang-sbatch", argv)
    if "--out" in argv:
        i = argv.index("--out")
        _OUT.append(argv[i + 1])
        argv = argv[:i] + argv[i + 2:]
    sys.argv = [sys.argv[0], *argv]
    register_configs()
    run_app("xirang-sbatch", _app)
