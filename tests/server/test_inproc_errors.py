"""Every refusal of the very app `kvledger serve` runs, in-process (``inproc.py``), as a client reads it:
the status, the whole ``{"error": {"message", "type", "param", "code"}}`` body, and the headers that go
with it (``Allow`` on 405, ``Retry-After`` on 429). Also the order of the checks: a 413 is decided from
``Content-Length`` before a byte of the body is read, and a text prompt whose length in characters alone
puts it past the model's length is refused before it is tokenized.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvledger.errors import ConfigError

from .inproc import HANG_GUARD_S, KEYS, MODEL, OPERATOR_KEY, TENANTS_TOML, InProcServer, running, standard_server

pytestmark = pytest.mark.model

BODY_LIMIT = 2560 * 64 + 2**20  # the default: 64 bytes per token of the model length + 1 MiB


@pytest.fixture
def srv(tmp_path: Path) -> Iterator[InProcServer]:
    yield from standard_server(tmp_path)


def error(message: str, kind: str = "invalid_request_error", code: str | None = None,
          param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def answer(r: Any) -> tuple[int, Any]:
    assert r.headers["content-type"] == "application/json", r.headers
    return r.status_code, r.json()


def raw_request(srv: InProcServer, head: str, body: bytes = b"") -> bytes:
    """One HTTP/1.1 exchange on a plain socket; the server's whole answer (it closes or we stop at the
    end of a Content-Length body)."""
    host, port = srv.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=HANG_GUARD_S) as s:
        s.sendall(head.encode() + b"\r\n" + body)
        data = b""
        while b"\r\n\r\n" not in data:
            data += s.recv(65536)
        head_part, _, rest = data.partition(b"\r\n\r\n")
        length = int(next(line.split(b":")[1] for line in head_part.split(b"\r\n")
                          if line.lower().startswith(b"content-length")))
        while len(rest) < length:
            rest += s.recv(65536)
        return head_part + b"\r\n\r\n" + rest


UNAUTHORIZED = error("Incorrect or missing API key (Authorization: Bearer <key>)", code="invalid_api_key")
OPERATOR_ONLY = error("this endpoint is for the operator's key only", code="forbidden")


def test_keys_and_roles(srv: InProcServer) -> None:
    """401 without a known key (every route but /health); 403 for an operator that generates and for a
    tenant on the operator's routes."""
    body = {"prompt": "Hi", "max_tokens": 1}
    for key in (None, "sk-nobody"):
        assert answer(srv.post("/v1/completions", body, key=key)) == (401, UNAUTHORIZED)
        assert answer(srv.post("/v1/chat/completions", body, key=key)) == (401, UNAUTHORIZED)
        assert answer(srv.get("/metrics", key=key)) == (401, UNAUTHORIZED)
    assert answer(srv.post("/v1/completions", body, key=OPERATOR_KEY)) == (
        403, error("operator keys cannot generate; use a tenant's key", code="forbidden"))
    for path in ("/metrics", "/admin/ledger"):
        assert answer(srv.get(path, key=KEYS["acme"])) == (403, OPERATOR_ONLY)
    assert answer(srv.post("/reset_prefix_cache", key=KEYS["globex"])) == (403, OPERATOR_ONLY)


def test_routing_refusals(srv: InProcServer) -> None:
    r = srv.get("/v1/nothing-here")
    assert answer(r) == (404, error("Not Found", "not_found_error", "not_found"))
    r = srv.get("/v1/completions")
    assert answer(r) == (405, error("Method Not Allowed", code="method_not_allowed"))
    assert r.headers["allow"] == "POST"
    r = srv.post("/v1/completions", {"model": "gpt-4", "prompt": "Hi"})
    assert answer(r) == (404, error("The model `gpt-4` does not exist.", code="model_not_found"))


def test_bad_bodies_are_400_naming_the_field(srv: InProcServer) -> None:
    cases: list[tuple[str, Any, dict[str, Any]]] = [
        ("/v1/completions", b"{not json", error("the body is not valid JSON")),
        ("/v1/completions", {"prompt": "Hi", "max_tokens": 0},
         error("max_tokens: Input should be greater than or equal to 1", param="max_tokens")),
        ("/v1/completions", {"prompt": "Hi", "logprobs": 21},
         error("logprobs: Input should be less than or equal to 20", param="logprobs")),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "tools": [{"type": "function"}]},
         error("tools are not supported", param="tools")),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "tool_choice": "auto"},
         error("tool_choice is not supported", param="tool_choice")),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}],
                                  "response_format": {"type": "yaml"}},
         error("response_format type must be text, json_object or json_schema, got 'yaml'", param="response_format")),
        ("/v1/completions", {"prompt": ""}, error("prompt is empty", param="prompt")),
        ("/v1/completions", {"prompt": []}, error("prompt is empty", param="prompt")),
        ("/v1/completions", {"prompt": ["Hi"] * 33}, error("at most 32 prompts per request", param="prompt")),
        ("/v1/completions", {"prompt": [1, 49152]}, error("prompt token ids must be in [0, 49152)", param="prompt")),
        ("/v1/completions", {"prompt": "Hi", "temperature": 0, "top_p": 1, "n": 17},
         error("n: Input should be less than or equal to 16", param="n")),
    ]
    for path, body, expected in cases:
        r = srv.post(path, content=body) if isinstance(body, bytes) else srv.post(path, body)
        assert answer(r) == (400, expected), body


def test_never_fits_by_length(srv: InProcServer) -> None:
    """The model's length (2560 tokens): the prompt alone, the prompt and max_tokens, in tokens and --
    before tokenizing -- in characters."""
    r = srv.post("/v1/completions", {"prompt": [7] * 2560, "max_tokens": 1})
    assert answer(r) == (400, error("This model's maximum context length is 2560 tokens. However, your prompt has "
                                    "2560 tokens: nothing is left for the completion."))
    r = srv.post("/v1/completions", {"prompt": "One, two, three,", "max_tokens": 2555})
    assert answer(r) == (400, error("This model's maximum context length is 2560 tokens. However, you requested "
                                    "2561 tokens (6 in the prompt, 2555 in the completion). Please reduce the length "
                                    "of the prompt or completion."))
    floor = srv.ctx.codec.max_token_chars
    assert isinstance(floor, int) and floor > 1
    encoded: list[str] = []
    real_encode = srv.ctx.codec.encode
    srv.ctx.codec.encode = lambda text: encoded.append(text) or real_encode(text)  # type: ignore[method-assign]
    huge = "a" * (2560 * floor)
    r = srv.post("/v1/completions", {"prompt": huge, "max_tokens": 1})
    assert answer(r) == (400, error(f"This model's maximum context length is 2560 tokens. However, your prompt has "
                                    f"{len(huge)} characters, at least 2560 tokens: nothing is left for the "
                                    "completion.", param="prompt"))
    long = "a" * (100 * floor)
    r = srv.post("/v1/completions", {"prompt": long, "max_tokens": 2461})
    assert answer(r) == (400, error(f"This model's maximum context length is 2560 tokens. However, your prompt has "
                                    f"{len(long)} characters, at least 100 tokens, and you requested 2461 in the "
                                    "completion. Please reduce the length of the prompt or completion.",
                                    param="prompt"))
    r = srv.post("/v1/chat/completions", {"messages": [{"role": "user", "content": huge}], "max_tokens": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    assert encoded == []  # none of them reached the tokenizer
    # At the floor: tokenized, and then refused in tokens (the text has more than the floor's 100).
    r = srv.post("/v1/completions", {"prompt": long, "max_tokens": 2460})
    assert encoded == [long]
    plen = len(real_encode(long))
    assert plen > 100 and answer(r) == (400, error(
        f"This model's maximum context length is 2560 tokens. However, you requested {plen + 2460} tokens ({plen} "
        "in the prompt, 2460 in the completion). Please reduce the length of the prompt or completion."))


def test_a_tenants_cap(srv: InProcServer) -> None:
    """The capped tenant (6 blocks of 16 tokens): asking past its cap is a 400 naming its own cap only;
    without max_tokens the default is the most its cap allows."""
    r = srv.post("/v1/completions", {"prompt": "One, two, three,", "max_tokens": 200}, key=KEYS["capped"])
    status, body = answer(r)
    assert status == 400 and body["error"]["type"] == "invalid_request_error"
    assert body["error"]["code"] is None and body["error"]["param"] is None
    assert body["error"]["message"].startswith("Your tenant's KV block cap can never hold this request (")
    assert body["error"]["message"].endswith("). Lower max_tokens or n.")
    assert "acme" not in body["error"]["message"] and "globex" not in body["error"]["message"]
    r = srv.post("/v1/completions", {"prompt": [42] * 96, "max_tokens": None}, key=KEYS["capped"])
    assert answer(r) == (400, error(
        "Your tenant's KV block cap can never hold this request (this request is larger than its trust group's "
        "quota: it needs 7 blocks (96 + 1 tokens) but its trust group's quota is 6 blocks). Lower max_tokens or n."))
    for plen in (85, 90):  # no max_tokens: the most the cap allows, 96 tokens in all
        r = srv.post("/v1/completions", {"prompt": [42] * plen, "max_tokens": None, "ignore_eos": True,
                                         "temperature": 0}, key=KEYS["capped"])
        assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length"
        assert (r.json()["usage"]["prompt_tokens"], r.json()["usage"]["completion_tokens"]) == (plen, 96 - plen)


def test_413_before_the_body_and_while_reading_it(srv: InProcServer) -> None:
    too_large = error(f"the request body is larger than the {BODY_LIMIT} bytes this server accepts",
                      code="request_too_large")
    # Content-Length past the limit: answered without sending (or reading) one byte of the body.
    raw = raw_request(srv, f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEYS['acme']}\r\n"
                           f"Content-Type: application/json\r\nContent-Length: {BODY_LIMIT + 1}\r\n")
    assert raw.startswith(b"HTTP/1.1 413 ")
    import json

    assert json.loads(raw.partition(b"\r\n\r\n")[2]) == too_large

    def chunks() -> Iterator[bytes]:  # no Content-Length: refused once the bytes read pass the limit
        yield b'{"prompt": "'
        for _ in range(BODY_LIMIT // 65536 + 2):
            yield b"a" * 65536

    assert answer(srv.post("/v1/completions", content=chunks())) == (413, too_large)
    at_limit = srv.post("/v1/completions", content=b" " * (BODY_LIMIT - 2) + b"{}")  # read whole: inclusive
    assert answer(at_limit) == (400, error("prompt: Field required", param="prompt"))


def test_queue_full_is_429_with_retry_after(tmp_path: Path) -> None:
    """One running slot and one waiting place: the third request is a 429 (Retry-After: 1); n above the
    running slots can never run (400, not a wait)."""
    with running(tmp_path, "--pool-blocks", "96", "--max-num-seqs", "1", "--max-queue", "1") as srv:
        r = srv.post("/v1/completions", {"prompt": ["Hi", "Yo", "Ok"], "max_tokens": 1})
        assert answer(r) == (400, error("3 prompts are more than this server's queue of 1 can hold", param="prompt"))
        r = srv.post("/v1/completions", {"prompt": "Hi", "max_tokens": 2, "n": 2})
        assert answer(r) == (400, error("n=2 samples can never run at once here (at most 1 sequences run at a time)",
                                        param="n"))
        with srv.http.stream("POST", srv.url + "/v1/completions", headers=srv.headers(KEYS["acme"]),
                             json={"prompt": "Tell a long story.", "max_tokens": 1500, "ignore_eos": True,
                                   "temperature": 0, "stream": True}) as a:
            a_lines = a.iter_lines()  # kept: a dropped iterator closes the connection (A would be gone)
            next(a_lines)  # A runs
            out: dict[str, Any] = {}
            b = threading.Thread(target=lambda: out.update(r=srv.post("/v1/completions", {
                "prompt": "Say B.", "max_tokens": 3, "temperature": 0, "ignore_eos": True})))
            b.start()
            deadline = time.monotonic() + HANG_GUARD_S
            while srv.metrics()[f'vllm:num_requests_waiting{{engine="0",model_name="{MODEL}"}}'] != 1:
                assert time.monotonic() < deadline
                time.sleep(0.02)
            r = srv.post("/v1/completions", {"prompt": "Say C.", "max_tokens": 3})
            assert answer(r) == (429, error("too many requests are waiting; retry later", "rate_limit_error",
                                            "queue_full"))
            assert r.headers["retry-after"] == "1"
        b.join(HANG_GUARD_S)  # A hung up: B gets the slot
        assert out["r"].status_code == 200 and out["r"].json()["usage"]["completion_tokens"] == 3
        m = srv.metrics()
        assert m['kvledger:requests_refused_total{reason="queue_full"}'] == 1
        assert m['kvledger:requests_refused_total{reason="never_fits"}'] == 1
        srv.wait_idle()


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the engine thread's "boom"
def test_an_engine_failure_is_500_and_health_says_error(tmp_path: Path) -> None:
    """The engine thread dies in its second step (the first admitted a request): that request gets 500
    engine_failed, a later stream an error event and [DONE], /health 503 error; at exit the engine did not
    drain, the ledger is not clean (the dead request still holds its blocks) and `kvledger serve` fails."""
    def fail(engine: Any) -> None:
        real_step, steps = engine.step, []

        def step() -> Any:
            steps.append(1)
            if len(steps) > 1:
                raise RuntimeError("boom")
            return real_step()
        engine.step = step

    with running(tmp_path, "--pool-blocks", "32", engine_hook=fail) as srv:
        r = srv.post("/v1/completions", {"prompt": "Hi", "max_tokens": 2})
        assert answer(r) == (500, error("the engine stopped: boom", "server_error", "engine_failed"))
        assert answer(srv.get("/health", key=None)) == (503, {"status": "error"})
        status, _, events = srv.stream("/v1/completions", {"prompt": "Hi", "max_tokens": 2, "stream": True})
        assert status == 200
        assert events == [error("the engine stopped: boom", "server_error", "engine_failed"), "[DONE]"]
    report = srv.report()
    assert report is not None and report["drained"] is False and report["clean"] is False
    assert report["sequences"] == 1 and report["running"] == 1
    assert srv.lines[-1].startswith("kvledger serve: ledger NOT clean at exit: {")
    assert isinstance(srv.error, ConfigError)
    assert str(srv.error) == "the ledger was not clean at exit (see the report above)"


def test_request_workers_refuse_a_bad_thread_count() -> None:
    """``ServerSettings.request_threads`` (a library setting): one clear error, at least one thread, and a
    tenant gets all but one of them (at least one)."""
    from kvledger.server.app import RequestWorkers

    for bad in (0, -1, True, 1.5, "2"):
        with pytest.raises(ValueError, match=r"^request_threads must be an integer >= 1, got " + repr(bad)
                           .replace(".", r"\.") + "$"):
            RequestWorkers(bad)  # type: ignore[arg-type]
    for threads, per_tenant in ((1, 1), (2, 1), (3, 2)):
        workers = RequestWorkers(threads)
        assert (workers.per_tenant, workers.inline_bytes, workers._pool._max_workers) == (per_tenant, 8192, threads)
        workers.close()


LIMITED_TENANTS = TENANTS_TOML + """
[tenants.vip]
api_keys = ["sk-test-vip"]
priority = 5
max_requests = 2
"""


def test_a_tenants_priority_and_request_limit(tmp_path: Path) -> None:
    """One running slot: a waiting request of a tenant with priority 5 runs before an earlier one of
    priority 0 (the scheduler's rule: larger runs first). The tenant's max_requests of 2: two prompts in
    one request are served, three can never be (400)."""
    vip = "sk-test-vip"
    with running(tmp_path, "--pool-blocks", "96", "--max-num-seqs", "1", tenants=LIMITED_TENANTS) as srv:
        r = srv.post("/v1/completions", {"prompt": ["Hi", "Yo"], "max_tokens": 1, "temperature": 0}, key=vip)
        assert r.status_code == 200 and len(r.json()["choices"]) == 2
        r = srv.post("/v1/completions", {"prompt": ["Hi", "Yo", "Ok"], "max_tokens": 1}, key=vip)
        assert answer(r) == (400, error("3 prompts are more than your tenant's limit of 2 requests in flight at "
                                        "once", param="prompt"))
        order: list[str] = []
        ask = {"max_tokens": 2, "temperature": 0, "ignore_eos": True}
        threads = [threading.Thread(target=lambda k=k, name=name: (srv.post("/v1/completions", {
            **ask, "prompt": f"Say {name}."}, key=k), order.append(name))) for k, name in
            ((KEYS["acme"], "plain"), (vip, "vip"))]
        with srv.http.stream("POST", srv.url + "/v1/completions", headers=srv.headers(KEYS["globex"]),
                             json={"prompt": "Tell a long story.", "max_tokens": 1500, "ignore_eos": True,
                                   "temperature": 0, "stream": True}) as a:
            a_lines = a.iter_lines()
            next(a_lines)  # the slot is taken
            for waiting, t in enumerate(threads, start=1):
                t.start()
                deadline = time.monotonic() + HANG_GUARD_S
                while srv.metrics()[f'vllm:num_requests_waiting{{engine="0",model_name="{MODEL}"}}'] != waiting:
                    assert time.monotonic() < deadline
                    time.sleep(0.02)
        for t in threads:  # the long one hung up: the vip's request runs first, though it came second
            t.join(HANG_GUARD_S)
        assert order == ["vip", "plain"]
