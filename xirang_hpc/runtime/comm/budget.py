"""Bandwidth budget: sync nodes every H steps (post-local-SGD / DiLoCo) instead of every step.

Ranks inside a node keep averaging gradients every step (shared memory, free of the slow
links). Across nodes, parameters are averaged every ``H`` steps, as in
``torch.distributed.algorithms.model_averaging.HierarchicalModelAverager``; optionally the
average is applied through an outer Nesterov step (DiLoCo, Douillard et al. 2023: outer lr 0.7,
momentum 0.9). ``H = 1`` is plain synchronous data parallelism: gradients are all-reduced over
all nodes every step and no parameters are averaged, so it equals DDP exactly.

H from a budget ``B`` (bytes/s per node NIC): one averaging moves ``2(m-1)/m * P`` bytes
through each node's NIC (ring all-reduce of the ``P`` parameter bytes over ``m`` nodes), and
the local steps take ``T`` seconds each, so ``H = ceil(2(m-1)/m * P / (B * T))``.
"""

from __future__ import annotations

import logging
import math
import statistics
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from xirang_hpc.runtime.comm.hierarchical import HierarchicalAllreduce

log = logging.getLogger(__name__)


def budget_bytes_per_s(budget: float, link_bytes_per_s: float) -> float:
    """``budget > 1``: bytes/s as given; ``0 < budget <= 1``: that fraction of the measured link."""
    return budget if budget > 1 else budget * link_bytes_per_s


def derive_period(param_bytes: float, nodes: int, budget_Bps: float, step_s: float, max_period: int = 100000) -> int:
    """Smallest sync period H whose average inter-node bytes/s stay within ``budget_Bps``."""
    if nodes <= 1 or budget_Bps <= 0 or step_s <= 0:
        return 1
    per_sync = 2 * (nodes - 1) / nodes * param_bytes
    return max(1, min(max_period, math.ceil(per_sync / (budget_Bps * step_s) - 1e-9)))


class ModelAverager:
    """Cross-node parameter averaging every ``period`` steps, with an optional outer Nesterov step.

    ``period=0`` means: calibrate during the first ``calibration_steps`` synchronous steps, then
    derive the period from ``budget`` (see module docstring). Call :meth:`after_step` after every
    optimizer step on every rank.
    """

    def __init__(self, params: list[torch.nn.Parameter], ar: HierarchicalAllreduce,
                 set_inter_node: Callable[[bool], None], period: int = 0, budget: float = 0.0,
                 calibration_steps: int = 3, outer: str = "average", outer_lr: float = 0.7,
                 outer_momentum: float = 0.9, log_fn: Callable[[str], None] | None = None) -> None:
        self.params, self.ar, self._set_inter_node = params, ar, set_inter_node
        self.period, self.budget, self.calibration_steps = period, budget, calibration_steps
        self.outer, self.outer_lr, self.outer_momentum = outer, outer_lr, outer_momentum
        self._log = log_fn
        self.local_steps = 0  # completed steps since the last cross-node sync
        self.syncs = 0
        self.decision: dict[str, float] = {}
        self.global_params: torch.Tensor | None = None  # DiLoCo: parameters after the last outer step
        self.momentum: torch.Tensor | None = None
        self._calib: list[tuple[float, float, float]] = []
        self._last_counters = (0.0, 0.0)
        if period > 1:
            self._start_local()

    @property
    def param_bytes(self) -> int:
        """Bytes of the averaged parameters."""
        return sum(p.numel() * p.element_size() for p in self.params)

    def _say(self, msg: str) -> None:
        log.info(msg)
        if self._log is not None:
            self._log(msg)

    def _flat(self) -> torch.Tensor:
        return _flatten_dense_tensors([p.detach() for p in self.params])

    def _assign(self, flat: torch.Tensor) -> None:
        with torch.no_grad():
            for p, v in zip(self.params, _unflatten_dense_tensors(flat, [p.detach() for p in self.params])):
                p.copy_(v)

    def _start_local(self) -> None:
        self._set_inter_node(False)
        if self.outer == "nesterov" and self.global_params is None:
            self.global_params = self._flat().clone()
            self.momentum = torch.zeros_like(self.global_params)

    def after_step(self, step_s: float, final: bool = False) -> None:
        """Bookkeeping after an optimizer step: calibrate, or average across nodes when due."""
        if self.period == 0:
            b, s = self.ar.internode_bytes, self.ar.internode_s
            self._calib.append((step_s, b - self._last_counters[0], s - self._last_counters[1]))
            self._last_counters = (b, s)
            if len(self._calib) > self.calibration_steps:  # the first step is warm-up
                self._decide()
            return
        if self.period == 1:
            return
        self.local_steps += 1
        if self.local_steps >= self.period or final:
            self.sync()

    def _decide(self) -> None:
        lay = self.ar.layout
        rows = self._calib[1:]
        step_s = statistics.median(r[0] for r in rows)
        comm_s = statistics.median(r[2] for r in rows)
        bytes_step = statistics.median(r[1] for r in rows)
        vals = torch.tensor([step_s, comm_s, bytes_step * lay.local], dtype=torch.float64)
        if dist.is_initialized():
            dist.all_reduce(vals, op=dist.ReduceOp.MAX)  # the same inputs (so the same H) on every rank
        step_s, comm_s, node_bytes = (float(v) for v in vals)
        link = node_bytes / comm_s if comm_s > 0 else 0.0
        local_s = max(step_s - comm_s, 0.25 * step_s)
        budget = budget_bytes_per_s(self.budget, link)
        self.period = derive_period(self.param_bytes, lay.num_nodes, budget, local_s)
        self.decision = {"period": self.period, "link_bytes_per_s": link, "budget_bytes_per_s": budget,
                         "local_step_s": local_s, "sync_step_s": step_s, "param_bytes": self.param_bytes}
        self._say(f"comm: inter-node budget {budget / 1e6:.2f} MB/s (link measured {link / 1e6:.1f} MB/s), "
                  f"params {self.param_bytes / 1e6:.2f} MB, local step {local_s * 1e3:.1f} ms "
                  f"-> sync every H={self.period} steps")
        if self.period > 1:
            self._start_local()

    def sync(self) -> None:
        """Average parameters over all nodes now (collective over the data-parallel group)."""
        flat = self._flat()
        self.ar.allreduce_([flat], inter_node=True)
        if self.outer == "nesterov":
            assert self.global_params is not None and self.momentum is not None
            delta = self.global_params - flat  # the averaged outer gradient
            self.momentum.mul_(self.outer_momentum).add_(delta)
            self.global_params.sub_(self.outer_lr * (delta + self.outer_momentum * self.momentum))
            flat = self.global_params
        self._assign(flat)
        self.local_steps = 0
        self.syncs += 1

    def state_dict(self) -> dict[str, Any]:
        """JSON-able scalars plus the outer-optimizer tensors (None unless nesterov)."""
        return {"period": self.period, "local_steps": self.local_steps, "syncs": self.syncs,
                "decision": dict(self.decision), "global_params": self.global_params, "momentum": self.momentum}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        """Restore after :meth:`state_dict` (call after the model's parameters are restored)."""
        self.period, self.local_steps, self.syncs = int(sd["period"]), int(sd["local_steps"]), int(sd["syncs"])
        self.decision = dict(sd.get("decision") or {})
        if sd.get("global_params") is not None:
            self.global_params = sd["global_params"].clone()
            self.momentum = sd["momentum"].clone()
        self._set_inter_node(self.period <= 1)
        if self.period > 1:
            self._start_local()
