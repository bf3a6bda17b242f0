"""The live fleet on Ray Serve: engine replicas, each with its own ledger and admission door, behind the
OpenAI-compatible server of :mod:`kvledger.server` running as the ingress deployment.

* :class:`EngineReplica` -- one engine (ledger + scheduler + torch runtime, its own pool) per Ray Serve
  replica. ``generate`` streams: first the door's answer (``accepted``, or ``not_now`` / ``never`` with a
  fresh load and nothing held), then the tokens, then the result. ``max_ongoing_requests`` is set far above
  what any pool holds, so Ray never turns a request away before the ledger has decided.
* :class:`FleetBackend` -- the server's :class:`~kvledger.server.backend.Backend` over the replicas: it
  answers "never" itself (larger than a replica's pool, longer than the model), computes the request's
  block digests with the tenant's context (as the replicas' ledgers do), and sends it through the
  deployment handle, whose :class:`~kvledger.fleet.router.LedgerRequestRouter` ranks the replicas. A
  refusal comes back with a fresh load; the backend retries with ``avoid=[replica]`` up to ``retries``
  times; when every replica has said "not now" it waits for news of room (a finished request, or a
  replica's cache events and load, which each ingress polls every ``news_period_s`` in the background,
  never on the routing path), at most four news periods, and starts a new round. A waiting request counts
  against the server's queue bound, which answers 429 past ``max_queue``. A replica that dies mid-request
  is avoided and the request resubmitted with the same seed: tokens already streamed are not sent twice.
* :func:`fleet_app` -- the application: ``engine`` and ``ingress`` deployments, ready for ``serve.run``.

Tenants: the trust group is the authenticated tenant's (``kvledger.server.tenants``), never the body's; it
salts every digest, so one tenant's prefix never scores as affinity for another, and the replicas'
routing stats are tenant-free aggregates (:class:`~kvledger.placement.score.ReplicaLoad`).

The module runs past 600 lines because it holds every Ray face of the fleet in one place (the loopback
setup, the engine replica, the ingress backend, the application); the Ray-free placement logic (score,
view, door) is :mod:`kvledger.placement`, and moving the four faces into modules of their own is planned.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request as HttpRequest
from ray import serve
from ray.serve.config import RequestRouterConfig

from ..core.identity import CacheContext, prompt_digests
from ..core.promises import largest_allowance
from ..core.sizing.geometry import KVSpec
from ..core.types import Request
from ..errors import AdmissionError, ConfigError, QuotaError
from ..placement.door import ACCEPTED, NEVER, AdmissionDoor, CacheEventTap
from ..placement.score import ReplicaLoad, make_route_request, request_blocks
from ..placement.view import RouterView, shared_view
from ..scheduler.intake import check_request_shape
from .ray_start import start_ray
from .spec import FleetSpec

ROUTER_CLASS = "kvledger.fleet.router:LedgerRequestRouter"
MAX_ONGOING = 4096  # far above any pool's requests: the ledger decides, not Ray's request cap


def local_ray(num_cpus: int | None = None, *, start_attempts: int = 2, **kwargs: Any) -> Any:
    """Start a local Ray for the fleet that listens on 127.0.0.1 only, and prove it: Ray must have been
    imported with ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` (``import kvledger.fleet`` sets it; without it Ray
    takes the machine's private address and listens on every interface), the node's address is loopback,
    there is no dashboard and no usage report. After ``ray.init`` every listening socket of the Ray
    processes it started is checked; any beyond loopback shuts Ray down again and raises
    :class:`~kvledger.errors.ConfigError`. The engine and ingress replicas also keep Serve's
    inter-deployment gRPC server on loopback (:func:`serve_on_loopback`). A start that times out (a busy
    machine) is tried up to ``start_attempts`` times; a failed start is one ConfigError line
    (:func:`~kvledger.fleet.ray_start.start_ray`). Stop it with ``ray.shutdown()``."""
    import os

    import ray

    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    options: dict[str, Any] = {"include_dashboard": False, "_node_ip_address": "127.0.0.1"}
    if num_cpus is not None:
        options["num_cpus"] = num_cpus
    options.update(kwargs)
    context = start_ray(lambda: ray.init(**options), ray.shutdown, start_attempts)
    outside = [x for x in ray_listeners() if not is_loopback(x[0])]
    if outside:
        ray.shutdown()
        raise ConfigError(f"Ray listens beyond 127.0.0.1 ({outside[:3]}): import kvledger.fleet before ray, or "
                          "set RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 before Ray is imported")
    return context


def is_loopback(ip: str) -> bool:
    return ip in ("127.0.0.1", "::1", "::ffff:127.0.0.1")


def ray_listeners() -> list[tuple[str, int, str]]:
    """``(address, port, process name)`` of every listening TCP socket of the Ray processes this process
    started (GCS, raylet, agents, workers), and of this process."""
    import psutil

    me = psutil.Process()
    procs = {me.pid: me}
    for p in me.children(recursive=True):
        try:
            if "ray" in " ".join(p.cmdline()).lower():
                procs[p.pid] = p
        except psutil.Error:
            continue
    out = []
    for c in psutil.net_connections(kind="tcp"):
        if c.status == psutil.CONN_LISTEN and c.pid in procs:
            try:
                name = procs[c.pid].name()
            except psutil.Error:
                name = "?"
            out.append((c.laddr.ip, c.laddr.port, name))
    return out


def serve_on_loopback() -> None:
    """Ray Serve 2.60 binds each replica's inter-deployment gRPC server to ``[::]:0`` -- every interface --
    with no option to change it. Called in a replica's constructor (which Ray runs before it starts that
    server), this rebinds it to 127.0.0.1: callers reach it at the node's address, loopback here."""
    from ray.serve._private import replica

    bind = replica.add_port_to_grpc_server
    if getattr(bind, "kvledger_loopback", False):
        return

    def loopback(server: Any, address: str) -> int:
        host, _, port = address.rpartition(":")
        if host in ("[::]", "0.0.0.0", ""):
            address = f"127.0.0.1:{port}"
        return bind(server, address)

    loopback.kvledger_loopback = True  # type: ignore[attr-defined]
    replica.add_port_to_grpc_server = loopback


def _branches(sampling: Any) -> int:
    """Sequences a request runs at once: its beam width, or n."""
    return sampling.beam_width if getattr(sampling, "beam", False) else (getattr(sampling, "n", 1) or 1)


async def _ask(call: Any, timeout: float) -> Any:
    """Await one replica call for at most ``timeout`` seconds (``TimeoutError`` past it). Cancelled, it
    cancels the call and returns at once: a call still being routed when the ingress stops (Ray's router
    may be waiting for a replica) must not hold the stop until it unwinds."""
    task = asyncio.ensure_future(call)
    try:
        done, _ = await asyncio.wait({task}, timeout=timeout)
    except asyncio.CancelledError:
        task.cancel()
        raise
    if not done:
        task.cancel()
        raise TimeoutError(f"no answer within {timeout:g} s")
    return task.result()


def _replica_name() -> str:
    return serve.get_replica_context().replica_id.to_full_id_str()


# ---- the engine replica -----------------------------------------------------------------------------


class EngineReplica:
    """One engine with its own pool; see the module docstring."""

    def __init__(self, spec: FleetSpec, quotas: dict[str, int] | None = None) -> None:
        import torch

        from ..runtime.engine import Engine

        serve_on_loopback()
        torch.set_num_threads(spec.torch_threads)
        self.spec = spec
        self.engine = Engine.from_config(spec.engine_config())
        ledger = self.engine.ledger
        # Cache events for the routers: the ledger's event sink (and the host tier's), set before any
        # request is admitted.
        self.tap = CacheEventTap()
        ledger.events = self.tap
        ledger.pool.on_event = self.tap.emit
        if spec.host_blocks:
            self.tap.attach_tiers(self.engine.scheduler.host)
        self.door = AdmissionDoor(ledger, clock=time.time)
        for group, blocks in (quotas or {}).items():  # a tenant's max_blocks caps it in every replica
            self.engine.set_quota(group, blocks)
        self.engine.step_observers.append(self._observe)
        self.engine.start()
        self.name = _replica_name()
        self.finished = 0

    def _observe(self, result: Any) -> None:
        plan = result.plan
        if plan is not None:
            for rid in plan.admitted:
                self.door.admitted(rid)

    def _load(self) -> ReplicaLoad:
        sched = self.engine.scheduler
        return self.door.load(running=len(sched.running), waiting=len(sched.waiting))

    def _events(self, since: dict[str, int] | None) -> dict[str, Any]:
        seq = (since or {}).get(self.name, 0)
        events, nxt, complete = self.tap.since(seq, limit=8192)
        return {"events": events, "events_next": nxt, "events_complete": complete}

    def record_routing_stats(self) -> dict[str, Any]:
        """Ray Serve polls this every ``request_routing_stats_period_s``: tenant-free aggregates only."""
        return {"load": self._load().to_dict()}

    async def generate(self, job: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        from ..runtime.sampling import SamplingParams

        engine = self.engine
        rid = job["request_id"]
        sampling = SamplingParams(**job["sampling"])
        try:
            prompt, max_new, context = engine.check_request(job["prompt"], job["max_tokens"], sampling,
                                                            trust_group=job["trust_group"], request_id=rid,
                                                            cache_salt=job.get("cache_salt"))
        except (AdmissionError, ConfigError) as exc:
            yield {"type": NEVER, "replica": self.name, "reason": str(exc), "load": self._load().to_dict(),
                   "seq": self.door.seq}
            return
        sched = engine.scheduler
        answer = self.door.decide(Request(rid, prompt, max_new, context, branches=_branches(sampling)),
                                  running=len(sched.running), waiting=len(sched.waiting))
        if not answer.accepted:
            yield {"type": answer.outcome, "replica": self.name, "reason": answer.reason,
                   "load": answer.load.to_dict(), "seq": answer.seq, **self._events(job.get("events_since"))}
            return
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[Any] = asyncio.Queue()

        def on_token(event: Any) -> None:  # the engine's thread
            try:
                loop.call_soon_threadsafe(queue.put_nowait, event)
            except RuntimeError:
                pass

        try:
            handle = engine.submit(prompt, max_new, sampling, stop_token_ids=job["stop_token_ids"],
                                   trust_group=job["trust_group"], priority=job.get("priority", 0), request_id=rid,
                                   on_token=on_token, cache_salt=job.get("cache_salt"))
        except (AdmissionError, ConfigError) as exc:
            # The engine's own refusal (a request id it has seen): an answer, not a failure of this replica,
            # or the ingress would blame the replica and retry the same refusal for ever.
            self.door.finished(rid)
            yield {"type": NEVER, "replica": self.name, "reason": str(exc), "load": self._load().to_dict(),
                   "seq": self.door.seq}
            return
        except Exception:
            self.door.finished(rid)
            raise
        yield {"type": ACCEPTED, "replica": self.name, "load": answer.load.to_dict(), "seq": answer.seq,
               "overshoot": answer.overshoot}
        done = False
        try:
            while True:
                event = await queue.get()
                if event.finished:
                    break
                msg = {"type": "token", "branch": event.branch, "token": event.token}
                if event.logprobs is not None or event.prompt_logprobs is not None:  # asked for: they travel too
                    msg.update(logprobs=event.logprobs, prompt_logprobs=event.prompt_logprobs)
                yield msg
            while not handle.done():
                await asyncio.sleep(0.001)
            result = handle.result()
            done = True
            seq = self.door.finished(rid)
            self.finished += 1
            yield {"type": "finished", "replica": self.name, "finish_reasons": list(result.finish_reasons),
                   "cached_prompt_tokens": result.cached_prompt_tokens, "seq": seq, "load": self._load().to_dict(),
                   **self._events(job.get("events_since"))}
        finally:
            if not done:  # the caller went away (or this replica is shutting down)
                engine.cancel(rid)
                self.door.finished(rid)

    async def news(self, job: dict[str, Any] | None = None) -> dict[str, Any]:
        """Cache events since ``job["since"]`` and a fresh load: what an ingress polls in the background
        (never on the routing path) to learn where the other ingresses' requests went."""
        self._meant_for_me(job)
        since = (job or {}).get("since", 0)
        return {"replica": self.name, "load": self._load().to_dict(), **self._events({self.name: since})}

    def _meant_for_me(self, job: dict[str, Any] | None) -> None:
        target = (job or {}).get("target")
        if target is not None and target != self.name:
            raise ConfigError(f"a call meant for replica {target!r} reached {self.name!r} (it is gone)")

    async def audit(self, job: dict[str, Any] | None = None) -> dict[str, Any]:
        """Every conservation law of this replica (ledger, scheduler, door) and its counters."""
        self._meant_for_me(job)
        self.engine.check()
        self.door.check()
        u = self.engine.ledger.usage()
        return {"replica": self.name, "door": self.door.counters(), "finished": self.finished,
                "usage": u.as_dict(), "hit_tokens": self.engine.ledger.stats()["prefix_cache"]["hit_tokens"]}

    async def pid(self, _job: dict[str, Any] | None = None) -> dict[str, Any]:
        import os

        return {"replica": self.name, "pid": os.getpid()}


# ---- the ingress backend ----------------------------------------------------------------------------


@dataclass(slots=True)
class FleetTokenEvent:
    request_id: str
    branch: int
    token: int | None
    position: int
    time_s: float
    finished: bool = False
    finish_reason: str | None = None
    logprobs: Any = None  # the replica's TokenLogprobs, when the request asked for them
    prompt_logprobs: Any = None


@dataclass(slots=True)
class FleetResult:
    request_id: str
    finish_reasons: list[str]
    cached_prompt_tokens: int = 0
    replica: str | None = None
    refusals: int = 0
    attempts: int = 0


@dataclass(slots=True)
class FleetHandle:
    request_id: str
    task: asyncio.Task[Any] | None = None
    _result: FleetResult | None = None
    refusals: list[str] = field(default_factory=list)

    def done(self) -> bool:
        return self._result is not None

    def result(self, timeout: float | None = None) -> FleetResult:
        if self._result is None:
            raise RuntimeError(f"request {self.request_id!r} has not finished")
        return self._result


class FleetBackend:
    """The server's Backend over the engine deployment (see the module docstring). Runs on the ingress
    replica's event loop."""

    def __init__(self, handle: Any, spec: FleetSpec, *, vocab_size: int, max_context: int | None,
                 kv_spec: KVSpec) -> None:
        self.handle = handle
        self.spec = spec
        self.model_name = spec.model
        self.block_size = spec.block_size
        self.pool_blocks = spec.pool_blocks
        self.max_context = max_context
        self.vocab_size = vocab_size
        self.max_num_seqs = spec.max_running
        self.kv_spec = kv_spec  # the engines' KV spec: requests' cache identities are built from it, as theirs
        self.error: BaseException | None = None
        self.view: RouterView = shared_view(spec.view_key, block_size=spec.block_size, score=spec.score())
        self.retries = spec.engine_replicas - 1 if spec.retries is None else spec.retries
        self._handles: dict[str, FleetHandle] = {}
        self._contexts: dict[tuple[str, str | None], CacheContext] = {}
        self.quotas: dict[str, int] = {}
        self.running = 0  # requests a replica accepted and has not finished
        self.counters = {"refusals": 0, "retries": 0, "replica_failures": 0, "accepted": 0, "overcommits": 0,
                         "news": 0, "waits": 0}
        self._news: asyncio.Task[Any] | None = None
        self._changed: asyncio.Event | None = None  # set (and replaced) whenever the view hears news
        self._line = asyncio.Lock()  # the waiting line of requests every replica has refused once
        self.ensure_news()

    def _heard(self) -> None:
        if self._changed is not None:
            self._changed.set()
            self._changed = None

    async def _wait_for_room(self, route: Any, budget_s: float) -> None:
        """Every replica said "not now": wait until the view says some replica has room for ``route`` (a
        request finished, or a replica's news came), at most ``budget_s``. The view only spares futile
        sends; the replica still decides."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + budget_s
        while True:
            names = self.view.candidates(route.trust_group)
            if any((self.view.available(n) or 0) >= route.charge for n in names):
                return
            left = deadline - loop.time()
            if left <= 0:
                return
            if self._changed is None:
                self._changed = asyncio.Event()
            try:
                await asyncio.wait_for(self._changed.wait(), timeout=left)
            except TimeoutError:
                return

    # ---- news from the replicas, in the background ------------------------------------------------
    def ensure_news(self) -> None:
        """Start the background task that polls every replica's cache events and load (once, on this
        ingress's event loop; a no-op outside one)."""
        if self._news is not None and not self._news.done():
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        self._news = loop.create_task(self._poll_news())

    async def _poll_news(self) -> None:
        period = self.spec.news_period_s
        while True:
            try:
                if not self.view.replicas:
                    # This ingress has not routed yet: one untargeted call makes Ray build its router here,
                    # which tells the view who the replicas are.
                    await _ask(self.handle.pid.remote(None), 30)
                for name, seq in list(self.view.event_positions().items()):
                    try:
                        msg = await _ask(self.handle.news.remote({"target": name, "since": seq}),
                                         max(1.0, 10 * period))
                    except asyncio.CancelledError:
                        raise
                    except Exception:  # noqa: BLE001 -- a replica that is gone or busy: news later
                        continue
                    self._events(name, msg)
                    self.view.update_load(name, ReplicaLoad.from_dict(msg["load"]), time.time())
                    self.counters["news"] += 1
                    self._heard()
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 -- news is advice: never let it take the ingress down
                pass
            await asyncio.sleep(period)

    def _context(self, trust_group: str, cache_salt: str | None) -> CacheContext:
        # As the replicas' engines build it (Engine.check_request): router and ledger digests agree.
        key = (trust_group, cache_salt)
        ctx = self._contexts.get(key)
        if ctx is None:
            ctx = self._contexts[key] = self.kv_spec.cache_context(trust_group, self.model_name, cache_salt)
        return ctx

    def set_quota(self, trust_group: str, max_blocks: int | None) -> None:
        """A tenant's block cap: every replica applies it to its own ledger (``fleet_app`` hands the
        tenants' caps to the engine replicas); here it answers "never" for a request larger than it."""
        if max_blocks is None:
            self.quotas.pop(trust_group, None)
        else:
            self.quotas[trust_group] = max_blocks

    def check_request(self, prompt: Sequence[int], max_new_tokens: int, sampling: Any = None, *,
                      trust_group: str = "default", request_id: str = "check",
                      cache_salt: str | None = None) -> tuple[list[int], int, Any]:
        """The ingress's own "never": answered here, at once, without asking (or retrying) any replica."""
        n = _branches(sampling) if sampling is not None else 1
        ids, max_new_tokens = check_request_shape(
            prompt, max_new_tokens, vocab_size=self.vocab_size, max_context=self.max_context, branches=n,
            max_running=self.max_num_seqs, beam=bool(getattr(sampling, "beam", False)), trust_group=trust_group,
            cache_salt=cache_salt, request_id=request_id)
        _, _, charge = request_blocks(len(ids), max_new_tokens, self.block_size, n)
        if charge > self.pool_blocks:
            raise AdmissionError(f"the KV pool of a replica is too small for this request: it needs {charge} "
                                 f"blocks and a replica has {self.pool_blocks}")
        quota = self.quotas.get(trust_group)
        if quota is not None and charge > quota:
            raise QuotaError(f"this request is larger than its trust group's quota: it needs {charge} blocks and "
                             f"the quota is {quota}")
        return ids, max_new_tokens, self._context(trust_group, cache_salt)

    def largest_allowance(self, prompt: Sequence[int], sampling: Any = None, *, trust_group: str = "default",
                          cache_salt: str | None = None) -> int:
        """The largest ``max_new_tokens`` :meth:`check_request` accepts: what the context leaves, cut by a
        replica's pool and the tenant's cap (the ledger's own arithmetic). Raises as :meth:`check_request`
        does when not even one token could run."""
        ids, _, _ = self.check_request(prompt, 1, sampling, trust_group=trust_group, cache_salt=cache_salt)
        limit = self.pool_blocks
        quota = self.quotas.get(trust_group)
        if quota is not None:
            limit = min(limit, quota)
        most = largest_allowance(len(ids), limit, self.block_size, _branches(sampling) if sampling is not None else 1)
        return most if self.max_context is None else min(most, self.max_context - len(ids))

    def submit(self, prompt: Sequence[int], max_new_tokens: int, sampling: Any = None, *,
               stop_token_ids: Sequence[int] = (), trust_group: str = "default", priority: int = 0,
               request_id: str | None = None, on_token: Callable[[Any], None] | None = None,
               cache_salt: str | None = None) -> FleetHandle:
        from dataclasses import asdict

        from ..runtime.sampling import SamplingParams

        self.ensure_news()
        params = sampling or SamplingParams()
        ids, max_new, ctx = self.check_request(prompt, max_new_tokens, params, trust_group=trust_group,
                                               cache_salt=cache_salt)
        rid = request_id or f"fleet-{secrets.token_hex(8)}"
        held = self._handles.get(rid)
        if held is not None and not held.done():
            raise ConfigError(f"request id {rid!r} is already in flight")
        if params.seed is None and not params.greedy:
            # One seed for every attempt: a resubmission after a replica died samples the same tokens.
            params = SamplingParams(**{**asdict(params), "seed": secrets.randbits(63)})
        digests = prompt_digests(ctx.root_digest(), ids, self.block_size)
        route = make_route_request(rid, trust_group, digests, len(ids), max_new, self.block_size, _branches(params))
        job = {"request_id": rid, "prompt": ids, "max_tokens": max_new, "sampling": asdict(params),
               "stop_token_ids": list(stop_token_ids), "trust_group": trust_group, "priority": priority,
               "cache_salt": cache_salt, "route": route, "avoid": []}
        handle = FleetHandle(rid)
        self._handles[rid] = handle
        handle.task = asyncio.get_running_loop().create_task(self._drive(handle, job, len(ids), on_token))
        return handle

    async def _drive(self, handle: FleetHandle, job: dict[str, Any], prompt_len: int,
                     on_token: Callable[[Any], None] | None) -> None:
        emitted: dict[int, int] = {}
        refusals = attempts = 0
        reasons: list[str] = ["cancelled"]
        cached = 0
        replica = None
        counted = False  # a replica accepted it: counted in ``running`` until it ends, however it ends
        waiting = False  # every replica has said "not now" to it at least once

        def accepted() -> None:
            nonlocal counted
            self._count_running(True)
            counted = True

        try:
            while True:
                attempts += 1
                job["events_since"] = self.view.event_positions()
                try:
                    if waiting:
                        outcome, replica, cached, reasons = await self._gated_attempt(
                            job, emitted, prompt_len, on_token, accepted)
                    else:
                        outcome, replica, cached, reasons = await self._attempt(
                            job, emitted, prompt_len, on_token, accepted)
                except _ReplicaFailed as exc:
                    self.counters["replica_failures"] += 1
                    if exc.replica:
                        job["avoid"] = [exc.replica]
                    if exc.counted:
                        self._count_running(False)
                        counted = False
                    await asyncio.sleep(self.spec.retry_s)
                    continue
                if outcome == ACCEPTED:
                    break
                if outcome == NEVER:
                    reasons = ["never"]
                    break
                refusals += 1
                self.counters["refusals"] += 1
                job["avoid"] = [*job["avoid"], replica]
                others = set(self.view.candidates(job["route"].trust_group)) - set(job["avoid"])
                if len(job["avoid"]) > self.retries or not others:
                    # Every replica said "not now": a new round, through the waiting line (_gated_attempt).
                    job["avoid"] = []
                    waiting = True
                    self.counters["waits"] += 1
                    await asyncio.sleep(self.spec.retry_s)
                else:
                    self.counters["retries"] += 1
        except asyncio.CancelledError:
            reasons = ["cancelled"]  # not an earlier attempt's refusal: the request itself was cancelled
            raise
        finally:
            if counted:
                self._count_running(False)
            handle._result = FleetResult(handle.request_id, reasons, cached, replica, refusals, attempts)
            self._handles.pop(handle.request_id, None)
            if on_token is not None:
                on_token(FleetTokenEvent(handle.request_id, 0, None, prompt_len + sum(emitted.values()), time.time(),
                                         finished=True, finish_reason=reasons[0] if reasons else None))

    async def _gated_attempt(self, job: dict[str, Any], emitted: dict[int, int], prompt_len: int,
                             on_token: Callable[[Any], None] | None, accepted_cb: Callable[[], None]
                             ) -> tuple[str, str | None, int, list[str]]:
        """An attempt of a request that every replica has already refused once. Such requests take turns,
        first come first served (an asyncio lock is FIFO): at the start of a round each waits for news of
        room, then asks, and holds the line only until the replica's first answer -- so one finished request
        does not wake every waiting one into a storm of refusals, and none is starved by the others."""
        async with self._line:
            if not job["avoid"]:
                await self._wait_for_room(job["route"], 4 * self.spec.news_period_s)
            answered = asyncio.Event()
            task = asyncio.ensure_future(self._attempt(job, emitted, prompt_len, on_token, accepted_cb, answered))
            signal = asyncio.ensure_future(answered.wait())
            try:
                await asyncio.wait({task, signal}, return_when=asyncio.FIRST_COMPLETED)
            except asyncio.CancelledError:
                task.cancel()
                raise
            finally:
                signal.cancel()
        return await task

    def _count_running(self, up: bool) -> None:
        self.running += 1 if up else -1

    async def _attempt(self, job: dict[str, Any], emitted: dict[int, int], prompt_len: int,
                       on_token: Callable[[Any], None] | None, accepted_cb: Callable[[], None],
                       answered: asyncio.Event | None = None) -> tuple[str, str | None, int, list[str]]:
        route = job["route"]
        replica: str | None = None
        counted = False
        seen: dict[int, int] = {}
        try:
            stream = self.handle.options(stream=True).generate.remote(job)
            async for msg in stream:
                kind = msg["type"]
                now = time.time()
                if kind == "token":
                    b = msg["branch"]
                    seen[b] = seen.get(b, 0) + 1
                    if seen[b] > emitted.get(b, 0):  # a resubmission repeats what was already streamed
                        emitted[b] = seen[b]
                        if on_token is not None:
                            on_token(FleetTokenEvent(job["request_id"], b, msg["token"], prompt_len + seen[b] - 1, now,
                                                     logprobs=msg.get("logprobs"),
                                                     prompt_logprobs=msg.get("prompt_logprobs")))
                    continue
                replica = msg.get("replica")
                if answered is not None:
                    answered.set()
                load = ReplicaLoad.from_dict(msg["load"]) if msg.get("load") else None
                self._events(replica, msg)
                if kind == ACCEPTED:
                    self.counters["accepted"] += 1
                    if msg.get("overshoot"):
                        self.counters["overcommits"] += 1
                    self.view.accepted(route.request_id, replica, msg["seq"], load, now)
                    accepted_cb()
                    counted = True
                elif kind == "finished":
                    self.view.finished(route.request_id, replica, msg["seq"], load, now)
                    self._heard()
                    return ACCEPTED, replica, int(msg["cached_prompt_tokens"]), list(msg["finish_reasons"])
                else:  # not_now or never: nothing is held there
                    self.view.refused(route.request_id, replica, load, now)
                    return kind, replica, 0, [kind]
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 -- a replica died or its call failed: go elsewhere
            if replica is not None:
                self.view.drop(replica)
            raise _ReplicaFailed(replica, counted) from exc
        finally:
            if answered is not None:
                answered.set()
        raise _ReplicaFailed(replica, counted)

    def _events(self, replica: str | None, msg: dict[str, Any]) -> None:
        if replica is None or "events" not in msg:
            return
        if not msg.get("events_complete", True):
            self.view.resync(replica)
        self.view.apply_events(replica, msg["events"], msg["events_next"])

    def cancel(self, request_id: str) -> bool:
        h = self._handles.get(request_id)
        if h is None or h.task is None or h.task.done():
            return False
        h.task.cancel()
        return True

    def num_running(self) -> int:
        return self.running

    def state(self) -> Any:
        from ..server.backend import BackendState

        loads = [st.load for st in self.view.replicas.values() if st.load is not None]
        blocks = {k: sum(getattr(x, k) for x in loads) for k in ("free", "evictable", "promised", "booked")}
        blocks.update(active=sum(x.pool - x.free - x.evictable for x in loads), retained=blocks["evictable"],
                      pinned=0, leased=0)
        c = self.counters
        return BackendState(running=self.running, blocks=blocks, total_blocks=sum(x.pool for x in loads), leases=0,
                            sequences=sum(x.running for x in loads),
                            admissions={"admitted": c["accepted"], "not_now": c["refusals"], "never": 0},
                            evictions=0, preemptions=0, swapped_blocks={"out": 0, "in": 0},
                            prefix_queries_tokens=0, prefix_hits_tokens=0)

    def audit(self) -> dict[str, Any]:
        return {"clean": self.running == 0 and not self._handles, "running": self.running, "sequences": 0,
                "leases": 0, "blocks": {}, "total_blocks": 0, "checked": False, "fleet": dict(self.counters)}

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> Any:
        """Refused: the ingress holds no cache; each replica's engine resets its own."""
        from ..core.lifetimes import CacheReset

        return CacheReset(False, 0, "the fleet's ingress holds no prefix cache: reset each replica's engine")

    def start(self) -> None:
        pass

    def drain(self, timeout: float) -> bool:
        return not self._handles

    def stop(self) -> None:
        if self._news is not None:
            self._news.cancel()
        for h in list(self._handles.values()):
            if h.task is not None:
                h.task.cancel()


class _ReplicaFailed(Exception):
    def __init__(self, replica: str | None, counted: bool) -> None:
        super().__init__(replica)
        self.replica = replica
        self.counted = counted


# ---- the ingress and the application -----------------------------------------------------------------


class FleetIngress:
    """The OpenAI-compatible server (``kvledger.server.create_app``) over a :class:`FleetBackend`."""

    def __init__(self, engine: Any, spec: FleetSpec, tenants: dict[str, Any] | None = None,
                 max_queue: int = 256) -> None:
        from ..runtime.loading import compute_dtype, kv_spec_for, model_context, resolve_model
        from ..server.tenants import Tenants
        from ..server.text import TextCodec

        serve_on_loopback()
        config = spec.engine_config()  # what the replicas run: the ingress's digests must equal theirs
        ckpt = resolve_model(config.model)
        self.codec = TextCodec.from_pretrained(str(ckpt.path))
        vocab = int(ckpt.config.get("vocab_size") or len(self.codec.tok))
        context = model_context(ckpt)  # the replicas' engines cut it to max_model_len: so does the ingress
        if config.max_model_len is not None:
            context = config.max_model_len if context is None else min(context, config.max_model_len)
        self.backend = FleetBackend(engine, spec, vocab_size=vocab, max_context=context,
                                    kv_spec=kv_spec_for(ckpt, compute_dtype(config.dtype), config.kv_dtype,
                                                        config.block_size))
        self.tenants = Tenants.from_dict(tenants) if tenants else Tenants.single_tenant()
        self.max_queue = max_queue
        self.spec = spec

    def __serve_build_asgi_app__(self) -> Any:
        from ..server.app import ServerSettings, create_app

        backend = self.backend
        settings = ServerSettings(self.spec.model, backend.max_context or backend.pool_blocks * backend.block_size,
                                  max_queue=self.max_queue)
        app = create_app(backend, self.codec, self.tenants, settings)

        @app.get("/admin/fleet")
        async def fleet_state(request: HttpRequest) -> Any:
            """This ingress's counters and its router's view: the age of each replica's load and how many
            prefix blocks it believes each holds (operator only; tenant-free aggregates)."""
            from fastapi.responses import JSONResponse

            app.state.kvledger.operator(request)
            backend.ensure_news()
            now = time.time()
            view = backend.view
            return JSONResponse({"ingress": _replica_name(), "counters": backend.counters, "running": backend.running,
                                 "ages_s": {r: view.age(r, now) for r in view.replicas}, "known_blocks": view.known(),
                                 "prefix_digests": len(view.index)})

        return app


def fleet_app(spec: FleetSpec, *, tenants: dict[str, Any] | None = None, max_queue: int = 256) -> Any:
    """The bound application: ``serve.run(fleet_app(spec), ...)``."""
    router = RequestRouterConfig(
        request_router_class=ROUTER_CLASS,
        request_router_kwargs={"view_key": spec.view_key, "block_size": spec.block_size,
                               "min_match_tokens": spec.min_match_tokens, "queue_weight": spec.queue_weight},
        request_routing_stats_period_s=spec.stats_period_s)
    engine = serve.deployment(EngineReplica, name="engine", num_replicas=spec.engine_replicas,
                              max_ongoing_requests=MAX_ONGOING, max_queued_requests=-1,
                              request_router_config=router, ray_actor_options={"num_cpus": 0},
                              health_check_period_s=2.0, graceful_shutdown_timeout_s=2.0)
    ingress_cls = serve.ingress()(FleetIngress)
    ingress = serve.deployment(ingress_cls, name="ingress", num_replicas=spec.ingress_replicas,
                               max_ongoing_requests=MAX_ONGOING, ray_actor_options={"num_cpus": 0},
                               graceful_shutdown_timeout_s=2.0)
    quotas: dict[str, int] = {}
    if tenants:
        from ..server.tenants import Tenants

        quotas = {t.name: t.max_blocks for t in Tenants.from_dict(tenants).by_name.values()
                  if t.max_blocks is not None}
    return ingress.bind(engine.bind(spec, quotas), spec, tenants, max_queue)


__all__ = ["EngineReplica", "FleetBackend", "FleetIngress", "FleetSpec", "fleet_app", "is_loopback", "local_ray",
           "ray_listeners", "serve_on_loopback"]
