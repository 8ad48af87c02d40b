# Data-Parallel PyTorch. `make help` lists the targets.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TARGET ?= solutions
LESSON ?=
JOBS ?= 2
PYTEST_ARGS ?=

LESSON_TESTS = $(if $(LESSON),$(wildcard tests/l$(LESSON)_*),tests)

QUICK ?=
METHODS ?=
NPROCS ?=
BENCH_ARGS ?=

.PHONY: help setup data test grade exercises lint run-01 benchmark clean

help:
	@echo "make setup        create $(VENV) from pyproject.toml (torch, lightning, jupyter, pytest, ...)"
	@echo "make data         put Fashion-MNIST (and MNIST when online) under data/"
	@echo "make test         run the tests on solutions/ (LESSON=03 for one lesson)"
	@echo "make grade        score a tree per lesson and task (TARGET=exercises by default)"
	@echo "make exercises    regenerate exercises/ and notebooks/ from solutions/"
	@echo "make benchmark    time 1-vs-N runs of every method in rounds, into benchmarks/runs/latest/ (QUICK=1, METHODS=a,b, NPROCS=1,2)"
	@echo "make run-01       lesson 01's solution: train one epoch and report test accuracy"
	@echo "make lint         ruff"

$(VENV)/.installed: pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --upgrade --quiet pip
	$(PY) -m pip install --quiet -e '.[dev]'
	@touch $@

setup: $(VENV)/.installed

data: setup
	$(PY) -m dpt.data fashion-mnist --optional mnist

test: setup data
	$(PY) -m pytest -n $(JOBS) $(LESSON_TESTS) $(PYTEST_ARGS)

grade: TARGET = exercises
grade: setup data
	$(PY) -m pytest -n $(JOBS) --target $(TARGET) --grade -q -m "not slow" -p no:randomly $(LESSON_TESTS) $(PYTEST_ARGS)

exercises: setup
	$(PY) tools/make_exercises.py

lint: setup
	$(VENV)/bin/ruff check dpt solutions tests tools benchmarks

benchmark: setup data
	$(PY) -m benchmarks.run $(if $(QUICK),--quick) $(if $(METHODS),--methods $(METHODS)) $(if $(NPROCS),--nprocs $(NPROCS)) $(BENCH_ARGS)

run-01: setup data
	$(PY) solutions/01_single_device/single_device.py --epochs 1

clean:
	rm -rf .pytest_cache **/__pycache__ benchmarks/results/tmp
