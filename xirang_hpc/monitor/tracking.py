"""Experiment tracking: ``train.loggers=[jsonl, tensorboard, mlflow]`` (rank 0 only).

``jsonl`` is the trainer's own ``<run>/metrics.jsonl`` and is always written; this module adds

- ``tensorboard``: event files under ``<run>/tb/`` (``torch.utils.tensorboard.SummaryWriter``):
  scalars ``train/loss``, ``val/loss``, ``train/lr``, ``train/grad_norm``, ``perf/tokens_per_s``,
  ``perf/tflops``, ``perf/mfu`` (when the device peak is known), ``sys/rss_mb``, ``sys/gpu_mem_mb``
  (CUDA), the composed config as a text summary (``config``) and every event of ``events.jsonl``
  (checkpoint commits, start, stop, requeue, faults, exit) as a text summary (``events``) at its step;
- ``mlflow``: one MLflow run per run directory (in ``train.mlflow_uri``, default a file store in
  ``<run>/mlruns``) with the config as params (``model.n_layer`` ...), the same metrics, and the
  events as tags (``xirang.checkpoints``, ``xirang.requeues``, ``xirang.event.<kind>``) plus marker
  metrics ``events/checkpoint`` and ``events/requeue``.

Resume: ``<run>/tracking.json`` keeps the MLflow run id and, per back end, the last step written
for training and validation rows and how far ``events.jsonl`` was forwarded. A resumed session
continues the same MLflow run and the same ``tb/`` directory and writes only rows past those marks
(a checkpoint restore rewinds ``metrics.jsonl`` to the checkpoint's step, and the steps trained
again are bitwise the same), so no step is logged twice and none is missing. A back end added on a
later session, or a fork made by ``train.resume_from``, is first back-filled from ``metrics.jsonl``.

The packages are imported only when their logger is selected (``mlflow`` is heavy); a missing one
fails at start-up, on every rank, with the install command.
"""

from __future__ import annotations

import atexit
import dataclasses
import importlib
import importlib.util
import json
import os
import time
from pathlib import Path
from typing import Any

import psutil

from xirang_hpc.config.schema import XirangConfig
from xirang_hpc.files import write_json_atomic
from xirang_hpc.monitor.events import EVENTS_FILE
from xirang_hpc.monitor.flops import flops_per_token_for, mfu, peak_for_device
from xirang_hpc.runtime.hooks import Loop, TrainerHook
from xirang_hpc.runtime.topology import Topology

TRACKING_FILE = "tracking.json"
CONFIG_FILE = "config.json"
TB_DIR = "tb"
MLRUNS_DIR = "mlruns"
# metrics.jsonl field -> the tag both back ends use.
TAGS = {"loss": "train/loss", "grad_norm": "train/grad_norm", "lr": "train/lr", "val_loss": "val/loss",
        "tokens_per_s": "perf/tokens_per_s", "tflops": "perf/tflops", "mfu": "perf/mfu",
        "rss_mb": "sys/rss_mb", "gpu_mem_mb": "sys/gpu_mem_mb"}
# Logger -> (module that must import, pip requirement).
PACKAGES = {"tensorboard": ("tensorboard", "tensorboard"), "mlflow": ("mlflow", "mlflow-skinny")}


class TrackingError(RuntimeError):
    """A tracking back end cannot be used (package missing, store unreachable)."""


def require_packages(loggers: list[str], load: bool = True) -> None:
    """Check the selected back ends' packages; raises :class:`TrackingError` naming the fix.

    ``load=False`` only looks the package up (ranks that never log need not pay for importing mlflow).
    """
    for name in loggers:
        if name not in PACKAGES:
            continue
        module, req = PACKAGES[name]
        try:
            if load:
                importlib.import_module(module)
            elif importlib.util.find_spec(module) is None:
                raise ImportError(f"No module named {module!r}")
        except (ImportError, ValueError) as exc:  # find_spec: ValueError for a module blocked in sys.modules
            raise TrackingError(
                f"train.loggers includes {name!r} but the {module!r} package is not installed ({exc}); "
                f"install it with `pip install 'xirang-hpc[track]'` (or `pip install {req}`), "
                f"or drop {name} from train.loggers") from exc


def kind_of(row: dict[str, Any]) -> str | None:
    """``train`` (a loss row), ``val`` (a validation row) or None."""
    return "train" if "loss" in row else "val" if "val_loss" in row else None


def scalars(row: dict[str, Any]) -> dict[str, float]:
    """The row's numbers under their tracking tags."""
    out = {}
    for key, tag in TAGS.items():
        v = row.get(key)
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            out[tag] = float(v)
    return out


def flatten(obj: Any, prefix: str = "") -> dict[str, str]:
    """``{"model": {"n_layer": 2}}`` -> ``{"model.n_layer": "2"}`` (lists as JSON)."""
    out: dict[str, str] = {}
    if isinstance(obj, dict):
        for k, v in obj.items():
            out.update(flatten(v, f"{prefix}{k}."))
        return out
    out[prefix[:-1]] = obj if isinstance(obj, str) else json.dumps(obj)
    return out


def event_text(ev: dict[str, Any]) -> str:
    """One line for an event of ``events.jsonl``."""
    skip = {"time", "kind", "reason"}
    extra = ", ".join(f"{k}={ev[k]}" for k in ev if k not in skip and ev[k] not in (None, ""))
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(ev.get("time", 0))))
    return f"{when} {ev.get('kind', '?')}: {ev.get('reason', '')}" + (f" ({extra})" if extra else "")


class TensorBoardBackend:
    """Scalars and text summaries in ``<run>/tb/``."""

    name = "tensorboard"

    def __init__(self, run_dir: Path, state: dict[str, Any]) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.new = "train" not in state
        self.writer = SummaryWriter(log_dir=str(run_dir / TB_DIR))

    def log_config(self, cfg: dict[str, Any], tags: dict[str, str]) -> None:
        """The composed config as a text summary (first session only)."""
        if self.new:
            body = json.dumps(cfg, indent=1, default=str)
            self.writer.add_text("config", "    " + body.replace("\n", "\n    "), 0)

    def log_metrics(self, step: int, values: dict[str, float], wall: float | None) -> None:
        """Scalars at ``step``."""
        for tag, v in values.items():
            self.writer.add_scalar(tag, v, step, walltime=wall)

    def log_event(self, step: int, ev: dict[str, Any]) -> None:
        """An ``events.jsonl`` row as a text summary."""
        self.writer.add_text("events", event_text(ev), step, walltime=float(ev.get("time", time.time())))

    def flush(self) -> None:
        """Make everything visible to readers."""
        self.writer.flush()

    def close(self, status: str) -> None:
        """Flush and close the event file."""
        self.writer.close()


class MLflowBackend:
    """One MLflow run per run directory, continued across sessions."""

    name = "mlflow"

    def __init__(self, run_dir: Path, state: dict[str, Any], uri: str, experiment: str,
                 base_tags: dict[str, str]) -> None:
        if not uri:
            # A file store beside the run: it works on shared cluster filesystems (NFS, Lustre), where
            # SQLite locking does not. MLflow 3 keeps it behind an explicit opt-in.
            uri = (run_dir / MLRUNS_DIR).absolute().as_uri()
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        from mlflow.exceptions import MlflowException
        from mlflow.tracking import MlflowClient

        self.uri, self.client = uri, MlflowClient(tracking_uri=uri)
        self.run_id = state.get("run_id") if state.get("uri") == uri else None
        self.new = True
        try:
            if self.run_id:
                try:
                    self.client.get_run(self.run_id)
                    self.client.update_run(self.run_id, status="RUNNING")
                    self.new = False
                except MlflowException:
                    self.run_id = None  # the store lost it (wiped, another URI): start a new run
            if self.run_id is None:
                exp = self.client.get_experiment_by_name(experiment)
                exp_id = exp.experiment_id if exp is not None else self.client.create_experiment(experiment)
                self.run_id = self.client.create_run(exp_id, run_name=run_dir.name, tags=base_tags).info.run_id
        except MlflowException as exc:
            raise TrackingError(f"MLflow tracking store {uri} (train.mlflow_uri): {exc}") from exc
        self.checkpoints: list[int] = [int(x) for x in state.get("checkpoints", [])]
        self.requeues = int(state.get("requeues", 0))
        if not self.new:
            # The run's own record wins over tracking.json: a session that died between forwarding an event and
            # saving its marks forwarded it already, and the next one reads it again from events.jsonl.
            tags = self.client.get_run(self.run_id).data.tags
            logged = [int(x) for x in str(tags.get("xirang.checkpoints", "")).split(",") if x.strip().isdigit()]
            self.checkpoints = sorted(set(self.checkpoints) | set(logged))
            self.requeues = max(self.requeues, int(tags.get("xirang.requeues", 0) or 0))

    def state(self) -> dict[str, Any]:
        """What a later session needs to continue this run."""
        return {"uri": self.uri, "run_id": self.run_id, "checkpoints": self.checkpoints, "requeues": self.requeues}

    def log_config(self, cfg: dict[str, Any], tags: dict[str, str]) -> None:
        """Params on a new run; on a continued run, new keys are added and changed values tagged."""
        from mlflow.entities import Param, RunTag

        flat = {k: v[:6000] for k, v in flatten(cfg).items()}
        have = {} if self.new else self.client.get_run(self.run_id).data.params
        params = [Param(k, v) for k, v in flat.items() if k not in have]
        changed = [RunTag(f"xirang.changed.{k}", f"{have[k]} -> {v}"[:5000]) for k, v in flat.items()
                   if k in have and have[k] != v]
        for i in range(0, len(params), 100):  # MLflow takes at most 100 params per batch
            self.client.log_batch(self.run_id, params=params[i:i + 100])
        run_tags = [RunTag(k, v) for k, v in tags.items()] + changed
        if run_tags:
            self.client.log_batch(self.run_id, tags=run_tags)

    def log_metrics(self, step: int, values: dict[str, float], wall: float | None) -> None:
        """Metrics at ``step``, one batch."""
        from mlflow.entities import Metric

        ts = int(1000 * (wall if wall is not None else time.time()))
        self.client.log_batch(self.run_id, metrics=[Metric(k, v, ts, step) for k, v in values.items()])

    def log_event(self, step: int, ev: dict[str, Any]) -> None:
        """Tags for the event (and a marker metric for checkpoints and requeues)."""
        from mlflow.entities import Metric, RunTag

        kind = str(ev.get("kind", "event"))
        ts = int(1000 * float(ev.get("time", time.time())))
        tags = [RunTag(f"xirang.event.{kind}", f"step {step}: {event_text(ev)}"[:5000])]
        metrics = []
        if kind == "checkpoint":
            if step in self.checkpoints:  # forwarded before a crash that lost the marks: once is enough
                return
            self.checkpoints.append(step)
            tags.append(RunTag("xirang.checkpoints", ",".join(map(str, self.checkpoints))[-5000:]))
            metrics.append(Metric("events/checkpoint", float(step), ts, step))
        elif kind == "requeue":
            self.requeues += 1
            tags.append(RunTag("xirang.requeues", str(self.requeues)))
            metrics.append(Metric("events/requeue", float(self.requeues), ts, step))
        self.client.log_batch(self.run_id, metrics=metrics, tags=tags)

    def flush(self) -> None:
        """Writes are synchronous."""

    def close(self, status: str) -> None:
        """End this session's part of the run (FINISHED, KILLED for a stop/requeue, FAILED)."""
        self.client.set_terminated(self.run_id, status)


class TrackingHook(TrainerHook):
    """Rank 0 forwards metrics rows and events to the selected back ends; see the module docstring.

    Every rank checks the packages at construction, so a missing one stops all ranks alike before
    any collective. On rank 0 the hook also enriches each training row (TFLOP/s, MFU, memory) and
    writes ``<run>/config.json`` (the composed config, read by ``xirang-status`` to compare runs).
    """

    def __init__(self, cfg: XirangConfig, topo: Topology, run_dir: Path) -> None:
        self.cfg, self.topo, self.run_dir = cfg, topo, Path(run_dir)
        self.names = [n for n in dict.fromkeys(cfg.train.loggers) if n != "jsonl"]
        require_packages(self.names, load=topo.rank == 0)
        self.backends: list[Any] = []
        self.state: dict[str, Any] = {}
        self.fpt = flops_per_token_for(cfg.model)
        self.devices = topo.world_size if cfg.cluster.gpus_per_node else 0
        from xirang_hpc.runtime.device import Device  # torch: imported by the ranks only

        self.device = Device.parse(topo.device)  # this rank's (runtime/device.py)
        self.peak = cfg.monitor.peak_tflops
        self.step = 0
        self.finished = False
        self.stopped = False
        self.closed = False
        self.warned: set[str] = set()

    # ---- state -------------------------------------------------------------------------------
    def _save_state(self) -> None:
        write_json_atomic(self.run_dir / TRACKING_FILE, self.state)

    def _marks(self, b: Any) -> dict[str, Any]:
        return self.state.setdefault(b.name, {})

    # ---- hook points -------------------------------------------------------------------------
    def on_fit_start(self, trainer: Loop) -> None:
        """Write config.json; open the back ends; back-fill rows and events they have not seen."""
        if self.topo.rank != 0:
            return
        self.run_dir = Path(trainer.run_dir)
        self.step = trainer.state.step
        cfg = dataclasses.asdict(self.cfg)
        write_json_atomic(self.run_dir / CONFIG_FILE, {"config": cfg, "run_dir": str(self.run_dir),
                                                       "time": time.time()})
        if not self.peak and self.device.is_accelerator:
            self.peak = peak_for_device(self.device.name())
        try:
            self.state = json.loads((self.run_dir / TRACKING_FILE).read_text())
        except (OSError, ValueError):
            self.state = {}
        tags = {"xirang.run_dir": str(self.run_dir), "xirang.model": self.cfg.model.name,
                "xirang.train_name": self.cfg.train.name}
        forked = self.run_dir / "forked_from.json"
        if forked.is_file():
            try:
                src = json.loads(forked.read_text())
                tags["xirang.forked_from"] = f"{src.get('run')}@step{src.get('step')}"
            except ValueError:
                pass
        for name in self.names:
            marks = self.state.setdefault(name, {})
            if name == "tensorboard":
                b: Any = TensorBoardBackend(self.run_dir, marks)
            else:
                b = MLflowBackend(self.run_dir, marks, self.cfg.train.mlflow_uri, self.cfg.train.name, tags)
                marks.update(b.state())
            b.log_config(cfg, tags)
            marks.setdefault("train", -1)
            marks.setdefault("val", -1)
            marks.setdefault("events", 0)
            self.backends.append(b)
        if self.backends:
            rows = _read_rows(self.run_dir / "metrics.jsonl")
            for row in rows:  # back-fill what a back end has not seen (a new back end, a fork)
                self._forward(row)
            self._drain_events()
            self._save_state()
            atexit.register(self.close)

    def on_log(self, trainer: Loop, row: dict[str, object]) -> None:
        """Add TFLOP/s, MFU and memory to a training row; forward the row to the back ends."""
        if "loss" in row:
            tok_s = float(row.get("tokens_per_s", 0.0))  # type: ignore[arg-type]
            row["tflops"] = tok_s * self.fpt / 1e12
            u = mfu(tok_s, self.fpt, self.devices, self.peak)
            if u is not None:
                row["mfu"] = u
            row["rss_mb"] = psutil.Process().memory_info().rss / 2**20
            if (peak := self.device.peak_memory_mb()) is not None:
                row["gpu_mem_mb"] = peak
        if self.backends:
            self.step = max(self.step, int(row.get("step", 0)))  # type: ignore[call-overload]
            self._forward(row)
            self._save_state()

    def on_step_end(self, trainer: Loop, metrics: dict[str, float]) -> None:
        """Forward new events (checkpoint commits are written by a background thread)."""
        self.step = trainer.state.step
        if self.backends and self.topo.rank == 0:
            self._drain_events()

    def on_fit_end(self, trainer: Loop, summary: dict[str, object]) -> None:
        """The loop ended (completed or stopped without a requeue)."""
        self.finished = trainer.state.step >= self.cfg.train.end_step
        if self.backends and self.topo.rank == 0:
            self._drain_events()

    # ---- forwarding --------------------------------------------------------------------------
    def _forward(self, row: dict[str, Any]) -> None:
        kind = kind_of(row)
        if kind is None:
            return
        step = int(row.get("step", 0))
        values = scalars(row)
        wall = float(row["time"]) if isinstance(row.get("time"), (int, float)) else None
        for b in self.backends:
            marks = self._marks(b)
            if step > marks[kind]:  # rows of steps trained again after a restore were written already
                if self._safe(b, b.log_metrics, step, values, wall):
                    marks[kind] = step

    def _safe(self, b: Any, fn: Any, *args: Any) -> bool:
        """Call a back end; a failure (a tracking server down) is reported, never fatal to training."""
        try:
            fn(*args)
            return True
        except Exception as exc:  # noqa: BLE001 - any client error; metrics.jsonl keeps every row
            if b.name not in self.warned:
                self.warned.add(b.name)
                print(f"tracking: {b.name}: {type(exc).__name__}: {exc}; training continues "
                      "(metrics.jsonl has every row; later failures are not repeated here)", flush=True)
            return False

    def _drain_events(self) -> None:
        path = self.run_dir / EVENTS_FILE
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            return
        changed = False
        for b in self.backends:
            marks = self._marks(b)
            start = int(marks["events"])
            if size <= start:
                continue
            changed = True
            with path.open("rb") as f:
                f.seek(start)
                data = f.read(size - start)
            end = data.rfind(b"\n") + 1  # a line still being written waits for the next round
            for line in data[:end].splitlines():
                try:
                    ev = json.loads(line)
                except ValueError:
                    continue
                if not isinstance(ev, dict):
                    continue
                if ev.get("kind") in ("stop", "requeue"):
                    self.stopped = True
                step = ev.get("step", ev.get("saved_step"))
                self._safe(b, b.log_event, int(step) if isinstance(step, int) else self.step, ev)
            marks["events"] = start + end
            if isinstance(b, MLflowBackend):
                marks.update(b.state())
        if changed:
            self._save_state()

    def close(self) -> None:
        """Forward the last events (stop, requeue, exit) and close the back ends; runs at exit too."""
        if self.closed or not self.backends:
            return
        self.closed = True
        self._drain_events()
        status = "FINISHED" if self.finished else "KILLED" if self.stopped else "FAILED"
        for b in self.backends:
            self._safe(b, b.flush)
            self._safe(b, b.close, status)
        self._save_state()


def _read_rows(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict):
            rows.append(row)
    return rows


def log_run_metrics(cfg: XirangConfig, run_dir: str | Path, step: int, values: dict[str, float]) -> list[str]:
    """Metrics measured after training (the eval stage's harness scores) into the run's own trackers.

    The back ends of ``train.loggers`` are opened as a resumed session would open them (the same ``tb/``
    directory, the same MLflow run from ``<run>/tracking.json``), ``values`` logged at ``step``, then closed
    (an MLflow run that was finished stays FINISHED). A failing back end is reported, never fatal. Returns the
    back ends written."""
    run_dir = Path(run_dir)
    names = [n for n in dict.fromkeys(cfg.train.loggers) if n != "jsonl"]
    if not names or not values:
        return []
    try:
        state = json.loads((run_dir / TRACKING_FILE).read_text())
    except (OSError, ValueError):
        state = {}
    done = []
    for name in names:
        marks = state.setdefault(name, {})
        try:
            if name == "tensorboard":
                b: Any = TensorBoardBackend(run_dir, marks)
            else:
                b = MLflowBackend(run_dir, marks, cfg.train.mlflow_uri, cfg.train.name,
                                  {"xirang.run_dir": str(run_dir), "xirang.model": cfg.model.name})
                marks.update(b.state())
            b.log_metrics(step, values, time.time())
            b.flush()
            b.close("FINISHED")
            done.append(name)
        except Exception as exc:  # noqa: BLE001 - any client error; harness.json has every value
            print(f"tracking: {name}: {type(exc).__name__}: {exc} (the values are in the run directory)", flush=True)
    write_json_atomic(run_dir / TRACKING_FILE, state)
    return done
