"""The train group: steps, batch, learning rate, logging and the run directory."""

from __future__ import annotations

from dataclasses import dataclass, field

from xirang_hpc.config.errors import ConfigError
from xirang_hpc.config.schema._checks import check_finite, check_positive
from xirang_hpc.config.schema.cluster import PRIORITIES

# Experiment-tracking back ends for train.loggers (jsonl is always written).
LOGGERS = ("jsonl", "tensorboard", "mlflow")
# AdamW implementations for train.optimizer_impl (auto: torch's own default for the parameters' device).
OPTIMIZER_IMPLS = ("auto", "foreach", "fused")


def check_share_group(group: str) -> None:
    """``train.share_group`` names a group that exists and that this user is in (else a ConfigError)."""
    import grp
    import os

    try:
        gid = grp.getgrnam(group).gr_gid
    except KeyError:
        raise ConfigError("train.share_group", group, "no such Unix group on this machine (see getent group)") from None
    if gid != os.getgid() and gid not in os.getgroups():
        raise ConfigError("train.share_group", group, "you are not a member of that group (see id -Gn); "
                          "share with one of your groups, or leave it empty for a private run")


@dataclass
class TrainConfig:
    """Optimisation and loop settings. ``global_batch`` counts sequences per optimizer step."""

    name: str = "default"
    seed: int = 1234
    max_steps: int = 200
    global_batch: int = 32
    grad_accum: int = 1
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 20
    # The warm-up as a fraction of max_steps (0 < f < 1); when set it replaces warmup_steps, so one multirun over
    # train.max_steps (a scaling sweep) keeps every run's warm-up in the same proportion. 0: use warmup_steps.
    warmup_frac: float = 0.0
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0
    eval_every: int = 0  # validation every N steps (rows in metrics.jsonl); 0: only at start and end
    eval_batches: int = 8
    log_every: int = 10
    runs_root: str = "runs"
    # Explicit run directory; empty = runs_root/<name>-<hash of the experiment config>.
    run_dir: str = ""
    # Block until the job ends; None: block for cluster.executor=local, return at once for slurm.
    wait: bool | None = None
    # Scheduling class: normal | high (the preset's high partition/QOS) | exploratory (its preemptible
    # scavenger partition/QOS); see cluster.high_* and cluster.scavenger_*.
    priority: str = "normal"
    # A launch whose run directory already has a live Slurm job queues behind it (--dependency=afterany)
    # instead of being refused.
    after_active: bool = False
    # Resume from a specific step (forks a new run from it; see checkpoint rollback); -1 = latest.
    resume_from: int = -1
    # Mixed precision: auto = bf16 autocast on CUDA (nccl), fp32 on CPU | fp32 | bf16 | fp8 (bf16 autocast and the
    # linear layers in float8 through torchao, rowwise scales; CUDA compute capability >= 8.9 only, refused at
    # start-up elsewhere; see xirang_hpc/runtime/precision.py).
    precision: str = "auto"
    # The output head and the loss computed this many tokens at a time (0: all at once). The full
    # (tokens, vocab) logits and their gradient are then never held: a 128k vocabulary at 16k tokens per
    # rank is 8 GiB per copy. Equal results up to summation order; see xirang_hpc/models/loss.py.
    loss_chunk_tokens: int = 0
    # Regional compilation: each transformer block's forward through torch.compile (Inductor), after tensor
    # parallelism and recompute, before FSDP2; kernels cached per user ($XDG_CACHE_HOME/xirang-hpc) across
    # restarts. A node that cannot compile is refused at start-up. See xirang_hpc/runtime/compile.py.
    compile: bool = False
    # AdamW's implementation: auto (torch's default choice for the device) | foreach (one kernel per op over
    # all tensors) | fused (one kernel for the whole update; refused on a device torch has no fused kernel for).
    optimizer_impl: str = "auto"
    # Experiment tracking (rank 0): jsonl (<run>/metrics.jsonl, always on) | tensorboard (<run>/tb/) |
    # mlflow (a run in <run>/mlruns, or in train.mlflow_uri). See xirang_hpc/monitor/tracking.py.
    loggers: list[str] = field(default_factory=lambda: ["jsonl"])
    # MLflow tracking URI (file:/..., http://host:5000, sqlite:///...); empty: file store <run>/mlruns.
    mlflow_uri: str = ""
    # Train a run past max_steps, to this step (0 = no extension). Not part of the run-dir hash, so the
    # same command plus train.extend_to=N finds the run and resumes from its last checkpoint; the LR
    # schedule is still defined by max_steps, so the extra steps run at the final (minimum) LR.
    extend_to: int = 0
    # A Unix group to share the run with: directories 0o2750 in that group, files 0640 (it reads, runs
    # xirang-status, exports, serves; never writes). Empty: everything private to the user (0700/0600).
    share_group: str = ""

    def __post_init__(self) -> None:
        check_finite("train", self)
        for name in ("max_steps", "global_batch", "grad_accum", "lr", "log_every", "eval_batches"):
            check_positive("train", name, getattr(self, name))
        if self.eval_every < 0:
            raise ConfigError("train.eval_every", self.eval_every, "use 0 (start and end only) or a step interval > 0")
        unknown = [x for x in self.loggers if x not in LOGGERS]
        if unknown:
            raise ConfigError("train.loggers", list(self.loggers),
                              f"unknown logger(s) {unknown}; choose from {list(LOGGERS)}, e.g. "
                              "train.loggers=[jsonl,tensorboard]")
        if self.warmup_steps < 0:
            raise ConfigError("train.warmup_steps", self.warmup_steps, "use 0 or more")
        if not 0 <= self.warmup_frac < 1:
            raise ConfigError("train.warmup_frac", self.warmup_frac,
                              "use a fraction of train.max_steps in [0, 1), e.g. 0.2; 0 uses train.warmup_steps")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ConfigError("train.min_lr_ratio", self.min_lr_ratio, "use a ratio in [0, 1]")
        if self.loss_chunk_tokens < 0:
            raise ConfigError("train.loss_chunk_tokens", self.loss_chunk_tokens,
                              "use 0 (the whole batch at once) or a chunk of tokens > 0, e.g. 4096")
        if self.priority not in PRIORITIES:
            raise ConfigError("train.priority", self.priority, f"choose one of {', '.join(PRIORITIES)}")
        if self.precision not in ("auto", "fp32", "bf16", "fp8"):
            raise ConfigError("train.precision", self.precision, "choose auto, fp32, bf16 or fp8")
        if self.optimizer_impl not in OPTIMIZER_IMPLS:
            raise ConfigError("train.optimizer_impl", self.optimizer_impl,
                              f"choose one of {', '.join(OPTIMIZER_IMPLS)}")
        if self.share_group:
            check_share_group(self.share_group)
        if self.extend_to and self.extend_to <= self.max_steps:
            raise ConfigError("train.extend_to", self.extend_to,
                              f"must exceed train.max_steps={self.max_steps} (or be 0: no extension)")

    @property
    def warmup(self) -> int:
        """The warm-up in steps: ``warmup_frac`` of ``max_steps`` (rounded) when set, else ``warmup_steps``."""
        return round(self.warmup_frac * self.max_steps) if self.warmup_frac else self.warmup_steps

    @property
    def end_step(self) -> int:
        """The step training runs to: ``extend_to`` when set, else ``max_steps``."""
        return self.extend_to or self.max_steps
