"""xirang-plan end to end, parallel=auto at launch, and calibration on the local virtual cluster."""

from __future__ import annotations

import json
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import compose_cfg

from xirang_hpc.cli import plan as plan_cli
from xirang_hpc.config.errors import ConfigError
from xirang_hpc.config.validate import check_runnable, load_config, validate
from xirang_hpc.planner.auto import PLAN_FILE, apply_plan, plan_for, runtime_allows
from xirang_hpc.planner.cost import Plan
from xirang_hpc.submit.autoplan import plan_at_launch, record_measured

EXE = Path(sys.executable).parent / "xirang-plan"


def _plan_cli(args: list[str], cwd: Path, timeout_s: float = 600) -> subprocess.CompletedProcess:
    # A safety net against a hang, not a speed requirement: a busy shared box may be many times slower.
    return subprocess.run([str(EXE), *args], cwd=cwd, capture_output=True, text=True, timeout=timeout_s)


def test_plan_cli_json_for_gpt175b(tmp_path: Path) -> None:
    r = _plan_cli(["--json", "--top", "3", "model=gpt-175b", "cluster=a100-80gb-ib", "cluster.nodes=128",
                   "train.global_batch=1536"], tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout)
    assert out["problem"]["hardware"] == "a100-80gb" and out["problem"]["nodes"] == 128
    best, runner = out["plans"][0], out["plans"][1]
    assert best["fits"] and best["lost_because"] is None and runner["lost_because"]
    p = best["plan"]
    assert p["dp"] * p["tp"] * p["pp"] == 1024
    assert p["dp"] * p["micro_batch"] * p["microbatches"] == 1536
    assert set(best["memory_gib"]) == {"params", "grads", "optimizer", "activations", "buffers", "total"}
    assert set(best["time_s"]) >= {"compute", "tp_comm", "bubble", "p2p", "dp_comm", "total"}
    assert best["memory_gib"]["total"] <= 80
    assert best["tokens_per_s"] >= runner["tokens_per_s"]
    # The search time is reported; how fast it is lives in benchmarks/bench_planner.py, not in a test.
    assert isinstance(out["search_seconds"], float) and out["search_seconds"] >= 0


def test_plan_cli_text_and_bad_hardware_key(tmp_path: Path) -> None:
    r = _plan_cli(["model=gpt-7b", "cluster=h100-ib", "train.global_batch=256"], tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "-- recommended" in r.stdout and "memory/rank" in r.stdout and "exposed DP comm" in r.stdout
    assert "lost:" in r.stdout
    r = _plan_cli(["model=tiny", "+cluster.hardware.bogus=1"], tmp_path)
    assert r.returncode == 2
    assert "cluster.hardware.bogus" in r.stderr and "unknown field" in r.stderr


def test_calibrate_rounds_must_be_positive_and_go_with_calibrate(tmp_path: Path) -> None:
    r = _plan_cli(["--calibrate", "--rounds", "0", "cluster=local"], tmp_path)
    assert r.returncode == 2 and "argument --rounds: must be a whole number >= 1, got '0'" in r.stderr, r.stderr
    r = _plan_cli(["--rounds", "2", "model=tiny"], tmp_path)
    assert r.returncode == 2 and "--rounds applies to --calibrate only" in r.stderr, r.stderr
    assert not list(tmp_path.iterdir()), "nothing written"


def test_runtime_allows_only_expressible_runnable_plans() -> None:
    cfg = load_config(compose_cfg())
    ok = runtime_allows(cfg)
    assert ok(Plan(dp=4, tp=1, pp=1, micro=8))
    assert ok(Plan(dp=2, tp=1, pp=2, micro=4, v=2))  # interleaved 1F1B, 2 chunks per rank (tiny: 4 layers)
    assert not ok(Plan(dp=1, tp=1, pp=4, micro=4, v=2))  # 8 chunks > 4 layers: validate refuses
    assert not ok(Plan(dp=4, tp=1, pp=1, micro=8, v=2))  # interleaving without a pipeline
    assert ok(Plan(dp=4, tp=1, pp=1, micro=8, zero=2))  # parallel.zero=2
    assert ok(Plan(dp=2, tp=1, pp=2, micro=4, zero=1)) and ok(Plan(dp=2, tp=1, pp=2, micro=4, zero=3))
    assert not ok(Plan(dp=1, tp=4, pp=1, micro=8))  # tp across the 2 virtual nodes: validate refuses


def test_every_ranked_plan_runs_and_zero_stages_compose_with_tp_and_pp() -> None:
    """What xirang-plan ranks passes the runtime's own checks, and the ranking is not narrowed to
    ZeRO-0/3: ZeRO-1 and ZeRO-2 appear with tensor and pipeline parallelism too."""
    cfg = compose_cfg(["model.n_head=4", "model.n_kv_head=2", "cluster.nodes=2", "cluster.tasks_per_node=4",
                       "train.global_batch=32"])
    typed = plan_cli.typed_config(cfg)
    res = plan_for(typed)
    assert len(res.ranked) > 20
    for e in res.ranked:
        new = validate(apply_plan(typed, e.plan))
        check_runnable(new)
        assert new.parallel.zero == e.plan.zero
        assert new.parallel.data_parallel == ("fsdp" if e.plan.zero >= 2 else "ddp")
    kinds = {(e.plan.zero, e.plan.tp > 1, e.plan.pp > 1) for e in res.ranked}
    assert {(1, True, False), (1, False, True), (2, True, False), (2, False, True), (3, False, True)} <= kinds


def test_a_config_error_no_layout_cures_names_its_field() -> None:
    typed = plan_cli.typed_config(compose_cfg(["train.warmup_steps=500", "train.max_steps=100"]))
    with pytest.raises(ConfigError, match="train.warmup_steps"):
        plan_for(typed)


def test_apply_plan_maps_interleaving_to_the_schedule() -> None:
    cfg = load_config(compose_cfg())
    new = validate(apply_plan(cfg, Plan(dp=2, tp=1, pp=2, micro=4, v=2)))
    p = new.parallel
    assert (p.schedule, p.virtual_stages, p.microbatches, new.train.grad_accum) == ("interleaved", 2, 4, 1)
    assert validate(apply_plan(cfg, Plan(dp=2, tp=1, pp=2, micro=4))).parallel.schedule == "1f1b"


def test_parallel_auto_fills_layout_and_records(tmp_path: Path) -> None:
    cfg = load_config(compose_cfg(["parallel=auto", f"train.runs_root={tmp_path}"]))
    assert cfg.parallel.auto
    said: list[str] = []
    new = plan_at_launch(cfg, said.append)
    check_runnable(new)  # what the planner picked, this build runs
    assert said and said[0].startswith("parallel=auto chose dp=")
    runs = list(tmp_path.iterdir())
    assert len(runs) == 1
    path = runs[0] / PLAN_FILE
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    rec = json.loads(path.read_text())
    p = rec["predicted"]["plan"]
    assert (new.parallel.dp, new.parallel.tp, new.parallel.pp) == (p["dp"], p["tp"], p["pp"])
    assert new.parallel.dp * new.parallel.tp * new.parallel.pp == 4
    assert rec["hardware"]["name"] == "cpu"
    record_measured(new, {"tokens_per_s": rec["predicted"]["tokens_per_s"] / 2}, said.append)
    rec = json.loads(path.read_text())
    assert rec["measured"]["predicted_over_measured"] == pytest.approx(2.0)
    assert "prediction +100%" in said[-1]
    # Without parallel=auto nothing is planned or recorded.
    plain = load_config(compose_cfg([f"train.runs_root={tmp_path}"]))
    assert plan_at_launch(plain) is plain


def test_plan_reads_the_model_of_model_init_from(tmp_path) -> None:
    """``xirang-plan model.init_from=<Hugging Face dir>`` plans the model in that directory (its own config
    conversion skipped the Hugging Face step and planned the preset's shape instead)."""
    import transformers

    hf = transformers.LlamaConfig(hidden_size=96, intermediate_size=160, num_hidden_layers=3, num_attention_heads=6,
                                  num_key_value_heads=2, vocab_size=320, max_position_embeddings=64)
    transformers.LlamaForCausalLM(hf).save_pretrained(tmp_path / "llama")
    from conftest import CONF_DIR
    from hydra import compose, initialize_config_dir

    from xirang_hpc.submit.hydra_setup import register_configs

    register_configs()
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):  # as the command line composes it
        dcfg = compose(config_name="config", overrides=[f"model.init_from={tmp_path / 'llama'}"],
                       return_hydra_config=True)
    typed = plan_cli.typed_config(dcfg)
    m = typed.model
    assert (m.d_model, m.n_layer, m.n_head, m.n_kv_head, m.vocab_size) == (96, 3, 6, 2, 320)
    # The plan is made for that shape: the problem the search ranks layouts for is the Hugging Face model's, and
    # the typed config is the one xirang-train's loader builds from the same composition (to_typed, then validate).
    from xirang_hpc.config.validate import to_typed
    from xirang_hpc.planner.auto import plan_for

    sh = plan_for(typed).problem.shape
    assert (sh.hidden, sh.layers, sh.heads, sh.n_kv, sh.vocab, sh.ffn, sh.swiglu, sh.tied) == (
        96, 3, 6, 2, 320, 160, True, False)
    assert to_typed(dcfg).model == typed.model
