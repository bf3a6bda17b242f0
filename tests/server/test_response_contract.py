"""What a client reads of a successful answer, over plain HTTP (the official client hides the status and
tolerates missing fields): 200, OpenAI's envelope fields, and the streamed chunks' shape."""

from __future__ import annotations

import json

import httpx

from .conftest import needs_smol

pytestmark = needs_smol


def _post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.v1}{path}", json=body, trust_env=False, timeout=120,
                      headers={"Authorization": f"Bearer {server.keys['acme']}"})


def test_a_completion_is_200_with_openais_envelope(server) -> None:
    resp = _post(server, "/completions", {"model": "smollm2-135m", "prompt": "Hello", "max_tokens": 2})
    assert resp.status_code == 200 and resp.headers["content-type"].startswith("application/json")
    body = resp.json()
    assert body["object"] == "text_completion" and body["id"] and body["model"] == "smollm2-135m"
    assert isinstance(body["created"], int) and body["created"] > 0
    assert [c["index"] for c in body["choices"]] == [0] and body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 2


def test_a_chat_completion_is_200_with_openais_envelope(server) -> None:
    resp = _post(server, "/chat/completions", {"model": "smollm2-135m", "max_tokens": 2,
                                               "messages": [{"role": "user", "content": "Hi"}]})
    assert resp.status_code == 200
    body = resp.json()
    assert body["object"] == "chat.completion" and body["id"]
    assert body["choices"][0]["message"]["role"] == "assistant"


def test_a_stream_is_200_event_stream_with_one_id_and_done(server) -> None:
    with httpx.stream("POST", f"{server.v1}/completions", trust_env=False, timeout=120,
                      json={"model": "smollm2-135m", "prompt": "Hello", "max_tokens": 3, "stream": True},
                      headers={"Authorization": f"Bearer {server.keys['acme']}"}) as resp:
        assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in resp.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]
    assert len({c["id"] for c in chunks}) == 1 and all(c["object"] == "text_completion" for c in chunks)
