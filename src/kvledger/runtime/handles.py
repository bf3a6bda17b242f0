"""What a request's caller holds: its streamed events (:class:`TokenEvent`), its result
(:class:`RequestResult`) and its handle (:class:`RequestHandle`: stream, wait, cancel).

The engine (:mod:`kvledger.runtime.engine`) creates them; this module knows the engine only through the
few methods a handle calls (``step``, ``cancel``, ``running_in_background``, ``_raise_if_failed``).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..scheduler import RequestMetrics

if TYPE_CHECKING:
    from .engine import Engine

TokenCallback = Callable[["TokenEvent"], None]


@dataclass(frozen=True, slots=True)
class TokenEvent:
    """One streamed token (``token`` set) or the end of a request (``finished``, ``token`` None).

    ``branch`` is the sample index of an ``n > 1`` request; beam search streams its best hypothesis
    as branch 0 once the search is over (earlier tokens of a beam may still be revised)."""

    request_id: str
    branch: int
    token: int | None
    position: int  # index of the token in its sequence (prompt included)
    time_s: float
    finished: bool = False
    finish_reason: str | None = None
    # SamplingParams.logprobs: this token's (a TokenLogprobs). prompt_logprobs: on a request's first
    # token event, one entry per prompt token (None for the first, which nothing scores).
    logprobs: Any = None
    prompt_logprobs: tuple[Any, ...] | None = None


@dataclass(slots=True)
class RequestResult:
    """A finished request. Latency figures follow the one definition of
    :mod:`kvledger.scheduler.metrics` (the simulator's and every face's): ``metrics`` holds them all."""

    request_id: str
    prompt: list[int]
    outputs: list[list[int]]  # per branch in branch order; beam search: hypotheses, best first
    finish_reasons: list[str]
    seed: int | None
    arrival_s: float
    first_token_s: float | None
    finish_s: float
    preemptions: int = 0
    scores: list[float] | None = None  # beam search: summed log-probabilities of the hypotheses
    cached_prompt_tokens: int = 0  # prompt tokens skipped because the prefix cache held them written
    metrics: RequestMetrics | None = None
    last_token_s: float | None = None  # when the latest token was streamed (None: no token)

    @property
    def output(self) -> list[int]:
        """The first branch (or best hypothesis)."""
        return self.outputs[0] if self.outputs else []

    @property
    def num_generated(self) -> int:
        return sum(len(o) for o in self.outputs)

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_s is None else self.first_token_s - self.arrival_s

    @property
    def latency_s(self) -> float:
        return self.finish_s - self.arrival_s

    @property
    def tpot_s(self) -> float | None:
        """Mean time per output token after the first (longest branch)."""
        if self.metrics is not None:
            return self.metrics.tpot_s
        longest = max((len(o) for o in self.outputs), default=0)
        if self.first_token_s is None or longest < 2:
            return None
        return (self.finish_s - self.first_token_s) / (longest - 1)

    def phases(self) -> dict[str, float] | None:
        """vLLM's request phases, in seconds on the engine's clock: ``queue`` (arrival to first
        admission), ``prefill`` (admission to first token), ``decode`` (first to last token), ``inference``
        (admission to last token). Preemptions stay inside the phase they hit, as in vLLM. None for a
        request never admitted or that produced no token."""
        admitted = self.metrics.admitted_s if self.metrics is not None else None
        if admitted is None or self.first_token_s is None:
            return None
        last = self.last_token_s if self.last_token_s is not None else self.finish_s
        return {"queue": admitted - self.arrival_s, "prefill": self.first_token_s - admitted,
                "decode": last - self.first_token_s, "inference": last - admitted}


class RequestHandle:
    """What :meth:`Engine.submit` returns: stream tokens, wait for the result, or cancel.

    Events are kept only for :meth:`stream`, and never beyond what a stream still needs:

    * without an ``on_token`` callback, the handle buffers the events nobody has streamed yet -- at most
      the request's own tokens plus the ``finished`` event (``n x max_new_tokens + 1``); a stream pops
      them as it yields them. When the request finishes and :meth:`stream` was never called, the buffer
      is dropped (:meth:`result` holds every token) and a later :meth:`stream` replays the result (its
      events carry the finish time);
    * with an ``on_token`` callback, the callback is the stream: the handle buffers nothing until
      :meth:`stream` is called, and a stream yields the events from then on (every event when it starts
      before the engine steps the request, as a foreground ``for e in handle.stream()`` does).

    The handle is finished (``done()``, ``result()``) before the ``finished`` event reaches a callback or
    a stream, so whoever sees that event can read the result at once."""

    def __init__(self, engine: Engine, request_id: str, buffer: bool = True) -> None:
        self.engine = engine
        self.request_id = request_id
        self._events: deque[TokenEvent] = deque()
        self._cond = threading.Condition()
        self._result: RequestResult | None = None
        self._buffer = buffer  # keep events for a stream (False: a callback has them, nobody streams yet)
        self._streaming = False  # stream() was called
        self._dropped = False  # finished with nobody streaming: the events went; stream() replays the result

    def _push(self, event: TokenEvent) -> None:
        if not self._buffer:
            return
        with self._cond:
            self._events.append(event)
            self._cond.notify_all()

    def _finish(self, result: RequestResult, last: TokenEvent) -> None:
        """Complete the handle and queue its ``finished`` event, in one step for any waiter."""
        with self._cond:
            self._result = result
            if self._streaming:
                self._events.append(last)
            else:  # nobody streams: result() has every token, keep no event
                self._events.clear()
                self._dropped = True
            self._cond.notify_all()

    def done(self) -> bool:
        return self._result is not None

    def cancel(self) -> bool:
        return self.engine.cancel(self.request_id)

    def result(self, timeout: float | None = None) -> RequestResult:
        """Wait for the request to finish. Without a background thread, steps the engine.
        ``timeout`` (background mode) bounds the wait; :class:`TimeoutError` past it."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self._result is None:
            if self.engine.running_in_background:
                with self._cond:  # sleeps until the result is set (token events only wake it briefly)
                    if self._result is None:
                        self._cond.wait(self._slice(deadline))
                self.engine._raise_if_failed()
            else:
                self.engine._raise_if_failed()
                self.engine.step()
        return self._result

    def _slice(self, deadline: float | None) -> float:
        """How long one wait may last: a tenth of a second (to notice a dead engine thread), less near
        the deadline; raises once the deadline has passed."""
        if deadline is None:
            return 0.1
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"request {self.request_id!r}: nothing within the timeout")
        return min(left, 0.1)

    def _wait_event(self, deadline: float | None) -> None:
        """Wait a little for an event from the engine thread; raise if it died or the deadline passed."""
        with self._cond:
            if not self._events:
                self._cond.wait(self._slice(deadline))
        self.engine._raise_if_failed()

    def stream(self, timeout: float | None = None) -> Iterator[TokenEvent]:
        """Events of this request as they are produced, ending with the ``finished`` event.
        ``timeout`` bounds the wait for each event when the engine runs in the background."""
        with self._cond:
            self._streaming = True
            self._buffer = True
            replay = self._dropped
        if replay:
            yield from self._replay()
            return
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            with self._cond:
                event = self._events.popleft() if self._events else None
            if event is None:
                if self.engine.running_in_background:
                    self._wait_event(deadline)
                else:
                    self.engine._raise_if_failed()
                    self.engine.step()
                continue
            deadline = None if timeout is None else time.monotonic() + timeout
            yield event
            if event.finished:
                return

    def _replay(self) -> Iterator[TokenEvent]:
        """The events of a finished request whose stream started after it finished: each branch's
        tokens in order, then the ``finished`` event, all at the finish time."""
        r = self._result
        assert r is not None
        plen = len(r.prompt)
        for branch, out in enumerate(r.outputs[:1] if r.scores is not None else r.outputs):
            for i, token in enumerate(out):
                yield TokenEvent(self.request_id, branch, token, plen + i, r.finish_s)
        longest = max((len(o) for o in r.outputs), default=0)
        yield TokenEvent(self.request_id, 0, None, plen + longest, r.finish_s, finished=True,
                         finish_reason=r.finish_reasons[0] if r.finish_reasons else None)


__all__ = ["RequestHandle", "RequestResult", "TokenCallback", "TokenEvent"]
