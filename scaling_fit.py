"""Fit, extrapolate and compare RL scaling curves: ScaleRL's sigmoidal compute-performance law.

The law (ScaleRL, Khatri et al. 2025, arXiv 2510.13786, eq. 1)::

    R_C - R_0 = (A - R_0) / (1 + (C_mid / C) ** B)

C is compute (GPU-hours in the paper; FLOPs, tokens or steps work too), R_C the validation pass rate at C,
R_0 the pass rate before training, A the asymptotic pass rate, B the efficiency exponent (the slope of
log((A - R_0)/(R_C - R_0) - 1) against log C) and C_mid the compute at which half of the gain A - R_0 is reached.

Fitting procedure (ScaleRL's, Khatri et al. 2025, arXiv 2510.13786):

1. R_0 is the measured first evaluation (``r0`` overrides it). Points with compute below ``min_compute``
   (the paper drops the first ~1.5k GPU-hours, about one epoch) and points at compute 0 are not fitted.
2. A grid over A and C_mid. For every grid point, B is the least-squares value; the grid point with the
   least sum of squared residuals (SSE) wins. The paper fits B per grid point with ``scipy.optimize.curve_fit``.
   We reach the same optimum in a fraction of the time: for fixed (A, C_mid, R_0) the curve is
   R_0 + (A - R_0) * s(B) with s(B) = 1 / (1 + exp(B * log(C_mid / C))), so one table of s over a fine
   log-spaced B grid serves every A, and SSE(A, C_mid, B) = sum y^2 - 2 g sum(y s) + g^2 sum(s^2) with
   y = R - R_0, g = A - R_0 costs O(1) per triple. The best tabulated B is then refined by a few vectorised
   Gauss-Newton steps at every grid point, and the best few grid points get a final ``curve_fit`` for B.
   B is bounded to ``B_BOUNDS``.
3. Default grids adapt to the data: A in steps of 0.005 from just below the best observed value (by the
   paper's noise margin, 0.02, so that noise on a saturated curve does not push A up) to the top of the
   value range (1.0); C_mid at 100 log-spaced values from half the first fitted compute to 20x the last.
   The paper's grids are ``PAPER_A_GRID`` (0.450..0.800) and ``PAPER_C_MID_GRID`` (100..40000 GPU-h).
4. A flat curve raises ``NoSigmoidError`` (a ``ValueError``) instead of returning parameters that would be
   noise: no fitted point rises above R_0, or the fitted gain over R_0 within the data is not above 4
   residual standard deviations. Bad input (fewer than 4 fitted points, non-finite values, compute
   that does not strictly increase, values outside [0, 1] for pass rates or [-1, 1] for rewards) raises
   ``ValueError`` with a message that names the offending point.

Also here: bootstrap confidence intervals (``bootstrap_sigmoid``), a saturating power law for comparison
(``fit_power_law``; ScaleRL app. A.4: fitted on early points it over-predicts the ceiling), the fixed-A
comparison of several runs (``compare_fixed_a``, ScaleRL sec. 4), IsoCompute's record-breaking points
(``record_points``), the metrics-file reader (``read_metrics``, ``load_curve``), the figure (``plot_fits``)
and a CLI (``python scaling_fit.py --help``).

Metrics file (``metrics.jsonl``, written by train.py, read here): JSON Lines, one JSON object per logged
step, appended in order, each line ending with a newline. Evaluation rows carry at least

    step           int    optimizer steps done
    compute_hours  float  wall-clock hours since the start x number of devices in use (GPU-hours)
    flops          float  training + generation FLOPs so far
    tokens         int    tokens generated so far
    val_pass_rate  float  mean@k pass rate on the held-out set, in [0, 1]
    val_reward     float  mean reward on the held-out set, in [-1, 1]

Other rows (training steps) carry whatever the trainer logs and lack ``val_pass_rate``; a reader keeps only
the rows that have the chosen y field. The x field must strictly increase across the kept rows. Every line
must be a JSON object: an empty or malformed line (including a partial last line left by a killed writer)
is an error that names the file and line number. A run's record (a ``.json`` file: one object whose ``rows`` are
the run's rows, with the fields a fit reads) is read as its metrics file: a study keeps its runs so (``python -m
tools.experiments``, docs/study-runs), and the fit reads them as committed.

This module knows nothing about training; it needs only numpy, scipy and matplotlib.
"""

from __future__ import annotations

import argparse
import errno
import json
import math
import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np
from scipy.optimize import curve_fit
from scipy.special import expit

from harness.cli import OneLineParser  # one error line for a bad flag, no usage block
from harness.cli import int_at_least as _count  # the argparse type of a count
from harness.cli import number  # the argparse type of a finite number
from harness.cli import figure_path, path_text  # argparse types of a path (its ~ the home directory), a figure's
from harness.cli import exit_with  # a closed stdout (`| head`) ends the command quietly


ArrayLike = Sequence[float] | np.ndarray

PASS_RATE_RANGE = (0.0, 1.0)
REWARD_RANGE = (-1.0, 1.0)
# The y fields a metrics file carries, and the range their values must lie in.
Y_FIELD_RANGES = {"val_pass_rate": PASS_RATE_RANGE, "val_reward": REWARD_RANGE}
X_FIELDS = ("compute_hours", "rl_compute_hours", "flops", "step", "tokens")
METRICS_FILENAME = "metrics.jsonl"

# ScaleRL's grids (app. A): A in 0.450, 0.455, ..., 0.800; C_mid at 100 values linearly spaced in [100, 40000].
PAPER_A_GRID = np.round(np.arange(0.450, 0.800 + 1e-9, 0.005), 3)
PAPER_C_MID_GRID = np.linspace(100.0, 40000.0, 100)
A_STEP = 0.005
N_C_MID = 100
# ScaleRL: A varies by at most +-0.015 across seeds, so +-0.02 is treated as noise.
NOISE_MARGIN = 0.02
B_BOUNDS = (0.01, 20.0)
# Log-spaced B values tabulated for the first pass; neighbours differ by 3%, Gauss-Newton does the rest.
_B_TABLE = np.geomspace(B_BOUNDS[0], B_BOUNDS[1], 256)
_GAUSS_NEWTON_STEPS = 5
_CURVE_FIT_FINALISTS = 5
# Bootstrap replicates refine, per C_mid, the A nearest the best tabulated cell and this many A either side.
_BOOTSTRAP_A_NEIGHBOURS = 3
# A fit whose gain over R_0 within the data is below this many residual standard deviations is noise.
_MIN_SIGNAL_TO_NOISE = 4.0
MIN_POINTS = 4


class NoSigmoidError(ValueError):
    """The curve does not rise above R_0 clearly enough for A, B and C_mid to mean anything."""


def sigmoid(C: ArrayLike | float, A: float, B: float, C_mid: float, R0: float) -> np.ndarray:
    """ScaleRL eq. 1: R_0 + (A - R_0) / (1 + (C_mid / C)^B). At C = 0 it is R_0."""
    C = np.asarray(C, dtype=float)
    with np.errstate(divide="ignore"):
        # expit(B (log C - log C_mid)) = 1 / (1 + (C_mid / C)^B), without overflow for large exponents.
        return R0 + (A - R0) * expit(B * (np.log(C) - math.log(C_mid)))


@dataclass(frozen=True)
class SigmoidFit:
    """A fitted ScaleRL curve. ``warnings`` lists parameters that ended on the edge of their grid or bound."""

    A: float
    B: float
    C_mid: float
    R0: float
    sse: float
    r2: float
    n_points: int
    warnings: tuple[str, ...] = ()

    def predict(self, C: ArrayLike | float) -> np.ndarray:
        return sigmoid(C, self.A, self.B, self.C_mid, self.R0)


def _value_name(value_range: tuple[float, float]) -> str:
    return {PASS_RATE_RANGE: "pass rate", REWARD_RANGE: "reward"}.get(tuple(value_range), "value")


def validate_curve(
    compute: ArrayLike, reward: ArrayLike, value_range: tuple[float, float] = PASS_RATE_RANGE
) -> tuple[np.ndarray, np.ndarray]:
    """Return (compute, reward) as float arrays, or raise ValueError naming the first bad point."""
    C = np.asarray(compute, dtype=float)
    R = np.asarray(reward, dtype=float)
    if C.ndim != 1 or C.shape != R.shape:
        raise ValueError(f"compute and reward must be 1-D arrays of one length; got shapes {C.shape} and {R.shape}")
    bad = np.flatnonzero(~(np.isfinite(C) & np.isfinite(R)))
    if bad.size:
        i = bad[0]
        raise ValueError(f"non-finite value at point {i}: compute={C[i]}, reward={R[i]}")
    if np.any(C < 0):
        i = np.flatnonzero(C < 0)[0]
        raise ValueError(f"negative compute at point {i}: {C[i]}")
    if np.any(np.diff(C) <= 0):
        i = np.flatnonzero(np.diff(C) <= 0)[0] + 1
        raise ValueError(f"compute must strictly increase: point {i} has compute {C[i]:g} after {C[i - 1]:g}")
    lo, hi = value_range
    outside = np.flatnonzero((R < lo) | (R > hi))
    if outside.size:
        i = outside[0]
        raise ValueError(f"{_value_name(value_range)} {R[i]:g} at point {i} is outside [{lo:g}, {hi:g}]")
    return C, R


def default_a_grid(
    reward: ArrayLike, r0: float, value_range: tuple[float, float] = PASS_RATE_RANGE
) -> np.ndarray:
    """A from just below the best observed value (by NOISE_MARGIN) to the top of the range, step 0.005."""
    top = value_range[1]
    lowest = max(float(np.max(reward)) - NOISE_MARGIN, r0 + A_STEP)
    start = math.floor(lowest / A_STEP + 1e-9) * A_STEP
    if start <= r0:
        start += A_STEP
    grid = np.round(np.arange(start, top + 1e-9, A_STEP), 6)
    return grid if grid.size else np.array([top])


def default_c_mid_grid(compute: ArrayLike) -> np.ndarray:
    """100 log-spaced C_mid values from half the first fitted compute to 20x the last."""
    C = np.asarray(compute, dtype=float)
    C = C[C > 0]
    return np.geomspace(C[0] / 2.0, C[-1] * 20.0, N_C_MID)


class _GridFitter:
    """The grid search of ScaleRL's fit for one set of compute points, reusable across rewards (bootstrap).

    Precomputes s(B) = 1 / (1 + (C_mid / C)^B) for every C_mid, tabulated B and point, and sum s^2.
    """

    def __init__(self, compute: np.ndarray, r0: float, a_grid: np.ndarray, c_mid_grid: np.ndarray):
        self.compute = compute
        self.r0 = r0
        self.a_grid = a_grid
        self.c_mid_grid = c_mid_grid
        self.gain = a_grid - r0  # (nA,)
        self.log_ratio = np.log(c_mid_grid)[:, None] - np.log(compute)[None, :]  # (nC, n): log(C_mid / C)
        self.s_table = expit(-_B_TABLE[None, :, None] * self.log_ratio[:, None, :])  # (nC, nB, n)
        self.ss_table = np.einsum("cbn,cbn->cb", self.s_table, self.s_table)  # (nC, nB)
        # Bound the (A, C_mid, B) SSE block to about 4M floats.
        self.a_chunk = max(1, 4_000_000 // (len(c_mid_grid) * len(_B_TABLE)))

    def grid_sse(self, y: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Least-squares B and its SSE at every (A, C_mid) grid point, for y = reward - R_0.

        Returns flat arrays (A index, C_mid index, B, SSE), one entry per grid point.
        """
        sy_table = self.s_table @ y  # (nC, nB)
        best_b = np.empty((len(self.a_grid), len(self.c_mid_grid)))
        for start in range(0, len(self.a_grid), self.a_chunk):
            g = self.gain[start : start + self.a_chunk, None, None]
            # SSE - sum y^2 = g (g sum s^2 - 2 sum y s); the constant does not move the argmin over B.
            excess = g * self.ss_table[None] - 2.0 * sy_table[None]  # (chunk, nC, nB), divided by g > 0
            best_b[start : start + self.a_chunk] = _B_TABLE[np.argmin(excess, axis=2)]
        a_index, c_index = (index.ravel() for index in np.indices(best_b.shape))
        b, sse = self._gauss_newton(a_index, c_index, best_b.ravel(), y)
        return a_index, c_index, b, sse

    def best_candidates(self, y: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Like ``grid_sse`` but for a few A per C_mid, in O(nC nB) instead of O(nA nC nB).

        For fixed (C_mid, B) the SSE is a parabola in A with its vertex at g = sum(y s) / sum(s^2), so the
        best A on the (sorted) grid is the one nearest the vertex. For each C_mid, the tabulated B with the
        least SSE gives an A; that A and its neighbours are refined by Gauss-Newton. Used for bootstrap
        replicates, where only the optimum counts.
        """
        sy_table = self.s_table @ y  # (nC, nB)
        vertex = sy_table / np.maximum(self.ss_table, 1e-300)
        n_a = len(self.gain)
        if n_a == 1:
            a_table = np.zeros(vertex.shape, dtype=int)
        else:
            upper = np.clip(np.searchsorted(self.gain, vertex), 1, n_a - 1)
            a_table = np.where(vertex - self.gain[upper - 1] < self.gain[upper] - vertex, upper - 1, upper)
        g = self.gain[a_table]
        b_best = np.argmin(g * (g * self.ss_table - 2.0 * sy_table), axis=1)  # (nC,): SSE - sum y^2
        c_all = np.arange(len(self.c_mid_grid))
        offsets = np.arange(-_BOOTSTRAP_A_NEIGHBOURS, _BOOTSTRAP_A_NEIGHBOURS + 1)
        a_index = np.clip(a_table[c_all, b_best][:, None] + offsets[None, :], 0, n_a - 1).ravel()
        c_index = np.repeat(c_all, len(offsets))
        _, first = np.unique(a_index * len(c_all) + c_index, return_index=True)
        a_index, c_index = a_index[first], c_index[first]
        b, sse = self._gauss_newton(a_index, c_index, _B_TABLE[b_best[c_index]], y)
        return a_index, c_index, b, sse

    def _gauss_newton(
        self, a_index: np.ndarray, c_index: np.ndarray, b: np.ndarray, y: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """Refine B at the given grid points at once; a step is kept only where it lowers the SSE."""
        g = self.gain[a_index, None]  # (k, 1)
        u = self.log_ratio[c_index]  # (k, n)
        s = expit(-b[:, None] * u)
        resid = y - g * s
        sse = np.einsum("kn,kn->k", resid, resid)
        for _ in range(_GAUSS_NEWTON_STEPS):
            jac = -g * u * s * (1.0 - s)  # d prediction / d B
            step = np.einsum("kn,kn->k", jac, resid) / np.maximum(np.einsum("kn,kn->k", jac, jac), 1e-300)
            new_b = np.clip(b + step, *B_BOUNDS)
            new_s = expit(-new_b[:, None] * u)
            new_resid = y - g * new_s
            new_sse = np.einsum("kn,kn->k", new_resid, new_resid)
            better = new_sse < sse
            b = np.where(better, new_b, b)
            sse = np.where(better, new_sse, sse)
            s = np.where(better[:, None], new_s, s)
            resid = np.where(better[:, None], new_resid, resid)
        return b, sse

    def fit(self, reward: np.ndarray, finalise: bool = True) -> tuple[float, float, float, float]:
        """(A, B, C_mid, SSE) of the best grid point.

        ``finalise``: refine B at every grid point and run curve_fit for B at the best few (the fit itself);
        otherwise refine only the most promising grid points (bootstrap replicates).
        """
        y = reward - self.r0
        a_index, c_index, b, sse = self.grid_sse(y) if finalise else self.best_candidates(y)
        best = (math.inf, 0.0, 0.0, 0.0)
        for k in np.argsort(sse)[: _CURVE_FIT_FINALISTS if finalise else 1]:
            A, C_mid, B, point_sse = self.a_grid[a_index[k]], self.c_mid_grid[c_index[k]], b[k], sse[k]
            if finalise:
                B, point_sse = _curve_fit_b(self.compute, reward, A, C_mid, self.r0, B, point_sse)
            if point_sse < best[0]:
                best = (float(point_sse), float(A), float(B), float(C_mid))
        point_sse, A, B, C_mid = best
        return A, B, C_mid, point_sse


def _curve_fit_b(
    compute: np.ndarray, reward: np.ndarray, A: float, C_mid: float, r0: float, b_start: float, sse_start: float
) -> tuple[float, float]:
    """ScaleRL's per-grid-point fit of B with curve_fit, started from b_start; keeps the start if it was better."""
    try:
        (B,), _ = curve_fit(
            lambda C, B: sigmoid(C, A, B, C_mid, r0), compute, reward, p0=[b_start], bounds=B_BOUNDS
        )
    except (RuntimeError, ValueError):
        return b_start, sse_start
    sse = float(np.sum((reward - sigmoid(compute, A, B, C_mid, r0)) ** 2))
    return (float(B), sse) if sse < sse_start else (b_start, sse_start)


def _select_points(
    C: np.ndarray, R: np.ndarray, min_compute: float
) -> tuple[np.ndarray, np.ndarray]:
    keep = (C >= min_compute) & (C > 0)
    if keep.sum() < MIN_POINTS:
        raise ValueError(
            f"need at least {MIN_POINTS} points with compute >= min_compute ({min_compute:g}) and > 0 to fit "
            f"a sigmoid; got {int(keep.sum())} of {len(C)}"
        )
    return C[keep], R[keep]


def _grid_warnings(A: float, B: float, C_mid: float, a_grid: np.ndarray, c_mid_grid: np.ndarray) -> tuple[str, ...]:
    notes = []
    if len(a_grid) > 1 and A >= a_grid.max():
        notes.append(
            f"A hit the top of its grid ({a_grid.max():g}): the curve shows no bend yet, treat A as a lower bound"
        )
    if len(a_grid) > 1 and A <= a_grid.min():
        notes.append(f"A hit the bottom of its grid ({a_grid.min():g}): widen the grid")
    if len(c_mid_grid) > 1 and C_mid >= c_mid_grid.max():
        notes.append(f"C_mid hit the top of its grid ({c_mid_grid.max():g}): the bend lies beyond the data")
    if len(c_mid_grid) > 1 and C_mid <= c_mid_grid.min():
        notes.append(f"C_mid hit the bottom of its grid ({c_mid_grid.min():g}): widen the grid")
    if B <= B_BOUNDS[0] * 1.001 or B >= B_BOUNDS[1] * 0.999:
        notes.append(f"B hit its bound {B_BOUNDS}")
    return tuple(notes)


def _prepare_fit(
    compute: ArrayLike,
    reward: ArrayLike,
    r0: float | None,
    min_compute: float,
    a_grid: ArrayLike | None,
    c_mid_grid: ArrayLike | None,
    value_range: tuple[float, float],
) -> tuple[np.ndarray, np.ndarray, float, np.ndarray, np.ndarray]:
    """Validate, select the fitted points, settle R_0 and the grids. Raises NoSigmoidError on no gain."""
    C_all, R_all = validate_curve(compute, reward, value_range)
    r0 = float(R_all[0]) if r0 is None else float(r0)
    lo, hi = value_range
    if not (math.isfinite(r0) and lo <= r0 <= hi):
        raise ValueError(f"r0 = {r0} is not a {_value_name(value_range)} in [{lo:g}, {hi:g}]")
    C, R = _select_points(C_all, R_all, min_compute)
    if R.max() <= r0:
        raise NoSigmoidError(f"no point rises above R0 = {r0:g} (best {R.max():g}): no sigmoid can be identified")
    # Sorted and unique: the bootstrap's nearest-A lookup needs a sorted grid.
    a_values = np.unique(default_a_grid(R, r0, value_range) if a_grid is None else np.asarray(a_grid, dtype=float))
    a_values = a_values[a_values > r0]
    if a_values.size == 0:
        raise ValueError(f"no A in the grid lies above R0 = {r0:g}")
    c_mid_values = np.unique(default_c_mid_grid(C) if c_mid_grid is None else np.asarray(c_mid_grid, dtype=float))
    if c_mid_values.size == 0 or np.any(~np.isfinite(c_mid_values)) or np.any(c_mid_values <= 0):
        raise ValueError("the C_mid grid must hold positive finite values")
    return C, R, r0, a_values, c_mid_values


def _check_identifiable(fit: SigmoidFit, C: np.ndarray) -> None:
    """Raise NoSigmoidError when the fitted gain within the data is not clearly above the residual noise."""
    gain_in_data = float(fit.predict(C[-1]) - fit.R0)
    noise = math.sqrt(fit.sse / max(fit.n_points - 3, 1))
    if gain_in_data <= _MIN_SIGNAL_TO_NOISE * noise:
        raise NoSigmoidError(
            f"the curve is flat: the fitted gain over R0 = {fit.R0:g} within the data is {gain_in_data:.3g}, "
            f"not above {_MIN_SIGNAL_TO_NOISE:g}x the residual noise ({noise:.3g}); no sigmoid can be identified"
        )


def fit_sigmoid(
    compute: ArrayLike,
    reward: ArrayLike,
    *,
    r0: float | None = None,
    min_compute: float = 0.0,
    a_grid: ArrayLike | None = None,
    c_mid_grid: ArrayLike | None = None,
    value_range: tuple[float, float] = PASS_RATE_RANGE,
) -> SigmoidFit:
    """Fit ScaleRL eq. 1 by its grid procedure (module docstring). ``r0`` defaults to the first evaluation.

    ``value_range`` is (0, 1) for pass rates, (-1, 1) for rewards. Raises ValueError on bad input and
    NoSigmoidError (a ValueError) when the curve is flat.
    """
    C, R, r0, a_values, c_mid_values = _prepare_fit(compute, reward, r0, min_compute, a_grid, c_mid_grid, value_range)
    A, B, C_mid, sse = _GridFitter(C, r0, a_values, c_mid_values).fit(R)
    sst = float(np.sum((R - R.mean()) ** 2))
    fit = SigmoidFit(
        A=A, B=B, C_mid=C_mid, R0=r0, sse=sse, r2=1.0 - sse / sst if sst > 0 else float("nan"),
        n_points=len(C), warnings=_grid_warnings(A, B, C_mid, a_values, c_mid_values),
    )
    _check_identifiable(fit, C)
    return fit


@dataclass(frozen=True)
class SigmoidBootstrap:
    """Percentile bootstrap intervals. ``*_ci`` are (low, high); ``predictions_ci`` rows match ``predict_at``."""

    fit: SigmoidFit
    A_ci: tuple[float, float]
    B_ci: tuple[float, float]
    C_mid_ci: tuple[float, float]
    predict_at: np.ndarray
    predictions: np.ndarray
    predictions_ci: np.ndarray  # (len(predict_at), 2)
    samples: np.ndarray  # (n_ok, 3): A, B, C_mid of each replicate
    n_failed: int


def bootstrap_sigmoid(
    compute: ArrayLike,
    reward: ArrayLike,
    n_boot: int = 200,
    *,
    r0: float | None = None,
    min_compute: float = 0.0,
    a_grid: ArrayLike | None = None,
    c_mid_grid: ArrayLike | None = None,
    value_range: tuple[float, float] = PASS_RATE_RANGE,
    predict_at: ArrayLike | None = None,
    confidence: float = 0.95,
    seed: int = 0,
) -> SigmoidBootstrap:
    """Fit, then refit ``n_boot`` residual-bootstrap replicates for confidence intervals.

    Each replicate keeps the compute points and R_0 (measured, not fitted) and adds resampled residuals to
    the fitted curve, clipped to ``value_range``; the grids are the original fit's. A and C_mid live on
    grids, so their percentile intervals are extended to the midpoints with the neighbouring grid values
    (a grid value stands for its cell). ``predict_at`` defaults to the last fitted compute.
    """
    fit = fit_sigmoid(
        compute, reward, r0=r0, min_compute=min_compute, a_grid=a_grid, c_mid_grid=c_mid_grid, value_range=value_range
    )
    C, R, r0, a_values, c_mid_values = _prepare_fit(compute, reward, r0, min_compute, a_grid, c_mid_grid, value_range)
    points = np.asarray([C[-1]] if predict_at is None else predict_at, dtype=float).ravel()
    fitted = fit.predict(C)
    residuals = R - fitted
    fitter = _GridFitter(C, r0, a_values, c_mid_values)
    rng = np.random.default_rng(seed)
    samples = []
    for _ in range(n_boot):
        replicate = np.clip(fitted + rng.choice(residuals, size=len(residuals), replace=True), *value_range)
        if replicate.max() <= r0:
            continue
        A, B, C_mid, _ = fitter.fit(replicate, finalise=False)
        samples.append((A, B, C_mid))
    samples_arr = np.asarray(samples, dtype=float).reshape(-1, 3)
    tail = 50.0 * (1.0 - confidence)

    def interval(values: np.ndarray) -> tuple[float, float]:
        if values.size == 0:
            return (float("nan"), float("nan"))
        lo, hi = np.percentile(values, [tail, 100.0 - tail])
        return (float(lo), float(hi))

    def grid_interval(values: np.ndarray, grid: np.ndarray) -> tuple[float, float]:
        # A grid value stands for its whole cell: extend the interval to the midpoints with the neighbours.
        if values.size == 0:
            return (float("nan"), float("nan"))
        lo, hi = np.percentile(values, tail, method="lower"), np.percentile(values, 100.0 - tail, method="higher")
        i, j = np.searchsorted(grid, lo), np.searchsorted(grid, hi)
        lo = (grid[i - 1] + grid[i]) / 2 if 0 < i < len(grid) else lo
        hi = (grid[j] + grid[j + 1]) / 2 if j + 1 < len(grid) else hi
        return (float(lo), float(hi))

    replicate_predictions = np.array([sigmoid(points, A, B, C_mid, r0) for A, B, C_mid in samples_arr]).reshape(
        -1, len(points)
    )
    predictions_ci = np.array([interval(replicate_predictions[:, j]) for j in range(len(points))])
    return SigmoidBootstrap(
        fit=fit,
        A_ci=grid_interval(samples_arr[:, 0], a_values),
        B_ci=interval(samples_arr[:, 1]),
        C_mid_ci=grid_interval(samples_arr[:, 2], c_mid_values),
        predict_at=points,
        predictions=fit.predict(points),
        predictions_ci=predictions_ci,
        samples=samples_arr,
        n_failed=n_boot - len(samples_arr),
    )


@dataclass(frozen=True)
class PowerLawFit:
    """R = A - D * (C / c_scale)^(-alpha): a power law in compute with a ceiling A (bounded by the range top)."""

    A: float
    D: float
    alpha: float
    c_scale: float
    sse: float
    r2: float
    n_points: int

    def predict(self, C: ArrayLike | float) -> np.ndarray:
        return self.A - self.D * (np.asarray(C, dtype=float) / self.c_scale) ** (-self.alpha)


def fit_power_law(
    compute: ArrayLike,
    reward: ArrayLike,
    *,
    min_compute: float = 0.0,
    value_range: tuple[float, float] = PASS_RATE_RANGE,
) -> PowerLawFit:
    """Fit R = A - D (C / C_first)^(-alpha) by least squares, A in [best observed, top of range], D, alpha > 0.

    The comparison of ScaleRL app. A.4: fitted on early points, its ceiling A overshoots the sigmoid's.
    """
    C_all, R_all = validate_curve(compute, reward, value_range)
    C, R = _select_points(C_all, R_all, min_compute)
    c_scale = float(C[0])
    top = value_range[1]
    a_low = float(R.max())
    a_start = min(a_low + 0.5 * (top - a_low), top)
    d_start = max(a_start - float(R[0]), 1e-3)
    model = lambda C, A, D, alpha: A - D * (C / c_scale) ** (-alpha)  # noqa: E731
    (A, D, alpha), _ = curve_fit(
        model, C, R, p0=[a_start, d_start, 0.5],
        bounds=([a_low, 0.0, 1e-4], [top + 1e-12, np.inf, 10.0]), maxfev=20000,
    )
    sse = float(np.sum((R - model(C, A, D, alpha)) ** 2))
    sst = float(np.sum((R - R.mean()) ** 2))
    return PowerLawFit(
        A=float(A), D=float(D), alpha=float(alpha), c_scale=c_scale, sse=sse,
        r2=1.0 - sse / sst if sst > 0 else float("nan"), n_points=len(C),
    )


@dataclass(frozen=True)
class FixedAComparison:
    """Runs refitted with one shared A; ``ranking`` lists the labels by B, most compute-efficient first."""

    A: float
    fits: dict[str, SigmoidFit]
    ranking: list[str]


def compare_fixed_a(
    curves: Mapping[str, tuple[ArrayLike, ArrayLike]],
    *,
    A: float | None = None,
    min_compute: float = 0.0,
    c_mid_grid: ArrayLike | None = None,
    value_range: tuple[float, float] = PASS_RATE_RANGE,
) -> FixedAComparison:
    """ScaleRL sec. 4: for runs with similar A, fix A (default: the mean of their own fits' A), refit, compare B.

    ``curves`` maps a label to (compute, reward); R_0 of each run is its first evaluation.
    """
    if not curves:
        raise ValueError("compare_fixed_a needs at least one curve")
    if A is None:
        A = float(np.mean([
            fit_sigmoid(C, R, min_compute=min_compute, c_mid_grid=c_mid_grid, value_range=value_range).A
            for C, R in curves.values()
        ]))
    fits = {
        label: fit_sigmoid(C, R, min_compute=min_compute, a_grid=[A], c_mid_grid=c_mid_grid, value_range=value_range)
        for label, (C, R) in curves.items()
    }
    ranking = sorted(fits, key=lambda label: fits[label].B, reverse=True)
    return FixedAComparison(A=A, fits=fits, ranking=ranking)


def record_points(compute: ArrayLike, reward: ArrayLike, n_bins: int) -> tuple[np.ndarray, np.ndarray]:
    """IsoCompute's record-breaking points: split [min, max] reward into ``n_bins`` equal bins and keep the
    first point of the run that enters each bin higher than any reached before (the first point is kept)."""
    C, R = np.asarray(compute, dtype=float), np.asarray(reward, dtype=float)
    if C.ndim != 1 or C.shape != R.shape or C.size == 0:
        raise ValueError("compute and reward must be non-empty 1-D arrays of one length")
    if n_bins < 1:
        raise ValueError(f"n_bins must be >= 1, got {n_bins}")
    span = R.max() - R.min()
    if span == 0:
        bins = np.zeros(len(R), dtype=int)
    else:
        bins = np.minimum(((R - R.min()) / span * n_bins).astype(int), n_bins - 1)  # the maximum joins the top bin
    keep, highest = [], -1
    for i, b in enumerate(bins):
        if b > highest:
            keep.append(i)
            highest = b
    return C[keep], R[keep]


# ---------------------------------------------------------------------------------------------------- metrics file


def metrics_path(path: str | Path) -> Path:
    """The metrics file of a run directory (``RUN_DIR/metrics.jsonl``), or ``path`` itself if it is a file (a
    metrics file, or a run's record: ``_record_rows``)."""
    path = Path(path)
    file = path / METRICS_FILENAME if path.is_dir() else path
    if not file.is_file():
        raise FileNotFoundError(f"no metrics file at {file}")
    return file


def _record_rows(file: Path, text: str) -> list[tuple[str, dict]]:
    """The rows of a run's record, a ``.json`` file: one JSON object whose ``rows`` are the run's metrics rows (with
    the fields a fit reads), as ``python -m tools.experiments`` keeps a study's runs so that they can be committed
    and refitted (docs/study-runs). Each row comes with where it is: ``FILE: rows[i]``."""
    what = ("a .json file is read as a run's record, one object whose \"rows\" is a list of objects (python -m "
            "tools.experiments writes them); a metrics file is JSON Lines, named .jsonl")
    try:
        record = json.loads(text)
    except json.JSONDecodeError as err:
        raise ValueError(f"{file}: malformed JSON at line {err.lineno} ({err.msg}): {what}") from None
    rows = record.get("rows") if isinstance(record, dict) else None
    if not isinstance(rows, list) or not all(isinstance(row, dict) for row in rows):
        raise ValueError(f"{file}: {what}")
    return [(f"{file}: rows[{i}]", row) for i, row in enumerate(rows)]


def _read_numbered_rows(path: str | Path, text: str | None = None) -> tuple[Path, list[tuple[str, dict]]]:
    """The rows of a metrics file (or of a run's record), each with where it is: ``FILE:LINE`` in a metrics file."""
    file = Path(path) if text is not None else metrics_path(path)
    text = file.read_text() if text is None else text
    if file.suffix == ".json":
        return file, _record_rows(file, text)
    lines = text.split("\n")
    complete_last_line = text.endswith("\n")
    if complete_last_line or text == "":
        lines.pop()  # the empty string after the final newline
    rows = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            raise ValueError(f"{file}:{number}: empty line in a metrics file")
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            partial = number == len(lines) and not complete_last_line
            hint = " (the last line has no newline: a partial line from a killed writer?)" if partial else ""
            raise ValueError(f"{file}:{number}: malformed JSON: {err.msg}{hint}") from None
        if not isinstance(row, dict):
            raise ValueError(f"{file}:{number}: expected a JSON object, got {type(row).__name__}")
        rows.append((f"{file}:{number}", row))
    return file, rows


def read_metrics(path: str | Path, text: str | None = None) -> list[dict]:
    """All rows of a metrics file (a run directory holding metrics.jsonl, or the .jsonl file itself), or of a run's
    record (a .json file); `text`: the file's text, already read (a run reads its own without following links),
    `path` then only names it.

    Strict: an empty or malformed line, a partial last line included, raises ValueError naming the line.
    """
    return [row for _, row in _read_numbered_rows(path, text)[1]]


def value_range_for(y: str) -> tuple[float, float]:
    """The range a y field's values must lie in: [0, 1] for pass rates, [-1, 1] for rewards."""
    if y in Y_FIELD_RANGES:
        return Y_FIELD_RANGES[y]
    if "pass_rate" in y:
        return PASS_RATE_RANGE
    if "reward" in y:
        return REWARD_RANGE
    raise ValueError(f"unknown y field {y!r}: expected one of {sorted(Y_FIELD_RANGES)}")


def load_curve(
    path: str | Path, x: str = "compute_hours", y: str = "val_pass_rate"
) -> tuple[np.ndarray, np.ndarray]:
    """(x, y) arrays from the rows of a metrics file that have field ``y`` (the evaluation rows).

    Raises ValueError naming the line for a missing or non-numeric x, a non-finite value, an x that does
    not strictly increase, or a y outside its range (``value_range_for``).
    """
    lo, hi = value_range_for(y)
    file, rows = _read_numbered_rows(path)
    xs, ys, previous_x = [], [], None
    for where, row in rows:
        if row.get(y) is None:
            continue
        if x not in row:
            raise ValueError(f"{where}: row has {y} but no {x}")
        values = []
        for field in (x, y):
            value = row[field]
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"{where}: {field} = {value!r} is not a number")
            if not math.isfinite(value):
                raise ValueError(f"{where}: non-finite {field} = {value}")
            values.append(float(value))
        x_value, y_value = values
        if previous_x is not None and x_value <= previous_x:
            raise ValueError(f"{where}: {x} = {x_value:g} does not increase (previous {previous_x:g})")
        if not lo <= y_value <= hi:
            raise ValueError(f"{where}: {y} = {y_value:g} is outside [{lo:g}, {hi:g}]")
        xs.append(x_value)
        ys.append(y_value)
        previous_x = x_value
    if not xs:
        raise ValueError(f"{file}: no rows carry {y}")
    return np.array(xs), np.array(ys)


# ---------------------------------------------------------------------------------------------------- figure


class PlotCurve(NamedTuple):
    """One run in a figure. A plain tuple (label, compute, reward, fit, fit_until) works too.

    ``fit`` may be None (flat curve: points only). Points beyond ``fit_until`` were held out and are drawn
    hollow, points below ``min_compute`` were not fitted and are drawn faint; the curve is solid up to
    ``fit_until`` (or the last point) and dashed where it extrapolates.
    """

    label: str
    compute: np.ndarray
    reward: np.ndarray
    fit: SigmoidFit | None
    fit_until: float | None = None
    min_compute: float = 0.0


def plot_fits(
    curves: Sequence[PlotCurve | tuple],
    out_path: str | Path,
    x_label: str = "compute_hours",
    y_label: str = "val_pass_rate",
    title: str | None = None,
) -> Path:
    """Draw several runs in one figure (points, fit, dashed extrapolation, dotted asymptote, log x); save it.

    ``curves`` holds PlotCurve or plain (label, compute, reward, fit, fit_until) tuples. Returns the path.
    """
    import matplotlib

    matplotlib.use("Agg")  # no screen needed
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 5.0))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    base_points: list[tuple[float, str]] = []  # (R0, color) of runs whose first point is the untrained model
    for index, curve in enumerate(curves):
        label, compute, reward, fit, fit_until, min_compute = PlotCurve(*curve)
        C, R = np.asarray(compute, dtype=float), np.asarray(reward, dtype=float)
        color = colors[index % len(colors)]
        order = np.argsort(C)
        C, R = C[order], R[order]
        # The evaluation before any training sits at compute ~0 (1e-7 h): on a log axis it would take decades
        # of the axis for one point. Draw it as R0, a line from the axis edge, and give the axis to the run.
        if C.size >= 2 and (C[0] <= 0 or C[0] < C[1] / 10):
            base_points.append((float(R[0]), color))
            C, R = C[1:], R[1:]
        positive = C > 0
        C, R = C[positive], R[positive]  # a log axis cannot show compute 0
        if C.size == 0:
            continue
        held_out = C > fit_until if fit_until is not None else np.zeros(len(C), dtype=bool)
        excluded = (C < min_compute) & ~held_out
        fitted = ~held_out & ~excluded
        ax.scatter(C[fitted], R[fitted], color=color, s=18, zorder=3)
        ax.scatter(C[excluded], R[excluded], color=color, s=18, alpha=0.3, zorder=3)
        ax.scatter(C[held_out], R[held_out], facecolors="none", edgecolors=color, s=18, zorder=3)
        if fit is None:
            ax.plot([], [], color=color, label=f"{label}: no sigmoid (flat)")
            continue
        end_fitted = min(fit_until, C.max()) if fit_until is not None else C.max()
        fitted_x = np.geomspace(C.min(), end_fitted, 200)
        extrapolated_x = np.geomspace(end_fitted, max(C.max(), end_fitted) * 2.0, 100)
        ax.plot(fitted_x, fit.predict(fitted_x), color=color,
                label=f"{label}: A={fit.A:.3f}, B={fit.B:.2f}, C_mid={fit.C_mid:.3g}")
        ax.plot(extrapolated_x, fit.predict(extrapolated_x), color=color, linestyle="--")
        ax.axhline(fit.A, color=color, linestyle=":", linewidth=1)
        if fit_until is not None:
            ax.axvline(fit_until, color=color, linestyle="-.", linewidth=0.6, alpha=0.5)
    ax.set_xscale("log")
    # label 2x and 5x between the decades: a run often spans less than two decades, and 3x/4x labels collide
    ax.xaxis.set_minor_locator(matplotlib.ticker.LogLocator(subs=(2.0, 5.0)))
    for r0, color in base_points:  # R0: a marker at the left edge and a faint line, labelled once
        ax.axhline(r0, color=color, linestyle="-.", linewidth=0.8, alpha=0.6)
        ax.plot([0.0], [r0], marker=">", color=color, markersize=8, transform=ax.get_yaxis_transform(),
                clip_on=False, zorder=4)
    if base_points:
        ax.plot([], [], color="gray", linestyle="-.", marker=">", label="R0: before training (step 0)")
    ax.set_xlabel(x_label)
    ax.set_ylabel(y_label)
    ax.set_title(title or "ScaleRL sigmoid fits. Dashed: extrapolation; dotted: asymptote A; "
                 "hollow: held out; faint: below min_compute")
    ax.title.set_fontsize(9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="best")
    fig.tight_layout()
    return _save_figure(fig, Path(out_path))


def _save_figure(fig: Any, out_path: Path, dpi: int = 120) -> Path:
    """Save `fig` to `out_path` and close it. A run directory may be shared: a new file (O_EXCL, random name:
    nothing planted is written through) renamed over the old, which replaces a link there rather than following it."""
    import matplotlib.pyplot as plt

    out_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_path.with_name(f".{out_path.name}.{os.urandom(4).hex()}.tmp")
    try:
        with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o666), "wb") as f:
            fig.savefig(f, dpi=dpi, format=out_path.suffix[1:] or "png")
        os.replace(tmp, out_path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    finally:
        plt.close(fig)
    return out_path


# What a practitioner watches in a run, one panel each: (title, [(field, line style)]), against the step.
DASHBOARD_PANELS = (
    ("validation pass rate (dashed: the sigmoid fit)", [("val_pass_rate", "o-")]),
    ("reward (dotted: train pass rate)", [("reward", "-"), ("train_pass_rate", ":")]),
    ("policy entropy (trained tokens)", [("entropy", "-")]),
    ("completion length (dotted: p90)", [("length_mean", "-"), ("length_p90", ":")]),
    ("sampler/learner KL (dotted: KL to pi_old)", [("mismatch_kl_k3", "-"), ("kl_k3", ":")]),
    ("clipped (dotted: truncated) fraction", [("clip_frac", "-"), ("frac_truncated", ":")]),
    ("lag of trained tokens (steps)", [("lag_mean", "-")]),
    ("trained tokens / s (dotted: MFU x 1e5)", [("train_tokens_per_s", "-"), ("mfu", ":")]),
    ("gradient norm", [("grad_norm", "-")]),
)


def plot_dashboard(runs: Sequence[tuple[str, Sequence[dict]]], out_path: str | Path) -> Path:
    """One picture of one run or several overlaid (label, metrics rows): DASHBOARD_PANELS against the step, the
    validation panel with each run's sigmoid fit (on compute_hours) drawn at its evaluations. A field no row has
    leaves its panel saying so. Returns the path."""
    import matplotlib

    matplotlib.use("Agg")  # no screen needed
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(3, 3, figsize=(13.0, 9.0))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, (title, fields) in zip(axes.flat, DASHBOARD_PANELS):
        drawn = False
        for index, (label, rows) in enumerate(runs):
            color = colors[index % len(colors)]
            for field, style in fields:
                points = [(r["step"], r[field] * (1e5 if field == "mfu" else 1)) for r in rows
                          if isinstance(r.get(field), (int, float)) and math.isfinite(r[field]) and "step" in r]
                if points:
                    ax.plot(*zip(*points), style, color=color, markersize=3, label=label if style != ":" else None)
                    drawn = True
            if field == "val_pass_rate":
                _draw_step_fit(ax, rows, color)
        ax.set_title(title, fontsize=9)
        ax.grid(True, alpha=0.3)
        ax.tick_params(labelsize=8)
        if not drawn:
            ax.text(0.5, 0.5, "not in these metrics", ha="center", va="center", transform=ax.transAxes, fontsize=8)
    axes.flat[0].legend(fontsize=8, loc="lower right")
    for ax in axes[-1]:
        ax.set_xlabel("step", fontsize=8)
    fig.tight_layout()
    return _save_figure(fig, Path(out_path), dpi=90)  # redrawn at every evaluation of a run: kept cheap


def _draw_step_fit(ax: Any, rows: Sequence[dict], color: str) -> None:
    """The sigmoid fitted on (compute_hours, val_pass_rate), drawn dashed at the evaluations' steps; nothing where
    it cannot be fitted (too few points, a flat curve)."""
    evals = [r for r in rows if isinstance(r.get("val_pass_rate"), (int, float)) and "compute_hours" in r]
    try:
        fit = fit_sigmoid([r["compute_hours"] for r in evals], [r["val_pass_rate"] for r in evals])
    except ValueError:
        return
    steps = [r["step"] for r in evals]
    ax.plot(steps, sigmoid(np.array([r["compute_hours"] for r in evals]), fit.A, fit.B, fit.C_mid, fit.R0), "--",
            color=color, linewidth=1)


# ---------------------------------------------------------------------------------------------------- CLI


def _run_label(path: str) -> str:
    p = Path(path)
    return p.parent.name if p.name == METRICS_FILENAME else (p.name if p.is_dir() else p.stem)


def _ci(interval: tuple[float, float] | None, fmt: str) -> str:
    if interval is None or not all(map(math.isfinite, interval)):
        return ""
    return f"[{interval[0]:{fmt}}, {interval[1]:{fmt}}]"


def _print_fit_table(label: str, args: argparse.Namespace, C: np.ndarray, R: np.ndarray,
                     fit: SigmoidFit, boot: SigmoidBootstrap | None) -> None:
    ci = (lambda name: getattr(boot, name)) if boot is not None else (lambda name: None)
    level = "95% CI" if boot is not None else ""
    print(f"run {label}: {fit.n_points} points fitted, x = {args.x}, y = {args.y}, R0 = {fit.R0:.4f}")
    print(f"  {'':8}{'value':>12}  {level}")
    print(f"  {'A':8}{fit.A:>12.4f}  {'(shared, fixed)' if args.shared_A else _ci(ci('A_ci'), '.4f')}")
    print(f"  {'B':8}{fit.B:>12.3f}  {_ci(ci('B_ci'), '.3f')}")
    print(f"  {'C_mid':8}{fit.C_mid:>12.4g}  {_ci(ci('C_mid_ci'), '.4g')}")
    print(f"  {'R^2':8}{fit.r2:>12.4f}")
    prediction_ci = tuple(boot.predictions_ci[0]) if boot is not None else None
    print(f"  predicted {args.y} at the last logged {args.x} = {C[-1]:g}: {float(fit.predict(C[-1])):.4f} "
          f"{_ci(prediction_ci, '.4f')} (actual {R[-1]:.4f})")
    if args.fit_until is not None:
        held_out = C > args.fit_until
        if held_out.any():
            errors = fit.predict(C[held_out]) - R[held_out]
            print(f"  held out {int(held_out.sum())} points beyond {args.x} = {args.fit_until:g}: "
                  f"mean |pred - actual| {np.mean(np.abs(errors)):.4f}, max {np.max(np.abs(errors)):.4f}, "
                  f"mean signed {np.mean(errors):+.4f}")
        else:
            print(f"  no points beyond {args.x} = {args.fit_until:g} to check the extrapolation against")
    for note in fit.warnings:
        print(f"  note: {note}")


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        description="Fit ScaleRL's sigmoidal compute-performance law (eq. 1) to RL runs, extrapolate, compare.",
        epilog="Example: python scaling_fit.py runs/a runs/b --min-compute 1.5 --fit-until 8 --out fits.png. "
        "Exit status: 0 all fitted, 1 some run is flat (no sigmoid can be identified), 2 bad input, 3 a figure "
        "could not be written (a full disk).",
    )
    parser.add_argument("paths", nargs="+", type=path_text, metavar="RUN_DIR_OR_METRICS.jsonl",
                        help="run directories holding metrics.jsonl, metrics .jsonl files, or runs' records (.json, "
                        "as python -m tools.experiments keeps a study's runs, e.g. docs/study-runs/*.json); one curve "
                        "each")
    parser.add_argument("--x", default="compute_hours", choices=X_FIELDS,
                        help="compute axis field of the metrics file (default: compute_hours, i.e. GPU-hours; "
                        "rl_compute_hours: the same without the hours spent evaluating)")
    parser.add_argument("--y", default="val_pass_rate", choices=sorted(Y_FIELD_RANGES),
                        help="performance field (default: val_pass_rate, in [0,1]; val_reward is in [-1,1])")
    parser.add_argument("--min-compute", type=number(0.0), default=0.0,
                        help="exclude points with x below this from the fit (ScaleRL drops the first ~epoch)")
    parser.add_argument("--fit-until", type=number(0.0), default=None,
                        help="fit only points with x <= this and report the error on the held-out rest")
    parser.add_argument("--shared-A", action="store_true",
                        help="refit all runs with A fixed to the mean of their fitted A and rank them by B")
    parser.add_argument("--bootstrap", type=_count(0), default=200,
                        help="bootstrap replicates for 95%% confidence intervals (0: none; default 200)")
    parser.add_argument("--paper-grids", action="store_true",
                        help="use ScaleRL's grids (A 0.450..0.800, C_mid 100..40000) instead of data-adaptive ones")
    parser.add_argument("--record-bins", type=_count(0), default=0,
                        help="fit only IsoCompute's record-breaking points with this many reward bins (0: all points)")
    parser.add_argument("--seed", type=_count(0), default=0, help="random seed of the bootstrap")
    parser.add_argument("--out", type=figure_path, default="scaling_fit.png",
                        help="where to write the figure (default: scaling_fit.png)")
    parser.add_argument("--dashboard", type=figure_path, default=None, metavar="PNG",
                        help="also draw the runs' dashboards, overlaid, into PNG: pass rate with its fit, reward, "
                        "entropy, lengths, KL and mismatch, clip and truncation, lag, throughput, gradient norm "
                        "against the step (train.py draws OUTPUT_DIR/dashboard.png for its own run)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry point. Returns 0, 1 if some run had no identifiable sigmoid, 2 on bad input, 3 if a figure could not
    be written."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.fit_until is not None and args.min_compute > args.fit_until:
        parser.error(f"--min-compute {args.min_compute:g} is above --fit-until {args.fit_until:g}: no point is left "
                     "to fit")
    value_range = value_range_for(args.y)
    grids = dict(a_grid=PAPER_A_GRID, c_mid_grid=PAPER_C_MID_GRID) if args.paper_grids else {}
    try:
        curves = {}
        for path in args.paths:
            label = _run_label(path)
            while label in curves:
                label += "'"
            C, R = load_curve(path, x=args.x, y=args.y)
            curves[label] = (C, R)
    except (ValueError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if args.dashboard:
        runs = [(label, read_metrics(path)) for label, path in zip(curves, args.paths)]
        try:
            print(f"dashboard: {plot_dashboard(runs, args.dashboard)}")
        except OSError as err:
            return _not_written(args.dashboard, err)

    def fitted_part(C: np.ndarray, R: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        keep = C <= args.fit_until if args.fit_until is not None else np.ones(len(C), dtype=bool)
        C, R = C[keep], R[keep]
        if args.record_bins:
            C, R = record_points(C, R, args.record_bins)
        return C, R

    def cut(C: np.ndarray, Cf: np.ndarray) -> str:
        """What --fit-until and --record-bins left of a run's points, where they left fewer, for an error."""
        flags = " and ".join(flag for flag, on in (("--fit-until", args.fit_until is not None),
                                                   ("--record-bins", args.record_bins)) if on)
        return f" ({flags} left {len(Cf)} of the run's {len(C)} points)" if len(Cf) < len(C) else ""

    shared_a = None
    if args.shared_A:
        own = []
        for label, (C, R) in curves.items():
            Cf, Rf = fitted_part(C, R)
            try:
                fit = fit_sigmoid(Cf, Rf, r0=R[0], min_compute=args.min_compute, value_range=value_range, **grids)
                own.append(fit.A)
            except ValueError as err:
                print(f"run {label}: excluded from the shared A: {err}{cut(C, Cf)}")
        shared_a = float(np.mean(own)) if own else None
        print(f"shared A = {shared_a:.4f} (mean of the runs' own fits)\n" if own else "no run gave an A to share\n")

    plotted, status = [], 0
    for label, (C, R) in curves.items():
        Cf, Rf = fitted_part(C, R)
        options = dict(r0=R[0], min_compute=args.min_compute, value_range=value_range, **grids)
        if shared_a is not None:
            options["a_grid"] = [shared_a]
        try:
            if args.bootstrap > 0:
                boot = bootstrap_sigmoid(Cf, Rf, args.bootstrap, predict_at=[C[-1]], seed=args.seed, **options)
                fit = boot.fit
            else:
                boot, fit = None, fit_sigmoid(Cf, Rf, **options)
        except NoSigmoidError as err:
            print(f"run {label}: {err}\n")
            plotted.append(PlotCurve(label, C, R, None, args.fit_until, args.min_compute))
            status = 1
            continue
        except ValueError as err:
            print(f"error: run {label}: {err}{cut(C, Cf)}", file=sys.stderr)
            return 2
        _print_fit_table(label, args, C, R, fit, boot)
        print()
        plotted.append(PlotCurve(label, C, R, fit, args.fit_until, args.min_compute))
    if shared_a is not None:
        fitted = [(p.label, p.fit.B) for p in plotted if p.fit is not None]
        ranking = ", ".join(f"{label} (B={b:.3f})" for label, b in sorted(fitted, key=lambda item: -item[1]))
        print(f"fixed-A comparison at A = {shared_a:.4f}, highest B (steepest) first: {ranking}")
    try:
        out = plot_fits(plotted, args.out, x_label=args.x, y_label=args.y)
    except OSError as err:
        return _not_written(args.out, err)
    print(f"figure: {out}")
    return status


def _not_written(path: str | Path, err: OSError) -> int:
    """A figure that could not be written (a full disk, a directory that cannot be made): one line naming it and,
    for a full disk, the free space where it was to go, instead of a traceback; exit status 3. The fits printed above
    stand."""
    free = ""
    if err.errno in (errno.ENOSPC, errno.EDQUOT):  # the free space says nothing of a permission or a path
        try:
            free = f" ({shutil.disk_usage(Path(path).parent).free / 2**20:.1f} MB free there)"
        except OSError:
            pass
    print(f"error: could not write {path}: {err.strerror or err}{free}", file=sys.stderr)
    return 3


if __name__ == "__main__":
    exit_with(main)
