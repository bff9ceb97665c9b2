"""Fitting a scaling law to finished runs (:class:`~xirang_hpc.planner.scaling.ScalingLaw`, the law itself).

Hoffmann et al.'s Approach 3: minimise, over (a, b, e, alpha, beta) with
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

No torch here: numpy only (the planner's layer).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from xirang_hpc.planner.scaling import COEFFICIENTS, Point, ScalingError, ScalingLaw, UndeterminedFit

HUBER_DELTA = 1e-3  # Hoffmann et al. 2022, Sec. 3.3
MIN_POINTS = 8  # 5 parameters: fewer points than this and the bootstrap intervals mean little
MIN_DISTINCT = 3  # distinct model sizes and distinct token counts: each exponent needs a trend of its own
# An exponent's 95% bootstrap interval may span at most this factor (hi/lo) for the fit to count as determined: a
# 20-point sweep with 1% noise spans 1.7; sweeps that do not determine the size term span 10 and more.
MAX_EXPONENT_SPREAD = 3.0


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
            lo, hi = np.quantile(cols[:, COEFFICIENTS.index(name)], [0.025, 0.975])
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
