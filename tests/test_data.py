"""Data prep round trip, split stability, sampling determinism, and corpus errors."""

from __future__ import annotations

import json
from pathlib import Path

import h5py
import numpy as np
import pytest

from xirang_hpc.data.dataset import TokenWindows
from xirang_hpc.data.prepare import CorpusError, assign_splits, load_index, prepare, verify
from xirang_hpc.data.tokenizer import ByteTokenizer


def _all_tokens(out: Path, split: str) -> bytes:
    index = load_index(out)
    chunks = []
    for s in index["splits"][split]:
        with h5py.File(out / s["file"], "r") as f:
            chunks.append(f["tokens"][:].tobytes())
    return b"".join(chunks)


def test_prepare_round_trip(small_corpus: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    index = prepare(str(small_corpus), out, val_fraction=0.2, shard_tokens=4096)
    # Files are walked in sorted directory order; rebuild the expected streams per split.
    walk = [str(p.relative_to(small_corpus)) for p in _walk(small_corpus)]
    text = {r: (small_corpus / r).read_text() + "\n\n" for r in walk}
    splits = assign_splits(walk, 0.2, 0)
    for split in ("train", "val"):
        expected = "".join(text[r] for r, s in zip(walk, splits) if s == split).encode()
        assert _all_tokens(out, split) == expected
        assert index[f"{split}_tokens"] == len(expected)
    assert len(index["splits"]["train"]) > 1, "small shard size must produce several shards"
    with h5py.File(out / index["splits"]["train"][0]["file"], "r") as f:
        assert f.attrs["tokenizer"] == "byte" and f.attrs["vocab_size"] == 256
        assert f.attrs["source"] == str(small_corpus)
        assert f.attrs["n_tokens"] == len(f["tokens"])
        assert len(f.attrs["sha256"]) == 64
    verify(out)
    assert json.loads((out / "index.json").read_text())["files"]["val"] >= 1


def _walk(root: Path) -> list[Path]:
    import os

    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        out += [Path(dirpath) / f for f in sorted(filenames) if f.endswith(".py")]
    return out


def test_verify_detects_a_changed_shard(small_corpus: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    index = prepare(str(small_corpus), out, val_fraction=0.2)
    with h5py.File(out / index["splits"]["train"][0]["file"], "r+") as f:
        f["tokens"][0] = (int(f["tokens"][0]) + 1) % 256
    with pytest.raises(CorpusError, match="checksum"):
        verify(out)


def test_split_is_stable_when_files_are_added() -> None:
    rels = [f"a/{i}.py" for i in range(500)]
    before = dict(zip(rels, assign_splits(rels, 0.1, 0)))
    more = rels + [f"b/{i}.py" for i in range(300)]
    after = dict(zip(more, assign_splits(more, 0.1, 0)))
    assert all(after[r] == before[r] for r in rels)
    assert 20 < list(before.values()).count("val") < 80


def test_tokenizer_round_trip() -> None:
    tok = ByteTokenizer()
    text = "def f(x):\n    return 'héllo' ∑ 🙂\n"
    assert tok.decode(tok.encode(text)) == text
    assert tok.encode(text).max() < tok.vocab_size


def test_sampling_is_a_pure_function_of_seed_step_and_rank(small_corpus: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    prepare(str(small_corpus), out, val_fraction=0.2, shard_tokens=2048)
    a = TokenWindows(out, "train", 32)
    b = TokenWindows(out, "train", 32)  # a "resumed" reader
    for step in (0, 1, 7, 1000):
        xa, ya = a.batch(seed=3, step=step, global_batch=8)
        xb, yb = b.batch(seed=3, step=step, global_batch=8)
        assert np.array_equal(xa, xb) and np.array_equal(ya, yb)
        # Targets are inputs shifted by one token.
        assert np.array_equal(xa[:, 1:], ya[:, :-1])
        # Data-parallel ranks take contiguous slices of the same global batch.
        parts = [a.batch(3, step, 8, dp_rank=r, dp_size=4)[0] for r in range(4)]
        assert np.array_equal(np.concatenate(parts), xa)
    # Different steps and seeds give different batches.
    assert not np.array_equal(a.batch(3, 0, 8)[0], a.batch(3, 1, 8)[0])
    assert not np.array_equal(a.batch(3, 0, 8)[0], a.batch(4, 0, 8)[0])
    # Windows never run off the end of a shard.
    pos = a.positions(3, 5, 10_000)
    assert pos.min() >= 0 and pos.max() < a.num_windows
    assert all(len(a.window(int(p))) == 33 for p in pos[:500])


def test_empty_corpus_is_a_clear_error(tmp_path: Path) -> None:
    (tmp_path / "c").mkdir()
    with pytest.raises(CorpusError, match="no usable text"):
        prepare(str(tmp_path / "c"), tmp_path / "out")


def test_binary_corpus_is_a_clear_error(tmp_path: Path) -> None:
    c = tmp_path / "c"
    c.mkdir()
    (c / "a.txt").write_bytes(b"\x00\x01\x02binary" * 10)
    (c / "b.txt").write_bytes(b"\xff\xfe not utf-8 \xc3\x28")
    with pytest.raises(CorpusError, match="2 binary"):
        prepare(str(c), tmp_path / "out")


def test_unreadable_corpus_is_a_clear_error(tmp_path: Path) -> None:
    c = tmp_path / "c"
    c.mkdir()
    # A dangling link is unreadable even for root (permission bits are not, under root).
    (c / "gone.py").symlink_to(tmp_path / "missing.py")
    with pytest.raises(CorpusError, match="unreadable"):
        prepare(str(c), tmp_path / "out")


def test_missing_corpus_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(CorpusError, match="does not exist"):
        prepare(str(tmp_path / "nope"), tmp_path / "out")


def test_unfinished_preparation_is_not_mistaken_for_data(tmp_path: Path) -> None:
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "train_00000.h5").write_bytes(b"partial")
    with pytest.raises(CorpusError, match="xirang-prepare"):
        TokenWindows(tmp_path / "out", "train", 16)


def test_stdlib_corpus_defaults(stdlib_data: Path) -> None:
    index = load_index(stdlib_data)
    assert index["train_tokens"] > 5_000_000 and index["val_tokens"] > 20_000
    assert "python3" in index["source"]


def _fifo_safe(fn, fifo: Path, timeout: float = 20.0):
    """Run ``fn`` in a thread; if it is still blocked (on opening ``fifo``) after ``timeout``, open the FIFO's
    write end so that the reader gets end-of-file and the test fails instead of hanging."""
    import os
    import threading

    out: dict[str, object] = {}

    def target() -> None:
        try:
            out["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            out["error"] = exc

    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(timeout)
    if t.is_alive():
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        t.join(timeout)
        pytest.fail(f"blocked on the FIFO {fifo} for {timeout:.0f} s")
    if "error" in out:
        raise out["error"]  # type: ignore[misc]
    return out["value"]


def test_special_files_in_the_corpus_are_skipped_and_counted(small_corpus: Path, tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    import os
    import socket

    fifo = small_corpus / "pipe.txt"
    os.mkfifo(fifo)
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(small_corpus / "pkg" / "s.py"))
    try:
        index = _fifo_safe(lambda: prepare(str(small_corpus), tmp_path / "out", val_fraction=0.2), fifo)
    finally:
        sock.close()
    assert index["skipped_special"] == 2 and index["skipped_unreadable"] == 0
    assert index["files"]["train"] + index["files"]["val"] == 12
    err = capsys.readouterr().err
    warning = [ln for ln in err.splitlines() if "warning" in ln]
    assert len(warning) == 1 and "2 special file(s)" in warning[0], err
    assert str(fifo) in warning[0] or str(small_corpus / "pkg" / "s.py") in warning[0]


def test_a_corpus_of_only_special_files_is_refused(tmp_path: Path) -> None:
    import os

    c = tmp_path / "c"
    c.mkdir()
    os.mkfifo(c / "a.txt")
    with pytest.raises(CorpusError, match=r"1 special file\(s\)"):
        _fifo_safe(lambda: prepare(str(c), tmp_path / "out"), c / "a.txt")
    os.mkfifo(tmp_path / "f")
    with pytest.raises(CorpusError, match="not a regular file or a directory"):
        _fifo_safe(lambda: prepare(str(tmp_path / "f"), tmp_path / "out"), tmp_path / "f")


def test_two_jobs_preparing_one_directory_take_turns(small_corpus: Path, tmp_path: Path) -> None:
    """Two jobs (two pipelines, a sweep) that need the same data.out_dir at once: the second waits for the
    first's lock and then uses its data; nothing is written twice, no shard is half-overwritten."""
    import subprocess
    import sys

    from xirang_hpc.data.prepare import prepare_lock

    out = tmp_path / "shared"
    code = ("import sys, types; from xirang_hpc.data.prepare import ensure_prepared; "
            "d = types.SimpleNamespace(corpus=sys.argv[1], val_fraction=0.2, shard_tokens=4096, split_seed=0, "
            "tokenizer='byte', vocab_size=0, text_field='text', on_bad_record='fail'); "
            "ensure_prepared(d, sys.argv[2], progress=None)")
    with prepare_lock(out):  # both jobs start while a preparation holds the directory
        procs = [subprocess.Popen([sys.executable, "-c", code, str(small_corpus), str(out)], text=True,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE) for _ in range(2)]
        # Each says it waits, then blocks: neither gets past the lock while it is held.
        for p in procs:
            assert "waiting for another preparation of" in p.stderr.readline()
        assert all(p.poll() is None for p in procs)
        assert not (out / "index.json").exists()
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    said = "".join(o + e for o, e in outs)
    assert said.count("preparing data from") == 1, said  # one preparation; the other found its data
    verify(out)
