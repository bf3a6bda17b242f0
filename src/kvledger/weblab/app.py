"""The web lab's FastAPI app: JSON endpoints over the library, and the static page that views them.

Every error reaches the page as one JSON object ``{"error": "<one line>"}``: 422 for input that fails
validation, 400 for input the core refuses (a pool below one block, a prefix longer than the prompt),
500 with no traceback for a kvledger bug. The page loads nothing from elsewhere (a strict
Content-Security-Policy says so to the browser too).
"""

from __future__ import annotations

import logging
from importlib import resources
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse
from fastapi.staticfiles import StaticFiles
from pydantic import BaseModel, ConfigDict, Field

from ..errors import KVLedgerError
from . import evict, lesson, quiz, views
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
        f" (got {err['input']!r:.60})"
    if kind == "json_invalid":
        return text
    if not loc:
        return "the request needs a JSON object body" if kind == "missing" else f"the request body {text}{shown}"
    if text.startswith(loc.rsplit(".", 1)[-1] + " "):  # the message names the field already
        return f"{loc.rsplit('.', 1)[0] + ': ' if '.' in loc else ''}{text}{shown}"
    return f"{loc}: {text}{shown}"


def create_app() -> FastAPI:
    app = FastAPI(title="kvledger lab", docs_url=None, redoc_url=None, openapi_url="/api/openapi.json")
    static = resources.files("kvledger.weblab").joinpath("static")

    @app.exception_handler(RequestValidationError)
    async def _invalid(_req: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        message = _describe(errors[0]) if errors else "invalid input"
        if len(errors) > 1:
            message += f" (and {len(errors) - 1} more problem{'s' if len(errors) > 2 else ''})"
        return JSONResponse({"error": message}, status_code=422)

    @app.exception_handler(KVLedgerError)
    async def _refused(_req: Request, exc: KVLedgerError) -> JSONResponse:
        return JSONResponse({"error": str(exc)}, status_code=400)

    @app.exception_handler(Exception)
    async def _bug(_req: Request, exc: Exception) -> JSONResponse:
        log.exception("kvledger lab: internal error")  # the traceback goes to the server's log only
        return JSONResponse({"error": f"internal error ({type(exc).__name__}); this is a kvledger bug"},
                            status_code=500)

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

    return app
