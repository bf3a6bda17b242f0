"""A local Ray for the fleet's Ray tests: started here, on loopback only, and stopped here -- no Ray
process outlives the tests that used it (checked).

The in-process tests share one Ray (``ray_cluster``, started once for the whole of tests/fleet, the only
place Ray runs in-process); the two subprocess tests (`kvledger fleet serve`, the import-order regression)
start their own, because their own Ray is what they check. A busy machine (load 20 on 2 cores) slows
Ray's start-up past its default timeouts, so every Ray started under these tests -- ours and the
subprocesses', which inherit the environment -- gets patient ones (``RAY_PATIENCE``), the start-up is
retried once, and a start that still fails says so in one line with the load it saw."""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest

os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # before ray.init: never take the machine's address
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # no usage report leaves the machine
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

# Ray's own start-up and liveness timeouts (RAY_<config name>; defaults 5-60 s), raised so that a node
# starting while other processes hold both cores is waited for rather than declared dead. Set in the
# environment, not ray.init's _system_config, so that the subprocesses' Rays get them too; an explicit
# setting in the caller's environment wins.
RAY_PATIENCE = {
    "RAY_gcs_server_port_wait_time_s": "180",  # the GCS writes its port (default 30)
    "RAY_gcs_rpc_server_connect_timeout_s": "60",  # a client's first connection to the GCS (default 5)
    "RAY_gcs_rpc_server_reconnect_timeout_s": "300",  # a client gives up on an unanswering GCS (default 60)
    "RAY_gcs_server_request_timeout_seconds": "300",  # one GCS request from Python (default 60)
    "RAY_worker_register_timeout_seconds": "300",  # a new worker process registers with its raylet (default 60)
    "RAY_agent_register_timeout_ms": "300000",  # the raylet's agents register
    "RAY_health_check_period_ms": "10000",  # the GCS asks each raylet whether it is alive ...
    "RAY_health_check_timeout_ms": "60000",  # ... waits this long for the answer ...
    "RAY_health_check_failure_threshold": "10",  # ... and declares it dead after this many misses
    "RAY_prestart_worker_first_driver": "0",  # no idle workers started with the node: less start-up work
}
for _name, _value in RAY_PATIENCE.items():
    os.environ.setdefault(_name, _value)

# How long one attempt to start Ray may take before it counts as failed (the start is tried twice).
RAY_START_TIMEOUT_S = float(os.environ.get("KVLEDGER_TEST_RAY_START_S", "240"))

# What Ray says when a node did not come up in time (as opposed to a real fault, which is not retried), and
# the load line: the product's own (`kvledger fleet serve` retries and fails on the same markers). Ray-free.
from kvledger.fleet.ray_start import RAY_START_TIMEOUTS, is_ray_start_timeout, load_average  # noqa: E402,F401


def ray_did_not_start(elapsed_s: float, load_at_start: str, detail: str) -> str:
    """The one line a test fails with when Ray still did not start after its retry."""
    return (f"Ray did not start within {elapsed_s:.0f} s under load {load_at_start} (now {load_average()}), "
            f"tried twice: {detail.strip().splitlines()[-1][:300] if detail.strip() else '?'}")


def ray_processes() -> list:
    """Every Ray process this test process started, recursively (GCS, raylet, agents, workers)."""
    import psutil

    out = []
    for p in psutil.Process().children(recursive=True):
        try:
            if p.is_running() and "ray" in " ".join(p.cmdline()).lower():
                out.append(p)
        except psutil.Error:
            continue
    return out


def listeners(processes: list) -> list[tuple[str, int, str]]:
    """(ip, port, process name) of every listening TCP socket of ``processes``."""
    import psutil

    pids = {p.pid: p for p in processes}
    out = []
    for c in psutil.net_connections(kind="tcp"):
        if c.status == psutil.CONN_LISTEN and c.pid in pids:
            try:
                name = pids[c.pid].name()
            except psutil.Error:
                name = "?"
            out.append((c.laddr.ip, c.laddr.port, name))
    return out


def is_loopback(ip: str) -> bool:
    return ip == "127.0.0.1" or ip == "::1" or ip == "::ffff:127.0.0.1"


@contextmanager
def patient_node_registration(timeout_s: float) -> Iterator[None]:
    """Inside ``ray.init``, Python waits a fixed 30 s (not configurable) for the new raylet to register
    with the GCS -- the "GCS has become overloaded" failure under load. While starting, our lookup of the
    node keeps asking until ``timeout_s`` has passed instead; past it, Ray's own error is raised."""
    from ray._private import services

    original = getattr(services, "get_node", None)
    if original is None:  # another Ray layout: nothing to widen; the retry below still applies
        yield
        return
    deadline = time.monotonic() + timeout_s

    def get_node(gcs_address, node_id):  # noqa: ANN001, ANN202 -- Ray's signature
        while True:
            try:
                return original(gcs_address, node_id)
            except RuntimeError:
                if time.monotonic() >= deadline:
                    raise
                time.sleep(0.5)

    services.get_node = get_node
    try:
        yield
    finally:
        services.get_node = original


def stop_ray(wait_s: float = 30.0) -> list:
    """Stop Serve and Ray and wait for the processes this test process started; kill (by pid) and return
    any still alive after ``wait_s``."""
    import ray

    try:
        from ray import serve

        if ray.is_initialized():
            serve.shutdown()
    except Exception:  # noqa: BLE001 -- serve was never started, or is already down
        pass
    ray.shutdown()
    deadline = time.monotonic() + wait_s
    left = ray_processes()
    while left and time.monotonic() < deadline:
        time.sleep(0.2)
        left = ray_processes()
    for p in left:  # ours, by pid: never by name
        p.kill()
    return left


def start_local_ray(start: Callable[[], object], timeout_s: float = RAY_START_TIMEOUT_S) -> object:
    """``start()`` (a ``local_ray`` call), each attempt given ``timeout_s``; a start that times out is
    stopped and tried once more; a second time-out fails the test with one line naming the load. Any other
    error (a Ray that listens beyond loopback, a missing Ray) is a real fault and is raised at once."""
    t0 = time.monotonic()
    load_at_start = load_average()
    detail = ""
    for _attempt in range(2):
        try:
            with patient_node_registration(timeout_s):
                return start()
        except Exception as exc:  # noqa: BLE001 -- Ray raises plain Exceptions for its time-outs
            detail = f"{type(exc).__name__}: {exc}"
            if not is_ray_start_timeout(detail):
                raise
            stop_ray()
    pytest.fail(ray_did_not_start(time.monotonic() - t0, load_at_start, detail), pytrace=False)


def run_with_ray(argv: list[str], timeout_s: float = 2 * RAY_START_TIMEOUT_S) -> subprocess.CompletedProcess:
    """``subprocess.run`` of a command that starts its own Ray (output captured as text). A run that fails
    because Ray did not come up in time is run once more; a second such failure fails the test in one line.
    Any other outcome, failures included, is returned for the test to judge."""
    t0 = time.monotonic()
    load_at_start = load_average()
    for _attempt in range(2):
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, check=False)
        if proc.returncode == 0 or "ConfigError" in proc.stderr or not is_ray_start_timeout(proc.stderr):
            return proc
    pytest.fail(ray_did_not_start(time.monotonic() - t0, load_at_start, proc.stderr), pytrace=False)


@pytest.fixture(scope="package")
def ray_cluster() -> Iterator[object]:
    """The one in-process Ray of the test run, shared by every test under tests/fleet that needs Ray
    (package scope: it stops once the last of them has run, so the rest of the suite runs without it)."""
    # `make install` installs the fleet extra: a missing Ray fails here rather than skipping the fleet's tests.
    import ray  # noqa: F401

    from kvledger.fleet.serve import local_ray

    # One try per local_ray call: start_local_ray retries itself, with a patient wait for the raylet.
    ctx = start_local_ray(lambda: local_ray(num_cpus=2, object_store_memory=150 * 2**20, log_to_driver=False,
                                            configure_logging=False, start_attempts=1))
    try:
        yield ctx
    finally:
        left = stop_ray()
        assert not left, f"Ray processes survived ray.shutdown(): {[p.pid for p in left]}"
