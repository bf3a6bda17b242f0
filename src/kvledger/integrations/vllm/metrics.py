"""kvledger's ``kvledger:`` Prometheus metrics beside vLLM's ``vllm:`` ones, from the engine core.

vLLM's ``/metrics`` is prometheus_client's registry in the API server process; the scheduler runs in the
engine core. With ``PROMETHEUS_MULTIPROC_DIR`` set (vLLM sets it itself for ``--api-server-count`` > 1,
and honours it when a user sets it) vLLM's ``/metrics`` reads every process's metric files there, so the
engine core's ``kvledger:`` metrics appear beside vLLM's; with the engine in the server's process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``) they are in the default registry it serves. Otherwise they are
kept in the engine core process only (and vLLM's ``/metrics`` does not show them): the start-up log says
so.

* ``kvledger:blocks{state}``: the pool by the ledger's states -- ``active`` (held by running requests
  or pins), ``retained`` (cached, idle, evictable), ``free``, ``promised`` (free blocks reserved for
  admitted requests' growth, part of ``free``) and ``pinned`` (part of ``active``).
* ``kvledger:admissions_total{outcome}``: ``admitted``, ``readmitted`` (after a preemption), ``not_now``
  (refused for now: kept waiting), ``never`` (refused for good: over its quota, ended with an error).
* ``kvledger:check_failures_total``: ``check`` mode's failed audits (each also stops the engine).
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

logger = logging.getLogger(__name__)

STATES = ("active", "retained", "free", "promised", "pinned")
OUTCOMES = ("admitted", "readmitted", "not_now", "never")
_FAMILIES: dict[int, tuple[Any, Any, Any]] = {}  # registry id -> its metric families (registered once)


def _families(registry: Any) -> tuple[Any, Any, Any]:
    from prometheus_client import Counter, Gauge
    key = id(registry)
    if key not in _FAMILIES:
        kw = {"registry": registry}
        _FAMILIES[key] = (
            Gauge("kvledger:blocks", "KV blocks by kvledger ledger state (promised is part of free, pinned of "
                  "active)", ["model_name", "state"], multiprocess_mode="mostrecent", **kw),
            Counter("kvledger:admissions", "kvledger admission decisions by outcome", ["model_name", "outcome"], **kw),
            Counter("kvledger:check_failures", "kvledger ledger audits (check mode) that failed", ["model_name"], **kw))
    return _FAMILIES[key]


class LedgerMetrics:
    """The ``kvledger:`` metrics of one scheduler, refreshed at most every ``interval_s`` seconds."""

    def __init__(self, model_name: str, registry: Any = None, interval_s: float = 0.5) -> None:
        from prometheus_client import REGISTRY
        self.model_name = model_name
        self.interval_s = interval_s
        blocks, admissions, failures = _families(REGISTRY if registry is None else registry)
        self._blocks = {s: blocks.labels(model_name=model_name, state=s) for s in STATES}
        self._admissions = {o: admissions.labels(model_name=model_name, outcome=o) for o in OUTCOMES}
        self._failures = failures.labels(model_name=model_name)
        self._counted = dict.fromkeys(OUTCOMES, 0)
        self._next = 0.0
        if not os.environ.get("PROMETHEUS_MULTIPROC_DIR") and os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING",
                                                                             "1") != "0":
            logger.info("kvledger: its kvledger: metrics stay in the engine core process; set "
                        "PROMETHEUS_MULTIPROC_DIR to an empty folder for vLLM's /metrics to show them")

    def maybe_update(self, ledger: Any) -> None:
        now = time.monotonic()
        if now >= self._next:
            self._next = now + self.interval_s
            self.update(ledger)

    def update(self, ledger: Any) -> None:
        stats = ledger.stats()
        usage = stats["usage"]
        for state in STATES:
            self._blocks[state].set(usage[state])
        admissions = stats["admissions"]
        for outcome in OUTCOMES:
            delta = admissions[outcome] - self._counted[outcome]
            if delta > 0:
                self._admissions[outcome].inc(delta)
                self._counted[outcome] = admissions[outcome]

    def check_failed(self) -> None:
        self._failures.inc()
