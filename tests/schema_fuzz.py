"""Schema-driven fuzzing of kvledger's two HTTP APIs with schemathesis: the OpenAI-compatible server
(`kvledger serve`) and the web lab (`kvledger lab`).

Each operation of an API's OpenAPI document gets schemathesis's deterministic coverage cases (boundary
values, each constraint broken in turn, wrong types, undocumented HTTP methods) and then random schema-valid
(positive) and schema-invalid (negative) requests through Hypothesis; every response is checked by
schemathesis (never a 5xx, a documented status code and content type, a body that conforms to the documented
schema) and by the API's own rule for errors (every 4xx is JSON in the documented error shape). A failure is
reported with a curl command that replays it (a random one first shrunk to a small request).

`make test` runs a short derandomised pass (the same requests on every run): `tests/lab/test_lab_schema_fuzz.py`
and `tests/server/test_schema_fuzz.py`. `make fuzz` runs them with many more examples on a new seed:

    KVLEDGER_HTTP_FUZZ_EXAMPLES=N   examples per operation and generation mode (set: the randomised run)
    KVLEDGER_HTTP_FUZZ_SEED=S       the seed of a randomised run (default: a new one, printed; S replays it)

The web lab publishes its schema (`/api/openapi.json`); the server does not publish one, so its document is
written here (`server_openapi`) from docs/server.md and the wire format of `kvledger.server.protocol`.
"""

from __future__ import annotations

import json
import os
import random
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import hypothesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from hypothesis.errors import Unsatisfiable

EXAMPLES_ENV = "KVLEDGER_HTTP_FUZZ_EXAMPLES"
SEED_ENV = "KVLEDGER_HTTP_FUZZ_SEED"
_SHOWN_BODY = 600  # characters of a response body quoted in a failure


# ---- the run ------------------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class FuzzPlan:
    """How much to generate: ``examples`` per operation and generation mode; ``seed`` None is derandomised
    (the same requests on every run)."""

    examples: int
    seed: int | None

    @classmethod
    def from_env(cls, short_examples: int) -> FuzzPlan:
        """The short derandomised run, unless KVLEDGER_HTTP_FUZZ_EXAMPLES asks for the randomised one."""
        examples = os.environ.get(EXAMPLES_ENV, "").strip()
        if not examples:
            return cls(short_examples, None)
        seed = os.environ.get(SEED_ENV, "").strip()
        return cls(int(examples), int(seed) if seed else random.SystemRandom().randrange(2**32))

    @property
    def randomised(self) -> bool:
        return self.seed is not None

    def describe(self) -> str:
        if self.seed is None:
            return "derandomised"
        return f"seed={self.seed} ({SEED_ENV}={self.seed} replays)"

    def settings(self) -> settings:
        # No deadline (a loaded 2-core machine must not fail a request for its time), no example database
        # (a run depends on its seed alone), and no explain phase (it re-sends requests to no purpose here).
        return settings(max_examples=self.examples, derandomize=self.seed is None, database=None, deadline=None,
                        suppress_health_check=list(HealthCheck), report_multiple_bugs=True,
                        phases=[Phase.explicit, Phase.generate, Phase.target, Phase.shrink])


@dataclass(slots=True)
class FuzzReport:
    """What one API's run sent and found."""

    api: str
    plan: FuzzPlan
    operations: int = 0
    requests: Counter[str] = field(default_factory=Counter)  # by phase: coverage, fuzzing
    statuses: Counter[int] = field(default_factory=Counter)
    failures: list[str] = field(default_factory=list)

    def summary(self) -> str:
        codes = ", ".join(f"{code}: {count:,}" for code, count in sorted(self.statuses.items()))
        phases = ", ".join(f"{phase} {count:,}" for phase, count in self.requests.items())
        return (f"schema fuzz {self.api}: {self.operations} operations, {self.requests.total():,} requests "
                f"({phases}; {codes}), {len(self.failures)} failures; fuzzing {self.plan.examples} examples per "
                f"operation and mode, {self.plan.describe()}")

    def verdict(self) -> str:
        """The summary, then every failure with the request that replays it."""
        return "\n\n".join([self.summary(), *self.failures])


def schemathesis_config(*, generated_auth: bool = True) -> Any:
    """schemathesis's settings for these runs: failures quote requests in full (its default hides any field
    named like a token, max_tokens included), streams are read to their end, and with ``generated_auth``
    False the key is the caller's, not generated."""
    import schemathesis

    return schemathesis.Config.from_dict({"max-stream-events": 100_000, "output": {"sanitization": {"enabled": False}},
                                          "generation": {"with-security-parameters": generated_auth}})


Send = Callable[[Any], Any]  # a schemathesis Case -> its schemathesis Response
# May edit a Case before it is sent: drawing from Hypothesis's data while fuzzing, None in the coverage phase.
Prepare = Callable[[Any, "st.DataObject | None"], None]
Judge = Callable[[Any, Any], "str | None"]  # (Case, Response) -> what is wrong with the response, or None


@dataclass(slots=True)
class ApiFuzzer:
    """Runs schemathesis's two generation phases over every operation of one API's schema and keeps going
    past a failing operation, so that one run reports every failure:

    * coverage: schemathesis's deterministic cases for each operation (boundary values, each constraint
      broken in turn, wrong types, missing required fields, undocumented HTTP methods), in the generation
      modes asked (``coverage_modes``: "positive", "negative");
    * fuzzing: ``plan.examples`` random cases per operation in each mode, through Hypothesis; a failure is
      shrunk to its smallest failing request.
    """

    api: str
    schema: Any
    plan: FuzzPlan
    send: Send
    judge: Judge
    checks: list[Any]
    prepare: Prepare | None = None
    coverage_modes: tuple[str, ...] = ("positive", "negative")
    coverage_limit: int | None = None  # at most this many coverage cases per operation, spread evenly

    def run(self) -> FuzzReport:
        report = FuzzReport(self.api, self.plan)
        for index, result in enumerate(self.schema.get_all_operations()):
            operation = result.ok()
            report.operations += 1
            self._coverage(operation, report)
            self._fuzzing(operation, index, report)
        return report

    def exercise(self, case: Any, data: st.DataObject | None, phase: str, report: FuzzReport) -> None:
        """Send one case and check its response; raises on the first thing wrong."""
        if self.prepare is not None:
            self.prepare(case, data)
        response = self.send(case)
        report.requests[phase] += 1
        report.statuses[response.status_code] += 1
        case.validate_response(response, checks=self.checks)  # raises schemathesis's FailureGroup
        problem = self.judge(case, response)
        if problem is not None:
            raise AssertionError(f"{problem}\n{exchange(case, response)}")

    def _coverage(self, operation: Any, report: FuzzReport) -> None:
        from schemathesis import GenerationMode

        if not self.coverage_modes:
            return
        modes = [GenerationMode(mode) for mode in self.coverage_modes]
        generation = self.schema.config.generation_for(operation=operation, phase="coverage")
        cases = list(self.schema.iter_coverage_cases(operation, generation_modes=modes, generation_config=generation))
        if self.coverage_limit is not None and len(cases) > self.coverage_limit:
            cases = [cases[i * len(cases) // self.coverage_limit] for i in range(self.coverage_limit)]
        seen: set[str] = set()  # one report per kind of failure: the first case that showed it
        for case in cases:
            try:
                self.exercise(case, None, "coverage", report)
            except (Exception, BaseExceptionGroup) as exc:  # noqa: BLE001 -- recorded; the run goes on
                kind = failure_kind(exc)
                if kind not in seen:
                    seen.add(kind)
                    report.failures.append(f"--- {operation.label} (coverage) ---\n{describe_failure(exc)}")

    def _fuzzing(self, operation: Any, index: int, report: FuzzReport) -> None:
        from schemathesis import GenerationMode

        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):

            @self.plan.settings()
            @given(case=operation.as_strategy(mode), data=st.data())
            def example(case: Any, data: st.DataObject) -> None:
                self.exercise(case, data, "fuzzing", report)

            if self.plan.seed is not None:
                example = hypothesis.seed(self.plan.seed + 2 * index + (mode is GenerationMode.NEGATIVE))(example)
            try:
                example()
            except Unsatisfiable:
                pass  # nothing to negate: an operation without parameters or body has no invalid request
            except (Exception, BaseExceptionGroup) as exc:  # noqa: BLE001 -- recorded; the run goes on
                # (schemathesis's FailureGroup is a BaseExceptionGroup)
                report.failures.append(f"--- {operation.label} (fuzzing, {mode.value}) ---\n{describe_failure(exc)}")


def failure_kind(exc: BaseException) -> str:
    """What kind of failure this is, whatever the request: schemathesis's failure codes, or our first line."""
    from schemathesis.core.failures import FailureGroup

    if isinstance(exc, FailureGroup):
        return " ".join(sorted(f"{failure.code} {failure.title}" for failure in exc.exceptions))
    return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"


def describe_failure(exc: BaseException) -> str:
    from schemathesis.core.failures import FailureGroup

    if isinstance(exc, FailureGroup):
        return exc.message.strip()
    if isinstance(exc, BaseExceptionGroup):  # Hypothesis found several distinct failures
        return "\n\n".join(describe_failure(sub) for sub in exc.exceptions)
    return f"{type(exc).__name__}: {exc}".strip()


def exchange(case: Any, response: Any) -> str:
    """The request as a curl command and the response's status and (start of its) body."""
    try:
        curl = case.as_curl_command()
    except Exception:  # noqa: BLE001 -- a report must not fail on its own formatting
        curl = f"{case.method} {case.formatted_path} {case.body!r}"
    body = response.content.decode("utf-8", "replace")
    shown = body if len(body) <= _SHOWN_BODY else body[:_SHOWN_BODY] + " ..."
    return f"request:  {curl}\nresponse: {response.status_code} {content_type(response)} {shown}"


def content_type(response: Any) -> str:
    values = response.headers.get("content-type") or [""]
    return values[0] if isinstance(values, list) else values


def json_body(response: Any) -> tuple[Any, str | None]:
    """The body as JSON, or (None, why it is not)."""
    if not content_type(response).startswith("application/json"):
        return None, f"a {response.status_code} must be JSON; its content type is {content_type(response)!r}"
    try:
        return json.loads(response.content), None
    except ValueError:
        return None, f"a {response.status_code} says it is JSON but its body is not"


# ---- the documented error shapes -------------------------------------------------------------------------------
def server_error_problem(response: Any) -> str | None:
    """The server's errors are OpenAI's: ``{"error": {"message", "type", "param", "code"}}`` (docs/server.md)."""
    if response.status_code < 400:
        return None
    body, problem = json_body(response)
    if problem:
        return problem
    error = body.get("error") if isinstance(body, dict) else None
    if not isinstance(error, dict) or set(body) != {"error"}:
        return f"a {response.status_code} must be {{\"error\": {{...}}}} and nothing else"
    if set(error) != {"message", "type", "param", "code"}:
        return f"a {response.status_code}'s error must have exactly message, type, param and code"
    if not isinstance(error["message"], str) or not error["message"] or not isinstance(error["type"], str):
        return f"a {response.status_code}'s error needs a message and a type, both non-empty strings"
    if not all(error[k] is None or isinstance(error[k], str) for k in ("param", "code")):
        return f"a {response.status_code}'s error param and code must be strings or null"
    return None


def lab_error_problem(response: Any) -> str | None:
    """The lab's errors are one JSON object ``{"error": "<one line>"}`` (kvledger.weblab.app)."""
    if response.status_code < 400:
        return None
    body, problem = json_body(response)
    if problem:
        return problem
    if not isinstance(body, dict) or set(body) != {"error"}:
        return f"a {response.status_code} must be {{\"error\": \"<one line>\"}} and nothing else"
    message = body["error"]
    if not isinstance(message, str) or not message.strip() or "\n" in message:
        return f"a {response.status_code}'s error must be one non-empty line of text"
    return None


def sse_problem(response: Any) -> str | None:
    """A streamed answer: every event a JSON chunk with choices, never an error event, and `[DONE]` last."""
    if response.status_code != 200 or not content_type(response).startswith("text/event-stream"):
        return None
    if response.stream_cut_short:
        return "the stream did not end within the request's timeout"
    events = [block.strip() for block in response.content.decode("utf-8", "replace").split("\n\n") if block.strip()]
    if not events or events[-1] != "data: [DONE]":
        return "a stream must end with `data: [DONE]`"
    for event in events[:-1]:
        if not event.startswith("data: "):
            return f"a stream event must be one `data:` line, got {event[:80]!r}"
        try:
            chunk = json.loads(event.removeprefix("data: "))
        except ValueError:
            return f"a stream event is not JSON: {event[:80]!r}"
        if not isinstance(chunk, dict) or "error" in chunk or not isinstance(chunk.get("choices"), list):
            return f"a stream event must be a chunk with choices, got {event[:200]!r}"
    return None


# ---- the server's OpenAPI document ---------------------------------------------------------------------------
def _nullable(schema: dict[str, Any]) -> dict[str, Any]:
    return {"anyOf": [schema, {"type": "null"}]}


def _only(*values: Any) -> dict[str, Any]:
    """A field the server accepts only at its default (anything else is a 400 naming it)."""
    return {"enum": list(values)}


def _json(schema: dict[str, Any]) -> dict[str, Any]:
    return {"application/json": {"schema": schema}}


_ERROR = {
    "type": "object", "required": ["error"], "additionalProperties": False,
    "properties": {"error": {
        "type": "object", "required": ["message", "type", "param", "code"], "additionalProperties": False,
        "properties": {"message": {"type": "string", "minLength": 1}, "type": {"type": "string", "minLength": 1},
                       "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}}}},
}
_USAGE = {
    "type": "object", "required": ["prompt_tokens", "completion_tokens", "total_tokens", "prompt_tokens_details"],
    "properties": {"prompt_tokens": {"type": "integer", "minimum": 1},
                   "completion_tokens": {"type": "integer", "minimum": 0},
                   "total_tokens": {"type": "integer", "minimum": 1},
                   "prompt_tokens_details": {"type": "object", "required": ["cached_tokens"],
                                             "properties": {"cached_tokens": {"type": "integer", "minimum": 0}}}},
}
_FINISH = {"enum": ["stop", "length", "abort"]}
# Each event of a stream (OpenAPI 3.2's reading of text/event-stream); sse_problem reads the chunks.
_EVENT = {"type": "object", "required": ["data"], "properties": {"data": {"type": "string"}}}


def _error_responses(*codes: int) -> dict[str, Any]:
    what = {400: "malformed, unsupported or never admissible", 401: "unknown or missing key",
            403: "the key may not use this endpoint", 404: "unknown model", 413: "body too large",
            409: "the prefix cache was not reset: requests hold blocks",
            429: "the queue is full or the tenant has max_requests in flight", 503: "the server is draining"}
    return {str(code): {"description": what[code], "content": _json(_ERROR)} for code in codes}


def _sampling_fields(model: str) -> dict[str, Any]:
    ids = {"type": "integer", "minimum": -(2**63), "maximum": 2**64 - 1}
    return {
        "model": {"enum": [model, None]},
        "temperature": _nullable({"type": "number", "minimum": 0, "maximum": 2}),
        "top_p": _nullable({"type": "number", "exclusiveMinimum": 0, "maximum": 1}),
        "top_k": _nullable({"type": "integer", "minimum": -1}),
        "n": {"type": "integer", "minimum": 1, "maximum": 16},
        "seed": _nullable(ids),
        "stop": _nullable({"anyOf": [{"type": "string", "minLength": 1, "maxLength": 256},
                                     {"type": "array", "maxItems": 16,
                                      "items": {"type": "string", "minLength": 1, "maxLength": 256}}]}),
        "stream": {"type": "boolean"},
        "stream_options": _nullable({"type": "object", "properties": {"include_usage": {"type": "boolean"}}}),
        "ignore_eos": {"type": "boolean"},
        "cache_salt": _nullable({"type": "string", "minLength": 1, "maxLength": 256}),
        "user": _nullable({"type": "string"}),
        "presence_penalty": _nullable({"type": "number", "minimum": -2, "maximum": 2}),
        "frequency_penalty": _nullable({"type": "number", "minimum": -2, "maximum": 2}),
        "repetition_penalty": _nullable({"type": "number", "exclusiveMinimum": 0}),
        "min_tokens": {"type": "integer", "minimum": 0},
        "logit_bias": _nullable({"type": "object", "maxProperties": 1024,
                                 "additionalProperties": {"type": "number", "minimum": -100, "maximum": 100}}),
        "stop_token_ids": _nullable({"type": "array", "maxItems": 256, "items": {"type": "integer", "minimum": 0}}),
        "best_of": _only(None, 1),
    }


def server_openapi(model: str, vocab_size: int) -> dict[str, Any]:
    """The OpenAI-compatible server's API (docs/server.md) as an OpenAPI 3.1 document: the requests it
    accepts (the limits of `kvledger.server.protocol`), its answers, and its one error shape."""
    max_tokens = {"type": "integer", "minimum": 1}
    token_ids = {"type": "array", "minItems": 1, "items": {"type": "integer", "minimum": 0, "maximum": vocab_size - 1}}
    text = {"type": "string", "minLength": 1}
    response_format = {"anyOf": [{"type": "null"}, {"type": "object", "properties": {
        "type": {"enum": ["text", "json_object", "json_schema"]}, "json_schema": {"type": "object"}}}]}
    completion_request = {
        "type": "object", "required": ["prompt"],
        "properties": {
            **_sampling_fields(model),
            "prompt": {"anyOf": [text, {"type": "array", "minItems": 1, "maxItems": 32, "items": text}, token_ids,
                                 {"type": "array", "minItems": 1, "maxItems": 32, "items": token_ids}]},
            "max_tokens": _nullable(max_tokens),
            "echo": {"type": "boolean"},
            "logprobs": _nullable({"type": "integer", "minimum": 0, "maximum": 20}),
            "suffix": _only(None, ""),
            "response_format": response_format,
        },
    }
    part = {"type": "object", "required": ["type", "text"],
            "properties": {"type": {"const": "text"}, "text": {"type": "string"}}}
    message = {"type": "object", "required": ["role"],
               "properties": {"role": {"enum": ["system", "developer", "user", "assistant"]},
                              "content": {"anyOf": [{"type": "string"}, {"type": "array", "items": part},
                                                    {"type": "null"}]},
                              "name": _nullable({"type": "string"})}}
    chat_request = {
        "type": "object", "required": ["messages"],
        "properties": {
            **_sampling_fields(model),
            "messages": {"type": "array", "minItems": 1, "items": message},
            "max_tokens": _nullable(max_tokens),
            "max_completion_tokens": _nullable(max_tokens),
            "tools": {"anyOf": [{"type": "null"}, {"type": "array", "maxItems": 0}]},
            "tool_choice": _only(None, "none"),
            "response_format": response_format,
            "add_generation_prompt": {"type": "boolean"},
            "logprobs": _nullable({"type": "boolean"}),
            "top_logprobs": _nullable({"type": "integer", "minimum": 0, "maximum": 20}),
        },
    }

    def head(obj: str) -> dict[str, Any]:
        return {"id": {"type": "string"}, "object": {"const": obj}, "created": {"type": "integer"},
                "model": {"const": model}}

    completion = {
        "type": "object", "required": ["id", "object", "created", "model", "choices", "usage"],
        "properties": {**head("text_completion"), "usage": _USAGE,
                       "choices": {"type": "array", "minItems": 1, "items": {
                           "type": "object", "required": ["index", "text", "logprobs", "finish_reason"],
                           "properties": {"index": {"type": "integer", "minimum": 0}, "text": {"type": "string"},
                                          "logprobs": {"type": ["object", "null"]}, "finish_reason": _FINISH}}}},
    }
    chat = {
        "type": "object", "required": ["id", "object", "created", "model", "choices", "usage"],
        "properties": {**head("chat.completion"), "usage": _USAGE,
                       "choices": {"type": "array", "minItems": 1, "items": {
                           "type": "object", "required": ["index", "message", "logprobs", "finish_reason"],
                           "properties": {"index": {"type": "integer", "minimum": 0},
                                          "message": {"type": "object", "required": ["role", "content"],
                                                      "properties": {"role": {"const": "assistant"},
                                                                     "content": {"type": "string"}}},
                                          "logprobs": {"type": ["object", "null"]}, "finish_reason": _FINISH}}}},
    }
    models = {
        "type": "object", "required": ["object", "data"],
        "properties": {"object": {"const": "list"}, "data": {"type": "array", "minItems": 1, "maxItems": 1, "items": {
            "type": "object", "required": ["id", "object", "created", "owned_by", "root", "max_model_len"],
            "properties": {"id": {"const": model}, "object": {"const": "model"}, "created": {"type": "integer"},
                           "owned_by": {"type": "string"}, "root": {"type": "string"},
                           "max_model_len": {"type": "integer", "minimum": 1}}}}},
    }
    count = {"type": "integer", "minimum": 0}
    ledger = {
        "type": "object",
        "required": ["clean", "running", "sequences", "leases", "blocks", "total_blocks", "checked", "groups", "gate"],
        "properties": {"clean": {"type": "boolean"}, "running": count, "sequences": count, "leases": count,
                       "blocks": {"type": "object", "additionalProperties": count},
                       "total_blocks": {"type": "integer", "minimum": 1}, "checked": {"const": True},
                       "groups": {"type": "object"},
                       "gate": {"type": "object", "required": ["in_flight", "waiting"],
                                "properties": {"in_flight": count, "waiting": count}}},
    }
    def generation(request: dict[str, Any], answer: dict[str, Any], summary: str) -> dict[str, Any]:
        return {"post": {"summary": summary, "security": [{"bearer": []}],
                         "requestBody": {"required": True, "content": _json(request)},
                         "responses": {"200": {"description": "the completion, or with stream its events",
                                               "content": {**_json(answer), "text/event-stream": {"schema": _EVENT}}},
                                       **_error_responses(400, 401, 403, 404, 413, 429, 503)}}}

    reset = {"type": "object", "required": ["reset", "cleared_blocks", "cleared_tier_entries", "reason"],
             "properties": {"reset": {"const": True}, "cleared_blocks": count, "cleared_tier_entries": count,
                            "reason": {"type": ["string", "null"]}}}

    return {
        "openapi": "3.1.0",
        "info": {"title": "kvledger serve", "version": "1"},
        "components": {"securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}},
        "paths": {
            "/health": {"get": {"responses": {
                "200": {"description": "serving", "content": _json({"type": "object", "required": ["status"],
                                                                     "properties": {"status": {"const": "ok"}}})},
                "503": {"description": "draining, or the engine stopped",
                        "content": _json({"type": "object", "properties": {"status": {"type": "string"}}})}}}},
            "/v1/models": {"get": {"security": [{"bearer": []}], "responses": {
                "200": {"description": "the served model", "content": _json(models)}, **_error_responses(401)}}},
            "/v1/completions": generation(completion_request, completion, "text completions"),
            "/v1/chat/completions": generation(chat_request, chat, "chat completions"),
            "/tokenize": {"post": {
                "security": [{"bearer": []}],
                "requestBody": {"required": True, "content": _json({
                    "type": "object",
                    "properties": {"model": {"enum": [model, None]}, "prompt": _nullable({"type": "string"}),
                                   "messages": _nullable({"type": "array", "minItems": 1, "items": message}),
                                   "add_special_tokens": _nullable({"type": "boolean"}),
                                   "add_generation_prompt": {"type": "boolean"},
                                   "return_token_strs": {"type": "boolean"}}})},
                "responses": {"200": {"description": "the prompt's token ids", "content": _json({
                    "type": "object", "required": ["count", "max_model_len", "tokens"],
                    "properties": {"count": count, "max_model_len": {"type": "integer", "minimum": 1},
                                   "tokens": {"type": "array", "items": count},
                                   "token_strs": {"type": ["array", "null"]}}})},
                              **_error_responses(400, 401, 404, 413)}}},
            "/detokenize": {"post": {
                "security": [{"bearer": []}],
                "requestBody": {"required": True, "content": _json({
                    "type": "object", "required": ["tokens"],
                    "properties": {"model": {"enum": [model, None]},
                                   "tokens": {"type": "array", "items": {"type": "integer", "minimum": 0,
                                                                         "maximum": vocab_size - 1}}}})},
                "responses": {"200": {"description": "the tokens' text", "content": _json({
                    "type": "object", "required": ["prompt"], "properties": {"prompt": {"type": "string"}}})},
                              **_error_responses(400, 401, 404, 413)}}},
            "/tokenizer_info": {"get": {"security": [{"bearer": []}], "responses": {
                "200": {"description": "the tokenizer's configuration (vLLM's)", "content": _json({
                    "type": "object", "required": ["eos_token", "tokenizer_class"],
                    "properties": {"tokenizer_class": {"type": "string"},
                                   "eos_token": {"type": ["string", "null"]}}})},
                **_error_responses(401)}}},
            "/version": {"get": {"responses": {"200": {"description": "kvledger's version", "content": _json({
                "type": "object", "required": ["version"], "properties": {"version": {"type": "string"}}})}}}},
            "/metrics": {"get": {"security": [{"bearer": []}], "responses": {
                "200": {"description": "Prometheus text format",
                        "content": {"text/plain": {"schema": {"type": "string"}}}},
                **_error_responses(401, 403)}}},
            "/admin/ledger": {"get": {"security": [{"bearer": []}], "responses": {
                "200": {"description": "every conservation law checked now", "content": _json(ledger)},
                **_error_responses(401, 403)}}},
            "/reset_prefix_cache": {"post": {
                "security": [{"bearer": []}],
                "parameters": [{"name": "reset_running_requests", "in": "query", "required": False,
                                "schema": {"type": "boolean"}}],
                "responses": {"200": {"description": "the prefix cache, every tier's and the hit-rate window reset",
                                      "content": _json(reset)},
                              **_error_responses(400, 401, 403, 409)}}},
        },
    }
