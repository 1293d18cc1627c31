"""Tests of scaling_fit.py: recovery, extrapolation, comparisons, the metrics file, bad input and the CLI."""

import json
import math
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from scipy.optimize import curve_fit

import scaling_fit as sf

REPO = Path(__file__).resolve().parent.parent
# ScaleRL's 8B fit (Table 1), with a made-up starting pass rate.
TRUTH = dict(A=0.610, B=1.92, C_mid=2542.0, R0=0.30)


def noisy_curve(seed: int, compute: np.ndarray, noise: float = 0.005, **truth: float) -> np.ndarray:
    params = {**TRUTH, **truth}
    rng = np.random.default_rng(seed)
    return np.clip(sf.sigmoid(compute, **params) + rng.normal(0.0, noise, len(compute)), 0.0, 1.0)


def write_metrics(path: Path, compute: np.ndarray, pass_rate: np.ndarray, train_rows_between: int = 2) -> Path:
    """A metrics.jsonl as train.py writes it: evaluation rows with training rows (no val_pass_rate) between."""
    lines, step = [], 0
    for c, p in zip(compute, pass_rate):
        lines.append(json.dumps({"step": step, "compute_hours": float(c), "flops": float(c) * 1e15,
                                 "tokens": step * 1000, "val_pass_rate": float(p), "val_reward": float(2 * p - 1)}))
        for _ in range(train_rows_between):
            step += 1
            lines.append(json.dumps({"step": step, "compute_hours": float(c) + 0.001 * step, "loss": 0.1}))
        step += 1
    path.write_text("\n".join(lines) + "\n")
    return path


# ------------------------------------------------------------------------------------------------ the law and fit


def test_sigmoid_is_scalerl_eq1():
    A, B, C_mid, R0 = 0.6, 2.0, 100.0, 0.2
    assert sf.sigmoid(C_mid, A, B, C_mid, R0) == pytest.approx((A + R0) / 2)
    assert sf.sigmoid(0.0, A, B, C_mid, R0) == pytest.approx(R0)
    C = np.array([10.0, 50.0, 400.0])
    np.testing.assert_allclose(sf.sigmoid(C, A, B, C_mid, R0), R0 + (A - R0) / (1 + (C_mid / C) ** B))


def test_recovers_parameters_from_noiseless_curve():
    compute = np.linspace(1500.0, 16000.0, 75)
    fit = sf.fit_sigmoid(compute, sf.sigmoid(compute, **TRUTH), r0=TRUTH["R0"], c_mid_grid=[2000.0, 2542.0, 3000.0])
    assert (fit.A, fit.C_mid) == (pytest.approx(0.610), 2542.0)
    assert fit.B == pytest.approx(1.92, rel=1e-4)
    assert fit.sse < 1e-12 and fit.r2 > 0.999999 and fit.n_points == 75


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_recovers_parameters_from_noisy_curves(seed):
    compute = np.linspace(0.0, 16000.0, 76)  # the first evaluation, at compute 0, is R0
    reward = noisy_curve(seed, compute)
    fit = sf.fit_sigmoid(compute, reward, min_compute=1500.0)
    assert fit.R0 == reward[0]
    assert abs(fit.A - TRUTH["A"]) <= 0.02  # ScaleRL's noise margin on A
    assert fit.B == pytest.approx(TRUTH["B"], rel=0.2)
    assert fit.C_mid == pytest.approx(TRUTH["C_mid"], rel=0.15)
    assert fit.r2 > 0.95


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_first_half_of_compute_predicts_second_half(seed):
    compute = np.linspace(1500.0, 16000.0, 75)
    reward = noisy_curve(seed, compute)
    first_half = compute <= 8000.0
    fit = sf.fit_sigmoid(compute[first_half], reward[first_half], r0=TRUTH["R0"])
    held_out = compute[~first_half]
    assert np.max(np.abs(fit.predict(held_out) - sf.sigmoid(held_out, **TRUTH))) < 0.02
    assert np.mean(np.abs(fit.predict(held_out) - reward[~first_half])) < 0.02


def test_grid_search_finds_the_exhaustive_curve_fit_optimum():
    compute = np.linspace(1500.0, 16000.0, 30)
    reward = noisy_curve(7, compute, noise=0.01)
    a_grid, c_mid_grid = np.arange(0.58, 0.66, 0.01), np.linspace(1500.0, 4000.0, 8)
    fit = sf.fit_sigmoid(compute, reward, r0=TRUTH["R0"], a_grid=a_grid, c_mid_grid=c_mid_grid)
    best = (math.inf,)
    for A in a_grid:
        for C_mid in c_mid_grid:
            (B,), _ = curve_fit(lambda C, B: sf.sigmoid(C, A, B, C_mid, TRUTH["R0"]), compute, reward,
                                p0=[1.0], bounds=sf.B_BOUNDS)
            sse = float(np.sum((reward - sf.sigmoid(compute, A, B, C_mid, TRUTH["R0"])) ** 2))
            best = min(best, (sse, A, C_mid, B))
    assert (fit.A, fit.C_mid) == (best[1], best[2])
    assert fit.B == pytest.approx(best[3], rel=1e-4)
    assert fit.sse == pytest.approx(best[0], rel=1e-7)


def test_default_grids_adapt_to_the_data():
    reward = np.array([0.1, 0.2, 0.3, 0.35])
    a_grid = sf.default_a_grid(reward, r0=0.1)
    assert a_grid[0] <= 0.35 - sf.NOISE_MARGIN + 1e-9 and a_grid[-1] == pytest.approx(1.0)
    assert np.allclose(np.diff(a_grid), 0.005)
    c_mid_grid = sf.default_c_mid_grid(np.array([0.0, 2.0, 4.0, 8.0]))
    assert len(c_mid_grid) == 100 and c_mid_grid[0] < 2.0 and c_mid_grid[-1] > 8.0 * 10


def test_paper_grids():
    assert sf.PAPER_A_GRID[0] == 0.45 and sf.PAPER_A_GRID[-1] == 0.8 and len(sf.PAPER_A_GRID) == 71
    assert sf.PAPER_C_MID_GRID[0] == 100 and sf.PAPER_C_MID_GRID[-1] == 40000 and len(sf.PAPER_C_MID_GRID) == 100


def test_bootstrap_intervals_contain_the_fit_and_the_truth():
    compute = np.linspace(1500.0, 16000.0, 40)
    reward = noisy_curve(3, compute)
    boot = sf.bootstrap_sigmoid(compute, reward, 60, r0=TRUTH["R0"], predict_at=[16000.0, 32000.0], seed=1)
    for name in ("A", "B", "C_mid"):
        lo, hi = getattr(boot, f"{name}_ci")
        assert lo <= getattr(boot.fit, name) <= hi, name
    assert boot.A_ci[0] - 0.01 <= TRUTH["A"] <= boot.A_ci[1] + 0.01
    assert boot.predictions_ci.shape == (2, 2)
    assert np.all(boot.predictions_ci[:, 0] <= boot.predictions)
    assert np.all(boot.predictions <= boot.predictions_ci[:, 1])
    assert len(boot.samples) + boot.n_failed == 60


def test_power_law_fitted_on_early_points_overpredicts_the_ceiling():
    # ScaleRL app. A.4: on the early, still-accelerating part of the run a power law runs off to A = 1.
    compute = np.geomspace(20.0, 2542.0, 30)
    reward = noisy_curve(4, compute)
    power = sf.fit_power_law(compute, reward)
    sigmoid_fit = sf.fit_sigmoid(compute, reward, r0=TRUTH["R0"])
    assert power.A > TRUTH["A"] + 0.2
    assert abs(sigmoid_fit.A - TRUTH["A"]) < abs(power.A - TRUTH["A"]) / 3
    assert power.predict(compute) == pytest.approx(reward, abs=0.1)


def test_fixed_a_comparison_ranks_runs_by_b():
    compute = np.linspace(1500.0, 16000.0, 40)
    curves = {f"B={b}": (compute, noisy_curve(i, compute, B=b)) for i, b in enumerate([1.2, 2.4, 1.8])}
    comparison = sf.compare_fixed_a(curves)
    assert comparison.ranking == ["B=2.4", "B=1.8", "B=1.2"]
    assert abs(comparison.A - TRUTH["A"]) < 0.02
    assert all(fit.A == comparison.A for fit in comparison.fits.values())
    assert sf.compare_fixed_a(curves, A=0.62).A == 0.62


def test_record_points_keep_first_entry_into_each_higher_bin():
    compute = np.arange(1.0, 9.0)
    reward = np.array([0.0, 0.5, 0.4, 0.55, 1.0, 0.9, 0.95, 1.0])
    C, R = sf.record_points(compute, reward, n_bins=4)
    np.testing.assert_array_equal(C, [1.0, 2.0, 5.0])
    np.testing.assert_array_equal(R, [0.0, 0.5, 1.0])


# ------------------------------------------------------------------------------------------------ metrics file


def test_read_metrics_and_load_curve(tmp_path):
    compute = np.array([0.0, 1.0, 2.0, 4.0])
    pass_rate = np.array([0.1, 0.2, 0.3, 0.4])
    run = tmp_path / "run_a"
    run.mkdir()
    write_metrics(run / "metrics.jsonl", compute, pass_rate)
    rows = sf.read_metrics(run)
    assert len(rows) == 4 * 3 and rows[0]["val_pass_rate"] == 0.1
    assert sf.read_metrics(run / "metrics.jsonl") == rows
    x, y = sf.load_curve(run)
    np.testing.assert_array_equal(x, compute)
    np.testing.assert_array_equal(y, pass_rate)
    x, y = sf.load_curve(run, x="flops", y="val_reward")
    np.testing.assert_allclose(y, 2 * pass_rate - 1)
    with pytest.raises(FileNotFoundError):
        sf.read_metrics(tmp_path / "missing")


@pytest.mark.parametrize(
    "text, message",
    [
        ('{"step": 0}\n\n{"step": 1}\n', ":2: empty line"),
        ('{"step": 0}\n{"step": 1,\n', ":2: malformed JSON"),
        ('{"step": 0}\n[1, 2]\n', ":2: expected a JSON object"),
        ('{"step": 0}\n{"step": 1}\n{"step": 2, "val_pa', ":3: malformed JSON.*partial line"),
    ],
)
def test_bad_metrics_lines_are_reported_with_their_line_number(tmp_path, text, message):
    path = tmp_path / "metrics.jsonl"
    path.write_text(text)
    with pytest.raises(ValueError, match=message):
        sf.read_metrics(path)


def test_a_complete_last_line_without_newline_is_accepted(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_text('{"step": 0}\n{"step": 1}')
    assert sf.read_metrics(path) == [{"step": 0}, {"step": 1}]


@pytest.mark.parametrize(
    "rows, message",
    [
        ([{"compute_hours": 1.0, "val_pass_rate": 0.2}, {"compute_hours": 1.0, "val_pass_rate": 0.3}],
         ":2: compute_hours = 1 does not increase"),
        ([{"compute_hours": 1.0, "val_pass_rate": 1.2}], ":1: val_pass_rate = 1.2 is outside \\[0, 1\\]"),
        ([{"compute_hours": 1.0, "val_pass_rate": float("nan")}], ":1: non-finite val_pass_rate"),
        ([{"val_pass_rate": 0.2}], ":1: row has val_pass_rate but no compute_hours"),
        ([{"compute_hours": "x", "val_pass_rate": 0.2}], ":1: compute_hours = 'x' is not a number"),
        ([{"compute_hours": 1.0, "loss": 0.2}], "no rows carry val_pass_rate"),
    ],
)
def test_load_curve_rejects_bad_rows_with_their_line_number(tmp_path, rows, message):
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    with pytest.raises(ValueError, match=message):
        sf.load_curve(path)


def test_a_runs_record_is_read_as_its_metrics_file(tmp_path):
    """A study's record of a run (docs/study-runs/*.json: one object whose rows are the run's) gives the rows, the
    curve and the CLI's fit that the same rows give as a metrics.jsonl; a row's error names where it is."""
    committed = REPO / "docs" / "study-runs" / "scalerl-s0.json"
    rows = json.loads(committed.read_text())["rows"]
    as_jsonl = tmp_path / "scalerl-s0" / "metrics.jsonl"
    as_jsonl.parent.mkdir()
    as_jsonl.write_text("".join(json.dumps(row) + "\n" for row in rows))
    assert sf.read_metrics(committed) == rows
    for got, expected in zip(sf.load_curve(committed, x="flops"), sf.load_curve(as_jsonl, x="flops"), strict=True):
        np.testing.assert_array_equal(got, expected)
    printed = [subprocess.run([sys.executable, str(Path(sf.__file__)), str(path), "--bootstrap", "0", "--fit-until",
                               "0.2", "--out", str(tmp_path / "fit.png")], capture_output=True, text=True, timeout=120)
               for path in (committed, as_jsonl.parent)]
    assert [run.returncode for run in printed] == [0, 0], printed
    assert printed[0].stdout == printed[1].stdout and "run scalerl-s0: " in printed[0].stdout

    record = tmp_path / "r.json"
    record.write_text(json.dumps({"rows": [{"compute_hours": 1.0, "val_pass_rate": 0.2}, {"val_pass_rate": 0.3}]}))
    with pytest.raises(ValueError, match=re.escape(f"{record}: rows[1]: row has val_pass_rate but no compute_hours")):
        sf.load_curve(record)


@pytest.mark.parametrize("text", ['{"step": 0}\n{"step": 1}\n', "[1, 2]", '{"rows": [1]}', '{"flags": null}'])
def test_a_json_file_that_is_no_record_is_one_line_that_says_a_metrics_file_is_jsonl(tmp_path, text):
    path = tmp_path / "metrics.json"
    path.write_text(text)
    run = subprocess.run([sys.executable, str(Path(sf.__file__)), str(path)], capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 2 and run.stdout == "", run
    assert run.stderr.startswith(f"error: {path}: ") and len(run.stderr.splitlines()) == 1, run.stderr
    assert "run's record" in run.stderr and "JSON Lines, named .jsonl" in run.stderr, run.stderr


@pytest.mark.parametrize("records", [2, 30])
def test_a_reader_that_stops_reading_ends_the_fit_quietly(tmp_path, records):
    """`python scaling_fit.py RUNS | head`: the reader closes the pipe before the fit prints. The command ends with
    status 1 and nothing on stderr (harness/cli.exit_with), where it ended in a BrokenPipeError: a traceback when a
    print met the closed pipe (30 runs' tables overflow the pipe's buffer), a message when the exit's flush did (2)."""
    paths = sorted((REPO / "docs" / "study-runs").glob("*.json"))[:records]
    proc = subprocess.Popen([sys.executable, str(Path(sf.__file__)), *map(str, paths), "--bootstrap", "0", "--out",
                             str(tmp_path / "fit.png")], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    proc.stdout.close()  # the reader is gone before the first line
    stderr = proc.stderr.read()
    assert proc.wait(timeout=300) == 1 and stderr == "", stderr


def test_load_curve_checks_reward_range(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text(json.dumps({"compute_hours": 1.0, "val_reward": -0.5}) + "\n"
                    + json.dumps({"compute_hours": 2.0, "val_reward": -1.5}) + "\n")
    with pytest.raises(ValueError, match=r":2: val_reward = -1.5 is outside \[-1, 1\]"):
        sf.load_curve(path, y="val_reward")


# ------------------------------------------------------------------------------------------------ bad input to the fit


GOOD_C = np.array([0.0, 1.0, 2.0, 3.0, 4.0, 5.0])
GOOD_R = np.array([0.1, 0.2, 0.35, 0.45, 0.5, 0.52])


@pytest.mark.parametrize(
    "compute, reward, options, message",
    [
        (GOOD_C, GOOD_R, dict(min_compute=3.0), "at least 4 points"),
        (GOOD_C[:4], GOOD_R[:4], {}, "at least 4 points"),
        (np.r_[GOOD_C[:3], np.nan, GOOD_C[4:]], GOOD_R, {}, "non-finite value at point 3"),
        (GOOD_C, np.r_[GOOD_R[:2], np.inf, GOOD_R[3:]], {}, "non-finite value at point 2"),
        (np.r_[GOOD_C[:4], 3.0, 5.0], GOOD_R, {}, "strictly increase: point 4"),
        (GOOD_C, np.r_[GOOD_R[:5], 1.01], {}, r"pass rate 1.01 at point 5 is outside \[0, 1\]"),
        (GOOD_C, np.r_[-0.2, GOOD_R[1:]], {}, r"outside \[0, 1\]"),
        (GOOD_C, np.r_[GOOD_R[:5], 1.5], dict(value_range=sf.REWARD_RANGE), r"1.5 at point 5 is outside \[-1, 1\]"),
        (-GOOD_C[::-1], GOOD_R, {}, "negative compute"),
    ],
)
def test_bad_input_to_the_fit_raises_a_clear_error(compute, reward, options, message):
    with pytest.raises(ValueError, match=message):
        sf.fit_sigmoid(compute, reward, **options)


def test_rewards_in_minus_one_one_are_fitted():
    compute = np.linspace(0.0, 16000.0, 40)
    reward = 2 * noisy_curve(5, compute) - 1
    fit = sf.fit_sigmoid(compute, reward, value_range=sf.REWARD_RANGE)
    assert abs(fit.A - (2 * TRUTH["A"] - 1)) < 0.04


@pytest.mark.parametrize("noise", [0.0, 0.01])
def test_flat_curve_raises_no_sigmoid_error(noise):
    compute = np.linspace(0.0, 100.0, 30)
    reward = np.clip(0.3 + np.random.default_rng(0).normal(0.0, noise, 30), 0, 1)
    with pytest.raises(sf.NoSigmoidError, match="no sigmoid can be identified"):
        sf.fit_sigmoid(compute, reward)


def test_declining_curve_raises_no_sigmoid_error():
    with pytest.raises(sf.NoSigmoidError, match="no point rises above R0"):
        sf.fit_sigmoid(GOOD_C, GOOD_R[::-1])


def test_grid_edges_are_flagged():
    compute = np.linspace(1500.0, 16000.0, 20)
    reward = sf.sigmoid(compute, **TRUTH)
    fit = sf.fit_sigmoid(compute, reward, r0=TRUTH["R0"], a_grid=[0.55, 0.57], c_mid_grid=[500.0, 1000.0])
    assert any("A hit the top" in note for note in fit.warnings)
    assert any("C_mid hit the top" in note for note in fit.warnings)


# ------------------------------------------------------------------------------------------------ figure and CLI


def test_plot_fits_accepts_plain_tuples(tmp_path):
    compute = np.linspace(0.0, 16000.0, 30)
    reward = noisy_curve(0, compute)
    fit = sf.fit_sigmoid(compute, reward, min_compute=1500.0)
    out = sf.plot_fits([("run", compute, reward, fit, 8000.0), ("flat", compute, np.full(30, 0.3), None, None)],
                       tmp_path / "fig.png", x_label="GPU-hours")
    assert out.stat().st_size > 0


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPO / "scaling_fit.py"), *args],
                          capture_output=True, text=True, cwd=REPO, timeout=120)


def test_cli_fits_runs_and_writes_a_figure(tmp_path):
    compute = np.linspace(0.0, 16000.0, 40)
    for i, b in enumerate([1.5, 2.2]):
        (tmp_path / f"run{i}").mkdir()
        write_metrics(tmp_path / f"run{i}" / "metrics.jsonl", compute, noisy_curve(i, compute, B=b))
    out = tmp_path / "fig.png"
    result = run_cli(str(tmp_path / "run0"), str(tmp_path / "run1" / "metrics.jsonl"), "--min-compute", "1500",
                     "--fit-until", "8000", "--bootstrap", "20", "--out", str(out))
    assert result.returncode == 0, result.stderr
    assert "run run0" in result.stdout and "run run1" in result.stdout
    assert "held out 20 points beyond compute_hours = 8000" in result.stdout
    assert "95% CI" in result.stdout
    assert out.stat().st_size > 0
    shared = run_cli(str(tmp_path / "run0"), str(tmp_path / "run1"), "--shared-A", "--bootstrap", "0",
                     "--out", str(tmp_path / "shared.png"))
    assert shared.returncode == 0, shared.stderr
    assert "highest B (steepest) first: run1" in shared.stdout


def test_cli_reports_flat_runs_and_bad_files(tmp_path):
    compute = np.linspace(0.0, 10.0, 10)
    write_metrics(tmp_path / "flat.jsonl", compute, np.full(10, 0.25))
    flat = run_cli(str(tmp_path / "flat.jsonl"), "--out", str(tmp_path / "flat.png"))
    assert flat.returncode == 1
    assert "no sigmoid can be identified" in flat.stdout
    assert (tmp_path / "flat.png").stat().st_size > 0
    (tmp_path / "bad.jsonl").write_text('{"compute_hours": 0, "val_pass_rate": 0.1}\nnot json\n')
    bad = run_cli(str(tmp_path / "bad.jsonl"), "--out", str(tmp_path / "bad.png"))
    assert bad.returncode == 2 and "bad.jsonl:2: malformed JSON" in bad.stderr


def test_cli_help_explains_every_flag():
    result = run_cli("--help")
    assert result.returncode == 0
    for flag in ("--x", "--y", "--min-compute", "--fit-until", "--shared-A", "--bootstrap", "--out"):
        assert flag in result.stdout


def test_plot_gives_the_log_axis_to_the_run_and_draws_the_step_0_point_as_r0(tmp_path, monkeypatch):
    """The evaluation before training sits at compute ~1e-7 h; it must not take five decades of the log axis."""
    import matplotlib.figure

    figures = []
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", lambda fig, *a, **k: figures.append(fig))
    compute = np.concatenate([[1e-7], np.geomspace(0.01, 0.5, 20)])
    reward = sf.sigmoid(compute, A=0.95, B=1.5, C_mid=0.08, R0=0.4)
    fit = sf.fit_sigmoid(compute, reward)
    sf.plot_fits([("run", compute, reward, fit, None)], tmp_path / "fit.png")
    ax = figures[0].axes[0]
    left, right = ax.get_xlim()
    assert 1e-3 < left < 0.01 and right > 0.5  # the axis starts just before the first trained point
    assert any(line.get_linestyle() == "-." and line.get_ydata()[0] == pytest.approx(0.4)
               for line in ax.get_lines())  # R0 drawn as a line


def test_dashboard_overlays_runs_and_says_which_panels_have_no_data(tmp_path, capsys):
    """plot_dashboard draws a run's metrics rows against the step, runs overlaid; `--dashboard` draws it for
    finished runs. A run without the newer fields (entropy, lengths) still draws, those panels saying so."""
    import matplotlib.pyplot as plt

    full, old = tmp_path / "full", tmp_path / "old"
    for run, extra in ((full, {"entropy": 0.5, "length_mean": 30.0, "length_p90": 40.0}), (old, {})):
        run.mkdir()
        rows = [{"step": s, "compute_hours": 0.001 * (s + 0.01), "reward": 0.1 * s, "grad_norm": 1.0, **extra,
                 **({"val_pass_rate": 0.3 + 0.06 * s} if s % 2 == 0 else {})} for s in range(10)]
        (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    drawn: list = []
    real_text = plt.Axes.text
    with pytest.MonkeyPatch.context() as mp:  # count the panels that say they have no data
        mp.setattr(plt.Axes, "text", lambda self, *a, **k: drawn.append(a[2]) or real_text(self, *a, **k))
        out = sf.plot_dashboard([("full", sf.read_metrics(full)), ("old", sf.read_metrics(old))], tmp_path / "d.png")
    assert out.read_bytes()[:4] == b"\x89PNG"
    # full has pass rate, reward, entropy, lengths and gradient norm: the other four panels have nothing
    assert drawn.count("not in these metrics") == 4
    assert sf.main([str(full), str(old), "--dashboard", str(tmp_path / "cli.png"), "--bootstrap", "0",
                    "--out", str(tmp_path / "fit.png")]) in (0, 1)
    assert (tmp_path / "cli.png").read_bytes()[:4] == b"\x89PNG" and "dashboard:" in capsys.readouterr().out


def test_too_few_points_left_by_the_cuts_says_which_cut_left_them(tmp_path, capsys):
    """`--fit-until` or `--record-bins` that left too few points said "got 2 of 2", as if the run had 2; now the
    error names the cut and the run's count. A --min-compute above --fit-until leaves no point: one line first."""
    compute = np.linspace(100.0, 16000.0, 20)
    run = write_metrics(tmp_path / "metrics.jsonl", compute, noisy_curve(0, compute))
    out = ["--bootstrap", "0", "--out", str(tmp_path / "fit.png")]
    assert sf.main([str(run), "--fit-until", "1000", *out]) == 2
    assert capsys.readouterr().err.endswith("got 2 of 2 (--fit-until left 2 of the run's 20 points)\n")
    with pytest.raises(SystemExit) as stop:
        sf.main([str(run), "--fit-until", "1000", "--min-compute", "2000", *out])
    assert stop.value.code == 2
    assert "error: --min-compute 2000 is above --fit-until 1000: no point is left to fit" in capsys.readouterr().err
    assert not (tmp_path / "fit.png").exists()


def test_a_figure_refused_for_another_reason_says_no_free_space(tmp_path, monkeypatch, capsys):
    """A figure that could not be written for a reason other than a full disk (permission denied) named the free
    space where it was to go too, as if the disk were the cause."""
    import errno

    compute = np.linspace(100.0, 16000.0, 20)
    run = write_metrics(tmp_path / "metrics.jsonl", compute, noisy_curve(0, compute))

    def refused(*args, **kwargs):
        raise PermissionError(errno.EACCES, "Permission denied")

    monkeypatch.setattr(sf, "plot_fits", refused)
    figure = tmp_path / "fit.png"
    assert sf.main([str(run), "--out", str(figure), "--bootstrap", "0"]) == 3
    assert capsys.readouterr().err == f"error: could not write {figure}: Permission denied\n"


def test_a_figure_on_a_full_disk_is_one_line_after_the_fits(full_tmpfs, tmp_path, capsys):
    """--out and --dashboard on a full disk were tracebacks after the fit had been printed; now the fit stands and the
    figure is one line naming it and the free space, exit status 3, with no half-written figure left behind."""
    compute = np.linspace(100.0, 16000.0, 20)
    run = write_metrics(tmp_path / "metrics.jsonl", compute, noisy_curve(0, compute))
    for flag in ("--out", "--dashboard"):
        figure = full_tmpfs / f"{flag[2:]}.png"
        assert sf.main([str(run), flag, str(figure), "--bootstrap", "0"]) == 3
        captured = capsys.readouterr()
        assert re.fullmatch(rf"error: could not write {re.escape(str(figure))}: No space left on device "
                            r"\([\d.]+ MB free there\)\n", captured.err), captured.err
        assert sorted(p.name for p in full_tmpfs.iterdir()) == ["filler"]
        if flag == "--out":  # the dashboard comes before the fits; the figure of the fits after them
            assert "R^2" in captured.out and "figure:" not in captured.out
