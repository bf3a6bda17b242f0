"""`kvledger fleet serve`: the live fleet on Ray Serve (engine replicas behind OpenAI-compatible ingresses).

Everything a user can get wrong is checked here, before Ray starts: bounded numbers, a loopback address,
a free port, the tenants file, the model and the `fleet` extra. A mistake found once Ray runs costs tens
of seconds of start-up and may surface only inside a replica, as a log line the user never sees.

The top level imports only click and the standard library: Ray, torch and the runtime load inside the
command, after validation.
"""

from __future__ import annotations

import ipaddress
import json
import logging
import signal
import socket
import threading
import time
from typing import Any

import click

from ..errors import ConfigError
from ..fleet.spec import FleetSpec
from .common import prepare_torch
from .engine_options import cpu_engine_refusals, engine_option, engine_options
from .options import MAX_COUNT, MAX_TOKENS, Float, Int, epilog, model_option
from .serve_cmds import _say, _url_host

APP_NAME = "kvledger-fleet"
STOP_WAIT_S = 30.0  # after ray.shutdown(): how long Ray's processes get to exit before they are killed
# The fleet's defaults are FleetSpec's (Ray-free: --help imports no Ray).
SPEC = FleetSpec()


@click.group("fleet", epilog=epilog(
    "kvledger fleet serve --model smollm2-135m --replicas 2 --ingress-replicas 2 --port 8000",
    "kvledger fleet serve --tenants tenants.toml --pool-blocks 256 --port 0",
))
def fleet_group() -> None:
    """The live fleet: several engine replicas, each with its own ledger, on a local Ray (loopback only)."""


@fleet_group.command("serve", epilog=epilog(
    "kvledger fleet serve --model smollm2-135m --replicas 2 --ingress-replicas 2 --port 8000",
    "kvledger fleet serve --tenants tenants.toml --pool-blocks 256 --block-size 16 --port 0   # URL printed",
    "kvledger fleet serve --replicas 1 --ingress-replicas 1 --num-cpus 2 --stats-period 5",
))
@model_option(SPEC.model)
@click.option("--replicas", type=Int(1, 64), default=SPEC.engine_replicas, show_default=True,
              help="Engine replicas, each with its own KV pool, ledger and admission door.")
@click.option("--ingress-replicas", type=Int(1, 64), default=SPEC.ingress_replicas, show_default=True,
              help="Ingress replicas: the OpenAI-compatible server, each with its own router.")
@click.option("--pool-blocks", "--num-gpu-blocks-override", "pool_blocks", type=Int(1, MAX_COUNT),
              default=SPEC.pool_blocks, show_default=True, help="KV pool of each engine replica, in blocks.")
@engine_options("block_size", "dtype", "kv_dtype", "allow_untested_kv", "enable_prefix_caching")
@engine_option("host_blocks", help="Host-memory tier below each replica's pool, in blocks: evicted prefix blocks are "
               "demoted to it and promoted back on a hit, and the routers keep counting them as that replica's.")
@engine_option("max_num_seqs", help="Most sequences running at once in each engine replica.")
@engine_option("max_num_batched_tokens", help="Tokens per engine step in each engine replica.")
@engine_option("max_model_len", help="Prompt + output tokens of one sequence [the model's context].")
@cpu_engine_refusals()
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Loopback address the HTTP proxy listens on (no other is accepted).")
@click.option("--port", type=Int(0, 65535), default=8000, show_default=True,
              help="Port (0: any free port, printed).")
@click.option("--tenants", "tenants_path", default=None,
              help="TOML file mapping API keys to tenants (trust groups), as `kvledger serve` reads it (or "
                   "JSON of the same shape, *.json); without it, single-tenant mode.")
@click.option("--max-queue", type=Int(1, MAX_COUNT), default=256, show_default=True,
              help="Requests that may wait in each ingress before new ones get 429.")
@click.option("--stats-period", type=Float(0.0, 3600.0, lo_open=True), default=SPEC.stats_period_s,
              show_default=True, help="Seconds between the routing stats Ray Serve collects from each replica.")
@click.option("--news-period", type=Float(0.0, 3600.0, lo_open=True), default=SPEC.news_period_s,
              show_default=True, help="Seconds between an ingress's polls of the replicas' cache events and load.")
@click.option("--retries", type=Int(0, 1000), default=None,
              help="Other replicas tried after a refusal before the request waits [replicas - 1].")
@click.option("--min-match", type=Int(0, MAX_TOKENS), default=SPEC.min_match_tokens, show_default=True,
              help="Prefix tokens below which a cached match is not affinity.")
@click.option("--queue-weight", type=Float(0.0, 1e6), default=SPEC.queue_weight, show_default=True,
              help="Weight of a replica's prefill backlog in the routing cost.")
@click.option("--threads", type=Int(1, 1024), default=SPEC.torch_threads, show_default=True,
              help="torch CPU threads of each engine replica.")
@click.option("--num-cpus", type=Int(1, 1024), default=None, help="CPUs the local Ray may use [all].")
@click.option("--ray-logs", is_flag=True, help="Show Ray's and the replicas' own log lines too.")
def fleet_serve_cmd(model: str, replicas: int, ingress_replicas: int, pool_blocks: int, block_size: int,
                    dtype: str, kv_dtype: str | None, allow_untested_kv: bool, enable_prefix_caching: bool,
                    host_blocks: int, max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int | None,
                    host: str, port: int,
                    tenants_path: str | None, max_queue: int,
                    stats_period: float, news_period: float, retries: int | None, min_match: int,
                    queue_weight: float, threads: int, num_cpus: int | None, ray_logs: bool) -> None:
    """Serve a model from a fleet of engine replicas on Ray Serve, over an OpenAI-compatible HTTP API."""
    address = _loopback(host)
    tenants, describe = _read_tenants(tenants_path)
    _need_fleet()
    port = _free_port(address, port)  # a taken port fails here, not as a proxy that never comes up
    spec = FleetSpec(model=model, pool_blocks=pool_blocks, block_size=block_size, dtype=dtype,
                     max_running=max_num_seqs, engine_replicas=replicas, ingress_replicas=ingress_replicas,
                     stats_period_s=stats_period, retries=retries, min_match_tokens=min_match,
                     queue_weight=queue_weight, torch_threads=threads, news_period_s=news_period,
                     host_blocks=host_blocks, kv_dtype=kv_dtype, allow_untested_kv=allow_untested_kv,
                     prefix_caching=enable_prefix_caching, max_batched_tokens=max_num_batched_tokens,
                     max_model_len=max_model_len)
    # A bad model, model length or untested KV format fails here; a .gguf is converted once, not by every
    # replica at once (a replica's refusal would be a log line inside Ray).
    _resolve_model(spec.engine_config())
    from .. import fleet  # noqa: F401 -- sets RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 before Ray is imported

    tier = f" + {host_blocks} host blocks" if host_blocks else ""
    kv = f", KV {kv_dtype}" if kv_dtype else ""
    caching = "" if enable_prefix_caching else "; prefix caching off"
    _say(f"kvledger fleet serve: model {model}; {replicas} engine replica(s) x {pool_blocks} blocks{tier} of "
         f"{block_size} tokens ({dtype}{kv}){caching}; {ingress_replicas} ingress replica(s); routing stats every "
         f"{stats_period:g} s; {describe}")
    _run(spec, tenants, address, port, max_queue, num_cpus, ray_logs)


def _loopback(host: str) -> str:
    """The address to listen on: loopback only -- the fleet's servers and Ray talk over 127.0.0.1. Exactly
    the addresses `kvledger.fleet.serve.is_loopback` accepts, which checks the listeners once Serve runs."""
    text = host.strip().lower()
    if text == "localhost":
        return "127.0.0.1"
    try:
        ip = str(ipaddress.ip_address(text))
    except ValueError:
        ip = None
    if ip not in ("127.0.0.1", "::1"):
        raise ConfigError(f"--host {host!r} is not a loopback address: the fleet listens on 127.0.0.1 (or ::1) only")
    return ip


def _read_tenants(path: str | None) -> tuple[dict[str, Any] | None, str]:
    """The tenants table as the replicas take it (a dict), validated here, and its banner line."""
    from ..server.tenants import Tenants

    if path is None:
        return None, Tenants.single_tenant().describe()
    import tomllib

    from .common import read_text

    text = read_text(path, "tenants file", limit=4 * 2**20)
    try:
        data = json.loads(text) if path.lower().endswith(".json") else tomllib.loads(text)
    except (ValueError, RecursionError) as exc:  # JSONDecodeError and TOMLDecodeError are ValueErrors
        kind = "JSON" if path.lower().endswith(".json") else "TOML"
        raise ConfigError(f"{path}: not valid {kind} ({exc})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the tenants file must hold a table ([tenants.NAME] and [operator])")
    return data, Tenants.from_dict(data, where=path).describe()


def _need_fleet() -> None:
    """One clear line when the fleet's optional dependencies are missing."""
    import importlib.util

    missing = [m for m in ("ray", "psutil", "fastapi", "uvicorn") if importlib.util.find_spec(m) is None]
    if not missing:
        try:
            missing = [] if importlib.util.find_spec("ray.serve") is not None else ["ray[serve]"]
        except ModuleNotFoundError:
            missing = ["ray[serve]"]
    if missing:
        raise ConfigError(f"this command needs {', '.join(missing)}: pip install 'kvledger[fleet]'")


def _free_port(address: str, port: int) -> int:
    """``port``, proved free on ``address``; for 0, a free port picked now (Serve needs a number)."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the proxy's server binds
        try:
            sock.bind((address, port))
        except OSError as exc:
            raise ConfigError(f"cannot listen on {address}:{port}: {exc.strerror or exc}") from None
        return int(sock.getsockname()[1])


def _resolve_model(config: Any) -> None:
    """What a replica would refuse about ``config`` (an EngineConfig), refused here before Ray starts: the
    model, a model length past its context or past a replica's pool, a quantised KV format without a
    passing quality record."""
    prepare_torch()  # before torch loads: see `kvledger serve`
    from ..runtime.engine import refuse_untested_kv_early, resolve_model
    from ..runtime.loading import compute_dtype, kv_spec_for, model_context

    refuse_untested_kv_early(config.model, config.kv_dtype, config.allow_untested_kv)
    ckpt = resolve_model(config.model)
    context, length = model_context(ckpt), config.max_model_len
    if length is not None and context is not None and length > context:
        raise ConfigError(f"--max-model-len {length} exceeds the model's context of {context} tokens")
    capacity = config.pool["num_blocks"] * config.block_size if "num_blocks" in config.pool else None
    if length is not None and capacity is not None and length > capacity:
        raise ConfigError(f"--max-model-len {length} exceeds a replica's KV pool ({config.pool['num_blocks']} blocks "
                          f"x {config.block_size} = {capacity} tokens): give a larger --pool-blocks")
    spec = kv_spec_for(ckpt, compute_dtype(config.dtype), config.kv_dtype, config.block_size)
    if spec.format.quantized and not config.allow_untested_kv:
        from ..runtime.measure.quality_records import require_record

        require_record(spec, ckpt, config.model)


def _run(spec: Any, tenants: dict[str, Any] | None, address: str, port: int, max_queue: int,
         num_cpus: int | None, ray_logs: bool) -> None:
    """Start Ray and Serve, deploy the fleet, wait for Ctrl-C or SIGTERM, then stop Serve and Ray and wait
    until every Ray process this command started has exited."""
    import ray
    from ray import serve

    from ..fleet.serve import fleet_app, is_loopback, local_ray, ray_listeners

    if not ray_logs:  # Serve's INFO lines in the driver would bury the one line that matters: the URL
        logging.getLogger("ray.serve").setLevel(logging.WARNING)
    stop = threading.Event()
    phase = {"now": "ray"}

    def on_signal(signum: int, _frame: Any) -> None:
        # Inside ray.init a KeyboardInterrupt would leave the node's processes running with nobody to stop
        # them, so the signal waits until ray.init returns; while Serve starts, it interrupts the start
        # (the `finally` below stops Ray); once the fleet serves, it asks the main loop to stop; while
        # stopping, a second Ctrl-C must not cut the shutdown short.
        if phase["now"] == "serve":
            raise KeyboardInterrupt
        stop.set()

    # Put back, at the end, the handlers found here (not the defaults): a caller that runs the command in
    # its own process (a test, an embedding) keeps its own, and Ray's, as they were.
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    # Ray processes already running here are somebody else's (a caller's own Ray): never stopped below.
    before = {p.pid for p in _ray_processes()}
    for sig in previous:
        signal.signal(sig, on_signal)
    started = time.monotonic()
    try:
        local_ray(num_cpus, log_to_driver=ray_logs, configure_logging=ray_logs)
        for sig in (signal.SIGINT, signal.SIGTERM):  # ray.init may have put its own handlers in place
            signal.signal(sig, on_signal)
        phase["now"] = "serve"
        if stop.is_set():
            raise KeyboardInterrupt
        try:
            serve.start(http_options={"host": address, "port": port})
            serve.run(fleet_app(spec, tenants=tenants, max_queue=max_queue), name=APP_NAME, route_prefix="/")
        except (KeyboardInterrupt, ConfigError):
            raise
        except Exception as exc:  # noqa: BLE001 -- Ray's failures are many types; the user gets one line
            raise ConfigError(f"the fleet did not start: {type(exc).__name__}: {exc}") from None
        outside = [x for x in ray_listeners() if not is_loopback(x[0])]
        if outside:
            raise ConfigError(f"the fleet listens beyond loopback ({outside[:3]}); stopped")
        phase["now"] = "ready"
        _say(f"kvledger fleet serve: listening on http://{_url_host(address)}:{port}  (started in "
             f"{time.monotonic() - started:.0f} s; SIGTERM or Ctrl-C stops)")
        while not stop.wait(1.0):
            pass
        _say("kvledger fleet serve: stopping Serve and Ray")
    finally:
        phase["now"] = "stopping"
        # Before shutdown: once their parent is gone they are no longer children.
        ray_procs = [p for p in _ray_processes() if p.pid not in before]
        if ray.is_initialized():
            try:
                serve.shutdown()
            except Exception:  # noqa: BLE001 -- Serve never started, or is already down; Ray still stops below
                pass
        ray.shutdown()  # a no-op when Ray never started
        left = _wait_gone(ray_procs, STOP_WAIT_S)
        for sig, handler in previous.items():
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)
    if left:
        raise ConfigError(f"{left} Ray process(es) outlived ray.shutdown() by {STOP_WAIT_S:g} s and were killed")
    _say("kvledger fleet serve: stopped")


def _ray_processes() -> list[Any]:
    """Every Ray process this process started (GCS, raylet, agents, workers, Serve's replicas)."""
    import psutil

    out = []
    for p in psutil.Process().children(recursive=True):
        try:
            if "ray" in " ".join(p.cmdline()).lower():
                out.append(p)
        except psutil.Error:
            continue
    return out


def _wait_gone(procs: list[Any], timeout: float) -> int:
    """Wait until ``procs`` have exited; kill (by pid: they are ours) any still alive after ``timeout``.
    Returns how many had to be killed."""
    import psutil

    _, alive = psutil.wait_procs(procs, timeout=timeout)
    for p in alive:
        try:
            p.kill()
        except psutil.Error:
            continue
    psutil.wait_procs(alive, timeout=5)
    return len(alive)


__all__ = ["APP_NAME", "SPEC", "fleet_group", "fleet_serve_cmd"]
