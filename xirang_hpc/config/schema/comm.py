"""The comm group: gradient reduction (hierarchical all-reduce, compression, sync period)."""

from __future__ import annotations

from dataclasses import dataclass, field

from xirang_hpc.config.errors import ConfigError
from xirang_hpc.config.schema._checks import check_finite, check_positive


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
        check_finite("comm", self)
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
            check_positive("comm", name, getattr(self, name))
        if not 0 <= self.outer_momentum < 1:
            raise ConfigError("comm.outer_momentum", self.outer_momentum, "use a momentum in [0, 1)")
