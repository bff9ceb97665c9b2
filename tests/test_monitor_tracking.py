"""Experiment tracking through the real job function: TensorBoard and MLflow read back with their own
readers (``EventAccumulator``, ``MlflowClient``) across a preemption (SIGUSR2 -> save -> requeue ->
exit) and a crash (steps trained again after the restore), and run comparison of a rollback fork
with its parent (``xirang-status A B --json/--plot``).

Each session is real processes (2 gloo ranks) with submitit's local-executor environment.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from conftest import compose_cfg
from ranks import rank_context

from xirang_hpc.config.validate import load_config
from xirang_hpc.monitor.tracking import TRACKING_FILE, TrackingError, TrackingHook, require_packages
from xirang_hpc.submit.rundir import make_private_dir

TWO_RANKS = ["cluster.nodes=1", "cluster.tasks_per_node=2", "parallel.tp=1", "parallel.pp=1",
             "parallel.microbatches=1", "cluster.threads_per_rank=1"]


def _rank_main(rank: int, world: int, job: str, cfg: dict, run_dir: str, data_dir: str, act: dict) -> None:
    os.environ.update(SUBMITIT_LOCAL_GLOBALID=str(rank), SUBMITIT_LOCAL_LOCALID=str(rank),
                      SUBMITIT_LOCAL_NTASKS=str(world), SUBMITIT_LOCAL_JOB_ID=job)
    from xirang_hpc.job import training as jobmod
    from xirang_hpc.runtime.hooks import TrainerHook

    class Act(TrainerHook):
        """After the stop-signal hook: a preemption signal, or a crash, at a given step."""

        def on_step_end(self, trainer, metrics):
            if trainer.state.step == act.get("signal_at"):
                os.kill(os.getpid(), signal.SIGUSR2)  # recorded now, agreed on at the next step boundary
            if trainer.state.step == act.get("crash_at"):
                raise RuntimeError(f"simulated crash at step {trainer.state.step}")

    real = jobmod.build_hooks
    jobmod.build_hooks = lambda *a: [*real(*a), Act()]
    try:
        jobmod.run_training(cfg, run_dir, data_dir)
    finally:
        if rank == 0 and act.get("modules_file"):
            heavy = sorted(m for m in ("mlflow", "tensorboard") if m in sys.modules)
            Path(act["modules_file"]).write_text(json.dumps(heavy))


def run_session(cfg: dict, run_dir: Path, data_dir: Path, world: int = 2, **act) -> list[int]:
    """One job session on ``world`` spawned ranks; returns their exit codes."""
    make_private_dir(run_dir)
    ctx = rank_context()
    job = f"track-test-{uuid.uuid4().hex[:8]}"
    procs = [ctx.Process(target=_rank_main, args=(r, world, job, cfg, str(run_dir), str(data_dir), act))
             for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(400)
    for p in procs:
        if p.is_alive():
            p.kill()
    return [p.exitcode for p in procs]


def make_cfg(data_dir: Path, run_dir: Path, extra: list[str]) -> dict:
    over = ["model=tiny", "cluster=local", *TWO_RANKS, "train.max_steps=20", "train.global_batch=8",
            "train.warmup_steps=2", "train.eval_batches=1", "train.log_every=1", "train.eval_every=5",
            "checkpoint.every_steps=5", "checkpoint.keep_last=1", "monitor.enabled=false",
            f"data.out_dir={data_dir}", f"train.run_dir={run_dir}", *extra]
    return dataclasses.asdict(load_config(compose_cfg(over)))


def _rows(run: Path) -> list[dict]:
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]


@pytest.mark.slow
def test_tensorboard_and_mlflow_across_preemption_and_crash(tmp_path: Path, stdlib_data: Path) -> None:
    from mlflow.tracking import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run = tmp_path / "run"
    cfg = make_cfg(stdlib_data, run, ["train.loggers=[jsonl,tensorboard,mlflow]"])
    # 1: SIGUSR2 seen after step 7 -> every rank saves step 8, rank 0 requeues (local: exit 144)
    assert run_session(cfg, run, stdlib_data, signal_at=7) == [144, 144]
    run_id = json.loads((run / TRACKING_FILE).read_text())["mlflow"]["run_id"]
    # 2: resumed at 8, crashes after step 13: steps 11-13 (after the step-10 checkpoint) are trained again
    # (the exit status of a crashed rank is 1, or SIGABRT when a native thread is still alive at exit)
    assert all(c not in (0, None) for c in run_session(cfg, run, stdlib_data, crash_at=13))
    assert json.loads((run / TRACKING_FILE).read_text())["mlflow"]["run_id"] == run_id
    # 3: resumed, runs to the end
    assert run_session(cfg, run, stdlib_data) == [0, 0]
    rows = _rows(run)
    loss = {r["step"]: r["loss"] for r in rows if "loss" in r}
    val = {r["step"]: r["val_loss"] for r in rows if "val_loss" in r}
    assert sorted(loss) == list(range(1, 21)) and sorted(val) == [0, 5, 10, 15, 20]
    assert all("tflops" in r and r["rss_mb"] > 0 for r in rows if "loss" in r)
    events = [json.loads(x) for x in (run / "events.jsonl").read_text().splitlines()]
    committed = sorted({e["step"] for e in events if e["kind"] == "checkpoint"})
    assert {5, 8, 15, 20} <= set(committed)

    # MLflow, through its own client: one run, every step exactly once, same values as metrics.jsonl
    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    client = MlflowClient(tracking_uri=(run / "mlruns").as_uri())
    exp = client.get_experiment_by_name("default")
    (only,) = client.search_runs([exp.experiment_id])
    assert only.info.run_id == run_id and only.info.status == "FINISHED"
    hist = client.get_metric_history(run_id, "train/loss")
    assert sorted(m.step for m in hist) == list(range(1, 21))  # no duplicate, none missing
    assert all(m.value == pytest.approx(loss[m.step], rel=1e-6) for m in hist)
    vhist = client.get_metric_history(run_id, "val/loss")
    assert sorted(m.step for m in vhist) == [0, 5, 10, 15, 20]
    assert all(m.value == pytest.approx(val[m.step], rel=1e-6) for m in vhist)
    for key in ("train/lr", "train/grad_norm", "perf/tokens_per_s", "perf/tflops", "sys/rss_mb"):
        assert sorted(m.step for m in client.get_metric_history(run_id, key)) == list(range(1, 21)), key
    data = only.data
    assert data.params["model.name"] == "tiny" and data.params["train.max_steps"] == "20"
    assert data.params["train.loggers"] == '["jsonl", "tensorboard", "mlflow"]'
    assert [int(s) for s in data.tags["xirang.checkpoints"].split(",")] == committed
    assert data.tags["xirang.requeues"] == "1" and "preemption" in data.tags["xirang.event.requeue"]
    assert sorted(m.step for m in client.get_metric_history(run_id, "events/checkpoint")) == committed

    # TensorBoard, through its own reader
    ea = EventAccumulator(str(run / "tb"), size_guidance={"scalars": 0, "tensors": 0})
    ea.Reload()
    tl = ea.Scalars("train/loss")
    assert [e.step for e in tl] == list(range(1, 21))
    assert all(e.value == pytest.approx(loss[e.step], rel=1e-6) for e in tl)
    assert [e.step for e in ea.Scalars("val/loss")] == [0, 5, 10, 15, 20]
    texts = [(e.step, e.tensor_proto.string_val[0].decode()) for e in ea.Tensors("events/text_summary")]
    assert (8, next(t for s, t in texts if "checkpoint: step 8 committed" in t)) in texts
    assert any("requeue: preemption" in t and s == 8 for s, t in texts)
    assert any("model" in e.tensor_proto.string_val[0].decode() for e in ea.Tensors("config/text_summary"))


@pytest.mark.slow
def test_compare_a_rollback_fork_with_its_parent(tmp_path: Path, stdlib_data: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """Parent 20 steps; train.resume_from=10 with another LR forks and trains 11..20; xirang-ckpt rollback
    makes a third, untrained fork. ``xirang-status A B C --json`` lists the config differences and
    overlays the curves; the default loggers never import mlflow or tensorboard."""
    parent = tmp_path / "parent"
    mods = tmp_path / "modules.json"
    assert run_session(make_cfg(stdlib_data, parent, ["checkpoint.keep_last=5"]), parent, stdlib_data,
                       modules_file=str(mods)) == [0, 0]
    assert json.loads(mods.read_text()) == []
    cfg = make_cfg(stdlib_data, parent, ["checkpoint.keep_last=5", "train.resume_from=10", "train.lr=1e-3"])
    assert run_session(cfg, parent, stdlib_data) == [0, 0]
    fork = Path(json.loads((parent / "forks.json").read_text())["10"])
    rolled = tmp_path / "rolled"
    exe = Path(sys.executable).parent
    # xirang-ckpt and xirang-status --json through their main() (one interpreter, no torch import per
    # command); the console script itself runs once, below.
    from xirang_hpc.cli.ckpt import main as ckpt_main
    from xirang_hpc.cli.status import main as status_main

    capsys.readouterr()
    assert ckpt_main(["rollback", str(parent), "--step", "15", "--to", str(rolled)]) == 0, capsys.readouterr()
    capsys.readouterr()
    out = tmp_path / "cmp.png"
    assert status_main([str(parent), str(fork), str(rolled), "--json", "--plot", str(out)]) == 0, capsys.readouterr()
    got = json.loads(capsys.readouterr().out)
    assert [Path(x["run_dir"]).name for x in got["runs"]] == [parent.name, fork.name, rolled.name]
    diff = got["config_diff"]
    assert diff["train.lr"] == [0.003, 0.001, 0.003] and diff["train.resume_from"] == [-1, 10, -1]
    assert "model.n_layer" not in diff
    by = {Path(x["run_dir"]).name: x for x in got["runs"]}
    assert by[fork.name]["forked_from"] == {"run": str(parent), "step": 10}
    assert by[rolled.name]["forked_from"]["step"] == 15 and by[rolled.name]["config_source"] == "checkpoint"
    assert by[parent.name]["steps"] == 20 and by[fork.name]["steps"] == 20 and by[rolled.name]["steps"] == 15
    # the fork shares the parent's first 10 steps exactly, then departs (another LR)
    pl, fl = ({r_["step"]: r_["loss"] for r_ in _rows(d) if "loss" in r_} for d in (parent, fork))
    assert all(pl[s] == fl[s] for s in range(1, 11)) and pl[20] != fl[20]
    assert got["plot"]["path"] == str(out) and out.read_bytes()[:4] == b"\x89PNG"
    # status of each, with the monitor off (no heartbeats): from config.json, metrics and the fork record
    from xirang_hpc.runs.status import run_status

    sf, sr = run_status(fork), run_status(rolled)
    assert (sf["state"], sf["step"], sf["total_steps"], sf["model"]) == ("COMPLETED", 20, 20, "tiny")
    assert sr["state"] == "UNKNOWN" and sr["state_reason"].startswith(f"fork of {parent} at step 15")
    r = subprocess.run([str(exe / "xirang-status"), str(parent), str(fork)], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0 and "config differences (2):" in r.stdout
    assert ["train.lr", "0.003", "0.001"] in [ln.split() for ln in r.stdout.splitlines()], r.stdout
    assert got["plot"]["series"] == {parent.name: 20, fork.name: 20, rolled.name: 15}


def test_missing_logger_package_fails_with_the_install_command(monkeypatch) -> None:
    # A real ImportError: Python refuses to import a module whose sys.modules entry is None.
    monkeypatch.setitem(sys.modules, "mlflow", None)
    with pytest.raises(TrackingError, match=r"train.loggers includes 'mlflow'.*pip install 'xirang-hpc\[track\]'"):
        require_packages(["jsonl", "mlflow"])
    cfg = load_config(compose_cfg(["train.loggers=[jsonl,mlflow]"]))
    from xirang_hpc.runtime.topology import Topology

    topo = Topology(rank=1, world_size=2, local_rank=1, local_world_size=2, node_id=0, num_nodes=1,
                    node_name="n0", master_addr="127.0.0.1", master_port=1, job_id="1", source="local")
    with pytest.raises(TrackingError, match="drop mlflow from train.loggers"):
        TrackingHook(cfg, topo, Path("/nonexistent"))  # every rank checks, before any collective


def test_unknown_logger_is_a_config_error() -> None:
    from xirang_hpc.config.errors import ConfigError

    with pytest.raises(ConfigError, match=r"train.loggers.*unknown logger\(s\) \['wandb'\]"):
        load_config(compose_cfg(["train.loggers=[jsonl,wandb]"]))
    with pytest.raises(ConfigError, match="train.eval_every"):
        load_config(compose_cfg(["train.eval_every=-1"]))


def test_a_backend_added_later_is_backfilled_and_a_failing_store_does_not_stop_training(tmp_path: Path,
                                                                                        capsys) -> None:
    """The hook alone, in this process, on a run directory that so far had only metrics.jsonl (the
    trainer's rows are written by hand here; the hook sees what ``Trainer._record`` passes it)."""
    from types import SimpleNamespace

    from mlflow.tracking import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from xirang_hpc.runtime.topology import Topology

    run = tmp_path / "run"
    run.mkdir()
    with (run / "metrics.jsonl").open("w") as f:
        f.write(json.dumps({"step": 0, "val_loss": 5.5}) + "\n")
        for s in range(1, 6):
            f.write(json.dumps({"step": s, "loss": 5.0 - s / 10, "tokens_per_s": 100.0, "time": 1e9 + s}) + "\n")
    cfg = load_config(compose_cfg(["model=tiny", "train.loggers=[jsonl,tensorboard,mlflow]", "train.max_steps=8",
                                    "train.warmup_steps=1"]))
    topo = Topology(rank=0, world_size=1, local_rank=0, local_world_size=1, node_id=0, num_nodes=1, node_name="n0",
                    master_addr="127.0.0.1", master_port=1, job_id="1", source="local")
    trainer = SimpleNamespace(run_dir=run, state=SimpleNamespace(step=5))
    hook = TrackingHook(cfg, topo, run)
    hook.on_fit_start(trainer)  # resumed at step 5: rows 0..5 are back-filled
    row = {"step": 6, "loss": 4.3, "grad_norm": 1.0, "lr": 1e-3, "tokens_per_s": 120.0, "time": 1e9 + 6}
    hook.on_log(trainer, row)
    assert row["tflops"] > 0 and row["rss_mb"] > 0 and "mfu" not in row  # CPU: no peak, no MFU
    run_id = json.loads((run / TRACKING_FILE).read_text())["mlflow"]["run_id"]
    client = MlflowClient(tracking_uri=(run / "mlruns").as_uri())
    assert sorted(m.step for m in client.get_metric_history(run_id, "train/loss")) == [1, 2, 3, 4, 5, 6]
    assert [m.step for m in client.get_metric_history(run_id, "val/loss")] == [0]
    # the store goes away mid-run: training goes on, the failure is reported once
    import shutil

    shutil.rmtree(run / "mlruns")
    (run / "mlruns").write_text("not a directory")
    for s in (7, 8):
        hook.on_log(trainer, {"step": s, "loss": 4.0, "tokens_per_s": 120.0})
    out = capsys.readouterr().out
    assert out.count("tracking: mlflow:") == 1 and "training continues" in out
    hook.finished = True
    hook.close()
    ea = EventAccumulator(str(run / "tb"), size_guidance={"scalars": 0})
    ea.Reload()
    assert [e.step for e in ea.Scalars("train/loss")] == list(range(1, 9))
    assert [e.step for e in ea.Scalars("val/loss")] == [0]


@pytest.mark.unit
def test_an_event_forwarded_again_after_a_crash_is_logged_once(tmp_path: Path) -> None:
    """A session that died after forwarding a checkpoint to MLflow but before saving its marks: the next one
    reads the event again from events.jsonl; the run's checkpoint list and marker metric still hold it once."""
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    from xirang_hpc.monitor.tracking import MLflowBackend

    first = MLflowBackend(tmp_path, {}, "", "default", {})
    first.log_event(5, {"kind": "checkpoint", "step": 5, "time": 1.0})
    stale = first.state()  # what tracking.json held when the session died
    first.log_event(10, {"kind": "checkpoint", "step": 10, "time": 2.0})
    again = MLflowBackend(tmp_path, stale, "", "default", {})
    again.log_event(10, {"kind": "checkpoint", "step": 10, "time": 2.0})  # read again from events.jsonl
    again.log_event(15, {"kind": "checkpoint", "step": 15, "time": 3.0})
    client = MlflowClient(tracking_uri=(tmp_path / "mlruns").as_uri())
    assert client.get_run(again.run_id).data.tags["xirang.checkpoints"] == "5,10,15"
    assert [m.step for m in client.get_metric_history(again.run_id, "events/checkpoint")] == [5, 10, 15]
