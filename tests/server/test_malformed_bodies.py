"""Malformed request bodies are the client's input, so each is a 400 in the documented JSON error shape on
every POST endpoint -- never a plain-text 500: JSON nested past the parser's depth, an integer past
CPython's 4,300-digit bound, a string with a lone UTF-16 surrogate."""

from __future__ import annotations

import json

import httpx
import pytest

from kvledger.server.protocol import BadRequestBody, read_request

ENDPOINTS = {"/v1/completions": "prompt", "/v1/chat/completions": "messages"}
VALID = {"prompt": '"hi"', "messages": '[{"role": "user", "content": "hi"}]'}
DEEP = "[" * 100_000 + "]" * 100_000
HUGE_INT = "9" * 5_000


def bodies(field: str) -> dict[str, str]:
    """The malformed bodies for an endpoint whose input is ``field``: raw JSON text."""
    lone = '"\\ud800"' if field == "prompt" else '[{"role": "user", "content": "\\ud800"}]'
    return {
        "deep_nesting": f'{{"model": "smollm2-135m", "{field}": {DEEP}}}',
        "huge_integer": f'{{"model": "smollm2-135m", "{field}": {VALID[field]}, "max_tokens": {HUGE_INT}}}',
        "lone_surrogate": f'{{"model": "smollm2-135m", "{field}": {lone}, "max_tokens": 2}}',
        # a lone surrogate anywhere, not only in the prompt (the model name is echoed in a 404)
        "lone_surrogate_in_model": f'{{"model": "\\udc00", "{field}": {VALID[field]}, "max_tokens": 2}}',
    }


CASES = [(path, kind) for path, field in ENDPOINTS.items() for kind in bodies(field)]


def assert_error_shape(resp: httpx.Response) -> dict:
    assert resp.status_code == 400, (resp.status_code, resp.text[:300])
    assert resp.headers["content-type"].startswith("application/json")
    body = resp.json()
    assert set(body) == {"error"}
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error"
    assert isinstance(error["message"], str) and error["message"]
    return error


# ---- the parser, without a server -----------------------------------------------------------------
@pytest.mark.parametrize("path, kind", CASES)
def test_malformed_bodies_are_one_typed_error(path: str, kind: str) -> None:
    with pytest.raises(BadRequestBody):
        read_request(bodies(ENDPOINTS[path])[kind].encode(), chat=path.endswith("chat/completions"))


def test_a_surrogate_pair_is_a_character_not_an_error() -> None:
    body = read_request(b'{"prompt": "\\ud83d\\ude00 and a backslash-u text: \\\\ud800"}', chat=False)
    assert body.prompt == "\U0001F600 and a backslash-u text: \\ud800"
    with pytest.raises(BadRequestBody, match="valid JSON"):
        read_request(b'{"prompt": "hi"', chat=False)
    with pytest.raises(BadRequestBody, match="prompt"):
        read_request(b'{"prompt": 3}', chat=False)


# ---- a live server --------------------------------------------------------------------------------
@pytest.mark.model
@pytest.mark.parametrize("path, kind", CASES)
def test_malformed_bodies_are_400_json_on_every_post_endpoint(server, path: str, kind: str) -> None:
    raw = bodies(ENDPOINTS[path])[kind].encode()
    resp = httpx.post(f"{server.url}{path}", content=raw, trust_env=False, timeout=120,
                      headers={"Authorization": f"Bearer {server.keys['acme']}",
                               "Content-Type": "application/json"})
    error = assert_error_shape(resp)
    json.dumps(error, ensure_ascii=False).encode()  # the answer itself is valid Unicode
    assert httpx.get(f"{server.url}/health", trust_env=False).json() == {"status": "ok"}


@pytest.mark.model
@pytest.mark.parametrize("method, path, status", [("DELETE", "/health", 405), ("GET", "/v1/completions", 405),
                                                  ("PUT", "/v1/chat/completions", 405), ("GET", "/v1/nowhere", 404)])
def test_an_unknown_path_or_method_is_the_documented_error(server, method: str, path: str, status: int) -> None:
    """Found by the schema fuzz: Starlette's own {"detail": ...} answered these."""
    resp = httpx.request(method, f"{server.url}{path}", trust_env=False, timeout=60,
                         headers={"Authorization": f"Bearer {server.keys['acme']}"})
    assert resp.status_code == status
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] in ("not_found", "method_not_allowed")
    if status == 405:
        assert resp.headers.get("allow")
