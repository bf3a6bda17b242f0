"""The operator's side of the very app `kvledger serve` runs, in-process (``inproc.py``): ``/metrics``
after known traffic (every sample's name, labels and value, less the latency figures; every metric's
HELP and TYPE), ``/admin/ledger`` idle and with a request in flight, and ``POST /reset_prefix_cache``
(operator only, 409 while blocks are held, ``reset_running_requests``). Tenants never see any of it, and
one tenant's cache never serves another.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from .inproc import KEYS, InProcServer, standard_server

pytestmark = pytest.mark.model

CAPITALS = "The capital of France is Paris. The capital of Germany is Berlin. The capital of Italy is"
PLANET = [{"role": "user", "content": "Name one planet."}]
M = 'model_name="smollm2-135m"'


@pytest.fixture
def srv(tmp_path: Path) -> Iterator[InProcServer]:
    yield from standard_server(tmp_path)


def figures(srv: InProcServer) -> dict[str, float]:
    """Every sample but the latencies' (bucket counts and sums depend on the clock) and creation times."""
    return {k: v for k, v in srv.metrics().items()
            if "_bucket{" not in k and "_sum{" not in k and "_created" not in k}


def known_traffic(srv: InProcServer) -> None:
    """Two acme completions (the second reads a block from acme's cache), one globex chat, a stopped
    stream, and one refusal of each kind the HTTP boundary counts but queue_full and draining."""
    ok = [srv.post("/v1/completions", {"prompt": CAPITALS, "max_tokens": 4, "temperature": 0}),
          srv.post("/v1/completions", {"prompt": CAPITALS, "max_tokens": 4, "temperature": 0}),
          srv.post("/v1/chat/completions", {"messages": PLANET, "max_tokens": 3, "temperature": 0},
                   key=KEYS["globex"]),
          srv.post("/v1/completions", {"prompt": "One, two, three,", "max_tokens": 8, "temperature": 0,
                                       "stop": " five"})]
    assert [r.status_code for r in ok] == [200] * 4
    assert [r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] for r in ok] == [0, 16, 0, 0]
    refusals = [srv.post("/v1/completions", {"prompt": "Hi"}, key=None),  # unauthorized
                srv.post("/v1/completions", {"prompt": "Hi"}, key=srv.operator_key),  # forbidden
                srv.get("/metrics", key=KEYS["acme"]),  # forbidden
                srv.post("/v1/completions", content=b"nope"),  # invalid
                srv.post("/v1/completions", {"prompt": "Hi", "model": "other"}),  # invalid (404)
                srv.post("/v1/completions", content=b" " * (2560 * 64 + 2**20 + 1)),  # too_large
                srv.post("/v1/completions", {"prompt": "Hi", "max_tokens": 2560}),  # never_fits
                srv.post("/v1/completions", {"prompt": "Hi", "max_tokens": 500}, key=KEYS["capped"])]  # tenant_cap
    assert [r.status_code for r in refusals] == [401, 403, 403, 400, 404, 413, 400, 400], [r.text for r in refusals]
    srv.wait_idle()


def test_metrics_after_known_traffic(srv: InProcServer) -> None:
    before = figures(srv)
    assert before == EXPECTED_BEFORE
    known_traffic(srv)
    after = figures(srv)
    # Engine steps: the stopped stream's cancel reaches the engine in the step after the stop string or in the
    # one after that (the HTTP side and the engine race), so the step count is one of two; every other figure
    # is exact.
    steps = 'vllm:iteration_tokens_total_count{engine="0",model_name="smollm2-135m"}'
    assert after.pop(steps) in (EXPECTED_FIGURES[steps], EXPECTED_FIGURES[steps] - 1)
    assert after == {k: v for k, v in EXPECTED_FIGURES.items() if k != steps}


def test_metrics_help_type_and_buckets(srv: InProcServer) -> None:
    """Every metric's HELP and TYPE line, and the latency histograms' bucket edges (vLLM's)."""
    text = srv.get("/metrics").text
    assert srv.get("/metrics").headers["content-type"] == "text/plain; version=0.0.4; charset=utf-8"
    assert [line for line in text.splitlines() if line.startswith("#")] == EXPECTED_COMMENTS
    edges: dict[str, list[str]] = {}
    for line in text.splitlines():
        if "_bucket{" in line:
            name, labels = line.split("_bucket{", 1)
            edges.setdefault(name, []).append(labels.split('le="', 1)[1].split('"', 1)[0])
    assert edges == EXPECTED_EDGES


def test_admin_ledger_idle_and_in_flight(srv: InProcServer) -> None:
    idle = srv.get("/admin/ledger")
    assert idle.status_code == 200
    assert idle.json() == {
        "clean": True, "running": 0, "sequences": 0, "leases": 0, "total_blocks": 160, "checked": True,
        "blocks": {"free": 160, "active": 0, "retained": 0, "evictable": 0, "promised": 0, "pinned": 0,
                   "leased": 0},
        "groups": {"capped": {"active": 0, "promised": 0, "growth": 0, "charged": 0, "cap": 6}},
        "gate": {"in_flight": 0, "waiting": 0}}
    with srv.http.stream("POST", srv.url + "/v1/completions", headers=srv.headers(KEYS["acme"]),
                         json={"prompt": "Tell a long story.", "max_tokens": 200, "ignore_eos": True,
                               "temperature": 0, "stream": True}) as a:
        lines = a.iter_lines()  # kept: dropping it would hang up
        next(lines)
        busy = srv.audit()
        assert busy["clean"] is False and busy["checked"] is True
        assert (busy["running"], busy["sequences"], busy["gate"]) == (1, 1, {"in_flight": 1, "waiting": 0})
        assert busy["blocks"]["active"] >= 1 and busy["groups"]["acme"]["active"] == busy["blocks"]["active"]
        assert sorted(busy) == sorted(idle.json())
    after = srv.wait_idle()  # the client hung up: cancelled, nothing held
    assert after["clean"] is True and after["blocks"]["active"] == 0
    assert srv.metrics()["kvledger:requests_cancelled_total"] == 1
    assert srv.metrics()[f'vllm:request_success_total{{engine="0",finished_reason="abort",{M}}}'] == 1


def test_reset_prefix_cache(srv: InProcServer) -> None:
    op = srv.operator_key
    assert srv.post("/v1/completions", {"prompt": CAPITALS, "max_tokens": 4, "temperature": 0}).status_code == 200
    r = srv.post("/reset_prefix_cache?reset_running_requests=maybe", key=op)
    assert (r.status_code, r.json()) == (400, {"error": {"message": "reset_running_requests must be true or false",
                                                         "type": "invalid_request_error",
                                                         "param": "reset_running_requests", "code": None}})
    with srv.http.stream("POST", srv.url + "/v1/completions", headers=srv.headers(KEYS["acme"]),
                         json={"prompt": "Tell a long story.", "max_tokens": 160, "ignore_eos": True,
                               "temperature": 0, "stream": True}) as a:
        # long enough to be running through all three refusals on a busy machine (40 tokens once finished first)
        lines = a.iter_lines()
        next(lines)
        for query in ("", "?reset_running_requests=false", "?reset_running_requests=0"):
            r = srv.post("/reset_prefix_cache" + query, key=op)
            assert (r.status_code, r.json()) == (409, {"error": {
                "message": "prefix cache not reset: blocks are still held: 1 running sequences",
                "type": "invalid_request_error", "param": None, "code": "cache_reset_refused"}})
        r = srv.post("/reset_prefix_cache?reset_running_requests=True", key=op)  # requeued, then reset
        assert r.status_code == 200 and r.json()["reset"] is True
        assert sorted(r.json()) == ["cleared_blocks", "cleared_tier_entries", "reason", "reset"]
        events = [json.loads(x[6:]) for x in lines if x.startswith("data: {")]
        assert events[-1]["choices"][0]["finish_reason"] == "length"  # the requeued request still finished
    srv.wait_idle()
    first = srv.post("/v1/completions", {"prompt": CAPITALS, "max_tokens": 4, "temperature": 0})
    assert first.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # the reset above emptied it
    retained = srv.audit()["blocks"]["retained"]
    assert retained > 0
    r = srv.post("/reset_prefix_cache", key=op)
    assert (r.status_code, r.json()) == (200, {"reset": True, "cleared_blocks": retained, "cleared_tier_entries": 0,
                                               "reason": f"{retained} cached blocks cleared"})
    assert srv.audit()["blocks"]["retained"] == 0
    again = srv.post("/v1/completions", {"prompt": CAPITALS, "max_tokens": 4, "temperature": 0})
    assert again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # the cache really is empty


# ---- known answers (a fresh server: before any request, and after known_traffic) --------------------------
EXPECTED_BEFORE: dict[str, float] = {
 'vllm:time_to_first_token_seconds_count{engine="0",model_name="smollm2-135m"}': 0.0,
 'vllm:inter_token_latency_seconds_count{engine="0",model_name="smollm2-135m"}': 0.0,
 'vllm:e2e_request_latency_seconds_count{engine="0",model_name="smollm2-135m"}': 0.0,
 'vllm:request_time_per_output_token_seconds_count{engine="0",model_name="smollm2-135m"}': 0.0,
 'vllm:request_queue_time_seconds_count{engine="0",model_name="smollm2-135m"}': 0.0,
 'vllm:request_prefill_time_seconds_count{engine="0",model_name="smollm2-135m"}': 0.0,
 'vllm:request_decode_time_seconds_count{engine="0",model_name="smollm2-135m"}': 0.0,
 'vllm:request_inference_time_seconds_count{engine="0",model_name="smollm2-135m"}': 0.0,
 'vllm:request_prompt_tokens_count{engine="0",model_name="smollm2-135m"}': 0.0,
 'vllm:request_generation_tokens_count{engine="0",model_name="smollm2-135m"}': 0.0,
 'vllm:request_max_num_generation_tokens_count{engine="0",model_name="smollm2-135m"}': 0.0,
 'vllm:request_params_max_tokens_count{engine="0",model_name="smollm2-135m"}': 0.0,
 'vllm:request_params_n_count{engine="0",model_name="smollm2-135m"}': 0.0,
 'vllm:request_num_preemptions_count{engine="0",model_name="smollm2-135m"}': 0.0,
 'vllm:request_prefill_kv_computed_tokens_count{engine="0",model_name="smollm2-135m"}': 0.0,
 'vllm:prompt_tokens_total{engine="0",model_name="smollm2-135m"}': 0.0,
 'vllm:prompt_tokens_cached_total{engine="0",model_name="smollm2-135m"}': 0.0,
 'vllm:prompt_tokens_by_source_total{engine="0",model_name="smollm2-135m",source="local_compute"}': 0.0,
 'vllm:prompt_tokens_by_source_total{engine="0",model_name="smollm2-135m",source="local_cache_hit"}': 0.0,
 'vllm:prompt_tokens_by_source_total{engine="0",model_name="smollm2-135m",source="external_kv_transfer"}': 0.0,
 'vllm:generation_tokens_total{engine="0",model_name="smollm2-135m"}': 0.0,
 'vllm:request_success_total{engine="0",finished_reason="stop",model_name="smollm2-135m"}': 0.0,
 'vllm:request_success_total{engine="0",finished_reason="length",model_name="smollm2-135m"}': 0.0,
 'vllm:request_success_total{engine="0",finished_reason="abort",model_name="smollm2-135m"}': 0.0,
 'vllm:request_success_total{engine="0",finished_reason="error",model_name="smollm2-135m"}': 0.0,
 'vllm:request_success_total{engine="0",finished_reason="repetition",model_name="smollm2-135m"}': 0.0,
 'kvledger:requests_refused_total{reason="unauthorized"}': 0.0,
 'kvledger:requests_refused_total{reason="forbidden"}': 0.0,
 'kvledger:requests_refused_total{reason="invalid"}': 0.0,
 'kvledger:requests_refused_total{reason="too_large"}': 0.0,
 'kvledger:requests_refused_total{reason="never_fits"}': 0.0,
 'kvledger:requests_refused_total{reason="tenant_cap"}': 0.0,
 'kvledger:requests_refused_total{reason="queue_full"}': 0.0,
 'kvledger:requests_refused_total{reason="draining"}': 0.0,
 'kvledger:tenant_requests_total{tenant="acme"}': 0.0,
 'kvledger:tenant_requests_total{tenant="capped"}': 0.0,
 'kvledger:tenant_requests_total{tenant="globex"}': 0.0,
 'kvledger:tenant_prompt_tokens_total{tenant="acme"}': 0.0,
 'kvledger:tenant_prompt_tokens_total{tenant="capped"}': 0.0,
 'kvledger:tenant_prompt_tokens_total{tenant="globex"}': 0.0,
 'kvledger:tenant_generation_tokens_total{tenant="acme"}': 0.0,
 'kvledger:tenant_generation_tokens_total{tenant="capped"}': 0.0,
 'kvledger:tenant_generation_tokens_total{tenant="globex"}': 0.0,
 'kvledger:tenant_cached_tokens_total{tenant="acme"}': 0.0,
 'kvledger:tenant_cached_tokens_total{tenant="capped"}': 0.0,
 'kvledger:tenant_cached_tokens_total{tenant="globex"}': 0.0,
 'vllm:num_requests_running{engine="0",model_name="smollm2-135m"}': 0.0,
 'vllm:num_requests_waiting{engine="0",model_name="smollm2-135m"}': 0.0,
 'vllm:kv_cache_usage_perc{engine="0",model_name="smollm2-135m"}': 0.0,
 'vllm:prefix_cache_queries_total{engine="0",model_name="smollm2-135m"}': 0.0,
 'vllm:prefix_cache_hits_total{engine="0",model_name="smollm2-135m"}': 0.0,
 'vllm:num_preemptions_total{engine="0",model_name="smollm2-135m"}': 0.0,
 'vllm:iteration_tokens_total_count{engine="0",model_name="smollm2-135m"}': 0.0,
 'kvledger:blocks{state="free"}': 160.0,
 'kvledger:blocks{state="active"}': 0.0,
 'kvledger:blocks{state="retained"}': 0.0,
 'kvledger:blocks{state="evictable"}': 0.0,
 'kvledger:blocks{state="promised"}': 0.0,
 'kvledger:blocks{state="pinned"}': 0.0,
 'kvledger:blocks{state="leased"}': 0.0,
 'kvledger:pool_blocks': 160.0,
 'kvledger:leases': 0.0,
 'kvledger:sequences': 0.0,
 'kvledger:admissions_total{outcome="admitted"}': 0.0,
 'kvledger:admissions_total{outcome="never"}': 0.0,
 'kvledger:admissions_total{outcome="not_now"}': 0.0,
 'kvledger:admissions_total{outcome="readmitted"}': 0.0,
 'kvledger:evictions_total': 0.0,
 'kvledger:requests_cancelled_total': 0.0,
 'kvledger:swapped_blocks_total{direction="in"}': 0.0,
 'kvledger:swapped_blocks_total{direction="out"}': 0.0,
 'kvledger:tier_demotion_failures_total{model_name="smollm2-135m"}': 0.0,
 'kvledger:tier_promotion_failures_total{model_name="smollm2-135m"}': 0.0,
 'kvledger:tenant_requests_in_flight{tenant="acme"}': 0.0,
 'kvledger:tenant_requests_in_flight{tenant="capped"}': 0.0,
 'kvledger:tenant_requests_in_flight{tenant="globex"}': 0.0,
 'kvledger:tenant_blocks{state="active",tenant="acme"}': 0.0,
 'kvledger:tenant_blocks{state="promised",tenant="acme"}': 0.0,
 'kvledger:tenant_blocks{state="growth",tenant="acme"}': 0.0,
 'kvledger:tenant_blocks{state="active",tenant="capped"}': 0.0,
 'kvledger:tenant_blocks{state="promised",tenant="capped"}': 0.0,
 'kvledger:tenant_blocks{state="growth",tenant="capped"}': 0.0,
 'kvledger:tenant_blocks{state="active",tenant="globex"}': 0.0,
 'kvledger:tenant_blocks{state="promised",tenant="globex"}': 0.0,
 'kvledger:tenant_blocks{state="growth",tenant="globex"}': 0.0,
 'kvledger:tenant_block_cap{tenant="capped"}': 6.0,
 'kvledger:tenant_quota_refusals_total{tenant="acme"}': 0.0,
 'kvledger:tenant_quota_refusals_total{tenant="capped"}': 0.0,
 'kvledger:tenant_quota_refusals_total{tenant="globex"}': 0.0,
 'kvledger:tenant_prefix_cache_queries_total{tenant="acme"}': 0.0,
 'kvledger:tenant_prefix_cache_queries_total{tenant="capped"}': 0.0,
 'kvledger:tenant_prefix_cache_queries_total{tenant="globex"}': 0.0,
 'kvledger:tenant_prefix_cache_hits_total{tenant="acme"}': 0.0,
 'kvledger:tenant_prefix_cache_hits_total{tenant="capped"}': 0.0,
 'kvledger:tenant_prefix_cache_hits_total{tenant="globex"}': 0.0,
}
EXPECTED_COMMENTS: list[str] = [
 '# HELP vllm:time_to_first_token_seconds Time to first token (server side).',
 '# TYPE vllm:time_to_first_token_seconds histogram',
 '# HELP vllm:time_to_first_token_seconds_created Time to first token (server side).',
 '# TYPE vllm:time_to_first_token_seconds_created gauge',
 '# HELP vllm:inter_token_latency_seconds Time between consecutive tokens of a sequence.',
 '# TYPE vllm:inter_token_latency_seconds histogram',
 '# HELP vllm:inter_token_latency_seconds_created Time between consecutive tokens of a sequence.',
 '# TYPE vllm:inter_token_latency_seconds_created gauge',
 '# HELP vllm:e2e_request_latency_seconds Request latency, arrival to last token.',
 '# TYPE vllm:e2e_request_latency_seconds histogram',
 '# HELP vllm:e2e_request_latency_seconds_created Request latency, arrival to last token.',
 '# TYPE vllm:e2e_request_latency_seconds_created gauge',
 "# HELP vllm:request_time_per_output_token_seconds A request's mean time per output token after the first "
 '(decode time / (tokens - 1); 0 with one token).',
 '# TYPE vllm:request_time_per_output_token_seconds histogram',
 "# HELP vllm:request_time_per_output_token_seconds_created A request's mean time per output token after the "
 'first (decode time / (tokens - 1); 0 with one token).',
 '# TYPE vllm:request_time_per_output_token_seconds_created gauge',
 "# HELP vllm:request_queue_time_seconds Time a request waited in the engine's queue (arrival to first admission).",
 '# TYPE vllm:request_queue_time_seconds histogram',
 "# HELP vllm:request_queue_time_seconds_created Time a request waited in the engine's queue (arrival to first "
 'admission).',
 '# TYPE vllm:request_queue_time_seconds_created gauge',
 "# HELP vllm:request_prefill_time_seconds Time from a request's admission to its first token.",
 '# TYPE vllm:request_prefill_time_seconds histogram',
 "# HELP vllm:request_prefill_time_seconds_created Time from a request's admission to its first token.",
 '# TYPE vllm:request_prefill_time_seconds_created gauge',
 "# HELP vllm:request_decode_time_seconds Time from a request's first token to its last.",
 '# TYPE vllm:request_decode_time_seconds histogram',
 "# HELP vllm:request_decode_time_seconds_created Time from a request's first token to its last.",
 '# TYPE vllm:request_decode_time_seconds_created gauge',
 "# HELP vllm:request_inference_time_seconds Time from a request's admission to its last token.",
 '# TYPE vllm:request_inference_time_seconds histogram',
 "# HELP vllm:request_inference_time_seconds_created Time from a request's admission to its last token.",
 '# TYPE vllm:request_inference_time_seconds_created gauge',
 '# HELP vllm:request_prompt_tokens Prompt tokens per request.',
 '# TYPE vllm:request_prompt_tokens histogram',
 '# HELP vllm:request_prompt_tokens_created Prompt tokens per request.',
 '# TYPE vllm:request_prompt_tokens_created gauge',
 '# HELP vllm:request_generation_tokens Generated tokens per request.',
 '# TYPE vllm:request_generation_tokens histogram',
 '# HELP vllm:request_generation_tokens_created Generated tokens per request.',
 '# TYPE vllm:request_generation_tokens_created gauge',
 '# HELP vllm:request_max_num_generation_tokens Most tokens any choice of a request generated.',
 '# TYPE vllm:request_max_num_generation_tokens histogram',
 '# HELP vllm:request_max_num_generation_tokens_created Most tokens any choice of a request generated.',
 '# TYPE vllm:request_max_num_generation_tokens_created gauge',
 '# HELP vllm:request_params_max_tokens The max_tokens request parameter (the budget given to the engine).',
 '# TYPE vllm:request_params_max_tokens histogram',
 '# HELP vllm:request_params_max_tokens_created The max_tokens request parameter (the budget given to the engine).',
 '# TYPE vllm:request_params_max_tokens_created gauge',
 '# HELP vllm:request_params_n The n request parameter.',
 '# TYPE vllm:request_params_n histogram',
 '# HELP vllm:request_params_n_created The n request parameter.',
 '# TYPE vllm:request_params_n_created gauge',
 '# HELP vllm:request_num_preemptions Times a request was preempted.',
 '# TYPE vllm:request_num_preemptions histogram',
 '# HELP vllm:request_num_preemptions_created Times a request was preempted.',
 '# TYPE vllm:request_num_preemptions_created gauge',
 '# HELP vllm:request_prefill_kv_computed_tokens Prompt tokens a request computed (cached ones excluded).',
 '# TYPE vllm:request_prefill_kv_computed_tokens histogram',
 '# HELP vllm:request_prefill_kv_computed_tokens_created Prompt tokens a request computed (cached ones excluded).',
 '# TYPE vllm:request_prefill_kv_computed_tokens_created gauge',
 '# HELP vllm:prompt_tokens_total Prompt tokens of finished requests.',
 '# TYPE vllm:prompt_tokens_total counter',
 '# HELP vllm:prompt_tokens_created Prompt tokens of finished requests.',
 '# TYPE vllm:prompt_tokens_created gauge',
 '# HELP vllm:prompt_tokens_cached_total Prompt tokens served from the prefix cache.',
 '# TYPE vllm:prompt_tokens_cached_total counter',
 '# HELP vllm:prompt_tokens_cached_created Prompt tokens served from the prefix cache.',
 '# TYPE vllm:prompt_tokens_cached_created gauge',
 '# HELP vllm:prompt_tokens_by_source_total Prompt tokens by source (computed or read from the prefix cache).',
 '# TYPE vllm:prompt_tokens_by_source_total counter',
 '# HELP vllm:prompt_tokens_by_source_created Prompt tokens by source (computed or read from the prefix cache).',
 '# TYPE vllm:prompt_tokens_by_source_created gauge',
 '# HELP vllm:generation_tokens_total Generated tokens.',
 '# TYPE vllm:generation_tokens_total counter',
 '# HELP vllm:generation_tokens_created Generated tokens.',
 '# TYPE vllm:generation_tokens_created gauge',
 '# HELP vllm:request_success_total Finished requests by finish reason.',
 '# TYPE vllm:request_success_total counter',
 '# HELP vllm:request_success_created Finished requests by finish reason.',
 '# TYPE vllm:request_success_created gauge',
 '# HELP kvledger:requests_refused_total Requests refused at the HTTP boundary, by reason.',
 '# TYPE kvledger:requests_refused_total counter',
 '# HELP kvledger:requests_refused_created Requests refused at the HTTP boundary, by reason.',
 '# TYPE kvledger:requests_refused_created gauge',
 '# HELP kvledger:tenant_requests_total Engine requests accepted, per tenant.',
 '# TYPE kvledger:tenant_requests_total counter',
 '# HELP kvledger:tenant_requests_created Engine requests accepted, per tenant.',
 '# TYPE kvledger:tenant_requests_created gauge',
 '# HELP kvledger:tenant_prompt_tokens_total Prompt tokens, per tenant.',
 '# TYPE kvledger:tenant_prompt_tokens_total counter',
 '# HELP kvledger:tenant_prompt_tokens_created Prompt tokens, per tenant.',
 '# TYPE kvledger:tenant_prompt_tokens_created gauge',
 '# HELP kvledger:tenant_generation_tokens_total Generated tokens, per tenant.',
 '# TYPE kvledger:tenant_generation_tokens_total counter',
 '# HELP kvledger:tenant_generation_tokens_created Generated tokens, per tenant.',
 '# TYPE kvledger:tenant_generation_tokens_created gauge',
 '# HELP kvledger:tenant_cached_tokens_total Prompt tokens served from the prefix cache, per tenant.',
 '# TYPE kvledger:tenant_cached_tokens_total counter',
 '# HELP kvledger:tenant_cached_tokens_created Prompt tokens served from the prefix cache, per tenant.',
 '# TYPE kvledger:tenant_cached_tokens_created gauge',
 '# HELP vllm:num_requests_running Requests with KV blocks admitted.',
 '# TYPE vllm:num_requests_running gauge',
 '# HELP vllm:num_requests_waiting Requests waiting to run (gate and engine queue).',
 '# TYPE vllm:num_requests_waiting gauge',
 '# HELP vllm:kv_cache_usage_perc Fraction of KV blocks held by requests (1 = full).',
 '# TYPE vllm:kv_cache_usage_perc gauge',
 '# HELP vllm:prefix_cache_queries_total Prompt tokens looked up in the prefix cache.',
 '# TYPE vllm:prefix_cache_queries_total counter',
 '# HELP vllm:prefix_cache_hits_total Prompt tokens found in the prefix cache.',
 '# TYPE vllm:prefix_cache_hits_total counter',
 '# HELP vllm:num_preemptions_total Preemptions (recompute or swap).',
 '# TYPE vllm:num_preemptions_total counter',
 '# HELP vllm:iteration_tokens_total Tokens per engine step (computed prompt tokens + sampled tokens).',
 '# TYPE vllm:iteration_tokens_total histogram',
 '# HELP kvledger:blocks KV blocks by ledger state (promised: reserved for future tokens, not yet materialised; '
 'leased: released but still read by an in-flight step).',
 '# TYPE kvledger:blocks gauge',
 '# HELP kvledger:pool_blocks KV blocks in the pool.',
 '# TYPE kvledger:pool_blocks gauge',
 '# HELP kvledger:leases Outstanding leases (in-flight steps and transfers).',
 '# TYPE kvledger:leases gauge',
 '# HELP kvledger:sequences Sequences (branches) holding blocks.',
 '# TYPE kvledger:sequences gauge',
 '# HELP kvledger:admissions_total Ledger admission decisions by outcome.',
 '# TYPE kvledger:admissions_total counter',
 '# HELP kvledger:evictions_total Retained (cached) blocks evicted for reuse.',
 '# TYPE kvledger:evictions_total counter',
 '# HELP kvledger:requests_cancelled_total Requests cancelled in the engine (client gone, stop string met, '
 'shutdown); their blocks went back at a step boundary.',
 '# TYPE kvledger:requests_cancelled_total counter',
 '# HELP kvledger:swapped_blocks_total Blocks moved by preemption by swap.',
 '# TYPE kvledger:swapped_blocks_total counter',
 '# HELP kvledger:tier_demotion_failures_total Prefix-cache blocks whose copy into a tier below the device pool '
 '(host, disk) raised; each lost only its cache entry.',
 '# TYPE kvledger:tier_demotion_failures_total counter',
 '# HELP kvledger:tier_promotion_failures_total Prefix-cache blocks whose read back from a tier raised; their '
 'requests recomputed those tokens.',
 '# TYPE kvledger:tier_promotion_failures_total counter',
 '# HELP kvledger:tenant_requests_in_flight Engine requests in flight, per tenant.',
 '# TYPE kvledger:tenant_requests_in_flight gauge',
 "# HELP kvledger:tenant_blocks A tenant's KV blocks in the ledger (its trust group's ledger): active (held), "
 'promised (reserved, not yet materialised), growth (its requests may still take past their reservations); their '
 'sum is what its cap bounds.',
 '# TYPE kvledger:tenant_blocks gauge',
 "# HELP kvledger:tenant_block_cap A tenant's cap on KV blocks (its quota), for tenants that have one.",
 '# TYPE kvledger:tenant_block_cap gauge',
 "# HELP kvledger:tenant_quota_refusals_total Admissions a tenant's cap made wait (not now) or refused (never).",
 '# TYPE kvledger:tenant_quota_refusals_total counter',
 '# HELP kvledger:tenant_prefix_cache_queries_total Prompt tokens looked up, per tenant.',
 '# TYPE kvledger:tenant_prefix_cache_queries_total counter',
 '# HELP kvledger:tenant_prefix_cache_hits_total Prompt tokens found cached, per tenant.',
 '# TYPE kvledger:tenant_prefix_cache_hits_total counter',
]
EXPECTED_EDGES: dict[str, list[str]] = {  # vLLM's bucket edges
    'vllm:e2e_request_latency_seconds': [
        "0.3", "0.5", "0.8", "1.0", "1.5", "2.0", "2.5", "5.0", "10.0", "15.0", "20.0", "30.0", "40.0", "50.0",
        "60.0", "120.0", "240.0", "480.0", "960.0", "1920.0", "7680.0", "+Inf",
    ],
    'vllm:inter_token_latency_seconds': [
        "0.01", "0.025", "0.05", "0.075", "0.1", "0.15", "0.2", "0.3", "0.4", "0.5", "0.75", "1.0", "2.5",
        "5.0", "7.5", "10.0", "20.0", "40.0", "80.0", "+Inf",
    ],
    'vllm:iteration_tokens_total': [
        "1.0", "8.0", "16.0", "32.0", "64.0", "128.0", "256.0", "512.0", "1024.0", "2048.0", "4096.0", "8192.0",
        "16384.0", "+Inf",
    ],
    'vllm:request_decode_time_seconds': [
        "0.3", "0.5", "0.8", "1.0", "1.5", "2.0", "2.5", "5.0", "10.0", "15.0", "20.0", "30.0", "40.0", "50.0",
        "60.0", "120.0", "240.0", "480.0", "960.0", "1920.0", "7680.0", "+Inf",
    ],
    'vllm:request_generation_tokens': [
        "1.0", "2.0", "5.0", "10.0", "20.0", "50.0", "100.0", "200.0", "500.0", "1000.0", "2000.0", "5000.0",
        "+Inf",
    ],
    'vllm:request_inference_time_seconds': [
        "0.3", "0.5", "0.8", "1.0", "1.5", "2.0", "2.5", "5.0", "10.0", "15.0", "20.0", "30.0", "40.0", "50.0",
        "60.0", "120.0", "240.0", "480.0", "960.0", "1920.0", "7680.0", "+Inf",
    ],
    'vllm:request_max_num_generation_tokens': [
        "1.0", "2.0", "5.0", "10.0", "20.0", "50.0", "100.0", "200.0", "500.0", "1000.0", "2000.0", "5000.0",
        "+Inf",
    ],
    'vllm:request_num_preemptions': [
        "1.0", "2.0", "3.0", "4.0", "5.0", "10.0", "20.0", "+Inf",
    ],
    'vllm:request_params_max_tokens': [
        "1.0", "2.0", "5.0", "10.0", "20.0", "50.0", "100.0", "200.0", "500.0", "1000.0", "2000.0", "5000.0",
        "+Inf",
    ],
    'vllm:request_params_n': [
        "1.0", "2.0", "5.0", "10.0", "20.0", "+Inf",
    ],
    'vllm:request_prefill_kv_computed_tokens': [
        "1.0", "2.0", "5.0", "10.0", "20.0", "50.0", "100.0", "200.0", "500.0", "1000.0", "2000.0", "5000.0",
        "+Inf",
    ],
    'vllm:request_prefill_time_seconds': [
        "0.3", "0.5", "0.8", "1.0", "1.5", "2.0", "2.5", "5.0", "10.0", "15.0", "20.0", "30.0", "40.0", "50.0",
        "60.0", "120.0", "240.0", "480.0", "960.0", "1920.0", "7680.0", "+Inf",
    ],
    'vllm:request_prompt_tokens': [
        "1.0", "2.0", "5.0", "10.0", "20.0", "50.0", "100.0", "200.0", "500.0", "1000.0", "2000.0", "5000.0",
        "+Inf",
    ],
    'vllm:request_queue_time_seconds': [
        "0.3", "0.5", "0.8", "1.0", "1.5", "2.0", "2.5", "5.0", "10.0", "15.0", "20.0", "30.0", "40.0", "50.0",
        "60.0", "120.0", "240.0", "480.0", "960.0", "1920.0", "7680.0", "+Inf",
    ],
    'vllm:request_time_per_output_token_seconds': [
        "0.01", "0.025", "0.05", "0.075", "0.1", "0.15", "0.2", "0.3", "0.4", "0.5", "0.75", "1.0", "2.5",
        "5.0", "7.5", "10.0", "20.0", "40.0", "80.0", "+Inf",
    ],
    'vllm:time_to_first_token_seconds': [
        "0.001", "0.005", "0.01", "0.02", "0.04", "0.06", "0.08", "0.1", "0.25", "0.5", "0.75", "1.0", "2.5",
        "5.0", "7.5", "10.0", "20.0", "40.0", "80.0", "160.0", "640.0", "2560.0", "+Inf",
    ],
}

# After the known traffic: the idle exposition with these figures changed (every other sample is as before).
EXPECTED_FIGURES: dict[str, float] = {**EXPECTED_BEFORE, **{
    'vllm:time_to_first_token_seconds_count{engine="0",model_name="smollm2-135m"}': 4.0,
    'vllm:inter_token_latency_seconds_count{engine="0",model_name="smollm2-135m"}': 10.0,
    'vllm:e2e_request_latency_seconds_count{engine="0",model_name="smollm2-135m"}': 4.0,
    'vllm:request_time_per_output_token_seconds_count{engine="0",model_name="smollm2-135m"}': 4.0,
    'vllm:request_queue_time_seconds_count{engine="0",model_name="smollm2-135m"}': 4.0,
    'vllm:request_prefill_time_seconds_count{engine="0",model_name="smollm2-135m"}': 4.0,
    'vllm:request_decode_time_seconds_count{engine="0",model_name="smollm2-135m"}': 4.0,
    'vllm:request_inference_time_seconds_count{engine="0",model_name="smollm2-135m"}': 4.0,
    'vllm:request_prompt_tokens_count{engine="0",model_name="smollm2-135m"}': 4.0,
    'vllm:request_generation_tokens_count{engine="0",model_name="smollm2-135m"}': 4.0,
    'vllm:request_max_num_generation_tokens_count{engine="0",model_name="smollm2-135m"}': 4.0,
    'vllm:request_params_max_tokens_count{engine="0",model_name="smollm2-135m"}': 4.0,
    'vllm:request_params_n_count{engine="0",model_name="smollm2-135m"}': 4.0,
    'vllm:request_num_preemptions_count{engine="0",model_name="smollm2-135m"}': 4.0,
    'vllm:request_prefill_kv_computed_tokens_count{engine="0",model_name="smollm2-135m"}': 4.0,
    'vllm:prompt_tokens_total{engine="0",model_name="smollm2-135m"}': 78.0,
    'vllm:prompt_tokens_cached_total{engine="0",model_name="smollm2-135m"}': 16.0,
    'vllm:prompt_tokens_by_source_total{engine="0",model_name="smollm2-135m",source="local_compute"}': 62.0,
    'vllm:prompt_tokens_by_source_total{engine="0",model_name="smollm2-135m",source="local_cache_hit"}': 16.0,
    'vllm:generation_tokens_total{engine="0",model_name="smollm2-135m"}': 14.0,
    'vllm:request_success_total{engine="0",finished_reason="stop",model_name="smollm2-135m"}': 1.0,
    'vllm:request_success_total{engine="0",finished_reason="length",model_name="smollm2-135m"}': 3.0,
    'kvledger:requests_refused_total{reason="unauthorized"}': 1.0,
    'kvledger:requests_refused_total{reason="forbidden"}': 2.0,
    'kvledger:requests_refused_total{reason="invalid"}': 2.0,
    'kvledger:requests_refused_total{reason="too_large"}': 1.0,
    'kvledger:requests_refused_total{reason="never_fits"}': 1.0,
    'kvledger:requests_refused_total{reason="tenant_cap"}': 1.0,
    'kvledger:tenant_requests_total{tenant="acme"}': 3.0,
    'kvledger:tenant_requests_total{tenant="globex"}': 1.0,
    'kvledger:tenant_prompt_tokens_total{tenant="acme"}': 44.0,
    'kvledger:tenant_prompt_tokens_total{tenant="globex"}': 34.0,
    'kvledger:tenant_generation_tokens_total{tenant="acme"}': 11.0,
    'kvledger:tenant_generation_tokens_total{tenant="globex"}': 3.0,
    'kvledger:tenant_cached_tokens_total{tenant="acme"}': 16.0,
    'vllm:prefix_cache_queries_total{engine="0",model_name="smollm2-135m"}': 78.0,
    'vllm:prefix_cache_hits_total{engine="0",model_name="smollm2-135m"}': 16.0,
    'vllm:iteration_tokens_total_count{engine="0",model_name="smollm2-135m"}': 15.0,
    'kvledger:blocks{state="free"}': 157.0,
    'kvledger:blocks{state="retained"}': 3.0,
    'kvledger:blocks{state="evictable"}': 3.0,
    'kvledger:admissions_total{outcome="admitted"}': 4.0,
    'kvledger:requests_cancelled_total': 1.0,
    'kvledger:tenant_prefix_cache_queries_total{tenant="acme"}': 44.0,
    'kvledger:tenant_prefix_cache_queries_total{tenant="globex"}': 34.0,
    'kvledger:tenant_prefix_cache_hits_total{tenant="acme"}': 16.0,
}}
