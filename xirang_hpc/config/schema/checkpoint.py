"""The checkpoint and requeue groups: what is saved, when, and what happens after a stop."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from xirang_hpc.config.errors import ConfigError
from xirang_hpc.config.fleet import unplanned_per_node_day
from xirang_hpc.config.schema._checks import check_finite, check_positive

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
    # Checkpoints exist but none is usable: refuse to start (the default, naming each and why), or
    # "fresh": start from a fresh init on purpose (never from a mix: nothing is copied before a step verifies).
    on_no_valid: str = "refuse"
    auto_interval: bool = False  # adapt every_steps with Daly's formula from measured costs
    mtbf_hours: float = 24.0  # MTBF for the interval tuner until the run has its own history
    dir_mode: int = 0o700
    # Recovery from memory: each rank's newest shard in node-local tmpfs plus a replica on another
    # node; an in-job restart loads it instead of the filesystem checkpoint when it is newer or equal.
    in_memory: bool = False
    memory_every_steps: int = 0  # 0 = with every filesystem checkpoint; may be smaller (more often)
    memory_dir: str = ""  # the tmpfs holding it; "" = /dev/shm (a per-job directory under it)

    def __post_init__(self) -> None:
        check_finite("checkpoint", self)
        check_positive("checkpoint", "every_steps", self.every_steps)
        check_positive("checkpoint", "mtbf_hours", self.mtbf_hours)
        if self.keep_last < 1:
            raise ConfigError("checkpoint.keep_last", self.keep_last, "keep at least 1 checkpoint")
        if self.dir_mode & ~0o777 or not self.dir_mode & 0o700 == 0o700:
            raise ConfigError("checkpoint.dir_mode", oct(self.dir_mode), "use a mode like 0o700 or 0o750 (owner rwx)")
        if self.dir_mode & 0o022:
            raise ConfigError("checkpoint.dir_mode", oct(self.dir_mode),
                              "a mode that lets the group or others write would let them replace checkpoints; "
                              "use 0o700 or 0o750")
        if self.on_no_valid not in ("refuse", "fresh"):
            raise ConfigError("checkpoint.on_no_valid", self.on_no_valid,
                              "choose refuse (stop when no checkpoint is usable) or fresh (start from a fresh init)")
        if self.compression not in COMPRESSIONS:
            raise ConfigError("checkpoint.compression", self.compression, f"choose one of {', '.join(COMPRESSIONS)}")
        if self.memory_every_steps < 0:
            raise ConfigError("checkpoint.memory_every_steps", self.memory_every_steps,
                              "use 0 (with every filesystem checkpoint) or a positive step count")
        if self.memory_dir and not self.memory_dir.startswith("/"):
            raise ConfigError("checkpoint.memory_dir", self.memory_dir,
                              "use an absolute path on a node-local tmpfs (e.g. /dev/shm), or '' for /dev/shm")


# The requeue budget's defaults (RequeueConfig.with_default_rates): failures at FAILURE_MARGIN x the fleet's
# unplanned rate (over the days of a run, Poisson counts at twice their mean do not happen), never below one a
# day; preemptions as many as one an hour; time limits TIMEOUT_MARGIN x the allocations a day of
# cluster.time_min holds.
FAILURE_MARGIN, MIN_FAILURES_PER_DAY, PREEMPTIONS_PER_DAY, TIMEOUT_MARGIN = 2.0, 1.0, 24.0, 2.0


@dataclass
class RequeueConfig:
    """Sysadmin requeue policy (applied inside the job on a stop signal and by the supervisor after a failure)."""

    enabled: bool = True
    # Budgets as rates: after a fault of one class the run is requeued while that class's requeues so far stay
    # within ``budget_burst`` + its rate x the days since the run started, so a run of any length keeps
    # recovering from faults at the fleet's rate and a crash loop (a fault every few minutes) still ends.
    # Classes: failures (node, infrastructure, non-zero exit, out of memory), preemptions, time limits.
    # null = the default for this run, set when the config is validated (runtime/policy.py
    # ``resolve_budget``): failures 2x the unplanned interruptions Llama 3's fleet had at this node count
    # (config/fleet.py), at least 1 a day; preemptions 24 a day; time limits 2x the allocations of
    # cluster.time_min a day fits.
    failures_per_day: float | None = None
    preemptions_per_day: float | None = None
    timeouts_per_day: float | None = None
    budget_burst: int = 5
    # Deprecated (one release): a cap on all requeues together, whatever their class, which ends a long run
    # after a fixed number of faults. Set, it still applies on top of the rates, with a warning at launch.
    max_requeues: int | None = None
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
        check_finite("requeue", self)
        if self.max_requeues is not None and self.max_requeues < 0:
            raise ConfigError("requeue.max_requeues", self.max_requeues, "use 0 or more (deprecated: prefer the "
                              "rates requeue.failures_per_day, preemptions_per_day, timeouts_per_day)")
        for name in ("failures_per_day", "preemptions_per_day", "timeouts_per_day"):
            v = getattr(self, name)
            if v is not None and not v >= 0:
                raise ConfigError(f"requeue.{name}", v, "use a rate >= 0 (requeues per day of the run, on top of "
                                  "requeue.budget_burst), or null for the default")
        if self.budget_burst < 0:
            raise ConfigError("requeue.budget_burst", self.budget_burst,
                              "use 0 or more (requeues of each class allowed at any time, on top of the rate)")

    def with_default_rates(self, nodes: int, time_min: int) -> RequeueConfig:
        """This policy with each rate left at null set to its default for a run of ``nodes`` nodes (spares
        included) whose allocations last ``time_min`` minutes; rates that are set stay as they are."""
        defaults = {
            "failures_per_day": max(MIN_FAILURES_PER_DAY, round(FAILURE_MARGIN * unplanned_per_node_day() * nodes, 2)),
            "preemptions_per_day": PREEMPTIONS_PER_DAY,
            "timeouts_per_day": round(TIMEOUT_MARGIN * 1440.0 / max(1, time_min), 2),
        }
        return dataclasses.replace(self, **{k: v for k, v in defaults.items() if getattr(self, k) is None})
        if self.max_restarts_in_job < 0:
            raise ConfigError("requeue.max_restarts_in_job", self.max_restarts_in_job, "use 0 (off) or more")
        if self.min_nodes < 0:
            raise ConfigError("requeue.min_nodes", self.min_nodes, "use 0 (any the layout allows) or more")
