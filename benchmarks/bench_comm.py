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
import math
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
    res.update(alpha_s=alpha, link_Bps=link_Bps, chunk_bytes=ar.pipeline_bytes, nodes=m, per_node=k)

    for mb in a.sizes_mb:
        n = int(mb * MB) // 4
        x = torch.randn(n)
        reps = 3 if mb >= 64 else 5
        flat = _timed(lambda x=x: dist.all_reduce(x), reps)
        inter = _timed(lambda x=x: pg_inter.allreduce([x]).wait(), reps)
        hier = _timed(lambda x=x: ar.allreduce_([x]), reps)
        intra = _timed(lambda x=x: ar.allreduce_([x], inter_node=False), reps)
        res["sizes"][str(mb)] = {"flat_by_node": flat, "flat_interleaved": inter, "hierarchical": hier,
                                 "intra_only": intra}
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

    # FSDP2 over all 4 ranks (shard groups cross the link) vs HSDP with shard groups inside each node
    # (replicate across nodes): the layout the runtime's comm note recommends (runtime/comm/groups.py).
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    def sharded(mesh) -> nn.Module:  # noqa: ANN001
        model = make()
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        return fully_shard(model, mesh=mesh)
    # Rank r = node * k + local, so the row-major (replicate, shard) mesh puts each shard group on one node.
    res["fsdp_step"] = {"fsdp": step_time(sharded(init_device_mesh("cpu", (world,)))),
                        "hsdp": step_time(sharded(init_device_mesh("cpu", (m, k),
                                                                   mesh_dim_names=("replicate", "shard"))))}
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
def fit_shm(res: dict) -> tuple[float, float]:
    """Calibrate the intra-node (shared-memory) step: ``intra(n) = C(n) a_l + n b_l``, least squares.

    From the benchmark's own intra-only runs (``allreduce_(inter_node=False)``: copy-in, barrier, shard
    sum, barrier, copy-out per chunk of ``chunk_bytes``; the link is not touched), over all sizes.
    """
    rows = [(math.ceil(float(mb) * MB / res["chunk_bytes"]), float(mb) * MB, r["intra_only"])
            for mb, r in res["sizes"].items()]
    scc = sum(c * c for c, _, _ in rows)
    scn = sum(c * n for c, n, _ in rows)
    snn = sum(n * n for _, n, _ in rows)
    sct = sum(c * t for c, _, t in rows)
    snt = sum(n * t for _, n, t in rows)
    det = scc * snn - scn * scn
    if len(rows) < 2 or det == 0:
        return 0.0, rows[0][2] / rows[0][1]
    a_l = (sct * snn - snt * scn) / det
    b_l = (scc * snt - scn * sct) / det
    if a_l < 0:  # not resolvable: all per-byte
        a_l, b_l = 0.0, snt / snn
    return a_l, b_l


def predict(res: dict, nbytes: float, a_l: float, b_l: float) -> dict[str, float]:
    """Alpha-beta predictions (anchors.md) for the three all-reduces of ``nbytes`` on ``m`` nodes x ``k`` ranks.

    veth: ``alpha`` = tiny all-reduce time / 2(p-1) steps, ``B`` = bytes/s of a lone 16 MB cross-node send;
    flat ring by node: every byte of 2(p-1)/p n crosses each node link once per direction; interleaved:
    twice. Hierarchical, pipelined in chunks of ``chunk_bytes`` (the intra-node work of chunk c+1 overlaps
    the inter-node all-reduce of chunk c): per chunk intra ``t_i = a_l + c b_l`` (shared memory, fitted by
    :func:`fit_shm`) and inter ``t_g = 2(m-1) alpha + 2(m-1)/m c / B`` (the k flows share the link), total
    ``t_i + t_g + (C-1) max(t_i, t_g)`` (fill + drain + steady state).
    """
    m, k = res["nodes"], res["per_node"]
    p, alpha, bw = m * k, res["alpha_s"], res["link_Bps"]
    chunks = max(1, math.ceil(nbytes / res["chunk_bytes"]))
    c = nbytes / chunks
    t_i = a_l + c * b_l
    t_g = 2 * (m - 1) * alpha + 2 * (m - 1) / m * c / bw
    return {
        "flat_by_node": 2 * (p - 1) * alpha + 2 * (p - 1) / p * nbytes / bw,
        "flat_interleaved": 2 * (p - 1) * alpha + 2 * (2 * (p - 1) / p * nbytes) / bw,
        "hierarchical": t_i + t_g + (chunks - 1) * max(t_i, t_g),
        "hierarchical_serial": nbytes / c * t_i + 2 * (m - 1) * alpha + 2 * (m - 1) / m * nbytes / bw,
    }


def add_model(res: dict) -> dict:
    """Calibrate the shared-memory step and attach predictions and errors to every size (in place)."""
    a_l, b_l = fit_shm(res)
    res["shm_alpha_s"], res["shm_Bps"] = a_l, (1 / b_l if b_l > 0 else float("inf"))
    for mb, r in res["sizes"].items():
        r["model"] = predict(res, float(mb) * MB, a_l, b_l)
        r["error"] = {key: r[key] / r["model"][key] - 1 for key in ("flat_by_node", "flat_interleaved", "hierarchical")}
    return res


def report(res: dict) -> str:
    lines = [f"link {res['rate']}: measured {res['link_Bps'] * 8 / 1e9:.2f} Gbit/s, "
             f"alpha {res['alpha_s'] * 1e6:.0f} us; shared memory (fitted): alpha {res['shm_alpha_s'] * 1e6:.0f} us "
             f"per {res['chunk_bytes'] / MB:g} MB chunk, {res['shm_Bps'] / 1e9:.2f} GB/s",
             f"{'size':>7} | {'flat(node)':>10} {'model':>7} {'err':>5} | {'flat(intl)':>10} {'model':>7} {'err':>5} | "
             f"{'hier':>8} {'model':>7} {'err':>5} | {'flat/hier':>9} {'intl/hier':>9}"]
    for mb, r in res["sizes"].items():
        cols = " | ".join(f"{r[key] * 1e3:8.1f}ms {r['model'][key] * 1e3:6.1f} {r['error'][key]:+5.0%}"
                          for key in ("flat_by_node", "flat_interleaved", "hierarchical"))
        lines.append(f"{mb:>4} MB | {cols} | "
                     f"{r['flat_by_node'] / r['hierarchical']:8.2f}x {r['flat_interleaved'] / r['hierarchical']:8.2f}x")
    dd = res["ddp_step"]
    lines.append(f"DDP step ({res['model_params_mb']:.1f} MB params): "
                 f"flat(node) {dd['flat_by_node'] * 1e3:.1f} ms | "
                 f"flat(intl) {dd['flat_interleaved'] * 1e3:.1f} ms | hier {dd['hierarchical'] * 1e3:.1f} ms | "
                 f"flat/hier {dd['flat_by_node'] / dd['hierarchical']:.2f}x")
    if "fsdp_step" in res:
        fs = res["fsdp_step"]
        lines.append(f"FSDP2 step (same model): fsdp over {res['nodes'] * res['per_node']} ranks "
                     f"{fs['fsdp'] * 1e3:.1f} ms | hsdp {res['nodes']} nodes x {res['per_node']} shards "
                     f"{fs['hsdp'] * 1e3:.1f} ms | fsdp/hsdp {fs['fsdp'] / fs['hsdp']:.2f}x")
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
        res = add_model(json.loads(Path(out).read_text()))
    print(report(res))
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
