"""The serving engine: continuous batching on real tensors, driven by the scheduler's one step loop.

Requests arrive at any time (:meth:`Engine.submit`, thread-safe), each with its prompt, sampling
parameters, output allowance, stop tokens, trust group and priority. The engine is a thin layer over
:class:`~kvledger.scheduler.driver.Driver` (schedule -> execute -> confirm, arrivals, cancellation,
request metrics, beam search, fault isolation) with the torch executor of
:mod:`kvledger.runtime.executor`::

    plan = scheduler.schedule()            # grow, restore swapped, decode + prefill chunks, admit
    transfers.submit(plan)                 # background worker: demote / promote prefix blocks, swap out / in
    store.copy_blocks(plan.copies)         # copy-on-write tails of forked branches
    logits = runner.forward(works)         # every prefill chunk and decode of the step, one batch
                                           # (after the transfers it depends on; the rest overlaps it)
    sampled = sample(logits)               # (seed, branch, position)-keyed: batch-independent
    scheduler.confirm(plan, sampled)       # tokens recorded, finished branches released

What the engine adds: tokens stream out after ``confirm`` through a per-request callback and
:meth:`RequestHandle.stream`; the engine runs in the caller's thread (``step`` / ``run_until_idle`` /
``generate``, or by iterating a handle's ``stream()``, which steps the engine itself) or in a
background thread (:meth:`Engine.start`). Cancellation (:meth:`Engine.cancel`) is applied at the start
of a step and again between the forward pass and ``confirm``: a request cancelled while its step is in
flight gives its blocks back when the step's lease ends, never earlier.

Faults stay with their request: an exception in the forward pass or in sampling fails only the request
whose part of the step raises (the driver reruns the step one request at a time), and an exception in a
request's ``on_token`` callback fails that request; every other request, of every tenant, goes on.

An engine is built from one :class:`~kvledger.engine_config.EngineConfig` (:meth:`Engine.from_config`; the
loader is :mod:`kvledger.runtime.loading`) around one replica assembly
(:class:`~kvledger.scheduler.replica.Replica`). The module runs past 600 lines (about 680) because
:class:`Engine` is one cohesive class: request intake, the step under its lock, streaming, cancellation,
the background thread and the operator's snapshot share its lock and its live-request table.
"""

from __future__ import annotations

import dataclasses
import itertools
import operator
import os
import secrets
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from ..core import CacheContext, Outcome, Request, checks
from ..core.sizing.geometry import canonical_dtype
from ..errors import AdmissionError, ConfigError, QuotaError
from ..scheduler import (
    FinishedRequest,
    GenRequest,
    RecoveryCosts,
    SchedulerConfig,
    StepOutput,
    StepPlan,
    StepResult,
    TransferModel,
    WallClock,
)
from ..scheduler.intake import check_request_shape
from ..scheduler.replica import Replica
from .executor import Sampling, TorchExecutor
from .handles import RequestHandle, RequestResult, TokenCallback, TokenEvent
from .host_store import TierStores
from .loading import (  # noqa: F401 -- re-exported: the loader's names as this module gave them
    BUNDLED_MODELS,
    RESIDUAL_SLOTS_DEFAULT,
    compute_dtype,
    kv_spec_for,
    load_decoder,
    load_runner,
    model_context,
    residual_slots_for,
    resolve_model,
)
from .model import BackendFactory, ModelRunner
from .sampling import SamplingParams
from .transfer import TransferEngine
from .weights import Checkpoint

if TYPE_CHECKING:
    from ..engine_config import EngineConfig


@dataclass(slots=True)
class _Live:
    """The engine's side of one request."""

    handle: RequestHandle
    request: GenRequest
    params: SamplingParams
    seed: int
    on_token: TokenCallback | None
    first_token_s: float | None = None
    last_token_s: float | None = None  # the latest token streamed (vLLM's decode time ends there)
    emitted: dict[int, int] = field(default_factory=dict)  # branch index -> output tokens streamed
    callback_failed: bool = False
    prompt_logprobs: dict[int, Any] | None = None  # prompt index -> TokenLogprobs, until the first event


@dataclass(slots=True)
class EngineStats:
    steps: int = 0
    forward_steps: int = 0
    transfer_s: float = 0.0  # worker time moving blocks to and from the tiers
    transfer_hidden_s: float = 0.0  # ... of which ran beside the steps' compute
    transfer_exposed_s: float = 0.0  # ... of which the steps waited for
    demoted_blocks: int = 0
    promoted_blocks: int = 0
    moved_blocks: int = 0
    written_back_blocks: int = 0  # retained blocks copied down ahead of their eviction
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
    failed: int = 0  # requests a step failed on (forward or sampling raised for them)
    callback_errors: int = 0  # on_token callbacks that raised (their request failed)
    # tokens a step processed (computed prompt tokens + sampled tokens, vLLM's iteration tokens) -> how many
    # steps processed that many: a server buckets it as vllm:iteration_tokens_total at scrape time
    iteration_tokens: dict[int, int] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {k: (dict(v) if isinstance(v := getattr(self, k), dict) else v)
                for k in self.__slots__}  # type: ignore[attr-defined]


@dataclass(frozen=True, slots=True)
class EngineSnapshot:
    """What a server or a metrics exporter reads from a running engine (:meth:`Engine.snapshot`).

    The operator's view: pool-wide figures and every trust group's. Never hand it to a tenant (a
    tenant may be shown its own entry of ``groups``, nothing else). Each part is read under the lock
    that guards it, between or during steps, so the parts may be a step apart."""

    steps: int  # engine steps taken
    running: int  # requests with a branch admitted
    waiting: int  # submitted and not running: not admitted yet, or preempted and waiting to come back
    swapped: int  # of those, preempted by swap (their KV on the host tier)
    max_running: int  # most sequences (branches) running at once
    pool_blocks: int
    block_size: int
    blocks: dict[str, int]  # the ledger's Usage: total, free, active, retained, evictable, promised, ...
    leases: int  # outstanding leases (in-flight steps and transfers)
    admissions: dict[str, int]  # ledger decisions: admitted, readmitted, not_now, never
    evictions: int
    preemptions: int
    prefix_query_tokens: int  # first admissions' prompt tokens looked up in the prefix cache
    prefix_hit_tokens: int  # of those, found cached
    groups: dict[str, dict[str, int | None]]  # trust group -> KVLedger.group_stats() entry
    stats: dict[str, Any]  # EngineStats.as_dict()


_IDS = itertools.count()


def refuse_untested_kv_early(model: str | os.PathLike[str], kv_dtype: str | None, allow_untested_kv: bool) -> None:
    """Refuse a quantised ``kv_dtype`` that no quality record allows for ``model``'s GGUF before the first use
    converts it (a minute): the refusal the engine would give after loading, given first. Call it before
    :func:`resolve_model` wherever the KV format is known."""
    if kv_dtype is None or allow_untested_kv:
        return
    from .loading import model_source

    source = model_source(model)
    if source.is_file() and source.suffix == ".gguf":
        from .measure.quality_records import require_any_record

        require_any_record(source, kv_dtype, str(model))


class Engine:
    """Continuous batching over one :class:`ModelRunner` and one :class:`Scheduler`, stepped by a
    :class:`Driver` on the wall clock.

    ``host_blocks`` > 0 adds a host tier of that many blocks and ``disk_blocks`` > 0 a disk tier (a file in
    ``disk_dir``, blocks stored raw or compressed by ``tier_compression``): a
    :class:`~kvledger.core.tiers.TierLedger` for the scheduler, :class:`TierStores` for the bytes and a
    :class:`TransferEngine` that moves them on a background worker through ``staging_blocks`` of staging
    (``overlap_transfers=False``: every transfer completes before the step's compute). Preemption by swap
    needs a tier; so does ``SchedulerConfig(offload_prefixes=True)``. ``max_context`` refuses
    prompts the model cannot attend over (default: the checkpoint's ``max_position_embeddings`` when
    built by :meth:`from_model`). ``eviction`` names the ledger's eviction policy for retained blocks
    (``lru`` or ``priority``; see ``kvledger.core.eviction``)."""

    def __init__(
        self,
        runner: ModelRunner,
        *,
        scheduler_config: SchedulerConfig | None = None,
        host_blocks: int = 0,
        disk_blocks: int = 0,
        disk_dir: str | os.PathLike[str] | None = None,
        tier_compression: str = "none",
        staging_blocks: int = 32,
        overlap_transfers: bool = True,
        costs: RecoveryCosts | None = None,
        max_context: int | None = None,
        prefix_caching: bool = True,
        eviction: str = "lru",
        model_name: str = "",
        clock: Callable[[], float] = time.perf_counter,
        checkpoint: Checkpoint | None = None,
        allow_untested_kv: bool = False,
    ) -> None:
        if runner.spec.format.quantized and not allow_untested_kv:
            from .measure.quality_records import require_record

            require_record(runner.spec, checkpoint, model_name)
        self.runner = runner
        self.spec = runner.spec
        specs = [(name, n) for name, n in (("host", host_blocks), ("disk", disk_blocks)) if n]
        self.host_store = TierStores(runner.store, [n for n, _ in specs], [b for _, b in specs], disk_dir=disk_dir,
                                     compression=tier_compression) if specs else None
        self.transfers = TransferEngine(self.host_store, staging_blocks=staging_blocks,
                                        overlap=overlap_transfers) if self.host_store is not None else None
        if costs is None:
            params = sum(p.numel() for p in runner.model.parameters())
            # CPU-ish defaults; they only matter to recovery="auto".
            costs = RecoveryCosts(flops_per_token=2.0 * params, flops_per_s=50e9, block_bytes=self.spec.block_bytes,
                                  transfer=TransferModel(link_Bps=10e9, overhead_s=20e-6))
        store = runner.store
        if store.residual_slots:
            # int4: one residual page per running sequence, so never run more sequences than pages.
            cfg = scheduler_config or SchedulerConfig()
            if cfg.max_running > store.residual_slots:
                scheduler_config = SchedulerConfig(**{**cfg.to_dict(), "max_running": store.residual_slots})
        groups = runner.kv_groups
        self.replica = Replica.assemble(store.num_blocks, self.spec.block_size, scheduler_config, eviction=eviction,
                                        prefix_caching=prefix_caching, host_blocks=host_blocks,
                                        disk_blocks=disk_blocks, costs=costs, kv_groups=groups)
        self.ledger = self.replica.ledger
        self.scheduler = self.replica.scheduler
        if store.residual_slots:  # pages of blocks the ledger freed are reclaimed by asking it
            pool = self.ledger.pool
            store.block_in_use = lambda b: pool.ref[b] > 0 or pool.leased[b] > 0
        self.max_context = max_context
        self.model_name = model_name
        self.clock = clock
        self.stats = EngineStats()
        self.checkpoint: Checkpoint | None = checkpoint
        self.executor = TorchExecutor(runner, self.transfers, self.stats,
                                      on_transfer_error=self.scheduler.transfers_failed)
        self.driver = self.replica.drive(self.executor, clock=WallClock(clock), on_executed=self._executed)
        self._lock = threading.Lock()  # guards _live and _submitted
        self._step_lock = threading.RLock()
        self._live: dict[str, _Live] = {}
        self._submitted: set[str] = set()
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._wake = threading.Condition(self._lock)
        self.error: BaseException | None = None  # what stopped the background thread, if anything
        # Called with the driver's StepResult after every step, in the stepping thread, once the step's
        # tokens are streamed: the step boundary (memory diagnostics sample here).
        self.step_observers: list[Callable[[StepResult], None]] = []

    @classmethod
    def from_config(cls, config: EngineConfig, *, checkpoint: Checkpoint | None = None,
                    backend: BackendFactory | None = None, kv_groups: bool = False, **runtime: Any) -> Engine:
        """The one build path: the engine ``config`` describes (:mod:`kvledger.runtime.loading` loads the
        model and sizes the pool). ``checkpoint``: the model already resolved; ``backend``: an attention
        backend factory instead of the configuration's name; ``runtime``: what is not configuration but
        wiring (``costs``, ``clock``, ``staging_blocks``, ``overlap_transfers``, ``model_name``,
        ``max_context``). ``kv_groups``: keep a sliding/full-interleaved model's KV in KV cache groups (the window
        layers' old blocks go back to the pool while requests run; prefix caching, swaps, n > 1, beams and forks run
        on it, speculative slots and tiers not yet: see runtime/kv_groups.py)."""
        from .loading import build_runner

        if checkpoint is None:
            refuse_untested_kv_early(config.model, config.kv_dtype, config.allow_untested_kv)
        ckpt, runner = build_runner(config, checkpoint, backend, kv_groups=kv_groups)
        context = model_context(ckpt)
        if config.max_model_len is not None:
            if context is not None and config.max_model_len > context:
                raise ConfigError(f"max_model_len {config.max_model_len} exceeds the model's context of "
                                  f"{context} tokens")
            context = config.max_model_len
        runtime.setdefault("max_context", context)
        runtime.setdefault("model_name", config.model)
        return cls(runner, scheduler_config=config.scheduler, host_blocks=config.host_blocks,
                   disk_blocks=config.disk_blocks, disk_dir=config.disk_dir, tier_compression=config.tier_compression,
                   prefix_caching=config.prefix_caching, eviction=config.eviction, checkpoint=ckpt,
                   allow_untested_kv=config.allow_untested_kv, **runtime)

    _CONFIG_KEYWORDS = ("host_blocks", "disk_blocks", "disk_dir", "tier_compression", "prefix_caching", "eviction",
                        "allow_untested_kv")

    @classmethod
    def from_model(
        cls, model: str | os.PathLike[str] | Checkpoint, *, num_blocks: int | None = None,
        pool_bytes: int | str | None = None, block_size: int = 16, dtype: torch.dtype | str = torch.float32,
        device: str | torch.device = "cpu", backend: BackendFactory | None = None, kv_dtype: str | None = None,
        residual_slots: int | None = None, **kwargs: Any,
    ) -> Engine:
        """Load ``model`` (bundled name, HF folder, GGUF or a resolved :class:`Checkpoint`) with a pool of
        ``num_blocks`` or ``pool_bytes`` in ``kv_dtype`` (default: the compute dtype; a quantised format
        needs a passing quality record for the model, or ``allow_untested_kv=True``): the keywords of an
        :class:`~kvledger.engine_config.EngineConfig`, handed to :meth:`from_config`; the rest are the
        constructor's. ``residual_slots``: int4's residual pages (default: see :func:`residual_slots_for`)."""
        from ..engine_config import EngineConfig

        if (num_blocks is None) == (pool_bytes is None):
            raise ConfigError("give exactly one of num_blocks or pool_bytes for the KV pool")
        if isinstance(pool_bytes, str):
            from ..units import parse_bytes

            pool_bytes = parse_bytes(pool_bytes)
        ckpt = model if isinstance(model, Checkpoint) else None
        settings = {k: kwargs.pop(k) for k in cls._CONFIG_KEYWORDS if k in kwargs}
        if settings.get("disk_dir") is not None:
            settings["disk_dir"] = os.fspath(settings["disk_dir"])
        scheduler = kwargs.pop("scheduler_config", None) or SchedulerConfig()
        named = isinstance(backend, str)
        config = EngineConfig(
            model=str(ckpt.path) if ckpt is not None else os.fspath(model), dtype=canonical_dtype(str(dtype)),
            kv_dtype=kv_dtype, num_blocks=num_blocks, pool_bytes=pool_bytes, block_size=block_size,
            residual_slots=residual_slots, device=str(device), scheduler=scheduler,
            attention_backend=backend if named else "auto", **settings)
        return cls.from_config(config, checkpoint=ckpt, backend=None if named else backend, **kwargs)

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
        read_prefix_cache: bool = True,
        cache_salt: str | None = None,
    ) -> RequestHandle:
        """Queue a request; it joins the batch at the next step (or, with ``arrival_s`` -- a time on the
        engine's clock -- in the future, once the clock passes it). ``read_prefix_cache=False`` computes
        the whole prompt even if it is cached (prompt log-probabilities need that) while still writing
        it to the cache. ``cache_salt`` splits the trust group's cache further (vLLM's ``cache_salt``:
        requests share cached blocks only with requests of the same group and salt); the group's quota
        still covers them all. Raises :class:`AdmissionError` for a request that can never run here
        (longer than the context, larger than the whole pool or its group's quota, more sequences than
        run at once) and :class:`ConfigError` for malformed input."""
        params = sampling or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ConfigError(f"sampling must be SamplingParams, got {type(params).__name__}")
        rid = request_id if request_id is not None else f"req-{next(_IDS)}"
        prompt, max_new_tokens, context = self.check_request(prompt, max_new_tokens, params,
                                                             trust_group=trust_group, request_id=rid,
                                                             cache_salt=cache_salt)
        try:
            stops = frozenset(operator.index(t) for t in stop_token_ids)
        except TypeError:
            raise ConfigError("stop_token_ids must be integer token ids") from None
        priority = checks.count(priority, "priority", minimum=None)
        if on_token is not None and not callable(on_token):
            raise ConfigError("on_token must be callable")
        checks.flag(read_prefix_cache, "read_prefix_cache")
        if params.prompt_logprobs is not None:
            # Prompt logprobs need the logits of every prompt position, which the prefix cache does not
            # keep: such a request computes its whole prompt (it still writes the cache for others).
            read_prefix_cache = False
        branches = params.beam_width if params.beam else params.n
        seed = params.seed if params.seed is not None else secrets.randbits(63)
        now = self.clock() if arrival_s is None else arrival_s
        request = GenRequest(rid, tuple(prompt), max_new_tokens, context, n=branches, priority=priority,
                             arrival_s=now, stop_token_ids=stops, payload=Sampling(params, seed), beam=params.beam,
                             read_prefix_cache=read_prefix_cache)
        handle = RequestHandle(self, rid, buffer=on_token is None)
        with self._lock:
            if rid in self._submitted:
                raise ConfigError(f"request id {rid!r} was already submitted")
            self._submitted.add(rid)
            self._live[rid] = _Live(handle, request, params, seed, on_token,
                                    prompt_logprobs={} if params.prompt_logprobs is not None else None)
            self.driver.submit(request)
            self._wake.notify_all()
        return handle

    def check_request(
        self, prompt: Sequence[int], max_new_tokens: int, sampling: SamplingParams | None = None, *,
        trust_group: str = "default", request_id: str = "check", cache_salt: str | None = None,
    ) -> tuple[list[int], int, CacheContext]:
        """Validate a request without queueing it: ``(prompt, max_new_tokens, context)`` with the output
        allowance cut to what the model's context leaves. Raises :class:`ConfigError` for malformed
        input and :class:`AdmissionError` for a request that can never run here: longer than the
        model's context, larger than the whole pool or than its trust group's quota, or asking for more
        sequences (``n``, beam width) than the scheduler runs at once."""
        params = sampling or SamplingParams()
        branches = params.beam_width if params.beam else params.n
        prompt, max_new_tokens = check_request_shape(
            prompt, max_new_tokens, vocab_size=self.runner.config.vocab_size, max_context=self.max_context,
            branches=branches, max_running=self.scheduler.config.max_running, beam=params.beam,
            trust_group=trust_group, cache_salt=cache_salt, request_id=request_id)
        context = self.spec.cache_context(trust_group, self.model_name, cache_salt)
        # Larger than the whole pool (or the group's quota) is known now; say so instead of queueing a
        # request that never runs.
        decision = self.ledger.can_admit(Request(request_id, prompt, max_new_tokens, context, branches=branches))
        if decision.outcome is Outcome.NEVER:
            if decision.over_quota:
                raise QuotaError(f"this request is larger than its trust group's quota: it {decision.reason}")
            raise AdmissionError(f"the KV pool is too small for this request: it {decision.reason}")
        return prompt, max_new_tokens, context

    def largest_allowance(
        self, prompt: Sequence[int], sampling: SamplingParams | None = None, *, trust_group: str = "default",
        cache_salt: str | None = None,
    ) -> int:
        """The largest ``max_new_tokens`` :meth:`check_request` accepts for this prompt: what the model's
        context leaves, cut by the ledger's own answer (:meth:`KVLedger.largest_allowance`: the pool and
        the trust group's quota). Raises as :meth:`check_request` does when not even one token could run."""
        params = sampling or SamplingParams()
        prompt, _, context = self.check_request(prompt, 1, params, trust_group=trust_group, cache_salt=cache_salt)
        branches = params.beam_width if params.beam else params.n
        most = self.ledger.largest_allowance(Request("check", prompt, 1, context, branches=branches))
        if self.max_context is not None:
            most = min(most, self.max_context - len(prompt))
        return most

    def cancel(self, request_id: str) -> bool:
        """Cancel a queued or running request (applied at the next safe point of the engine loop).
        Returns False if the request is unknown or already finished."""
        with self._lock:
            live = self._live.get(request_id)
            if live is None or live.handle.done():
                return False
            accepted = self.driver.cancel(request_id)
            self._wake.notify_all()
            return accepted

    def has_work(self) -> bool:
        return self.driver.has_work()

    # ---- what a server reads --------------------------------------------------------------------
    @property
    def max_running(self) -> int:
        """Most sequences (branches) that run at once: a request with more can never run."""
        return self.scheduler.config.max_running

    @property
    def pool_blocks(self) -> int:
        return self.ledger.num_blocks

    @property
    def vocab_size(self) -> int:
        return self.runner.config.vocab_size

    def num_running(self) -> int:
        """Requests with a branch admitted now (one atomic read; cheap enough for every HTTP request)."""
        return len(self.scheduler.running)

    def set_quota(self, trust_group: str, max_blocks: int | None) -> None:
        """Cap the KV blocks ``trust_group`` may hold or have committed (``KVLedger.set_quota``): its
        requests past the cap wait (without holding up other groups' requests), a request larger than the
        cap on its own is refused by :meth:`submit`. None removes the cap."""
        self.ledger.set_quota(trust_group, max_blocks)

    def snapshot(self) -> EngineSnapshot:
        """The engine's state for an operator, a server's ``/metrics`` or an audit (see
        :class:`EngineSnapshot`). Safe to call from any thread while the engine runs."""
        ledger, sched = self.ledger, self.scheduler
        stats = ledger.stats()
        prefix, life = stats["prefix_cache"], stats["lifetimes"]
        running = len(sched.running)
        with self._lock:
            live = len(self._live)
        return EngineSnapshot(
            steps=self.stats.steps, running=running, waiting=max(0, live - running), swapped=len(sched.swapped),
            max_running=self.max_running, pool_blocks=ledger.num_blocks, block_size=self.spec.block_size,
            blocks=dict(stats["usage"]), leases=life["leases"], admissions=dict(stats["admissions"]),
            evictions=life["evictions"], preemptions=sched.preemptions,
            prefix_query_tokens=prefix["query_tokens"], prefix_hit_tokens=prefix["hit_tokens"],
            groups=ledger.group_stats(), stats=self.stats.as_dict())

    # ---- the loop -------------------------------------------------------------------------------
    def step(self) -> list[TokenEvent]:
        """One engine step; returns the events it produced (also delivered to callbacks/streams)."""
        with self._step_lock:
            result = self.driver.step()
            if result.plan is not None:
                self.stats.steps += 1
                plan = result.plan
                tokens = plan.num_tokens + sum(1 for w in plan.prefills if w.sample)
                if tokens:
                    counts = self.stats.iteration_tokens
                    counts[tokens] = counts.get(tokens, 0) + 1
            events: list[TokenEvent] = []
            self._stream(result, events)
            for observe in self.step_observers:
                observe(result)
            return events

    def run_until_idle(self, max_steps: int | None = None) -> None:
        """Step until every submitted request has finished (waiting for arrivals set in the future)."""
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

    def close(self) -> None:
        """Stop the background thread if any, then the transfer worker, and close the disk tier's file."""
        self.stop()
        if self.transfers is not None:
            self.transfers.close()

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
                if not self.driver.has_work():
                    with self._lock:
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
    def _executed(self, plan: StepPlan, output: StepOutput) -> None:
        """Between the executor and confirm: the peak of memory in use, beam bookkeeping counters."""
        self.stats.held_back = self.driver.beams.held_back
        self._track_peak()

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

    def _stream(self, result: StepResult, events: list[TokenEvent]) -> None:
        """Stream the tokens confirmed this step; complete the requests the driver finished."""
        now = result.end_s
        self.stats.failed += len(result.failed)
        done = {f.request.request_id: f for f in result.finished}
        sampled: set[str] = set()
        if result.plan is not None:
            sampled.update(w.request_id for w in (*result.plan.prefills, *result.plan.decodes) if w.sample)
        sched = self.scheduler
        token_lp, prompt_lp = self.executor.token_logprobs, self.executor.prompt_logprobs
        self.executor.token_logprobs, self.executor.prompt_logprobs = {}, {}
        with self._lock:
            lives = [(rid, self._live[rid]) for rid in sampled | set(done) if rid in self._live]
            for rid, got in prompt_lp.items():
                live = self._live.get(rid)
                if live is not None and live.prompt_logprobs is not None:
                    live.prompt_logprobs.update(got)
        for rid, live in lives:
            if live.params.beam:
                continue  # a beam search streams its winner when it is over
            finished = done.get(rid)
            if finished is not None:
                outputs = list(enumerate(finished.outputs))
            elif rid in sched:
                outputs = [(br.index, br.output) for br in sched.branches(rid)]
            else:
                continue
            plen = len(live.request.prompt)
            for branch, out in outputs:
                sent = live.emitted.get(branch, 0)
                if len(out) > sent:
                    new = [TokenEvent(rid, branch, out[i], plen + i, now) for i in range(sent, len(out))]
                    lp = token_lp.get((rid, branch))
                    if lp is not None and lp.token == new[-1].token:  # this step's sample is the last new token
                        new[-1] = dataclasses.replace(new[-1], logprobs=lp)
                    if live.prompt_logprobs is not None:
                        got = live.prompt_logprobs
                        new[0] = dataclasses.replace(new[0], prompt_logprobs=(None, *(got.get(i)
                                                                                    for i in range(1, plen))))
                        live.prompt_logprobs = None
                    self._emit(live, new, events)
                    live.emitted[branch] = len(out)
        for f in result.finished:
            live = self._live.get(f.request.request_id)
            if live is not None:
                self._complete(live, f, now, events)

    def _emit(self, live: _Live, new: list[TokenEvent], events: list[TokenEvent]) -> None:
        if live.first_token_s is None and new and new[0].token is not None:
            live.first_token_s = new[0].time_s
        if new and new[-1].token is not None:
            live.last_token_s = new[-1].time_s
        self.stats.generated_tokens += sum(1 for e in new if e.token is not None)
        for event in new:
            events.append(event)
            live.handle._push(event)
            self._notify(live, event)

    def _notify(self, live: _Live, event: TokenEvent) -> None:
        """Hand one event to the request's callback; a callback that raises fails its request only."""
        if live.on_token is None or live.callback_failed:
            return
        try:
            live.on_token(event)
        except Exception as exc:  # noqa: BLE001 -- a tenant's callback must not stop the engine
            live.callback_failed = True
            self.stats.callback_errors += 1
            if not event.finished:
                self.driver.fail(live.request.request_id,
                                 f"the on_token callback raised {type(exc).__name__}: {exc}")

    def _complete(self, live: _Live, f: FinishedRequest, now: float, events: list[TokenEvent]) -> None:
        rid = f.request.request_id
        prompt = list(live.request.prompt)
        outputs, reasons, m = f.outputs, f.finish_reasons, f.metrics
        if live.params.beam and outputs and outputs[0]:
            # The search is over: stream its winner.
            self._emit(live, [TokenEvent(rid, 0, t, len(prompt) + i, now) for i, t in enumerate(outputs[0])],
                       events)
        last = TokenEvent(rid, 0, None, len(prompt) + max((len(o) for o in outputs), default=0), now,
                          finished=True, finish_reason=reasons[0] if reasons else None)
        result = RequestResult(rid, prompt, [list(o) for o in outputs], list(reasons),
                               None if live.params.greedy or live.params.beam else live.seed,
                               m.arrival_s, m.first_token_s, m.finish_s if m.finish_s is not None else now,
                               m.preemptions, f.scores, m.hit_tokens, m, live.last_token_s)
        with self._lock:
            self._live.pop(rid, None)
        self.stats.completed += 1
        if "cancelled" in reasons:
            self.stats.cancelled += 1
        # The handle is complete before anyone hears of the end: a callback or stream that sees the
        # finished event reads the result at once.
        live.handle._finish(result, last)
        events.append(last)
        self._notify(live, last)

    def reset_prefix_cache(self, requeue_running: bool = False) -> Any:
        """Forget the prefix cache between steps (after a weight update, say); see
        :meth:`Scheduler.reset_prefix_cache`. Returns a ``CacheReset`` (true when done, with a reason)."""
        with self._step_lock:
            return self.scheduler.reset_prefix_cache(requeue_running)

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
            "host_blocks": self.scheduler.host.sizes[self.scheduler.host.names.index("host")]
            if self.scheduler.host is not None and "host" in self.scheduler.host.names else 0,
            "disk_blocks": self.scheduler.host.sizes[self.scheduler.host.names.index("disk")]
            if self.scheduler.host is not None and "disk" in self.scheduler.host.names else 0,
            "tiers": self.scheduler.tier_stats(),
            "transfers": self.transfers.stats() if self.transfers is not None else None,
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


__all__ = ["BUNDLED_MODELS", "Engine", "EngineSnapshot", "EngineStats", "RequestHandle", "RequestResult",
           "TokenCallback", "TokenEvent", "load_decoder", "load_runner", "model_context", "refuse_untested_kv_early",
           "resolve_model"]
