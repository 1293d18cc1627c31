"""Benchmarks of scalerl. Each prints what it measured, as a ratio against a baseline timed in the same run,
and ends with one line holding a JSON object of the results (the LAST line printed).

    python bench.py fit        # ScaleRL's full-grid sigmoid fit vs exhaustive per-grid-point curve_fit

A subcommand is a function ``bench_<name>(args)`` registered in ``BENCHMARKS`` with its argument setup.
Heavy imports live inside the functions so that one benchmark does not pay for another's.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Callable


def _pin_to_one_core() -> None:
    """The fit target is for one CPU core: pin the process and its BLAS threads before numpy loads."""
    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[var] = "1"
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})


def _add_fit_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--points", type=int, default=75, help="evaluation points in the synthetic curve (default 75)")
    parser.add_argument("--noise", type=float, default=0.01, help="std of the Gaussian noise on the pass rate")
    parser.add_argument("--repeats", type=int, default=5, help="timed repeats of our fit; the median is reported")
    parser.add_argument("--seed", type=int, default=0, help="random seed of the synthetic noise")


def bench_fit(args: argparse.Namespace) -> dict:
    """Time fit_sigmoid on ScaleRL's grids (71 A x 100 C_mid) against a loop of curve_fit over the same grid."""
    _pin_to_one_core()
    import numpy as np
    from scipy.optimize import curve_fit

    import scaling_fit as sf

    # A synthetic run shaped like ScaleRL's 8B fit (Table 1: C_mid 2542, B 1.92, A 0.610), evaluated at
    # evenly spaced compute between the paper's 1.5k GPU-h cut-off and 16k GPU-h.
    truth = dict(A=0.610, B=1.92, C_mid=2542.0, R0=0.30)
    rng = np.random.default_rng(args.seed)
    compute = np.linspace(1500.0, 16000.0, args.points)
    reward = np.clip(sf.sigmoid(compute, **truth) + rng.normal(0.0, args.noise, args.points), 0.0, 1.0)
    r0 = truth["R0"]
    a_grid, c_mid_grid = sf.PAPER_A_GRID, sf.PAPER_C_MID_GRID

    ours_times, fit = [], None
    for _ in range(args.repeats):
        start = time.perf_counter()
        fit = sf.fit_sigmoid(compute, reward, r0=r0, a_grid=a_grid, c_mid_grid=c_mid_grid)
        ours_times.append(time.perf_counter() - start)
    ours_s = float(np.median(ours_times))

    default_times = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        default_fit = sf.fit_sigmoid(compute, reward, r0=r0)
        default_times.append(time.perf_counter() - start)
    n_default_grid = len(sf.default_a_grid(reward, r0)) * sf.N_C_MID

    # The baseline: the paper's procedure written directly, one bounded curve_fit for B per grid point.
    start = time.perf_counter()
    baseline = (np.inf, 0.0, 0.0, 0.0)
    failures = 0
    for A in a_grid:
        for C_mid in c_mid_grid:
            model = lambda C, B: sf.sigmoid(C, A, B, C_mid, r0)  # noqa: E731
            try:
                (B,), _ = curve_fit(model, compute, reward, p0=[1.0], bounds=sf.B_BOUNDS)
            except (RuntimeError, ValueError):
                failures += 1
                continue
            sse = float(np.sum((reward - model(compute, B)) ** 2))
            if sse < baseline[0]:
                baseline = (sse, float(A), float(B), float(C_mid))
    baseline_s = time.perf_counter() - start
    base_sse, base_A, base_B, base_C_mid = baseline

    same_optimum = bool(
        abs(fit.A - base_A) < 1e-9
        and abs(fit.C_mid - base_C_mid) < 1e-6 * base_C_mid
        and abs(fit.B - base_B) < 1e-4 * base_B
        and abs(fit.sse - base_sse) <= 1e-7 * base_sse
    )
    grid_size = len(a_grid) * len(c_mid_grid)
    print(f"synthetic curve: {args.points} points, truth {truth}, noise std {args.noise}")
    print(f"grid: {len(a_grid)} A x {len(c_mid_grid)} C_mid = {grid_size} points (ScaleRL's), one CPU core")
    print(f"{'method':38}{'time (s)':>10}{'A':>8}{'B':>9}{'C_mid':>9}{'SSE':>12}")
    print(f"{'fit_sigmoid (median of ' + str(args.repeats) + ')':38}{ours_s:>10.3f}{fit.A:>8.3f}{fit.B:>9.4f}"
          f"{fit.C_mid:>9.1f}{fit.sse:>12.6g}")
    print(f"{'exhaustive curve_fit per grid point':38}{baseline_s:>10.3f}{base_A:>8.3f}{base_B:>9.4f}"
          f"{base_C_mid:>9.1f}{base_sse:>12.6g}")
    print(f"speed-up: {baseline_s / ours_s:.1f}x; same optimum: {same_optimum}; curve_fit failures: {failures}")
    print(f"fit_sigmoid on its default data-adaptive grid ({n_default_grid} points): "
          f"{float(np.median(default_times)):.3f} s, A={default_fit.A:.3f} B={default_fit.B:.3f} "
          f"C_mid={default_fit.C_mid:.1f}")
    return {
        "bench": "fit",
        "n_points": args.points,
        "grid_points": grid_size,
        "ours_s": round(ours_s, 4),
        "baseline_s": round(baseline_s, 3),
        "speedup": round(baseline_s / ours_s, 1),
        "same_optimum": same_optimum,
        "ours": {"A": fit.A, "B": fit.B, "C_mid": fit.C_mid, "sse": fit.sse},
        "baseline": {"A": base_A, "B": base_B, "C_mid": base_C_mid, "sse": base_sse},
        "default_grid_points": n_default_grid,
        "default_grid_s": round(float(np.median(default_times)), 4),
        "target_met": bool(ours_s <= 2.0 and same_optimum),
    }


# name -> (benchmark function, function adding its flags, one-line help)
BENCHMARKS: dict[str, tuple[Callable[[argparse.Namespace], dict], Callable[[argparse.ArgumentParser], None], str]] = {
    "fit": (bench_fit, _add_fit_args, "full-grid sigmoid fit on 75 points vs exhaustive per-grid-point curve_fit"),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    subparsers = parser.add_subparsers(dest="benchmark", required=True, metavar="BENCHMARK")
    for name, (_, add_args, help_text) in BENCHMARKS.items():
        add_args(subparsers.add_parser(name, help=help_text, description=help_text))
    args = parser.parse_args(argv)
    results = BENCHMARKS[args.benchmark][0](args)
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
