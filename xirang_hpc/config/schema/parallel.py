"""The parallel group: the layout (dp x cp x tp x pp, ZeRO stage, microbatches, recompute)."""

from __future__ import annotations

from dataclasses import dataclass

from xirang_hpc.config.errors import ConfigError
from xirang_hpc.config.schema._checks import check_finite, check_positive


@dataclass
class ParallelConfig:
    """Parallel layout. ``dp=-1`` derives data parallelism from the world size."""

    dp: int = -1
    tp: int = 1
    pp: int = 1
    # Context parallelism: each sequence split over cp ranks (load-balanced causal chunks), K/V all-gathered
    # in attention; the cp ranks of a group see the same rows, and gradients are reduced over dp x cp.
    cp: int = 1
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
    # Expert parallelism (mixture-of-experts models): each expert lives on one of ep ranks, which are taken
    # from the data-parallel ranks (ep divides dp); tokens travel to their experts by all-to-all.
    ep: int = 1
    # ep > 1: each expert runs the rows of each source rank through GEMMs of their own and adds the sources'
    # gradients as a pairwise tree, so that a change of ep on the same 2 or 4 ranks continues bitwise (one
    # microbatch a step). Smaller GEMMs cost more per row (benchmarks/bench_moe.py --ep-bitwise).
    ep_bitwise: bool = False
    # parallel=auto: xirang-train runs the planner at launch and fills in the fields above.
    auto: bool = False

    def __post_init__(self) -> None:
        check_finite("parallel", self)
        if self.dp != -1 and self.dp < 1:
            raise ConfigError("parallel.dp", self.dp, "use a positive degree, or -1 to derive it")
        for name in ("tp", "pp", "cp", "microbatches"):
            check_positive("parallel", name, getattr(self, name))
        if self.data_parallel not in ("ddp", "fsdp"):
            raise ConfigError("parallel.data_parallel", self.data_parallel, "choose ddp or fsdp")
        if self.schedule not in ("gpipe", "1f1b", "interleaved"):
            raise ConfigError("parallel.schedule", self.schedule, "choose gpipe, 1f1b or interleaved")
        if self.schedule == "interleaved" and self.virtual_stages < 2:
            raise ConfigError("parallel.virtual_stages", self.virtual_stages,
                              "interleaved needs 2 or more stages per rank; use schedule=1f1b for one")
        if self.recompute not in ("none", "selective", "full"):
            raise ConfigError("parallel.recompute", self.recompute, "choose none, selective or full")
        check_positive("parallel", "dp_replicate", self.dp_replicate)
        check_positive("parallel", "ep", self.ep)
        if self.zero not in (-1, 0, 1, 2, 3):
            raise ConfigError("parallel.zero", self.zero, "choose a ZeRO stage 0, 1, 2 or 3 (or -1 to derive it "
                              "from parallel.data_parallel / parallel.optimizer_sharding)")
