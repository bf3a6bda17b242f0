"""The OpenAI-compatible HTTP face: ``create_app(backend, codec, tenants, settings)`` -> a FastAPI app.

Endpoints: ``GET /v1/models``, ``POST /v1/completions``, ``POST /v1/chat/completions`` (server-sent
events with ``stream``), vLLM's ``POST /tokenize`` and ``POST /detokenize`` (any valid key), ``GET /version``,
``GET /health``, ``GET /metrics`` and ``GET /admin/ledger`` (operator only).

Order of checks for a generation request, each answered before anything changes state:
401 unknown key -> 503 draining -> 413 body too large (from ``Content-Length`` before reading, and while
reading) -> 400 malformed or unsupported -> 404 unknown model -> 400 "never" (longer than the model's
length, larger than the pool, larger than the tenant's cap, more samples than run at once) -> 429 queue
full (with ``Retry-After``) -> queued in the engine ("not now": the pool, or the tenant at its cap) ->
running.

The event loop only routes: a large body's parsing, the chat template and the tokenizer run on a small
pool of request workers (:class:`RequestWorkers`), and a text prompt whose length in characters already
proves it longer than the model's length is refused before it is tokenized, so one client's huge prompt
never stalls ``/health`` or another tenant's stream.

A tenant's ``max_blocks`` is its trust group's quota in the engine's ledger (``Engine.set_quota``): what
its requests hold, are promised and may still grow into never passes it, the decision is taken with the
admission itself, and a tenant at its cap waits without holding up the others.

Tenancy: the trust group comes from the API key only (a ``cache_salt`` in the body can split a tenant's
cache further, never join two tenants). Responses and errors carry nothing about the pool or about other
tenants: the reasons name only the request itself and static limits (model length, pool capacity, the
tenant's own cap).

The module is past 600 lines because every route's bounds, errors and tenant rules are read side by side
here: one place to check that no route leaks another tenant's state.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from ..errors import AdmissionError, ConfigError, KVLedgerError, QuotaError
from . import structured
from .backend import Backend
from .gate import AdmissionGate, NeverFits, QueueFull
from .metrics import ServerMetrics
from .protocol import (
    MAX_PROMPTS,
    BadRequestBody,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    LogprobFormat,
    ResponseShape,
    TokenizeRequest,
    default_max_body_bytes,
    error_body,
    read_body_as,
    read_request,
    usage_body,
)
from .serving import EngineFailed, Job, Run
from .tenants import Principal, Tenant, Tenants
from .text import TextCodec

_T = TypeVar("_T")
INLINE_WORK_BYTES = 8 * 1024  # a body this small is parsed and tokenized in a few milliseconds at most


@dataclass(frozen=True, slots=True)
class ServerSettings:
    served_model_name: str
    max_model_len: int  # prompt + output tokens of one sequence
    max_queue: int = 256  # requests that may wait before new ones get 429
    retry_after_s: int = 1
    max_request_body_bytes: int | None = None  # None: default_max_body_bytes(max_model_len)
    request_threads: int = 2  # workers for CPU-heavy request work (parsing, chat template, tokenizer)

    @property
    def body_limit(self) -> int:
        """The largest request body accepted (413 past it)."""
        if self.max_request_body_bytes is not None:
            return self.max_request_body_bytes
        return default_max_body_bytes(self.max_model_len)


class RequestWorkers:
    """CPU-heavy request work off the event loop: parsing a large body, the chat template, the tokenizer.

    A small fixed pool of threads, so the work of any number of requests costs a bounded number of threads;
    a tenant has at most ``threads - 1`` of them at once (at least one), so a burst of one tenant's large
    requests leaves a worker for the others. Work on a small body runs inline (a few
    milliseconds at most), so it never waits behind large requests for a worker."""

    def __init__(self, threads: int, inline_bytes: int = INLINE_WORK_BYTES) -> None:
        if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
            raise ValueError(f"request_threads must be an integer >= 1, got {threads!r}")
        self.inline_bytes = inline_bytes
        self.per_tenant = max(1, threads - 1)
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="kvledger-request")
        self._slots: dict[str, asyncio.Semaphore] = {}  # one per tenant: the key table bounds them

    async def run(self, tenant: str, size: int, fn: Callable[..., _T], *args: Any) -> _T:
        """``fn(*args)`` for a request of ``size`` body bytes from ``tenant``; its exceptions propagate."""
        if size <= self.inline_bytes:
            return fn(*args)
        slots = self._slots.get(tenant)
        if slots is None:
            slots = self._slots[tenant] = asyncio.Semaphore(self.per_tenant)
        async with slots:
            return await asyncio.get_running_loop().run_in_executor(self._pool, partial(fn, *args))

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


class ApiError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", code: str | None = None,
                 headers: dict[str, str] | None = None, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.kind, self.code, self.headers = status, message, kind, code, headers
        self.param = param


class ServerContext:
    """Everything the routes share; ``app.state.kvledger``."""

    def __init__(self, backend: Backend, codec: TextCodec, tenants: Tenants, settings: ServerSettings) -> None:
        self.backend = backend
        self.codec = codec
        self.tenants = tenants
        self.settings = settings
        self.gate = AdmissionGate(settings.max_queue, backend.num_running)
        self.metrics = ServerMetrics(settings.served_model_name, backend, self.gate,
                                     lambda: sorted(tenants.by_name))
        self.draining = False
        self.runs: set[Run] = set()
        self.workers = RequestWorkers(settings.request_threads)
        # response_format's JSON grammars: with llguidance installed, over an engine that runs constraints.
        self.grammar = None
        if getattr(backend, "supports_constraints", False) and getattr(codec, "tok", None) is not None \
                and structured.available():
            self.grammar = structured.GrammarTokenizer(codec.tok, backend.vocab_size, codec.turn_end_ids)
        for tenant in tenants.by_name.values():  # a tenant's block cap is its trust group's quota
            if tenant.max_blocks is not None:
                backend.set_quota(tenant.name, tenant.max_blocks)

    def cancel_all(self) -> None:
        """Shutdown: cancel every request in flight (they end with finish_reason abort)."""
        for run in list(self.runs):
            run.cancel()

    def close(self) -> None:
        """After serving: let the request workers go."""
        self.workers.close()

    # ---- checks -----------------------------------------------------------------------------------
    def principal(self, request: Request) -> Principal:
        principal = self.tenants.authenticate(request.headers.get("authorization"))
        if principal is None:
            self.metrics.refused.labels("unauthorized").inc()
            raise ApiError(401, "Incorrect or missing API key (Authorization: Bearer <key>)", code="invalid_api_key")
        return principal

    def tenant(self, request: Request) -> Tenant:
        principal = self.principal(request)
        if principal.tenant is None:
            self.metrics.refused.labels("forbidden").inc()
            raise ApiError(403, "operator keys cannot generate; use a tenant's key", code="forbidden")
        if self.draining:
            self.metrics.refused.labels("draining").inc()
            raise ApiError(503, "the server is shutting down", kind="server_error", code="draining")
        return principal.tenant

    def operator(self, request: Request) -> None:
        principal = self.principal(request)
        if not principal.operator:
            self.metrics.refused.labels("forbidden").inc()
            raise ApiError(403, "this endpoint is for the operator's key only", code="forbidden")

    def invalid(self, message: str, reason: str = "invalid", param: str | None = None) -> ApiError:
        self.metrics.refused.labels(reason).inc()
        return ApiError(400, message, param=param)

    def too_large(self) -> ApiError:
        self.metrics.refused.labels("too_large").inc()
        return ApiError(413, f"the request body is larger than the {self.settings.body_limit} bytes this server "
                        "accepts", code="request_too_large")

    async def read_body(self, request: Request) -> bytes:
        """The body, at most ``body_limit`` bytes: refused from its ``Content-Length`` before a byte is
        read, and while reading when it has none (chunked) or sends more than it said."""
        limit = self.settings.body_limit
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            raise self.too_large()
        chunks: list[bytes] = []
        size = 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise self.too_large()
            chunks.append(chunk)
        return b"".join(chunks)

    # ---- building the engine requests -------------------------------------------------------------
    def prompt_ids(self, body: CompletionRequest | ChatCompletionRequest, asked: int | None) -> list[list[int]]:
        """The prompts as token ids. CPU-heavy for a long text (the chat template, the tokenizer): the
        route runs it on the request workers. A text whose length alone proves it too long for the
        model is refused before it is tokenized."""
        codec = self.codec
        if isinstance(body, ChatCompletionRequest):
            messages = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()}
                        for m in body.messages]
            try:
                text = codec.chat_text(messages, body.add_generation_prompt)
            except ConfigError as exc:
                raise self.invalid(str(exc)) from None
            self.refuse_long_text(text, asked, "messages")
            return [codec.encode_chat(text)]
        prompts = body.prompts()
        if not prompts:
            raise self.invalid("prompt is empty", param="prompt")
        if len(prompts) > MAX_PROMPTS:
            raise self.invalid(f"at most {MAX_PROMPTS} prompts per request", param="prompt")
        for p in prompts:  # every text checked before any is tokenized
            if isinstance(p, str):
                self.refuse_long_text(p, asked, "prompt")
        out = []
        for p in prompts:
            ids = codec.encode(p) if isinstance(p, str) else list(p)
            if not ids:
                raise self.invalid("prompt is empty", param="prompt")
            if min(ids) < 0 or max(ids) >= self.backend.vocab_size:
                raise self.invalid(f"prompt token ids must be in [0, {self.backend.vocab_size})", param="prompt")
            out.append(ids)
        return out

    def refuse_long_text(self, text: str, asked: int | None, param: str) -> None:
        """400 "never" for a text prompt the tokenizer's floor (no token covers more than so many
        characters) already puts past the model's length: it is never tokenized."""
        limit = self.settings.max_model_len
        floor = self.codec.min_tokens(text)
        if floor >= limit:
            raise self.invalid(f"This model's maximum context length is {limit} tokens. However, your prompt "
                               f"has {len(text)} characters, at least {floor} tokens: nothing is left for the "
                               "completion.", "never_fits", param)
        if asked is not None and floor + asked > limit:
            raise self.invalid(f"This model's maximum context length is {limit} tokens. However, your prompt "
                               f"has {len(text)} characters, at least {floor} tokens, and you requested {asked} "
                               "in the completion. Please reduce the length of the prompt or completion.",
                               "never_fits", param)

    def sampling(self, body: CompletionRequest | ChatCompletionRequest) -> Any:
        from ..runtime.sampling import SamplingParams

        if body.n > self.backend.max_num_seqs:
            raise self.invalid(f"n={body.n} samples can never run at once here (at most "
                               f"{self.backend.max_num_seqs} sequences run at a time)", "never_fits", "n")
        top_k = body.top_k if body.top_k is not None and body.top_k > 0 else 0
        temperature = 1.0 if body.temperature is None else body.temperature
        if isinstance(body, ChatCompletionRequest):
            logprobs = (body.top_logprobs or 0) if body.logprobs else None
            prompt_logprobs = None
        else:
            logprobs = body.logprobs
            prompt_logprobs = body.logprobs if body.echo else None
        try:
            bias = body.bias(self.backend.vocab_size)
            constraint = self.constraint(body)
            return SamplingParams(temperature=temperature, top_p=1.0 if body.top_p is None else body.top_p,
                                  top_k=top_k, seed=body.seed, n=body.n, logprobs=logprobs,
                                  prompt_logprobs=prompt_logprobs, presence_penalty=body.presence_penalty or 0.0,
                                  frequency_penalty=body.frequency_penalty or 0.0,
                                  repetition_penalty=body.repetition_penalty or 1.0,
                                  min_tokens=body.min_tokens, logit_bias=bias, constraint=constraint)
        except BadRequestBody as exc:
            raise self.invalid(str(exc), param=exc.param) from None
        except ConfigError as exc:
            raise self.invalid(str(exc)) from None

    def constraint(self, body: CompletionRequest | ChatCompletionRequest) -> Any:
        """``response_format`` (chat or completions) as a compiled JSON grammar (None for text); CPU work for
        a large schema, so the route calls this on the request workers."""
        if not body.response_format:
            return None
        schema = structured.json_schema_of(body.response_format)
        if schema is None:
            return None
        if self.grammar is None:
            raise BadRequestBody("response_format other than text is not supported here (it needs llguidance: "
                                 "pip install kvledger[serve])", "response_format")
        return structured.JsonConstraint(self.grammar, schema)

    def budget(self, ids: list[int], asked: int | None, sampling: Any, group: str) -> int:
        """The request's max_tokens: as asked (refused if it can never fit), or by default the most the
        model's length, the pool and the tenant's cap allow."""
        limit = self.settings.max_model_len
        plen = len(ids)
        if plen >= limit:
            raise self.invalid(f"This model's maximum context length is {limit} tokens. However, your prompt "
                               f"has {plen} tokens: nothing is left for the completion.", "never_fits")
        if asked is not None:
            if plen + asked > limit:
                raise self.invalid(f"This model's maximum context length is {limit} tokens. However, you "
                                   f"requested {plen + asked} tokens ({plen} in the prompt, {asked} in the "
                                   "completion). Please reduce the length of the prompt or completion.",
                                   "never_fits")
            self.check(ids, asked, sampling, group)
            return asked
        with self.refusals():  # the engine's own answer (pool, tenant's cap), or its reason for "never"
            most = self.backend.largest_allowance(ids, sampling, trust_group=group)
        return min(limit - plen, most)

    def check(self, ids: list[int], max_tokens: int, sampling: Any, group: str) -> None:
        with self.refusals():
            self.backend.check_request(ids, max_tokens, sampling, trust_group=group)

    @contextmanager
    def refusals(self) -> Iterator[None]:
        """The engine's refusals as the client's 400s."""
        try:
            yield
        except QuotaError as exc:  # the tenant's own cap: the only figures it names are the tenant's own
            raise self.invalid(f"Your tenant's KV block cap can never hold this request ({exc}). Lower "
                               "max_tokens or n.", "tenant_cap") from None
        except AdmissionError as exc:
            raise self.invalid(str(exc), "never_fits") from None
        except ConfigError as exc:
            raise self.invalid(str(exc)) from None


def _json(status: int, body: dict[str, Any], headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(body, status_code=status, headers=headers)


def _sse(data: dict[str, Any] | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data, separators=(',', ':'))}\n\n"


class _EventStream(StreamingResponse):
    """Server-sent events whose run is closed however the response ends -- even when the client is gone
    before the first byte (the body generator then never starts, so its own cleanup never runs)."""

    def __init__(self, content: AsyncIterator[str], run: Run, runs: set[Run]) -> None:
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.run = run
        self.runs = runs

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.run.close()
            self.runs.discard(self.run)


def _has_tokens(logprobs: dict[str, Any]) -> bool:
    return bool(logprobs.get("content") or logprobs.get("tokens"))


async def _disconnected(request: Request) -> None:
    """Returns when the client goes away (the body has been read, so the next message is the end)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def create_app(backend: Backend, codec: TextCodec, tenants: Tenants | None = None,
               settings: ServerSettings | None = None) -> FastAPI:
    """The server app over any :class:`Backend` (the engine must already run in its background thread)."""
    tenants = tenants or Tenants.single_tenant()
    if settings is None:
        settings = ServerSettings(backend.model_name, backend.max_context or backend.pool_blocks * backend.block_size)
    ctx = ServerContext(backend, codec, tenants, settings)
    remote = bool(getattr(backend, "remote", False))  # its calls cross to another process
    app = FastAPI(title="kvledger", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.kvledger = ctx

    @app.exception_handler(ApiError)
    async def _api_error(_: Request, exc: ApiError) -> JSONResponse:
        return _json(exc.status, error_body(exc.message, exc.kind, exc.code, exc.param), exc.headers)

    @app.exception_handler(StarletteHTTPException)
    async def _routing(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        # An unknown path (404) or method (405, with its Allow header): the documented shape too.
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        return _json(exc.status_code, error_body(str(exc.detail), kind, code), getattr(exc, "headers", None))

    @app.exception_handler(EngineFailed)
    async def _engine_failed(_: Request, exc: EngineFailed) -> JSONResponse:
        # The engine is gone (its process died): a call it had to answer (a check, a quota) could not be.
        return _json(500, error_body(str(exc), "server_error", "engine_failed"))

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        # A bug, not the client's input: still the documented shape (Starlette logs the traceback).
        return _json(500, error_body("internal server error", "server_error", "internal_error"))

    @app.get("/health")
    async def health() -> Response:
        if backend.error is not None:
            return _json(503, {"status": "error"})
        if ctx.draining:
            return _json(503, {"status": "draining"})
        return _json(200, {"status": "ok"})

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        ctx.principal(request)
        card = {"id": settings.served_model_name, "object": "model", "created": 0, "owned_by": "kvledger",
                "root": backend.model_name, "max_model_len": settings.max_model_len}
        return _json(200, {"object": "list", "data": [card]})

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        ctx.operator(request)
        # The engine's snapshot is a round trip when the engine has its own process: off the event loop.
        text = await asyncio.to_thread(ctx.metrics.exposition) if remote else ctx.metrics.exposition()
        return Response(text, media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/admin/ledger")
    async def ledger(request: Request) -> Response:
        ctx.operator(request)
        report = await asyncio.to_thread(backend.audit)  # waits for the current step to end
        ctx.gate.check()
        report["gate"] = {"in_flight": ctx.gate.in_flight, "waiting": ctx.gate.waiting()}
        return _json(200, report)

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache(request: Request) -> Response:
        # vLLM's endpoint (operator only here: it empties every tenant's cache). Between steps; refused
        # (409, nothing changed) while blocks are held, unless ?reset_running_requests=true requeues them.
        ctx.operator(request)
        flag = request.query_params.get("reset_running_requests", "false").lower()
        if flag not in ("true", "false", "1", "0"):
            raise ctx.invalid("reset_running_requests must be true or false", param="reset_running_requests")
        reset = await asyncio.to_thread(backend.reset_prefix_cache, flag in ("true", "1"))
        if not reset:
            raise ApiError(409, f"prefix cache not reset: {reset.reason}", code="cache_reset_refused")
        return _json(200, {"reset": True, "cleared_blocks": reset.cleared_blocks,
                           "cleared_tier_entries": reset.cleared_tier_entries, "reason": reset.reason})

    @app.get("/version")
    async def version() -> Response:
        from importlib import metadata

        return _json(200, {"version": metadata.version("kvledger")})

    async def _small_body(request: Request, kind: type, who: str) -> Any:
        """A tokenizer endpoint's body, read within the body limit and validated (400 naming the field)."""
        try:
            raw = await ctx.read_body(request)
        except ClientDisconnect:
            raise ApiError(400, "the client went away") from None
        try:
            body = await ctx.workers.run(who, len(raw), read_body_as, raw, kind)
        except BadRequestBody as exc:
            raise ctx.invalid(str(exc), param=exc.param) from None
        if body.model is not None and body.model != settings.served_model_name:
            ctx.metrics.refused.labels("invalid").inc()
            raise ApiError(404, f"The model `{body.model}` does not exist.", code="model_not_found", param="model")
        return body

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        # vLLM's endpoint (``vllm bench serve`` realigns its prompts with it); any valid key.
        principal = ctx.principal(request)
        who = principal.tenant.name if principal.tenant is not None else "operator"
        body = await _small_body(request, TokenizeRequest, who)
        if (body.prompt is None) == (body.messages is None):
            raise ctx.invalid("give exactly one of prompt or messages", param="prompt")

        def work() -> list[int]:
            if body.messages is None:
                add = True if body.add_special_tokens is None else body.add_special_tokens
                return codec.tokenize(body.prompt, add)
            messages = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()}
                        for m in body.messages]
            try:
                text = codec.chat_text(messages, body.add_generation_prompt)
            except ConfigError as exc:
                raise ctx.invalid(str(exc), param="messages") from None
            return codec.tokenize(text, bool(body.add_special_tokens))

        size = len(body.prompt or "") + sum(len(m.text()) for m in body.messages or ())
        ids = await ctx.workers.run(who, size, work)
        strs = [codec.detokenize([t]) for t in ids] if body.return_token_strs else None
        return _json(200, {"count": len(ids), "max_model_len": settings.max_model_len, "tokens": ids,
                           "token_strs": strs})

    @app.get("/tokenizer_info")
    async def tokenizer_info(request: Request) -> Response:
        # vLLM's (behind its --enable-tokenizer-info-endpoint); lm-eval's `remote` tokenizer reads it, then
        # tokenizes through /tokenize. Any valid key.
        ctx.principal(request)
        return _json(200, codec.info())

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        principal = ctx.principal(request)
        who = principal.tenant.name if principal.tenant is not None else "operator"
        body = await _small_body(request, DetokenizeRequest, who)
        if any(t >= backend.vocab_size for t in body.tokens):
            raise ctx.invalid(f"tokens must be token ids in [0, {backend.vocab_size})", param="tokens")
        text = await ctx.workers.run(who, len(body.tokens) * 8, codec.detokenize, body.tokens)
        return _json(200, {"prompt": text})

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await _generate(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await _generate(request, chat=True)

    async def _generate(request: Request, chat: bool) -> Response:
        received = time.perf_counter()
        tenant = ctx.tenant(request)
        try:
            raw = await ctx.read_body(request)
        except ClientDisconnect:
            return Response(status_code=499)
        work = partial(ctx.workers.run, tenant.name, len(raw))  # large bodies: off the event loop
        try:
            body = await work(read_request, raw, chat)
        except BadRequestBody as exc:
            raise ctx.invalid(str(exc), param=exc.param) from None
        problem = body.unsupported()
        if problem:
            raise ctx.invalid(problem.message, param=problem.param)
        if body.model is not None and body.model != settings.served_model_name:
            ctx.metrics.refused.labels("invalid").inc()
            raise ApiError(404, f"The model `{body.model}` does not exist.", code="model_not_found")
        if chat and not codec.has_chat_template:
            raise ctx.invalid("this model has no chat template: use /v1/completions")
        group = tenant.name  # the trust group: from the API key only
        sampling = await work(ctx.sampling, body)  # a response_format schema compiles here
        asked = body.limit() if isinstance(body, ChatCompletionRequest) else body.max_tokens
        try:
            extra_stops = body.stop_ids(backend.vocab_size)
        except BadRequestBody as exc:
            raise ctx.invalid(str(exc), param=exc.param) from None
        # A JSON grammar ends with the end-of-turn tokens (structured.py): on completions too, they stop it.
        ends = codec.turn_end_ids if chat or sampling.constraint is not None else codec.eos_ids
        stop_ids = sorted(set(extra_stops) | (set() if body.ignore_eos else set(ends)))
        jobs: list[Job] = []
        shape = ResponseShape(chat, settings.served_model_name)
        tokenizing = time.perf_counter()
        prompts = await work(ctx.prompt_ids, body, asked)
        tokenize_s = time.perf_counter() - tokenizing
        for i, ids in enumerate(prompts):
            if remote:  # a round trip to the engine's process: never on the event loop
                max_tokens = await asyncio.to_thread(ctx.budget, ids, asked, sampling, group)
            else:
                max_tokens = ctx.budget(ids, asked, sampling, group)
            jobs.append(Job(f"{shape.id}-{i}", ids, max_tokens, sampling, stop_ids, group, tenant.priority,
                            body.cache_salt))
        fmt = None
        if sampling.logprobs is not None:
            fmt = LogprobFormat(chat, sampling.logprobs, codec.decode)
        echo = None
        if isinstance(body, CompletionRequest) and body.echo:
            echo = [p if isinstance(p, str) else codec.decode(p) for p in body.prompts()]
        run = Run(backend, codec, ctx.gate, ctx.metrics, jobs, sampling.n, body.stop or [], fmt, echo,
                  body.min_tokens)
        run.received_s, run.tokenize_s = received, tokenize_s
        try:
            run.ticket = ctx.gate.enter(tenant, len(jobs))
        except NeverFits as exc:
            raise ctx.invalid(str(exc), "tenant_cap", "prompt") from None
        except QueueFull as exc:
            ctx.metrics.refused.labels("queue_full").inc()
            raise ApiError(429, str(exc), kind="rate_limit_error", code="queue_full",
                           headers={"Retry-After": str(settings.retry_after_s)}) from None
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        if body.stream:
            return _EventStream(_stream(run, shape, include_usage), run, ctx.runs)
        return await _complete(request, run, shape)

    async def _start(run: Run) -> None:
        ctx.runs.add(run)
        run.start()

    async def _complete(request: Request, run: Run, shape: ResponseShape) -> Response:
        async def work() -> None:
            await _start(run)
            async for _ in run.deltas():
                pass

        task = asyncio.ensure_future(work())
        gone = asyncio.ensure_future(_disconnected(request))
        try:
            await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
            if not task.done():  # the client went away: stop its work
                task.cancel()
                return Response(status_code=499)
            if task.cancelled():  # shutdown: it never left the gate
                return _json(503, error_body("the server is shutting down", "server_error", "draining"))
            task.result()
        except EngineFailed as exc:
            return _json(500, error_body(str(exc), "server_error", "engine_failed"))
        except KVLedgerError as exc:  # the engine refused at submission (state changed since the checks)
            return _json(400, error_body(str(exc)))
        finally:
            gone.cancel()
            if not task.done():
                task.cancel()
            run.close()
            ctx.runs.discard(run)
        usage = usage_body(run.prompt_tokens, run.completion_tokens, run.cached_tokens)
        return _json(200, shape.body(run.texts(), run.reasons(), usage, run.choice_logprobs()))

    async def _stream(run: Run, shape: ResponseShape, include_usage: bool) -> AsyncIterator[str]:
        try:
            await _start(run)
            if shape.chat:  # the assistant's role opens every choice
                for i in range(len(run.choices)):
                    yield _sse(shape.chunk(i, "", None, role=True, with_usage=include_usage))
            async for d in run.deltas():
                if d.text or (d.logprobs is not None and _has_tokens(d.logprobs)):
                    yield _sse(shape.chunk(d.choice, d.text, None, with_usage=include_usage, logprobs=d.logprobs))
                if d.finish_reason is not None:
                    yield _sse(shape.chunk(d.choice, None if shape.chat else "", d.finish_reason,
                                           with_usage=include_usage))
            if include_usage:
                yield _sse(shape.usage_chunk(usage_body(run.prompt_tokens, run.completion_tokens,
                                                        run.cached_tokens)))
            yield _sse("[DONE]")
        except EngineFailed as exc:  # headers are out: the error travels as an event, like vLLM's
            yield _sse(error_body(str(exc), "server_error", "engine_failed"))
            yield _sse("[DONE]")
        except KVLedgerError as exc:
            yield _sse(error_body(str(exc)))
            yield _sse("[DONE]")
        finally:  # also on disconnect: Starlette cancels this generator's task
            run.close()
            ctx.runs.discard(run)

    return app


__all__ = ["ApiError", "ServerContext", "ServerSettings", "create_app"]
