"""One HTTP request in flight: its engine requests, the bridge from the engine's thread to the event
loop, incremental text with stop strings, and the per-request metrics.

The engine calls ``on_token`` from its own thread after each step's ``confirm``; the bridge hands each
event to the event loop with ``call_soon_threadsafe`` (never blocking the engine, never raising into
it). When a request's engine work is over (the engine's ``finished`` event, which for a cancelled
request comes only once the step that still read its blocks has confirmed), its share goes back to the
gate.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from .backend import Backend
from .gate import AdmissionGate, Ticket
from .metrics import ServerMetrics
from .protocol import LogprobFormat
from .text import Detokenizer, StopMatcher, TextCodec

_ENGINE_POLL_S = 1.0  # how often a waiting request checks that the engine thread is still alive
# Where the time of each request goes (HTTP and tokenizing, queue, prefill, decode, detokenizing), one JSON
# line per engine request appended to this file: benchmarks/serve_load.py's breakdown. Off when unset.
_TIMING_PATH = os.environ.get("KVLEDGER_SERVE_TIMING")


class EngineFailed(RuntimeError):
    """The engine thread stopped with an error."""


@dataclass(slots=True)
class Job:
    """One engine request: a prompt with its budget."""

    request_id: str
    prompt: list[int]
    max_tokens: int
    sampling: Any  # SamplingParams
    stop_token_ids: list[int]
    trust_group: str
    priority: int = 0
    cache_salt: str | None = None  # splits the tenant's cache further (never joins two tenants)


@dataclass(slots=True)
class Delta:
    choice: int
    text: str
    finish_reason: str | None = None
    logprobs: Any = None  # the chunk's logprobs object, when the request asked for them


@dataclass(slots=True)
class _Choice:
    detok: Detokenizer
    stops: StopMatcher
    tokens: int = 0
    text: list[str] = field(default_factory=list)
    finish_reason: str | None = None
    last_token_s: float | None = None
    echoed: bool = False  # the prompt (echo) went out with the choice's first delta
    pending: list[tuple[int, Any]] = field(default_factory=list)  # (token, logprobs) not yet in a delta
    entries: list[tuple[int, Any]] = field(default_factory=list)  # every (token, logprobs) sent
    offset: int = 0  # completions' text_offset of the next token


def _reason(engine_reason: str | None) -> str:
    if engine_reason in ("stop", "length"):
        return engine_reason
    return "abort"  # cancelled, rejected by the scheduler, ...


class Run:
    """The engine requests of one HTTP request (``n`` choices per prompt, choice = prompt * n + branch)."""

    def __init__(self, backend: Backend, codec: TextCodec, gate: AdmissionGate, metrics: ServerMetrics,
                 jobs: list[Job], n: int, stops: list[str], logprobs: LogprobFormat | None = None,
                 echo: list[str] | None = None, min_tokens: int = 0) -> None:
        self.backend = backend
        self.codec = codec
        self.gate = gate
        self.metrics = metrics
        self.jobs = jobs
        self.ticket: Ticket | None = None  # the gate's share; set before start()
        self.n = n
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()
        self.arrival_s = time.perf_counter()
        self.handles: list[Any] = []
        self.choices = [_Choice(codec.detokenizer(), StopMatcher(stops)) for _ in range(len(jobs) * n)]
        self.first_token_s: list[float | None] = [None] * len(jobs)
        self.finished = [False] * len(jobs)  # the engine's finished event arrived
        self.cancelled = [False] * len(jobs)  # we asked the engine to cancel it (once)
        self.cached_tokens = 0
        self.prompt_tokens = sum(len(j.prompt) for j in jobs)
        self.logprobs = logprobs  # None: the request asked for no logprobs
        self.echo = echo  # completions' echo: each prompt's text, sent before its choices' output
        self.prompt_logprobs: list[Any] = [None] * len(jobs)  # per prompt, from its first token event
        self.min_tokens = min_tokens  # stop strings are looked for only after this many tokens, as vLLM's
        self.stop_ids = [frozenset(j.stop_token_ids) for j in jobs]
        self.received_s: float | None = None  # when the HTTP request came in (the route sets it)
        self.detok_s = 0.0  # time spent detokenizing this request's output
        self.tokenize_s: float | None = None  # time the prompts took to tokenize (the route sets it)

    # ---- engine side ------------------------------------------------------------------------------
    def _bridge(self, index: int) -> Any:
        loop, queue, gate, ticket = self.loop, self.queue, self.gate, self.ticket
        assert ticket is not None

        def deliver(event: Any) -> None:
            queue.put_nowait((index, event))
            if event.finished:
                gate.release(ticket, index)

        def on_token(event: Any) -> None:  # engine thread: must never raise
            try:
                loop.call_soon_threadsafe(deliver, event)
            except RuntimeError:
                pass  # the event loop is closed: the server is shutting down

        return on_token

    def start(self) -> None:
        """Submit every engine request. On failure, the ones already submitted are cancelled and every
        share is given back before the error propagates."""
        try:
            for i, job in enumerate(self.jobs):
                self.handles.append(self.backend.submit(
                    job.prompt, job.max_tokens, job.sampling, stop_token_ids=job.stop_token_ids,
                    trust_group=job.trust_group, priority=job.priority, request_id=job.request_id,
                    on_token=self._bridge(i), cache_salt=job.cache_salt))
                self.metrics.tenant_requests.labels(job.trust_group).inc()
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Whatever happened (done, error, client gone, never started): cancel what still runs and give
        back the gate's share of everything that never reached the engine. Idempotent."""
        self.cancel()
        for c in self.choices:
            if c.finish_reason is None:  # the client went away (or an error): vLLM counts these as abort
                c.finish_reason = "abort"
                self.metrics.finished("abort")
        if self.ticket is not None:
            for i in range(len(self.handles), len(self.jobs)):
                self.gate.release(self.ticket, i)

    def cancel(self) -> None:
        """Cancel whatever is still running (a client that went away, an error). The blocks come back at
        the engine's next safe point; the gate share when the engine confirms."""
        for i, handle in enumerate(self.handles):
            if not self.finished[i] and not self.cancelled[i]:
                self.cancelled[i] = True
                self.backend.cancel(handle.request_id)

    # ---- event loop side --------------------------------------------------------------------------
    async def deltas(self) -> AsyncIterator[Delta]:
        """Text deltas as they are produced; each choice ends with a delta carrying its finish reason."""
        while not all(self.finished):
            try:
                index, event = await asyncio.wait_for(self.queue.get(), _ENGINE_POLL_S)
            except TimeoutError:
                if self.backend.error is not None:
                    raise EngineFailed(f"the engine stopped: {self.backend.error}") from None
                continue
            if event.finished:
                for delta in await self._finish(index):
                    yield delta
                continue
            delta = self._token(index, event)
            if delta is not None:
                yield delta

    def _token(self, index: int, event: Any) -> Delta | None:
        now = time.perf_counter()
        m = self.metrics
        if self.first_token_s[index] is None:
            self.first_token_s[index] = now
            m.ttft.observe(now - self.arrival_s)
        if event.prompt_logprobs is not None:
            self.prompt_logprobs[index] = event.prompt_logprobs
        c = self.choices[index * self.n + event.branch]
        if c.finish_reason is not None:
            return None  # this choice already hit a stop string; the engine is being told
        if self.logprobs is not None:
            c.pending.append((event.token, event.logprobs))
        c.tokens += 1
        m.generation_tokens.inc()
        m.tenant_generated.labels(self.jobs[index].trust_group).inc()
        if c.last_token_s is not None:
            m.itl.observe(now - c.last_token_s)
        c.last_token_s = now
        # A stop token (the model's end tokens, stop_token_ids) ends the output without its text, as vLLM's.
        t = time.perf_counter()
        piece = "" if event.token in self.stop_ids[index] else c.detok.push(event.token)
        self.detok_s += time.perf_counter() - t
        text = c.stops.feed(piece) if c.tokens > self.min_tokens else piece
        if c.stops.stopped:
            c.finish_reason = "stop"
            self._maybe_cancel(index)
            return self._delta(index, event.branch, text, "stop")
        return self._delta(index, event.branch, text) if text else None

    def _delta(self, index: int, branch: int, text: str, reason: str | None = None) -> Delta:
        """A choice's next delta: its text (after the echoed prompt, the first time) and the logprobs of
        the tokens since its last delta."""
        c = self.choices[index * self.n + branch]
        entries, c.pending = c.pending, []
        if self.echo is not None and not c.echoed:
            c.echoed = True
            text = self.echo[index] + text
            if self.logprobs is not None:
                prompt = self.jobs[index].prompt
                got = self.prompt_logprobs[index] or (None,) * len(prompt)
                entries = [(t, got[i] if i < len(got) else None) for i, t in enumerate(prompt)] + entries
        if text:
            c.text.append(text)
        lp = None
        if self.logprobs is not None:
            c.entries.extend(entries)
            if self.logprobs.chat:
                lp = self.logprobs.chat_entries(entries)
            else:
                lp, c.offset = self.logprobs.completion_entries(entries, c.offset)
        return Delta(index * self.n + branch, text, reason, lp)

    def _maybe_cancel(self, index: int) -> None:
        """Every choice of this engine request has met a stop string: stop generating now."""
        choices = self.choices[index * self.n:(index + 1) * self.n]
        if all(c.finish_reason is not None for c in choices) and not self.cancelled[index]:
            self.cancelled[index] = True
            self.backend.cancel(self.jobs[index].request_id)

    async def _finish(self, index: int) -> list[Delta]:
        handle = self.handles[index]
        # The engine completes the handle before it emits the finished event: the result is there.
        if not handle.done():
            raise EngineFailed(f"request {handle.request_id} ended without a result")
        result = handle.result(timeout=0)
        self.finished[index] = True
        job = self.jobs[index]
        tenant = job.trust_group  # a tenant is its trust group
        m = self.metrics
        # Served from the cache: the last prompt token is always computed (its logits start the output).
        cached = min(result.cached_prompt_tokens, max(0, len(job.prompt) - 1))
        self.cached_tokens += cached
        m.observe_request(result, len(job.prompt), cached, self.n, job.max_tokens,
                          [c.tokens for c in self.choices[index * self.n:(index + 1) * self.n]])
        m.tenant_prompt.labels(tenant).inc(len(job.prompt))
        m.tenant_cached.labels(tenant).inc(cached)
        m.e2e.observe(time.perf_counter() - self.arrival_s)
        if _TIMING_PATH:
            self._log_timing(index, result)
        out: list[Delta] = []
        for branch in range(self.n):
            choice = index * self.n + branch
            c = self.choices[choice]
            if c.finish_reason is not None:
                m.finished(c.finish_reason)
                continue
            text = c.stops.feed(c.detok.flush())
            reason = "stop" if c.stops.stopped else _reason(
                result.finish_reasons[branch] if branch < len(result.finish_reasons) else None)
            text += c.stops.flush()
            c.finish_reason = reason
            m.finished(reason)
            out.append(self._delta(index, branch, text, reason))
        return out

    def _log_timing(self, index: int, result: Any) -> None:
        """One line of where this engine request's time went (every time on the one monotonic clock the
        engine's process shares with this one)."""
        m, now = result.metrics, time.perf_counter()
        if m is None:
            return

        def gap(a: float | None, b: float | None) -> float | None:
            return None if a is None or b is None else round(b - a, 6)
        row = {"request_id": self.jobs[index].request_id, "prompt_tokens": len(self.jobs[index].prompt),
               "output_tokens": m.generated, "http_to_run_s": gap(self.received_s, self.arrival_s),
               "tokenize_s": None if self.tokenize_s is None else round(self.tokenize_s, 6),
               "run_to_engine_s": gap(self.arrival_s, m.arrival_s), "queue_s": gap(m.arrival_s, m.admitted_s),
               "prefill_s": gap(m.admitted_s, m.first_token_s), "decode_s": gap(m.first_token_s, m.finish_s),
               "first_token_to_server_s": gap(m.first_token_s, self.first_token_s[index]),
               "finish_to_server_s": gap(m.finish_s, now), "detokenize_s": round(self.detok_s, 6),
               "e2e_s": gap(self.received_s, now)}
        with open(_TIMING_PATH, "a", encoding="utf-8") as fh:  # type: ignore[arg-type]
            fh.write(json.dumps(row) + "\n")

    # ---- summaries --------------------------------------------------------------------------------
    @property
    def completion_tokens(self) -> int:
        return sum(c.tokens for c in self.choices)

    def texts(self) -> list[str]:
        return ["".join(c.text) for c in self.choices]

    def reasons(self) -> list[str | None]:
        return [c.finish_reason for c in self.choices]

    def choice_logprobs(self) -> list[Any] | None:
        """Each choice's whole logprobs object (the non-streaming body), or None when not asked for."""
        fmt = self.logprobs
        if fmt is None:
            return None
        if fmt.chat:
            return [fmt.chat_entries(c.entries) for c in self.choices]
        return [fmt.completion_entries(c.entries, 0)[0] for c in self.choices]


__all__ = ["Delta", "EngineFailed", "Job", "Run"]
