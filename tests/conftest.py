"""Shared test setup: the repository root on sys.path, so tests import the top-level modules as `import grpo`."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import pytest  # noqa: E402

import tasks  # noqa: E402

tasks.set_vllm_cpu_env()  # before any test imports vllm


@pytest.fixture(scope="session")
def base_model_dir() -> Path:
    """The embedded tiny base model, built once (a few minutes) and cached under .cache/ by its fingerprint."""
    return tasks.build_base_model(progress=False)
