"""Runtime overheads for the CPU cost model, measured on small *probe* models during calibration.

Where compute is tiny (CPU ranks, small models) a step is dominated by fixed costs the FLOP model
cannot see: Python dispatch per layer, DTensor redistribution under tensor parallelism, the
pipelining schedule's bookkeeping per microbatch, FSDP2's hooks per unit, and per-step work
(grad-norm all-reduce, Adam's loop over tensors). Calibration measures them in this order:

1. per-layer and per-microbatch dispatch: forward+backward of a width-32 GPT (``DISPATCH_MODEL``)
   with 1 and 3 layers on every rank at once, no communication (slope -> ``kernel_overhead_us`` per
   layer and pass, intercept -> ``microbatch_overhead_us``);
2. ten runs of the real :class:`Trainer`, each in ``PROBE_ROUNDS`` interleaved rounds (median):
   dp with 2 and 4 layers, dp + ZeRO-1, fsdp, HSDP with shard groups of 1 = replicate, dp x tp2 at
   two activation sizes, dp x tp2 with sequence parallelism, dp x pp2 with 2 and 4 microbatches.
   Each residual over the model's prediction (with the terms fitted before it) is attributed to its
   term(s): ``step_overhead_us`` (per parameter tensor) + ``step_fixed_us`` (the two dp runs),
   ``zero1_overhead_us``, ``fsdp_unit_overhead_us``, ``replicate_unit_overhead_us``,
   ``tp_overhead_us`` + ``tp_overhead_us_per_mb`` (the two TP runs), ``sp_overhead_us``,
   ``pp_overhead_us`` (least squares over the two pipeline runs);
3. the peak RSS of the dp run minus its predicted model state -> ``reserved_gb`` (the torch + gloo
   process footprint).

The exposed fraction of the pipeline bubble is not fitted here but derived from ranks per core
(``calibrate.bubble_exposed``). The probes' shapes (2 layers, width 32 or 128) are not ones the
planner is evaluated on; the layouts are the runtime's mechanisms, so tp x pp and fsdp x tp are
predicted by composition.
"""

from __future__ import annotations

import ctypes
import gc
import re
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from xirang_hpc.config.schema import ClusterConfig, ModelConfig, ParallelConfig, TrainConfig, XirangConfig
from xirang_hpc.planner.cost import Plan, Problem, estimate
from xirang_hpc.planner.formulas import Shape
from xirang_hpc.planner.hardware import Hardware

PROBE_MODEL = {"name": "probe", "n_layer": 2, "n_head": 2, "d_model": 128, "d_ff": 512, "seq_len": 32}
# Per-layer dispatch is timed on a model so narrow that its FLOPs are negligible.
DISPATCH_MODEL = {"name": "dispatch", "n_layer": 2, "n_head": 2, "d_model": 32, "d_ff": 128, "seq_len": 16}
PROBE_BATCH = 8
PROBE_STEPS = 10  # timed steps after 2 warm-up steps
PROBE_ROUNDS = 3  # median over rounds: one round's figures swung up to 2x between calibrations


# Probes on another shape than PROBE_MODEL: two TP probes separate TP's fixed cost per layer from its
# cost per activation byte (8 KB vs 131 KB of activations per rank). The wide one runs twice
# PROBE_MODEL's sequence, so its activations sit near the sizes real layers move and the per-byte
# slope is not a long extrapolation.
# The deep dp probe (4 layers) separates the per-step fixed cost from the per-tensor one.
PROBE_MODELS = {"tp_narrow": DISPATCH_MODEL, "tp": {**PROBE_MODEL, "seq_len": 64},
                "dp_deep": {**PROBE_MODEL, "n_layer": 4}}


def probe_model(name: str) -> dict[str, Any]:
    """The model a probe layout runs (PROBE_MODEL unless listed in PROBE_MODELS)."""
    return PROBE_MODELS.get(name, PROBE_MODEL)


def probe_layouts(world: int, per_node: int) -> dict[str, dict[str, Any]]:
    """Layouts to probe, in fitting order (each residual uses the terms fitted before it).

    Pairs fitted together: ``dp`` + ``dp_deep`` (per-tensor and per-step cost: 2 vs 4 layers),
    ``tp_narrow`` + ``tp`` (fixed and per-byte TP cost), ``pp`` + ``pp_deep``
    (per-slot schedule cost, least squares over 2 and 4 microbatches).
    """
    out: dict[str, dict[str, Any]] = {
        "dp": {"dp": world},
        "dp_deep": {"dp": world},
        "zero1": {"dp": world, "optimizer_sharding": True},
        "fsdp": {"dp": world, "data_parallel": "fsdp"},
        # HSDP with shard groups of 1: what the runtime runs for dp with tp > 1 or pp > 1.
        "replicate": {"dp": world, "data_parallel": "fsdp", "dp_replicate": world},
    }
    if world % 2 == 0 and per_node % 2 == 0:
        out["tp_narrow"] = {"dp": world // 2, "tp": 2}
        out["tp"] = {"dp": world // 2, "tp": 2}
        out["sp"] = {"dp": world // 2, "tp": 2, "sequence_parallel": True}
    if world % 2 == 0 and world // 2 >= 1:
        out["pp"] = {"dp": world // 2, "pp": 2, "microbatches": 2}
        out["pp_deep"] = {"dp": world // 2, "pp": 2, "microbatches": 4}
    return out


def _solve2(rows: list[tuple[float, float, float]]) -> tuple[float, float]:
    """Non-negative (x, y) with u*x + v*y = r for two rows (u, v, r); one term alone when needed."""
    (u1, v1, r1), (u2, v2, r2) = rows
    det = u1 * v2 - u2 * v1
    if abs(det) > 1e-30:
        x, y = (r1 * v2 - r2 * v1) / det, (u1 * r2 - u2 * r1) / det
        if x >= 0 and y >= 0:
            return x, y
    # Degenerate or a negative part: the better single-term least-squares fit, clamped at 0.
    fits = []
    for col in (0, 1):
        a = [row[col] for row in rows]
        den = sum(z * z for z in a)
        k = max(0.0, sum(z * row[2] for z, row in zip(a, rows)) / den) if den > 0 else 0.0
        err = sum((row[2] - k * z) ** 2 for z, row in zip(a, rows))
        fits.append((err, (k, 0.0) if col == 0 else (0.0, k)))
    return min(fits)[1]


def plan_of(par: dict[str, Any], global_batch: int) -> Plan:
    """The planner's Plan for a ParallelConfig-style dict (grad_accum 1)."""
    dp, pp = par.get("dp", 1), par.get("pp", 1)
    m = par.get("microbatches", 1) if pp > 1 else 1
    if par.get("data_parallel") == "fsdp":  # HSDP with shard groups of 1 is replication: ZeRO-0 volume
        zero = 0 if par.get("dp_replicate", 1) == dp else 3
    else:
        zero = 1 if par.get("optimizer_sharding") else 0
    return Plan(dp=dp, tp=par.get("tp", 1), pp=pp, micro=global_batch // (dp * m), zero=zero,
                recompute=par.get("recompute", "none"), sp=par.get("sequence_parallel", False))


def fit_overheads(hw: Hardware, nodes: int, per_node: int, measured: dict[str, float]) -> dict[str, float]:
    """Overhead fields from probe step times (seconds per step, by :func:`probe_layouts` name)."""
    terms = {"dp": "step_overhead_us", "zero1": "zero1_overhead_us", "fsdp": "fsdp_unit_overhead_us",
             "replicate": "replicate_unit_overhead_us", "tp": "tp_overhead_us", "sp": "sp_overhead_us",
             "pp": "pp_overhead_us"}
    # Two probes, two unknowns. The pipeline pair has one: the exposed bubble is not fitted (it swung
    # between 0 and 0.95 on the same box) but derived from ranks per core (calibrate.bubble_exposed).
    pairs = {"dp": ("dp_deep", "step_overhead_us", "step_fixed_us"),
             "tp": ("tp_narrow", "tp_overhead_us", "tp_overhead_us_per_mb"),
             "pp": ("pp_deep", "pp_overhead_us", "")}
    layouts = probe_layouts(nodes * per_node, per_node)
    out: dict[str, float] = {}

    def step(name: str, hw_: Hardware) -> float:
        sh = Shape.from_model(ModelConfig(**probe_model(name)))
        return estimate(Problem(sh, hw_, nodes, per_node, PROBE_BATCH), plan_of(layouts[name], PROBE_BATCH)).step_time

    for name in layouts:
        if name not in measured or name not in terms:
            continue
        cur = hw.scaled(**out)
        if name in pairs and pairs[name][0] in measured:
            other, kx, ky = pairs[name]
            zero = cur.scaled(**{kx: 0.0, **({ky: 0.0} if ky else {})})
            rows = []
            for n in (name, other):
                base = step(n, zero)
                v = step(n, zero.scaled(**{ky: 1.0})) - base if ky else 0.0
                rows.append((step(n, zero.scaled(**{kx: 1.0})) - base, v, measured[n] - base))
            x, y = _solve2(rows)  # with v == 0: the single-term least-squares fit of x
            out[kx] = x
            if ky:
                out[ky] = y
            continue
        key = terms[name]
        base = step(name, cur.scaled(**{key: 0.0}))
        if name == "replicate":  # the cost model charges it only with tp/pp > 1: one unit per layer + root
            unit = (Shape.from_model(ModelConfig(**probe_model(name))).layers + 1) * 1e-6
        else:
            unit = step(name, cur.scaled(**{key: 1.0})) - base
        out[key] = max(0.0, (measured[name] - base) / unit) if unit > 0 else 0.0
    return out


def layer_dispatch(reps: int = 20) -> tuple[float, float]:
    """(us per layer and pass, us per microbatch) from fwd+bwd of the probe GPT with 1 and 3 layers.

    The two models alternate and the per-pair difference is taken, so load drift cancels.
    """
    from xirang_hpc.models.gpt import GPT, lm_loss

    steps = []
    for layers in (1, 3):
        cfg = ModelConfig(**{**DISPATCH_MODEL, "n_layer": layers})
        model = GPT(cfg)
        x = torch.randint(0, cfg.vocab_size, (PROBE_BATCH, cfg.seq_len))

        def step(model: torch.nn.Module = model, x: torch.Tensor = x) -> float:
            t0 = time.perf_counter()
            lm_loss(model(x), x).backward()
            return time.perf_counter() - t0

        step()
        steps.append(step)
    pairs = [(steps[0](), steps[1]()) for _ in range(reps)]
    per_layer = max(0.0, statistics.median(b - a for a, b in pairs) / 2)
    one = statistics.median(a for a, _ in pairs)
    return per_layer / 3 * 1e6, max(0.0, one - per_layer) * 1e6


def _kb(field: str) -> int:
    m = re.search(rf"{field}:\s+(\d+)", Path("/proc/self/status").read_text())
    return int(m.group(1)) if m else 0


def reset_peak() -> None:
    """Hand freed heap back and reset VmHWM (Linux), so the next peak is this run's."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:  # pragma: no cover - not Linux/glibc
        pass


def peak_rss_bytes() -> float:
    """This process's RSS high-water mark since :func:`reset_peak`."""
    return _kb("VmHWM") * 1024.0


def probe_config(par: dict[str, Any], nodes: int, per_node: int,
                 model: dict[str, Any] | None = None) -> XirangConfig:
    """A validated config for the probe model (or ``model``) in layout ``par``."""
    from xirang_hpc.config.validate import check_runnable, validate

    cfg = XirangConfig(model=ModelConfig(**(model or PROBE_MODEL)),
                       cluster=ClusterConfig(name="probe", nodes=nodes, tasks_per_node=per_node, backend="gloo"),
                       parallel=ParallelConfig(**par),
                       train=TrainConfig(max_steps=PROBE_STEPS + 2, global_batch=PROBE_BATCH, warmup_steps=2,
                                         eval_batches=1, log_every=1000))
    cfg = validate(cfg)
    check_runnable(cfg)
    return cfg


def time_layout(cfg: XirangConfig, topo: Any, data_dir: Path, steps: int, warmup: int = 2) -> tuple[float, float]:
    """(median step seconds of the slowest rank, max peak RSS bytes over ranks) of ``steps`` real steps."""
    from xirang_hpc.runtime.trainer import Trainer

    reset_peak()
    with tempfile.TemporaryDirectory() as d:
        tr = Trainer(cfg, topo, Path(d), data_dir, log=lambda s: None)
        times = []
        for s in range(warmup + steps):
            t0 = time.perf_counter()
            tr.train_step(s)
            times.append(time.perf_counter() - t0)
        peak = peak_rss_bytes()
        del tr
    per_step = torch.tensor(times[warmup:] + [peak], dtype=torch.float64)
    if dist.is_initialized():
        dist.all_reduce(per_step, op=dist.ReduceOp.MAX)
    vals = per_step.tolist()
    return statistics.median(vals[:-1]), vals[-1]


def ensure_data(folder: Path, rank: int) -> Path:
    """A small prepared corpus (the stdlib ``email`` package) under ``folder``, made by rank 0."""
    import sysconfig

    from xirang_hpc.data.prepare import is_prepared, prepare

    out = Path(folder) / "probe-data"
    if rank == 0 and not is_prepared(out):
        prepare(str(Path(sysconfig.get_paths()["stdlib"]) / "email"), out, val_fraction=0.2)
    if dist.is_initialized():
        dist.barrier()
    return out


def measure_overheads(hw: Hardware, topo: Any, folder: Path, say: Callable[[str], None] = print,
                      ) -> dict[str, float]:
    """Steps 1-3 of the module docstring, on this rank (process group up); same result on every rank."""
    from xirang_hpc.planner.cost import GiB

    nodes, per_node = topo.num_nodes, topo.local_world_size
    per_layer, per_mb = layer_dispatch()
    t = torch.tensor([per_layer, per_mb], dtype=torch.float64)
    if dist.is_initialized():
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    out = {"kernel_overhead_us": float(t[0]), "microbatch_overhead_us": float(t[1])}
    data = ensure_data(folder, topo.rank)
    runs: dict[str, list[tuple[float, float]]] = {}
    layouts = probe_layouts(topo.world_size, per_node)
    for _ in range(PROBE_ROUNDS):  # rounds interleave the layouts, so load drift hits all of them
        for name, par in layouts.items():
            runs.setdefault(name, []).append(time_layout(probe_config(par, nodes, per_node, probe_model(name)),
                                                         topo, data, PROBE_STEPS))
    measured = {name: statistics.median(r[0] for r in v) for name, v in runs.items()}
    peaks = {name: max(r[1] for r in v) for name, v in runs.items()}
    if topo.rank == 0:
        for name in layouts:
            say(f"probe {name}: {1e3 * measured[name]:.1f} ms/step, peak RSS {peaks[name] / 2**20:.0f} MiB")
    out.update(fit_overheads(hw.scaled(**out), nodes, per_node, measured))
    sh = Shape.from_model(ModelConfig(**PROBE_MODEL))
    plan = plan_of(probe_layouts(topo.world_size, per_node)["dp"], PROBE_BATCH)
    mem = estimate(Problem(sh, hw.scaled(**out, reserved_gb=0.0), nodes, per_node, PROBE_BATCH), plan).memory
    out["reserved_gb"] = max(0.0, peaks["dp"] - mem["total"]) / GiB
    return out
