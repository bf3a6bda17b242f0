"""Fixtures of the web lab tests: the app in-process, and `kvledger lab` as a real server on a free loopback
port (started with `--port 0`, so the system picks the port and the server prints it)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest
from fastapi.testclient import TestClient

from kvledger.weblab import create_app

SEED_CONTROLS = {"layers": 32, "kv_heads": 8, "head_dim": 128, "kv_dtype": "bf16", "block_size": 16,
                 "pool": "512MiB", "requests": 8, "prompt": 2048, "shared_prefix": 2048, "max_new": 257,
                 "groups": 1, "prefix_cache": True, "policy": "full"}


@pytest.fixture(scope="session")
def client() -> TestClient:
    return TestClient(create_app())


@pytest.fixture()
def seed() -> dict:
    return dict(SEED_CONTROLS)


@dataclass
class LabServer:
    proc: subprocess.Popen
    url: str
    stderr: list[str] = field(default_factory=list)

    def stop(self) -> int:
        """Ctrl-C, as a person would; returns the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        return self.proc.returncode


def start_lab(*args: str) -> LabServer:
    """`python -m kvledger lab --port 0 ...`; waits for the line with the URL."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([sys.executable, "-m", "kvledger", "lab", "--port", "0", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    server = LabServer(proc, "")
    threading.Thread(target=lambda: server.stderr.extend(proc.stderr), daemon=True).start()
    line = proc.stdout.readline()  # blocks until the server binds (or exits)
    match = re.search(r"serving on (http://127\.0\.0\.1:\d+/)", line)
    if not match:
        proc.kill()
        proc.wait(timeout=10)
        raise AssertionError(f"kvledger lab did not start: {line!r} {''.join(server.stderr)!r}")
    server.url = match.group(1)
    return server


@pytest.fixture()
def start_lab_server():
    """Start `kvledger lab` servers in a test; every one still running at the end is stopped."""
    started: list[LabServer] = []

    def start(*args: str) -> LabServer:
        started.append(start_lab(*args))
        return started[-1]

    yield start
    for server in started:
        server.stop()


@pytest.fixture(scope="module")
def lab_server() -> Iterator[LabServer]:
    server = start_lab()
    try:
        yield server
    finally:
        server.stop()
