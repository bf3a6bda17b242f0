"""Start, SIGTERM, drain and exit of the very server `kvledger serve` runs, in-process (``inproc.py``):
the lines an operator reads (startup banner, shutdown report, on stderr), the signal handlers ``serve``
installs and puts back, new requests refused with a typed 503 from the first signal on, running requests
left to finish until ``--drain-timeout`` and cancelled (finish_reason abort) past it, a client that hangs
up on a non-streamed request, and ``bind``'s refusals.
"""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvledger.errors import ConfigError
from kvledger.server.launch import bind

from .inproc import HANG_GUARD_S, KEYS, MODEL, InProcServer, running, start_inproc

pytestmark = pytest.mark.model

DRAINING = {"error": {"message": "the server is shutting down", "type": "server_error", "param": None,
                      "code": "draining"}}
CLEAN = {"blocks": {"active": 0, "evictable": 0, "free": 96, "leased": 0, "pinned": 0, "promised": 0,
                    "retained": 0},
         "checked": True, "clean": True, "drained": True, "leases": 0, "running": 0, "sequences": 0,
         "total_blocks": 96,
         "groups": {"acme": {"active": 0, "cap": None, "charged": 0, "growth": 0, "promised": 0},
                    "capped": {"active": 0, "cap": 6, "charged": 0, "growth": 0, "promised": 0}}}


def through_the_app(srv: InProcServer, method: str, path: str, key: str | None, body: Any = None) -> httpx.Response:
    """A request that reaches the app itself once the listening socket is closed: what a request on a
    connection that was already open gets during the drain."""
    async def go() -> httpx.Response:
        transport = httpx.ASGITransport(app=srv.server.config.app)
        async with httpx.AsyncClient(transport=transport, base_url="http://inproc") as client:
            return await client.request(method, path, json=body, headers=srv.headers(key))

    return asyncio.run(go())


def open_stream(srv: InProcServer, stack: Any, max_tokens: int) -> Any:
    """A streamed completion that is running (its first event is in); the line iterator to read it on."""
    r = stack.enter_context(srv.http.stream(
        "POST", srv.url + "/v1/completions", headers=srv.headers(KEYS["acme"]),
        json={"prompt": "Tell a long story.", "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0,
              "stream": True}))
    lines = r.iter_lines()  # kept: a dropped iterator closes the connection
    assert next(lines).startswith("data: {")
    return lines


def rest_of(lines: Any) -> list[Any]:
    out = []
    for line in lines:
        if line.startswith("data: "):
            out.append(line[6:] if line == "data: [DONE]" else json.loads(line[6:]))
    return out


def test_sigterm_refuses_new_work_lets_running_work_finish_and_reports(tmp_path: Path) -> None:
    from contextlib import ExitStack

    srv = start_inproc(tmp_path, "--pool-blocks", "96", "--drain-timeout", "600")
    try:
        with ExitStack() as stack:
            lines = open_stream(srv, stack, 12)
            srv.sigterm()
            assert srv.ctx.draining is True
            for path in ("/v1/completions", "/v1/chat/completions"):
                r = through_the_app(srv, "POST", path, KEYS["globex"], {"prompt": "Hi", "messages": []})
                assert (r.status_code, r.json()) == (503, DRAINING)
            r = through_the_app(srv, "GET", "/health", None)
            assert (r.status_code, r.json()) == (503, {"status": "draining"})
            r = through_the_app(srv, "GET", "/metrics", srv.operator_key)
            assert 'kvledger:requests_refused_total{reason="draining"} 2.0' in r.text
            events = rest_of(lines)
            assert events[-1] == "[DONE]"
            assert events[-2]["choices"][0]["finish_reason"] == "length"  # ran to its end: not cancelled
            assert len(events) == 11 + 2  # 12 tokens (the first read above), the closing chunk, [DONE]
        srv.join()
    finally:
        srv.stop()
    assert srv.error is None
    assert srv.lines == [
        f"kvledger serve: model {MODEL} ({MODEL}); KV pool 96 blocks x 16 tokens = 67.50 MiB fp32; policy "
        "incremental, on growth failure preempt, recovery recompute",
        "kvledger serve: max model length 1536 tokens (cut to what the KV pool holds); up to 256 requests wait, "
        "then 429; request bodies up to 1.09 MiB, then 413",
        "kvledger serve: multi-tenant mode: 3 tenants (acme, capped, globex), each its own trust group; operator "
        "keys may read /metrics and /admin/ledger",
        f"kvledger serve: listening on {srv.url}  (SIGTERM or Ctrl-C drains and stops)",
        "kvledger serve: stopped accepting; cancelling what did not finish and draining the engine",
        "kvledger serve: ledger clean at exit: " + json.dumps(CLEAN, sort_keys=True)]
    # The handlers serve installed (for SIGTERM and SIGINT, doing nothing) and the ones it put back.
    calls = srv.signals.calls
    assert [sig for sig, _ in calls] == [signal.SIGTERM, signal.SIGINT, signal.SIGTERM, signal.SIGINT]
    assert all(callable(h) and h(signal.SIGTERM, None) is None for _, h in calls[:2])
    assert [h for _, h in calls[2:]] == ["previous-15", "previous-2"]


def test_the_drain_timeout_cancels_what_still_runs(tmp_path: Path) -> None:
    """--drain-timeout 0: a stream and a plain request still running both end at once, finish_reason
    abort (200, the text so far), and the ledger is clean at exit."""
    from contextlib import ExitStack

    srv = start_inproc(tmp_path, "--pool-blocks", "96", "--drain-timeout", "0")
    out: dict[str, Any] = {}
    try:
        with ExitStack() as stack:
            lines = open_stream(srv, stack, 400)
            plain = threading.Thread(target=lambda: out.update(r=srv.post("/v1/completions", {
                "prompt": "Tell another long story.", "max_tokens": 400, "ignore_eos": True, "temperature": 0})))
            plain.start()
            deadline = time.monotonic() + HANG_GUARD_S
            while srv.audit()["running"] != 2:
                assert time.monotonic() < deadline
                time.sleep(0.02)
            srv.sigterm()
            events = rest_of(lines)
            assert events[-1] == "[DONE]"
            assert events[-2]["choices"][0]["finish_reason"] == "abort" and len(events) < 400
            plain.join(HANG_GUARD_S)
        srv.join()
    finally:
        srv.stop()
    body = out["r"].json()
    assert out["r"].status_code == 200 and body["choices"][0]["finish_reason"] == "abort"
    assert 0 < body["usage"]["completion_tokens"] < 400 and body["choices"][0]["text"]
    report = srv.report()
    assert srv.error is None and report is not None and report["clean"] and report["drained"]


def test_the_default_echo_is_stderr(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``launch.serve`` without ``echo`` writes its shutdown lines to stderr, never stdout."""
    with running(tmp_path, "--pool-blocks", "32", default_echo=True):
        pass
    out, err = capsys.readouterr()
    assert out == ""
    lines = err.splitlines()
    assert lines[0] == "kvledger serve: stopped accepting; cancelling what did not finish and draining the engine"
    assert lines[1].startswith("kvledger serve: ledger clean at exit: {") and len(lines) == 2


def test_a_client_that_hangs_up_on_a_plain_request_is_cancelled(tmp_path: Path) -> None:
    with running(tmp_path, "--pool-blocks", "96") as srv:
        host, port = srv.url.removeprefix("http://").split(":")
        body = json.dumps({"prompt": "Tell a long story.", "max_tokens": 1000, "ignore_eos": True}).encode()
        with socket.create_connection((host, int(port)), timeout=HANG_GUARD_S) as s:
            s.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEYS['acme']}\r\n"
                      f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
            deadline = time.monotonic() + HANG_GUARD_S
            while srv.audit()["running"] != 1:
                assert time.monotonic() < deadline
                time.sleep(0.02)
        assert srv.wait_idle()["clean"] is True
        m = srv.metrics()
        assert m["kvledger:requests_cancelled_total"] == 1
        assert m[f'vllm:request_success_total{{engine="0",finished_reason="abort",model_name="{MODEL}"}}'] == 1
        assert m['kvledger:tenant_requests_in_flight{tenant="acme"}'] == 0


def test_bind_refusals_and_port_zero() -> None:
    for bad in (-1, 65536, True, "80", 1.5):
        with pytest.raises(ConfigError, match=r"^--port must be in \[0, 65535\], got " + repr(bad).replace(".", r"\.")):
            bind("127.0.0.1", bad)  # type: ignore[arg-type]
    try:  # the top of the range is a port like any other (free or taken, never out of range)
        bind("127.0.0.1", 65535).close()
    except ConfigError as exc:
        assert str(exc).startswith("cannot listen on 127.0.0.1:65535: ")
    sock = bind("127.0.0.1", 0)
    try:
        assert sock.family == socket.AF_INET and sock.getsockname()[1] > 0 and not sock.getblocking()
        assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR)
        taken = sock.getsockname()[1]
        with pytest.raises(ConfigError, match=f"^cannot listen on 127.0.0.1:{taken}: Address already in use$"):
            bind("127.0.0.1", taken)
    finally:
        sock.close()
    by_name = bind("localhost", 0)  # a host name: IPv4
    assert by_name.family == socket.AF_INET
    by_name.close()
    try:
        v6 = bind("::1", 0)
    except ConfigError:
        return  # no IPv6 loopback here
    assert v6.family == socket.AF_INET6
    v6.close()


def test_a_bad_tenants_file_stops_the_start_in_one_line(tmp_path: Path) -> None:
    srv = start_inproc(tmp_path, "--pool-blocks", "32", tenants='[tenants.a]\napi_keys = ["k"]\n[zzz]\n[operators]\n',
                       wait=False)
    srv.join()
    srv.stop()
    assert isinstance(srv.error, ConfigError)
    assert str(srv.error) == (f"{tmp_path / 'tenants.toml'}: unknown section(s) operators, zzz (expected "
                              "[tenants.NAME] and [operator])")
