"""Parallel layouts side by side on real gloo process groups (CPU), in one run.

1. Our data parallel (xirang Trainer, dp=4 DDP) vs a plain ``DistributedDataParallel`` loop on
   the same model, data and optimizer: tokens/s ratio of medians (target >= 0.95). The two are
   interleaved in rounds so machine noise hits both.
2. tokens/s and peak RSS per rank for each 4-rank layout (2 virtual nodes x 2 ranks).
3. Peak memory (RSS high-water mark above the pre-build baseline, per rank) with activation
   recomputation and with optimizer-state sharding vs without, on a model big enough to see it.

Peak RSS is the kernel's VmHWM, reset before each measurement via /proc/self/clear_refs.

Run:  python benchmarks/bench_parallel.py [--steps 12] [--rounds 3]
      python benchmarks/bench_parallel.py --paired 9   # only the paired comparisons, 9 rounds

``--paired N`` runs only the two head-to-head comparisons, in N rounds inside one process group:
our DP vs plain DDP, and the default-layout candidates dp2xpp2 vs dp2xtp2. Within a round the two
sides of each pair run back to back, and the order alternates between rounds (AB, BA, ...), so
drift in machine load hits both sides alike. It prints the median tokens/s of each side and the
median of the per-round ratios with its range.

``--tracking N`` measures the cost of collective-progress tracking (the watchdog's collective rule,
``monitor.collective_timeout_s``): our dp=4 step with the monitor's heartbeat thread sampling every
process group's collective count, the explicit collectives' entry/exit and the training thread's CPU
clock (on), vs the same heartbeat without them (off), in N alternating rounds; plus the cost of one
sample and of one entry/exit record measured alone, as a share of the step time.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import re
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import parallel_harness as H  # noqa: E402

from xirang_hpc.data.dataset import TokenWindows  # noqa: E402
from xirang_hpc.models.gpt import GPT, lm_loss  # noqa: E402
from xirang_hpc.monitor.heartbeat import Heartbeat  # noqa: E402
from xirang_hpc.runtime import liveness  # noqa: E402
from xirang_hpc.runtime.dist import collective_progress  # noqa: E402
from xirang_hpc.runtime.local_ranks import LocalRanks, RankPlace  # noqa: E402
from xirang_hpc.runtime.schedule import lr_at  # noqa: E402
from xirang_hpc.runtime.trainer import Trainer, build_optimizer  # noqa: E402

TINY = {"n_layer": 4, "n_head": 4, "d_model": 64, "d_ff": 256, "seq_len": 64}  # conf/model/tiny.yaml
TRAIN = {"global_batch": 32, "grad_clip": 1.0, "warmup_steps": 2}
LAYOUTS = {
    "dp4": {"dp": 4},
    "dp2xtp2": {"dp": 2, "tp": 2},
    "dp2xpp2": {"dp": 2, "pp": 2, "microbatches": 4},
    "tp2xpp2": {"tp": 2, "pp": 2, "microbatches": 4},
    "fsdp4": {"dp": 4, "data_parallel": "fsdp"},
    "fsdp2xtp2": {"dp": 2, "tp": 2, "data_parallel": "fsdp"},
}
BIG = {"n_layer": 6, "n_head": 8, "d_model": 384, "d_ff": 1536, "seq_len": 256}
MEMORY = {
    "dp4 (baseline)": {"dp": 4},
    "dp4 recompute=full": {"dp": 4, "recompute": "full"},
    "dp4 recompute=selective": {"dp": 4, "recompute": "selective"},
    "dp4 optimizer_sharding (ZeRO-1)": {"dp": 4, "optimizer_sharding": True},
    "fsdp4 (ZeRO-3)": {"dp": 4, "data_parallel": "fsdp"},
    "fsdp4 + recompute=full": {"dp": 4, "data_parallel": "fsdp", "recompute": "full"},
}


def _kb(field: str) -> int:
    return int(re.search(rf"{field}:\s+(\d+)", Path("/proc/self/status").read_text()).group(1))


def _reset_peak() -> int:
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)  # hand freed heap back so the next peak is not hidden
    Path("/proc/self/clear_refs").write_text("5")
    return _kb("VmRSS")


def ours(cfg, topo, data_dir: Path, steps: int) -> dict[str, Any]:
    base = _reset_peak()
    with tempfile.TemporaryDirectory() as d:
        tr = Trainer(cfg, topo, Path(d), data_dir, log=lambda s: None)
        times, cpu = [], []
        for s in range(steps):
            t0, c0 = time.perf_counter(), time.process_time()
            # As Trainer.fit runs it between logged steps: the global loss is reduced only when logged.
            tr.train_step(s, reduce_loss=False)
            times.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
        peak = _kb("VmHWM")
        del tr
    dist.barrier()
    return {"times": times, "cpu": cpu, "peak_mb": peak / 1024, "peak_above_base_mb": (peak - base) / 1024}


def plain_ddp(cfg, topo, data_dir: Path, steps: int) -> dict[str, Any]:
    """The textbook loop: DDP, AdamW, local clip_grad_norm_, same batches."""
    _reset_peak()  # the same pre-run housekeeping as ``ours`` (gc, heap trim), so neither side starts warmer
    t = cfg.train
    torch.manual_seed(t.seed)
    model = DDP(GPT(cfg.model))
    opt = build_optimizer(model.module, t)
    data = TokenWindows(data_dir, "train", cfg.model.seq_len)
    times, cpu = [], []
    for s in range(steps):
        t0, c0 = time.perf_counter(), time.process_time()
        x, y = data.batch(t.seed, s, t.global_batch, topo.rank, topo.world_size)
        for g in opt.param_groups:
            g["lr"] = lr_at(s, t)
        loss = lm_loss(model(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    dist.barrier()
    return {"times": times, "cpu": cpu}


PAIRS = {"ratio": ("ours", "ddp"), "default": ("dp2xpp2", "dp2xtp2")}
TRACKING = ("tracking on", "tracking off")
HEARTBEAT_S = 1.0  # monitor.heartbeat_s's default: how often the heartbeat thread samples


def with_heartbeat(track: bool, d: Path, fn: Any) -> dict[str, Any]:
    """Run ``fn`` beside the monitor's heartbeat thread, collective progress sampled (``track``) or not."""
    hb = Heartbeat(d / f"rank-{dist.get_rank()}.json", {"rank": dist.get_rank()}, HEARTBEAT_S,
                   progress_fn=collective_progress if track else None, inside_fn=liveness.inside if track else None)
    hb.start()
    try:
        return fn()
    finally:
        hb.stop()


def _tracking(topo, d: Path, world: int, steps: int, rounds: int, queue: Any) -> None:
    """Tracking on vs off, ``rounds`` times in alternating order; then the unit costs, measured alone."""
    cfg = H.make_cfg(world, {"dp": 4}, steps, model=TINY, train=TRAIN)
    with tempfile.TemporaryDirectory() as hd:
        for rnd in range(rounds):
            for side in TRACKING if rnd % 2 == 0 else TRACKING[::-1]:
                res = with_heartbeat(side == "tracking on", Path(hd), lambda: ours(cfg, topo, d, steps))
                queue.put((topo.rank, f"tracking/{side}/{rnd}", res))
        hb = Heartbeat(Path(hd) / "unit.json", {"rank": topo.rank}, HEARTBEAT_S,
                       progress_fn=collective_progress, inside_fn=liveness.inside)
        n = 2000
        t0 = time.perf_counter()
        for _ in range(n):
            hb.snapshot()
        sample_s = (time.perf_counter() - t0) / n
        plain = Heartbeat(Path(hd) / "unit.json", {"rank": topo.rank}, HEARTBEAT_S)
        t0 = time.perf_counter()
        for _ in range(n):
            plain.snapshot()
        plain_s = (time.perf_counter() - t0) / n
        t0 = time.perf_counter()
        for _ in range(100_000):
            with liveness.collective("grad-norm / loss all-reduce"):
                pass
        record_s = (time.perf_counter() - t0) / 100_000
    queue.put((topo.rank, "tracking/unit", {"sample_s": sample_s - plain_s, "record_s": record_s,
                                             "groups": len(collective_progress())}))


def _paired(topo, d: Path, world: int, steps: int, rounds: int, queue: Any) -> None:
    """Both pairs, ``rounds`` times, alternating the order inside each pair every round."""
    dp_cfg = H.make_cfg(world, {"dp": 4}, steps, model=TINY, train=TRAIN)
    run = {"ours": lambda: ours(dp_cfg, topo, d, steps), "ddp": lambda: plain_ddp(dp_cfg, topo, d, steps)}
    for name in PAIRS["default"]:
        cfg = H.make_cfg(world, LAYOUTS[name], steps, model=TINY, train=TRAIN)
        run[name] = lambda cfg=cfg: ours(cfg, topo, d, steps)
    for rnd in range(rounds):
        for pair in PAIRS.values():
            for side in pair if rnd % 2 == 0 else pair[::-1]:
                queue.put((topo.rank, f"paired/{side}/{rnd}", run[side]()))


def _worker(place: RankPlace, queue: Any, data_dir: str, steps: int, rounds: int, memory: str = "",
            paired: bool = False, tracking: bool = False) -> None:
    torch.set_num_threads(1)
    rank, world = place.rank, place.world_size
    try:
        place.init_process_group("gloo")
        topo = place.topology("test")
        d = Path(data_dir)
        if tracking:
            _tracking(topo, d, world, steps, rounds, queue)
            queue.put((rank, "__done__", None))
            return
        if paired:
            _paired(topo, d, world, steps, rounds, queue)
            queue.put((rank, "__done__", None))
            return
        if memory:  # one configuration per fresh process group: nothing earlier hides its peak
            cfg = H.make_cfg(world, MEMORY[memory], 3, model=BIG, train={**TRAIN, "global_batch": 16})
            queue.put((rank, f"memory/{memory}", ours(cfg, topo, d, 3)))
            queue.put((rank, "__done__", None))
            return
        dp_cfg = H.make_cfg(world, {"dp": 4}, steps, model=TINY, train=TRAIN)
        for rnd in range(rounds):
            queue.put((rank, f"ratio/ours/{rnd}", ours(dp_cfg, topo, d, steps)))
            queue.put((rank, f"ratio/ddp/{rnd}", plain_ddp(dp_cfg, topo, d, steps)))
        for name, lay in LAYOUTS.items():
            queue.put((rank, f"layout/{name}", ours(H.make_cfg(world, lay, steps, model=TINY, train=TRAIN),
                                                      topo, d, steps)))
        queue.put((rank, "__done__", None))
    except Exception:
        queue.put((rank, "__error__", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _collect(world: int, data_dir: Path, steps: int, rounds: int, memory: str = "", paired: bool = False,
             tracking: bool = False) -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = {}
    done = 0
    # 2 virtual nodes from 4 ranks, as the tests' harness lays them out
    with LocalRanks(_worker, world, (str(data_dir), steps, rounds, memory, paired, tracking),
                    nodes=2 if world >= 4 else 1) as ranks:
        while done < world:
            rank, name, res = ranks.get()
            if name == "__error__":
                raise RuntimeError(f"rank {rank}:\n{res}")
            if name == "__done__":
                done += 1
                continue
            out.setdefault(name, [{}] * world)
            out[name] = [*out[name][:rank], res, *out[name][rank + 1 :]]
    return out


def _tok_s(per_rank: list[dict[str, Any]], tokens: int, warmup: int = 2) -> float:
    # A step ends when the slowest rank ends it: per step, max over ranks; then the median step.
    steps = [max(r["times"][i] for r in per_rank) for i in range(warmup, len(per_rank[0]["times"]))]
    return tokens / statistics.median(steps)


def _tok_cpu_s(per_rank: list[dict[str, Any]], tokens: int, warmup: int = 2) -> float:
    # Tokens per CPU-second (all ranks' process CPU time, incl. gloo threads): insensitive to other load.
    steps = [sum(r["cpu"][i] for r in per_rank) for i in range(warmup, len(per_rank[0]["cpu"]))]
    return tokens / statistics.median(steps)


def report_paired(res: dict[str, list[dict[str, Any]]], steps: int, rounds: int) -> None:
    """Median tokens/s per side and the median (min..max) of the per-round ratios."""
    tokens = TRAIN["global_batch"] * TINY["seq_len"]
    print(f"## bench_parallel --paired {rounds}: 4 ranks (2 virtual nodes x 2), gloo, 1 thread/rank, model tiny, "
          f"global batch {TRAIN['global_batch']} x {TINY['seq_len']}, {steps - 2} timed steps per run, "
          f"order alternating per round")
    print("\n| pair | A tok/s (median) | B tok/s (median) | A/B per-round ratios | median ratio (min..max) |")
    print("|---|---|---|---|---|")
    for a, b in PAIRS.values():
        ta = [_tok_s(res[f"paired/{a}/{i}"], tokens) for i in range(rounds)]
        tb = [_tok_s(res[f"paired/{b}/{i}"], tokens) for i in range(rounds)]
        ratios = [x / y for x, y in zip(ta, tb)]
        print(f"| {a} vs {b} | {statistics.median(ta):,.0f} | {statistics.median(tb):,.0f} | "
              f"{' '.join(f'{r:.2f}' for r in ratios)} | **{statistics.median(ratios):.3f}** "
              f"({min(ratios):.2f}..{max(ratios):.2f}) |")
    print("\nCPU cost (tokens per CPU-second summed over ranks; waiting for the shared cores is not counted):")
    print("\n| pair | A tok/CPU-s | B tok/CPU-s | median per-round ratio (min..max) |\n|---|---|---|---|")
    for a, b in PAIRS.values():
        ca = [_tok_cpu_s(res[f"paired/{a}/{i}"], tokens) for i in range(rounds)]
        cb = [_tok_cpu_s(res[f"paired/{b}/{i}"], tokens) for i in range(rounds)]
        ratios = [x / y for x, y in zip(ca, cb)]
        print(f"| {a} vs {b} | {statistics.median(ca):,.0f} | {statistics.median(cb):,.0f} | "
              f"**{statistics.median(ratios):.3f}** ({min(ratios):.2f}..{max(ratios):.2f}) |")


def report_tracking(res: dict[str, list[dict[str, Any]]], steps: int, rounds: int) -> None:
    """Step time with tracking on vs off (median of per-round ratios), and the unit costs as a share of a step."""
    tokens = TRAIN["global_batch"] * TINY["seq_len"]
    on = [_tok_s(res[f"tracking/tracking on/{i}"], tokens) for i in range(rounds)]
    off = [_tok_s(res[f"tracking/tracking off/{i}"], tokens) for i in range(rounds)]
    ratios = [b / a for a, b in zip(on, off)]  # step time on / off
    step_s = tokens / statistics.median(off)
    # CPU time per step summed over ranks (process CPU: the heartbeat thread's sampling included), which waiting
    # for the shared cores does not inflate: the steadier figure on a loaded machine.
    con = [_tok_cpu_s(res[f"tracking/tracking on/{i}"], tokens) for i in range(rounds)]
    coff = [_tok_cpu_s(res[f"tracking/tracking off/{i}"], tokens) for i in range(rounds)]
    cratios = [b / a for a, b in zip(con, coff)]
    unit = res["tracking/unit"]
    sample_s = max(u["sample_s"] for u in unit)
    record_s = max(u["record_s"] for u in unit)
    print(f"## bench_parallel --tracking {rounds}: dp=4 (2 virtual nodes x 2), gloo, 1 thread/rank, model tiny, "
          f"global batch {TRAIN['global_batch']} x {TINY['seq_len']}, {steps - 2} timed steps per run, heartbeat every "
          f"{HEARTBEAT_S:g} s, order alternating per round")
    print("\n| tracking on tok/s | tracking off tok/s | step time on/off per round | median (min..max) |")
    print("|---|---|---|---|")
    print(f"| {statistics.median(on):,.0f} | {statistics.median(off):,.0f} | {' '.join(f'{r:.3f}' for r in ratios)} | "
          f"**{statistics.median(ratios):.3f}** ({min(ratios):.3f}..{max(ratios):.3f}) |")
    print(f"\nCPU time per step (summed over ranks) on/off per round: {' '.join(f'{r:.3f}' for r in cratios)}; "
          f"median **{statistics.median(cratios):.3f}** ({min(cratios):.3f}..{max(cratios):.3f})")
    # Per step: two entry/exit records (the grad-norm / loss reduction; the evaluation's is per evaluation), and
    # the heartbeat thread's extra sampling, once per HEARTBEAT_S, prorated to the step.
    per_step = 2 * record_s + sample_s * step_s / HEARTBEAT_S
    print(f"\nunit costs (max over ranks): one sample of {unit[0]['groups']} groups' counts + CPU clock "
          f"{sample_s * 1e6:.1f} us (every {HEARTBEAT_S:g} s, off the training thread), one entry/exit record "
          f"{record_s * 1e9:.0f} ns; per step of {step_s * 1e3:.1f} ms: {per_step * 1e6:.2f} us = "
          f"**{100 * per_step / step_s:.4f}%** of the step")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--paired", type=int, default=0, metavar="N",
                    help="only the paired comparisons (ours vs DDP, dp2xpp2 vs dp2xtp2), N alternating rounds")
    ap.add_argument("--data", default="", help="prepared data dir (default: stdlib 'email' package, prepared)")
    ap.add_argument("--tracking", type=int, default=0, metavar="N",
                    help="only collective-progress tracking on vs off, N alternating rounds")
    args = ap.parse_args()
    from xirang_hpc.data.prepare import is_prepared, prepare

    data_dir = Path(args.data) if args.data else Path(tempfile.gettempdir()) / "xirang-bench-email"
    if not is_prepared(data_dir):
        import sysconfig

        prepare(str(Path(sysconfig.get_paths()["stdlib"]) / "email"), data_dir, val_fraction=0.2)
    t0 = time.time()
    if args.tracking:
        report_tracking(_collect(4, data_dir, args.steps, args.tracking, tracking=True), args.steps, args.tracking)
        print(f"\n(total {time.time() - t0:.0f}s)")
        return
    if args.paired:
        report_paired(_collect(4, data_dir, args.steps, args.paired, paired=True), args.steps, args.paired)
        print(f"\n(total {time.time() - t0:.0f}s)")
        return
    res = _collect(4, data_dir, args.steps, args.rounds)
    for name in MEMORY:
        res.update(_collect(4, data_dir, args.steps, args.rounds, memory=name))
    tokens = TRAIN["global_batch"] * TINY["seq_len"]
    ours_t = [_tok_s(res[f"ratio/ours/{i}"], tokens) for i in range(args.rounds)]
    ddp_t = [_tok_s(res[f"ratio/ddp/{i}"], tokens) for i in range(args.rounds)]
    print(f"## bench_parallel: 4 ranks (2 virtual nodes x 2), gloo, 1 thread/rank, model tiny, "
          f"global batch {TRAIN['global_batch']} x {TINY['seq_len']}")
    print(f"\nData parallel vs plain DDP (median of {args.rounds} interleaved rounds x {args.steps - 2} steps):")
    print(f"  ours {statistics.median(ours_t):,.0f} tok/s | plain DDP {statistics.median(ddp_t):,.0f} tok/s | "
          f"ratio {statistics.median(ours_t) / statistics.median(ddp_t):.3f} (target >= 0.95)")
    print("\n| layout | tokens/s | peak RSS per rank (MB) |\n|---|---|---|")
    for name in LAYOUTS:
        r = res[f"layout/{name}"]
        rss = " / ".join(f"{x['peak_mb']:.0f}" for x in r)
        print(f"| {name} | {_tok_s(r, tokens):,.0f} | {rss} |")
    print(f"\nPeak memory above the pre-build baseline, model {BIG}, batch 16 (max over ranks, MB):")
    print("| configuration | peak above baseline (MB) | vs baseline |\n|---|---|---|")
    base = max(x["peak_above_base_mb"] for x in res["memory/dp4 (baseline)"])
    for name in MEMORY:
        v = max(x["peak_above_base_mb"] for x in res[f"memory/{name}"])
        print(f"| {name} | {v:.0f} | {v / base:.2f}x |")
    print(f"\n(total {time.time() - t0:.0f}s)")


if __name__ == "__main__":
    main()
