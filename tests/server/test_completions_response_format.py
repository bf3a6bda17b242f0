"""``response_format`` on ``/v1/completions`` (JSON mode and JSON schema), through the official `openai`
client as vLLM accepts it there (``extra_body``), against the app `kvledger serve` runs (in-process, real
SmolLM2). Before, completions ignored the field and answered free text."""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from .inproc import KEYS, MODEL, InProcServer, standard_server

pytestmark = [pytest.mark.model,
              pytest.mark.skipif(importlib.util.find_spec("llguidance") is None, reason="llguidance is not installed")]

PROMPT = "Here is a planet described as JSON:"
SCHEMA = {"type": "object", "properties": {"planet": {"enum": ["Mercury", "Venus", "Earth", "Mars"]},
                                           "moons": {"type": "integer", "minimum": 0, "maximum": 200}},
          "required": ["planet", "moons"], "additionalProperties": False}


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[InProcServer]:
    yield from standard_server(tmp_path_factory.mktemp("completions-json"))


def client(srv: InProcServer) -> Any:
    import openai

    return openai.OpenAI(base_url=srv.url + "/v1", api_key=KEYS["acme"], max_retries=0, timeout=120,
                         http_client=httpx.Client(trust_env=False, timeout=120))


def test_completions_json_schema_and_json_object_parse_and_validate(srv: InProcServer) -> None:
    """Greedy and sampled (n = 2), streamed, echoed: every answer under a json_schema parses and validates,
    and ends with ``stop`` (the grammar's end, not max_tokens); json_object answers are JSON objects."""
    import jsonschema

    c = client(srv)
    fmt = {"type": "json_schema", "json_schema": {"name": "planet", "schema": SCHEMA}}
    free = c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=40, temperature=0)
    with pytest.raises(ValueError):  # without response_format the model's own text is not this JSON
        jsonschema.validate(json.loads(free.choices[0].text), SCHEMA)
    for temperature in (0, 0.9):
        r = c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=60, temperature=temperature, seed=7, n=2,
                                 extra_body={"response_format": fmt})
        for choice in r.choices:
            assert choice.finish_reason == "stop", choice
            jsonschema.validate(json.loads(choice.text), SCHEMA)
    chunks = list(c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=60, temperature=0, stream=True,
                                       extra_body={"response_format": fmt}))
    jsonschema.validate(json.loads("".join(ch.choices[0].text for ch in chunks if ch.choices)), SCHEMA)
    echoed = c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=60, temperature=0, echo=True,
                                  extra_body={"response_format": fmt})
    text = echoed.choices[0].text
    assert text.startswith(PROMPT)
    jsonschema.validate(json.loads(text[len(PROMPT):]), SCHEMA)
    # json_object: any object (a greedy small model can write digits forever: a prompt it closes quickly)
    r = c.completions.create(model=MODEL, prompt='{"color": "red"} is JSON. Another JSON object:', max_tokens=120,
                             temperature=0, extra_body={"response_format": {"type": "json_object"}})
    assert r.choices[0].finish_reason == "stop" and isinstance(json.loads(r.choices[0].text), dict)
    assert srv.wait_idle()["clean"]


def test_completions_bad_response_format_is_a_400_naming_it(srv: InProcServer) -> None:
    for fmt in ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}},
                {"type": "json_schema"}, {"type": "yaml"}):
        r = srv.post("/v1/completions", {"prompt": PROMPT, "response_format": fmt})
        assert r.status_code == 400 and r.json()["error"]["param"] == "response_format", (fmt, r.text)
    r = srv.post("/v1/completions", {"prompt": PROMPT, "max_tokens": 4, "response_format": {"type": "text"}})
    assert r.status_code == 200  # text is the default: no grammar
