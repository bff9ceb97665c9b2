"""What a training checkpoint holds, and how it goes into and out of a trainer.

Tensors (model + optimizer state) go through DCP's ``get_state_dict``/``set_state_dict`` so
DTensor (TP, FSDP2) and pipeline stages (full-model parameter names) reshard unchanged.
Everything else is JSON: optimizer hyperparameters (``param_groups``), the run state (step,
tokens, initial validation loss), the LR schedule, the composed config and layout, metrics so
far, and each rank's RNG states.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from xirang_hpc.checkpoint.snapshot import capture_rng


def _jsonable(v: Any) -> Any:
    if isinstance(v, torch.Tensor):
        return v.item() if v.numel() == 1 else v.tolist()
    if isinstance(v, (list, tuple)):
        return [_jsonable(x) for x in v]
    if isinstance(v, float) and not math.isfinite(v):
        return repr(v)
    return v


def _check_supported(opt: torch.optim.Optimizer) -> None:
    if type(opt).__name__ == "ZeroRedundancyOptimizer":
        raise NotImplementedError(
            "checkpointing a ZeroRedundancyOptimizer (parallel.optimizer_sharding=true) is not supported by "
            "DCP's get_state_dict; use parallel.data_parallel=fsdp for sharded optimizer state")


def tensor_state(model: torch.nn.Module, opt: torch.optim.Optimizer) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """(DCP tensor state dict, JSON-able optimizer param_groups). Initialises empty optimizer state."""
    _check_supported(opt)
    msd, osd = get_state_dict(model, opt)
    groups = [{k: _jsonable(v) for k, v in g.items()} for g in osd.get("param_groups", [])]
    return {"model": msd, "optim": {"state": osd["state"]}}, groups


def apply_tensor_state(model: torch.nn.Module, opt: torch.optim.Optimizer, tensors: dict[str, Any],
                       groups: list[dict[str, Any]]) -> None:
    """Put loaded tensors and param_groups back into ``model``/``opt``."""
    current = opt.state_dict()["param_groups"]
    fixed = []
    for saved, cur in zip(groups, current):
        g = dict(saved)
        for k, v in cur.items():
            if isinstance(v, tuple) and k in g:
                g[k] = tuple(g[k])
        fixed.append(g)
    osd = {"state": tensors["optim"]["state"], "param_groups": fixed}
    set_state_dict(model, opt, model_state_dict=tensors["model"], optim_state_dict=osd)


def run_state_json(trainer: Any, lr: float) -> dict[str, Any]:
    """The global JSON side of a checkpoint (meaningful on rank 0)."""
    s = trainer.state
    metrics: list[Any] = []
    path = Path(trainer.metrics_path)
    if trainer.topo.rank == 0 and path.exists():
        metrics = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return {
        "step": s.step,
        "tokens_seen": s.tokens_seen,
        "initial_val_loss": s.initial_val_loss if math.isfinite(s.initial_val_loss) else None,
        "lr_schedule": {"kind": "warmup_cosine", "lr_at_step": lr, "lr": trainer.cfg.train.lr,
                        "warmup_steps": trainer.cfg.train.warmup_steps, "max_steps": trainer.cfg.train.max_steps,
                        "min_lr_ratio": trainer.cfg.train.min_lr_ratio},
        "config": dataclasses.asdict(trainer.cfg),
        "metrics": metrics,
    }


def layout_json(trainer: Any) -> dict[str, Any]:
    """Parallel layout facts recorded in the manifest."""
    dims = getattr(trainer, "dims", None)
    out: dict[str, Any] = {"world_size": trainer.topo.world_size, "num_nodes": trainer.topo.num_nodes,
                           "parallel": dataclasses.asdict(trainer.cfg.parallel)}
    if dims is not None:
        out["dims"] = {k: getattr(dims, k) for k in ("dp", "tp", "pp") if hasattr(dims, k)}
    return out


def rank_state_json(trainer: Any) -> dict[str, Any]:
    """This rank's JSON: its RNG states and coordinates."""
    return {"rank": trainer.topo.rank, "rng": capture_rng()}


def restore_run_state(trainer: Any, state: dict[str, Any]) -> None:
    """Step, tokens and initial validation loss back into ``trainer.state``."""
    trainer.state.step = int(state["step"])
    trainer.state.tokens_seen = int(state["tokens_seen"])
    ivl = state.get("initial_val_loss")
    trainer.state.initial_val_loss = float("nan") if ivl is None else float(ivl)


def rewrite_metrics(path: Path, rows: list[dict[str, Any]]) -> None:
    """Replace a metrics file with the checkpoint's rows (drops rows of steps that were lost)."""
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
