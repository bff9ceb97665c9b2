"""Goodput under faults injected at a known rate, per recovery policy, and the simulator's prediction of it.

The chaos run: one 2-node x 1-rank tiny-GPT job per recovery policy, all at once, each on its own 3-node
cluster of a multi-cluster Slurm testbed (so that a preemption or a lost node hits only its job), for ``--minutes``
of wall time (15 by default). The steps mostly sleep (``XIRANG_TESTPOINT_SLOW``: rank 0 sleeps ``--step-s``
in each forward phase, the other waits in the gradient all-reduce), so three jobs fit a loaded 2-core box.
Faults arrive as a Poisson process (exponential inter-arrival times, mean ``--mtbf-s``, ``--seed``; the
same schedule for every policy), each of a class drawn with ``--mix``:

- ``kill9``: SIGKILL of rank 1 (software; the watchdog names the dead rank);
- ``sigstop``: SIGSTOP of rank 1 (software; a hang, named after ``monitor.hang_s``);
- ``node``: rank 1's node lost: its slurmd, the job's slurmstepd there and its rank SIGKILLed; the node
  comes back ``--node-back-s`` later (the stand-in for a replacement in the cluster);
- ``preempt``: a job on the ``high`` partition that needs every node (planned: the job saves on the signal
  and Slurm requeues it).

Policies (``requeue.exclude_failed_nodes=false`` so a requeue can use the node once it is back,
``requeue.min_nodes=2`` so an in-job restart never shrinks):

- ``requeue``: every fault ends the job, Slurm requeues it (``requeue.start_now``), the newest checkpoint;
- ``in-job``: one spare node (``cluster.spare_nodes=1``); a fault restarts the ranks inside the allocation
  from the filesystem checkpoint, without the culprit's node (the driver excludes it whatever the fault), so
  on the spare; with no spare left the job is requeued (a new allocation, its spare free again);
- ``in-job+memory``: the same from the in-memory copy (``checkpoint.in_memory``, one copy per step).

Testbed: ``XIRANG_SLURM_NODES=3``, one cluster per policy (``XIRANG_SLURM_CLUSTERS=rq,fs,mm``).

A fault that falls while the job is not training (recovering, pending) waits until its next first step:
the trace replayed is the one applied, with its real times.

Measured, from each run's own records (``xirang-status RUN --goodput``'s computation, over the window from
the first allocation's start to the run's last record): goodput and its breakdown. Predicted: the goodput
simulator (``planner.goodput_replay.replay``) fed with the same faults and the costs measured in the same run:
start-up (allocation start -> productive steps), each policy's recovery (fault -> productive steps again,
the requeued job's pending time apart), the checkpoint stall per step and the background write, the step
time. Everything else (lost progress, stalls, exposure) is the model's.

    XIRANG_SLURM_DIR=/tmp/xirang-slurm-chaos XIRANG_SLURM_PORT=16960 XIRANG_SLURM_NODE_PREFIX=x \\
        XIRANG_SLURM_CLUSTERS=rq,fs,mm XIRANG_SLURM_NODES=3 tools/slurm-testbed start   # then
    python benchmarks/bench_goodput.py --slurm-dir /tmp/xirang-slurm-chaos --data DATA --minutes 15
    python benchmarks/bench_goodput.py --slurm-dir /tmp/xirang-slurm-chaos --analyze OUT.json   # again
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import psutil

from xirang_hpc.monitor.events import read_events
from xirang_hpc.monitor.goodput import breakdown, load_run
from xirang_hpc.planner.goodput_replay import Replay, replay
from xirang_hpc.planner.goodput_sim import CheckpointCosts, RecoveryCosts

# policy -> (the testbed cluster it runs on, its overrides)
POLICIES: dict[str, tuple[str, list[str]]] = {
    "requeue": ("rq", ["requeue.max_restarts_in_job=0"]),
    "in-job": ("fs", ["requeue.max_restarts_in_job=1000", "cluster.spare_nodes=1"]),
    "in-job+memory": ("mm", ["requeue.max_restarts_in_job=1000", "cluster.spare_nodes=1", "checkpoint.in_memory=true",
                             "checkpoint.memory_every_steps=1"]),
}
SPARES = {"requeue": 0, "in-job": 1, "in-job+memory": 1}
FAULTS = ("kill9", "sigstop", "node", "preempt")
CLASS_OF = {"kill9": "software", "sigstop": "software", "node": "hardware", "preempt": "planned"}


def schedule(seed: int, mtbf_s: float, mix: dict[str, float], horizon_s: float) -> list[tuple[float, str]]:
    """Fault times (seconds after the job first trains) and kinds: exponential inter-arrival times."""
    rng = np.random.default_rng(seed)
    names = [f for f in FAULTS if mix.get(f, 0) > 0]
    p = np.array([mix[f] for f in names], dtype=float)
    out, t = [], 0.0
    while True:
        t += float(rng.exponential(mtbf_s))
        if t >= horizon_s:
            return out
        out.append((t, names[int(rng.choice(len(names), p=p / p.sum()))]))


def _sh(args: list[str], env: dict[str, str], check: bool = False) -> str:
    return subprocess.run(args, capture_output=True, text=True, env=env, check=check).stdout


class Chaos:
    """One policy's job on its own cluster, and the faults injected into it."""

    def __init__(self, policy: str, a: argparse.Namespace, runs: Path) -> None:
        self.policy, self.a = policy, a
        cluster, self.overrides = POLICIES[policy]
        self.conf = Path(a.slurm_dir) / f"{cluster}.conf"
        self.env = {**os.environ, "SLURM_CONF": str(self.conf),
                    "XIRANG_TESTPOINT_SLOW": f"rank=0,s={a.step_s},phases=forward"}
        self.runs = runs / policy.replace("+", "-")
        self.faults: list[dict[str, Any]] = []
        self.log: list[str] = []
        self.run: Path | None = None
        self.job = ""
        self.t_end = 0.0
        self.error = ""

    def submit(self) -> None:
        a = self.a
        cmd = [sys.executable, "-c", "from xirang_hpc.cli.train import main; main()", "cluster=testbed",
               "requeue=testbed", "cluster.tasks_per_node=1", "cluster.threads_per_rank=1", "cluster.time_min=240",
               "train.priority=exploratory", "train.max_steps=1000000", "train.warmup_steps=2",
               "train.log_every=10", "train.eval_every=1000000", "train.eval_batches=1", "parallel.pp=1",
               "parallel.tp=1", "monitor.enabled=true", f"monitor.hang_s={a.hang_s}",
               f"checkpoint.every_steps={a.every}", "requeue.budget_burst=1000",
               "requeue.exclude_failed_nodes=false", "requeue.min_nodes=2",
               f"data.out_dir={Path(a.data).absolute()}", f"train.runs_root={self.runs}", *self.overrides]
        out = subprocess.run(cmd, capture_output=True, text=True, check=True, env=self.env).stdout
        self.job = re.search(r"submitted Slurm job (\d+)", out).group(1)
        self.run = Path(re.search(r"run dir (\S+)", out).group(1))

    def events(self, kind: str, since: float = 0.0) -> list[dict[str, Any]]:
        assert self.run is not None
        return [e for e in read_events(self.run) if e.get("kind") == kind and float(e.get("time", 0)) > since]

    def training_since(self, t: float) -> bool:
        """A first step after ``t``: the job trains again."""
        return bool(self.events("first_step", t))

    def nodes(self) -> list[str]:
        out = _sh(["sinfo", "-h", "-N", "-o", "%N"], self.env)
        return sorted(set(out.split()), key=lambda n: (len(n), n))

    def rank_pids(self) -> dict[int, tuple[str, int]]:
        """The current start's ranks: rank -> (node, pid)."""
        assert self.run is not None
        starts = self.events("start")
        restart = int(starts[-1].get("restart", 0)) if starts else 0
        out = {}
        for p in (self.run / "ranks" / f"r{restart}").glob("*.start"):
            node, pid = p.read_text().split()[:2]
            out[int(p.stem)] = (node, int(pid))
        return out

    def inject(self, kind: str) -> dict[str, Any]:
        """Apply one fault now; returns its record (``applied`` False when it found nothing to hit)."""
        ranks = self.rank_pids()
        t = time.time()
        rec: dict[str, Any] = {"time": t, "fault": kind, "class": CLASS_OF[kind], "applied": True}
        try:
            if kind in ("kill9", "sigstop"):
                os.kill(ranks[1][1], signal.SIGKILL if kind == "kill9" else signal.SIGSTOP)
            elif kind == "node":
                node = ranks[1][0]
                pids = [pid for n, pid in ranks.values() if n == node]
                stepds = {psutil.Process(pid).ppid() for pid in pids}
                slurmd = int((self.conf.parent / "run" / f"slurmd-{node}.pid").read_text())
                for pid in (slurmd, *stepds, *pids):
                    os.kill(pid, signal.SIGKILL)
                rec["node"] = node
            else:
                _sh(["sbatch", "-p", "high", f"-N{len(self.nodes())}", "--ntasks-per-node=8", "-o", "/dev/null",
                     "--wrap", "sleep 1"], self.env, check=True)
        except (KeyError, ProcessLookupError, psutil.NoSuchProcess, FileNotFoundError) as exc:
            rec.update(applied=False, why=repr(exc))
        return rec

    def revive(self, node: str) -> None:
        """The lost node back: its slurmd started again (resumed if Slurm marked it down meanwhile). The job's
        own recovery decides (a requeue by its supervisor, an in-job restart), not Slurm's node-failure kill."""
        subprocess.run(["slurmd", "-N", node, "-f", str(self.conf)], check=True, env=self.env)
        for _ in range(60):
            state = _sh(["sinfo", "-h", "-n", node, "-o", "%t"], self.env).strip()
            if state in ("idle", "mix", "alloc", "comp"):
                return
            if state.startswith(("down", "drain")):
                _sh(["scontrol", "update", f"nodename={node}", "state=resume"], self.env)
            time.sleep(2)

    def wait(self, pred: Any, until: float) -> bool:
        while time.time() < until:
            if pred():
                return True
            time.sleep(0.5)
        return False

    def chaos(self, plan: list[tuple[float, str]]) -> None:
        """Submit, then inject the planned faults until ``--minutes`` after the job's first step."""
        a = self.a
        try:
            self.submit()
            if not self.wait(lambda: self.training_since(0.0), time.time() + 600):
                raise TimeoutError("the job never trained")
            t0 = float(self.events("first_step")[0]["time"])
            end = t0 + a.minutes * 60
            last = 0.0
            for offset, kind in plan:
                due = t0 + offset
                if due >= end:
                    break
                while time.time() < due:
                    time.sleep(min(1.0, due - time.time()))
                # Deferred until the job trains again after the previous fault.
                if not self.wait(lambda last=last: self.training_since(last) and self.rank_pids(), end):
                    break
                time.sleep(a.settle_s)  # the first block recorded: a fault never hits the first step itself
                if time.time() >= end:
                    break
                rec = self.inject(kind)
                rec["planned_offset_s"] = offset
                self.faults.append(rec)
                print(f"[{self.policy}] {time.strftime('%H:%M:%S')} {kind} applied={rec['applied']}", flush=True)
                if rec["applied"]:
                    last = rec["time"]
                if kind == "node" and rec["applied"]:
                    time.sleep(a.node_back_s)
                    self.revive(rec["node"])
            while time.time() < end:
                time.sleep(1.0)
        except Exception as exc:  # noqa: BLE001 - a policy's failure is reported, the others go on
            self.error = repr(exc)
            print(f"[{self.policy}] failed: {exc!r}", flush=True)
        finally:
            self.t_end = time.time()
            # A SIGTERM the job cannot explain makes its supervisor requeue it: SIGKILL every step, the batch
            # step's included, then cancel, until the job stays gone.
            for _ in range(20):
                if not self.job or self.job not in _sh(["squeue", "-h", "-o", "%i"], self.env).split():
                    break
                _sh(["scancel", "--signal=KILL", "--full", self.job], self.env)
                time.sleep(2)
                _sh(["scancel", self.job], self.env)
                time.sleep(3)
            for node in self.nodes():
                if _sh(["sinfo", "-h", "-n", node, "-o", "%t"], self.env).strip().startswith("down"):
                    _sh(["scontrol", "update", f"nodename={node}", "state=resume"], self.env)

    def to_dict(self) -> dict[str, Any]:
        return {"policy": self.policy, "conf": str(self.conf), "run": str(self.run), "job": self.job,
                "faults": self.faults, "t_end": self.t_end, "error": self.error}


def _outside(t0: float, t1: float, allocs: list[tuple[float, float]]) -> float:
    """Seconds of [t0, t1] outside every allocation (pending in the queue)."""
    inside = sum(max(0.0, min(t1, b) - max(t0, a)) for a, b in allocs)
    return max(0.0, (t1 - t0) - inside)


def analyze(d: dict[str, Any], a: argparse.Namespace) -> dict[str, Any]:
    """Measured breakdown over the window and the simulator's prediction from the same run."""
    os.environ["SLURM_CONF"] = d["conf"]
    rec = load_run(d["run"])
    allocs = rec.allocations or []
    spans = sorted((x.start, x.end) for x in allocs)
    sessions = sorted(rec.sessions, key=lambda s: s.proc_start)
    ideal = rec.timeline.ideal_step_s
    w0 = spans[0][0]
    # The window ends at the last record of the starts begun before the benchmark cancelled the job (the step in
    # flight at the cancel included; the save on the stop and a start after it are not).
    w1 = max(s.last_time for s in sessions if s.blocks and s.proc_start < d["t_end"])
    meas = breakdown(rec.timeline, rec.allocations, w0, w1)

    def resume(s: Any) -> float:
        """When a start's productive steps begin: its first step's end less one ideal step (the rest is warm-up)."""
        b = s.blocks[0]
        if int(b["b"]) == int(b["a"]):
            return s.wall(float(b["mono"])) - ideal
        return s.wall(float(b["mono"]) - float(b["dur"]))

    startup = resume(sessions[0]) - w0
    events = read_events(Path(d["run"]))
    restarts = [float(e["time"]) for e in events if e.get("kind") == "restart"]
    # Checkpoint costs from the run's blocks and its checkpoints' own records.
    steps = sum(int(b["b"]) - int(b["a"]) + 1 for s in sessions for b in s.blocks)
    saves = sum(float(b.get("save", 0)) for s in sessions for b in s.blocks)
    memory = d["policy"] == "in-job+memory"
    per = 1 if memory else a.every
    persist = [json.loads(p.read_text()).get("persist_s") for p in Path(d["run"]).rglob("metadata.json")]
    persist = [float(x) for x in persist if isinstance(x, (int, float))]
    write_s = float(np.mean(persist)) if persist else 0.0
    ck = CheckpointCosts(snapshot_s=saves / max(steps, 1) * per, write_s=write_s, load_s=0.0)
    resumes = sorted(resume(s) for s in sessions if s.blocks)
    applied = sorted((f for f in d["faults"] if f["applied"] and float(f["time"]) < w1), key=lambda f: f["time"])
    faults, rq, rq_pend, ij = [], [], [], []
    for f in applied:
        t = float(f["time"])
        faults.append((t - w0, f["class"]))
        # Training seconds since the job last resumed: the exposure that decides what the fault loses.
        f["offset_s"] = t - max((r for r in resumes if r <= t), default=w0 + startup)
        nxt = next((s for s in sessions if s.proc_start > t and s.blocks), None)
        if nxt is None or resume(nxt) > w1:
            continue  # not recovered inside the window: in the trace, not in the costs
        cost = resume(nxt) - t
        if any(t <= r <= nxt.proc_start for r in restarts):
            ij.append(cost)
            f["recovered_by"] = "in-job restart"
        else:
            pend = _outside(t, resume(nxt), spans)
            extra = ck.snapshot_s + ck.write_s if f["class"] == "planned" else 0.0
            rq.append(cost - pend - startup - extra)
            rq_pend.append(pend)
            f["recovered_by"] = "requeue"
        f["cost_s"] = cost
    # Means, not medians: each cost enters the simulation once per fault, so the mean keeps the total.
    costs = RecoveryCosts(startup_s=startup, requeue_recovery_s=max(0.0, float(np.mean(rq))) if rq else 0.0,
                          requeue_hold_s=float(np.mean(rq_pend)) if rq_pend else 0.0, queue_wait_s=0.0,
                          injob_recovery_s=float(np.mean(ij)) if ij else 0.0, memory_restore_s=0.0)
    rp = Replay(d["policy"], w1 - w0, faults, costs, ck, interval_s=a.every * ideal, memory_every_s=ideal,
                spares=SPARES[d["policy"]], exclude_on_restart=True)
    sim_wall = replay(rp)
    # The injector holds a fault that falls in a recovery until the job trains again; the simulator would
    # start that recovery over. So the replayed trace places each fault at its measured training offset after
    # the simulator's own resume (its recovery costs are the run's means), the exposure the fault really had.
    t_sim, trace = costs.startup_s, []
    for f in applied:
        at = t_sim + f["offset_s"]
        trace.append((at, f["class"]))
        if f.get("recovered_by") == "in-job restart":
            t_sim = at + costs.injob_recovery_s
        else:
            t_sim = at + costs.requeue_recovery_s + costs.requeue_hold_s + costs.startup_s + (
                ck.snapshot_s + ck.write_s if f["class"] == "planned" else 0.0)
    sim = replay(Replay(d["policy"], w1 - w0, [x for x in trace if x[0] < w1 - w0], costs, ck,
                        interval_s=a.every * ideal, memory_every_s=ideal, spares=SPARES[d["policy"]],
                        exclude_on_restart=True))
    counts = {k: sum(1 for f in d["faults"] if f["applied"] and f["time"] < w1 and f["fault"] == k) for k in FAULTS}
    return {"policy": d["policy"], "window_s": w1 - w0, "faults": counts, "requeues": len(rq),
            "injob_restarts": len(ij), "measured": meas, "ideal_step_s": ideal,
            "costs": costs.__dict__, "checkpoint": {"snapshot_s": ck.snapshot_s, "write_s": ck.write_s},
            "trace_wall": faults, "trace": trace, "simulated": sim, "simulated_wall_times": sim_wall,
            "fault_records": applied, "difference_pp": (sim["goodput"] - meas["goodput"]) * 100}


def table(results: list[dict[str, Any]]) -> str:
    """The RESULTS table."""
    lines = ["| policy | window (min) | faults (kill9/sigstop/node/preempt) | recovered in-job / requeued | "
             "measured goodput | productive / lost / recovery / start-up+restore / save stall / other (% of "
             "allocated) | queue wait (s) | simulated goodput | difference (pp) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        m, b = r["measured"], r["measured"]["badput_s"]
        tot = m["total_s"]

        def pct(x: float, tot: float = tot) -> str:
            return f"{100 * x / tot:.1f}"
        rec = b["recovery"] + b["hang_detection"]
        start = b["startup"] + b["restore"]
        other = b["other"] + b["data_loading"] + b["eval"]
        f = r["faults"]
        lines.append(
            f"| {r['policy']} | {r['window_s'] / 60:.1f} | {sum(f.values())} ({f['kill9']}/{f['sigstop']}/"
            f"{f['node']}/{f['preempt']}) | {r['injob_restarts']} / {r['requeues']} | **{100 * m['goodput']:.1f}%** | "
            f"{pct(m['productive_s'])} / {pct(b['lost_progress'])} / {pct(rec)} / {pct(start)} / "
            f"{pct(b['checkpoint_save'])} / {pct(other)} | {m['queue_wait_s']:.0f} | "
            f"{100 * r['simulated']['goodput']:.1f}% | {r['difference_pp']:+.1f} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--slurm-dir", default="/tmp/xirang-slurm-chaos", help="the testbed's XIRANG_SLURM_DIR")
    ap.add_argument("--data", default="data/stdlib-bytes")
    ap.add_argument("--minutes", type=float, default=15.0, help="wall time of each policy's run")
    ap.add_argument("--mtbf-s", type=float, default=120.0, help="mean time between injected faults")
    ap.add_argument("--mix", default="kill9=1,sigstop=1,node=1,preempt=1", help="relative weights of the kinds")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--step-s", type=float, default=1.0, help="rank 0's sleep per step (the step time)")
    ap.add_argument("--every", type=int, default=15, help="checkpoint.every_steps")
    ap.add_argument("--hang-s", type=float, default=8.0, help="monitor.hang_s (the SIGSTOP's detection)")
    ap.add_argument("--node-back-s", type=float, default=10.0, help="a lost node is back after this long")
    ap.add_argument("--settle-s", type=float, default=2.0)
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--out", default="", help="JSON of the runs and the results")
    ap.add_argument("--analyze", default="", help="only the analysis, of an earlier --out")
    a = ap.parse_args()
    if a.analyze:
        raw = json.loads(Path(a.analyze).read_text())
        runs = raw["runs"]
        for k in ("every",):
            setattr(a, k, raw["args"][k])
    else:
        commit = _sh(["git", "rev-parse", "--short", "HEAD"], dict(os.environ)).strip()  # the code that runs
        mix = {k: float(v) for k, v in (x.split("=") for x in a.mix.split(","))}
        plan = schedule(a.seed, a.mtbf_s, mix, a.minutes * 60)
        print(f"fault plan ({len(plan)}): " + ", ".join(f"{t:.0f}s {k}" for t, k in plan), flush=True)
        root = Path(tempfile.mkdtemp(prefix="bench-goodput-"))
        chaos = [Chaos(p, a, root) for p in a.policies.split(",")]
        threads = [threading.Thread(target=c.chaos, args=(plan,)) for c in chaos]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        time.sleep(5)
        runs = [c.to_dict() for c in chaos]
        raw = {"args": vars(a), "plan": plan, "runs": runs,
               "commit": commit,
               "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
        out = Path(a.out or root / "bench_goodput.json")
        out.write_text(json.dumps(raw, indent=1, default=str))
        print(f"runs: {out}", flush=True)
    results = []
    for d in runs:
        try:
            results.append(analyze(d, a))
        except Exception as exc:  # noqa: BLE001
            print(f"[{d['policy']}] analysis failed: {exc!r}", flush=True)
    for r in results:
        print(json.dumps({k: r[k] for k in ("policy", "faults", "costs", "checkpoint", "ideal_step_s")}))
        sim = {k: round(v, 1) for k, v in r["simulated"].items() if not k.startswith("goodput")}
        meas = {k: round(v, 1) for k, v in r["measured"]["badput_s"].items()}
        print(f"  measured {r['measured']['goodput']:.4f}, productive {r['measured']['productive_s']:.1f} s of "
              f"{r['measured']['total_s']:.1f} s; badput {meas}")
        print(f"  simulated {r['simulated']['goodput']:.4f}: {sim}")
        print(f"  simulated with the faults at their wall times {r['simulated_wall_times']['goodput']:.4f}")
    print()
    print(table(results))
    if a.out or a.analyze:
        path = Path(a.out or a.analyze).with_suffix(".results.json")
        path.write_text(json.dumps(results, indent=1, default=str))
        print(f"results: {path}")


if __name__ == "__main__":
    main()
