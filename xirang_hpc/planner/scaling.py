"""Scaling laws: the loss a model of N parameters reaches after D training tokens, and what to train for a target.

The law is Hoffmann et al.'s parametric form ("Training Compute-Optimal Large Language Models",
NeurIPS 2022, arXiv:2203.15556, Sec. 3.3, eq. (2)):

    L(N, D) = E + A / N^alpha + B / D^beta

with N the model's parameters (all of them, embeddings included, as Hoffmann et al. count them) and
D its training tokens. It is fitted to the user's own runs as their Approach 3
(:mod:`xirang_hpc.planner.scaling_fit`).

Compute: C = 6 N D FLOPs (Kaplan et al. 2020, Sec. 2.1; Hoffmann et al. use the same approximation).
Minimising L at fixed C gives (Hoffmann et al., eq. (4))

    N_opt(C) = G (C/6)^(beta/(alpha+beta)),  D_opt(C) = G^-1 (C/6)^(alpha/(alpha+beta)),
    G = (alpha A / (beta B))^(1/(alpha+beta)).

Without a fit of the user's own runs, :data:`CHINCHILLA` (the published coefficients) is used; it
describes their data (MassiveText) and tokenizer, and callers say so. Its compute-optimal split is not the
closed form above but the paper's Approach 1 allocation (Hoffmann et al., Table 2: N_opt and D_opt both
~ C^0.50; Chinchilla itself, 70B parameters on 1.4T tokens, sets the constant: 20 tokens per parameter), which
its Table 3 tabulates. The eq. (10) coefficients give a = beta/(alpha+beta) = 0.45, and Besiroglu et al.
("Chinchilla Scaling: A replication attempt", 2024, arXiv:2404.10102) show that this exponent comes from a
fit stopped before convergence and rounded coefficients: their refit of the same data has a = 0.513,
consistent with Approaches 1 and 2. Over Table 3's nine decades of compute that difference in the exponent
alone moves N_opt by 23-70% (eq. (10)) or up to 23% (the refit); the loss itself is still eq. (10)'s.

Batch size and learning rate for a budget follow DeepSeek-AI's fitted power laws ("DeepSeek LLM:
Scaling Open-Source Language Models with Longtermism", 2024, arXiv:2401.02954, Sec. 3.1, eq. (1)):
B_opt = 0.2920 C^0.3271 tokens, eta_opt = 0.3118 C^-0.1250.

No torch here: numpy only (the planner's layer).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from xirang_hpc.config.schema import ModelConfig
from xirang_hpc.files import write_json_atomic
from xirang_hpc.planner.formulas import model_params

FIT_FILE = "scaling_fit.json"  # beside the data's index.json
CHINCHILLA_SOURCE = ("Hoffmann et al., 'Training Compute-Optimal Large Language Models', NeurIPS 2022 "
                     "(arXiv:2203.15556), Sec. 3.3, eq. (10): E=1.69, A=406.4, B=410.7, alpha=0.34, beta=0.28; "
                     "compute-optimal split of Approach 1, 20 tokens per parameter")
COEFFICIENTS = ("E", "A", "B", "alpha", "beta")


class ScalingError(ValueError):
    """A fit that cannot be trusted, or a target the law cannot reach; the message says why and what to do."""


class UndeterminedFit(ScalingError):
    """The runs do not pin the five coefficients down (they run off beyond a float):
    :func:`~xirang_hpc.planner.scaling_fit.fit` then ties the exponents, unless asked for the free fit."""


@dataclass(frozen=True)
class Point:
    """One finished run: its parameters, training tokens and final validation loss."""

    params: float
    tokens: float
    loss: float
    run: str = ""  # where it came from (a run directory), for messages

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready."""
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class ScalingLaw:
    """L(N, D) = E + A/N^alpha + B/D^beta, with where it came from and (when fitted) bootstrap samples."""

    E: float
    A: float
    B: float
    alpha: float
    beta: float
    source: str = ""
    default: bool = False  # the published coefficients, not a fit of the user's runs
    # Bootstrap refits, one row (E, A, B, alpha, beta) each: every interval is computed from these.
    samples: tuple[tuple[float, ...], ...] = field(default=(), repr=False)
    # A published compute-optimal split used instead of the law's own minimum: D_opt = tokens_per_param x N_opt
    # with C = 6 N D (Hoffmann et al.'s Approach 1: both exponents 0.50). 0: the law's closed form, eq. (4).
    tokens_per_param: float = 0.0
    # Fitted with one exponent (alpha = beta) because the runs did not determine both (see the module's notes).
    tied: bool = False

    def loss(self, n: float, d: float) -> float:
        """Predicted loss of ``n`` parameters trained on ``d`` tokens.

        Written with negative powers: a bootstrap refit can carry a large exponent, and ``n**alpha`` would
        overflow a float where ``n**-alpha`` only underflows to 0.
        """
        return self.E + self.A * n ** -self.alpha + self.B * d ** -self.beta

    @property
    def _G(self) -> float:
        return (self.alpha * self.A / (self.beta * self.B)) ** (1.0 / (self.alpha + self.beta))

    def optimal(self, compute: float) -> tuple[float, float]:
        """Compute-optimal (N, D) for ``compute`` FLOPs (C = 6ND; Hoffmann et al. eq. (4), or the fixed
        tokens-per-parameter allocation when the law carries one)."""
        if self.tokens_per_param:
            n = math.sqrt(compute / (6.0 * self.tokens_per_param))  # C = 6 N (r N)
            return n, self.tokens_per_param * n
        a = self.beta / (self.alpha + self.beta)
        n = self._G * (compute / 6.0) ** a
        return n, compute / (6.0 * n)

    def optimal_loss(self, compute: float) -> float:
        """The loss on the compute-optimal frontier at ``compute`` FLOPs."""
        return self.loss(*self.optimal(compute))

    def compute_for_loss(self, target: float) -> float:
        """The least compute (FLOPs) whose compute-optimal model reaches ``target`` loss.

        The frontier's loss falls monotonically with C towards E, so a bisection in log C finds it.
        """
        if target <= self.E:
            raise ScalingError(self._below_e(target))
        lo, hi = 1e6, 1e40
        if self.optimal_loss(hi) > target:
            raise ScalingError(f"target loss {target:g} is not reached below 1e40 FLOPs by {self.describe()}; "
                               f"aim higher than the irreducible loss E={self.E:.4g}")
        for _ in range(200):
            mid = math.sqrt(lo * hi)
            if self.optimal_loss(mid) > target:
                lo = mid
            else:
                hi = mid
            if hi / lo < 1 + 1e-9:
                break
        return hi

    def optimal_for_tokens(self, tokens: float) -> tuple[float, float]:
        """(N, C): the model that ``tokens`` training tokens are compute-optimal for, and its compute.

        Inverts D_opt(C) = G^-1 (C/6)^(alpha/(alpha+beta)), or D = r N for a fixed allocation.
        """
        if self.tokens_per_param:
            n = tokens / self.tokens_per_param
            return n, 6.0 * n * tokens
        c6 = (tokens * self._G) ** ((self.alpha + self.beta) / self.alpha)
        return 6.0 * c6 / (6.0 * tokens), 6.0 * c6

    def interval(self, name: str, level: float = 0.95) -> tuple[float, float] | None:
        """Bootstrap percentile interval of a coefficient (``E``, ``A``, ``B``, ``alpha``, ``beta``); None
        without samples (the default law)."""
        if not self.samples:
            return None
        col = np.asarray(self.samples)[:, COEFFICIENTS.index(name)]
        q = (1 - level) / 2
        return float(np.quantile(col, q)), float(np.quantile(col, 1 - q))

    def sample_laws(self) -> list[ScalingLaw]:
        """One law per bootstrap sample (for intervals of derived quantities)."""
        return [ScalingLaw(*row, tokens_per_param=self.tokens_per_param, tied=self.tied) for row in self.samples]

    def spread(self, fn: Any, level: float = 0.95) -> tuple[float, float] | None:
        """Bootstrap percentile interval of ``fn(law)`` over the samples (None without samples); samples
        where ``fn`` fails (a target below that sample's E) are left out."""
        vals = []
        for law in self.sample_laws():
            try:
                v = float(fn(law))
            except (ScalingError, ValueError, OverflowError, ZeroDivisionError):
                continue
            if math.isfinite(v):
                vals.append(v)
        if len(vals) < 10:
            return None
        q = (1 - level) / 2
        return float(np.quantile(vals, q)), float(np.quantile(vals, 1 - q))

    def describe(self) -> str:
        """One line: the coefficients (with 95% intervals when fitted)."""
        parts = []
        for name in COEFFICIENTS[:4] if self.tied else COEFFICIENTS:
            v = getattr(self, name)
            iv = self.interval(name)
            label = "alpha=beta" if self.tied and name == "alpha" else name
            parts.append(f"{label}={v:.4g}" + (f" [{iv[0]:.4g}, {iv[1]:.4g}]" if iv else ""))
        split = (f"; compute-optimal split D = {self.tokens_per_param:g} N (Hoffmann et al. Approach 1)"
                 if self.tokens_per_param else "")
        tied = ("; one exponent for both terms (the runs did not determine two; alpha = beta is Hoffmann et al.'s "
                "Approaches 1-2 allocation, N_opt ~ C^0.5)" if self.tied else "")
        return "L(N,D) = E + A/N^alpha + B/D^beta with " + ", ".join(parts) + split + tied

    def _below_e(self, target: float) -> str:
        iv = self.interval("E")
        where = f" (95% interval [{iv[0]:.4g}, {iv[1]:.4g}])" if iv else ""
        return (f"target.loss={target:g} is at or below the irreducible loss E={self.E:.4g}{where} of the "
                f"scaling law ({self.source or 'fitted'}): no model size or token count reaches it; "
                f"set target.loss above {self.E:.4g}")

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready (the samples as lists)."""
        d = dataclasses.asdict(self)
        d["samples"] = [list(r) for r in self.samples]
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ScalingLaw:
        """Inverse of :meth:`to_dict`."""
        return cls(**{**d, "samples": tuple(tuple(float(x) for x in r) for r in d.get("samples", ()))})


# Chinchilla: 70B parameters trained on 1.4T tokens as the compute-optimal model of Gopher's budget (Hoffmann et
# al., Sec. 4): 20 tokens per parameter, Approach 1's split (Table 2: a = b = 0.50), which Table 3 tabulates.
CHINCHILLA_TOKENS_PER_PARAM = 1.4e12 / 70e9
CHINCHILLA = ScalingLaw(E=1.69, A=406.4, B=410.7, alpha=0.34, beta=0.28, source=CHINCHILLA_SOURCE, default=True,
                        tokens_per_param=CHINCHILLA_TOKENS_PER_PARAM)


def default_warning() -> str:
    """What to say whenever :data:`CHINCHILLA` stands in for a fit of the user's runs."""
    return ("warning: no scaling fit for this data; using the published law of Hoffmann et al. 2022 (Chinchilla), "
            "fitted on their data (MassiveText) and tokenizer: losses on other data or tokenizers differ, so "
            "target.loss is only indicative. Fit your own with xirang-plan --fit-scaling.")


# The runs behind the published law: "over 400 language models ranging from 70 million to over 16 billion
# parameters on 5 to 500 billion tokens" (Hoffmann et al. 2022, abstract): (parameters, tokens) ranges.
CHINCHILLA_RANGE = ((70e6, 16e9), (5e9, 500e9))


def fit_range(points: Sequence[Point]) -> tuple[tuple[float, float], tuple[float, float]]:
    """((fewest, most) parameters, (fewest, most) tokens) of a fit's runs."""
    return ((min(p.params for p in points), max(p.params for p in points)),
            (min(p.tokens for p in points), max(p.tokens for p in points)))


def extrapolation(span: tuple[tuple[float, float], tuple[float, float]], n: float, d: float,
                  whose: str = "the fit's runs") -> str | None:
    """A note where (``n`` parameters, ``d`` tokens) lies outside ``span`` (the parameter and token ranges of
    the runs behind a law: :func:`fit_range`, or :data:`CHINCHILLA_RANGE`), naming how far; None inside."""
    out = []
    for what, v, (lo, hi) in (("parameters", n, span[0]), ("tokens", d, span[1])):
        if v < lo or v > hi:
            side = f"{lo / v:.3g}x below" if v < lo else f"{v / hi:.3g}x above"
            out.append(f"{v:.3g} {what} is {side} {whose} ({lo:.3g} to {hi:.3g})")
    if not out:
        return None
    return ("extrapolated: " + "; ".join(out) + ". The predicted loss is the law's guess there; runs around "
            "the planned size make it a measurement (xirang-plan --fit-scaling)")


# ---- the fit on disk ---------------------------------------------------------------------------------

def data_fingerprint(index: dict[str, Any]) -> str:
    """sha256 over what the loss depends on in a prepared data directory's ``index.json``: the tokenizer
    and every shard's checksum (not paths or times)."""
    key = {"tokenizer": index.get("tokenizer"),
           "shards": sorted((str(s.get("file")), str(s.get("sha256"))) for s in
                            index.get("train", []) + index.get("val", []) if isinstance(s, dict))}
    if not key["shards"]:
        key["shards"] = sorted(json.dumps(s, sort_keys=True) for s in index.get("shards", []))
    return hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()


def save_fit(path: Path, law: ScalingLaw, points: Sequence[Point], fingerprint: str,
             extra: dict[str, Any] | None = None) -> Path:
    """Store a fit with its points and the data fingerprint it was fitted on (0600, atomic)."""
    rec = {"law": law.to_dict(), "points": [p.to_dict() for p in points], "data_fingerprint": fingerprint,
           **(extra or {})}
    write_json_atomic(Path(path), rec, indent=2, sort_keys=True)
    return Path(path)


def load_fit(path: Path, fingerprint: str | None = None) -> tuple[ScalingLaw, list[Point]]:
    """A stored fit; refused when ``fingerprint`` is given and differs (the data changed since the fit)."""
    path = Path(path)
    try:
        rec = json.loads(path.read_text())
        law = ScalingLaw.from_dict(rec["law"])
        points = [Point(**p) for p in rec.get("points", [])]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ScalingError(f"cannot read the scaling fit {path}: {exc}; rerun xirang-plan --fit-scaling") from exc
    if fingerprint is not None and rec.get("data_fingerprint") != fingerprint:
        raise ScalingError(f"the scaling fit {path} was fitted on other data (fingerprint "
                           f"{str(rec.get('data_fingerprint'))[:12]} vs this data's {fingerprint[:12]}): rerun "
                           "xirang-plan --fit-scaling on this data, or remove the file to use the published law")
    return law, points


# ---- from a budget to a model -------------------------------------------------------------------------

def batch_tokens(compute: float) -> float:
    """DeepSeek LLM's compute-optimal batch size in tokens: 0.2920 C^0.3271."""
    return 0.2920 * compute**0.3271


def learning_rate(compute: float) -> float:
    """DeepSeek LLM's compute-optimal peak learning rate: 0.3118 C^-0.1250."""
    return 0.3118 * compute**-0.1250


def global_batch_for(compute: float, seq_len: int, lo: int = 1, hi: int = 1 << 16) -> int:
    """Sequences per step: the power of two nearest (in log) to :func:`batch_tokens` / ``seq_len``, clamped
    to [lo, hi] (a power of two divides every data-parallel size the planner picks)."""
    want = max(1.0, batch_tokens(compute) / seq_len)
    p = 2 ** round(math.log2(want))
    return int(min(max(p, lo), hi))


def _aspect(d_model: int) -> int:
    """Width per layer: ~32 for the smallest models (the tiny presets, 64/4 = 16 to 128/4), ~64 up to d_model
    1024 (GPT-2 small 768/12), ~128 beyond (Llama 3.2 1B 2048/16, Llama 3 8B 4096/32, 405B 16384/126).
    The loss is nearly flat in this ratio over a wide range (Kaplan et al. 2020, Fig. 5)."""
    if d_model <= 256:
        return 32
    return 64 if d_model <= 1024 else 128


def _head_dim(d_model: int) -> int:
    """128 from d_model 2560 (Llama 3 8B-405B), 64 below (Llama 3.2 1B, GPT-2), 32 and 16 for tiny models."""
    if d_model < 128:
        return 16
    if d_model < 256:
        return 32
    return 64 if d_model < 2560 else 128


def model_shape(n_params: float, template: ModelConfig, name: str = "") -> ModelConfig:
    """A preset-like model of about ``n_params`` parameters in ``template``'s style (norm, MLP, positions,
    vocab, context, tied embeddings): width, depth, heads, key/value heads and MLP width chosen here.

    Widths are multiples of the head width; depth follows from the width so that the parameter count
    (:func:`~xirang_hpc.planner.formulas.model_params`, embeddings included) comes closest to
    ``n_params`` at an aspect ratio near :func:`_aspect`. GQA: a template with fewer key/value heads
    than query heads keeps Llama 3's 8 key/value heads (fewer when there are fewer heads); the MLP
    keeps the template's width ratio, rounded to a multiple of 64 (16 for tiny models).
    """
    ffn_ratio = template.ffn_dim / template.d_model
    gqa = template.n_kv_head < template.n_head
    best: tuple[float, ModelConfig] | None = None
    d = 16
    while d <= 65536:
        hd = _head_dim(d)
        # Heads in multiples of 8 from d_model 1024 (tensor parallelism up to a node's 8 GPUs divides them,
        # and 8 key/value heads divide them), of 2 from 256.
        mult = 8 if d >= 1024 else (2 if d >= 256 else 1)
        if d % (hd * mult) == 0:
            heads = d // hd
            kv = min(8, heads) if gqa else heads
            while heads % kv:
                kv -= 1
            q = 64 if d >= 256 else 16
            ffn = max(q, int(round(ffn_ratio * d / q)) * q)
            base = dataclasses.replace(template, name=name or template.name, n_layer=1, d_model=d, n_head=heads,
                                       n_kv_head=kv, d_ff=ffn, d_head=0, init_from=None)
            one = model_params(base)
            per_layer = model_params(dataclasses.replace(base, n_layer=2)) - one
            layers = max(1, round((n_params - (one - per_layer)) / per_layer))
            cand = dataclasses.replace(base, n_layer=layers)
            p = model_params(cand)
            # Closeness in parameters first, then an aspect ratio near the usual one.
            score = abs(math.log(p / n_params)) + 0.25 * abs(math.log((d / layers) / _aspect(d)))
            if best is None or score < best[0]:
                best = (score, cand)
        d += 16 if d < 256 else 64
    assert best is not None
    return best[1]


# The default sweep of ``xirang-plan --fit-scaling``: small enough for CPU ranks (minutes per run), three
# budgets a factor ~3 apart and four sizes each, so both exponents see a trend (Hoffmann et al. use 9
# budgets; more budgets and sizes give tighter intervals).
SWEEP_BUDGETS = (3e11, 1e12, 3e12)
SWEEP_SIZES = (1e5, 2e5, 4e5, 8e5)
# Each sweep run warms up over this fraction of its steps (``train.warmup_frac``): a fixed warm-up is most of
# the shortest runs and little of the longest, which bends the fitted exponents (with a fixed 20 steps the default
# sweep's larger models came out worse than its smaller ones at equal tokens).
SWEEP_WARMUP_FRAC = 0.2


def isoflop_grid(budgets: Sequence[float], sizes_per_budget: int, min_params: float, max_params: float,
                 ) -> list[tuple[float, float, float]]:
    """IsoFLOP sweep (Hoffmann et al., Approach 2's profiles): for each budget C, ``sizes_per_budget``
    model sizes spread log-evenly over [min_params, max_params]; rows (C, N, D = C/6N)."""
    rows = []
    for c in budgets:
        for n in np.geomspace(min_params, max_params, sizes_per_budget):
            rows.append((float(c), float(n), float(c / (6.0 * n))))
    return rows
