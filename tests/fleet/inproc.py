"""Ray Serve's deployment handles, in this process: the fleet's own code -- the real
:class:`~kvledger.fleet.serve.EngineReplica` objects, the real
:class:`~kvledger.fleet.router.LedgerRequestRouter` and the :class:`~kvledger.fleet.serve.FleetBackend` over
them -- run in the test process, where mutmut (and a debugger) can see them. No ``ray.init``, no Ray process.

What is Ray's and kept: the application :func:`~kvledger.fleet.serve.fleet_app` builds (each deployment's
plain class is ``Deployment.func_or_class``, its constructor arguments ``init_args``, its replica count and
its request router's class and kwargs its ``RequestRouterConfig``); the router itself, built as Ray builds
it (``RequestRouter.__init__`` then ``initialize_state(**request_router_kwargs)``) and driven by Ray's own
routing loop (``_choose_replica_for_request``: ``choose_replicas`` per round, best rank first, and
``_select_from_candidate_replicas`` on each rank), with ``update_replicas`` on every membership change,
``on_replica_actor_died`` when a replica dies and ``on_request_routed`` once a call is placed; the replica
context each replica's constructor reads (``serve.get_replica_context()``, set with Ray's own setter).

What is this module's: the handle face the fleet uses -- ``handle.options(stream=True).method.remote(x)``
(an async iterator of the replica's messages) and ``handle.method.remote(x)`` (an awaitable) -- the
routing-stats poll (Ray's every ``request_routing_stats_period_s``; here :meth:`InprocDeployment.poll_stats`,
called when a test says so) and a replica's death (:meth:`InprocDeployment.kill`: its streams and calls
raise :class:`ReplicaDied` from their next message on, as Ray's ``ActorDiedError`` would).
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import importlib
import importlib.util
import inspect
import itertools
import os
import shutil
from collections.abc import AsyncIterator, Coroutine, Iterator
from pathlib import Path
from typing import Any

from ray.serve import context as serve_context
from ray.serve._private.common import DeploymentHandleSource, DeploymentID, ReplicaID, RequestMetadata
from ray.serve._private.config import DeploymentConfig
from ray.serve._private.request_router.common import PendingRequest

_ids = itertools.count()
HANG_S = 60.0  # a test's coroutine that has not finished by then hangs: it fails (nothing here is timed)


class ReplicaDied(RuntimeError):
    """A call on a replica that died (Ray raises ``ActorDiedError``)."""


def run_fleet(coro: Coroutine[Any, Any, Any]) -> Any:
    """Run a test's coroutine on a fresh event loop. A fleet that hangs (it never should) fails the test
    after ``HANG_S`` instead of holding the run; so does a task left behind that ignores cancellation."""
    async def main() -> Any:
        try:
            return await asyncio.wait_for(coro, HANG_S)
        finally:
            left = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in left:
                t.cancel()
            if left:
                _, pending = await asyncio.wait(left, timeout=10)
                assert not pending, f"tasks ignore cancellation: {[t.get_stack() for t in pending]}"
    return asyncio.run(main())


@contextlib.contextmanager
def replica_context(replica_id: ReplicaID) -> Iterator[None]:
    """Code run inside this block is "in" that replica: ``serve.get_replica_context()`` names it."""
    serve_context._set_internal_replica_context(
        replica_id=replica_id, servable_object=None, _deployment_config=DeploymentConfig(), rank=None, world_size=1)
    try:
        yield
    finally:
        serve_context._INTERNAL_REPLICA_CONTEXT = None


class InprocReplica:
    """One running replica: the plain object, and the face a request router sees (``RunningReplica``'s)."""

    def __init__(self, replica_id: ReplicaID, servable: Any, max_ongoing_requests: int) -> None:
        self.replica_id = replica_id
        self.servable = servable
        self.routing_stats: dict[str, Any] = {}
        self.max_ongoing_requests = max_ongoing_requests
        self.multiplexed_model_ids: set[str] = set()
        self.is_cross_language = False
        self.alive = True
        self.calls = 0

    @property
    def name(self) -> str:
        return self.replica_id.to_full_id_str()

    async def get_queue_len(self, *, deadline_s: float) -> int:  # Ray probes a new replica once
        return 0

    def check_alive(self) -> None:
        if not self.alive:
            raise ReplicaDied(f"the replica {self.name} died")


class InprocDeployment:
    """One deployment of a Ray Serve application, its replicas built here from the deployment's plain class
    (``Deployment.func_or_class``) with its bound arguments. Build and use it inside one event loop (Ray's
    router binds to the loop it first routes on)."""

    def __init__(self, deployment: Any, app_name: str = "inproc", *, replicas: int | None = None,
                 args: tuple[Any, ...] | None = None) -> None:
        self.deployment = deployment
        self.args = args  # the constructor's arguments as Ray passes them (bound deployments made handles)
        self.deployment_id = DeploymentID(name=deployment.name, app_name=app_name)
        config = deployment._deployment_config
        self.router_config = config.request_router_config
        self.replicas: list[InprocReplica] = []
        self.router: Any = None
        self.sent: list[tuple[str, str, tuple[Any, ...]]] = []  # (method, replica name, args) of every call placed
        count = deployment.num_replicas if replicas is None else replicas
        for _ in range(count):
            self.add_replica()

    def another_process(self, **router_kwargs: Any) -> InprocDeployment:
        """The same replicas as seen from another process (another ingress replica): its own handle and
        router (its own view when ``view_key`` differs), built from the same router config with
        ``router_kwargs`` changed."""
        other = InprocDeployment.__new__(InprocDeployment)
        other.deployment, other.deployment_id = self.deployment, self.deployment_id
        kwargs = {**(self.router_config.request_router_kwargs or {}), **router_kwargs}
        other.router_config = self.router_config.model_copy(update={"request_router_kwargs": kwargs})
        other.args, other.replicas, other.router, other.sent = self.args, self.replicas, None, []
        return other

    # ---- membership ---------------------------------------------------------------------------------
    def add_replica(self) -> InprocReplica:
        """Start one more replica (Ray: a scale-up or a restart, under a new replica id)."""
        rid = ReplicaID(unique_id=f"r{next(_ids)}", deployment_id=self.deployment_id)
        cls = self.deployment.func_or_class
        if inspect.iscoroutinefunction(cls.__init__):  # serve.ingress(): Ray's wrapper subclasses the user's class
            cls = cls.__bases__[0]
        with replica_context(rid):
            servable = cls(*(self.args if self.args is not None else self.deployment.init_args),
                           **self.deployment.init_kwargs)
        replica = InprocReplica(rid, servable, self.deployment.max_ongoing_requests)
        self.replicas.append(replica)
        if self.router is not None:
            self.router.update_replicas(self.live())
        return replica

    def live(self) -> list[InprocReplica]:
        return [r for r in self.replicas if r.alive]

    def by_name(self, name: str) -> InprocReplica:
        return next(r for r in self.replicas if r.name == name)

    def kill(self, name: str) -> None:
        """The replica's actor dies: its calls fail from their next message on, the router is told
        (``on_replica_actor_died``), then the controller's new membership (``update_replicas``)."""
        replica = self.by_name(name)
        replica.alive = False
        if self.router is not None:
            self.router.on_replica_actor_died(replica.replica_id)
            self.router.update_replicas(self.live())

    def poll_stats(self) -> None:
        """Ray's routing-stats poll: each live replica's ``record_routing_stats()``, as the router reads it."""
        for r in self.live():
            r.routing_stats = r.servable.record_routing_stats()

    def close(self) -> None:
        for r in self.replicas:
            engine = getattr(r.servable, "engine", None)
            if engine is not None:
                engine.stop()

    # ---- routing, as Ray's router does it -------------------------------------------------------------
    def _router(self) -> Any:
        if self.router is None:  # Ray builds it on a handle's first call, in the calling process
            module, _, name = self.router_config.request_router_class.partition(":")
            cls = getattr(importlib.import_module(module), name)
            self.router = cls(self.deployment_id, DeploymentHandleSource.UNKNOWN)
            self.router.initialize_state(**(self.router_config.request_router_kwargs or {}))
            self.router.update_replicas(self.live())
        return self.router

    async def route(self, method: str, args: tuple[Any, ...], kwargs: dict[str, Any],
                    stream: bool) -> tuple[InprocReplica, tuple[Any, ...], dict[str, Any]]:
        """Place one call; returns the replica and the arguments as it receives them (a copy: Ray
        serialises them, so the caller's later changes to its job never reach the replica)."""
        router = self._router()
        n = next(_ids)
        pending = PendingRequest(args=list(args), kwargs=dict(kwargs), metadata=RequestMetadata(
            request_id=f"req-{n}", internal_request_id=f"internal-{n}", call_method=method,
            app_name=self.deployment_id.app_name, is_streaming=stream))
        replica = await router._choose_replica_for_request(pending)
        router.on_request_routed(pending, replica.replica_id, None)
        replica.calls += 1
        args, kwargs = copy.deepcopy((args, kwargs))
        self.sent.append((method, replica.name, args))
        return replica, args, kwargs

    def handle(self) -> InprocHandle:
        return InprocHandle(self)


class InprocHandle:
    """A ``DeploymentHandle``'s face: ``options(stream=...)`` and ``handle.method.remote(...)``."""

    def __init__(self, deployment: InprocDeployment, stream: bool = False) -> None:
        self._deployment = deployment
        self._stream = stream

    def options(self, *, stream: bool | None = None) -> InprocHandle:
        return InprocHandle(self._deployment, self._stream if stream is None else stream)

    def __getattr__(self, method: str) -> _Method:
        if method.startswith("_"):
            raise AttributeError(method)
        return _Method(self._deployment, method, self._stream)


class _Method:
    def __init__(self, deployment: InprocDeployment, method: str, stream: bool) -> None:
        self.deployment, self.method, self.stream = deployment, method, stream

    def remote(self, *args: Any, **kwargs: Any) -> Any:
        if self.stream:
            return _Stream(self.deployment, self.method, args, kwargs)
        return asyncio.ensure_future(_call(self.deployment, self.method, args, kwargs))


async def _call(deployment: InprocDeployment, method: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    replica, args, kwargs = await deployment.route(method, args, kwargs, stream=False)
    replica.check_alive()
    fn = getattr(replica.servable, method)
    if inspect.isasyncgenfunction(fn):
        raise TypeError(f"{method} is a generator: call it with handle.options(stream=True)")
    out = fn(*args, **kwargs)
    if inspect.isawaitable(out):
        out = await out
    replica.check_alive()
    return out


class _Stream:
    """``DeploymentResponseGenerator``: routed on first iteration, then the replica's messages one by one;
    a dead replica raises :class:`ReplicaDied` at the next message (its generator is closed, as Ray's
    cancellation closes it in the replica)."""

    def __init__(self, deployment: InprocDeployment, method: str, args: tuple[Any, ...],
                 kwargs: dict[str, Any]) -> None:
        self.deployment, self.method, self.args, self.kwargs = deployment, method, args, kwargs
        self.replica: InprocReplica | None = None
        self.gen: AsyncIterator[Any] | None = None

    def __aiter__(self) -> _Stream:
        return self

    async def __anext__(self) -> Any:
        if self.gen is None:
            self.replica, args, kwargs = await self.deployment.route(self.method, self.args, self.kwargs, stream=True)
            fn = getattr(self.replica.servable, self.method)
            if not inspect.isasyncgenfunction(fn):
                raise TypeError(f"{self.method} is not a generator: call it without stream=True")
            self.gen = fn(*args, **kwargs)
        assert self.replica is not None
        if not self.replica.alive:
            await self.gen.aclose()  # type: ignore[attr-defined]
            raise ReplicaDied(f"the replica {self.replica.name} died")
        return await self.gen.__anext__()


def tiny_model(folder: Path, seed: int = 0) -> str:
    """A tiny random Llama (tests/runtime/conftest.py's ``save_tiny``), saved in ``folder`` unless it is
    there already (written beside it and renamed into place, so concurrent sessions never read half a
    model): its path is the fleet's ``model``."""
    if not (folder / "config.json").exists():
        spec = importlib.util.spec_from_file_location(
            "kvledger_tests_runtime_conftest", Path(__file__).resolve().parent.parent / "runtime" / "conftest.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        scratch = folder.with_name(f"{folder.name}.{os.getpid()}.tmp")
        module.save_tiny("llama", scratch, seed)
        save_tiny_tokenizer(scratch)
        try:
            os.replace(scratch, folder)
        except OSError:  # another session put it there first
            shutil.rmtree(scratch, ignore_errors=True)
    return str(folder)


def save_tiny_tokenizer(folder: Path, vocab_size: int = 256) -> None:
    """A word-level tokenizer for the tiny model: token ``i`` is the word ``t<i>`` (so the server's text
    face -- prompts, completions -- works over it)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(vocab={f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0").save_pretrained(folder)


def shared_tiny_model(tmp_path_factory: Any) -> str:
    """The tiny model, kept between sessions next to pytest's temporary folders (seeded: always the same)."""
    return tiny_model(tmp_path_factory.getbasetemp().parent / "kvledger-inproc-tiny-llama-seed0-words")


def engine_deployment(app: Any) -> Any:
    """The engine deployment of a ``fleet_app(...)`` application (the ingress's first bound argument)."""
    return app._bound_deployment.init_args[0]._bound_deployment


def fleet_spec(model: str, **overrides: Any) -> Any:
    """A small fleet over ``model``, with a view key of its own (views are shared per process by key)."""
    from kvledger.fleet.serve import FleetSpec

    fields: dict[str, Any] = {"model": model, "pool_blocks": 16, "block_size": 4, "engine_replicas": 2,
                              "min_match_tokens": 4, "view_key": f"inproc-{next(_ids)}", "news_period_s": 3600.0,
                              "retry_s": 0.001, "max_running": 8}
    fields.update(overrides)
    return FleetSpec(**fields)


def backend_for(handle: Any, spec: Any) -> Any:
    """The ingress's backend, built with the arguments :class:`~kvledger.fleet.serve.FleetIngress` gives it
    (vocabulary and context from the checkpoint, the engines' KV spec)."""
    from kvledger.fleet.serve import FleetBackend
    from kvledger.runtime.loading import compute_dtype, kv_spec_for, model_context, resolve_model

    ckpt = resolve_model(spec.model)
    return FleetBackend(handle, spec, vocab_size=int(ckpt.config["vocab_size"]), max_context=model_context(ckpt),
                        kv_spec=kv_spec_for(ckpt, compute_dtype(spec.dtype), None, spec.block_size))


@contextlib.asynccontextmanager
async def inproc_fleet(spec: Any, *, tenants: dict[str, Any] | None = None,
                       seed: int = 0) -> AsyncIterator[tuple[InprocDeployment, Any]]:
    """``fleet_app(spec)``'s engine deployment in this process and one ingress's backend over it; stops
    both on the way out."""
    from kvledger.fleet.serve import fleet_app
    from kvledger.placement.view import shared_view

    # The process's view of this fleet, created first with a seed: ties between equal replicas are broken
    # the same way every run (the router and the backend both find it by the spec's view key).
    shared_view(spec.view_key, block_size=spec.block_size, score=spec.score(), seed=seed)
    deployment = InprocDeployment(engine_deployment(fleet_app(spec, tenants=tenants)))
    backend = None
    try:
        backend = backend_for(deployment.handle(), spec)
        yield deployment, backend
    finally:
        if backend is not None:
            backend.stop()
            await asyncio.sleep(0)
        deployment.close()


__all__ = ["HANG_S", "InprocDeployment", "InprocHandle", "InprocReplica", "ReplicaDied", "backend_for",
           "engine_deployment", "fleet_spec", "inproc_fleet", "replica_context", "run_fleet", "shared_tiny_model",
           "tiny_model"]


def scripted_fleet(servable: type, key: str, block_size: int = 4, **spec: Any) -> tuple[InprocDeployment, Any]:
    """Two replicas of ``servable`` (a scripted stand-in for an engine replica) behind the real router, and
    an ingress backend, over the view ``key`` (views are shared per process by key: use a fresh one)."""
    from ray import serve

    from kvledger.core.sizing.geometry import KVSpec
    from kvledger.fleet.serve import FleetBackend, FleetSpec
    from kvledger.placement.view import shared_view

    spec_ = FleetSpec(**{"block_size": block_size, "pool_blocks": 16, "view_key": key, "min_match_tokens": block_size,
                         "retry_s": 0.001, "news_period_s": 3600.0, **spec})
    shared_view(key, block_size=block_size, score=spec_.score(), seed=0)
    config = {"request_router_class": "kvledger.fleet.router:LedgerRequestRouter",
              "request_router_kwargs": {"view_key": key, "block_size": block_size, "min_match_tokens": block_size}}
    deployment = InprocDeployment(serve.deployment(servable, name="engine", num_replicas=2,
                                                   request_router_config=config).bind()._bound_deployment)
    backend = FleetBackend(deployment.handle(), spec_, vocab_size=100, max_context=None,
                           kv_spec=KVSpec(layers=1, kv_heads=1, head_dim=4, kv_dtype="fp32", block_size=block_size))
    return deployment, backend
