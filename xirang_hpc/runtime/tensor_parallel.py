"""Megatron-style tensor parallelism for the GPT blocks, with DTensor parallel styles.

Per block (Shoeybi et al. 2019): q/k/v and MLP up/gate are column-parallel (each rank holds
``n_head/tp`` heads, ``ffn/tp`` hidden units), attention output and MLP down are row-parallel
(their all-reduce restores the full residual). Attention derives its local head count from the
local width, so the model code runs unchanged on a shard. Embeddings, norms and head stay
replicated (small for our vocab); their gradients are identical on every tp rank because the
column-parallel inputs all-reduce their gradient in backward.

LoRA adapters (``finetune.method=lora``) are sharded with their base layer, so the adapted projection
computes exactly what the unsharded one does: beside a column-parallel ``W`` (rows split), ``A`` is
replicated and ``B`` is split by the same rows, so each rank adds the update of its own output columns;
beside a row-parallel ``W`` (columns split), ``A`` is split by the same input columns and ``B`` is
replicated, and the update's partial sums are reduced together with the base's, in the same all-reduce.

A mixture-of-experts feed-forward (``models/moe.py``) stays whole on every tp rank: its router, experts and
shared expert run on the full (replicated) activations, so each tp rank routes and computes the same tokens
and gets the same gradients, as the replicated norms do (Megatron-Core's expert tensor parallelism of 1).
Only the attention is split. The experts' memory is shared out by expert parallelism instead
(``parallel.ep``, over the data-parallel ranks of each tp position; ``runtime/expert_parallel.py``).

Optional sequence parallelism (Korthikanti et al. 2022): between the two sublayers the residual
stream is split along the sequence dimension, norms run on the local slice, and the all-reduces
become all-gather + reduce-scatter. The stage boundary (first/last owned block) gathers the
sequence back, so pipeline stages always exchange full (B, T, C) activations.
"""

from __future__ import annotations

from functools import partial

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Placement, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from xirang_hpc.models.lora import LoRALinear
from xirang_hpc.models.moe import MoE


def _shard_params(module: nn.Module, mesh: DeviceMesh, placements: dict[str, Placement], src_data_rank: int) -> None:
    """Replace ``module``'s own parameters (not its children's) by DTensors placed as ``placements`` says."""
    for name, param in list(module.named_parameters(recurse=False)):
        dist = distribute_tensor(param, mesh, [placements[name]], src_data_rank=src_data_rank)
        module.register_parameter(name, nn.Parameter(dist, requires_grad=param.requires_grad))


class ColwiseLoRA(ColwiseParallel):
    """:class:`ColwiseParallel` for a :class:`LoRALinear`: ``W``, bias and ``B`` split by output rows, ``A`` whole."""

    def _partition(self, name: str, module: nn.Module, mesh: DeviceMesh) -> None:
        if isinstance(module, LoRALinear):
            _shard_params(module, mesh, {"weight": Shard(0), "bias": Shard(0)}, self.src_data_rank)
        elif name in ("lora_A", "lora_B"):
            _shard_params(module, mesh, {"weight": Replicate() if name == "lora_A" else Shard(0)}, self.src_data_rank)

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return distribute_module(module, device_mesh, self._partition,
                                 partial(self._prepare_input_fn, self.input_layouts, self.desired_input_layouts),
                                 partial(self._prepare_output_fn, self.output_layouts, self.use_local_output))


class RowwiseLoRA(RowwiseParallel):
    """:class:`RowwiseParallel` for a :class:`LoRALinear`: ``W`` and ``A`` split by input columns, bias and ``B``
    whole; the update's partial sums reduce with the base's."""

    def _partition(self, name: str, module: nn.Module, mesh: DeviceMesh) -> None:
        if isinstance(module, LoRALinear):
            _shard_params(module, mesh, {"weight": Shard(1), "bias": Replicate()}, self.src_data_rank)
        elif name in ("lora_A", "lora_B"):
            _shard_params(module, mesh, {"weight": Shard(1) if name == "lora_A" else Replicate()}, self.src_data_rank)

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        self.desired_input_layouts = (Shard(-1),)
        return distribute_module(module, device_mesh, self._partition,
                                 partial(self._prepare_input_fn, self.input_layouts, self.desired_input_layouts),
                                 partial(self._prepare_output_fn, self.output_layouts, self.use_local_output))


def block_plan(swiglu: bool, sequence_parallel: bool, adapted: frozenset[str] = frozenset(),
               moe: bool = False) -> dict[str, object]:
    """The per-block plan: module FQN (relative to the block) -> parallel style (``adapted``: the LoRA targets;
    ``moe``: the block's feed-forward is a mixture of experts, whose weights stay whole on every tp rank)."""
    sp_in, sp_out = (Shard(1), Shard(1)) if sequence_parallel else (None, None)

    def col(name: str) -> object:
        return (ColwiseLoRA if name in adapted else ColwiseParallel)(input_layouts=sp_in)

    def row(name: str) -> object:
        return (RowwiseLoRA if name in adapted else RowwiseParallel)(output_layouts=sp_out)

    plan: dict[str, object] = {"attn.q": col("attn.q"), "attn.k": col("attn.k"), "attn.v": col("attn.v"),
                               "attn.o": row("attn.o")}
    if moe:
        if sequence_parallel:
            # The experts see the whole sequence on every tp rank (gathered in, this rank's slice out; the
            # slice's backward gathers the gradient), as the dense MLP's column-parallel input would.
            plan["mlp"] = PrepareModuleInputOutput(
                input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_input=True,
                output_layouts=(Replicate(),), desired_output_layouts=(Shard(1),), use_local_output=True)
    else:
        plan |= {"mlp.up": col("mlp.up"), "mlp.down": row("mlp.down")}
        if swiglu:
            plan["mlp.gate"] = col("mlp.gate")
    if sequence_parallel:
        plan["attn_norm"] = SequenceParallel()
        plan["mlp_norm"] = SequenceParallel()
    return plan


def apply_tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh, sequence_parallel: bool = False) -> None:
    """Shard every block of ``model`` (a GPT or one pipeline stage of it) over ``tp_mesh`` in place."""
    blocks = list(model.layers.values())
    for block in blocks:
        adapted = frozenset(n for n, m in block.named_modules() if isinstance(m, LoRALinear))
        plan = block_plan(model.cfg.mlp == "swiglu", sequence_parallel, adapted, moe=isinstance(block.mlp, MoE))
        parallelize_module(block, tp_mesh, plan)  # type: ignore[arg-type]
    if sequence_parallel and blocks:
        # Scatter the sequence entering this stage's first block, gather it leaving the last.
        parallelize_module(blocks[0], tp_mesh, PrepareModuleInput(
            input_layouts=(Replicate(), None), desired_input_layouts=(Shard(1), None), use_local_output=True))
        parallelize_module(blocks[-1], tp_mesh, PrepareModuleOutput(
            output_layouts=Shard(1), desired_output_layouts=Replicate(), use_local_output=True))
