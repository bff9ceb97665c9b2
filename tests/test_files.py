"""``xirang_hpc.files``: the one atomic replace every run record goes through."""

from __future__ import annotations

import json
import stat
import threading

import pytest

from xirang_hpc.files import write_bytes_atomic, write_json_atomic


def test_replaces_whole_private_and_leaves_no_temporary(tmp_path):
    path = tmp_path / "owner.json"
    path.write_text("old")
    path.chmod(0o644)
    write_json_atomic(path, {"job": "12", "at": tmp_path}, indent=1, sort_keys=True, default=str)
    assert json.loads(path.read_text()) == {"at": str(tmp_path), "job": "12"}
    assert stat.S_IMODE(path.stat().st_mode) == 0o600  # a new inode, private, whatever the old mode was
    assert [p.name for p in tmp_path.iterdir()] == ["owner.json"]


def test_a_failed_write_keeps_the_old_file_and_no_temporary(tmp_path):
    path = tmp_path / "site.json"
    write_json_atomic(path, {"site": "alpha"})
    with pytest.raises(TypeError):
        write_json_atomic(path, {"site": object()})  # not JSON: nothing replaced

    with pytest.raises(TypeError):
        write_bytes_atomic(path, "text, not bytes")  # fails in the write, after the temporary was made
    assert json.loads(path.read_text()) == {"site": "alpha"}
    assert [p.name for p in tmp_path.iterdir()] == ["site.json"]


def test_concurrent_writers_never_show_a_torn_file(tmp_path):
    path = tmp_path / "rank-0.json"
    write_json_atomic(path, {"n": 0, "pad": "x" * 4096})
    seen: list[int] = []
    stop = threading.Event()

    def read() -> None:
        while not stop.is_set():
            seen.append(json.loads(path.read_text())["n"])  # a torn file would raise here

    reader = threading.Thread(target=read)
    reader.start()
    writers = [threading.Thread(target=lambda k=k: [write_json_atomic(path, {"n": k * 100 + i, "pad": "x" * 4096})
                                                    for i in range(100)]) for k in range(3)]
    for w in writers:
        w.start()
    for w in writers:
        w.join()
    stop.set()
    reader.join()
    assert seen and [p.name for p in tmp_path.iterdir()] == ["rank-0.json"]
