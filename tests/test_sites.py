"""Several clusters as one (submit/sites/): placement from `sbatch --test-only` answers, policies, dead and
unknown sites, and the verified copy of a run to another site's run root (real checkpoint files, kill -9).

The Slurm answers below were recorded on the two-cluster testbed (``tools/slurm-testbed start --clusters
alpha,beta``, Slurm 22.05): alpha full (one job on both nodes), beta idle; beta's slurmctld stopped
(SIGSTOP: the socket times out) and killed (slurmdbd then reports it unreachable); a name slurmdbd does not know.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import FakeLoop, compose_cfg

from xirang_hpc.checkpoint import layout
from xirang_hpc.checkpoint.manager import CheckpointManager
from xirang_hpc.config.errors import ConfigError
from xirang_hpc.config.schema import SiteConfig
from xirang_hpc.config.validate import load_config
from xirang_hpc.monitor.events import read_events
from xirang_hpc.slurm.accounting import Result
from xirang_hpc.submit import sites

NOW = time.mktime((2026, 11, 30, 18, 10, 9, 0, 0, -1))
# Recorded: alpha full until its filler's 20-minute limit, beta idle.
ALPHA_FULL = Result(0, "", "sbatch: Job 3 to start at 2026-11-30T18:30:06 using 1 processors on nodes sa1 in "
                           "partition low\n")
BETA_IDLE = Result(0, "", "sbatch: Job 2 to start at 2026-11-30T18:10:09 using 1 processors on nodes sb1 in "
                          "partition low\n")
ALPHA_IDLE = Result(0, "", "sbatch: Job 1 to start at 2026-11-30T18:10:09 using 2 processors on nodes sa1 in "
                           "partition low\n")
# Recorded: slurmctld stopped (SIGSTOP) -> 20 s socket timeout; killed -> unreachable; unknown name.
STOPPED = Result(1, "", "allocation failure: Socket timed out on send/recv operation\n")
KILLED = Result(1, "", "sbatch: error: 'beta' can't be reached now, or it is an invalid entry for --cluster.  Use "
                       "'sacctmgr list clusters' to see available clusters.\n")
UNKNOWN = Result(1, "", "sbatch: error: No cluster 'gamma' known by database.\nsbatch: error: 'gamma' can't be "
                        "reached now, or it is an invalid entry for --cluster.  Use 'sacctmgr list clusters' to "
                        "see available clusters.\n")
CLUSTERS = Result(0, "alpha\nbeta\n", "")


def _cfg(*over: str):
    return load_config(compose_cfg(["cluster=testbed-sites", *over]))


class FakeSlurm:
    """Answers by command: `sbatch --test-only` per cluster, `sacctmgr show cluster`, quota queries."""

    def __init__(self, test_only: dict[str, Result], assoc: dict[str, str] | None = None,
                 squeue: dict[str, str] | None = None, clusters: Result = CLUSTERS,
                 partitions: dict[str, str] | None = None) -> None:
        self.answers, self.assoc, self.squeue, self.clusters = test_only, assoc or {}, squeue or {}, clusters
        self.partitions = partitions or {}  # site -> `scontrol -o show partition` (none: scontrol fails)
        self.calls: list[list[str]] = []

    def __call__(self, argv: list[str]) -> Result:
        self.calls.append(argv)
        if argv[0] == "sbatch":
            assert "--test-only" in argv, argv  # placement never submits
            site = next(a.split("=", 1)[1] for a in argv if a.startswith("--clusters="))
            return self.answers[site]
        if argv[:4] == ["sacctmgr", "-n", "-P", "show"] and argv[4] == "cluster":
            return self.clusters
        if argv[0] == "sacctmgr":
            site = next(a.split("=", 1)[1] for a in argv if a.startswith("cluster="))
            return Result(0, self.assoc.get(site, ""), "")
        if argv[0] == "scancel":
            return Result(0, "", "")
        if argv[0] == "scontrol" and "partition" in argv:
            site = argv[argv.index("-M") + 1]
            return Result(0, self.partitions[site], "") if site in self.partitions else Result(1, "", "down")
        if argv[0] == "squeue":
            return Result(0, self.squeue.get(argv[argv.index("-M") + 1], ""), "")
        raise AssertionError(f"unexpected command {argv}")


def test_preset_lists_both_testbed_sites_with_separate_run_roots():
    c = _cfg().cluster
    assert [s.name for s in c.sites] == ["alpha", "beta"]
    assert [s.shared_fs for s in c.sites] == [False, False]
    assert len({s.run_root for s in c.sites}) == 2


def test_parse_recorded_test_only_answer():
    e = sites.parse_test_only("alpha", ALPHA_FULL, NOW)
    assert e.alive and e.nodes == "sa1" and e.partition == "low"
    assert e.wait_s == pytest.approx(20 * 60 - 3, abs=1)
    dead = sites.parse_test_only("beta", STOPPED, NOW)
    assert not dead.alive and "Socket timed out" in dead.error


def test_test_only_argv_carries_the_site_and_the_jobs_shape():
    cfg = _cfg("cluster.nodes=2", "cluster.sites.1.account=projb")
    argv = sites.test_only_argv(cfg.cluster, cfg.cluster.sites[1])
    assert argv[:3] == ["sbatch", "--test-only", "--clusters=beta"]
    assert "--nodes=2" in argv and "--account=projb" in argv and "--partition=low" in argv and "--time=30" in argv


def test_full_site_sends_the_job_to_the_idle_one_and_records_the_evidence(tmp_path):
    cfg = _cfg()
    fake = FakeSlurm({"alpha": ALPHA_FULL, "beta": BETA_IDLE})
    p = sites.place(cfg, run=fake, now=lambda: NOW)
    assert p.site.name == "beta" and not p.warnings
    text = p.describe()
    assert "site beta" in text and "alpha: starts in 1197s" in text and "beta: starts in 0s" in text
    sites.record_placement(tmp_path, p)
    ev = [e for e in read_events(tmp_path) if e["kind"] == "placement"][-1]
    assert ev["site"] == "beta" and {e["site"] for e in ev["estimates"]} == {"alpha", "beta"}
    # Nothing but --test-only reached sbatch.
    assert all("--test-only" in a for a in fake.calls if a[0] == "sbatch")


def test_idle_first_site_wins_when_both_are_free():
    p = sites.place(_cfg(), run=FakeSlurm({"alpha": ALPHA_IDLE, "beta": BETA_IDLE}), now=lambda: NOW)
    assert p.site.name == "alpha"  # equal starts: the first in name order, deterministic


@pytest.mark.parametrize("dead", [STOPPED, KILLED])
def test_dead_site_gets_a_warning_naming_it_and_the_job_goes_elsewhere(dead):
    p = sites.place(_cfg(), run=FakeSlurm({"alpha": ALPHA_FULL, "beta": dead}), now=lambda: NOW)
    assert p.site.name == "alpha"
    assert len(p.warnings) == 1 and "site beta does not answer" in p.warnings[0]


def test_all_sites_dead_is_a_clear_error_and_nothing_is_submitted():
    fake = FakeSlurm({"alpha": STOPPED, "beta": KILLED})
    with pytest.raises(sites.NoSiteAvailable) as exc:
        sites.place(_cfg(), run=fake, now=lambda: NOW)
    msg = str(exc.value)
    assert "alpha" in msg and "beta" in msg and "nothing was submitted" in msg
    assert not [a for a in fake.calls if a[0] == "sbatch" and "--test-only" not in a]


def test_site_unknown_to_slurmdbd_is_refused_with_the_registered_names():
    cfg = _cfg("cluster.sites.1.name=gamma")
    with pytest.raises(ConfigError) as exc:
        sites.place(cfg, run=FakeSlurm({"alpha": ALPHA_IDLE, "gamma": UNKNOWN}), now=lambda: NOW)
    assert "gamma" in str(exc.value) and "['alpha', 'beta']" in str(exc.value)
    # slurmdbd not answering sacctmgr: sbatch's own "No cluster ... known" still refuses it.
    with pytest.raises(ConfigError, match="not a cluster registered in slurmdbd"):
        sites.place(cfg, run=FakeSlurm({"alpha": ALPHA_IDLE, "gamma": UNKNOWN}, clusters=Result(1, "", "down")),
                    now=lambda: NOW)


def test_quota_policy_prefers_the_site_with_most_free_quota():
    assoc = {"alpha": "|cpu=16\nroot|\n", "beta": "|cpu=4\nroot|\n"}  # account row first, as sacctmgr prints
    squeue = {"alpha": "2\n", "beta": "3\n"}
    fake = FakeSlurm({"alpha": ALPHA_FULL, "beta": BETA_IDLE}, assoc, squeue)
    p = sites.place(_cfg("cluster.site_policy=quota"), run=fake, now=lambda: NOW)
    assert p.site.name == "alpha" and "14 CPUs" in p.reason
    assert [e.free_cpus for e in p.estimates] == [14, 1]
    # The same answers under the default policy: the earliest start.
    assert sites.place(_cfg(), run=fake, now=lambda: NOW).site.name == "beta"


def test_stay_policy_keeps_the_site_unless_another_saves_more_than_the_margin():
    cfg = _cfg("cluster.site_policy=stay", "cluster.site_stay_s=1800")
    fake = FakeSlurm({"alpha": ALPHA_FULL, "beta": BETA_IDLE})
    p = sites.place(cfg, current="alpha", run=fake, now=lambda: NOW)
    assert p.site.name == "alpha" and "stays" in p.reason
    cfg = _cfg("cluster.site_policy=stay", "cluster.site_stay_s=600")
    p = sites.place(cfg, current="alpha", run=fake, now=lambda: NOW)
    assert p.site.name == "beta" and "moves" in p.reason
    assert sites.should_migrate("alpha", p, wait_limit_s=120)
    assert not sites.should_migrate("alpha", p, wait_limit_s=3600)  # its requeue there waits only 20 min


@pytest.mark.parametrize("over,field", [
    (["cluster.site_policy=cheapest"], "cluster.site_policy"),
    (["cluster.site_stay_s=-1"], "cluster.site_stay_s"),
    (["cluster.sites.1.name=alpha"], "cluster.sites"),
    (["cluster.sites.0.run_root="], "cluster.sites[alpha].run_root"),
    (["cluster.executor=local"], "cluster.sites"),
])
def test_bad_site_config_is_refused_naming_the_field(over, field):
    with pytest.raises(ConfigError) as exc:
        _cfg(*over)
    assert field in str(exc.value)


def test_apply_site_sets_account_and_run_root(tmp_path):
    cfg = _cfg("cluster.sites.1.account=projb", f"cluster.sites.1.run_root={tmp_path}/beta")
    out = sites.apply_site(cfg, cfg.cluster.sites[1])
    assert out.cluster.account == "projb" and out.train.runs_root == f"{tmp_path}/beta"
    lines: list[str] = []
    cfg2, p = sites.place_for_launch(cfg, run=FakeSlurm({"alpha": ALPHA_FULL, "beta": BETA_IDLE}), out=lines.append)
    assert p is not None and p.site.name == "beta" and cfg2.cluster.account == "projb"
    assert lines and lines[0].startswith("placement: site beta")


# `scontrol -M alpha -o show partition` on the two-cluster testbed (Slurm 22.05), trimmed.
PARTITIONS = ("PartitionName=low AllowGroups=ALL Default=YES GraceTime={grace} MaxTime=UNLIMITED Nodes=sa[1-2] "
              "PriorityTier=1 PreemptMode=REQUEUE State=UP TotalCPUs=16\n"
              "PartitionName=high AllowGroups=ALL Default=NO GraceTime=0 MaxTime=UNLIMITED Nodes=sa[1-2] "
              "PriorityTier=10 PreemptMode=OFF State=UP TotalCPUs=16\n")


def test_a_grace_time_too_short_for_a_move_is_named_at_launch():
    cfg = _cfg()
    fake = FakeSlurm({"alpha": ALPHA_IDLE, "beta": ALPHA_FULL}, partitions={"alpha": PARTITIONS.format(grace=20)})
    lines: list[str] = []
    _, p = sites.place_for_launch(cfg, run=fake, out=lines.append)
    assert p is not None and p.site.name == "alpha"
    (warning,) = [w for w in lines if w.startswith("warning:")]
    assert "partition low on site alpha gives a preempted job GraceTime=20s" in warning
    assert f"GraceTime={sites.MOVE_GRACE_S}" in warning and "cluster.site_auto_migrate=false" in warning
    assert any(w.startswith("partition low on site alpha") for w in p.warnings)  # recorded with the placement


def test_no_grace_warning_when_the_move_fits_or_cannot_happen():
    c = _cfg().cluster
    alpha = c.sites[0]
    enough = FakeSlurm({}, partitions={"alpha": PARTITIONS.format(grace=60)})
    assert sites.grace_warning(c, alpha, enough) is None
    short = FakeSlurm({}, partitions={"alpha": PARTITIONS.format(grace=20)})
    assert sites.grace_warning(c, alpha, short) is not None
    off = _cfg("cluster.site_auto_migrate=false").cluster
    assert sites.grace_warning(off, off.sites[0], short) is None  # moves only by hand: nothing to fit
    high = _cfg("cluster.sites.0.partition=high").cluster
    assert sites.grace_warning(high, high.sites[0], short) is None  # not preemptible
    assert sites.grace_warning(c, alpha, FakeSlurm({})) is None  # scontrol does not answer: no guess


# ---- verified copy -------------------------------------------------------------------------------------------


def _tensors(step: int) -> dict:
    return {"model": {"w": torch.full((64, 128), float(step)), "b": torch.arange(2048) + step}}


def _template() -> dict:
    return {"model": {"w": torch.zeros(64, 128), "b": torch.zeros(2048, dtype=torch.int64)}}


def _run_with_steps(run: Path, steps: list[int], dedup: bool = False) -> None:
    mgr = CheckpointManager(run / "checkpoints", async_save=False, dedup=dedup)
    for s in steps:
        t = _tensors(s)
        if dedup:
            t["model"]["b"] = torch.arange(2048)  # unchanged across steps: deduplicated by reference
        mgr.save(s, t, state={"step": s}, rank_state={"rank": 0})
    (run / "events.jsonl").write_text(json.dumps({"time": 1.0, "kind": "start", "reason": "x"}) + "\n")
    (run / "job.json").write_text("{}")  # the site's job ownership: never copied


def test_copy_moves_the_newest_good_checkpoint_verified_and_records_it(tmp_path):
    src, dst = tmp_path / "alpha" / "run", tmp_path / "beta" / "run"
    _run_with_steps(src, [2, 4])
    res = sites.copy_run(src, dst)
    assert res.step == 4 and res.bytes > 64 * 128 * 4 and res.files >= 4
    assert layout.read_latest(dst / "checkpoints") == 4
    assert not (dst / "checkpoints" / "step_2").exists()  # only what a resume needs
    assert not (dst / "job.json").exists() and (dst / "events.jsonl").exists()
    assert oct((dst / "checkpoints" / "step_4").stat().st_mode & 0o777) == "0o700"
    t = _template()
    r = CheckpointManager(dst / "checkpoints", async_save=False).load(t)
    assert r is not None and r.step == 4 and torch.equal(t["model"]["w"], _tensors(4)["model"]["w"])
    for run in (src, dst):
        ev = [e for e in read_events(run) if e["kind"] == "migrate_copy"]
        assert ev and ev[-1]["bytes"] == res.bytes and ev[-1]["step"] == 4 and "seconds" in ev[-1]


def test_copy_skips_a_corrupt_newest_step_and_follows_dedup_references(tmp_path):
    src, dst = tmp_path / "a", tmp_path / "b"
    _run_with_steps(src, [1, 2, 3], dedup=True)
    h5 = next((src / "checkpoints" / "step_3").glob("*.h5"))
    with h5.open("r+b") as f:  # garbage in the newest step
        f.seek(h5.stat().st_size // 2)
        f.write(b"\xff" * 64)
    res = sites.copy_run(src, dst)
    assert res.step == 2
    refs = layout.read_manifest(dst / "checkpoints" / "step_2").get("refs", [])
    assert refs, "the dedup checkpoint must reference an earlier step"
    layout.verify(dst / "checkpoints" / "step_2")  # the referenced step came along and verifies


def test_a_copy_that_goes_wrong_is_never_used(tmp_path):
    src, dst = tmp_path / "a", tmp_path / "b"
    _run_with_steps(src, [5])

    def truncating(a: Path, b: Path) -> None:
        shutil.copyfile(a, b)
        if b.suffix == ".h5":
            with b.open("r+b") as f:
                f.truncate(b.stat().st_size // 2)

    with pytest.raises(sites.CopyError, match="the run stays where it was"):
        sites.copy_run(src, dst, copier=truncating)
    ck = dst / "checkpoints"
    assert layout.read_latest(ck) is None and not list(ck.iterdir())
    assert layout.read_latest(src / "checkpoints") == 5  # the source is untouched


_SLOW_COPY = """
import shutil, sys, time
from pathlib import Path
from xirang_hpc.submit.sites import copy_run

def slow(a, b):
    shutil.copyfile(a, b)
    print("copied", b.name, flush=True)
    time.sleep(30)

copy_run(Path(sys.argv[1]), Path(sys.argv[2]), copier=slow)
"""


@pytest.mark.slow
def test_kill_minus_9_during_the_copy_leaves_nothing_usable_and_a_retry_succeeds(tmp_path):
    src, dst = tmp_path / "a", tmp_path / "b"
    _run_with_steps(src, [7])
    p = subprocess.Popen([sys.executable, "-c", _SLOW_COPY, str(src), str(dst)], stdout=subprocess.PIPE, text=True)
    assert p.stdout is not None and p.stdout.readline().startswith("copied")  # mid-copy: one file is there
    os.kill(p.pid, signal.SIGKILL)
    p.wait(timeout=60)
    ck = dst / "checkpoints"
    assert layout.read_latest(ck) is None and not (ck / "step_7").exists()
    assert [d.name for d in ck.iterdir()][0].startswith("step_7.tmp-copy-")
    res = sites.copy_run(src, dst)
    assert res.step == 7 and [d.name for d in ck.iterdir() if d.is_dir()] == ["step_7"]
    layout.verify(ck / "step_7")


def test_site_run_dir_maps_the_run_under_the_sites_root(tmp_path):
    site = SiteConfig(name="beta", run_root=str(tmp_path / "beta"), shared_fs=False)
    assert sites.site_run_dir(tmp_path / "runs" / "r-1", tmp_path / "runs", site) == tmp_path / "beta" / "r-1"
    shared = SiteConfig(name="alpha")
    assert sites.site_run_dir(tmp_path / "runs" / "r-1", tmp_path / "runs", shared) == tmp_path / "runs" / "r-1"


def _placed_run(tmp_path: Path) -> tuple[Path, object]:
    over = [f"cluster.sites.0.run_root={tmp_path}/alpha", f"cluster.sites.1.run_root={tmp_path}/beta",
            f"train.runs_root={tmp_path}/alpha"]
    cfg = sites.apply_site(_cfg(*over), _cfg(*over).cluster.sites[0])
    run = tmp_path / "alpha" / "r-1"
    _run_with_steps(run, [3, 6])
    sites.write_site_state(run, cfg, tmp_path / "data", "alpha", "41")
    return run, cfg


def test_preempted_run_whose_requeue_waits_too_long_migrates_with_a_verified_copy(tmp_path):
    run, _ = _placed_run(tmp_path)
    fake = FakeSlurm({"alpha": ALPHA_FULL, "beta": BETA_IDLE})
    submitted: list[tuple] = []

    def submit(cfg, run_dir, data_dir, site):
        submitted.append((cfg, run_dir, site))
        assert layout.read_latest(run_dir / "checkpoints") == 6  # the copy is in place before the job exists
        return "7"

    facts = sites.migrate(run, run=fake, submit=submit, out=lambda s: None, now=lambda: NOW)
    assert facts is not None and facts["from"] == "alpha" and facts["to"] == "beta" and facts["step"] == 6
    assert facts["copy_bytes"] > 0
    assert ["scancel", "-M", "alpha", "41"] in fake.calls  # the pending requeue on alpha is cancelled
    cfg, dst, site = submitted[0]
    assert site == "beta" and dst == tmp_path / "beta" / "r-1" and cfg.train.runs_root == f"{tmp_path}/beta"
    state = sites.read_site_state(dst)
    assert state["site"] == "beta" and [h["site"] for h in state["history"]] == ["alpha", "beta"]
    assert [e["to"] for e in read_events(dst) if e["kind"] == "migrate"] == ["beta"]


def test_run_stays_when_its_requeue_starts_soon_enough(tmp_path):
    run, _ = _placed_run(tmp_path)
    fake = FakeSlurm({"alpha": ALPHA_IDLE, "beta": BETA_IDLE})
    assert sites.migrate(run, run=fake, submit=lambda *a: pytest.fail("submitted"), out=lambda s: None,
                         now=lambda: NOW) is None
    assert not any(a[0] == "scancel" for a in fake.calls)


def test_a_failed_copy_submits_nothing_on_the_other_site(tmp_path, monkeypatch):
    run, _ = _placed_run(tmp_path)

    def broken(src, dst, **kw):
        raise sites.CopyError("checksum mismatch; the run stays where it was")

    monkeypatch.setattr(sites.moves, "copy_run", broken)  # where migrate looks it up
    fake = FakeSlurm({"alpha": ALPHA_FULL, "beta": BETA_IDLE})
    with pytest.raises(sites.CopyError):
        sites.migrate(run, run=fake, submit=lambda *a: pytest.fail("submitted"), out=lambda s: None, now=lambda: NOW)
    assert not any(a[0] == "scancel" for a in fake.calls)  # its job on alpha keeps waiting there
    assert sites.read_site_state(run)["site"] == "alpha"


def test_status_shows_the_site_and_the_history_across_sites(tmp_path, capsys):
    from xirang_hpc.cli import status as status_cli

    run, _ = _placed_run(tmp_path)
    fake = FakeSlurm({"alpha": ALPHA_FULL, "beta": BETA_IDLE})
    sites.migrate(run, run=fake, submit=lambda *a: "7", out=lambda s: None, now=lambda: NOW)
    moved = tmp_path / "beta" / "r-1"
    status_cli.main([str(moved)])
    out = capsys.readouterr().out
    assert "site: beta; history: alpha (job 41) -> beta (job 7)" in out, out
    status_cli.main([str(run)])  # the run dir it left says where it went
    out = capsys.readouterr().out
    assert f"the run moved to beta: {moved}" in out, out
    status_cli.main([str(moved), "--json"])
    snap = json.loads(capsys.readouterr().out)
    assert snap["site"] == "beta" and [h["site"] for h in snap["site_history"]] == ["alpha", "beta"]


# Recorded during a preemption's grace time on alpha (our 1-node job 41 on sa1; a 2-node `high` job 3 waits
# for sa1 and sa2): `sbatch --test-only` answers "now" (the preempted job's nodes count as free), while
# `squeue --start` shows the preemptor scheduled onto both nodes for its 30-minute limit.
PREEMPTOR = ("3|2026-11-30T18:10:18|30:00|sa[1-2]||PENDING\n"
             "41|2026-11-30T18:01:00|30:00|(null)|sa1|RUNNING\n")


class PreemptedSlurm(FakeSlurm):
    """FakeSlurm plus `scontrol show hostnames` and the preemptor's `squeue` row."""

    def __call__(self, argv: list[str]) -> Result:
        if argv[:3] == ["scontrol", "show", "hostnames"]:
            expr = argv[3]
            names = {"sa[1-2]": "sa1\nsa2", "sa2": "sa2", "sa1": "sa1"}
            return Result(0, names.get(expr, expr) + "\n", "")
        return super().__call__(argv)


def test_preempted_job_moves_itself_when_the_preemptor_holds_its_nodes(tmp_path, monkeypatch):
    run, _ = _placed_run(tmp_path)
    fake = PreemptedSlurm({"alpha": ALPHA_IDLE, "beta": BETA_IDLE}, squeue={"alpha": PREEMPTOR})
    monkeypatch.setenv("SLURM_RESTART_COUNT", "2")
    monkeypatch.setenv("SLURM_JOB_ID", "41")
    seen: list[dict] = []

    def submit(cfg, run_dir, data_dir, site, handover=None):
        # Submitted from inside job 41: its identity must not leak into the new job's environment.
        seen.append({"site": site, "dst": run_dir, "handover": handover,
                     "env": {k for k in os.environ if k.startswith("SLURM_") and k != "SLURM_CONF"}})
        assert layout.read_latest(run_dir / "checkpoints") == 6  # verified copy before the job exists
        return "9"

    facts = sites.migrate_at_preemption(run, "41", "alpha", ["sa1"], run=fake, submit=submit, now=lambda: NOW)
    assert facts is not None and facts["to"] == "beta" and facts["trigger"] == "preemption"
    assert facts["preempted_by"] == ["3"] and facts["copy_bytes"] > 0 and facts["step"] == 6
    est = {e["site"]: e for e in facts["estimates"]}
    # test-only said "now" on alpha; the requeue really waits for the preemptor's end (30 min after its start)
    assert est["alpha"]["wait_s"] == pytest.approx(9 + 1800) and est["beta"]["wait_s"] == 0
    assert seen == [{"site": "beta", "dst": tmp_path / "beta" / "r-1", "handover": ("41", "alpha"), "env": set()}]
    assert os.environ["SLURM_RESTART_COUNT"] == "2"  # restored for the rest of the supervisor
    assert not any(a[0] == "scancel" for a in fake.calls)  # the supervisor ends its own job afterwards
    moved = [e for e in read_events(tmp_path / "beta" / "r-1") if e["kind"] == "migrate"]
    assert moved and moved[0]["old_job"] == "41" and moved[0]["site_migrate_wait_s"] == 120


def test_preempted_job_stays_when_its_nodes_come_back_soon(tmp_path):
    run, _ = _placed_run(tmp_path)
    short = PREEMPTOR.replace("30:00|sa[1-2]", "01:00|sa[1-2]")  # the preemptor needs the nodes for a minute
    fake = PreemptedSlurm({"alpha": ALPHA_IDLE, "beta": BETA_IDLE}, squeue={"alpha": short})
    assert sites.migrate_at_preemption(run, "41", "alpha", ["sa1"], run=fake,
                                       submit=lambda *a, **k: pytest.fail("submitted"), now=lambda: NOW) is None
    check = [e for e in read_events(run) if e["kind"] == "migrate_check"]
    assert check and check[0]["preempted_by"] == ["3"] and "stays on alpha" in check[0]["reason"]
    # A preemptor on other nodes does not hold this job's requeue at all.
    other = PreemptedSlurm({"alpha": ALPHA_IDLE, "beta": BETA_IDLE},
                           squeue={"alpha": PREEMPTOR.replace("sa[1-2]", "sa2")})
    assert sites.held_until("alpha", ["sa1"], "41", other) == (None, [])


def test_auto_migration_can_be_switched_off(tmp_path):
    over = [f"cluster.sites.0.run_root={tmp_path}/alpha", f"cluster.sites.1.run_root={tmp_path}/beta",
            f"train.runs_root={tmp_path}/alpha", "cluster.site_auto_migrate=false"]
    cfg = _cfg(*over)
    run = tmp_path / "alpha" / "r-1"
    run.mkdir(parents=True)
    sites.write_site_state(run, cfg, tmp_path / "data", "alpha", "41")
    fake = PreemptedSlurm({"alpha": ALPHA_IDLE, "beta": BETA_IDLE}, squeue={"alpha": PREEMPTOR})
    assert sites.migrate_at_preemption(run, "41", "alpha", ["sa1"], run=fake, now=lambda: NOW) is None
    assert fake.calls == []


def test_stop_handler_hands_a_preemption_over_to_the_supervisor_on_several_sites(tmp_path):
    # The ranks only save and leave: the requeue-or-move decision belongs to the batch script's supervisor.

    from xirang_hpc.monitor.events import EventLog
    from xirang_hpc.runtime.signals import EXIT_REQUEUED, StopSignalHook
    from xirang_hpc.runtime.topology import Topology

    def hook_for(cfg, codes):
        topo = Topology(rank=0, world_size=1, local_rank=0, local_world_size=1, node_id=0, num_nodes=1,
                        node_name="sa1", master_addr="127.0.0.1", master_port=20001, job_id="41", source="slurm")
        return StopSignalHook(cfg, topo, tmp_path, events=EventLog(tmp_path), env={"SLURM_JOB_ID": "41"},
                              exit_fn=codes.append, save_fn=lambda t: 5,
                              job_info=lambda j: {"PreemptTime": "2026-11-30T18:10:00", "JobState": "RUNNING"},
                              requeue_fn=requeued.append, start_now_fn=lambda *a: None)

    requeued: list[str] = []
    codes: list[int] = []
    trainer = FakeLoop(step=5)
    hook_for(_cfg(), codes).stop(trainer, "SIGUSR2")
    assert codes == [EXIT_REQUEUED] and requeued == []
    kinds = [(e["kind"], e["reason"]) for e in read_events(tmp_path)]
    assert ("handover", "preemption") in kinds and not any(k == "exit" for k, _ in kinds)
    # Auto-migration off: the handler requeues itself as on one cluster.
    hook_for(_cfg("cluster.site_auto_migrate=false"), codes).stop(trainer, "SIGUSR2")
    assert requeued == ["41"]


def test_on_one_site_rank_0_requeues_at_once_with_the_ranks_leaving_margin(tmp_path):
    # A preemption and a time limit are requeued by rank 0 right after the save (the grace time or the limit
    # would otherwise end the job first); the begin time is set ahead by the ranks-leaving margin, since the
    # job leaves its nodes only once its last rank has exited.

    from xirang_hpc.monitor.events import EventLog
    from xirang_hpc.runtime.signals import EXIT_REQUEUED, StopSignalHook
    from xirang_hpc.runtime.topology import Topology
    from xirang_hpc.slurm import control

    topo = Topology(rank=0, world_size=1, local_rank=0, local_world_size=1, node_id=0, num_nodes=1,
                    node_name="n1", master_addr="127.0.0.1", master_port=20001, job_id="41", source="slurm")
    trainer = FakeLoop(step=5)
    one_site = load_config(compose_cfg(["cluster=testbed", "requeue=testbed"]))
    for run_time, reason in (("00:01:00", "preemption"), ("00:09:30", "timeout")):
        run, requeued, updates, codes = tmp_path / reason, [], [], []
        run.mkdir()
        info = {"JobState": "RUNNING", "RunTime": run_time, "TimeLimit": "00:10:00"}
        hook = StopSignalHook(one_site, topo, run, events=EventLog(run), env={"SLURM_JOB_ID": "41"},
                              exit_fn=codes.append, save_fn=lambda t: 5, job_info=lambda j, i=info: i,
                              requeue_fn=requeued.append, start_now_fn=lambda *a, u=updates, **k: u.append(k))
        hook.stop(trainer, "SIGUSR2")
        events = read_events(run)
        assert codes == [EXIT_REQUEUED] and requeued == ["41"], (reason, events)
        assert [e["reason"] for e in events if e["kind"] == "requeue"] == [reason]
        assert not [e for e in events if e["kind"] == "handover"]
        assert updates[0]["margin_s"] == control.RANKS_LEAVING_MARGIN_S > control.START_MARGIN_S, updates


def test_supervisor_ignores_the_old_sites_events_after_a_move(tmp_path):
    # A moved run carries alpha's events; beta's job numbers its restarts from 0 again.
    from xirang_hpc.batch.supervise import already_handled, handed_over
    from xirang_hpc.monitor.events import append_event

    append_event(tmp_path, "handover", "preemption", restart=0)
    append_event(tmp_path, "exit", "requeued", final=False, restart=0)
    assert already_handled(tmp_path, 0) and handed_over(tmp_path, 0)
    append_event(tmp_path, "migrate", "earliest start", to="beta")
    assert not already_handled(tmp_path, 0) and not handed_over(tmp_path, 0)
    append_event(tmp_path, "exit", "completed", final=True, restart=0)
    assert already_handled(tmp_path, 0)


def test_status_asks_the_runs_site_for_its_job(tmp_path, monkeypatch, capsys):
    # Job 7 runs on beta; the default cluster (alpha) does not know it. xirang-status must ask beta (-M).
    from xirang_hpc.cli import status as status_cli

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for cmd, answer in (("squeue", "RUNNING|None"), ("scontrol", "JobId=7 JobState=RUNNING Restarts=0"),
                        ("sacct", "")):
        (bin_dir / cmd).write_text(f"""#!/bin/sh
if [ "$1" = "-M" ] && [ "$2" = "beta" ]; then echo "{answer}"; exit 0; fi
echo "slurm_load_jobs error: Invalid job id specified" >&2; exit 1
""")
        (bin_dir / cmd).chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    run, _ = _placed_run(tmp_path)
    sites.migrate(run, run=FakeSlurm({"alpha": ALPHA_FULL, "beta": BETA_IDLE}), submit=lambda *a: "7",
                  out=lambda s: None, now=lambda: NOW)
    moved = tmp_path / "beta" / "r-1"
    hb = moved / "heartbeats"
    hb.mkdir(exist_ok=True)
    (hb / "session.json").write_text(json.dumps({"session": "s1", "source": "slurm", "job_id": "7", "started": NOW}))
    status_cli.main([str(moved), "--json"])
    snap = json.loads(capsys.readouterr().out)
    assert snap["state"] == "RUNNING" and snap["site"] == "beta", snap


def test_the_moving_job_is_made_non_requeueable_only_after_the_copy_and_again_requeueable_if_the_move_fails(
        tmp_path, monkeypatch):
    from xirang_hpc.batch import supervise
    from xirang_hpc.slurm import control

    run, _ = _placed_run(tmp_path)
    order: list[str] = []
    monkeypatch.setattr(control, "run_scontrol", lambda args, **kw: order.append(" ".join(args)) or "")

    def move(run_dir, job_id, current, nodes, before_submit=None, **kw):
        order.append("copy")
        before_submit()
        order.append("submit")
        raise RuntimeError("sbatch: error: Batch job submission failed: Socket timed out")

    monkeypatch.setattr(sites, "migrate_at_preemption", move)
    env = {"SLURM_CLUSTER_NAME": "alpha", "SLURM_JOB_NODELIST": ""}
    assert supervise.try_migrate(run, "41", env) is None  # the caller requeues it on alpha
    assert order == ["copy", "update jobid=41 Requeue=0", "submit", "update jobid=41 Requeue=1"]
    failed = [e for e in read_events(run) if e["kind"] == "migrate_failed"]
    assert failed and "Socket timed out" in failed[0]["error"]
