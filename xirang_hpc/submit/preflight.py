"""Checks made before a launch writes or starts anything: paths, run identity, completion.

A launch into an existing run directory continues that run, so it must train the same thing:
the directory's ``identity.json`` (or, for a run made before it existed, the config recorded in
its newest checkpoint) is compared with the launch's config, and a mismatch is refused with the
differing fields and the ways out. A finished run is reported as such and nothing starts. Every
path the job will write (runs root, run dir, checkpoint dir, data dir) is probed first, so a
read-only, forbidden or full filesystem is named before submission rather than in a rank's
traceback.
"""

from __future__ import annotations

import errno
import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from xirang_hpc.checkpoint import layout as ckpt_layout
from xirang_hpc.checkpoint.identity import experiment_key, flatten, read_identity, write_identity
from xirang_hpc.checkpoint.naming import committed_steps
from xirang_hpc.checkpoint.rollback import fork_for_resume, forked_at
from xirang_hpc.config.errors import ConfigError
from xirang_hpc.config.schema import XirangConfig
from xirang_hpc.data.prepare import is_prepared
from xirang_hpc.planner.formulas import model_params
from xirang_hpc.submit.rundir import make_private_dir, run_dir_for

# Bytes per parameter in one checkpoint: fp32 weights + AdamW's two fp32 moments.
CKPT_BYTES_PER_PARAM = 12


class PreflightError(ConfigError):
    """A launch refused before anything was written or started (exit 2); the message is the whole story."""

    def __init__(self, field: str, value: Any, message: str) -> None:
        self.field, self.value, self.fix = field, value, message
        ValueError.__init__(self, message)


@dataclass
class RunStatus:
    """What an existing run directory holds, as far as a launch is concerned."""

    run_dir: Path
    last_step: int | None  # newest committed checkpoint step that passes verification (None: no such checkpoint)
    complete: bool  # that checkpoint is at or past the launch's end step
    corrupt: tuple[tuple[int, str], ...] = ()  # newer committed steps that fail verification, with why


# ---- writable paths ---------------------------------------------------------------------------

def _existing_ancestor(path: Path) -> Path:
    p = path
    while not p.exists() and p != p.parent:
        p = p.parent
    return p


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def _why(exc: OSError) -> str:
    if exc.errno == errno.EROFS:
        return "it is on a read-only file system"
    if exc.errno in (errno.EACCES, errno.EPERM):
        return f"permission denied for uid {os.getuid()}"
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return "no space left on the device (or quota exceeded)"
    if exc.errno == errno.ENOENT:  # e.g. /proc or /sys: the directory exists but takes no new entries
        return "its file system does not allow creating directories there"
    return exc.strerror or str(exc)


def check_writable(path: Path, field: str, what: str, need_bytes: int = 0, need_what: str = "") -> None:
    """Raise :class:`PreflightError` unless ``path`` can be created/written and has ``need_bytes`` free.

    Probes for real (a temporary directory, removed at once) in ``path`` or its nearest existing
    ancestor: permission bits do not stop root, but a read-only mount or a kernel filesystem does.
    """
    path = Path(path).expanduser().absolute()
    base = _existing_ancestor(path)
    fix = f"set {field}= to a writable directory with room, or fix {base}"
    if not base.is_dir():
        raise PreflightError(field, str(path), f"{what} {path}: {base} exists and is not a directory; {fix}")
    try:
        probe = tempfile.mkdtemp(prefix=".xirang-probe-", dir=base)
        os.rmdir(probe)
    except OSError as exc:
        where = "" if base == path else f" (it would be created under {base})"
        raise PreflightError(field, str(path),
                             f"{what} {path} is not writable{where}: {_why(exc)}; {fix}") from None
    if need_bytes:
        st = os.statvfs(base)
        free = st.f_bavail * st.f_frsize
        if free < need_bytes:
            raise PreflightError(field, str(path),
                                 f"{what} {path}: only {_human(free)} free on its file system, but {need_what} "
                                 f"needs about {_human(need_bytes)}; {fix}")


def checkpoint_bytes(cfg: XirangConfig) -> int:
    """Estimated size of one checkpoint: parameters + AdamW state in fp32 (12 bytes per parameter)."""
    return CKPT_BYTES_PER_PARAM * model_params(cfg.model)


MEMORY_FS = ("tmpfs", "ramfs")


def filesystem_type(path: Path, mounts: Path = Path("/proc/mounts")) -> str | None:
    """The type of the filesystem holding ``path`` (its longest mount point in ``/proc/mounts``), or None."""
    try:
        rows = [line.split() for line in mounts.read_text().splitlines()]
    except OSError:
        return None
    target = str(path.resolve())
    best, kind = "", None
    for row in rows:
        if len(row) < 3:
            continue
        point = row[1].replace("\\040", " ")
        if (target == point or target.startswith(point.rstrip("/") + "/")) and len(point) >= len(best):
            best, kind = point, row[2]
    return kind


def check_memory_dir(cfg: XirangConfig, mounts: Path = Path("/proc/mounts")) -> None:
    """``checkpoint.memory_dir`` must be memory (tmpfs): on a disk the "in-memory" copy is a second disk write
    that survives nothing a node loss does not take with it. Checked where the path exists on this node."""
    c = cfg.checkpoint
    if not (c.in_memory and c.memory_dir) or not Path(c.memory_dir).exists():
        return
    kind = filesystem_type(Path(c.memory_dir), mounts)
    if kind is not None and kind not in MEMORY_FS:
        raise PreflightError("checkpoint.memory_dir", c.memory_dir,
                             f"checkpoint.memory_dir={c.memory_dir} is on a {kind} filesystem, not in memory; use "
                             "a node-local tmpfs (e.g. /dev/shm, the default with checkpoint.memory_dir='')")


def check_device_memory(cfg: XirangConfig) -> None:
    """A layout the planner's memory model says cannot fit the GPUs is refused before the queue wait.

    Per-rank parameters, gradients, optimizer state and activations of the configured layout (the estimate
    ``xirang-plan --layout config`` prints) against the GPU preset's memory. Only with GPUs: a CPU rank's
    memory is the node's RAM, which ``cluster.mem_gb`` and the cgroup govern. ``parallel=auto`` chooses a
    layout that fits by itself.
    """
    if cfg.cluster.gpus_per_node <= 0 or cfg.parallel.auto:
        return
    from xirang_hpc.planner.auto import problem_of
    from xirang_hpc.planner.cost import estimate
    from xirang_hpc.planner.evaluate import plan_from_config

    pb = problem_of(cfg)
    est = estimate(pb, plan_from_config(cfg))
    if est.fits:
        return
    gib = 2**30
    mem = {k: v for k, v in est.memory.items() if k != "total"}
    top = max(mem, key=lambda k: mem[k])
    parts = ", ".join(f"{k} {v / gib:.1f}" for k, v in sorted(mem.items(), key=lambda kv: -kv[1]) if v > 0)
    ways = ("parallel.recompute=full, a smaller micro-batch (train.grad_accum), parallel.tp or parallel.pp, or a "
            "shorter model.seq_len" if top == "activations" else
            "parallel.zero=1..3 or FSDP (parallel=fsdp), parallel.tp or parallel.pp, or more nodes")
    raise PreflightError("model.seq_len" if top == "activations" else "parallel", cfg.model.seq_len,
                         f"this layout needs ~{est.peak_memory / gib:.1f} GiB per GPU and a {pb.hw.name} has "
                         f"{pb.hw.mem_gb:.0f} GiB ({parts} GiB; model.seq_len={cfg.model.seq_len}, "
                         f"{est.plan.label()}); fit it with {ways}; xirang-plan ranks the layouts that fit")


def check_paths(cfg: XirangConfig, run_dir: Path) -> None:
    """Every directory the launch and the job will write: runs root, run dir, checkpoints, data."""
    if not cfg.train.run_dir:
        check_writable(Path(cfg.train.runs_root), "train.runs_root", "runs root")
    check_writable(run_dir, "train.run_dir", "run directory")
    if cfg.checkpoint.enabled:
        need = checkpoint_bytes(cfg)
        check_writable(run_dir / "checkpoints", "train.run_dir", "checkpoint directory", need,
                       f"one checkpoint of model {cfg.model.name} (parameters + AdamW state, fp32)")
    data = Path(cfg.data.out_dir).expanduser().absolute()
    if is_prepared(data):
        if not os.access(data, os.R_OK | os.X_OK):
            raise PreflightError("data.out_dir", str(data), f"data directory {data} is not readable; fix its "
                                 "permissions or set data.out_dir= to a readable prepared directory")
    else:
        check_writable(data, "data.out_dir", "data directory (to prepare the corpus into)")


# ---- run identity --------------------------------------------------------------------------------

def recorded_identity(run_dir: Path) -> tuple[dict[str, Any] | None, str]:
    """(identity key, where it came from) of an existing run directory; (None, "") when it has none.

    A run made before ``identity.json`` existed is identified by the config in its newest checkpoint.
    """
    try:
        rec = read_identity(run_dir)
    except (OSError, ValueError) as exc:
        path = run_dir / "identity.json"
        raise PreflightError("train.run_dir", str(run_dir),
                             f"{path} cannot be read ({exc}); it records what this run trains, so nothing was "
                             f"started: restore it, or remove it to identify the run by its newest checkpoint"
                             ) from None
    if rec is not None:
        return rec, str(run_dir / "identity.json")
    root = run_dir / "checkpoints"
    for step in reversed(committed_steps(root)):
        try:
            cfg = ckpt_layout.read_state(root / ckpt_layout.step_dir_name(step)).get("config")
        except (OSError, ValueError):
            continue
        if cfg:
            from xirang_hpc.checkpoint.identity import key_of_dict

            return key_of_dict(cfg, strict=False), f"the config in checkpoint step {step}"
    return None, ""


def differences(recorded: dict[str, Any], current: dict[str, Any], prefixes: tuple[str, ...] = ()) -> list[
        tuple[str, Any, Any]]:
    """(field, recorded value, current value) for fields both know that differ (optionally only ``prefixes``)."""
    old, new = flatten(recorded), flatten(current)
    out = []
    for k in sorted(set(old) & set(new)):
        if prefixes and not k.startswith(prefixes):
            continue
        if _norm(old[k]) != _norm(new[k]):
            out.append((k, old[k], new[k]))
    return out


def _norm(v: Any) -> Any:
    # JSON turns tuples into lists and may print 3e-3 and 0.003 differently: compare canonically.
    return json.loads(json.dumps(v))


def _refusal(run_dir: Path, source: str, diffs: list[tuple[str, Any, Any]], steps: list[int],
             fork_ok: bool) -> str:
    lines = [f"run directory {run_dir} holds a different run than this launch would train "
             f"(recorded in {source}); nothing was written and nothing started:"]
    lines += [f"  {k}: the run has {old!r}, this launch has {new!r}" for k, old, new in diffs]
    only_steps = [k for k, _, _ in diffs] == ["train.max_steps"]
    lines.append("ways out:")
    if only_steps:
        old, new = diffs[0][1], diffs[0][2]
        if new > old:
            lines.append(f"  - extend this run: keep train.max_steps={old} and add train.extend_to={new} "
                         "(resumes from its last checkpoint; the extra steps run at the final LR)")
    lines.append("  - a new run directory: drop train.run_dir (each experiment gets "
                 "train.runs_root/<name>-<model>-<hash>) or set train.run_dir=<another directory>")
    if fork_ok and steps:
        lines.append(f"  - fork this run from one of its checkpoints, keeping its history: train.resume_from=STEP "
                     f"(steps {steps})")
    elif steps:
        lines.append("  - (train.resume_from=STEP cannot fork it: its checkpoints hold another model shape "
                     "or tokenizer)")
    return "\n".join(lines)


# Fields a fork (train.resume_from) must share with its parent: its checkpoints must load.
FORK_FIXED = ("model.", "data.tokenizer")
FORK_EXEMPT = ("model.init_from",)


def check_identity(cfg: XirangConfig, run_dir: Path) -> RunStatus:
    """Refuse a launch whose config does not match what ``run_dir`` already trained; report completion."""
    steps = committed_steps(run_dir / "checkpoints") if run_dir.is_dir() else []
    last = steps[-1] if steps else None
    recorded, source = recorded_identity(run_dir) if run_dir.is_dir() else (None, "")
    if recorded is not None:
        current = experiment_key(cfg)
        forking = cfg.train.resume_from >= 0
        diffs = differences(recorded, current, FORK_FIXED if forking else ())
        diffs = [d for d in diffs if not d[0].startswith(FORK_EXEMPT)] if forking else diffs
        if diffs:
            fork_ok = not any(k.startswith(FORK_FIXED) and not k.startswith(FORK_EXEMPT) for k, _, _ in diffs)
            raise PreflightError(diffs[0][0], diffs[0][2], _refusal(run_dir, source, diffs, steps, fork_ok))
    # Completion counts loadable checkpoints only: a finished run whose final step is damaged is not
    # finished; the launch resumes from the newest good step and writes the final one again.
    corrupt: list[tuple[int, str]] = []
    if last is not None:
        last, corrupt = ckpt_layout.newest_good(run_dir / "checkpoints")
    fork = cfg.train.resume_from
    if fork >= 0 and fork not in steps and forked_at(run_dir) != fork:
        raise PreflightError("train.resume_from", fork,
                             f"train.resume_from={fork}: {run_dir} has no checkpoint for step {fork} "
                             f"(it has {steps or 'none'}); name one of its steps (xirang-ckpt list {run_dir})")
    complete = cfg.train.resume_from < 0 and last is not None and last >= cfg.train.end_step
    return RunStatus(run_dir=run_dir, last_step=last, complete=complete, corrupt=tuple(corrupt))


def corrupt_message(status: RunStatus) -> str | None:
    """What a launch says of checkpoints that fail verification (None when all are good)."""
    if not status.corrupt:
        return None
    lines = [f"checkpoint step {s} of {status.run_dir} fails verification: {why}" for s, why in status.corrupt]
    nxt = (f"resuming from step {status.last_step}, the newest good checkpoint" if status.last_step is not None
           else "no good checkpoint is left: training starts from step 0")
    return "\n".join(lines) + f"\nthe run is not complete; {nxt} (the damaged steps are replaced as they are " \
        "saved again and leave the retention window)"


def preflight(cfg: XirangConfig) -> RunStatus:
    """Every check, writing nothing: run identity (refused on mismatch), completion, then the paths.

    Raises :class:`PreflightError`. A complete run is returned as such (``status.complete``) without
    the path checks: the caller reports it and starts nothing.
    """
    run_dir = run_dir_for(cfg)
    status = check_identity(cfg, run_dir)
    if not status.complete:
        check_device_memory(cfg)
        check_paths(cfg, run_dir)
        check_memory_dir(cfg)
        check_tracking(cfg)
    return status


def _reachable(uri: str, timeout_s: float) -> str | None:
    """None when an HTTP server answers at ``uri`` (any status), else why not."""
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(uri, timeout=timeout_s):  # noqa: S310 - the user's own tracking URI
            return None
    except urllib.error.HTTPError:
        return None  # it answered
    except (urllib.error.URLError, OSError, ValueError) as exc:
        return str(getattr(exc, "reason", exc))


def check_tracking(cfg: XirangConfig, probe: Any = _reachable, timeout_s: float = 5.0) -> None:
    """An MLflow server the run will log to answers now, not only after the queue wait (http/https URIs)."""
    uri = cfg.train.mlflow_uri
    if "mlflow" not in cfg.train.loggers or not uri.startswith(("http://", "https://")):
        return
    why = probe(uri, timeout_s)
    if why is not None:
        raise PreflightError("train.mlflow_uri", uri,
                             f"train.mlflow_uri={uri}: the MLflow server does not answer from this node ({why}, "
                             f"{timeout_s:.0f} s): start "
                             "it, fix the URI, or leave train.mlflow_uri empty for the run's own store <run>/mlruns")


def open_run_dir(cfg: XirangConfig) -> Path:
    """:func:`preflight` passed: create the private run directory and record its identity (first launch).

    With ``train.resume_from=STEP`` the directory the job trains in is the fork (made here, once; a later
    launch of the same command finds it): the job's events, checkpoints, metrics, markers and records all go
    there, and the batch step watches the same directory. The run it forks from is left as it was.
    """
    run_dir = make_private_dir(run_dir_for(cfg), cfg.checkpoint.dir_mode)
    step = cfg.train.resume_from
    if step < 0:
        if read_identity(run_dir) is None:
            write_identity(run_dir, cfg)
        return run_dir
    fork = fork_for_resume(run_dir, step, cfg.checkpoint.dir_mode)
    # A fork may change optimisation fields: it records its own identity, never in the run it forks from.
    if fork != run_dir and read_identity(fork) is None:
        write_identity(fork, cfg, forked_from=str(run_dir), fork_step=step)
        print(f"train.resume_from={step}: forked {run_dir} -> {fork}; the original history is untouched",
              flush=True)
    return fork


def complete_message(cfg: XirangConfig, status: RunStatus) -> str:
    """What a launch on a finished run prints (and how to train it further)."""
    t = cfg.train
    nxt = max(status.last_step or 0, t.end_step) * 2
    return (f"run {status.run_dir} is complete: its last checkpoint is step {status.last_step} of "
            f"{t.end_step}; nothing to do, nothing started.\n"
            f"to train it further, rerun the same command with train.extend_to=N (e.g. train.extend_to={nxt}): "
            f"it resumes from step {status.last_step}, and the extra steps run at the final LR")
