"""Megatron-style tensor parallelism for the GPT blocks, with DTensor parallel styles.

Per block (Shoeybi et al. 2019): q/k/v and MLP up/gate are column-parallel (each rank holds
``n_head/tp`` heads, ``ffn/tp`` hidden units), attention output and MLP down are row-parallel
(their all-reduce restores the full residual). Attention derives its local head count from the
local width, so the model code runs unchanged on a shard. Embeddings, norms and head stay
replicated (small for our vocab); their gradients are identical on every tp rank because the
column-parallel inputs all-reduce their gradient in backward.

Optional sequence parallelism (Korthikanti et al. 2022): between the two sublayers the residual
stream is split along the sequence dimension, norms run on the local slice, and the all-reduces
become all-gather + reduce-scatter. The stage boundary (first/last owned block) gathers the
sequence back, so pipeline stages always exchange full (B, T, C) activations.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)


def block_plan(swiglu: bool, sequence_parallel: bool) -> dict[str, object]:
    """The per-block plan: module FQN (relative to the block) -> parallel style."""
    if sequence_parallel:
        col = ColwiseParallel(input_layouts=Shard(1))
        row = RowwiseParallel(output_layouts=Shard(1))
    else:
        col, row = ColwiseParallel(), RowwiseParallel()
    plan: dict[str, object] = {"attn.q": col, "attn.k": col, "attn.v": col, "attn.o": row,
                               "mlp.up": col, "mlp.down": row}
    if swiglu:
        plan["mlp.gate"] = col
    if sequence_parallel:
        plan["attn_norm"] = SequenceParallel()
        plan["mlp_norm"] = SequenceParallel()
    return plan


def apply_tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh, sequence_parallel: bool = False) -> None:
    """Shard every block of ``model`` (a GPT or one pipeline stage of it) over ``tp_mesh`` in place."""
    blocks = list(model.layers.values())
    plan = block_plan(model.cfg.mlp == "swiglu", sequence_parallel)
    for block in blocks:
        parallelize_module(block, tp_mesh, plan)  # type: ignore[arg-type]
    if sequence_parallel and blocks:
        # Scatter the sequence entering this stage's first block, gather it leaving the last.
        parallelize_module(blocks[0], tp_mesh, PrepareModuleInput(
            input_layouts=(Replicate(), None), desired_input_layouts=(Shard(1), None), use_local_output=True))
        parallelize_module(blocks[-1], tp_mesh, PrepareModuleOutput(
            output_layouts=Shard(1), desired_output_layouts=Replicate(), use_local_output=True))
