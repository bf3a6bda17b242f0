"""A local Ray for the fleet's Ray tests: started here, on loopback only, and stopped here -- no Ray
process outlives the tests that used it (checked)."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator

import pytest

os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # before ray.init: never take the machine's address
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # no usage report leaves the machine
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


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


@pytest.fixture(scope="package")
def ray_cluster() -> Iterator[object]:
    # `make install` installs the fleet extra: a missing Ray fails here rather than skipping the fleet's tests.
    import ray

    from kvledger.fleet.serve import local_ray

    ctx = local_ray(num_cpus=2, object_store_memory=150 * 2**20, log_to_driver=False, configure_logging=False)
    try:
        yield ctx
    finally:
        try:
            from ray import serve

            serve.shutdown()
        except Exception:  # noqa: BLE001 -- serve was never started, or is already down
            pass
        ray.shutdown()
        deadline = time.monotonic() + 30
        left = ray_processes()
        while left and time.monotonic() < deadline:
            time.sleep(0.2)
            left = ray_processes()
        for p in left:  # ours, by pid: never by name
            p.kill()
        assert not left, f"Ray processes survived ray.shutdown(): {[p.pid for p in left]}"
