"""tools/experiments.py's plumbing (fast): the report of a run's metrics, that a finished run is not run again, and
the study's pooled fits and verdicts (on fake runs). The experiments themselves are real train.py runs; their results
are in docs/results.md."""

import argparse
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import scaling_fit as sf
import torch
from harness import flags
from tools import experiments
from helpers import file_tree

REPO = Path(__file__).resolve().parent.parent


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
    report = experiments.run_report(_rows(values, lags), devices=3)
    assert report["val_first"] == 0.4 and report["val_final"] == 0.88 and report["val_best"] == 0.95
    assert report["largest_fall_after_0.8"] == pytest.approx(0.95 - 0.88)  # not 0.85 -> 0.79's 0.06
    assert report["largest_fall"] == pytest.approx(0.95 - 0.88)
    rising = experiments.run_report(_rows([0.4, 0.5, 0.85, 0.9], [{}] * 4))
    assert rising["largest_fall"] == 0.0 and rising["largest_fall_after_0.8"] == 0.0  # no fall is 0, not negative
    assert report["lag_mean"] == pytest.approx((30 + 40 + 40 + 10) / 110)
    assert report["lag_max"] == 2 and report["compute_to_0.8"] == pytest.approx(0.03 + 1e-7)
    assert report["wall_s"] == pytest.approx((0.07 + 1e-7) * 3600 / 3)
    assert report["weight_sync_frac"] is None  # these rows log no step times
    timed = _rows(values, lags)
    for row, (sync_s, step_s) in zip(timed[1:], [(0.01, 1.0), (0.03, 1.0), (0.02, 0.5), (0.5, 1.0)]):
        row.update(weight_sync_s=sync_s, step_s=step_s)
    assert experiments.run_report(timed)["weight_sync_frac"] == pytest.approx((0.03 + 0.04) / 2)  # the median share


def test_run_report_half_fit_error_is_the_first_half_prediction_minus_the_final_value():
    compute = np.concatenate([[1e-7], np.linspace(0.01, 0.4, 30)])
    values = sf.sigmoid(compute, A=0.95, B=2.0, C_mid=0.05, R0=0.4)
    rows = [{"step": i, "compute_hours": c, "val_pass_rate": v} for i, (c, v) in enumerate(zip(compute, values))]
    report = experiments.run_report(rows)
    assert report["fit"]["r2"] > 0.99 and abs(report["half_fit_error"]) < 0.01
    assert abs(report["half_fit_error_vs_fit"]) < 0.01 and report["eval_sd_second_half"] < 1e-3
    rows[-1]["val_pass_rate"] = values[-1] - 0.2  # a collapse at the end is what the first half cannot predict
    collapsed = experiments.run_report(rows)
    assert collapsed["half_fit_error"] > 0.15
    # one low last evaluation: the full fit's end moves a little, the last sample by 0.2; the noise shows in the sd
    assert abs(collapsed["half_fit_error_vs_fit"]) < collapsed["half_fit_error"] - 0.1
    assert collapsed["eval_sd_second_half"] > 0.03


def test_fit_from_step_leaves_the_early_evaluations_out_of_every_fit():
    """A run that jumps in its first steps, then follows a sigmoid to 0.7 (the verified task's shape): fitted from
    step 0 the jump drags A off; fitted from step 3 on (R0 still the step-0 value), A and the prediction hold."""
    compute = np.concatenate([[1e-7], np.linspace(0.01, 0.4, 30)])
    values = sf.sigmoid(compute, A=0.7, B=2.0, C_mid=0.1, R0=0.25)
    values[1:3] = 0.6  # the early jump
    rows = [{"step": i, "compute_hours": c, "val_pass_rate": v} for i, (c, v) in enumerate(zip(compute, values))]
    late = experiments.run_report(rows, fit_from_step=3)
    assert late["min_compute"] == pytest.approx(compute[3]) and late["eval_steps"] == list(range(31))
    assert late["fit"]["A"] == pytest.approx(0.7, abs=0.01) and late["fit"]["R0"] == pytest.approx(0.25)
    assert abs(late["half_fit_error"]) < 0.01
    assert abs(experiments.run_report(rows)["fit"]["A"] - 0.7) > 0.02  # the same curve with every point fitted
    pooled = experiments.pooled_fit([late, late], n_boot=20)
    assert pooled["n_points"] == 1 + 2 * 28 and pooled["A"] == pytest.approx(0.7, abs=0.01)  # R0 + steps 3..30


def _write_args(run: Path, argv: list[str]) -> None:
    """RUN/args.json as train.py writes it when started with `argv`: parsed, with the defaults it resolves here."""
    run.mkdir(parents=True, exist_ok=True)
    args = flags.parse_args(["--output-dir", str(run), *argv])
    flags.resolve_defaults(args, args.model is None, torch.cuda.is_available())
    flags.write_args_json(run, args, 0, [])


def _plant_run(run: Path, argv: list[str], steps: int, token: str | None = None, checkpoint: bool = False) -> None:
    """A run as train.py leaves it, without training: its args.json as train.py writes it for `argv`, metrics rows
    for steps 0..`steps` (the last one evaluated), a checkpoint if asked."""
    _write_args(run, [*argv, *(["--start-token", token] if token else [])])
    rows = [{"step": step, "compute_hours": 0.01 * step, **({"val_pass_rate": 0.5} if step in (0, steps) else {})}
            for step in range(steps + 1)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    if checkpoint:
        (run / "checkpoint").mkdir()
        (run / "checkpoint" / "trainer_state.json").write_text("{}")  # complete, as complete_checkpoints reads it


@pytest.fixture
def torchrun_calls(monkeypatch) -> list[list[str]]:
    """The torchrun commands _train_run runs; none trains: each exits with status 0, a start (--output-dir) once it has
    written its args.json and step 0's row, as a run killed then leaves them."""
    calls = []

    def fake_run(cmd, check=False, **kwargs):
        calls.append(cmd)
        argv = cmd[cmd.index("train.py") + 1:]
        if "--output-dir" in argv:
            out = Path(argv[argv.index("--output-dir") + 1])
            _write_args(out, argv)
            (out / "metrics.jsonl").write_text(json.dumps({"step": 0, "compute_hours": 0.0, "val_pass_rate": 0.5}))
        return subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr(subprocess, "run", fake_run)
    return calls


def _token(command_file: Path) -> str:
    return json.loads(command_file.read_text())["token"]


def test_a_finished_run_with_the_same_flags_is_not_run_again(tmp_path, torchrun_calls):
    """The same flags as train.py parses them, not as the command line writes them: --lr 0.0001 is the tiny
    model's default, and the study gives none."""
    run = tmp_path / "run"
    _plant_run(run, ["--seed", "1", "--lr", "0.0001", "--max-steps", "10"], 10)
    rows = experiments._train_run(run, 10, ["--seed", "1"])
    assert len(rows) == 11 and not torchrun_calls
    assert len(experiments._train_run(run, 5, ["--seed", "1"])) == 11 and not torchrun_calls  # cut by the study


def test_a_run_made_with_other_flags_is_refused_in_one_line_naming_them(tmp_path, torchrun_calls):
    """A finished run at the path of a study's run, made with other flags: never reused (its rows would be recorded
    under the study's flags), never deleted; the line names each flag that differs and does not advise keeping
    --out-dir."""
    run = tmp_path / "out" / "gspo-s0"
    _plant_run(run, ["--seed", "0", "--lr", "1.0", "--max-steps", "10"], 10)
    before = file_tree(run)
    with pytest.raises(SystemExit) as refused:
        experiments._train_run(run, 10, ["--seed", "0", "--loss", "gspo"])
    line = str(refused.value.code)
    assert len(line.splitlines()) == 1 and str(run) in line, line
    assert "--loss cispo, where the experiment gives gspo" in line
    assert "--lr 1.0, where the experiment gives 0.0001" in line  # the tiny model's default, resolved as train.py does
    assert "--seed" not in line and "another --out-dir" in line and "nothing was run or deleted" in line
    assert not torchrun_calls and file_tree(run) == before
    assert not (tmp_path / "out" / "gspo-s0.command.json").exists()
    with pytest.raises(SystemExit, match="--seed 0, where the experiment gives 1"):  # unfinished: the same
        experiments._train_run(run, 20, ["--seed", "1", "--lr", "1.0"])
    assert not torchrun_calls and file_tree(run) == before


@pytest.mark.parametrize("planted", ["unfinished run", "run files", "other token"])
def test_a_directory_the_study_did_not_start_is_refused_not_deleted(tmp_path, torchrun_calls, planted):
    """A foreign directory at a study's run path: an unfinished run with the study's very flags but made by hand (no
    start token), the files of a run without its args.json, or a run another study started (another token). The
    study neither resumes nor starts over it (train.py --overwrite would delete it): one line, nothing changed."""
    run = tmp_path / "out" / "scalerl-s0"
    command_file = tmp_path / "out" / "scalerl-s0.command.json"
    if planted == "run files":
        run.mkdir(parents=True)
        (run / "checkpoint").mkdir()
        (run / "metrics.jsonl").write_text('{"step": 0}\n')
    else:
        _plant_run(run, ["--seed", "0", "--max-steps", "10"], 4, checkpoint=True,
                   token="theirs" if planted == "other token" else None)
        if planted == "other token":
            command_file.write_text(json.dumps({"token": "ours", "steps": 10, "flags": ["--seed", "0"]}))
    before, command = file_tree(run), command_file.read_bytes() if command_file.exists() else None
    with pytest.raises(SystemExit) as refused:
        experiments._train_run(run, 10, ["--seed", "0"])
    line = str(refused.value.code)
    assert len(line.splitlines()) == 1 and str(run) in line and "nothing was run or deleted" in line, line
    assert ("no args.json" in line) if planted == "run files" else ("an unfinished run that this experiment did not "
                                                                    "start" in line)
    assert not torchrun_calls and file_tree(run) == before
    assert (command_file.read_bytes() if command_file.exists() else None) == command


def test_a_symlink_at_the_command_file_is_refused_and_nothing_is_written_through_it(tmp_path, torchrun_calls, victim):
    run = tmp_path / "out" / "scalerl-s0"
    run.parent.mkdir()
    command_file = tmp_path / "out" / "scalerl-s0.command.json"
    command_file.symlink_to(victim)
    with pytest.raises(SystemExit) as refused:
        experiments._train_run(run, 10, ["--seed", "0"])
    line = str(refused.value.code)
    assert len(line.splitlines()) == 1 and f"{command_file} is a symbolic link: refused" in line, line
    assert victim.read_text() == "precious\n" and command_file.is_symlink() and not torchrun_calls
    victim.unlink()  # a dangling link: refused all the same, and not created through
    with pytest.raises(SystemExit, match=f"{command_file} is a symbolic link: refused"):
        experiments._train_run(run, 10, ["--seed", "0"])
    assert not victim.exists() and not torchrun_calls


def test_a_study_writes_its_records_and_summary_without_following_a_planted_link(tmp_path, victim, monkeypatch):
    rows = _sigmoid_run(0.9, 0, 10)
    (tmp_path / "records").mkdir()
    (tmp_path / "records" / "run.json").symlink_to(victim)
    with pytest.raises(SystemExit, match="run.json is a symbolic link: refused, nothing was written through it"):
        experiments.write_record(tmp_path / "records" / "run.json", rows, None, [])
    with pytest.raises(SystemExit, match="run.json is a symbolic link: refused, nothing was read through it"):
        experiments._read_record(tmp_path / "records" / "run.json", 10, [])
    monkeypatch.setattr(experiments, "_train_run", lambda run_dir, steps, flags: _sigmoid_run(0.9, 0, steps))
    out = tmp_path / "study"
    out.mkdir()
    (out / "study.png").symlink_to(victim)  # replaced by the new figure, not written through
    (out / "study.json").symlink_to(victim)
    with pytest.raises(SystemExit, match="study.json is a symbolic link: refused, nothing was written through it"):
        experiments.main(["study", "--variants", "scalerl", "--seeds", "0", "--steps", "10", "--bootstrap", "0",
                          "--out-dir", str(out)])
    assert victim.read_text() == "precious\n"
    (out / "study.json").unlink()
    assert experiments.main(["study", "--variants", "scalerl", "--seeds", "0", "--steps", "10", "--bootstrap", "0",
                             "--out-dir", str(out)]) == 0
    assert victim.read_text() == "precious\n" and not (out / "study.png").is_symlink()
    assert (out / "study.png").read_bytes()[:4] == b"\x89PNG"


def test_a_killed_study_resumes_or_restarts_only_the_run_it_started(tmp_path, torchrun_calls, monkeypatch):
    """The study's own unfinished run (its args.json holds the token of the command file beside it) goes on from its
    checkpoint with --resume, or without a checkpoint starts over with --overwrite: the only case the study deletes
    anything, and it made all of it. A fresh start never passes --overwrite. Nothing depends on file times."""
    run = tmp_path / "out" / "gspo-s1"
    command_file = tmp_path / "out" / "gspo-s1.command.json"
    experiments._train_run(run, 48, ["--seed", "1"])  # the first start: fresh, into a directory train.py makes
    token = _token(command_file)  # killed before its first checkpoint
    assert "--overwrite" not in torchrun_calls[-1] and torchrun_calls[-1][-4:] == ["--seed", "1", "--start-token",
                                                                                     token]
    os.utime(command_file, ns=(2, 2))  # file times say nothing
    os.utime(run / "args.json", ns=(1, 1))
    experiments._train_run(run, 48, ["--seed", "1"])  # started over, with the same token
    assert "--overwrite" in torchrun_calls[-1] and torchrun_calls[-1][-1] == token == _token(command_file)
    (run / "checkpoint").mkdir()
    (run / "checkpoint" / "trainer_state.json").write_text("{}")  # killed after a checkpoint: resumed
    experiments._train_run(run, 48, ["--seed", "1"])
    assert torchrun_calls[-1][-4:] == ["--resume", str(run), "--max-steps", "48"]
    experiments._train_run(run, 60, ["--seed", "1"])  # a longer study: the same run, resumed further
    assert torchrun_calls[-1][-4:] == ["--resume", str(run), "--max-steps", "60"]
    experiments._train_run(run, 20, ["--seed", "1"])  # a shorter one: resumed to its own --max-steps, then cut
    assert torchrun_calls[-1][-4:] == ["--resume", str(run), "--max-steps", "48"]
    calls = len(torchrun_calls)
    with pytest.raises(SystemExit, match="--seed 1, where the experiment gives 2"):  # another command: refused
        experiments._train_run(run, 48, ["--seed", "2"])
    assert len(torchrun_calls) == calls


def test_a_run_that_crashes_after_a_checkpoint_is_resumed_from_it_once(tmp_path, monkeypatch):
    """A study's run whose rank crashed (torchrun's exit status 1) goes on from its checkpoint with --resume, once;
    a run that failed before any checkpoint, or fails again, stops the study in one line (it was a traceback of the
    subprocess call), below the run's own error."""
    import shutil

    run, calls, statuses, checkpointed = tmp_path / "run", [], [], []

    def fake_run(cmd, check=False, **kwargs):  # a fresh start that fails writes a checkpoint first if asked
        calls.append(cmd)
        status = statuses.pop(0)
        if "--output-dir" in cmd and checkpointed:
            _plant_run(run, ["--seed", "1", "--max-steps", "15"], 10, token=cmd[-1], checkpoint=True)
        if check and status:
            raise subprocess.CalledProcessError(status, cmd)
        return subprocess.CompletedProcess(cmd, status)

    monkeypatch.setattr(subprocess, "run", fake_run)
    statuses[:] = [1]
    with pytest.raises(SystemExit) as stop:  # no checkpoint: it never started, so no resume; one line, no traceback
        experiments._train_run(run, 10 + 5, ["--seed", "1"])
    assert str(stop.value) == (f"[run] {run} failed before its first checkpoint (exit status 1): its error is printed "
                               "above; the runs made so far are kept, and the same command goes on from them")
    assert len(calls) == 1
    checkpointed.append(True)
    calls.clear()
    statuses[:] = [1, 0]
    experiments._train_run(run, 15, ["--seed", "1"])
    assert calls[1][-4:] == ["--resume", str(run), "--max-steps", "15"] and "--overwrite" not in calls[1]
    shutil.rmtree(run)
    calls.clear()
    statuses[:] = [1, 1]  # the resumed run fails too: the study stops there
    with pytest.raises(SystemExit, match=r"failed again as it resumed \(exit status 1\): its error is printed above"):
        experiments._train_run(run, 15, ["--seed", "1"])
    assert len(calls) == 2


def test_staleness_runs_every_k_on_every_seed_and_reports_mean_and_range(tmp_path, monkeypatch):
    """tools/experiments.py staleness on fake runs (the plumbing; the real runs are in docs/results.md): one run per k
    and seed, the table's pass rates as mean (range) over the seeds, one figure."""
    asked = []

    def fake_run(run_dir, steps, flags):
        asked.append((run_dir.name, flags))
        k, seed = int(run_dir.name[1:].split("-s")[0]), int(flags[flags.index("--seed") + 1])
        rows = _sigmoid_run(0.95 - 0.05 * k, seed)
        for row in rows[1:]:
            row["lag_hist"] = {str(k): 100}
        return rows

    monkeypatch.setattr(experiments, "_train_run", fake_run)
    args = argparse.Namespace(ks="0,2", seeds="0,1", steps=50, learner_slowdown=2.0, out_dir=str(tmp_path), figure=None,
                              eval_every=5)
    result = experiments.experiment_staleness(args)
    assert [name for name, _ in asked] == ["k0-s0", "k0-s1", "k2-s0", "k2-s1"]
    assert "--buffer-steps" in asked[2][1] and "--mode" in asked[0][1]
    table = (tmp_path / "staleness.md").read_text()
    finals = [rep["val_final"] for rep in result["runs"][2]]
    assert f"{sum(finals) / 2:.3f} ({min(finals):.3f}..{max(finals):.3f})" in table
    assert "| 2 | 2.00 (2.00..2.00) (2) |" in table and (tmp_path / "staleness.png").stat().st_size > 0


def _sigmoid_run(A: float, seed: int, steps: int = 50) -> list[dict]:
    """The metrics rows of a fake run: evaluations every 5 steps on ScaleRL's sigmoid plus noise of 0.01."""
    rng = np.random.default_rng(seed)
    compute = [1e-7 * (1 + seed % 3)] + [0.004 * step * (1 + 0.05 * (seed % 3)) for step in range(5, steps + 1, 5)]
    values = sf.sigmoid(np.array(compute), A=A, B=2.0, C_mid=0.02, R0=0.4)
    values[1:] = np.clip(values[1:] + rng.normal(0, 0.01, len(values) - 1), 0, 1)
    return [{"step": 5 * i, "compute_hours": c, "val_pass_rate": float(v)} for i, (c, v) in
            enumerate(zip(compute, values))]


def test_study_pools_the_seeds_and_tells_apart_asymptotes_whose_intervals_do_not_overlap(tmp_path, monkeypatch,
                                                                                        capsys):
    ran = []

    def fake_train_run(run_dir, steps, flags):  # the DAPO variant tops out at 0.6, the others at 0.9
        ran.append(run_dir.name)
        seed = int(flags[flags.index("--seed") + 1]) + (10 if "keep" in flags else 0)  # keep: other noise
        return _sigmoid_run(0.6 if "dapo" in flags else 0.9, seed, steps)

    monkeypatch.setattr(experiments, "_train_run", fake_train_run)
    summary_path = tmp_path / "docs" / "study.json"
    summary_path.parent.mkdir()
    assert experiments.main(["study", "--variants", "scalerl,dapo,keep", "--seeds", "0,1,2", "--bootstrap", "100",
                       "--out-dir", str(tmp_path / "study"), "--summary", str(summary_path), "--ceiling", "0.9",
                       "--figure", str(tmp_path / "docs" / "study.png")]) == 0
    assert ran == [f"{v}-s{s}" for v in ("scalerl", "dapo", "keep") for s in (0, 1, 2)]
    summary = json.loads(summary_path.read_text())
    assert summary == json.loads((tmp_path / "study" / "study.json").read_text())
    by_name = {v["name"]: v for v in summary["variants"]}
    for name, true_a in (("scalerl", 0.9), ("dapo", 0.6), ("keep", 0.9)):
        v = by_name[name]
        assert v["seeds"] == [0, 1, 2] and v["n_points"] == 1 + 3 * 10  # R0, then 10 evaluations per seed
        assert v["A_lo"] <= v["A"] <= v["A_hi"] and abs(v["A"] - true_a) < 0.02
        assert v["B_lo"] <= v["B"] <= v["B_hi"] and v["R0"] == pytest.approx(0.4, abs=1e-6)
        assert set(v["half_fit_errors"]) == {"0", "1", "2"}
        assert all(abs(e) < 0.05 for e in v["half_fit_errors"].values())
        assert set(v["half_fit_errors_vs_fit"]) == {"0", "1", "2"} and len(v["eval_sd_second_half"]) == 3
    assert by_name["dapo"]["A_hi"] < by_name["scalerl"]["A_lo"] and by_name["dapo"]["against_baseline"] == "lower"
    assert by_name["keep"]["against_baseline"] == "not separable"  # the same curve: the intervals overlap
    # B compared as ScaleRL does, with A fixed at the mean A of the runs whose A is alike: scalerl's and keep's
    assert summary["shared_A"] == pytest.approx((by_name["scalerl"]["A"] + by_name["keep"]["A"]) / 2, abs=1e-3)
    assert by_name["keep"]["B_at_shared_A_lo"] <= 2.0 <= by_name["keep"]["B_at_shared_A_hi"]  # the true B
    assert by_name["keep"]["C_mid_at_shared_A_lo"] <= 0.02 <= by_name["keep"]["C_mid_at_shared_A_hi"]
    assert by_name["keep"]["B_C_mid_against_baseline"] == "not separable, not separable"
    assert by_name["dapo"]["B_C_mid_against_baseline"] == "A differs" and by_name["dapo"]["B_at_shared_A"] is None
    assert summary["runs"] == 9 and abs(summary["worst_half_fit_error"]) < 0.05
    assert summary["worst_half_fit_error_vs_fit"] in [e for v in summary["variants"]
                                                      for e in v["half_fit_errors_vs_fit"].values()]
    table = (tmp_path / "study" / "study.md").read_text()
    assert "| DAPO loss instead of CISPO (dapo) |" in table and "| lower |" in table
    assert (tmp_path / "study" / "study.png").stat().st_size > 0 and (tmp_path / "docs" / "study.png").exists()
    assert summary["ceiling"] == 0.9
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["benchmark"] == "study"


def test_a_study_continues_from_its_records_without_run_directories_and_cuts_them_at_fewer_steps(tmp_path,
                                                                                                 monkeypatch):
    """Records are what a study leaves for another machine: with the run directories gone, the same study runs
    nothing; a shorter study is the records cut at its steps; other flags under the same records are refused."""
    ran = []

    def fake_train_run(run_dir, steps, flags):
        ran.append((run_dir.name, steps))
        rows = _sigmoid_run(0.9, int(flags[flags.index("--seed") + 1]), steps)
        for row in rows:
            row["loss"], row["clip_frac"] = 1.0, 0.25  # the loss is not a record key, the clip fraction is
        return rows

    monkeypatch.setattr(experiments, "_train_run", fake_train_run)
    records = tmp_path / "records"
    study = ["study", "--variants", "scalerl,keep", "--seeds", "0,1", "--bootstrap", "20", "--records", str(records)]
    assert experiments.main([*study, "--steps", "50", "--out-dir", str(tmp_path / "a")]) == 0
    assert ran == [("scalerl-s0", 50), ("scalerl-s1", 50), ("keep-s0", 50), ("keep-s1", 50)]
    record = json.loads((records / "keep-s1.json").read_text())
    assert record["flags"] == ["--seed", "1", "--eval-every", "5", "--zero-variance", "keep"] and record["steps"] == 50
    assert record["args"] is None  # the fake run leaves no args.json
    assert record["rows"] == [{**row, "clip_frac": 0.25} for row in _sigmoid_run(0.9, 1, 50)]
    first = json.loads((tmp_path / "a" / "study.json").read_text())

    ran.clear()  # another machine: no run directories, the same records
    assert experiments.main([*study, "--steps", "50", "--out-dir", str(tmp_path / "b")]) == 0
    again = json.loads((tmp_path / "b" / "study.json").read_text())
    assert not ran and again["variants"] == first["variants"]

    assert experiments.main([*study, "--steps", "25", "--out-dir", str(tmp_path / "c")]) == 0  # a cut, not a run
    cut = {v["name"]: v for v in json.loads((tmp_path / "c" / "study.json").read_text())["variants"]}
    assert not ran and cut["scalerl"]["n_points"] == 1 + 2 * 5 and cut["scalerl"]["val_final"] == [
        experiments.cut_rows(_sigmoid_run(0.9, seed, 50), 25)[-1]["val_pass_rate"] for seed in (0, 1)]

    assert experiments.main([*study, "--steps", "60", "--out-dir", str(tmp_path / "d")]) == 0  # longer: run again
    assert ran == [("scalerl-s0", 60), ("scalerl-s1", 60), ("keep-s0", 60), ("keep-s1", 60)]
    assert json.loads((records / "scalerl-s0.json").read_text())["steps"] == 60
    with pytest.raises(SystemExit, match="scalerl-s0.json holds a run made with other flags than this experiment gives "
                       "it: --lr 0.0001, where the experiment gives 0.001: a study with other flags needs another "
                       "--out-dir and another --records"):
        experiments.main([*study, "--steps", "50", "--common", "--lr 1e-3", "--out-dir", str(tmp_path / "e")])
    # the common flags come after each variant's: the table says so, since they win where both name a flag
    assert experiments.main(["study", "--variants", "scalerl", "--seeds", "0", "--bootstrap", "0", "--steps", "20",
                             "--common", "--lr 1e-3", "--records", str(tmp_path / "other"),
                             "--out-dir", str(tmp_path / "e")]) == 0
    assert "every run also takes `--lr 1e-3` after its variant's flags" in (tmp_path / "e" / "study.md").read_text()


def test_a_study_on_flops_pools_runs_from_machines_of_other_speeds(tmp_path, monkeypatch):
    """Seed 2 ran on a machine twice as slow: its device-hours are doubled, its FLOPs are not. Pooled on
    compute_hours the three seeds disagree about where the midpoint is; on flops they agree."""
    def fake_train_run(run_dir, steps, flags):
        seed = int(flags[flags.index("--seed") + 1])
        rng = np.random.default_rng(seed)
        rows = []
        for step in range(0, steps + 1, 5):
            flops = 1e12 * step
            noise = rng.normal(0, 0.005) if step else 0.0
            value = float(sf.sigmoid(flops + 1e-3, A=0.8, B=2.0, C_mid=8e12, R0=0.3)) + noise
            rows.append({"step": step, "flops": flops, "val_pass_rate": value,
                         "compute_hours": 0.004 * step * (2.0 if seed == 2 else 1.0) + 1e-7})
        return rows

    monkeypatch.setattr(experiments, "_train_run", fake_train_run)
    fits = {}
    for axis in ("compute_hours", "flops"):
        out = tmp_path / axis
        experiments.main(["study", "--variants", "scalerl", "--seeds", "0,1,2", "--steps", "50", "--bootstrap", "20",
                    "--compute-axis", axis, "--out-dir", str(out)])
        summary = json.loads((out / "study.json").read_text())
        assert summary["compute_axis"] == axis
        fits[axis] = summary["variants"][0]
        assert f"C_mid ({experiments.COMPUTE_AXES[axis]})" in (out / "study.md").read_text()
    assert fits["flops"]["r2"] > 0.98 > fits["compute_hours"]["r2"]
    assert fits["flops"]["C_mid"] == pytest.approx(8e12, rel=0.1) and fits["flops"]["A"] == pytest.approx(0.8, abs=0.01)
    assert fits["flops"]["compute_hours"] == fits["compute_hours"]["compute_hours"]  # still reported in device-hours


def test_cut_rows_stops_a_run_at_an_evaluated_step_only():
    rows = _sigmoid_run(0.9, 0, 50)  # evaluations every 5 steps
    assert experiments.cut_rows(rows, 20) == rows[:5] and experiments.cut_rows(rows, 50) == rows
    with pytest.raises(ValueError, match="no evaluation at step 22; cut it at one of its evaluated steps"):
        experiments.cut_rows(rows, 22)
    with pytest.raises(ValueError, match="no evaluation at step 55"):
        experiments.cut_rows(rows, 55)


def test_report_reads_records_and_reports_a_run_at_several_lengths(tmp_path, capsys):
    rows = _sigmoid_run(0.9, 0, 50)
    (tmp_path / "run.json").write_text(json.dumps({"flags": [], "steps": 50, "rows": rows}))
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (run_dir / "args.json").write_text(json.dumps({"seed": 0, "max_steps": 50}))
    result = experiments.main(["report", str(tmp_path / "run.json"), str(run_dir), "--at-steps", "30,50",
                         "--fit-from-step", "10", "--save-records", str(tmp_path / "saved")])
    assert result == 0
    saved = json.loads((tmp_path / "saved" / "run.json").read_text())  # the run directory's, not the record's
    assert saved["rows"] == rows and saved["args"] == {"seed": 0, "max_steps": 50} and saved["steps"] == 50
    assert [p.name for p in (tmp_path / "saved").iterdir()] == ["run.json"]
    out = capsys.readouterr().out
    runs = json.loads(out.strip().splitlines()[-1])["runs"]
    assert list(runs) == [f"{tmp_path / 'run.json'} @ 30", str(tmp_path / "run.json"), f"{run_dir} @ 30", str(run_dir)]
    assert runs[str(run_dir)] == runs[str(tmp_path / "run.json")]  # a record reports as its run directory does
    assert runs[str(run_dir) + " @ 30"]["steps"] == 30 and runs[str(run_dir)]["min_compute"] == rows[2]["compute_hours"]
    assert "| predicted - full fit's end |" in out
    assert f"| {runs[str(run_dir)]['half_fit_error_vs_fit']:+.3f} |" in out


def test_a_study_names_unknown_variants(tmp_path, capsys):
    with pytest.raises(SystemExit) as stop:  # refused as the flags are parsed, before any run
        experiments.main(["study", "--variants", "scalerl,cispoo", "--out-dir", str(tmp_path)])
    assert stop.value.code == 2 and "argument --variants: unknown variants ['cispoo']" in capsys.readouterr().err


@pytest.mark.parametrize("common, why", [
    ("--lossarg x", "'--lossarg x': train.py: unrecognized arguments: --lossarg x"),
    ("--lr abc", "'--lr abc': train.py: argument --lr: expected a number, got 'abc'"),
    ("--seed 3", "'--seed 3': --seed: the study gives each run its own (--seeds, --out-dir, --steps)"),
    ("--output-dir x --max-steps 9", "'--output-dir x --max-steps 9': --output-dir, --max-steps: the study gives each "
                                     "run its own (--seeds, --out-dir, --steps)"),
    ("'unclosed", "\"'unclosed\": No closing quotation")])
def test_a_studys_common_flags_are_train_pys_and_not_its_own(tmp_path, capsys, monkeypatch, common, why):
    """--common with a flag train.py does not know, or a value it refuses, failed every run of the study, each after
    its torchrun had started (a traceback of the study's after the first); one that the study gives each run itself
    (--seed: one seed for all would pool one run as three; the run's directory or steps) overrode it. Each is now one
    line as the study's flags are parsed, before any run."""
    monkeypatch.setattr(experiments, "_train_run", lambda *a: pytest.fail("a run started"))
    with pytest.raises(SystemExit) as stop:
        experiments.main(["study", "--variants", "scalerl", "--seeds", "0", "--common", common,
                          "--out-dir", str(tmp_path)])
    assert stop.value.code == 2
    err = capsys.readouterr().err  # the program's name is pytest's here
    assert err.endswith(f" study: error: argument --common: {why} (see --help)\n") and err.count("\n") == 1, err


def test_compare_intervals_needs_intervals_that_do_not_overlap():
    base = {"A": 0.9, "A_lo": 0.88, "A_hi": 0.92}
    assert experiments.compare_intervals({"A": 0.95, "A_lo": 0.93, "A_hi": 0.97}, base) == "higher"
    assert experiments.compare_intervals({"A": 0.8, "A_lo": 0.7, "A_hi": 0.87}, base) == "lower"
    assert experiments.compare_intervals({"A": 0.86, "A_lo": 0.80, "A_hi": 0.88}, base) == "not separable"  # touching
    assert experiments.compare_intervals({"A": None}, base) == "no fit"


def _results_section(heading: str) -> str:
    return (REPO / "docs" / "results.md").read_text().split(f"## {heading}")[1].split("\n## ")[0]


@pytest.mark.parametrize("summary_file, heading", [("study.json", "A miniature ScaleRL study"),
                                                   ("real-study.json", "ScaleRL's loss comparison on a real model")])
def test_the_results_page_quotes_the_committed_study_as_it_is(summary_file, heading):
    """docs/study.json and docs/real-study.json are the studies' summaries (issue 14's fields, at least 3 seeds a
    variant); each study's section of docs/results.md must quote its summary: each variant's A interval and per-seed
    first-half errors, the worst error, the steps."""
    summary = json.loads((REPO / "docs" / summary_file).read_text())
    section = _results_section(heading)
    rows = [line for line in section.splitlines() if line.startswith("| ")]
    for variant in summary["variants"]:
        assert {"name", "seeds", "A", "A_lo", "A_hi", "B", "C_mid", "half_fit_errors"} <= set(variant)
        assert len(variant["seeds"]) >= 3 and set(variant["half_fit_errors"]) == {str(s) for s in variant["seeds"]}
        row = next(line for line in rows if f"({variant['name']})" in line)
        assert f"{variant['A']:.3f} [{variant['A_lo']:.3f}, {variant['A_hi']:.3f}]" in row, variant["name"]
        errors = ("no fit" if e is None else f"{e:+.3f}" for e in variant["half_fit_errors"].values())
        assert ", ".join(errors) in row, variant["name"]  # None: too few evaluations in the first half to fit
    assert f"--steps {summary['steps']}" in section
    assert f"{summary['worst_half_fit_error']:+.3f}" in section


@pytest.mark.parametrize("summary_file, heading, runs", [  # the miniature study's 19 pooled fits take 20-30 s
    pytest.param("study.json", "A miniature ScaleRL study", 30, marks=pytest.mark.slow),
    ("real-study.json", "ScaleRL's loss comparison on a real model", 9)])
def test_a_study_is_refitted_from_its_committed_records_by_its_documented_command(tmp_path, monkeypatch,
                                                                                  summary_file, heading, runs):
    """The command beside each study in docs/results.md, on the committed records (docs/study-runs,
    docs/real-study-runs), trains nothing and gives the committed summary: the figure and the table can be redrawn
    without the runs, as the page says."""
    block = next(part.split("```")[0] for part in _results_section(heading).split("```bash\n")[1:]
                 if "python -m tools.experiments study" in part.split("```")[0] and "--records" in part.split("```")[0])
    command = next(line for line in block.replace("\\\n", " ").splitlines()
                   if line.startswith("python -m tools.experiments study"))
    argv = shlex.split(command)[3:]
    for flag, name in (("--out-dir", "out"), ("--summary", "study.json"), ("--figure", "study.png")):
        if flag in argv:
            argv[argv.index(flag) + 1] = str(tmp_path / name)
        else:  # the study's default, under the checkout: here, the test's own directory
            argv += [flag, str(tmp_path / name)]

    def no_training(run_dir, steps, flags):
        raise AssertionError(f"{run_dir} was trained: its record is missing or holds other flags")

    monkeypatch.setattr(experiments, "_train_run", no_training)
    monkeypatch.chdir(REPO)  # the records and --model are named relative to the checkout, as the docs run them
    assert experiments.main(argv) == 0
    committed = json.loads((REPO / "docs" / summary_file).read_text())
    again = json.loads((tmp_path / "study.json").read_text())
    assert again["runs"] == committed["runs"] == runs and again["records"] == committed["records"]
    for ours, theirs in zip(again["variants"], committed["variants"], strict=True):
        assert ours["name"] == theirs["name"] and ours["val_final"] == theirs["val_final"]
        for key in ("A", "A_lo", "A_hi", "B", "B_lo", "B_hi", "C_mid", "r2"):  # a fit on another CPU: its last bits
            assert ours[key] == pytest.approx(theirs[key], rel=1e-3), (ours["name"], key)
    assert (tmp_path / "study.png").stat().st_size > 0


def test_the_run_length_table_is_what_the_committed_records_give():
    """The run-length table of docs/results.md (each 300-step run cut at 100..300 steps) must be what
    `python -m tools.experiments report` gives on the committed records in docs/run-length: each cell, predicted -
    last evaluation (predicted - full fit's end)."""
    repo = Path(__file__).resolve().parent.parent
    section = (repo / "docs" / "results.md").read_text().split("### How long a run must be")[1].split("\n## ")[0]
    records = sorted((repo / "docs" / "run-length").glob("*.json"))
    assert len(records) >= 4
    lengths = [100, 150, 200, 250, 300]
    for record in records:
        rows = sf.read_metrics(record)
        assert rows[-1]["step"] == 300
        line = next(line for line in section.splitlines() if line.startswith(f"| {record.stem} |"))
        for steps in lengths:
            rep = experiments.run_report(experiments.cut_rows(rows, steps), fit_from_step=10)
            cell = f"{rep['half_fit_error']:+.3f}" + ("**" if abs(rep["half_fit_error"]) > 0.05 else "") + \
                f" ({rep['half_fit_error_vs_fit']:+.3f})"
            assert cell in line, (record.stem, steps, cell)


def test_the_default_runs_table_is_what_the_committed_records_give():
    """The table of the two default runs on a third CPU kind (docs/results.md) must be what
    `python -m tools.experiments report` gives on their committed records (docs/default-runs), cell for cell."""
    section = _results_section("200 steps, an evaluation every 5")
    for seed in (0, 1):
        rows = sf.read_metrics(REPO / "docs" / "default-runs" / f"default-s{seed}.json")
        rep = experiments.run_report(rows)
        at = [experiments.run_report(experiments.cut_rows(rows, steps))["val_final"] for steps in (100, 150)]
        cells = [f"{rep['val_first']:.3f} -> {rep['val_final']:.3f} ({rep['val_best']:.3f})",
                 f"{at[0]:.3f}, {at[1]:.3f}", f"{rep['largest_fall_after_0.8']:.3f}",
                 f"{rep['lag_mean']:.2f} ({rep['lag_max']})", f"{rep['fit']['A']:.3f}, {rep['fit']['r2']:.3f}",
                 f"{rep['half_fit_error']:+.3f}", f"{rep['wall_s']:.0f} s"]
        assert f"| seed {seed} | " + " | ".join(cells) + " |" in section.splitlines(), (seed, cells)


@pytest.mark.parametrize("what, said", [
    ("missing", "no metrics file at {run}"),
    ("empty.jsonl", "{run}: no metrics rows: a run that never logged a step"),
    ("no-record.json", "{run}: a .json file is read as a run's record"),
    ("cut", "{run}: this run has no evaluation at step 101; cut it at one of its evaluated steps [0, 5, 10]"),
    ("twice", "{run} and ./docs/default-runs/default-s0.json are one run: give each run once"),
])
def test_report_says_what_is_wrong_with_a_run_in_one_line(tmp_path, what, said):
    """A run that is not there, one that logged nothing, a .json that is no record, a cut at a step the run never
    evaluated: `report` ends on one line naming the run (before, each was a traceback). One run given twice (under
    two spellings) would weigh twice in the mean and range over the runs: also one line."""
    run = tmp_path / what
    if what in ("cut", "twice"):
        run = REPO / "docs" / "default-runs" / "default-s0.json"
    elif what != "missing":
        run.write_text('{"step": 0}\n' if what.endswith(".json") else "")
    argv = ["-m", "tools.experiments", "report", str(run)] + (["--at-steps", "101"] if what == "cut" else []) \
        + (["./docs/default-runs/default-s0.json"] if what == "twice" else [])
    result = subprocess.run([sys.executable, *argv], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 1 and result.stdout == "", result
    assert result.stderr.startswith(said.format(run=run)) and len(result.stderr.splitlines()) == 1, result.stderr


def test_help_lists_every_experiment_and_each_has_its_own():
    """`python -m tools.experiments --help` and each experiment's --help print."""
    top = subprocess.run([sys.executable, "-m", "tools.experiments", "--help"], cwd=REPO, capture_output=True,
                         text=True)
    assert top.returncode == 0, top.stderr
    for name in experiments.EXPERIMENTS:
        assert name in top.stdout
        own = subprocess.run([sys.executable, "-m", "tools.experiments", name, "--help"], cwd=REPO,
                             capture_output=True, text=True)
        assert own.returncode == 0 and f"python -m tools.experiments {name}" in own.stdout, own.stderr


def test_study_progress_names_the_run_and_the_time_left_from_the_runs_made_here():
    """Before each run: its place among all, and the time left from the mean of the runs trained in this invocation
    (a run read from its record costs nothing and does not count); before any is trained, it says so."""
    now = [0.0]
    progress = experiments.StudyProgress(4, clock=lambda: now[0])
    assert progress.next("cispo, seed 0", recorded=True) == "[study] run 1 of 4: cispo, seed 0; read from its record"
    assert progress.next("cispo, seed 1") == ("[study] run 2 of 4: cispo, seed 1; the time left is known once a run "
                                              "has been made here")
    now[0] += 1500.0  # 25 minutes
    progress.done()
    assert progress.next("dapo, seed 0").endswith("about 0 h 50 min left if each run still to make takes what the 1 "
                                                  "made here took")  # runs 3 and 4 are still to make
    now[0] += 2100.0  # 35 minutes: the mean is 30
    progress.done()
    assert progress.next("dapo, seed 1") == ("[study] run 4 of 4: dapo, seed 1; about 0 h 30 min left if each run "
                                             "still to make takes what the 2 made here took")


@pytest.fixture(autouse=True)
def _fake_runs_reruns_stay_out_of_the_session_summary(request, tmp_path, monkeypatch):
    """A fast test here fakes torchrun (subprocess.run): a resume it makes after a faked failure is counted in a file
    of its own, not among the session's reruns after a native crash (tests/conftest.py). Slow tests run real studies,
    whose resumes are counted there."""
    if request.node.get_closest_marker("slow") is None:
        monkeypatch.setenv("SCALERL_RERUN_LOG", str(tmp_path / "faked-reruns.jsonl"))


def test_a_resume_after_a_failure_is_counted_among_the_sessions_reruns(tmp_path, monkeypatch):
    """A study's run that fails after its first checkpoint and is resumed from it: counted where the test session
    counts its reruns (SCALERL_RERUN_LOG), so CI's log shows it as it shows a test's rerun after a native crash."""
    run, calls = tmp_path / "run", []

    def fake_run(cmd, check=False, **kwargs):  # the fresh start writes a checkpoint and a row, then a rank crashes
        calls.append(cmd)
        if len(calls) == 1:
            (run / "checkpoint").mkdir(parents=True)
            (run / "checkpoint" / "trainer_state.json").write_text("{}")
            (run / "metrics.jsonl").write_text(json.dumps({"step": 1, "compute_hours": 0.1}) + "\n")
        return subprocess.CompletedProcess(cmd, 1 if len(calls) == 1 else 0)

    monkeypatch.setattr(subprocess, "run", fake_run)
    experiments._train_run(run, 5, ["--seed", "1"])
    assert len(calls) == 2 and "--resume" in calls[1]
    recorded = [json.loads(line) for line in (tmp_path / "faked-reruns.jsonl").read_text().splitlines()]
    assert recorded == [{"what": f"study run {run}", "why": "it exited 1 after a checkpoint and was resumed from it",
                         "story": ""}]


def _documented_experiment_commands() -> list[tuple[str, list[str]]]:
    """Each `python -m tools.experiments study|staleness` command in a code block of the docs: (page, its argv)."""
    found = []
    for page in sorted((REPO / "docs").glob("*.md")):
        for block in page.read_text().split("```")[1::2]:
            for line in block.replace("\\\n", " ").splitlines():
                if line.startswith(("python -m tools.experiments study", "python -m tools.experiments staleness")):
                    found.append((page.name, shlex.split(line, comments=True)[3:]))
    return found


def _runs_of(argv: list[str]) -> list[tuple[str, int, list[str]]]:
    """(run name, steps, train.py flags) of each run a documented experiment command gives, as it gives them; nothing
    runs."""
    args = experiments.build_parser().parse_args(argv)
    seeds = [int(x) for x in args.seeds.split(",")]
    if argv[0] == "staleness":
        return [(f"k{k}-s{seed}", args.steps, experiments.staleness_run_flags(int(k), seed, args))
                for k in args.ks.split(",") for seed in seeds]
    names = experiments.VARIANT_SETS.get(args.variants, args.variants).split(",")
    return [(f"{name}-s{seed}", args.steps, experiments.study_run_flags(name, seed, args)) for name in names
            for seed in seeds]


@pytest.mark.parametrize("page, argv", _documented_experiment_commands(),
                         ids=lambda v: " ".join(v[:3]) if isinstance(v, list) else v)
def test_each_documented_study_gives_its_runs_the_documented_runs_flags(page, argv, monkeypatch):
    """train.py's default went from 200 steps evaluated every 5 to 150 every 10 (make run's). The studies built their
    runs' flags on the defaults, so a 50-step run got 6 evaluations instead of 11 and no documented command made its
    documented runs again. Each study now gives its runs their cadence in their own flags: a command whose runs are
    committed as records gives each run exactly the flags its record's args.json holds (the defaults of its day
    resolved); the others (the staleness experiment, the leave-one-out table) give the documented 50 steps, every 5."""
    monkeypatch.chdir(REPO)  # records and --model are named relative to the checkout, as the docs run them
    records = argv[argv.index("--records") + 1] if "--records" in argv else None
    runs = _runs_of(argv)
    assert runs
    for name, steps, run_flags in runs:
        if records:
            record = json.loads((REPO / records / f"{name}.json").read_text())
            assert experiments.flag_differences(flags.upgraded_args(record["args"]), run_flags) == [], name
            assert steps == record["args"]["max_steps"] == record["steps"], name
        else:
            assert experiments.parsed_flags(run_flags)["eval_every"] == 5 and steps == 50, (page, name)


def test_the_committed_study_records_are_read_by_their_documented_command_and_cut_at_its_steps(monkeypatch):
    """The records of docs/study-runs and docs/real-study-runs were made under the old defaults (every 5) or with
    their own cadence: each is read by the flags its documented command gives it (compared with the run's args.json
    that the record keeps, not with its flags read under today's defaults), so the command refits without training."""
    monkeypatch.chdir(REPO)
    commands = [argv for _, argv in _documented_experiment_commands() if "--records" in argv]
    assert len(commands) >= 2
    for argv in commands:
        records = REPO / argv[argv.index("--records") + 1]
        for name, steps, run_flags in _runs_of(argv):
            rows = experiments._read_record(records / f"{name}.json", steps, run_flags)
            assert rows is not None and rows[-1]["step"] == steps, name
            evaluated = [row["step"] for row in rows if "val_pass_rate" in row]
            cadence = experiments.parsed_flags(run_flags)["eval_every"]
            assert evaluated[:3] == [0, cadence, 2 * cadence], name


def test_a_run_made_with_the_old_defaults_is_reused_when_the_study_pins_them_and_refused_otherwise(tmp_path):
    """A run directory is reused only if its args.json holds the flags the study gives it. A run of the 250-step study
    (its args.json as the record keeps it: made every 5 steps under the old default, its --debug-gen-slowdown still a
    number) is finished for the study's command now that it pins --eval-every 5; a run made every 10, today's default,
    is refused, naming the flag."""
    record = json.loads((REPO / "docs" / "study-runs" / "scalerl-s0.json").read_text())
    assert record["args"]["eval_every"] == 5 and isinstance(record["args"]["debug_gen_slowdown"], float)
    argv = next(argv for _, argv in _documented_experiment_commands() if "docs/study-runs" in argv)
    name, steps, run_flags = next(run for run in _runs_of(argv) if run[0] == "scalerl-s0")
    run_dir = tmp_path / name
    run_dir.mkdir()
    (run_dir / "args.json").write_text(json.dumps(record["args"]))
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in record["rows"]))
    action, rows = experiments._run_at(run_dir, tmp_path / f"{name}.command.json", steps, run_flags)
    assert action == "finished" and rows[-1]["step"] == steps == 250
    (run_dir / "args.json").write_text(json.dumps({**record["args"], "eval_every": 10}))
    with pytest.raises(SystemExit, match=f"{run_dir} holds a run made with other flags than this experiment gives it: "
                                         r"--eval-every 10, where the experiment gives 5; nothing was run or deleted"):
        experiments._run_at(run_dir, tmp_path / f"{name}.command.json", steps, run_flags)
