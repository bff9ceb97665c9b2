"""The hierarchical all-reduce across real network namespaces (tools/netem_nodes.py): 2 nodes x 2 ranks.

Each node is a namespace joined to a bridge by a TBF-shaped (1 gbit) veth; its two ranks run inside
it with gloo bound to the veth, so cross-node traffic really crosses the shaped link and intra-node
traffic stays on the node (shared memory). Every rank checks the hierarchical average against a flat
gloo all-reduce for many sizes (tests/comm_harness.py ``scen_sizes``). Needs root and iproute2;
skipped with the reason otherwise. The namespaces are deleted however the test ends.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tools"))
sys.path.insert(0, str(HERE))

import netem_nodes  # noqa: E402

PORT = 29631  # namespaces have their own port space: nothing else listens there


def worker(rank: int, per_node: int, nodes: int, master: str, out: str) -> None:
    """One rank inside its node's namespace."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist
    from comm_harness import scen_sizes, topology

    node = rank // per_node
    os.environ["GLOO_SOCKET_IFNAME"] = f"v{node}"
    torch.set_num_threads(1)
    world = nodes * per_node
    store = dist.TCPStore(master, PORT, world, is_master=rank == 0, timeout=timedelta(seconds=300))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=300))
    tx0 = int(Path(f"/sys/class/net/v{node}/statistics/tx_bytes").read_text())
    res = scen_sizes(topology(rank, nodes, per_node, PORT))  # asserts equality inside
    res["veth_tx_bytes"] = int(Path(f"/sys/class/net/v{node}/statistics/tx_bytes").read_text()) - tx0
    dist.barrier()
    dist.destroy_process_group()
    Path(out, f"rank{rank}.json").write_text(json.dumps(res))


@pytest.mark.slow
def test_hierarchical_equals_flat_across_namespaces(tmp_path: Path) -> None:
    why = netem_nodes.available()
    if why:
        pytest.skip(f"network namespaces unavailable: {why}")
    prefix = f"xrt{os.getpid() % 100000}"
    procs: list[subprocess.Popen[bytes]] = []
    with netem_nodes.emulated_nodes(2, "1gbit", prefix) as nodes:
        try:
            for r in range(4):
                nd = nodes[r // 2]
                procs.append(subprocess.Popen(
                    [*nd.exec_prefix(), sys.executable, __file__, str(r), "2", "2", nodes[0].addr, str(tmp_path)],
                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
            outs = [p.communicate(timeout=600)[0].decode()[-3000:] for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        assert [p.returncode for p in procs] == [0] * 4, "\n".join(outs)
    assert netem_nodes.namespaces(prefix) == []  # cleaned up
    res = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(4)]
    assert all(0 <= x["worst_rel"] < 1e-6 for x in res)
    # The cross-node shard all-reduces went through each node's veth (> 1 MB of the ~4.8 MB of data each way).
    assert all(x["veth_tx_bytes"] > 1_000_000 for x in res[::2])


if __name__ == "__main__":
    worker(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5])
