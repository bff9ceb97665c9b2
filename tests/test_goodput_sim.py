"""The goodput simulator: hand-computed single-failure timelines, Llama 3 405B's published setting, Daly's
interval against the simulated optimum, spares, and bad input refused by name."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from conftest import compose_cfg

from xirang_hpc.cli import plan as plan_cli
from xirang_hpc.config.errors import ConfigError
from xirang_hpc.config.validate import to_typed
from xirang_hpc.planner.formulas import model_params
from xirang_hpc.planner.goodput_replay import Replay, replay
from xirang_hpc.planner.goodput_report import render
from xirang_hpc.planner.goodput_sim import (
    BUCKETS,
    DAY_S,
    LLAMA3_COUNTS,
    POLICIES,
    CheckpointCosts,
    FailureModel,
    RecoveryCosts,
    Scenario,
    draw_trace,
    fixed_trace,
    llama3_405b,
    recommend,
    scan_intervals,
    simulate,
    summarize,
)

H = 1000.0  # seconds of wall time in the hand-computed cases

# Round costs so each timeline below can be followed by hand: queue 40 s before the first start, start-up
# 10 s, a checkpoint every 100 s of compute with a 1 s stall, durable 2 s later, loaded in 3 s.
COSTS = RecoveryCosts(startup_s=10, requeue_recovery_s=20, requeue_hold_s=30, queue_wait_s=40, injob_recovery_s=5,
                      memory_restore_s=1)
CKPT = CheckpointCosts(snapshot_s=1, write_s=2, load_s=3)


def _hand(nodes: int = 1, spares: int = 1) -> Scenario:
    return Scenario(nodes=nodes, gpus_per_node=1, days=H / DAY_S, failures=FailureModel.llama3(), costs=COSTS,
                    checkpoint=CKPT, interval_s=100, memory_every_s=10, spares=spares, seeds=1)


def _buckets(sc: Scenario, policy: str, events: list[tuple[float, str]]) -> dict[str, float]:
    """Seconds per bucket; ``shrunk`` only where the allocation shrank."""
    res = simulate(sc, policy, fixed_trace(events, H))
    out = {k: float(res[k][0, 0]) for k in BUCKETS}
    assert sum(out.values()) == pytest.approx(H)  # every second in exactly one bucket
    if out["shrunk"] == 0:
        del out["shrunk"]
    return out


def test_no_failure_is_queue_startup_compute_and_stalls() -> None:
    # Queue 0-40, start-up 40-50, then 950 s of 101-s cycles: 9 full (909 s), 41 s of compute left.
    b = _buckets(_hand(spares=0), "requeue", [])
    assert b == pytest.approx(dict(productive=941, lost=0, recovery=0, startup=10, stall=9, queue=40, spares=0))
    # An interruption while the job waits in the queue hits no node of it.
    assert _buckets(_hand(spares=0), "requeue", [(20.0, "hardware")]) == pytest.approx(b)


def test_one_hardware_failure_under_requeue_by_hand() -> None:
    # Training from t=50; the failure at 300 s is 250 s in: 2 cycles of 101 s (202 s) + 48 s computed.
    # Checkpoint i ends its stall 101*i s in and is durable 2 s later (103, 204; the third would be at
    # 305): 200 s kept, the 48 s computed since are lost.
    # Then recovery 20 (300-320), hold + queue 70 (320-390), start-up + load 13 (390-403), 597 s of
    # training: 5 cycles (505 s) + 92 s = 592 s of compute, 5 stalls.
    b = _buckets(_hand(spares=0), "requeue", [(300.0, "hardware")])
    assert b == pytest.approx(dict(productive=792, lost=48, recovery=20, startup=23, stall=7, queue=110, spares=0))


def test_in_job_restart_on_a_spare_by_hand() -> None:
    # Same failure, replaced by the spare inside the allocation: recovery 5 + load 3 (300-308), then 692 s:
    # 6 cycles (606 s) + 86 s = 686 s of compute. One spare beside 4 nodes idles 1/5 of the GPU time, and
    # every other bucket is 4/5 of its seconds.
    b = _buckets(_hand(nodes=4, spares=1), "in-job", [(300.0, "hardware")])
    seconds = dict(productive=200 + 686, lost=48, recovery=8, startup=10, stall=8, queue=40)
    assert b == pytest.approx({**{k: v * 0.8 for k, v in seconds.items()}, "spares": 200})
    # No spare left: the lost node means a requeue, as under the requeue policy.
    assert _buckets(_hand(spares=0), "in-job", [(300.0, "hardware")]) == \
        pytest.approx(_buckets(_hand(spares=0), "requeue", [(300.0, "hardware")]))
    # A software fault needs no spare: restarted in place.
    sw = _buckets(_hand(spares=0), "in-job", [(300.0, "software")])
    assert sw == pytest.approx(seconds | {"spares": 0})


def test_lost_node_without_spare_shrinks_by_hand() -> None:
    # 4 nodes, no spare, a replica of 1 node: after the failure at 300 s the restart (8 s) goes on with 3
    # nodes, so the 686 s computed after it train 3/4 as fast; the other 1/4 is the shrunk bucket.
    sc = replace(_hand(nodes=4, spares=0), shrink_nodes=1, min_nodes=3)
    b = _buckets(sc, "in-job", [(300.0, "hardware")])
    assert b == pytest.approx(dict(productive=200 + 686 * 0.75, lost=48, recovery=8, startup=10, stall=8, queue=40,
                                   shrunk=686 * 0.25, spares=0))
    # A second loss would leave 2 nodes, below min_nodes: a requeue, whose new allocation is whole again.
    two = _buckets(sc, "in-job", [(300.0, "hardware"), (600.0, "hardware")])
    assert two["shrunk"] == pytest.approx((600 - 308 - 2) * 0.25)  # 2 of the 292 s were stalls
    assert two["queue"] == 40 + 70


def test_in_job_restart_from_memory_by_hand() -> None:
    # A copy every 10 s of compute (1 s stall, 11-s cycles), complete one interval later; every 10th is also
    # written. 250 s in: 22 cycles (242 s) + 8 s = 228 s computed; the newest complete copy is cycle 21
    # (21*11 + 10 = 241 <= 250): 210 s kept, 18 s lost. Restore 5 + 1 (300-306), then 694 s: 63 cycles
    # (693 s) + 1 s = 631 s computed.
    b = _buckets(_hand(spares=1, nodes=1), "in-job+memory", [(300.0, "network")])
    seconds = dict(productive=210 + 631, lost=18, recovery=6, startup=10, stall=22 + 63, queue=40)
    assert b == pytest.approx({**{k: v / 2 for k, v in seconds.items()}, "spares": 500})


def test_planned_interruption_saves_first_then_requeues() -> None:
    # The signal's save (snapshot 1 + write 2, 300-303) keeps all 248 s computed; requeue 20, hold + queue
    # 70, start-up + load 13, then 594 s: 5 cycles + 89 s = 589 s of compute.
    b = _buckets(_hand(spares=1, nodes=1), "in-job", [(300.0, "planned")])
    seconds = dict(productive=248 + 589, lost=0, recovery=20, startup=23, stall=2 + 3 + 5, queue=110)
    assert b == pytest.approx({**{k: v / 2 for k, v in seconds.items()}, "spares": 500})


def test_failure_during_startup_starts_it_again() -> None:
    # Start-up 40-50 is hit at 45: 5 s of it paid, nothing computed; requeued: recovery 20, queue 70,
    # start-up + load 13, training from 148: 852 s = 8 cycles + 44 s.
    b = _buckets(_hand(spares=0), "requeue", [(45.0, "software")])
    assert b == pytest.approx(dict(productive=844, lost=0, recovery=20, startup=18, stall=8, queue=110, spares=0))


def test_seeded_and_reproducible() -> None:
    sc = replace(llama3_405b(seeds=4), days=5.0)
    a, b = simulate(sc, "in-job", draw_trace(sc)), simulate(sc, "in-job", draw_trace(sc))
    assert np.array_equal(a["goodput"], b["goodput"])
    c = simulate(sc, "in-job", draw_trace(replace(sc, seed=1)))
    assert not np.array_equal(a["goodput"], c["goodput"])


def test_llama3_405b_published_setting_is_above_90_percent() -> None:
    """466 interruptions in 54 days on 16,384 GPUs with the costs derived in ``llama3_405b``: every policy
    above the published >90% effective training time; the interruption count matches the paper's."""
    sc = llama3_405b(seeds=16)
    assert sc.gpus == 16384 and sc.days == 54
    assert sc.checkpoint.bytes_total == 12 * model_params(to_typed(compose_cfg(["model=llama3-405b"])).model)
    trace = draw_trace(sc)
    by = {}
    for p in POLICIES:
        res = simulate(sc, p, trace, np.array([sc.daly_s(p)]), np.array([0 if p == "requeue" else 8]))
        by[p] = r = summarize(sc, p, res, 0, sc.daly_s(p), 8)
        assert r.goodput_pct - r.ci_pct > 90.0, r
        assert r.interruptions == pytest.approx(sum(LLAMA3_COUNTS.values()), rel=0.05)
    assert by["in-job"].goodput_pct > by["requeue"].goodput_pct  # no Slurm cycle, no new allocation
    # The published figure bounds the cost: at 30 minutes per restart the requeue policy falls below 90%.
    slow = replace(sc, costs=replace(sc.costs, requeue_recovery_s=900.0, startup_s=900.0))
    r = simulate(slow, "requeue", draw_trace(slow))
    assert r["goodput"].mean() < 0.90


def test_daly_interval_is_in_the_scanned_optimums_flat_region() -> None:
    sc = replace(llama3_405b(seeds=16), days=20.0)
    trace = draw_trace(sc)
    for policy in ("requeue", "in-job"):
        scan = scan_intervals(sc, policy, trace)
        lo, hi = scan.flat_s
        assert lo <= scan.daly_s <= hi, scan
        # ... and the scan is not flat everywhere: a 4x longer or shorter interval is measurably worse.
        assert scan.goodput_pct[0] < max(scan.goodput_pct) - scan.tolerance_pct
        assert scan.goodput_pct[-1] < max(scan.goodput_pct) - scan.tolerance_pct


def test_spares_pay_when_nodes_fail_often() -> None:
    sc = replace(llama3_405b(seeds=8), days=10.0)
    trace = draw_trace(sc)
    res = simulate(sc, "in-job", trace, np.full(3, sc.interval_s), np.array([0, 4, 512]))
    g = res["goodput"].mean(axis=1)
    assert g[1] > g[0]  # a few spares turn requeues into in-job restarts
    assert g[2] < g[1]  # a quarter of the nodes idle costs more than it saves
    assert res["requeues"][1].mean() < res["requeues"][0].mean()


def test_bad_input_is_refused_by_name() -> None:
    with pytest.raises(ConfigError, match="goodput.hardware_per_node_day"):
        FailureModel(0.0, 0.0, 0.0, 0.0)
    with pytest.raises(ConfigError, match="goodput.network_per_node_day"):
        FailureModel(0.01, -1.0, 0.0, 0.0)
    with pytest.raises(ConfigError, match="goodput.requeue_hold_s"):
        RecoveryCosts(requeue_hold_s=-5)
    with pytest.raises(ConfigError, match="goodput.load_s"):
        CheckpointCosts(snapshot_s=1, write_s=1, load_s=-1)
    with pytest.raises(ConfigError, match="goodput.days"):
        replace(_hand(), days=0)
    with pytest.raises(ConfigError, match="goodput.trace"):
        fixed_trace([(1.0, "cosmic-ray")], H)


def test_plan_cli_goodput_from_the_config() -> None:
    """``xirang-plan --goodput``'s inputs come from the composed config, goodput.* overrides them, and
    unknown or bad ones are refused by name."""
    cfg = to_typed(compose_cfg(["model=llama3-405b", "cluster=h100-ib", "cluster.nodes=2048", "train.global_batch=2048",
                                "requeue.start_now=true", "cluster.spare_nodes=2"]))
    sc, step = plan_cli.goodput_inputs(cfg, {"days": "3", "seeds": "4", "step_s": "8", "queue_wait_s": "60"})
    assert (sc.gpus, sc.days, sc.seeds, sc.spares, step) == (16384, 3.0, 4, 2, 8.0)
    assert sc.costs.requeue_hold_s == 0 and sc.costs.queue_wait_s == 60  # start_now: no hold
    assert sc.interval_s == cfg.checkpoint.every_steps * 8.0
    assert sc.checkpoint.bytes_total == 12 * model_params(cfg.model)
    assert sc.shrink_nodes >= 1  # requeue.min_nodes=0: a restart may go on without the lost node's replica
    no_shrink = cfg.__class__(**{**cfg.__dict__, "requeue": type(cfg.requeue)(**{**cfg.requeue.__dict__,
                                                                                  "min_nodes": 2048})})
    assert plan_cli.goodput_inputs(no_shrink, {"step_s": "8", "days": "1", "seeds": "2"})[0].shrink_nodes == 0
    text = render(recommend(sc, plan_cli.configured_policy(cfg)), step)
    assert "recommended:" in text and "(as configured)" in text and "checkpoint.every_steps=" in text
    for sim, field in (({"hardware_per_node_dya": "1"}, "goodput.hardware_per_node_dya"),
                       ({"startup_s": "-1"}, "goodput.startup_s"), ({"days": "x"}, "goodput.days"),
                       ({"seeds": "2.5"}, "goodput.seeds"),
                       ({k: "0" for k in ("hardware_per_node_day", "network_per_node_day", "software_per_node_day",
                                          "planned_per_node_day")}, "goodput.hardware_per_node_day")):
        with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
            plan_cli.goodput_inputs(cfg, {"step_s": "8", **sim})
    opts, rest = plan_cli.parse_flags(["--goodput", "goodput.days=2", "model=tiny"])
    assert opts.goodput and opts.sim == {"days": "2"} and rest == ["model=tiny"]


def test_plan_cli_goodput_json() -> None:
    import json

    cfg = to_typed(compose_cfg(["model=llama3-405b", "cluster=h100-ib", "cluster.nodes=2048"]))
    out = json.loads(plan_cli.goodput(cfg, {"days": "2", "seeds": "3", "step_s": "8"}, True))
    assert out["recommended"]["policy"] in ("requeue", "in-job", "in-job+memory") and out["step_s"] == 8
    assert {r["policy"] for r in out["results"]} == {"requeue", "in-job", "in-job+memory"}
    for r in out["results"]:
        assert sum(r["breakdown_pct"].values()) == pytest.approx(100)
    # The default budgets are rates that grow with the run's size: 2 days at 16,384 GPUs stay within them ...
    assert not any("exceeded" in n for n in out["notes"]), out["notes"]
    # ... where the deprecated total cap (the old default, 5) ends the run, and a low rate too: each said so.
    capped = to_typed(compose_cfg(["model=llama3-405b", "cluster=h100-ib", "cluster.nodes=2048",
                                   "requeue.max_requeues=5", "requeue.failures_per_day=1",
                                   "requeue.max_restarts_in_job=0"]))
    notes = json.loads(plan_cli.goodput(capped, {"days": "2", "seeds": "3", "step_s": "8"}, True))["notes"]
    assert any("max_requeues_exceeded" in n for n in notes), notes
    assert any("requeue.failures_per_day=" in n and "requeue_budget_exceeded" in n for n in notes), notes


def test_the_default_failure_budget_covers_what_the_simulator_says_a_llama3_scale_run_needs() -> None:
    """Llama 3 405B's setting (16,384 GPUs, 54 days, its interruption rates), every policy: the requeue
    budget's default rates at 2,048 nodes let through the most requeues of each class over the seeds."""
    from xirang_hpc.config.schema import RequeueConfig
    from xirang_hpc.planner.goodput_sim import llama3_405b, recommend

    rec = recommend(llama3_405b(seeds=8), "requeue")
    budget = RequeueConfig().with_default_rates(nodes=2048, time_min=1440)
    for r in [*rec.results, rec.configured]:
        need = r.needed_rates(54.0, budget.budget_burst)
        assert 0 < need["failures_per_day"] <= budget.failures_per_day, (r.policy, need)
        assert need["preemptions_per_day"] <= budget.preemptions_per_day, (r.policy, need)
    # Under the requeue policy every unplanned interruption is a requeue: ~419 in 54 days, ~7.8 a day.
    assert 6.5 < rec.configured.needed_rates(54.0, 0)["failures_per_day"] < 9.5


@pytest.mark.slow
def test_xirang_plan_goodput_command(tmp_path) -> None:
    import subprocess
    import sys
    from pathlib import Path

    exe = Path(sys.executable).parent / "xirang-plan"
    r = subprocess.run([str(exe), "--goodput", "model=llama3-405b", "cluster=h100-ib", "cluster.nodes=2048",
                        "goodput.days=2", "goodput.seeds=4", "goodput.step_s=8"], cwd=tmp_path, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "| policy |" in r.stdout and "recommended:" in r.stdout
    r = subprocess.run([str(exe), "--goodput", "goodput.startup_s=-3"], cwd=tmp_path, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 2 and "goodput.startup_s" in r.stderr, r.stderr[-2000:]
    r = subprocess.run([str(exe), "goodput.days=3"], cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert r.returncode == 2 and "applies to --goodput only" in r.stderr, r.stderr[-2000:]


def _replay(policy: str, faults: list[tuple[float, str]]) -> dict[str, float]:
    """A 1,000 s window: 10 s start-up, 100 s of compute then a 1 s stall per checkpoint (durable at once),
    in-job restart 20 s (on the one spare node), requeue 15 s + 5 s pending; a planned stop saves 1 + 2 s."""
    costs = RecoveryCosts(startup_s=10.0, requeue_recovery_s=15.0, requeue_hold_s=0.0, queue_wait_s=5.0,
                          injob_recovery_s=20.0, memory_restore_s=0.0)
    ck = CheckpointCosts(snapshot_s=1.0, write_s=2.0, load_s=0.0, synchronous=False)
    return replay(Replay(policy, 1000.0, faults, costs, ck, interval_s=100.0, memory_every_s=100.0, spares=1))


def test_replay_of_a_measured_run_by_hand() -> None:
    # Software fault at 500 s, in-job: 10 s start-up; 490 s of training = 4 cycles of 101 s + 86 s, the
    # newest durable checkpoint after 4 x 100 s (86 s lost); 20 s recovery; 480 s = 4 cycles + 76 s kept.
    r = _replay("in-job", [(500.0, "software")])
    assert r["productive"] == pytest.approx(876.0)
    assert r["lost"] == pytest.approx(86.0)
    assert (r["recovery"], r["startup"], r["stall"], r["queue"]) == pytest.approx((20.0, 10.0, 8.0, 0.0))
    assert r["goodput"] == pytest.approx(0.876)
    # The same fault requeued: 15 s recovery, 5 s pending (not allocated), 10 s start-up, then 470 s = 4 cycles
    # + 66 s. Goodput is over the allocated 995 s, as xirang-status measures it.
    r = _replay("requeue", [(500.0, "software")])
    assert r["productive"] == pytest.approx(866.0)
    assert (r["recovery"], r["startup"], r["queue"]) == pytest.approx((15.0, 20.0, 5.0))
    assert r["goodput"] == pytest.approx(866.0 / 995.0)
    assert r["goodput_window"] == pytest.approx(0.866)
    # A preemption: everything computed is kept (486 s), the save on the signal stalls 1 + 2 s, then the requeue:
    # 500 + 3 + 15 + 5 + 10 = 533 s, 467 s = 4 cycles + 63 s.
    r = _replay("in-job", [(500.0, "planned")])
    assert r["productive"] == pytest.approx(949.0)
    assert r["lost"] == pytest.approx(0.0)
    assert r["stall"] == pytest.approx(11.0)
    assert r["goodput"] == pytest.approx(949.0 / 995.0)


def test_replay_restarts_that_take_a_node_use_the_spare_then_requeue() -> None:
    # This build's in-job driver excludes the culprit's node on every restart: with one spare, the first
    # software fault restarts in-job on the spare, the second (no spare left, no shrinking) is a requeue.
    costs = RecoveryCosts(startup_s=10.0, requeue_recovery_s=15.0, requeue_hold_s=0.0, queue_wait_s=5.0,
                          injob_recovery_s=20.0, memory_restore_s=0.0)
    ck = CheckpointCosts(snapshot_s=1.0, write_s=0.0, load_s=0.0)
    faults = [(300.0, "software"), (600.0, "software")]
    r = replay(Replay("in-job", 1000.0, faults, costs, ck, interval_s=100.0, memory_every_s=100.0, spares=1))
    # 10 s start-up; 290 s = 2 cycles + 88 s (88 s lost); 20 s in-job; 280 s = 2 cycles + 78 s (78 s lost);
    # requeue 15 s + 5 s pending + 10 s start-up; 370 s = 3 cycles + 67 s, all kept. Per wall second: the
    # spare's idle GPU time is not charged.
    assert (r["requeues"], r["interruptions"]) == (1.0, 2.0)
    assert r["productive"] == pytest.approx(200 + 200 + 367)
    assert r["lost"] == pytest.approx(88 + 78)
    assert (r["recovery"], r["startup"], r["queue"], r["spares"]) == pytest.approx((35.0, 20.0, 5.0, 0.0))
    assert r["goodput"] == pytest.approx(767.0 / 995.0)
    # Restarted in place (the simulator's default): both faults in-job, no requeue.
    r = replay(Replay("in-job", 1000.0, faults, costs, ck, interval_s=100.0, memory_every_s=100.0, spares=1,
                      exclude_on_restart=False))
    assert (r["requeues"], r["recovery"], r["queue"]) == (0.0, pytest.approx(40.0), 0.0)
