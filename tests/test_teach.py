"""tools/teach.py: exercises keep signatures and docstrings and carry the equation; the untouched exercise fails
grading and the reference bodies pasted back pass it; the picture curves at hand-computed points."""

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tools import teach

REPO = Path(__file__).resolve().parent.parent
ALGOS = [exercise.algo for exercise in teach.EXERCISES]


def top_level_functions(source: str) -> dict[str, ast.FunctionDef]:
    return {node.name: node for node in ast.parse(source).body if isinstance(node, ast.FunctionDef)}


def restore_bodies(exercise_source: str, reference_source: str, names: tuple[str, ...]) -> str:
    """The exercise with each named function's full reference text pasted back: what a perfect student hands in."""
    reference_lines = reference_source.splitlines()
    reference = top_level_functions(reference_source)
    lines = exercise_source.splitlines()
    exercise = top_level_functions(exercise_source)
    for name in sorted(names, key=lambda n: exercise[n].lineno, reverse=True):
        node, ref = exercise[name], reference[name]
        lines[node.lineno - 1 : node.end_lineno] = reference_lines[ref.lineno - 1 : ref.end_lineno]
    return "\n".join(lines) + "\n"


def run_teach(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tools.teach", *args], capture_output=True, text=True, cwd=REPO)


def test_every_algorithm_file_has_one_exercise_in_teaching_order():
    assert ALGOS == ["grpo", "drgrpo", "dapo", "gspo", "cispo", "tis"]
    assert all(exercise.question.endswith("?") for exercise in teach.EXERCISES)
    listing = run_teach("list")
    assert listing.returncode == 0
    positions = [listing.stdout.index(f"{algo}.py") for algo in ALGOS]
    assert positions == sorted(positions)


@pytest.mark.parametrize("algo", ALGOS)
def test_exercise_keeps_signatures_docstrings_and_helpers_and_hints_the_equation(algo):
    reference_source = (REPO / f"{algo}.py").read_text()
    exercise_source = teach.make_exercise_source(algo)
    reference, exercise = top_level_functions(reference_source), top_level_functions(exercise_source)
    assert reference.keys() == exercise.keys()
    assert ast.get_docstring(ast.parse(exercise_source)) == ast.get_docstring(ast.parse(reference_source))
    equation_title = next(line for line in reference_source.splitlines() if line.startswith("Equation"))
    for name, ref in reference.items():
        ex = exercise[name]
        assert ast.dump(ex.args) == ast.dump(ref.args) and ast.dump(ex.returns) == ast.dump(ref.returns)
        assert ast.get_docstring(ex) == ast.get_docstring(ref)
        if name not in teach.EXERCISE_BY_ALGO[algo].functions:
            assert ast.dump(ex) == ast.dump(ref), f"helper {name} must stay as it is"
            continue
        # The body is the docstring and one `raise NotImplementedError(hint)`.
        assert len(ex.body) == 2 and isinstance(ex.body[1], ast.Raise)
        call = ex.body[1].exc
        assert call.func.id == "NotImplementedError"
        hint = ast.literal_eval(call.args[0])
        assert f"{algo}.{name}" in hint
        assert ("Aggregation unit" if name == "loss_denominator" else equation_title) in hint
    # Pasting the reference bodies back gives the reference file, byte for byte: nothing else was touched.
    names = teach.EXERCISE_BY_ALGO[algo].functions
    assert restore_bodies(exercise_source, reference_source, names) == reference_source


# Two pytest processes per algorithm (about 4 s each on 2 cores): the base, the one whose helpers (filter_groups,
# overlong_penalty) must keep working, ScaleRL's loss, and the file with other function names. The other two differ
# from these only in the text that the byte-for-byte check above already covers.
@pytest.mark.parametrize("algo", ["grpo", "dapo", "cispo", "tis"])
def test_untouched_exercise_fails_grading_and_reference_bodies_pass(algo, tmp_path):
    assert run_teach("exercise", algo, str(tmp_path)).returncode == 0
    student_file = tmp_path / f"{algo}.py"
    untouched = run_teach("grade", algo, str(tmp_path))
    assert untouched.returncode != 0
    # The failures come from the student's file, so the graded run imported it and not the reference.
    # (pytest names it relative to the checkout when the two share a parent folder, e.g. both under /tmp)
    shown_as = [f"{student_file.resolve()}:", f"{os.path.relpath(student_file.resolve(), REPO)}:"]
    assert any(name in untouched.stdout for name in shown_as) and "NotImplementedError" in untouched.stdout

    reference_source = (REPO / f"{algo}.py").read_text()
    names = teach.EXERCISE_BY_ALGO[algo].functions
    student_file.write_text(restore_bodies(student_file.read_text(), reference_source, names))
    solved = run_teach("grade", algo, str(tmp_path))
    assert solved.returncode == 0, solved.stdout + solved.stderr
    assert "PASS" in solved.stdout
    # what a student reads is about their file: not the suite's own count of torchrun reruns, which CI's log ends with
    assert "native crash" not in untouched.stdout + solved.stdout


def test_the_tests_catch_cispo_without_the_detach(tmp_path):
    """The CISPO exercise's question, as a bug: a weight left attached changes the gradient, and grading says so."""
    source = (REPO / "cispo.py").read_text()
    buggy = source.replace("token_loss = -ratio.clamp(low, high).detach() * adv * logprobs",
                           "token_loss = -ratio.clamp(low, high) * adv * logprobs")
    assert buggy != source
    (tmp_path / "cispo.py").write_text(buggy)
    assert run_teach("grade", "cispo", str(tmp_path)).returncode != 0


def test_exercise_refuses_to_overwrite_and_grade_needs_the_file(tmp_path):
    assert run_teach("exercise", "tis", str(tmp_path)).returncode == 0
    assert run_teach("exercise", "tis", str(tmp_path)).returncode == 1
    assert run_teach("exercise", "tis", str(tmp_path), "--force").returncode == 0
    missing = run_teach("grade", "grpo", str(tmp_path))
    assert missing.returncode == 1 and "python -m tools.teach exercise grpo" in missing.stderr


def test_a_reader_that_stops_reading_ends_the_list_quietly():
    """`python -m tools.teach list | head -0`: the command ends with status 1 and nothing on stderr
    (harness/cli.exit_with), where it ended in a BrokenPipeError traceback, or a message when only the exit's flush
    met the closed pipe."""
    proc = subprocess.Popen([sys.executable, "-m", "tools.teach", "list"], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    proc.stdout.close()
    stderr = proc.stderr.read()
    assert proc.wait(timeout=120) == 1 and stderr == "", stderr


# ----------------------------------------------------------------------------------------------------------------
# The picture curves, at hand-computed points: d loss / d log pi of one one-token completion
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "algo, ratio, advantage, expected",
    [
        # PPO clip [0.8, 1.2]: the token pushes with -A * ratio until the ratio passes the clip in A's direction.
        ("grpo", 1.1, +1.0, -1.1),
        ("grpo", 0.5, +1.0, -0.5),     # A > 0 below the range: the min keeps the unclipped term
        ("grpo", 1.5, +1.0, 0.0),      # A > 0 above 1 + eps: clipped, no gradient
        ("grpo", 0.5, -1.0, 0.0),      # A < 0 below 1 - eps: clipped, no gradient
        ("grpo", 3.0, -1.0, 3.0),      # A < 0 above: never clipped, the push grows with the ratio
        # DAPO clip-higher [0.8, 1.28]
        ("dapo", 1.25, +1.0, -1.25),
        ("dapo", 1.3, +1.0, 0.0),
        ("dapo", 0.85, -1.0, 0.85),
        ("dapo", 0.75, -1.0, 0.0),
        # GSPO on a one-token sequence: the sequence ratio is the token ratio, the range [1 - 3e-4, 1 + 4e-4]
        ("gspo", 1.0002, +1.0, -1.0002),
        ("gspo", 1.001, +1.0, 0.0),
        ("gspo", 0.5, +1.0, -0.5),
        ("gspo", 0.999, -1.0, 0.0),
        # CISPO: -A * min(ratio, eps_max) / denominator (one prompt of one token: 1); nonzero above the cap
        ("cispo", 2.0, +1.0, -2.0),
        ("cispo", 8.0, +1.0, -5.0),
        ("cispo", 8.0, -1.0, 5.0),
        ("cispo", 0.25, -1.0, 0.25),
    ],
)
def test_token_gradient_hand_computed(algo, ratio, advantage, expected):
    assert teach.token_gradient(algo, ratio, advantage) == pytest.approx(expected, abs=1e-9)


def test_token_gradient_takes_hyperparameters_and_the_tis_weight_is_min_ratio_c():
    assert teach.token_gradient("cispo", 8.0, 2.0, eps_max=4.0) == pytest.approx(-8.0)
    assert teach.token_gradient("grpo", 1.5, 1.0, clip_eps=0.6) == pytest.approx(-1.5)
    assert [teach.tis_weight(r) for r in (0.5, 1.5, 3.0)] == pytest.approx([0.5, 1.5, 2.0])
    assert [teach.tis_weight(r, mode="mask") for r in (0.5, 3.0)] == pytest.approx([0.5, 0.0])
    assert 1.0 in teach.ratio_grid()                # the clip ranges around 1 are drawn from their centre


def test_per_token_push_hand_computed():
    lengths, group_size = [4, 40, 40, 40], 2         # two prompts: {4, 40} and {40, 40}; N = 4 completions
    expected = {
        ("grpo", ()): [1 / (4 * 4), 1 / (4 * 40), 1 / (4 * 40), 1 / (4 * 40)],   # 1 / (N |y_i|)
        ("drgrpo", (("max_tokens", 48),)): [1 / (4 * 48)] * 4,                  # 1 / (N max_tokens)
        ("dapo", ()): [1 / (2 * 44)] * 2 + [1 / (2 * 80)] * 2,                   # 1 / (P * the group's tokens)
        ("cispo", (("aggregation", "prompt"),)): [1 / (2 * 44)] * 2 + [1 / (2 * 80)] * 2,
        ("cispo", (("aggregation", "sample"),)): [1 / 16, 1 / 160, 1 / 160, 1 / 160],
        ("cispo", (("aggregation", "token"),)): [1 / 124] * 4,                   # 1 / (the batch's tokens)
    }
    for (algo, hyperparameters), weights in expected.items():
        assert teach.per_token_push(algo, lengths, group_size, **dict(hyperparameters)) == pytest.approx(weights)
    # And the picture's table covers exactly these.
    assert teach.AGGREGATION_LENGTHS == lengths and teach.AGGREGATION_GROUP_SIZE == group_size
    assert {(algo, tuple(hp.items())) for _, algo, hp in teach.AGGREGATIONS} == set(expected)


def test_pictures_are_written(tmp_path):
    result = run_teach("pictures", "--out", str(tmp_path))
    assert result.returncode == 0, result.stderr
    for name in ("gradients.png", "aggregation.png"):
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def diff_lines(a: str, b: str, changed_only: bool = False) -> int:
    """Lines of `diff a b` (as `| wc -l` counts them), or only its changed lines (`| grep -c '^[<>]'`)."""
    out = subprocess.run(["diff", a, b], cwd=REPO, capture_output=True, text=True).stdout
    return sum(1 for line in out.splitlines() if not changed_only or line.startswith(("<", ">")))


def test_every_loss_file_is_within_about_100_changed_lines_of_grpo():
    """`diff grpo.py X.py` should show the algorithm and little else (issue 12: about 80 changed lines). A file
    that grows past this repeats in its own words what grpo.py already says; tis.py is not a loss, so not diffed.
    The bound is a guard, not the goal: cispo.py, at 99 (97 before AGGREGATION named its unit), now computes only
    the aggregation it uses, in the order it reads (issue 29), where keeping GRPO's sample-level lines as a base to
    overwrite had held it at 88."""
    losses = ("drgrpo", "gspo", "dapo", "cispo")
    changed = {name: diff_lines("grpo.py", f"{name}.py", changed_only=True) for name in losses}
    assert max(changed.values()) <= 100, changed


def test_the_workshop_quotes_the_diff_sizes_of_the_files_as_they_are():
    """docs/WORKSHOP.md tells instructors how long each diff is; it must follow the algorithm files."""
    import re

    text = (REPO / "docs" / "WORKSHOP.md").read_text()
    quoted = dict(re.findall(r"\| `(\w+)\.py` \| (\d+) \|", text))
    assert set(quoted) == {"drgrpo", "gspo", "dapo", "cispo"}
    assert {name: diff_lines("grpo.py", f"{name}.py") for name in quoted} == {k: int(v) for k, v in quoted.items()}
    lines = len((REPO / "grpo.py").read_text().splitlines())
    assert f"`grpo.py` ({lines} lines)" in text
    assert f"`diff dapo.py cispo.py | wc -l` counts {diff_lines('dapo.py', 'cispo.py')} lines" in text


def _same_but_for_the_last_digit(quoted: str, printed: str) -> bool:
    """Whether two outputs say the same, blank lines aside, each number to within one unit of the last digit it is
    quoted with (a fit on another CPU may round its last digit the other way)."""
    import re

    quoted, printed = ("\n".join(line for line in text.splitlines() if line.strip()) for text in (quoted, printed))
    number = re.compile(r"-?\d+\.\d+|-?\d+")
    if number.sub("#", quoted) != number.sub("#", printed):
        return False
    for a, b in zip(number.findall(quoted), number.findall(printed), strict=True):
        unit = 10.0 ** -len(a.partition(".")[2])
        if abs(float(a) - float(b)) > 1.01 * unit:
            return False
    return True


def test_the_workshops_fit_is_what_its_command_prints_on_the_committed_runs(tmp_path):
    """Section 6 of docs/WORKSHOP.md fits the first half of two default runs that every clone has (their records in
    docs/default-runs), with the command it shows: the command prints what the section quotes, and the compute it
    fits until is half of the first run's, which the section gives."""
    import json
    import re
    import shlex

    section = (REPO / "docs" / "WORKSHOP.md").read_text().split("## 6. ")[1].split("\n## 7. ")[0]
    command_block, output_block = re.findall(r"```(?:bash)?\n(.*?)```", section, flags=re.S)[:2]
    argv = shlex.split(command_block.strip().removeprefix("time "))
    assert argv[:2] == ["python", "scaling_fit.py"], argv
    records = [REPO / arg for arg in argv[2:argv.index("--fit-until")]]
    assert len(records) == 2 and all(record.parent.name == "default-runs" for record in records), records
    total = json.loads(records[0].read_text())["rows"][-1]["compute_hours"]
    fit_until = float(argv[argv.index("--fit-until") + 1])
    assert fit_until == pytest.approx(total / 2, abs=1e-4), (fit_until, total)
    assert f"{total:.4f} device-hours" in section, total
    rest = argv[argv.index("--fit-until"):]
    run = subprocess.run([sys.executable, str(REPO / "scaling_fit.py"), *map(str, records), *rest], cwd=tmp_path,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert _same_but_for_the_last_digit(output_block, run.stdout), run.stdout
    assert (tmp_path / "scaling_fit.png").stat().st_size > 0  # where the section says the figure goes


def test_a_student_loop_that_never_ends_is_stopped_and_named(tmp_path):
    """Grading a file whose function never returns (a `while` whose condition never changes) hung until someone
    pressed Ctrl-C, in a room of students: now the tests are stopped past --timeout and the line says why."""
    assert run_teach("exercise", "grpo", str(tmp_path)).returncode == 0
    student = tmp_path / "grpo.py"
    source = student.read_text()
    stub = "    # EXERCISE: replace the raise below with your implementation.\n"
    assert stub in source, "the exercise's stubs changed their words: update this test"
    student.write_text(source.replace(stub, stub + "    while True:\n        pass\n", 1))
    graded = run_teach("grade", "grpo", str(tmp_path), "--timeout", "3")
    assert graded.returncode == 1 and "NOT YET" in graded.stdout
    assert f"the tests did not finish in 3 s and were stopped: does a loop in {student} never end?" in graded.stderr
