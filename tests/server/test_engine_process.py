"""`kvledger serve` with its engine in a process of its own (the default; the live server tests of this
package all run through it): what only that seam can break -- a child that dies, a child left behind, a
grammar that must be rebuilt on the far side, and the wire carrying every field of what it carries."""

from __future__ import annotations

import json
import os
import signal
import time

import pytest

from .conftest import process_gone

pytestmark = pytest.mark.model

def test_response_format_schema_is_rebuilt_in_the_engine_process(server) -> None:
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": False}
    out = server.client().chat.completions.create(
        model="smollm2-135m", messages=[{"role": "user", "content": "A person as JSON."}], max_tokens=60,
        temperature=0, response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": schema}})
    body = json.loads(out.choices[0].message.content)
    assert set(body) == {"name", "age"} and isinstance(body["age"], int)
    assert out.choices[0].finish_reason == "stop"


def test_a_dead_engine_process_fails_requests_fast_and_the_server_exits(spawn) -> None:
    import httpx
    import openai

    server = spawn("--pool-blocks", "96", "--drain-timeout", "1")
    pid = server.engine_pid()
    client = server.client()
    stream = client.completions.create(model="smollm2-135m", prompt="Tell a long story.", max_tokens=1500,
                                       temperature=0, stream=True, extra_body={"ignore_eos": True})
    chunks = iter(stream)
    next(chunks)
    os.kill(pid, signal.SIGKILL)  # the engine dies mid-stream (out of memory, a crash)
    started = time.monotonic()
    with pytest.raises(openai.APIError, match="engine"):  # the stream ends with the error event
        for _ in chunks:
            pass
    assert time.monotonic() - started < 10
    with pytest.raises(openai.InternalServerError) as err:  # later requests: a 500 at once, no hang
        client.completions.create(model="smollm2-135m", prompt="Hi", max_tokens=2)
    assert err.value.body["code"] == "engine_failed"
    assert httpx.get(f"{server.url}/health", trust_env=False, timeout=10).status_code == 503
    code, log = server.stop(timeout=60)
    assert code == 2 and "NOT clean" in log, log  # the exit says the engine's ledger could not be audited


def test_a_killed_server_leaves_no_engine_process(spawn) -> None:
    """SIGKILL: no drain, no handler, no finalizer -- the engine's process notices on its own and exits
    (SIGTERM's clean exit is checked in test_queue_and_shutdown)."""
    server = spawn("--pool-blocks", "64")
    pid = server.engine_pid()
    assert not process_gone(pid, 0)
    server.proc.kill()
    server.proc.wait(10)
    assert process_gone(pid, 10)


def test_sampling_params_cross_with_every_field() -> None:
    """The wire keeps every field of SamplingParams (a field added later crosses too), and a JSON grammar
    crosses as its schema and end tokens."""
    import pickle
    from dataclasses import fields

    from kvledger.runtime.sampling import SamplingParams
    from kvledger.server.engine_core import sampling_to_wire

    class Grammar:
        schema = {"type": "object"}
        end_ids = (2,)

        def restrict(self, *_: object) -> None: ...

    params = SamplingParams(temperature=0.7, top_p=0.9, top_k=5, seed=3, n=2, logprobs=2, presence_penalty=0.5,
                            frequency_penalty=0.25, repetition_penalty=1.1, min_tokens=3, logit_bias=((7, 1.5),),
                            constraint=Grammar())
    values = pickle.loads(sampling_to_wire(params))
    assert set(values) == {f.name for f in fields(SamplingParams)}
    assert values["constraint"] == ("json_schema", {"type": "object"}, (2,))
    assert {k: v for k, v in values.items() if k != "constraint"} == \
        {f.name: getattr(params, f.name) for f in fields(SamplingParams) if f.name != "constraint"}
    assert sampling_to_wire(None) is None
