"""Regional compilation (``train.compile``): each transformer block's forward through ``torch.compile``, and the loss.

As torchtitan does it: the blocks are compiled one by one (they share one code object, so the first
block's graph is reused by the others rather than the whole model traced as one; a mixture-of-experts block
is compiled in parts, its attention half and its router, around the data-dependent dispatch), after tensor
parallelism and recomputation have been applied to them and before FSDP2 wraps them, so the
tensor-parallel redistributions and the checkpoint region are inside the compiled graph and FSDP2's
all-gather/reshard hooks stay outside it. Unlike torchtitan the block is not replaced by an
``OptimizedModule`` wrapper: its ``forward`` is replaced on the instance (as recompute and autocast do),
so parameter names (``layers.3.attn.q.weight``) and checkpoints do not change.

Inductor's compiled kernels go to a per-user cache directory shared by every start of a job
(:func:`configure_cache`), so an in-job restart or a requeue reads them instead of compiling again.
:func:`probe` compiles one tiny function at start-up, so a node where the backend cannot build
kernels (no C++ compiler on a CPU node, no Triton on a GPU one) is refused with one line naming
``train.compile`` before any training starts.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, MutableMapping, Sequence
from pathlib import Path

import torch
from torch import nn

from xirang_hpc.config.errors import ConfigError
from xirang_hpc.models.gpt import lm_loss
from xirang_hpc.models.loss import chunk_step
from xirang_hpc.models.moe import MoE

CACHE_SUBDIR = "xirang-hpc"


def cache_root(env: Mapping[str, str] | None = None) -> Path:
    """``$XDG_CACHE_HOME/xirang-hpc`` (``~/.cache/xirang-hpc`` where XDG_CACHE_HOME is unset)."""
    e = os.environ if env is None else env
    base = e.get("XDG_CACHE_HOME") or str(Path(e.get("HOME") or Path.home()) / ".cache")
    return Path(base) / CACHE_SUBDIR


def _torch_default_cache() -> str:
    """The directory Inductor picks by itself (``/tmp/torchinductor_<user>``): node-local, lost on a requeue."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    return os.path.abspath(default_cache_dir())


def configure_cache(env: MutableMapping[str, str] | None = None) -> dict[str, str]:
    """Point Inductor's and Triton's caches at the user's cache directory (created private, mode 0700).

    A ``TORCHINDUCTOR_CACHE_DIR`` or ``TRITON_CACHE_DIR`` set by the user or the site is kept. Importing
    ``torch._dynamo`` writes Inductor's own node-local default (``/tmp/torchinductor_<user>``) into the
    environment, so that value counts as unset. Inductor reads the variable whenever it opens its cache,
    so this runs in the rank process before anything is compiled (:func:`probe` and :func:`apply_compile`
    call it). Returns the two directories.
    """
    e = os.environ if env is None else env
    root = cache_root(e)
    torch_default = _torch_default_cache()
    out: dict[str, str] = {}
    for var, sub in (("TORCHINDUCTOR_CACHE_DIR", "inductor"), ("TRITON_CACHE_DIR", "triton")):
        if not e.get(var) or (var == "TORCHINDUCTOR_CACHE_DIR" and os.path.abspath(e[var]) == torch_default):
            path = root / sub
            for d in (root, path):  # private: compiled code that another user could replace would run here
                d.mkdir(mode=0o700, parents=True, exist_ok=True)
                os.chmod(d, 0o700)
            e[var] = str(path)
        out[var] = e[var]
    return out


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}".strip().rstrip(":")


def probe(device: torch.device) -> None:
    """Compile and run one tiny function on ``device``; refuse ``train.compile`` by name where that fails.

    A CPU node needs a C++ compiler (``g++``, or ``$CXX``); an accelerator needs its Inductor backend
    (Triton for CUDA/ROCm/XPU). Warm cache: well under a second.
    """
    configure_cache()
    fix = ("install a C++ compiler (g++, or point $CXX at one)" if device.type == "cpu"
           else f"install Triton (or the Inductor backend of {device.type})")
    try:
        if device.type == "cpu":  # explicitly: kernels cached by an earlier start would hide a missing compiler
            from torch._inductor.cpp_builder import get_cpp_compiler

            get_cpp_compiler()
        torch._dynamo.reset()  # really compiled now, not reused from dynamo's in-process cache
        fn = torch.compile(_probe_fn, backend="inductor", fullgraph=True)
        x = torch.arange(8, dtype=torch.float32, device=device)
        ok = torch.allclose(fn(x).cpu(), _probe_fn(x).cpu(), rtol=1e-5, atol=1e-6)
    except Exception as exc:  # noqa: BLE001 - any failure to build kernels is the same refusal
        raise ConfigError("train.compile", True,
                          f"torch.compile cannot build kernels for {device.type} on this node ({_first_line(exc)}); "
                          f"{fix}, or set train.compile=false") from None
    if not ok:
        raise ConfigError("train.compile", True, f"torch.compile gives wrong results for {device.type} on this "
                          "node; set train.compile=false")


def _probe_fn(x: torch.Tensor) -> torch.Tensor:
    return torch.sin(x) * 2.0 + x


def apply_compile(model: nn.Module, views: Sequence[nn.Module] = ()) -> int:
    """``torch.compile`` each block's forward of ``model`` (a GPT or a pipeline stage) in place, and its loss;
    returns how many blocks.

    The loss is compiled as torchtitan compiles it: the plain cross-entropy over the logits (``loss_fn``) and
    the chunked head's per-chunk step (``loss_kernel``: matmul, log-sum-exp, softmax gradient and both gradient
    matmuls in one graph). ``views``: the pipeline's per-stage views of ``model``, which run its loss too.
    Call after tensor parallelism and recompute, before FSDP2 (see the module docstring).
    """
    configure_cache()
    blocks = list(model.layers.values())
    for block in blocks:
        if isinstance(block.mlp, MoE):
            # A mixture of experts routes each token to experts by value: the slot counts are data, not
            # shapes a graph can hold. Compiled around it: the attention half with the MLP's norm, and the
            # router's selection (scores, top-k, weights); the gate's matmul (a module FSDP2 may shard), the
            # dispatch and the experts' GEMMs run eager.
            block.attend = torch.compile(block.attend, fullgraph=True)  # type: ignore[method-assign]
            block.mlp.select = torch.compile(block.mlp.select, fullgraph=True)  # type: ignore[method-assign]
            continue
        # fullgraph: a graph break inside a block is a bug to see, not a silent slow path.
        block.forward = torch.compile(block.forward, fullgraph=True)  # type: ignore[method-assign]
    if getattr(model, "head", None) is not None:  # the stage that computes the loss
        loss_fn = compiled_lm_loss()
        kernel = torch.compile(chunk_step, fullgraph=True)
        for m in (model, *views):
            m.loss_fn, m.loss_kernel = loss_fn, kernel
    return len(blocks)


def compiled_lm_loss() -> Callable[..., torch.Tensor]:
    """:func:`~xirang_hpc.models.gpt.lm_loss` compiled, with the denominator outside the graph.

    Chat data divides the summed loss by the global batch's learned-token count, a new number every step: as an
    argument of the compiled function it would be a constant of the graph (a recompilation per step).
    """
    mean = torch.compile(lambda logits, targets: lm_loss(logits, targets), fullgraph=True)
    total = torch.compile(lambda logits, targets: lm_loss(logits, targets, 1.0), fullgraph=True)

    def loss(logits: torch.Tensor, targets: torch.Tensor, denom: float | None = None) -> torch.Tensor:
        return mean(logits, targets) if denom is None else total(logits, targets) / denom

    return loss
