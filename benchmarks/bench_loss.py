"""Peak memory and time of the output head + next-token loss, forward and backward: chunked vs plain.

- plain: ``lm_loss(F.linear(h, W), y)`` (models/gpt.py): the (tokens, vocab) logits, their fp32 copy for the
  softmax and, in the backward, a gradient of the same size;
- chunked: ``chunked_lm_loss(h, W, y, chunk)`` (models/loss.py): one chunk's logits at a time, the gradients of h
  and W computed in the same pass.

Each variant runs in its own fresh process (fp32, CPU), so its peak resident memory above the process's
resident size just before the loss is the loss's own; the results (loss, gradient norms) of both are
compared first. Printed: peak MiB of each, the ratio chunked/plain, and median seconds over ``--repeats``.

    python benchmarks/bench_loss.py [--vocab 128256 --tokens 4096 --hidden 512 --chunk 2048 --repeats 3]

The issue-sized case (4 x 4,096 tokens at a 128,256 vocabulary: 8 GiB per logits copy) needs ~30 GiB for
the plain path; the default is one 4,096-token sequence (2 GiB per copy) so that it fits a 24 GiB box.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time

from _common import rss_mib


def _child(variant: str, vocab: int, tokens: int, hidden: int, chunk: int, repeats: int) -> None:
    import torch
    import torch.nn.functional as F

    from xirang_hpc.models.gpt import lm_loss
    from xirang_hpc.models.loss import chunked_lm_loss

    g = torch.Generator().manual_seed(0)
    h = (torch.randn(1, tokens, hidden, generator=g) * 0.5).requires_grad_()
    w = (torch.randn(vocab, hidden, generator=g) * 0.02).requires_grad_()
    y = torch.randint(0, vocab, (1, tokens), generator=g)
    times = []
    base = 0.0
    for i in range(repeats):
        h.grad = w.grad = None
        if i == 0:
            base = rss_mib()  # inputs and weights allocated, nothing of the loss yet
        t0 = time.perf_counter()
        loss = lm_loss(F.linear(h, w), y) if variant == "plain" else chunked_lm_loss(h, w, y, chunk)
        loss.backward()
        times.append(time.perf_counter() - t0)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB -> MiB
    print(json.dumps({"loss": float(loss), "gh": float(h.grad.norm()), "gw": float(w.grad.norm()),
                      "peak_mib": peak - base, "median_s": statistics.median(times)}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--chunk", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--child", choices=["plain", "chunked"], help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        _child(a.child, a.vocab, a.tokens, a.hidden, a.chunk, a.repeats)
        return
    res = {}
    for variant in ("plain", "chunked"):
        out = subprocess.run([sys.executable, __file__, "--child", variant, "--vocab", str(a.vocab), "--tokens",
                              str(a.tokens), "--hidden", str(a.hidden), "--chunk", str(a.chunk), "--repeats",
                              str(a.repeats)], check=True, capture_output=True, text=True).stdout
        res[variant] = json.loads(out.strip().splitlines()[-1])
    p, c = res["plain"], res["chunked"]
    for k in ("loss", "gh", "gw"):
        assert abs(c[k] / p[k] - 1) < 1e-4, (k, p[k], c[k])
    logits_mib = a.tokens * a.vocab * 4 / 2**20
    print(f"head + loss, vocab {a.vocab}, {a.tokens} tokens, hidden {a.hidden}, chunk {a.chunk} "
          f"(one fp32 logits copy: {logits_mib:.0f} MiB); results equal (loss {p['loss']:.5f})")
    print(f"peak memory above inputs: plain {p['peak_mib']:.0f} MiB, chunked {c['peak_mib']:.0f} MiB, "
          f"ratio {c['peak_mib'] / p['peak_mib']:.3f}x")
    print(f"median time fwd+bwd: plain {p['median_s']:.3f} s, chunked {c['median_s']:.3f} s, "
          f"ratio {c['median_s'] / p['median_s']:.2f}x")


if __name__ == "__main__":
    main()
