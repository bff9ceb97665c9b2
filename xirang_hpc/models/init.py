"""Layout-independent parameter initialisation, computed shard by shard.

Every parameter's initial values are a pure function of ``(seed, parameter name, element index)``:
a matrix is cut into blocks of whole rows (``block_rows`` rows, fixed by the global shape only) and
block ``b`` of parameter ``name`` is drawn from its own generator seeded with a hash of
``(seed, name, b)``. A rank that holds a slice of the matrix (a tensor-parallel shard, an FSDP2
dim-0 shard, both, or the whole tensor) generates only the row blocks that overlap its slice, one
block at a time, and copies the overlapping rows and columns out. So:

- the initial weights are bitwise the same in every parallel layout (fsdp, dp x tp, pp, one
  process), which lets a model be built on the ``meta`` device, carved and sharded, and only then
  materialised shard by shard;
- no rank ever allocates a full-size tensor: the transient memory is one block (at most
  ``BLOCK_ELEMS`` elements, or one row when a row is larger).

Blocks are drawn on the parameter's device with that device's generator, so the values are the
same for every layout on one device type (CPU ranks, or CUDA ranks), not between CPU and CUDA.

The distribution is GPT-2's: N(0, init_std) for matrices, the residual output projections
(``attn.o``, ``mlp.down``) scaled by 1/sqrt(2L), norm weights one, biases zero. Tied embeddings are
one parameter, initialised once under its first name (``tok_emb.weight``).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from xirang_hpc.config.schema import ModelConfig

# Elements per generated block: 4 MiB of fp32. Part of the definition of the initial values (the
# row-block split depends on it), so changing it changes every seed's weights.
BLOCK_ELEMS = 1 << 20
# Residual output projections, dense and mixture-of-experts (stacked experts' down, shared expert's down).
_RESIDUAL = ("attn.o.weight", "mlp.down.weight", "mlp.w2", "mlp.shared.down.weight")


def param_init(cfg: ModelConfig, name: str, ndim: int) -> tuple[str, float]:
    """How parameter ``name`` (full-model name, ``ndim`` dims) starts: ("ones"|"zeros"|"normal", std)."""
    if name.endswith(".lora_B.weight"):  # LoRA (models/lora.py): B zero, the adapted model starts as its base
        return "zeros", 0.0
    if name.endswith(".lora_A.weight"):  # the std of PEFT's kaiming-uniform A (+-1/sqrt(in)) for in = d_model
        return "normal", 1.0 / math.sqrt(3 * cfg.d_model)
    if ndim < 2:
        return ("zeros", 0.0) if name.endswith("bias") else ("ones", 0.0)
    if name.endswith(_RESIDUAL):
        return "normal", cfg.init_std / math.sqrt(2 * cfg.n_layer)
    return "normal", cfg.init_std


def block_rows(shape: Sequence[int]) -> int:
    """Rows per generated block of a tensor of global ``shape`` (depends on the shape only)."""
    row = math.prod(shape[1:]) if len(shape) > 1 else 1
    return max(1, BLOCK_ELEMS // max(row, 1))


def block_seed(seed: int, name: str, block: int) -> int:
    """The generator seed of row block ``block`` of parameter ``name`` (63 bits of a BLAKE2b hash)."""
    h = hashlib.blake2b(f"{seed}\0{name}\0{block}".encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") & ((1 << 63) - 1)


def normal_region(seed: int, name: str, shape: Sequence[int], offset: Sequence[int], local_shape: Sequence[int],
                  std: float, out: torch.Tensor) -> None:
    """Fill ``out`` (``local_shape``) with the region at ``offset`` of the N(0, std) tensor (seed, name, shape).

    Only the row blocks overlapping rows ``[offset[0], offset[0] + local_shape[0])`` are generated,
    each on ``out``'s device in fp32, one at a time; the other dims are sliced out of each block.
    """
    if out.numel() == 0:
        return
    rows = block_rows(shape)
    lo, hi = offset[0], offset[0] + local_shape[0]
    gen = torch.Generator(device=out.device)
    for b in range(lo // rows, (hi - 1) // rows + 1):
        b_lo, b_hi = b * rows, min((b + 1) * rows, shape[0])
        gen.manual_seed(block_seed(seed, name, b))
        block = torch.empty((b_hi - b_lo, *shape[1:]), dtype=torch.float32, device=out.device)
        block.normal_(0.0, std, generator=gen)
        r_lo, r_hi = max(lo, b_lo), min(hi, b_hi)
        part = block[r_lo - b_lo : r_hi - b_lo]
        for d in range(1, len(shape)):  # column (and further dims') slice of this rank's region
            part = part.narrow(d, offset[d], local_shape[d])
        out[r_lo - lo : r_hi - lo].copy_(part)
        del block, part


def local_region(p: torch.Tensor) -> tuple[tuple[int, ...], tuple[int, ...], torch.Tensor]:
    """(global shape, global offset, local tensor) of a plain tensor or this rank's DTensor shard.

    DTensor shards (tensor-parallel Shard/Replicate, FSDP2's dim-0 shards including uneven and
    empty last shards, and their combinations on 2-D meshes) are boxes of the global tensor, as
    distributed checkpointing also assumes.
    """
    if isinstance(p, DTensor):
        local_shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
        local = p.to_local()
        if tuple(local.shape) != tuple(local_shape):
            raise RuntimeError(f"local shard of shape {tuple(local.shape)} does not match the expected {local_shape}")
        return tuple(p.shape), tuple(offset), local
    return tuple(p.shape), (0,) * p.dim(), p


@torch.no_grad()
def init_parameters(model: nn.Module, cfg: ModelConfig, seed: int) -> int:
    """Initialise every parameter ``model`` holds (whole, or this rank's shard) from ``seed``; returns the count.

    ``model`` must use full-model parameter names (a GPT or a carved pipeline stage of it, possibly
    tensor-parallel and/or FSDP2-sharded, not wrapped in DDP). Tied parameters are set once.
    """
    n = 0
    for name, p in model.named_parameters():  # deduplicates tied parameters: first name wins
        if p.is_meta:
            raise RuntimeError(f"parameter {name} is still on the meta device; call to_empty(device=...) first")
        shape, offset, local = local_region(p)
        kind, std = param_init(cfg, name, len(shape))
        if kind == "ones":
            local.fill_(1.0)
        elif kind == "zeros":
            local.zero_()
        elif local.dtype == torch.float32:
            normal_region(seed, name, shape, offset, tuple(local.shape), std, local)
        else:  # draw in fp32 (the values do not depend on the storage dtype), store rounded
            tmp = torch.empty(local.shape, dtype=torch.float32, device=local.device)
            normal_region(seed, name, shape, offset, tuple(local.shape), std, tmp)
            local.copy_(tmp)
        n += 1
    return n
