"""The rooms by where code runs, and what a job queued by an earlier version still finds.

A batch script written before the rooms (a job still queued, or requeued, across an upgrade) runs
``python -m xirang_hpc.launch.<module>``; those names keep working for one release, as forwarders.
"""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

pytestmark = pytest.mark.unit

FORWARDERS = {"job_entry": "xirang_hpc.batch.rank", "supervise": "xirang_hpc.batch.supervise",
              "injob": "xirang_hpc.batch.injob", "preload": "xirang_hpc.local.preload",
              "local_controller": "xirang_hpc.local.controller"}


@pytest.mark.parametrize("old", sorted(FORWARDERS))
def test_an_old_module_name_runs_the_new_module(old: str) -> None:
    assert importlib.import_module(f"xirang_hpc.launch.{old}").main is importlib.import_module(FORWARDERS[old]).main


def test_a_batch_script_of_an_earlier_version_still_starts_its_steps() -> None:
    """The two lines every rendered batch script of an earlier version holds: the rank entry and the supervisor."""
    for old, flag in (("job_entry", "--config"), ("supervise", "--rc")):
        r = subprocess.run([sys.executable, "-m", f"xirang_hpc.launch.{old}", "--help"], capture_output=True,
                           text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        assert flag in r.stdout, r.stdout
    r = subprocess.run([sys.executable, "-m", "xirang_hpc.launch.sites", "--help"], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0 and "migrate" in r.stdout, r.stderr


def test_the_current_batch_script_names_the_new_rooms() -> None:
    from importlib.resources import files

    text = (files("xirang_hpc") / "sbatch_templates" / "xirang.sbatch").read_text()
    assert "-m xirang_hpc.batch.rank " in text and "-m xirang_hpc.batch.supervise " in text
    assert "xirang_hpc.launch" not in text
