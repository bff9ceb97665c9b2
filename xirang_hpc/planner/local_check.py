"""Predicted vs measured on this machine: train each candidate layout for real on local gloo ranks.

Used by ``benchmarks/bench_planner.py --local`` and the planner's slow test. Candidates are the
fastest predicted plan of every runnable (dp, tp, pp, ZeRO) layout; each is written into a config
(``auto.apply_plan``) and trained for a few steps by the real :class:`Trainer` in one gloo process
group of ``nodes x per_node`` spawned ranks (virtual nodes, as the local executor makes them;
:class:`~xirang_hpc.runtime.local_ranks.LocalRanks`).
"""

from __future__ import annotations

import dataclasses
import tempfile
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from omegaconf import OmegaConf

from xirang_hpc.config.schema import ClusterConfig, XirangConfig
from xirang_hpc.config.validate import validate
from xirang_hpc.planner.auto import apply_plan, plan_for
from xirang_hpc.planner.cost import Estimate
from xirang_hpc.runtime.local_ranks import LocalRanks, RankPlace


def load_cluster(path: Path) -> ClusterConfig:
    """A ``cluster/`` preset YAML (e.g. written by ``xirang-plan --calibrate``) as a ClusterConfig."""
    data = OmegaConf.to_container(OmegaConf.load(path))
    fields = {f.name for f in dataclasses.fields(ClusterConfig)}
    return ClusterConfig(**{k: v for k, v in data.items() if k in fields})


def candidates(cfg: XirangConfig) -> list[tuple[str, Estimate, XirangConfig]]:
    """(name, prediction, config) of the fastest runnable plan per (dp, tp, pp, ZeRO), fastest first."""
    res = plan_for(cfg)
    seen: set[tuple[int, int, int, int]] = set()
    out = []
    for e in res.ranked:
        p = e.plan
        key = (p.dp, p.tp, p.pp, p.zero)
        if key in seen:
            continue
        seen.add(key)
        zero = {0: "", 1: "zero1", 2: "zero2", 3: "fsdp"}[p.zero]
        name = "x".join(f"{k}{v}" for k, v in (("dp", p.dp), ("tp", p.tp), ("pp", p.pp)) if v > 1) or "single"
        out.append((f"{zero}:{name}" if zero else name, e, validate(apply_plan(cfg, p))))
    return out


def _worker(place: RankPlace, queue: Any, jobs: list[tuple[str, XirangConfig]], data: str, steps: int,
            rounds: int) -> None:
    from xirang_hpc.planner.probe import time_layout

    torch.set_num_threads(1)
    try:
        place.init_process_group("gloo")
        topo = place.topology("plan-check")
        for rnd in range(rounds):  # rounds interleave the layouts, so load changes hit all of them
            for name, cfg in jobs:
                queue.put((place.rank, name, rnd, time_layout(cfg, topo, Path(data), steps)))
        queue.put((place.rank, "__done__", 0, None))
    except Exception:  # report to the parent instead of hanging it
        queue.put((place.rank, "__error__", 0, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def prepared_data(folder: Path | None = None) -> Path:
    """The stdlib ``email`` package prepared once under ``folder`` (default: the temp dir)."""
    import sysconfig

    from xirang_hpc.data.prepare import is_prepared, prepare

    out = Path(folder or tempfile.gettempdir()) / "xirang-plan-check-data"
    if not is_prepared(out):
        prepare(str(Path(sysconfig.get_paths()["stdlib"]) / "email"), out, val_fraction=0.2, progress=None)
    return out


def measure(jobs: list[tuple[str, XirangConfig]], nodes: int, per_node: int, steps: int = 8, rounds: int = 1,
            data: Path | None = None, spread: dict[str, list[float]] | None = None) -> dict[str, tuple[float, float]]:
    """name -> (median over rounds of the median step seconds, max peak RSS bytes) on spawned ranks.

    ``spread``, when given, receives each layout's per-round step seconds.
    """
    import statistics

    world = nodes * per_node
    data = data or prepared_data()
    got: dict[str, list[tuple[float, float]]] = {}
    done = 0
    with LocalRanks(_worker, world, (jobs, str(data), steps, rounds), nodes=nodes) as ranks:
        while done < world:
            rank, name, _rnd, res = ranks.get()
            if name == "__error__":
                raise RuntimeError(f"rank {rank}:\n{res}")
            if name == "__done__":
                done += 1
            elif rank == 0:  # every rank holds the same (all-reduced) figures
                got.setdefault(name, []).append(res)
    if spread is not None:
        spread.update({k: [r[0] for r in v] for k, v in got.items()})
    return {k: (statistics.median(r[0] for r in v), max(r[1] for r in v)) for k, v in got.items()}
