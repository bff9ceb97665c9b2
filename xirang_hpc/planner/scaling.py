"""Scaling laws: the loss a model of N parameters reaches after D training tokens, and what to train for a target.

The law is Hoffmann et al.'s parametric form ("Training Compute-Optimal Large Language Models",
NeurIPS 2022, arXiv:2203.15556, Sec. 3.3, eq. (2)):

    L(N, D) = E + A / N^alpha + B / D^beta

with N the model's parameters (all of them, embeddings included, as Hoffmann et al. count them) and
D its training tokens. It is fitted as their Approach 3: minimise, over (a, b, e, alpha, beta) with
A = exp(a), B = exp(b), E = exp(e),

    sum_i Huber_delta( LSE(a - alpha log N_i, b - beta log D_i, e) - log L_i ),  delta = 1e-3,

with L-BFGS from every point of their grid of initialisations (alpha, beta in {0, 0.5, ..., 2},
e in {-1, -0.5, ..., 1}, a, b in {0, 5, ..., 25}), keeping the best. Confidence intervals come from
a bootstrap over the points (resampled with replacement, each resample refitted). scipy is not a
dependency: the L-BFGS here is numpy's, batched over all starts at once (one array operation per
step for the whole grid), so a full fit takes about a second.

Small sweeps often do not determine all five coefficients: where the loss barely falls with model size
at a fixed token count, A and alpha trade off without bound (the fit runs off to coefficients beyond a
float, or most bootstrap refits do). Such a fit is then refitted with one exponent, alpha = beta, four
coefficients, and the law says so. The constraint is the compute-optimal allocation Hoffmann et al. found
with their Approaches 1 and 2 (Table 2: N_opt and D_opt both ~ C^0.50, which eq. (4) gives exactly when
alpha = beta), and Besiroglu et al.'s refit of their data is close to it (alpha 0.348, beta 0.366); the
data term, which a sweep does determine, then fixes the exponent and the size term keeps only A.

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

HUBER_DELTA = 1e-3  # Hoffmann et al. 2022, Sec. 3.3
FIT_FILE = "scaling_fit.json"  # beside the data's index.json
MIN_POINTS = 8  # 5 parameters: fewer points than this and the bootstrap intervals mean little
MIN_DISTINCT = 3  # distinct model sizes and distinct token counts: each exponent needs a trend of its own
# An exponent's 95% bootstrap interval may span at most this factor (hi/lo) for the fit to count as determined: a
# 20-point sweep with 1% noise spans 1.7; sweeps that do not determine the size term span 10 and more.
MAX_EXPONENT_SPREAD = 3.0
CHINCHILLA_SOURCE = ("Hoffmann et al., 'Training Compute-Optimal Large Language Models', NeurIPS 2022 "
                     "(arXiv:2203.15556), Sec. 3.3, eq. (10): E=1.69, A=406.4, B=410.7, alpha=0.34, beta=0.28; "
                     "compute-optimal split of Approach 1, 20 tokens per parameter")
_PARAMS = ("E", "A", "B", "alpha", "beta")


class ScalingError(ValueError):
    """A fit that cannot be trusted, or a target the law cannot reach; the message says why and what to do."""


class UndeterminedFit(ScalingError):
    """The runs do not pin the five coefficients down (they run off beyond a float): :func:`fit` then ties the
    exponents, unless asked for the free fit."""


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
        col = np.asarray(self.samples)[:, _PARAMS.index(name)]
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
        for name in _PARAMS[:4] if self.tied else _PARAMS:
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


# ---- fitting ---------------------------------------------------------------------------------------

def hoffmann_grid() -> np.ndarray:
    """Hoffmann et al.'s initialisations as rows (a, b, e, alpha, beta): 6 x 6 x 5 x 5 x 5 = 4500."""
    ab = np.arange(0.0, 25.0 + 1e-9, 5.0)
    e = np.arange(-1.0, 1.0 + 1e-9, 0.5)
    ex = np.arange(0.0, 2.0 + 1e-9, 0.5)
    g = np.meshgrid(ab, ab, e, ex, ex, indexing="ij")
    return np.stack([x.ravel() for x in g], axis=1)  # (4500, 5)


def _objective(x: np.ndarray, log_n: np.ndarray, log_d: np.ndarray, log_l: np.ndarray, w: np.ndarray,
               delta: float) -> tuple[np.ndarray, np.ndarray]:
    """Weighted Huber objective of every start and its gradient.

    x: (S, 5) rows (a, b, e, alpha, beta); log_n, log_d, log_l: (P,); w: (S, P) point weights (ones, or a
    bootstrap resample's counts). Returns f: (S,), grad: (S, 5).
    """
    a, b, e, al, be = (x[:, i:i + 1] for i in range(5))  # each (S, 1)
    u = np.stack([a - al * log_n, b - be * log_d, np.broadcast_to(e, (x.shape[0], log_n.size))])  # (3, S, P)
    m = u.max(axis=0)
    ex = np.exp(u - m)
    tot = ex.sum(axis=0)
    pred = m + np.log(tot)  # (S, P): log of E + A/N^alpha + B/D^beta
    r = pred - log_l
    small = np.abs(r) <= delta
    f = (w * np.where(small, 0.5 * r * r, delta * (np.abs(r) - 0.5 * delta))).sum(axis=1)
    dr = w * np.where(small, r, delta * np.sign(r))  # (S, P): dHuber/dpred
    sm = ex / tot  # (3, S, P): softmax weights, d pred / d u_k
    grad = np.stack([(dr * sm[0]).sum(1), (dr * sm[1]).sum(1), (dr * sm[2]).sum(1),
                     -(dr * sm[0] * log_n).sum(1), -(dr * sm[1] * log_d).sum(1)], axis=1)
    return f, grad


def lbfgs(fun: Any, x0: np.ndarray, max_iter: int = 500, memory: int = 10, gtol: float = 1e-10,
          ftol: float = 1e-13) -> tuple[np.ndarray, np.ndarray]:
    """Minimise independent problems at once with L-BFGS (Nocedal & Wright, Alg. 7.4 and 7.5).

    ``fun(x, rows)`` takes (R, k) points of the problems numbered ``rows`` and returns (f (R,), grad (R, k));
    each row is its own problem, with its own curvature pairs and its own backtracking (Armijo) line
    search. Returns (x, f) at the end.
    """
    x = x0.astype(float).copy()
    s_, k = x.shape
    f, g = fun(x, np.arange(s_))
    hist_s = np.zeros((memory, s_, k))
    hist_y = np.zeros((memory, s_, k))
    rho = np.zeros((memory, s_))
    done = np.zeros(s_, dtype=bool)
    stored = 0
    for it in range(max_iter):
        # Two-loop recursion: d = -H g, newest pair first (slot (it-1) % memory is the newest).
        q = g.copy()
        alphas = []
        order = [(it - 1 - j) % memory for j in range(min(stored, memory))]
        for j in order:
            a_j = rho[j] * np.einsum("sk,sk->s", hist_s[j], q)
            alphas.append(a_j)
            q -= a_j[:, None] * hist_y[j]
        if order:
            j = order[0]
            yy = np.einsum("sk,sk->s", hist_y[j], hist_y[j])
            sy = np.einsum("sk,sk->s", hist_s[j], hist_y[j])
            gamma = np.where((yy > 0) & (rho[j] > 0), sy / np.where(yy > 0, yy, 1.0), 1.0)
            q *= gamma[:, None]
        for j, a_j in zip(reversed(order), reversed(alphas), strict=True):
            b_j = rho[j] * np.einsum("sk,sk->s", hist_y[j], q)
            q += (a_j - b_j)[:, None] * hist_s[j]
        d = -q
        slope = np.einsum("sk,sk->s", g, d)
        bad = ~(slope < 0)  # not a descent direction: fall back to steepest descent
        d[bad] = -g[bad]
        slope[bad] = -np.einsum("sk,sk->s", g[bad], g[bad])
        # Backtracking: the first of t = t0, t0/2, t0/4, ... with sufficient decrease, per row, evaluating only
        # the rows still searching. The first step has no curvature yet: t0 = 1/|g|_1 (as scipy's L-BFGS-B).
        t = np.ones(s_) if stored else 1.0 / np.maximum(1.0, np.abs(g).sum(axis=1))
        accepted = done.copy()
        x_new, f_new, g_new = x.copy(), f.copy(), g.copy()
        for _ in range(30):
            idx = np.flatnonzero(~accepted)
            if idx.size == 0:
                break
            xt = x[idx] + t[idx, None] * d[idx]
            ft, gt = fun(xt, idx)
            ok = np.isfinite(ft) & (ft <= f[idx] + 1e-4 * t[idx] * slope[idx])
            hit = idx[ok]
            x_new[hit], f_new[hit], g_new[hit] = xt[ok], ft[ok], gt[ok]
            accepted[hit] = True
            t[idx[~ok]] *= 0.5
        stalled = ~accepted  # no decrease along d even at a tiny step: converged as far as it goes
        slot = it % memory
        s_vec, y_vec = x_new - x, g_new - g
        sy = np.einsum("sk,sk->s", s_vec, y_vec)
        hist_s[slot], hist_y[slot] = s_vec, y_vec
        rho[slot] = np.where(sy > 1e-12, 1.0 / np.where(sy > 1e-12, sy, 1.0), 0.0)  # no curvature: drop the pair
        stored += 1
        df = f - f_new
        x, f, g = x_new, f_new, g_new
        done |= stalled | (np.abs(g).max(axis=1) < gtol) | ((df >= 0) & (df < ftol * np.maximum(1.0, np.abs(f))))
        if done.all():
            break
    return x, f


def _to_law(row: np.ndarray) -> tuple[float, ...]:
    a, b, e, al, be = (float(v) for v in row)
    return (math.exp(e), math.exp(a), math.exp(b), al, be)


def _finite_law(row: np.ndarray) -> tuple[float, ...] | None:
    """:func:`_to_law`, or None for a resample whose optimiser ran off to a coefficient beyond a float
    (a degenerate resample: e.g. one that repeats a single model size, so A and alpha trade off without bound)."""
    if not np.isfinite(row).all() or np.abs(row[:3]).max() > 700.0:  # exp(709) is the largest double
        return None
    return _to_law(row)


def _points_table(points: Sequence[Point]) -> str:
    rows = [f"  N={p.params:.4g} D={p.tokens:.4g} loss={p.loss:.4f}" + (f"  {p.run}" if p.run else "")
            for p in sorted(points, key=lambda p: (p.params, p.tokens))]
    return "\n".join(rows)


def check_points(points: Sequence[Point]) -> None:
    """Refuse points a fit cannot extrapolate from (too few, too few sizes or token counts, no decreasing
    trend); the message lists the points."""
    pts = list(points)
    bad = [p for p in pts if not (p.params > 0 and p.tokens > 0 and p.loss > 0 and math.isfinite(p.loss))]
    if bad:
        raise ScalingError("scaling points need positive parameters, tokens and a finite positive loss; bad "
                           f"points:\n{_points_table(bad)}")
    sizes = {round(math.log(p.params), 6) for p in pts}
    tokens = {round(math.log(p.tokens), 6) for p in pts}
    if len(pts) < MIN_POINTS or len(sizes) < MIN_DISTINCT or len(tokens) < MIN_DISTINCT:
        raise ScalingError(
            f"a scaling fit needs at least {MIN_POINTS} finished runs over at least {MIN_DISTINCT} model sizes and "
            f"{MIN_DISTINCT} token counts; got {len(pts)} run(s), {len(sizes)} size(s), {len(tokens)} token "
            f"count(s): refusing to extrapolate. Add runs to the sweep (xirang-plan --fit-scaling prints it). "
            f"Points:\n{_points_table(pts)}")
    # The trend: log L against log N and log D by least squares must fall with both.
    x = np.array([[1.0, math.log(p.params), math.log(p.tokens)] for p in pts])
    y = np.log([p.loss for p in pts])
    coef = np.linalg.lstsq(x, y, rcond=None)[0]
    falling = [name for name, c in (("model size", coef[1]), ("tokens", coef[2])) if c >= 0]
    if falling:
        raise ScalingError(
            f"the validation loss does not decrease with {' and '.join(falling)} across these runs (log-log slopes: "
            f"size {coef[1]:+.3f}, tokens {coef[2]:+.3f}): refusing to extrapolate. Train longer or larger "
            f"sweep points, or check the runs for divergence. Points:\n{_points_table(pts)}")


def fit(points: Sequence[Point], bootstrap: int = 200, seed: int = 0, starts: np.ndarray | None = None,
        delta: float = HUBER_DELTA, source: str = "", exponents: str = "auto") -> ScalingLaw:
    """Fit L(N, D) to ``points`` as Hoffmann et al.'s Approach 3, with ``bootstrap`` resampled refits.

    ``starts``: rows (a, b, e, alpha, beta) to start L-BFGS from (default :func:`hoffmann_grid`). Each
    bootstrap refit starts from the best few optima of the full fit (a refit of resampled data lands near
    them; starting each resample from the whole grid costs 4500x more for the same answer).
    ``exponents``: "free" (five coefficients; :class:`UndeterminedFit` where the runs do not pin them down),
    "tied" (alpha = beta), or "auto": free, and tied where the free fit is undetermined (the law's
    ``tied`` and :meth:`ScalingLaw.describe` say so).
    """
    if exponents not in ("auto", "free", "tied"):
        raise ValueError(f"exponents={exponents!r}: choose auto, free or tied")
    check_points(points)
    # In one order, whatever order the runs were found in (run directories sort by their hash): the summed
    # objective's rounding and the bootstrap's resamples follow the order, and on points that barely
    # determine the law that alone could decide between a fit and a refusal.
    points = sorted(points, key=lambda p: (p.params, p.tokens, p.loss))
    if exponents != "tied":
        try:
            return _fit(points, bootstrap, seed, starts, delta, source, tied=False)
        except UndeterminedFit:
            if exponents == "free":
                raise
    return _fit(points, bootstrap, seed, starts, delta, source, tied=True)


# Free coefficients -> the objective's five (a, b, e, alpha, beta): x5 = x @ map.T, and grad = grad5 @ map.
_FREE = np.eye(5)
_TIED = np.array([[1, 0, 0, 0], [0, 1, 0, 0], [0, 0, 1, 0], [0, 0, 0, 1], [0, 0, 0, 1]], dtype=float)  # beta = alpha


def _fit(points: list[Point], bootstrap: int, seed: int, starts: np.ndarray | None, delta: float, source: str,
         tied: bool) -> ScalingLaw:
    """:func:`fit` with the exponents free or tied; raises :class:`UndeterminedFit` where the law runs off."""
    log_n = np.log([p.params for p in points])
    log_d = np.log([p.tokens for p in points])
    log_l = np.log([p.loss for p in points])
    lin = _TIED if tied else _FREE
    x0 = hoffmann_grid() if starts is None else np.asarray(starts, dtype=float)
    if tied:  # the starts' distinct (a, b, e, alpha): beta dropped (900 of Hoffmann's 4500)
        x0 = np.unique(x0[:, :4], axis=0)

    def fun_w(w: np.ndarray) -> Any:
        def fun(x: np.ndarray, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
            f, g = _objective(x @ lin.T, log_n, log_d, log_l, w[rows], delta)
            return f, g @ lin
        return fun

    xs, fs = lbfgs(fun_w(np.ones((x0.shape[0], log_n.size))), x0)
    xs = xs @ lin.T  # (S, 5) from here on
    fs = np.where(np.isfinite(fs), fs, np.inf)
    best = xs[int(np.argmin(fs))]
    if not (best[3] > 1e-3 and best[4] > 1e-3):
        raise ScalingError(f"the fitted exponents are not positive (alpha={best[3]:.3g}, beta={best[4]:.3g}): the "
                           "runs show no power-law decrease to extrapolate; refusing. "
                           f"Points:\n{_points_table(points)}")
    how = " with one exponent (alpha = beta)" if tied else ""
    samples: list[tuple[float, ...]] = []
    if bootstrap:
        # Warm starts: the distinct best optima of the full fit (rounded to tell them apart).
        order = np.argsort(fs)
        warm: list[np.ndarray] = []
        for i in order:
            if len(warm) == 4:
                break
            if all(np.abs(xs[i] - w_).max() > 1e-2 for w_ in warm):
                warm.append(xs[i])
        k = len(warm)
        rng = np.random.default_rng(seed)
        counts = rng.multinomial(len(points), [1.0 / len(points)] * len(points), size=bootstrap)  # (B, P)
        w = np.repeat(counts.astype(float), k, axis=0)  # (B*k, P): each resample once per warm start
        start = np.tile(np.stack(warm)[:, :lin.shape[1]], (bootstrap, 1))  # alpha first: tied rows drop beta
        xb, fb = lbfgs(fun_w(w), start)
        xb = xb @ lin.T
        fb = np.where(np.isfinite(fb), fb, np.inf).reshape(bootstrap, k)  # (B, k)
        pick = xb.reshape(bootstrap, k, 5)[np.arange(bootstrap), np.argmin(fb, axis=1)]  # (B, 5)
        # Degenerate resamples are left out of the intervals (they are not a law at all); where most are, the
        # runs do not determine the law and an extrapolation from it would be a guess.
        samples = [law for law in map(_finite_law, pick) if law is not None]
        if len(samples) < bootstrap / 2:
            raise UndeterminedFit(f"{bootstrap - len(samples)} of {bootstrap} bootstrap refits{how} ran off to "
                                  "coefficients beyond a float: the runs do not determine the law (typically: the "
                                  "loss does not fall with model size at a fixed token count); refusing to "
                                  "extrapolate. Train the sweep longer or with more sizes. "
                                  f"Points:\n{_points_table(points)}")
        # An exponent whose interval spans a wide factor is not determined either: A and alpha (or B and beta)
        # trade off along a valley, and which end the optimiser stops at follows the points' last digits.
        cols = np.asarray(samples)
        for name in ("alpha",) if tied else ("alpha", "beta"):
            lo, hi = np.quantile(cols[:, _PARAMS.index(name)], [0.025, 0.975])
            if not (lo > 0 and hi / lo <= MAX_EXPONENT_SPREAD):
                raise UndeterminedFit(f"{name}'s 95% bootstrap interval{how} [{lo:.3g}, {hi:.3g}] spans more than a "
                                      f"factor {MAX_EXPONENT_SPREAD:g}: the runs do not determine the law; refusing to "
                                      "extrapolate. Train the sweep longer or with more sizes. "
                                      f"Points:\n{_points_table(points)}")
    law = _finite_law(best)
    if law is None:
        raise UndeterminedFit(f"the fit{how} ran off to coefficients beyond a float (the runs do not pin the law "
                              f"down); add runs of other sizes and token counts. Points:\n{_points_table(points)}")
    e_, a_, b_, al, be = law
    return ScalingLaw(E=e_, A=a_, B=b_, alpha=al, beta=be, source=source or f"fit of {len(points)} runs",
                      samples=tuple(samples), tied=tied)


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
