"""Prometheus metrics: vLLM's names where vLLM has the same quantity (so its dashboards work), ours under
``kvledger:``. One registry per app (no global state): two apps in one process never mix counts.

Latencies and token counts are observed by the server as requests stream; pool state (blocks by state,
queue lengths, ledger counters) is read from the backend at scrape time, so it is never stale. A failed
transfer to or from a tier below the device pool fails no request (it loses a cache entry, or its request
recomputes a prefix): ``kvledger:tier_demotion_failures`` and ``kvledger:tier_promotion_failures`` are where
a failing disk shows.
``/metrics`` is the operator's view: it carries every tenant's usage, so in multi-tenant mode only an
operator key may read it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from .backend import Backend
from .gate import AdmissionGate

# The same bucket edges as vLLM's, so histograms line up on a shared dashboard.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0, 7680.0)

BLOCK_STATES = ("free", "active", "retained", "evictable", "promised", "pinned", "leased")
REFUSALS = ("unauthorized", "forbidden", "invalid", "too_large", "never_fits", "tenant_cap", "queue_full",
            "draining")
GROUP_STATES = ("active", "promised", "growth")  # a trust group's ledger (kvledger.core.quota)


class ServerMetrics:
    def __init__(self, model_name: str, backend: Backend, gate: AdmissionGate,
                 tenant_names: Callable[[], list[str]]) -> None:
        self.model_name = model_name
        self.registry = CollectorRegistry(auto_describe=False)
        reg, m = self.registry, ["model_name"]
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Time to first token (server side).", m,
                              buckets=TTFT_BUCKETS, registry=reg).labels(model_name)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Time between consecutive tokens of a sequence.",
                             m, buckets=ITL_BUCKETS, registry=reg).labels(model_name)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "Request latency, arrival to last token.", m,
                             buckets=E2E_BUCKETS, registry=reg).labels(model_name)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prompt tokens of finished requests.", m,
                                     registry=reg).labels(model_name)
        self.generation_tokens = Counter("vllm:generation_tokens", "Generated tokens.", m,
                                         registry=reg).labels(model_name)
        self.success = Counter("vllm:request_success", "Finished requests by finish reason.",
                               ["model_name", "finished_reason"], registry=reg)
        self.refused = Counter("kvledger:requests_refused", "Requests refused at the HTTP boundary, by reason.",
                               ["reason"], registry=reg)
        for reason in REFUSALS:
            self.refused.labels(reason)
        t = ["tenant"]
        self.tenant_requests = Counter("kvledger:tenant_requests", "Engine requests accepted, per tenant.", t,
                                       registry=reg)
        self.tenant_prompt = Counter("kvledger:tenant_prompt_tokens", "Prompt tokens, per tenant.", t, registry=reg)
        self.tenant_generated = Counter("kvledger:tenant_generation_tokens", "Generated tokens, per tenant.", t,
                                        registry=reg)
        self.tenant_cached = Counter("kvledger:tenant_cached_tokens",
                                     "Prompt tokens served from the prefix cache, per tenant.", t, registry=reg)
        for reason in ("stop", "length", "abort"):
            self.success.labels(model_name, reason)
        for name in tenant_names():  # every known tenant reads 0 from the first scrape on
            for counter in (self.tenant_requests, self.tenant_prompt, self.tenant_generated, self.tenant_cached):
                counter.labels(name)
        reg.register(_StateCollector(model_name, backend, gate, tenant_names))

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


class _StateCollector:
    """Reads the pool and the queues at scrape time."""

    def __init__(self, model_name: str, backend: Backend, gate: AdmissionGate,
                 tenant_names: Callable[[], list[str]]) -> None:
        self.model_name = model_name
        self.backend = backend
        self.gate = gate
        self.tenant_names = tenant_names

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        s = self.backend.state()
        m = [self.model_name]

        def gauge(name: str, doc: str, value: float, labels: list[str] | None = None) -> GaugeMetricFamily:
            g = GaugeMetricFamily(name, doc, labels=["model_name"] if labels is None else labels)
            g.add_metric(m if labels is None else [], value)
            return g

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(name, doc, labels=["model_name"])
            c.add_metric(m, value)
            return c

        yield gauge("vllm:num_requests_running", "Requests with KV blocks admitted.", s.running)
        yield gauge("vllm:num_requests_waiting", "Requests waiting to run (gate and engine queue).",
                    self.gate.waiting())
        total = s.total_blocks or 1
        yield gauge("vllm:kv_cache_usage_perc", "Fraction of KV blocks held by requests (1 = full).",
                    s.blocks["active"] / total)
        yield counter("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                      s.prefix_queries_tokens)
        yield counter("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache.", s.prefix_hits_tokens)
        yield counter("vllm:num_preemptions", "Preemptions (recompute or swap).", s.preemptions)

        blocks = GaugeMetricFamily("kvledger:blocks", "KV blocks by ledger state (promised: reserved for "
                                   "future tokens, not yet materialised; leased: released but still read by "
                                   "an in-flight step).", labels=["state"])
        for state in BLOCK_STATES:
            blocks.add_metric([state], s.blocks.get(state, 0))
        yield blocks
        yield gauge("kvledger:pool_blocks", "KV blocks in the pool.", s.total_blocks, [])
        yield gauge("kvledger:leases", "Outstanding leases (in-flight steps and transfers).", s.leases, [])
        yield gauge("kvledger:sequences", "Sequences (branches) holding blocks.", s.sequences, [])
        adm = CounterMetricFamily("kvledger:admissions", "Ledger admission decisions by outcome.",
                                  labels=["outcome"])
        for outcome, value in sorted(s.admissions.items()):
            adm.add_metric([outcome], value)
        yield adm
        ev = CounterMetricFamily("kvledger:evictions", "Retained (cached) blocks evicted for reuse.")
        ev.add_metric([], s.evictions)
        yield ev
        cancelled = CounterMetricFamily("kvledger:requests_cancelled", "Requests cancelled in the engine (client "
                                        "gone, stop string met, shutdown); their blocks went back at a step "
                                        "boundary.")
        cancelled.add_metric([], s.cancelled)
        yield cancelled
        sw = CounterMetricFamily("kvledger:swapped_blocks", "Blocks moved by preemption by swap.",
                                 labels=["direction"])
        for direction, value in sorted(s.swapped_blocks.items()):
            sw.add_metric([direction], value)
        yield sw
        # BackendState.tier_failures: {"demotion": blocks, "promotion": blocks}; empty without tiers.
        tier_failures = s.tier_failures
        yield counter("kvledger:tier_demotion_failures", "Prefix-cache blocks whose copy into a tier below the "
                      "device pool (host, disk) raised; each lost only its cache entry.",
                      tier_failures.get("demotion", 0))
        yield counter("kvledger:tier_promotion_failures", "Prefix-cache blocks whose read back from a tier "
                      "raised; their requests recomputed those tokens.", tier_failures.get("promotion", 0))

        names = sorted(set(self.tenant_names()) | set(self.gate.tenants()) | set(s.groups))
        flight = GaugeMetricFamily("kvledger:tenant_requests_in_flight", "Engine requests in flight, per tenant.",
                                   labels=["tenant"])
        for name in names:
            flight.add_metric([name], self.gate.tenant_in_flight(name))
        yield flight
        usage = GaugeMetricFamily("kvledger:tenant_blocks", "A tenant's KV blocks in the ledger (its trust "
                                  "group's ledger): active (held), promised (reserved, not yet materialised), "
                                  "growth (its requests may still take past their reservations); their sum is "
                                  "what its cap bounds.", labels=["tenant", "state"])
        caps = GaugeMetricFamily("kvledger:tenant_block_cap", "A tenant's cap on KV blocks (its quota), for "
                                 "tenants that have one.", labels=["tenant"])
        refused = CounterMetricFamily("kvledger:tenant_quota_refusals", "Admissions a tenant's cap made wait "
                                      "(not now) or refused (never).", labels=["tenant"])
        tq = CounterMetricFamily("kvledger:tenant_prefix_cache_queries", "Prompt tokens looked up, per tenant.",
                                 labels=["tenant"])
        th = CounterMetricFamily("kvledger:tenant_prefix_cache_hits", "Prompt tokens found cached, per tenant.",
                                 labels=["tenant"])
        for name in names:
            entry = s.groups.get(name, {})
            for state in GROUP_STATES:
                usage.add_metric([name, state], entry.get(state) or 0)
            if entry.get("cap") is not None:
                caps.add_metric([name], entry["cap"])
            refused.add_metric([name], entry.get("quota_refusals") or 0)
            tq.add_metric([name], entry.get("query_tokens") or 0)
            th.add_metric([name], entry.get("hit_tokens") or 0)
        yield usage
        yield caps
        yield refused
        yield tq
        yield th


__all__ = ["BLOCK_STATES", "GROUP_STATES", "REFUSALS", "ServerMetrics"]
