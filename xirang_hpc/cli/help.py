"""``--help`` of every entry point: what the command does, its own flags, examples, where the config lives.

The Hydra apps (train, prepare, plan, sbatch, pipeline) answer ``--help``/``-h`` here, before Hydra
(whose generic help is still ``--hydra-help``); the argparse tools (status, serve, ckpt) take their
description and epilog from here. One place, so tests/golden/help_*.txt pins every text.
"""

from __future__ import annotations

import argparse
import logging
import sys
import textwrap
from dataclasses import dataclass, field
from pathlib import Path

from xirang_hpc.planner.defaults import PROBE_ROUNDS

CONF_DIR = Path(__file__).resolve().parents[1] / "conf"
WIDTH = 100


@dataclass(frozen=True)
class CommandHelp:
    """The help of one command."""

    usage: str
    about: str  # one paragraph: what the command does
    flags: list[tuple[str, str]] = field(default_factory=list)  # (flag, meaning); Hydra apps only
    examples: list[tuple[str, str]] = field(default_factory=list)  # (command line, comment)
    notes: str = ""  # a closing sentence (exit status, files)
    hydra: bool = True  # takes the Hydra config groups and key=value overrides


_HYDRA_FLAGS = [
    ("--cfg job", "print the composed config and exit (--cfg hydra: Hydra's own settings)"),
    ("--info", "Hydra's plugins, config search path and defaults, and exit"),
    ("--hydra-help", "Hydra's generic help"),
    ("-h, --help", "this help"),
]

COMMANDS: dict[str, CommandHelp] = {
    "xirang-train": CommandHelp(
        usage="xirang-train [--wait] [-m] [GROUP=OPTION ...] [KEY=VALUE ...]",
        about=(
            "Train a model. Composes the config from the groups below and the overrides, validates all of it, "
            "then checks the run directory before anything is written or started: a directory that already "
            "trained something else (identity.json) is refused with the differing fields, a finished run is "
            "reported and nothing starts, and every path the job writes (runs root, run dir, checkpoints, data) "
            "must be writable with room for a checkpoint. Then it prepares the data if missing and runs the job: "
            "locally through submitit's local executor, following rank 0's output to the end, or on Slurm by "
            "submitting and returning. The run directory is train.runs_root/<train.name>-<model.name>-<hash of "
            "what is trained>, so rerunning a command resumes its run from the last checkpoint."
        ),
        flags=[
            ("--wait", "on Slurm, block until the job has ended for good (same as train.wait=true)"),
            ("-m, --multirun", "a sweep over comma-separated values (on Slurm: one array job)"),
            *_HYDRA_FLAGS,
        ],
        examples=[
            ("xirang-train", "tiny GPT, 4 ranks on 2 virtual nodes (dp2 x pp2)"),
            ("xirang-train model=gpt2-small train.max_steps=1000 train.lr=1e-3", ""),
            ("xirang-train cluster=slurm cluster.partition=gpu cluster.nodes=4 --wait", ""),
            ("xirang-train train.extend_to=600", "a finished 300-step run trained on to step 600"),
            ("xirang-train train.resume_from=400", "fork the run from its step-400 checkpoint"),
        ],
        notes="Exit status: 0 trained (or already complete), 1 the job failed, 2 refused before anything started, "
              "128+N stopped by signal N (130 Ctrl-C, 143 SIGTERM, 129 SIGHUP: a local job stops after a final "
              "checkpoint).",
    ),
    "xirang-prepare": CommandHelp(
        usage="xirang-prepare [data=OPTION] [data.KEY=VALUE ...]",
        about=(
            "Turn a corpus directory into HDF5 token shards: train_*.h5 and val_*.h5 plus index.json (written "
            "last; a directory without it is an unfinished preparation) under data.out_dir. Files go to train or "
            "val by a hash of their path; each shard records tokenizer, source, token count and sha256. "
            "data.corpus=stdlib takes this interpreter's standard-library .py sources. xirang-train runs the "
            "same step itself when the data is missing."
        ),
        flags=_HYDRA_FLAGS,
        examples=[
            ("xirang-prepare", "the default corpus into data/stdlib-bytes"),
            ("xirang-prepare data.corpus=/path/to/text data.out_dir=data/mytext", ""),
            ("xirang-prepare data.corpus=/path/to/text data.val_fraction=0.05 data.shard_tokens=1000000", ""),
        ],
        notes="Exit status: 0 prepared, 2 a bad config or an empty, binary-only or unreadable corpus.",
    ),
    "xirang-plan": CommandHelp(
        usage="xirang-plan [--json] [--top N] [GROUP=OPTION ...] [KEY=VALUE ...]\n"
              "       xirang-plan --layout SPEC|config [--json] [GROUP=OPTION ...] [KEY=VALUE ...]\n"
              "       xirang-plan --calibrate [--out FILE] [--rounds N] cluster=OPTION\n"
              "       xirang-plan --goodput [--json] [goodput.KEY=VALUE ...] [GROUP=OPTION ...] [KEY=VALUE ...]\n"
              "       xirang-plan target.loss=L|target.tokens=D|target.compute=C [target.deadline=T] "
              "[target.budget=B] ...\n"
              "       xirang-plan --fit-scaling [data=...] [train.runs_root=DIR]",
        about=(
            "Rank parallel layouts (dp x tp x pp, ZeRO-1/2/3 with any tp and pp, recomputation, microbatches) for a "
            "model on "
            "a cluster: memory per GPU, step time (compute, tensor-parallel communication, pipeline bubble, "
            "exposed data-parallel communication), MFU and tokens/s, and why each runner-up lost. The parallel "
            "group is ignored (the planner chooses it) unless --layout config asks for exactly that layout. "
            "--calibrate measures this cluster's compute and links "
            "instead and writes a cluster preset. --goodput simulates the run's effective training time "
            "instead: failures by class (default: Llama 3's published rates), this build's measured recovery "
            "costs per policy (requeue, in-job restart, in-job from memory), checkpoint costs scaled from the "
            "model's size, spares; goodput and its breakdown per policy with a 95% CI over seeds, and the "
            "recommended policy, checkpoint interval (Daly's, checked by a scan) and spare nodes. Its inputs "
            "are goodput.KEY=VALUE: days, seeds, step_s, interval_s, spares, hardware/network/software/"
            "planned_per_node_day, startup_s, requeue_recovery_s, requeue_hold_s, queue_wait_s, "
            "injob_recovery_s, memory_restore_s, checkpoint_bytes, fs_gbps, synchronous and more "
            "(docs/parallel-and-planning.md)."
            " With target.* it plans from a target instead of a model: a "
            "scaling law gives the model size and tokens, then the layout, nodes, wall time, GPU-hours, cost and "
            "the xirang-train command; --fit-scaling fits that law on the user's own sweep of small runs."
        ),
        flags=[
            ("--json", "machine-readable plans"),
            ("--top N", "how many plans to show (default 5)"),
            ("--runnable", "accepted for old scripts and changes nothing: every ranked layout is one this build "
                           "runs"),
            ("--layout SPEC", "evaluate one given layout instead of searching: tp=8,pp=16,dp=64,mbs=1,v=4,zero=1,"
                              "recompute=selective,sp=true, or 'config' for the parallel group as xirang-train "
                              "runs it"),
            ("--calibrate", "measure the cluster (runs a short job) and write a preset"),
            ("--out FILE", "where --calibrate writes the preset (default conf/cluster/<cluster>-calibrated.yaml)"),
            ("--rounds N", "rounds of --calibrate's probe training runs on CPU clusters, median kept (default "
                           f"{PROBE_ROUNDS}; 1 is the fastest and noisiest)"),
            ("--goodput", "simulate the run's goodput per recovery policy and recommend policy, interval and "
                          "spares (goodput.KEY=VALUE set its inputs)"),
            ("--fit-scaling", "print the IsoFLOP sweep to run, or, once its runs finished, fit the scaling law to "
                              "their validation losses and store it beside the data"),
            *_HYDRA_FLAGS,
        ],
        examples=[
            ("xirang-plan model=gpt-175b cluster=a100-80gb-ib cluster.nodes=128 train.global_batch=1536", ""),
            ("xirang-plan model=gpt-7b cluster=h100-ib cluster.nodes=8 --json --top 5", ""),
            ("xirang-plan --layout config parallel=dp2xtp2", "the cost of one layout, as xirang-train runs it"),
            ("xirang-plan --calibrate cluster=local --out conf/cluster/local-calibrated.yaml", ""),
            ("xirang-plan --goodput model=llama3-405b cluster=h100-ib cluster.nodes=2048 goodput.days=54",
             "16,384 GPUs, Llama 3's failure rates"),
            ("xirang-plan model=llama3-8b cluster=h100-ib cluster.nodes=64 target.loss=2.1 target.deadline=30d",
             "the model, tokens and run that reach a loss by a deadline"),
        ],
        notes="Exit status: 0 planned, 2 a bad config, a bad goodput.* input, no layout fits, or a target the "
              "deadline or budget cannot meet (the message says which binds and by how much).",
    ),
    "xirang-sbatch": CommandHelp(
        usage="xirang-sbatch [--out FILE] [GROUP=OPTION ...] [KEY=VALUE ...]",
        about=(
            "Write a ready batch script for users who call sbatch themselves: the same validation and run "
            "directory checks as xirang-train, the same sbatch flags (partition, account, QoS, --signal, "
            "--time-min, exclusions), the job's config in the run directory, and the requeue supervisor at the "
            "end. Nothing is submitted."
        ),
        flags=[
            ("--out FILE", "where the script goes (default RUN_DIR/job.sbatch)"),
            *_HYDRA_FLAGS,
        ],
        examples=[
            ("xirang-sbatch cluster=slurm model=gpt2-small --out job.sbatch", "then: sbatch job.sbatch"),
            ("xirang-sbatch cluster=slurm cluster.partition=gpu cluster.account=proj cluster.nodes=4", ""),
            ("xirang-sbatch cluster=testbed train.priority=exploratory", "scavenger partition/QoS"),
        ],
        notes="Exit status: 0 written, 2 refused (config, run directory or paths).",
    ),
    "xirang-pipeline": CommandHelp(
        usage="xirang-pipeline [GROUP=OPTION ...] [KEY=VALUE ...]\n"
              "       xirang-pipeline --status RUN_DIR [--json]",
        about=(
            "Prepare, train, evaluate and serve one model with one composed config. Locally the four stages run "
            "here in sequence; on Slurm they are four jobs chained with --dependency=afterok, so a failed stage "
            "cancels the rest, and the command returns after submitting. eval.max_val_loss > 0 is a quality "
            "gate: above it the eval stage fails and serving never starts. <run>/pipeline.json holds the chain "
            "and <run>/pipeline/<stage>.json what each stage reported. With preference.corpus (preference "
            "pairs) the chain is prepare -> train -> export -> dpo -> eval -> serve: the fine-tune's result "
            "(LoRA merged) is the start and reference of a DPO run in <run>/dpo, which eval and serve take."
        ),
        flags=[
            ("--status RUN_DIR", "print the chain of RUN_DIR and exit (1 when a stage failed)"),
            ("--json", "with --status: machine-readable"),
            *_HYDRA_FLAGS,
        ],
        examples=[
            ("xirang-pipeline", "all four stages on this machine"),
            ("xirang-pipeline cluster=testbed eval.max_val_loss=2.5", "4 chained Slurm jobs"),
            ("xirang-pipeline model.init_from=$MODEL data.format=chat data.corpus=chats.jsonl finetune.method=lora "
             "preference.corpus=pairs.jsonl preference.lora=true", "SFT, then DPO, eval, serve the adapter"),
            ("xirang-pipeline --status runs/default-tiny-0123456789ab --json", ""),
        ],
        notes="Exit status: 0 every stage passed (or was submitted), 1 a stage failed, 2 refused before starting.",
    ),
    "xirang-eval": CommandHelp(
        usage="xirang-eval [GROUP=OPTION ...] [KEY=VALUE ...]",
        about=(
            "Evaluate the checkpoint of the run the overrides name, as the pipeline's eval stage does: held-out "
            "loss, perplexity and a greedy sample to <run>/eval.json. With eval.harness_tasks, lm-evaluation-"
            "harness runs those tasks against the checkpoint served on 127.0.0.1 (an ephemeral port) through its "
            "local-completions model; results go to <run>/harness.json, the run's trackers and xirang-status. "
            "Shipped tasks, built from the run's held-out text: xirang_heldout_mc (multiple choice) and "
            "xirang_heldout_gen (generation). Nothing is downloaded: a task that would need a dataset download "
            "is refused before anything runs."
        ),
        flags=list(_HYDRA_FLAGS),
        examples=[
            ("xirang-eval", "the default run's checkpoint: loss, perplexity, sample"),
            ("xirang-eval eval.harness_tasks=[xirang_heldout_mc,xirang_heldout_gen] eval.harness_limit=50", ""),
            ("xirang-eval train.run_dir=RUN_DIR eval.harness_tasks=[my_task] eval.harness_include=tasks/",
             "your own task YAMLs, local data_files"),
        ],
        notes="Exit status: 0 evaluated, 1 the quality gate (eval.max_val_loss) failed, 2 refused before starting.",
    ),
    "xirang-status": CommandHelp(
        usage="",
        about=(
            "Show where a run, a directory of runs or a Slurm job stands, from anywhere: job state (squeue, "
            "scontrol, sacct), requeues, step/total, loss, tokens/s, MFU, ETA, the last checkpoint and its age, "
            "CPU/RSS (and GPU) per node, and recent events. For a directory of runs or an array job: one line "
            "per run, pending tasks included. For two or more run directories: a comparison (config "
            "differences, progress, final numbers). A pending Slurm job's reason is said in words with the quota "
            "numbers behind it; a job that left squeue is shown from sacct (exit code, elapsed, restarts, nodes, "
            "CPU time). --queue: the whole cluster (partitions, nodes, jobs, quotas, QOS, fair share, utilization "
            "of the last hour)."
        ),
        examples=[
            ("xirang-status runs/default-tiny-0123456789ab", ""),
            ("xirang-status --queue", "the cluster; --watch refreshes, --json, --plot queue.png"),
            ("xirang-status --queue --sites all", "every Slurm cluster of the slurmdbd side by side, then each one"),
            ("xirang-status runs", "every run under the runs root"),
            ("xirang-status 4242 --runs-root runs", "an array sweep's tasks"),
            ("xirang-status RUN_DIR --watch", ""),
            ("xirang-status RUN_A RUN_B --plot compare.png", "compare runs, curves overlaid"),
        ],
        notes="Exit status: 0 shown, 2 nothing found.",
        hydra=False,
    ),
    "xirang-serve": CommandHelp(
        usage="",
        about=(
            "Serve a trained model over HTTP: the newest good checkpoint of a run directory (from any dp/tp/pp/"
            "fsdp layout, reassembled in one process), one step_N directory, or exported safetensors. "
            "Endpoints: GET /health, GET /metrics (Prometheus), POST /v1/generate, and the OpenAI API "
            "(POST /v1/completions and /v1/chat/completions, streaming or not; GET /v1/models), so OpenAI "
            "clients work unchanged. Concurrent requests are decoded together. Binds 127.0.0.1 unless --host says "
            "otherwise; set $XIRANG_SERVE_TOKEN (or the variable --token-env names) to require a bearer token."
        ),
        examples=[
            ("xirang-serve RUN_DIR", "127.0.0.1:8000"),
            ("xirang-serve RUN_DIR --step 400 --port 0 --info-file serve.json", ""),
            ("xirang-serve RUN_DIR/export/step_300/model.safetensors --max-batch 32 --threads 1", ""),
            ("XIRANG_SERVE_TOKEN=s3cret xirang-serve RUN_DIR", "/v1/* then needs 'Authorization: Bearer s3cret'"),
        ],
        notes="Exit status: 0 stopped, 2 nothing servable at PATH.",
        hydra=False,
    ),
    "xirang-ckpt": CommandHelp(
        usage="",
        about=(
            "Manage a run's checkpoints: list them (steps, sizes, times, layouts), inspect or verify one "
            "(sizes and checksums), fork a new run directory from a step (rollback), apply retention now "
            "(prune), protect a step from retention (pin), export the weights as safetensors, and compute the "
            "recommended checkpoint interval (Daly). RUN is a run directory or its checkpoints/ directory. "
            "Each subcommand has its own --help."
        ),
        examples=[
            ("xirang-ckpt list RUN_DIR", ""),
            ("xirang-ckpt verify RUN_DIR", ""),
            ("xirang-ckpt rollback RUN_DIR --step 400 --to NEW_DIR", ""),
            ("xirang-ckpt prune RUN_DIR --keep-last 2 --dry-run", ""),
            ("xirang-ckpt export RUN_DIR --format safetensors", "model.safetensors + config.json"),
        ],
        notes="Exit status: 0 done, 2 no such run, step or file, or a corrupt checkpoint.",
        hydra=False,
    ),
}


def config_groups() -> list[tuple[str, list[str], str]]:
    """(group, options, default) for every config group in the package's conf/ directory."""
    from omegaconf import OmegaConf

    defaults: dict[str, str] = {}
    for entry in OmegaConf.to_container(OmegaConf.load(CONF_DIR / "config.yaml")).get("defaults", []):
        if isinstance(entry, dict):
            defaults.update({k: v for k, v in entry.items() if isinstance(v, str) and "/" not in k})
    out = []
    for d in sorted(p for p in CONF_DIR.iterdir() if p.is_dir() and not p.name.startswith("_")):
        options = sorted(p.stem for p in d.glob("*.yaml"))
        if options:
            out.append((d.name, options, defaults.get(d.name, "")))
    return out


def _wrap(text: str, indent: str = "") -> str:
    return textwrap.fill(text, WIDTH, initial_indent=indent, subsequent_indent=indent, break_on_hyphens=False)


def _examples(h: CommandHelp) -> list[str]:
    return [f"  {cmd}  # {note}" if note else f"  {cmd}" for cmd, note in h.examples]


def _groups_text() -> list[str]:
    lines = [_wrap("Config groups (xirang_hpc/conf/, typed by xirang_hpc/config/schema/; choose one with "
                   "GROUP=OPTION, set a field with GROUP.FIELD=VALUE; --cfg job shows every field):")]
    for group, options, default in config_groups():
        opts = ", ".join(f"{o} (default)" if o == default else o for o in options)
        lines.append(textwrap.fill(opts, WIDTH, initial_indent=f"  {group + ':':<12}", subsequent_indent=" " * 14,
                                   break_on_hyphens=False))
    return lines


def render(name: str) -> str:
    """The full ``--help`` text of a Hydra app."""
    h = COMMANDS[name]
    width = max(len(f) for f, _ in h.flags)
    lines = [f"usage: {h.usage}", "", _wrap(h.about), "", "options:"]
    lines += [textwrap.fill(m, WIDTH, initial_indent=f"  {f:<{width}}  ", subsequent_indent=" " * (width + 4),
                            break_on_hyphens=False) for f, m in h.flags]
    lines += ["", "examples:", *_examples(h), ""]
    lines += _groups_text()
    if h.notes:
        lines += ["", _wrap(h.notes)]
    return "\n".join(lines) + "\n"


def maybe_print_help(name: str, argv: list[str]) -> None:
    """``--help``/``-h`` anywhere in ``argv``: print this command's help and exit 0."""
    if "--help" in argv or "-h" in argv:
        sys.stdout.write(render(name))
        sys.exit(0)


def argparse_texts(name: str) -> dict[str, object]:
    """``description``/``epilog``/``formatter_class`` for an argparse-based command's parser."""
    h = COMMANDS[name]
    epilog = "\n".join(["examples:", *_examples(h), "", _wrap(h.notes)]) if h.notes else None
    return {"description": _wrap(h.about), "epilog": epilog, "formatter_class": argparse.RawDescriptionHelpFormatter}


def setup_logging(level: int) -> None:
    """Our log level, unless Hydra's ``--info`` is about to install its own handler (lines would print twice)."""
    if not any(a == "--info" or a.startswith("--info=") for a in sys.argv[1:]):
        logging.basicConfig(level=level)
