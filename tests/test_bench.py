"""bench.py's experiment plumbing (fast): the report of a run's metrics, and that a finished run is not run again.
The experiments themselves are real train.py runs; their results are in the README."""

import json
import subprocess

import numpy as np
import pytest

import bench
import scaling_fit as sf


def _rows(values: list[float], lags: list[dict[str, int]]) -> list[dict]:
    rows = []
    for step, (value, lag) in enumerate(zip(values, lags)):
        row = {"step": step, "compute_hours": 0.01 * step + 1e-7, "lag_hist": lag, "stale_dropped": 0}
        if value is not None:
            row["val_pass_rate"] = value
        rows.append(row)
    return rows


def test_run_report_measures_the_fall_after_0_8_and_the_token_weighted_lag():
    values = [0.4, None, 0.7, 0.85, 0.79, 0.9, 0.95, 0.88]
    lags = [{}, {"0": 10, "1": 30}, {"1": 40}, {"2": 20}, {"1": 10}, {}, {}, {}]
    report = bench.run_report(_rows(values, lags), devices=3)
    assert report["val_first"] == 0.4 and report["val_final"] == 0.88 and report["val_best"] == 0.95
    assert report["largest_fall_after_0.8"] == pytest.approx(0.95 - 0.88)  # not 0.85 -> 0.79's 0.06
    assert report["largest_fall"] == pytest.approx(0.95 - 0.88)
    rising = bench.run_report(_rows([0.4, 0.5, 0.85, 0.9], [{}] * 4))
    assert rising["largest_fall"] == 0.0 and rising["largest_fall_after_0.8"] == 0.0  # no fall is 0, not negative
    assert report["lag_mean"] == pytest.approx((30 + 40 + 40 + 10) / 110)
    assert report["lag_max"] == 2 and report["compute_to_0.8"] == pytest.approx(0.03 + 1e-7)
    assert report["wall_s"] == pytest.approx((0.07 + 1e-7) * 3600 / 3)


def test_run_report_half_fit_error_is_the_first_half_prediction_minus_the_final_value():
    compute = np.concatenate([[1e-7], np.linspace(0.01, 0.4, 30)])
    values = sf.sigmoid(compute, A=0.95, B=2.0, C_mid=0.05, R0=0.4)
    rows = [{"step": i, "compute_hours": c, "val_pass_rate": v} for i, (c, v) in enumerate(zip(compute, values))]
    report = bench.run_report(rows)
    assert report["fit"]["r2"] > 0.99 and abs(report["half_fit_error"]) < 0.01
    rows[-1]["val_pass_rate"] = values[-1] - 0.2  # a collapse at the end is what the first half cannot predict
    assert bench.run_report(rows)["half_fit_error"] > 0.15


def test_a_finished_run_is_not_run_again(tmp_path, monkeypatch):
    run = tmp_path / "run"
    run.mkdir()
    rows = [{"step": 0, "compute_hours": 0.0, "val_pass_rate": 0.4}, {"step": 5, "compute_hours": 0.1,
                                                                      "val_pass_rate": 0.9}]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    calls = []
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: calls.append(a))
    assert bench._train_run(run, 5, []) == rows and not calls
    bench._train_run(run, 10, ["--seed", "1"])  # unfinished for 10 steps: it runs (again, from scratch)
    assert calls and "--overwrite" in calls[0][0] and calls[0][0][-2:] == ["--seed", "1"]
