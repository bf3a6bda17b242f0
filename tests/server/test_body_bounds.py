"""A request's size never stalls the server: bodies past `--max-request-body-bytes` are a 413 (from the
Content-Length before reading, and while reading a chunked body), a text prompt whose length alone puts it
past the model's length is refused without being tokenized, and the CPU work of large requests runs off
the event loop -- so while one tenant's huge prompt is refused, `/health` answers and another tenant's
stream keeps streaming."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from urllib.parse import urlsplit

import httpx
import pytest

from kvledger.cli.main import main
from kvledger.server.app import RequestWorkers, ServerSettings
from kvledger.server.protocol import default_max_body_bytes

WORDS = b"The quick brown fox jumps over the lazy dog, then naps under 42 old oak trees. "


def text_of(size: int) -> bytes:
    """Ordinary prose of ``size`` bytes (what a tokenizer does at its usual speed)."""
    return (WORDS * (size // len(WORDS) + 1))[:size]


def auth(server, tenant: str = "acme") -> dict[str, str]:  # noqa: ANN001
    return {"Authorization": f"Bearer {server.keys[tenant]}", "Content-Type": "application/json"}


def assert_error(resp: httpx.Response, status: int) -> dict:
    assert resp.status_code == status, (resp.status_code, resp.text[:300])
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error"
    return error


# ---- the flag and its default -------------------------------------------------------------------
def test_the_default_body_limit_follows_the_model_length() -> None:
    assert default_max_body_bytes(2560) == 2560 * 64 + 2**20
    assert default_max_body_bytes(8192) > default_max_body_bytes(2560)
    assert ServerSettings("m", 2560).body_limit == default_max_body_bytes(2560)
    assert ServerSettings("m", 2560, max_request_body_bytes=4096).body_limit == 4096


@pytest.mark.parametrize("value", ["0", "12x", "-5", "1" * 60])
def test_a_bad_body_limit_is_one_line(capsys: pytest.CaptureFixture[str], value: str) -> None:
    rc = main(["serve", "--max-request-body-bytes", value])
    _, err = capsys.readouterr()
    lines = [line for line in err.strip().splitlines() if line.strip()]
    assert rc == 2 and len(lines) == 1, err
    assert lines[0].startswith("kvledger: error: --max-request-body-bytes")


# ---- the request workers ------------------------------------------------------------------------
def test_one_tenants_burst_leaves_a_worker_for_the_others() -> None:
    workers = RequestWorkers(2, inline_bytes=100)
    release = threading.Event()
    ran: list[str] = []

    def held(name: str) -> str:  # a large request's work, blocked until the test lets it go
        ran.append(name)
        release.wait(60)
        return name

    async def scenario() -> None:
        burst = [asyncio.ensure_future(workers.run("acme", 10_000, held, f"acme-{i}")) for i in range(3)]
        other = await asyncio.wait_for(workers.run("globex", 10_000, lambda: "globex"), 30)
        assert other == "globex" and ran == ["acme-0"]  # acme holds one worker, its others wait their turn
        assert await workers.run("acme", 10, threading.current_thread) is threading.current_thread()  # inline
        release.set()
        assert await asyncio.gather(*burst) == ["acme-0", "acme-1", "acme-2"]

    try:
        asyncio.run(scenario())
    finally:
        release.set()
        workers.close()


# ---- 413 at the shared server's default limit ----------------------------------------------------
def _limit(server) -> int:  # noqa: ANN001
    models = httpx.get(f"{server.v1}/models", headers=auth(server), trust_env=False).json()
    return default_max_body_bytes(models["data"][0]["max_model_len"])


def _raw_exchange(server, head: str, parts: list[bytes]) -> tuple[int, dict]:  # noqa: ANN001
    """Send a request by hand (headers, then body parts, stopping early if the server stops reading) and
    read one response: its status and JSON body."""
    url = urlsplit(server.url)
    with socket.create_connection((url.hostname, url.port), timeout=60) as sock:
        sock.sendall(head.encode())
        for part in parts:
            try:
                sock.sendall(part)
            except OSError:
                break
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = sock.recv(65536)
            assert chunk, f"the server closed without answering: {data!r}"
            data += chunk
        header, _, rest = data.partition(b"\r\n\r\n")
        lines = header.decode("latin-1").split("\r\n")
        fields = {k.strip().lower(): v.strip() for k, v in (line.split(":", 1) for line in lines[1:])}
        length = int(fields["content-length"])
        while len(rest) < length:
            chunk = sock.recv(65536)
            assert chunk, "the server closed mid-answer"
            rest += chunk
    assert fields["content-type"].startswith("application/json")
    return int(lines[0].split()[1]), json.loads(rest[:length])


@pytest.mark.model
def test_a_body_over_the_limit_is_413_from_its_content_length(server) -> None:
    limit = _limit(server)
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {server.keys['acme']}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {limit + 1}\r\n\r\n")
    status, body = _raw_exchange(server, head, [])  # not a byte of the body sent: refused unread
    assert status == 413
    assert body["error"]["code"] == "request_too_large" and str(limit) in body["error"]["message"]
    # the ordinary client, sending the whole body
    resp = httpx.post(f"{server.v1}/chat/completions", content=b" " * (limit + 1), headers=auth(server),
                      trust_env=False, timeout=120)
    assert assert_error(resp, 413)["code"] == "request_too_large"


@pytest.mark.model
def test_a_chunked_body_is_cut_off_at_the_limit(server) -> None:
    limit = _limit(server)
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {server.keys['acme']}\r\n"
            "Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n")
    piece = b" " * 65536
    chunk = f"{len(piece):x}\r\n".encode() + piece + b"\r\n"
    # More than the limit, and never the closing chunk: only a server that stops reading at the limit answers.
    status, body = _raw_exchange(server, head, [chunk] * (limit // len(piece) + 2))
    assert status == 413 and body["error"]["code"] == "request_too_large"


@pytest.mark.model
def test_a_body_of_exactly_the_limit_is_served(server) -> None:
    limit = _limit(server)
    body = json.dumps({"model": "smollm2-135m", "prompt": "Hello", "max_tokens": 1}).encode()
    resp = httpx.post(f"{server.v1}/completions", content=body + b" " * (limit - len(body)), headers=auth(server),
                      trust_env=False, timeout=120)
    assert resp.status_code == 200, resp.text[:300]
    assert resp.json()["usage"]["completion_tokens"] == 1


# ---- a maximum-size prompt does not stall anyone else -------------------------------------------
BIG = 32 * 2**20  # the body limit of the server below; its refusals used to hold the event loop 15-45 s


class HealthPoller(threading.Thread):
    """Polls /health back to back; records each answer's status and latency."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.url = url
        self.stop = threading.Event()
        self.answers: list[tuple[int, float]] = []

    def run(self) -> None:
        with httpx.Client(trust_env=False, timeout=120) as client:
            while not self.stop.is_set():
                start = time.monotonic()
                status = client.get(f"{self.url}/health").status_code
                self.answers.append((status, time.monotonic() - start))
                time.sleep(0.02)


class Streamer(threading.Thread):
    """Another tenant streams completions back to back; records the longest wait for a chunk (the first
    one's included) and how each stream ended."""

    def __init__(self, server) -> None:  # noqa: ANN001
        super().__init__(daemon=True)
        self.client = server.client(server.keys["globex"])
        self.stop = threading.Event()
        self.started = threading.Event()
        self.max_gap = 0.0
        self.endings: list[str | None] = []
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            while not self.stop.is_set():
                last = time.monotonic()
                reason = None
                for chunk in self.client.completions.create(model="smollm2-135m", prompt="Once upon a time",
                                                            max_tokens=24, temperature=0, stream=True,
                                                            extra_body={"ignore_eos": True}):
                    now = time.monotonic()
                    self.max_gap = max(self.max_gap, now - last)
                    last = now
                    self.started.set()
                    if chunk.choices and chunk.choices[0].finish_reason:
                        reason = chunk.choices[0].finish_reason
                self.endings.append(reason)
        except BaseException as exc:  # noqa: BLE001 -- reported by the test
            self.error = exc


@pytest.mark.model
def test_a_maximum_size_prompt_is_refused_without_stalling_health_or_streams(spawn) -> None:
    server = spawn("--pool-blocks", "160", "--block-size", "16", "--max-request-body-bytes", f"{BIG // 2**20}MiB")
    assert "request bodies up to 32 MiB" in server.stderr()
    poller, streamer = HealthPoller(server.url), Streamer(server)
    streamer.start()
    assert streamer.started.wait(120), streamer.error
    poller.start()
    head = b'{"model": "smollm2-135m", "max_tokens": 8, '
    bodies = {"/v1/completions": (head + b'"prompt": "', b'"}'),
              "/v1/chat/completions": (head + b'"messages": [{"role": "user", "content": "', b'"}]}')}
    try:
        for path, (before, after) in bodies.items():
            raw = before + text_of(BIG - len(before) - len(after)) + after
            assert len(raw) == BIG  # as large as the server accepts
            resp = httpx.post(f"{server.url}{path}", content=raw, headers=auth(server), trust_env=False,
                              timeout=300)
            assert "maximum context length" in assert_error(resp, 400)["message"]
    finally:
        poller.stop.set()
        streamer.stop.set()
        poller.join(120)
        streamer.join(120)
    assert streamer.error is None, streamer.error
    assert poller.answers and all(status == 200 for status, _ in poller.answers)
    worst_health = max(latency for _, latency in poller.answers)
    # Tokenizing 32 MiB on the event loop held both for 15 s or more; refused unread, nobody waits.
    assert worst_health < 3.0, f"/health took {worst_health:.1f} s while a large prompt was refused"
    assert streamer.max_gap < 3.0, f"another tenant's stream stalled {streamer.max_gap:.1f} s"
    assert streamer.endings and all(reason == "length" for reason in streamer.endings), streamer.endings
