"""The fleet simulator: N replicas, each the real ledger + scheduler + one step loop timed by the cost
model, behind R routers that rank replicas with the live router's own code (:mod:`kvledger.placement.score`,
:mod:`kvledger.placement.view`) on views that are ``staleness_s`` old.

Two arms answer the seed's question -- can a stale metric sent to a router keep admission sound?

* **arm A** ("the router decides"): a router sends a request only where its view says it fits, and the
  replica commits whatever arrives (its door does not enforce);
* **arm B** ("placement is advice, admission is local"): the router sends to its best-ranked replica;
  the replica's door decides with its own ledger (:mod:`kvledger.placement.door`) and a refusal ("not now")
  comes back with a fresh load; the router retries the next replica (``avoid``), at most
  ``max_retries`` times, then queues the request and tries again later, and past ``max_queue`` waiting
  requests answers 429. When its view says no replica fits, the router waits for news (a reply, a
  snapshot, its retry timer) instead of sending, unless the view is older than ``probe_after_s``: the
  view only spares futile sends, it never decides.

Both arms get the same information: a periodic snapshot of every replica's load (every ``staleness_s``
seconds, phases spread over the routers; 0 means fresh at every decision) and, with ``usage_on_reply``,
a fresh load on every reply. Messages take ``transit_s`` each way, so even a fresh view misses what other
routers are sending at the same moment. Cache events reach a router with the loads.

One event loop on one virtual clock: arrivals at routers, deliveries at replicas, replica steps (each
replica's :class:`~kvledger.scheduler.driver.Driver` with :class:`CostModelExecutor`), replies, snapshots
and retry timers. A delivery that reaches a replica mid-step waits for the step's end: the door, like the
scheduler, decides between steps. An overcommitted request in arm A still cannot overcommit the simulated
engine's ledger: it waits in the replica's queue (a real engine would break its promise by preempting or
running out of memory); the overcommit is counted when it is accepted.
"""

from __future__ import annotations

import heapq
import itertools
import math
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from ..core.identity import CacheContext, prompt_digests
from ..core.types import Request
from ..errors import ConfigError, InvariantError
from ..placement.door import ACCEPTED, NEVER, AdmissionDoor, CacheEventTap, DoorAnswer
from ..placement.score import ARMS, ROUTINGS, ReplicaLoad, RouteChoice, RouteRequest, ScoreConfig, make_route_request
from ..placement.view import Placement, RouterView
from ..scheduler import GenRequest, StepOutput, StepPlan, VirtualClock, percentile
from ..scheduler.policies import ADMISSION_POLICIES
from ..scheduler.replica import Replica
from ..workloads import SimRequest
from .simulator import (
    CostModelExecutor,
    Deployment,
    SimConfig,
    build_deployment,
    prepare_workload,
    recovery_costs,
    tier_links,
)

_ARRIVE, _DELIVER, _STEP, _REPLY, _SNAPSHOT, _RETRY = range(6)


@dataclass(frozen=True)
class FleetConfig:
    """One simulated fleet (see the module docstring). ``sim`` configures every replica (model, device,
    block size, the pool per replica in ``pool_blocks``); its policy must reserve exactly (``full``)."""

    sim: SimConfig = field(default_factory=SimConfig)
    replicas: int = 4
    routers: int = 1
    staleness_s: float = 1.0
    arm: str = "B"
    routing: str = "score"
    transit_s: float = 0.001
    max_retries: int | None = None  # default: replicas - 1 (each replica once)
    retry_s: float = 0.05  # a queued request is tried again after this long (or when the router hears news)
    probe_after_s: float = 0.5  # arm B: when no replica fits by the view, send anyway once the view is this old
    # Arm B, score routing: how long (since its arrival) a request may wait for the replica with the lowest
    # cost when the view says it does not fit there yet, instead of going to the cheapest that fits now
    # (0: never wait; the cheapest that fits).
    affinity_wait_s: float = 0.0
    max_queue: int = 100_000
    usage_on_reply: bool = True
    score: ScoreConfig = field(default_factory=ScoreConfig)
    dedicated: tuple[tuple[str, tuple[int, ...]], ...] = ()  # tenant -> replica indices
    check: bool = False  # every conservation law after every acceptance and admission (tests)
    seed: int = 0

    def __post_init__(self) -> None:
        for name, lo in (("replicas", 1), ("routers", 1), ("max_queue", 0)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < lo or v > 4096 * 64:
                raise ConfigError(f"{name} must be an integer >= {lo}, got {v!r}")
        if self.replicas > 64:
            raise ConfigError(f"at most 64 replicas are simulated, got {self.replicas}")
        if self.max_retries is not None and (isinstance(self.max_retries, bool) or not isinstance(self.max_retries, int)
                                             or not 0 <= self.max_retries <= 1000):
            raise ConfigError(f"max_retries must be an integer in [0, 1000], got {self.max_retries!r}")
        for name in ("staleness_s", "transit_s", "retry_s", "probe_after_s", "affinity_wait_s"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int | float) or not (math.isfinite(v) and 0 <= v <= 86400):
                raise ConfigError(f"{name} must be a number of seconds in [0, 86400], got {v!r}")
        if self.retry_s <= 0:
            raise ConfigError("retry_s must be positive")
        if self.arm not in ARMS:
            raise ConfigError(f"arm must be one of {', '.join(ARMS)}, got {self.arm!r}")
        if self.routing not in ROUTINGS:
            raise ConfigError(f"routing must be one of {', '.join(ROUTINGS)}, got {self.routing!r}")
        if not isinstance(self.sim, SimConfig):
            raise ConfigError("sim must be a SimConfig")
        if not ADMISSION_POLICIES[self.sim.scheduler.policy].exact:
            raise ConfigError(f"fleet replicas reserve exactly (policy full); {self.sim.scheduler.policy!r} does not")
        if self.sim.declared_max_new is not None:
            raise ConfigError("the fleet simulator gives every request its trace output length (no declared_max_new)")
        for tenant, idx in self.dedicated:
            if not idx or any(not 0 <= i < self.replicas for i in idx):
                raise ConfigError(f"dedicated replicas of {tenant!r} must be indices in [0, {self.replicas})")

    @property
    def retries(self) -> int:
        return self.replicas - 1 if self.max_retries is None else self.max_retries


# ---- the pieces -------------------------------------------------------------------------------------


@dataclass(slots=True)
class _Req:
    """One request's journey through the fleet."""

    index: int
    sim: SimRequest
    router: int
    arrival_s: float
    route: RouteRequest | None = None
    gen: GenRequest | None = None
    ledger_request: Request | None = None
    attempts: int = 0  # sends in the current round
    refusals: int = 0
    avoid: list[str] = field(default_factory=list)
    queued_s: float | None = None  # waiting in its router's queue since
    queued: bool = False
    accepted_s: float | None = None
    replica: int | None = None
    done: bool = False
    rejected: str | None = None  # 429 or never


class _Router:
    def __init__(self, index: int, names: list[str], block_size: int, config: FleetConfig,
                 placement: Placement) -> None:
        self.index = index
        self.view = RouterView(block_size, config.score, seed=config.seed * 1000 + index, placement=placement)
        self.view.set_replicas(names)  # in order: the view's order breaks ties, whatever the hash salt
        self.queue: deque[_Req] = deque()
        self.rr = index  # round-robin position
        self.retry_armed = False


class _Replica:
    def __init__(self, index: int, dep: Deployment, config: FleetConfig, fleet: FleetSimulator) -> None:
        cfg = config.sim
        self.index = index
        self.name = f"r{index}"
        self.tap = CacheEventTap(maxlen=1 << 20)
        # Tiers below the device pool (host memory, disk), each replica its own, as the single simulator
        # builds them: swapped requests and, with the scheduler's offload_prefixes, demoted prefix blocks,
        # which the tap keeps publishing as the replica's (a hit there is promoted, not recomputed).
        self.replica = Replica.assemble(dep.pool_blocks, dep.spec.block_size, cfg.scheduler, eviction=cfg.eviction,
                                        prefix_caching=cfg.prefix_cache, tiers=dep.tiers(), events=self.tap,
                                        costs=recovery_costs(dep, cfg.staging_blocks))
        self.ledger, self.host, self.sched = self.replica.ledger, self.replica.tiers, self.replica.scheduler
        if self.host is not None and cfg.scheduler.offload_prefixes:
            self.tap.attach_tiers(self.host)
        links = tier_links(dep, self.host, cfg.staging_blocks)
        self.clock = VirtualClock()
        self.door = AdmissionDoor(self.ledger, enforce=config.arm == "B", clock=self.clock.now)
        executor = CostModelExecutor(dep.cost.step_time, links=links, block_bytes=dep.block_bytes,
                                     block_size=dep.spec.block_size)
        self.driver = self.replica.drive(executor, clock=self.clock, feed_window=cfg.feed_window,
                                         on_planned=self._planned, on_executed=self._executed)
        self.fleet = fleet
        self.busy = False  # a step is scheduled (deliveries wait for its end)
        self.inbox: list[_Req] = []
        self.prefill_tokens = 0
        self.use_area = 0.0  # blocks in use (held + promised) x seconds
        self.steps = 0
        self.cross_tenant_hits = 0

    # -- hooks of the driver --
    def _planned(self, plan: StepPlan, t: float) -> None:
        door, ledger = self.door, self.ledger
        for a in plan.admissions:  # all of the step's admissions are the ledger's now: unbook them first
            door.admitted(a.request_id)
        if plan.admissions and self.fleet.config.check:
            ledger.check()
            if door.enforce:
                door.check()
        for a in plan.admissions:
            seq = ledger.sequence(a.request_id)
            group = seq.context.trust_group
            pool_group = ledger.pool.group
            self.cross_tenant_hits += sum(1 for b in seq.table.blocks[: seq.hit_blocks] if pool_group[b] != group)

    def _executed(self, plan: StepPlan, output: StepOutput) -> None:
        self.steps += 1
        self.prefill_tokens += sum(w.end - w.start for w in plan.prefills)
        pool = self.ledger.pool
        self.use_area += (pool.num_active - pool.deferred + self.ledger.promised) * output.elapsed_s

    def backlog(self) -> int:
        """Prompt blocks of running requests still to prefill."""
        bs = self.ledger.block_size
        todo = 0
        for branches in self.sched.running.values():
            br = branches[0]
            left = len(br.request.prompt) - br.computed
            if left > 0:
                todo += -(-left // bs)
        return todo

    def load(self) -> ReplicaLoad:
        return self.door.load(running=len(self.sched.running), waiting=len(self.sched.waiting), backlog=self.backlog())

    def decide(self, req: _Req) -> DoorAnswer:
        assert req.ledger_request is not None
        return self.door.decide(req.ledger_request, running=len(self.sched.running),
                                waiting=len(self.sched.waiting), backlog=self.backlog())


@dataclass(slots=True)
class FleetSimResult:
    config: FleetConfig
    deployment: Deployment
    summary: dict[str, Any]
    per_replica: list[dict[str, Any]]
    wall_s: float


class FleetSimulator:
    """``FleetSimulator(config).run(requests)`` -> :class:`FleetSimResult`."""

    def __init__(self, config: FleetConfig, deployment: Deployment | None = None) -> None:
        self.config = config
        self.dep = deployment or build_deployment(config.sim)

    # ---- the run ----------------------------------------------------------------------------------
    def run(self, requests: Sequence[SimRequest], *, progress: Callable[[float, int, int], None] | None = None
            ) -> FleetSimResult:
        cfg, dep = self.config, self.dep
        wall0 = time.perf_counter()
        workload, notes = prepare_workload(requests, cfg.sim, dep.max_model_len)
        bs = dep.spec.block_size
        self.replicas = [_Replica(i, dep, cfg, self) for i in range(cfg.replicas)]
        names = [r.name for r in self.replicas]
        placement = Placement.of({t: [names[i] for i in idx] for t, idx in cfg.dedicated})
        self.routers = [_Router(k, names, bs, cfg, placement) for k in range(cfg.routers)]
        self._events: list[tuple[float, int, int, Any]] = []
        self._tie = itertools.count()
        self._contexts: dict[str, CacheContext] = {}
        self.decision_us: list[float] = []
        self.view_ages: list[float] = []
        self.reqs = [_Req(i, r, i % cfg.routers, r.arrival_s) for i, r in enumerate(workload)]
        self._index_of = {r.sim.request_id: r.index for r in self.reqs}
        self.finished_metrics: list[tuple[_Req, Any]] = []
        self.rejected = 0
        if self.reqs:
            self._push(self.reqs[0].arrival_s, _ARRIVE, 0)
        if cfg.staleness_s > 0:
            for k in range(cfg.routers):
                self._push(cfg.staleness_s * k / cfg.routers, _SNAPSHOT, k)
        total, done_count = len(self.reqs), 0
        last_report = 0
        handlers = {_ARRIVE: self._on_arrive, _DELIVER: self._on_deliver, _STEP: self._on_step,
                    _REPLY: self._on_reply, _SNAPSHOT: self._on_snapshot, _RETRY: self._on_retry}
        events = self._events
        self.now = 0.0
        while events:
            t, _, kind, payload = heapq.heappop(events)
            self.now = t
            handlers[kind](t, payload)
            if kind == _SNAPSHOT and not self._work_left():
                continue
            if progress is not None:
                done_count = len(self.finished_metrics) + self.rejected
                if done_count - last_report >= 500:
                    last_report = done_count
                    progress(t, done_count, total)
        if progress is not None:
            progress(self.now, len(self.finished_metrics) + self.rejected, total)
        return self._result(workload, notes, time.perf_counter() - wall0)

    def _push(self, t: float, kind: int, payload: Any) -> None:
        heapq.heappush(self._events, (t, next(self._tie), kind, payload))

    def _work_left(self) -> bool:
        return len(self.finished_metrics) + self.rejected < len(self.reqs)

    # ---- routers ----------------------------------------------------------------------------------
    def _on_arrive(self, t: float, index: int) -> None:
        req = self.reqs[index]
        if index + 1 < len(self.reqs):
            self._push(self.reqs[index + 1].arrival_s, _ARRIVE, index + 1)
        r = req.sim
        ctx = self._contexts.get(r.trust_group)
        sim = self.config.sim
        if ctx is None:
            ctx = self._contexts[r.trust_group] = self.dep.spec.cache_context(r.trust_group, str(sim.model))
        tokens = r.prompt_tokens.tolist()
        bs = self.dep.spec.block_size
        digests = prompt_digests(ctx.root_digest(), tokens, bs) if sim.prefix_cache else []
        req.route = make_route_request(r.request_id, r.trust_group, digests, len(tokens), r.output_len, bs, r.n)
        req.gen = GenRequest(r.request_id, tokens, r.output_len, ctx, n=r.n, priority=r.priority, arrival_s=t)
        req.ledger_request = Request(r.request_id, tokens, r.output_len, ctx, branches=r.n)
        if req.route.charge > self.dep.pool_blocks:
            # "never" is answered at the ingress, at once and without retries: no replica's pool holds it.
            req.rejected = "never"
            req.done = True
            req.gen = req.ledger_request = None
            self.rejected += 1
            return
        self._route(self.routers[req.router], req, t)

    def _route(self, router: _Router, req: _Req, t: float) -> None:
        """Choose a replica for ``req`` now, or queue it."""
        cfg = self.config
        if cfg.staleness_s == 0:
            self._refresh(router, t)
        assert req.route is not None
        if cfg.routing == "round-robin":
            choice = self._round_robin(router, req)
            matched = 0
        else:
            t0 = time.perf_counter()
            ranking = router.view.rank(req.route, t, req.avoid)
            self.decision_us.append((time.perf_counter() - t0) * 1e6)
            if cfg.arm == "A":
                ranking = [c for c in ranking if c.fits]
            elif ranking and cfg.affinity_wait_s and t - req.arrival_s < cfg.affinity_wait_s \
                    and self._worth_waiting(ranking, cfg.probe_after_s):
                ranking = []  # the cheapest replica holds more of its prefix: wait for it to free memory
            elif ranking and not ranking[0].fits and ranking[0].age_s is not None \
                    and ranking[0].age_s < cfg.probe_after_s:
                ranking = []  # a fresh view says nothing fits: wait for news instead of a futile send
            best = ranking[0] if ranking else None
            choice = best.replica if best is not None else None
            matched = best.matched if best is not None else 0
            if best is not None and best.age_s is not None:
                self.view_ages.append(best.age_s)
        if choice is None:
            self._enqueue(router, req, t)
            return
        req.attempts += 1
        router.view.routed(req.route, choice, matched)
        self._push(t + cfg.transit_s, _DELIVER, (req, int(choice[1:])))

    @staticmethod
    def _worth_waiting(ranking: list[RouteChoice], fresh_s: float) -> bool:
        """Whether the replica with the lowest cost (ties: the ranking's order, fitting ones first) does not
        fit by a view younger than ``fresh_s``: then waiting for it saves more prefill than the cheapest
        replica that fits now would."""
        cheapest = min(ranking, key=lambda c: c.cost)
        return not cheapest.fits and cheapest.age_s is not None and cheapest.age_s < fresh_s

    def _round_robin(self, router: _Router, req: _Req) -> str | None:
        names = router.view.candidates(req.sim.trust_group, req.avoid)
        if not names:
            return None
        if self.config.arm == "A":
            names = [n for n in names if (router.view.available(n) is None
                                          or router.view.available(n) >= req.route.charge)]  # type: ignore[union-attr]
            if not names:
                return None
        router.rr += 1
        return names[router.rr % len(names)]

    def _enqueue(self, router: _Router, req: _Req, t: float) -> None:
        if not req.queued:
            if len(router.queue) >= self.config.max_queue:
                req.rejected = "429"
                req.done = True
                self.rejected += 1
                return
            req.queued = True
            if req.queued_s is None:
                req.queued_s = t
            router.queue.append(req)
        self._arm_retry(router, t)

    def _arm_retry(self, router: _Router, t: float) -> None:
        if not router.retry_armed and router.queue:
            router.retry_armed = True
            self._push(t + self.config.retry_s, _RETRY, router.index)

    def _on_retry(self, t: float, k: int) -> None:
        router = self.routers[k]
        router.retry_armed = False
        self._drain_queue(router, t)

    def _drain_queue(self, router: _Router, t: float) -> None:
        """Try the queued requests again, oldest first, each from a fresh round of replicas."""
        pending, router.queue = router.queue, deque()
        for req in pending:
            req.queued = False
            req.avoid.clear()
            req.attempts = 0
            self._route(router, req, t)
        self._arm_retry(router, t)

    def _refresh(self, router: _Router, t: float) -> None:
        view = router.view
        for rep in self.replicas:
            self._feed(view, rep, rep.load(), rep.tap.seq, t)

    def _feed(self, view: RouterView, rep: _Replica, load: ReplicaLoad | None, events_upto: int, t: float) -> None:
        if load is not None:
            view.update_load(rep.name, load, t)
        state = view.replicas.get(rep.name)
        if state is not None and events_upto > state.events_seq:
            events, nxt, complete = rep.tap.since(state.events_seq, events_upto)
            if not complete:
                view.resync(rep.name)
            view.apply_events(rep.name, events, nxt)

    def _on_snapshot(self, t: float, k: int) -> None:
        if not self._work_left():
            return
        router = self.routers[k]
        self._refresh(router, t)
        self._push(t + self.config.staleness_s, _SNAPSHOT, k)
        if router.queue and self.config.arm == "A":
            self._drain_queue(router, t)

    def _on_reply(self, t: float, payload: tuple) -> None:
        kind, req, rep_index, seq, load, events_upto = payload
        router = self.routers[req.router]
        rep = self.replicas[rep_index]
        view = router.view
        if kind == ACCEPTED:
            view.accepted(req.sim.request_id, rep.name, seq, load, t)
        elif kind == "finished":
            view.finished(req.sim.request_id, rep.name, seq, load, t)
        else:
            view.refused(req.sim.request_id, rep.name, load, t)
        self._feed(view, rep, None, events_upto, t)
        if kind == "refused":
            req.refusals += 1
            req.avoid.append(rep.name)
            if req.attempts > self.config.retries:
                self._enqueue(router, req, t)
            else:
                self._route(router, req, t)
        elif kind == "finished" and router.queue:
            self._drain_queue(router, t)  # memory came free somewhere: try the queued ones now

    # ---- replicas ---------------------------------------------------------------------------------
    def _on_deliver(self, t: float, payload: tuple[_Req, int]) -> None:
        req, j = payload
        rep = self.replicas[j]
        if rep.busy:
            rep.inbox.append(req)
            return
        rep.clock.wait_until(t)
        self._door(rep, req, t)
        if rep.driver.has_work():
            rep.busy = True
            self._push(t, _STEP, j)

    def _door(self, rep: _Replica, req: _Req, t: float) -> None:
        answer = rep.decide(req)
        cfg = self.config
        if answer.accepted:
            req.accepted_s = t
            req.replica = rep.index
            assert req.gen is not None
            rep.driver.submit(replace(req.gen, arrival_s=t))
            if cfg.check:
                rep.ledger.check()
                if rep.door.enforce:
                    rep.door.check()
            kind = ACCEPTED
        elif answer.outcome == NEVER:
            req.rejected = "never"
            req.done = True
            self.rejected += 1
            kind = NEVER
        else:
            kind = "refused"
        load = answer.load if cfg.usage_on_reply or kind == "refused" else None
        if kind != NEVER:
            self._push(t + cfg.transit_s, _REPLY, (kind, req, rep.index, answer.seq, load, rep.tap.seq))

    def _on_step(self, t: float, j: int) -> None:
        rep = self.replicas[j]
        rep.clock.wait_until(t)
        if rep.inbox:
            inbox, rep.inbox = rep.inbox, []
            for req in inbox:
                self._door(rep, req, t)
        if not rep.driver.has_work():
            rep.busy = False
            return
        result = rep.driver.step()
        end = rep.clock.now()
        cfg = self.config
        for f in result.finished:
            rid = f.request.request_id
            seq = rep.door.finished(rid)
            req = self._by_id(rid)
            req.done = True
            req.gen = req.ledger_request = None  # the prompt's token lists are not needed any more
            self.finished_metrics.append((req, f.metrics))
            load = rep.load() if cfg.usage_on_reply else None
            self._push(end + cfg.transit_s, _REPLY, ("finished", req, j, seq, load, rep.tap.seq))
        if rep.driver.has_work() or rep.inbox:
            self._push(end, _STEP, j)
        else:
            rep.busy = False

    def _ttft_parts(self, recs: list[tuple[_Req, Any]]) -> dict[str, float | None]:
        """Where the mean TTFT goes, for requests that got a first token: ``ttft_routing_mean_s`` from
        arrival to a replica's acceptance (refusals, retries, the router's queue), ``ttft_replica_wait_mean_s``
        from acceptance to the replica's scheduler admitting it (its door's book), ``ttft_prefill_mean_s``
        from admission to the first token (its prefill, chunked and sharing steps with everyone else's
        work). ``ttft_alone_mean_s`` is the floor: the uncached part of each prompt computed as one step on
        an idle replica (the cost model's ``recompute_time``); prefill minus alone is time lost to the
        other requests on the same replica."""
        cost = self.dep.cost
        routing = wait = prefill = alone = 0.0
        n = 0
        for req, m in recs:
            if m.first_token_s is None:  # the same requests as the summary's TTFT, so the parts add up to it
                continue
            assert req.accepted_s is not None and m.admitted_s is not None  # a first token needs both
            n += 1
            routing += req.accepted_s - req.arrival_s
            wait += m.admitted_s - req.accepted_s
            prefill += m.first_token_s - m.admitted_s
            alone += cost.recompute_time(m.prompt_len - m.hit_tokens, m.hit_tokens)
        keys = ("ttft_routing_mean_s", "ttft_replica_wait_mean_s", "ttft_prefill_mean_s", "ttft_alone_mean_s")
        if not n:
            return dict.fromkeys(keys)
        return dict(zip(keys, (routing / n, wait / n, prefill / n, alone / n), strict=True))

    def _by_id(self, rid: str) -> _Req:
        return self.reqs[self._index_of[rid]]

    # ---- results ----------------------------------------------------------------------------------
    def _result(self, workload: Sequence[SimRequest], notes: list[str], wall_s: float) -> FleetSimResult:
        cfg = self.config
        recs = self.finished_metrics
        end = max((m.finish_s for _, m in recs if m.finish_s is not None), default=0.0)
        ttft = [m.first_token_s - req.arrival_s for req, m in recs if m.first_token_s is not None]
        prompt = sum(m.prompt_len for _, m in recs)
        hits = sum(m.hit_tokens for _, m in recs)
        refusals = sum(req.refusals for req in self.reqs)
        deferred = [req.accepted_s - req.arrival_s for req in self.reqs
                    if req.accepted_s is not None and (req.refusals or req.queued_s is not None)]
        waits = [req.accepted_s - req.arrival_s for req in self.reqs if req.accepted_s is not None]
        prefill = [rep.prefill_tokens for rep in self.replicas]
        parts = self._ttft_parts(recs)
        per_replica = []
        for rep in self.replicas:
            c = rep.door.counters()
            per_replica.append({"replica": rep.name, "prefill_tokens": rep.prefill_tokens, "steps": rep.steps,
                                "requests": c["accepted"], "refusals": c["refused"], "overcommits": c["overcommits"],
                                "max_overshoot": c["max_overshoot"], "pool_blocks": rep.ledger.num_blocks,
                                "mean_use": rep.use_area / end / rep.ledger.num_blocks if end else 0.0,
                                "cross_tenant_hit_blocks": rep.cross_tenant_hits,
                                "promoted_tokens": rep.sched.promoted_tokens,
                                "tier_blocks": rep.host.num_blocks if rep.host is not None else 0})
            if cfg.check:
                rep.sched.check()
                if rep.door.enforce:
                    rep.door.check()
        n = len(self.reqs)

        def p_or_none(samples: list[float], q: float) -> float | None:  # the scheduler's percentile
            return percentile(samples, q) if samples else None

        completed = sum(1 for _, m in recs if m.completed)
        summary = {
            "replicas": cfg.replicas, "routers": cfg.routers, "staleness_s": cfg.staleness_s, "arm": cfg.arm,
            "routing": cfg.routing, "pool_blocks": self.dep.pool_blocks, "block_size": self.dep.spec.block_size,
            "requests": n, "completed": completed, "rejected": self.rejected,
            "rejected_429": sum(1 for r in self.reqs if r.rejected == "429"),
            "overcommits": sum(p["overcommits"] for p in per_replica),
            "max_overshoot": max((p["max_overshoot"] for p in per_replica), default=0),
            "refusals": refusals, "refusals_per_request": refusals / n if n else 0.0,
            "deferred_requests": len(deferred),
            "deferral_p50_s": p_or_none(deferred, 50), "deferral_p99_s": p_or_none(deferred, 99),
            "deferral_max_s": max(deferred, default=None),
            "accept_wait_p99_s": p_or_none(waits, 99),
            "prompt_tokens": prompt, "hit_tokens": hits, "hit_rate": hits / prompt if prompt else 0.0,
            "ttft_mean_s": sum(ttft) / len(ttft) if ttft else None,
            "ttft_p50_s": p_or_none(ttft, 50), "ttft_p90_s": p_or_none(ttft, 90), "ttft_p99_s": p_or_none(ttft, 99),
            **parts,
            "max_prefill_share": max(prefill) / sum(prefill) if sum(prefill) else 0.0,
            "mean_use": sum(p["mean_use"] for p in per_replica) / len(per_replica),
            "view_age_mean_s": sum(self.view_ages) / len(self.view_ages) if self.view_ages else None,
            "view_age_p99_s": p_or_none(self.view_ages, 99),
            "decision_us_p50": p_or_none(self.decision_us, 50), "decision_us_p99": p_or_none(self.decision_us, 99),
            "cross_tenant_hit_blocks": sum(p["cross_tenant_hit_blocks"] for p in per_replica),
            "promoted_tokens": sum(p["promoted_tokens"] for p in per_replica),
            "sim_duration_s": end, "notes": notes,
        }
        if len(recs) + self.rejected < n:
            raise InvariantError(f"{n - len(recs) - self.rejected} requests never finished: a fleet simulator bug")
        return FleetSimResult(cfg, self.dep, summary, per_replica, wall_s)


def simulate_fleet(requests: Sequence[SimRequest], config: FleetConfig) -> FleetSimResult:
    return FleetSimulator(config).run(requests)


__all__ = ["ARMS", "ROUTINGS", "FleetConfig", "FleetSimResult", "FleetSimulator", "simulate_fleet"]
