"""Experiments made of real train.py runs, each a subcommand; each prints what its runs show and ends with one line
holding a JSON object of the results (the LAST line printed).

    python -m tools.experiments staleness  # the tiny recipe at k = 0, 1, 2, 4, 8 with a fast generator
    python -m tools.experiments study      # ScaleRL's ablations in miniature: variants x seeds, A, B with 95% CIs
    python -m tools.experiments report RUN_DIR...   # what finished runs (or study records) show: pass rate, lag, fits

A run is train.py under torchrun (`_train_run`): a finished run is never run again, and an unfinished one that the
experiment started (its start token in its args.json) goes on from its last checkpoint, so a killed experiment
continues where it stopped. A run directory is used only if its args.json holds the flags the experiment gives it;
any other is refused in one line naming the flags that differ, never deleted. The benchmarks that time one run's
parts are tools/bench.py's.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import math
import os
import secrets
import shlex
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, Iterable

from harness.cli import exit_with  # a closed stdout (`| head`) ends the command quietly
from harness.cli import run_subcommand, subcommand_parser  # one subcommand per experiment, one error line for a bad flag
from harness.cli import int_at_least as _count  # the argparse type of a count (`none`: or the word none)
from harness.cli import int_list as _int_list, number as _number  # argparse types of a list of integers, a number
from harness.cli import directory_path, output_file  # argparse types of a directory and a file written into
from harness.cli import figure_path, path_text  # argparse types of a figure's file and a path (~: the home directory)
from harness.cli import repeated  # what a list gives twice: one run counted twice


def _count_rerun(run_dir: Path, exit_status: int) -> None:
    """Count a resume after a failure where the test suite counts its reruns (SCALERL_RERUN_LOG, set by
    tests/conftest.py; unset, nothing is written): CI's log ends with each, so no crash a resume hides goes unseen.
    The crashed rank's stack is in the study's stderr, above its '[run] ... failed' line."""
    import os

    log = os.environ.get("SCALERL_RERUN_LOG")
    if log:
        with open(log, "a", encoding="utf-8") as f:
            f.write(json.dumps({"what": f"study run {run_dir}", "why": f"it exited {exit_status} after a checkpoint "
                                f"and was resumed from it", "story": ""}) + "\n")


def _train_run(run_dir, steps: int, flags: list[str], nproc: int = 2) -> list[dict]:
    """Run train.py under torchrun into `run_dir` with `flags` for `steps` steps, unless a finished run made with
    these flags is there already (so a killed experiment continues where it stopped and never reruns a finished
    run); its metrics rows. What `run_dir` holds is checked first (`_run_at`): a run whose args.json holds other
    flags is refused in one line naming them, never reused, resumed or deleted; an unfinished run is resumed from
    its checkpoint, or started over, only if it holds the start token of RUN_DIR.command.json (train.py
    --start-token), which says that this experiment started it. A run that fails after its first checkpoint is
    resumed from it once: a rank of FSDP2 over gloo has crashed in native code (SIGSEGV) once in many hours of
    runs, and a resumed run loses and repeats no step (in sync mode it is the same run)."""
    import subprocess

    import scaling_fit as sf
    from harness.checkpoints import complete_checkpoints

    run_dir = Path(run_dir)
    command_file = run_dir.with_name(run_dir.name + ".command.json")
    action, value = _run_at(run_dir, command_file, steps, flags)
    if action == "finished":
        return value
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
                "train.py"]
    repo = Path(__file__).resolve().parent.parent
    if action == "resume":
        print(f"[run] {run_dir}: resuming it from its checkpoint (this experiment started it with these flags)",
              flush=True)
        if status := subprocess.run([*torchrun, "--resume", str(run_dir), "--max-steps", str(value)],
                                    cwd=repo).returncode:
            _stop(run_dir, status, "failed as it resumed")
        return sf.read_metrics(run_dir)
    token, own_unfinished = value
    cmd = [*torchrun, "--output-dir", str(run_dir), *(["--overwrite"] if own_unfinished else []),
           "--max-steps", str(steps), *flags, "--start-token", token]
    print(f"[run] torchrun ... {' '.join(cmd[6:])}", flush=True)
    _write_text(command_file, json.dumps({"token": token, "steps": steps, "flags": flags}) + "\n")
    failed = subprocess.run(cmd, cwd=repo).returncode
    if failed:
        if not complete_checkpoints(run_dir):  # it failed before its first checkpoint: a real error
            _stop(run_dir, failed, "failed before its first checkpoint")
        _count_rerun(run_dir, failed)
        print(f"[run] {run_dir} failed (exit status {failed}): resuming it from its checkpoint, once", flush=True)
        if status := subprocess.run([*torchrun, "--resume", str(run_dir), "--max-steps", str(steps)],
                                    cwd=repo).returncode:
            _stop(run_dir, status, "failed again as it resumed")
    return sf.read_metrics(run_dir)


def _stop(run_dir: Path, status: int, what: str) -> None:
    """Stop the experiment in one line where a run failed (train.py's own error is above it), rather than in a
    traceback of the subprocess call: what it made so far is kept, and the same command goes on from there."""
    raise SystemExit(f"[run] {run_dir} {what} (exit status {status}): its error is printed above; the runs made so "
                     "far are kept, and the same command goes on from them")


def _run_at(run_dir: Path, command_file: Path, steps: int, flags: list[str]) -> tuple[str, object]:
    """What _train_run does with `run_dir`: ("finished", its rows), ("resume", the --max-steps to resume it with)
    or ("start", (its start token, whether it starts over an unfinished run of its own, with --overwrite)). A run
    whose args.json differs from `flags` in any flag, as train.py parses them, is refused; so is an unfinished run
    (or a run's files without args.json) that does not hold the command file's token: this experiment did not
    start it, and deletes nothing it did not create. Each refusal is one line (SystemExit) naming the run."""
    import scaling_fit as sf
    from harness import flags as train_flags
    from harness.checkpoints import LinkRefusedError, complete_checkpoints, read_no_follow

    token = None
    try:
        if os.path.lexists(command_file):  # read without following a link: a planted one is refused by name
            token = json.loads(read_no_follow(command_file).decode()).get("token")
    except LinkRefusedError as e:
        raise SystemExit(str(e)) from None
    except (ValueError, AttributeError):  # cut short by a kill, or not this experiment's: no token
        pass
    refused = "nothing was run or deleted"
    if not os.path.lexists(run_dir / "args.json"):
        held = train_flags.run_files(run_dir)
        if held:
            raise SystemExit(f"{run_dir} holds {', '.join(held)} but no args.json, so not a run this experiment "
                             f"started: {refused}; move it away, or give the experiment another --out-dir")
        return "start", (token or secrets.token_hex(8), False)
    try:
        saved = train_flags.read_args_json(run_dir)
    except ValueError as e:
        raise SystemExit(f"{e} ({refused} by the experiment)") from None
    differences = flag_differences(saved, flags)
    if differences:
        raise SystemExit(f"{run_dir} holds a run made with other flags than this experiment gives it: "
                         f"{'; '.join(differences)}; {refused}: give the experiment another --out-dir (and another "
                         f"--records, if you give one), or move that run away")
    rows = sf.read_metrics(run_dir) if (run_dir / "metrics.jsonl").exists() else []
    if rows and rows[-1]["step"] >= steps and "val_pass_rate" in rows[-1]:
        return "finished", rows
    if token is None or saved.get("start_token") != token:
        raise SystemExit(f"{run_dir} holds an unfinished run that this experiment did not start (its args.json "
                         f"holds no start token of {command_file}): {refused}; finish it with train.py --resume "
                         f"{run_dir}, or move it away")
    if complete_checkpoints(run_dir):
        return "resume", max(steps, saved.get("max_steps", steps))
    return "start", (token, True)


# Where a run is and how long it goes, and who started it: not what it trains. flag_differences leaves them out (the
# study cuts a longer run at its steps, and resumes a shorter one of its own with a higher --max-steps).
BOOKKEEPING_FLAGS = ("output_dir", "resume", "overwrite", "max_steps", "start_token")


def parsed_flags(flags: list[str]) -> dict:
    """train.py's flags as it parses `flags`, each field of its Args, with the defaults it resolves as it starts on
    this machine (the optimiser's, the dtype): what its args.json would hold. A flag train.py does not know is its
    one error line."""
    import torch

    from harness import flags as train_flags

    args = train_flags.Args(**vars(train_flags.build_parser().parse_args(flags)))
    train_flags.resolve_defaults(args, args.model is None, torch.cuda.is_available())
    return dataclasses.asdict(args)


def flag_differences(saved: dict, flags: list[str]) -> list[str]:
    """Each flag, bookkeeping aside, in which a run's args.json `saved` differs from `flags` as train.py parses them
    (a field the run's args.json lacks holds its default): "--lr 1.0, where the experiment gives 0.0001"."""
    from harness import flags as train_flags

    wanted = parsed_flags(flags)
    defaults = {f.name: f.default for f in dataclasses.fields(train_flags.Args)}
    return [f"--{name.replace('_', '-')} {train_flags._shown(saved.get(name, defaults[name]))}, where the "
            f"experiment gives {train_flags._shown(value)}" for name, value in wanted.items()
            if name not in BOOKKEEPING_FLAGS and saved.get(name, defaults[name]) != value]


def _write_text(path, text: str) -> None:
    """`text` into `path` through the project's atomic write, which never follows a link: a link or a non-file
    there is refused in one line (SystemExit naming it), nothing written through it."""
    from harness.checkpoints import LinkRefusedError, write_atomically

    Path(path).parent.mkdir(parents=True, exist_ok=True)
    try:
        write_atomically(Path(path), text)
    except LinkRefusedError as e:
        raise SystemExit(str(e)) from None


# The compute axes a run can be fitted on. compute_hours is ScaleRL's (device-hours: wall time x learner ranks and
# generator), so it holds the idle time of a synchronous pipeline, and it depends on the machine's speed; flops
# (2N per generated token + 6N per trained token) does not, so runs made on machines of other speeds pool on it.
COMPUTE_AXES = {"compute_hours": "device-h", "flops": "FLOPs"}
# What run_report reads from a metrics row, the FLOPs (a compute axis that does not depend on the machine's
# speed, for records made on different machines), and what says how one variant's updates differed from another's
# (reward, clipping, the importance ratio, gradient-norm clipping, lengths, entropy): a run's record keeps these and
# nothing else.
RECORD_KEYS = ("step", "compute_hours", "flops", "val_pass_rate", "lag_hist", "stale_dropped", "step_s",
               "weight_sync_s", "reward", "clip_frac", "ratio_mean", "grad_clipped", "length_mean", "entropy")


def cut_rows(rows: list[dict], steps: int) -> list[dict]:
    """The rows of a run up to `steps`: what the same run stopped there would have logged (the learning rate is
    constant after its warm-up, so the first steps of a longer run are a shorter run). The cut must fall on an
    evaluated step, where a shorter run would have ended with its last evaluation."""
    kept = [row for row in rows if row["step"] <= steps]
    if not kept or kept[-1]["step"] != steps or "val_pass_rate" not in kept[-1]:
        evaluated = [row["step"] for row in rows if "val_pass_rate" in row]
        raise ValueError(f"this run has no evaluation at step {steps}; cut it at one of its evaluated steps "
                         f"{evaluated[:3]}..{evaluated[-3:]}")
    return kept


def _read_record(record_path, steps: int, flags: list[str]) -> list[dict] | None:
    """A study run's metrics rows cut at `steps`, from its record when one holds at least that many steps with the
    same flags; None when there is none yet or it holds fewer steps. A record is the run's rows with RECORD_KEYS
    only (about 40 kB for 200 steps), so a study's records can be committed, and the study refitted or continued
    where its run directories are gone."""
    from harness import flags as train_flags
    from harness.checkpoints import LinkRefusedError, read_no_follow

    record_path = Path(record_path)
    if not os.path.lexists(record_path):
        return None
    try:
        record = json.loads(read_no_follow(record_path).decode())
    except LinkRefusedError as e:
        raise SystemExit(str(e)) from None
    if record["flags"] is None:
        raise SystemExit(f"{record_path} holds the record of a run made outside a study, not one of this study's "
                         "runs: give the study another --out-dir and another --records")
    # What the run was: its args.json, which the record keeps (train.py's defaults of the day resolved in it), not its
    # flags read with today's defaults, which may have changed since (--eval-every did); a record without it, its flags.
    ran_with = train_flags.upgraded_args(record["args"]) if record.get("args") else parsed_flags(record["flags"])
    differences = flag_differences(ran_with, flags)
    if differences:
        raise SystemExit(f"{record_path} holds a run made with other flags than this experiment gives it: "
                         f"{'; '.join(differences)}: a study with other flags needs another --out-dir and another "
                         "--records")
    return cut_rows(record["rows"], steps) if record["steps"] >= steps else None


def _train_and_record(run_dir, record_path, steps: int, flags: list[str]) -> list[dict]:
    """A study run made now by train.py (`_train_run`): its rows cut at `steps`, its record written."""
    rows = _train_run(run_dir, steps, flags)
    write_record(record_path, rows, run_dir, flags)
    return cut_rows(rows, steps)


class StudyProgress:
    """Which run of how many a study is at, and the time left: the mean wall time of the runs trained so far in
    this invocation times the runs still to come (recorded ones cost nothing), printed before each run."""

    def __init__(self, total: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.total, self.clock, self.trained_s, self.index, self.started = total, clock, [], 0, None

    def next(self, label: str, recorded: bool = False) -> str:
        """The line before run `label`; `recorded`: it is read from its record, not trained."""
        self.index += 1
        left = self.total - self.index + 1
        if recorded:
            eta = "read from its record"
        elif self.trained_s:
            minutes = statistics.mean(self.trained_s) * left / 60
            eta = f"about {minutes // 60:.0f} h {minutes % 60:02.0f} min left if each run still to make takes what " \
                  f"the {len(self.trained_s)} made here took"
        else:
            eta = "the time left is known once a run has been made here"
        line = f"[study] run {self.index} of {self.total}: {label}; {eta}"
        print(line, flush=True)
        self.started = self.clock()
        return line

    def done(self) -> None:
        """The run announced last was trained: its wall time counts toward the time left."""
        self.trained_s.append(self.clock() - self.started)


def write_record(path, rows: list[dict], run_dir=None, flags: list[str] | None = None) -> None:
    """A run's record: its RECORD_KEYS rows, the study flags it was run with (None outside a study) and the
    run's train.py arguments (its args.json) when `run_dir` has them."""
    from harness.checkpoints import LinkRefusedError, read_no_follow

    args_file = Path(run_dir) / "args.json" if run_dir is not None else None
    try:  # never read through a link: it would record another run's flags as this one's
        args = json.loads(read_no_follow(args_file).decode()) if args_file and os.path.lexists(args_file) else None
    except LinkRefusedError as e:
        raise SystemExit(str(e)) from None
    record = {"flags": flags, "steps": rows[-1]["step"], "args": args,
              "rows": [{key: row[key] for key in RECORD_KEYS if key in row} for row in rows]}
    _write_text(path, json.dumps(record, separators=(",", ":")) + "\n")


def run_report(rows: list[dict], devices: int = 3, fit_from_step: int = 0, axis: str = "compute_hours") -> dict:
    """What a run shows, from its metrics rows: the validation curve, its largest fall once it passed 0.8, the
    token-weighted lag, the final sigmoid fit, and how well a fit on the first half of the compute predicted the
    last evaluation. `devices`: learner ranks + generator, to turn compute_hours back into wall time.
    `fit_from_step`: both fits leave out the evaluations before this step (R0 stays the step-0 evaluation), as
    ScaleRL leaves out its first ~1.5k GPU-hours. `axis`: the compute of the curve and the fits, one of
    COMPUTE_AXES."""
    import scaling_fit as sf

    evals = [r for r in rows if "val_pass_rate" in r]
    C = [r[axis] for r in evals]
    R = [r["val_pass_rate"] for r in evals]
    min_compute = next((r[axis] for r in evals if r["step"] >= fit_from_step), C[-1]) \
        if fit_from_step else 0.0
    after_08 = next((i for i, r in enumerate(R) if r >= 0.8), len(R))
    lags: collections.Counter[int] = collections.Counter()
    for row in rows:
        lags.update({int(lag): n for lag, n in row.get("lag_hist", {}).items()})
    tokens = sum(lags.values())
    report = {
        "steps": rows[-1]["step"], "val_first": R[0], "val_final": R[-1], "val_best": max(R),
        "largest_fall": max([0.0] + [a - b for a, b in zip(R, R[1:])]),
        "largest_fall_after_0.8": max([0.0] + [a - b for a, b in zip(R[after_08:], R[after_08 + 1:])]),
        "lag_mean": sum(lag * n for lag, n in lags.items()) / max(tokens, 1), "lag_max": max(lags, default=0),
        "lag_hist": {lag: lags[lag] / tokens for lag in sorted(lags)} if tokens else {},
        "stale_dropped": rows[-1].get("stale_dropped", 0), "compute_hours": evals[-1]["compute_hours"],
        # the share of a learner step (step_s includes it) that rank 0 spent pushing the weights to the generator
        "weight_sync_frac": statistics.median(fracs) if (fracs := [r["weight_sync_s"] / r["step_s"] for r in rows
                                                                  if r.get("step_s") and "weight_sync_s" in r]) else None,
        "wall_s": rows[-1]["compute_hours"] * 3600 / devices, "curve": list(zip(C, R)),
        "eval_steps": [r["step"] for r in evals], "min_compute": min_compute,
        "fit": None, "half_fit_error": None, "half_fit_error_vs_fit": None, "eval_sd_second_half": None,
        "compute_to_0.8": None,
    }
    try:
        fit = sf.fit_sigmoid(C, R, min_compute=min_compute)
        report["fit"] = {"A": fit.A, "B": fit.B, "C_mid": fit.C_mid, "R0": fit.R0, "r2": fit.r2}
        half = [i for i, c in enumerate(C) if c <= C[-1] / 2]
        half_fit = sf.fit_sigmoid([C[i] for i in half], [R[i] for i in half], min_compute=min_compute)
        half_prediction = float(half_fit.predict(C[-1]))
        report["half_fit_error"] = half_prediction - R[-1]
        # The last evaluation is one noisy sample of where the run ends. Against the full fit's end value the error is
        # the first half's extrapolation alone; the residuals' spread over the second half is that sample's noise.
        report["half_fit_error_vs_fit"] = half_prediction - float(fit.predict(C[-1]))
        second_half = [R[i] - float(fit.predict(C[i])) for i, c in enumerate(C) if c > C[-1] / 2]
        report["eval_sd_second_half"] = statistics.stdev(second_half) if len(second_half) > 1 else None
    except ValueError as err:  # flat curve or too few points: say so in the report
        report["fit_error"] = str(err)
    report["compute_to_0.8"] = next((c for c, r in zip(C, R) if r >= 0.8), None)
    return report


def _mean_spread(values: list[float | None], fmt: str) -> str:
    values = [v for v in values if v is not None]
    if not values:
        return "-"
    mean = sum(values) / len(values)
    if len(values) == 1:
        return f"{mean:{fmt}}"
    return f"{mean:{fmt}} ({min(values):{fmt}}..{max(values):{fmt}})"


def _add_curve_fit_args(parser: argparse.ArgumentParser) -> None:
    """What run_report's fits take, the same for `report` and `study`."""
    parser.add_argument("--fit-from-step", type=_count(0), default=0,
                        help="leave every run's evaluations before this step out of the fits (R0 stays the step-0 "
                             "evaluation), as ScaleRL leaves out its first ~1.5k GPU-hours (default 0: fit them all)")
    parser.add_argument("--compute-axis", choices=list(COMPUTE_AXES), default="compute_hours",
                        help="the compute every fit is on: compute_hours (ScaleRL's device-hours: wall time, so it "
                             "counts a synchronous pipeline's idle time, and runs made on machines of other speeds "
                             "do not pool) or flops (2N per generated + 6N per trained token: the same on every "
                             "machine, blind to idle time) (default compute_hours)")


def _add_report_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("runs", nargs="+", type=path_text,
                        help="run directories (train.py --output-dir) or a study's run records (.json) to report")
    parser.add_argument("--devices", type=_count(1), default=3,
                        help="learner ranks + generator of the runs (default 3)")
    parser.add_argument("--at-steps", type=_int_list(0, distinct=True), default=None,
                        help="comma list of evaluated steps: report each run as if it had stopped there too, to see "
                             "from which length on its first half predicts its end, e.g. 100,150,200 (default: the "
                             "whole run only)")
    _add_curve_fit_args(parser)
    parser.add_argument("--save-records", type=directory_path, default=None,
                        help="also write each run directory's record (NAME.json, as `study` keeps them: the "
                             "rows run_report reads and the run's args.json) into this directory, to commit what a "
                             "table was made from")


def experiment_report(args: argparse.Namespace) -> dict:
    """One line per run (and per --at-steps length): the pass rate from step 0 to the end, its largest fall once
    past 0.8, the mean lag, the final fit's R^2, the first-half fit's prediction error against the last evaluation
    and against the full fit's end, the wall time; then the mean and range over the runs."""
    import scaling_fit as sf

    reports, seen = {}, {}
    for run in args.runs:
        where = Path(run).resolve()
        where = where.parent if where.name == "metrics.jsonl" else where  # a run's directory, or its record
        if where in seen:  # counted twice, it would weigh twice in the mean and range over the runs
            raise SystemExit(f"{seen[where]} and {run} are one run: give each run once")
        seen[where] = run
        try:  # a run that is not there, an empty or malformed one, a cut at a step never evaluated: one line
            rows = sf.read_metrics(run)  # its directory, its metrics.jsonl, or its record (a .json file)
            if not rows:
                raise ValueError("no metrics rows: a run that never logged a step")
            cuts = [int(s) for s in args.at_steps.split(",")] if args.at_steps else [rows[-1]["step"]]
            cut = {steps: cut_rows(rows, steps) for steps in cuts}
        except (OSError, ValueError) as e:
            raise SystemExit(str(e) if str(run) in str(e) else f"{run}: {e}") from None
        if args.save_records and not str(run).endswith(".json"):
            write_record(Path(args.save_records) / f"{Path(run).name}.json", rows, run)
        for steps in cuts:
            name = run if steps == rows[-1]["step"] else f"{run} @ {steps}"
            reports[name] = run_report(cut[steps], args.devices, fit_from_step=args.fit_from_step,
                                       axis=args.compute_axis)
    print("| run | val pass 0 -> end (best) | largest fall after 0.8 | mean lag (max) | final fit A, R^2 "
          "| first-half fit: predicted - final | predicted - full fit's end | weight sync / step (median) | wall |")
    print("|---|---|---|---|---|---|---|---|---|")
    for run, rep in reports.items():
        fit = rep["fit"]
        print(f"| {run} | {rep['val_first']:.3f} -> {rep['val_final']:.3f} ({rep['val_best']:.3f}) | "
              f"{rep['largest_fall_after_0.8']:.3f} | {rep['lag_mean']:.2f} ({rep['lag_max']}) | "
              + (f"{fit['A']:.3f}, {fit['r2']:.3f} | " if fit else f"{rep.get('fit_error')} | ")
              + (f"{rep['half_fit_error']:+.3f} | " if rep["half_fit_error"] is not None else "- | ")
              + (f"{rep['half_fit_error_vs_fit']:+.3f} | " if rep["half_fit_error_vs_fit"] is not None else "- | ")
              + (f"{rep['weight_sync_frac']:.3f} | " if rep["weight_sync_frac"] is not None else "- | ")
              + f"{rep['wall_s']:.0f} s |")
    reps = list(reports.values())
    print(f"| mean (range) over {len(reps)} | {_mean_spread([r['val_final'] for r in reps], '.3f')} | "
          f"{_mean_spread([r['largest_fall_after_0.8'] for r in reps], '.3f')} | "
          f"{_mean_spread([r['lag_mean'] for r in reps], '.2f')} | "
          f"R^2 {_mean_spread([r['fit']['r2'] if r['fit'] else None for r in reps], '.3f')} | "
          f"{_mean_spread([abs(r['half_fit_error']) if r['half_fit_error'] is not None else None for r in reps], '.3f')} (abs) | "
          f"{_mean_spread([abs(r['half_fit_error_vs_fit']) if r['half_fit_error_vs_fit'] is not None else None for r in reps], '.3f')} (abs) | "
          f"{_mean_spread([r['weight_sync_frac'] for r in reps], '.3f')} | "
          f"{_mean_spread([r['wall_s'] for r in reps], '.0f')} s |")
    return {"benchmark": "report", "runs": {run: {k: v for k, v in rep.items() if k != "curve"}
                                            for run, rep in reports.items()}}


# How often each run of an experiment evaluates: the cadence of every study documented in docs/results.md, written in
# the runs' own flags. train.py's default (10 since make run became 150 steps) is make run's, and a study that took it
# would give a 50-step run 6 evaluations instead of 11, and no longer make the runs its documented command made.
STUDY_EVAL_EVERY = 5


def _add_eval_every_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--eval-every", type=_count(1), default=STUDY_EVAL_EVERY,
                        help=f"train.py --eval-every of every run (default {STUDY_EVAL_EVERY}, the documented runs'; "
                             "given in each run's own flags, so that train.py's default, make run's, changes no "
                             "study's runs)")


def staleness_run_flags(k: int, seed: int, args: argparse.Namespace) -> list[str]:
    """train.py's flags of the staleness experiment's run at bound `k` on `seed` (--max-steps aside: _train_run's):
    k = 0 is synchronous on-policy RL, k >= 1 PipelineRL-k with only k limiting the lag (--buffer-steps k + 1), the
    learner slowed so that the generator is ahead."""
    mode = ["--mode", "sync", "--max-off-policy", "1"] if k == 0 else \
        ["--mode", "pipeline", "--max-off-policy", str(k), "--buffer-steps", str(k + 1)]
    return ["--seed", str(seed), "--eval-every", str(args.eval_every), "--debug-learner-slowdown",
            str(args.learner_slowdown), *mode]


def _add_staleness_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--ks", type=_int_list(0, distinct=True), default="0,1,2,4,8",
                        help="staleness bounds k to compare; 0 is synchronous on-policy RL (--mode sync "
                             "--max-off-policy 1), k >= 1 PipelineRL-k with only k limiting the lag (default 0,1,2,4,8)")
    parser.add_argument("--steps", type=_count(1), default=50, help="optimizer steps per run (default 50)")
    parser.add_argument("--learner-slowdown", type=_number(1.0), default=2.0,
                        help="train.py --debug-learner-slowdown: a generator this much faster relative to the learner "
                             "than the machine's own ratio (default 2)")
    parser.add_argument("--seeds", type=_int_list(0, distinct=True), default="0,1",
                        help="seeds: every k runs on each (default 0,1)")
    _add_eval_every_arg(parser)
    parser.add_argument("--out-dir", type=directory_path, default="runs/staleness",
                        help="one run directory per k and seed under it (kK-sSEED), plus staleness.png and "
                             "staleness.md; finished runs are not run again (default runs/staleness)")
    parser.add_argument("--figure", type=figure_path, default=None,
                        help="also save the figure here, e.g. docs/staleness.png (make pictures does)")


def experiment_staleness(args: argparse.Namespace) -> dict:
    """The tiny recipe at several staleness bounds k with a generator faster than the learner, so that k alone
    sets the lag (--buffer-steps k + 1): validation pass rate against compute and the lag histogram of each run,
    the picture of why the off-policyness of an asynchronous pipeline must be bounded."""

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir = Path(args.out_dir)
    seeds = [int(x) for x in args.seeds.split(",")]
    results: dict[int, list[dict]] = {}  # k -> one report per seed
    for k in (int(k) for k in args.ks.split(",")):
        for seed in seeds:
            rows = _train_run(out_dir / f"k{k}-s{seed}", args.steps, staleness_run_flags(k, seed, args))
            results.setdefault(k, []).append(run_report(rows))

    fig, (ax_curve, ax_lag) = plt.subplots(1, 2, figsize=(12, 4.5))
    for index, (k, reps) in enumerate(results.items()):
        label = "k=0 (sync, on-policy)" if k == 0 else f"k={k}"
        color = f"C{index}"
        lag_mean = sum(rep["lag_mean"] for rep in reps) / len(reps)
        for n, rep in enumerate(reps):  # one line per seed: solid, dashed, dotted
            x, y = zip(*rep["curve"][1:])  # compute of step 0 is ~0: leave it off the log axis
            ax_curve.plot(x, y, marker="o", markersize=3, color=color, linestyle=["-", "--", ":"][n % 3],
                          label=f"{label}: mean lag {lag_mean:.1f}" if n == 0 else None)
        lags = sorted({lag for rep in reps for lag in rep["lag_hist"]})
        ax_lag.plot(lags, [sum(rep["lag_hist"].get(lag, 0.0) for rep in reps) / len(reps) for lag in lags],
                    marker="o", color=color, label=label)
    firsts = [rep["val_first"] for reps in results.values() for rep in reps]
    r0 = sum(firsts) / len(firsts)
    ax_curve.axhline(r0, color="gray", linestyle="-.", linewidth=0.8, label=f"R0 (step 0, mean) {r0:.2f}")
    ax_curve.set_xscale("log")
    ax_curve.xaxis.set_minor_locator(matplotlib.ticker.LogLocator(subs=(2.0, 5.0)))
    ax_curve.set(xlabel="compute_hours (wall hours x 3 devices)", ylabel="validation pass rate (mean@4)",
                 title=f"Tiny recipe, generator far ahead of the learner (learner slowed {args.learner_slowdown:g}x), "
                       f"seeds {args.seeds}")
    ax_lag.set(xlabel="lag of a trained token (optimizer steps)", ylabel="fraction of trained tokens",
               title="Lag histogram over the run (mean over seeds)")
    for ax in (ax_curve, ax_lag):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        ax.title.set_fontsize(10)
    fig.tight_layout()
    fig.savefig(out_dir / "staleness.png", dpi=110)
    if args.figure:
        fig.savefig(args.figure, dpi=110)
    plt.close(fig)
    lines = ["| k | mean lag (max) | val pass 0 -> end (best) | largest fall between evaluations | final fit A, R^2 "
             "per seed | wall |", "|---|---|---|---|---|---|"]
    for k, reps in results.items():
        fits = "; ".join(f"{rep['fit']['A']:.3f}, {rep['fit']['r2']:.3f}" if rep["fit"] else "no sigmoid"
                         for rep in reps)
        lines.append(f"| {k}{' (sync)' if k == 0 else ''} | {_mean_spread([r['lag_mean'] for r in reps], '.2f')} "
                     f"({max(r['lag_max'] for r in reps)}) | {_mean_spread([r['val_first'] for r in reps], '.3f')} -> "
                     f"{_mean_spread([r['val_final'] for r in reps], '.3f')} "
                     f"({_mean_spread([r['val_best'] for r in reps], '.3f')}) | "
                     f"{_mean_spread([r['largest_fall'] for r in reps], '.3f')} | {fits} | "
                     f"{_mean_spread([r['wall_s'] for r in reps], '.0f')} s |")
    lines.append(f"\n(mean and, in brackets, range over seeds {args.seeds}; {args.steps} steps each)")
    _write_text(out_dir / "staleness.md", "\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"[staleness] figure: {out_dir / 'staleness.png'}")
    return {"benchmark": "staleness", "learner_slowdown": args.learner_slowdown, "steps": args.steps, "seeds": seeds,
            "runs": {k: [{key: v for key, v in rep.items() if key != "curve"} for rep in reps]
                     for k, reps in results.items()}}


# ScaleRL's ablations in miniature (its Figures 7 and 9-11): the recipe, then one component changed at a time.
VARIANTS: dict[str, tuple[str, list[str]]] = {
    "scalerl": ("ScaleRL recipe (CISPO, PipelineRL-8)", []),
    "gspo": ("GSPO loss instead of CISPO", ["--loss", "gspo"]),
    "dapo": ("DAPO loss instead of CISPO", ["--loss", "dapo"]),
    "grpo": ("GRPO loss instead of CISPO", ["--loss", "grpo"]),
    "sync8": ("PPO-off-policy-8 instead of PipelineRL-8", ["--mode", "sync", "--max-off-policy", "8"]),
    "keep": ("keep zero-variance groups", ["--zero-variance", "keep"]),
    "group": ("group instead of batch advantage norm", ["--adv-norm", "group"]),
    "sample": ("sample instead of prompt aggregation", ["--aggregation", "sample"]),
    "batch2x": ("2x larger batch (64 prompts per step)", ["--prompts-per-step", "64"]),
    "nonpr": ("no No-Positive-Resampling", ["--retire-pass-rate", "0"]),
    "overlong": ("DAPO overlong penalty instead of interruptions", ["--length-control", "overlong"]),
}
# Named lists of variants: the study of ScaleRL's design axes, and the leave-one-out table of docs/results.md.
VARIANT_SETS = {
    "study": "scalerl,sync8,dapo,grpo,gspo,keep,group,sample,batch2x",
    "leave-one-out": "scalerl,sync8,dapo,sample,group,keep,nonpr,overlong",
}


def pooled_fit(reports: list[dict], n_boot: int = 200, seed: int = 0, fixed_A: float | None = None) -> dict:
    """ScaleRL's sigmoid fitted to the evaluations of all seeds of one variant at once, with residual-bootstrap
    95% intervals. R0 is the base model's pass rate: the mean of the runs' step-0 evaluations, one point at the
    smallest step-0 compute. Each run's evaluations below its report's `min_compute` (run_report's fit_from_step)
    are left out of the fit. `fixed_A`: fit B and C_mid with A held there (ScaleRL's way to compare the B of runs
    whose A is alike). `reports` are run_report()s; a flat pooled curve gives None values and its error."""
    import math

    import scaling_fit as sf

    r0 = sum(rep["curve"][0][1] for rep in reports) / len(reports)
    C, R = [min(rep["curve"][0][0] for rep in reports)], [r0]
    for c, r in sorted(point for rep in reports for point in rep["curve"][1:] if point[0] >= rep["min_compute"]):
        C.append(c if c > C[-1] else math.nextafter(C[-1], math.inf))  # two seeds at one compute: keep both
        R.append(r)
    out = {"A": None, "A_lo": None, "A_hi": None, "B": None, "B_lo": None, "B_hi": None, "C_mid": None,
           "C_mid_lo": None, "C_mid_hi": None,
           "R0": r0, "r2": None, "n_points": len(C), "curve": list(zip(C, R)), "fit": None}
    try:
        boot = sf.bootstrap_sigmoid(C, R, n_boot, r0=r0, seed=seed, a_grid=None if fixed_A is None else [fixed_A])
    except ValueError as err:  # flat: no sigmoid can be identified
        return out | {"error": str(err)}
    fit = boot.fit
    return out | {"A": fit.A, "A_lo": boot.A_ci[0], "A_hi": boot.A_ci[1], "B": fit.B, "B_lo": boot.B_ci[0],
                  "B_hi": boot.B_ci[1], "C_mid": fit.C_mid, "C_mid_lo": boot.C_mid_ci[0], "C_mid_hi": boot.C_mid_ci[1],
                  "r2": fit.r2, "fit": fit}


def compare_intervals(variant: dict, baseline: dict, key: str = "A") -> str:
    """'higher' or 'lower' when the 95% intervals of `key` (A, B or C_mid) do not overlap, 'not separable' when
    they do."""
    if variant[key] is None or baseline[key] is None:
        return "no fit"
    if variant[f"{key}_lo"] > baseline[f"{key}_hi"]:
        return "higher"
    if variant[f"{key}_hi"] < baseline[f"{key}_lo"]:
        return "lower"
    return "not separable"


def plot_study(fits: dict[str, dict], out_path, title: str, ceiling: float | None = None,
               axis: str = "compute_hours") -> None:
    """The study's figure: each variant's pooled evaluations and fit against compute, then A and B with their 95%
    intervals, one row per variant (the first is the baseline), and the task's known ceiling where there is one."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    import scaling_fit as sf

    fig, (ax_curve, ax_a, ax_b) = plt.subplots(1, 3, figsize=(15, 5.2), gridspec_kw={"width_ratios": [2.2, 1, 1]})
    names = list(fits)
    for row, name in enumerate(names):
        fit, color = fits[name], f"C{row % 10}"
        C, R = (np.asarray(v) for v in zip(*fit["curve"][1:]))  # [0] is R0 at compute ~0: off the log axis
        ax_curve.scatter(C, R, s=7, color=color, alpha=0.45)
        if fit["fit"] is None:
            ax_curve.plot([], [], color=color, label=f"{name}: no sigmoid")
            continue
        x = np.geomspace(C.min(), C.max(), 200)
        ax_curve.plot(x, fit["fit"].predict(x), color=color, label=name)
        for ax, key in ((ax_a, "A"), (ax_b, "B")):
            ax.errorbar(fit[key], row, xerr=[[fit[key] - fit[f"{key}_lo"]], [fit[f"{key}_hi"] - fit[key]]], fmt="o",
                        color=color, capsize=3)
    if ceiling is not None:
        for ax, axline in ((ax_curve, ax_curve.axhline), (ax_a, ax_a.axvline)):
            axline(ceiling, color="black", linestyle=":", linewidth=1, label=f"known ceiling {ceiling:g}")
        ax_a.legend(fontsize=8, loc="upper right")
    ax_curve.set_xscale("log")
    ax_curve.set(xlabel=f"{axis} ({COMPUTE_AXES[axis]})", ylabel="validation pass rate (mean@k)", title=title)
    ax_curve.legend(fontsize=7, ncol=2)
    ax_a.set(xlabel="asymptote A (95% interval)", title="A: where the variant ends")
    ax_b.set(xlabel="B (95% interval)", title="B: how fast it gets there")
    for ax in (ax_a, ax_b):
        ax.set_yticks(range(len(names)), names)
        ax.set_ylim(len(names) - 0.5, -0.5)  # the baseline on top
    for ax in (ax_curve, ax_a, ax_b):
        ax.grid(alpha=0.3)
        ax.title.set_fontsize(9)
    fig.tight_layout()
    sf._save_figure(fig, Path(out_path), dpi=110)  # a new file renamed into place: a link there is replaced, not
                                                   # written through


def _add_study_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--variants", type=_variant_names, default="study",
                        help=f"a named set ({', '.join(f'{k}: {v}' for k, v in VARIANT_SETS.items())}) or a comma "
                             f"list of variants from: {', '.join(VARIANTS)} (default: study). The first is the "
                             "baseline the others are compared with")
    parser.add_argument("--seeds", type=_int_list(0, distinct=True), default="0,1,2",
                        help="seeds of every variant (default 0,1,2)")
    parser.add_argument("--steps", type=_count(1), default=50, help="optimizer steps per run (default 50)")
    _add_eval_every_arg(parser)
    parser.add_argument("--common", type=_common_flags, default="",
                        help="train.py flags added to every run, after the variant's (so they win where both name one "
                             "flag, --eval-every's too), e.g. \"--model DIR --dataset FILE\" for another task; checked "
                             "by train.py's parser before any run, and never --seed, --output-dir, --max-steps, "
                             "--resume or --overwrite, which the study gives each run")
    _add_curve_fit_args(parser)
    parser.add_argument("--bootstrap", type=_count(0), default=200,
                        help="residual-bootstrap replicates of each pooled fit, for the 95%% intervals (default 200)")
    parser.add_argument("--out-dir", type=directory_path, default="runs/study",
                        help="runs go to OUT_DIR/VARIANT-sSEED; a finished run is not run again and an unfinished "
                             "one that this study started (the start token of OUT_DIR/VARIANT-sSEED.command.json in "
                             "its args.json) goes on from its checkpoint, so a killed study continues where it "
                             "stopped; a run there whose args.json holds other flags, or an unfinished one the study "
                             "did not start, is refused, never deleted; the table, figure and summary go to "
                             "OUT_DIR/study.{md,png,json} (default runs/study)")
    parser.add_argument("--records", type=directory_path, default=None,
                        help="one small JSON record per finished run (VARIANT-sSEED.json: its flags and metrics rows) "
                             "goes here, and a run whose record holds at least --steps steps with the same flags is "
                             "not run again but cut at --steps. Committed (e.g. docs/study-runs), they let a study be "
                             "refitted (another fitter, fewer steps) without its run directories, or continued by a "
                             "later session (on compute_hours, only records from machines of one speed pool; on "
                             "--compute-axis flops, any do) (default OUT_DIR/records)")
    parser.add_argument("--ceiling", type=_number(0.0, 1.0), default=None,
                        help="the task's known ceiling, drawn beside the fitted asymptotes and kept in the summary "
                             "(arithmetic-verified with --think-budget 27,36: 0.7, see tasks.VerifiedArithmeticTask)")
    parser.add_argument("--summary", type=output_file, default=None,
                        help="also write the summary JSON here, e.g. docs/study.json")
    parser.add_argument("--figure", type=figure_path, default=None, help="also save the figure here, e.g. docs/study.png")


def _worst(errors: Iterable[float | None]) -> float | None:
    """The error of largest magnitude, with its sign; None when no run has one."""
    known = [e for e in errors if e is not None]
    return max(known, key=abs) if known else None


def experiment_study(args: argparse.Namespace) -> dict:
    """Each variant on each seed (resumable), then per variant one sigmoid fitted to all its seeds' evaluations
    with 95% bootstrap intervals of A and B, each run's first-half prediction error, and whether the variant's
    asymptote is separable from the baseline's (the first variant); then, for the variants whose A is not, B and
    C_mid refitted at their shared A and compared the same way: one table, one figure, one summary JSON."""

    out_dir = Path(args.out_dir)
    seeds = [int(x) for x in args.seeds.split(",")]
    names = VARIANT_SETS.get(args.variants, args.variants).split(",")
    unknown = [v for v in names if v not in VARIANTS]
    if unknown:
        raise SystemExit(f"unknown variants {unknown}; known: {list(VARIANTS)}, or a set: {list(VARIANT_SETS)}")
    common = shlex.split(args.common)
    records = Path(args.records) if args.records else out_dir / "records"
    reports: dict[str, list[dict]] = {}
    progress = StudyProgress(len(names) * len(seeds))
    for name in names:
        for seed in seeds:
            record, flags = records / f"{name}-s{seed}.json", study_run_flags(name, seed, args)
            rows = _read_record(record, args.steps, flags)
            progress.next(f"{name}, seed {seed}", recorded=rows is not None)
            if rows is None:
                rows = _train_and_record(out_dir / f"{name}-s{seed}", record, args.steps, flags)
                progress.done()
            reports.setdefault(name, []).append(run_report(rows, fit_from_step=args.fit_from_step,
                                                           axis=args.compute_axis))
    fits = {name: pooled_fit(reps, args.bootstrap) for name, reps in reports.items()}
    baseline = fits[names[0]]
    # ScaleRL compares the efficiency of runs whose asymptotes are alike with A fixed at their average: here the
    # baseline and every variant whose A is not separable from it, refitted with A at the mean of their A.
    alike = [name for name in names
             if name == names[0] or compare_intervals(fits[name], baseline) == "not separable"]
    shared_a = round(statistics.mean(fits[name]["A"] for name in alike), 3) if baseline["A"] is not None else None
    shared = {name: pooled_fit(reports[name], args.bootstrap, fixed_A=shared_a) for name in alike} \
        if shared_a is not None else {}
    summary_variants = []
    unit = COMPUTE_AXES[args.compute_axis]
    c_fmt = ".4f" if args.compute_axis == "compute_hours" else ".3g"
    lines = [f"| variant (NAME) | FLAGS | val pass 0 -> {args.steps} | A [95%] | B [95%] | C_mid ({unit}) | R^2 "
             f"| first-half fit: predicted - final, worst | predicted - full fit's end, worst | A against {names[0]} "
             f"| at A = {shared_a}: B [95%] | C_mid [95%] | B, C_mid against {names[0]} |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, reps in reports.items():
        line, variant = _study_row(name, reps, seeds, fits, shared, names[0], c_fmt)
        lines.append(line)
        summary_variants.append(variant)
    all_reports = [rep for reps in reports.values() for rep in reps]
    total_hours = sum(rep["compute_hours"] for rep in all_reports)
    total_wall = sum(rep["wall_s"] for rep in all_reports)
    summary = {
        "steps": args.steps, "seeds": seeds, "common_flags": common, "fit_from_step": args.fit_from_step,
        "compute_axis": args.compute_axis,
        "ceiling": args.ceiling, "shared_A": shared_a,
        "bootstrap": args.bootstrap,
        "baseline": names[0], "records": str(records), "runs": len(all_reports), "total_compute_hours": total_hours,
        "total_wall_s": total_wall,
        "worst_half_fit_error": _worst(rep["half_fit_error"] for rep in all_reports),
        "worst_half_fit_error_vs_fit": _worst(rep["half_fit_error_vs_fit"] for rep in all_reports),
        "runs_without_half_fit": sum(rep["half_fit_error"] is None for rep in all_reports),
        "variants": summary_variants,
    }
    from_step = f", fitted from step {args.fit_from_step} on" if args.fit_from_step else ""
    table = "\n".join(lines) + (
        f"\n\n(one sigmoid per variant fitted to the evaluations of seeds {args.seeds} together, {args.steps} steps "
        f"each{from_step}, on {args.compute_axis}; 95% residual-bootstrap intervals; {len(all_reports)} runs, "
        f"{total_hours:.2f} "
        f"device-hours, {total_wall / 3600:.2f} h of wall time"
        + (f"; every run also takes `{shlex.join(common)}` after its variant's flags, and so where the two name one "
           f"flag, the common one holds, whatever the variant's title says" if common else "") + ")\n")
    _write_text(out_dir / "study.md", table)
    for path in [out_dir / "study.json", *([Path(args.summary)] if args.summary else [])]:
        _write_text(path, json.dumps(summary, indent=1) + "\n")
    title = f"{len(seeds)} seeds pooled per variant (seeds {args.seeds}), {args.steps} steps{from_step}"
    for path in [out_dir / "study.png", *([Path(args.figure)] if args.figure else [])]:
        plot_study(fits, path, title, args.ceiling, args.compute_axis)
    print(table)
    return {"benchmark": "study", **summary}


def study_run_flags(name: str, seed: int, args: argparse.Namespace) -> list[str]:
    """train.py's flags of the study's run of variant `name` on `seed` (--max-steps aside: _train_run's): the seed and
    the evaluation cadence, the variant's own flags, then --common's, which win where they name the same flag."""
    return ["--seed", str(seed), "--eval-every", str(args.eval_every), *VARIANTS[name][1], *shlex.split(args.common)]


def _study_row(name: str, reps: list[dict], seeds: list[int], fits: dict[str, dict], shared: dict[str, dict],
               baseline_name: str, c_fmt: str) -> tuple[str, dict]:
    """One variant's line of the study's table and its entry in study.json: its pooled fit, each seed's first-half
    prediction error, and how its A (and, at the shared A, its B and C_mid) compare with the baseline's."""
    title, flags = VARIANTS[name]
    fit, baseline = fits[name], fits[baseline_name]
    half_errors = {str(seed): rep["half_fit_error"] for seed, rep in zip(seeds, reps)}
    errors_vs_fit = {str(seed): rep["half_fit_error_vs_fit"] for seed, rep in zip(seeds, reps)}
    worst, worst_vs_fit = _worst(half_errors.values()), _worst(errors_vs_fit.values())
    verdict = "(baseline)" if name == baseline_name else compare_intervals(fit, baseline)
    at_shared = shared.get(name, {"B": None})
    b_verdict = "(baseline)" if name == baseline_name else "A differs" if name not in shared else \
        ", ".join(compare_intervals(at_shared, shared[baseline_name], key=key) for key in ("B", "C_mid"))
    b_shared_text = "- | -" if at_shared["B"] is None else \
        (f"{at_shared['B']:.2f} [{at_shared['B_lo']:.2f}, {at_shared['B_hi']:.2f}] | {at_shared['C_mid']:{c_fmt}} "
         f"[{at_shared['C_mid_lo']:{c_fmt}}, {at_shared['C_mid_hi']:{c_fmt}}]")
    if fit["A"] is None:
        a_text = b_text = c_text = r2_text = "no sigmoid"
    else:
        a_text = f"{fit['A']:.3f} [{fit['A_lo']:.3f}, {fit['A_hi']:.3f}]"
        b_text = f"{fit['B']:.2f} [{fit['B_lo']:.2f}, {fit['B_hi']:.2f}]"
        c_text, r2_text = f"{fit['C_mid']:{c_fmt}}", f"{fit['r2']:.3f}"
    line = (f"| {title} ({name}) | {'`' + ' '.join(flags) + '`' if flags else ''} | "
            f"{_mean_spread([r['val_first'] for r in reps], '.3f')} -> "
            f"{_mean_spread([r['val_final'] for r in reps], '.3f')} | {a_text} | {b_text} | {c_text} | "
            f"{r2_text} | {'-' if worst is None else f'{worst:+.3f}'} | "
            f"{'-' if worst_vs_fit is None else f'{worst_vs_fit:+.3f}'} | {verdict} | {b_shared_text} | "
            f"{b_verdict} |")
    variant = {
        "name": name, "title": title, "flags": flags, "seeds": seeds,
        **{key: fit[key] for key in ("A", "A_lo", "A_hi", "B", "B_lo", "B_hi", "C_mid", "C_mid_lo", "C_mid_hi",
                                     "R0", "r2", "n_points")},
        "half_fit_errors": half_errors, "half_fit_errors_vs_fit": errors_vs_fit,
        "eval_sd_second_half": [rep["eval_sd_second_half"] for rep in reps],
        "val_final": [rep["val_final"] for rep in reps],
        "compute_hours": [rep["compute_hours"] for rep in reps], "against_baseline": verdict,
        **{f"{key}_at_shared_A{end}": at_shared.get(f"{key}{end}") for key in ("B", "C_mid") for end in
           ("", "_lo", "_hi")}, "B_C_mid_against_baseline": b_verdict,
    }
    return line, variant


def _variant_names(text: str) -> str:
    """An argparse type that checks --variants (a named set, or variants by name) and keeps its text."""
    names = VARIANT_SETS.get(text, text).split(",")
    unknown = [name for name in names if name not in VARIANTS]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown variants {unknown}; known: {list(VARIANTS)}, or a set: "
                                          f"{list(VARIANT_SETS)}")
    if twice := repeated(names):  # one run would count as two
        raise argparse.ArgumentTypeError(f"{', '.join(twice)} given twice (got {text!r})")
    return text


def _common_flags(text: str) -> str:
    """--common's argparse type: shell-quoted train.py flags, each one train.py knows, with a value it takes (a typo
    failed every run of the study, each after its torchrun's start), and none of those the study gives each run
    itself: its seed (--seeds: one seed given to all would pool one run as three), its directory, its steps."""
    try:
        words = shlex.split(text)
    except ValueError as e:  # an unclosed quote
        raise argparse.ArgumentTypeError(f"{text!r}: {e}") from None
    if not words:
        return text
    from harness import flags as train_flags

    def refuse(message: str) -> None:
        raise argparse.ArgumentTypeError(f"{text!r}: train.py: {message}")

    parser = train_flags.build_parser()
    parser.error = refuse  # type: ignore[method-assign]  # its one error line, as --common's
    if {"-h", "--help"} & set(words):
        refuse("--help is not a flag of a run")
    given = train_flags.given_flags(parser, words)
    if ours := [name for name in ("seed", *BOOKKEEPING_FLAGS) if name in given]:
        raise argparse.ArgumentTypeError(f"{text!r}: {', '.join('--' + name.replace('_', '-') for name in ours)}: the "
                                         "study gives each run its own (--seeds, --out-dir, --steps)")
    return text


# name -> (experiment function, function adding its flags, one-line help)
EXPERIMENTS: dict[str, tuple[Callable[[argparse.Namespace], dict], Callable[[argparse.ArgumentParser], None], str]] = {
    "report": (experiment_report, _add_report_args,
               "targets of finished runs: pass rate, largest fall, mean lag, fit R^2, first-half prediction error"),
    "study": (experiment_study, _add_study_args,
              "ScaleRL's ablations in miniature: variants x seeds (resumable), pooled fits with 95%% intervals of A, B"),
    "staleness": (experiment_staleness, _add_staleness_args,
                  "the tiny recipe at k = 0 (sync), 1, 2, 4, 8 with a fast generator: pass rate vs compute, lag"),
}


def build_parser() -> argparse.ArgumentParser:
    """tools/experiments.py's command line: one subcommand per experiment, each with its own flags."""
    return subcommand_parser(__doc__.split("\n\n")[0], EXPERIMENTS, "EXPERIMENT")


def main(argv: list[str] | None = None) -> int:
    return run_subcommand(build_parser(), EXPERIMENTS, "EXPERIMENT", argv)


if __name__ == "__main__":
    exit_with(main)
