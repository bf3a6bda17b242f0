"""Servers of their own: a one-slot queue (429 with Retry-After), and SIGTERM (stop accepting, drain or
cancel, exit 0 with the ledger audited clean)."""

from __future__ import annotations

import signal
import time

import httpx
import openai
import pytest

from .conftest import process_gone

pytestmark = pytest.mark.model


def waiting(server) -> float:  # noqa: ANN001
    for line in server.get("/metrics").text.splitlines():
        if line.startswith("vllm:num_requests_waiting{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError("no vllm:num_requests_waiting")


def until(predicate, timeout: float = 60.0) -> None:  # noqa: ANN001
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition never became true"
        time.sleep(0.05)


def test_full_queue_is_429_then_sigterm_cancels_and_exits_clean(spawn) -> None:
    server = spawn("--pool-blocks", "96", "--max-num-seqs", "1", "--max-queue", "1", "--drain-timeout", "1")
    client = server.client()
    # A runs (the only slot) ...
    a = client.completions.create(model="smollm2-135m", prompt="Tell a long story.", max_tokens=1500,
                                  temperature=0, stream=True, extra_body={"ignore_eos": True})
    next(iter(a))
    # ... B waits in the queue (its stream has no first token yet) ...
    import threading

    b_out: dict = {}

    def run_b() -> None:
        b_out["r"] = server.client().completions.create(model="smollm2-135m", prompt="Say B.", max_tokens=3,
                                                        temperature=0, extra_body={"ignore_eos": True})

    tb = threading.Thread(target=run_b)
    tb.start()
    until(lambda: waiting(server) == 1)
    # ... so C finds the queue full. (n=2 can never run with one slot: that is a 400, not a wait.)
    with pytest.raises(openai.BadRequestError, match="n=2"):
        client.completions.create(model="smollm2-135m", prompt="Say C.", max_tokens=3, n=2)
    with pytest.raises(openai.RateLimitError) as err:
        client.completions.create(model="smollm2-135m", prompt="Say C.", max_tokens=3)
    assert err.value.status_code == 429
    assert err.value.response.headers["retry-after"] == "1"
    assert "waiting" in err.value.message and "acme" not in err.value.message
    # A hangs up: its slot goes to B, which completes normally.
    a.close()
    tb.join(120)
    assert b_out["r"].usage.completion_tokens == 3

    # Shutdown with a request running: after the 1 s drain timeout D is cancelled in the engine, and its
    # stream ends properly (finish_reason abort, then [DONE]) well before its 1500 tokens.
    d = client.completions.create(model="smollm2-135m", prompt="Another long story.", max_tokens=1500,
                                  temperature=0, stream=True, extra_body={"ignore_eos": True},
                                  stream_options={"include_usage": True})
    chunks = iter(d)
    next(chunks)
    server.proc.send_signal(signal.SIGTERM)
    rest = list(chunks)
    reasons = [c.choices[0].finish_reason for c in rest if c.choices and c.choices[0].finish_reason]
    assert reasons == ["abort"]
    assert rest[-1].usage.completion_tokens < 1500
    code, log = server.stop()
    assert code == 0, log
    assert "ledger clean at exit" in log and '"drained": true' in log, log
    assert "Traceback" not in log and "ERROR" not in log, log  # nothing had to be killed


def test_sigterm_lets_running_requests_finish(spawn) -> None:
    server = spawn("--pool-blocks", "96", "--drain-timeout", "120")
    client = server.client()
    stream = client.completions.create(model="smollm2-135m", prompt="Count to twenty:", max_tokens=24,
                                       temperature=0, stream=True, extra_body={"ignore_eos": True},
                                       stream_options={"include_usage": True})
    chunks = iter(stream)
    first = next(chunks)
    server.proc.send_signal(signal.SIGTERM)
    # New work is refused from now on (503 on an open connection, refused on a new one) ...
    def refused() -> bool:
        try:
            r = httpx.post(f"{server.v1}/completions", json={"prompt": "x", "max_tokens": 1}, trust_env=False,
                           headers={"Authorization": f"Bearer {server.keys['acme']}"}, timeout=10)
        except httpx.TransportError:
            return True
        if r.status_code != 503:
            return False
        if r.headers.get("content-type", "").startswith("application/json"):  # ours (not uvicorn's own)
            error = r.json()["error"]  # the documented shape, typed as the server's state, not the client's
            assert (error["type"], error["code"]) == ("server_error", "draining"), error
        return True

    until(refused)
    # ... while the running request streams to its end.
    rest = list(chunks)
    usage = rest[-1].usage
    assert usage.completion_tokens == 24
    assert "".join(c.choices[0].text for c in [first, *rest] if c.choices)
    engine = server.engine_pid()
    code, log = server.stop()
    assert code == 0, log
    assert "ledger clean at exit" in log, log
    assert process_gone(engine, 5)  # the engine's process went with the server: no orphan


def test_sigterm_ends_requests_held_at_a_tenant_cap(spawn) -> None:
    """At the drain timeout a request still held by its tenant's cap (queued in the engine: the ledger's
    quota said "not now") is cancelled there like the running one: both end with finish_reason abort, the
    held one with no token, and the ledger is clean."""
    server = spawn("--pool-blocks", "96", "--drain-timeout", "0.3")
    capped = server.client(server.keys["capped"])
    tokens = server.capped_blocks * server.block_size - 8  # most of the cap: one at a time
    running = capped.completions.create(model="smollm2-135m", prompt="Tell a story.", max_tokens=tokens,
                                        temperature=0, stream=True, extra_body={"ignore_eos": True})
    chunks = iter(running)
    next(chunks)
    import threading

    held: dict = {}

    def send_held() -> None:
        try:
            out = capped.completions.create(model="smollm2-135m", prompt="Another story.", max_tokens=tokens,
                                            extra_body={"ignore_eos": True})
            held["result"] = (out.choices[0].finish_reason, out.usage.completion_tokens)
        except openai.APIStatusError as exc:
            held["status"] = exc.status_code

    t = threading.Thread(target=send_held)
    t.start()
    until(lambda: waiting(server) == 1)  # held in the engine by the cap
    server.proc.send_signal(signal.SIGTERM)
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    t.join(60)
    assert reasons == ["abort"]
    assert held == {"result": ("abort", 0)}
    code, log = server.stop()
    assert code == 0 and "ledger clean at exit" in log, log
