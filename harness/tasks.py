"""harness/tasks.py: prompts, verifiable rewards and data loaders. The base models a run starts from (the tiny one
built here, a real one converted) are harness/base_model.py's.

Everything the RL loop needs to know about *what* it is learning lives here; nothing here knows about losses,
vLLM scheduling or FSDP. `pipeline_rl.py` draws prompts from a `Task` and scores completions with `Task.reward`.

1. The embedded task (`ArithmeticTask`): column addition with a scratchpad
   Prompt:      "add 347 289"
   Completion:  "<think> 7+9+0=16 4+8+1=13 3+2+1=06 </think> 636"
   One scratchpad step per column, least significant first: the two digits, the carry in and their two-digit sum.
   Every step has the same width, so the digits a step needs sit at fixed offsets: a transformer of under a
   million parameters learns the procedure in a few hundred SFT steps. Everything is generated from a seed; nothing is downloaded.
   - Splits: a problem belongs to the validation split when a hash of (a, b) falls in a fixed 1/16 bucket,
     so train and validation are disjoint by construction, deterministic, and the train stream is unlimited.
   - Reward convention: +1 for a correct answer, -1 otherwise (ScaleRL and DAPO use +1/-1). The pass rate is the
     fraction of completions with reward > 0.
   - Strict parsing: the completion must be exactly `<think> ... </think> INTEGER` (surrounding whitespace is
     allowed). Two answers, stray or repeated tags, signs, leading zeros or anything after the answer score -1.
   - `VerifiedArithmeticTask` (`--dataset arithmetic-verified`) checks the scratchpad too, so that a tight think
     budget is a hard ceiling known in advance: the task of the miniature ScaleRL study
     (`python -m tools.experiments study`).

2. Real data (`MathDataset`): math problems from a hub name (through `datasets`), a Parquet file (pyarrow) or a local
   JSONL/JSON/CSV file (read line by line with the standard library, so that every row keeps its file line), with
   configurable question/answer fields (GSM8K: question/answer with "#### 42"; Polaris-53K: problem/answer).
   The reward is math-verify's verdict (`check_answer`): each side's final answer (\\boxed{} first, then GSM8K's
   ####) parsed from LaTeX and compared by value with sympy, in a process of its own that kills an answer past 1 s
   (`MathVerifier`), so that a hostile answer costs a bounded time in whichever thread or process scores it.
   `python -m harness.tasks check-answer` prints, per answer pair, what was extracted and compared.
   `math_answers_match`, the normalised-text comparison it replaced, is kept as the baseline that the labelled pairs
   measure. Bad rows (a line that is not JSON, a missing field, a question that is not text...) are all collected and
   raised as one `DataFileError` naming each by file, line (or row) and field, or are skipped and reported
   (`MathDataset.skipped_summary`) with `skip_bad_rows=True`.
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import itertools
import json
import math
import os
import random
import re
import signal
import sys
import threading
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path
from typing import Any, Callable, Iterator, Protocol

from harness.cli import OneLineParser  # one error line for a bad flag, no usage block (its subcommands too)
from harness.cli import exit_with  # a closed stdout (`| head`) ends the command quietly
from harness.cli import path_text, path_value  # the argparse types of a path: not empty, its ~ the home directory
from harness.cli import text_value  # the argparse type of a name: not empty
from harness.cli import no_model_config  # a --model directory without config.json, a run's named as one
from harness.cli import int_at_least, number  # the argparse types of a count and a finite number
from harness.cli import output_file, write_output  # a file written after the work: checked before it
from harness.cli import git_lfs_pointers  # a clone made without git-lfs: its data files are pointers

REPO_DIR = Path(__file__).resolve().parent.parent  # the repository root: this module lives in harness/

# Environment that vLLM on CPU needs; set before vllm is imported anywhere (harness/runtime.py and
# harness/vllm_replica.py set it).
VLLM_CPU_ENV = {
    "TORCHDYNAMO_DISABLE": "1",  # first generate call ~37 s -> ~1.4 s on CPU
    "VLLM_HOST_IP": "127.0.0.1",
    "HF_HUB_OFFLINE": "1",  # no model-hub access on these machines; local paths still work
    "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB; a replica takes more for a longer context (vllm_replica.cpu_kv_cache_bytes)
    "TOKENIZERS_PARALLELISM": "false",
    # vLLM's engine inside the process that calls LLM(), not in an engine process and a worker process of its own:
    # one import of vLLM instead of three, and `build-base`'s measurement of the tiny model took 13 s instead of
    # 31 s. A replica sets this for itself (harness/fleet.py's FleetConfig.engine_process).
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
}


def set_vllm_cpu_env() -> None:
    """Set the environment vLLM needs on these CPU machines, without overriding what the user set. On a machine
    with CUDA it sets nothing: there vLLM runs on the GPU, may reach the hub, and compiles with dynamo."""
    import torch  # here, as elsewhere in this file: the task and its verifier need no torch

    if torch.cuda.is_available():
        return
    for key, value in VLLM_CPU_ENV.items():
        os.environ.setdefault(key, value)


# --------------------------------------------------------------------------------------------------------------
# The task interface
# --------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Problem:
    """One prompt with its reference answer. `prompt` is the user message, before the chat template."""

    id: str
    prompt: str
    answer: str


class Task(Protocol):
    name: str
    interruption_phrase: str  # appended by the generator when thinking runs out of budget (ScaleRL)

    def train_stream(self, seed: int, start: int = 0) -> Iterator[tuple[int, Problem]]:
        """Unlimited (index, problem) stream; `start` skips to a saved data position."""
        ...

    def validation(self, n: int | None = None) -> list[Problem]: ...

    def reward(self, problem: Problem, completion: str) -> float: ...


SCALERL_INTERRUPTION = "Okay, time is up. Let me stop thinking and formulate a final answer now. </think>"

def chat_prompt_ids(tokenizer: Any, prompt: str) -> list[int]:
    """Token ids of the chat-templated user turn, ending with the assistant header (the generation prompt)."""
    ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                        tokenize=True, return_dict=False)
    return list(ids)


def tokenizer_problem(model_dir: str | Path) -> str | None:
    """Why the tokenizer of a local model directory cannot template a prompt (`chat_prompt_ids`), in one line: it does
    not load (a file cut short), or it has no chat template (a base model saved without one: Llama's and Mistral's
    bases). None when it templates. Asked of transformers itself (a template may sit in chat_template.jinja,
    chat_template.json or tokenizer_config.json)."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    except Exception as e:  # JSONDecodeError, OSError, ValueError: transformers' words, in one line
        why = (str(e).strip().splitlines() or [""])[0][:200]
        for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.json"):
            try:  # a JSON file cut short is named: transformers' JSONDecodeError names none
                json.loads((Path(model_dir) / name).read_bytes())
            except FileNotFoundError:
                continue
            except (OSError, ValueError):
                return f"{Path(model_dir) / name}: not valid JSON, and the tokenizer does not load without it " \
                       f"({type(e).__name__}: {why}): a file cut short?"
        return f"{model_dir}: its tokenizer does not load ({type(e).__name__}: {why})"
    if tokenizer.chat_template is not None:
        return None
    return (f"{model_dir}: its tokenizer has no chat template, and every prompt is chat-templated (the user turn, then "
            "the assistant's header): give an instruct model or one whose base has a template (Qwen3's), or save a "
            "template into it (chat_template.jinja)")


# --------------------------------------------------------------------------------------------------------------
# 1. The embedded task: column addition with a scratchpad
# --------------------------------------------------------------------------------------------------------------

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"

_ANSWER_RE = re.compile(r"\s*<think>(?P<think>(?:(?!<think>|</think>).)*)</think>\s*(?P<answer>0|[1-9][0-9]{0,40})\s*", re.S)


def text_after_thinking(completion: str) -> str:
    """What follows the last </think> (which ends a forced interruption phrase), else the whole completion."""
    return completion.rsplit(THINK_CLOSE, 1)[1] if THINK_CLOSE in completion else completion


def _split_of(a: int, b: int) -> str:
    digest = hashlib.blake2b(f"{a}+{b}".encode(), digest_size=2).digest()
    return "val" if digest[0] % 16 == 0 else "train"


def scratchpad(a: int, b: int, slips: set[int] = frozenset()) -> tuple[str, int]:
    """The column-by-column solution of a + b. Columns in `slips` write a sum off by one (a deliberate mistake);
    later columns carry on from the faulty sum, and the returned answer follows the faulty scratchpad."""
    da, db = str(a)[::-1], str(b)[::-1]
    steps, digits, carry = [], [], 0
    for col in range(max(len(da), len(db))):
        x = int(da[col]) if col < len(da) else 0
        y = int(db[col]) if col < len(db) else 0
        s = x + y + carry
        if col in slips:
            s = s + 1 if s < 19 else s - 1
        steps.append(f"{x}+{y}+{carry}={s:02d}")  # fixed width: every column is the same number of tokens
        digits.append(s % 10)
        carry = s // 10
    if carry:
        digits.append(carry)
    answer = int("".join(str(d) for d in reversed(digits)))
    return " ".join(steps), answer


@dataclass
class ArithmeticTask:
    """Addition of two numbers of `min_digits`..`max_digits` digits, solved with a column scratchpad."""

    min_digits: int = 3
    max_digits: int = 3
    split_seed: int = 1234  # seed of the fixed validation list
    name: str = "arithmetic"
    interruption_phrase: str = " time is up </think>"  # short: the tiny model thinks in ~30 tokens

    def _draw(self, rng: random.Random) -> tuple[int, int]:
        na, nb = rng.randint(self.min_digits, self.max_digits), rng.randint(self.min_digits, self.max_digits)
        return rng.randint(10 ** (na - 1), 10**na - 1), rng.randint(10 ** (nb - 1), 10**nb - 1)

    def problem(self, a: int, b: int) -> Problem:
        return Problem(id=f"add-{a}-{b}", prompt=f"add {a} {b}", answer=str(a + b))

    def train_stream(self, seed: int, start: int = 0) -> Iterator[tuple[int, Problem]]:
        """Index i of the stream is the i-th train-split draw of Random(seed): resumable by index."""
        rng, index = random.Random(seed), 0
        while True:
            a, b = self._draw(rng)
            if _split_of(a, b) != "train":
                continue
            if index >= start:
                yield index, self.problem(a, b)
            index += 1

    def validation(self, n: int | None = 256) -> list[Problem]:
        rng, seen, out = random.Random(self.split_seed), set(), []
        while len(out) < (n or 256):
            a, b = self._draw(rng)
            if _split_of(a, b) == "val" and (a, b) not in seen:
                seen.add((a, b))
                out.append(self.problem(a, b))
        return out

    def solution(self, problem: Problem, slips: set[int] = frozenset()) -> str:
        a, b = (int(x) for x in problem.prompt.split()[1:])
        steps, answer = scratchpad(a, b, slips)
        return f"{THINK_OPEN} {steps} {THINK_CLOSE} {answer}"

    def reward(self, problem: Problem, completion: str) -> float:
        return 1.0 if parse_answer(completion) == problem.answer else -1.0


@dataclass
class VerifiedArithmeticTask(ArithmeticTask):
    """The embedded task with its scratchpad verified as well (`--dataset arithmetic-verified`): +1 only when the
    thinking is exactly the column procedure of `scratchpad`, spaces included, and the answer is right.

    With the answer alone verified, a completion interrupted before its last column can still score by guessing
    or by learning to add that column without writing it, and a policy can learn to drop the spaces to fit a tighter
    budget, so a tight `--think-budget` gives a soft ceiling that keeps creeping up. Verified, the written scratchpad
    is `<think>` plus 28 tokens, so its `</think>` is token 30 of the completion; an interrupted one always scores
    -1, and the pass rate can never exceed P(b >= 30) for the drawn budget b: 0.7 for `--think-budget 27,36`. A
    hard ceiling known in advance, which the miniature study (`python -m tools.experiments study`) can check its
    fitted asymptotes against. (A subclass, not a flag of ArithmeticTask: the base model's cache fingerprint reads that
    class.)"""

    name: str = "arithmetic-verified"

    def reward(self, problem: Problem, completion: str) -> float:
        m = _ANSWER_RE.fullmatch(completion)
        if m is None or m.group("think") != _ANSWER_RE.fullmatch(self.solution(problem)).group("think"):
            return -1.0
        return super().reward(problem, completion)


def parse_answer(completion: str) -> str | None:
    """Strictly parse `<think> ... </think> INTEGER`; None when the completion does not have exactly that shape."""
    m = _ANSWER_RE.fullmatch(completion)
    return m.group("answer") if m else None


_COLUMN_STEP_RE = re.compile(r"\d\+\d\+\d=(?P<carry>\d)(?P<digit>\d)")


def scratchpad_answer(completion: str) -> str | None:
    """The answer a completion's own scratchpad spells: its column sums' last digits, most significant first, after
    the last column's carry; None when the completion is not `<think> STEP ... </think> INTEGER` with column steps.
    `<think> 7+6+0=13 3+3+1=07 9+9+0=18 </think>` spells 1873, whether or not 937 + 936 is 1873."""
    m = _ANSWER_RE.fullmatch(completion)
    steps = [_COLUMN_STEP_RE.fullmatch(step) for step in m.group("think").split()] if m else []
    if not steps or not all(steps):
        return None
    return str(int(steps[-1].group("carry") + "".join(step.group("digit") for step in reversed(steps))))


# --------------------------------------------------------------------------------------------------------------
# 2. Real data: math problems through `datasets`, and a math answer checker
# --------------------------------------------------------------------------------------------------------------


class BadRowError(ValueError):
    """Data rows that cannot become Problems; the message names the file (or hub split), the line or row, and the
    field. What the loaders raise is its subclass DataFileError."""


@dataclass(frozen=True)
class BadRow:
    """One row that cannot become a Problem. `reason` is short and the same for alike rows (skipped rows are
    counted by it); `detail` says what this row holds."""

    where: str  # "data.jsonl line 7", "data.json line 3, item 1", "data.parquet row 12", "openai/gsm8k:train row 5"
    reason: str  # "not JSON", "missing field 'answer'", "field 'question' has type int instead of a string", ...
    detail: str = ""

    def __str__(self) -> str:
        return f"{self.where}: {self.reason}" + (f" ({self.detail})" if self.detail else "")


class DataNotFoundError(FileNotFoundError):
    """A data set that is neither a local file nor on a reachable hub; the message names it and says so."""


class DataConfigError(DataNotFoundError):
    """A hub data set's configuration missing or not one of the set's (datasets' words); the caller names its flag."""


def config_hint(error: Exception, flag: str) -> str:
    """The flag that gives a hub set its configuration, for an error message, where the error is a missing or unknown
    configuration (DataConfigError)."""
    return f" ({flag} NAME)" if isinstance(error, DataConfigError) else ""


class DataFileError(BadRowError):
    """Every bad row of one data source at once (the first BAD_ROWS_SHOWN listed, then a count of the rest, by
    reason), or a file that cannot be read as rows at all. `bad_rows` holds all of them (empty for a whole file)."""

    def __init__(self, message: str, bad_rows: list[BadRow] | None = None) -> None:
        super().__init__(message)
        self.bad_rows = bad_rows or []


BAD_ROWS_SHOWN = 30  # an error lists this many bad rows, then counts the rest
_QUESTION_FIELDS = ("question", "problem", "prompt")
_ANSWER_FIELDS = ("answer", "solution", "final_answer")
_LOCAL_SUFFIXES = (".json", ".jsonl", ".csv", ".parquet")
_JSON_SPACE = re.compile(r"[ \t\n\r]*")


def is_local_data_file(name_or_path: str) -> bool:
    """A local file: a name ending in .json/.jsonl/.csv/.parquet, or any file that exists (anything else is a hub
    data set name: an existing data.txt taken for one would fail with a hub error that never names the file)."""
    return Path(name_or_path).suffix.lower() in _LOCAL_SUFFIXES or Path(name_or_path).is_file()


def takes_config(name_or_path: str) -> bool:
    """Whether a data set has configurations to choose from (`--dataset-config`): a hub set, or a local directory,
    which may be a clone of one (its README names the configurations, as openai/gsm8k's does); a data file does not."""
    return name_or_path not in EMBEDDED_TASKS and not is_local_data_file(name_or_path)


def data_file_kind_problem(name_or_path: str) -> str | None:
    """Why a local file cannot be read as data whatever it holds: its suffix is none of the kinds read here."""
    suffix = Path(name_or_path).suffix.lower()
    if not is_local_data_file(name_or_path) or suffix in _LOCAL_SUFFIXES:
        return None
    return (f"{name_or_path}: a local file of unknown kind ({suffix or 'no suffix'}); data files are "
            f"{', '.join(_LOCAL_SUFFIXES)}")


@dataclass(frozen=True)
class _NotARow:
    """A line of a file that holds no row (not JSON, not UTF-8, a CSV line with the wrong number of cells)."""

    reason: str
    detail: str = ""


@dataclass
class DataRows:
    """The rows of one data source as they are in it, unvalidated, each with where it is."""

    source: str  # the file or hub split, as messages name it
    # (index, where, row): the index counts the rows of the source from 0 (the Problem ids use it); a row is what
    # the source holds there (a dict when all is well), or a _NotARow for a line that could not be read as one.
    rows: list[tuple[int, str, Any]] = field(default_factory=list)


def read_rows(name_or_path: str, split: str = "train", config: str | None = None) -> DataRows:
    """The rows of a local .jsonl/.json/.csv/.parquet file or of a hub data set split (with its configuration
    `config`, e.g. "main" for openai/gsm8k), as they are in the source, each named by where it is.

    JSON Lines, JSON and CSV files are read with the standard library, so that every row keeps its 1-based file
    line and a line that is not JSON is a bad row of its own: datasets' JSON reader fails on the whole file with
    a pyarrow message that names neither, and fills the keys a row lacks with None. A .json file holds one list
    of row objects (a row is named by the line it starts on and its list index from 0) or JSON Lines, as datasets
    accepts. CSV: the header line names the fields and every cell is text. Parquet files are read by pyarrow, hub
    sets through `datasets.load_dataset`; their rows are named "row N", counted from 0 as `dataset[N]` counts them.
    A local directory, a hub set's clone among them, is read as its data files of the split (`_directory_rows`).
    """
    if Path(name_or_path).is_dir() and not is_local_data_file(name_or_path):  # not a data.jsonl/
        return _directory_rows(Path(name_or_path), split, config)
    if not is_local_data_file(name_or_path):
        import datasets

        label = _split_label(name_or_path, split, config)
        try:
            hub_rows = datasets.load_dataset(name_or_path, config, split=split)
        except (ConnectionError, FileNotFoundError) as e:  # offline: ConnectionError; online: DatasetNotFoundError
            raise DataNotFoundError(f"{name_or_path}: not a local file and not found on the hub (offline?): "
                                    f"{str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
        except ValueError as e:
            raise _datasets_words(e, label) from None
        return _dataset_rows(hub_rows, label)
    path, source = Path(name_or_path), name_or_path
    if config:
        raise ValueError(f"a data set configuration ({config!r}) names a part of a hub data set; {path} is a "
                         "local file")
    if not path.exists():
        raise FileNotFoundError(f"data file not found: {path}")
    if problem := data_file_kind_problem(name_or_path):
        raise DataFileError(problem)
    if pointer := git_lfs_pointers([path]):  # a hub set's clone without git-lfs: its lines would be "not JSON"
        raise DataFileError(pointer)
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        return _some_rows(_parquet_rows(path, source))
    try:
        data = path.read_bytes()
    except OSError as e:  # unreadable (permissions, a directory, an I/O error): one line naming the file
        raise DataFileError(f"{source}: cannot be read ({e.strerror or type(e).__name__})") from None
    if suffix == ".csv":
        return _some_rows(_csv_rows(data, source), data)
    if suffix == ".json" and data.removeprefix(b"\xef\xbb\xbf").lstrip()[:1] == b"[":  # past a byte order mark
        return _some_rows(_json_array_rows(data, source), data)
    rows = _json_lines_rows(data, source)
    if suffix == ".json" and rows.rows and all(isinstance(r, _NotARow) for _, _, r in rows.rows):
        # Most likely one pretty-printed object: say so rather than list each of its lines as "not JSON".
        raise DataFileError(f"{source}: neither a list of row objects nor one JSON object per line")
    return _some_rows(rows, data)


def _split_label(source: str, split: str, config: str | None) -> str:
    """How a split of a hub set or a directory is named in messages and row names: "openai/gsm8k (main):train"."""
    return f"{source}{f' ({config})' if config else ''}:{split}"


def _datasets_words(error: ValueError, label: str) -> Exception:
    """datasets' ValueError for a split or a configuration the set does not have, as one line naming the set (a
    DataConfigError, whose caller names its flag); any other ValueError as it came."""
    lines = str(error).splitlines() or [""]
    if lines[0].startswith("Unknown split"):  # 'Unknown split "test". Should be one of [...]'
        return DataNotFoundError(f"{label}: {lines[0]}")
    if lines[0] == "Config name is missing." or lines[0].startswith("BuilderConfig '"):
        return DataConfigError(f"{label}: {' '.join(lines[:2])}")
    return error


def _directory_rows(path: Path, split: str, config: str | None = None) -> DataRows:
    """A local directory of data files: the files of `split` as `datasets` finds them (from their names: train*,
    test*, validation*; without such names all are train; in a hub set's clone, as its README's configuration
    `config` names them), each read as `read_rows` reads a file, so that a bad row is named by its file and line
    (through `datasets.load_dataset`, one bad line failed the whole directory with a traceback). The rows are indexed
    on across the files, in the files' order.

    Not `datasets.load_dataset(path, config)`: datasets 5.2 caches a clone's rows under its directory's name and its
    README alone, so a second clone of that name (another version, an edited copy) was given the first one's rows."""
    import datasets

    label = _split_label(str(path), split, config)
    if glob.has_magic(resolved := path.resolve().as_posix()):  # datasets globs below it: it would find no file
        raise DataFileError(f"{path}: its path ({resolved}) holds *, ? or [, and datasets reads a directory's path "
                            "as a pattern, which matches other directories or none: rename it, or give a file")
    try:
        files = datasets.load_dataset_builder(str(path), config).config.data_files or {}
    except FileNotFoundError:  # datasets' EmptyDatasetError
        raise DataFileError(f"{path}: a directory with no data files (data files are "
                            f"{', '.join(_LOCAL_SUFFIXES)})") from None
    except ValueError as e:  # a clone's configuration missing (its README names several) or not one of its own
        raise _datasets_words(e, label) from None
    if split not in files:
        raise DataFileError(f"{path}: no {split} split among its data files (it has {', '.join(map(str, files))}: "
                            f"name a file {split}*, or give the file itself)")
    rows = DataRows(label)
    for file in files[split]:
        rows.rows += [(len(rows.rows) + i, where, row) for i, where, row in read_rows(str(file)).rows]
    return rows


def _some_rows(rows: DataRows, data: bytes | None = None) -> DataRows:
    """`rows`, unless the file holds none: then one DataFileError naming it (a data set of no rows is no data set,
    and each reader would say so in its own words, or later)."""
    if not rows.rows:
        why = "it is empty" if data is not None and not data.strip() else "no row in it"
        raise DataFileError(f"{rows.source}: holds no rows ({why})")
    return rows


def _parquet_rows(path: Path, source: str) -> DataRows:
    """A Parquet file's rows, read by pyarrow (datasets' own Parquet reader); a file it cannot read (corrupt, cut
    short, not Parquet, not readable) is DataFileError naming it, with the first line of pyarrow's reason rather
    than its traceback.

    Not `datasets.load_dataset("parquet", ...)`: its cache knows a local file by its path and modification time, so
    a file replaced by another of the same time (`cp -p`, `rsync -t`, an archive) was given the first one's rows."""
    import pyarrow.parquet

    try:
        return _dataset_rows(pyarrow.parquet.read_table(path).to_pylist(), source)
    except Exception as e:  # pyarrow's ArrowInvalid, OSError
        why = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        raise DataFileError(f"{source}: not a readable Parquet file ({type(e).__name__}: {why})") from None


def prompt_overflow(problem: Problem, n: int, max_tokens: int, max_model_len: int) -> str | None:
    """Why `problem`'s prompt, `n` tokens once chat-templated (`chat_prompt_ids`), cannot be generated from (with
    max_tokens it exceeds the context max_model_len), naming its id (the file and row of a data set's prompt), or
    None when it fits."""
    if n + max_tokens <= max_model_len:
        return None
    return (f"prompt {problem.id} has {n} tokens: with max_tokens {max_tokens} it exceeds the context, "
            f"max_model_len {max_model_len}")


def _dataset_rows(rows: Any, source: str) -> DataRows:
    # datasets gives every row every column, None where the row has no value: drop those, so that a missing field
    # is judged, and the row's keys listed, as the row really is.
    return DataRows(source, [(i, f"{source} row {i}", {k: v for k, v in row.items() if v is not None}
                              if isinstance(row, dict) else row) for i, row in enumerate(rows)])


def _excerpt(value: Any, width: int = 40) -> str:
    """A short view of a value for a message: a string quoted, anything else as JSON (or repr) text."""
    if isinstance(value, str):
        return repr(value[:width] + "..." if len(value) > width else value)
    try:
        text = json.dumps(value)
    except (TypeError, ValueError):  # parquet and hub rows may hold bytes, dates...
        text = repr(value)
    return text[:width] + "..." if len(text) > width else text


def _decode(data: bytes, source: str) -> str:
    """A whole .json or .csv file as text; a file that is not UTF-8 is named with the line of its first bad byte."""
    try:
        return data.decode("utf-8-sig")  # -sig: spreadsheets write a byte order mark
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        raise DataFileError(f"{source} line {line}: not UTF-8 text ({e.reason})") from None


def _json_lines_rows(data: bytes, source: str) -> DataRows:
    out, index = DataRows(source), 0
    # Split the bytes on "\n" (not str.splitlines, which also splits on \r, \x0c, \u2028...): lines as editors count.
    for lineno, raw in enumerate(data.split(b"\n"), 1):
        where = f"{source} line {lineno}"
        try:
            text = raw.decode("utf-8-sig" if lineno == 1 else "utf-8")
        except UnicodeDecodeError as e:
            out.rows.append((index, where, _NotARow("not UTF-8", f"byte {e.start + 1} of the line")))
            index += 1
            continue
        if not text.strip():
            continue  # blank lines hold no row (datasets skips them too), and do not count as rows
        try:
            row: Any = json.loads(text)
        except json.JSONDecodeError as e:
            row = _NotARow("not JSON", f"{e.msg} at column {e.colno}: {_excerpt(text.strip())}")
        except (ValueError, RecursionError) as e:  # an integer past Python's digit limit, absurd nesting
            row = _NotARow("not JSON", str(e)[:100])
        out.rows.append((index, where, row))
        index += 1
    return out


def _json_array_rows(data: bytes, source: str) -> DataRows:
    """A .json file holding one list: each item is a row, named by the line it starts on and its index."""
    text = _decode(data, source)
    decoder, out = json.JSONDecoder(), DataRows(source)
    pos = _JSON_SPACE.match(text, text.index("[") + 1).end()
    line, counted_to = 1, 0
    try:
        if text[pos : pos + 1] != "]":
            while True:  # json.load would do, but says nothing of where each item starts
                line, counted_to = line + text.count("\n", counted_to, pos), pos
                item, end = decoder.raw_decode(text, pos)
                out.rows.append((len(out.rows), f"{source} line {line}, item {len(out.rows)}", item))
                pos = _JSON_SPACE.match(text, end).end()
                if text[pos : pos + 1] == ",":
                    pos = _JSON_SPACE.match(text, pos + 1).end()
                elif text[pos : pos + 1] == "]":
                    break
                else:
                    raise json.JSONDecodeError("Expecting ',' delimiter or ']'", text, pos)
        if text[pos + 1 :].strip(" \t\n\r"):
            raise json.JSONDecodeError("Extra data", text, _JSON_SPACE.match(text, pos + 1).end())
    except json.JSONDecodeError as e:  # the list itself is broken: no row of it can be trusted, skipped or not
        raise DataFileError(f"{source} line {e.lineno} column {e.colno}: not JSON ({e.msg}); a .json file holds "
                            "one list of row objects, or one object per line") from None
    except (ValueError, RecursionError) as e:
        raise DataFileError(f"{source}: not JSON ({str(e)[:100]})") from None
    return out


def _csv_rows(data: bytes, source: str) -> DataRows:
    """CSV with a header line: every cell is text, so here a question "42" is the string "42"."""
    import csv
    import io

    reader = csv.reader(io.StringIO(_decode(data, source), newline=""))
    out = DataRows(source)
    try:
        header = [name.strip() for name in next(reader, [])]
        start = reader.line_num + 1  # a quoted cell may span lines: a row is named by its first line
        for cells in reader:
            if cells:  # [] is a blank line
                where = f"{source} line {start}"
                if len(cells) == len(header):
                    out.rows.append((len(out.rows), where, dict(zip(header, cells))))
                else:  # most often an unquoted comma inside a question
                    out.rows.append((len(out.rows), where, _NotARow(
                        "wrong number of cells", f"{len(cells)} cells, the header has {len(header)}")))
            start = reader.line_num + 1
    except csv.Error as e:  # e.g. a cell over csv.field_size_limit(): the reader cannot go on
        raise DataFileError(f"{source} line {reader.line_num}: not CSV ({e})") from None
    return out


class _Reject(Exception):
    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(reason)
        self.reason, self.detail = reason, detail


def rows_to_problems(
    rows: DataRows | Any, question_field: str | None = None, answer_field: str | None = None,
    skip_bad_rows: bool = False, source: str = "data",
) -> tuple[list[Problem], list[BadRow]]:
    """Validate rows into Problems with ids f"{source}-{row index}"; returns (problems, the bad rows skipped).

    `rows` is a DataRows from `read_rows`, or any sequence of dicts (a datasets.Dataset, a list), whose rows are
    then named f"{source} row N". The question and answer fields are `question_field`/`answer_field`, else the
    first of question/problem/prompt and answer/solution/final_answer that the rows have. A row is bad when:
    - it is not an object (or its line is not JSON), or a field is absent or null (judged on the row as it is in
      the file; the message lists the keys the row has);
    - the question is not a non-empty string: a number such as 42 is a bad row, never the prompt "42" (in CSV
      every cell is text, so there "42" is a string);
    - the answer is neither a non-empty string nor a finite number: math sets often store answers as numbers, so
      42 or 0.5 become "42" or "0.5" (a bool is bad);
    - a GSM8K answer has nothing after "####", or a solution with </think> or \\boxed has no final answer.
    Every bad row is found before anything is raised: without `skip_bad_rows`, one DataFileError lists them all
    (the first BAD_ROWS_SHOWN, then a count of the rest), each with its file and line (or row) and field.
    """
    data = rows if isinstance(rows, DataRows) else _dataset_rows(rows, source)
    keys = list(dict.fromkeys(k for _, _, row in data.rows if isinstance(row, dict) for k in row))
    q_field = _pick_field(question_field, _QUESTION_FIELDS, keys, "question", data.source)
    a_field = _pick_field(answer_field, _ANSWER_FIELDS, keys, "answer", data.source)
    problems, bad = [], []
    for index, where, row in data.rows:
        try:
            if isinstance(row, _NotARow):
                raise _Reject(row.reason, row.detail)
            if not isinstance(row, dict):
                raise _Reject("not a JSON object", f"{type(row).__name__} {_excerpt(row)}")
            question = _text_field(row, q_field, numbers=False)
            answer = _final_answer(_text_field(row, a_field, numbers=True), a_field)
        except _Reject as e:
            bad.append(BadRow(where, e.reason, e.detail))
            continue
        problems.append(Problem(id=f"{source}-{index}", prompt=question, answer=answer))
    if bad and not skip_bad_rows:
        raise DataFileError(_bad_rows_message(data.source, bad), bad)
    return problems, bad


def _pick_field(given: str | None, candidates: tuple[str, ...], keys: list[str], kind: str, source: str) -> str:
    """The field named `given`, else the first candidate that the rows have. A field that no row has is not a bad
    row but a wrong file or setting (every row would be bad, or skipped): one error says so, skipping or not."""
    name = given or next((f for f in candidates if f in keys), None)
    if keys and name not in keys:
        expected = f"'{given}'" if given else f"({', '.join(candidates[:-1])} or {candidates[-1]})"
        raise DataFileError(f"{source}: no row has the {kind} field {expected}; the rows have {keys} (set "
                            f"{kind}_field / --{kind}-field)")
    return name or candidates[0]


def _text_field(row: dict, name: str, numbers: bool) -> str:
    if row.get(name) is None:
        null = "it is null; " if name in row else ""
        raise _Reject(f"missing field '{name}'", f"{null}row has {list(row)}")
    value = row[name]
    if isinstance(value, str):
        text = value.strip()
    elif numbers and isinstance(value, (int, float)) and not isinstance(value, bool):
        if not math.isfinite(value):
            raise _Reject(f"field '{name}' is not a finite number", repr(value))
        text = str(value)
    else:
        expected = "a string or a number" if numbers else "a string"  # no comma: reasons are listed with commas
        raise _Reject(f"field '{name}' has type {type(value).__name__} instead of {expected}", _excerpt(value))
    if not text:
        raise _Reject(f"field '{name}' is empty")
    _utf8_text(text, name)
    return text


def _utf8_text(text: str, name: str) -> None:
    """_Reject a text that cannot be written as UTF-8: JSON's escape "\\ud800" reads as a lone surrogate, which
    pyarrow (and any UTF-8 writer, print included) refuses later, with a traceback that names no row."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise _Reject(f"field '{name}' is not UTF-8 text", f"a lone surrogate {text[e.start]!a} at character "
                      f"{e.start + 1}") from None


def _final_answer(answer: str, name: str) -> str:
    if "####" in answer:  # GSM8K: worked solution, then "#### 42"
        answer = answer.rsplit("####", 1)[1].strip().replace(",", "")
        if not answer:
            raise _Reject(f"field '{name}' has nothing after '####'")
    elif THINK_CLOSE in answer or "\\boxed" in answer:
        answer = extract_final_answer(answer) or ""
        if not answer:
            raise _Reject(f"field '{name}' has no final answer")
    return answer


def summarize_bad_rows(bad: list[BadRow]) -> str:
    """How many bad rows by reason, most frequent first: "2 not JSON, 1 missing field 'answer'"."""
    from collections import Counter

    return ", ".join(f"{n} {reason}" for reason, n in Counter(b.reason for b in bad).most_common())


def _bad_rows_message(source: str, bad: list[BadRow]) -> str:
    lines = [f"{source}: {len(bad)} bad row{'s' * (len(bad) != 1)} (to skip bad rows, set skip_bad_rows / "
             "--skip-bad-rows):"]
    lines += [f"  {b}" for b in bad[:BAD_ROWS_SHOWN]]
    if len(bad) > BAD_ROWS_SHOWN:
        lines.append(f"  ... and {len(bad) - BAD_ROWS_SHOWN} more; all {len(bad)} by reason: {summarize_bad_rows(bad)}")
    return "\n".join(lines)


def load_rows(
    name_or_path: str, split: str = "train", config: str | None = None, question_field: str | None = None,
    answer_field: str | None = None, skip_bad_rows: bool = False, source: str | None = None,
) -> tuple[Any, list[BadRow]]:
    """The validated rows of a data file or hub split (see `read_rows` and `rows_to_problems`) as a
    `datasets.Dataset` with the string columns id, question and answer, and the bad rows that were skipped.
    `source` prefixes the ids (default: `name_or_path`). Raises DataFileError listing every bad row unless
    `skip_bad_rows`, FileNotFoundError for a local file that does not exist."""
    import datasets

    problems, skipped = rows_to_problems(read_rows(name_or_path, split, config), question_field, answer_field,
                                         skip_bad_rows, source or name_or_path)
    # Built from the validated rows only: built from the raw ones, pyarrow would refuse a column of mixed types.
    columns = {"id": [p.id for p in problems], "question": [p.prompt for p in problems],
               "answer": [p.answer for p in problems]}
    features = datasets.Features({name: datasets.Value("string") for name in columns})
    return datasets.Dataset.from_dict(columns, features=features), skipped


@dataclass
class MathDataset:
    """A math data set as a Task: the prompt asks for a \\boxed{} answer, the reward is +1/-1 by math-verify
    (`check_answer`).

    Every data file is read and every row validated here, when the task is constructed: bad rows raise one
    DataFileError naming each by file, line (or row) and field, or with `skip_bad_rows` are skipped and kept in
    `skipped` (`skipped_rows` counts them, `skipped_summary` says it in one line for the run log)."""

    name_or_path: str
    question_field: str | None = None
    answer_field: str | None = None
    split: str = "train"
    dataset_config: str | None = None  # hub configuration name, e.g. "main" for openai/gsm8k
    val_split: str | None = None  # a split name of the same source, or a local file; else a held-out slice
    val_size: int = 500
    test_set: bool = False  # --test-dataset's: every row is evaluated (validation() gives them all), none trained on
    skip_bad_rows: bool = False
    instruction: str = "Please reason step by step, and put your final answer within \\boxed{}."
    name: str = "math"
    interruption_phrase: str = SCALERL_INTERRUPTION
    problems: list[Problem] = field(default_factory=list, init=False)
    val_problems: list[Problem] = field(default_factory=list, init=False)
    skipped_rows: int = field(default=0, init=False)
    skipped: list[BadRow] = field(default_factory=list, init=False)  # the rows skipped, in file order
    unparsed_references: set[str] = field(default_factory=set, init=False)  # ids of rows math-verify cannot parse

    def __post_init__(self) -> None:
        if math_verify_missing():  # before the run starts, not at its first reward
            raise MathVerifyUnavailableError(f"a math data set is scored with math-verify, not installed: "
                                             f"{MATH_VERIFY_PIP}")
        problems = self._problems(self.name_or_path, self.split, self.dataset_config, self.name_or_path)
        if self.test_set:  # a test set is evaluated whole, not a held-out slice of it
            self.val_problems = problems
        elif self.val_split:
            val_source = self.val_split if Path(self.val_split).suffix else self.name_or_path
            val_config = self.dataset_config if val_source == self.name_or_path else None
            self.val_problems = self._problems(val_source, self.val_split, val_config, f"{val_source}:{self.val_split}")
            self.problems = problems
        else:  # hold out a fixed, seeded slice so train and validation stay disjoint
            order = list(range(len(problems)))
            random.Random(0).shuffle(order)
            n_val = min(self.val_size, len(problems) // 5)
            held = set(order[:n_val])
            self.val_problems = [problems[i] for i in sorted(held)]
            self.problems = [p for i, p in enumerate(problems) if i not in held]
        self.skipped_rows = len(self.skipped)
        if not (self.val_problems if self.test_set else self.problems):  # every row skipped as bad: one line
            raise DataFileError(f"{self.name_or_path}: no usable {'test' if self.test_set else 'training'} rows "
                                f"({self.skipped_summary or 'no rows'})")

    def _problems(self, name_or_path: str, split: str, config: str | None, id_prefix: str) -> list[Problem]:
        rows, skipped = load_rows(name_or_path, split, config, self.question_field, self.answer_field,
                                  self.skip_bad_rows, id_prefix)
        self.skipped += skipped
        columns = rows.to_dict()  # all at once: rows["id"] and the like go through datasets' formatting, 40x slower
        return [Problem(i, f"{q}\n{self.instruction}", a)
                for i, q, a in zip(columns["id"], columns["question"], columns["answer"])]

    @property
    def skipped_reasons(self) -> dict[str, int]:
        """Skipped rows by reason, most frequent first, e.g. {"not JSON": 2, "missing field 'answer'": 1}."""
        from collections import Counter

        return dict(Counter(b.reason for b in self.skipped).most_common())

    @property
    def skipped_summary(self) -> str:
        """One line for the run log, "" when no row was skipped: how many, why, and the first three."""
        if not self.skipped:
            return ""
        first = "; ".join(str(b) for b in self.skipped[:3])
        return (f"skipped {len(self.skipped)} bad row{'s' * (len(self.skipped) != 1)} "
                f"({summarize_bad_rows(self.skipped)}); first: {first}")

    def train_stream(self, seed: int, start: int = 0) -> Iterator[tuple[int, Problem]]:
        """Epoch after epoch, each in its own seeded order; index i is the i-th problem drawn since the start."""
        n, index = len(self.problems), start
        while True:
            epoch, offset = divmod(index, n)
            order = list(range(n))
            random.Random(seed * 100_003 + epoch).shuffle(order)
            for i in order[offset:]:
                yield index, self.problems[i]
                index += 1

    def validation(self, n: int | None = None) -> list[Problem]:
        return self.val_problems[:n] if n else list(self.val_problems)

    def start_rewards(self) -> float:
        """Start math-verify's server, or replace one that died, before a reward needs it: the generator calls
        this outside any reward's deadline (a start takes 1.5-1.7 s on an idle 2-core AMD EPYC).
        Returns the seconds the running server's start took (`reward_timeout_refusal` weighs them)."""
        verifier = math_verifier()
        verifier.start()
        return verifier.start_s or 0.0

    def reward_restarts(self) -> int:
        """math-verify servers replaced in this process: one that died, or one stuck on an answer."""
        return math_verifier().restarts

    def reward(self, problem: Problem, completion: str) -> float:
        """+1 when math-verify finds the completion's final answer equal to the reference (`check_answer`), else -1.
        An answer that overruns the verifier's bound raises RewardTimeout: the generator scores it -1 and counts
        it in reward_timeouts, as it does for any reward past the run's deadline."""
        check = check_answer(completion, problem.answer)
        if check.timed_out:
            raise RewardTimeout(f"math-verify: {check.error}")
        if not check.reference_parsed and not self.unparsed_references:
            print(f"[math-verify] {self.name_or_path}: the reference of row {problem.id} ({_excerpt(problem.answer)}) "
                  "is no math to math-verify, so only the same text matches it (said once for this data set; "
                  "`python -m harness.tasks check-answer` shows what each side parses to)", file=sys.stderr, flush=True)
        if not check.reference_parsed:
            self.unparsed_references.add(problem.id)
        return 1.0 if check.match else -1.0


class RewardTimeout(BaseException):
    """A reward past its deadline (`reward_deadline`). A BaseException, as KeyboardInterrupt is, so that a verifier's
    own `except Exception` does not swallow it and carry on."""


def _raise_in_thread(thread_id: int, exception: type[BaseException] | None) -> None:
    """Have `exception` raised in the thread `thread_id` at its next Python instruction (None: take back one not
    raised yet). CPython's PyThreadState_SetAsyncExc: what a signal does for the main thread, for any thread."""
    import ctypes

    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread_id),
                                               ctypes.py_object(exception) if exception else None)


@contextlib.contextmanager
def reward_deadline(seconds: float | None) -> Iterator[None]:
    """RewardTimeout raised in the code inside once `seconds` have passed, in whichever thread it runs (None or 0:
    no deadline). Python code stops at once, whatever it catches (RewardTimeout is a BaseException) and whatever it
    does to SIGALRM (`signal.alarm(0)` cancels the timer, not the deadline). In the main thread a SIGALRM timer
    fires it, so a blocking call (time.sleep, a socket read) is interrupted too; a watchdog thread signals the main
    thread again at the deadline, or raises the exception in another thread directly. What it cannot stop, as no
    in-process deadline can (docs/runtime.md): one long C call (sum(range(10**9)), a regular expression, a big
    bytes.find) runs to its end and the exception comes as it returns; outside the main thread a blocking call
    runs to its end too; and threads or processes the code inside starts run on after it is stopped."""
    if not seconds:
        yield
        return
    message = f"reward took longer than {seconds:g} s"
    # The class a watchdog raises in another thread (CPython instantiates it without arguments): this message.
    expired = type("RewardTimeout", (RewardTimeout,),
                   {"__init__": lambda self, *_: RewardTimeout.__init__(self, message)})
    main = threading.current_thread() is threading.main_thread()
    target, lock, done, fired = threading.get_ident(), threading.Lock(), threading.Event(), []

    def expire(signum: int, frame: Any) -> None:  # the main thread's handler: raises once, never after the block
        if not done.is_set() and not fired:
            fired.append("signal")
            raise expired()

    def watchdog() -> None:
        if done.wait(seconds):
            return
        with lock:  # the block's exit takes it too: nothing is raised after the block has ended
            if done.is_set() or fired:
                return
            if main and signal.getsignal(signal.SIGALRM) is expire:
                signal.pthread_kill(target, signal.SIGALRM)  # again: the code inside may have cancelled the timer
            else:  # another thread, or the code inside replaced the handler
                fired.append("async")
                _raise_in_thread(target, expired)

    previous = None
    if main:
        previous = signal.signal(signal.SIGALRM, expire)
        signal.setitimer(signal.ITIMER_REAL, seconds)
    threading.Thread(target=watchdog, name="reward-deadline", daemon=True).start()
    try:
        yield
    finally:
        with lock:
            done.set()
            if fired == ["async"]:  # not raised yet if the block ended first: take it back
                _raise_in_thread(target, None)
        if main:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)


def extract_final_answer(text: str) -> str | None:
    """The last \\boxed{...} (balanced braces), else the text after 'answer is'/'####', else the last number."""
    start = text.rfind("\\boxed")
    if start >= 0:
        i = text.find("{", start)
        if i >= 0:
            depth = 0
            for j in range(i, len(text)):
                depth += {"{": 1, "}": -1}.get(text[j], 0)
                if depth == 0:
                    return text[i + 1 : j].strip()
        return None  # an unclosed \boxed is no answer
    for marker in ("####", "answer is", "Answer:"):
        if marker in text:
            tail = text.rsplit(marker, 1)[1].strip().rstrip(".").strip()
            if tail:
                return tail.split("\n")[0].strip()
    numbers = re.findall(r"-?\d[\d,]*(?:\.\d+)?(?:/\d+)?", text)
    return numbers[-1] if numbers else None


def _strip_text_commands(s: str) -> str:
    r"""Each \text{X} as X (its leading spaces dropped; X ends at the first closing brace), as replacing the
    pattern \\text\{\s*([^}]*)\} by its group does, but linear in len(s): that pattern rescans the rest of the text
    from every unclosed \text{ (quadratic: a 160k-character answer took minutes)."""
    out, i = [], 0
    while (j := s.find("\\text{", i)) >= 0:
        k = s.find("}", j)
        if k < 0:  # no closing brace after this one, nor after any later one
            break
        out += [s[i:j], s[j + 6:k].lstrip()]
        i = k + 1
    return "".join(out) + s[i:]


def normalize_expression(text: str) -> str:
    s = _strip_text_commands(text.strip().strip("$").strip())
    for old, new in (("\\left", ""), ("\\right", ""), ("\\!", ""), ("\\,", ""), ("\\;", ""), ("\\dfrac", "\\frac"),
                     ("\\tfrac", "\\frac"), ("^\\circ", ""), ("^{\\circ}", ""), ("\\%", ""), ("%", ""), ("$", "")):
        s = s.replace(old, new)
    s = re.sub(r"\s+", "", s).rstrip(".")
    s = re.sub(r"\\frac\{([^{}]+)\}\{([^{}]+)\}", r"(\1)/(\2)", s)
    s = re.sub(r"\\frac(\d)(\d)", r"\1/\2", s)
    return s


def _as_number(s: str) -> Fraction | None:
    s = s.replace(",", "") if re.fullmatch(r"-?\d{1,3}(,\d{3})+(\.\d+)?", s) else s
    m = re.fullmatch(r"\(?(-?\d+(?:\.\d+)?)\)?(?:/\(?(-?\d+(?:\.\d+)?)\)?)?", s)
    if not m or len(s) > 200:  # 200: no pathological integers (Python refuses >4300 digits anyway)
        return None
    try:
        value = Fraction(m.group(1))
        return value / Fraction(m.group(2)) if m.group(2) else value
    except (ValueError, ZeroDivisionError):
        return None


def math_answers_match(predicted: str | None, reference: str) -> bool:
    """Numbers and fractions compare by value (1/2 == 0.5 == \\frac{1}{2}); anything else by normalised text. The
    reward before math-verify, kept as the baseline (`text_answers_match`, `check-answer --verifier text`)."""
    if predicted is None:
        return False
    p, r = normalize_expression(predicted), normalize_expression(reference)
    if not p:
        return False
    pn, rn = _as_number(p), _as_number(r)
    if pn is not None and rn is not None:
        return pn == rn
    return p == r


# The reward of a math data set: math-verify (Hugging Face, 0.9.0; the checker of TRL's accuracy reward, verl and
# prime-rl) parses each side's final answer from LaTeX into sympy and compares them by value: \sqrt2 and \sqrt{2},
# x = 3 and 3, \{2, 1\} and \{1, 2\}, 2^{10} and 1024 are each one answer. Its own timeouts use signal.alarm, which
# works only in a process's main thread (and whose alarm(0) would cancel the run's reward deadline), and a tower of
# powers hangs in one C call that no signal interrupts. So it runs with its timeouts off, in processes of its own:
# a server that imports it once and forks a comparer, which is killed once an answer overruns
# `MathVerifier.timeout_s` and forked again in milliseconds.

MATH_VERIFY_PIP = "pip install math-verify==0.9.0 (pinned in both requirements files)"
MATH_VERIFY_TIMEOUT_S = 1.0  # one answer's comparison; real answers take 1-200 ms on one core
MAX_ANSWER_CHARS = 2000  # longer extracted answers are no answer (the longest MATH answers are a few hundred)
_WORKER_MEMORY_BYTES = 4 << 30  # address space of a comparer: a memory bomb fails there, not in the run
_SCI_NUMBER = re.compile(r"(-?\d+(?:\.\d+)?)[eE]([+-]?\d{1,3})")
_PERCENT = re.compile(r"\\?%\s*$")
_NUMBER_THEN_WORDS = re.compile(r"(-?\\?\$?\d[\d,]*(?:\.\d+)?)(?:\s+[A-Za-z]{2,}\.?)+")


class MathVerifyUnavailableError(RuntimeError):
    """math-verify is not installed; the message names the pip command."""


def math_verify_missing() -> bool:
    import importlib.util

    return importlib.util.find_spec("math_verify") is None


def prepare_answer(answer: str | None) -> str | None:
    """An extracted answer as math-verify is given it (inside \\boxed{}): without $ signs and a final period, with
    1.5e3 as 1.5\\times 10^{3} (LaTeX reads e as a symbol) and "18 dollars" as 18 (a number and plain words are the
    number and its unit; \\text{} units math-verify drops itself). None: no answer (empty or over MAX_ANSWER_CHARS)."""
    if answer is None:
        return None
    s = answer.replace("**", "").strip().rstrip(".").strip().strip("$").strip().rstrip(".").strip()  # **: markdown
    # Spellings latex2sympy does not read: a Unicode degree sign, \\varnothing.
    s = s.replace("°", "^\\circ").replace("\\varnothing", "\\emptyset")
    if not s or len(s) > MAX_ANSWER_CHARS:
        return None
    if m := _SCI_NUMBER.fullmatch(s):
        return f"{m.group(1)}\\times 10^{{{int(m.group(2))}}}"
    if m := _NUMBER_THEN_WORDS.fullmatch(s):
        return m.group(1)
    return s


@dataclass(frozen=True)
class AnswerCheck:
    """One comparison, as `check-answer` prints it: the answer extracted from each side, what math-verify parsed
    each into (its sympy forms, then the text it parsed), and whether they match. `error` says why a comparison
    did not happen ("timeout", "no answer", the comparer's exception); `reference_parsed` is false when math-verify
    found no math in the reference (then only equal text matches)."""

    match: bool
    predicted: str | None
    reference: str | None
    compared: dict[str, list[str]] = field(default_factory=dict)
    reference_parsed: bool = True
    error: str | None = None
    seconds: float = 0.0

    @property
    def timed_out(self) -> bool:
        return self.error is not None and self.error.startswith("timeout")


def _compare_answers(predicted: str, reference: str) -> dict[str, Any]:
    """Inside a comparer: parse both sides (each wrapped in \\boxed{}) and compare, math-verify's timeouts off."""
    from math_verify import parse, verify
    from sympy import Basic, MatrixBase

    gold = parse(f"\\boxed{{{reference}}}", parsing_timeout=None)
    pred = parse(f"\\boxed{{{predicted}}}", parsing_timeout=None)
    # allow_set_relation_comp: x > 3 is the interval (3, \\infty) whichever side writes which.
    match = bool(gold and pred and verify(gold, pred, allow_set_relation_comp=True, timeout_seconds=None))
    if not match and (_PERCENT.search(predicted) is None) != (_PERCENT.search(reference) is None):
        # A percentage may drop its sign (MATH's convention, which math-verify applies to whole numbers only):
        # 12.5\\% and 12.5 are one answer, as 50\\% and 50 are.
        match = bool(verify(parse(f"\\boxed{{{_PERCENT.sub('', reference)}}}", parsing_timeout=None),
                            parse(f"\\boxed{{{_PERCENT.sub('', predicted)}}}", parsing_timeout=None),
                            timeout_seconds=None))
    return {"match": match, "reference_parsed": any(isinstance(g, (Basic, MatrixBase)) for g in gold),
            "compared": {"predicted": [str(x)[:200] for x in pred], "reference": [str(x)[:200] for x in gold]}}


def _die_with_parent(parent: int) -> None:
    """This process exits with the one that started it, even in the middle of a C call (Linux: PR_SET_PDEATHSIG)."""
    with contextlib.suppress(OSError, AttributeError):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1: PR_SET_PDEATHSIG
    if os.getppid() != parent:  # the parent died before prctl took effect
        os._exit(0)


def _read_line(fd: int, buffer: bytearray, seconds: float | None) -> bytes | None:
    """The next line from `fd` (without its newline), None when none came within `seconds`; EOFError when the
    writer is gone. select() waits in any thread, and a signal handler's exception (the run's deadline) still
    interrupts it."""
    import select
    import time

    deadline = None if seconds is None else time.monotonic() + seconds
    while b"\n" not in buffer:
        left = None if deadline is None else deadline - time.monotonic()
        if left is not None and (left <= 0 or not select.select([fd], [], [], left)[0]):
            return None
        chunk = os.read(fd, 1 << 16)
        if not chunk:
            raise EOFError
        buffer += chunk
    line, _, rest = bytes(buffer).partition(b"\n")
    buffer[:] = rest
    return line


def _fork_comparer(server: int) -> tuple[int, int, int]:
    """A child of the server that compares answers, forked with math-verify already imported (a restart takes
    milliseconds): (pid, its request pipe, its reply pipe). It runs under a memory limit, so a memory bomb fails there."""
    import resource

    from_parent, to_child = os.pipe()  # (read end, write end)
    from_child, to_parent = os.pipe()
    pid = os.fork()
    if pid:
        os.close(from_parent)
        os.close(to_parent)
        return pid, to_child, from_child
    try:  # the child: never returns
        os.close(to_child)
        os.close(from_child)
        _die_with_parent(server)
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_AS, (_WORKER_MEMORY_BYTES, _WORKER_MEMORY_BYTES))
        buffer = bytearray()
        while True:
            request = json.loads(_read_line(from_parent, buffer, None))
            try:
                reply = _compare_answers(request["p"], request["r"])
            except (Exception, RecursionError, MemoryError) as e:  # sympy and antlr raise anything: no match
                reply = {"match": False, "error": f"{type(e).__name__}: {str(e)[:200]}"}
            os.write(to_parent, (json.dumps(reply) + "\n").encode())
    finally:
        os._exit(0)


_WARM_UP = [("x^2+2x+1", "(x+1)^2"), ("\\frac{\\sqrt3}2", "0.5"), ("\\{1, 2\\}", "(1,2]"), ("x > 3", "(3,\\infty)"),
             ("x = 3", "3"), ("50\\%", "\\pi"), ("\\text{odd}", "do not"), ("(1, 2)", "\\begin{pmatrix}1\\\\2\\end{pmatrix}")]


def math_verify_server(parent: int) -> None:
    """The math-verify process (`MathVerifier` starts it): it imports math-verify once, then forwards each request
    line of stdin ({"p", "r", "t"}) to a forked comparer and its reply to stdout; a comparer that overruns "t"
    seconds is killed and replaced by a fresh fork, and the reply says so. It never computes anything itself, so
    it always answers in time."""
    import logging

    _die_with_parent(parent)
    logging.disable(logging.CRITICAL)  # math-verify warns that its timeouts are off: here that is the design
    replies = os.fdopen(os.dup(1), "w")
    os.dup2(os.open(os.devnull, os.O_WRONLY), 1)  # a stray print in a library must not corrupt the replies
    for predicted, reference in _WARM_UP:  # sympy imports much on first use: done once here, every fork has it
        with contextlib.suppress(Exception):
            _compare_answers(predicted, reference)
    comparer, buffer = _fork_comparer(os.getpid()), bytearray()
    replies.write('{"ready": true}\n')
    replies.flush()
    for line in sys.stdin:
        request = json.loads(line)
        pid, to_child, from_child = comparer
        try:
            os.write(to_child, (json.dumps(request) + "\n").encode())
            reply_line = _read_line(from_child, buffer, request["t"])
            reply = json.loads(reply_line) if reply_line is not None else {
                "match": False, "error": f"timeout after {request['t']:g} s (the comparer was restarted)"}
        except (EOFError, OSError):  # the comparer died on this answer (a crash, its memory limit)
            reply_line, reply = None, {"match": False, "error": "the comparer died on this answer (restarted)"}
        replies.write(json.dumps({**reply, "n": request.get("n")}) + "\n")
        replies.flush()
        if reply_line is None:  # after the reply: the caller's answer does not wait for the restart
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            os.close(to_child)
            os.close(from_child)
            comparer, buffer = _fork_comparer(os.getpid()), bytearray()


class MathVerifier:
    """math-verify behind a bound: `compare` returns within about `timeout_s` in any thread of any process, once
    the server process has started (`start`, paid once per process: the generator calls it before any reward, so no
    reward's deadline ever covers a start; `start_s` is how long the last one took). An answer that overruns is no
    match (error "timeout"): the server kills the comparer it forked and forks another. The run's deadline may stop
    a `compare`: a server still starting is left to start, and a request already sent has its reply skipped when it
    comes, so neither costs a restart. Thread-safe: one comparison at a time. `timeouts` counts the answers that
    overran, `restarts` the servers that had to be replaced."""

    def __init__(self, timeout_s: float = MATH_VERIFY_TIMEOUT_S, start_timeout_s: float = 60.0) -> None:
        self.timeout_s, self.start_timeout_s = timeout_s, start_timeout_s
        self.timeouts = self.restarts = 0
        self.start_s: float | None = None  # seconds the last start took, from the process's launch to its ready line
        self._lock = threading.Lock()
        self._proc: Any = None
        self._ready, self._buffer = False, bytearray()
        self._sent, self._started_at = 0, 0.0  # requests sent to the current server; when it was launched
        self._unread = 0  # requests sent whose reply has not been read (a deadline stopped the wait for it)

    def start(self) -> float:
        """Start the server, or replace one that died, and wait until it is ready: the seconds that took (0 when it
        was running). Call it outside any deadline (`reward_deadline`)."""
        with self._lock:
            if self._proc is not None and self._proc.poll() is not None:
                self._kill()
            if self._proc is not None and self._ready:
                return 0.0
            self._wait_ready()
            return self.start_s or 0.0

    def _start(self) -> None:
        import subprocess
        import time

        if math_verify_missing():
            raise MathVerifyUnavailableError(f"math answers are checked with math-verify, not installed: "
                                             f"{MATH_VERIFY_PIP}")
        boot = ("import sys; sys.path.insert(0, sys.argv[1]); from harness import tasks; "
                "tasks.math_verify_server(int(sys.argv[2]))")
        self._started_at = time.perf_counter()
        self._proc = subprocess.Popen([sys.executable, "-c", boot, str(REPO_DIR), str(os.getpid())],
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                      bufsize=0)
        self._ready, self._buffer, self._sent, self._unread = False, bytearray(), 0, 0

    def _wait_ready(self) -> None:
        """The server started (launched here if none is): an exception while it starts (the run's deadline) leaves
        it starting, and the next call waits on for the same server."""
        import time

        if self._proc is None:
            self._start()
        if not self._ready:
            left = self.start_timeout_s - (time.perf_counter() - self._started_at)
            if _read_line(self._proc.stdout.fileno(), self._buffer, max(left, 0.0)) is None:
                self._kill()
                raise RuntimeError(f"the math-verify server did not start within {self.start_timeout_s:g} s")
            self._ready, self.start_s = True, time.perf_counter() - self._started_at

    def _kill(self, restart: bool = True) -> None:
        if self._proc is not None:
            with contextlib.suppress(OSError):
                self._proc.kill()
            self._proc.wait()
            for pipe in (self._proc.stdin, self._proc.stdout):
                with contextlib.suppress(OSError):
                    pipe.close()
            self._proc = None
            self.restarts += restart

    def _ask(self, request: dict[str, Any]) -> dict[str, Any] | None:
        """The server's reply to `request`, None when it did not come in time. Replies to earlier requests whose
        wait a deadline stopped come first, and are skipped (each request carries its number, "n")."""
        self._wait_ready()
        self._sent += 1
        number = self._sent
        self._unread += 1  # before the write: a deadline between the two then costs a longer wait, not a restart
        self._proc.stdin.write((json.dumps({**request, "n": number}) + "\n").encode())
        while True:  # the server answers each request within its "t": the ones before ours first
            line = _read_line(self._proc.stdout.fileno(), self._buffer, self._unread * self.timeout_s + 1.0)
            if line is None:
                return None
            self._unread -= 1
            reply = json.loads(line)
            if reply.pop("n", None) == number:
                return reply

    def compare(self, predicted: str, reference: str) -> dict[str, Any]:
        """math-verify's verdict on two extracted answers: {"match", "compared", "reference_parsed"}, and "error"
        when there was none ("timeout after 1 s", the comparer's exception)."""
        request = {"p": predicted, "r": reference, "t": self.timeout_s}
        with self._lock:
            for attempt in (1, 2):  # a server that died between two answers (killed from outside) is replaced once
                try:
                    reply = self._ask(request)
                except (EOFError, OSError, ValueError):  # ValueError: a reply cut by a deadline mid-read, not JSON
                    self._kill()
                    if attempt == 2:
                        raise
                    continue
                if reply is None:  # the server itself stuck or, on a loaded machine, late: no run waits on it
                    self._kill()
                    reply = {"match": False, "error": f"timeout after {self.timeout_s:g} s (server restarted)"}
                if str(reply.get("error", "")).startswith("timeout"):
                    self.timeouts += 1
                return reply
        raise AssertionError("unreachable")

    def close(self) -> None:
        with self._lock:
            self._kill(restart=False)


def reward_timeout_refusal(reward_timeout: float, start_s: float,
                           answer_s: float = MATH_VERIFY_TIMEOUT_S) -> str | None:
    """One line when a run's `--reward-timeout` is shorter than its reward server's start (`start_s`, measured as
    the run started) plus one answer's bound, else None. A server that dies mid-answer is started again inside that
    answer's deadline: a deadline shorter than a start and an answer scores that answer as a timeout."""
    needed = start_s + answer_s
    if reward_timeout >= needed:
        return None
    return (f"--reward-timeout {reward_timeout:g} s is shorter than the math-verify server's start ({start_s:.1f} s, "
            f"measured as this run started) plus one answer's bound ({answer_s:g} s): a server that dies mid-run "
            f"starts again inside a reward's deadline, which would then score that answer as a timeout; raise "
            f"--reward-timeout to at least {math.ceil(needed)} s")


_VERIFIER: tuple[int, MathVerifier] | None = None


def math_verifier() -> MathVerifier:
    """This process's MathVerifier (a forked child makes its own: its parent's server is not its child)."""
    global _VERIFIER
    if _VERIFIER is None or _VERIFIER[0] != os.getpid():
        _VERIFIER = (os.getpid(), MathVerifier())
        import atexit

        atexit.register(_VERIFIER[1].close)  # its server ends with this process, without Popen's warning at exit
    return _VERIFIER[1]


_LATEX_COMMAND = re.compile(r"\\[A-Za-z]+")
_WORD = re.compile(r"[A-Za-z]{3,}")
_ENVIRONMENT = re.compile(r"\\(?:begin|end)\{\w+\*?\}")


def math_final_answer(completion: str) -> str | None:
    """The final answer of a completion, after its thinking: the last \\boxed{} (an unclosed one is no answer), else
    what follows GSM8K's ####, 'answer is' or 'Answer:', else the whole text when it is one short line that reads as
    an answer (\\frac{\\sqrt3}2, x = 3, (1,2], Monday: no word of 3 letters outside LaTeX commands and \\text{},
    or no digit and at most two words), else its last number ("so we get 3 and then 5" answers 5; "I do not know."
    has no answer, and is never given to sympy as a product of symbols)."""
    text = text_after_thinking(completion).strip()
    if "\\boxed" in text or any(marker in text for marker in ("####", "answer is", "Answer:")):
        return extract_final_answer(text)
    if text and "\n" not in text and len(text) <= 200:
        latex = _ENVIRONMENT.sub(" ", _strip_text_commands(text))  # \\begin{pmatrix}: no words
        words = _WORD.findall(_LATEX_COMMAND.sub(" ", latex))
        if not words or (not re.search(r"\d", text) and len(text.split()) <= 2):  # Monday, no solution
            return text
    return extract_final_answer(text)


def check_answer(completion: str, reference: str, verifier: MathVerifier | None = None) -> AnswerCheck:
    """The reward's check, step by step: the completion's final answer (`math_final_answer`) and the reference's
    (`reference_answer`, as the data loaders extract it), each `prepare_answer`d, compared by math-verify."""
    import time

    start = time.perf_counter()
    predicted = prepare_answer(math_final_answer(completion))
    ref = prepare_answer(reference_answer(reference))
    if predicted is None or ref is None:
        side = "completion" if predicted is None else "reference"
        return AnswerCheck(False, predicted, ref, error=f"no answer in the {side} (none, empty, or over "
                           f"{MAX_ANSWER_CHARS} characters)", seconds=time.perf_counter() - start)
    reply = (verifier or math_verifier()).compare(predicted, ref)
    return AnswerCheck(bool(reply.get("match")), predicted, ref, reply.get("compared", {}),
                       reply.get("reference_parsed", True), reply.get("error"), time.perf_counter() - start)


def reference_answer(reference: str) -> str | None:
    """A reference's final answer as the data loaders keep it: after GSM8K's ####, else the last \\boxed{} of a
    worked solution, else the text itself. None when there is none."""
    try:
        return _final_answer(reference.strip(), "reference") or None
    except _Reject:
        return None


def text_answers_match(completion: str, reference: str) -> bool:
    """The reward before math-verify, kept as the baseline that the labelled answer pairs measure (`check-answer
    --verifier text`): `extract_final_answer` and `math_answers_match`'s normalised text."""
    return math_answers_match(extract_final_answer(text_after_thinking(completion)), reference_answer(reference) or "")


def read_answer_pairs(path: str) -> list[tuple[str, dict[str, Any]]]:
    """(where, row) of a file of {"predicted", "reference"} rows, with an optional boolean label "equivalent" (and
    any other fields, passed through). Bad rows (not JSON or UTF-8, a missing or non-text field, a reference with no
    final answer) raise one DataFileError naming each, before anything is compared. A file, or a directory of
    them: never a hub data set's name (a path where nothing is would have been looked up on the hub)."""
    if not Path(path).exists():
        raise FileNotFoundError(f"data file not found: {path}")
    rows, bad, out = read_rows(path), [], []
    for _, where, row in rows.rows:
        try:
            if isinstance(row, _NotARow):
                raise _Reject(row.reason, row.detail)
            if not isinstance(row, dict):
                raise _Reject("not a JSON object", _excerpt(row))
            predicted = row.get("predicted")
            if isinstance(predicted, (int, float)) and not isinstance(predicted, bool):
                predicted = str(predicted)
            if not isinstance(predicted, str):  # "" is an empty answer (no match), not a bad row
                raise _Reject("field 'predicted' is not text", f"row has {list(row)}")
            _utf8_text(predicted, "predicted")
            if isinstance(row.get("id"), str):  # printed back with the row's record
                _utf8_text(row["id"], "id")
            reference = _text_field(row, "reference", numbers=True)
            if reference_answer(reference) is None:
                raise _Reject("field 'reference' has no final answer", _excerpt(reference))
            if "equivalent" in row and not isinstance(row["equivalent"], bool):
                raise _Reject("field 'equivalent' is not true or false", _excerpt(row["equivalent"]))
        except _Reject as e:
            bad.append(BadRow(where, e.reason, e.detail))
            continue
        out.append((where, {**row, "predicted": predicted, "reference": reference}))
    if bad:
        first, *rest = _bad_rows_message(rows.source, bad).split("\n")
        raise DataFileError("\n".join([first.split(" (to skip")[0] + ":", *rest]), bad)  # no rows are skipped here
    return out


def check_answer_rows(pairs: list[tuple[str, dict[str, Any]]], verifier: str = "math-verify",
                      timeout_s: float = MATH_VERIFY_TIMEOUT_S) -> Iterator[dict[str, Any]]:
    """One record per pair, as `check-answer` prints it: match (the chosen verifier's; with "both", math-verify's,
    and text_match the old one's), the answer extracted from each side, what math-verify compared, the label."""
    checker = MathVerifier(timeout_s=timeout_s) if verifier != "text" else None
    try:
        for where, row in pairs:
            record: dict[str, Any] = {"row": where} | ({"id": row["id"]} if "id" in row else {})
            if checker is not None:
                check = check_answer(row["predicted"], row["reference"], checker)
                record |= {"match": check.match, "extracted": {"predicted": check.predicted,
                                                               "reference": check.reference},
                           "compared": check.compared, "seconds": round(check.seconds, 4)}
                record |= {"error": check.error} if check.error else {}
                record |= {} if check.reference_parsed else {"reference_parsed": False}
            if verifier != "math-verify":
                old = text_answers_match(row["predicted"], row["reference"])
                record |= {"text_match": old} if checker is not None else {
                    "match": old, "extracted": {"predicted": extract_final_answer(text_after_thinking(row["predicted"])),
                                                "reference": reference_answer(row["reference"])}}
            if "equivalent" in row:
                record["equivalent"] = row["equivalent"]
            yield record
    finally:
        if checker is not None:
            checker.close()


def _agreement_line(records: list[dict[str, Any]]) -> str:
    """The summary of a check-answer run: matches, agreement with the labels, rows where the verifiers differ."""
    line = f"{len(records)} pairs: {sum(r['match'] for r in records)} match"
    labelled = [r for r in records if "equivalent" in r]
    for key, name in (("match", "this verifier"), ("text_match", "the text verifier")):
        scored = [r for r in labelled if key in r]
        if scored and (key == "match" or len(scored) == len(labelled)):
            agree = sum(r[key] == r["equivalent"] for r in scored)
            line += f"; {name} agrees with {agree} of {len(scored)} labels ({agree / len(scored):.3f})"
    if records and "text_match" in records[0]:
        line += f"; the two verifiers differ on {sum(r['match'] != r['text_match'] for r in records)} rows"
    timeouts = sum(str(r.get("error", "")).startswith("timeout") for r in records)
    return line + (f"; {timeouts} timed out" if timeouts else "")


def check_answer_main(args: Any, parser: Any) -> None:
    """`python -m harness.tasks check-answer`: one JSON object per pair on stdout, the summary line on stderr."""
    if (args.pairs is None) == (args.predicted is None or args.reference is None):
        parser.error("check-answer takes --pairs FILE, or --predicted TEXT and --reference TEXT")
    if not args.timeout > 0:
        parser.error(f"--timeout must be a number of seconds > 0, not {args.timeout:g}")
    if args.pairs is not None:
        try:
            pairs = read_answer_pairs(args.pairs)
        except (DataFileError, FileNotFoundError) as e:
            parser.exit(2, f"error: {e}\n")
    else:
        for flag, text in (("--predicted", args.predicted), ("--reference", args.reference)):
            try:
                text.encode("utf-8")
            except UnicodeEncodeError:  # argv bytes that are not UTF-8 arrive as lone surrogates
                parser.error(f"{flag} is not UTF-8 text")
        if reference_answer(args.reference) is None:
            parser.error(f"--reference has no final answer: {_excerpt(args.reference)}")
        pairs = [("command line", {"predicted": args.predicted, "reference": args.reference})]
    records = []
    for record in check_answer_rows(pairs, args.verifier, args.timeout):
        records.append(record)
        differing = "text_match" in record and record["match"] != record["text_match"]
        wrong = "equivalent" in record and record["match"] != record["equivalent"]
        if args.show == "all" or (args.show == "differing" and differing) or (args.show == "wrong" and wrong):
            print(json.dumps(record, ensure_ascii=False), flush=True)
    print(_agreement_line(records), file=sys.stderr, flush=True)


def sample_completions(model_dir: Path, task: MathDataset, samples: int = 4, max_tokens: int = 256,
                       temperature: float = 1.0, seed: int = 0) -> list[dict[str, Any]]:
    """`samples` completions of every problem of a math data set (train and validation) from a model with vLLM, as
    rows {"id", "sample", "predicted", "reference"} that `check-answer --pairs` reads: what a run's rewards would
    score."""
    set_vllm_cpu_env()
    from vllm import LLM, SamplingParams

    from harness import vllm_internals
    from transformers import AutoTokenizer

    problems = task.problems + task.validation()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    # Whole prompts prefilled at once, as the replicas do on CPU: a seeded request's generator cannot be rewound
    # after a prefill chunk there ('CPU Generator does not use offset').
    with vllm_internals.engine_start():
        llm = LLM(model=vllm_internals.loadable_model_path(str(model_dir)), dtype="float32", seed=seed,
                  max_model_len=1024, enforce_eager=True, enable_chunked_prefill=False, max_num_batched_tokens=4096)
    prompts = [{"prompt_token_ids": chat_prompt_ids(tokenizer, p.prompt)} for p in problems]
    params = SamplingParams(n=samples, temperature=temperature, max_tokens=max_tokens, seed=seed)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    vllm_internals.shutdown_engine_core(llm)
    return [{"id": p.id, "sample": i, "predicted": c.text, "reference": p.answer}
            for p, out in zip(problems, outputs) for i, c in enumerate(out.outputs)]


# --------------------------------------------------------------------------------------------------------------
# 2b. A generated task for a small real chat model: one-digit arithmetic asked in words
# --------------------------------------------------------------------------------------------------------------

_INTEGER = re.compile(r"-?\d+")


@dataclass
class SmallArithmeticTask:
    """One-digit addition and subtraction asked in plain words, for a small real chat model through its chat
    template (`--dataset small-arithmetic`; the level add-1d of mixed-arithmetic below, which `make run-real` uses):

        What is 7 + 5? Answer with a single number.        ->  12
        What is 8 - 3? Answer with a single number.        ->  5      (a >= b: no negative answers)

    Why this task: SmolLM2-135M-Instruct answers two-digit word problems right 7-9% of the time greedily and 1-3%
    at temperature 1 (too little signal for RL); on these, the last number it writes is right about 31% of the time
    at temperature 1 and 46% at 0.7 (measured: docs/real-models.md), with real variance inside a group.

    The reward is +1 when the last integer of the completion (after an interruption phrase, if one was forced) is
    the answer, else -1: a completion's final number is its answer, so "7 + 5 = 12" scores, and so does "The answer
    is 12."; no number, an answer in words ("twelve") or a wrong last number ("12 or 13") score -1. `checks` gives,
    for reports, a strict format check (the completion is the number and nothing else) and a lenient one (the answer
    appears anywhere among its numbers), so that format learning can be told from arithmetic learning.

    The 155 problems (100 sums, 55 differences) are split by a hash of the question: 42 are held out for
    validation, never trained on, and the training stream draws the other 113 at random."""

    name: str = "small-arithmetic"
    interruption_phrase: str = SCALERL_INTERRUPTION
    suffix: str = " Answer with a single number."

    def problem(self, a: int, op: str, b: int) -> Problem:
        answer = a + b if op == "+" else (a * b if op == "*" else a - b)
        return Problem(id=f"{a}{op}{b}", prompt=f"What is {a} {op} {b}?{self.suffix}", answer=str(answer))

    def problems(self, split: str) -> list[Problem]:
        every = [self.problem(a, "+", b) for a in range(10) for b in range(10)]
        every += [self.problem(a, "-", b) for a in range(10) for b in range(a + 1)]
        held_out = [hashlib.blake2b(p.id.encode(), digest_size=2).digest()[0] % 5 == 0 for p in every]
        return [p for p, val in zip(every, held_out) if val == (split == "val")]

    def train_stream(self, seed: int, start: int = 0) -> Iterator[tuple[int, Problem]]:
        """Index i is the i-th draw of Random(seed) (`_drawer`): resumable by index."""
        draw, rng, index = self._drawer(), random.Random(seed), 0
        while True:
            problem = draw(rng)
            if index >= start:
                yield index, problem
            index += 1

    def _drawer(self) -> Callable[[random.Random], Problem]:
        """One draw of the training stream: a training problem, uniformly."""
        train = self.problems("train")
        return lambda rng: rng.choice(train)

    def validation(self, n: int | None = None) -> list[Problem]:
        val = self.problems("val")
        return val[:n] if n else val

    def reward(self, problem: Problem, completion: str) -> float:
        numbers = _INTEGER.findall(text_after_thinking(completion))
        return 1.0 if numbers and int(numbers[-1]) == int(problem.answer) else -1.0

    def checks(self, problem: Problem, completion: str) -> dict[str, bool]:
        """The reward's check and two others, for reports: strict (the number alone, a final period allowed) and
        lenient (the answer among the completion's numbers)."""
        text = text_after_thinking(completion).strip().rstrip(".").strip()
        numbers = [int(x) for x in _INTEGER.findall(text)]
        return {"last_number": self.reward(problem, completion) > 0,
                "strict": re.fullmatch(r"-?\d+", text) is not None and int(text) == int(problem.answer),
                "lenient": int(problem.answer) in numbers}


class MixedArithmeticTask(SmallArithmeticTask):
    """SmallArithmeticTask's prompts and reward at three levels, drawn in equal shares (`--dataset mixed-arithmetic`;
    `make run-real` trains SmolLM2-135M-Instruct on it):

        What is 7 + 5? Answer with a single number.      add-1d:   sums and differences of one-digit numbers (155)
        What is 7 * 5? Answer with a single number.      times-1d: products of one-digit numbers, 1-9 (81)
        What is 47 - 8? Answer with a single number.     add-2d1d: a two-digit and a one-digit number (1,620)

    Why: on small-arithmetic alone the run runs out of problems. After some ten steps most of its 113 training
    problems are solved by all 8 samples, their groups carry no gradient and are dropped, and the run declines
    (docs/real-models.md). Measured at temperature 1 with make run-real's interruptions (8 samples of 40 problems
    of each kind), SmolLM2-135M-Instruct scores 0.25, 0.14 and 0.20 on one-digit sums, differences and products
    (pass@8 0.63-0.88: it can be taught), but 0.02-0.04 on a two-digit and a one-digit number (pass@8 0.13-0.20).
    So the one-digit levels rise first, the two-digit level keeps groups with mixed rewards in the batch late in
    the run, and the pass rate tends to an asymptote clearly below 1.

    Differences keep a >= b. 32 problems of each level (96) are held out for validation, chosen by a hash of the
    question and never trained on: with 3 samples each, the evaluation's sampling noise is at most +-0.03 (one
    standard deviation, at a pass rate of 0.5 on every problem). The training stream picks a level uniformly, then
    one of its training problems."""

    name: str = "mixed-arithmetic"
    levels: tuple[str, ...] = ("add-1d", "times-1d", "add-2d1d")
    held_out_per_level: int = 32

    def level_problems(self, level: str) -> list[Problem]:
        """Every problem of one level, in a fixed order."""
        one, two = range(10), range(10, 100)
        if level == "times-1d":
            return [self.problem(a, "*", b) for a in range(1, 10) for b in range(1, 10)]
        first, second = {"add-1d": (one, one), "add-2d1d": (two, range(1, 10))}[level]
        return ([self.problem(a, "+", b) for a in first for b in second]
                + [self.problem(a, "-", b) for a in first for b in second if a >= b])

    def problems(self, split: str) -> list[Problem]:
        """The split's problems, the levels interleaved (so that the first n of the validation set mix them)."""
        per_level = [self._split(level)[split] for level in self.levels]
        return [p for row in itertools.zip_longest(*per_level) for p in row if p is not None]

    def _split(self, level: str) -> dict[str, list[Problem]]:
        """The level's held-out problems (the first by a hash of the question) and its training ones."""
        every = self.level_problems(level)
        order = sorted(every, key=lambda p: hashlib.blake2b(p.id.encode(), digest_size=8).digest())
        val_ids = {p.id for p in order[:self.held_out_per_level]}
        return {"val": order[:self.held_out_per_level], "train": [p for p in every if p.id not in val_ids]}

    def level_of(self, problem: Problem) -> str:
        """The level a problem belongs to, from its operator and operands."""
        a, op, _ = re.fullmatch(r"(\d+)([-+*])(\d+)", problem.id).groups()
        return "times-1d" if op == "*" else ("add-1d" if int(a) < 10 else "add-2d1d")

    def _drawer(self) -> Callable[[random.Random], Problem]:
        """One draw of the training stream: a level uniformly, then one of its training problems."""
        train = [self._split(level)["train"] for level in self.levels]
        return lambda rng: rng.choice(rng.choice(train))


# `--dataset` names of the tasks generated here (no data set behind them: --dataset-config and fields do not apply)
EMBEDDED_TASKS: dict[str, type] = {"arithmetic": ArithmeticTask, "arithmetic-verified": VerifiedArithmeticTask,
                                   "small-arithmetic": SmallArithmeticTask, "mixed-arithmetic": MixedArithmeticTask}


def data_digest(*sets: Task | None) -> str:
    """The sha256 of the problems data sets give (each MathDataset's training and validation problems, in order), for
    a resumed run to check that it trains and evaluates on what it started with; "" where none is a MathDataset (a
    task generated here: its problems are its code's)."""
    problems = [[[p.id, p.prompt, p.answer] for p in t.problems + t.val_problems] if isinstance(t, MathDataset)
                else None for t in sets]
    return hashlib.sha256(json.dumps(problems).encode()).hexdigest() if any(problems) else ""


def trained_eval_problems(task: Task, eval_task: Task | None) -> int:
    """How many of the problems `eval_task` evaluates (`task` itself: its validation) are training problems of `task`
    too (the same prompt): a validation from a file that repeats rows, a test set that is not held out (--test-dataset
    naming --dataset's own file, or a file that shares rows with it). 0 for a task generated here."""
    if not isinstance(task, MathDataset) or not isinstance(eval_task, MathDataset):
        return 0
    trained = {p.prompt for p in task.problems}
    return sum(p.prompt in trained for p in eval_task.val_problems)


def load_task(dataset: str | None = None, **kwargs: Any) -> Task:
    """The task behind `--dataset`: None or 'arithmetic' is the embedded task, 'arithmetic-verified' the same with
    its scratchpad verified, 'small-arithmetic' one-digit arithmetic for a small real chat model, 'mixed-arithmetic'
    the same with one-digit products and two-digit operands, anything else a MathDataset."""
    if not dataset:
        return ArithmeticTask()
    if dataset in EMBEDDED_TASKS:
        return EMBEDDED_TASKS[dataset]()
    return MathDataset(dataset, **kwargs)


def _add_answer_commands(sub: Any) -> None:
    """The subcommands about a math data set's answers: check-answer and sample."""
    check = sub.add_parser("check-answer", help="say whether answers match their references as a math data set's "
                           "reward scores them (math-verify), and why: one JSON object per pair")
    check.add_argument("--pairs", type=path_text, default=None,
                       help="a .jsonl (or .json, .csv) file of {\"predicted\": completion or answer, \"reference\": "
                       "answer or worked solution} rows, with an optional boolean label "
                       "\"equivalent\" (then the summary gives the agreement with the labels)")
    check.add_argument("--predicted", default=None, help="one completion or answer to check (with --reference)")
    check.add_argument("--reference", default=None, help="its reference: an answer, or a solution with \\boxed{} or "
                       "GSM8K's '#### 42'")
    check.add_argument("--verifier", choices=("math-verify", "text", "both"), default="math-verify",
                       help="math-verify (the reward), text (the normalised-text comparison the reward used before) "
                       "or both (match is math-verify's, text_match the old one's)")
    check.add_argument("--show", choices=("all", "differing", "wrong"), default="all",
                       help="rows to print: all, those where the two verifiers differ (with --verifier both), or "
                       "those that disagree with their label; the summary on stderr counts them all")
    check.add_argument("--timeout", type=float, default=MATH_VERIFY_TIMEOUT_S,
                       help=f"seconds math-verify may take on one pair before it is no match (default "
                       f"{MATH_VERIFY_TIMEOUT_S:g}, as in a run)")
    sample = sub.add_parser("sample", help="write a model's completions of every problem of a math data set, as "
                            "check-answer --pairs rows (what a run's rewards would score), with vLLM")
    sample.add_argument("--model", type=path_value, required=True, help="a Hugging Face model directory")
    sample.add_argument("--dataset", type=path_text, required=True, help="a math data file, as --dataset of train.py")
    sample.add_argument("--dataset-config", type=text_value, default=None,
                        help="configuration (subset) of a hub --dataset, e.g. main for openai/gsm8k")
    sample.add_argument("--question-field", type=text_value, default=None,
                        help="question field of --dataset (default: question, problem or prompt)")
    sample.add_argument("--answer-field", type=text_value, default=None,
                        help="answer field of --dataset (default: answer, solution or final_answer)")
    sample.add_argument("--split", type=text_value, default="train",
                        help="the split of a hub --dataset or of a directory's files (test: its test* files); a data "
                             "file is one split whatever this says (default train)")
    sample.add_argument("--skip-bad-rows", action="store_true",
                        help="skip the rows that cannot be read as a problem (counted on stderr), as train.py's "
                             "--skip-bad-rows does, rather than refuse the data set")
    sample.add_argument("--out", type=output_file, required=True, help="the .jsonl file to write")
    sample.add_argument("--samples", type=int_at_least(1), default=4, help="completions per problem (default 4)")
    sample.add_argument("--max-tokens", type=int_at_least(1), default=256,
                        help="tokens per completion at most (default 256)")
    sample.add_argument("--temperature", type=number(0.0), default=1.0,
                        help="sampling temperature; 0 is greedy (default 1)")
    sample.add_argument("--seed", type=int_at_least(0), default=0, help="vLLM's seed (default 0)")


def build_parser() -> OneLineParser:
    """`python -m harness.tasks`'s parser: check-answer and sample."""
    parser = OneLineParser(description="The tasks' answer checker of scalerl, and a model's completions to check.")
    _add_answer_commands(parser.add_subparsers(dest="command", required=True))
    return parser


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "check-answer":
        check_answer_main(args, parser)
        return
    if args.dataset_config and not takes_config(args.dataset):
        parser.error("--dataset-config names a configuration of a hub data set (or of a directory that clones one), "
                     "not of a data file")
    try:  # before vLLM's import (10 s): a bad data set or model directory is one line
        task = MathDataset(args.dataset, question_field=args.question_field, answer_field=args.answer_field,
                           split=args.split, dataset_config=args.dataset_config, val_size=0,
                           skip_bad_rows=args.skip_bad_rows)
    except (BadRowError, FileNotFoundError) as e:
        parser.exit(2, f"{parser.prog} sample: error: {e}{config_hint(e, '--dataset-config')}\n")
    if task.skipped_rows:
        print(f"{parser.prog} sample: {task.skipped_summary}", file=sys.stderr)
    if not args.model.exists():  # the model: a path where nothing is, or a directory that holds no model
        parser.exit(2, f"{parser.prog} sample: error: --model {args.model}: no such directory\n")
    if not (args.model / "config.json").is_file():
        parser.exit(2, f"{parser.prog} sample: error: --model {no_model_config(args.model)}\n")
    if pointers := git_lfs_pointers(list(args.model.iterdir())):  # vLLM's words would be a header error
        parser.exit(2, f"{parser.prog} sample: error: --model {pointers}\n")
    if why := tokenizer_problem(args.model):
        parser.exit(2, f"{parser.prog} sample: error: --model {why}\n")
    rows = sample_completions(args.model, task, args.samples, args.max_tokens, args.temperature, args.seed)
    write_output(args.out, "".join(json.dumps(row) + "\n" for row in rows))
    print(json.dumps({"out": str(args.out), "rows": len(rows)}))


if __name__ == "__main__":  # vLLM on CPU spawns workers: the entry point must be guarded
    exit_with(main)
