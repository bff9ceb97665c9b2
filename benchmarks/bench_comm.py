#!/usr/bin/env python3
"""Hierarchical all-reduce vs flat gloo all-reduce on 2 emulated nodes x 2 ranks over a shaped link.

    sudo .venv/bin/python benchmarks/bench_comm.py --rate 1gbit --sizes-mb 1 4 16 64 256

Creates two network namespaces joined through a TBF-shaped link (tools/netem_nodes.py), starts
2 ranks in each (gloo bound to the namespace's interface), and measures side by side in one run:
flat all-reduce with ranks ordered node by node (the default group), the same ring with ranks
interleaved across nodes (every hop crosses the link), the hierarchical all-reduce
(xirang_hpc/runtime/comm), a DDP training step with each, the alpha-beta model's prediction for
each, and the inter-node bytes per step of the bandwidth budget (H=1 vs H=8) read from the veth
counters. Prints medians (max over ranks per repetition) and ratios; ``--json`` saves them.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))

import netem_nodes  # noqa: E402

MB = 1 << 20
PORT = 29517


# ---------------------------------------------------------------- worker (runs inside a namespace)
def _timed(fn, reps: int, group=None) -> float:  # noqa: ANN001
    import torch
    import torch.distributed as dist

    fn()  # warm-up
    if reps == 0:
        return 0.0
    times = []
    for _ in range(reps):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        t = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        times.append(float(t))
    return statistics.median(times)


def worker(a: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    from xirang_hpc.config.schema import CommConfig
    from xirang_hpc.runtime.comm import install_comm
    from xirang_hpc.runtime.comm.groups import build_layout
    from xirang_hpc.runtime.comm.hierarchical import HierarchicalAllreduce
    from xirang_hpc.runtime.topology import Topology

    k, m = a.per_node, a.nodes
    world, rank = k * m, a.rank
    node = rank // k
    torch.set_num_threads(1)
    ifname = f"v{node}"
    os.environ["GLOO_SOCKET_IFNAME"] = ifname
    store = dist.TCPStore(a.master, PORT, world, is_master=rank == 0, timeout=timedelta(seconds=300))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    topo = Topology(rank=rank, world_size=world, local_rank=rank % k, local_world_size=k, node_id=node,
                    num_nodes=m, node_name=f"n{node}", master_addr=a.master, master_port=PORT, job_id="bench",
                    source="local")
    # Interleaved ring: group rank q sits on node q % m (every hop of the ring crosses the link).
    opts = dist.ProcessGroupGloo._Options()
    opts._devices = [dist.ProcessGroupGloo.create_device(interface=ifname)]
    opts._timeout = timedelta(seconds=300)
    local = rank % k
    inter_rank = local * m + node
    pg_inter = dist.ProcessGroupGloo(dist.PrefixStore("interleaved", store), inter_rank, world, opts)
    ar = HierarchicalAllreduce(build_layout(topo), slot_bytes=64 * MB)
    res: dict = {"sizes": {}, "rate": a.rate}

    # Alpha-beta parameters: alpha from a tiny all-reduce, link bandwidth from a lone cross-node send.
    tiny = torch.zeros(1)
    alpha = _timed(lambda: dist.all_reduce(tiny), 20) / (2 * (world - 1))
    probe = torch.zeros(16 * MB // 4)

    def p2p() -> None:
        if rank == 0:
            dist.send(probe, dst=k)
        elif rank == k:
            dist.recv(probe, src=0)
    link_Bps = probe.numel() * 4 / _timed(p2p, 3)
    res.update(alpha_s=alpha, link_Bps=link_Bps)

    for mb in a.sizes_mb:
        n = int(mb * MB) // 4
        x = torch.randn(n)
        reps = 3 if mb >= 64 else 5
        flat = _timed(lambda x=x: dist.all_reduce(x), reps)
        inter = _timed(lambda x=x: pg_inter.allreduce([x]).wait(), reps)
        hier = _timed(lambda x=x: ar.allreduce_([x]), reps)
        intra = _timed(lambda x=x: ar.allreduce_([x], inter_node=False), reps)
        nbytes, p = n * 4, world
        model = {  # anchors.md alpha-beta; the k hierarchical flows share one link per node
            "flat_by_node": 2 * (p - 1) * alpha + 2 * (p - 1) / p * nbytes / link_Bps,
            "flat_interleaved": 2 * (p - 1) * alpha + 2 * (2 * (p - 1) / p * nbytes) / link_Bps,
            "hierarchical": intra + 2 * (m - 1) * alpha + 2 * (m - 1) / m * nbytes / link_Bps,
        }
        res["sizes"][str(mb)] = {"flat_by_node": flat, "flat_interleaved": inter, "hierarchical": hier,
                                 "intra_only": intra, "model": model}
        if rank == 0:
            print(f"  {mb:>5g} MB: flat {flat * 1e3:8.1f} ms | interleaved {inter * 1e3:8.1f} ms | "
                  f"hier {hier * 1e3:8.1f} ms (intra {intra * 1e3:.1f}) | flat/hier {flat / hier:.2f}x", flush=True)

    # DDP training step on an MLP of ~a.model_mb MB of parameters.
    width = int((a.model_mb * MB / 4 / 3) ** 0.5)

    def make() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(width, width), nn.Tanh(), nn.Linear(width, width), nn.Tanh(),
                             nn.Linear(width, width))

    def step_time(ddp: nn.Module, state=None, steps: int = 4) -> float:  # noqa: ANN001
        opt = torch.optim.SGD(ddp.parameters(), lr=1e-3)
        xb = torch.randn(16, width)

        def one() -> None:
            loss = ddp(xb).square().mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            if state is not None:
                state.after_step(0.0)
        return _timed(one, steps)

    def interleaved_hook(_state, bucket):  # noqa: ANN001, ANN202 - DDP's flat ring on the interleaved group
        buf = bucket.buffer().div_(world)
        return pg_inter.allreduce([buf]).get_future().then(lambda f: f.value()[0])

    d_int = DDP(make())
    d_int.register_comm_hook(None, interleaved_hook)
    ddp_res = {"flat_by_node": step_time(DDP(make())), "flat_interleaved": step_time(d_int)}
    d = DDP(make())
    st = install_comm(d, topo, CommConfig(bucket="25"))
    ddp_res["hierarchical"] = step_time(d, st)
    st.close()
    res["ddp_step"] = ddp_res
    res["model_params_mb"] = 3 * (width * width + width) * 4 / MB

    # Bandwidth budget: inter-node bytes per step on the veth, H=1 vs H=8.
    def tx() -> int:
        return int(Path(f"/sys/class/net/{ifname}/statistics/tx_bytes").read_text())

    budget = {}
    for H in (1, 8):
        d = DDP(make())
        st = install_comm(d, topo, CommConfig(bucket="25", sync_period=H))
        step_time(d, st, steps=0)  # one warm-up step outside the window
        dist.barrier()
        b0 = tx()
        t = step_time(d, st, steps=a.budget_steps) if a.budget_steps else 0.0
        dist.barrier()
        b1 = tx()
        node_bytes = torch.tensor([float(b1 - b0) if rank % k == 0 else 0.0], dtype=torch.float64)
        dist.all_reduce(node_bytes)
        # a.budget_steps timed steps + their barriers/max all-reduces (tiny) per node
        budget[str(H)] = {"veth_tx_bytes_per_step_per_node": float(node_bytes) / m / (a.budget_steps + 1),
                          "logical_bytes_per_step": st.stats()["internode_bytes_per_step"], "step_s": t}
        st.close()
    res["budget"] = budget
    ar.close()
    if rank == 0:
        Path(a.out).write_text(json.dumps(res))
    dist.barrier()
    dist.destroy_process_group()


# ---------------------------------------------------------------- parent
def report(res: dict) -> str:
    lines = [f"link {res['rate']}: measured {res['link_Bps'] * 8 / 1e9:.2f} Gbit/s, "
             f"alpha {res['alpha_s'] * 1e6:.0f} us",
             f"{'size':>7} | {'flat(node)':>10} {'model':>7} | {'flat(intl)':>10} {'model':>7} | "
             f"{'hier':>8} {'model':>7} | {'flat/hier':>9} {'intl/hier':>9}"]
    for mb, r in res["sizes"].items():
        mo = r["model"]
        lines.append(
            f"{mb:>4} MB | {r['flat_by_node'] * 1e3:8.1f}ms {mo['flat_by_node'] * 1e3:6.1f} | "
            f"{r['flat_interleaved'] * 1e3:8.1f}ms {mo['flat_interleaved'] * 1e3:6.1f} | "
            f"{r['hierarchical'] * 1e3:6.1f}ms {mo['hierarchical'] * 1e3:6.1f} | "
            f"{r['flat_by_node'] / r['hierarchical']:8.2f}x {r['flat_interleaved'] / r['hierarchical']:8.2f}x")
    dd = res["ddp_step"]
    lines.append(f"DDP step ({res['model_params_mb']:.1f} MB params): "
                 f"flat(node) {dd['flat_by_node'] * 1e3:.1f} ms | "
                 f"flat(intl) {dd['flat_interleaved'] * 1e3:.1f} ms | hier {dd['hierarchical'] * 1e3:.1f} ms | "
                 f"flat/hier {dd['flat_by_node'] / dd['hierarchical']:.2f}x")
    b = res["budget"]  # inter-node bytes per step per node
    v1, v8 = (b[h]["veth_tx_bytes_per_step_per_node"] for h in ("1", "8"))
    lines.append(f"budget: veth bytes/step/node H=1 {v1 / 1e6:.2f} MB, H=8 {v8 / 1e6:.2f} MB -> factor "
                 f"{v1 / max(1.0, v8):.2f}"
                 f" (logical {b['1']['logical_bytes_per_step'] / max(1.0, b['8']['logical_bytes_per_step']):.2f})")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rate", default="1gbit")
    ap.add_argument("--sizes-mb", type=float, nargs="+", default=[1, 4, 16, 64, 256])
    ap.add_argument("--model-mb", type=float, default=24.0)
    ap.add_argument("--budget-steps", type=int, default=16)
    ap.add_argument("--json", default="")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--nodes", type=int, default=2, help=argparse.SUPPRESS)
    ap.add_argument("--per-node", type=int, default=2, help=argparse.SUPPRESS)
    ap.add_argument("--master", default="", help=argparse.SUPPRESS)
    ap.add_argument("--out", default="", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        worker(a)
        return 0
    why = netem_nodes.available()
    if why:
        print(f"bench_comm: cannot emulate nodes here: {why}", file=sys.stderr)
        return 2
    prefix = f"xrb{os.getpid() % 10000}"
    with tempfile.TemporaryDirectory() as tmp, netem_nodes.emulated_nodes(a.nodes, a.rate, prefix) as nodes:
        out = str(Path(tmp) / "res.json")
        procs = []
        for r in range(a.nodes * a.per_node):
            nd = nodes[r // a.per_node]
            cmd = [*nd.exec_prefix(), sys.executable, __file__, "--worker", "--rank", str(r), "--nodes", str(a.nodes),
                   "--per-node", str(a.per_node), "--master", nodes[0].addr, "--out", out, "--rate", a.rate,
                   "--model-mb", str(a.model_mb), "--budget-steps", str(a.budget_steps),
                   "--sizes-mb", *[str(s) for s in a.sizes_mb]]
            procs.append(subprocess.Popen(cmd, env={**os.environ, "PYTHONPATH": str(ROOT)}))
        rcs = [p.wait() for p in procs]
        if any(rcs):
            print(f"bench_comm: workers exited with {rcs}", file=sys.stderr)
            return 1
        res = json.loads(Path(out).read_text())
    print(report(res))
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
