"""bf16 under ZeRO-3: FSDP2's mixed precision (ours) vs autocast alone over fp32 gathers, per rank.

Both phases train the same model in ``train.precision=bf16`` with FSDP2 over ``--ranks`` gloo ranks
(1 thread each), through the runtime's ``parallelize``; each takes one step (forward, backward, AdamW).

- *ours*: the blocks' weights gathered in bf16, gradients reduced in fp32
  (:func:`xirang_hpc.runtime.data_parallel.block_precision`);
- *autocast only* (the previous way): the blocks' weights gathered in fp32, each matmul casting its weight to
  bf16 under autocast.

Per rank: the bytes autograd keeps for the backward that are still allocated when the forward ends (each storage
once: exact, independent of load), among them those shaped like a whole block weight (the bf16 copies autocast
makes), the bytes the blocks' all-gathers receive in the step, and the rise of peak RSS (VmHWM) over the step above
the built model's in the forward and backward (glibc's mmap threshold fixed, as in ``bench_meta_init.py``).

Run:  python benchmarks/bench_fsdp_precision.py [--layers 8 --d-model 1024 --heads 16 --ranks 2]
"""

from __future__ import annotations

import argparse
import os
import traceback
from typing import Any

import torch
import torch.distributed as dist
from bench_meta_init import GIB, _kb, make_cfg, run_phase

from xirang_hpc.models.gpt import full_model_params, lm_loss
from xirang_hpc.runtime.local_ranks import RankPlace
from xirang_hpc.runtime.parallel_dims import Layout


def _rank(place: RankPlace, queue: Any, phase: str, args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    try:
        import xirang_hpc.runtime.parallelize as par

        if phase == "autocast":  # the previous way: no mixed-precision policy on the blocks
            par.block_precision = lambda precision: None  # type: ignore[assignment]
        place.init_process_group("gloo")
        cfg = make_cfg(args)
        cfg.train.precision = "bf16"
        topo = place.topology("bench")
        layout = Layout.for_job(cfg.parallel, topo)
        pm = par.parallelize(cfg, layout, layout.build_mesh(topo))
        opt = par.make_optimizer(pm, cfg, layout)
        weights = {tuple(p.shape) for n, p in pm.model.named_parameters() if n.startswith("layers.") and p.dim() == 2}
        weights |= {s[::-1] for s in weights}  # a matmul may keep the transposed view
        gathered = [0]
        all_gather = dist.all_gather_single

        def counted(output: torch.Tensor, *a: Any, **kw: Any) -> Any:  # FSDP2's all-gathers land here
            gathered[0] += output.numel() * output.element_size()
            return all_gather(output, *a, **kw)

        dist.all_gather_single = counted  # type: ignore[assignment]
        saved: list[torch.Tensor] = []

        def keep(t: torch.Tensor) -> torch.Tensor:
            saved.append(t)
            return t

        g = torch.Generator().manual_seed(place.rank)
        x = torch.randint(0, cfg.model.vocab_size, (args.micro, cfg.model.seq_len + 1), generator=g)
        dist.barrier()
        base = _kb("VmHWM")
        with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
            loss = lm_loss(pm.module(x[:, :-1]), x[:, 1:])
        live = {t.untyped_storage().data_ptr(): (t.untyped_storage().nbytes(), tuple(t.shape) in weights)
                for t in saved if t.untyped_storage().nbytes() > 0}
        out = {"kept": float(sum(b for b, _ in live.values())),
               "kept_weights": float(sum(b for b, w in live.values() if w))}
        saved.clear()
        loss.backward()
        out.update(peak_rise=_kb("VmHWM") - base, gathered=float(gathered[0]), loss=loss.detach().item())
        opt.step()
        dist.barrier()
        queue.put((place.rank, out))
    except Exception:
        queue.put((place.rank, {"error": traceback.format_exc()}))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def main() -> None:
    """Both phases, the per-rank table and the ratios."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--d-model", type=int, default=1024)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--vocab", type=int, default=256)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--micro", type=int, default=1, help="sequences per rank in the step")
    args = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(1 << 20))  # see bench_meta_init.py
    n = full_model_params(make_cfg(args).model)
    print(f"model: {args.layers} layers, d_model {args.d_model}, vocab {args.vocab}, seq_len {args.seq_len}: "
          f"{n / 1e6:.1f}M params; bf16, ZeRO-3 over {args.ranks} ranks, micro-batch {args.micro}")
    ours, prev = run_phase("ours", args, _rank), run_phase("autocast", args, _rank)
    hdr = ("rank", "kept at forward end, ours / autocast only (GiB)", "of it whole block weights",
           "all-gathers received (GiB)", "peak RSS rise in forward + backward (GiB)",
           "ours / autocast only (peak rise)")
    print("| " + " | ".join(hdr) + " |")
    print("|" + "---|" * len(hdr))
    for r, (o, p) in enumerate(zip(ours, prev)):
        print(f"| {r} | {o['kept'] / GIB:.3f} / {p['kept'] / GIB:.3f} | {o['kept_weights'] / GIB:.3f} / "
              f"{p['kept_weights'] / GIB:.3f} | {o['gathered'] / GIB:.3f} / {p['gathered'] / GIB:.3f} | "
              f"{o['peak_rise'] / GIB:.3f} / {p['peak_rise'] / GIB:.3f} | {o['peak_rise'] / p['peak_rise']:.2f}x |")
    print(f"kept for the backward: {ours[0]['kept'] / prev[0]['kept']:.2f}x; all-gathered bytes: "
          f"{ours[0]['gathered'] / prev[0]['gathered']:.2f}x; first-step loss ours {ours[0]['loss']:.5f} vs "
          f"autocast only {prev[0]['loss']:.5f}")


if __name__ == "__main__":
    main()
