"""model.init_from=<Hugging Face dir>: lazy per-rank regions vs every rank reading the whole file.

A Llama-family model built by transformers (default ~33M parameters, fp32) is saved to a temporary
directory; 4 gloo ranks in an FSDP2 x tensor-parallel layout (dp2 x tp2, every parameter sharded) fill
their shards two ways, back to back in the same processes:

- ours: ``xirang_hpc.weights.hf_import.init_model_from_hf`` (safetensors lazy slices of this rank's region);
- baseline: every rank ``safetensors.torch.load_file``s the whole checkpoint, then keeps its region
  (what loading a full state dict on every rank amounts to).

Printed per rank: bytes read and seconds; then the ratios. Both must give identical shards.

    python benchmarks/bench_hf_import.py [--hidden 512 --layers 8 --vocab 8192]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from xirang_hpc.runtime.local_ranks import LocalRanks, RankPlace  # noqa: E402


def _worker(place: RankPlace, queue: Any, hf_dir: str) -> None:
    import torch.distributed as dist
    from parallel_harness import LAYOUTS, make_cfg
    from safetensors.torch import load_file

    import xirang_hpc.weights.hf_import as hi
    from xirang_hpc.config.hf import apply_hf_model
    from xirang_hpc.runtime.parallel_dims import Layout
    from xirang_hpc.runtime.parallelize import parallelize
    from xirang_hpc.weights.hf import param_shapes, tensor_map

    torch.set_num_threads(1)
    rank, world = place.rank, place.world_size
    try:
        place.init_process_group("gloo")
        read = [0]
        from safetensors import safe_open as real_open

        class Counting:  # counts the bytes of every region handed back
            def __init__(self, path: str, framework: str) -> None:
                self.f = real_open(path, framework=framework)

            def __enter__(self) -> Counting:
                self.h = self.f.__enter__()
                return self

            def __exit__(self, *a: Any) -> None:
                self.f.__exit__(*a)

            def keys(self) -> list[str]:
                return self.h.keys()

            def get_slice(self, name: str) -> Any:
                inner = self.h.get_slice(name)

                class S:
                    def get_shape(self) -> list[int]:
                        return inner.get_shape()

                    def __getitem__(self, idx: Any) -> torch.Tensor:
                        t = inner[idx]
                        read[0] += t.numel() * t.element_size()
                        return t

                return S()

        hi.safe_open = Counting
        fields = apply_hf_model({"init_from": hf_dir}, [])
        cfg = make_cfg(world, LAYOUTS["fsdp2xtp2"], steps=2, model={k: v for k, v in fields.items()
                                                                     if k != "init_from"})
        topo = place.topology("test")
        layout = Layout.for_job(cfg.parallel, topo)
        mesh = layout.build_mesh(topo)
        torch.manual_seed(0)
        pm = parallelize(cfg, layout, mesh)
        dist.barrier()
        t0 = time.perf_counter()
        hi.init_model_from_hf(pm.model, hf_dir, cfg.model)
        ours_s = time.perf_counter() - t0
        ours = {n: (p.to_local() if hasattr(p, "to_local") else p).detach().clone()
                for n, p in pm.model.named_parameters()}
        dist.barrier()
        # Baseline: the whole checkpoint on every rank, then this rank's regions out of it.
        t0 = time.perf_counter()
        files = sorted(Path(hf_dir).glob("*.safetensors"))
        full: dict[str, torch.Tensor] = {}
        for f in files:
            full.update(load_file(str(f)))
        base_bytes = sum(t.numel() * t.element_size() for t in full.values())

        class Mem:
            def read(self, name: str, idx: tuple[slice, ...]) -> torch.Tensor:
                return full[name][idx]

        tmap, shapes = tensor_map(cfg.model), param_shapes(cfg.model)
        same = True
        with torch.no_grad():
            for n, p in pm.model.named_parameters():
                local, off, shape = hi.local_region(p)
                local.copy_(hi.read_region(Mem(), tmap[n], shapes[n], off, shape))
                same &= torch.equal(local, ours[n])
        base_s = time.perf_counter() - t0
        queue.put((rank, {"ours_bytes": read[0], "ours_s": ours_s, "base_bytes": base_bytes, "base_s": base_s,
                          "same": bool(same)}))
    except Exception:  # noqa: BLE001 - report to the parent
        queue.put((rank, {"error": traceback.format_exc()}))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def main() -> None:
    """Build the model, run both loaders on 4 ranks, print the comparison."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=8192)
    a = ap.parse_args()
    import transformers

    with tempfile.TemporaryDirectory() as tmp:
        torch.manual_seed(0)
        cfg = transformers.LlamaConfig(hidden_size=a.hidden, intermediate_size=3 * a.hidden, num_hidden_layers=a.layers,
                                       num_attention_heads=8, num_key_value_heads=4, vocab_size=a.vocab,
                                       max_position_embeddings=128)
        model = transformers.LlamaForCausalLM(cfg)
        n_params = sum(p.numel() for p in model.parameters())
        model.save_pretrained(tmp, max_shard_size="64MB")
        del model
        world = 4
        res: dict[int, dict[str, Any]] = {}
        with LocalRanks(_worker, world, (tmp,), nodes=2) as ranks:  # 2 virtual nodes x 2, as the tests' harness
            while len(res) < world:
                rank, r = ranks.get()
                if "error" in r:
                    raise SystemExit(f"rank {rank}:\n{r['error']}")
                res[rank] = r
    print(f"Llama {n_params / 1e6:.1f}M params fp32, 4 ranks fsdp2xtp2 (dp2 FSDP2 x tp2), torch {torch.__version__}")
    print("rank | ours MB read | ours s | baseline MB read | baseline s | same shards")
    for r in range(world):
        x = res[r]
        print(f"{r:4d} | {x['ours_bytes'] / 1e6:12.1f} | {x['ours_s']:6.2f} | {x['base_bytes'] / 1e6:16.1f} | "
              f"{x['base_s']:10.2f} | {x['same']}")
    ob = sum(x["ours_bytes"] for x in res.values())
    bb = sum(x["base_bytes"] for x in res.values())
    os_, bs = max(x["ours_s"] for x in res.values()), max(x["base_s"] for x in res.values())
    print(f"bytes read, all ranks: ours {ob / 1e6:.1f} MB vs baseline {bb / 1e6:.1f} MB ({bb / ob:.2f}x less)")
    print(f"slowest rank: ours {os_:.2f}s vs baseline {bs:.2f}s ({bs / os_:.2f}x)")
    assert all(x["same"] for x in res.values()), "the two loaders disagree"


if __name__ == "__main__":
    main()
