"""The one step loop: every user of the scheduler (the torch engine, the simulator, the lab, the
benchmarks, the server) drives it through a :class:`Driver`, so they agree on what a step is, what a
stuck request is, and what TTFT means.

One step::

    apply cancels; release due arrivals into the scheduler
    plan   = scheduler.schedule()               # grow, restore, decode + prefill, admit, liveness
    output = executor.execute(plan)             # copies, swap out, swap in, forward, sampling
    clock.advance(output.elapsed_s)             # a virtual clock moves; a wall clock moved by itself
    apply cancels that came in meanwhile        # their blocks stay leased until confirm
    beam search chooses (before confirm)
    scheduler.confirm(plan, output.sampled)     # tokens recorded, finished branches released
    beam forks; first tokens and finished requests recorded (one RequestMetrics definition)

An :class:`Executor` turns a plan into sampled tokens and the seconds it took; it needs nothing but the
plan (every ``Work`` names its request, branch, block table and tokens). Executors: the torch runtime's
(:mod:`kvledger.runtime.executor`), the simulator's cost model, and :class:`ConstantExecutor` here.

A failing step: if ``execute`` raises, the driver runs the plan again one request at a time (each with
its own copies and transfers) to find the culprit; a request whose part fails ends with
``"error: <exception>"``, every other request's part completes normally, and ``confirm`` releases
everything the step took. Sampling keyed by (seed, branch, position) makes the others' tokens exactly
those of an undisturbed run. The prefix cache's transfers (demotions, write-backs, moves, promotions)
belong to no request and run first, as one part: when it raises, only cache entries are lost --
``Scheduler.transfers_failed`` drops the tier entries it was writing and sends each request holding a
promoted block back to the waiting queue to recompute it -- and every other part of the step runs.
Anything else raised between ``schedule`` and ``confirm`` (a hook, an interrupt) ends the step's requests
with the error and confirms the step -- so no lease, swap copy or host block outlives it -- before it
propagates.

Thread safety: :meth:`submit` and :meth:`cancel` may be called from any thread; :meth:`step` and
:meth:`run` from one thread at a time.
"""

from __future__ import annotations

import heapq
import itertools
import threading
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

from ..core import checks
from ..core.types import MAX_TOKEN_ID, as_token_id
from ..errors import ConfigError, InvariantError, LedgerError
from .beam import BeamSearch
from .execution import Clock, ConstantExecutor, Executor, StepOutput, VirtualClock, WallClock
from .metrics import RequestMetrics, join_reasons
from .plan import GenRequest, StepPlan, validate_request
from .scheduler import Scheduler

# ---- results ----------------------------------------------------------------------------------------


@dataclass(slots=True)
class FinishedRequest:
    """A request the driver has finished with: its metrics and its outputs (per branch in branch order;
    beam search: the hypotheses, best first, with their ``scores``)."""

    request: GenRequest
    metrics: RequestMetrics
    outputs: list[list[int]]
    finish_reasons: list[str]
    scores: list[float] | None = None


@dataclass(slots=True)
class StepResult:
    plan: StepPlan | None  # None when the scheduler had nothing to plan
    start_s: float
    end_s: float
    output: StepOutput | None = None
    finished: list[FinishedRequest] = field(default_factory=list)
    failed: list[tuple[str, Exception]] = field(default_factory=list)  # requests a failing step ended


StepHook = Callable[[StepPlan, float], None]  # (plan, step start on the clock)
OutputHook = Callable[[StepPlan, StepOutput], None]


class Driver:
    """Schedule -> execute -> confirm on ``clock``, with arrivals, cancellation and request metrics.

    ``feed_window``: at most this many units wait in the scheduler; later arrivals stay in the driver
    (the scheduler only ever looks at the head of its queue, so this only bounds memory). ``check_every``:
    run ``scheduler.check()`` every N steps (0: never). ``on_planned(plan, t)`` runs after each
    ``schedule`` (a timeline's sample point), ``on_executed(plan, output)`` before ``confirm``.
    ``keep_records``: keep every finished request's metrics in ``records``."""

    def __init__(self, scheduler: Scheduler, executor: Executor, *, clock: Clock | None = None,
                 feed_window: int | None = None, check_every: int = 0, on_planned: StepHook | None = None,
                 on_executed: OutputHook | None = None, keep_records: bool = False,
                 idle_wait_s: float = 0.05, stall_steps: int = 1000) -> None:
        # A zero feed window never lets a request in (the run would step forever); bound everything first.
        if feed_window is not None:
            checks.count(feed_window, "driver: feed_window", 1)
        checks.count(check_every, "driver: check_every")
        checks.count(stall_steps, "driver: stall_steps", 1)
        if isinstance(idle_wait_s, bool) or not isinstance(idle_wait_s, int | float) or \
                not 0 <= idle_wait_s < float("inf"):
            raise ConfigError(f"driver: idle_wait_s must be a finite number of seconds >= 0, got {idle_wait_s!r}")
        self.scheduler = scheduler
        self.executor = executor
        self.clock: Clock = clock or VirtualClock()
        self.beams = BeamSearch(scheduler)
        self.feed_window = feed_window
        self.check_every = check_every
        self.on_planned = on_planned
        self.on_executed = on_executed
        self.keep_records = keep_records
        self.records: list[RequestMetrics] = []
        self.idle_wait_s = idle_wait_s
        self.stall_steps = stall_steps
        self.steps = 0
        self._lock = threading.Lock()  # guards the intake: _incoming, _cancels, _metrics, _requests
        self._incoming: deque[GenRequest] = deque()
        self._cancels: dict[str, str] = {}
        self._metrics: dict[str, RequestMetrics] = {}  # every request known and not finished
        self._requests: dict[str, GenRequest] = {}
        self._pending: list[tuple[float, int, GenRequest]] = []  # arrivals not yet due (a heap)
        self._tie = itertools.count()
        self._source: Iterator[GenRequest] | None = None
        self._peek: GenRequest | None = None
        self._origin = 0.0
        self._in_scheduler: set[str] = set()
        self._awaiting_first: set[str] = set()
        self._readmitted: set[str] = set()  # requests whose latest admission was a re-admission
        self._idle = 0

    # ---- intake (any thread) ----------------------------------------------------------------------
    def submit(self, request: GenRequest) -> RequestMetrics:
        """Queue ``request``; it reaches the scheduler at the next step once the clock passes its
        ``arrival_s`` (a time on this driver's clock). Raises for a malformed request, or for the id of
        a request that has not finished yet (a finished request's id may be used again)."""
        validate_request(request)
        with self._lock:
            metrics = self._new_metrics(request, request.arrival_s)
            self._incoming.append(request)
        return metrics

    def cancel(self, request_id: str, reason: str = "cancelled") -> bool:
        """End a request at the next safe point (before a step is planned, or between the executor and
        ``confirm``). Returns False if it is unknown or already finished."""
        with self._lock:
            if request_id not in self._metrics:
                return False
            self._cancels.setdefault(request_id, reason)
            return True

    def fail(self, request_id: str, error: BaseException | str) -> bool:
        """End a request because something about it failed (its callback raised, say)."""
        text = error if isinstance(error, str) else f"{type(error).__name__}: {error}"
        return self.cancel(request_id, f"error: {text}")

    def has_work(self) -> bool:
        with self._lock:
            intake = bool(self._incoming or self._cancels)
        sched = self.scheduler
        return intake or bool(self._pending) or self._peek is not None or sched.has_work() or sched.has_finished

    def next_arrival_s(self) -> float | None:
        """When the next request not yet handed to the scheduler arrives (None: none known)."""
        times = [self._pending[0][0]] if self._pending else []
        if self._peek is not None:
            times.append(self._origin + self._peek.arrival_s)
        with self._lock:
            if self._incoming:
                times.append(min(r.arrival_s for r in self._incoming))
        return min(times) if times else None

    def metrics(self, request_id: str) -> RequestMetrics | None:
        """The live metrics of an unfinished request."""
        with self._lock:
            return self._metrics.get(request_id)

    def _new_metrics(self, request: GenRequest, arrival_s: float) -> RequestMetrics:
        rid = request.request_id
        if rid in self._metrics:  # memory stays bounded by the requests in flight, not by all ever seen
            raise LedgerError(f"request id {rid!r} was already submitted and has not finished")
        m = RequestMetrics(rid, request.context.trust_group, arrival_s, len(request.prompt),
                           request.max_new_tokens, request.n)
        self._metrics[rid] = m
        self._requests[rid] = request
        return m

    # ---- the loop ---------------------------------------------------------------------------------
    def run(self, arrivals: Iterable[GenRequest] = (), *, origin: float | None = None,
            max_steps: int | None = None, progress: Callable[[Driver], None] | None = None,
            progress_every: int = 1000) -> list[RequestMetrics]:
        """Replay ``arrivals`` (in arrival order; ``arrival_s`` in seconds after ``origin``, by default
        the clock's time now) and step until everything is finished. Requests are pulled from the
        iterable only when due, so a long trace is never materialised at once. Returns the metrics of
        every request that finished during the run."""
        self._origin = self.clock.now() if origin is None else origin
        self._source = iter(arrivals)
        self._peek = next(self._source, None)
        out: list[RequestMetrics] = []
        steps = 0
        while self.has_work():
            result = self.step()
            out.extend(f.metrics for f in result.finished)
            steps += 1
            if progress is not None and steps % progress_every == 0:
                progress(self)
            if max_steps is not None and steps >= max_steps:
                break
        self._source = None
        if progress is not None:
            progress(self)
        return out

    def step(self) -> StepResult:
        """One step (or, when nothing can run before the next arrival, a wait for it)."""
        clock, sched = self.clock, self.scheduler
        finished: list[FinishedRequest] = []
        self._apply_cancels(finished)
        self._release(clock.now())
        if not sched.has_work():
            nxt = self.next_arrival_s()
            if nxt is not None and not self._cancels:
                clock.wait_until(nxt, self.idle_wait_s)
                self._release(clock.now())
        now = clock.now()
        self._collect(finished, now)
        if not sched.has_work():
            return StepResult(None, now, now, None, finished)
        plan = sched.schedule()
        self.steps += 1
        start = clock.now()
        try:
            self._admissions(plan, start)
            self._collect(finished, start)  # ended while planning: never, rejected
            if self.beams:
                self.beams.hold_back(plan)
            if self.on_planned is not None:
                self.on_planned(plan, start)
            output, failed = self._execute(plan)
            clock.advance(output.elapsed_s)
            self._apply_cancels(finished)  # arrived while the step was in flight
            if self.beams and output.candidates:
                self.beams.choose(plan, output.candidates, output.sampled)
            if output.sampled:
                failed += self._malformed(plan, output)
            if self.on_executed is not None:
                self.on_executed(plan, output)
            sched.confirm(plan, output.sampled)
        except BaseException as exc:
            self._abandon(plan, exc)
            raise
        if self.beams:
            self.beams.fork()
        end = clock.now()
        self._first_tokens(end)
        self._collect(finished, end)
        if self.check_every and self.steps % self.check_every == 0:
            sched.check()
        self._watch(plan, finished)
        return StepResult(plan, start, end, output, finished, failed)

    # ---- step internals ---------------------------------------------------------------------------
    def _drain_incoming(self) -> None:
        with self._lock:
            incoming = list(self._incoming)
            self._incoming.clear()
        for req in incoming:
            heapq.heappush(self._pending, (req.arrival_s, next(self._tie), req))

    def _release(self, now: float) -> None:
        """Hand every due arrival to the scheduler (at most ``feed_window`` units waiting)."""
        self._drain_incoming()
        window = self.feed_window
        sched = self.scheduler
        pending = self._pending
        while window is None or len(sched.waiting) < window:
            peek = self._peek
            due_source = peek is not None and self._origin + peek.arrival_s <= now
            if pending and pending[0][0] <= now and (not due_source or pending[0][0] <= self._origin + peek.arrival_s):
                req = heapq.heappop(pending)[2]
            elif due_source:
                assert peek is not None and self._source is not None
                req = peek
                self._peek = next(self._source, None)
                validate_request(req)
                with self._lock:
                    self._new_metrics(req, self._origin + req.arrival_s)
            else:
                break
            sched.add(req)
            self._in_scheduler.add(req.request_id)
            if req.beam:
                self.beams.add(req)

    def _apply_cancels(self, finished: list[FinishedRequest]) -> None:
        with self._lock:
            if not self._cancels:
                return
            cancels, self._cancels = self._cancels, {}
        self._drain_incoming()
        now = self.clock.now()
        for rid, reason in cancels.items():
            if rid in self._in_scheduler:
                self.scheduler.cancel(rid, reason)
                continue
            # Not in the scheduler yet: drop it from the arrivals and finish it here.
            before = len(self._pending)
            self._pending = [p for p in self._pending if p[2].request_id != rid]
            if len(self._pending) != before:
                heapq.heapify(self._pending)
                self._finish_unscheduled(rid, reason, now, finished)

    def _finish_unscheduled(self, rid: str, reason: str, now: float, finished: list[FinishedRequest]) -> None:
        with self._lock:
            m = self._metrics.pop(rid)
            req = self._requests.pop(rid)
        m.finish_s = now
        m.finish_reason = reason
        branches = 1 if req.beam else req.n
        self._finished(FinishedRequest(req, m, [[] for _ in range(branches)], [reason] * branches), finished)

    def _admissions(self, plan: StepPlan, t: float) -> None:
        if not (plan.admissions or plan.shared_hits):
            return
        with self._lock:
            metrics = self._metrics
            for a in plan.admissions:
                m = metrics.get(a.request_id)
                if m is None:
                    continue
                if m.admitted_s is None and not a.readmission:
                    m.admitted_s = t
                    m.hit_tokens = a.cached_tokens
                    self._awaiting_first.add(a.request_id)
                    self._readmitted.discard(a.request_id)
                else:
                    m.readmit_hit_tokens += a.cached_tokens
                    self._readmitted.add(a.request_id)
            # Prompt tokens skipped after the admission step or beyond what it counted: prefix blocks
            # another request wrote while this one waited, or writes in the same step.
            for rid, skipped in plan.shared_hits:
                m = metrics.get(rid)
                if m is None:
                    continue
                if rid in self._readmitted:
                    m.readmit_hit_tokens += skipped
                else:
                    m.hit_tokens += skipped

    def _first_tokens(self, t: float) -> None:
        if not self._awaiting_first:
            return
        sched = self.scheduler
        got = [rid for rid in self._awaiting_first
               if any(br.num_generated for br in sched.branches(rid))]
        if not got:
            return
        with self._lock:
            for rid in got:
                self._awaiting_first.discard(rid)
                m = self._metrics.get(rid)
                if m is not None and m.first_token_s is None:
                    m.first_token_s = t

    def _collect(self, finished: list[FinishedRequest], t: float) -> None:
        sched = self.scheduler
        for rid in sched.take_finished():
            if rid not in self._in_scheduler:
                continue  # added to the scheduler by someone else: not ours to report
            if rid in self.beams:
                outputs, reasons, scores = self.beams.outcome(rid)
            else:
                ordered = sorted(sched.branches(rid), key=lambda b: b.index)
                outputs = [br.output for br in ordered]
                reasons = [br.finish_reason or "cancelled" for br in ordered]
                scores = None
            branches = sched.forget(rid)
            self._in_scheduler.discard(rid)
            self._awaiting_first.discard(rid)
            self._readmitted.discard(rid)
            with self._lock:
                m = self._metrics.pop(rid)
                req = self._requests.pop(rid)
            m.finish_s = t
            m.generated = sum(len(o) for o in outputs)
            m.longest = max((len(o) for o in outputs), default=0)
            m.preemptions = max((br.preemptions for br in branches), default=0)
            m.finish_reason = join_reasons(reasons)
            if m.first_token_s is None and any(br.num_generated for br in branches):
                m.first_token_s = t
            self._finished(FinishedRequest(req, m, outputs, reasons, scores), finished)

    def _finished(self, f: FinishedRequest, finished: list[FinishedRequest]) -> None:
        finished.append(f)
        if self.keep_records:
            self.records.append(f.metrics)

    def _execute(self, plan: StepPlan) -> tuple[StepOutput, list[tuple[str, Exception]]]:
        try:
            return self.executor.execute(plan), []
        except Exception as exc:  # noqa: BLE001 -- isolated below, re-raised if it belongs to nobody
            return self._isolate(plan, exc)

    def _isolate(self, plan: StepPlan, error: Exception) -> tuple[StepOutput, list[tuple[str, Exception]]]:
        """Run ``plan`` again one request at a time; fail the requests whose part raises."""
        sched = self.scheduler
        copy_owner, out_owner, in_owner = sched.transfer_owners(plan)
        parts: dict[str, StepPlan] = {}
        orphan = StepPlan(plan.step)

        def part(rid: str | None) -> StepPlan:
            if rid is None:
                return orphan
            p = parts.get(rid)
            if p is None:
                p = parts[rid] = StepPlan(plan.step)
            return p

        # The prefix cache's transfers belong to no request; they run first, as in the whole plan.
        orphan.demote, orphan.tier_moves = list(plan.demote), list(plan.tier_moves)
        orphan.writeback, orphan.promote = list(plan.writeback), list(plan.promote)
        for op, rid in zip(plan.copies, copy_owner, strict=True):
            part(rid).copies.append(op)
        for pair, rid in zip(plan.swap_out, out_owner, strict=True):
            part(rid).swap_out.append(pair)
        for pair, rid in zip(plan.swap_in, in_owner, strict=True):
            part(rid).swap_in.append(pair)
        for w in plan.prefills:
            part(w.request_id).prefills.append(w)
        for w in plan.decodes:
            part(w.request_id).decodes.append(w)
        # A part that reads blocks another request's part writes in this step runs after it, and not
        # at all if that part failed: its request goes back to the waiting queue instead.
        writers: dict[str, set[str]] = {}
        for r in plan.shared_reads:
            reader, writer = r.seq_id.split("/", 1)[0], r.writer.split("/", 1)[0]
            part(reader).shared_reads.append(r)
            if writer != reader:
                writers.setdefault(reader, set()).add(writer)
        merged = StepOutput()
        failed: list[tuple[str, Exception]] = []
        done: set[str] = set()
        lost: set[str] = set()  # parts that failed or did not run
        requeue: list[str] = []
        pending = list(parts)
        if not orphan.empty:
            try:
                merged.elapsed_s += self.executor.execute(orphan).elapsed_s
            except Exception:  # noqa: BLE001 -- only cache entries are lost; nobody's request fails
                # Which of them failed is unknown: none is trusted. The requests reading a promoted block
                # recompute it (requeued by the scheduler), so their parts do not run.
                recompute = sched.transfers_failed(orphan)
                lost.update(recompute)
                pending = [rid for rid in pending if rid not in lost]
        while pending:
            # Writers come before their readers in the plan, so this settles in a pass or two.
            ready = [rid for rid in pending if writers.get(rid, set()) <= done | lost]
            if not ready:
                raise InvariantError(f"step {plan.step}: circular shared reads among {sorted(pending)}")
            for rid in ready:
                pending.remove(rid)
                if writers.get(rid, set()) & lost:
                    lost.add(rid)
                    requeue.append(rid)
                    continue
                try:
                    out = self.executor.execute(parts[rid])
                except Exception as exc:  # noqa: BLE001 -- this request's part fails: end it, go on
                    failed.append((rid, exc))
                    lost.add(rid)
                    sched.cancel(rid, f"error: {type(exc).__name__}: {exc}")
                    continue
                done.add(rid)
                merged.sampled.update(out.sampled)
                merged.candidates.update(out.candidates)
                merged.elapsed_s += out.elapsed_s
        for rid in reversed(requeue):  # each goes to the front: the last first keeps their order
            sched.requeue(rid)
        return merged, failed

    def _malformed(self, plan: StepPlan, output: StepOutput) -> list[tuple[str, Exception]]:
        """The executor is code the embedder may write: a request whose sampled tokens are not token ids
        (not a list of integers in [0, 2**32)) fails alone with a ConfigError, before ``confirm`` takes
        anything, and the others go on -- as a request whose part of the step raises."""
        bad: dict[str, Exception] = {}
        owner: dict[str, str] | None = None
        for seq_id, tokens in output.sampled.items():
            try:
                if type(tokens) is not list:
                    if isinstance(tokens, str | bytes) or not isinstance(tokens, Iterable):
                        raise ConfigError(f"{seq_id!r}: {type(tokens).__name__} is not a list of token ids")
                    tokens = output.sampled[seq_id] = list(tokens)
                for t in tokens:
                    if type(t) is not int or not 0 <= t <= MAX_TOKEN_ID:
                        as_token_id(t, seq_id)  # numpy integers pass (confirm converts them); others raise
            except ConfigError as exc:
                if owner is None:
                    owner = {w.seq_id: w.request_id for w in (*plan.prefills, *plan.decodes)}
                rid = owner.get(seq_id)
                if rid is not None and rid not in bad:
                    bad[rid] = ConfigError(f"the executor's output: {exc}")
        if not bad or owner is None:
            return []
        for rid, exc in bad.items():
            self.scheduler.cancel(rid, f"error: ConfigError: {exc}")
        for seq_id in [s for s in output.sampled if owner.get(s) in bad]:
            del output.sampled[seq_id]
        return list(bad.items())

    def _abandon(self, plan: StepPlan, error: BaseException) -> None:
        """Something outside any one request's part failed after ``schedule``: end every request the
        step touched with the error and confirm the step, so that everything it took (leases, swap
        copies, host blocks) is released before the exception goes on. The others are untouched."""
        sched = self.scheduler
        if sched.in_flight is not plan:
            return  # confirm already ran
        reason = f"error: {type(error).__name__}: {error}"
        copy_owner, out_owner, in_owner = sched.transfer_owners(plan)
        touched = {w.request_id for w in (*plan.prefills, *plan.decodes)}
        touched.update(r for r in (*copy_owner, *out_owner, *in_owner) if r is not None)
        touched.update(plan.admitted)
        for rid in sorted(touched):
            sched.cancel(rid, reason)
        sched.confirm(plan, {})

    def _watch(self, plan: StepPlan, finished: list[FinishedRequest]) -> None:
        """A guard against scheduler bugs: with the liveness rule every plan makes progress."""
        if plan.progressed or finished:
            self._idle = 0
            return
        self._idle += 1
        if self._idle >= self.stall_steps:
            sched = self.scheduler
            heads = [u[0].request.request_id for u in sched.waiting][:4]
            raise InvariantError(f"the scheduler made no progress in {self._idle} steps (running "
                                 f"{list(sched.running)[:4]}, waiting {heads}): a scheduler bug")


__all__ = ["Clock", "ConstantExecutor", "Driver", "Executor", "FinishedRequest", "StepOutput", "StepResult",
           "VirtualClock", "WallClock"]
