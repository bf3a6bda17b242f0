"""The web lab's FastAPI app: JSON endpoints over the library, and the static page that views them.

Every error reaches the page as one JSON object ``{"error": "<one line>"}``: 422 for input that fails
validation (a body the JSON parser refuses included: too deeply nested, an integer past Python's digit
limit, bytes that are not UTF-8; and controls past the work bound), 400 for input the core refuses (a
pool below one block, a prefix longer than the prompt), 404 / 405 for a path or method the lab does not
serve, 500 with no traceback for a kvledger bug. The page loads nothing from elsewhere (a strict
Content-Security-Policy says so to the browser too).
"""

from __future__ import annotations

import logging
import reprlib
import sys
from importlib import resources
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse
from fastapi.staticfiles import StaticFiles
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException

from ..errors import KVLedgerError
from . import evict, hybrid_view, lesson, quiz, views
from .inputs import LabInput, choices
from .poolmap import STATES

log = logging.getLogger("kvledger.weblab")

_CSP = ("default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; "
        "object-src 'none'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")

# The controls a learner starts from: the seed's worked example.
SEED_CONTROLS = {"layers": 32, "kv_heads": 8, "head_dim": 128, "kv_dtype": "bf16", "tp": 1, "block_size": 16,
                 "pool": "512MiB", "requests": 8, "prompt": 2048, "shared_prefix": 2048, "max_new": 257,
                 "groups": 1, "prefix_cache": True, "policy": "full", "branches": 1}


class ScoreInput(BaseModel):
    model_config = ConfigDict(extra="forbid")
    controls: LabInput
    prediction: lesson.Prediction


class DecisionInput(BaseModel):
    model_config = ConfigDict(extra="forbid")
    controls: LabInput
    text: str = Field(max_length=8000)


class QuizCheckInput(BaseModel):
    model_config = ConfigDict(extra="forbid")
    controls: LabInput
    id: str = Field(max_length=32)
    answer: str = Field(min_length=1, max_length=4000)


# What an error message shows of a value it was sent: short, and bounded in depth and length, so that
# writing the message about a deeply nested or huge value costs little and cannot exhaust the stack.
_SHOWN = reprlib.Repr()
_SHOWN.maxlevel, _SHOWN.maxstring, _SHOWN.maxother, _SHOWN.maxlong = 4, 60, 60, 60


def _error(message: str, status: int, headers: dict[str, str] | None = None) -> JSONResponse:
    """The one error shape. A lone surrogate the client sent is escaped, so writing the answer as UTF-8
    can never fail."""
    safe = message.encode("utf-8", "backslashreplace").decode("utf-8")
    if not safe.isprintable():  # one line: a field name or value the client sent may hold a newline
        safe = "".join(c if c.isprintable() else repr(c)[1:-1] for c in safe)
    return JSONResponse({"error": safe}, status_code=status, headers=headers)


class ErrorBody(BaseModel):
    """What every refusal of the lab's API looks like: one line, ``{"error": "..."}``."""

    error: str


# Declared for every route, so the published OpenAPI document says what the API really answers.
_ERRORS: dict[int | str, dict[str, Any]] = {
    400: {"model": ErrorBody, "description": "the ledger or the planner refused the controls"},
    422: {"model": ErrorBody, "description": "invalid input, or more work than one request may cause"},
}


def _unparsable(cause: BaseException) -> str:
    """One line for a body the JSON parser raised on with something other than a syntax error."""
    if isinstance(cause, RecursionError):
        return "the request body is nested too deeply to read"
    if isinstance(cause, UnicodeError):
        return "the request body is not UTF-8 text"
    if "digits" in str(cause):
        return f"the request body has an integer of more than {sys.get_int_max_str_digits():,} digits"
    return "the request body is not valid JSON"


def _describe(err: dict[str, Any]) -> str:
    """One line for one pydantic error: where, what, and what was sent."""
    loc = ".".join(str(p) for p in err.get("loc", ()) if p != "body")
    kind, ctx = err.get("type", ""), err.get("ctx") or {}
    messages = {
        "greater_than_equal": lambda: f"must be >= {ctx.get('ge')}",
        "less_than_equal": lambda: f"must be <= {ctx.get('le')}",
        "int_type": lambda: "must be a whole number",
        "bool_type": lambda: "must be true or false",
        "string_type": lambda: "must be a string",
        "missing": lambda: "is required",
        "extra_forbidden": lambda: "is not a known field",
        "string_too_long": lambda: f"is longer than {ctx.get('max_length')} characters",
        "string_too_short": lambda: "must not be empty",
        "string_unicode": lambda: "is not valid Unicode text (it holds a lone surrogate)",
        "too_long": lambda: f"has more than {ctx.get('max_length')} items",
        "too_short": lambda: f"needs at least {ctx.get('min_length')} item(s)",
        "json_invalid": lambda: "the request body is not valid JSON",
        "model_attributes_type": lambda: "must be a JSON object",
        "dict_type": lambda: "must be a JSON object",
        "list_type": lambda: "must be a list",
    }
    if kind == "value_error":
        text = str(ctx.get("error", err.get("msg", "")))
    else:
        text = messages.get(kind, lambda: str(err.get("msg", "is not valid")))()
    shown = "" if kind in ("missing", "json_invalid", "value_error") or "input" not in err else \
        f" (got {_SHOWN.repr(err['input']):.60})"
    if kind == "json_invalid":
        return text
    if not loc:
        return "the request needs a JSON object body" if kind == "missing" else f"the request body {text}{shown}"
    if text.startswith(loc.rsplit(".", 1)[-1] + " "):  # the message names the field already
        return f"{loc.rsplit('.', 1)[0] + ': ' if '.' in loc else ''}{text}{shown}"
    return f"{loc}: {text}{shown}"


def create_app() -> FastAPI:
    app = FastAPI(title="kvledger lab", docs_url=None, redoc_url=None, openapi_url="/api/openapi.json",
                  responses=_ERRORS)
    static = resources.files("kvledger.weblab").joinpath("static")

    @app.exception_handler(RequestValidationError)
    async def _invalid(_req: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        message = _describe(errors[0]) if errors else "invalid input"
        if len(errors) > 1:
            message += f" (and {len(errors) - 1} more problem{'s' if len(errors) > 2 else ''})"
        return _error(message, 422)

    @app.exception_handler(HTTPException)
    async def _http(_req: Request, exc: HTTPException) -> JSONResponse:
        # FastAPI answers a body its JSON parser raised on (RecursionError, the integer digit limit's
        # ValueError, UnicodeDecodeError) with a 400 of its own, raised from the parser's exception:
        # that body is invalid input like any other, so it gets the same 422 as a syntax error.
        cause = exc.__cause__
        if exc.status_code == 400 and isinstance(cause, (RecursionError, ValueError)):
            return _error(_unparsable(cause), 422)
        return _error(str(exc.detail), exc.status_code, getattr(exc, "headers", None))

    @app.exception_handler(KVLedgerError)
    async def _refused(_req: Request, exc: KVLedgerError) -> JSONResponse:
        return _error(str(exc), 400)

    @app.exception_handler(Exception)
    async def _bug(_req: Request, exc: Exception) -> JSONResponse:
        log.exception("kvledger lab: internal error")  # the traceback goes to the server's log only
        return _error(f"internal error ({type(exc).__name__}); this is a kvledger bug", 500)

    @app.middleware("http")
    async def _headers(request: Request, call_next: Any) -> Any:
        response = await call_next(request)
        response.headers["Content-Security-Policy"] = _CSP
        response.headers["X-Content-Type-Options"] = "nosniff"
        response.headers["Referrer-Policy"] = "no-referrer"
        if request.url.path.startswith("/api/"):
            response.headers["Cache-Control"] = "no-store"
        return response

    @app.api_route("/", methods=["GET", "HEAD"], include_in_schema=False)
    def index() -> FileResponse:
        return FileResponse(str(static.joinpath("index.html")), media_type="text/html")

    app.mount("/static", StaticFiles(directory=str(static)), name="static")

    @app.get("/api/health")
    def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/api/meta")
    def meta() -> dict[str, Any]:
        return {**choices(), "seed": SEED_CONTROLS, "states": {k: text for k, (_label, text) in STATES.items()}}

    @app.post("/api/admit")
    def admit(inp: LabInput) -> dict[str, Any]:
        """The same fields and output as `kvledger admit --json`."""
        return lesson.admit_payload(inp)

    @app.post("/api/lab")
    def lab(inp: LabInput) -> dict[str, Any]:
        """The admit payload, block maps (one trust group, one group per request) and the arithmetic."""
        return lesson.lab_view(inp)

    @app.post("/api/score")
    def score(body: ScoreInput) -> dict[str, Any]:
        return lesson.score(body.controls, body.prediction)

    @app.post("/api/decision")
    def decision(body: DecisionInput) -> dict[str, Any]:
        return lesson.check_decision(body.controls, body.text)

    @app.post("/api/quiz")
    def quiz_questions(inp: LabInput) -> dict[str, Any]:
        return {"questions": quiz.questions(inp)}

    @app.post("/api/quiz/check")
    def quiz_check(body: QuizCheckInput) -> dict[str, Any]:
        return quiz.check(body.controls, body.id, body.answer)

    @app.post("/api/views/forks")
    def forks(inp: views.ForkInput) -> dict[str, Any]:
        return views.fork_view(inp)

    @app.post("/api/views/fragmentation")
    def fragmentation(inp: views.FragmentInput) -> dict[str, Any]:
        return views.fragment_view(inp)

    @app.post("/api/views/eviction")
    def eviction(inp: evict.EvictInput) -> dict[str, Any]:
        return evict.evict_view(inp)

    @app.post("/api/views/hybrid")
    def hybrid(inp: hybrid_view.HybridInput) -> dict[str, Any]:
        return hybrid_view.hybrid_view(inp)

    return app
