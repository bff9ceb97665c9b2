"""What FSDP2 holds under torch's pipeline schedule, measured in a real 2-rank gloo group.

The planner charges ZeRO-2/3 under pp > 1 with whole weights and gradients plus FSDP2's 1/dp shards
of both (planner/cost.py, ``_memory``), because torch's ``PipelineStage`` sets
``reshard_after_backward`` and ``requires_gradient_sync`` to False for every microbatch but the
step's last. This checks those bytes on real FSDP2 modules driven exactly as the schedule drives
them, so a torch that changes the behaviour fails here rather than silently mis-ranking plans.
"""

from __future__ import annotations

import os
import socket
import traceback
from typing import Any

import pytest
import torch
import torch.distributed as dist
from ranks import rank_context
from torch import nn

pytestmark = pytest.mark.slow

WIDTH, LAYERS, DP = 256, 4, 2


def _held(model: nn.Module) -> dict[str, int]:
    """Bytes of sharded / unsharded weights and gradients FSDP2 holds on this rank, over every unit."""
    from torch.distributed.fsdp import FSDPModule

    out = {"sharded_w": 0, "unsharded_w": 0, "unsharded_g": 0, "sharded_g": 0}
    for mod in model.modules():
        if not isinstance(mod, FSDPModule):
            continue
        group = mod._get_fsdp_state()._fsdp_param_group
        for fp in group.fsdp_params if group else []:
            out["sharded_w"] += fp._sharded_param_data.untyped_storage().nbytes()
            out["unsharded_w"] += sum(t.untyped_storage().nbytes() for t in fp.all_gather_outputs)
            up = getattr(fp, "_unsharded_param", None)
            if up is not None and up.grad is not None:
                out["unsharded_g"] += up.grad.untyped_storage().nbytes()
            if fp.unsharded_accumulated_grad is not None:
                out["unsharded_g"] += fp.unsharded_accumulated_grad.untyped_storage().nbytes()
            if fp.sharded_param.grad is not None:
                out["sharded_g"] += fp.sharded_param.grad.to_local().untyped_storage().nbytes()
    return out


def _worker(rank: int, port: int, zero: int, q: Any) -> None:
    try:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        torch.set_num_threads(1)
        dist.init_process_group("gloo", rank=rank, world_size=DP)
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (DP,))
        torch.manual_seed(0)
        model = nn.Sequential(*[nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(LAYERS)])
        for layer in model:  # as the runtime: one unit per block, then the root; ZeRO-2 keeps weights
            fully_shard(layer, mesh=mesh, reshard_after_forward=zero != 2)
        fully_shard(model, mesh=mesh, reshard_after_forward=zero != 2)
        x = torch.randn(8, WIDTH)
        # Every microbatch but the last, as PipelineStage.backward_one_chunk sets it.
        model.set_is_last_backward(False)
        model.set_reshard_after_backward(False)
        model.set_requires_gradient_sync(False)
        for _ in range(2):
            model(x).sum().backward()
        during = _held(model)
        # The step's last: PipelineStage's reduce step turns both back on and reduce-scatters once.
        model.set_is_last_backward(True)
        model.set_reshard_after_backward(True)
        model.set_requires_gradient_sync(True)
        model(x).sum().backward()
        q.put((rank, {"during": during, "after": _held(model)}))
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - the parent reports it
        q.put((rank, {"error": traceback.format_exc()}))


def _run(zero: int) -> dict[str, Any]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = rank_context()
    q = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, port, zero, q)) for r in range(DP)]
    for p in procs:
        p.start()
    got = dict(q.get(timeout=600) for _ in procs)
    for p in procs:
        p.join(timeout=120)
    for r, res in got.items():
        assert "error" not in res, f"rank {r}: {res['error']}"
    return got[0]


@pytest.mark.parametrize("zero", [2, 3])
def test_pipelined_fsdp_holds_whole_weights_and_grads_beside_the_shards(zero: int) -> None:
    full = LAYERS * WIDTH * WIDTH * 4  # fp32 bytes of every weight (or gradient)
    res = _run(zero)
    during, after = res["during"], res["after"]
    # Between microbatches: whole weights and gradients, and FSDP2's 1/dp weight shards beside them --
    # the planner's w * (1 + 1/dp) and a whole gradient (cost._memory).
    assert during["sharded_w"] == full // DP
    assert during["unsharded_w"] == full
    assert during["unsharded_g"] == full and during["sharded_g"] == 0
    # After the step's last backward: reduced to 1/dp gradient shards, weights resharded.
    assert after["sharded_g"] == full // DP
    assert after["unsharded_w"] == 0 and after["unsharded_g"] == 0
