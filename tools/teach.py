"""Teaching kit for instructors: exercises that the project's own tests grade, and pictures drawn from the real losses.

    python -m tools.teach list                   the exercises in teaching order, each with the question it raises
    python -m tools.teach exercise ALGO DIR      write a student copy of ALGO.py into DIR, the bodies to write removed
    python -m tools.teach grade ALGO DIR         run tests/test_ALGO.py against DIR/ALGO.py; status 0 when all pass
    python -m tools.teach pictures [--out docs]  draw gradients.png and aggregation.png by autograd through the loss

An exercise is the reference file with the bodies of its core functions (compute_advantages, loss_denominator and
compute_loss; tis_weights and mismatch_metrics for tis.py) replaced by `raise NotImplementedError(hint)`, where the
hint quotes the equation from the module docstring. Signatures, docstrings and every helper stay, so a student
writes only what the paper specifies. The bodies are found with `ast` (function line ranges), so the same code
serves any algorithm file.

Grading runs the algorithm's existing test file in a fresh pytest process with SCALERL_STUDENT_FILE set;
tests/conftest.py then loads that file under the reference module's name, so `import dapo` in tests/test_dapo.py
gets the student's copy while every other module stays the reference, and fails any test that would not see it.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import inspect
import math
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness.cli import OneLineParser  # one error line for a bad flag, no usage block (its subcommands too)
from harness.cli import exit_with  # a closed stdout (`| head`) ends the command quietly
from harness.cli import directory_path  # the argparse type of a directory written into: no file in its way
from harness.cli import number  # the argparse type of a finite number

REPO = Path(__file__).resolve().parent.parent  # the repository root: this module lives in tools/
LOSS_FUNCTIONS = ("compute_advantages", "loss_denominator", "compute_loss")


# ----------------------------------------------------------------------------------------------------------------
# The exercises, in teaching order: GRPO first, every later file is a diff of what came before it
# ----------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Exercise:
    algo: str                                   # the algorithm file, without .py
    why_here: str                               # what it changes relative to the exercises before it
    question: str                               # the one thing writing it should make the student think about
    functions: tuple[str, ...] = LOSS_FUNCTIONS  # the bodies the student writes


EXERCISES = (
    Exercise(
        "grpo",
        "the base: the group is the baseline, PPO's clip is the trust region; every other file is a diff of it",
        "Why does the min of the clipped and unclipped terms give a token zero gradient once its ratio has passed "
        "1 + eps in the direction its advantage favours, but keep its gradient when the ratio moved the other way?",
    ),
    Exercise(
        "drgrpo",
        "the smallest diff from GRPO: two divisions leave",
        "GRPO divides by |y_i| and by std_g: what does each do to a long wrong answer and to an almost-solved "
        "prompt, and why does a constant max_tokens in place of |y_i| only rescale the loss?",
    ),
    Exercise(
        "dapo",
        "GRPO's clip range and aggregation change; the recipe's helpers (filter_groups, overlong_penalty) are given",
        "Why does DAPO raise only the upper clip bound (1 + 0.28, against 1 - 0.2 below): which tokens can now grow "
        "further, and why does that keep the policy's entropy from collapsing?",
    ),
    Exercise(
        "gspo",
        "GRPO with the unit of the ratio and of the clip moved from the token to the sequence",
        "Why must the sequence ratio be the exp of the MEAN token log-ratio, not of the sum, and why does that make "
        "a clip range as narrow as [1 - 3e-4, 1 + 4e-4] sensible?",
    ),
    Exercise(
        "cispo",
        "DAPO's clipped surrogate becomes a detached, truncated weight on REINFORCE (ScaleRL's loss)",
        "Why does CISPO detach the weight min(r_{i,t}, eps_max), and what gradient does a token with r_{i,t} = 8 "
        "still get where PPO's clip would give it none?",
    ),
    Exercise(
        "tis",
        "not a loss: the importance weight that any of the five multiplies into its per-token loss",
        "The sampler and the learner hold the same weights: why is pi_learner_old / pi_sampler not 1, and why "
        "truncate it at C = 2 rather than use it as it is?",
        functions=("tis_weights", "mismatch_metrics"),
    ),
)
EXERCISE_BY_ALGO = {exercise.algo: exercise for exercise in EXERCISES}

# Which sections of the module docstring each function's hint quotes (every function gets its own docstring too).
HINT_SECTIONS = {"loss_denominator": ("Aggregation unit",), "compute_loss": ("Equation", "Aggregation unit")}
DEFAULT_HINT_SECTIONS = ("Equation",)


def print_exercise_list() -> None:
    """The exercises in order, with why each comes where it does and its question."""
    for number, exercise in enumerate(EXERCISES, start=1):
        print(f"{number}. {exercise.algo}.py: {', '.join(exercise.functions)}")
        print(f"   why here: {exercise.why_here}")
        print(f"   question: {exercise.question}")


# ----------------------------------------------------------------------------------------------------------------
# Making an exercise: the reference file with the chosen function bodies removed
# ----------------------------------------------------------------------------------------------------------------


def docstring_sections(docstring: str) -> dict[str, list[str]]:
    """A module docstring's sections: a title at column 0 ("Equation (...)", "Aggregation unit"), then its lines."""
    sections: dict[str, list[str]] = {}
    title = None
    for line in docstring.splitlines():
        if line and not line[0].isspace():
            title = line
            sections[title] = [line]
        elif title is not None:
            sections[title].append(line)
    return {title: _strip_blank_tail(lines) for title, lines in sections.items()}


def _strip_blank_tail(lines: list[str]) -> list[str]:
    while lines and not lines[-1].strip():
        lines = lines[:-1]
    return lines


def exercise_hint(algo: str, function: ast.FunctionDef, module_docstring: str) -> str:
    """The NotImplementedError message: what to write, the function's summary, the equation it implements."""
    summary = (ast.get_docstring(function) or "").split("\n")[0]
    lines = [f"Exercise: write {algo}.{function.name}: {summary}", "Its docstring gives the arguments and returns."]
    sections = docstring_sections(module_docstring)
    for wanted in HINT_SECTIONS.get(function.name, DEFAULT_HINT_SECTIONS):
        for title, section_lines in sections.items():
            if title.startswith(wanted):
                lines += ["", *section_lines]
    return "\n".join(lines)


def _raise_statement(hint: str, indent: str) -> list[str]:
    """`raise NotImplementedError(...)` with the hint as one string literal per line, so it reads in the file too."""
    hint_lines = hint.split("\n")
    literals = [_string_literal(line + "\n") for line in hint_lines[:-1]] + [_string_literal(hint_lines[-1])]
    return [
        f"{indent}# EXERCISE: replace the raise below with your implementation.",
        f"{indent}raise NotImplementedError(",
        *(f"{indent}    {literal}" for literal in literals),
        f"{indent})",
    ]


def _string_literal(text: str) -> str:
    """A double-quoted Python literal of text (repr() would pick single quotes for text holding a double quote)."""
    escaped = text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
    return f'"{escaped}"'


def make_exercise_source(algo: str) -> str:
    """The student copy of ALGO.py: each exercise function keeps its signature and docstring, loses its body."""
    exercise = EXERCISE_BY_ALGO[algo]
    source = (REPO / f"{algo}.py").read_text()
    tree = ast.parse(source)
    functions = {node.name: node for node in tree.body if isinstance(node, ast.FunctionDef)}
    missing = [name for name in exercise.functions if name not in functions]
    if missing:
        raise ValueError(f"{algo}.py has no top-level function {', '.join(missing)}")
    lines = source.splitlines()
    # From the bottom up, so that the line numbers of the functions still to do stay valid.
    for node in sorted((functions[name] for name in exercise.functions), key=lambda n: n.lineno, reverse=True):
        # The body starts after the docstring (the comments before the first statement go too).
        has_docstring = ast.get_docstring(node) is not None
        body_start = node.body[0].end_lineno + 1 if has_docstring else node.body[0].lineno
        indent = " " * node.body[0].col_offset
        hint = exercise_hint(algo, node, ast.get_docstring(tree) or "")
        lines[body_start - 1 : node.end_lineno] = _raise_statement(hint, indent)
    return "\n".join(lines) + "\n"


def write_exercise(algo: str, directory: Path, *, force: bool = False) -> Path:
    """Write DIR/ALGO.py, the student copy; refuse to overwrite a student's work unless force."""
    target = directory / f"{algo}.py"
    if target.exists() and not force:
        raise FileExistsError(f"{target} exists (a student's work?); pass --force to overwrite it")
    directory.mkdir(parents=True, exist_ok=True)
    target.write_text(make_exercise_source(algo))
    return target


# ----------------------------------------------------------------------------------------------------------------
# Grading: the algorithm's own tests, against the student's file
# ----------------------------------------------------------------------------------------------------------------


GRADE_TIMEOUT_S = 120.0  # the tests take a second or two; a student's loop that never ends stops here


def grade(algo: str, directory: Path, timeout_s: float = GRADE_TIMEOUT_S) -> int:
    """Run tests/test_ALGO.py in a fresh pytest process with DIR/ALGO.py in place of the reference ALGO.py;
    returns pytest's exit status (0 only when every test passed). A run past `timeout_s` (a loop in the student's
    file that never ends: grading hung until someone pressed Ctrl-C) is stopped, said in one line, status 1."""
    student_file = (directory / f"{algo}.py").resolve()
    if not student_file.is_file():
        raise FileNotFoundError(f"no {student_file}; write one with: "
                                f"python -m tools.teach exercise {algo} {directory}")
    # tests/conftest.py loads SCALERL_STUDENT_FILE under the module name `algo` and checks each test sees it.
    env = {**os.environ, "SCALERL_STUDENT_FILE": str(student_file)}
    # No cache: a student's failures must not become the developers' `pytest --lf`.
    command = [sys.executable, "-m", "pytest", f"tests/test_{algo}.py", "-q", "--tb=short", "-p", "no:cacheprovider"]
    try:
        return subprocess.run(command, cwd=REPO, env=env, timeout=timeout_s).returncode
    except subprocess.TimeoutExpired:  # run() has killed pytest
        print(f"\nthe tests did not finish in {timeout_s:g} s and were stopped: does a loop in {student_file} never "
              "end? (--timeout sets the limit)", file=sys.stderr)
        return 1


# ----------------------------------------------------------------------------------------------------------------
# Pictures: the curves, computed by autograd through each file's own compute_loss
# (torch and matplotlib are imported inside the functions, so that list, exercise and grade start at once)
# ----------------------------------------------------------------------------------------------------------------


def token_gradient(algo: str, ratio: float, advantage: float, **hyperparameters: Any) -> float:
    """d loss / d log pi of the one token of a batch of one one-token completion, whose ratio pi / pi_old is
    `ratio`, by autograd through ALGO.compute_loss with the file's defaults (unless overridden).

    With one token, GSPO's sequence ratio is the token ratio, and every aggregation divides by 1: the value is the
    gradient the loss puts on a token with this ratio and advantage, before the aggregation scales it.
    """
    import torch

    module = importlib.import_module(algo)
    old_logprobs = torch.full((1, 1), math.log(0.1), dtype=torch.float64)
    logprobs = (old_logprobs + math.log(ratio)).requires_grad_()            # a leaf: the gradient lands here
    advantages = torch.tensor([advantage], dtype=torch.float64)
    mask = torch.ones(1, 1, dtype=torch.bool)
    loss, _ = module.compute_loss(logprobs, old_logprobs, advantages, mask, 1, **hyperparameters)
    (gradient,) = torch.autograd.grad(loss, logprobs)
    return float(gradient)


def tis_weight(ratio: float, **hyperparameters: Any) -> float:
    """tis.tis_weights for one token whose ratio pi_learner_old / pi_sampler is `ratio` (defaults: min(ratio, 2))."""
    import torch

    tis = importlib.import_module("tis")
    sampler_logprobs = torch.full((1, 1), math.log(0.1), dtype=torch.float64)
    learner_logprobs = sampler_logprobs + math.log(ratio)
    mask = torch.ones(1, 1, dtype=torch.bool)
    return float(tis.tis_weights(learner_logprobs, sampler_logprobs, mask, **hyperparameters))


def per_token_push(algo: str, lengths: list[int], group_size: int, **hyperparameters: Any) -> list[float]:
    """-d loss / d log pi of the first token of each completion, for a batch of completions of these lengths, all on
    policy (ratio 1) with advantage +1: the weight the aggregation gives each token of each completion (it is the
    same on every token of a completion, so the first stands for all).
    """
    import torch

    module = importlib.import_module(algo)
    mask = torch.arange(max(lengths))[None, :] < torch.tensor(lengths)[:, None]   # [N, T]
    old_logprobs = torch.full(mask.shape, math.log(0.1), dtype=torch.float64)
    logprobs = old_logprobs.clone().requires_grad_()                        # ratio 1 everywhere
    advantages = torch.ones(len(lengths), dtype=torch.float64)
    loss, _ = module.compute_loss(logprobs, old_logprobs, advantages, mask, group_size, **hyperparameters)
    (gradient,) = torch.autograd.grad(loss, logprobs)
    return [-float(gradient[row, 0]) for row in range(len(lengths))]


def loss_defaults(algo: str) -> dict[str, Any]:
    """The numeric hyper-parameter defaults of ALGO.compute_loss, for the legends (read, so they cannot go stale)."""
    parameters = inspect.signature(importlib.import_module(algo).compute_loss).parameters
    return {
        name: p.default
        for name, p in parameters.items()
        if p.kind is inspect.Parameter.KEYWORD_ONLY and isinstance(p.default, float)
    }


# The losses whose token gradient is drawn, with the line style that keeps overlapping curves apart.
GRADIENT_LOSSES = (
    ("grpo", "GRPO / PPO clip", dict(color="tab:blue", lw=2.5)),
    ("dapo", "DAPO clip-higher", dict(color="tab:orange", lw=2, ls="--")),
    ("gspo", "GSPO, one-token sequence", dict(color="tab:green", lw=2, ls=":")),
    ("cispo", "CISPO truncated weight", dict(color="tab:red", lw=7, alpha=0.3)),
)

# The aggregations compared, on a batch of two prompts with G = 2: the plotted group holds a short and a long
# completion, the other group two long ones (it only matters to the prompt and token denominators).
AGGREGATION_LENGTHS = [4, 40, 40, 40]
AGGREGATION_GROUP_SIZE = 2
AGGREGATIONS = (
    ("GRPO\ntoken mean\nper completion", "grpo", {}),
    # max_tokens: the tiny task's generation budget, which train.py passes (the file's default 1024 is a placeholder).
    ("Dr. GRPO\ntoken sum /\nmax_tokens=48", "drgrpo", {"max_tokens": 48}),
    ("DAPO\ntoken sum /\nthe group's tokens", "dapo", {}),
    ("CISPO\nprompt\n(ScaleRL)", "cispo", {"aggregation": "prompt"}),
    ("CISPO\nsample", "cispo", {"aggregation": "sample"}),
    ("CISPO\ntoken", "cispo", {"aggregation": "token"}),
)


def ratio_grid() -> list[float]:
    """pi / pi_old from 1/4 to 8, evenly on a log scale, 48 points an octave, 1.0 exactly on the grid."""
    return [2.0 ** (k / 48) for k in range(-96, 145)]


def _pyplot() -> Any:
    """matplotlib's pyplot on the Agg backend: it writes files and needs no display."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def draw_gradients(path: Path) -> None:
    """gradients.png: the push on one token against its ratio, for A = +1 and A = -1, and the TIS weight."""
    plt = _pyplot()
    ratios = ratio_grid()
    fig, axes = plt.subplots(1, 3, figsize=(18, 6.2), gridspec_kw={"width_ratios": [1.2, 1.2, 1]})
    for ax, advantage in zip(axes[:2], (+1.0, -1.0)):
        for algo, name, style in GRADIENT_LOSSES:
            push = [-token_gradient(algo, r, advantage) for r in ratios]
            defaults = ", ".join(f"{k}={v:g}" for k, v in loss_defaults(algo).items())
            ax.plot(ratios, push, label=f"{name} ({defaults})", **style)
        ax.plot(ratios, [advantage * r for r in ratios], color="gray", lw=1, ls="-.",
                label="A * ratio: importance-weighted REINFORCE, nothing clipped")
        ax.axhline(0, color="black", lw=0.6)
        ax.axvline(1, color="black", lw=0.6, ls=":")
        ax.set_title(f"advantage A = {advantage:+g}: "
                     + ("the update raises pi (push > 0)" if advantage > 0 else "the update lowers pi (push < 0)"))
        ax.set_ylabel("push on the token: -d loss / d log pi")
    # The numbers in the notes are read from the files too; the arrows point at where the default curves bend.
    grpo, dapo, gspo, cispo = (loss_defaults(algo) for algo in ("grpo", "dapo", "gspo", "cispo"))
    arrow = dict(arrowstyle="->", lw=0.8)
    axes[0].annotate(f"GSPO, GRPO, DAPO: 0 once the ratio has passed\n{1 + gspo['clip_eps_high']:g}, "
                     f"{1 + grpo['clip_eps']:g}, {1 + dapo['clip_eps_high']:g}", xy=(1.3, 0.05), xytext=(2.0, 0.45),
                     fontsize=9, arrowprops=arrow)
    axes[0].annotate(f"CISPO: capped at eps_max = {cispo['eps_max']:g},\nnever 0", xy=(6, 5), xytext=(1.6, 5.8),
                     fontsize=9, arrowprops=arrow)
    axes[1].annotate(f"GRPO, DAPO: 0 below {1 - grpo['clip_eps']:g}\n(GSPO: below {1 - gspo['clip_eps_low']:g})",
                     xy=(0.5, -0.03), xytext=(0.28, -2.2), fontsize=9, arrowprops=arrow)
    axes[1].annotate(f"the min never clips this side:\nthe push grows with the ratio\n(CISPO stops at "
                     f"{cispo['eps_max']:g})", xy=(3.5, -3.5), xytext=(0.3, -6.5), fontsize=9, arrowprops=arrow)

    tis_ax = axes[2]
    tis_ax.plot(ratios, [tis_weight(r) for r in ratios], color="tab:purple", lw=2.5,
                label="TIS, mode='truncate': min(rho, C=2)")
    tis_ax.plot(ratios, [tis_weight(r, mode="mask") for r in ratios], color="tab:brown", lw=2, ls="--",
                label="MIS, mode='mask': rho if rho <= C, else 0")
    tis_ax.plot(ratios, ratios, color="gray", lw=1, ls="-.", label="rho, untruncated")
    tis_ax.set_ylim(-0.2, 4.5)
    tis_ax.set_title("TIS weight (tis.tis_weights), a factor on any loss", fontsize=11)
    tis_ax.set_ylabel("is_weight of the token")
    tis_ax.legend(fontsize=9, loc="upper left")

    for ax, xlabel in zip(axes, ("ratio pi_theta / pi_old", "ratio pi_theta / pi_old",
                                 "rho = pi_learner_old / pi_sampler")):
        ax.set_xscale("log", base=2)
        ax.set_xticks([0.25, 0.5, 0.8, 1, 1.2, 2, 5, 8], ["1/4", "1/2", "0.8", "1", "1.2", "2", "5", "8"], fontsize=8.5)
        ax.set_xlabel(f"{xlabel} (log scale)")
        ax.grid(alpha=0.3)
    fig.legend(*axes[0].get_legend_handles_labels(), loc="lower center", ncol=3, fontsize=9.5, frameon=False)
    fig.suptitle("The gradient each loss puts on one token, by autograd through each file's compute_loss with its "
                 "defaults (a batch of one one-token completion, so GSPO's sequence ratio is the token ratio)",
                 fontsize=12)
    fig.tight_layout(rect=(0, 0.1, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def draw_aggregation(path: Path) -> None:
    """aggregation.png: the push on each token, and on the whole completion, of a short and a long completion."""
    plt = _pyplot()
    short, long = AGGREGATION_LENGTHS[0], AGGREGATION_LENGTHS[1]
    names = [name for name, _, _ in AGGREGATIONS]
    pushes = [per_token_push(algo, AGGREGATION_LENGTHS, AGGREGATION_GROUP_SIZE, **hp) for _, algo, hp in AGGREGATIONS]
    x = range(len(names))
    width = 0.38
    fig, (per_token_ax, per_completion_ax) = plt.subplots(1, 2, figsize=(17, 5.8))
    for offset, row, length, color in ((-width / 2, 0, short, "tab:cyan"), (width / 2, 1, long, "tab:blue")):
        per_token = [push[row] for push in pushes]
        per_completion = [w * length for w in per_token]
        positions = [i + offset for i in x]
        bars = per_token_ax.bar(positions, per_token, width, color=color, label=f"{length}-token completion")
        per_token_ax.bar_label(bars, [f"1/{1 / w:.0f}" for w in per_token], fontsize=8.5)
        bars = per_completion_ax.bar(positions, per_completion, width, color=color,
                                     label=f"{length}-token completion")
        per_completion_ax.bar_label(bars, [f"{w:.3f}" for w in per_completion], fontsize=8.5)
    per_token_ax.set_yscale("log")
    per_token_ax.set_ylabel("push on each of its tokens: -d loss / d log pi (log scale)")
    per_token_ax.set_title("per token: GRPO and CISPO-sample weigh a short answer's tokens 10x more")
    per_completion_ax.set_ylabel("push on the whole completion: per-token push x length")
    per_completion_ax.set_title("per completion: token-level sums weigh the long answer 10x more")
    for ax in (per_token_ax, per_completion_ax):
        ax.set_xticks(list(x), names, fontsize=9)
        ax.legend(loc="upper right")
        ax.grid(axis="y", alpha=0.3)
    per_token_ax.set_ylim(top=max(p[0] for p in pushes) * 4)
    per_completion_ax.set_ylim(top=max(max(p[0] * short, p[1] * long) for p in pushes) * 1.15)
    fig.suptitle(f"How each aggregation weighs a {short}- and a {long}-token completion of the same group, with the "
                 "same advantage A = +1, on policy (ratio 1), by autograd through compute_loss\n"
                 f"(the batch holds a second group, of two {long}-token completions: it enters only the prompt and "
                 "token denominators)", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ----------------------------------------------------------------------------------------------------------------
# Command line
# ----------------------------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    """tools/teach.py's command line: list, exercise, grade and pictures."""
    parser = OneLineParser(description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("list", help="the exercises in teaching order, with their questions")
    exercise_parser = commands.add_parser("exercise", help="write a student copy of ALGO.py into DIR")
    grade_parser = commands.add_parser("grade", help="run tests/test_ALGO.py against DIR/ALGO.py")
    for sub in (exercise_parser, grade_parser):
        sub.add_argument("algo", choices=list(EXERCISE_BY_ALGO), metavar="ALGO", help=", ".join(EXERCISE_BY_ALGO))
        sub.add_argument("dir", type=directory_path, metavar="DIR", help="the student's directory")
    exercise_parser.add_argument("--force", action="store_true", help="overwrite an existing DIR/ALGO.py")
    grade_parser.add_argument("--timeout", type=number(0.0, above=True), default=GRADE_TIMEOUT_S,
                              help=f"seconds the tests may take before they are stopped (default {GRADE_TIMEOUT_S:g})")
    pictures_parser = commands.add_parser("pictures", help="draw gradients.png and aggregation.png")
    pictures_parser.add_argument("--out", type=directory_path, default=REPO / "docs", help="output directory (default "
                                 "docs/)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)

    if args.command == "list":
        print_exercise_list()
        return 0
    if args.command == "exercise":
        try:
            target = write_exercise(args.algo, args.dir, force=args.force)
        except FileExistsError as error:
            print(error, file=sys.stderr)
            return 1
        exercise = EXERCISE_BY_ALGO[args.algo]
        print(f"wrote {target}: write the bodies of {', '.join(exercise.functions)}")
        print(f"question: {exercise.question}")
        print(f"check it with: python -m tools.teach grade {args.algo} {args.dir}")
        return 0
    if args.command == "grade":
        try:
            returncode = grade(args.algo, args.dir, args.timeout)
        except FileNotFoundError as error:
            print(error, file=sys.stderr)
            return 1
        verdict = "PASS" if returncode == 0 else "NOT YET"
        print(f"{verdict}: tests/test_{args.algo}.py against {(args.dir / f'{args.algo}.py').resolve()}")
        return returncode
    args.out.mkdir(parents=True, exist_ok=True)
    for name, draw in (("gradients.png", draw_gradients), ("aggregation.png", draw_aggregation)):
        draw(args.out / name)
        print(f"wrote {args.out / name}")
    return 0


if __name__ == "__main__":
    exit_with(main)
