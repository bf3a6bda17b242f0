"""Fixtures of the web lab tests: the app in-process, `kvledger lab` as a real server on a free loopback
port (started with `--port 0`, so the system picks the port and the server prints it), and the browser.

The browser is Debian's `chromium` package, driven by Playwright through ``executable_path`` (never
`playwright install`, which downloads a browser of its own). `make test` and `.ci/run` install it when
they can (scripts/ensure_chromium.sh: as root, with apt-get). ``KVLEDGER_BROWSER`` chooses:

* unset or ``auto``: `chromium` (or `chromium-browser`) on PATH; when there is none the browser tests are
  skipped with one line saying why;
* ``off``: the browser tests are skipped;
* ``required`` (`.ci/run`): a missing chromium fails the browser tests instead of skipping them;
* a path: that chromium binary.
"""

from __future__ import annotations

import os
import re
import shutil
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


NO_BROWSER = ("no chromium on PATH: browser tests skipped (as root, `make test` installs Debian's chromium; "
              "or `apt-get install chromium`)")


def chromium_path() -> str:
    """The chromium binary the browser tests drive, or a skip (a fail under KVLEDGER_BROWSER=required)."""
    choice = os.environ.get("KVLEDGER_BROWSER", "auto").strip() or "auto"
    if choice == "off":
        pytest.skip("KVLEDGER_BROWSER=off: browser tests skipped")
    if choice not in ("auto", "required"):
        if not (os.path.isfile(choice) and os.access(choice, os.X_OK)):
            pytest.fail(f"KVLEDGER_BROWSER={choice}: not an executable file", pytrace=False)
        return choice
    for name in ("chromium", "chromium-browser"):
        path = shutil.which(name)
        if path:
            return path
    if choice == "required":
        pytest.fail(f"KVLEDGER_BROWSER=required but {NO_BROWSER.split(':')[0]}", pytrace=False)
    pytest.skip(NO_BROWSER)


@pytest.fixture(scope="module")
def browser():
    """Headless chromium under Playwright, one per test module."""
    path = chromium_path()
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=path, headless=True,
                              args=["--disable-background-networking", "--no-first-run", "--disable-gpu"])
        try:
            yield b
        finally:
            b.close()
