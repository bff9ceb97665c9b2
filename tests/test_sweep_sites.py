"""A Hydra sweep spread over several sites (``cluster.site_sweep=spread``): one array per site, with fake Slurm
clients (``sbatch --test-only`` answers like Slurm 22.05 on the two-cluster testbed; a real submission prints
``Submitted batch job N on cluster C``). The same on the real two-cluster testbed: tests/test_slurm_sites.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import compose_cfg, fake_slurm_bin

from xirang_hpc.config.validate import check_runnable, load_config
from xirang_hpc.monitor.events import read_events
from xirang_hpc.submit.sites import read_site_state
from xirang_hpc.submit.sweep import split_sweep, submit_array, sweep_folder

FAKE = r'''#!{python}
import json, os, re, sys, time
name = os.path.basename(sys.argv[0])
args = sys.argv[1:]
entry = {{"cmd": name, "args": args}}
if name == "sbatch" and "--test-only" not in args:
    entry["script"] = open(args[-1]).read()
with open(os.environ["FAKE_SLURM_LOG"], "a") as f:
    f.write(json.dumps(entry) + "\n")
waits = json.loads(os.environ["FAKE_WAITS"])
if name == "sbatch" and "--test-only" in args:
    site = [a.split("=", 1)[1] for a in args if a.startswith("--clusters=")][0]
    if waits.get(site) is None:
        print("allocation failure: Socket timed out on send/recv operation", file=sys.stderr)
        sys.exit(1)
    start = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(time.time() + waits[site]))
    print(f"sbatch: Job 9 to start at {{start}} using 2 processors on nodes s{{site[0]}}1 in partition low",
          file=sys.stderr)
elif name == "sbatch":
    site = re.search(r"--clusters=(\w+)", entry["script"]).group(1)
    print(f"Submitted batch job {{ {{'alpha': 4242, 'beta': 5151}}[site] }} on cluster {{site}}")
elif name == "sacctmgr":
    print("alpha\nbeta")
'''


@pytest.fixture
def fake_sites(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("FAKE_WAITS", json.dumps({"alpha": 1200, "beta": 0}))  # alpha full, beta idle
    return fake_slurm_bin(tmp_path, monkeypatch, FAKE, commands=("sbatch", "scontrol", "squeue", "sacct", "srun",
                                                                  "sacctmgr", "sinfo", "sshare"))


def _calls(log: Path) -> list[dict]:
    return [json.loads(line) for line in log.read_text().splitlines()]


def test_split_is_even_with_the_earliest_sites_taking_the_remainder():
    assert split_sweep(3, ["beta", "alpha"]) == ["beta", "beta", "alpha"]
    assert split_sweep(4, ["alpha", "beta"]) == ["alpha", "alpha", "beta", "beta"]
    assert split_sweep(2, ["beta"]) == ["beta", "beta"]
    assert split_sweep(1, ["beta", "alpha"]) == ["beta"]


def _sweep(tmp_path: Path, corpus: Path, *extra: str):
    common = ["cluster=testbed-sites", "requeue=testbed", f"train.runs_root={tmp_path}/alpha",
              f"cluster.sites.0.run_root={tmp_path}/alpha", f"cluster.sites.1.run_root={tmp_path}/beta",
              f"data.corpus={corpus}", f"data.out_dir={tmp_path}/data", "data.val_fraction=0.2", *extra]
    overrides = [[*common, f"train.lr={lr}"] for lr in ("1e-3", "3e-4", "1e-4")]
    cfgs = [load_config(compose_cfg(o)) for o in overrides]
    for c in cfgs:
        check_runnable(c)
    return cfgs, overrides


def test_spread_sweep_is_one_array_per_site_on_each_sites_run_root(fake_sites, tmp_path, small_corpus):
    cfgs, overrides = _sweep(tmp_path, small_corpus, "cluster.site_sweep=spread")
    array_ids, run_dirs, tasks = submit_array(cfgs, overrides)

    assert array_ids == "beta:5151,alpha:4242"  # the idle site first: it takes the larger share
    # (submitit submits a one-point array as a plain job: no task suffix)
    assert tasks == ["beta:5151_0", "beta:5151_1", "alpha:4242"]
    subs = [c for c in _calls(fake_sites) if c["cmd"] == "sbatch" and "--test-only" not in c["args"]]
    assert len(subs) == 2, "one array per site"
    by_site = {("beta" if "--clusters=beta" in c["script"] else "alpha"): c["script"] for c in subs}
    assert "#SBATCH --array=0-1%" in by_site["beta"] and "--array" not in by_site["alpha"]
    for site, script in by_site.items():
        assert f"#SBATCH --clusters={site}" in script and "#SBATCH --account=proja" in script
    # Each task's run directory is on its site's run root, knows its site and the evidence of the split.
    for d, site, task in zip(run_dirs, ["beta", "beta", "alpha"], tasks):
        assert d.is_relative_to(tmp_path / site), (d, site)
        st = read_site_state(d)
        assert st["site"] == site and st["job"] == task.split(":")[1]
        placed = [e for e in read_events(d) if e["kind"] == "placement"]
        assert placed and placed[0]["site"] == site and placed[0]["policy"] == "spread"
        assert {e["site"] for e in placed[0]["estimates"]} == {"alpha", "beta"}
    # The split is recorded once for the whole sweep.
    rec = json.loads((sweep_folder(cfgs, overrides) / "sites.json").read_text())
    assert [r["site"] for r in rec["split"]] == ["beta", "beta", "alpha"] and rec["arrays"] == array_ids.split(",")
    est = {e["site"]: e for e in rec["estimates"]}
    assert est["alpha"]["wait_s"] > 1000 and est["beta"]["wait_s"] < 60


def test_a_dead_site_gets_no_tasks_and_one_sweep_is_one_array_by_default(fake_sites, tmp_path, small_corpus,
                                                                          monkeypatch):
    monkeypatch.setenv("FAKE_WAITS", json.dumps({"alpha": 0, "beta": None}))  # beta's slurmctld hangs
    cfgs, overrides = _sweep(tmp_path, small_corpus, "cluster.site_sweep=spread")
    array_ids, run_dirs, tasks = submit_array(cfgs, overrides)
    assert array_ids == "4242" and tasks == ["4242_0", "4242_1", "4242_2"]  # everything on alpha
    assert all(d.is_relative_to(tmp_path / "alpha") for d in run_dirs)
    # Without spread: the whole array on the placed site (beta here), with -M.
    monkeypatch.setenv("FAKE_WAITS", json.dumps({"alpha": 1200, "beta": 0}))
    cfgs, overrides = _sweep(tmp_path / "one", small_corpus)
    array_ids, run_dirs, tasks = submit_array(cfgs, overrides)
    assert array_ids == "5151" and all(d.is_relative_to(tmp_path / "one" / "beta") for d in run_dirs)
