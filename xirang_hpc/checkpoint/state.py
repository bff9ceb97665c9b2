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
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from xirang_hpc.checkpoint.snapshot import capture_rng
from xirang_hpc.runtime.hooks import Loop


def _jsonable(v: Any) -> Any:
    if isinstance(v, torch.Tensor):
        return v.item() if v.numel() == 1 else v.tolist()
    if isinstance(v, (list, tuple)):
        return [_jsonable(x) for x in v]
    if isinstance(v, float) and not math.isfinite(v):
        return repr(v)
    return v


def _is_zero(opt: torch.optim.Optimizer) -> bool:
    # By name: checkpoint sits beside runtime in the layers and does not import it.
    return type(opt).__name__ in ("ZeroRedundancyOptimizer", "DpShardedOptimizer")


def _zero_local_state(model: torch.nn.Module, opt: Any) -> dict[str, Any]:
    """ZeRO-1: this rank's partition of the optimizer state, keyed by parameter name.

    Each name lives on exactly one rank, so DCP writes every entry once and the checkpoint has
    the same keys as a full ``get_state_dict`` (loads under any layout, with or without ZeRO).
    Missing entries are created as AdamW would on its first step (step 0, zero moments).
    """
    names = {id(p): n for n, p in model.named_parameters()}
    local = opt.optim
    out: dict[str, Any] = {}
    for g in local.param_groups:
        for p in g["params"]:
            st = local.state[p]
            if not st:
                st["step"] = torch.tensor(0.0)
                st["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                st["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            out[names[id(p)]] = st
    return out


def has_frozen(model: torch.nn.Module) -> bool:
    """Whether some parameters do not train (LoRA's frozen base): checkpoints then hold the trainable ones only."""
    return any(not p.requires_grad for p in model.parameters())


def _options(model: torch.nn.Module) -> StateDictOptions:
    # Frozen parameters come from model.init_from at every start; a checkpoint holds what trains (and its
    # optimizer state), and loading then leaves the frozen ones as they are (checked in apply_tensor_state).
    frozen = has_frozen(model)
    return StateDictOptions(ignore_frozen_params=frozen, strict=not frozen)


def tensor_state(model: torch.nn.Module, opt: torch.optim.Optimizer) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """(DCP tensor state dict, JSON-able optimizer param_groups). Initialises empty optimizer state.

    Frozen parameters (``requires_grad`` False) are left out: a LoRA checkpoint holds the adapters only.
    """
    if _is_zero(opt):
        groups = [{k: _jsonable(v) for k, v in g.items() if k != "params"} for g in opt.param_groups]
        return {"model": get_model_state_dict(model, options=_options(model)),
                "optim": {"state": _zero_local_state(model, opt)}}, groups
    msd, osd = get_state_dict(model, opt, options=_options(model))
    groups = [{k: _jsonable(v) for k, v in g.items()} for g in osd.get("param_groups", [])]
    return {"model": msd, "optim": {"state": osd["state"]}}, groups


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _live_ptrs(module_tensors: list[torch.Tensor], opt: Any) -> frozenset[int]:
    """Storage addresses of the module's parameters and buffers and of every optimizer state tensor."""
    ptrs = {_local(t).data_ptr() for t in module_tensors}
    for o in (opt, getattr(opt, "optim", None)):
        for st in getattr(o, "state", {}).values():
            ptrs.update(_local(v).data_ptr() for v in st.values() if isinstance(v, torch.Tensor))
    return frozenset(ptrs)


def _leaf_ptrs(obj: Any) -> set[int]:
    if isinstance(obj, torch.Tensor):
        return {_local(obj).data_ptr()}
    if isinstance(obj, dict):
        return {p for v in obj.values() for p in _leaf_ptrs(v)}
    return set()


class TensorStateCache:
    """:func:`tensor_state` built once and reused while it still aliases the live tensors.

    Building the DCP state dict (``get_state_dict``: FQN maps, optimizer state repacking) cost 20x
    the copy of the tiny model's bytes at every save. The optimizer and the model update their
    tensors in place, so the same dict stays right; it is reused only while the storage addresses of
    every parameter, buffer and optimizer state tensor are those it was built from, and only when its
    tensors share those storages (a state dict holding copies is rebuilt every time).
    """

    def __init__(self) -> None:
        self._cached: tuple[dict[str, Any], list[dict[str, Any]], frozenset[int]] | None = None
        self._module_tensors: list[torch.Tensor] = []  # walking the module tree each save cost more than the copy
        self._model: Any = None

    def get(self, model: torch.nn.Module, opt: Any) -> tuple[dict[str, Any], list[dict[str, Any]], bool]:
        """(tensors, JSON param groups with current hyperparameters, whether ``tensors`` is the cached object)."""
        if model is not self._model:
            self._model, self._module_tensors, self._cached = model, [*model.parameters(), *model.buffers()], None
        live = _live_ptrs(self._module_tensors, opt)
        if self._cached is not None and self._cached[2] == live:
            tensors, groups, _ = self._cached
            fresh = [{**g, **{k: _jsonable(v) for k, v in pg.items() if k != "params"}}
                     for g, pg in zip(groups, opt.param_groups)]
            return tensors, fresh, True
        tensors, groups = tensor_state(model, opt)
        self._module_tensors = [*model.parameters(), *model.buffers()]
        live = _live_ptrs(self._module_tensors, opt)  # tensor_state may have created the optimizer state
        self._cached = (tensors, groups, live) if _leaf_ptrs(tensors) <= live else None
        return tensors, groups, False


# How AdamW computes, set by train.optimizer_impl at every start: never taken from a checkpoint.
IMPL_KEYS = frozenset({"foreach", "fused"})


def _merge_groups(saved: list[dict[str, Any]], current: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Saved hyperparameters over the current groups (which keep their own ``params``).

    A foreach/fused AdamW under tensor parallelism splits each group in two (``origin_group``: the index of the
    group it came from, see ``runtime.data_parallel.split_dtensor_groups``); groups are matched through it, so
    a run can switch ``train.optimizer_impl`` when it resumes.
    """
    def origin(g: dict[str, Any], i: int) -> int:
        return int(g.get("origin_group", i))

    by_origin: dict[int, dict[str, Any]] = {}
    for i, s in enumerate(saved):
        by_origin.setdefault(origin(s, i), s)
    want = {origin(c, i) for i, c in enumerate(current)}
    if len(saved) != len(current) and want != set(by_origin):
        raise ValueError(f"checkpoint has {len(saved)} optimizer param groups, this optimizer {len(current)}")
    out = []
    for i, cur in enumerate(current):
        s = saved[i] if len(saved) == len(current) else by_origin[origin(cur, i)]
        g = dict(cur)
        for k, v in s.items():
            if k != "params" and k in cur and k not in IMPL_KEYS and k != "origin_group":
                g[k] = tuple(v) if isinstance(cur[k], tuple) else v
        out.append(g)
    return out


def apply_tensor_state(model: torch.nn.Module, opt: torch.optim.Optimizer, tensors: dict[str, Any],
                       saved_groups: list[dict[str, Any]], current_groups: list[dict[str, Any]]) -> None:
    """Put loaded tensors and hyperparameters back (``current_groups``: from :func:`tensor_state`)."""
    if _is_zero(opt):
        # DCP loaded the optimizer tensors in place into the local state; only weights and groups remain.
        _check_missing(model, set_model_state_dict(model, tensors["model"], options=_options(model)))
        for g, m in zip(opt.param_groups, _merge_groups(saved_groups, current_groups)):
            g.update({k: v for k, v in m.items() if k != "params"})
        for g, m in zip(opt.optim.param_groups, opt.param_groups):
            g.update({k: v for k, v in m.items() if k != "params"})
        return
    osd = {"state": tensors["optim"]["state"], "param_groups": _merge_groups(saved_groups, current_groups)}
    _check_missing(model, set_state_dict(model, opt, model_state_dict=tensors["model"], optim_state_dict=osd,
                                         options=_options(model)))


def _check_missing(model: torch.nn.Module, result: Any) -> None:
    """Non-strict loading (frozen parameters present) may skip only frozen parameters, never a trainable one."""
    missing = set(getattr(result, "missing_keys", None) or [])
    trainable = [n for n, p in model.named_parameters() if p.requires_grad and n in missing]
    if trainable:
        raise ValueError(f"checkpoint lacks trainable parameters: {', '.join(sorted(trainable)[:5])}")


class MetricsHistory:
    """The rows of a run's ``metrics.jsonl``, read incrementally: each save parses only what was appended since
    the one before (reading the whole file at every save costs O(steps) per save, O(steps^2) per run)."""

    def __init__(self) -> None:
        self.path: Path | None = None
        self.offset = 0
        self.rows: list[Any] = []

    def read(self, path: Path) -> list[Any]:
        """Every row of ``path`` so far (a list the caller must not change)."""
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            size = -1
        if path != self.path or size < self.offset:  # another file, or rewritten (a rollback truncates it)
            self.path, self.offset, self.rows = path, 0, []
        if size > self.offset:
            with path.open("rb") as f:
                f.seek(self.offset)
                chunk = f.read(size - self.offset)
            whole = chunk.rfind(b"\n") + 1  # a row being appended right now is read by the next save
            self.rows.extend(json.loads(line) for line in chunk[:whole].splitlines() if line.strip())
            self.offset += whole
        return self.rows


def run_state_json(trainer: Loop, lr: float, history: MetricsHistory | None = None) -> dict[str, Any]:
    """The global JSON side of a checkpoint (meaningful on rank 0); ``history`` keeps the metrics read so far."""
    s = trainer.state
    metrics: list[Any] = []
    if trainer.topo.rank == 0:
        metrics = list((history or MetricsHistory()).read(Path(trainer.metrics_path)))
    return {
        "step": s.step,
        "tokens_seen": s.tokens_seen,
        "initial_val_loss": s.initial_val_loss if math.isfinite(s.initial_val_loss) else None,
        # Sampling is a pure function of (seed, step): this is the whole data position, in any layout.
        "data_position": {"seed": trainer.cfg.train.seed, "next_step": s.step,
                          "global_batch": trainer.cfg.train.global_batch},
        "lr_schedule": {"kind": "warmup_cosine", "lr_at_step": lr, "lr": trainer.cfg.train.lr,
                        "warmup_steps": trainer.cfg.train.warmup, "max_steps": trainer.cfg.train.max_steps,
                        "min_lr_ratio": trainer.cfg.train.min_lr_ratio},
        "config": dataclasses.asdict(trainer.cfg),
        "metrics": metrics,
    }


def layout_json(trainer: Loop) -> dict[str, Any]:
    """Parallel layout facts recorded in the manifest."""
    layout = getattr(trainer, "layout", None)  # loops in tests may carry no layout
    dims = layout.dims if layout is not None else None
    out: dict[str, Any] = {"world_size": trainer.topo.world_size, "num_nodes": trainer.topo.num_nodes,
                           "parallel": dataclasses.asdict(trainer.cfg.parallel)}
    if dims is not None:
        out["dims"] = {k: getattr(dims, k) for k in ("dp", "tp", "pp") if hasattr(dims, k)}
    return out


def rank_state_json(trainer: Loop) -> dict[str, Any]:
    """This rank's JSON: its RNG states and coordinates."""
    return {"rank": trainer.topo.rank, "rng": capture_rng()}


def restore_run_state(trainer: Loop, state: dict[str, Any]) -> None:
    """Step, tokens and initial validation loss back into ``trainer.state``."""
    trainer.state.step = int(state["step"])
    trainer.state.tokens_seen = int(state["tokens_seen"])
    ivl = state.get("initial_val_loss")
    trainer.state.initial_val_loss = float("nan") if ivl is None else float(ivl)


def rewrite_metrics(path: Path, rows: list[dict[str, Any]]) -> None:
    """Replace a metrics file with the checkpoint's rows (drops rows of steps that were lost)."""
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
