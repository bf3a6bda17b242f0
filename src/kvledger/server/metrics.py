"""Prometheus metrics: vLLM's names where vLLM has the same quantity (so its dashboards work), ours under
``kvledger:``. One registry per app (no global state): two apps in one process never mix counts.

vLLM's families carry vLLM v1's label sets (``model_name`` and ``engine``, always ``"0"`` here: one engine
per server) and its bucket edges (``vllm/v1/metrics/buckets.py``), so a vLLM Grafana dashboard finds every
series it queries (``tests/server/data/vllm_grafana_series.json`` pins the list). Per request, as vLLM's
output processor does: the phases (queue: arrival to first admission; prefill: admission to first token;
decode: first to last token; inference: admission to last token) and TPOT come from the engine's own
timestamps (``RequestResult.phases``), once per engine request; token counts, parameters, preemptions and
``request_success`` once per choice (vLLM's child requests), ``request_params_n`` and
``request_max_num_generation_tokens`` once per engine request (vLLM's parent request). TTFT and
inter-token latency are observed by the server as tokens stream.

Pool state (blocks by state, queue lengths, ledger counters) and the engine's tokens per step
(``vllm:iteration_tokens_total``) are read from the backend at scrape time, so they are never stale. A failed
transfer to or from a tier below the device pool fails no request (it loses a cache entry, or its request
recomputes a prefix): ``kvledger:tier_demotion_failures`` and ``kvledger:tier_promotion_failures`` are where
a failing disk shows.
``/metrics`` is the operator's view: it carries every tenant's usage, so in multi-tenant mode only an
operator key may read it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

from .backend import Backend
from .gate import AdmissionGate

# vLLM's bucket edges (vllm/v1/metrics/buckets.py), so histograms line up on a shared dashboard.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0)  # also TPOT's
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0, 7680.0)  # every request phase's (e2e, queue, prefill, decode, inference)
ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
PARAMS_N_BUCKETS = (1, 2, 5, 10, 20)
PREEMPTIONS_BUCKETS = (1, 2, 3, 4, 5, 10, 20)
DEFAULT_MAX_MODEL_LEN = 65536  # request token buckets' cap when the backend does not know its context

ENGINE = "0"  # vLLM's ``engine`` label: the engine core's index (one engine per server here)
FINISH_REASONS = ("stop", "length", "abort", "error", "repetition")  # vLLM's FinishReason, all pre-created
PROMPT_SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")  # vLLM's PromptTokenStats
BLOCK_STATES = ("free", "active", "retained", "evictable", "promised", "pinned", "leased")
REFUSALS = ("unauthorized", "forbidden", "invalid", "too_large", "never_fits", "tenant_cap", "queue_full",
            "draining")
GROUP_STATES = ("active", "promised", "growth")  # a trust group's ledger (kvledger.core.quota)


def request_tokens_buckets(max_model_len: int) -> tuple[int, ...]:
    """vLLM's token-count edges: 1, 2, 5, 10, 20, 50, ... up to the model's length."""
    out: list[int] = []
    scale = 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_model_len:
                return tuple(out)
            out.append(m * scale)
        scale *= 10


class ServerMetrics:
    def __init__(self, model_name: str, backend: Backend, gate: AdmissionGate,
                 tenant_names: Callable[[], list[str]]) -> None:
        self.model_name = model_name
        self.registry = CollectorRegistry(auto_describe=False)
        reg, m, me = self.registry, ["model_name", "engine"], (model_name, ENGINE)

        def hist(name: str, doc: str, buckets: tuple[float, ...]) -> Any:
            return Histogram(name, doc, m, buckets=buckets, registry=reg).labels(*me)

        self.ttft = hist("vllm:time_to_first_token_seconds", "Time to first token (server side).", TTFT_BUCKETS)
        self.itl = hist("vllm:inter_token_latency_seconds", "Time between consecutive tokens of a sequence.",
                        ITL_BUCKETS)
        self.e2e = hist("vllm:e2e_request_latency_seconds", "Request latency, arrival to last token.", E2E_BUCKETS)
        self.tpot = hist("vllm:request_time_per_output_token_seconds", "A request's mean time per output token "
                         "after the first (decode time / (tokens - 1); 0 with one token).", ITL_BUCKETS)
        self.queue_time = hist("vllm:request_queue_time_seconds", "Time a request waited in the engine's queue "
                               "(arrival to first admission).", E2E_BUCKETS)
        self.prefill_time = hist("vllm:request_prefill_time_seconds", "Time from a request's admission to its "
                                 "first token.", E2E_BUCKETS)
        self.decode_time = hist("vllm:request_decode_time_seconds", "Time from a request's first token to its "
                                "last.", E2E_BUCKETS)
        self.inference_time = hist("vllm:request_inference_time_seconds", "Time from a request's admission to "
                                   "its last token.", E2E_BUCKETS)
        cap = getattr(backend, "max_context", None) or DEFAULT_MAX_MODEL_LEN
        tokens = request_tokens_buckets(cap)
        self.request_prompt = hist("vllm:request_prompt_tokens", "Prompt tokens per request.", tokens)
        self.request_generation = hist("vllm:request_generation_tokens", "Generated tokens per request.", tokens)
        self.request_max_generation = hist("vllm:request_max_num_generation_tokens", "Most tokens any choice of "
                                           "a request generated.", tokens)
        self.request_max_tokens = hist("vllm:request_params_max_tokens", "The max_tokens request parameter "
                                       "(the budget given to the engine).", tokens)
        self.request_n = hist("vllm:request_params_n", "The n request parameter.", PARAMS_N_BUCKETS)
        self.request_preemptions = hist("vllm:request_num_preemptions", "Times a request was preempted.",
                                        PREEMPTIONS_BUCKETS)
        self.request_prefill_computed = hist("vllm:request_prefill_kv_computed_tokens", "Prompt tokens a "
                                             "request computed (cached ones excluded).", tokens)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prompt tokens of finished requests.", m,
                                     registry=reg).labels(*me)
        self.prompt_cached = Counter("vllm:prompt_tokens_cached", "Prompt tokens served from the prefix cache.",
                                     m, registry=reg).labels(*me)
        self.prompt_by_source = Counter("vllm:prompt_tokens_by_source", "Prompt tokens by source (computed or "
                                        "read from the prefix cache).", [*m, "source"], registry=reg)
        self.generation_tokens = Counter("vllm:generation_tokens", "Generated tokens.", m,
                                         registry=reg).labels(*me)
        self.success = Counter("vllm:request_success", "Finished requests by finish reason.",
                               [*m, "finished_reason"], registry=reg)
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
        for reason in FINISH_REASONS:
            self.success.labels(model_name, ENGINE, reason)
        for source in PROMPT_SOURCES:
            self.prompt_by_source.labels(model_name, ENGINE, source)
        for name in tenant_names():  # every known tenant reads 0 from the first scrape on
            for counter in (self.tenant_requests, self.tenant_prompt, self.tenant_generated, self.tenant_cached):
                counter.labels(name)
        reg.register(_StateCollector(model_name, backend, gate, tenant_names))

    def finished(self, reason: str) -> None:
        """One choice finished (vLLM counts each of its child requests)."""
        self.success.labels(self.model_name, ENGINE, reason).inc()

    def observe_request(self, result: Any, prompt_len: int, cached: int, n: int, max_tokens: int,
                        generated: list[int]) -> None:
        """What one finished engine request adds (``generated``: each choice's tokens as sent). A result
        without the engine's timestamps (a fleet ingress's) adds no phase and no TPOT."""
        self.prompt_tokens.inc(prompt_len)
        self.prompt_cached.inc(cached)
        self.prompt_by_source.labels(self.model_name, ENGINE, "local_compute").inc(prompt_len - cached)
        self.prompt_by_source.labels(self.model_name, ENGINE, "local_cache_hit").inc(cached)
        self.request_n.observe(n)
        self.request_max_generation.observe(max(generated, default=0))
        for tokens in generated:
            self.request_prompt.observe(prompt_len)
            self.request_generation.observe(tokens)
            self.request_max_tokens.observe(max_tokens)
            self.request_prefill_computed.observe(prompt_len - cached)
            self.request_preemptions.observe(getattr(result, "preemptions", 0))
        phases = result.phases() if hasattr(result, "phases") else None
        if phases is None:
            return
        self.queue_time.observe(phases["queue"])
        self.prefill_time.observe(phases["prefill"])
        self.decode_time.observe(phases["decode"])
        self.inference_time.observe(phases["inference"])
        longest = max((len(o) for o in result.outputs), default=0)
        self.tpot.observe(phases["decode"] / (longest - 1) if longest > 1 else 0.0)

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
        m, me = [self.model_name], [self.model_name, ENGINE]

        def gauge(name: str, doc: str, value: float, labels: list[str] | None = None) -> GaugeMetricFamily:
            g = GaugeMetricFamily(name, doc, labels=["model_name", "engine"] if labels is None else labels)
            g.add_metric(me if labels is None else [], value)
            return g

        def counter(name: str, doc: str, value: float, vllm: bool = True) -> CounterMetricFamily:
            c = CounterMetricFamily(name, doc, labels=["model_name", "engine"] if vllm else ["model_name"])
            c.add_metric(me if vllm else m, value)
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
        yield _iteration_histogram(me, s.iteration_tokens)

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
                      tier_failures.get("demotion", 0), vllm=False)
        yield counter("kvledger:tier_promotion_failures", "Prefix-cache blocks whose read back from a tier "
                      "raised; their requests recomputed those tokens.", tier_failures.get("promotion", 0),
                      vllm=False)

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


def _iteration_histogram(labels: list[str], counts: dict[int, int]) -> HistogramMetricFamily:
    """The engine's steps by tokens processed, bucketed at scrape time with vLLM's edges."""
    h = HistogramMetricFamily("vllm:iteration_tokens_total", "Tokens per engine step (computed prompt tokens "
                              "+ sampled tokens).", labels=["model_name", "engine"])
    items = sorted(counts.items())
    buckets = [(str(float(edge)), sum(steps for tokens, steps in items if tokens <= edge))
               for edge in ITERATION_TOKENS_BUCKETS]
    buckets.append(("+Inf", sum(steps for _, steps in items)))
    h.add_metric(labels, buckets, sum_value=sum(tokens * steps for tokens, steps in items))
    return h


__all__ = ["BLOCK_STATES", "FINISH_REASONS", "GROUP_STATES", "REFUSALS", "ServerMetrics"]
