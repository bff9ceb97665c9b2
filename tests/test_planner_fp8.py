"""The planner under train.precision=fp8: the H100/H200 presets' datasheet FP8 peak (1,979 TFLOP/s dense, twice
bf16's 989) for the linear layers' GEMMs, attention and the output head at the bf16 peak; a preset without FP8 is
refused by name."""

from __future__ import annotations

import pytest
from conftest import compose_cfg

from xirang_hpc.config.errors import ConfigError
from xirang_hpc.config.validate import load_config
from xirang_hpc.planner.auto import problem_of
from xirang_hpc.planner.cost import Plan, Problem, estimate
from xirang_hpc.planner.formulas import Shape, layer_forward_flops
from xirang_hpc.planner.hardware import PRESETS, with_precision

SHAPE = Shape(layers=8, hidden=4096, heads=32, kv_heads=8, seq=4096, vocab=32000, ffn=14336, swiglu=True,
              bias=False, learned_pos=False, tied=False)


def test_h100_and_h200_carry_the_datasheet_fp8_peak_and_the_a100_none() -> None:
    assert PRESETS["h100"].fp8_tflops == PRESETS["h200"].fp8_tflops == 1979.0
    assert PRESETS["h100"].peak_tflops == 989.0
    assert PRESETS["a100-80gb"].fp8_tflops == 0.0
    assert with_precision(PRESETS["h100"], "bf16") is PRESETS["h100"]
    assert with_precision(PRESETS["h100"], "fp8").linear_peak_tflops == 1979.0
    with pytest.raises(ConfigError, match="a100-80gb preset has no FP8 peak"):
        with_precision(PRESETS["a100-80gb"], "fp8")


def test_fp8_speeds_up_the_linear_gemms_only_by_hand() -> None:
    """Compute time saved = m * layers * 3 * dense forward FLOPs / eff * (1/989e12 - 1/1979e12); the head, the
    attention products and the rest of the compute unchanged."""
    hw = PRESETS["h100"]
    plan = Plan(dp=8, tp=1, pp=1, micro=1)
    bf16 = estimate(Problem(SHAPE, hw, 1, 8, 16), plan)
    fp8 = estimate(Problem(SHAPE, with_precision(hw, "fp8"), 1, 8, 16), plan)
    dense, _ = layer_forward_flops(SHAPE, SHAPE.seq)
    eff = hw.gemm_efficiency * SHAPE.hidden / (SHAPE.hidden + hw.gemm_half_width)
    m = 2  # 16 sequences over dp 8, micro-batch 1
    saved = m * SHAPE.layers * 3 * dense / eff * (1 / 989e12 - 1 / 1979e12)
    assert bf16.time["compute"] - fp8.time["compute"] == pytest.approx(saved, rel=1e-9)
    for k in ("optimizer", "tp_comm"):
        assert fp8.time[k] == bf16.time[k]
    assert fp8.time["dp_comm"] >= bf16.time["dp_comm"]  # a shorter backward hides less of the gradient all-reduce
    assert fp8.memory == bf16.memory
    assert fp8.mfu > bf16.mfu  # MFU stays against the bf16 peak, so plans compare on one scale


def test_a_config_asking_for_fp8_plans_with_the_fp8_peak() -> None:
    cfg = load_config(compose_cfg(["model=llama3-8b", "cluster=h100-ib", "cluster.nodes=1", "train.global_batch=64",
                                   "train.precision=fp8"]))
    assert problem_of(cfg).hw.linear_peak_tflops == 1979.0
    cfg = load_config(compose_cfg(["model=llama3-8b", "cluster=a100-80gb-ib", "cluster.nodes=1",
                                   "train.global_batch=64", "train.precision=fp8"]))
    with pytest.raises(ConfigError, match="train.precision"):
        problem_of(cfg)
