"""`/metrics` as Prometheus reads it (prometheus_client's own text parser): vLLM's names, ours, and
counters that move by exactly what a request did."""

from __future__ import annotations

import uuid

import pytest
from prometheus_client.parser import text_string_to_metric_families

pytestmark = pytest.mark.model

VLLM_NAMES = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
              "vllm:prefix_cache_queries", "vllm:prefix_cache_hits", "vllm:num_preemptions",
              "vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds",
              "vllm:e2e_request_latency_seconds", "vllm:prompt_tokens", "vllm:generation_tokens")


def scrape(server) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:  # noqa: ANN001
    resp = server.get("/metrics")
    assert resp.status_code == 200
    assert resp.headers["content-type"].startswith("text/plain")
    out = {}
    for family in text_string_to_metric_families(resp.text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def families(server) -> dict[str, str]:  # noqa: ANN001
    return {f.name: f.type for f in text_string_to_metric_families(server.get("/metrics").text)}


def value(samples: dict, name: str, **labels: str) -> float:
    want = tuple(sorted(labels.items()))
    hits = [v for (n, lab), v in samples.items() if n == name and all(p in lab for p in want)]
    assert len(hits) == 1, (name, labels, hits)
    return hits[0]


def test_vllm_and_kvledger_names_are_exposed(server) -> None:
    types = families(server)
    for name in VLLM_NAMES:
        assert name in types, name
    assert types["vllm:prompt_tokens"] == "counter"
    assert types["vllm:time_to_first_token_seconds"] == "histogram"
    assert types["vllm:kv_cache_usage_perc"] == "gauge"
    for name in ("kvledger:blocks", "kvledger:admissions", "kvledger:evictions", "kvledger:swapped_blocks",
                 "kvledger:tenant_prompt_tokens", "kvledger:tenant_prefix_cache_hits"):
        assert name in types, name
    samples = scrape(server)
    states = {dict(lab)["state"] for (n, lab) in samples if n == "kvledger:blocks"}
    assert {"free", "active", "retained", "promised", "pinned", "leased"} <= states
    # Blocks by physical state add up to the pool (promised is a claim, not a state of its own).
    total = sum(value(samples, "kvledger:blocks", state=s) for s in ("free", "active", "retained"))
    assert total == value(samples, "kvledger:pool_blocks") == server.pool_blocks


def test_counters_move_by_what_a_request_did(server) -> None:
    client = server.client(server.keys["globex"])
    prompt = f"[{uuid.uuid4().hex[:8]}] " + "Metrics count what happened, no more and no less. " * 6
    before = scrape(server)
    first = client.completions.create(model="smollm2-135m", prompt=prompt, max_tokens=5, temperature=0,
                                      extra_body={"ignore_eos": True})
    second = client.completions.create(model="smollm2-135m", prompt=prompt, max_tokens=5, temperature=0,
                                       extra_body={"ignore_eos": True})
    server.wait_idle()
    after = scrape(server)

    def moved(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    plen = first.usage.prompt_tokens
    hit = second.usage.prompt_tokens_details.cached_tokens
    assert hit > 0
    assert moved("vllm:prompt_tokens_total") == 2 * plen
    assert moved("vllm:generation_tokens_total") == 10
    assert moved("vllm:request_success_total", finished_reason="length") == 2
    assert moved("vllm:time_to_first_token_seconds_count") == 2
    assert moved("vllm:e2e_request_latency_seconds_count") == 2
    assert moved("vllm:inter_token_latency_seconds_count") == 2 * 4
    assert moved("vllm:prefix_cache_queries_total") == 2 * plen
    assert moved("vllm:prefix_cache_hits_total") >= hit  # the ledger counts whole hit blocks
    assert moved("kvledger:admissions_total", outcome="admitted") == 2
    assert moved("kvledger:tenant_requests_total", tenant="globex") == 2
    assert moved("kvledger:tenant_prompt_tokens_total", tenant="globex") == 2 * plen
    assert moved("kvledger:tenant_generation_tokens_total", tenant="globex") == 10
    assert moved("kvledger:tenant_cached_tokens_total", tenant="globex") == hit
    assert moved("kvledger:tenant_prefix_cache_hits_total", tenant="globex") >= hit
    assert moved("kvledger:tenant_prompt_tokens_total", tenant="acme") == 0  # nobody else's counters
    # Idle again: nothing running, waiting, held or promised.
    assert value(after, "vllm:num_requests_running") == 0
    assert value(after, "vllm:num_requests_waiting") == 0
    assert value(after, "vllm:kv_cache_usage_perc") == 0
    assert value(after, "kvledger:blocks", state="promised") == 0
    for state in ("active", "promised", "growth"):
        assert value(after, "kvledger:tenant_blocks", tenant="globex", state=state) == 0
    assert value(after, "kvledger:tenant_block_cap", tenant="capped") == server.capped_blocks


def test_refusals_are_counted(server) -> None:
    before = scrape(server)
    bad = server.client("sk-nobody")
    with pytest.raises(Exception):  # noqa: B017 -- AuthenticationError; the counter is what is tested
        bad.completions.create(model="smollm2-135m", prompt="hi", max_tokens=1)
    after = scrape(server)
    assert (value(after, "kvledger:requests_refused_total", reason="unauthorized")
            - value(before, "kvledger:requests_refused_total", reason="unauthorized")) == 1
