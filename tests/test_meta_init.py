"""Meta-device construction: every layout materialises only its share, with bitwise the same initial weights.

- The init is a pure function of (seed, name, element): a region computed alone equals the same
  region of the whole tensor, bitwise, and the distribution is GPT-2's (std, residual scaling).
- In real gloo process groups, ``parallelize`` for fsdp4 (uneven dim-0 shards included),
  hsdp2x2, dp2xtp2, fsdp2xtp2, tp2 with sequence parallelism, pp2, interleaved pp2v2 and tied
  embeddings yields, gathered, bitwise the weights of ``GPT(cfg, seed)`` in one process.
- No full-size parameter tensor is ever allocated while an FSDP rank builds its model (a
  TorchDispatchMode records every allocation), and the previous full build does allocate them.
"""

from __future__ import annotations

import math
import traceback
from typing import Any

import parallel_harness as H
import pytest
import torch
import torch.distributed as dist
from ranks import rank_context
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

from xirang_hpc.config.schema import ModelConfig
from xirang_hpc.models.gpt import GPT
from xirang_hpc.models.init import BLOCK_ELEMS, block_rows, init_parameters, normal_region
from xirang_hpc.runtime.parallel_dims import Layout
from xirang_hpc.runtime.parallelize import parallelize

SEED = 1234
# vocab 258 over 4 FSDP ranks: shards of 65, 65, 65, 63 rows (an uneven last shard).
ODD = {"name": "odd", "vocab_size": 258}
GQA = {"name": "gqa", "n_kv_head": 2, "norm": "rmsnorm", "mlp": "swiglu", "pos": "rope", "bias": False}
TIED = {"name": "tied", "tie_embeddings": True}
# Embedding and head of 32768 x 64 = 2 generated blocks, 4 FSDP shards of 8192 rows.
BIG = {"name": "big", "vocab_size": 32768, "d_model": 64}
LAYOUTS: dict[int, list[tuple[str, dict[str, Any]]]] = {
    2: [("tp2sp", GQA), ("pp2", {}), ("pp2v2", GQA)],
    4: [("fsdp4", {}), ("fsdp4", ODD), ("fsdp4", TIED), ("hsdp2x2", {}), ("dp2xtp2", {}), ("dp2xtp2", GQA),
        ("fsdp2xtp2", GQA), ("tp2xpp2", {})],
}


def test_a_region_equals_that_region_of_the_whole_tensor() -> None:
    shape = (300, 7000)  # 149 rows per block: regions cross block boundaries
    assert block_rows(shape) == BLOCK_ELEMS // 7000
    whole = torch.empty(shape)
    normal_region(7, "w", shape, (0, 0), shape, 0.02, whole)
    for offset, local in [((0, 0), (1, 7000)), ((140, 3500), (20, 3500)), ((149, 1), (151, 6999)), ((299, 0), (1, 7))]:
        part = torch.empty(local)
        normal_region(7, "w", shape, offset, local, 0.02, part)
        assert torch.equal(part, whole[offset[0] : offset[0] + local[0], offset[1] : offset[1] + local[1]])
    other = torch.empty(shape)
    normal_region(8, "w", shape, (0, 0), shape, 0.02, other)
    assert not torch.equal(other, whole), "the seed matters"
    normal_region(7, "v", shape, (0, 0), shape, 0.02, other)
    assert not torch.equal(other, whole), "the parameter name matters"
    assert abs(whole.std().item() - 0.02) < 2e-4 and abs(whole.mean().item()) < 2e-4


def test_distribution_and_determinism_of_a_fresh_model() -> None:
    cfg = ModelConfig(name="t", n_layer=4, n_head=4, d_model=64, d_ff=256, seq_len=16, bias=True)
    a, b = GPT(cfg, seed=3), GPT(cfg, seed=3)
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p, q), name
    sd = a.state_dict()
    assert torch.all(sd["layers.0.attn_norm.weight"] == 1) and torch.all(sd["layers.0.attn.q.bias"] == 0)
    std = cfg.init_std
    assert abs(sd["tok_emb.weight"].std().item() - std) < 0.05 * std
    assert abs(sd["layers.1.mlp.down.weight"].std().item() - std / math.sqrt(8)) < 0.05 * std / math.sqrt(8)
    torch.manual_seed(0)
    c, d = GPT(cfg), GPT(cfg)  # seeds drawn from the global generator: reproducible, and distinct
    torch.manual_seed(0)
    assert torch.equal(GPT(cfg).tok_emb.weight, c.tok_emb.weight)
    assert not torch.equal(c.tok_emb.weight, d.tok_emb.weight)


def test_meta_build_then_materialize_equals_eager_build_and_keeps_ties_and_rope() -> None:
    cfg = ModelConfig(name="t", n_layer=2, n_head=4, d_model=32, d_ff=64, seq_len=16, pos="rope",
                      norm="rmsnorm", tie_embeddings=True)
    eager = GPT(cfg, seed=5)
    with torch.device("meta"):
        m = GPT(cfg)
    assert m.tok_emb.weight.is_meta
    m.materialize("cpu", seed=5)
    assert m.head.weight is m.tok_emb.weight, "tied embeddings stay one parameter"
    for (name, p), q in zip(eager.state_dict().items(), m.state_dict().values()):
        assert torch.equal(p, q), name
    assert torch.equal(m.rope_cos, eager.rope_cos) and torch.equal(m.rope_sin, eager.rope_sin)
    x = torch.randint(0, 256, (2, 16))
    torch.testing.assert_close(m(x), eager(x), rtol=0, atol=0)
    loaded = GPT.for_loading(cfg)
    loaded.load_state_dict(eager.state_dict())
    torch.testing.assert_close(loaded(x), eager(x), rtol=0, atol=0)
    with pytest.raises(RuntimeError, match="meta device"):
        with torch.device("meta"):
            init_parameters(GPT(cfg), cfg, 0)


class _Allocations(TorchDispatchMode):
    """Records the element count of every tensor an op creates (factories and results)."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204 - torch's protocol
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, DTensor):  # the mode sees DTensor-level ops: count the local storage
                t = t._local_tensor
            if isinstance(t, torch.Tensor) and not t.is_meta:
                self.largest = max(self.largest, t.numel())
        return out


def _build(world: int, name: str, model: dict[str, Any], full_build: bool = False) -> tuple[Any, Any]:
    cfg = H.make_cfg(world, H.LAYOUTS[name], model=model)
    topo = H.topology(dist.get_rank(), world, 0) if world > 1 else H.topology(0, 1, 0)
    layout = Layout.for_job(cfg.parallel, topo)
    return cfg, parallelize(cfg, layout, layout.build_mesh(topo), _full_build=full_build)


def _worker(rank: int, world: int, port: int, queue: Any) -> None:
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        for name, model in LAYOUTS[world]:
            _, pm = _build(world, name, model)
            full = {}
            for n, p in pm.model.state_dict().items():  # keeps both names of a tied parameter
                t = p.full_tensor() if isinstance(p, DTensor) else p
                full[n] = t.detach().numpy().copy()
            tied = bool(model.get("tie_embeddings")) and pm.model.head.weight is pm.model.tok_emb.weight
            queue.put((rank, f"{name}/{model.get('name', 'test')}", {"params": full, "tied": tied}))
            dist.barrier()
        if world == 4:
            # Allocation tracking while an FSDP rank builds: new way vs the previous full build.
            sizes = {}
            for full_build in (False, True):
                with _Allocations() as rec:
                    _build(world, "fsdp4", BIG, full_build)
                sizes[full_build] = rec.largest
            queue.put((rank, "allocations", sizes))
        queue.put((rank, "__done__", None))
    except Exception:
        queue.put((rank, "__error__", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _run(world: int) -> dict[str, list[Any]]:
    ctx = rank_context()
    queue = ctx.SimpleQueue()
    port = H.free_port()
    procs = [ctx.Process(target=_worker, args=(r, world, port, queue)) for r in range(world)]
    for p in procs:
        p.start()
    out: dict[str, list[Any]] = {}
    done = 0
    try:
        while done < world:
            rank, key, res = queue.get()
            if key == "__error__":
                raise RuntimeError(f"rank {rank} failed:\n{res}")
            if key == "__done__":
                done += 1
                continue
            out.setdefault(key, [None] * world)[rank] = res
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    return out


@pytest.fixture(scope="module")
def runs() -> dict[int, dict[str, list[Any]]]:
    return {w: _run(w) for w in LAYOUTS}


@pytest.mark.parametrize("world,layout,model", [(w, n, m) for w, jobs in LAYOUTS.items() for n, m in jobs],
                         ids=[f"{n}-{m.get('name', 'test')}" for jobs in LAYOUTS.values() for n, m in jobs])
def test_every_layout_materializes_the_single_process_weights_bitwise(runs, world: int, layout: str,
                                                                      model: dict[str, Any]) -> None:
    ref_cfg = H.make_cfg(1, {}, model=model)
    ref = {n: p.numpy() for n, p in GPT(ref_cfg.model, seed=SEED).state_dict().items()}
    per_rank = runs[world][f"{layout}/{model.get('name', 'test')}"]
    merged: dict[str, Any] = {}
    for r in per_rank:
        merged.update(r["params"])
        assert r["tied"] == bool(model.get("tie_embeddings"))
    assert sorted(merged) == sorted(ref), "the stages together hold every tensor, under full names"
    for n, want in ref.items():
        assert merged[n].tobytes() == want.tobytes(), f"{layout}: {n} differs from the single-process init"


def test_an_fsdp_rank_never_allocates_a_full_parameter(runs) -> None:
    full_elems = 32768 * 64  # the embedding (and head) of the model built
    assert full_elems == 2 * BLOCK_ELEMS
    for sizes in runs[4]["allocations"]:
        assert sizes[True] >= full_elems, "the previous full build allocates whole tensors (the check can fail)"
        assert sizes[False] <= BLOCK_ELEMS, f"largest allocation {sizes[False]} elements: more than one block"
