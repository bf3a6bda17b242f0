"""The OpenAI-compatible server fuzzed from its OpenAPI document with schemathesis, over real HTTP to the live
`kvledger serve` of these tests (SmolLM2, the real engine and ledger): no 5xx, every status code and body
as documented, every error OpenAI's shape `{"error": {"message", "type", "param", "code"}}`, every stream
well formed; afterwards nothing runs, waits, is held, promised or leased, and every conservation law holds.
Derandomised in `make test`; `make fuzz` runs it on a new seed with many more examples
(tests/schema_fuzz.py, where the document is written: the server publishes none).
"""

from __future__ import annotations

from typing import Any

import pytest
import requests
from hypothesis import strategies as st

from kvledger.core.sizing.models import load_model_config

try:  # the module name pytest gives tests/schema_fuzz.py depends on its import mode
    from tests import schema_fuzz
except ImportError:  # pragma: no cover
    import schema_fuzz

pytestmark = pytest.mark.model

MODEL = "smollm2-135m"
SHORT_EXAMPLES = 10  # fuzzed per operation and generation mode (GETs have one each): ~50 requests
COVERAGE_CASES = 40  # of schemathesis's coverage cases per operation in the short run: ~110 requests
OPERATOR_PATHS = ("/metrics", "/admin/ledger", "/reset_prefix_cache")
# Cost bounds on what is sent, so that no generated request takes minutes of the model's time (and the
# short run seconds): at most MAX_TOKENS generated tokens per sample and N samples per prompt, also where
# the request leaves its limit to the server's default (16 for completions, the model's length for chat).
# The server's own limits on both (the model's length, the pool, n <= 16) and its defaults have their own
# tests; a max_tokens past the model's length, or an n past 16, is sent as generated, so the refusals
# are still fuzzed.
MAX_TOKENS = 3
N = 2


def _as_int(value: Any) -> int | None:
    """What the server reads as an integer (pydantic's lax mode: 5, 5.0, "5"), or None."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str) and value.strip().lstrip("+-").isdigit():
        return int(value)
    return None


def _bound_cost(body: Any, chat: bool, max_model_len: int) -> None:
    """Cap a request's generation (in place) at MAX_TOKENS tokens and N samples."""
    if not isinstance(body, dict):
        return
    limits = ("max_completion_tokens", "max_tokens") if chat else ("max_tokens",)
    for key in limits:
        asked = _as_int(body.get(key))
        if asked is not None and MAX_TOKENS < asked < max_model_len:
            body[key] = MAX_TOKENS
    if all(body.get(key) is None for key in limits):
        body["max_tokens"] = MAX_TOKENS
    n = _as_int(body.get("n"))
    if n is not None and N < n <= 16:
        body["n"] = N


def test_server_api_fuzzed_from_its_schema(server) -> None:  # noqa: ANN001 -- the package's live server
    import schemathesis
    from schemathesis.checks import not_a_server_error
    from schemathesis.specs.openapi.checks import (
        content_type_conformance,
        response_headers_conformance,
        response_schema_conformance,
        status_code_conformance,
        unsupported_method,
    )

    max_model_len = server.get("/v1/models", key=server.keys["acme"]).json()["data"][0]["max_model_len"]
    document = schema_fuzz.server_openapi(MODEL, load_model_config(MODEL)["vocab_size"])
    # The key is set on every request (a tenant's, or the operator's for its endpoints), not generated.
    schema = schemathesis.openapi.from_dict(document, config=schema_fuzz.schemathesis_config(generated_auth=False))
    plan = schema_fuzz.FuzzPlan.from_env(SHORT_EXAMPLES)
    session = requests.Session()
    session.trust_env = False  # 127.0.0.1 directly, whatever proxy the environment names

    def prepare(case: Any, data: st.DataObject | None) -> None:
        if case.path in OPERATOR_PATHS:
            key = server.operator_key
        elif data is None:  # the coverage phase
            key = server.keys["acme"]
        else:  # a tenant with no cap, or one in four times the tenant whose KV block cap is small
            key = server.keys[data.draw(st.sampled_from(["acme", "acme", "acme", "capped"]), label="tenant")]
        case.headers = {**(case.headers or {}), "Authorization": f"Bearer {key}"}
        if case.method.upper() == "POST":
            _bound_cost(case.body, case.path == "/v1/chat/completions", max_model_len)

    def send(case: Any) -> Any:
        return case.call(base_url=server.url, session=session, timeout=300)

    def judge(case: Any, response: Any) -> str | None:
        return schema_fuzz.server_error_problem(response) or schema_fuzz.sse_problem(response)

    # The server reads bodies as OpenAI's and vLLM's servers do (pydantic's lax mode: "2" for 2; unknown
    # fields ignored), so a request the document calls invalid may be served: schemathesis's negative-data
    # check is not asked. What is asked of every request: no 5xx, documented answers, the error shape.
    checks = [not_a_server_error, status_code_conformance, content_type_conformance, response_headers_conformance,
              response_schema_conformance, unsupported_method]
    # The coverage phase has ~630 cases; its ~220 schema-valid ones each run the model. The short run sends
    # COVERAGE_CASES of the schema-invalid ones per operation (spread over all of them), the long run all.
    if plan.randomised:
        coverage: dict[str, Any] = {"coverage_modes": ("positive", "negative")}
    else:
        coverage = {"coverage_modes": ("negative",), "coverage_limit": COVERAGE_CASES}
    with session:
        report = schema_fuzz.ApiFuzzer("server", schema, plan, send, judge, checks, prepare=prepare,
                                       **coverage).run()
    if plan.randomised:
        print(f"\n{report.summary()}")

    ledger = server.wait_idle()  # cancellations and finished requests land at the engine's next step
    clean = (ledger["clean"] and ledger["running"] == 0 and ledger["sequences"] == 0 and ledger["leases"] == 0
             and ledger["blocks"]["promised"] == 0 and ledger["blocks"]["leased"] == 0
             and ledger["gate"] == {"in_flight": 0, "waiting": 0})
    problems = [*report.failures, *([] if clean else [f"the ledger is not clean after the run: {ledger}"])]
    if problems:
        pytest.fail("\n\n".join([report.summary(), *problems]), pytrace=False)
    assert report.operations == 11 and report.statuses[200] > 0, report.summary()
    assert server.get("/health", key=None).json() == {"status": "ok"}
