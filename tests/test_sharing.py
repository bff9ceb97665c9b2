"""Private by default, shared by group on purpose: real Unix users, created and removed by the test.

User ``a`` trains a tiny run on the embedded default; user ``b`` is in ``a``'s share group, user ``c`` is
not. Without ``train.share_group`` nobody but ``a`` can read anything of the run or its data; with it,
``b`` reads (``xirang-status``, ``xirang-ckpt export``) and writes nothing, and ``c`` still reads nothing.
"""

from __future__ import annotations

import os
import re
import shutil
import stat
import subprocess
import sys
import sysconfig
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

_NO_USERS = os.geteuid() != 0 or shutil.which("useradd") is None or shutil.which("runuser") is None
pytestmark = [pytest.mark.slow, pytest.mark.skipif(_NO_USERS, reason="creates Unix users (root, useradd, runuser)")]

BIN = Path(sys.executable).parent
CORPUS = Path(sysconfig.get_paths()["stdlib"]) / "email"


def _sh(*argv: str) -> None:
    subprocess.run(argv, check=True, capture_output=True, text=True)


@pytest.fixture(scope="module")
def reachable() -> Iterator[None]:
    """The interpreter, the virtualenv and this checkout reachable by other users: directories on their path
    that others cannot traverse (a pyenv under /root) get o+x for the module's tests, then their mode back."""
    changed: list[tuple[Path, int]] = []
    for target in {Path(sys.executable).resolve(), Path(sys.executable).absolute(), Path(__file__).resolve()}:
        for d in reversed(target.parents):
            mode = d.stat().st_mode
            if not mode & 0o001:
                changed.append((d, stat.S_IMODE(mode)))
                d.chmod(stat.S_IMODE(mode) | 0o001)
    try:
        yield
    finally:
        for d, mode in reversed(changed):
            d.chmod(mode)


@pytest.fixture(scope="module")
def users(reachable: None) -> Iterator[dict[str, str]]:
    """Three users and a group: a (the owner) and b are in the group, c is not."""
    tag = uuid.uuid4().hex[:6]
    names = {"a": f"xra{tag}", "b": f"xrb{tag}", "c": f"xrc{tag}", "group": f"xrg{tag}"}
    _sh("groupadd", names["group"])
    try:
        for who in ("a", "b", "c"):
            extra = ["-G", names["group"]] if who in ("a", "b") else []
            _sh("useradd", "-M", "-N", "-s", "/bin/sh", *extra, names[who])
        yield names
    finally:
        for who in ("a", "b", "c"):
            subprocess.run(["userdel", names[who]], capture_output=True)
        subprocess.run(["groupdel", names["group"]], capture_output=True)


@pytest.fixture(scope="module")
def home(users: dict[str, str]) -> Iterator[Path]:
    """A project directory of user a that others may traverse (as on a shared filesystem)."""
    base = Path(tempfile.mkdtemp(prefix="xirang-share-", dir="/tmp"))
    base.chmod(0o755)
    for who in ("a", "b", "c"):
        d = base / who
        d.mkdir()
        shutil.chown(d, users[who])
        d.chmod(0o755)
    yield base
    shutil.rmtree(base, ignore_errors=True)


def _as(user: str, *argv: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    # Not root's: its temporary directory and the compile cache torch exported there (TORCHINDUCTOR_CACHE_DIR).
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("XIRANG_SHARE", "PYTEST", "TORCHINDUCTOR_", "TRITON_")) and k != "TMPDIR"}
    env.update(HOME=str(cwd), PATH=f"{BIN}:{env.get('PATH', '/usr/bin:/bin')}")
    return subprocess.run(["runuser", "-u", user, "--", *argv], capture_output=True, text=True, cwd=cwd,
                          env=env, timeout=900)


def _train(users: dict[str, str], home: Path, name: str, *extra: str) -> Path:
    a = home / "a"
    out = _as(users["a"], str(BIN / "xirang-train"), "cluster=local", "cluster.nodes=1", "cluster.tasks_per_node=1",
              "model=tiny", f"data.corpus={CORPUS}", f"data.out_dir={a / name / 'data'}", "data.val_fraction=0.2",
              f"train.runs_root={a / name / 'runs'}", "train.max_steps=4", "checkpoint.every_steps=2",
              "train.warmup_steps=1", "train.eval_batches=1", "train.wait=true", "parallel.pp=1", "parallel.tp=1",
              *extra, cwd=a)
    assert out.returncode == 0, out.stdout + out.stderr
    return Path(re.search(r"run dir (\S+)", out.stdout).group(1))


def _entries(*roots: Path) -> list[Path]:
    return [p for r in roots for p in (r, *r.rglob("*")) if not p.is_symlink()]


def test_a_run_and_its_data_are_the_owners_only(users, home):
    run = _train(users, home, "private")
    data = home / "a" / "private" / "data"
    assert (run / "environment.json").stat().st_mode & 0o777 == 0o600  # the start recorded its environment
    import json

    (launch,) = [json.loads(x) for x in (run / "audit.jsonl").read_text().splitlines()]
    assert launch["action"] == "launch" and launch["user"] == users["a"] and launch["job"], launch
    shared = [f"{p}: {stat.filemode(p.stat().st_mode)}" for p in _entries(run, data, run.parent)
              if p.stat().st_mode & 0o077]
    assert not shared, f"readable by group or others: {shared[:10]}"
    assert all(p.stat().st_uid == int(_uid(users["a"])) for p in _entries(run, data))
    for who in ("b", "c"):
        for target in (run / "metrics.jsonl", run / "checkpoints", next(data.glob("*.h5"))):
            got = _as(users[who], "cat" if target.is_file() else "ls", str(target), cwd=home / who)
            assert got.returncode != 0 and "Permission denied" in got.stderr, (who, target, got)


def _uid(name: str) -> str:
    return subprocess.run(["id", "-u", name], capture_output=True, text=True, check=True).stdout.strip()


def test_a_shared_run_is_read_by_the_group_and_written_by_nobody_else(users, home):
    run = _train(users, home, "shared", f"train.share_group={users['group']}")
    data = home / "a" / "shared" / "data"
    import grp

    gid = grp.getgrnam(users["group"]).gr_gid
    for p in _entries(run, data, run.parent):
        mode = p.stat().st_mode
        assert not mode & 0o027, f"{p}: {stat.filemode(mode)} (group-writable or open to others)"
        assert p.stat().st_gid == gid, f"{p}: not in the share group"
        if p.is_dir():
            assert mode & 0o2050 == 0o2050, f"{p}: {stat.filemode(mode)} (not setgid r-x for the group)"
        else:
            assert mode & 0o040, f"{p}: {stat.filemode(mode)} (not group-readable)"
    b, c = home / "b", home / "c"
    status = _as(users["b"], str(BIN / "xirang-status"), str(run), cwd=b)
    assert status.returncode == 0 and "COMPLETED" in status.stdout, status.stdout + status.stderr
    export = _as(users["b"], str(BIN / "xirang-ckpt"), "export", str(run), "--out", str(b / "export"), cwd=b)
    assert export.returncode == 0, export.stdout + export.stderr
    assert (b / "export" / "model.safetensors").stat().st_uid == int(_uid(users["b"]))
    for argv in (["touch", str(run / "planted")], ["rm", "-f", str(run / "checkpoints" / "latest")],
                 ["sh", "-c", f"echo x >> {run / 'metrics.jsonl'}"], ["touch", str(data / "planted")]):
        got = _as(users["b"], *argv, cwd=b)
        assert got.returncode != 0 and "Permission denied" in got.stderr, (argv, got)
    assert (run / "checkpoints" / "latest").exists()
    got = _as(users["c"], "cat", str(run / "metrics.jsonl"), cwd=c)
    assert got.returncode != 0 and "Permission denied" in got.stderr, got


def test_share_group_is_checked_at_validation(users):
    from xirang_hpc.config.errors import ConfigError
    from xirang_hpc.config.schema.train import check_share_group

    with pytest.raises(ConfigError, match=r"train.share_group.*no such Unix group"):
        check_share_group("no-such-group-xirang")
    out = subprocess.run(["runuser", "-u", users["c"], "--", sys.executable, "-c",
                          "from xirang_hpc.config.schema.train import check_share_group as c; "
                          f"c({users['group']!r})"], capture_output=True, text=True, cwd="/")
    assert out.returncode != 0 and "you are not a member of that group" in out.stderr, out.stderr
