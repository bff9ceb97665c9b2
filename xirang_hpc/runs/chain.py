"""The record of a pipeline's stage chain: prepare -> train -> eval -> serve, one config for all.

With a preference stage (``preference.corpus``, see ``submit/preference.py``) the chain is prepare -> train ->
export -> dpo -> eval -> serve: the train stage's result exported as a Hugging Face directory
(``<run>/sft-model``), a DPO run on it (``<run>/dpo``), and eval and serve of the DPO run. Its records live in
the pipeline's run directory all the same.

Every stage receives the *same* validated config (composed from the usual groups). On Slurm each
stage is its own job, submitted up front and chained with ``--dependency=afterok:<previous>``
plus ``--kill-on-invalid-dep=yes``, so a failed stage cancels the rest instead of leaving them
pending forever. On the local executor the stages run in sequence in the launching process.

State lives in the run directory:
- ``pipeline.json``: the chain as submitted (stage, job id, dependency), written by the launcher;
- ``pipeline/<stage>.json``: what each stage itself reports (running / completed / failed + error).
:func:`chain_status` merges both with Slurm's view of the jobs (a job cancelled because its
dependency failed never starts, so only Slurm knows about it).
"""

from __future__ import annotations

import json
import os
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from xirang_hpc.config.schema.serve import SERVE_FILE
from xirang_hpc.files import make_dir, write_json_atomic
from xirang_hpc.slurm import control

STAGES = ("prepare", "train", "eval", "serve")
#: The chain with a preference stage (``preference.corpus``).
PREFERENCE_STAGES = ("prepare", "train", "export", "dpo", "eval", "serve")
#: Under the pipeline's run directory: the train stage's result as a Hugging Face directory (the DPO start) ...
SFT_MODEL = "sft-model"
#: ... the DPO run's own run directory ...
DPO_RUN = "dpo"
#: ... and, when the DPO run trains adapters, their PEFT export inside it, served under this name.
DPO_ADAPTER = "dpo"
PIPELINE_FILE = "pipeline.json"
STAGE_DIR = "pipeline"


def read_json(path: Path) -> dict[str, Any] | None:
    """A JSON file, or None when missing or unreadable."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def write_stage(run_dir: Path, stage: str, status: str, **extra: Any) -> None:
    """Record ``status`` (running | completed | failed) of ``stage`` under ``<run>/pipeline/``."""
    d = Path(run_dir) / STAGE_DIR
    if not d.is_dir():
        make_dir(d)
    prev = read_json(d / f"{stage}.json") or {}
    row = {**prev, "stage": stage, "status": status, "time": time.time(), **extra}
    if status == "running":
        row["start"] = row["time"]
        row.pop("error", None)
    else:
        row["end"] = row["time"]
    write_json_atomic(d / f"{stage}.json", row, indent=1)


@contextmanager
def stage_record(run_dir: Path, stage: str, enabled: bool = True, **extra: Any) -> Iterator[None]:
    """Mark ``stage`` running (with ``extra`` in its record), then completed, or failed with the error (re-raised)."""
    if enabled:
        write_stage(run_dir, stage, "running", host=os.uname().nodename, job=os.environ.get("SLURM_JOB_ID"),
                    **extra)
    try:
        yield
    except BaseException as exc:
        if enabled:
            msg = str(exc) or type(exc).__name__
            write_stage(run_dir, stage, "failed", error=f"{type(exc).__name__}: {msg}",
                        trace=traceback.format_exc()[-2000:])
        raise
    if enabled:
        write_stage(run_dir, stage, "completed")


def eval_dir(run_dir: Path) -> Path:
    """Where the pipeline's eval stage wrote ``eval.json`` and ``harness.json``: the run itself, or, in a chain with
    a preference stage, the DPO run (the stage's record names the file)."""
    rec = read_json(Path(run_dir) / STAGE_DIR / "eval.json") or {}
    return Path(rec["eval_file"]).parent if rec.get("eval_file") else Path(run_dir)


# ---- the record -------------------------------------------------------------------------------
def write_pipeline(run_dir: Path, executor: str, stages: list[dict[str, Any]]) -> None:
    """``<run>/pipeline.json``: the chain as launched."""
    write_json_atomic(Path(run_dir) / PIPELINE_FILE, {"executor": executor, "created": time.time(),
                                                "run_dir": str(run_dir), "stages": stages})


def _slurm_state(job_id: str) -> str | None:
    try:
        return control.job_info(job_id).get("JobState", "UNKNOWN")
    except control.SlurmCommandError:
        return "UNKNOWN"
    except Exception:  # noqa: BLE001 - no Slurm here: fall back to the stages' own records
        return None


def chain_status(run_dir: Path, slurm_state: Callable[[str], str | None] = _slurm_state) -> dict[str, Any]:
    """The whole chain: each stage's status and detail, and the overall status.

    Overall: ``failed at <stage>`` when a stage failed (later stages read ``cancelled``),
    ``completed`` when all are, else ``running`` / ``pending``.
    """
    run_dir = Path(run_dir)
    pipe = read_json(run_dir / PIPELINE_FILE)
    if pipe is None:
        raise FileNotFoundError(f"{run_dir}: no {PIPELINE_FILE}; was it started with xirang-pipeline?")
    rows, failed_at = [], None
    for st in pipe["stages"]:
        name = st["stage"]
        own = read_json(run_dir / STAGE_DIR / f"{name}.json") or {}
        status, detail = own.get("status", "pending"), own.get("error") or own.get("note", "")
        job = st.get("job_id")
        sstate = slurm_state(job) if (job and pipe["executor"] == "slurm") else None
        if sstate in ("FAILED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL") and status != "failed":
            status, detail = "failed", detail or f"Slurm job {job} ended {sstate}"
        elif sstate == "CANCELLED" and status not in ("failed", "completed"):
            status = "cancelled"
        if failed_at is not None and status in ("pending", "cancelled"):
            status, detail = "cancelled", f"not run: stage {failed_at} failed"
        if status == "failed" and failed_at is None:
            failed_at = name
        if name == "eval" and status == "completed":
            ev = read_json(eval_dir(run_dir) / "eval.json") or {}  # the DPO run's, in a preference chain
            if "val_loss" in ev:
                detail = f"val loss {ev['val_loss']:.4f}, perplexity {ev['perplexity']:.2f} (step {ev['step']})"
                if (ev.get("harness") or {}).get("metrics"):
                    detail += "; harness " + "; ".join(
                        f"{t} " + ", ".join(f"{m} {v:.4f}" for m, v in ms.items() if not m.endswith("_stderr"))
                        for t, ms in ev["harness"]["metrics"].items())
        if name == "serve" and status in ("running", "completed"):
            sv = read_json(run_dir / SERVE_FILE) or {}
            detail = f"{sv.get('status', '')} {sv.get('url', '')}".strip()
        rows.append({"stage": name, "job_id": job, "depends_on": st.get("depends_on"), "status": status,
                     "slurm_state": sstate, "detail": detail})
    statuses = [r["status"] for r in rows]
    if failed_at is not None:
        overall = f"failed at {failed_at}"
    elif all(s == "completed" for s in statuses):
        overall = "completed"
    elif any(s == "running" for s in statuses) or "completed" in statuses:
        overall = "running"
    else:
        overall = "pending"
    return {"run_dir": str(run_dir), "executor": pipe["executor"], "status": overall, "stages": rows}


def format_chain(chain: dict[str, Any]) -> str:
    """A small table of the chain for terminals."""
    lines = [f"pipeline {chain['run_dir']} ({chain['executor']}): {chain['status']}"]
    for r in chain["stages"]:
        job = (f"job {r['job_id']}" if r["job_id"]
               else "not submitted" if chain["executor"] == "slurm" else "in-process")
        dep = f" after {r['depends_on']}" if r.get("depends_on") else ""
        lines.append(f"  {r['stage']:<8} {r['status']:<10} {job}{dep}  {r['detail']}".rstrip())
    return "\n".join(lines)
