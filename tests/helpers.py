"""What several test files share: the repository root, torchrun's command, small groups and batches, a saved run
directory, and the check that two steps gave the same gradient."""

import dataclasses
import fcntl
import json
import os
import random
import re
import shlex
import shutil
import subprocess
import sys
import threading
import warnings
from collections.abc import Callable
from pathlib import Path

import torch

from harness import checkpoints, flags
from harness.tasks import Problem
from pipeline_rl import Completion, Group


REPO = Path(__file__).resolve().parent.parent


TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone"]


def make_group(i: int, lengths: list[int], rewards: list[float], prompt_len: int = 3) -> Group:
    completions = [Completion(token_ids=list(range(10, 10 + n)), sampler_logprobs=[-0.5] * n, versions=[0] * n,
                              loss_mask=[True] * (n - 1) + [False], text="", finish_reason="stop", reward=r)
                   for n, r in zip(lengths, rewards)]
    return Group(Problem(f"p{i}", "", ""), i, list(range(1, 1 + prompt_len)), completions)


def random_groups(rng: random.Random, n_groups: int, group_size: int, vocab: int, longest: int = 20) -> list[Group]:
    """Groups of random prompts and completions (an empty completion now and then), for the packing tests."""
    groups = []
    for i in range(n_groups):
        completions = []
        for _ in range(group_size):
            n = rng.randint(0, longest)
            completions.append(Completion(token_ids=[rng.randrange(3, vocab) for _ in range(n)],
                                          sampler_logprobs=[-rng.random() for _ in range(n)], versions=[0] * n,
                                          loss_mask=[rng.random() < 0.8 for _ in range(n)], text="",
                                          finish_reason="stop", reward=1.0))
        prompt = [rng.randrange(3, vocab) for _ in range(rng.randint(1, 9))]
        groups.append(Group(Problem(f"p{i}", "", ""), i, prompt, completions))
    return groups


def assert_same_gradient(grads: list, reference_grads: list, where: object = None) -> None:
    """Float32 sums taken in another order (other micro-batches, ranks or head chunks) differ by up to some 5e-5 of
    the gradient's largest entry (measured on the default base model: GSPO's sequence ratios are the least exact), so
    the absolute tolerance is 1e-4 of it; an error of normalisation moves the entries it touches by tens of percent.
    A fixed tolerance would depend on the base model's weights: a base that fits its data better gives larger
    gradients on the synthetic groups, and larger rounding. Measured again over tests/test_train.py's split layouts:
    at most 0.40 of this bound with torch's default kernels, 0.29 with ATEN_CPU_CAPABILITY=avx2: a margin of 2.5."""
    atol = 1e-4 * max(g.abs().max().item() for g in reference_grads)
    for grad, reference_grad in zip(grads, reference_grads):
        torch.testing.assert_close(grad, reference_grad, rtol=1e-4, atol=atol, msg=lambda m: f"{where}: {m}")


# Unit roundoff: one rounding to float32 or bf16 is off by at most this much of the value (24 and 8 significant bits).
U32 = 2.0**-24
U_BF16 = 2.0**-8


def fp32_sum_error(sizes: list[int], scale: torch.Tensor | float) -> torch.Tensor | float:
    """A bound on float32's error in a chain of sums: a dot product, a GEMM's entry, a reduction of K terms, in any
    order, is off by about sqrt(K) * u of the size of its terms (u = 2^-24; the probabilistic bound of Higham and Mary
    2019, with its constant lambda = 1), and a chain's relative errors add, so its result is off by at most
    u * sum(sqrt(K_i)) * scale, where scale is the largest |result|. Two computations of it that sum in other orders
    (another vector width, GEMM blocking, packing, chunking, rank count) are within twice that of each other."""
    return U32 * sum(k**0.5 for k in sizes) * scale


def fp32_logprob_error(config, seq_len: int, logit_scale: torch.Tensor) -> torch.Tensor:
    """A bound on a float32 forward's error in a token's log-probability, from float32's rounding and the model's sizes.

    Each stage of a Llama layer sums K products: the input RMSNorm and the q/k/v projections (K = hidden), the
    attention scores (K = head_dim) and their weighted sum over positions (K = seq_len), the output projection
    (K = heads * head_dim), the second RMSNorm and the gate/up projections (K = hidden), the down projection
    (K = intermediate); then the final norm, the LM head (K = hidden) and the log-sum-exp over the vocabulary.
    fp32_sum_error of that chain bounds a logit z by u * sum(sqrt(K)) * max|z|; a log-probability z_t - logsumexp(z)
    then by twice that. The summation order (the CPU's vector width, oneDNN's blocking, vLLM's own kernels) changes
    which error a kernel makes, not this bound. logit_scale: [N] max_j |z_j| / T per token, from a float64 forward."""
    h, inter, hd, heads = config.hidden_size, config.intermediate_size, config.head_dim, config.num_attention_heads
    per_layer = [h, h, hd, seq_len, heads * hd, h, h, inter]
    return 2 * fp32_sum_error(per_layer * config.num_hidden_layers + [h, h, config.vocab_size], logit_scale)


def assert_within(gap: torch.Tensor, bound: torch.Tensor | float, where: object = None) -> float:
    """Every |gap| within its bound (same shape, or a scalar); returns the worst gap / bound, which the
    tests print and docs/benchmarks.md ("Comparison bounds in the tests") lists per kernel path."""
    ratio = gap.double().abs() / torch.as_tensor(bound, dtype=torch.float64)
    worst = ratio.max().item() if ratio.numel() else 0.0
    assert (ratio <= 1).all(), f"{where}: {worst:.3g} of its bound"
    print(f"{where}: worst {worst:.3g} of its bound")  # pytest -s shows it
    return worst


def head_weights(vocab: int, hidden: int, rows: int, logit_std: float, seed: int = 0) -> tuple:
    """A float32 LM head weight [V, H] whose logits have standard deviation `logit_std`, bf16-exact hidden states
    [M, H] (a bf16 trunk's), and targets [M] sampled from the head's own distribution, as a sampler's are."""
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(vocab, hidden, generator=gen) * (logit_std / hidden ** 0.5)
    hidden_states = torch.randn(rows, hidden, generator=gen).to(torch.bfloat16)
    probs = torch.softmax(hidden_states.double() @ weight.double().T, -1)
    return weight, hidden_states, torch.multinomial(probs, 1, generator=gen).squeeze(1)


def tied_llama(out: Path) -> Path:
    """A small random Llama saved at `out` whose LM head is its input embedding, as SmolLM2's is: with the FP32
    head, the embedding joins the head's float32 FSDP2 unit (train.build_learner), a path the embedded model never
    takes."""
    from transformers import LlamaConfig, LlamaForCausalLM  # here: most tests need no transformers

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, head_dim=32, max_position_embeddings=64,
                         tie_word_embeddings=True)
    LlamaForCausalLM(config).save_pretrained(out)
    return out


def wide_kv_model(base_model_dir: Path, out: Path) -> Path:
    """The tiny model's directory without its weights, its config made of 8 layers of 32 KV heads of 128: 256 KiB of
    KV cache a token in float32, so that 1 GiB holds 3,968 tokens of it in vLLM (a config is all the KV cache's
    size is read from)."""
    shutil.copytree(base_model_dir, out, ignore=shutil.ignore_patterns("*.safetensors"))
    config = json.loads((out / "config.json").read_text())
    config.update(num_hidden_layers=8, num_attention_heads=32, num_key_value_heads=32, head_dim=128,
                  max_position_embeddings=16384)
    (out / "config.json").write_text(json.dumps(config))
    return out


def saved_run(out: Path, steps: tuple[int, ...] = (1, 2), size: int = 4) -> tuple:
    """A run directory with a checkpoint per step of `steps` (a Linear layer and its AdamW state), its args.json and
    a metrics row per step. Returns (model, optimizer)."""
    model = torch.nn.Linear(size, size)
    optimizer = torch.optim.AdamW(model.parameters())
    out.mkdir(exist_ok=True)
    (out / "args.json").write_text(json.dumps(dataclasses.asdict(flags.Args(output_dir=str(out)))))
    for step in steps:
        model(torch.ones(1, size)).sum().backward()
        optimizer.step()
        checkpoints.save_checkpoint(out, model, optimizer, {"step": step, "metrics_lines": step + 1}, rank=0)
    (out / "metrics.jsonl").write_text("".join(json.dumps({"step": s}) + "\n" for s in range(max(steps) + 1)))
    return model, optimizer


def file_tree(path: Path) -> dict[str, bytes]:
    return {str(f.relative_to(path)): f.read_bytes() for f in sorted(path.rglob("*")) if f.is_file()}


def metrics_rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def run_where(where: str, fn: Callable[[], None]) -> None:
    """fn() in this, the main thread ("main") or in another one ("thread", joined within 60 s): rewards run in both."""
    if where == "thread":
        thread = threading.Thread(target=fn)
        thread.start()
        thread.join(60)
    else:
        fn()


def machine() -> str:
    """This machine's CPU as the kernel names it, with its family and model numbers and CPU count: what a timing or a
    crash depends on (an AMD EPYC and an Intel Xeon differ in kernels, and each kind in its speed)."""
    info = Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else []
    field = lambda name: next((line.split(":", 1)[1].strip() for line in info if line.startswith(name)), "?")  # noqa: E731
    model = field("model\t")  # "model\t:", not "model name"
    return f"{field('model name')} (family {field('cpu family')}, model {model}), {os.cpu_count()} CPUs"


def why_failed(run: subprocess.CompletedProcess, tail: int = 3000) -> str:
    """A failed command's story for an assertion message: the machine's CPU, each crashed process's own report (a
    Python traceback, or faulthandler's 'Fatal Python error' and its threads' stacks, which a rank killed by
    SIGSEGV or SIGABRT prints before torchrun's pages of its own) and the tail of stderr. The tail alone showed only
    torchrun's summary of a rank's crash, never where the rank was."""
    reports, lines = [], run.stderr.splitlines()
    for i, line in enumerate(lines):
        if "Fatal Python error" in line or line.startswith("Traceback (most recent call last)"):
            block = [b for b in lines[i:i + 60] if not b.startswith("Extension modules:")]
            if not any("torch/distributed/run.py" in b or "elastic" in b for b in block[:8]):
                reports.append("\n".join(block)[:2500])
        if len(reports) == 2:
            break
    return "\n".join([f"exit {run.returncode} on {machine()}", *reports, "[... stderr's tail:]",
                      run.stdout[-1000:] + run.stderr[-tail:]])


# torchrun's summary of a rank killed in native code (a segfault or an abort inside torch, gloo or a kernel).
NATIVE_CRASH = re.compile(r"Signal (?:11|6|7) \((?:SIGSEGV|SIGABRT|SIGBUS)\) received by PID")
# torchrun's lines for one failed rank: "rank      : 1 (local_rank: 1)" ... "traceback : Signal 11 (SIGSEGV) ..."
_RANK_SIGNAL = re.compile(r"rank\s*:\s*(\d+)[^\n]*\n(?:[^\n]*\n){0,4}?\s*traceback\s*:\s*Signal \d+ \((SIG\w+)\)")

# The file (JSON lines) where each rerun after a native crash is recorded, named by tests/conftest.py for the
# session (and inherited by its subprocesses: a study's resume after a failure records itself there too); the
# session's terminal summary ends with them. Unset: nothing is recorded.
RERUN_LOG = "SCALERL_RERUN_LOG"


def crashed_ranks(stderr: str) -> str:
    """Which rank died of which signal, from torchrun's summary: "rank 1: SIGSEGV; rank 0: SIGABRT"."""
    found = [f"rank {rank}: {sig}" for rank, sig in _RANK_SIGNAL.findall(stderr)]
    if not found:  # a summary of another layout: the signals alone
        found = [f"a rank: {sig}" for sig in re.findall(r"Signal \d+ \((SIG\w+)\) received by PID", stderr)]
    return "; ".join(dict.fromkeys(found)) or "no signal named"


def record_rerun(what: str, why: str, story: str) -> None:
    """Count one rerun where the session's summary reads them (RERUN_LOG): `what` ran, `why` it was run again
    (which rank, which signal, how the rerun ended), `story` its stack and stderr's tail."""
    log = os.environ.get(RERUN_LOG)
    if log:
        with open(log, "a", encoding="utf-8") as f:
            fcntl.flock(f, fcntl.LOCK_EX)  # make test's workers share the file: a long record is several writes
            f.write(json.dumps({"what": what, "why": why, "story": story}) + "\n")


def recorded_reruns() -> list[dict]:
    log = os.environ.get(RERUN_LOG)
    if not log or not Path(log).exists():
        return []
    return [json.loads(line) for line in Path(log).read_text(encoding="utf-8").splitlines() if line.strip()]


def at_once(*calls: Callable[[], object]) -> list:
    """Each call in a thread of its own, all started together; their results in the calls' order (the first
    call's error is raised). Runs of the tiny model go two or three at once: one alone leaves a core mostly idle
    while rank 0 starts vLLM and while the learner waits for the generator."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(len(calls)) as pool:
        futures = [pool.submit(call) for call in calls]
        return [future.result() for future in futures]


def run_torchrun(cmd: list[str], state: list[Path] = (), timeout: float = 600) -> subprocess.CompletedProcess:
    """Run a torchrun command (or one that starts torchrun, as make run-real does); if a rank died in native code,
    run it once more from the state it started from.

    `state`: the directories the run reads and writes (its output directory, a run it resumes). Each is copied
    aside first (a missing one is noted), and after a crash each is put back as it was before the rerun. Every
    process runs with PYTHONFAULTHANDLER=1, so a rank that dies in native code prints its Python stack. Each rerun is
    recorded (record_rerun: the test, the rank and signal, the machine's CPU, the rank's own stack) and the session's
    summary ends with them all. Such a crash is rare, seen only on CI's machines and never reproduced on demand
    (FSDP2 over gloo, torch 2.13; docs/runtime.md says what was tried): it must not fail the suite by chance, while a
    crash that repeats, and every other failure, still does."""
    saved = {}
    for directory in state:
        aside = directory.with_name(directory.name + ".before-run")
        shutil.rmtree(aside, ignore_errors=True)
        saved[directory] = shutil.copytree(directory, aside, symlinks=True) if directory.exists() else None
    env = {**os.environ, "PYTHONFAULTHANDLER": "1"}
    run = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout, env=env)
    if run.returncode != 0 and NATIVE_CRASH.search(run.stderr):
        story = why_failed(run, tail=1500)
        warnings.warn(f"a rank crashed in native code; running once more from where it started:\n{story}")
        for directory, aside in saved.items():
            shutil.rmtree(directory, ignore_errors=True)
            if aside is not None:
                shutil.copytree(aside, directory, symlinks=True)
        first = run
        run = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout, env=env)
        test = os.environ.get("PYTEST_CURRENT_TEST", "").removesuffix(" (call)").removesuffix(" (setup)")
        record_rerun(f"{test or '?'}: {shlex.join(str(c) for c in cmd)[:300]}",
                     f"{crashed_ranks(first.stderr)}; the rerun exited {run.returncode}", story)
    for aside in saved.values():
        if aside is not None:
            shutil.rmtree(aside, ignore_errors=True)
    return run


LFS_POINTER = ("version https://git-lfs.github.com/spec/v1\noid sha256:4d7a214614ab2935c943f9e0ff69d22eadbb8f32b1258d"
               "aaa5e2ca24d17e2393\nsize 1234567\n")  # what a hub clone made without git-lfs holds for a large file


def rank_lines(stderr: str, text: str) -> int:
    """How many lines of a torchrun run's stderr that the ranks printed hold `text`: torchrun's failure summary,
    whose root cause repeats the error line a rank stopped on (harness/cli.torchrun_error_file), is not theirs."""
    return sum(text in line for line in stderr.splitlines() if not line.startswith("  traceback : "))
