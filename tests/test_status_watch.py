"""``xirang-status --watch`` follows a run through a requeue: a state that looks final for one view (a
preempted job's first record) does not end the watch; two final views in a row do."""

from __future__ import annotations

from pathlib import Path

import pytest

from xirang_hpc.cli import status as status_cli


def _watch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, states: list[str]) -> list[str]:
    run = tmp_path / "run"
    run.mkdir()
    (run / "events.jsonl").write_text("")
    views = iter(states)
    shown: list[str] = []
    monkeypatch.setattr(status_cli, "snapshot", lambda runs, many: {"state": next(views)})
    monkeypatch.setattr(status_cli, "render", lambda snap, tty: shown.append(snap["state"]) or snap["state"])
    monkeypatch.setattr(status_cli.time, "sleep", lambda s: None)
    assert status_cli.main([str(run), "--watch", "--interval", "0"]) == 0
    return shown


def test_watch_goes_on_through_a_requeue(tmp_path, monkeypatch):
    states = ["RUNNING", "PREEMPTED", "PENDING", "RUNNING", "COMPLETED", "COMPLETED", "UNREACHED"]
    assert _watch(tmp_path, monkeypatch, states) == states[:6]


def test_watch_ends_on_a_run_that_stays_ended(tmp_path, monkeypatch):
    assert _watch(tmp_path, monkeypatch, ["FAILED", "FAILED", "UNREACHED"]) == ["FAILED", "FAILED"]
