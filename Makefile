# launcher: `make help` lists the targets. Every target sets up .venv first if needed.
#   make train RECIPE=ddp ARGS="model=gpt_small optim.lr=1e-3 train.steps=300"

PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
RECIPE ?=
ARGS   ?=
RUN    ?=

.DEFAULT_GOAL := help
.PHONY: help setup train test test-quick bench lint clean

help: ## list the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-11s %s\n", $$1, $$2}'
	@echo '  RECIPE=<conf/recipe name>  ARGS="<hydra overrides>"  e.g. make train RECIPE=ddp ARGS="train.steps=300"'

setup: $(STAMP) ## make .venv and install the project (torch pinned; CPU wheel here, CUDA on GPU hosts)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install --quiet --upgrade pip
	$(VENV)/bin/pip install --quiet -e '.[dev]'
	touch $(STAMP)

train: setup ## train: RECIPE=<name> ARGS="<overrides>" (--dry-run in ARGS prints, starts nothing)
	$(PY) -m launcher train $(if $(RECIPE),recipe=$(RECIPE)) $(ARGS)

test: setup ## the full test suite (real processes; about 10 minutes on 2 cores)
	$(PY) -m pytest -q tests

test-quick: setup ## the suite without the slow multi-process tests
	$(PY) -m pytest -q -m "not slow" tests

bench: setup ## throughput benchmarks; writes bench/results.md
	$(PY) scripts/bench.py

clean: ## remove outputs/ and multirun/ (runs and checkpoints!)
	rm -rf outputs multirun
