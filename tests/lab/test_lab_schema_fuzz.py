"""The web lab's HTTP API fuzzed from its own OpenAPI document (`/api/openapi.json`) with schemathesis, the
app in-process: no 5xx, every status code and body as the document says, every error the lab's one shape
`{"error": "<one line>"}`, every schema-invalid request refused; afterwards the lab still answers the seed's
exercise. Derandomised in `make test`; `make fuzz` runs it on a new seed with many more examples
(tests/schema_fuzz.py)."""

from __future__ import annotations

from typing import Any

import pytest
from fastapi.testclient import TestClient
from hypothesis import strategies as st

from kvledger.weblab import create_app
from kvledger.weblab.inputs import choices

try:  # the module name pytest gives tests/schema_fuzz.py depends on its import mode
    from tests import schema_fuzz
except ImportError:  # pragma: no cover
    import schema_fuzz

SHORT_EXAMPLES = 25  # fuzzed per operation and generation mode, after the ~1,600 coverage cases; ~10 s
CONTROLS = {"model": "llama-3.1-8b", "pool": "512MiB", "requests": 8, "prompt": 2048, "shared_prefix": 2048,
            "max_new": 257}


# Where an operation's body holds the `kvledger admit` controls (LabInput): the body itself, or one field.
CONTROLS_AT = {"/api/admit": None, "/api/lab": None, "/api/quiz": None, "/api/score": "controls",
               "/api/decision": "controls", "/api/quiz/check": "controls"}


def _whole_numbers(value: Any) -> Any:
    """JSON Schema counts 1.0 as an integer and schemathesis sends it so; the lab reads integers strictly
    and refuses it (422). Steered cases send it as 1, so that they get past validation."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, dict):
        return {key: _whole_numbers(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_whole_numbers(item) for item in value]
    return value


def _steer_controls(controls: dict[str, Any], data: st.DataObject) -> None:
    """Most schema-valid controls name no bundled model, KV dtype, policy or pool size the lab knows (the
    document types them as free strings), so the lab refuses them before its core runs. Steered, these
    names are replaced by ones it knows (still schema-valid) and the requests reach the ledger."""
    known = choices()
    geometry = ("layers", "kv_heads", "head_dim")
    if "model" in controls or not all(controls.get(k) is not None for k in geometry):
        for key in geometry:
            controls.pop(key, None)
        controls["model"] = data.draw(st.sampled_from(known["models"]), label="model")
    for key, names in (("kv_dtype", known["kv_dtypes"]), ("policy", known["policies"])):
        if key in controls and controls[key] not in names:
            controls[key] = data.draw(st.sampled_from(names), label=key)
    if "pool" in controls:
        controls["pool"] = f"{data.draw(st.integers(1, 4096), label='pool MiB')}MiB"


def _steer(case: Any, data: st.DataObject | None) -> None:
    """While fuzzing, three positive cases in four are steered (integral numbers as integers, known names
    in the controls); negative cases and the coverage phase's cases are sent as generated."""
    from schemathesis import GenerationMode

    if data is None or case.meta is None or case.meta.generation.mode is not GenerationMode.POSITIVE:
        return
    if not isinstance(case.body, dict):
        return
    if data.draw(st.integers(0, 3), label="steer") == 0:
        return
    case.body = _whole_numbers(case.body)
    if case.path in CONTROLS_AT:
        where = CONTROLS_AT[case.path]
        controls = case.body if where is None else case.body.get(where)
        if isinstance(controls, dict):
            _steer_controls(controls, data)


def served_as_uvicorn_does(app: Any) -> Any:
    """The app, answering as it does behind uvicorn. On an unexpected exception Starlette sends the 500
    and then re-raises, for the server to log; the in-process client would raise it in place of the
    response, and the fuzzer could not show what the lab answered. Here the response stands."""

    async def served(scope: Any, receive: Any, send: Any) -> None:
        started = False

        async def tracked(message: Any) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await app(scope, receive, tracked)
        except Exception:
            if not started:
                raise

    return served


def _judge(case: Any, response: Any) -> str | None:
    return schema_fuzz.lab_error_problem(response)


def test_lab_api_fuzzed_from_its_schema() -> None:
    import schemathesis
    from schemathesis.checks import not_a_server_error
    from schemathesis.specs.openapi.checks import (
        content_type_conformance,
        negative_data_rejection,
        response_headers_conformance,
        response_schema_conformance,
        status_code_conformance,
        unsupported_method,
    )

    app = create_app()
    schema = schemathesis.openapi.from_asgi("/api/openapi.json", served_as_uvicorn_does(app),
                                            config=schema_fuzz.schemathesis_config())
    plan = schema_fuzz.FuzzPlan.from_env(SHORT_EXAMPLES)
    # The lab's inputs are strict (no coercion, unknown fields refused), so a schema-invalid request must
    # be refused too. Schema-valid controls may still be refused (400: the core's own rules, such as a
    # prefix longer than the prompt), so positive acceptance is not asked.
    checks = [not_a_server_error, status_code_conformance, content_type_conformance, response_headers_conformance,
              response_schema_conformance, negative_data_rejection, unsupported_method]
    report = schema_fuzz.ApiFuzzer("lab", schema, plan, lambda case: case.call(), _judge, checks,
                                   prepare=_steer).run()
    if plan.randomised:
        print(f"\n{report.summary()}")
    if report.failures:
        pytest.fail(report.verdict(), pytrace=False)
    assert report.operations >= 11 and report.statuses[200] > 0, report.summary()

    # Still responsive: the seed's exercise gets its known answer.
    client = TestClient(app)
    assert client.get("/api/health").json() == {"status": "ok"}
    admitted = client.post("/api/admit", json=CONTROLS)
    assert admitted.status_code == 200, admitted.text
    assert admitted.json()["blocks_per_request"] == 145
