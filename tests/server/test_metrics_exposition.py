"""`/metrics` as a scraper reads it, without a model or a socket: every metric's name, HELP text, type,
labels and value, from a backend whose every figure is distinct (so a figure read from the wrong field shows)."""

# The exposition's lines are as long as Prometheus writes them.
# ruff: noqa: E501
from __future__ import annotations

from kvledger.server.backend import BackendState
from kvledger.server.gate import AdmissionGate
from kvledger.server.metrics import ServerMetrics
from kvledger.server.tenants import Tenant

# Every metric's name, HELP text, type, labels and value (histogram buckets and the `_created` timestamps
# left out: the buckets are vLLM's constants, the timestamps differ per run).
EXPOSITION = """\
# HELP vllm:time_to_first_token_seconds Time to first token (server side).
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_count{engine="0",model_name="smol"} 0.0
vllm:time_to_first_token_seconds_sum{engine="0",model_name="smol"} 0.0
# HELP vllm:inter_token_latency_seconds Time between consecutive tokens of a sequence.
# TYPE vllm:inter_token_latency_seconds histogram
vllm:inter_token_latency_seconds_count{engine="0",model_name="smol"} 0.0
vllm:inter_token_latency_seconds_sum{engine="0",model_name="smol"} 0.0
# HELP vllm:e2e_request_latency_seconds Request latency, arrival to last token.
# TYPE vllm:e2e_request_latency_seconds histogram
vllm:e2e_request_latency_seconds_count{engine="0",model_name="smol"} 0.0
vllm:e2e_request_latency_seconds_sum{engine="0",model_name="smol"} 0.0
# HELP vllm:request_time_per_output_token_seconds A request's mean time per output token after the first (decode time / (tokens - 1); 0 with one token).
# TYPE vllm:request_time_per_output_token_seconds histogram
vllm:request_time_per_output_token_seconds_count{engine="0",model_name="smol"} 1.0
vllm:request_time_per_output_token_seconds_sum{engine="0",model_name="smol"} 0.5
# HELP vllm:request_queue_time_seconds Time a request waited in the engine's queue (arrival to first admission).
# TYPE vllm:request_queue_time_seconds histogram
vllm:request_queue_time_seconds_count{engine="0",model_name="smol"} 1.0
vllm:request_queue_time_seconds_sum{engine="0",model_name="smol"} 0.25
# HELP vllm:request_prefill_time_seconds Time from a request's admission to its first token.
# TYPE vllm:request_prefill_time_seconds histogram
vllm:request_prefill_time_seconds_count{engine="0",model_name="smol"} 1.0
vllm:request_prefill_time_seconds_sum{engine="0",model_name="smol"} 0.5
# HELP vllm:request_decode_time_seconds Time from a request's first token to its last.
# TYPE vllm:request_decode_time_seconds histogram
vllm:request_decode_time_seconds_count{engine="0",model_name="smol"} 1.0
vllm:request_decode_time_seconds_sum{engine="0",model_name="smol"} 2.0
# HELP vllm:request_inference_time_seconds Time from a request's admission to its last token.
# TYPE vllm:request_inference_time_seconds histogram
vllm:request_inference_time_seconds_count{engine="0",model_name="smol"} 1.0
vllm:request_inference_time_seconds_sum{engine="0",model_name="smol"} 2.5
# HELP vllm:request_prompt_tokens Prompt tokens per request.
# TYPE vllm:request_prompt_tokens histogram
vllm:request_prompt_tokens_count{engine="0",model_name="smol"} 2.0
vllm:request_prompt_tokens_sum{engine="0",model_name="smol"} 200.0
# HELP vllm:request_generation_tokens Generated tokens per request.
# TYPE vllm:request_generation_tokens histogram
vllm:request_generation_tokens_count{engine="0",model_name="smol"} 2.0
vllm:request_generation_tokens_sum{engine="0",model_name="smol"} 7.0
# HELP vllm:request_max_num_generation_tokens Most tokens any choice of a request generated.
# TYPE vllm:request_max_num_generation_tokens histogram
vllm:request_max_num_generation_tokens_count{engine="0",model_name="smol"} 1.0
vllm:request_max_num_generation_tokens_sum{engine="0",model_name="smol"} 5.0
# HELP vllm:request_params_max_tokens The max_tokens request parameter (the budget given to the engine).
# TYPE vllm:request_params_max_tokens histogram
vllm:request_params_max_tokens_count{engine="0",model_name="smol"} 2.0
vllm:request_params_max_tokens_sum{engine="0",model_name="smol"} 128.0
# HELP vllm:request_params_n The n request parameter.
# TYPE vllm:request_params_n histogram
vllm:request_params_n_count{engine="0",model_name="smol"} 1.0
vllm:request_params_n_sum{engine="0",model_name="smol"} 2.0
# HELP vllm:request_num_preemptions Times a request was preempted.
# TYPE vllm:request_num_preemptions histogram
vllm:request_num_preemptions_count{engine="0",model_name="smol"} 2.0
vllm:request_num_preemptions_sum{engine="0",model_name="smol"} 2.0
# HELP vllm:request_prefill_kv_computed_tokens Prompt tokens a request computed (cached ones excluded).
# TYPE vllm:request_prefill_kv_computed_tokens histogram
vllm:request_prefill_kv_computed_tokens_count{engine="0",model_name="smol"} 2.0
vllm:request_prefill_kv_computed_tokens_sum{engine="0",model_name="smol"} 136.0
# HELP vllm:prompt_tokens_total Prompt tokens of finished requests.
# TYPE vllm:prompt_tokens_total counter
vllm:prompt_tokens_total{engine="0",model_name="smol"} 100.0
# HELP vllm:prompt_tokens_cached_total Prompt tokens served from the prefix cache.
# TYPE vllm:prompt_tokens_cached_total counter
vllm:prompt_tokens_cached_total{engine="0",model_name="smol"} 32.0
# HELP vllm:prompt_tokens_by_source_total Prompt tokens by source (computed or read from the prefix cache).
# TYPE vllm:prompt_tokens_by_source_total counter
vllm:prompt_tokens_by_source_total{engine="0",model_name="smol",source="local_compute"} 68.0
vllm:prompt_tokens_by_source_total{engine="0",model_name="smol",source="local_cache_hit"} 32.0
vllm:prompt_tokens_by_source_total{engine="0",model_name="smol",source="external_kv_transfer"} 0.0
# HELP vllm:generation_tokens_total Generated tokens.
# TYPE vllm:generation_tokens_total counter
vllm:generation_tokens_total{engine="0",model_name="smol"} 0.0
# HELP vllm:request_success_total Finished requests by finish reason.
# TYPE vllm:request_success_total counter
vllm:request_success_total{engine="0",finished_reason="stop",model_name="smol"} 1.0
vllm:request_success_total{engine="0",finished_reason="length",model_name="smol"} 0.0
vllm:request_success_total{engine="0",finished_reason="abort",model_name="smol"} 0.0
vllm:request_success_total{engine="0",finished_reason="error",model_name="smol"} 0.0
vllm:request_success_total{engine="0",finished_reason="repetition",model_name="smol"} 0.0
# HELP kvledger:requests_refused_total Requests refused at the HTTP boundary, by reason.
# TYPE kvledger:requests_refused_total counter
kvledger:requests_refused_total{reason="unauthorized"} 0.0
kvledger:requests_refused_total{reason="forbidden"} 0.0
kvledger:requests_refused_total{reason="invalid"} 0.0
kvledger:requests_refused_total{reason="too_large"} 0.0
kvledger:requests_refused_total{reason="never_fits"} 0.0
kvledger:requests_refused_total{reason="tenant_cap"} 0.0
kvledger:requests_refused_total{reason="queue_full"} 2.0
kvledger:requests_refused_total{reason="draining"} 0.0
# HELP kvledger:tenant_requests_total Engine requests accepted, per tenant.
# TYPE kvledger:tenant_requests_total counter
kvledger:tenant_requests_total{tenant="acme"} 3.0
kvledger:tenant_requests_total{tenant="globex"} 0.0
# HELP kvledger:tenant_prompt_tokens_total Prompt tokens, per tenant.
# TYPE kvledger:tenant_prompt_tokens_total counter
kvledger:tenant_prompt_tokens_total{tenant="acme"} 0.0
kvledger:tenant_prompt_tokens_total{tenant="globex"} 0.0
# HELP kvledger:tenant_generation_tokens_total Generated tokens, per tenant.
# TYPE kvledger:tenant_generation_tokens_total counter
kvledger:tenant_generation_tokens_total{tenant="acme"} 0.0
kvledger:tenant_generation_tokens_total{tenant="globex"} 0.0
# HELP kvledger:tenant_cached_tokens_total Prompt tokens served from the prefix cache, per tenant.
# TYPE kvledger:tenant_cached_tokens_total counter
kvledger:tenant_cached_tokens_total{tenant="acme"} 0.0
kvledger:tenant_cached_tokens_total{tenant="globex"} 0.0
# HELP vllm:num_requests_running Requests with KV blocks admitted.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="smol"} 3.0
# HELP vllm:num_requests_waiting Requests waiting to run (gate and engine queue).
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="smol"} 2.0
# HELP vllm:kv_cache_usage_perc Fraction of KV blocks held by requests (1 = full).
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="smol"} 0.25
# HELP vllm:prefix_cache_queries_total Prompt tokens looked up in the prefix cache.
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{engine="0",model_name="smol"} 41.0
# HELP vllm:prefix_cache_hits_total Prompt tokens found in the prefix cache.
# TYPE vllm:prefix_cache_hits_total counter
vllm:prefix_cache_hits_total{engine="0",model_name="smol"} 42.0
# HELP vllm:num_preemptions_total Preemptions (recompute or swap).
# TYPE vllm:num_preemptions_total counter
vllm:num_preemptions_total{engine="0",model_name="smol"} 7.0
# HELP vllm:iteration_tokens_total Tokens per engine step (computed prompt tokens + sampled tokens).
# TYPE vllm:iteration_tokens_total histogram
vllm:iteration_tokens_total_count{engine="0",model_name="smol"} 330.0
vllm:iteration_tokens_total_sum{engine="0",model_name="smol"} 1.705719e+06
# HELP kvledger:blocks KV blocks by ledger state (promised: reserved for future tokens, not yet materialised; leased: released but still read by an in-flight step).
# TYPE kvledger:blocks gauge
kvledger:blocks{state="free"} 11.0
kvledger:blocks{state="active"} 12.0
kvledger:blocks{state="retained"} 13.0
kvledger:blocks{state="evictable"} 14.0
kvledger:blocks{state="promised"} 15.0
kvledger:blocks{state="pinned"} 16.0
kvledger:blocks{state="leased"} 17.0
# HELP kvledger:pool_blocks KV blocks in the pool.
# TYPE kvledger:pool_blocks gauge
kvledger:pool_blocks 48.0
# HELP kvledger:leases Outstanding leases (in-flight steps and transfers).
# TYPE kvledger:leases gauge
kvledger:leases 4.0
# HELP kvledger:sequences Sequences (branches) holding blocks.
# TYPE kvledger:sequences gauge
kvledger:sequences 5.0
# HELP kvledger:admissions_total Ledger admission decisions by outcome.
# TYPE kvledger:admissions_total counter
kvledger:admissions_total{outcome="admitted"} 21.0
kvledger:admissions_total{outcome="never"} 22.0
kvledger:admissions_total{outcome="not_now"} 23.0
# HELP kvledger:evictions_total Retained (cached) blocks evicted for reuse.
# TYPE kvledger:evictions_total counter
kvledger:evictions_total 6.0
# HELP kvledger:requests_cancelled_total Requests cancelled in the engine (client gone, stop string met, shutdown); their blocks went back at a step boundary.
# TYPE kvledger:requests_cancelled_total counter
kvledger:requests_cancelled_total 8.0
# HELP kvledger:swapped_blocks_total Blocks moved by preemption by swap.
# TYPE kvledger:swapped_blocks_total counter
kvledger:swapped_blocks_total{direction="in"} 31.0
kvledger:swapped_blocks_total{direction="out"} 32.0
# HELP kvledger:tier_demotion_failures_total Prefix-cache blocks whose copy into a tier below the device pool (host, disk) raised; each lost only its cache entry.
# TYPE kvledger:tier_demotion_failures_total counter
kvledger:tier_demotion_failures_total{model_name="smol"} 71.0
# HELP kvledger:tier_promotion_failures_total Prefix-cache blocks whose read back from a tier raised; their requests recomputed those tokens.
# TYPE kvledger:tier_promotion_failures_total counter
kvledger:tier_promotion_failures_total{model_name="smol"} 72.0
# HELP kvledger:tenant_requests_in_flight Engine requests in flight, per tenant.
# TYPE kvledger:tenant_requests_in_flight gauge
kvledger:tenant_requests_in_flight{tenant="acme"} 2.0
kvledger:tenant_requests_in_flight{tenant="globex"} 1.0
kvledger:tenant_requests_in_flight{tenant="initech"} 0.0
# HELP kvledger:tenant_blocks A tenant's KV blocks in the ledger (its trust group's ledger): active (held), promised (reserved, not yet materialised), growth (its requests may still take past their reservations); their sum is what its cap bounds.
# TYPE kvledger:tenant_blocks gauge
kvledger:tenant_blocks{state="active",tenant="acme"} 51.0
kvledger:tenant_blocks{state="promised",tenant="acme"} 52.0
kvledger:tenant_blocks{state="growth",tenant="acme"} 53.0
kvledger:tenant_blocks{state="active",tenant="globex"} 0.0
kvledger:tenant_blocks{state="promised",tenant="globex"} 0.0
kvledger:tenant_blocks{state="growth",tenant="globex"} 0.0
kvledger:tenant_blocks{state="active",tenant="initech"} 61.0
kvledger:tenant_blocks{state="promised",tenant="initech"} 0.0
kvledger:tenant_blocks{state="growth",tenant="initech"} 0.0
# HELP kvledger:tenant_block_cap A tenant's cap on KV blocks (its quota), for tenants that have one.
# TYPE kvledger:tenant_block_cap gauge
kvledger:tenant_block_cap{tenant="acme"} 54.0
# HELP kvledger:tenant_quota_refusals_total Admissions a tenant's cap made wait (not now) or refused (never).
# TYPE kvledger:tenant_quota_refusals_total counter
kvledger:tenant_quota_refusals_total{tenant="acme"} 55.0
kvledger:tenant_quota_refusals_total{tenant="globex"} 0.0
kvledger:tenant_quota_refusals_total{tenant="initech"} 0.0
# HELP kvledger:tenant_prefix_cache_queries_total Prompt tokens looked up, per tenant.
# TYPE kvledger:tenant_prefix_cache_queries_total counter
kvledger:tenant_prefix_cache_queries_total{tenant="acme"} 56.0
kvledger:tenant_prefix_cache_queries_total{tenant="globex"} 0.0
kvledger:tenant_prefix_cache_queries_total{tenant="initech"} 0.0
# HELP kvledger:tenant_prefix_cache_hits_total Prompt tokens found cached, per tenant.
# TYPE kvledger:tenant_prefix_cache_hits_total counter
kvledger:tenant_prefix_cache_hits_total{tenant="acme"} 57.0
kvledger:tenant_prefix_cache_hits_total{tenant="globex"} 0.0
kvledger:tenant_prefix_cache_hits_total{tenant="initech"} 0.0
"""


# ---- /metrics as a scraper reads it -------------------------------------------------------------
class _Backend:
    """A backend whose every figure is distinct, so a figure read from the wrong field shows."""

    max_context = 2048

    def state(self) -> BackendState:
        return BackendState(
            running=3, blocks={"free": 11, "active": 12, "retained": 13, "evictable": 14, "promised": 15,
                               "pinned": 16, "leased": 17},
            total_blocks=48, leases=4, sequences=5, admissions={"admitted": 21, "never": 22, "not_now": 23},
            evictions=6, preemptions=7, swapped_blocks={"in": 31, "out": 32}, prefix_queries_tokens=41,
            prefix_hits_tokens=42, cancelled=8,
            groups={"acme": {"active": 51, "promised": 52, "growth": 53, "cap": 54, "quota_refusals": 55,
                             "query_tokens": 56, "hit_tokens": 57},
                    "initech": {"active": 61}},  # a trust group the ledger knows with no other figures yet
            tier_failures={"demotion": 71, "promotion": 72},
            iteration_tokens={1: 81, 9: 82, 300: 83, 20000: 84})  # tokens per step -> steps


class _Result:
    """A finished engine request: two choices, admitted 0.25 s after it arrived, first token 0.5 s later,
    last 2 s after that, over 5 tokens of its longest choice; preempted once."""

    outputs = [[1, 2, 3, 4, 5], [6, 7]]
    preemptions = 1

    def phases(self) -> dict[str, float]:
        return {"queue": 0.25, "prefill": 0.5, "decode": 2.0, "inference": 2.5}


def test_the_metrics_exposition_names_every_figure_with_its_help_labels_and_value() -> None:
    gate = AdmissionGate(8, lambda: 1)
    gate.enter(Tenant("acme"), 2)
    gate.enter(Tenant("globex"), 1)
    metrics = ServerMetrics("smol", _Backend(), gate, lambda: ["acme", "globex"])
    metrics.refused.labels("queue_full").inc(2)
    metrics.tenant_requests.labels("acme").inc(3)
    metrics.finished("stop")
    metrics.observe_request(_Result(), 100, 32, 2, 64, [5, 2])
    text = metrics.exposition().decode()
    got = [line for line in text.splitlines() if line and "_created" not in line and "_bucket{" not in line]
    assert got == EXPOSITION.splitlines()
    buckets = [line for line in text.splitlines() if line.startswith("vllm:iteration_tokens_total_bucket{")]
    assert buckets == [f'vllm:iteration_tokens_total_bucket{{engine="0",le="{le}",model_name="smol"}} {n}'
                       for le, n in (("1.0", 81.0), ("8.0", 81.0), ("16.0", 163.0), ("32.0", 163.0),
                                     ("64.0", 163.0), ("128.0", 163.0), ("256.0", 163.0), ("512.0", 246.0),
                                     ("1024.0", 246.0), ("2048.0", 246.0), ("4096.0", 246.0),
                                     ("8192.0", 246.0), ("16384.0", 246.0), ("+Inf", 330.0))]
    # vLLM's request-token edges: 1-2-5 up to the model's length (2,048 here)
    edges = [line.split('le="')[1].split('"')[0] for line in text.splitlines()
             if line.startswith("vllm:request_prompt_tokens_bucket{")]
    assert edges == ["1.0", "2.0", "5.0", "10.0", "20.0", "50.0", "100.0", "200.0", "500.0", "1000.0", "2000.0",
                     "+Inf"]
