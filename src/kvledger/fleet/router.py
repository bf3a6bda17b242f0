"""kvledger's Ray Serve request router: the fleet's :class:`~kvledger.placement.view.RouterView` behind Ray's
``RequestRouter`` API (``ray.serve.request_router``, alpha in Ray 2.60).

Ray builds one router per deployment handle, inside the calling process (each ingress replica has its
own), and asks it to rank replicas for every call. This one:

* ranks with :meth:`RouterView.rank` -- the fleet's one cost function -- and returns one replica per rank,
  best first, so Ray's ranked fallback is kvledger's (a replica that died is skipped for the next);
* reads each replica's published load from Ray's routing stats (``record_routing_stats``, every
  ``request_routing_stats_period_s``) and from every reply the ingress feeds back, each stamped with its
  age; cache events come with the replies;
* never makes a blocking call on the routing path: Ray's default picks among candidates by probing their
  queue lengths with an actor call; here the first live replica of a rank is taken as is (the replica's
  ledger is what decides, not a queue length);
* honours ``avoid`` (replicas that just refused the request) and ``target`` (an operator call meant for
  one replica) in the call's first argument, a dict built by :mod:`kvledger.fleet.serve`; it never
  answers with an empty ranking while replicas exist (Ray would ask again at once, in a tight loop).

The router and the ingress code of one process share the view through
:func:`kvledger.placement.view.shared_view` (Ray constructs the router itself, from ``request_router_kwargs``,
so it cannot be handed a live object; and Ray ships this module by value, so the registry lives there).
"""

from __future__ import annotations

import time
from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from ..errors import ConfigError
from ..placement.score import ReplicaLoad, ScoreConfig
from ..placement.view import shared_view


def replica_key(replica_id: ReplicaID) -> str:
    return replica_id.to_full_id_str()


class LedgerRequestRouter(RequestRouter):
    """See the module docstring. Configure with ``request_router_kwargs``: ``view_key``, ``block_size``,
    ``min_match_tokens``, ``queue_weight``, ``decode_weight``, ``seed``."""

    def initialize_state(self, view_key: str = "kvledger", block_size: int = 16, min_match_tokens: int = 1024,
                         queue_weight: float = 0.1, decode_weight: float = 1.0, seed: int | None = None,
                         **_: Any) -> None:
        score = ScoreConfig(min_match_tokens=min_match_tokens, queue_weight=queue_weight, decode_weight=decode_weight)
        self.view = shared_view(view_key, block_size=block_size, score=score, seed=seed)
        self._known: frozenset[str] = frozenset()
        self._matched: dict[str, dict[str, int]] = {}
        self.decisions = 0

    # ---- Ray's hooks ------------------------------------------------------------------------------
    def _sync(self, candidates: list[RunningReplica]) -> None:
        names = frozenset(replica_key(r.replica_id) for r in candidates)
        # Ray's list is the membership. The ingress drops a replica from the (shared) view when a call to it
        # fails; while Ray still lists it, it comes back here, or a view emptied that way would rank nothing
        # and Ray's routing loop would ask again at once, for ever.
        if names != self._known or not names <= self.view.replicas.keys():
            self.view.set_replicas(replica_key(r.replica_id) for r in candidates)
            self._known = names
        now = time.time()
        for r in candidates:
            stats = r.routing_stats or {}
            load = stats.get("load")
            if load:
                try:
                    self.view.update_load(replica_key(r.replica_id), ReplicaLoad.from_dict(load), now)
                except ConfigError:
                    pass  # a malformed stat is no advice: the replica still decides

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        # Ray tells every router of a membership change: the view learns it before the next request.
        super().update_replicas(replicas)
        names = frozenset(replica_key(r.replica_id) for r in replicas)
        if names != self._known:
            self.view.set_replicas(names)
            self._known = names

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        self._sync(candidate_replicas)
        by_name = {replica_key(r.replica_id): r for r in candidate_replicas}
        job = pending_request.args[0] if pending_request is not None and pending_request.args else None
        if not isinstance(job, dict):
            return [[r] for r in candidate_replicas]
        target = job.get("target")
        if target is not None:
            if target in by_name:
                return [[by_name[target]]]
            # The replica is gone. An empty answer would make Ray ask again at once, forever (no backoff
            # between rounds): send the call to any replica instead, which refuses a call not meant for it.
            return [[r] for r in candidate_replicas]
        route = job.get("route")
        if route is None:
            return [[r] for r in candidate_replicas]
        ranking = self.view.rank(route, time.time(), job.get("avoid") or ())
        if not ranking:  # every replica the view knows is to be avoided: an empty rank would wait forever
            ranking = self.view.rank(route, time.time())
        self.decisions += 1
        self._matched[route.request_id] = {c.replica: c.matched for c in ranking}
        ranks = [[by_name[c.replica]] for c in ranking if c.replica in by_name]
        # Never an empty answer while replicas exist (Ray would ask again at once, with no backoff): any
        # replica decides for itself.
        return ranks or [[r] for r in candidate_replicas]

    async def _select_from_candidate_replicas(self, candidates: list[RunningReplica],
                                              backoff_index: int) -> RunningReplica | None:
        # Ray's default probes queue lengths here (an actor call on the routing path). The rank is ours:
        # take its replica if it is still there.
        for r in candidates:
            live = self._replicas.get(r.replica_id)
            if live is not None:
                return live
        return None

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        job = pending_request.args[0] if pending_request.args else None
        if not isinstance(job, dict) or job.get("route") is None:
            return
        route = job["route"]
        name = replica_key(replica_id)
        matched = self._matched.pop(route.request_id, {}).get(name, 0)
        self.view.routed(route, name, matched)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.view.drop(replica_key(replica_id))
        self._known = self._known - {replica_key(replica_id)}


__all__ = ["LedgerRequestRouter", "replica_key"]
