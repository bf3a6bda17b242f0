"""Logprobs, echo with prompt logprobs, penalties, min_tokens, logit_bias and stop_token_ids through the
official `openai` client against the app `kvledger serve` runs (in-process, real SmolLM2).

Logprobs are vLLM's default (``raw_logprobs``): the log-softmax of the model's own logits before any
processing; the reference is a teacher-forced pass through the runtime (``tests/runtime/test_engine_logprobs``).
"""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest
import torch

from logprob_reference import stepwise, teacher_forced

from .inproc import KEYS, MODEL, InProcServer, standard_server

pytestmark = pytest.mark.model

CAPITALS = "The capital of France is Paris. The capital of Germany is Berlin. The capital of Italy is"
PLANET = [{"role": "user", "content": "Name one planet."}]


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[InProcServer]:
    yield from standard_server(tmp_path_factory.mktemp("sampling"))


def client(srv: InProcServer) -> Any:
    import openai

    return openai.OpenAI(base_url=srv.url + "/v1", api_key=KEYS["acme"], max_retries=0, timeout=120,
                         http_client=httpx.Client(trust_env=False, timeout=120))


def close(a: float, b: float, tol: float = 1e-5) -> bool:
    return abs(a - b) < tol


def test_completion_logprobs_stream_and_not_equal_teacher_forcing(srv: InProcServer) -> None:
    """``logprobs: 3``: each token's text, its logprob (equal to teacher-forced decoding within 1e-5),
    a top dict of the token and its 3 best alternatives, text offsets; the stream carries the same."""
    c = client(srv)
    r = c.completions.create(model=MODEL, prompt=CAPITALS, max_tokens=5, temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    codec, engine = srv.ctx.codec, srv.engine
    prompt = codec.encode(CAPITALS)
    out = [codec.encode(t)[0] if len(codec.encode(t)) == 1 else None for t in lp.tokens]
    assert "".join(lp.tokens) == r.choices[0].text and None not in out
    ref = stepwise(engine, prompt, out)
    assert all(close(v, ref[i, t].item()) for i, (t, v) in enumerate(zip(out, lp.token_logprobs, strict=True)))
    for i, top in enumerate(lp.top_logprobs):
        best = torch.topk(ref[i], 3)
        assert len(top) == 3  # greedy: the token is the best one, so the token and 3 alternatives are 3
        assert [codec.decode([t]) for t in best.indices.tolist()] == list(top)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    streamed = list(c.completions.create(model=MODEL, prompt=CAPITALS, max_tokens=5, temperature=0, logprobs=3,
                                         stream=True))
    tokens = [t for ch in streamed for t in (ch.choices[0].logprobs.tokens if ch.choices[0].logprobs else [])]
    values = [v for ch in streamed for v in (ch.choices[0].logprobs.token_logprobs if ch.choices[0].logprobs else [])]
    assert tokens == lp.tokens and all(close(a, b) for a, b in zip(values, lp.token_logprobs, strict=True))


def test_chat_logprobs_and_top_logprobs_stream_and_not(srv: InProcServer) -> None:
    """Chat: ``choices[].logprobs.content[]`` with token, logprob, bytes and ``top_logprobs`` entries."""
    c = client(srv)
    r = c.chat.completions.create(model=MODEL, messages=PLANET, max_tokens=6, temperature=0, logprobs=True,
                                  top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert "".join(e.token for e in content) == r.choices[0].message.content
    codec = srv.ctx.codec
    prompt = codec.encode_chat(codec.chat_text(PLANET, True))
    out = [codec.encode(e.token)[0] for e in content]
    ref = stepwise(srv.engine, prompt, out)
    for i, e in enumerate(content):
        assert e.bytes == list(e.token.encode("utf-8"))
        assert close(e.logprob, ref[i, out[i]].item())
        assert len(e.top_logprobs) == 2 and e.top_logprobs[0].token == e.token
        assert close(e.top_logprobs[1].logprob, torch.topk(ref[i], 2).values[1].item())
    plain = c.chat.completions.create(model=MODEL, messages=PLANET, max_tokens=2, temperature=0, logprobs=True)
    assert [e.top_logprobs for e in plain.choices[0].logprobs.content] == [[], []]
    assert c.chat.completions.create(model=MODEL, messages=PLANET, max_tokens=2).choices[0].logprobs is None
    chunks = list(c.chat.completions.create(model=MODEL, messages=PLANET, max_tokens=6, temperature=0,
                                            logprobs=True, top_logprobs=2, stream=True))
    streamed = [e for ch in chunks if ch.choices and ch.choices[0].logprobs for e in ch.choices[0].logprobs.content]
    assert [e.token for e in streamed] == [e.token for e in content]
    assert all(close(a.logprob, b.logprob) for a, b in zip(streamed, content, strict=True))


def test_logprob_limits_are_400_naming_the_field(srv: InProcServer) -> None:
    for path, body, param in [
        ("/v1/completions", {"prompt": "Hi", "logprobs": 21}, "logprobs"),
        ("/v1/completions", {"prompt": "Hi", "logprobs": -1}, "logprobs"),
        ("/v1/chat/completions", {"messages": PLANET, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ("/v1/chat/completions", {"messages": PLANET, "top_logprobs": 2}, "top_logprobs"),
    ]:
        r = srv.post(path, body)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == param and r.json()["error"]["type"] == "invalid_request_error"
    assert srv.post("/v1/completions", {"prompt": "Hi", "logprobs": 20, "max_tokens": 1}).status_code == 200


def test_echo_with_prompt_logprobs_equals_a_teacher_forced_pass(srv: InProcServer) -> None:
    """``echo`` + ``logprobs``: the text starts with the prompt, the prompt's tokens come first with the
    first one's logprob None, every other prompt logprob equals one teacher-forced prefill within 1e-5,
    also when the prompt is in the prefix cache (it is computed again) and when streamed (lm-eval's
    loglikelihood request: max_tokens 1, logprobs 1, echo)."""
    c = client(srv)
    codec = srv.ctx.codec
    prompt = codec.encode(CAPITALS)
    ref = teacher_forced(srv.engine, prompt)
    c.completions.create(model=MODEL, prompt=CAPITALS, max_tokens=1, temperature=0)  # cache the prompt
    for _ in range(2):
        r = c.completions.create(model=MODEL, prompt=CAPITALS, max_tokens=1, temperature=0, logprobs=1, echo=True)
        ch = r.choices[0]
        assert ch.text.startswith(CAPITALS) and len(ch.text) > len(CAPITALS)
        lp = ch.logprobs
        assert len(lp.tokens) == len(prompt) + 1
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        for i in range(1, len(prompt)):
            assert close(lp.token_logprobs[i], ref[i - 1, prompt[i]].item())
            assert codec.decode([prompt[i]]) in lp.top_logprobs[i] and 1 <= len(lp.top_logprobs[i]) <= 2
        assert "".join(lp.tokens) == ch.text
        assert lp.text_offset[len(prompt)] == len("".join(lp.tokens[:len(prompt)]))
    streamed = list(c.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0, logprobs=0,
                                         echo=True, stream=True))
    text = "".join(ch.choices[0].text for ch in streamed)
    assert text.startswith(codec.decode(prompt))
    values = [v for ch in streamed if ch.choices[0].logprobs for v in ch.choices[0].logprobs.token_logprobs]
    assert len(values) == len(prompt) + 2 and values[0] is None
    assert all(close(values[i], ref[i - 1, prompt[i]].item()) for i in range(1, len(prompt)))
    plain = c.completions.create(model=MODEL, prompt=CAPITALS, max_tokens=2, temperature=0, echo=True)
    assert plain.choices[0].text.startswith(CAPITALS) and plain.choices[0].logprobs is None


COUNT = "One, two, three,"


def test_logit_bias_min_tokens_stop_token_ids_and_penalties_on_the_model(srv: InProcServer) -> None:
    """What a client sees: logit_bias +100 forces a token, -100 bans the greedy one; min_tokens keeps a
    chat answer going past its end-of-turn token; a stop token id ends the output where it is sampled;
    the penalties change a repetitive greedy output (their formulas: tests/runtime/test_sampling_processors)."""
    c = client(srv)
    codec = srv.ctx.codec
    forced = codec.encode(" banana")[0]
    r = c.completions.create(model=MODEL, prompt=COUNT, max_tokens=3, temperature=0, logit_bias={str(forced): 100})
    assert r.choices[0].text == " banana" * 3
    base = c.completions.create(model=MODEL, prompt=COUNT, max_tokens=8, temperature=0)
    assert base.choices[0].text == " four, five, six, seven,"
    banned = codec.encode(" four")[0]
    r = c.completions.create(model=MODEL, prompt=COUNT, max_tokens=2, temperature=0, logit_bias={str(banned): -100})
    assert not r.choices[0].text.startswith(" four")
    # min_tokens: the answer ends with its end-of-turn token, unless that is masked until 8 more are out.
    short = c.chat.completions.create(model=MODEL, messages=PLANET, max_tokens=60, temperature=0)
    assert short.choices[0].finish_reason == "stop"
    least = short.usage.completion_tokens + 8
    longer = c.chat.completions.create(model=MODEL, messages=PLANET, max_tokens=60, temperature=0,
                                       extra_body={"min_tokens": least})
    assert longer.usage.completion_tokens >= least
    assert longer.choices[0].message.content.startswith(short.choices[0].message.content)
    # ... and stop strings count only after min_tokens (vLLM's rule): the first comma is past the 3rd token.
    r = c.completions.create(model=MODEL, prompt=COUNT, max_tokens=8, temperature=0, stop=[","])
    assert r.choices[0].text == " four"
    r = c.completions.create(model=MODEL, prompt=COUNT, max_tokens=8, temperature=0, stop=[","],
                             extra_body={"min_tokens": 3})
    assert r.choices[0].text == " four, five"
    # stop_token_ids: " six" ends the output (vLLM's extension; the stop token's text is not in the output)
    six = codec.encode(" six")[0]
    r = c.completions.create(model=MODEL, prompt=COUNT, max_tokens=8, temperature=0,
                             extra_body={"stop_token_ids": [six]})
    assert r.choices[0].finish_reason == "stop" and r.choices[0].text == " four, five,"
    assert r.usage.completion_tokens == 5
    # Penalties (known greedy answers): a repeated comma costs its count (frequency: the list stops at its
    # fourth comma) or a fixed amount (presence: "respectively" goes); repetition covers the prompt's too.
    for extra, text in [({}, " four, five, six, seven, eight, and nine, respectively.\n"),
                        ({"presence_penalty": 2.0}, " four, five, six, seven, eight, and nine.\n\nThe"),
                        ({"frequency_penalty": 2.0}, " four, five, six and seven are all the same.\n\nThe number"),
                        ({"extra_body": {"repetition_penalty": 1.8}}, " four...\n* 10: I'm not sure if it's a")]:
        r = c.completions.create(model=MODEL, prompt=COUNT, max_tokens=16, temperature=0, **extra)
        assert r.choices[0].text == text, extra


def test_processor_fields_are_bounded_with_400s_naming_the_field(srv: InProcServer) -> None:
    for body, param in [
        ({"presence_penalty": 2.5}, "presence_penalty"), ({"frequency_penalty": -2.01}, "frequency_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"), ({"min_tokens": -1}, "min_tokens"),
        ({"min_tokens": 5, "max_tokens": 4}, "min_tokens"), ({"logit_bias": {"12": 101}}, "logit_bias"),
        ({"logit_bias": {"abc": 1}}, "logit_bias"), ({"logit_bias": {"49152": 1}}, "logit_bias"),
        ({"logit_bias": {"-1": 1}}, "logit_bias"), ({"logit_bias": {str(t): 1 for t in range(1025)}}, "logit_bias"),
        ({"stop_token_ids": [49152]}, "stop_token_ids"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"), ({"stop_token_ids": list(range(257))}, "stop_token_ids"),
    ]:
        r = srv.post("/v1/completions", {"prompt": "Hi", **body})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)


# ---- vLLM's tokenizer endpoints and /version ------------------------------------------------------------
def test_tokenize_detokenize_and_version(srv: InProcServer) -> None:
    """vLLM's shapes: /tokenize {prompt | messages} -> {count, max_model_len, tokens, token_strs};
    /detokenize {tokens} -> {prompt}; /version -> {version}."""
    import kvledger

    codec = srv.ctx.codec
    r = srv.post("/tokenize", {"model": MODEL, "prompt": CAPITALS})
    ids = codec.encode(CAPITALS)
    assert r.status_code == 200
    assert r.json() == {"count": len(ids), "max_model_len": srv.ctx.settings.max_model_len, "tokens": ids,
                        "token_strs": None}
    chat = srv.post("/tokenize", {"messages": PLANET, "return_token_strs": True}).json()
    assert chat["tokens"] == codec.encode_chat(codec.chat_text(PLANET, True))
    assert "".join(chat["token_strs"]) == codec.chat_text(PLANET, True)
    assert srv.post("/detokenize", {"model": MODEL, "tokens": ids}).json() == {"prompt": CAPITALS}
    assert srv.get("/version", key=None).json() == {"version": kvledger.__version__}
    for path, body, status, param in [
        ("/tokenize", {}, 400, "prompt"), ("/tokenize", {"prompt": "a", "messages": PLANET}, 400, "prompt"),
        ("/tokenize", {"prompt": 5}, 400, "prompt"), ("/tokenize", {"prompt": "a", "model": "gpt-4"}, 404, "model"),
        ("/detokenize", {"tokens": [49152]}, 400, "tokens"), ("/detokenize", {"tokens": [-1]}, 400, "tokens"),
        ("/detokenize", {}, 400, "tokens"),
    ]:
        r = srv.post(path, body)
        assert r.status_code == status and r.json()["error"]["param"] == param, (path, body, r.text)
    assert srv.post("/tokenize", {"prompt": "a"}, key=None).status_code == 401


# ---- response_format: JSON mode and JSON schema (llguidance) ---------------------------------------------
SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20}}, "required": ["name"],
     "additionalProperties": False},
    {"type": "object", "properties": {"planet": {"enum": ["Mercury", "Venus", "Earth", "Mars"]},
                                      "moons": {"type": "integer", "minimum": 0, "maximum": 200}},
     "required": ["planet", "moons"], "additionalProperties": False},
    {"type": "object", "properties": {"items": {"type": "array", "items": {"type": "integer"}, "minItems": 1,
                                                "maxItems": 3}}, "required": ["items"], "additionalProperties": False},
    {"type": "object", "properties": {"ok": {"type": "boolean"}, "score": {"type": "number"}},
     "required": ["ok", "score"], "additionalProperties": False},
    {"type": "object", "properties": {"city": {"type": "string", "pattern": "^[A-Z][a-z]{1,12}$"},
                                      "country": {"type": "string", "maxLength": 16}},
     "required": ["city", "country"], "additionalProperties": False},
]


@pytest.mark.skipif(importlib.util.find_spec("llguidance") is None, reason="llguidance is not installed")
def test_response_format_json_schema_outputs_parse_and_validate(srv: InProcServer) -> None:
    """Every answer under a json_schema parses and validates against its schema (greedy and sampled,
    n = 2, and streamed); json_object answers are JSON objects; a schema llguidance cannot compile is a 400
    naming response_format."""
    import jsonschema

    c = client(srv)
    ask = [{"role": "user", "content": "Describe a planet as JSON."}]
    for i, schema in enumerate(SCHEMAS):
        fmt = {"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": schema, "strict": True}}
        r = c.chat.completions.create(model=MODEL, messages=ask, max_tokens=80, temperature=0 if i % 2 else 0.8,
                                      seed=i, n=2, response_format=fmt)
        for ch in r.choices:
            assert ch.finish_reason == "stop", ch
            jsonschema.validate(json.loads(ch.message.content), schema)
    chunks = list(c.chat.completions.create(model=MODEL, messages=ask, max_tokens=80, temperature=0, stream=True,
                                            response_format={"type": "json_schema",
                                                             "json_schema": {"name": "x", "schema": SCHEMAS[1]}}))
    jsonschema.validate(json.loads("".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)),
                        SCHEMAS[1])
    r = c.chat.completions.create(model=MODEL, messages=ask, max_tokens=60, temperature=0,
                                  response_format={"type": "json_object"})
    assert r.choices[0].finish_reason == "stop" and isinstance(json.loads(r.choices[0].message.content), dict)
    for fmt in ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}},
                {"type": "json_schema"}, {"type": "yaml"}, {"type": "json_schema", "json_schema": {"schema": 3}}):
        r = srv.post("/v1/chat/completions", {"messages": ask, "response_format": fmt})
        assert r.status_code == 400 and r.json()["error"]["param"] == "response_format", (fmt, r.text)
    assert srv.wait_idle()["clean"]


def fifty_schemas() -> list[dict[str, Any]]:
    """50 JSON schemas from a few templates (every string and array bounded, so a greedy small model ends)."""
    leaves: list[dict[str, Any]] = [
        {"type": "string", "maxLength": 12}, {"type": "integer", "minimum": 0, "maximum": 999},
        {"type": "boolean"}, {"enum": ["red", "green", "blue"]}, {"type": "number", "minimum": -10, "maximum": 10},
        {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 1, "maxItems": 4},
        {"type": ["string", "null"], "maxLength": 8}, {"const": "fixed"},
        {"type": "string", "pattern": "^[a-z]{2,6}$"},
        {"anyOf": [{"type": "integer", "minimum": 1, "maximum": 5}, {"type": "string", "maxLength": 5}]},
    ]
    names = ["name", "count", "ok", "color", "score", "digits", "note", "kind", "code", "pick"]
    out = []
    for i in range(50):
        a, b = leaves[i % 10], leaves[(i * 3 + 1) % 10]
        props = {names[i % 10]: a, names[(i * 3 + 1) % 10] + "_2": b}
        if i % 5 == 4:  # nested
            props["inner"] = {"type": "object", "properties": {"v": leaves[(i + 2) % 10]}, "required": ["v"],
                              "additionalProperties": False}
        required = list(props) if i % 2 == 0 else list(props)[:1]
        out.append({"type": "object", "properties": props, "required": required, "additionalProperties": False})
    return out


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("llguidance") is None, reason="llguidance is not installed")
def test_fifty_json_schemas_all_parse_and_validate(srv: InProcServer) -> None:
    """The issue's target: on a 50-schema set every greedy answer parses and validates (100%)."""
    import jsonschema

    c = client(srv)
    ask = [{"role": "user", "content": "Answer with a JSON object."}]
    schemas = fifty_schemas()

    def answer(i: int) -> Any:
        return c.chat.completions.create(model=MODEL, messages=ask, max_tokens=120, temperature=0,
                                         response_format={"type": "json_schema",
                                                          "json_schema": {"name": f"s{i}", "schema": schemas[i]}})

    with ThreadPoolExecutor(16) as pool:  # all in flight at once: the engine batches them
        answers = list(pool.map(answer, range(len(schemas))))
    bad = []
    for i, (schema, r) in enumerate(zip(schemas, answers, strict=True)):
        jsonschema.Draft202012Validator.check_schema(schema)
        text = r.choices[0].message.content
        try:
            jsonschema.validate(json.loads(text), schema)
        except (ValueError, jsonschema.ValidationError) as exc:
            bad.append((i, r.choices[0].finish_reason, text, str(exc)[:120]))
    assert bad == []
