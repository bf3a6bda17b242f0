"""A replica the ingress dropped from its view after a failed call comes back while Ray still lists it.

The ingress and its router share one view. When a call to a replica fails (its stream broke, the replica
stays alive), the ingress drops it from the view; the router learnt membership only from changes in
Ray's list, which did not change, so the replica never came back. With every replica dropped that way the
router ranked nothing, and Ray's routing loop, which asks again at once when given an empty answer, spun
the ingress's event loop at 100% CPU for ever."""

from __future__ import annotations

from .test_fleet_router_inproc import name_of, new_router, pending, replica, route_for, run


def test_replicas_dropped_by_the_ingress_are_ranked_again_while_ray_lists_them() -> None:
    async def go() -> None:
        router = new_router()
        a, b = replica("a", free=30), replica("b", free=20)
        router.update_replicas([a, b])
        route = route_for(list(range(8)))
        assert {r[0] for r in await router.choose_replicas([a, b], pending({"route": route}))} == {a, b}
        for r in (a, b):  # the ingress's reaction to a broken stream from each (the replicas are alive)
            router.view.drop(name_of(r))
        assert not router.view.replicas
        ranks = await router.choose_replicas([a, b], pending({"route": route}))
        assert ranks and {r[0] for r in ranks} == {a, b}
        assert list(router.view.replicas) == [name_of(a), name_of(b)]  # back, in Ray's order
    run(go())


def test_the_answer_is_never_empty_while_replicas_exist() -> None:
    """Even a view that knows none of the candidates (the shared view reset under the router) answers with
    every candidate, each of which decides for itself."""
    async def go() -> None:
        router = new_router()
        a = replica("a", free=30)
        router.update_replicas([a])
        route = route_for(list(range(8)))
        router.view.rank = lambda *args, **kwargs: []  # type: ignore[method-assign]
        assert await router.choose_replicas([a], pending({"route": route})) == [[a]]
    run(go())
