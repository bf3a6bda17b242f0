"""The OpenAI surface of the very app `kvledger serve` runs, in-process (``inproc.py``): whole response
bodies (known answers of SmolLM2 greedy decoding, less ``id`` and ``created``), streams event by event,
``n`` > 1, prompt batches, stop strings, the ``max_tokens`` default, ``/v1/models`` and ``/health``.

A client notices every key here: a status other than 200, a missing ``id``, a wrong ``object``, usage
figures that do not add up, a chunk without ``usage: null`` when usage was asked for, a stream without
``[DONE]``.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from .inproc import KEYS, MODEL, InProcServer, standard_server

pytestmark = pytest.mark.model

CAPITALS = "The capital of France is Paris. The capital of Germany is Berlin. The capital of Italy is"
COUNT = "One, two, three,"
PLANET = [{"role": "user", "content": "Name one planet."}]


@pytest.fixture
def srv(tmp_path: Path) -> Iterator[InProcServer]:
    yield from standard_server(tmp_path)


def bare(body: dict[str, Any], prefix: str = "cmpl") -> dict[str, Any]:
    """The body less its id and creation time, after checking both are there and well formed (and that
    every choice's index is an integer: 0.0 would compare equal to 0)."""
    assert re.fullmatch(prefix + r"-[0-9a-f]{32}", body["id"]), body
    assert isinstance(body["created"], int) and body["created"] > 1_700_000_000, body
    assert all(type(c["index"]) is int for c in body["choices"]), body
    return {k: v for k, v in body.items() if k not in ("id", "created")}


def usage(prompt: int, completion: int, cached: int = 0) -> dict[str, Any]:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def completion(choices: list[tuple[str, str]], use: dict[str, Any]) -> dict[str, Any]:
    return {"object": "text_completion", "model": MODEL, "usage": use,
            "choices": [{"index": i, "text": t, "logprobs": None, "finish_reason": r}
                        for i, (t, r) in enumerate(choices)]}


def test_completions_whole_bodies_and_the_tenants_own_prefix_cache(srv: InProcServer) -> None:
    """200 with every key; the second identical request of a tenant reads one full block (16 tokens)
    from its cache, another tenant's identical request reads none (its own trust group)."""
    ask = {"model": MODEL, "prompt": CAPITALS, "max_tokens": 4, "temperature": 0}
    first = srv.post("/v1/completions", ask)
    assert first.status_code == 200 and first.headers["content-type"] == "application/json"
    assert bare(first.json()) == completion([(" Rome. The capital", "length")], usage(19, 4))
    again = srv.post("/v1/completions", {k: v for k, v in ask.items() if k != "model"})  # model is optional
    assert again.status_code == 200
    assert bare(again.json()) == completion([(" Rome. The capital", "length")], usage(19, 4, cached=16))
    assert again.json()["id"] != first.json()["id"]
    other = srv.post("/v1/completions", ask, key=KEYS["globex"])
    assert bare(other.json()) == completion([(" Rome. The capital", "length")], usage(19, 4, cached=0))


def test_prompt_batches_with_n_and_stop_strings(srv: InProcServer) -> None:
    """Choices are numbered prompt * n + branch; usage counts every prompt once and every choice's
    tokens; a stop string ends its choice (stop, the string left out) and the 16-token default applies."""
    r = srv.post("/v1/completions", {"prompt": [CAPITALS, COUNT], "max_tokens": 3, "temperature": 0, "n": 2})
    assert r.status_code == 200
    assert bare(r.json()) == completion([(" Rome. The", "length"), (" Rome. The", "length"),
                                         (" four, five", "length"), (" four, five", "length")], usage(25, 12))
    ids = srv.ctx.codec.encode(COUNT)  # a token-id prompt: the same answer
    by_ids = srv.post("/v1/completions", {"prompt": ids, "max_tokens": 8, "temperature": 0, "stop": [" five"]})
    assert bare(by_ids.json()) == completion([(" four,", "stop")], usage(6, 3, cached=0))
    default = srv.post("/v1/completions", {"prompt": COUNT, "temperature": 0})
    assert bare(default.json()) == completion(
        [(" four, five, six, seven, eight, and nine, respectively.\n", "length")], usage(6, 16))
    sampled = {"prompt": "Once upon a time", "max_tokens": 5, "temperature": 1.0, "n": 2, "seed": 1234}
    a, b = srv.post("/v1/completions", sampled).json(), srv.post("/v1/completions", sampled).json()
    assert bare(a) == bare(b) and len(a["choices"]) == 2 and a["usage"] == usage(4, 10)
    assert a["choices"][0]["text"] != a["choices"][1]["text"]  # two samples, not one twice


def test_chat_whole_body(srv: InProcServer) -> None:
    r = srv.post("/v1/chat/completions", {"model": MODEL, "messages": PLANET, "max_tokens": 5, "temperature": 0})
    assert r.status_code == 200
    assert bare(r.json(), "chatcmpl") == {
        "object": "chat.completion", "model": MODEL, "usage": usage(34, 5),
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "One planet is thought to"},
                     "logprobs": None, "finish_reason": "length"}]}
    # No max_tokens: up to the model's length; the model ends its turn itself (stop, no special token).
    r = srv.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "Reply with just: OK"}],
                                          "temperature": 0})
    assert bare(r.json(), "chatcmpl") == {
        "object": "chat.completion", "model": MODEL, "usage": usage(36, 33, cached=16),  # the template's head
        "choices": [{"index": 0, "message": {"role": "assistant", "content": (
            "I'm glad to help, but I'm not here to help with your request. I'm here to assist with any kind of "
            "editing or assistance you need.")}, "logprobs": None, "finish_reason": "stop"}]}
    # The same conversation as text parts, with tool_choice "none" and a text response_format: the same answer.
    parts = [{"role": "user", "content": [{"type": "text", "text": "Name one "}, {"type": "text", "text": "planet."}]}]
    r = srv.post("/v1/chat/completions", {"messages": parts, "max_tokens": 5, "temperature": 0, "tool_choice": "none",
                                          "response_format": {"type": "text"}})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "One planet is thought to"
    # max_completion_tokens wins over max_tokens.
    r = srv.post("/v1/chat/completions", {"messages": PLANET, "max_tokens": 50, "max_completion_tokens": 2,
                                          "temperature": 0})
    assert r.json()["choices"][0]["message"]["content"] == "One planet"
    assert r.json()["usage"]["completion_tokens"] == 2


def test_completion_stream_event_by_event(srv: InProcServer) -> None:
    status, ctype, events = srv.stream("/v1/completions", {"prompt": COUNT, "max_tokens": 3, "temperature": 0,
                                                           "stream": True, "stream_options": {"include_usage": True}})
    assert status == 200 and ctype.startswith("text/event-stream")
    assert events[-1] == "[DONE]"
    heads = {(e["id"], e["created"]) for e in events[:-1]}
    assert len(heads) == 1  # one id and one creation time for the whole stream
    assert [bare(e) for e in events[:-1]] == [
        {"object": "text_completion", "model": MODEL, "usage": None,
         "choices": [{"index": 0, "text": t, "logprobs": None, "finish_reason": r}]}
        for t, r in ((" four", None), (",", None), (" five", None), ("", "length"))
    ] + [{"object": "text_completion", "model": MODEL, "choices": [], "usage": usage(6, 3)}]
    with srv.http.stream("POST", srv.url + "/v1/completions", headers=srv.headers(KEYS["acme"]),
                         json={"prompt": COUNT, "max_tokens": 1, "stream": True}) as r:
        r.read()
        assert (r.headers["cache-control"], r.headers["x-accel-buffering"]) == ("no-cache", "no")
    # Without include_usage: no usage key at all, and no usage chunk.
    _, _, plain = srv.stream("/v1/completions", {"prompt": COUNT, "max_tokens": 3, "temperature": 0,
                                                 "stream": True})
    assert [bare(e) for e in plain[:-1]] == [
        {"object": "text_completion", "model": MODEL,
         "choices": [{"index": 0, "text": t, "logprobs": None, "finish_reason": r}]}
        for t, r in ((" four", None), (",", None), (" five", None), ("", "length"))] and plain[-1] == "[DONE]"


def test_chat_stream_event_by_event(srv: InProcServer) -> None:
    status, _, events = srv.stream("/v1/chat/completions", {"messages": PLANET, "max_tokens": 3, "temperature": 0,
                                                            "stream": True, "stream_options": {"include_usage": True}})
    assert status == 200 and events[-1] == "[DONE]"

    def chunk(delta: dict[str, Any], reason: str | None) -> dict[str, Any]:
        return {"object": "chat.completion.chunk", "model": MODEL, "usage": None,
                "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}]}

    assert [bare(e, "chatcmpl") for e in events[:-1]] == [
        chunk({"role": "assistant", "content": ""}, None), chunk({"content": "One"}, None),
        chunk({"content": " planet"}, None), chunk({"content": " is"}, None), chunk({}, "length"),
        {"object": "chat.completion.chunk", "model": MODEL, "choices": [], "usage": usage(34, 3, cached=0)}]


def test_stream_with_n_and_a_stop_string(srv: InProcServer) -> None:
    """Every choice of a streamed n=2 request ends with its own closing chunk, stop strings included."""
    _, _, events = srv.stream("/v1/completions", {"prompt": COUNT, "max_tokens": 8, "temperature": 0, "n": 2,
                                                  "stop": " five", "stream": True})
    assert events[-1] == "[DONE]"
    by_choice: dict[int, list[tuple[str, str | None]]] = {0: [], 1: []}
    for e in events[:-1]:
        (c,) = bare(e)["choices"]
        by_choice[c["index"]].append((c["text"], c["finish_reason"]))
    for steps in by_choice.values():
        assert "".join(t for t, _ in steps) == " four,"
        assert [r for _, r in steps if r is not None] == ["stop"] and steps[-1][1] == "stop"


def test_a_streamed_batch_numbers_its_choices(srv: InProcServer) -> None:
    """Two prompts, n=2: choice = prompt * n + branch, each closed once, in a stream too."""
    _, _, events = srv.stream("/v1/completions", {"prompt": [CAPITALS, COUNT], "max_tokens": 2, "temperature": 0,
                                                  "n": 2, "stream": True})
    texts: dict[int, str] = {}
    closed: list[int] = []
    for e in events[:-1]:
        (c,) = bare(e)["choices"]
        texts[c["index"]] = texts.get(c["index"], "") + c["text"]
        if c["finish_reason"] is not None:
            closed.append(c["index"])
    assert texts == {0: " Rome.", 1: " Rome.", 2: " four,", 3: " four,"} and sorted(closed) == [0, 1, 2, 3]


def test_models_and_health(srv: InProcServer) -> None:
    r = srv.get("/v1/models", key=KEYS["acme"])
    assert r.status_code == 200
    assert r.json() == {"object": "list", "data": [{"id": MODEL, "object": "model", "created": 0,
                                                    "owned_by": "kvledger", "root": MODEL, "max_model_len": 2560}]}
    assert srv.get("/v1/models", key=None).status_code == 401
    h = srv.get("/health", key=None)
    assert (h.status_code, h.json()) == (200, {"status": "ok"})
