"""The fleet's ingress backend (:class:`~kvledger.fleet.serve.FleetBackend`) over real engine replicas and
the real request router, all in this process (``tests/fleet/inproc.py`` stands in for Ray Serve's handles):
what a client sees -- refusals, tokens, results, n > 1, cancellation, a replica dying mid-request, waiting
for room -- and what an operator sees (counters, state, audit, news of the replicas)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from kvledger.core.identity import CacheContext, prompt_digests
from kvledger.core.lifetimes import CacheReset
from kvledger.errors import AdmissionError, ConfigError, QuotaError
from kvledger.placement.score import make_route_request
from kvledger.runtime.sampling import SamplingParams

from .inproc import backend_for, fleet_spec, inproc_fleet, run_fleet, shared_tiny_model

TENANTS = {"tenants": {"acme": {"api_keys": ["sk-acme"]}, "small": {"api_keys": ["sk-small"], "max_blocks": 5}}}
GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return shared_tiny_model(tmp_path_factory)


run = run_fleet


def quiet(counters: dict[str, int]) -> dict[str, int]:
    """The backend's counters less the news polls (their count depends on timing)."""
    return {k: v for k, v in counters.items() if k != "news"}


async def settle(backend: Any, handle: Any) -> Any:
    """The request's result, once its task is over (a cancelled task ends cancelled, with a result)."""
    await asyncio.wait({handle.task})
    return handle.result()


def tokens(events: list[Any]) -> list[tuple[int, int | None, int, bool, str | None]]:
    return [(e.branch, e.token, e.position, e.finished, e.finish_reason) for e in events]


# ---- the ingress's own "never" -------------------------------------------------------------------------


CASES: list[tuple[list[int], Any, Any, dict[str, Any], tuple[str, str] | int]] = [
    ([1, 2, 3], 5, None, {}, 5),
    ([7] * 250, 20, None, {}, 6),  # the output allowance is cut to what the context leaves
    ([7] * 200, 50, SamplingParams(temperature=1.0, n=2), {}, 50),
    ([1, 2, 3], 5, None, {"cache_salt": "s", "trust_group": "acme"}, 5),
    ([7] * 256, 1, None, {}, ("AdmissionError",
                              "the prompt has 256 tokens but the model's context is 256 tokens: it does not fit")),
    ([7] * 200, 50, SamplingParams(temperature=1.0, n=3), {},
     ("AdmissionError", "the KV pool of a replica is too small for this request: it needs 89 blocks and a replica "
                        "has 80")),
    ([7] * 24, 4, None, {"trust_group": "small"},
     ("QuotaError", "this request is larger than its trust group's quota: it needs 7 blocks and the quota is 5")),
    ([1, 2], 1, SamplingParams(temperature=1.0, n=5), {},
     ("AdmissionError", "n=5 sequences can never run at once here: at most 4 sequences run at a time")),
    ([1, 2], 1, SamplingParams(beam_width=5), {},
     ("AdmissionError", "beam width 5 sequences can never run at once here: at most 4 sequences run at a time")),
    ([1, 256], 1, None, {}, ("ConfigError", "prompt token ids must be in [0, 256)")),
    ([-1], 1, None, {}, ("ConfigError", "prompt token ids must be in [0, 256)")),
    ([], 1, None, {}, ("ConfigError", "the prompt is empty")),
    ([1], 0, None, {}, ("ConfigError", "max_new_tokens must be an integer >= 1, got 0")),
    ([1], True, None, {}, ("ConfigError", "max_new_tokens must be an integer >= 1, got True")),
    ([1], 2.0, None, {}, ("ConfigError", "max_new_tokens must be an integer >= 1, got 2.0")),
    ([1], 1, None, {"cache_salt": ""}, ("ConfigError", "cache_salt must be a non-empty string or None, got ''")),
    ([1], 1, None, {"cache_salt": 5}, ("ConfigError", "cache_salt must be a non-empty string or None, got 5")),
]


def test_the_ingress_refuses_exactly_what_a_replica_would_and_builds_the_same_cache_identity(model):
    """The ingress answers "never" itself (no replica asked): for each request its answer has the type a
    replica's engine gives (accepted, ConfigError, AdmissionError, QuotaError), its own words, and for an
    accepted request the same ids, output allowance and cache context -- the one the replicas' ledgers
    salt their digests with, so the router's affinity is the ledgers' (at fp32 the KV format id and the
    compute dtype agree: see issue 32 for quantised KV)."""
    async def go() -> None:
        spec = fleet_spec(model, pool_blocks=80, max_running=4)
        async with inproc_fleet(spec, tenants=TENANTS) as (deployment, backend):
            backend.set_quota("small", 5)
            engine = deployment.replicas[0].servable.engine
            for prompt, max_new, sampling, kw, want in CASES:
                answers = []
                for check in (backend.check_request, engine.check_request):
                    try:
                        answers.append(check(prompt, max_new, sampling, **kw))
                    except (ConfigError, AdmissionError) as exc:
                        answers.append(exc)
                ours, theirs = answers
                assert type(ours) is type(theirs), (prompt[:3], max_new, kw, ours, theirs)
                if isinstance(want, int):
                    assert ours == theirs and ours[1] == want
                    assert ours[2] == CacheContext(trust_group=kw.get("trust_group", "default"), model=model,
                                                   kv_dtype="fp32", extra=(("cache_salt", kw["cache_salt"]),)
                                                   if "cache_salt" in kw else ())
                else:
                    assert (type(ours).__name__, str(ours)) == want
            assert not [call for call in deployment.sent if call[0] == "generate"]  # no replica was asked
            backend.set_quota("small", None)  # no cap left at the ingress: the replicas' own refuse it
            assert backend.check_request([7] * 24, 4, trust_group="small")[1] == 4
            with pytest.raises(QuotaError):
                engine.check_request([7] * 24, 4, trust_group="small")
            assert backend.check_request([9] * 8, 1, trust_group="acme")[2] is backend.check_request(
                [9] * 8, 2, trust_group="acme")[2]  # one context per (tenant, salt), built once
    run(go())


# ---- a request's life ---------------------------------------------------------------------------------


def test_a_request_streams_its_tokens_then_its_result_and_leaves_nothing_held(model):
    """submit -> one token event per generated token, at its position, then one finished event; the result
    names the replica, its reasons and attempts; the job sent is the request as the replica needs it; the
    counters, ``running`` and the audits come back to rest; the same prompt again goes to the replica that
    holds its prefix and is served from its cache (the digests agree), another tenant's is not."""
    async def go() -> None:
        spec = fleet_spec(model)
        async with inproc_fleet(spec) as (deployment, backend):
            prompt = list(range(1, 20))  # 19 tokens: four full blocks of 4
            events: list[Any] = []
            before = time.time()
            handle = backend.submit(prompt, 5, GREEDY, trust_group="acme", request_id="req-1", on_token=events.append,
                                    stop_token_ids=[255], priority=3)
            assert handle.request_id == "req-1" and not handle.done()
            with pytest.raises(RuntimeError, match="'req-1' has not finished"):
                handle.result()
            assert backend.num_running() == 0
            first = await settle(backend, handle)
            assert all(before <= e.time_s <= time.time() for e in events)  # stamped when streamed (wall clock)
            assert handle.done() and handle.result(timeout=1.0) is first
            out = [e.token for e in events if not e.finished]
            assert len(out) == 5
            assert tokens(events) == [(0, t, 19 + i, False, None) for i, t in enumerate(out)] + [
                (0, None, 24, True, "length")]
            assert {e.request_id for e in events} == {"req-1"}
            served = first.replica
            assert (first.request_id, first.finish_reasons, first.cached_prompt_tokens, first.refusals,
                    first.attempts) == ("req-1", ["length"], 0, 0, 1)
            assert served in {r.name for r in deployment.replicas}
            generate = [args[0] for method, _, args in deployment.sent if method == "generate"]
            assert len(generate) == 1
            job = generate[0]
            ctx = backend.check_request(prompt, 5, trust_group="acme")[2]
            route = make_route_request("req-1", "acme", prompt_digests(ctx.root_digest(), prompt, 4), 19, 5, 4)
            assert job == {"request_id": "req-1", "prompt": prompt, "max_tokens": 5,
                           "sampling": {"temperature": 0.0, "top_p": 1.0, "top_k": 0, "seed": None, "n": 1,
                                        "beam_width": 1, "logprobs": None, "prompt_logprobs": None,
                                        "presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0,
                                        "min_tokens": 0, "logit_bias": (), "constraint": None},
                           "stop_token_ids": [255], "trust_group": "acme", "priority": 3, "cache_salt": None,
                           "route": route, "avoid": [], "events_since": job["events_since"]}
            assert quiet(backend.counters) == {"refusals": 0, "retries": 0, "replica_failures": 0, "accepted": 1,
                                               "overcommits": 0, "waits": 0}
            assert backend.running == 0 and backend.num_running() == 0
            assert backend.audit() == {"clean": True, "running": 0, "sequences": 0, "leases": 0, "blocks": {},
                                       "total_blocks": 0, "checked": False, "fleet": backend.counters}
            # the finished reply's cache events: five full blocks (19 prompt and 4 of the 5 output tokens computed)
            assert backend.view.known()[served] == 5

            again: list[Any] = []
            second = await settle(backend, backend.submit(prompt, 5, GREEDY, trust_group="acme", request_id="req-2",
                                                          on_token=again.append))
            assert second.replica == served and second.cached_prompt_tokens == 16
            assert [e.token for e in again if not e.finished] == out  # greedy: the same tokens
            salted = await settle(backend, backend.submit(prompt, 5, GREEDY, trust_group="acme", cache_salt="s"))
            sent = [args[0] for method, _, args in deployment.sent if method == "generate"][-1]
            salted_ctx = CacheContext(trust_group="acme", model=model, kv_dtype="fp32", extra=(("cache_salt", "s"),))
            assert sent["cache_salt"] == "s" and sent["route"].digests == tuple(
                prompt_digests(salted_ctx.root_digest(), prompt, 4))  # salted as the replica salts it
            assert salted.cached_prompt_tokens == 0  # the salt is another cache
            other = await settle(backend, backend.submit(prompt, 5, GREEDY, trust_group="globex"))
            assert other.cached_prompt_tokens == 0 and other.request_id.startswith("fleet-")
            audits = {r.name: await r.servable.audit() for r in deployment.replicas}
            assert sum(a["finished"] for a in audits.values()) == 4
            assert all(a["usage"]["promised"] == 0 and a["door"]["overcommits"] == 0 for a in audits.values())
            assert backend.drain(0.0) is True
    run(go())


def test_n_samples_stream_on_their_branches_and_every_attempt_shares_one_seed(model):
    """n=2 streams two branches, each at its own positions, and reports one reason per branch; a sampled
    request without a seed is given one at the ingress, so a resubmission samples the same tokens."""
    async def go() -> None:
        spec = fleet_spec(model)
        async with inproc_fleet(spec) as (deployment, backend):
            events: list[Any] = []
            result = await settle(backend, backend.submit([5, 6, 7, 8, 9], 3, SamplingParams(temperature=1.0, n=2,
                                                                                            seed=11),
                                                          on_token=events.append))
            assert result.finish_reasons == ["length", "length"]
            by_branch = {b: [(e.position, e.finished) for e in events if e.branch == b and not e.finished]
                         for b in (0, 1)}
            assert by_branch == {0: [(5, False), (6, False), (7, False)], 1: [(5, False), (6, False), (7, False)]}
            assert tokens(events)[-1] == (0, None, 11, True, "length")
            job = [args[0] for method, _, args in deployment.sent if method == "generate"][-1]
            assert job["sampling"]["seed"] == 11 and job["route"].charge == 3
            await settle(backend, backend.submit([5, 6, 7], 2, SamplingParams(temperature=1.0)))
            unseeded = [args[0] for method, _, args in deployment.sent if method == "generate"][-1]
            assert isinstance(unseeded["sampling"]["seed"], int) and unseeded["sampling"]["temperature"] == 1.0
            await settle(backend, backend.submit([5, 6, 7], 2, None))
            default = [args[0] for method, _, args in deployment.sent if method == "generate"][-1]
            assert default["sampling"]["seed"] is None  # greedy needs no seed
    run(go())


def test_cancel_ends_the_request_everywhere_and_says_so(model):
    """cancel() of a running request: its result and last event say "cancelled", the replica releases what
    it held; cancelling it again, or an unknown id, answers False."""
    async def go() -> None:
        spec = fleet_spec(model, pool_blocks=64)
        async with inproc_fleet(spec) as (deployment, backend):
            events: list[Any] = []
            first = asyncio.Event()

            def on_token(e: Any) -> None:
                events.append(e)
                first.set()

            handle = backend.submit([3] * 8, 200, GREEDY, request_id="long", on_token=on_token)
            await first.wait()
            assert backend.running == 1 and backend.drain(0.0) is False
            assert backend.cancel("long") is True
            result = await settle(backend, handle)
            assert (result.finish_reasons, result.attempts, result.replica) == (["cancelled"], 1, None)
            assert events[-1].finished and events[-1].finish_reason == "cancelled"
            assert backend.cancel("long") is False and backend.cancel("nobody") is False
            assert backend.drain(0.0) is True
            served = [name for method, name, _ in deployment.sent if method == "generate"][-1]
            replica = deployment.by_name(served).servable
            for _ in range(1000):  # the engine applies a cancel at its next safe point
                audit = await replica.audit()
                if audit["usage"]["promised"] == 0 and not replica.engine.scheduler.running:
                    break
                await asyncio.sleep(0.005)
            assert audit["usage"]["promised"] == 0 and audit["finished"] == 0 and audit["door"]["booked"] == 0
    run(go())


async def _two_streaming(backend: Any) -> list[Any]:
    """Two long requests, both streaming (each has sent a token)."""
    started: set[str] = set()
    both = asyncio.Event()

    def on_token(e: Any) -> None:
        started.add(e.request_id)
        if len(started) == 2:
            both.set()

    handles = [backend.submit([4 + k] * 8, 100, GREEDY, request_id=f"long-{k}", on_token=on_token)
               for k in range(2)]
    await both.wait()
    assert backend.running == 2
    return handles


def test_stop_cancels_every_request_in_flight_and_the_news(model):
    async def go() -> None:
        spec = fleet_spec(model, pool_blocks=64, news_period_s=0.01)
        async with inproc_fleet(spec) as (_, backend):
            handles = await _two_streaming(backend)
            news = backend._news
            backend.stop()
            results = [await settle(backend, h) for h in handles]
            assert [r.finish_reasons for r in results] == [["cancelled"], ["cancelled"]]
            # The poll may be inside a replica call when it is cancelled: it ends once that call unwinds.
            assert news is not None
            await asyncio.wait({news}, timeout=30)
            assert news.cancelled()
            assert backend.drain(0.0) is True
    run(go())


def test_a_cancelled_request_no_longer_counts_as_running(model):
    """Regression: a request cancelled (client gone, or the ingress stopping) while a replica streamed it
    stayed counted in ``running`` for good -- ``state().running`` grew with every disconnect and the audit
    never came back clean."""
    async def go() -> None:
        spec = fleet_spec(model, pool_blocks=64)
        async with inproc_fleet(spec) as (_, backend):
            handles = await _two_streaming(backend)
            assert backend.cancel("long-0") is True
            await settle(backend, handles[0])
            assert backend.running == 1 and backend.state().running == 1
            backend.stop()
            await settle(backend, handles[1])
            assert backend.running == 0 and backend.num_running() == 0
            assert backend.audit()["clean"] is True
    run(go())


def test_a_replica_that_dies_mid_request_is_counted_avoided_and_the_request_completes_elsewhere(model):
    """The replica serving a request dies after its first token: the ingress counts a replica failure,
    resubmits to the other replica (same seed), and the client receives every token exactly once -- the
    same tokens a clean run gives."""
    async def go() -> None:
        spec = fleet_spec(model, pool_blocks=64)
        async with inproc_fleet(spec) as (deployment, backend):
            prompt = [11, 12, 13, 14, 15, 16]
            clean: list[Any] = []
            await settle(backend, backend.submit(prompt, 6, GREEDY, on_token=clean.append))
            events: list[Any] = []

            def on_token(e: Any) -> None:
                events.append(e)
                if len(events) == 2:  # the serving replica dies after streaming two tokens
                    deployment.kill(deployment.sent[-1][1])

            result = await settle(backend, backend.submit(prompt, 6, GREEDY, request_id="survivor", on_token=on_token))
            victim = [name for method, name, _ in deployment.sent if method == "generate"][-2]
            assert result.replica != victim and result.finish_reasons == ["length"]
            assert (result.attempts, result.refusals) == (2, 0)
            assert tokens(events) == tokens(clean)  # nothing lost, nothing streamed twice
            assert quiet(backend.counters) == {"refusals": 0, "retries": 0, "replica_failures": 1, "accepted": 3,
                                               "overcommits": 0, "waits": 0}
            assert backend.running == 0
            retry = [args[0] for method, _, args in deployment.sent if method == "generate"][-1]
            assert retry["avoid"] == [victim]
            assert victim not in backend.view.replicas
            assert victim not in {replica.name for replica in deployment.router.curr_replicas.values()}
    run(go())


def test_a_request_every_replica_refuses_waits_for_room_and_then_runs(model):
    """Three requests that each need a whole replica's pool, on two replicas: the third is refused by both
    ("not now": retried once elsewhere, then waits in line for news of room) and runs when one finishes.
    Nobody overcommits and everyone completes."""
    async def go() -> None:
        spec = fleet_spec(model, pool_blocks=8, block_size=16, max_running=4)
        async with inproc_fleet(spec) as (deployment, backend):
            handles = [backend.submit([20 + k] * 16, 112, GREEDY, request_id=f"big-{k}") for k in range(3)]
            results = [await settle(backend, h) for h in handles]
            assert [r.finish_reasons for r in results] == [["length"]] * 3
            c = backend.counters
            # One was refused by both replicas, then waited for news of room (no storm of refusals meanwhile)
            # and ran at once when a replica finished.
            assert max(r.refusals for r in results) == 2 and c["waits"] == 1
            assert c["retries"] >= 1 and c["refusals"] == sum(r.refusals for r in results)
            assert c["accepted"] == 3 and c["replica_failures"] == 0
            assert all(r.attempts == r.refusals + 1 for r in results)
            refused = 0
            for replica in deployment.replicas:
                audit = await replica.servable.audit()
                assert audit["door"]["overcommits"] == 0 and audit["usage"]["promised"] == 0
                refused += audit["door"]["refused"]
            assert refused == c["refusals"]  # every refusal the ingress counted was a replica's door's
            assert backend.running == 0
            assert backend.state().admissions == {"admitted": 3, "not_now": c["refusals"], "never": 0}
    run(go())


def test_a_replica_that_says_never_ends_the_request_without_retrying(model):
    """A request the ingress lets through (it was not told the tenant's cap) but a replica's ledger can
    never hold ends at once with "never": no retry, no wait."""
    async def go() -> None:
        spec = fleet_spec(model)
        async with inproc_fleet(spec, tenants=TENANTS) as (_, backend):
            events: list[Any] = []
            result = await settle(backend, backend.submit([7] * 24, 4, GREEDY, trust_group="small",
                                                          on_token=events.append))
            assert (result.finish_reasons, result.attempts, result.refusals, result.cached_prompt_tokens) == (
                ["never"], 1, 0, 0)
            assert tokens(events) == [(0, None, 24, True, "never")]
            assert quiet(backend.counters) == {"refusals": 0, "retries": 0, "replica_failures": 0, "accepted": 0,
                                               "overcommits": 0, "waits": 0}
    run(go())


# ---- what the operator sees -------------------------------------------------------------------------


def test_news_tells_the_state_and_another_ingress_where_prefixes_went(model):
    """Each ingress polls every replica for its load and cache events in the background: before routing
    anything it knows every replica's pool (``state()``), and it learns which replica holds a prefix that
    another ingress sent there -- and sends the same prefix there too."""
    async def go() -> None:
        spec = fleet_spec(model, news_period_s=0.02)
        async with inproc_fleet(spec) as (deployment, backend):
            while backend.counters["news"] < 2:
                await asyncio.sleep(0.005)
            state = backend.state()
            assert (state.running, state.total_blocks, state.sequences, state.leases) == (0, 32, 0, 0)
            assert state.blocks == {"free": 32, "evictable": 0, "promised": 0, "booked": 0, "active": 0,
                                    "retained": 0, "pinned": 0, "leased": 0}
            assert state.admissions == {"admitted": 0, "not_now": 0, "never": 0}
            assert (state.evictions, state.preemptions, state.swapped_blocks, state.prefix_queries_tokens,
                    state.prefix_hits_tokens) == (0, 0, {"out": 0, "in": 0}, 0, 0)
            assert backend.reset_prefix_cache() == CacheReset(
                False, 0, "the fleet's ingress holds no prefix cache: reset each replica's engine")
            assert backend.reset_prefix_cache(True).done is False
            prompt = list(range(40, 61))  # five full blocks
            first = await settle(backend, backend.submit(prompt, 2, GREEDY))
            state = backend.state()  # the finished reply's load: five blocks retained for the next hit
            assert (state.running, state.total_blocks, state.sequences) == (0, 32, 0)
            assert state.blocks == {"free": 27, "evictable": 5, "promised": 0, "booked": 0, "active": 0,
                                    "retained": 5, "pinned": 0, "leased": 0}
            assert state.admissions == {"admitted": 1, "not_now": 0, "never": 0}

            # Another ingress process, with a view of its own: it routed nothing, the news tells it.
            other_spec = fleet_spec(model, news_period_s=0.02)
            elsewhere = deployment.another_process(view_key=other_spec.view_key)
            other = backend_for(elsewhere.handle(), other_spec)
            try:
                while other.view.known().get(first.replica, 0) < 5:
                    await asyncio.sleep(0.005)
                assert other.counters["news"] >= 2
                again = await settle(other, other.submit(prompt + [1, 2], 2, GREEDY))
                assert again.replica == first.replica and again.cached_prompt_tokens == 20
            finally:
                other.stop()
    run(go())
