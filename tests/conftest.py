"""Test-wide settings: the Hypothesis profiles.

The tests are filed by subject, one folder per layer of docs/architecture.md: ``core/`` (the ledger, the
pool, tables, identity, eviction, tiers, the sizing planner, the C core), ``scheduler/`` (the scheduler, the
driver, replica assembly, request intake), ``cli/``, ``lab/`` (the admission lab and the web lab), ``sim/``,
``runtime/``, ``server/``, ``fleet/`` and ``diagnostics/``; ``vllm_integration/`` drives vLLM itself and is
collected only where vLLM is installed (``make test-vllm``). What stays at this level checks several layers at
once: the layering of the source (test_layering.py), the known answers (test_golden.py), the named behaviours
the golden transcripts pin only as digests (test_named_behaviour.py), the randomised fuzz and its regressions
(test_fuzz_short.py, test_fuzz_regressions.py, over the ledger and the scheduler together) and the one
percentile definition every report uses (test_one_percentile.py). Helpers shared across folders stay here too
(fuzzing.py, mutation.py, plant_survivors.py, schema_fuzz.py, golden/, data/).

* ``deterministic`` (the default, what ``make test`` runs): derandomised -- the same examples on every
  run and every machine, so a failure is reproducible and never intermittent -- with a bounded number
  of examples, no example database, and bounded shrinking, so a failing property reports in seconds.
* ``fuzz`` (``HYPOTHESIS_PROFILE=fuzz``, for ``make fuzz``): new random examples every run, many more
  of them, and full shrinking. A failure prints a ``@reproduce_failure`` blob to replay it.

Tests that pin ``max_examples`` themselves keep their count in both profiles; the ledger's property
tests take theirs from the profile, so ``fuzz`` searches them far harder.
"""

from __future__ import annotations

import importlib.util
import os

from hypothesis import HealthCheck, settings

_COMMON = {
    "deadline": None,  # no timed assertions: a loaded 2-core CI machine must not fail a property
    "database": None,
    "print_blob": True,
    "suppress_health_check": [HealthCheck.too_slow, HealthCheck.data_too_large],
}

settings.register_profile("deterministic", derandomize=True, max_examples=100, **_COMMON)
settings.register_profile("fuzz", derandomize=False, max_examples=2000, **_COMMON)

PROFILE = os.environ.get("HYPOTHESIS_PROFILE", "deterministic")
settings.load_profile(PROFILE)  # an unknown name fails here, loudly, before any test runs


def _bound_shrinking(max_shrinks: int, max_seconds: int) -> None:
    """Hypothesis has no public setting for the length of shrinking; its engine reads these two
    module constants (500 shrinks, 300 s by default). Bounded, a failing derandomised property still
    shrinks to a readable example, in seconds rather than minutes. If a future Hypothesis renames them,
    shrinking is simply unbounded again."""
    from hypothesis.internal.conjecture import engine

    if hasattr(engine, "MAX_SHRINKS"):
        engine.MAX_SHRINKS = max_shrinks
    if hasattr(engine, "MAX_SHRINKING_SECONDS"):
        engine.MAX_SHRINKING_SECONDS = max_seconds


if PROFILE == "deterministic":
    _bound_shrinking(max_shrinks=100, max_seconds=10)


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:  # noqa: ANN001 -- pytest's hook
    """Print the short fuzz's seed and operation counts (tests/test_fuzz_short.py), pass or fail, so a
    run can be replayed."""
    import sys

    for name in ("tests.test_fuzz_short", "test_fuzz_short"):
        module = sys.modules.get(name)
        if module is not None and getattr(module, "SUMMARY", None):
            terminalreporter.write_sep("-", "randomised fuzz (new seed each run; KVLEDGER_FUZZ_SEED=N replays)")
            for line in module.SUMMARY:
                terminalreporter.write_line(line)
            return

# tests/vllm_integration/ drives vLLM itself: it runs where vLLM is installed (`make test-vllm`'s .venv-vllm),
# never in kvledger's own .venv, which keeps vLLM out of its dependencies.
collect_ignore = [] if importlib.util.find_spec("vllm") is not None else ["vllm_integration"]
