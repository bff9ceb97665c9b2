"""LoRA vs full fine-tuning of the same model, and our LoRA step vs peft on transformers, in one run.

One process, the same Llama-shaped model (built with transformers' config classes and loaded into ours
from its ``save_pretrained`` directory: nothing downloaded), the same random token batches, the same
intra-op threads. Reported: trainable parameters, AdamW state bytes, median step time (forward, backward,
AdamW step) over ``--steps`` after ``--warmup`` untimed steps, for

- ours, full fine-tune (every parameter trains);
- ours, LoRA (``finetune.method=lora``: frozen base, adapters on ``--targets``);
- peft on transformers' ``LlamaForCausalLM`` with the same LoRA config;

and the ratios LoRA/full and ours/peft.

    python benchmarks/bench_lora.py --layers 4 --d-model 256 --heads 8 --seq 256 --batch 4 --threads 2
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from xirang_hpc.config.schema import LoraConfig
from xirang_hpc.models.lora import apply_lora
from xirang_hpc.weights.load import load_hf


def _opt_bytes(opt: torch.optim.Optimizer) -> int:
    return sum(v.numel() * v.element_size() for st in opt.state.values() for v in st.values()
               if isinstance(v, torch.Tensor) and v.dim() > 0)


def _time(step: Callable[[torch.Tensor], None], batches: list[torch.Tensor], warmup: int) -> float:
    for x in batches[:warmup]:
        step(x)
    times = []
    for x in batches[warmup:]:
        t0 = time.perf_counter()
        step(x)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _train(model: torch.nn.Module, logits_of: Callable[[torch.Tensor], torch.Tensor], lr: float,
           ) -> tuple[Callable[[torch.Tensor], None], torch.optim.Optimizer]:
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)

    def step(x: torch.Tensor) -> None:
        logits = logits_of(x[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), x[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step, opt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=2048)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--targets", default="q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    import peft
    import transformers

    targets = a.targets.split(",")
    lora = LoraConfig(rank=a.rank, alpha=2.0 * a.rank, target_modules=targets)
    with tempfile.TemporaryDirectory() as d:
        torch.manual_seed(0)
        hcfg = transformers.LlamaConfig(hidden_size=a.d_model, intermediate_size=int(8 * a.d_model / 3) // 64 * 64,
                                        num_hidden_layers=a.layers, num_attention_heads=a.heads,
                                        num_key_value_heads=a.kv_heads, vocab_size=a.vocab,
                                        max_position_embeddings=a.seq, bos_token_id=None, eos_token_id=None)
        transformers.LlamaForCausalLM(hcfg).save_pretrained(d)
        g = torch.Generator().manual_seed(1)
        batches = [torch.randint(0, a.vocab, (a.batch, a.seq + 1), generator=g) for _ in range(a.warmup + a.steps)]
        rows = []
        for name in ("ours full", "ours lora", "peft lora"):
            if name.startswith("ours"):
                model = load_hf(Path(d)).model.train()
                if name == "ours lora":
                    apply_lora(model, lora)
                fwd: Callable[[torch.Tensor], torch.Tensor] = model
            else:
                base = transformers.LlamaForCausalLM.from_pretrained(d, dtype=torch.float32)
                pcfg = peft.LoraConfig(r=a.rank, lora_alpha=2.0 * a.rank, lora_dropout=0.0, target_modules=targets,
                                       task_type="CAUSAL_LM")
                model = peft.get_peft_model(base, pcfg).train()
                fwd = lambda x, m=model: m(input_ids=x).logits  # noqa: E731
            step, opt = _train(model, fwd, 1e-3)
            t = _time(step, batches, a.warmup)
            n = sum(p.numel() for p in model.parameters() if p.requires_grad)
            rows.append((name, n, _opt_bytes(opt), t))
            del model, opt
    total = rows[0][1]
    print(f"model: {a.layers} layers, d_model {a.d_model}, {a.heads}/{a.kv_heads} heads, vocab {a.vocab}, "
          f"{total / 1e6:.2f}M params | batch {a.batch} x {a.seq} | LoRA rank {a.rank} on {a.targets} | "
          f"{a.threads} threads | median of {a.steps} steps")
    print(f"{'':12} {'trainable':>12} {'AdamW state':>14} {'step (ms)':>10}")
    for name, n, b, t in rows:
        print(f"{name:12} {n:>12,} {b / 1e6:>11.2f} MB {t * 1e3:>10.1f}")
    (_, nf, bf, tf), (_, nl, bl, tl), (_, npf, bp, tp) = rows
    print(f"LoRA / full: trainable {nl / nf:.4f}x, optimizer bytes {bl / bf:.4f}x, step time {tl / tf:.2f}x")
    print(f"ours / peft (LoRA): step time {tl / tp:.2f}x (trainable {nl}/{npf})")


if __name__ == "__main__":
    main()
