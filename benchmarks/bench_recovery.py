"""Recovery from a fault on the Slurm testbed: time from the fault to the first step after it, steps lost.

One 2-node x 2-rank tiny-GPT job per (policy, fault), one after another, in one run:

- policies: ``requeue`` (the default requeue policy: Slurm holds the requeued job in BeginTime),
  ``requeue+now`` (the requeue with an immediate restart, ``requeue.start_now``), ``in-job``
  (in-job restart from the filesystem checkpoint; no spare node on a 2-node testbed, so the job
  goes on shrunk on the healthy node), ``in-job+memory`` (the same from the in-memory copy,
  ``checkpoint.in_memory=true`` kept every step: the survivor holds the lost node's replicas);
- faults: ``kill9`` (SIGKILL of rank 3, on the second node), ``sigstop`` (SIGSTOP of rank 3;
  ``monitor.hang_s`` below), ``node`` (the second node lost: its slurmd, the job's slurmstepd
  there and its ranks SIGKILLed; only the in-job restart can go on: a requeued 2-node job has no
  second node to run on).

Each fault hits 5 steps after the first periodic checkpoint (``checkpoint.every_steps``). Measured
from the job's event log and metrics: detection (fault -> the watchdog's dead/hang event), recovery
(fault -> the first completed step after it) and steps lost (the step reached before the fault ->
the step the job resumed from). The job is cancelled once it has trained again.

    XIRANG_SLURM_DIR=... tools/slurm-testbed start   # then
    SLURM_CONF=/tmp/xirang-slurm/slurm.conf python benchmarks/bench_recovery.py --data data/stdlib-bytes
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
import time
from pathlib import Path

import psutil

from xirang_hpc.monitor.events import read_events
from xirang_hpc.runtime.markers import rank_pid

POLICIES = {
    "requeue": ["requeue=default", "requeue.max_restarts_in_job=0"],
    "requeue+now": ["requeue=testbed", "requeue.max_restarts_in_job=0"],
    "in-job": ["requeue=testbed", "requeue.max_restarts_in_job=2"],
    # The same, restarting from the node-local memory copy (kept every step, replica on the other node).
    "in-job+memory": ["requeue=testbed", "requeue.max_restarts_in_job=2", "checkpoint.in_memory=true",
                      "checkpoint.memory_every_steps=1"],
}
FAULTS = ("kill9", "sigstop", "node")
# Fault classes beyond the rank faults, each with the policy it is measured under (--classes):
# - supervisor: kill -9 of the batch step's in-job driver: the guard has the ranks save, the run is requeued;
# - controller: slurmctld stopped, then kill -9 of rank 3; slurmctld back after --outage-s: the driver's
#   new step is launched again with backoff until the controller answers;
# - oom: cluster.mem_gb too small for the ranks (the testbed enforces --mem): named and stopped, not
#   recovered (the same layout would run out again); measured from the submission to the final event;
# - disk_full: the run directory on a tmpfs that holds one checkpoint: the next save fails; named and
#   stopped at the save after it, never a crash; measured from the failing save's step to save_failed.
CLASSES = ("kill9", "oom", "sigstop", "node", "disk_full", "supervisor", "controller")


def _ev(run: Path, kind: str, since: float = 0.0) -> list[dict]:
    return [e for e in read_events(run) if e.get("kind") == kind and e.get("time", 0) >= since]


def _wait(pred, timeout: float, what: str):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        got = pred()
        if got:
            return got
        time.sleep(0.2)
    raise TimeoutError(f"benchmark run did not progress: {what}")


def _metrics(run: Path) -> list[dict]:
    path = run / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def _progress(run: Path) -> int:
    return max((r.get("step", 0) for r in _metrics(run) if "loss" in r), default=0)


def _second_node() -> str:
    """The testbed's second node (n2 unless XIRANG_SLURM_NODE_PREFIX renamed them)."""
    out = subprocess.run(["sinfo", "-h", "-N", "-o", "%N"], capture_output=True, text=True, check=True).stdout
    return sorted(set(out.split()), key=lambda n: (len(n), n))[1]


def _lose_node(run: Path, node: str) -> None:
    ranks = [int(p.read_text().split()[1]) for p in (run / "ranks" / "r0").glob("*.start")
             if p.read_text().split()[0] == node]
    stepds = {psutil.Process(pid).ppid() for pid in ranks}
    slurmd = int((Path(os.environ["SLURM_CONF"]).parent / "run" / f"slurmd-{node}.pid").read_text())
    for pid in (slurmd, *stepds, *ranks):
        os.kill(pid, signal.SIGKILL)


def _revive(node: str) -> None:
    # Down first, as an admin would mark a lost node: slurmctld then takes the job's processes there for gone,
    # and the cancelled job leaves COMPLETING at once instead of waiting for the node to answer.
    subprocess.run(["scontrol", "update", f"nodename={node}", "state=down", "reason=bench: node lost"],
                   capture_output=True)
    subprocess.run(["slurmd", "-N", node, "-f", os.environ["SLURM_CONF"]], check=True)
    for _ in range(60):
        subprocess.run(["scontrol", "update", f"nodename={node}", "state=resume"], capture_output=True)
        state = subprocess.run(["sinfo", "-h", "-n", node, "-o", "%t"], capture_output=True, text=True).stdout
        if state.strip() in ("idle", "mix", "alloc"):
            return
        time.sleep(2)


def _slurmctld_pidfile() -> Path:
    conf = Path(os.environ["SLURM_CONF"])
    name = re.search(r"^ClusterName=(\S+)", conf.read_text(), re.M).group(1)
    return conf.parent / "run" / f"slurmctld-{name}.pid"


def _driver(run: Path) -> psutil.Process | None:
    for p in psutil.process_iter(["cmdline"]):
        cmd = " ".join(p.info["cmdline"] or [])
        if "xirang_hpc.batch.injob" in cmd and str(run) in cmd and "--guard" not in cmd:
            return p
    return None


def one(policy: str, fault: str, a: argparse.Namespace, extra: tuple[str, ...] = (),
        runs: Path | None = None) -> dict:
    """Submit, wait past the first checkpoint, inject ``fault``, measure until a step runs again."""
    runs = runs or Path(tempfile.mkdtemp(prefix=f"bench-recovery-{policy}-{fault}-"))
    cmd = [sys.executable, "-c", "from xirang_hpc.cli.train import main; main()", "cluster=testbed",
           *POLICIES[policy], f"train.max_steps={a.steps}", "train.warmup_steps=2", "train.log_every=1",
           "train.eval_batches=2", "parallel.pp=1", "parallel.tp=1", "monitor.enabled=true",
           f"monitor.hang_s={a.hang_s}", "cluster.threads_per_rank=1", f"checkpoint.every_steps={a.every}",
           f"data.out_dir={Path(a.data).absolute()}", f"train.runs_root={runs}", *extra]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    job = re.search(r"submitted Slurm job (\d+)", out).group(1)
    run = Path(re.search(r"run dir (\S+)", out).group(1))
    try:
        if fault == "oom":  # stopped and named, from the start: the ranks never fit
            t_fault = float(_ev(run, "submit")[0]["time"])
            final = _wait(lambda: [e for e in _ev(run, "exit") if e.get("final")], a.timeout, "the OOM's final exit")
            return {"policy": policy, "fault": fault, "job": job, "how": f"stopped: {final[-1].get('status')}",
                    "detect_s": final[-1]["time"] - t_fault, "recovery_s": float("nan"), "reached": 0,
                    "resumed": 0, "lost": 0, "nodes_after": None}
        _wait(lambda: _progress(run) >= a.every + 5, 600, "training past the first checkpoint")
        if fault == "disk_full":  # the next save does not fit: the time from its step to the event naming it
            failed = _wait(lambda: _ev(run, "save_failed"), a.timeout, "the failed save")[0]
            rows = {r["step"]: r for r in _metrics(run) if "loss" in r and "time" in r}
            at = rows.get(failed.get("step"), {}).get("time", failed["time"])
            final = _wait(lambda: [e for e in _ev(run, "exit") if e.get("final")], a.timeout, "the final exit")
            return {"policy": policy, "fault": fault, "job": job, "how": f"stopped: {final[-1].get('status')}",
                    "detect_s": failed["time"] - at, "recovery_s": float("nan"), "reached": failed.get("step"),
                    "resumed": a.every, "lost": failed.get("step", 0) - a.every, "nodes_after": None}
        pid = rank_pid(run, 0, 3)
        ctld = None
        if fault == "controller":
            ctld = psutil.Process(int(_slurmctld_pidfile().read_text()))
            ctld.terminate()
            ctld.wait(60)
        reached = _progress(run)
        t_fault = time.time()
        if fault in ("kill9", "controller"):
            os.kill(pid, signal.SIGKILL)
        elif fault == "sigstop":
            os.kill(pid, signal.SIGSTOP)
        elif fault == "supervisor":
            _wait(lambda: _driver(run), 30, "the in-job driver").kill()
        else:
            _lose_node(run, _second_node())
        if ctld is not None:
            time.sleep(a.outage_s)
            subprocess.run(["slurmctld", "-f", os.environ["SLURM_CONF"]], check=True)
        first = _wait(lambda: _ev(run, "first_step", t_fault), a.timeout, "the first step after the fault")[0]
        start = _ev(run, "start", t_fault)[0]
        detect = [e["time"] for e in _ev(run, "dead", t_fault) + _ev(run, "hang", t_fault)
                  + _ev(run, "supervisor_died", t_fault)]
        how = "in-job restart" if _ev(run, "restart", t_fault) else "requeue" if _ev(run, "requeue", t_fault) else "?"
        restored = _ev(run, "restore", t_fault)
        if restored:
            how += f" ({restored[0].get('source', '?')})"
        return {"policy": policy, "fault": fault, "job": job, "how": how,
                "detect_s": min(detect) - t_fault if detect else float("nan"),
                "recovery_s": first["time"] - t_fault, "reached": reached, "resumed": start["step"],
                # A stop that saves (the driver's guard) resumes past the step sampled at the fault: nothing lost.
                "lost": max(0, reached - start["step"]), "nodes_after": start.get("nodes")}
    finally:
        subprocess.run(["scancel", job], capture_output=True)
        if fault == "disk_full":
            _wait(lambda: job not in subprocess.run(["squeue", "-h", "-o", "%i"], capture_output=True,
                                                    text=True).stdout.split(), 120, "the job to leave the queue")
            subprocess.run(["umount", str(runs)], capture_output=True)
        if fault == "node":
            _revive(_second_node())
        _wait(lambda: job not in subprocess.run(["squeue", "-h", "-o", "%i"], capture_output=True,
                                                text=True).stdout.split(), 120, "the job to leave the queue")


def one_class(fault: str, a: argparse.Namespace) -> dict:
    """One fault class under the policy it is measured with (see CLASSES)."""
    if fault == "oom":
        return one("in-job", "oom", a, ("cluster.mem_gb=0.35",))
    if fault == "disk_full":
        runs = Path(tempfile.mkdtemp(prefix="bench-recovery-disk-"))
        # One checkpoint of the tiny model (2.8 MB) and the run's small files fit, a second does not.
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=5m", "tmpfs", str(runs)], check=True)
        return one("in-job", "disk_full", a, ("checkpoint.keep_last=3",), runs=runs)
    if fault == "supervisor":
        return one("in-job", "supervisor", a)
    return one("in-job", fault, a)


def _median(xs: list[float]) -> float:
    xs = sorted(x for x in xs if x == x)
    return xs[len(xs) // 2] if xs else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", default="data/stdlib-bytes")
    ap.add_argument("--every", type=int, default=10, help="checkpoint.every_steps")
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--hang-s", type=float, default=8.0, help="monitor.hang_s for the SIGSTOP fault")
    ap.add_argument("--timeout", type=float, default=420.0, help="seconds to wait for recovery")
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--faults", default=",".join(FAULTS))
    ap.add_argument("--classes", default="", help=f"instead: these fault classes ({','.join(CLASSES)}), each "
                    "under its policy, --repeat times, medians")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--outage-s", type=float, default=10.0, help="how long slurmctld is down (controller class)")
    a = ap.parse_args()
    if a.classes:
        return by_class(a)
    rows = []
    for fault in a.faults.split(","):
        for policy in a.policies.split(","):
            if fault == "node" and not policy.startswith("in-job"):
                continue  # a requeued 2-node job has no second node left on a 2-node testbed
            try:
                rows.append(one(policy, fault, a))
            except TimeoutError as exc:
                rows.append({"policy": policy, "fault": fault, "how": f"not recovered ({exc})"})
            print(json.dumps(rows[-1]), flush=True)
    base = {r["fault"]: r["recovery_s"] for r in rows if r["policy"] == "requeue" and "recovery_s" in r}
    print("\n| fault | policy | recovered by | detection (s) | fault -> first step (s) | vs requeue | "
          "steps lost | step reached -> resumed | nodes after |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if "recovery_s" not in r:
            print(f"| {r['fault']} | {r['policy']} | {r['how']} | | | | | | |")
            continue
        ratio = f"{r['recovery_s'] / base[r['fault']]:.2f}x" if r["fault"] in base else "n/a"
        print(f"| {r['fault']} | {r['policy']} | {r['how']} | {r['detect_s']:.1f} | {r['recovery_s']:.1f} | "
              f"{ratio} | {r['lost']} | {r['reached']} -> {r['resumed']} | {r['nodes_after']} |")


def by_class(a: argparse.Namespace) -> None:
    """Each fault class --repeat times; the medians of detection, fault -> first step and steps lost."""
    table = []
    for fault in a.classes.split(","):
        rows = []
        for _ in range(a.repeat):
            try:
                rows.append(one_class(fault, a))
            except TimeoutError as exc:
                rows.append({"fault": fault, "how": f"not recovered ({exc})"})
            print(json.dumps(rows[-1]), flush=True)
        ok = [r for r in rows if "detect_s" in r]
        table.append((fault, ok[0]["how"] if ok else rows[0]["how"], len(ok), len(rows),
                      _median([r["detect_s"] for r in ok]), _median([r["recovery_s"] for r in ok]),
                      _median([float(r["lost"]) for r in ok]),
                      [round(r["recovery_s"], 1) if r["recovery_s"] == r["recovery_s"] else round(r["detect_s"], 1)
                       for r in ok]))
    print("\n| fault class | what happens | runs | detected / named (s, median) | fault -> first step (s, median) "
          "| steps lost (median) | each run (s) |")
    print("|---|---|---|---|---|---|---|")
    for fault, how, n_ok, n, det, rec, lost, each in table:
        rec_s = f"{rec:.1f}" if rec == rec else "n/a (stopped by design)"
        print(f"| {fault} | {how} | {n_ok}/{n} | {det:.1f} | {rec_s} | {lost:.0f} | {each} |")


if __name__ == "__main__":
    main()
