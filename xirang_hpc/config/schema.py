"""Dataclass schemas for every Hydra config group.

Each group (``model/``, ``cluster/``, ...) has one dataclass here; the YAML files under
``conf/`` are presets that fill these schemas. Field-local checks live in ``__post_init__``
(they run when OmegaConf turns the composed config into objects); checks that span groups
(tp vs heads, dp*tp*pp vs world size) live in :mod:`xirang_hpc.config.validate`.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from omegaconf import MISSING

from xirang_hpc.config.errors import ConfigError
from xirang_hpc.config.hf import is_hf_dir


def _finite(group: str, obj: object) -> None:
    """Refuse NaN and infinities in every float field of ``obj`` (also inside lists and dicts).

    ``nan <= 0`` is False, so without this a NaN slips through every range check below.
    """
    for f in dataclasses.fields(obj):  # type: ignore[arg-type]
        value = getattr(obj, f.name)
        if isinstance(value, dict):
            items = list(value.items())
        elif isinstance(value, list):
            items = list(enumerate(value))
        else:
            items = [(None, value)]
        for key, v in items:
            if isinstance(v, float) and not math.isfinite(v):
                where = f"{group}.{f.name}" + (f"[{key!r}]" if key is not None else "")
                raise ConfigError(where, v, "must be a finite number (not NaN or infinity)")


def _positive(group: str, name: str, value: float, fix: str = "use a value > 0") -> None:
    if value <= 0:
        raise ConfigError(f"{group}.{name}", value, f"must be positive; {fix}")


@dataclass
class ModelConfig:
    """Decoder-only transformer shape. ``d_ff=0`` means 4*d_model (or 8/3*d_model for swiglu)."""

    name: str = MISSING
    n_layer: int = 2
    n_head: int = 4
    # Key/value heads (grouped-query attention, Ainslie et al. 2023): each group of n_head/n_kv_head
    # query heads shares one key/value head. 0 = n_head (plain multi-head attention).
    n_kv_head: int = 0
    d_model: int = 128
    d_ff: int = 0
    vocab_size: int = 256
    seq_len: int = 128
    norm: str = "layernorm"  # layernorm | rmsnorm
    mlp: str = "gelu"  # gelu | swiglu
    pos: str = "learned"  # learned | rope
    bias: bool = True
    # Epsilon of every LayerNorm/RMSNorm (GPT-2 and Llama 2/3 use 1e-5).
    norm_eps: float = 1e-5
    # Rotary base frequency (10000 in the RoPE paper and Llama 2; 500000 in Llama 3).
    rope_theta: float = 10000.0
    # Share the token embedding with the output head (GPT-2 ties them; Llama 3 8B/70B do not).
    tie_embeddings: bool = False
    init_std: float = 0.02
    # Weights to initialise from, for fine-tuning: an exported .safetensors file, or a Hugging Face model
    # directory (Llama or GPT-2 family; its config.json fills model.*, see xirang_hpc/config/hf.py).
    init_from: str | None = None

    def __post_init__(self) -> None:
        _finite("model", self)
        for name in ("n_layer", "n_head", "d_model", "vocab_size", "seq_len", "norm_eps", "rope_theta"):
            _positive("model", name, getattr(self, name))
        if self.n_kv_head < 0:
            raise ConfigError("model.n_kv_head", self.n_kv_head, "use a positive count, or 0 for n_head")
        if self.n_kv_head == 0:
            self.n_kv_head = self.n_head
        if self.n_head % self.n_kv_head:
            ok = [d for d in range(1, self.n_head + 1) if self.n_head % d == 0]
            raise ConfigError("model.n_kv_head", self.n_kv_head,
                              f"must divide model.n_head={self.n_head} (each key/value head serves a whole group of "
                              f"query heads); choose from {ok}")
        if self.d_model % self.n_head:
            raise ConfigError(
                "model.d_model", self.d_model, f"must be divisible by model.n_head={self.n_head}"
            )
        if self.norm not in ("layernorm", "rmsnorm"):
            raise ConfigError("model.norm", self.norm, "choose layernorm or rmsnorm")
        if self.mlp not in ("gelu", "swiglu"):
            raise ConfigError("model.mlp", self.mlp, "choose gelu or swiglu")
        if self.pos not in ("learned", "rope"):
            raise ConfigError("model.pos", self.pos, "choose learned or rope")
        if self.pos == "rope" and (self.d_model // self.n_head) % 2:
            raise ConfigError("model.pos", self.pos, "rope needs an even head dimension (d_model/n_head)")
        if self.init_from and not str(self.init_from).endswith(".safetensors") and not is_hf_dir(self.init_from):
            raise ConfigError("model.init_from", self.init_from,
                              "point it at a .safetensors file (xirang-ckpt export RUN --format safetensors) or at a "
                              "Hugging Face model directory (config.json + model.safetensors or its index)")

    @property
    def head_dim(self) -> int:
        """Width of one attention head."""
        return self.d_model // self.n_head

    @property
    def ffn_dim(self) -> int:
        """Hidden width of the MLP."""
        if self.d_ff:
            return self.d_ff
        if self.mlp == "swiglu":
            # LLaMA's 2/3 * 4d, rounded up to a multiple of 256 as in the paper's code.
            return 256 * ((int(8 * self.d_model / 3) + 255) // 256)
        return 4 * self.d_model


# train.priority levels, lowest first: exploratory is preemptible (requeued), high is the site's urgent class.
PRIORITIES = ("exploratory", "normal", "high")


# cluster.site_policy values: where a job goes when the preset lists several sites.
SITE_POLICIES = ("earliest", "quota", "stay")
# cluster.site_sweep values: a Hydra sweep as one array on the placed site, or one array per site.
SITE_SWEEPS = ("one", "spread")


@dataclass
class SiteConfig:
    """One Slurm cluster of a multi-cluster preset (``cluster.sites``), registered in the shared slurmdbd
    under ``name`` (``sbatch -M <name>``). Unset partition/account/qos fall back to the cluster's own."""

    name: str = MISSING
    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    # Where this site's runs live ("" = train.runs_root). With shared_fs false the sites do not see each
    # other's files: a run moving here gets its newest good checkpoint copied into this root first.
    run_root: str = ""
    shared_fs: bool = True

    def __post_init__(self) -> None:
        if not self.name or not str(self.name).replace("-", "").replace("_", "").isalnum():
            raise ConfigError("cluster.sites[].name", self.name,
                              "give each site the Slurm cluster name registered in slurmdbd (sacctmgr show cluster)")
        if not self.shared_fs and not self.run_root:
            raise ConfigError(f"cluster.sites[{self.name}].run_root", self.run_root,
                              "a site without a shared filesystem needs its own run_root (where runs are copied to)")


@dataclass
class ClusterConfig:
    """Where the job runs. ``local`` runs submitit's local executor on this machine with a
    *virtual* topology of ``nodes`` x ``tasks_per_node`` ranks, so node-aware code runs here."""

    name: str = MISSING
    executor: str = "local"  # local | slurm
    nodes: int = 1
    tasks_per_node: int = 1
    gpus_per_node: int = 0
    cpus_per_task: int = 1
    mem_gb: float = 0.0
    time_min: int = 60
    partition: str | None = None
    qos: str | None = None
    account: str | None = None
    constraint: str | None = None
    exclude: str | None = None
    signal_delay_s: int = 90
    array_parallelism: int = 256
    setup: list[str] = field(default_factory=list)
    srun_args: list[str] = field(default_factory=list)
    # Torch intra-op threads per rank; 0 = cores / ranks on this node.
    threads_per_rank: int = 0
    # Scheduling classes (train.priority): normal uses partition/qos above; exploratory the preemptible
    # scavenger partition/QOS (requeued on preemption); high the site's urgent partition/QOS. Each
    # class falls back to partition/qos for the half it leaves unset. min_time_min is sbatch
    # --time-min (0: unset), which lets the backfill scheduler start the job in a gap shorter than time_min.
    scavenger_partition: str | None = None
    scavenger_qos: str | None = None
    high_partition: str | None = None
    high_qos: str | None = None
    # The QOS the site defines (`sacctmgr show qos`); when set, every QOS above must be one of them,
    # so a typo is refused before anything reaches sbatch. Empty: not checked here.
    qos_names: list[str] = field(default_factory=list)
    min_time_min: int = 0
    backend: str = "auto"  # auto | gloo | nccl
    # Planner: accelerator preset (a100-40gb | a100-80gb | h100 | h200 | cpu; "" = cpu
    # without GPUs, else a100-80gb) and measured overrides of its fields (xirang_hpc/planner/hardware.py).
    gpu: str = ""
    hardware: dict[str, float] = field(default_factory=dict)
    # Extra nodes allocated beside ``nodes`` and left idle: an in-job restart (requeue.max_restarts_in_job)
    # replaces a failed node with one of them and keeps the layout (Slurm only).
    spare_nodes: int = 0
    # Several Slurm clusters as one (launch/sites.py): a job goes to the site whose `sbatch --test-only`
    # promises the earliest start (site_policy=earliest), the most free quota for the account (quota), or
    # stays on its current site unless another starts it more than site_stay_s sooner (stay). A run
    # preempted on its site moves when its requeue there would wait more than site_migrate_wait_s.
    sites: list[SiteConfig] = field(default_factory=list)
    site_policy: str = "earliest"
    site_stay_s: float = 600.0
    site_migrate_wait_s: float = 120.0
    # The job moves itself: at a preemption the batch script's supervisor places the run again and, when
    # its requeue here would wait longer than site_migrate_wait_s, resubmits it on the site that starts
    # it soonest (verified copy first) instead of requeuing it here. false: requeued here, moved only by
    # `python -m xirang_hpc.launch.sites migrate`.
    site_auto_migrate: bool = True
    # A Hydra sweep (-m) with sites: `one` submits the whole array to the site placement chooses; `spread`
    # splits its tasks over the sites that answer (one array per site, earliest start first) and records
    # the split in <sweep folder>/sites.json; each task's run directory is on its site's run root.
    site_sweep: str = "one"

    def __post_init__(self) -> None:
        _finite("cluster", self)
        if self.site_policy not in SITE_POLICIES:
            raise ConfigError("cluster.site_policy", self.site_policy, f"choose one of {list(SITE_POLICIES)}")
        if self.site_sweep not in SITE_SWEEPS:
            raise ConfigError("cluster.site_sweep", self.site_sweep, f"choose one of {list(SITE_SWEEPS)}")
        for name in ("site_stay_s", "site_migrate_wait_s"):
            if getattr(self, name) < 0:
                raise ConfigError(f"cluster.{name}", getattr(self, name), "use seconds >= 0")
        names = [s.name for s in self.sites]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ConfigError("cluster.sites", dup, "each site (Slurm cluster) may be listed once")
        if self.sites and self.executor != "slurm":
            raise ConfigError("cluster.sites", names, "sites are Slurm clusters: set cluster.executor=slurm")
        if self.executor not in ("local", "slurm"):
            raise ConfigError("cluster.executor", self.executor, "choose local or slurm")
        for name in ("nodes", "tasks_per_node", "time_min"):
            _positive("cluster", name, getattr(self, name))
        if self.spare_nodes < 0:
            raise ConfigError("cluster.spare_nodes", self.spare_nodes, "use 0 (no spare) or more")
        if self.backend not in ("auto", "gloo", "nccl"):
            raise ConfigError("cluster.backend", self.backend, "choose auto, gloo or nccl")
        if self.qos_names:
            for key in ("qos", "scavenger_qos", "high_qos"):
                value = getattr(self, key)
                if value and value not in self.qos_names:
                    raise ConfigError(f"cluster.{key}", value,
                                      f"cluster {self.name!r} defines the QOS {list(self.qos_names)}; choose one "
                                      "of them (a new QOS is added by the site's admin with `sacctmgr add qos`, "
                                      "then listed in cluster.qos_names)")

    @property
    def world_size(self) -> int:
        """Total number of ranks."""
        return self.nodes * self.tasks_per_node


@dataclass
class ParallelConfig:
    """Parallel layout. ``dp=-1`` derives data parallelism from the world size."""

    dp: int = -1
    tp: int = 1
    pp: int = 1
    data_parallel: str = "ddp"  # ddp | fsdp (data_parallel=fsdp is ZeRO-3 unless parallel.zero says 2)
    microbatches: int = 1
    schedule: str = "1f1b"  # gpipe | 1f1b | interleaved (interleaved 1F1B, virtual_stages per rank)
    # Interleaved only: pipeline stages (model chunks) per rank; the model is split into pp*virtual_stages.
    virtual_stages: int = 2
    recompute: str = "none"  # none | selective | full
    sequence_parallel: bool = False
    # FSDP only: replicate groups of HSDP (shard inside a group of dp/dp_replicate ranks).
    dp_replicate: int = 1
    # Shard the optimizer state over dp (ZeRO-1); the same as parallel.zero=1.
    optimizer_sharding: bool = False
    # ZeRO stage over the data-parallel ranks: 0 = replicated (DDP), 1 = optimizer state sharded,
    # 2 = + gradients sharded (FSDP2 keeping weights gathered from forward to backward),
    # 3 = + weights sharded (FSDP2). -1 = derived: 3 for data_parallel=fsdp, 1 for optimizer_sharding, else 0.
    zero: int = -1
    # parallel=auto: xirang-train runs the planner at launch and fills in the fields above.
    auto: bool = False

    def __post_init__(self) -> None:
        _finite("parallel", self)
        if self.dp != -1 and self.dp < 1:
            raise ConfigError("parallel.dp", self.dp, "use a positive degree, or -1 to derive it")
        for name in ("tp", "pp", "microbatches"):
            _positive("parallel", name, getattr(self, name))
        if self.data_parallel not in ("ddp", "fsdp"):
            raise ConfigError("parallel.data_parallel", self.data_parallel, "choose ddp or fsdp")
        if self.schedule not in ("gpipe", "1f1b", "interleaved"):
            raise ConfigError("parallel.schedule", self.schedule, "choose gpipe, 1f1b or interleaved")
        if self.schedule == "interleaved" and self.virtual_stages < 2:
            raise ConfigError("parallel.virtual_stages", self.virtual_stages,
                              "interleaved needs 2 or more stages per rank; use schedule=1f1b for one")
        if self.recompute not in ("none", "selective", "full"):
            raise ConfigError("parallel.recompute", self.recompute, "choose none, selective or full")
        _positive("parallel", "dp_replicate", self.dp_replicate)
        if self.zero not in (-1, 0, 1, 2, 3):
            raise ConfigError("parallel.zero", self.zero, "choose a ZeRO stage 0, 1, 2 or 3 (or -1 to derive it "
                              "from parallel.data_parallel / parallel.optimizer_sharding)")


# Experiment-tracking back ends for train.loggers (jsonl is always written).
LOGGERS = ("jsonl", "tensorboard", "mlflow")


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
    # Mixed precision: auto = bf16 autocast on CUDA (nccl), fp32 on CPU | fp32 | bf16.
    precision: str = "auto"
    # Experiment tracking (rank 0): jsonl (<run>/metrics.jsonl, always on) | tensorboard (<run>/tb/) |
    # mlflow (a run in <run>/mlruns, or in train.mlflow_uri). See xirang_hpc/monitor/tracking.py.
    loggers: list[str] = field(default_factory=lambda: ["jsonl"])
    # MLflow tracking URI (file:/..., http://host:5000, sqlite:///...); empty: file store <run>/mlruns.
    mlflow_uri: str = ""
    # Train a run past max_steps, to this step (0 = no extension). Not part of the run-dir hash, so the
    # same command plus train.extend_to=N finds the run and resumes from its last checkpoint; the LR
    # schedule is still defined by max_steps, so the extra steps run at the final (minimum) LR.
    extend_to: int = 0

    def __post_init__(self) -> None:
        _finite("train", self)
        for name in ("max_steps", "global_batch", "grad_accum", "lr", "log_every", "eval_batches"):
            _positive("train", name, getattr(self, name))
        if self.eval_every < 0:
            raise ConfigError("train.eval_every", self.eval_every, "use 0 (start and end only) or a step interval > 0")
        unknown = [x for x in self.loggers if x not in LOGGERS]
        if unknown:
            raise ConfigError("train.loggers", list(self.loggers),
                              f"unknown logger(s) {unknown}; choose from {list(LOGGERS)}, e.g. "
                              "train.loggers=[jsonl,tensorboard]")
        if self.warmup_steps < 0:
            raise ConfigError("train.warmup_steps", self.warmup_steps, "use 0 or more")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ConfigError("train.min_lr_ratio", self.min_lr_ratio, "use a ratio in [0, 1]")
        if self.priority not in PRIORITIES:
            raise ConfigError("train.priority", self.priority, f"choose one of {', '.join(PRIORITIES)}")
        if self.precision not in ("auto", "fp32", "bf16"):
            raise ConfigError("train.precision", self.precision, "choose auto, fp32 or bf16")
        if self.extend_to and self.extend_to <= self.max_steps:
            raise ConfigError("train.extend_to", self.extend_to,
                              f"must exceed train.max_steps={self.max_steps} (or be 0: no extension)")

    @property
    def end_step(self) -> int:
        """The step training runs to: ``extend_to`` when set, else ``max_steps``."""
        return self.extend_to or self.max_steps


# HDF5 filters for checkpoint shards (zstd through hdf5plugin); checkpoint/storage.py uses the same list.
COMPRESSIONS = ("none", "lzf", "gzip", "zstd")


@dataclass
class CheckpointConfig:
    """Checkpoint policy: HDF5 DCP checkpoints under ``<run>/checkpoints`` (see xirang_hpc/checkpoint)."""

    enabled: bool = True
    every_steps: int = 50
    keep_last: int = 3
    keep_every: int = 0  # also keep every K-th step as a milestone (0 = none)
    pinned: list[int] = field(default_factory=list)  # steps never pruned
    async_save: bool = True
    compression: str = "none"  # none | lzf | gzip | zstd (hdf5plugin)
    dedup: bool = False  # store chunks identical to the previous checkpoint's as references
    verify_checksums: bool = True  # checksum (xxh3-128) of every file before loading
    auto_interval: bool = False  # adapt every_steps with Daly's formula from measured costs
    mtbf_hours: float = 24.0  # MTBF for the interval tuner until the run has its own history
    dir_mode: int = 0o700
    # Recovery from memory: each rank's newest shard in node-local tmpfs plus a replica on another
    # node; an in-job restart loads it instead of the filesystem checkpoint when it is newer or equal.
    in_memory: bool = False
    memory_every_steps: int = 0  # 0 = with every filesystem checkpoint; may be smaller (more often)
    memory_dir: str = ""  # the tmpfs holding it; "" = /dev/shm (a per-job directory under it)

    def __post_init__(self) -> None:
        _finite("checkpoint", self)
        _positive("checkpoint", "every_steps", self.every_steps)
        _positive("checkpoint", "mtbf_hours", self.mtbf_hours)
        if self.keep_last < 1:
            raise ConfigError("checkpoint.keep_last", self.keep_last, "keep at least 1 checkpoint")
        if self.dir_mode & ~0o777 or not self.dir_mode & 0o700 == 0o700:
            raise ConfigError("checkpoint.dir_mode", oct(self.dir_mode), "use a mode like 0o700 or 0o750 (owner rwx)")
        if self.compression not in COMPRESSIONS:
            raise ConfigError("checkpoint.compression", self.compression, f"choose one of {', '.join(COMPRESSIONS)}")
        if self.memory_every_steps < 0:
            raise ConfigError("checkpoint.memory_every_steps", self.memory_every_steps,
                              "use 0 (with every filesystem checkpoint) or a positive step count")
        if self.memory_dir and not self.memory_dir.startswith("/"):
            raise ConfigError("checkpoint.memory_dir", self.memory_dir,
                              "use an absolute path on a node-local tmpfs (e.g. /dev/shm), or '' for /dev/shm")


@dataclass
class RequeueConfig:
    """Sysadmin requeue policy (applied inside the job on a stop signal and by the supervisor after a failure)."""

    enabled: bool = True
    max_requeues: int = 5
    on_preemption: bool = True
    on_timeout: bool = True
    on_node_failure: bool = True
    on_nonzero_exit: bool = False
    backoff_s: int = 0
    exclude_failed_nodes: bool = True
    start_now: bool = False
    # In-job restart (Slurm): after a dead or hung rank, restart the ranks inside the same allocation
    # on the healthy nodes (a spare one, else fewer nodes) from the newest checkpoint, up to this many
    # times per allocation; 0 = off (the requeue policy above handles every failure).
    max_restarts_in_job: int = 0
    # The fewest nodes a shrunk restart may run on (same global batch through more gradient
    # accumulation); 0 = as few as the layout allows. Set it to cluster.nodes to forbid shrinking.
    min_nodes: int = 0

    def __post_init__(self) -> None:
        _finite("requeue", self)
        if self.max_requeues < 0:
            raise ConfigError("requeue.max_requeues", self.max_requeues, "use 0 or more")
        if self.max_restarts_in_job < 0:
            raise ConfigError("requeue.max_restarts_in_job", self.max_restarts_in_job, "use 0 (off) or more")
        if self.min_nodes < 0:
            raise ConfigError("requeue.min_nodes", self.min_nodes, "use 0 (any the layout allows) or more")


@dataclass
class DataConfig:
    """Token data. ``corpus=stdlib`` uses the running interpreter's standard-library sources.

    ``corpus``: a directory or one file; text files, JSONL (``.jsonl``) and Parquet (``.parquet``) by
    extension. ``tokenizer``: ``byte`` (vocab 256), ``bpe`` (a byte-level BPE of ``vocab_size`` tokens
    trained on the corpus; 0 = ``model.vocab_size``), or a tokenizer.json path / HF model dir.
    """

    corpus: str = "stdlib"
    out_dir: str = "data/stdlib-bytes"
    tokenizer: str = "byte"
    vocab_size: int = 0
    # JSONL key / Parquet column holding the text.
    text_field: str = "text"
    # A JSONL line that is not JSON, or a record without text: fail (naming file:line) | skip (counted).
    on_bad_record: str = "fail"
    val_fraction: float = 0.01
    shard_tokens: int = 16 * 1024 * 1024
    split_seed: int = 0

    def __post_init__(self) -> None:
        _finite("data", self)
        if not self.tokenizer:
            raise ConfigError("data.tokenizer", self.tokenizer,
                              "use byte, bpe, a tokenizer.json path or an HF model dir")
        if self.vocab_size < 0:
            raise ConfigError("data.vocab_size", self.vocab_size, "use 0 (= model.vocab_size) or a size >= 257")
        if self.vocab_size and self.tokenizer != "bpe":  # byte is 256; a tokenizer.json brings its own size
            raise ConfigError("data.vocab_size", self.vocab_size,
                              f"only a trained tokenizer (data.tokenizer=bpe) takes a vocabulary size, not "
                              f"data.tokenizer={self.tokenizer}; leave data.vocab_size at 0")
        if self.on_bad_record not in ("fail", "skip"):
            raise ConfigError("data.on_bad_record", self.on_bad_record, "choose fail or skip")
        if not self.text_field:
            raise ConfigError("data.text_field", self.text_field, "name the JSONL field / Parquet column of the text")
        if not 0 < self.val_fraction < 0.5:
            raise ConfigError("data.val_fraction", self.val_fraction, "use a fraction in (0, 0.5)")
        _positive("data", "shard_tokens", self.shard_tokens)


@dataclass
class MonitorConfig:
    """Heartbeats, watchdog thresholds and status reporting (see xirang_hpc/monitor)."""

    enabled: bool = True
    # Seconds between heartbeat writes (a background thread on every rank).
    heartbeat_s: float = 1.0
    # Hang: every rank has stopped moving (no new phase, no liveness tick) for its phase's bound; then
    # stacks are dumped and the job aborted (see monitor/detect.py for the table of phase bounds).
    # hang_s: the bound where nothing is measured yet: start-up, the first step (warm-up, compilation,
    # the first batch's data preparation), the initial evaluation; and the cap of every other bound.
    hang_s: float = 300.0
    # Once step times are measured: max(hang_min_s, hang_k x the median step time) in a training step
    # (data/forward/backward/optimizer/comm), and between the ticks of a checkpoint save (one per tensor
    # written) or of an evaluation (one per batch). A hang is named in seconds; a save or an evaluation
    # that keeps ticking is never one. hang_k=0 turns this off (hang_s everywhere).
    hang_k: float = 20.0
    hang_min_s: float = 10.0
    # Heartbeat silence after which a rank's process counts as frozen or lost (its thread stopped too).
    stale_s: float = 10.0
    # Straggler: median local work time (data phase) over the window exceeds k x the ranks' median.
    straggler_k: float = 2.0
    straggler_min_s: float = 0.05
    straggler_window: int = 5
    abort_on_hang: bool = True
    abort_on_dead: bool = True
    # Signal that makes every rank dump its Python stacks (faulthandler). SIGUSR2/SIGTERM belong to requeue.
    stack_signal: str = "SIGQUIT"
    # Peak FLOP/s per device for MFU, in TFLOP/s; 0 = look up the GPU name via NVML, else MFU is n/a.
    peak_tflops: float = 0.0
    # Test-only: sleep this long in every step of this rank (simulates a straggler), on entering each of
    # debug_slow_phases, in the steps debug_slow_steps (empty: every step; [0]: a slow first step).
    debug_slow_rank: int = -1
    debug_slow_s: float = 0.0
    debug_slow_steps: list[int] = field(default_factory=list)
    debug_slow_phases: list[str] = field(default_factory=lambda: ["data"])
    # Test-only: every rank's checkpoint writer sleeps this long per tensor written (a slow filesystem).
    debug_slow_save_s: float = 0.0
    # Test-only: every rank sleeps this long per evaluation batch (a long evaluation).
    debug_slow_eval_s: float = 0.0

    def __post_init__(self) -> None:
        _finite("monitor", self)
        for name in ("heartbeat_s", "hang_s", "stale_s", "straggler_k", "straggler_window", "hang_min_s"):
            _positive("monitor", name, getattr(self, name))
        if self.hang_k < 0:
            raise ConfigError("monitor.hang_k", self.hang_k, "must be >= 0 (0 = use monitor.hang_s in every phase)")
        if self.stale_s < 2 * self.heartbeat_s:
            raise ConfigError("monitor.stale_s", self.stale_s,
                              f"must be at least 2 x monitor.heartbeat_s={self.heartbeat_s}")
        if self.stack_signal in ("SIGUSR2", "SIGTERM", "SIGKILL", "SIGSTOP", "SIGINT"):
            raise ConfigError("monitor.stack_signal", self.stack_signal,
                              "SIGUSR2/SIGTERM are the requeue signals; use SIGQUIT or SIGUSR1")


@dataclass
class CommConfig:
    """Gradient communication (xirang_hpc/runtime/comm): hierarchical all-reduce and the bandwidth budget."""

    # DDP communication hook: intra-node shared memory + k parallel inter-node flows. false = DDP's flat ring.
    hierarchical: bool = True
    # Message size in MB for the hook, or "auto" (time auto_candidates_mb in the first steps, keep the fastest).
    bucket: str = "25"
    auto_candidates_mb: list[float] = field(default_factory=lambda: [1.0, 4.0, 16.0])
    auto_steps: int = 2
    # Cross-node bandwidth budget per node: 0 = unset (exact synchronous training); > 1 = bytes/s;
    # (0, 1] = fraction of the inter-node link speed measured in the first calibration_steps steps.
    inter_node_budget: float = 0.0
    # Explicit cross-node sync period H (overrides the budget): 0 = derive from the budget, 1 = every step.
    sync_period: int = 0
    calibration_steps: int = 3
    # How a cross-node sync applies the average: average (post-local-SGD) | nesterov (DiLoCo outer step).
    outer_optimizer: str = "average"
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    timeout_s: float = 300.0

    def __post_init__(self) -> None:
        _finite("comm", self)
        if str(self.bucket) != "auto":
            try:
                mb = float(self.bucket)
            except ValueError:
                mb = -1.0
            if mb <= 0:
                raise ConfigError("comm.bucket", self.bucket, "use a size in MB (e.g. 25) or auto")
        if not self.auto_candidates_mb or min(self.auto_candidates_mb) <= 0:
            raise ConfigError("comm.auto_candidates_mb", self.auto_candidates_mb, "list positive sizes in MB")
        if self.inter_node_budget < 0:
            raise ConfigError("comm.inter_node_budget", self.inter_node_budget,
                              "use 0 (unset), bytes/s (> 1) or a fraction of the link in (0, 1]")
        if self.sync_period < 0:
            raise ConfigError("comm.sync_period", self.sync_period, "use 0 (from the budget), 1 (every step) or more")
        if self.outer_optimizer not in ("average", "nesterov"):
            raise ConfigError("comm.outer_optimizer", self.outer_optimizer, "choose average or nesterov")
        for name in ("auto_steps", "calibration_steps", "outer_lr", "timeout_s"):
            _positive("comm", name, getattr(self, name))
        if not 0 <= self.outer_momentum < 1:
            raise ConfigError("comm.outer_momentum", self.outer_momentum, "use a momentum in [0, 1)")


@dataclass
class EvalConfig:
    """Held-out evaluation of a checkpoint (xirang_hpc/eval): loss, perplexity, a generation sample."""

    batches: int = 16
    batch_size: int = 8
    seed: int = 0
    step: int = -1  # checkpoint step to evaluate; -1 = the newest good one
    sample_prompt: str = "def "
    sample_tokens: int = 64
    # Quality gate for xirang-pipeline: > 0 fails the eval stage (and stops the chain) above this loss.
    max_val_loss: float = 0.0

    def __post_init__(self) -> None:
        _finite("eval", self)
        for name in ("batches", "batch_size"):
            _positive("eval", name, getattr(self, name))
        if self.sample_tokens < 0 or self.max_val_loss < 0:
            raise ConfigError("eval.sample_tokens/max_val_loss", (self.sample_tokens, self.max_val_loss),
                              "use 0 or more")


@dataclass
class ServeConfig:
    """HTTP serving of a checkpoint (xirang_hpc/serve, xirang-serve)."""

    host: str = "127.0.0.1"  # loopback by default; 0.0.0.0 exposes the server to the network
    port: int = 8000  # 0 = any free port (written to <run>/serve.json)
    max_batch: int = 16  # requests decoded together in one generation loop
    max_prompt_tokens: int = 0  # 0 = model.seq_len
    max_new_tokens: int = 256
    token_env: str = "XIRANG_SERVE_TOKEN"  # bearer token read from this env var; unset or empty = no auth
    duration_s: float = 0.0  # 0 = serve until interrupted; > 0 = stop after this long (smoke runs, tests)
    # A request whose headers or body have not fully arrived this many seconds after the connection
    # opened (or after the previous response) is answered 408 / closed: half-sent requests cannot pin
    # connections. Also the idle keep-alive time of a connection.
    read_timeout_s: float = 30.0
    model_name: str = ""  # the model id of the OpenAI-compatible API; "" = the run directory's name

    def __post_init__(self) -> None:
        _finite("serve", self)
        if not self.read_timeout_s > 0:
            raise ConfigError("serve.read_timeout_s", self.read_timeout_s,
                              "use a number of seconds > 0 (how long a request may take to arrive)")
        if not 0 <= self.port < 65536:
            raise ConfigError("serve.port", self.port, "use a TCP port in [0, 65535] (0 = any free port)")
        for name in ("max_batch", "max_new_tokens"):
            _positive("serve", name, getattr(self, name))
        if self.max_prompt_tokens < 0 or self.duration_s < 0:
            raise ConfigError("serve.max_prompt_tokens/duration_s", (self.max_prompt_tokens, self.duration_s),
                              "use 0 or more")


@dataclass
class XirangConfig:
    """The composed root config."""

    model: ModelConfig = MISSING
    cluster: ClusterConfig = MISSING
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    requeue: RequeueConfig = field(default_factory=RequeueConfig)
    data: DataConfig = field(default_factory=DataConfig)
    monitor: MonitorConfig = field(default_factory=MonitorConfig)
    comm: CommConfig = field(default_factory=CommConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    serve: ServeConfig = field(default_factory=ServeConfig)


GROUPS: dict[str, type] = {
    "model": ModelConfig,
    "cluster": ClusterConfig,
    "parallel": ParallelConfig,
    "train": TrainConfig,
    "checkpoint": CheckpointConfig,
    "requeue": RequeueConfig,
    "data": DataConfig,
    "monitor": MonitorConfig,
    "comm": CommConfig,
    "eval": EvalConfig,
    "serve": ServeConfig,
}
