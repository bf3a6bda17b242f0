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
vllm:time_to_first_token_seconds_count{model_name="smol"} 0.0
vllm:time_to_first_token_seconds_sum{model_name="smol"} 0.0
# HELP vllm:inter_token_latency_seconds Time between consecutive tokens of a sequence.
# TYPE vllm:inter_token_latency_seconds histogram
vllm:inter_token_latency_seconds_count{model_name="smol"} 0.0
vllm:inter_token_latency_seconds_sum{model_name="smol"} 0.0
# HELP vllm:e2e_request_latency_seconds Request latency, arrival to last token.
# TYPE vllm:e2e_request_latency_seconds histogram
vllm:e2e_request_latency_seconds_count{model_name="smol"} 0.0
vllm:e2e_request_latency_seconds_sum{model_name="smol"} 0.0
# HELP vllm:prompt_tokens_total Prompt tokens of finished requests.
# TYPE vllm:prompt_tokens_total counter
vllm:prompt_tokens_total{model_name="smol"} 0.0
# HELP vllm:generation_tokens_total Generated tokens.
# TYPE vllm:generation_tokens_total counter
vllm:generation_tokens_total{model_name="smol"} 0.0
# HELP vllm:request_success_total Finished requests by finish reason.
# TYPE vllm:request_success_total counter
vllm:request_success_total{finished_reason="stop",model_name="smol"} 1.0
vllm:request_success_total{finished_reason="length",model_name="smol"} 0.0
vllm:request_success_total{finished_reason="abort",model_name="smol"} 0.0
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
vllm:num_requests_running{model_name="smol"} 3.0
# HELP vllm:num_requests_waiting Requests waiting to run (gate and engine queue).
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{model_name="smol"} 2.0
# HELP vllm:kv_cache_usage_perc Fraction of KV blocks held by requests (1 = full).
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{model_name="smol"} 0.25
# HELP vllm:prefix_cache_queries_total Prompt tokens looked up in the prefix cache.
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{model_name="smol"} 41.0
# HELP vllm:prefix_cache_hits_total Prompt tokens found in the prefix cache.
# TYPE vllm:prefix_cache_hits_total counter
vllm:prefix_cache_hits_total{model_name="smol"} 42.0
# HELP vllm:num_preemptions_total Preemptions (recompute or swap).
# TYPE vllm:num_preemptions_total counter
vllm:num_preemptions_total{model_name="smol"} 7.0
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
            tier_failures={"demotion": 71, "promotion": 72})


def test_the_metrics_exposition_names_every_figure_with_its_help_labels_and_value() -> None:
    gate = AdmissionGate(8, lambda: 1)
    gate.enter(Tenant("acme"), 2)
    gate.enter(Tenant("globex"), 1)
    metrics = ServerMetrics("smol", _Backend(), gate, lambda: ["acme", "globex"])
    metrics.refused.labels("queue_full").inc(2)
    metrics.tenant_requests.labels("acme").inc(3)
    metrics.success.labels("smol", "stop").inc()
    text = metrics.exposition().decode()
    got = [line for line in text.splitlines() if line and "_created" not in line and "_bucket{" not in line]
    assert got == EXPOSITION.splitlines()
