"""``kvledger:`` metrics beside vLLM's: the engine core's scheduler publishes them, and vLLM's own
``/metrics`` registry (``get_prometheus_registry``, multiprocess when ``PROMETHEUS_MULTIPROC_DIR`` is set, as
with ``--api-server-count`` > 1) serves them."""

from __future__ import annotations

import json
import os
import subprocess
import sys

ENGINE_CORE = r"""
import json, sys
from kvledger.integrations.vllm.harness import build_scheduler
h = build_scheduler("kvledger", num_blocks=60, max_num_batched_tokens=512,
                    additional_config={"kvledger": {"quotas": {"small": 2}}})
for i in range(12):
    h.add(f"r{i}", [i + 1] * 70, 20, cache_salt="small" if i == 0 else None)
h.run()
sched = h.scheduler
ledger = sched.kv_cache_manager.ledger
print(json.dumps(ledger.stats()))
"""


def samples(text: str) -> dict[tuple[str, str], float]:
    """``(metric name, label text)`` -> value for the ``kvledger:`` lines of a /metrics page."""
    out = {}
    for line in text.splitlines():
        if line.startswith("kvledger:"):
            name_labels, value = line.rsplit(" ", 1)
            name, _, labels = name_labels.partition("{")
            out[(name, labels.rstrip("}"))] = float(value)
    return out


def test_the_engine_cores_kvledger_metrics_are_on_vllms_metrics_page(tmp_path) -> None:
    env = dict(os.environ, PROMETHEUS_MULTIPROC_DIR=str(tmp_path))
    child = subprocess.run([sys.executable, "-c", ENGINE_CORE], env=env, capture_output=True, text=True,
                           timeout=300, check=True)
    stats = json.loads(child.stdout.strip().splitlines()[-1])
    # What vLLM's API server does for /metrics (entrypoints/serve/instrumentator/metrics.py).
    from prometheus_client import generate_latest
    from vllm.v1.metrics.prometheus import get_prometheus_registry
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = str(tmp_path)
    try:
        page = generate_latest(get_prometheus_registry()).decode()
    finally:
        del os.environ["PROMETHEUS_MULTIPROC_DIR"]
    got = samples(page)
    model = next(labels for (name, labels) in got if name == "kvledger:blocks").split('"')[1]
    for state in ("active", "retained", "free", "promised", "pinned"):
        assert got[("kvledger:blocks", f'model_name="{model}",state="{state}"')] == stats["usage"][state]
    for outcome in ("admitted", "never"):
        assert got[("kvledger:admissions_total", f'model_name="{model}",outcome="{outcome}"')] == \
            stats["admissions"][outcome]
    # refreshed as the engine went idle (no step would refresh them later), not 0.5 s before
    assert stats["usage"]["retained"] > 0 and stats["usage"]["active"] == 0 and stats["admissions"]["never"] == 1


def test_metrics_off_publishes_nothing() -> None:
    from kvledger.integrations.vllm.harness import build_scheduler
    h = build_scheduler("kvledger", num_blocks=32, additional_config={"kvledger": {"metrics": False}})
    assert h.scheduler._kvl_metrics is None
