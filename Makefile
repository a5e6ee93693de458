# launcher: `make help` lists the targets. Every target sets up .venv first if needed.
# Recipes are silent (@): make prints only what the program prints, so `make plan ARGS="--json"`
# is JSON on stdout. make turns every failure into exit 2: scripts that need the launcher's own
# exit codes (74, 75, 124, 130) call .venv/bin/launcher directly.
#   make train RECIPE=ddp ARGS="model=gpt_small optim.lr=1e-3 train.steps=300"

PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
TESTED := $(VENV)/.installed-test
# The first run's install (model=hf, data=hf_text, fine-tuning, TensorBoard); the suite's and the
# GPU check's on top of it: pytest, torchao (precision=fp8: GPUs of compute capability 8.9+) and the
# Kubernetes schemas (tests only).
RUN_EXTRAS := hf,tb
TEST_EXTRAS := dev,fp8,k8s
RECIPE ?=
ARGS   ?=
RUN    ?=
# Where setup installs from: WHEELHOUSE, except for `make wheelhouse`, where WHEELHOUSE names the
# folder being written (setup then installs online, as it must to download the wheels).
FROM   := $(if $(filter wheelhouse,$(MAKECMDGOALS)),,$(WHEELHOUSE))

.DEFAULT_GOAL := help
.PHONY: help setup wheelhouse gpu-check train data plan rehearse submit export lint test test-quick bench clean

help: ## list the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-11s %s\n", $$1, $$2}'
	@echo '  RECIPE=<conf/recipe name>  ARGS="<hydra overrides>"  e.g. make train RECIPE=ddp ARGS="train.steps=300"'

setup: $(STAMP) ## make .venv, install the project and the hf, tb extras (torch pinned; CPU wheel here, CUDA on GPU hosts); BUILD_OPS=1 also compiles DeepSpeed's ops now; offline: WHEELHOUSE=<dir> [TORCH=system]

# Offline (make wheelhouse wrote <dir>): everything from <dir> with --no-index. TORCH=system keeps
# the torch the system Python imports (a site's CUDA build; the venv reads its site-packages
# after its own, through a .pth file), else the wheelhouse must hold torch==2.13.0 too.
# DeepSpeed's ops compile when a run first needs one (the launcher says so; launcher/ops.py), or
# here with BUILD_OPS=1; the test set-up compiles them (the suite runs every ZeRO recipe) unless BUILD_OPS=0.
$(STAMP): pyproject.toml
	@echo 'setting up $(VENV) (once, 2-3 minutes): python -m venv, pip install -e .[$(RUN_EXTRAS)]$(if $(FROM), from $(FROM) offline)' >&2
	@case '$(TORCH)' in ''|system) ;; *) echo "error: TORCH=$(TORCH): allowed: system (keep the torch $(PYTHON) imports), or leave it out" >&2; exit 2;; esac
	@test -n '$(FROM)' -o -z '$(TORCH)' || { echo 'error: TORCH=system goes with WHEELHOUSE=<dir> (make wheelhouse); online, make setup installs the pinned torch' >&2; exit 2; }
ifneq ($(FROM),)
	@test -f '$(FROM)/requirements.txt' || { echo 'error: WHEELHOUSE=$(FROM) has no requirements.txt; make wheelhouse writes one' >&2; exit 2; }
endif
	@$(PYTHON) -m venv $(VENV)
ifneq ($(FROM),)
ifeq ($(TORCH),system)
	@$(PYTHON) -c 'import torch, pathlib; print(pathlib.Path(torch.__file__).parent.parent)' > "$$($(PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/system-torch.pth" \
		|| { echo 'error: TORCH=system, but $(PYTHON) cannot import torch' >&2; exit 2; }
else
	@$(VENV)/bin/pip install --quiet --no-index --find-links '$(FROM)' 'torch==2.13.0' >&2
endif
	@$(VENV)/bin/pip install --quiet --no-index --find-links '$(FROM)' -r '$(FROM)/requirements.txt' >&2
	@PYTHONWARNINGS=ignore $(VENV)/bin/pip install --quiet --no-index --find-links '$(FROM)' --no-deps -e . >&2
else
	@$(VENV)/bin/pip install --quiet --upgrade pip >&2
	@PYTHONWARNINGS=ignore $(VENV)/bin/pip install --quiet -e '.[$(RUN_EXTRAS)]' >&2
endif
	@$(if $(filter 1,$(BUILD_OPS)),$(PY) scripts/build_ops.py,true)
	@touch $(STAMP)

# What the suite, the GPU check and the wheelhouse need beyond the first run's install (offline,
# the wheelhouse's requirements.txt installed everything it holds already).
$(TESTED): $(STAMP)
	@echo 'setting up the tests (once): pip install -e .[$(RUN_EXTRAS),$(TEST_EXTRAS)]$(if $(filter 0,$(BUILD_OPS)),, and DeepSpeed ops (scripts/build_ops.py))' >&2
ifeq ($(FROM),)
	@PYTHONWARNINGS=ignore $(VENV)/bin/pip install --quiet -e '.[$(RUN_EXTRAS),$(TEST_EXTRAS)]' >&2
endif
	@$(if $(filter 0,$(BUILD_OPS)),true,$(PY) scripts/build_ops.py)
	@touch $(TESTED)

wheelhouse: $(TESTED) ## wheels of every dependency but torch for offline nodes: WHEELHOUSE=<dir> PYVER=3.12 [PLATFORM=manylinux2014_x86_64] [EXTRAS=dev,hf,tb,fp8]
	@$(PY) scripts/wheelhouse.py --out '$(or $(WHEELHOUSE),wheelhouse)' $(if $(PYVER),--python '$(PYVER)') $(if $(PLATFORM),--platform '$(PLATFORM)') $(if $(filter undefined,$(origin EXTRAS)),,--extras '$(EXTRAS)')

train: setup ## train: RECIPE=<name> ARGS="<overrides>" (--dry-run in ARGS prints, starts nothing)
	@$(PY) -m launcher train $(if $(RECIPE),recipe=$(RECIPE)) $(ARGS)

data: setup ## data=hf_text (or data=chat) tokenized once, by every core, into the shared cache (ARGS="data.files='corpus/*.jsonl' data.tokenizer=byte")
	@$(PY) -m launcher data $(ARGS)

plan: setup ## memory per GPU of every recipe, the largest micro-batch that fits, the recommendation (ARGS="... --json")
	@$(PY) -m launcher plan $(ARGS)

rehearse: setup ## ranks of a cluster-sized layout built here on meta under a fake process group, against the plan (ARGS="model=llama3_70b recipe=tp_fsdp parallel.tp=8 cluster.nnodes=32 cluster.gpus_per_node=8")
	@$(PY) -m launcher rehearse $(ARGS)

submit: setup ## Slurm batch job: RECIPE=<name> ARGS="cluster.nnodes=2 cluster.partition=gpu ..." (cluster=k8s: a Kubernetes job; --dry-run prints it)
	@$(PY) -m launcher submit $(if $(RECIPE),recipe=$(RECIPE)) $(ARGS)

export: setup ## consolidated weights: RUN=<run dir> [export.dtype=bf16] [export.step=N] [export.format=...]
	@test -n "$(RUN)" || { echo 'error: RUN=<run directory> is required, e.g. make export RUN=outputs/2026-11-22/07-00-14-ddp' >&2; exit 2; }
	@$(PY) -m launcher export "$(RUN)" $(foreach k,format dtype step out,$(if $(export.$(k)),export.$(k)=$(export.$(k)))) $(ARGS)

# pytest-xdist workers, whole test files each (a file's shared runs stay in one worker): a
# run uses 2-4 processes, so half the cores, and 2 on 2 cores (about 25 minutes there; 3
# workers on 2 cores were no faster, 24:28: the suite is bound by its processes' CPU).
TEST_WORKERS ?= $(shell n=$$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc 2>/dev/null || echo 2); echo $$(( n > 4 ? n / 2 : 2 )))

# The formatter, the linter and the type checker (pyproject.toml: [tool.ruff], [tool.mypy]), pinned in
# the dev extra; the test targets run it first, so a tree that fails it runs no test.
lint: $(TESTED) ## ruff format --check, ruff check and mypy on the whole tree (seconds; ruff format . fixes the first)
	@$(PY) -m ruff format --check --quiet . || { echo 'lint: run .venv/bin/python -m ruff format . (then commit)' >&2; exit 1; }
	@$(PY) -m ruff check --quiet .
	@$(PY) -m mypy

test: $(TESTED) lint ## the full test suite: tests/unit and tests/e2e (real processes; about 25 minutes on 2 cores) [TEST_WORKERS=N]
	@$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --durations=25 tests

test-quick: $(TESTED) lint ## tests/unit only: in-process checks and quick commands, no multi-process runs (about 4 minutes)
	@$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile tests/unit

# The dry-run plans on CPU and needs the first run's install only; the cases need the tests' set-up.
gpu-check: $(if $(findstring --dry-run,$(ARGS)),$(STAMP),$(TESTED)) ## on a GPU machine: the GPU cases in priority order within ARGS=--budget-s (720), appended to bench/gpu.md; ARGS=--dry-run lists them here
	@$(PY) scripts/gpu_check.py $(ARGS)

bench: setup ## recipes against hand-written loops, interleaved, and start-up; writes bench/results.md (ARGS="--models llama_5m --only ddp zero2")
	@$(PY) scripts/bench.py $(ARGS)

clean: ## remove outputs/ and multirun/ (runs and checkpoints!)
	rm -rf outputs multirun
