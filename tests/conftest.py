"""Shared fixtures: prepared corpora, one trained run for the whole session, Hydra composition helpers."""

from __future__ import annotations

import contextlib
import copy
import os
import shutil
import stat
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from filelock import FileLock
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig

from xirang_hpc.runtime.startup import TRAINING_STACK, import_paused
from xirang_hpc.submit.hydra_setup import register_configs

ROOT = Path(__file__).resolve().parents[1]
CONF_DIR = str(ROOT / "xirang_hpc" / "conf")
TIERS = ("unit", "slow", "slurm")
# The users' own audit trails of the commands the tests run go to a scratch state directory, not ~.
os.environ.setdefault("XDG_STATE_HOME", f"/tmp/xirang-test-state-{os.getuid()}")


@contextlib.contextmanager
def slurm_conf_env(conf: str) -> Iterator[str]:
    """``SLURM_CONF=conf`` for the block, the previous value restored after (also when the block skips):
    Slurm's clients and submitit read it from the environment."""
    old = os.environ.get("SLURM_CONF")
    os.environ["SLURM_CONF"] = conf
    try:
        yield conf
    finally:
        if old is None:
            os.environ.pop("SLURM_CONF", None)
        else:
            os.environ["SLURM_CONF"] = old


@contextlib.contextmanager
def testbed_held(env: dict[str, str] | None = None) -> Iterator[str]:
    """Every CPU of the testbed's two nodes held by a ``high`` job for the block (cancelled after, however the
    block ends): what is submitted meanwhile stays PENDING, so a test reads Slurm's view of its jobs before any
    can run, however slow the machine is. ``env``: the testbed's environment (default: this process's)."""
    blocker = subprocess.run(["sbatch", "--parsable", "-p", "high", "-N2", "--ntasks-per-node=8", "-o", "/dev/null",
                              "--wrap", "sleep 600"], capture_output=True, text=True, env=env, check=True,
                             timeout=300).stdout.strip()
    try:
        yield blocker
    finally:
        subprocess.run(["scancel", blocker], env=env, check=False, timeout=300)


def registered_clusters(conf: str, timeout: float = 300) -> tuple[subprocess.CompletedProcess, list[str]]:
    """Clusters registered in the testbed's slurmdbd whose slurmctld has connected (a control port): the ones a
    job can be submitted to. Returns sacctmgr's result too, for skip messages."""
    out = subprocess.run(["sacctmgr", "-n", "-P", "show", "cluster", "format=cluster,controlport"],
                         capture_output=True, text=True, env={**os.environ, "SLURM_CONF": conf}, timeout=timeout)
    return out, [ln.split("|")[0] for ln in out.stdout.split() if ln.split("|")[-1] not in ("", "0")]


# The files that hold the slurm tier (checked at collection). Under pytest-xdist (`make test`) they run one test
# after another on the worker that holds their testbed, because a testbed has two nodes (a test that fills a
# partition or preempts a job must not meet another test's job there); every other file runs whole on one
# worker, so that its module-scoped fixtures (process groups, trained runs) are built once.
SLURM_FILES = {"test_injob_slurm.py", "test_monitor_slurm.py", "test_pipeline_slurm.py", "test_slurm_accounting.py",
               "test_slurm_clusters.py", "test_slurm_e2e.py", "test_slurm_preempt_stages.py", "test_slurm_sched.py",
               "test_slurm_sites.py"}
# With a second testbed (``XIRANG_SLURM_CONF_B``, which CI starts), these files run on it, on their own worker,
# beside the others on the first: the two halves of the slurm tier take about the same time (estimated from
# the last CI's durations, ~13 min each once preemptions no longer met Slurm's 2-minute requeue hold).
SLURM_FILES_B = {"test_injob_slurm.py", "test_monitor_slurm.py", "test_slurm_preempt_stages.py"}


def slurm_conf_for(test_file: str | Path) -> str | None:
    """SLURM_CONF of the testbed that ``test_file``'s tests run on: ``XIRANG_SLURM_CONF_B`` for the files of
    :data:`SLURM_FILES_B` when it is set, else ``XIRANG_SLURM_CONF`` (None: no testbed was given)."""
    if Path(test_file).name in SLURM_FILES_B and os.environ.get("XIRANG_SLURM_CONF_B"):
        return os.environ["XIRANG_SLURM_CONF_B"]
    return os.environ.get("XIRANG_SLURM_CONF") or None


def _testbed_scope(path: str) -> str | None:
    """The xdist scope of a slurm file: one per testbed."""
    name = Path(path).name
    if name not in SLURM_FILES:
        return None
    return "slurm-testbed-b" if name in SLURM_FILES_B and os.environ.get("XIRANG_SLURM_CONF_B") else "slurm-testbed"


@pytest.hookimpl(optionalhook=True)
def pytest_configure(config: pytest.Config) -> None:
    """In a process that runs tests (not pytest-xdist's controller, which runs none): what most test modules
    import, imported once with the garbage collector paused and then frozen, as a rank does
    (runtime/startup.py), so that later collections in this long-lived process skip it."""
    if getattr(config, "workerinput", None) is not None or not getattr(config.option, "numprocesses", None):
        import_paused(TRAINING_STACK)


def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """``--dist loadfile`` with the slurm files of each testbed as one unit (see :data:`SLURM_FILES`)."""
    if config.getoption("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class TierScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return _testbed_scope(path) or path

    return TierScheduling(config, log)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Every test belongs to exactly one tier: a test not marked ``slow`` or ``slurm`` is ``unit``. Under
    pytest-xdist the longest tiers first (the testbed's, then the tests that train), so that no worker
    starts one last."""
    rank = {}
    for item in items:
        tiers = [t for t in TIERS if item.get_closest_marker(t) is not None]
        if not tiers:
            item.add_marker(pytest.mark.unit)
        elif "slurm" in tiers and "slow" in tiers:
            raise pytest.UsageError(f"{item.nodeid}: marked both slow and slurm; a test has one tier")
        elif "slurm" in tiers and item.path.name not in SLURM_FILES:
            raise pytest.UsageError(f"{item.nodeid}: a slurm test in a file not listed in conftest.SLURM_FILES")
        rank[item.nodeid] = 0 if "slurm" in tiers else 1 if "slow" in tiers else 2
    if os.environ.get("PYTEST_XDIST_WORKER"):  # one process keeps the files' order
        items.sort(key=lambda item: rank[item.nodeid])


def shared_dir(tmp_path_factory: pytest.TempPathFactory, name: str, build: Callable[[Path], None]) -> Path:
    """``name``, a directory that ``build`` fills once per test run, also when pytest-xdist runs several
    workers: the first worker to ask builds it in the run's common temporary directory (under a file lock),
    the others wait and reuse it. A build that fails leaves nothing behind, so the next one starts clean."""
    if "PYTEST_XDIST_WORKER" not in os.environ:
        out = tmp_path_factory.mktemp(name)
        build(out)
        return out
    out = tmp_path_factory.getbasetemp().parent / name
    with FileLock(f"{out}.lock"):
        done = out.with_name(f"{name}.done")
        if not done.exists():
            shutil.rmtree(out, ignore_errors=True)
            out.mkdir()
            try:
                build(out)
            except BaseException:
                shutil.rmtree(out, ignore_errors=True)
                raise
            done.touch()
    return out


_COMPOSED: dict[tuple[str, ...], DictConfig] = {}


def committed_stub(step_dir: Path) -> Path:
    """A committed checkpoint with no tensors (a manifest listing no files), for tests of what reads the
    step list: status, completion, retention. An empty ``step_N`` directory is a damaged checkpoint."""
    step_dir.mkdir(parents=True, exist_ok=True)
    (step_dir / "manifest.json").write_text('{"files": {}, "refs": []}')
    return step_dir


def fake_slurm_bin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, script: str,
                   commands: tuple[str, ...] = ("sbatch", "scontrol", "squeue", "sacct", "srun")) -> Path:
    """A ``fake-bin/`` under ``tmp_path`` first on PATH, each of ``commands`` an executable copy of ``script``
    (a Python script template whose ``{python}`` is this interpreter; it tells the commands apart by the name
    it runs as). The scripts append their calls to the log named by ``FAKE_SLURM_LOG``; returns that log.
    submitit looks for ``srun`` before it submits."""
    bin_dir, log = tmp_path / "fake-bin", tmp_path / "slurm-calls.jsonl"
    bin_dir.mkdir()
    for cmd in commands:
        exe = bin_dir / cmd
        exe.write_text(script.format(python=sys.executable))
        exe.chmod(exe.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_SLURM_LOG", str(log))
    log.touch()
    return log


def compose_cfg(overrides: list[str] | None = None) -> DictConfig:
    """Compose the root config exactly as xirang-train does.

    Composed once per list of overrides in a test process (Hydra's compose reads every YAML group again:
    ~0.1 s of CPU, and the suite composes the same lists hundreds of times); each call gets its own deep
    copy, so a test that changes its config changes nobody else's."""
    key = tuple(overrides or ())
    if key not in _COMPOSED:
        _COMPOSED[key] = _values_over_base(key)
        if _COMPOSED[key] is None:
            register_configs()
            with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
                _COMPOSED[key] = compose(config_name="config", overrides=list(key))
    return copy.deepcopy(_COMPOSED[key])


def _values_over_base(overrides: tuple[str, ...]) -> DictConfig | None:
    """``overrides`` applied to the composed defaults, when each only sets an existing value (``train.lr=1e-3``,
    ``train.loggers=[jsonl,mlflow]``): what Hydra's compose gives for them (it applies value overrides after
    the defaults, each parsed by the same parser), without re-reading every YAML group. None for anything else
    (a group choice, ``+``/``~``, a sweep, a dict, a key or value the schema refuses): then Hydra composes, and
    refuses as it does."""
    if not overrides:
        return None
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from omegaconf import OmegaConf

    try:
        parsed = OverridesParser.create().parse_overrides(list(overrides))
    except Exception:
        return None
    base = compose_cfg()
    missing = object()
    for o in parsed:
        if (o.is_add() or o.is_delete() or o.is_force_add() or o.is_sweep_override() or o.package is not None
                or "." not in o.key_or_group or OmegaConf.select(base, o.key_or_group, default=missing) is missing):
            return None
        value = o.value()
        if isinstance(value, dict) or isinstance(OmegaConf.select(base, o.key_or_group), DictConfig):
            return None
        try:
            OmegaConf.update(base, o.key_or_group, value, merge=False)
        except Exception:
            return None
    return base


@pytest.fixture
def small_corpus(tmp_path: Path) -> Path:
    """A corpus of a few text files (a few KB) with a nested directory."""
    root = tmp_path / "corpus"
    (root / "pkg").mkdir(parents=True)
    for i in range(12):
        body = "".join(f"def f{i}_{j}(x):\n    return x * {j} + {i}\n\n" for j in range(40))
        (root / ("pkg" if i % 2 else "") / f"mod{i}.py").write_text(body)
    return root


@pytest.fixture(scope="session")
def stdlib_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The default corpus (this interpreter's stdlib), prepared once per test session."""
    from xirang_hpc.data.prepare import prepare

    return shared_dir(tmp_path_factory, "stdlib-bytes", lambda out: prepare("stdlib", out))


@pytest.fixture(scope="session")
def email_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small real corpus for the parallel-layout tests: the stdlib ``email`` package (~1 MB), byte-tokenized."""
    import sysconfig

    from xirang_hpc.data.prepare import prepare

    email = Path(sysconfig.get_paths()["stdlib"]) / "email"
    return shared_dir(tmp_path_factory, "email-bytes", lambda out: prepare(str(email), out, val_fraction=0.2))


@pytest.fixture(scope="session")
def source_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """This package's own sources (~1 MB of Python), byte-tokenized, 5% held out: prepared once per session."""
    from xirang_hpc.data.prepare import prepare

    return shared_dir(tmp_path_factory, "source-bytes",
                      lambda out: prepare(str(ROOT / "xirang_hpc"), out / "data", val_fraction=0.05)) / "data"


# The session's trained run: the embedded default (`make demo`'s layout: 4 gloo ranks on 2 virtual
# nodes, 2 pipeline stages x 2 data-parallel replicas) for TRAINED_STEPS steps.
TRAINED_STEPS = 100
TRAINED_LOG_EVERY = 20


@dataclass(frozen=True)
class TrainedRun:
    """A finished ``xirang-train`` run: its directory, its data, and what the command printed."""

    run: Path
    data: Path
    stdout: str
    stderr: str
    steps: int = TRAINED_STEPS
    log_every: int = TRAINED_LOG_EVERY


def _snapshot(root: Path) -> dict[str, tuple[int, int]]:
    """Every file under ``root`` with its size and mtime: any write shows up. Not the run's audit trail: it records
    the readers too (an export, a server and its requests append to it), which changes nothing the run is."""
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in sorted(root.rglob("*")) if p.is_file() and p.relative_to(root) != Path("audit.jsonl")}


@pytest.fixture(scope="session")
def trained_run(tmp_path_factory: pytest.TempPathFactory, source_data: Path) -> Iterator[TrainedRun]:
    """One real ``xirang-train`` run, trained once per session and shared by the tests that only read it
    (the end-to-end run's output, serving, export, eval). A test that writes into a run uses
    ``trained_run_copy`` instead, so that the next reader sees the run exactly as training left it."""
    def train(tmp: Path) -> None:
        r = subprocess.run([str(Path(sys.executable).parent / "xirang-train"), f"train.max_steps={TRAINED_STEPS}",
                            "train.warmup_steps=10", f"train.log_every={TRAINED_LOG_EVERY}",
                            f"train.runs_root={tmp}/runs", f"data.out_dir={source_data}"],
                           cwd=tmp, capture_output=True, text=True, timeout=1800)  # a safety net against a hang
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        (tmp / "train.stdout").write_text(r.stdout)
        (tmp / "train.stderr").write_text(r.stderr)

    tmp = shared_dir(tmp_path_factory, "trained", train)
    (run,) = (tmp / "runs").iterdir()
    before = _snapshot(run)
    yield TrainedRun(run, source_data, (tmp / "train.stdout").read_text(), (tmp / "train.stderr").read_text())
    # A reader that wrote into the shared run would make the tests after it see another run.
    assert _snapshot(run) == before, "a test wrote into the session's trained_run: use trained_run_copy"


@pytest.fixture(scope="session")
def calibrated_preset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The preset ``xirang-plan --calibrate`` writes for this machine, measured once per session (the CLI's
    own checks in ``test_planner_cli.py``, the predictions it gives in ``test_planner_local.py``)."""
    def calibrate(tmp: Path) -> None:
        # No kill timer on the measurement itself: only a 30-minute net against a hang. One round of probe
        # runs: the tests check the preset and its memory predictions; the step-time accuracy of a default
        # (3-round) calibration is measured by benchmarks/bench_planner.py --local.
        r = subprocess.run([str(Path(sys.executable).parent / "xirang-plan"), "--calibrate", "--rounds", "1", "--out",
                            str(tmp / "local-calibrated.yaml"), f"train.runs_root={tmp}/runs"],
                           cwd=tmp, capture_output=True, text=True, timeout=1800)
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]

    return shared_dir(tmp_path_factory, "calibrated", calibrate) / "local-calibrated.yaml"


@pytest.fixture
def trained_run_copy(trained_run: TrainedRun, tmp_path: Path) -> TrainedRun:
    """A private copy of the session's trained run (same directory name) for a test that writes into it."""
    dst = tmp_path / "runs" / trained_run.run.name
    # Not the socket of the job's fork server (local/preload.py), which stays in the run's submitit folder until
    # the server's idle exit, ~30 s after the run: a socket cannot be copied, and it is no part of the run.
    shutil.copytree(trained_run.run, dst, symlinks=True, ignore=shutil.ignore_patterns(".preload-*.sock"))
    dst.chmod(trained_run.run.stat().st_mode)
    return TrainedRun(dst, trained_run.data, trained_run.stdout, trained_run.stderr)


class FakeLoop:
    """The training loop as the stop-signal hook sees it (runtime.hooks.Loop): the step, stop, phases."""

    def __init__(self, step: int, phases: list[str] | None = None) -> None:
        import types

        self.state = types.SimpleNamespace(step=step)
        self.stop_requested = False
        self.phases = [] if phases is None else phases

    def phase(self, phase: str) -> None:
        """Record the phase the hook announces."""
        self.phases.append(phase)

    def request_stop(self) -> None:
        """What the loop does on a hook's request: stop at the next step boundary."""
        self.stop_requested = True
