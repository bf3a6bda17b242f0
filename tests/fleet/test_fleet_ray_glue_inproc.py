"""The fleet's Ray glue, without starting Ray: the application ``fleet_app`` hands Ray Serve (deployments,
their sizes and limits, the request router and its kwargs, each tenant's cap), ``local_ray``'s options and
its refusal of a Ray that listens beyond loopback, ``ray_listeners``' survey of the listening sockets,
``serve_on_loopback``'s rebinding of Serve's gRPC server, and a request's branch count."""

from __future__ import annotations

import os
from types import SimpleNamespace
from typing import Any

import pytest

from kvledger.errors import ConfigError
from kvledger.fleet import serve as fleet_serve
from kvledger.fleet.serve import (
    MAX_ONGOING,
    EngineReplica,
    FleetIngress,
    FleetSpec,
    fleet_app,
    is_loopback,
    local_ray,
    ray_listeners,
    serve_on_loopback,
)
from kvledger.runtime.sampling import SamplingParams

from .inproc import engine_deployment

TENANTS = {"operator": {"api_keys": ["sk-op"]},
           "tenants": {"acme": {"api_keys": ["sk-a"], "max_blocks": 7}, "globex": {"api_keys": ["sk-g"]}}}


def test_fleet_app_binds_an_engine_deployment_behind_the_ingress():
    """What Ray Serve is asked to run: ``engine_replicas`` engine replicas (the plain EngineReplica, each
    told the tenants' caps), routed by kvledger's router with the spec's knobs and stats period, Ray's
    request cap far above any pool, no CPU reserved; ``ingress_replicas`` ingress replicas (the
    OpenAI-compatible FleetIngress) bound to the engine with the spec, tenants and queue bound."""
    spec = FleetSpec(engine_replicas=3, ingress_replicas=2, block_size=8, min_match_tokens=32, queue_weight=0.5,
                     stats_period_s=4.0, view_key="glue")
    app = fleet_app(spec, tenants=TENANTS, max_queue=9)
    ingress = app._bound_deployment
    engine = engine_deployment(app)
    assert (engine.name, engine.func_or_class, engine.init_args, engine.init_kwargs) == (
        "engine", EngineReplica, (spec, {"acme": 7}), {})
    assert (engine.num_replicas, engine.max_ongoing_requests, engine.max_queued_requests) == (3, MAX_ONGOING, -1)
    assert MAX_ONGOING == 4096 and engine.ray_actor_options == {"num_cpus": 0}
    config = engine._deployment_config
    assert (config.health_check_period_s, config.graceful_shutdown_timeout_s) == (2.0, 2.0)
    router = config.request_router_config
    assert router.request_router_class == "kvledger.fleet.router:LedgerRequestRouter" == fleet_serve.ROUTER_CLASS
    assert router.request_router_kwargs == {"view_key": "glue", "block_size": 8, "min_match_tokens": 32,
                                           "queue_weight": 0.5}
    assert router.request_routing_stats_period_s == 4.0

    assert ingress.name == "ingress" and issubclass(ingress.func_or_class, FleetIngress)
    assert ingress.init_args[1:] == (spec, TENANTS, 9) and ingress.init_kwargs == {}
    assert (ingress.num_replicas, ingress.max_ongoing_requests, ingress.ray_actor_options) == (
        2, MAX_ONGOING, {"num_cpus": 0})
    assert ingress._deployment_config.graceful_shutdown_timeout_s == 2.0

    plain = engine_deployment(fleet_app(FleetSpec()))
    assert plain.init_args == (FleetSpec(), {}) and plain.num_replicas == 2
    assert engine_deployment(fleet_app(FleetSpec(), tenants={"tenants": {"a": {"api_keys": ["k"]}}})).init_args[1] == {}
    assert fleet_app(FleetSpec())._bound_deployment.init_args[1:] == (FleetSpec(), None, 256)


class _Ray:
    """``ray.init`` / ``ray.shutdown`` recorded instead of run."""

    def __init__(self) -> None:
        self.inits: list[dict[str, Any]] = []
        self.shutdowns = 0

    def init(self, **options: Any) -> str:
        self.inits.append(options)
        return "context"

    def shutdown(self) -> None:
        self.shutdowns += 1


def test_local_ray_asks_for_a_loopback_ray_and_refuses_one_that_listens_beyond(monkeypatch):
    import ray

    fake = _Ray()
    monkeypatch.setattr(ray, "init", fake.init)
    monkeypatch.setattr(ray, "shutdown", fake.shutdown)
    monkeypatch.delenv("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", raising=False)
    monkeypatch.delenv("RAY_USAGE_STATS_ENABLED", raising=False)
    listening = [("127.0.0.1", 6379, "gcs_server"), ("::1", 8265, "raylet")]
    monkeypatch.setattr(fleet_serve, "ray_listeners", lambda: listening)

    assert local_ray(num_cpus=2, log_to_driver=False) == "context"
    assert fake.inits == [{"include_dashboard": False, "_node_ip_address": "127.0.0.1", "num_cpus": 2,
                           "log_to_driver": False}]
    assert os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] == "0" and os.environ["RAY_USAGE_STATS_ENABLED"] == "0"
    assert fake.shutdowns == 0
    monkeypatch.setenv("RAY_USAGE_STATS_ENABLED", "1")  # the operator's own setting is kept
    local_ray()
    assert fake.inits[-1] == {"include_dashboard": False, "_node_ip_address": "127.0.0.1"}
    assert os.environ["RAY_USAGE_STATS_ENABLED"] == "1"

    listening += [("0.0.0.0", 1, "a"), ("10.0.0.2", 2, "b"), ("::", 3, "c"), ("192.168.0.1", 4, "d")]
    with pytest.raises(ConfigError) as err:
        local_ray()
    assert str(err.value) == (
        "Ray listens beyond 127.0.0.1 ([('0.0.0.0', 1, 'a'), ('10.0.0.2', 2, 'b'), ('::', 3, 'c')]): import "
        "kvledger.fleet before ray, or set RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 before Ray is imported")
    assert fake.shutdowns == 1


@pytest.mark.parametrize("ip, ok", [("127.0.0.1", True), ("::1", True), ("::ffff:127.0.0.1", True),
                                    ("0.0.0.0", False), ("::", False), ("127.0.0.2", False), ("", False)])
def test_loopback_addresses(ip, ok):
    assert is_loopback(ip) is ok


class _Proc:
    def __init__(self, pid: int, cmdline: list[str] | None, name: str = "proc", kids: list[_Proc] | None = None,
                 name_fails: bool = False) -> None:
        self.pid, self._cmdline, self._name, self.kids, self.name_fails = pid, cmdline, name, kids or [], name_fails

    def children(self, recursive: bool = False) -> list[_Proc]:
        assert recursive
        return self.kids

    def cmdline(self) -> list[str]:
        import psutil

        if self._cmdline is None:
            raise psutil.AccessDenied(self.pid)
        return self._cmdline

    def name(self) -> str:
        import psutil

        if self.name_fails:
            raise psutil.NoSuchProcess(self.pid)
        return self._name


def test_ray_listeners_lists_the_listening_sockets_of_this_process_and_its_ray_children(monkeypatch):
    import psutil

    me = _Proc(10, ["python", "-m", "pytest"], "python", kids=[
        _Proc(11, ["/x/RAY/gcs_server", "--port"], "gcs_server"),
        _Proc(12, ["sleep", "5"], "sleep"),  # not Ray's
        _Proc(13, None, "secret"),  # cannot be read: skipped
        _Proc(14, ["raylet"], "raylet", name_fails=True),
    ])
    monkeypatch.setattr(psutil, "Process", lambda: me)

    def conn(ip: str, port: int, pid: int, status: str = psutil.CONN_LISTEN) -> Any:
        return SimpleNamespace(laddr=SimpleNamespace(ip=ip, port=port), pid=pid, status=status)

    conns = [conn("127.0.0.1", 1, 10), conn("0.0.0.0", 2, 11), conn("127.0.0.1", 3, 11, psutil.CONN_ESTABLISHED),
             conn("::", 4, 12), conn("::1", 5, 13), conn("127.0.0.1", 6, 14), conn("10.0.0.1", 7, 99)]
    kinds: list[str] = []
    monkeypatch.setattr(psutil, "net_connections", lambda kind: kinds.append(kind) or conns)
    assert ray_listeners() == [("127.0.0.1", 1, "python"), ("0.0.0.0", 2, "gcs_server"), ("127.0.0.1", 6, "?")]
    assert kinds == ["tcp"]


def test_serve_on_loopback_rebinds_servers_bound_to_every_interface(monkeypatch):
    """Serve binds each replica's gRPC server to ``[::]:0``; after serve_on_loopback the same call binds
    127.0.0.1 on the same port, other addresses are left alone, and patching twice wraps once."""
    from ray.serve._private import replica

    bound: list[tuple[Any, str]] = []

    def bind(server: Any, address: str) -> int:
        bound.append((server, address))
        return 4321

    monkeypatch.setattr(replica, "add_port_to_grpc_server", bind)
    serve_on_loopback()
    patched = replica.add_port_to_grpc_server
    assert patched is not bind and patched.kvledger_loopback is True
    serve_on_loopback()
    assert replica.add_port_to_grpc_server is patched  # not wrapped again
    for address in ("[::]:0", "0.0.0.0:5", ":6", "10.1.2.3:7", "127.0.0.1:8", "[::1]:9"):
        assert patched("srv", address) == 4321
    assert bound == [("srv", "127.0.0.1:0"), ("srv", "127.0.0.1:5"), ("srv", "127.0.0.1:6"), ("srv", "10.1.2.3:7"),
                     ("srv", "127.0.0.1:8"), ("srv", "[::1]:9")]


def test_a_requests_branches_are_its_beam_width_or_its_n():
    branches = fleet_serve._branches
    assert branches(SamplingParams()) == 1
    assert branches(SamplingParams(temperature=1.0, n=3)) == 3
    assert branches(SamplingParams(beam_width=4)) == 4
    assert branches(SimpleNamespace(beam=False, beam_width=9, n=2)) == 2
    assert branches(SimpleNamespace(n=0)) == 1 and branches(SimpleNamespace()) == 1
    assert branches(SimpleNamespace(beam=True, beam_width=5, n=1)) == 5
