"""The monitor group: heartbeats, hang detection and the watchdog."""

from __future__ import annotations

from dataclasses import dataclass

from xirang_hpc.config.errors import ConfigError
from xirang_hpc.config.schema._checks import check_finite, check_positive


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
    # Collective progress: a rank that has not entered a collective its peers entered this many seconds ago,
    # and is stopped, silent or shows no motion at all (no phase, tick, CPU use or collective), is the hang's
    # culprit, whatever the step time (monitor/detect.py). 10 s: the rule's closest call in healthy runs on a
    # loaded 2-core machine (6.3 s, a rank crawling 6 s per phase) plus margin (docs/monitoring-and-tracking.md).
    # 0 turns it off.
    collective_timeout_s: float = 10.0
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

    def __post_init__(self) -> None:
        check_finite("monitor", self)
        for name in ("heartbeat_s", "hang_s", "stale_s", "straggler_k", "straggler_window", "hang_min_s"):
            check_positive("monitor", name, getattr(self, name))
        if self.hang_k < 0:
            raise ConfigError("monitor.hang_k", self.hang_k, "must be >= 0 (0 = use monitor.hang_s in every phase)")
        if self.hang_s < 5:
            raise ConfigError("monitor.hang_s", self.hang_s,
                              "a bound under 5 s aborts healthy jobs in their start-up (imports, rendezvous, the "
                              "first step); keep the default 300 or at least a few minutes on a cluster")
        if self.collective_timeout_s < 0 or 0 < self.collective_timeout_s < 2 * self.heartbeat_s:
            raise ConfigError("monitor.collective_timeout_s", self.collective_timeout_s,
                              f"must be 0 (off) or at least 2 x monitor.heartbeat_s={self.heartbeat_s}: the heartbeat "
                              "samples when each collective was entered, once per heartbeat")
        if self.stale_s < 2 * self.heartbeat_s:
            raise ConfigError("monitor.stale_s", self.stale_s,
                              f"must be at least 2 x monitor.heartbeat_s={self.heartbeat_s}")
        if self.stack_signal in ("SIGUSR2", "SIGTERM", "SIGKILL", "SIGSTOP", "SIGINT"):
            raise ConfigError("monitor.stack_signal", self.stack_signal,
                              "SIGUSR2/SIGTERM are the requeue signals; use SIGQUIT or SIGUSR1")
