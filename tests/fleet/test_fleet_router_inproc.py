"""kvledger's Ray Serve request router (:class:`~kvledger.fleet.router.LedgerRequestRouter`), built as Ray
builds it (``RequestRouter.__init__``, then ``initialize_state(**request_router_kwargs)``) and driven by Ray's
own routing loop through ``tests/fleet/inproc.py``, in this process: which replica a request goes to, what
the router counts in flight there, how it treats ``avoid``, ``target``, dead and unknown replicas."""

from __future__ import annotations

import random
from types import SimpleNamespace
from typing import Any

from ray.serve._private.common import DeploymentHandleSource, DeploymentID, ReplicaID

from kvledger.core.identity import CacheContext, prompt_digests
from kvledger.fleet.router import LedgerRequestRouter, replica_key
from kvledger.fleet.serve import MAX_ONGOING, FleetSpec, fleet_app
from kvledger.placement.score import ReplicaLoad, ScoreConfig, make_route_request
from kvledger.placement.view import STORED, shared_view

from .inproc import InprocDeployment, InprocReplica, engine_deployment, run_fleet

BS = 4
DEPLOYMENT = DeploymentID(name="engine", app_name="router-test")
_keys = iter(range(1_000_000))


run = run_fleet


def new_router(**kwargs: Any) -> LedgerRequestRouter:
    """A router as Ray builds one, on a view of its own (unless ``view_key`` is given)."""
    router = LedgerRequestRouter(DEPLOYMENT, DeploymentHandleSource.UNKNOWN)
    router.initialize_state(**{"view_key": f"router-test-{next(_keys)}", "block_size": BS, "min_match_tokens": BS,
                               "seed": 0, **kwargs})
    return router


def replica(name: str, free: int | None = None, promised: int = 0, pool: int = 32, seq: int = 1) -> InprocReplica:
    """A replica as the router sees it, publishing a load with ``free`` blocks and ``promised`` decode blocks
    (no ``free``: no stats yet)."""
    r = InprocReplica(ReplicaID(unique_id=name, deployment_id=DEPLOYMENT), None, MAX_ONGOING)
    if free is not None:
        r.routing_stats = {"load": ReplicaLoad(pool, free, 0, promised, seq=seq, stamp=0.0).to_dict()}
    return r


def name_of(r: Any) -> str:
    return r.replica_id.to_full_id_str()


def route_for(prompt: list[int], rid: str = "q", group: str = "t", max_new: int = BS, n: int = 1) -> Any:
    ctx = CacheContext(trust_group=group)
    return make_route_request(rid, group, prompt_digests(ctx.root_digest(), prompt, BS), len(prompt), max_new, BS, n)


def pending(job: Any) -> Any:
    return SimpleNamespace(args=[job] if job is not None else [], kwargs={})


def test_the_router_is_configured_by_the_fleets_request_router_config():
    """``fleet_app`` names this router and hands it the spec's view key, block size and score knobs; Ray
    builds it from them, and it shares its view with the ingress code of its process (the view key)."""
    spec = FleetSpec(block_size=8, min_match_tokens=48, queue_weight=0.25, view_key=f"cfg-{next(_keys)}")
    config = engine_deployment(fleet_app(spec))._deployment_config.request_router_config
    assert config.request_router_class == "kvledger.fleet.router:LedgerRequestRouter"
    router = LedgerRequestRouter(DEPLOYMENT, DeploymentHandleSource.UNKNOWN)
    router.initialize_state(**config.request_router_kwargs)
    assert router.view is shared_view(spec.view_key, block_size=8)
    assert router.view.block_size == 8
    assert router.view.config == ScoreConfig(min_match_tokens=48, queue_weight=0.25, decode_weight=1.0)
    assert (router.decisions, router._known, router._matched) == (0, frozenset(), {})

    seeded = new_router(queue_weight=0.5, decode_weight=2.0, seed=7, ignored_option=1)
    assert seeded.view.config == ScoreConfig(min_match_tokens=BS, queue_weight=0.5, decode_weight=2.0)
    assert seeded.view.rng.random() == random.Random(7).random()

    defaults = LedgerRequestRouter(DEPLOYMENT, DeploymentHandleSource.UNKNOWN)
    defaults.initialize_state()
    assert defaults.view is shared_view("kvledger", block_size=16)
    assert defaults.view.config == ScoreConfig(min_match_tokens=1024, queue_weight=0.1, decode_weight=1.0)


def test_a_request_goes_to_the_cheapest_replica_that_fits_and_is_counted_there_in_flight():
    """The ranking, best first, one replica per rank: those the request fits first, then by cost (prefix
    held, decode owed); the routed request is counted in flight on its replica (its charge off what the
    view believes is available, its uncached prompt in the backlog) until a reply says otherwise."""
    async def go() -> None:
        router = new_router()
        a, b, c = replica("a", free=32), replica("b", free=2), replica("c", free=12, promised=2)
        router.update_replicas([a, b, c])
        assert set(router.view.replicas) == {name_of(a), name_of(b), name_of(c)}
        prompt = list(range(16))  # four blocks
        route = route_for(prompt, max_new=8)  # charge 4 + 2 = 6 blocks
        ranks = await router.choose_replicas([a, b, c], pending({"route": route, "avoid": []}))
        assert [[name_of(r) for r in rank] for rank in ranks] == [[name_of(a)], [name_of(c)], [name_of(b)]]
        assert router.decisions == 1
        assert router.view.available(name_of(a)) == 32  # the published loads were read

        # c holds the first three blocks of the prompt: now the cheapest that fits.
        router.view.apply_events(name_of(c), [(STORED, d) for d in route.digests[:3]], 3)
        ranks = await router.choose_replicas([a, b, c], pending({"route": route, "avoid": []}))
        assert [name_of(rank[0]) for rank in ranks] == [name_of(c), name_of(a), name_of(b)]
        assert router._matched == {"q": {name_of(c): 3, name_of(a): 0, name_of(b): 0}}

        router.on_request_routed(pending({"route": route}), c.replica_id, None)
        assert router._matched == {}
        state = router.view.replicas[name_of(c)]
        assert (state.delta_available, state.delta_decode, state.delta_prefill) == (-6, 2, 1)
        assert router.view.available(name_of(c)) == 12 - 2 - 6
        assert router.view.in_flight() == 1

        # Another request now fits only on a: c's in-flight request is counted against it.
        other = route_for(list(range(100, 116)), rid="q2", max_new=8)
        ranks = await router.choose_replicas([a, b, c], pending({"route": other, "avoid": []}))
        assert [name_of(rank[0]) for rank in ranks] == [name_of(a), name_of(b), name_of(c)]  # fits; then cost
        router.on_request_routed(pending({"route": other}), a.replica_id, None)
        assert router.view.replicas[name_of(a)].delta_prefill == 4  # nothing cached there: all four blocks
    run(go())


def test_avoid_target_and_calls_without_a_route():
    """``avoid`` drops replicas that just refused (all avoided: every replica again, never an empty ranking);
    ``target`` sends an operator call to its replica, or -- that replica gone -- to any, which refuses it; a
    call without a route (news, pid) may go anywhere; none of these counts as a routing decision."""
    async def go() -> None:
        router = new_router(seed=1)
        a, b = replica("a", free=32), replica("b", free=32)
        router.update_replicas([a, b])
        route = route_for(list(range(8)))
        ranks = await router.choose_replicas([a, b], pending({"route": route, "avoid": [name_of(a)]}))
        assert [[name_of(r) for r in rank] for rank in ranks] == [[name_of(b)]]
        ranks = await router.choose_replicas([a, b], pending({"route": route, "avoid": [name_of(a), name_of(b)]}))
        assert sorted(name_of(rank[0]) for rank in ranks) == sorted([name_of(a), name_of(b)])
        assert router.decisions == 2

        everyone = [[a], [b]]
        assert await router.choose_replicas([a, b], pending({"target": name_of(b)})) == [[b]]
        assert await router.choose_replicas([a, b], pending({"target": "gone", "route": route})) == everyone
        assert await router.choose_replicas([a, b], pending({"since": 0})) == everyone
        assert await router.choose_replicas([a, b], pending(None)) == everyone
        assert await router.choose_replicas([a, b], pending("not a job")) == everyone
        assert await router.choose_replicas([a, b], None) == everyone
        assert router.decisions == 2
        router.on_request_routed(pending(None), a.replica_id, None)  # nothing to count
        router.on_request_routed(pending({"target": name_of(a)}), a.replica_id, None)
        router.on_request_routed(pending(["a list"]), a.replica_id, None)
        assert router.view.in_flight() == 0
    run(go())


def test_membership_stats_and_deaths_reach_the_view():
    """Ray tells the router who the replicas are (``update_replicas``) and their published loads (routing
    stats, read on every decision; a malformed one is ignored); a replica that dies is dropped from the
    view with its prefixes, and Ray's own choice skips it."""
    async def go() -> None:
        router = new_router()
        a, b = replica("a", free=30), replica("b")
        b.routing_stats = {"load": {"pool": -1}}  # malformed: no advice
        router.update_replicas([a, b])
        assert router._known == frozenset({name_of(a), name_of(b)})
        route = route_for(list(range(8)))
        await router.choose_replicas([a, b], pending({"route": route}))
        assert router.view.available(name_of(a)) == 30 and router.view.available(name_of(b)) is None
        a.routing_stats = {"load": ReplicaLoad(32, 10, 0, 0, seq=2).to_dict()}
        await router.choose_replicas([a, b], pending({"route": route}))
        assert router.view.available(name_of(a)) == 10

        router.view.apply_events(name_of(a), [(STORED, route.digests[0])], 1)
        assert router.view.known()[name_of(a)] == 1
        assert await router._select_from_candidate_replicas([a, b], 0) is a
        router.on_replica_actor_died(a.replica_id)
        assert name_of(a) not in router.view.replicas and router._known == frozenset({name_of(b)})
        assert a.replica_id not in router.curr_replicas
        assert await router._select_from_candidate_replicas([a, b], 0) is b
        assert await router._select_from_candidate_replicas([a], 0) is None

        # A replica Ray lists again (or a new one) is learnt from the candidates of the next decision.
        c = replica("c", free=5)
        await router.choose_replicas([b, c], pending({"route": route}))
        assert set(router.view.replicas) == {name_of(b), name_of(c)} and router.view.available(name_of(c)) == 5
        router.update_replicas([c])
        assert set(router.view.replicas) == {name_of(c)} and router._known == frozenset({name_of(c)})
        assert replica_key(c.replica_id) == "SERVE_REPLICA::router-test#engine#c"
    run(go())


class Echo:
    """A replica without a model: answers who it is."""

    def __init__(self, tag: str) -> None:
        from ray import serve

        self.name = serve.get_replica_context().replica_id.to_full_id_str()
        self.tag = tag

    async def whoami(self, job: Any = None) -> str:
        return self.name


def test_rays_routing_loop_takes_the_first_live_rank_and_the_router_counts_it():
    """Through Ray's own routing loop: a request goes to the router's first choice; when that replica is
    gone from Ray's list (died, not yet dropped from the view), to the next rank; ``target`` reaches one
    replica; ``on_request_routed`` leaves the request in flight on the replica it went to."""
    from ray import serve

    async def go() -> None:
        key = f"loop-{next(_keys)}"
        config = {"request_router_class": "kvledger.fleet.router:LedgerRequestRouter",
                  "request_router_kwargs": {"view_key": key, "block_size": BS, "min_match_tokens": BS}}
        echo = serve.deployment(Echo, name="echo", num_replicas=3, request_router_config=config).bind("x")
        deployment = InprocDeployment(echo._bound_deployment)
        first, second, third = (r.name for r in deployment.replicas)
        for r, owed in zip(deployment.replicas, (4, 0, 8), strict=True):  # decode blocks each owes: its cost
            r.routing_stats = {"load": ReplicaLoad(32, 30, 0, owed, seq=1).to_dict()}
        handle = deployment.handle()
        route = route_for(list(range(8)), rid="r1")
        assert await handle.whoami.remote({"route": route, "avoid": []}) == second
        view = deployment.router.view
        assert view.replicas[second].sent.keys() == {"r1"} and view.in_flight() == 1
        assert await handle.whoami.remote({"target": third}) == third
        deployment.router.curr_replicas.pop(deployment.replicas[1].replica_id)  # Ray's list lost it first
        route2 = route_for(list(range(50, 58)), rid="r2")
        assert await handle.whoami.remote({"route": route2, "avoid": []}) == first
        assert view.replicas[first].sent.keys() == {"r2"}
    run(go())
