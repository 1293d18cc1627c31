"""`make gpu-smoke` on a machine without a GPU: one line saying it needs one, and exit status 2 (nothing was checked,
so a CI job that runs it without a GPU does not pass)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def test_the_smoke_script_says_in_one_line_that_it_needs_a_gpu():
    run = subprocess.run([sys.executable, "tests/gpu_smoke.py"], cwd=REPO, capture_output=True, text=True,
                         timeout=120, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert run.returncode == 2 and run.stdout.count("\n") == 1 and "no CUDA GPU" in run.stdout, run


@pytest.mark.skipif(shutil.which("nvidia-smi") is not None, reason="this machine has nvidia-smi: make would run it")
def test_make_gpu_smoke_says_so_before_installing_anything():
    run = subprocess.run(["make", "-s", "gpu-smoke"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and run.stdout.strip().splitlines() == [
        "make gpu-smoke: no NVIDIA GPU here (nvidia-smi finds none); it checks the GPU path on one or two GPUs"], run
