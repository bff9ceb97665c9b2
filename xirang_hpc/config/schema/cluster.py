"""The cluster group: nodes, Slurm partition/account/QOS and the sites of several clusters."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from omegaconf import MISSING

from xirang_hpc.config.errors import ConfigError
from xirang_hpc.config.schema._checks import check_finite, check_positive

# train.priority levels, lowest first: exploratory is preemptible (requeued), high is the site's urgent class.
PRIORITIES = ("exploratory", "normal", "high")
BACKENDS = ("auto", "gloo", "nccl", "xccl", "hccl")


# cluster.site_policy values: where a job goes when the preset lists several sites.
SITE_POLICIES = ("earliest", "quota", "stay")
# cluster.site_sweep values: a Hydra sweep as one array on the placed site, or one array per site.
SITE_SWEEPS = ("one", "spread")
# cluster.omp_wait_policy values.
OMP_WAIT_POLICIES = ("passive", "active", "inherit")


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


CONTAINER_RUNTIMES = ("pyxis", "apptainer")


@dataclass
class ContainerConfig:
    """The container the ranks run in (``cluster.container.*``); the batch script, the in-job restart driver
    and the supervisor stay on the host. See xirang_hpc/slurm/container.py."""

    image: str = ""  # "" = no container; pyxis: a registry image or a squashfs; apptainer: a .sif
    runtime: str = "pyxis"  # pyxis (srun --container-image, enroot) | apptainer (apptainer exec)
    # Host paths mounted at the same place, besides the runs root, the data dir and this package's environment.
    mounts: list[str] = field(default_factory=list)
    # The interpreter inside the container; "" = this one's path (the host environment, mounted).
    python: str = ""
    nv: bool = True  # apptainer exec --nv: the node's GPUs and driver inside (pyxis does it itself)

    def __post_init__(self) -> None:
        if self.runtime not in CONTAINER_RUNTIMES:
            raise ConfigError("cluster.container.runtime", self.runtime,
                              f"choose one of {', '.join(CONTAINER_RUNTIMES)}")
        bad = [m for m in self.mounts if not m.startswith("/") or "," in m]
        if bad:
            raise ConfigError("cluster.container.mounts", bad, "use absolute host paths (src or src:dst), no commas")


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
    container: ContainerConfig = field(default_factory=ContainerConfig)
    # Torch intra-op threads per rank; 0 = the CPUs the rank is given: its own CPU set where Slurm binds
    # each task (--cpus-per-task), else the node's CPU set (cgroup cpuset, CPU quota) shared by its ranks.
    threads_per_rank: int = 0
    # OpenMP's wait policy for the ranks (OMP_WAIT_POLICY, set before torch loads OpenMP): passive threads
    # sleep between parallel regions, active ones spin. On a node shared with other work spinning threads
    # steal the CPUs the busy ones need: a single 2-thread rank beside busy loops ran 1.8-17.7x faster passive
    # (benchmarks/bench_threads.py); on a quiet node spinning is faster (passive 0.84x there), so an exclusive
    # CPU node may set active. Passive by default: the loss on a quiet node is small, the loss on a shared one is
    # not. inherit: leave the environment's value.
    omp_wait_policy: str = "passive"
    # Local executor, jobs of more than one rank: ranks are forked from one process per job that has imported
    # torch and the package (local/preload.py), instead of each starting a fresh interpreter (~4 s of CPU per
    # rank). false: plain.
    preload: bool = True
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
    # Each rank's device: auto (the accelerator torch finds, CUDA/ROCm, XPU, NPU, MPS; else the CPU) | cpu | a
    # device type. backend: auto (torch's own for the device: nccl, xccl, hccl; gloo on the CPU) or named.
    device: str = "auto"
    backend: str = "auto"  # auto | gloo | nccl | xccl | hccl
    # Planner: accelerator preset (a100-40gb | a100-80gb | h100 | h200 | cpu; "" = cpu
    # without GPUs, else a100-80gb) and measured overrides of its fields (xirang_hpc/planner/hardware.py).
    gpu: str = ""
    hardware: dict[str, float] = field(default_factory=dict)
    # Extra nodes allocated beside ``nodes`` and left idle: an in-job restart (requeue.max_restarts_in_job)
    # replaces a failed node with one of them and keeps the layout (Slurm only).
    spare_nodes: int = 0
    # Several Slurm clusters as one (submit/sites/): a job goes to the site whose `sbatch --test-only`
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
    # `python -m xirang_hpc.submit.sites migrate`.
    site_auto_migrate: bool = True
    # A Hydra sweep (-m) with sites: `one` submits the whole array to the site placement chooses; `spread`
    # splits its tasks over the sites that answer (one array per site, earliest start first) and records
    # the split in <sweep folder>/sites.json; each task's run directory is on its site's run root.
    site_sweep: str = "one"
    # What one GPU-hour costs here (any currency; 0 = not set): xirang-plan's target.budget in money and
    # its cost figures. A CPU cluster (gpus_per_node 0) prices a rank-hour.
    price_per_gpu_hour: float = 0.0

    def __post_init__(self) -> None:
        check_finite("cluster", self)
        if self.price_per_gpu_hour < 0:
            raise ConfigError("cluster.price_per_gpu_hour", self.price_per_gpu_hour,
                              "use the price of one GPU-hour (>= 0; 0 = not set)")
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
            check_positive("cluster", name, getattr(self, name))
        if self.spare_nodes < 0:
            raise ConfigError("cluster.spare_nodes", self.spare_nodes, "use 0 (no spare) or more")
        if self.omp_wait_policy not in OMP_WAIT_POLICIES:
            raise ConfigError("cluster.omp_wait_policy", self.omp_wait_policy,
                              f"choose one of {list(OMP_WAIT_POLICIES)}")
        if self.backend not in BACKENDS:
            raise ConfigError("cluster.backend", self.backend, f"choose one of {', '.join(BACKENDS)}")
        if not re.match(r"^[a-z][a-z0-9_]*$", self.device):
            raise ConfigError("cluster.device", self.device,
                              "use auto, cpu or an accelerator type (cuda, xpu, npu, mps)")
        if self.qos_names:
            for key in ("qos", "scavenger_qos", "high_qos"):
                value = getattr(self, key)
                if value and value not in self.qos_names:
                    raise ConfigError(f"cluster.{key}", value,
                                      f"cluster {self.name!r} defines the QOS {list(self.qos_names)}; choose one "
                                      "of them (a new QOS is added by the site's admin with `sacctmgr add qos`, "
                                      "then listed in cluster.qos_names)")

    def rank_environment(self) -> dict[str, str]:
        """Environment variables every rank starts with (before any import of torch)."""
        if self.omp_wait_policy == "inherit":
            return {}
        return {"OMP_WAIT_POLICY": self.omp_wait_policy.upper()}

    @property
    def world_size(self) -> int:
        """Total number of ranks."""
        return self.nodes * self.tasks_per_node
