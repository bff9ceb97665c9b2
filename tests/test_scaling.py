"""Scaling laws: the fit (Hoffmann et al.'s Approach 3), the published law, the model shape for a size, the
points read from run directories, and ``xirang-plan target.*`` from a target to a launchable command."""

from __future__ import annotations

import dataclasses
import json
import math
import shlex
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import compose_cfg

from xirang_hpc.cli.plan import typed_config
from xirang_hpc.config.errors import ConfigError
from xirang_hpc.config.schema.target import deadline_seconds, parse_budget
from xirang_hpc.config.validate import check_runnable, load_config
from xirang_hpc.planner.formulas import model_params
from xirang_hpc.planner.scaling import (
    CHINCHILLA,
    FIT_FILE,
    Point,
    ScalingError,
    ScalingLaw,
    data_fingerprint,
    extrapolation,
    fit_range,
    load_fit,
    model_shape,
)
from xirang_hpc.planner.scaling_fit import HUBER_DELTA, _objective, check_points, fit, hoffmann_grid, lbfgs
from xirang_hpc.runs.scaling import sweep_runs
from xirang_hpc.submit.plan_target import (
    TargetError,
    fit_scaling,
    law_for,
    plan_target,
    sweep_commands,
    train_command,
)

TRUTH = ScalingLaw(E=1.8, A=300.0, B=800.0, alpha=0.35, beta=0.30)
SIZES = (1e6, 2e6, 4e6, 8e6, 16e6)
TOKENS = (2e7, 8e7, 3.2e8, 1.28e9)
# A coarse subset of Hoffmann et al.'s grid: a unit test's budget (the full grid runs in the benchmark).
COARSE = hoffmann_grid()[::37]


def synthetic(law: ScalingLaw = TRUTH, noise: float = 0.0, seed: int = 1) -> list[Point]:
    rng = np.random.default_rng(seed)
    return [Point(n, d, law.loss(n, d) * float(np.exp(rng.normal(0.0, noise))) if noise else law.loss(n, d))
            for n in SIZES for d in TOKENS]


# ---- the law ------------------------------------------------------------------------------------------

def test_compute_optimal_split_is_hoffmanns_closed_form_by_hand() -> None:
    # Hoffmann et al. eq. (4) with E=1.69, A=406.4, B=410.7, alpha=0.34, beta=0.28 at Gopher's 5.76e23 FLOPs:
    # G = (0.34*406.4 / (0.28*410.7))^(1/0.62) = 1.2016^1.6129 = 1.3447; N = G * (9.6e22)^(0.28/0.62).
    # (A fitted law splits so; the default carries Approach 1's split instead, below.)
    eq10 = dataclasses.replace(CHINCHILLA, tokens_per_param=0.0)
    g = (0.34 * 406.4 / (0.28 * 410.7)) ** (1 / 0.62)
    assert g == pytest.approx(1.3447, rel=1e-4)
    n, d = eq10.optimal(5.76e23)
    assert n == pytest.approx(g * 9.6e22 ** (0.28 / 0.62), rel=1e-12)
    assert n == pytest.approx(3.22e10, rel=2e-3) and 6 * n * d == pytest.approx(5.76e23)
    # The optimum: a small move of N along the same budget only raises the loss.
    for f in (0.9, 1.1):
        assert eq10.loss(n * f, 5.76e23 / (6 * n * f)) > eq10.loss(n, d)


# Hoffmann et al. 2022, Table 3 (Approach 1): (parameters, FLOPs, tokens).
TABLE3 = [(400e6, 1.92e19, 8.0e9), (1e9, 1.21e20, 20.2e9), (10e9, 1.23e22, 205.1e9), (67e9, 5.76e23, 1.5e12),
          (175e9, 3.85e24, 3.7e12), (280e9, 9.90e24, 5.9e12), (520e9, 3.43e25, 11.0e12), (1e12, 1.27e26, 21.2e12),
          (10e12, 1.30e28, 216.2e12)]


def test_default_split_is_chinchillas_and_reproduces_table_3() -> None:
    # Gopher's budget, 5.76e23 FLOPs, at 20 tokens per parameter: N = sqrt(5.76e23 / 120) = 6.93e10, D = 1.39e12
    # (Chinchilla: 70B on 1.4T tokens).
    n, d = CHINCHILLA.optimal(5.76e23)
    assert n == pytest.approx(math.sqrt(5.76e23 / 120), rel=1e-12) and n == pytest.approx(6.93e10, rel=1e-3)
    assert d == pytest.approx(20 * n) and 6 * n * d == pytest.approx(5.76e23)
    # Every Table 3 budget within 10% in parameters and tokens (the closed form of eq. (10) is 23-70% off).
    for params, flops, tokens in TABLE3:
        n, d = CHINCHILLA.optimal(flops)
        assert abs(n / params - 1) < 0.10 and abs(d / tokens - 1) < 0.10, (flops, n, d)
    eq10 = dataclasses.replace(CHINCHILLA, tokens_per_param=0.0)
    assert eq10.optimal(1.30e28)[0] / 10e12 - 1 < -0.6
    # The inverse for a token count, and the frontier's loss, follow the same split.
    n2, c2 = CHINCHILLA.optimal_for_tokens(d)
    assert n2 == pytest.approx(n) and c2 == pytest.approx(1.30e28)
    assert CHINCHILLA.optimal_loss(1e22) == pytest.approx(CHINCHILLA.loss(*CHINCHILLA.optimal(1e22)))


def test_compute_for_loss_and_tokens_invert_the_frontier() -> None:
    c = CHINCHILLA.compute_for_loss(2.0)
    assert CHINCHILLA.optimal_loss(c) == pytest.approx(2.0, rel=1e-8)
    n, d = CHINCHILLA.optimal(1e22)
    n2, c2 = CHINCHILLA.optimal_for_tokens(d)
    assert n2 == pytest.approx(n, rel=1e-9) and c2 == pytest.approx(1e22, rel=1e-9)


def test_target_loss_below_e_names_e_and_its_interval() -> None:
    with pytest.raises(ScalingError, match=r"E=1.69 .*set target.loss above 1.69"):
        CHINCHILLA.compute_for_loss(1.6)
    law = fit(synthetic(noise=0.003), bootstrap=30, starts=COARSE)
    lo, hi = law.interval("E")
    with pytest.raises(ScalingError) as err:
        law.compute_for_loss(law.E - 0.01)
    assert f"95% interval [{lo:.4g}, {hi:.4g}]" in str(err.value)


# ---- the fit ------------------------------------------------------------------------------------------

def test_batched_lbfgs_minimises_independent_rosenbrocks() -> None:
    def rosen(x: np.ndarray, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        a = rows[:, None] * 0.5 + 1.0  # problem r has its minimum at (a_r, a_r^2)
        f = ((a[:, 0] - x[:, 0]) ** 2 + 100 * (x[:, 1] - x[:, 0] ** 2) ** 2)
        g = np.stack([-2 * (a[:, 0] - x[:, 0]) - 400 * x[:, 0] * (x[:, 1] - x[:, 0] ** 2),
                      200 * (x[:, 1] - x[:, 0] ** 2)], axis=1)
        return f, g

    x, f = lbfgs(rosen, np.full((4, 2), -1.2))
    a = np.arange(4) * 0.5 + 1.0
    np.testing.assert_allclose(x[:, 0], a, rtol=1e-4)
    np.testing.assert_allclose(x[:, 1], a**2, rtol=1e-4)


def _torch_lbfgs(pts: list[Point], x0: np.ndarray) -> tuple[np.ndarray, float]:
    """torch.optim.LBFGS (strong Wolfe line search) on the same Huber objective: (x, f)."""
    ln, ld, ll = (torch.tensor(np.log([getattr(p, k) for p in pts])) for k in ("params", "tokens", "loss"))
    p = torch.tensor(x0, dtype=torch.float64, requires_grad=True)
    opt = torch.optim.LBFGS([p], max_iter=2000, tolerance_grad=1e-12, tolerance_change=1e-15,
                            line_search_fn="strong_wolfe")

    def closure() -> torch.Tensor:
        opt.zero_grad()
        pred = torch.logsumexp(torch.stack([p[0] - p[3] * ln, p[1] - p[4] * ld, p[2].expand_as(ln)]), dim=0)
        # torch's huber_loss is ours term by term: 0.5 r^2 within delta, delta (|r| - delta/2) beyond.
        loss = torch.nn.functional.huber_loss(pred, ll, delta=HUBER_DELTA, reduction="sum")
        loss.backward()
        return loss

    for _ in range(5):
        opt.step(closure)
    return p.detach().numpy(), float(closure().detach())


def _ours(pts: list[Point], x0: np.ndarray) -> tuple[np.ndarray, float]:
    ln, ld, ll = (np.log([getattr(p, k) for p in pts]) for k in ("params", "tokens", "loss"))
    x, f = lbfgs(lambda x, rows: _objective(x, ln, ld, ll, np.ones((len(rows), ln.size)), HUBER_DELTA), x0[None])
    return x[0], float(f[0])


def test_our_lbfgs_agrees_with_torchs_on_the_huber_objective() -> None:
    """The reference: torch.optim.LBFGS on the same objective from the same start."""
    x0 = np.array([5.0, 5.0, 0.0, 0.5, 0.5])
    ours, _ = _ours(synthetic(), x0)
    ref, _ = _torch_lbfgs(synthetic(), x0)
    truth = np.array([math.log(TRUTH.A), math.log(TRUTH.B), math.log(TRUTH.E), TRUTH.alpha, TRUTH.beta])
    np.testing.assert_allclose(ref, truth, atol=1e-4)  # the reference finds the law behind the points
    np.testing.assert_allclose(ours, truth, atol=1e-4)
    # On noisy points, from a poorer start, ours ends no higher than the reference.
    noisy, far = synthetic(noise=0.004), np.array([5.0, 5.0, 0.5, 0.5, 0.5])
    assert _ours(noisy, far)[1] <= _torch_lbfgs(noisy, far)[1] * (1 + 1e-6)


def _law(row: np.ndarray) -> tuple[float, ...]:
    a, b, e, al, be = (float(v) for v in row)
    return (math.exp(e), math.exp(a), math.exp(b), al, be)


def test_the_fit_does_not_depend_on_the_order_the_runs_were_found_in() -> None:
    pts = synthetic(noise=0.003)
    a = fit(pts, bootstrap=20, starts=COARSE, seed=3)
    b = fit(list(reversed(pts)), bootstrap=20, starts=COARSE, seed=3)
    assert (a.E, a.A, a.B, a.alpha, a.beta) == (b.E, b.A, b.B, b.alpha, b.beta) and a.samples == b.samples


def test_fit_recovers_a_known_law_and_its_interval_covers_the_truth() -> None:
    law = fit(synthetic(noise=0.003), bootstrap=40, starts=COARSE, seed=3)
    for name in ("alpha", "beta"):
        lo, hi = law.interval(name)
        assert lo < getattr(law, name) < hi, (name, lo, hi)
        assert getattr(law, name) == pytest.approx(getattr(TRUTH, name), rel=0.05)
    # The 4x extrapolation in size and tokens that the fit is for.
    n, d = 4 * SIZES[-1], 4 * TOKENS[-1]
    assert law.loss(n, d) == pytest.approx(TRUTH.loss(n, d), rel=0.01)
    noiseless = fit(synthetic(), bootstrap=0, starts=COARSE)
    assert noiseless.loss(n, d) == pytest.approx(TRUTH.loss(n, d), rel=1e-3)


def test_too_few_points_or_no_trend_is_refused_with_the_points() -> None:
    pts = synthetic()
    with pytest.raises(ScalingError, match=r"at least 8 finished runs .* got 5 run\(s\)") as err:
        check_points(pts[:5])
    assert "N=1e+06 D=2e+07" in str(err.value)
    rising = [Point(p.params, p.tokens, 3.0 + 0.1 * math.log(p.params)) for p in pts]
    with pytest.raises(ScalingError, match="does not decrease with model size"):
        fit(rising, bootstrap=0, starts=COARSE)


# ---- the model shape ----------------------------------------------------------------------------------

def test_model_shape_of_llama3_8b_size_is_llama3_8b() -> None:
    tpl = load_config(compose_cfg(["model=llama3-8b"])).model
    m = model_shape(model_params(tpl), tpl)
    assert (m.n_layer, m.d_model, m.n_head, m.n_kv_head, m.ffn_dim) == (32, 4096, 32, 8, 14336)
    big = model_shape(70e9, tpl)
    assert big.n_head % 8 == 0 and big.n_kv_head == 8 and abs(model_params(big) / 70e9 - 1) < 0.03
    tiny = load_config(compose_cfg()).model
    small = model_shape(4e5, tiny)
    assert small.mlp == tiny.mlp and small.vocab_size == tiny.vocab_size
    assert abs(model_params(small) / 4e5 - 1) < 0.15


# ---- config -------------------------------------------------------------------------------------------

def test_target_fields_parse_and_refuse_with_the_field() -> None:
    assert deadline_seconds("36h") == 36 * 3600 and deadline_seconds("2w") == 14 * 86400
    assert parse_budget("5000") == (5000.0, "gpu_hours") and parse_budget("$20000") == (20000.0, "money")
    assert parse_budget("20000usd") == (20000.0, "money") and parse_budget("800gpuh") == (800.0, "gpu_hours")
    for bad, field in ((["target.deadline=soon"], "target.deadline"), (["target.deadline=2001-01-01"],
                                                                        "target.deadline"),
                       (["target.budget=lots"], "target.budget"), (["target.loss=-1"], "target.loss"),
                       (["target.loss=2", "target.tokens=1e9"], "target.tokens"),
                       (["cluster.price_per_gpu_hour=-2"], "cluster.price_per_gpu_hour")):
        with pytest.raises(ConfigError) as err:
            typed_config(compose_cfg(bad))
        assert field in str(err.value), err.value


# ---- xirang-plan target.* -----------------------------------------------------------------------------

H100 = ["model=llama3-8b", "cluster=h100-ib", "cluster.nodes=64"]


def test_target_compute_plans_a_launchable_run() -> None:
    over = [*H100, "target.compute=1e22", "cluster.price_per_gpu_hour=2.5"]
    tp = plan_target(typed_config(compose_cfg(over)), over)
    assert tp.law.default
    n_opt, _ = CHINCHILLA.optimal(1e22)
    assert abs(tp.params / n_opt - 1) < 0.05 and tp.compute == pytest.approx(6 * tp.params * tp.tokens)
    e = tp.estimate
    assert tp.wall_s == pytest.approx(tp.steps * e.step_time)
    assert tp.gpu_hours == pytest.approx(tp.wall_s / 3600 * tp.nodes * 8)
    assert tp.cost == pytest.approx(2.5 * tp.gpu_hours)
    # The command, composed as xirang-train composes it, is the planned run and passes the runtime's checks.
    args = tp.command[1:]
    assert "target.compute=1e22" not in args and "model=llama3-8b" in args
    cfg = load_config(compose_cfg(args))
    check_runnable(cfg)
    assert model_params(cfg.model) == tp.params and cfg.cluster.nodes == tp.nodes
    assert (cfg.parallel.dp, cfg.parallel.tp, cfg.parallel.pp) == (e.plan.dp, e.plan.tp, e.plan.pp)
    assert cfg.train.max_steps * cfg.train.global_batch * cfg.model.seq_len == tp.tokens
    assert train_command(cfg, args) == tp.command  # the command reproduces itself
    assert "train.warmup_steps=" in " ".join(args)


def test_target_command_keeps_a_warmup_fraction_instead_of_a_fixed_warmup() -> None:
    over = [*H100, "target.compute=1e22", "train.warmup_frac=0.05"]
    tp = plan_target(typed_config(compose_cfg(over)), over)
    args = tp.command[1:]
    assert "train.warmup_frac=0.05" in args and not any(a.startswith("train.warmup_steps=") for a in args)
    cfg = load_config(compose_cfg(args))
    assert cfg.train.warmup == round(0.05 * cfg.train.max_steps)


@pytest.mark.slow  # three planner searches
def test_deadline_picks_fewer_nodes_or_says_how_many_more_it_needs() -> None:
    over = [*H100, "target.compute=1e22"]
    full = plan_target(typed_config(compose_cfg(over)))
    loose = plan_target(typed_config(compose_cfg([*over, f"target.deadline={full.wall_s * 8 / 3600:.0f}h"])))
    assert loose.nodes < 64 and loose.wall_s <= loose.deadline_s
    with pytest.raises(TargetError, match=r"the deadline binds: .* the deadline needs [0-9.]+x the nodes"):
        plan_target(typed_config(compose_cfg([*over, f"target.deadline={full.wall_s / 3 / 3600:.1f}h"])))


def test_budget_binds_and_money_needs_a_price() -> None:
    over = [*H100, "target.compute=1e22"]
    with pytest.raises(ConfigError, match="cluster.price_per_gpu_hour"):
        plan_target(typed_config(compose_cfg([*over, "target.budget=$1000"])))
    with pytest.raises(TargetError, match=r"the budget binds: .* it needs [0-9.]+x the budget.*predicted loss"):
        plan_target(typed_config(compose_cfg([*over, "target.budget=100"])))


# ---- --fit-scaling on synthetic runs ------------------------------------------------------------------

def _fake_run(root: Path, name: str, n_layer: int, d_model: int, steps: int, loss: float | None,
              error: str = "") -> Path:
    """A finished (or failed) run directory as the trainer leaves it: config.json and metrics.jsonl."""
    d = root / f"scaling-{name}-{n_layer}x{d_model}-{steps}"
    d.mkdir(parents=True)
    model = {"name": name, "n_layer": n_layer, "n_head": 2, "d_model": d_model, "vocab_size": 256, "seq_len": 64}
    (d / "config.json").write_text(json.dumps({"config": {"model": model, "train": {
        "name": "scaling", "max_steps": steps, "global_batch": 32, "extend_to": 0}}}))
    rows = [{"step": 0, "val_loss": 5.5}] + ([{"step": steps, "val_loss": loss}] if loss is not None else [])
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    if error:
        (d / "submitit").mkdir()
        (d / "submitit" / "7_0_log.err").write_text(f"Traceback (most recent call last):\n{error}\n")
    return d


def _sweep(root: Path) -> list[Path]:
    out = []
    for n_layer, d_model in ((2, 32), (2, 64), (4, 64), (4, 128)):
        for steps in (100, 300, 1000):
            from xirang_hpc.config.schema import ModelConfig

            m = ModelConfig(name="s", n_layer=n_layer, n_head=2, d_model=d_model, vocab_size=256, seq_len=64)
            loss = TRUTH.loss(model_params(m), steps * 32 * 64)
            out.append(_fake_run(root, "s", n_layer, d_model, steps, loss))
    return out


def _data(tmp_path: Path) -> Path:
    data = tmp_path / "data"
    data.mkdir()
    (data / "index.json").write_text(json.dumps({"tokenizer": {"name": "byte"},
                                                 "train": [{"file": "train_0.h5", "sha256": "ab"}],
                                                 "val": [{"file": "val_0.h5", "sha256": "cd"}]}))
    return data


def test_sweep_runs_read_points_and_list_failures(tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    _sweep(runs)
    got = sweep_runs(runs, "scaling")
    assert len(got.points) == 12 and not got.failed and not got.unfinished
    p = min(got.points, key=lambda p: (p.params, p.tokens))
    assert p.tokens == 100 * 32 * 64 and p.loss == pytest.approx(TRUTH.loss(p.params, p.tokens))
    _fake_run(runs, "s", 6, 64, 50, None, error="RuntimeError: CUDA out of memory")
    _fake_run(runs, "s", 6, 96, 50, None)
    got = sweep_runs(runs, "scaling")
    assert [c for _, c in got.failed] == ["RuntimeError: CUDA out of memory"]
    assert len(got.unfinished) == 1 and "no validation loss at its last step 50" in got.unfinished[0]


@pytest.mark.slow  # a full-grid fit
def test_fit_scaling_stores_the_fit_beside_the_data_and_target_plans_use_it(tmp_path: Path) -> None:
    runs, data = tmp_path / "runs", _data(tmp_path)
    over = [f"train.runs_root={runs}", f"data.out_dir={data}"]
    cfg = typed_config(compose_cfg(over))
    report, code = fit_scaling(cfg, over)
    assert code == 0 and "no finished runs" in report and report.count("xirang-train -m train.name=scaling") == 4
    _sweep(runs)
    report, code = fit_scaling(cfg, over, bootstrap=20)
    assert code == 0 and str(data / FIT_FILE) in report
    law, points = load_fit(data / FIT_FILE, data_fingerprint(json.loads((data / "index.json").read_text())))
    assert len(points) == 12 and not law.default and law.interval("E") is not None
    assert law.loss(4e5, 4e7) == pytest.approx(TRUTH.loss(4e5, 4e7), rel=0.02)
    used, note, span = law_for(cfg)
    assert used == law and "fitted on 12 runs" in note and span == fit_range(points)
    # A plan beyond the fitted sizes says how far it extrapolates.
    hi = max(p.params for p in points)
    assert extrapolation(span, hi, 1e6) is None
    far = extrapolation(span, 4 * hi, 1e6)
    assert far is not None and far.startswith(f"extrapolated: {4 * hi:.3g} parameters is 4x above the fit's runs")
    assert "tokens" not in far.partition(".")[0]
    # Other data (another shard checksum): the fit is refused, not silently applied.
    (data / "index.json").write_text(json.dumps({"tokenizer": {"name": "byte"},
                                                 "train": [{"file": "train_0.h5", "sha256": "ff"}]}))
    with pytest.raises(ScalingError, match="fitted on other data"):
        law_for(cfg)


def test_fit_scaling_refuses_a_sweep_with_failed_runs(tmp_path: Path) -> None:
    runs, data = tmp_path / "runs", _data(tmp_path)
    _sweep(runs)
    bad = _fake_run(runs, "s", 6, 64, 50, None, error="ValueError: bad shard")
    over = [f"train.runs_root={runs}", f"data.out_dir={data}"]
    with pytest.raises(ScalingError, match=r"1 run\(s\) of the sweep 'scaling' .* failed") as err:
        fit_scaling(typed_config(compose_cfg(over)), over)
    assert f"{bad}: ValueError: bad shard" in str(err.value)


def test_sweep_commands_compose_and_cover_the_isoflop_grid() -> None:
    cmds = sweep_commands(typed_config(compose_cfg()), [], budgets=(1e12, 3e12), sizes=(1e5, 4e5))
    assert len(cmds) == 2
    for c in cmds:
        args = [a for a in c[2:] if not a.startswith("train.max_steps=")]
        steps = next(a for a in c if a.startswith("train.max_steps=")).partition("=")[2].split(",")
        assert len(steps) == 2
        cfg = load_config(compose_cfg([*args, f"train.max_steps={steps[0]}"]))
        d = int(steps[1]) * cfg.train.global_batch * cfg.model.seq_len
        assert 6 * model_params(cfg.model) * d == pytest.approx(3e12, rel=0.05)
        for s in steps:  # every run warms up over a fifth of its own steps
            assert load_config(compose_cfg([*args, f"train.max_steps={s}"])).train.warmup == round(0.2 * int(s))
    assert shlex.join(cmds[0]).startswith("xirang-train -m train.name=scaling ")
    # A fixed warm-up the user gave is left out (it would be a different share of each run); a fraction is kept.
    own = sweep_commands(typed_config(compose_cfg()), ["train.warmup_steps=50"], budgets=(1e12,), sizes=(1e5,))[0]
    assert "train.warmup_frac=0.2" in own and not any(a.startswith("train.warmup_steps") for a in own)
    own = sweep_commands(typed_config(compose_cfg()), ["train.warmup_frac=0.1"], budgets=(1e12,), sizes=(1e5,))[0]
    assert [a for a in own if a.startswith("train.warmup_frac")] == ["train.warmup_frac=0.1"]


# ---- the docs' commands, as written -------------------------------------------------------------------

def _doc_commands() -> list[tuple[str, int]]:
    """(command, expected exit status) of each line of the bash block under "## Plan from a target"."""
    import re

    text = (Path(__file__).resolve().parents[1] / "docs" / "parallel-and-planning.md").read_text()
    block = re.search(r"```bash\n(.*?)```", text.split("## Plan from a target", 1)[1], flags=re.S)
    assert block, "no bash block under 'Plan from a target'"
    out = []
    for line in block.group(1).strip().splitlines():
        cmd, _, comment = line.partition("   #")
        out.append((cmd.strip(), 2 if "exit 2" in comment else 0))
    return out


@pytest.mark.slow  # six xirang-plan processes
def test_docs_plan_from_a_target_commands_run_as_written(tmp_path: Path) -> None:
    import os
    import subprocess
    import sys

    cmds = _doc_commands()
    assert len(cmds) == 6 and all(c.startswith("xirang-plan ") for c, _ in cmds)
    bin_dir = Path(sys.executable).parent
    for cmd, code in cmds:
        argv = shlex.split(cmd)
        r = subprocess.run([str(bin_dir / argv[0]), *argv[1:]], cwd=tmp_path, capture_output=True, text=True,
                           timeout=600, env=dict(os.environ))
        assert r.returncode == code, (cmd, r.stdout[-2000:], r.stderr[-2000:])
        if code == 2:
            assert "the budget binds" in r.stderr and "x the budget" in r.stderr, r.stderr
            continue
        if "--fit-scaling" in argv:
            assert "xirang-train -m train.name=scaling" in r.stdout
            continue
        if "--json" in argv:
            out = json.loads(r.stdout)
            assert out["tokens"] >= 2e11 and out["command"].startswith("xirang-train ")
            launch = out["command"]
        else:
            assert "using the published law of Hoffmann et al. 2022" in r.stderr
            launch = next(ln for ln in r.stdout.splitlines() if ln.startswith("launch ")).split(None, 1)[1]
            if "cluster.price_per_gpu_hour=2.5" in argv:
                assert "at the cluster's price" in r.stdout
        args = shlex.split(launch)[1:]
        check_runnable(load_config(compose_cfg(args)))  # the printed command is one xirang-train launches


@pytest.mark.slow  # a few planner searches
def test_a_deadline_alone_plans_the_most_compute_it_allows() -> None:
    tp = plan_target(typed_config(compose_cfg([*H100, "target.deadline=14d"])))
    assert "deadline-optimal" in tp.ask and tp.nodes == 64
    # Within the deadline, and not far under it: the budget was fitted to the deadline.
    assert 0.8 * 14 * 86400 <= tp.wall_s <= 14 * 86400
    with pytest.raises(ConfigError, match="say how much to train"):
        plan_target(typed_config(compose_cfg([*H100, "target.budget=5000"])))


def test_a_resample_whose_coefficients_overflow_is_left_out_not_a_crash() -> None:
    """A bootstrap resample of a real sweep ran its log-coefficients past exp's range (OverflowError, a traceback
    from xirang-plan --fit-scaling): such a resample is no law and is dropped; finite ones are kept."""
    from xirang_hpc.planner.scaling_fit import _finite_law

    assert _finite_law(np.array([800.0, 5.0, 0.5, 0.3, 0.3])) is None
    assert _finite_law(np.array([5.0, np.nan, 0.5, 0.3, 0.3])) is None
    e, a, b, alpha, beta = _finite_law(np.array([5.0, 6.0, 0.5, 0.3, 0.35]))
    assert (a, b, e, alpha, beta) == pytest.approx((np.exp(5.0), np.exp(6.0), np.exp(0.5), 0.3, 0.35))
    # A refit with a large exponent (seen: alpha 34) predicts a finite loss at a large model, no OverflowError
    # (3.67e6 ** 60 is beyond a float).
    steep = ScalingLaw(E=1.0, A=1e7, B=20.0, alpha=60.0, beta=0.18)
    assert steep.loss(3.67e6, 5.8e5) == pytest.approx(1.0 + 20.0 * 5.8e5 ** -0.18)


# The default sweep's 12 runs on the embedded corpus (byte tokens, 4 ranks each, warm-up 20% of each run's steps), as
# trained on the development VM, and a model 4.2x the largest of them trained for real at the largest's token count:
# the loss falls with tokens but barely with size at a fixed token count, so the five coefficients are not determined.
REAL_SWEEP = [(112560, 444416, 2.4620), (112560, 1480704, 1.9970), (112560, 4442112, 1.5919),
              (201920, 247808, 2.5445), (201920, 825344, 2.0690), (201920, 2476032, 1.6432),
              (391008, 126976, 2.7810), (391008, 425984, 2.3015), (391008, 1277952, 1.8373),
              (867072, 57344, 3.0849), (867072, 192512, 2.5647), (867072, 577536, 2.1065)]
REAL_HELDOUT = (3669888, 577536, 2.0604)


@pytest.mark.slow
def test_a_real_sweep_that_does_not_determine_five_coefficients_is_fitted_with_one_exponent() -> None:
    """Free, the fit is refused with the points: its size exponent spans about a factor 11 over its bootstrap refits
    (alpha's interval [0.434, 4.79] on the VM the sweep was trained on), or, where the CPU's floating point takes
    the L-BFGS refits elsewhere (seen on another VM, and with the losses to more digits), half of them run off
    beyond a float; either way the runs do not determine the law. By default it is refitted with alpha = beta,
    says so, and predicts the 4.2x larger model within 3% with an interval that covers it."""
    pts = [Point(n, d, loss) for n, d, loss in REAL_SWEEP]
    with pytest.raises(ScalingError, match=r"(alpha's 95% bootstrap interval \[[0-9.]+, [0-9.]+\] spans more than a "
                       r"factor 3|of 200 bootstrap refits ran off to coefficients beyond a float): the runs do not "
                       r"determine the law") as err:
        fit(pts, bootstrap=200, exponents="free")
    assert "N=8.671e+05 D=5.775e+05 loss=2.1065" in str(err.value)
    law = fit(pts, bootstrap=200)
    assert law.tied and law.alpha == law.beta and len(law.samples) == 200
    assert "alpha=beta=" in law.describe() and "one exponent for both terms" in law.describe()
    n, d, measured = REAL_HELDOUT
    assert law.loss(n, d) == pytest.approx(measured, rel=0.03)
    lo, hi = law.spread(lambda lw: lw.loss(n, d))
    assert lo < measured < hi
    # The stored law keeps the tie (a planner reading it back describes the same law).
    assert ScalingLaw.from_dict(json.loads(json.dumps(law.to_dict()))) == law


def test_a_tied_fit_recovers_a_law_with_one_exponent_and_a_free_fit_stays_free() -> None:
    truth = ScalingLaw(E=1.8, A=300.0, B=900.0, alpha=0.32, beta=0.32)
    law = fit(synthetic(truth, noise=0.002), bootstrap=20, starts=COARSE, seed=3, exponents="tied")
    assert law.tied and law.alpha == law.beta == pytest.approx(0.32, rel=0.05)
    n, d = 4 * SIZES[-1], 4 * TOKENS[-1]
    assert law.loss(n, d) == pytest.approx(truth.loss(n, d), rel=0.01)
    assert not fit(synthetic(noise=0.003), bootstrap=20, starts=COARSE, seed=3).tied  # determined: not tied
    with pytest.raises(ValueError, match="exponents='both': choose auto, free or tied"):
        fit(synthetic(), exponents="both")
