"""The training loop: data parallel over the process group, progress and metrics on rank 0."""

from __future__ import annotations

import contextlib
import copy
import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.nn.parallel import DistributedDataParallel as DDP

from xirang_hpc.config.schema import XirangConfig
from xirang_hpc.data.dataset import ChatSamples, PairSamples, TokenWindows
from xirang_hpc.models.dpo import DpoTerms, completion_logps, dpo_terms
from xirang_hpc.models.gpt import full_model_params
from xirang_hpc.models.lora import adapters_disabled, lora_params
from xirang_hpc.runtime import liveness, testpoint
from xirang_hpc.runtime.data_parallel import build_optimizer
from xirang_hpc.runtime.hooks import TrainerHook
from xirang_hpc.runtime.parallel_dims import Layout, ParallelDims
from xirang_hpc.runtime.parallelize import clip_and_reduce, global_mean, make_optimizer, parallelize
from xirang_hpc.runtime.schedule import lr_at
from xirang_hpc.runtime.topology import Topology

# The clock is a tiny function so tests can substitute it.
now: Callable[[], float] = time.perf_counter


__all__ = ["Trainer", "TrainerHook", "RunState", "build_optimizer", "lr_at"]


def _mean_across(value: float, world: int) -> float:
    if world == 1:
        return value
    buf = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(buf)
    return float(buf.item()) / world


def _fmt_eta(seconds: float) -> str:
    s = int(max(0, seconds))
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


@dataclass
class RunState:
    """What the loop carries between steps (and what a checkpoint will hold)."""

    step: int = 0
    tokens_seen: int = 0
    initial_val_loss: float = float("nan")


class Trainer:
    """Data-parallel trainer for the GPT model on one process group."""

    def __init__(self, cfg: XirangConfig, topo: Topology, run_dir: Path, data_dir: Path,
                 log: Callable[[str], None] = print, hooks: list[TrainerHook] | None = None) -> None:
        self.cfg, self.topo, self.run_dir, self.log = cfg, topo, run_dir, log
        self.hooks: list[TrainerHook] = list(hooks or [])
        self.stop_requested = False
        # Per-rank state owned by hooks (name -> object with state_dict()/load_state_dict()), saved and
        # restored by the checkpoint hook for every rank (e.g. "comm": the local-SGD averaging state).
        self.extra_state: dict[str, Any] = {}
        self.state = RunState()
        # The build below runs collectives (the mesh, the weights' broadcast, FSDP's and DDP's set-up): the
        # hooks that watch the ranks (heartbeats, the watchdog) start first, so a rank that hangs here is named.
        for h in self.hooks:
            h.on_build_start(self)
        testpoint.pause("build", rank=topo.rank)  # tests only: a rank held in the build while its peers go on
        t = cfg.train
        # One layout object (degrees + the placement, gathered once), passed explicitly to everything
        # that builds or reduces over the parallel model; the mesh is built from the real topology.
        self.layout = Layout.for_job(cfg.parallel, topo)
        self.mesh = self.layout.build_mesh(topo, log_fn=log if topo.rank == 0 else None)
        # Initial weights come from train.seed inside parallelize (identical in every layout, no broadcast);
        # the global generator gets the same seed on every rank for anything else drawn at random.
        torch.manual_seed(t.seed)
        self.pm = parallelize(cfg, self.layout, self.mesh)
        self.dp_size, self.dp_rank = self.dims.dp, self.pm.coords["dp"]
        # ``model``: this rank's (stage of the) GPT, full-model parameter names; ``ddp``: what runs forward.
        self.model: nn.Module = self.pm.model
        self.ddp: nn.Module = self.pm.module
        self.opt = make_optimizer(self.pm, cfg, self.layout)
        d = cfg.data
        self.chat = d.format == "chat"
        self.dpo = cfg.finetune.method == "dpo"
        self.train_data: TokenWindows | ChatSamples | PairSamples
        self.val_data: TokenWindows | ChatSamples | PairSamples
        # DPO: the frozen reference (None with adapters: the policy with its adapters disabled) and the last
        # logged step's reward metrics.
        self.ref_model: nn.Module | None = None
        self.dpo_metrics: dict[str, float] = {}
        if self.dpo:
            self.train_data = PairSamples(data_dir, "train", cfg.model.seq_len, d.overlong, t.seed)
            self.val_data = PairSamples(data_dir, "val", cfg.model.seq_len, d.overlong, t.seed)
            self.refresh_reference()
            if topo.rank == 0:
                s, v = self.train_data.summary, self.val_data.summary
                log(f"preference pairs: {s['pairs']} train / {v['pairs']} val | overlong ({d.overlong}): "
                    f"{s['truncated'] + v['truncated']} truncated, {s['dropped'] + v['dropped']} dropped, "
                    f"{s['left_out_nothing_to_learn'] + v['left_out_nothing_to_learn']} left with nothing to learn "
                    f"| dpo beta {cfg.finetune.dpo.beta} | reference: "
                    f"{'the base (adapters disabled)' if cfg.finetune.adapters else 'a frozen copy of the start'}")
        elif self.chat:  # whole samples, masked targets: the loss is normalised over the global batch's learned tokens
            self.train_data = ChatSamples(data_dir, "train", cfg.model.seq_len, d.packing, d.overlong, t.seed)
            self.val_data = ChatSamples(data_dir, "val", cfg.model.seq_len, d.packing, d.overlong, t.seed)
            if topo.rank == 0:
                s, v = self.train_data.summary, self.val_data.summary
                log(f"chat data: {s['samples']} train / {v['samples']} val samples | packing {d.packing} | "
                    f"overlong ({d.overlong}): {s['truncated'] + v['truncated']} truncated, "
                    f"{s['dropped'] + v['dropped']} dropped, "
                    f"{s['left_out_nothing_to_learn'] + v['left_out_nothing_to_learn']} left with nothing to learn")
        else:
            self.train_data = TokenWindows(data_dir, "train", cfg.model.seq_len)
            self.val_data = TokenWindows(data_dir, "val", cfg.model.seq_len)
        # Accumulation steps without a pipeline (under pp, microbatches go to the schedule).
        self.accum = 1 if self.dims.pp > 1 else t.grad_accum * self.layout.parallel.microbatches
        self.micro = t.global_batch // (self.dp_size * self.accum)
        self.metrics_path = run_dir / "metrics.jsonl"

    @property
    def dims(self) -> ParallelDims:
        """The layout's degrees (``self.layout.dims``)."""
        return self.layout.dims

    def phase(self, phase: str) -> None:
        """Enter ``phase``: every hook's ``on_phase`` sees it (hooks.Loop.phase)."""
        for h in self.hooks:
            h.on_phase(self, phase)

    def request_stop(self) -> None:
        """End the loop cleanly at the next step boundary (hooks.Loop.request_stop)."""
        self.stop_requested = True

    def _record(self, row: dict[str, object]) -> None:
        if self.topo.rank == 0:
            for h in self.hooks:
                h.on_log(self, row)
            with self.metrics_path.open("a") as f:
                f.write(json.dumps(row) + "\n")

    def refresh_reference(self) -> None:
        """Make the DPO reference the model's current weights (the start: after ``model.init_from``, before a
        checkpoint restore; :class:`xirang_hpc.runtime.dpo.ReferenceHook`). With adapters there is nothing to copy."""
        if not self.dpo or self.cfg.finetune.adapters:
            return
        if self.ref_model is None:
            self.ref_model = copy.deepcopy(self.model)
            self.ref_model.requires_grad_(False)
            self.ref_model.eval()
        else:
            self.ref_model.load_state_dict(self.model.state_dict())

    def _dpo(self, module: nn.Module, x: torch.Tensor, y: torch.Tensor) -> DpoTerms:
        """DPO loss and rewards of (x, y): 2B rows, chosen then rejected, the completion's targets learned."""
        pi = completion_logps(module(x), y)
        with torch.no_grad():
            if self.ref_model is not None:
                ref = completion_logps(self.ref_model(x), y)
            else:
                with adapters_disabled(self.model):
                    ref = completion_logps(self.model(x), y)
        return dpo_terms(pi, ref, self.cfg.finetune.dpo.beta, self.cfg.finetune.dpo.loss)

    def _reduce_dpo(self, sums: torch.Tensor, pairs: int) -> dict[str, float]:
        """Means over the global batch of the per-pair reward sums (chosen, rejected, margin, accuracy)."""
        buf = torch.cat([sums.double(), torch.tensor([float(pairs)], dtype=torch.float64)])
        if dist.is_initialized() and self.topo.world_size > 1:
            dist.all_reduce(buf)
        n = max(float(buf[-1]), 1.0)
        names = ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies")
        return {k: float(v) / n for k, v in zip(names, buf[:-1])}

    def _batch(self, data: TokenWindows | ChatSamples | PairSamples, step: int, terms: int
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """This rank's (inputs, targets, position ids or None) of ``step``; for chat data also the loss denominator.

        ``terms``: how many loss terms this rank averages for the step (accumulation steps or pipeline
        microbatches); see :class:`xirang_hpc.models.loss.LossNorm` for why ``N / (terms * dp)``.
        """
        t = self.cfg.train
        if isinstance(data, PairSamples):
            x, y = data.batch(t.seed, step, t.global_batch, self.dp_rank, self.dp_size)
            return self._on_device(x, y, None)
        if isinstance(data, ChatSamples):
            x, y, pos, n_learned = data.batch(t.seed, step, t.global_batch, self.dp_rank, self.dp_size)
            # Under cp every shard is a term of its own too: the gradient reduction averages over dp x cp.
            self.model.loss_norm.denom = max(n_learned, 1) / (terms * self.dims.dp_cp)  # type: ignore[union-attr]
            return self._on_device(*self._shard(x, y, pos))
        x, y = data.batch(t.seed, step, t.global_batch, self.dp_rank, self.dp_size)
        return self._on_device(*self._shard(x, y, None))

    def _shard(self, x: torch.Tensor, y: torch.Tensor, pos: torch.Tensor | None
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Context parallelism: this rank's tokens of the rows its cp group shares, (B, T) -> (B, T/cp) each."""
        sh = self.pm.seq_shards
        if sh is None:
            return x, y, pos
        return sh.shard(x), sh.shard(y), None if pos is None else sh.shard(pos)

    def _on_device(self, x: torch.Tensor, y: torch.Tensor, pos: torch.Tensor | None
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The batch on the layout's device (read from the shards on the host)."""
        dev = self.layout.device
        if not dev.is_accelerator:
            return x, y, pos
        move = lambda t: t.to(dev.torch, non_blocking=True)  # noqa: E731
        return move(x), move(y), None if pos is None else move(pos)

    def _loss(self, module: nn.Module, x: torch.Tensor, y: torch.Tensor,
              pos: torch.Tensor | None = None) -> torch.Tensor:
        """Next-token loss of ``module`` on (x, y): the chunked head + loss in the forward, or the plain one.

        The mean over the batch's tokens, or (chat data) the sum over learned targets / ``loss_norm.denom``.
        """
        kw = {"position_ids": pos} if pos is not None else {}
        if self.cfg.train.loss_chunk_tokens:
            return module(x, targets=y, **kw).squeeze(0)
        return self.model.loss_fn(module(x, **kw), y,  # type: ignore[operator]
                                  self.model.loss_norm.denom if self.chat else None)  # type: ignore[union-attr]

    def _forward_loss(self, x: torch.Tensor, y: torch.Tensor, train: bool, pos: torch.Tensor | None = None) -> float:
        """Loss of this rank's batch slice through the pipeline (0.0 on non-last stages)."""
        losses: list[torch.Tensor] = []
        sched = self.pm.schedule
        run = sched.step if train else sched.eval  # type: ignore[union-attr]
        # A chunked loss is computed inside the last stage's forward: it gets the targets too (split per microbatch).
        fused = {"targets": y} if self.cfg.train.loss_chunk_tokens and self.pm.is_last_stage else {}
        # Packed samples: every stage builds its rotary positions and block-diagonal mask from the position ids.
        if pos is not None:
            fused["position_ids"] = pos
        if self.pm.is_first_stage:
            run(x, target=y if self.pm.is_last_stage else None, losses=losses, **fused)
        elif self.pm.is_last_stage:
            run(target=y, losses=losses, **fused)
        else:
            run(**fused)
        return float(torch.stack([v.detach().float() for v in losses]).mean()) if losses else 0.0

    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean validation loss over ``eval_batches`` fixed batches, averaged across ranks."""
        t = self.cfg.train
        self.model.eval()
        total = 0.0
        terms = self.pm.n_microbatches if self.pm.schedule is not None else 1
        for i in range(t.eval_batches):
            x, y, pos = self._batch(self.val_data, i, terms)
            if self.pm.schedule is not None:
                total += self._forward_loss(x, y, train=False, pos=pos)
            elif self.dpo:
                total += float(self._dpo(self.model, x, y).loss)
            else:
                total += self._loss(self.ddp if self.pm.data_parallel == "fsdp" else self.model, x, y, pos).item()
            testpoint.slow_item("eval")  # tests only: a long evaluation
            liveness.tick("eval batch")  # a long evaluation that still moves is no hang
        self.model.train()
        if self.pm.data_parallel == "fsdp":
            # No backward follows to reshard the weights an evaluation gathered and kept for one (ZeRO-2's blocks,
            # every root's embedding and head): free them now, so that between steps each rank holds its shards.
            for m in self.model.modules():
                if isinstance(m, FSDPModule):
                    m.reshard()
        with liveness.collective("evaluation mean all-reduce"):
            return global_mean(self.pm, total / t.eval_batches)

    def _grads_replicated(self) -> bool:
        """Plain synchronous DDP: every rank ends the backward with the same full gradients."""
        c = self.cfg.comm
        return (self.pm.data_parallel == "ddp" and self.pm.dims.tp == 1 and self.pm.dims.pp == 1
                and self.pm.expert is None
                and c.inter_node_budget == 0 and c.sync_period <= 1)

    def train_step(self, step: int, reduce_loss: bool = True) -> tuple[float, float]:
        """One optimizer step over the global batch; returns (mean loss, global grad norm before clipping).

        With ``reduce_loss=False`` a plain-DDP step skips the loss all-reduce and returns this
        rank's loss (the loop asks for the global mean only on the steps it logs).
        """
        t = self.cfg.train
        self.phase("data")
        x, y, pos = self._batch(self.train_data, step, self.pm.n_microbatches if self.pm.schedule is not None
                                else self.accum)
        for g in self.opt.param_groups:
            g["lr"] = lr_at(step, t)
        loss_sum = 0.0
        reward_sums = torch.zeros(4, dtype=torch.float64)  # DPO: chosen, rejected, margin, accuracy over pairs
        if self.pm.schedule is not None:
            # The schedule interleaves forward, backward and the stage-to-stage sends.
            self.phase("forward")
            loss_sum = self._forward_loss(x, y, train=True, pos=pos)
        else:
            fsdp = self.pm.data_parallel == "fsdp"
            for k in range(self.accum):
                mb = slice(k * self.micro, (k + 1) * self.micro)
                if self.dpo:  # rows are [chosen; rejected]: the micro-step's pairs from both halves
                    half = x.shape[0] // 2
                    xs = torch.cat([x[:half][mb], x[half:][mb]])
                    ys, ps = torch.cat([y[:half][mb], y[half:][mb]]), None
                else:
                    xs, ys, ps = x[mb], y[mb], (pos[mb] if pos is not None else None)  # (micro, T) each
                last = k == self.accum - 1
                # Skip the gradient all-reduce on all but the last micro-step of an accumulation.
                ctx = self.ddp.no_sync() if (not last and isinstance(self.ddp, DDP)) else contextlib.nullcontext()
                if fsdp:
                    # ZeRO-2/3 reduce-scatter every microbatch so gradients stay sharded (their memory saving;
                    # accumulating would hold full unsharded gradients); replication (ZeRO-0/1 under tp or pp)
                    # accumulates locally and all-reduces once, on the last. planner/cost.py costs the same.
                    self.model.set_requires_gradient_sync(last or self.pm.zero >= 2)  # type: ignore[operator]
                with ctx:
                    self.phase("forward")
                    if self.dpo:
                        terms = self._dpo(self.ddp, xs, ys)
                        loss = terms.loss
                        reward_sums += torch.stack([terms.chosen_rewards.sum(), terms.rejected_rewards.sum(),
                                                    terms.margins.sum(), terms.accuracies.sum()]).double().cpu()
                    else:
                        loss = self._loss(self.ddp, xs, ys, ps)
                    aux = self.model.moe_aux_loss() if self.cfg.model.moe_experts else None  # type: ignore[operator]
                    if aux is not None:  # MoE load balancing: part of the loss that is minimised
                        loss = loss + aux
                    loss = loss / self.accum
                    # DDP's all-reduce overlaps with backward; "backward" covers both.
                    self.phase("backward")
                    loss.backward()
                loss_sum += loss.item()
        self.phase("optimizer")
        if self.pm.expert is not None:  # expert shards: summed over the ranks holding the same experts
            with liveness.collective("expert-gradient all-reduce"):
                self.pm.expert.reduce_grads()
        with liveness.collective("grad-norm / loss all-reduce"):
            mean_loss, gnorm = clip_and_reduce(self.pm, t.grad_clip, loss_sum, self._grads_replicated(), reduce_loss)
        if self.dpo and reduce_loss:  # the logged steps: every rank reduces (the flag is the same on all)
            self.dpo_metrics = self._reduce_dpo(reward_sums, x.shape[0] // 2)
        self.opt.step()
        if self.cfg.model.moe_experts:
            self.model.moe_after_step()  # type: ignore[operator]  # expert-bias balancing, after the weights move
        self.opt.zero_grad(set_to_none=True)
        return mean_loss, gnorm

    def fit(self) -> dict[str, object]:
        """Train to ``train.end_step`` (``max_steps``, or ``extend_to``); returns the summary (meaningful on rank 0).

        The summary separates this session from the run: ``steps`` is the step reached,
        ``session_steps`` how many of them ran now, and ``tokens_per_s`` covers only those.
        """
        t, topo = self.cfg.train, self.topo
        end = t.end_step
        # DPO: every pair is two rows (chosen and rejected)
        tokens_per_step = t.global_batch * self.cfg.model.seq_len * (2 if self.dpo else 1)
        if topo.rank == 0:
            self.log(
                f"model {self.cfg.model.name}: {full_model_params(self.cfg.model) / 1e6:.2f}M params | "
                f"{topo.world_size} ranks on {topo.num_nodes} node(s) | dp={self.dp_size}"
                f"{f' x cp={self.dims.cp}' if self.dims.cp > 1 else ''} | {self.pm.precision} | "
                f"global batch {t.global_batch} x {self.cfg.model.seq_len} tokens | run dir {self.run_dir}"
            )
            if self.cfg.finetune.adapters:
                n = lora_params(self.cfg.model, self.cfg.finetune.lora)
                # fp32 adapters + AdamW's two moments: what a checkpoint holds (the base is frozen, not saved)
                self.log(f"lora: {n / 1e6:.3f}M trainable params ({', '.join(self.cfg.finetune.lora.modules())}, "
                         f"rank {self.cfg.finetune.lora.rank}) | checkpoint ~{3 * 4 * n / 1e6:.2f} MB "
                         "(adapters + optimizer state)")
        for h in self.hooks:
            h.on_fit_start(self)
        if math.isnan(self.state.initial_val_loss):
            self.phase("eval")
            self.state.initial_val_loss = self.evaluate()
            self._record({"step": self.state.step, "val_loss": self.state.initial_val_loss})
            if topo.rank == 0:
                self.log(f"step {self.state.step:>5}/{end} | val loss {self.state.initial_val_loss:.4f}")
        t0 = now()
        window_t, window_tokens = t0, 0
        start_step = self.state.step
        for step in range(start_step, end):
            if self.stop_requested:
                break
            logged = (step + 1) % t.log_every == 0 or step + 1 == end
            loss, gnorm = self.train_step(step, reduce_loss=logged)
            self.state.step = step + 1
            self.state.tokens_seen += tokens_per_step
            window_tokens += tokens_per_step
            if self.state.step % t.log_every == 0 or self.state.step == end:
                tnow = now()
                tok_s = window_tokens / max(tnow - window_t, 1e-9)
                eta = (end - self.state.step) * (tnow - t0) / (self.state.step - start_step)
                self._record({"step": self.state.step, "loss": loss, "grad_norm": gnorm,
                              "lr": lr_at(step, t), "tokens_per_s": tok_s, "time": time.time(),
                              **(self.dpo_metrics if self.dpo else {})})
                if topo.rank == 0:
                    dpo = (f" | reward margin {self.dpo_metrics['rewards/margins']:.4f} acc "
                           f"{self.dpo_metrics['rewards/accuracies']:.2f}" if self.dpo_metrics else "")
                    self.log(f"step {self.state.step:>5}/{end} | loss {loss:.4f}{dpo} | "
                             f"grad norm {gnorm:.3f} | {tok_s:,.0f} tok/s | ETA {_fmt_eta(eta)}")
                window_t, window_tokens = tnow, 0
            if t.eval_every and self.state.step % t.eval_every == 0 and self.state.step < end:
                self.phase("eval")
                val = self.evaluate()
                self._record({"step": self.state.step, "val_loss": val})
                if topo.rank == 0:
                    self.log(f"step {self.state.step:>5}/{t.max_steps} | val loss {val:.4f}")
            for h in self.hooks:
                h.on_step_end(self, {"loss": loss, "grad_norm": gnorm})
            testpoint.pause("step")  # tests only: a run that takes long without more work
        elapsed = now() - t0
        self.phase("eval")
        final_val = self.evaluate()
        self._record({"step": self.state.step, "val_loss": final_val})
        session_steps = self.state.step - start_step
        summary: dict[str, object] = {
            "initial_val_loss": self.state.initial_val_loss,
            "final_val_loss": final_val,
            "steps": self.state.step,
            "end_step": end,
            "start_step": start_step,
            "session_steps": session_steps,
            # Over this session's steps only (a resumed run did not train the restored ones now).
            "tokens_per_s": session_steps * tokens_per_step / elapsed if session_steps and elapsed > 0 else 0.0,
            "train_seconds": elapsed,
            "run_dir": str(self.run_dir),
            "world_size": topo.world_size,
            "stopped_early": self.state.step < end,
        }
        for h in self.hooks:
            h.on_fit_end(self, summary)
        return summary
