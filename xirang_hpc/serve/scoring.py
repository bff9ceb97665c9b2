"""Log-probabilities of whole token sequences: what ``echo`` and ``logprobs`` of ``/v1/completions`` return.

One forward per batch of sequences (right-padded: attention is causal, so a row's real positions never see
the padding), log-softmax in float32. For a sequence of ``L`` tokens, position ``i`` (1 <= i < L) gets the
log-probability of token ``i`` given tokens ``0..i-1`` and the ``top`` most likely tokens there; position
``L`` (after the last token) gets the greedy next token and its log-probability, so a request for one
greedy token with logprobs needs no generation loop. This is what evaluation harnesses read to score a
continuation (lm-evaluation-harness's ``local-completions`` sends ``echo=true, logprobs=1, max_tokens=1``).
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from xirang_hpc.serve.adapters import AdapterSet


@dataclass
class Scored:
    """One sequence's scores."""

    token_logprobs: list[float]  # positions 1..L-1: log p(token_i | tokens_<i)
    top: list[list[tuple[int, float]]]  # positions 1..L: the ``top`` most likely (token, logprob), best first
    next_id: int  # the greedy token after the sequence
    next_logprob: float


class Scorer:
    """Scores sequences with ``model`` (``model(x) -> (B, T, V)`` logits), ``max_batch`` rows per forward.

    Calls are serialised (one forward at a time beside the generation engine's thread)."""

    def __init__(self, model: nn.Module, max_batch: int, adapters: AdapterSet | None = None) -> None:
        self.model, self.max_batch, self.adapters = model, max(1, max_batch), adapters
        self._lock = threading.Lock()

    @torch.inference_mode()
    def score(self, seqs: list[list[int]], top: int, adapter: int = 0) -> list[Scored]:
        """Scores of every sequence (each non-empty, at most the model's context), under the served LoRA adapter
        ``adapter`` (0: the base model)."""
        with self._lock:
            out: list[Scored | None] = [None] * len(seqs)
            order = sorted(range(len(seqs)), key=lambda i: -len(seqs[i]))  # similar lengths share a forward
            for start in range(0, len(order), self.max_batch):
                rows = order[start:start + self.max_batch]
                width = len(seqs[rows[0]])
                x = torch.zeros(len(rows), width, dtype=torch.long)
                for r, i in enumerate(rows):
                    x[r, : len(seqs[i])] = torch.tensor(seqs[i], dtype=torch.long)
                device = next(self.model.parameters()).device
                rows_of = self.adapters.rows([adapter] * len(rows)) if self.adapters else contextlib.nullcontext()
                with rows_of:
                    logp = F.log_softmax(self.model(x.to(device)).float(), dim=-1).cpu()
                for r, i in enumerate(rows):
                    out[i] = _one(logp[r], seqs[i], top)
            return [s for s in out if s is not None]


def _one(logp: torch.Tensor, ids: list[int], top: int) -> Scored:
    n = len(ids)
    rows = logp[:n]  # row j: the distribution of token j+1
    tgt = torch.tensor(ids[1:], dtype=torch.long)
    tok_lp = rows[: n - 1].gather(1, tgt[:, None])[:, 0].tolist() if n > 1 else []
    best_lp, best_id = rows[n - 1].max(dim=-1)
    tops: list[list[tuple[int, float]]] = []
    if top > 0:
        vals, idx = rows.topk(min(top, rows.shape[-1]), dim=-1)
        tops = [list(zip(i.tolist(), v.tolist(), strict=True)) for v, i in zip(vals, idx, strict=True)]
    else:
        tops = [[] for _ in range(n)]
    return Scored(tok_lp, tops, int(best_id), float(best_lp))
