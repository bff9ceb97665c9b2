"""Evaluate a checkpoint in one process: held-out loss and perplexity, plus a greedy sample.

The checkpoint may come from any training layout (it is reassembled through DCP resharding,
see :mod:`xirang_hpc.weights.load`). Batches come from the prepared data's ``val`` split via
:class:`TokenWindows`, as a pure function of ``eval.seed`` and the batch index, so two
evaluations of the same weights agree exactly. Results go to ``<run>/eval.json``; with
``eval.max_val_loss > 0`` a loss above it fails the evaluation (the pipeline's quality gate).
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

import torch

from xirang_hpc.config.schema import EvalConfig, ServeConfig, XirangConfig
from xirang_hpc.data.dataset import IGNORE_INDEX, ChatSamples, PairSamples, TokenWindows
from xirang_hpc.data.prepare import load_index
from xirang_hpc.files import record_mode
from xirang_hpc.models.gpt import lm_loss
from xirang_hpc.serve.engine import Engine
from xirang_hpc.weights.load import LoadedModel, load_checkpoint

EVAL_FILE = "eval.json"


class EvalGateError(RuntimeError):
    """The evaluated loss is above ``eval.max_val_loss``."""


@torch.inference_mode()
def heldout_loss(loaded: LoadedModel, data_dir: str | Path, ecfg: EvalConfig) -> tuple[float, int]:
    """(mean next-token loss over ``eval.batches`` x ``eval.batch_size`` val windows, tokens scored).

    Chat data: padded rows of whole samples, the mean over their learned (assistant) tokens. Preference pairs
    (a DPO run's data): the mean over the chosen replies' tokens (the rejected ones are not what to generate).
    """
    dev = next(loaded.model.parameters()).device  # where run_eval placed it (eval.device)
    fmt = load_index(data_dir).get("format")
    if fmt == "pairs":
        pairs = PairSamples(data_dir, "val", loaded.cfg.seq_len, seed=ecfg.seed)
        total, tokens = 0.0, 0
        for i in range(ecfg.batches):
            x, y = pairs.batch(ecfg.seed, i, ecfg.batch_size)
            x, y = x[: ecfg.batch_size].to(dev), y[: ecfg.batch_size].to(dev)  # the chosen rows
            total += float(lm_loss(loaded.model(x), y, 1.0))  # the sum over the chosen replies' targets
            tokens += int((y != IGNORE_INDEX).sum())
        return total / max(tokens, 1), tokens
    if fmt == "chat":
        chat = ChatSamples(data_dir, "val", loaded.cfg.seq_len, packing=False, seed=ecfg.seed)
        total, tokens = 0.0, 0
        for i in range(ecfg.batches):
            x, y, _, n = chat.batch(ecfg.seed, i, ecfg.batch_size)
            x, y = x.to(dev), y.to(dev)
            total += float(lm_loss(loaded.model(x), y, 1.0))  # the sum over learned targets
            tokens += n
        return total / max(tokens, 1), tokens
    val = TokenWindows(data_dir, "val", loaded.cfg.seq_len)
    try:
        total, tokens = 0.0, 0
        for i in range(ecfg.batches):
            x, y = val.batch(ecfg.seed, i, ecfg.batch_size)
            x, y = x.to(dev), y.to(dev)
            total += float(lm_loss(loaded.model(x), y)) * y.numel()
            tokens += y.numel()
    finally:
        val.close()
    return total / tokens, tokens


def sample(loaded: LoadedModel, prompt: str, n_tokens: int) -> str:
    """Greedy continuation of ``prompt`` with the run's tokenizer (through the serving engine, so eval and
    serve agree)."""
    if n_tokens == 0 or not prompt:
        return ""
    tok = loaded.tokenizer
    engine = Engine(loaded.model, loaded.cfg.seq_len, max_batch=1)
    try:
        out = engine.generate([[int(t) for t in tok.encode(prompt)]], n_tokens, temperature=0.0)[0]
    finally:
        engine.stop()
    return tok.decode(out)


def evaluate(loaded: LoadedModel, data_dir: str | Path, ecfg: EvalConfig) -> dict[str, Any]:
    """Loss, perplexity and a sample for already-loaded weights."""
    t0 = time.perf_counter()
    loss, tokens = heldout_loss(loaded, data_dir, ecfg)
    text = sample(loaded, ecfg.sample_prompt, ecfg.sample_tokens)
    passed = not (ecfg.max_val_loss > 0 and loss > ecfg.max_val_loss)
    return {"step": loaded.step, "source": loaded.source, "split": "val", "val_loss": loss,
            "perplexity": math.exp(min(loss, 700.0)), "tokens": tokens, "batches": ecfg.batches,
            "batch_size": ecfg.batch_size, "seed": ecfg.seed, "sample_prompt": ecfg.sample_prompt,
            "sample": text, "tokenizer": loaded.tokenizer.name, "max_val_loss": ecfg.max_val_loss, "passed": passed,
            "seconds": time.perf_counter() - t0, "time": time.time()}


def run_eval(run_dir: str | Path, data_dir: str | Path, ecfg: EvalConfig, scfg: ServeConfig | None = None,
             cfg: XirangConfig | None = None) -> dict[str, Any]:
    """Evaluate the run's checkpoint (``eval.step`` or the newest good one), write ``<run>/eval.json``.

    With ``eval.harness_tasks``, lm-evaluation-harness then runs them against the checkpoint served on
    127.0.0.1 (:mod:`xirang_hpc.eval.harness`; ``scfg``: the serving limits, ``cfg``: the run's trackers);
    its metrics also go to ``eval.json`` (``harness``). Raises :class:`EvalGateError` (after writing the file)
    when the loss fails ``eval.max_val_loss``, before any harness task runs.
    """
    loaded = load_checkpoint(run_dir, ecfg.step if ecfg.step >= 0 else None)
    loaded.place(ecfg.device, field="eval.device")
    result = evaluate(loaded, data_dir, ecfg)
    path = Path(run_dir) / EVAL_FILE

    def write() -> None:
        path.write_text(json.dumps(result, indent=1))
        path.chmod(record_mode())

    write()
    if not result["passed"]:
        raise EvalGateError(f"eval: val loss {result['val_loss']:.4f} at step {result['step']} is above "
                            f"eval.max_val_loss={ecfg.max_val_loss}; train longer or relax the gate")
    if ecfg.harness_tasks:
        from xirang_hpc.eval.harness import run_harness

        def track(step: int, values: dict[str, float]) -> None:
            if cfg is not None:
                from xirang_hpc.monitor.tracking import log_run_metrics

                log_run_metrics(cfg, run_dir, step, values)

        h = run_harness(run_dir, data_dir, ecfg, scfg or ServeConfig(), loaded, tracking=track)
        result["harness"] = {"metrics": h["metrics"], "seconds": h["seconds"], "file": "harness.json"}
        write()
    return result
