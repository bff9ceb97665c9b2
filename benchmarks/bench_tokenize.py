"""Tokenization throughput: xirang-prepare's path vs the ``tokenizers`` library's own ``encode_batch``.

One run, the same files, the same BPE, the same cores. The corpus is the first ``--mb`` MB of this
interpreter's standard-library ``.py`` files (sorted paths), copied to a temporary directory; the BPE
(``--vocab`` tokens) is trained on it once by ``xirang-prepare``'s own trainer, untimed.

- ``ours (prepare)``: the whole ``prepare()`` call with that tokenizer.json: walk and read the files,
  encode in batches, append <|endoftext|>, write the HDF5 shards with their sha256, write index.json;
- ``ours (encode only)``: the same reading + batched encoding, without the shards (where time goes);
- ``ceiling``: the files already in memory, one ``Tokenizer.encode_batch`` call over all of them, and
  one ``encode_batch_fast`` call (the same without offsets: what prepare uses); the ratio is taken
  against the faster of the two.

Medians over ``--repeats`` rounds, the methods alternating inside each round (order rotated per round).

    python benchmarks/bench_tokenize.py --mb 4 --repeats 3
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sysconfig
import tempfile
import time
from pathlib import Path

from xirang_hpc.data.prepare import encode_documents, iter_documents, prepare, scan_corpus, train_bpe
from xirang_hpc.data.tokenizer import HFTokenizer


def build_corpus(dst: Path, mb: float) -> tuple[int, int]:
    """Copy stdlib .py files (sorted) into ``dst`` until ``mb`` MB; (files, bytes)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    n = size = 0
    for p in sorted(root.rglob("*.py")):
        if "site-packages" in p.parts or "__pycache__" in p.parts:
            continue
        try:
            p.read_bytes().decode("utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        rel = p.relative_to(root)
        (dst / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(p, dst / rel)
        n, size = n + 1, size + p.stat().st_size
        if size >= mb * 1e6:
            break
    return n, size


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mb", type=float, default=4.0, help="corpus size in MB")
    ap.add_argument("--vocab", type=int, default=8192, help="BPE vocabulary size")
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="xirang-bench-tok-"))
    try:
        corpus = work / "corpus"
        corpus.mkdir()
        n_files, n_bytes = build_corpus(corpus, a.mb)
        texts = [p.read_text(encoding="utf-8") for p in sorted(corpus.rglob("*.py"))]
        tok_path = work / "tokenizer.json"
        t0 = time.perf_counter()
        train_bpe(iter(texts), a.vocab).save(str(tok_path))
        print(f"corpus: {n_files} files, {n_bytes / 1e6:.2f} MB; BPE vocab {a.vocab} trained in "
              f"{time.perf_counter() - t0:.1f}s; cores visible: {len(os.sched_getaffinity(0))}, "
              f"RAYON_NUM_THREADS={os.environ.get('RAYON_NUM_THREADS', 'unset')}")
        tok = HFTokenizer(tok_path)
        backend = tok.backend
        scan = scan_corpus(str(corpus))

        def ours_prepare() -> int:
            index = prepare(str(corpus), work / "out", val_fraction=0.01, tokenizer=str(tok_path), progress=None)
            return int(index["train_tokens"]) + int(index["val_tokens"])

        def ours_encode() -> int:
            docs = iter_documents(scan, corpus, val_fraction=0.01)
            return sum(len(ids) for _, ids in encode_documents(tok, docs))

        def ceiling() -> int:
            return sum(len(e.ids) for e in backend.encode_batch(texts, add_special_tokens=False))

        def ceiling_fast() -> int:
            return sum(len(e.ids) for e in backend.encode_batch_fast(texts, add_special_tokens=False))

        methods = {"ours (prepare)": ours_prepare, "ours (encode only)": ours_encode,
                   "ceiling encode_batch": ceiling, "ceiling _fast": ceiling_fast}
        times: dict[str, list[float]] = {k: [] for k in methods}
        tokens: dict[str, int] = {}
        names = list(methods)
        for r in range(a.repeats):
            for name in names[r % len(names):] + names[: r % len(names)]:  # rotate the order every round
                fn = methods[name]
                t0 = time.perf_counter()
                tokens[name] = fn()
                times[name].append(time.perf_counter() - t0)
        print(f"{'method':<22} {'median s':>9} {'tokens':>10} {'tokens/s':>11} {'MB/s':>7}")
        rate = {}
        for name in methods:
            med = statistics.median(times[name])
            rate[name] = tokens[name] / med
            print(f"{name:<22} {med:9.3f} {tokens[name]:10,d} {rate[name]:11,.0f} {n_bytes / 1e6 / med:7.2f}")
        # Ours also counts one <|endoftext|> per file; compare time for the same bytes.
        best = min(statistics.median(times["ceiling encode_batch"]), statistics.median(times["ceiling _fast"]))
        ratio = best / statistics.median(times["ours (prepare)"])
        ratio_enc = best / statistics.median(times["ours (encode only)"])
        print(f"ratio ours/ceiling (same bytes; ceiling time / our time, vs the faster ceiling): "
              f"prepare {ratio:.2f}x, encode only {ratio_enc:.2f}x "
              f"(target >= 0.8)")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
