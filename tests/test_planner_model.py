"""Planner building blocks: Korthikanti activations, ZeRO bytes, alpha-beta costs, search, hardware."""

from __future__ import annotations

import pytest

from xirang_hpc.config.errors import ConfigError
from xirang_hpc.config.schema import ClusterConfig
from xirang_hpc.planner import comm
from xirang_hpc.planner.calibrate import fit_alpha_beta, fit_saturation
from xirang_hpc.planner.cost import GiB, Plan, Problem, estimate
from xirang_hpc.planner.formulas import Shape, layer_activation_bytes, state_bytes_per_param
from xirang_hpc.planner.hardware import PRESETS, hardware_for
from xirang_hpc.planner.search import search, why_lost

SH = Shape(layers=80, hidden=12288, heads=96, seq=2048, vocab=51200, ffn=4 * 12288)
A100 = PRESETS["a100-80gb"]


def test_korthikanti_activation_bytes() -> None:
    s, b, h, a = 2048, 1, 12288, 96
    sbh = s * b * h
    assert layer_activation_bytes(SH, 1, 1, False, "none", 2) == pytest.approx(sbh * (34 + 5 * a * s / h))
    tp8 = sbh * (10 + 24 / 8 + 5 * a * s / (h * 8))
    assert layer_activation_bytes(SH, 1, 8, False, "none", 2) == pytest.approx(tp8)
    assert layer_activation_bytes(SH, 1, 8, True, "none", 2) == pytest.approx(sbh * (34 / 8 + 5 * a * s / (h * 8)))
    assert layer_activation_bytes(SH, 1, 8, True, "selective", 2) == pytest.approx(sbh * 34 / 8)
    assert layer_activation_bytes(SH, 1, 8, False, "full", 2) == pytest.approx(2 * sbh)
    # fp32 activations take twice the bytes.
    assert layer_activation_bytes(SH, 2, 1, False, "full", 4) == pytest.approx(2 * 2 * 2 * sbh)


def test_activation_bytes_without_dropout_drop_the_masks() -> None:
    """Korthikanti et al. Sec. 4.1 by hand, without dropout: of the 34 bytes per s*b*h element the attention
    output's and the MLP output's 1-byte masks go (32; the replicated 10 under tensor parallelism becomes 8), and
    of the 5*a*s/h per score only the softmax output's 2 bytes stay (no mask, no dropout output)."""
    import dataclasses

    s, b, h, a = 2048, 1, 12288, 96
    sbh = s * b * h
    no = dataclasses.replace(SH, dropout=False)
    assert layer_activation_bytes(no, 1, 1, False, "none", 2) == pytest.approx(sbh * (32 + 2 * a * s / h))
    assert layer_activation_bytes(no, 1, 8, False, "none", 2) == pytest.approx(sbh * (8 + 24 / 8 + 2 * a * s / (h * 8)))
    assert layer_activation_bytes(no, 1, 8, True, "selective", 2) == pytest.approx(sbh * 32 / 8)
    assert layer_activation_bytes(no, 1, 8, True, "none", 2, flash=True) == pytest.approx(sbh * 32 / 8)
    assert layer_activation_bytes(no, 1, 8, True, "full", 2) == layer_activation_bytes(SH, 1, 8, True, "full", 2)
    # The override keeps the masks for a model without dropout (cost.py's traffic proxy).
    assert layer_activation_bytes(no, 1, 1, False, "none", 2, dropout=True) == layer_activation_bytes(
        SH, 1, 1, False, "none", 2)


def test_llama3_405b_layer_activations_by_hand() -> None:
    """Llama 3 405B (h 16,384, 8 KV heads of 128, SwiGLU 53,248, no dropout) at tp 8 with sequence parallelism and
    a fused attention kernel, tensor by tensor, in bytes per s*b*h element before the 1/t: the two RMSNorms' inputs
    2 + 2, the QKV and MLP inputs 2 + 2, Q 2, K and V 2 * 1,024/16,384 each, the attention output (the output
    projection's input) 2, the gate, up and product tensors 3 * 2 * 53,248/16,384 = 19.5: 31.75."""
    from xirang_hpc.planner.published import LLAMA3

    sh = LLAMA3[0].shape
    assert not sh.dropout and sh.kv_width == 1024
    per = 2 + 2 + 2 + 2 + 2 + 2 * 2 * 1024 / 16384 + 2 + 3 * 2 * 53248 / 16384
    assert per == 31.75
    got = layer_activation_bytes(sh, 1, 8, True, "none", 2, flash=True)
    assert got == pytest.approx(8192 * 16384 * per / 8)
    assert got / GiB == pytest.approx(0.496, abs=5e-4)


def test_zero_stages_match_rajbhandari() -> None:
    nd = 8
    assert sum(state_bytes_per_param(0, nd, 2, 2, 12)) == 16
    assert sum(state_bytes_per_param(1, nd, 2, 2, 12)) == pytest.approx(4 + 12 / nd)
    assert sum(state_bytes_per_param(2, nd, 2, 2, 12)) == pytest.approx(2 + 14 / nd)
    assert sum(state_bytes_per_param(3, nd, 2, 2, 12)) == pytest.approx(16 / nd)


def test_alpha_beta_ring_and_hierarchical() -> None:
    n, a, b = 100e6, 5e-6, 1 / 20e9
    assert comm.ring_allreduce(n, 4, a, b) == pytest.approx(2 * 3 * a + 2 * 3 / 4 * n * b)
    assert comm.ring_allreduce(n, 1, a, b) == 0.0
    links = comm.Links(a_intra=3e-6, b_intra=1 / 240e9, a_inter=8e-6, b_inter_node=1 / 160e9, nics=8)
    k, m = 8, 4
    hier = comm.hierarchical_allreduce(n, k, m, links, flows=8)
    expected = (2 * 7 * 3e-6 + 2 * 7 / 8 * n / 240e9) + (2 * 3 * 8e-6 + 2 * 3 / 4 * (n / 8) * 8 / 160e9)
    assert hier == pytest.approx(expected)
    # 8 ranks/node x 4 nodes: the hierarchical algorithm beats one flat ring through a single NIC.
    t, algo = comm.group_allreduce(n, k, m, links, flows=8)
    assert algo == "hierarchical" and t == pytest.approx(hier)
    assert comm.group_allreduce(n, 8, 1, links, flows=8)[1] == "ring-intra"
    assert comm.p2p(1e6, True, links, flows=8) == pytest.approx(8e-6 + 1e6 * 8 / 160e9)


def test_pipelined_ring_is_set_by_its_slowest_link() -> None:
    """NCCL's multi-channel ring (comm.pipelined_ring): NVLink and network hops run at once, so the time is
    2(p-1)/p * n times the larger of (k-1)/k * b_l and the rank's NIC share b_inter(flows)/k, plus NCCL's
    step latencies (2(p-m) on NVLink, 2(m-1) across nodes) -- not the hierarchical sum of both phases."""
    n = 100e6
    links = comm.Links(a_intra=3e-6, b_intra=1 / 240e9, a_inter=8e-6, b_inter_node=1 / 160e9, nics=8)
    k, m = 8, 4
    p = k * m
    ring = comm.pipelined_ring(n, k, m, links, flows=8)
    per_byte = max(7 / 8 / 240e9, 8 / 160e9 / 8)  # here the network (160 GB/s per node) is the bottleneck
    assert ring == pytest.approx(2 * (p - m) * 3e-6 + 2 * (m - 1) * 8e-6 + 2 * (p - 1) / p * n * per_byte)
    assert ring < comm.hierarchical_allreduce(n, k, m, links, flows=8)
    # A faster network leaves NVLink the bottleneck: then the time no longer depends on the network.
    fast = comm.Links(a_intra=3e-6, b_intra=1 / 240e9, a_inter=8e-6, b_inter_node=1 / 1000e9, nics=8)
    latency = 2 * (p - m) * 3e-6 + 2 * (m - 1) * 8e-6
    assert comm.pipelined_ring(n, k, m, fast, flows=8) == pytest.approx(latency + 2 * (p - 1) / p * n * 7 / 8 / 240e9)
    # One node: the intra-node ring; one rank per node: the flat ring through that rank's NIC share.
    assert comm.pipelined_ring(n, 8, 1, links, flows=8) == pytest.approx(comm.ring_allreduce(n, 8, 3e-6, 1 / 240e9))
    flat = comm.group_allreduce(n, 1, m, links, flows=8)[0]
    assert comm.pipelined_ring(n, 1, m, links, flows=8) == pytest.approx(flat)


def test_pipeline_bubble_and_interleaving() -> None:
    pb = Problem(SH, A100, nodes=192, per_node=8, global_batch=2304)
    e1 = estimate(pb, Plan(dp=24, tp=8, pp=8, micro=1, recompute="full"))
    e2 = estimate(pb, Plan(dp=24, tp=8, pp=8, micro=1, v=2, recompute="full"))
    m = 2304 // 24
    slot = (e1.time["compute"] + e1.time["tp_comm"]) / m
    assert e1.time["bubble"] == pytest.approx(7 * slot)  # (p-1)/m of the ideal time
    assert e2.time["bubble"] == pytest.approx(7 / 2 * slot)  # (p-1)/(v*m)
    assert e2.time["p2p"] > e1.time["p2p"]  # interleaving communicates more


def test_search_reports_oom_and_no_plan() -> None:
    pb = Problem(SH, A100, nodes=1, per_node=8, global_batch=64)  # 145B on 8 GPUs cannot fit
    res = search(pb)
    assert res.ranked == []
    with pytest.raises(ValueError, match="no plan fits"):
        _ = res.best
    big = Problem(SH, A100, nodes=64, per_node=8, global_batch=512)
    res = search(big)
    assert res.best.fits
    for e in res.oom:
        assert not e.fits and e.peak_memory > 80 * GiB
        assert res.reasons[id(e)].startswith("OOM: needs")


def test_why_lost_names_the_component() -> None:
    pb = Problem(SH, A100, nodes=192, per_node=8, global_batch=2304)
    fast = estimate(pb, Plan(dp=24, tp=8, pp=8, micro=1, v=2, recompute="full"))
    deep = estimate(pb, Plan(dp=12, tp=8, pp=16, micro=1, recompute="full"))
    assert why_lost(deep, fast).startswith("pipeline bubble")
    rc = estimate(pb, Plan(dp=24, tp=8, pp=8, micro=1, v=2, recompute="none", sp=True))
    assert why_lost(fast, rc).startswith("compute (recompute=full)")


def test_hardware_overrides_and_errors() -> None:
    c = ClusterConfig(name="x", gpus_per_node=8, tasks_per_node=8, gpu="h200", hardware={"inter_bw_gbs": 50.0})
    hw = hardware_for(c)
    assert hw.name == "h200" and hw.mem_gb == 141.0 and hw.inter_bw_gbs == 50.0
    assert hardware_for(ClusterConfig(name="cpu")).name == "cpu"
    assert hardware_for(ClusterConfig(name="g", gpus_per_node=8)).name == "a100-80gb"
    with pytest.raises(ConfigError, match=r"cluster.hardware.bogus.*unknown field"):
        hardware_for(ClusterConfig(name="x", hardware={"bogus": 1.0}))
    with pytest.raises(ConfigError, match=r"cluster.gpu='tpu'.*choose one of"):
        hardware_for(ClusterConfig(name="x", gpu="tpu"))
    with pytest.raises(ConfigError, match=r"cluster.hardware.peak_tflops.*must be positive"):
        hardware_for(ClusterConfig(name="x", hardware={"peak_tflops": 0.0}))
    with pytest.raises(ConfigError, match=r"cluster.hardware.dp_overlap.*must be 0 or more"):
        hardware_for(ClusterConfig(name="x", hardware={"dp_overlap": -0.5}))
    assert hardware_for(ClusterConfig(name="x", hardware={"gemm_half_width": 0.0})).gemm_half_width == 0.0


def test_calibration_fits_recover_parameters() -> None:
    a, b, p = 20e-6, 1 / 3e9, 4
    t = [comm.ring_allreduce(n, p, a, b) for n in (4096, 4 << 20)]
    fa, fb = fit_alpha_beta(p, 4096, t[0], 4 << 20, t[1])
    assert fa == pytest.approx(a, rel=1e-6) and fb == pytest.approx(b, rel=1e-6)
    r_peak, half = 2e11, 40.0

    def rate(w: float) -> float:
        return r_peak * w / (w + half)

    fr, fh = fit_saturation(32, rate(32), 256, rate(256))
    assert fr == pytest.approx(r_peak) and fh == pytest.approx(half)
