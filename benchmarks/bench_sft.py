"""Chat fine-tuning: packed rows vs padded rows, useful (non-pad) tokens per second on the same model and cores.

A synthetic chat corpus (``--samples`` conversations: a user turn and an assistant reply whose length in words
is lognormal, so most are short and a few long, as in real SFT sets) is prepared with ``xirang-prepare``'s own
code (``data.format=chat``, a trained BPE of ``--vocab`` tokens, assistant-only loss masks). Then the same
GPT trains on it twice, ``--steps`` steps of ``--batch`` rows of ``--seq`` positions after ``--warmup`` untimed
ones:

- padded (``data.packing=false``): one sample per row, the rest padding (masked from the loss);
- packed (``data.packing=true``): whole samples first-fit into rows, per-sample positions, block-diagonal
  causal attention (SDPA with a boolean mask).

Reported per mode: row fill (real positions / all positions), median step time (forward, backward, AdamW),
useful tokens/s (real input positions per second) and learned tokens/s; then the packed/padded ratio of useful
tokens/s.

    python benchmarks/bench_sft.py --samples 3000 --seq 512 --batch 8 --layers 4 --d-model 256 --threads 2
    python benchmarks/bench_sft.py --device cuda --bf16 --samples 20000 --seq 2048 --batch 16 --layers 8 --d-model 1024
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch

from xirang_hpc.config.schema import ModelConfig
from xirang_hpc.data.dataset import IGNORE_INDEX, ChatSamples
from xirang_hpc.data.prepare import prepare
from xirang_hpc.models.gpt import GPT, lm_loss

WORDS = ("the of and to in is that for it as was with be by on not he this are or his from at which but have an "
         "they you were her she there one all we their can has more when will would if so what out up into no "
         "model data train token loss layer batch sequence attention gradient").split()


def write_corpus(path: Path, n: int, seed: int, mu: float, sigma: float) -> None:
    """``n`` conversations: a short user turn, an assistant reply of lognormal(mu, sigma) words (at least 1)."""
    rng = random.Random(seed)
    with path.open("w") as f:
        for _ in range(n):
            msgs = [{"role": "user", "content": " ".join(rng.choices(WORDS, k=rng.randint(4, 24)))},
                    {"role": "assistant",
                     "content": " ".join(rng.choices(WORDS, k=max(1, int(rng.lognormvariate(mu, sigma)))))}]
            if rng.random() < 0.3:
                msgs.insert(0, {"role": "system", "content": "You are a helpful assistant."})
            f.write(json.dumps({"messages": msgs}) + "\n")


def run(data_dir: Path, packing: bool, a: argparse.Namespace) -> dict[str, float]:
    """Train ``a.steps`` timed steps; fill, step time, useful and learned tokens per second."""
    data = ChatSamples(data_dir, "train", a.seq, packing=packing, overlong="truncate", seed=0)
    cfg = ModelConfig(name="bench", n_layer=a.layers, n_head=a.heads, d_model=a.d_model, d_ff=4 * a.d_model,
                      seq_len=a.seq, vocab_size=a.vocab, pos="rope", norm="rmsnorm", mlp="swiglu", bias=False)
    torch.manual_seed(0)
    dev = torch.device(a.device)
    model = GPT(cfg, seed=0).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def sync() -> None:
        if dev.type == "cuda":
            torch.cuda.synchronize()

    def autocast() -> contextlib.AbstractContextManager[None]:
        return torch.autocast(dev.type, dtype=torch.bfloat16) if a.bf16 else contextlib.nullcontext()

    times, useful, learned, positions = [], 0, 0, 0
    for step in range(a.warmup + a.steps):
        x, y, pos, n = data.batch(0, step, a.batch)
        real = sum(int(data._slots[i]) for g in range(step * a.batch, (step + 1) * a.batch)
                   for i in data._row_samples(g))
        x, y = x.to(dev), y.to(dev)
        pos = pos.to(dev) if pos is not None else None
        sync()
        t0 = time.perf_counter()
        with autocast():
            loss = lm_loss(model(x, position_ids=pos), y, float(max(n, 1)))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync()
        dt = time.perf_counter() - t0
        if step >= a.warmup:
            times.append(dt)
            useful += real
            learned += int((y != IGNORE_INDEX).sum())
            positions += x.numel()
    med = statistics.median(times)
    per_step = a.steps
    return {"fill": useful / positions, "step_s": med, "useful_tok_s": useful / per_step / med,
            "learned_tok_s": learned / per_step / med}


def main() -> None:
    """Prepare the corpus, train padded then packed, print both and the ratio."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--samples", type=int, default=3000)
    p.add_argument("--mu", type=float, default=3.5, help="lognormal mean of log(reply words)")
    p.add_argument("--sigma", type=float, default=0.9, help="lognormal sigma of log(reply words)")
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--bf16", action="store_true", help="bf16 autocast (fp32 weights)")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    with tempfile.TemporaryDirectory() as tmp:
        corpus = Path(tmp) / "chat.jsonl"
        write_corpus(corpus, a.samples, 0, a.mu, a.sigma)
        index = prepare(str(corpus), Path(tmp) / "out", val_fraction=0.05, tokenizer="bpe", vocab_size=a.vocab,
                        fmt="chat", progress=None)
        st = index["sample_tokens"]
        print(f"corpus: {a.samples} conversations, tokens per sample min {st['min']} median {st['median']} "
              f"p99 {st['p99']} max {st['max']} | seq {a.seq} x batch {a.batch} | {a.layers} layers d {a.d_model} | "
              f"{a.device}{' bf16' if a.bf16 else ''}, {a.threads} threads")
        res = {}
        for packing in (False, True):
            r = run(Path(tmp) / "out", packing, a)
            res[packing] = r
            print(f"{'packed' if packing else 'padded'}: fill {r['fill']:.1%} | step {r['step_s'] * 1e3:.0f} ms | "
                  f"useful {r['useful_tok_s']:,.0f} tok/s | learned {r['learned_tok_s']:,.0f} tok/s")
        print(f"packed/padded useful tokens/s: {res[True]['useful_tok_s'] / res[False]['useful_tok_s']:.2f}x")


if __name__ == "__main__":
    main()
