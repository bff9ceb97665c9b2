"""``xirang-eval``: evaluate a run's checkpoint, as the pipeline's eval stage does, from the run's own config.

    xirang-eval [hydra overrides]                 # the run those overrides name (as xirang-train would)
    xirang-eval eval.harness_tasks=[xirang_heldout_mc,xirang_heldout_gen] eval.harness_limit=50

Held-out loss, perplexity and a sample to ``<run>/eval.json``; with ``eval.harness_tasks``, lm-evaluation-harness
against the checkpoint served on 127.0.0.1 (``<run>/harness.json``, the run's trackers). A task that would need a
download is refused before anything runs.
"""

from __future__ import annotations

import sys

import hydra
from omegaconf import DictConfig

from xirang_hpc.cli.help import maybe_print_help
from xirang_hpc.config.errors import ConfigError
from xirang_hpc.config.validate import load_config
from xirang_hpc.files import private_by_default
from xirang_hpc.runs.render import harness_text
from xirang_hpc.submit.hydra_setup import register_configs, run_app
from xirang_hpc.submit.rundir import run_dir_for


def _fail(msg: str, code: int = 2) -> None:
    print(f"xirang-eval: error: {msg}", file=sys.stderr, flush=True)
    sys.exit(code)


@hydra.main(version_base="1.3", config_path="../conf", config_name="config")
def _app(dcfg: DictConfig) -> None:
    from pathlib import Path

    from xirang_hpc.eval.harness import check_tasks

    try:
        cfg = load_config(dcfg)
        private_by_default(cfg.train.share_group)
        check_tasks(cfg.eval)
    except ConfigError as exc:
        _fail(str(exc))
    run_dir = run_dir_for(cfg)
    if not (run_dir / "checkpoints").is_dir():
        _fail(f"no checkpoints in {run_dir}; train it first (xirang-train with the same overrides), or name the "
              "run with train.run_dir=RUN_DIR")
    from xirang_hpc.runtime.startup import collector_paused

    with collector_paused():  # the evaluation stack, imported as the pipeline's stages import it
        from xirang_hpc.eval.evaluate import EvalGateError, run_eval
    data_dir = Path(cfg.data.out_dir).expanduser().absolute()
    try:
        out = run_eval(run_dir, data_dir, cfg.eval, cfg.serve, cfg)
    except EvalGateError as exc:
        _fail(str(exc), 1)
    print(f"eval: {run_dir} step {out['step']} | val loss {out['val_loss']:.4f} | perplexity {out['perplexity']:.2f}",
          flush=True)
    if "harness" in out:
        print(f"harness: {harness_text(out['harness']['metrics'])} | {run_dir / 'harness.json'}", flush=True)


def main() -> None:
    """Console entry point."""
    maybe_print_help("xirang-eval", sys.argv[1:])
    register_configs()
    run_app("xirang-eval", _app)
