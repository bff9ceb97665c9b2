"""Runtime overheads for the CPU cost model, measured on small *probe* models during calibration.

Where compute is tiny (CPU ranks, small models) a step is dominated by fixed costs the FLOP model
cannot see: Python dispatch per layer, DTensor redistribution under tensor parallelism, the
pipelining schedule's bookkeeping per microbatch, FSDP2's hooks per unit, and per-step work
(grad-norm all-reduce, Adam's loop over tensors). Calibration measures them in this order:

1. per-layer cost: forward+backward of GPTs of width 32 (``DISPATCH_MODEL``), 128 (``PROBE_MODEL``),
   96 with sequence 128 (``ATTN_MODEL``) and 320 (``LAYER_MODEL``), each with 1 and 3 layers, on
   every rank at once, no communication. The per-layer slopes give ``kernel_overhead_us`` per layer
   and pass, ``gemm_efficiency`` (what a real layer reaches of the GEMM peak) and ``attn_score_ns``
   (softmax per attention score); the narrow model's intercept gives ``microbatch_overhead_us``
   (:func:`fit_layers`);
2. twelve runs of the real :class:`Trainer`, each in ``PROBE_ROUNDS`` interleaved rounds (median):
   dp with 2 layers, 4 layers and a wider model, dp + ZeRO-1, fsdp at two widths, HSDP with shard
   groups of 1 = replicate, a pipeline of up to 4 stages with 1 and 2 microbatches per stage,
   tp2 x pp at two activation sizes and with sequence parallelism. :data:`FITS` groups them: each
   group's residuals over the model's prediction (with the groups before it fitted) give its fields
   by non-negative least squares: ``step_overhead_us`` (per parameter tensor) + ``step_fixed_us`` +
   ``dp_overhead_us_per_mb`` (the three dp runs), ``zero1_overhead_us`` (per tensor),
   ``fsdp_unit_overhead_us`` + ``fsdp_overhead_us_per_mb``, ``replicate_unit_overhead_us``,
   ``pp_overhead_us``, ``tp_overhead_us`` + ``tp_overhead_us_per_mb``, ``sp_overhead_us``;
3. the peak RSS of the dp run minus its predicted model state -> ``reserved_gb`` (the torch + gloo
   process footprint); the wide fsdp run's peak beyond its prediction -> ``fsdp_buffer_factor``
   (:func:`fit_memory`).

The exposed fraction of the pipeline bubble is not fitted here but derived from ranks per core
(``calibrate.bubble_exposed``). The probes' shapes (widths 32, 96, 128 and 320) are not ones the
planner is evaluated on; the layouts are the runtime's mechanisms, so dp x tp, dp x pp and fsdp x tp are
predicted by composition.
"""

from __future__ import annotations

import ctypes
import gc
import itertools
import re
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from xirang_hpc.config.schema import ClusterConfig, ModelConfig, ParallelConfig, TrainConfig, XirangConfig
from xirang_hpc.planner.cost import Plan, Problem, estimate
from xirang_hpc.planner.defaults import PROBE_ROUNDS
from xirang_hpc.planner.formulas import Shape, layer_activation_bytes, layer_forward_flops, logits_flops
from xirang_hpc.planner.hardware import Hardware

PROBE_MODEL = {"name": "probe", "n_layer": 2, "n_head": 2, "d_model": 128, "d_ff": 512, "seq_len": 32}
# Layer-fit probes (fit_layers): one so narrow that per-layer dispatch dominates its time ...
DISPATCH_MODEL = {"name": "dispatch", "n_layer": 2, "n_head": 2, "d_model": 32, "d_ff": 128, "seq_len": 16}
# ... and the layer's efficiency against the GEMM peak on one wide enough for FLOPs to dominate
# (a width no evaluated preset uses, so the fit is not tuned to one).
LAYER_MODEL = {"name": "layer", "n_layer": 2, "n_head": 4, "d_model": 320, "d_ff": 1280, "seq_len": 64}
# ... and one narrow with a long sequence, where the softmax over attention scores is a large share.
ATTN_MODEL = {"name": "attn", "n_layer": 2, "n_head": 4, "d_model": 96, "d_ff": 384, "seq_len": 128}
PROBE_BATCH = 8
PROBE_STEPS = 10  # timed steps after 2 warm-up steps


# Probes on another shape than PROBE_MODEL: two TP probes separate TP's fixed cost per layer from its
# cost per activation byte (131 KB vs 328 KB of activations per rank: PROBE_MODEL at sequence 64 and
# LAYER_MODEL, bracketing the sizes real layers move; an 8 KB narrow probe overstated the fixed part,
# and two nearby points swung the slope 0-40k us/MB). The deep dp probe (4 layers)
# separates the per-step fixed cost from the per-tensor one; the wide dp and fsdp probes (LAYER_MODEL,
# 6x the gradient bytes at the same tensor and unit counts) separate per-MB synchronisation costs from
# per-tensor and per-unit ones.
# The pipeline probes run 4 layers so that up to 4 stages hold one each.
PROBE_MODELS = {"tp_narrow": {**PROBE_MODEL, "seq_len": 64}, "tp": LAYER_MODEL,
                "dp_deep": {**PROBE_MODEL, "n_layer": 4}, "dp_wide": LAYER_MODEL, "fsdp_wide": LAYER_MODEL,
                "pp": {**PROBE_MODEL, "n_layer": 4}, "pp_deep": {**PROBE_MODEL, "n_layer": 4}}

# Probes fitted together -> the Hardware fields they determine, in fitting order: each group's
# residuals (measured minus predicted) are taken with the fields of the groups before it in place.
# The pipeline and TP probes use no data parallelism where the world allows (pp alone; tp x pp), so
# their residuals are not differences of large replication costs.
FITS: tuple[tuple[tuple[str, ...], tuple[str, ...]], ...] = (
    (("dp", "dp_deep", "dp_wide"), ("step_overhead_us", "step_fixed_us", "dp_overhead_us_per_mb")),
    (("zero1",), ("zero1_overhead_us",)),
    (("fsdp", "fsdp_wide"), ("fsdp_unit_overhead_us", "fsdp_overhead_us_per_mb")),
    (("replicate",), ("replicate_unit_overhead_us",)),
    # One unknown over two probes (least squares). The exposed bubble is not fitted (it swung between 0
    # and 0.95 on the same box) but derived from ranks per core (calibrate.bubble_exposed).
    (("pp", "pp_deep"), ("pp_overhead_us",)),
    (("tp_narrow", "tp"), ("tp_overhead_us", "tp_overhead_us_per_mb")),
    (("sp",), ("sp_overhead_us",)),
)


def probe_model(name: str) -> dict[str, Any]:
    """The model a probe layout runs (PROBE_MODEL unless listed in PROBE_MODELS)."""
    return PROBE_MODELS.get(name, PROBE_MODEL)


def probe_layouts(world: int, per_node: int) -> dict[str, dict[str, Any]]:
    """Layouts to probe (:data:`FITS` groups them and sets the fitting order)."""
    dp = {"dp": world}
    fsdp = {"dp": world, "data_parallel": "fsdp"}
    out: dict[str, dict[str, Any]] = {
        "dp": dp, "dp_deep": dp, "dp_wide": dp,
        "zero1": {"dp": world, "optimizer_sharding": True},
        "fsdp": fsdp, "fsdp_wide": fsdp,
        # HSDP with shard groups of 1: what the runtime runs for dp with tp > 1 or pp > 1.
        "replicate": {"dp": world, "data_parallel": "fsdp", "dp_replicate": world},
    }
    if world % 2 == 0:
        stages = 4 if world % 4 == 0 else 2
        out["pp"] = {"dp": world // stages, "pp": stages, "microbatches": stages}
        out["pp_deep"] = {"dp": world // stages, "pp": stages, "microbatches": 2 * stages}
    if world % 2 == 0 and per_node % 2 == 0:
        rest = world // 2  # ranks beside the tp pair: pipeline stages first (2-layer probe models), then dp
        stages = 2 if rest % 2 == 0 else 1
        tp = {"dp": rest // stages, "tp": 2, "pp": stages, "microbatches": stages}
        out["tp_narrow"] = tp
        out["tp"] = tp
        out["sp"] = {**tp, "sequence_parallel": True}
    return out


def nnls(rows: list[tuple[float, ...]]) -> tuple[float, ...]:
    """Non-negative least squares for a few unknowns: rows are (a_1 .. a_k, r), minimise |A x - r|, x >= 0.

    Every subset of the unknowns is solved by least squares (k <= 3 here, so at most 7 small
    solves); the feasible solution with the smallest residual wins, fewer terms on a tie. An unknown
    that would have to be negative to fit (the probe ran faster than the model) is thus dropped, and
    the others explain the residuals alone.
    """
    a = np.array([r[:-1] for r in rows], dtype=np.float64)
    r = np.array([row[-1] for row in rows], dtype=np.float64)
    k = a.shape[1]
    best: tuple[float, int, np.ndarray] = (float(r @ r), 0, np.zeros(k))
    for size in range(1, k + 1):
        for cols in itertools.combinations(range(k), size):
            sub = a[:, cols]
            if size > len(rows) or np.linalg.matrix_rank(sub) < size:
                continue
            x = np.linalg.lstsq(sub, r, rcond=None)[0]
            if (x < 0).any():
                continue
            res = r - sub @ x
            err = float(res @ res)
            if err < best[0] * (1 - 1e-9) - 1e-30:
                full = np.zeros(k)
                full[list(cols)] = x
                best = (err, size, full)
    return tuple(float(v) for v in best[2])


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
    """Overhead fields from probe step times (seconds per step, by :func:`probe_layouts` name).

    Each :data:`FITS` group is a small linear system: a probe's residual over the model's prediction
    (its fields at 0) is the sum of each field times that field's effect on the probe (the predicted
    step with the field at 1 us minus at 0), solved by :func:`nnls`.
    """
    layouts = probe_layouts(nodes * per_node, per_node)
    out: dict[str, float] = {}

    def step(name: str, hw_: Hardware) -> float:
        sh = Shape.from_model(ModelConfig(**probe_model(name)))
        return estimate(Problem(sh, hw_, nodes, per_node, PROBE_BATCH), plan_of(layouts[name], PROBE_BATCH)).step_time

    for probes, fields in FITS:
        probes = tuple(n for n in probes if n in measured and n in layouts)
        if not probes:
            continue
        zero = hw.scaled(**out, **{f: 0.0 for f in fields})
        rows = []
        for name in probes:
            base = step(name, zero)
            if name == "replicate":  # the cost model charges it only with tp/pp > 1: one unit per layer + root
                effect = [(Shape.from_model(ModelConfig(**probe_model(name))).layers + 1) * 1e-6]
            else:
                effect = [step(name, zero.scaled(**{f: 1.0})) - base for f in fields]
            rows.append((*effect, measured[name] - base))
        out.update(zip(fields, nnls(rows)))
    return out


def layer_times(model: dict[str, Any], reps: int) -> tuple[float, float]:
    """(seconds per layer, seconds of the 1-layer model) of fwd+bwd of ``model`` with 1 and 3 layers.

    The two depths alternate and the per-pair difference is taken, so load drift cancels.
    """
    from xirang_hpc.models.gpt import GPT, lm_loss

    steps = []
    for layers in (1, 3):
        cfg = ModelConfig(**{**model, "n_layer": layers})
        net = GPT(cfg)
        x = torch.randint(0, cfg.vocab_size, (PROBE_BATCH, cfg.seq_len))

        def step(net: torch.nn.Module = net, x: torch.Tensor = x) -> float:
            t0 = time.perf_counter()
            lm_loss(net(x), x).backward()
            return time.perf_counter() - t0

        step()
        steps.append(step)
    pairs = [(steps[0](), steps[1]()) for _ in range(reps)]
    return max(0.0, statistics.median(b - a for a, b in pairs) / 2), statistics.median(a for a, _ in pairs)


def fit_layers(hw: Hardware, points: list[tuple[dict[str, Any], float, float]]) -> dict[str, float]:
    """``kernel_overhead_us``, ``gemm_efficiency``, ``attn_score_ns``, ``microbatch_overhead_us``.

    ``points`` are (model, seconds per layer, seconds of the 1-layer model), narrowest model first.
    The cost model charges a layer's fwd+bwd 3 * (kernel overhead + flops / rate(w) + score elements
    * attn_score_ns + activation streaming), rate(w) = peak * efficiency * w/(w + gemm_half_width), with
    peak and half width from the GEMM microbenchmark. That is linear in (kernel overhead,
    1/efficiency, ns per score), and the three scale differently (1; ~w^2; a*s^2), so layers of
    different width and sequence separate them (:func:`nnls`, relative errors). Pure GEMMs overstate
    what a real layer's backward GEMMs, attention and copies reach: the fitted terms are that gap.
    """
    rows = []
    for model, per_layer, _ in points:
        sh = Shape.from_model(ModelConfig(**model))
        dense, attn = layer_forward_flops(sh, PROBE_BATCH * sh.seq)
        w = sh.hidden
        at_peak = 3 * (dense + attn) * (w + hw.gemm_half_width) / w / (hw.peak_tflops * 1e12)
        scores = 3 * PROBE_BATCH * sh.heads * sh.seq**2 * 1e-9
        stream = 3 * layer_activation_bytes(sh, PROBE_BATCH, 1, False, "none", hw.act_bytes,
                                        dropout=True) / (hw.mem_bw_gbs * 1e9)  # cost.py's traffic proxy
        target = per_layer - hw.elementwise_traffic * stream
        rows.append((3e-6 / per_layer, at_peak / per_layer, scores / per_layer, target / per_layer))
    kernel_us, inv_eff, score_ns = nnls(rows)
    eff = 1.0 / inv_eff if inv_eff > 0 else hw.gemm_efficiency
    # The narrow model's 1-layer time minus its layer leaves embedding + head + loss; the head's FLOPs
    # are charged by the cost model already.
    model, per_layer, one = points[0]
    sh = Shape.from_model(ModelConfig(**model))
    rate = hw.peak_tflops * 1e12 * eff * sh.hidden / (sh.hidden + hw.gemm_half_width)
    head = 3 * logits_flops(sh, PROBE_BATCH * sh.seq) / rate
    return {"kernel_overhead_us": kernel_us, "gemm_efficiency": eff, "attn_score_ns": score_ns,
            "microbatch_overhead_us": max(0.0, one - per_layer - head) * 1e6}


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
        prepare(str(Path(sysconfig.get_paths()["stdlib"]) / "email"), out, val_fraction=0.2, progress=None)
    if dist.is_initialized():
        dist.barrier()
    return out


def measure_overheads(hw: Hardware, topo: Any, folder: Path, say: Callable[[str], None] = print,
                      rounds: int = PROBE_ROUNDS) -> dict[str, float]:
    """Steps 1-3 of the module docstring, on this rank (process group up); same result on every rank.
    ``rounds``: interleaved rounds of the twelve probe runs (the median is kept; fewer is faster and noisier)."""
    nodes, per_node = topo.num_nodes, topo.local_world_size
    models = ((DISPATCH_MODEL, 20), (PROBE_MODEL, 12), (ATTN_MODEL, 10), (LAYER_MODEL, 8))
    t = torch.tensor([layer_times(m, reps) for m, reps in models], dtype=torch.float64)
    if dist.is_initialized():  # every rank ran at once (the node's cores shared as in training): mean share
        dist.all_reduce(t)
        t /= dist.get_world_size()
    out = fit_layers(hw, [(m, *row) for (m, _), row in zip(models, t.tolist())])
    data = ensure_data(folder, topo.rank)
    runs: dict[str, list[tuple[float, float]]] = {}
    layouts = probe_layouts(topo.world_size, per_node)
    for _ in range(rounds):  # rounds interleave the layouts, so load drift hits all of them
        for name, par in layouts.items():
            runs.setdefault(name, []).append(time_layout(probe_config(par, nodes, per_node, probe_model(name)),
                                                         topo, data, PROBE_STEPS))
    measured = {name: statistics.median(r[0] for r in v) for name, v in runs.items()}
    peaks = {name: max(r[1] for r in v) for name, v in runs.items()}
    if topo.rank == 0:
        for name in layouts:
            say(f"probe {name}: {1e3 * measured[name]:.1f} ms/step, peak RSS {peaks[name] / 2**20:.0f} MiB")
    out.update(fit_overheads(hw.scaled(**out), nodes, per_node, measured))
    out.update(fit_memory(hw.scaled(**out), nodes, per_node, peaks))
    return out


def fit_memory(hw: Hardware, nodes: int, per_node: int, peaks: dict[str, float]) -> dict[str, float]:
    """``reserved_gb`` and ``fsdp_buffer_factor`` from probe peak RSS bytes (by probe name).

    The dp probe's peak minus its predicted model state is the process footprint (torch, gloo,
    allocator); the wide fsdp probe's peak beyond its prediction with that footprint is FSDP's extra
    buffers, per unsharded parameter byte.
    """
    from xirang_hpc.planner.cost import GiB

    layouts = probe_layouts(nodes * per_node, per_node)

    def mem(name: str, hw_: Hardware) -> float:
        sh = Shape.from_model(ModelConfig(**probe_model(name)))
        return estimate(Problem(sh, hw_, nodes, per_node, PROBE_BATCH), plan_of(layouts[name], PROBE_BATCH)).peak_memory

    out = {"reserved_gb": max(0.0, peaks["dp"] - mem("dp", hw.scaled(reserved_gb=0.0))) / GiB}
    if "fsdp_wide" in peaks:
        cur = hw.scaled(**out, fsdp_buffer_factor=0.0)
        base = mem("fsdp_wide", cur)
        unit = mem("fsdp_wide", cur.scaled(fsdp_buffer_factor=1.0)) - base
        out["fsdp_buffer_factor"] = max(0.0, peaks["fsdp_wide"] - base) / unit if unit > 0 else 0.0
    return out
