"""Several LoRA adapters served over one base: what a mixed batch costs against the base alone, in one run.

One process, one Llama-shaped model (built with transformers' config classes, ``save_pretrained``, loaded into
ours: nothing downloaded) and ``--adapters`` LoRA adapters made on it with peft. The engine decodes the same
``--requests`` greedy requests (``--new`` tokens each, all queued before it starts, so they share batches) in
three ways, interleaved over ``--repeats`` rounds:

- ``plain``: the base model, no adapters attached;
- ``base rows``: adapters attached, every request for the base (the per-row check only);
- ``mixed``: adapters attached, the requests spread evenly over the base and every adapter;
- ``merged``: for reference, one adapter merged into a copy of the weights, every request for it (what serving
  that one adapter alone would cost; N adapters this way would need N copies of the model).

Reported: median tokens/s of each, and the ratios to ``plain``.

    python benchmarks/bench_serve_adapters.py --layers 4 --d-model 256 --heads 8 --adapters 3 --rank 16 --threads 2
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import threading
import time
from pathlib import Path

import torch

from xirang_hpc.serve.adapters import attach_adapters
from xirang_hpc.serve.engine import Engine, GenRequest
from xirang_hpc.weights.load import load_hf


def _build(root: Path, a: argparse.Namespace) -> list[Path]:
    import peft
    import transformers

    cfg = transformers.LlamaConfig(hidden_size=a.d_model, intermediate_size=4 * a.d_model, num_hidden_layers=a.layers,
                                   num_attention_heads=a.heads, num_key_value_heads=a.heads, vocab_size=256,
                                   max_position_embeddings=a.seq, bos_token_id=None, eos_token_id=None)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).save_pretrained(root / "base")
    out = []
    for i in range(a.adapters):
        base = transformers.LlamaForCausalLM.from_pretrained(root / "base", dtype=torch.float32)
        lcfg = peft.LoraConfig(r=a.rank, lora_alpha=2 * a.rank, init_lora_weights=False,
                               target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "up_proj", "down_proj"])
        torch.manual_seed(i + 1)
        peft.get_peft_model(base, lcfg).save_pretrained(root / f"a{i}")
        out.append(root / f"a{i}")
    return out


def _decode(engine: Engine, adapters: list[int], new: int) -> float:
    """Tokens/s of one round: every request queued first, then the engine started."""
    done, left, lock = threading.Event(), [len(adapters)], threading.Lock()

    def fin(tokens: list[int], err: BaseException | None) -> None:
        with lock:
            left[0] -= 1
            if left[0] == 0:
                done.set()

    engine.stop()
    for i, ad in enumerate(adapters):
        engine.submit(GenRequest([65 + i % 26, 66, 67, 68], new, adapter=ad, on_done=fin))
    t0 = time.perf_counter()
    engine.start()
    done.wait()
    return len(adapters) * new / (time.perf_counter() - t0)


def main() -> None:
    """Run the comparison and print the table."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--adapters", type=int, default=3)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        dirs = _build(root, a)
        plain = load_hf(root / "base")
        multi = load_hf(root / "base")
        aset = attach_adapters(multi.model, multi.cfg, {f"a{i}": str(d) for i, d in enumerate(dirs)})
        merged = load_hf(root / "base")
        one = attach_adapters(merged.model, merged.cfg, {"a0": str(dirs[0])})
        with torch.no_grad():  # fold adapter 1 into the weights: W + s B A, then drop the adapters
            for mod in list(merged.model.modules()):
                for name, child in list(mod.named_children()):
                    if type(child).__name__ == "MultiLoRALinear":
                        child.weight.add_((child.lora_B[1] @ child.lora_A[1]) * child.scale[1])
                        lin = torch.nn.Linear(child.weight.shape[1], child.weight.shape[0], bias=child.bias is not None)
                        lin.weight, lin.bias = child.weight, child.bias
                        setattr(mod, name, lin)
        del one
        engines = {"plain": (Engine(plain.model, plain.cfg.seq_len, a.requests), [0] * a.requests),
                   "base rows": (Engine(multi.model, multi.cfg.seq_len, a.requests, adapters=aset), [0] * a.requests),
                   "mixed": (Engine(multi.model, multi.cfg.seq_len, a.requests, adapters=aset),
                             [i % (a.adapters + 1) for i in range(a.requests)]),
                   "merged": (Engine(merged.model, merged.cfg.seq_len, a.requests), [0] * a.requests)}
        rates: dict[str, list[float]] = {k: [] for k in engines}
        for eng, ads in engines.values():  # warm-up round each
            _decode(eng, ads, a.new)
        for _ in range(a.repeats):  # interleaved: the machine's drift falls on every variant alike
            for name, (eng, ads) in engines.items():
                rates[name].append(_decode(eng, ads, a.new))
        for eng, _ in engines.values():
            eng.stop()
    med = {k: statistics.median(v) for k, v in rates.items()}
    print(f"model {a.layers}x{a.d_model}, {a.adapters} adapters of rank {a.rank} on 6 linears, "
          f"{a.requests} requests x {a.new} tokens, {a.threads} threads, median of {a.repeats}")
    print("| serving | tokens/s | vs plain |")
    print("|---|---|---|")
    for k, v in med.items():
        print(f"| {k} | {v:.0f} | {v / med['plain']:.2f}x |")


if __name__ == "__main__":
    main()
