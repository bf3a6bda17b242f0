"""The KV ledger: admission with reservation, block tables, prefix sharing, growth and release.

Two ledgers live side by side and are never mixed:

* **live blocks** -- physical blocks in the :class:`BlockPool` (free / active / retained);
* **promises** -- blocks a running sequence has been promised for its reserved output allowance (and
  copy-on-write copies its branches will need) but has not materialised yet. They hold no data and no
  block id; they are a claim on capacity.

The promise rule (checked by :meth:`KVLedger.check`): ``promised <= free + evictable``. Admission keeps
it true, so every promise can be turned into a block without evicting or preempting a running request.
Admission is one atomic decision under the ledger's lock, so concurrent admissions cannot overcommit.

:class:`KVLedger` is the thread-safe face of collaborators that each own their state and state their
law: the :class:`~kvledger.core.promises.PromiseBook` (every promise, and the one rule), the
:class:`~kvledger.core.admission.AdmissionControl` (decisions and the digests of waiting requests), the
:class:`~kvledger.core.branches.Branches` (forks, beam steps, copy-on-write and its copy queue), the
:class:`~kvledger.core.lifetimes.LeaseBook` and :class:`~kvledger.core.lifetimes.PinBook`, the
:class:`~kvledger.core.quota.QuotaBook` and the :class:`~kvledger.core.offload.TierHandoff`. None has a
lock: the ledger takes its own around every call. The ledger itself keeps what every per-token operation
touches (the pool, the tables, growth, speculative slots, release), the cache controls that span every
collaborator, the statistics and the audit; its public methods are those of the collaborators it
answers for, one line each. That is why the module runs past 600 lines: the per-token paths must see
the pool and the tables without a call in between.
"""

from __future__ import annotations

import operator
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import replace
from typing import Any

from ..errors import ConfigError, InvariantError, LedgerError, OutOfBlocksError
from . import checks, native
from .admission import AdmissionControl, FamilyLayout
from .branches import Branches, beam_arguments
from .eviction import EvictionPolicy, as_policy
from .groups import KVCacheGroup
from .identity import CacheContext, block_digest_at, block_key, prompt_digests
from .lifetimes import CacheReset, LeaseBook, PinBook, lease_arguments
from .observe import Counters, EventLog, prefix_figures
from .offload import TierHandoff
from .pool import BlockPool
from .promises import PromiseBook, largest_allowance
from .quota import GroupUsage, QuotaBook
from .tiers import TierLedger
from .types import (
    MAX_TOKEN_ID,
    CopyOp,
    Decision,
    Outcome,
    Request,
    Retention,
    SequenceState,
    Usage,
    as_token_id,
    find_sequence,
    pop_known,
    show,
)
from .windows import GroupTables

MAX_POOL_BLOCKS = 2**24  # per-block facts live in flat lists: ~50 bytes of bookkeeping per block
MAX_BLOCK_SIZE = 2**16  # tokens per block

__all__ = ["CopyOp", "Decision", "KVLedger", "Outcome", "Request", "Retention", "SequenceState", "Usage"]


class KVLedger:
    """Owns one block pool and every sequence that holds blocks of it. Thread-safe.

    ``policy`` is an eviction policy object or a registered name (``core.eviction.EVICTION_POLICIES``:
    ``"lru"``, ``"priority"``); a named priority policy uses the ledger's ``clock``. Every argument is
    checked here: a wrong type or an out-of-range number is a :class:`ConfigError`.

    ``kv_groups``: a hybrid model's KV cache groups (`core.groups.KVCacheGroup`, the first of full attention;
    a block is one group's page). The sequence's table is the first group's; `core.windows.GroupTables` keeps
    the others (a sliding group's reservation bounded by its window, its blocks released as they leave it; a state
    group's one block per sequence held for its life),
    ``step_tokens`` being the most tokens one work computes. None or one group: the uniform ledger, untouched.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int = 16,
        *,
        prefix_caching: bool = True,
        policy: EvictionPolicy | str | None = None,
        events: EventLog | None = None,
        max_pinned_fraction: float = 0.25,
        clock: Callable[[], float] = time.monotonic,
        kv_groups: Sequence[KVCacheGroup] | None = None,
        step_tokens: int = 8192,
    ) -> None:
        num_blocks = checks.count(num_blocks, "num_blocks", minimum=None)
        if num_blocks <= 0:
            raise ConfigError(f"the pool needs at least one block, got {show(num_blocks)}")
        if num_blocks > MAX_POOL_BLOCKS:
            raise ConfigError(f"a pool of {show(num_blocks)} blocks is beyond the supported {MAX_POOL_BLOCKS:,}")
        block_size = checks.count(block_size, "block size", minimum=None)
        if not 0 < block_size <= MAX_BLOCK_SIZE:
            raise ConfigError(f"block size must be an integer in 1..{MAX_BLOCK_SIZE}, got {show(block_size)}")
        checks.flag(prefix_caching, "prefix_caching")
        checks.fraction(max_pinned_fraction, "max_pinned_fraction")
        if not callable(clock):
            raise ConfigError("clock must be a callable returning seconds")
        if events is not None and not callable(getattr(events, "emit", None)):
            raise ConfigError(f"events must be an EventLog (or have emit()), got {type(events).__name__}")
        self.block_size = block_size
        self.prefix_caching = prefix_caching
        self.pool = BlockPool(num_blocks, as_policy(policy, clock))
        configure = getattr(self.pool.retained, "configure", None)
        if configure is not None:  # tree policies: ghost bounds and the block cost's block size
            configure(num_blocks, block_size)
        self.promises = PromiseBook(self.pool)  # the only writer of every promise
        self.events = events
        if events is not None:
            self.pool.on_event = events.emit
        self.counters = Counters()
        self.clock = clock
        self._seqs: dict[str, SequenceState] = {}
        self._lock = threading.RLock()
        self._native = native.MODULE  # the optional C part (kvledger.core.native), None: pure Python
        pool, promises = self.pool, self.promises
        self._leases = LeaseBook(pool)
        self._pins = PinBook(pool, promises, float(max_pinned_fraction))
        self._quotas = QuotaBook(pool, promises, self._seqs, self._pins, block_size)
        self._admission = AdmissionControl(lock=self._lock, pool=pool, promises=promises, quotas=self._quotas,
                                    seqs=self._seqs, counters=self.counters, block_size=block_size,
                                    prefix_caching=prefix_caching, native=self._native, clock=clock)
        self._branches = Branches(pool=pool, promises=promises, seqs=self._seqs, counters=self.counters,
                                  block_size=block_size, events=events)
        self._handoff = TierHandoff(pool, promises, self._leases, self.counters)
        groups = tuple(kv_groups or ())
        if not all(isinstance(g, KVCacheGroup) for g in groups):
            raise ConfigError("kv_groups must be KVCacheGroup values")
        # The groups after the first (None: a uniform pool, and every path below is as it always was).
        self.groups: GroupTables | None = None
        if len(groups) > 1:
            self.groups = GroupTables(pool, promises, groups, block_size,
                                      checks.positive(step_tokens, "step_tokens"), prefix_caching=prefix_caching)
            self._quotas.kv_groups = self.groups
            self._branches.groups = self.groups
            self.groups.on_copy = self._group_copy

    # ---- queries --------------------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def promised(self) -> int:
        """Blocks promised and not yet materialised (read-only: :class:`PromiseBook` writes them)."""
        return self.promises.total

    @property
    def max_pinned_fraction(self) -> float:
        return self._pins.max_fraction

    @property
    def tiers(self) -> TierLedger | None:
        """The lower tiers evicted prefix blocks are demoted to (:meth:`attach_tiers`), or None."""
        return self._handoff.tiers

    @property
    def policy_name(self) -> str:
        return getattr(self.pool.retained, "name", type(self.pool.retained).__name__)

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks covering ``num_tokens``: the tail block is charged whole."""
        return self._blocks_for(checks.count(num_tokens, "num_tokens"))

    def _blocks_for(self, num_tokens: int) -> int:
        # The ledger's own callers pass token counts it computed: no check on the per-step paths.
        return -(-num_tokens // self.block_size)

    def largest_allowance(self, request: Request) -> int:
        """The largest output allowance (``max_new_tokens``) that ``request`` -- its prompt, branches,
        speculative slots and trust group, its own ``max_new_tokens`` ignored -- could ever be promised
        here: the most whose declaration (:func:`~kvledger.core.promises.declared_blocks`) fits the whole
        pool and its trust group's quota; 0 when not even one token could. Asking for it is never
        "never" (it may still wait for room); one token more is."""
        request = AdmissionControl.checked(request)
        limit = self.pool.num_blocks
        cap = self._quotas.cap(request.context.trust_group)
        if cap is not None:
            limit = min(limit, cap)
        return largest_allowance(len(request.prompt), limit, self.block_size, request.branches, request.lookahead)

    def usage(self) -> Usage:
        with self._lock:
            p = self.pool
            return Usage(p.num_blocks, p.num_free, p.num_active, p.num_retained, p.num_evictable,
                         self.promises.total, len(self._seqs), self._pins.total(),
                         p.deferred)

    def sequence(self, request_id: str) -> SequenceState:
        try:  # the hit is the hot path (a step's lease looks up every running sequence): no call in between
            return self._seqs[request_id]
        except (KeyError, TypeError):
            return find_sequence(self._seqs, request_id)  # raises the one "unknown sequence" error

    def sequences(self) -> list[str]:
        with self._lock:
            return list(self._seqs)

    def __contains__(self, request_id: object) -> bool:
        try:
            return request_id in self._seqs
        except TypeError:
            return False

    def ready_tokens(self, request_id: str) -> int:
        """Leading tokens whose KV is written and readable now (shared blocks still being filled by
        another request stop the count: a reader must wait for them, or compute them itself)."""
        with self._lock:
            seq = self.sequence(request_id)
            blocks, written = seq.table.blocks, self.pool.written
            n = seq.written_blocks
            while n < len(blocks) and written[blocks[n]]:
                n += 1
            return max(seq.num_computed, min(n * self.block_size, len(seq.tokens)))

    # ---- progress -------------------------------------------------------------------------------
    def mark_computed(self, request_id: str, num_tokens: int) -> None:
        """The first ``num_tokens`` tokens now have their KV written (after a prefill chunk or step).
        It never moves backwards: a smaller count than already recorded changes nothing."""
        num_tokens = checks.count(num_tokens, "mark_computed: num_tokens")
        with self._lock:
            seq = self.sequence(request_id)
            if num_tokens > len(seq.tokens):
                raise LedgerError(f"{request_id!r}: cannot compute {num_tokens} of {len(seq.tokens)} tokens")
            self._computed(seq, num_tokens)

    def _computed(self, seq: SequenceState, num_tokens: int) -> None:
        """Record that ``num_tokens`` leading tokens are written: full blocks become readable, and
        generated full blocks get their identity (prompt blocks got theirs at admission)."""
        if num_tokens <= seq.computed_mark:
            return
        seq.computed_mark = num_tokens
        bs = self.block_size
        full = num_tokens // bs
        if full <= seq.written_blocks:
            return
        blocks, written = seq.table.blocks, self.pool.written
        start = seq.written_blocks
        if full - start == 1:  # decode: one block at a time
            written[blocks[start]] = True
        elif self._native is None or self._native.set_items(written, blocks, start, full, True) is None:
            for i in range(start, full):
                written[blocks[i]] = True
        seq.written_blocks = full
        if self.prefix_caching and len(seq.digests) < full:
            digests, tokens, pool = seq.digests, seq.tokens, self.pool
            group = seq.context.trust_group
            first = len(digests)
            while len(digests) < full:
                i = len(digests)
                if seq.mm_items:  # a block an image covers (the prompt's partial tail) is keyed by it
                    digest = block_key(digests[-1] if digests else seq.root, tokens[i * bs:(i + 1) * bs], i * bs,
                                       seq.mm_items)
                else:
                    digest = block_digest_at(digests[-1] if digests else seq.root, tokens, i * bs, bs, self._native)
                digests.append(digest)
                if pool.on_event is None and digest not in pool.index:
                    pool.index[digest] = blocks[i]  # BlockPool.register, inlined
                    pool.digest[blocks[i]] = digest
                    pool.group[blocks[i]] = group
                    link = pool._policy_link
                    if link is not None:  # a tree policy learns the block's parent and depth
                        link(blocks[i], digest, pool.index.get(digests[i - 1]) if i else None, i)
                else:
                    pool.register(blocks[i], digest, group, parent=digests[i - 1] if i else None, depth=i)
            if seq.retention:
                self._admission.apply_retention(seq.retention, blocks, first, full)
        if self.groups is not None and self.prefix_caching:
            self.groups.register(seq.request_id, seq.digests, full)

    def append_token(self, request_id: str, token_id: int) -> list[CopyOp]:
        """Append one sampled token. Sampling it means the model has run over every earlier token, so
        their KV is confirmed written; the new token's KV is written by the next step. Returns the
        copy-on-write copies the runtime must perform before writing (usually none). On any error
        nothing changes."""
        with self._lock:
            seq = self.sequence(request_id)
            checked, fits = self._check_growth([(seq, token_id)])
            if not fits:
                raise self._no_room(seq)
            copies = self._branches.copies
            before = len(copies)
            self._grow(seq, checked[0][1])
            return copies[before:]

    def append_tokens(self, request_id: str, token_ids: Iterable[int], *, confirm: bool = True) -> None:
        """Append several tokens to one sequence. A bad token id or a length past ``max_new_tokens``
        changes nothing; growth past the reservation with no block left appends the tokens before it
        and raises :class:`OutOfBlocksError`. ``confirm=False``: the tokens are known but nothing has
        run over them yet (a prompt's tail that an engine computes in chunks), so appending them marks
        no earlier block written; :meth:`mark_computed` does as each chunk runs."""
        if isinstance(token_ids, (str, bytes)) or not hasattr(token_ids, "__iter__"):
            raise ConfigError(f"{request_id!r}: token ids must be a sequence of integers, got {show(token_ids)}")
        with self._lock:
            seq = self.sequence(request_id)
            checked, fits = self._check_growth([(seq, t) for t in token_ids])
            for _, token in checked[:fits]:
                self._grow(seq, token, confirm)
            if fits < len(checked):
                raise self._no_room(seq)

    def decode_step(self, steps: Iterable[tuple[str, int]]) -> None:
        """One engine step: append one token to each named sequence, under one lock acquisition.

        Every pair is checked before anything changes: an unknown sequence, a bad token id or a
        sequence past ``max_new_tokens`` raises and leaves every sequence as it was. Growth past a
        reservation with no block left is not a bad call but a full pool: the pairs before it are
        applied, in order, and :class:`OutOfBlocksError` names the sequence that could not grow.

        This is the ledger's hottest path, so the common case (the token lands inside the tail block,
        which the sequence owns alone) is a list append, remembered so that a later bad pair can undo
        it; the rest (every ``block_size`` tokens, the first write into a forked tail) is checked as a
        whole by :meth:`_check_growth` before any of it is applied."""
        bs = self.block_size
        if type(steps) is not list:
            steps = list(steps)
        with self._lock:
            seqs = self._seqs
            fast = self._native
            scan = fast.decode_fast(seqs, steps, bs, SequenceState) if fast is not None else None
            if scan is not None:  # the loop below, in C (None: an input the loop must see for itself)
                at, slow, opens = scan
                if not at:
                    return
            else:
                slow, at, raised_count = self._decode_common(steps)
                if slow is None:
                    return
                opens = raised_count == len(slow) and self._all_open_blocks(slow)
            if opens:
                # Usually each deferred pair opens the next block of its sequence from its promise, which
                # cannot fail: applied as it stands, without the general check below (the promises are
                # redeemed in one call; the allocations follow in the pairs' order).
                self.promises.redeem_each([seq for seq, _ in slow])
                allocate = self.pool.allocate
                for seq, token in slow:
                    n = len(seq.tokens)
                    self._computed(seq, n)
                    seq.cow_tail = False
                    seq.table.blocks.append(allocate())
                    seq.tokens.append(token)
                return
            try:
                checked, fits = self._check_growth(slow)
            except (LedgerError, ConfigError):
                self._undo_fast(steps, len(steps), at)
                raise
            if fits == len(checked):
                for seq, token in checked:
                    self._grow(seq, token)
                return
            # The pool runs out part-way: start again and apply the pairs in their order up to there.
            self._undo_fast(steps, len(steps), at)
            for request_id, token in steps:
                seq = seqs[request_id]
                tokens = seq.tokens
                n = len(tokens)
                if n % bs and seq.num_prompt < n < seq.limit and not seq.cow_tail and type(token) is int:
                    tokens.append(token)
                else:
                    self._grow(seq, operator.index(token))  # raises OutOfBlocksError where it runs out

    def _all_open_blocks(self, slow: list[tuple[SequenceState, object]]) -> bool:
        """Whether every deferred pair (one per sequence, none with a forked tail) just opens the next
        block of its sequence from its promise, with a valid token id: nothing there can fail."""
        bs = self.block_size
        for seq, token in slow:
            n = len(seq.tokens)
            if not (n % bs == 0 and seq.promised and n < seq.limit and n >= len(seq.table.blocks) * bs
                    and type(token) is int and 0 <= token <= MAX_TOKEN_ID):
                return False
        return True

    def _decode_common(self, steps: list) -> tuple[list | None, list[int] | None, int]:
        """:meth:`decode_step`'s first loop: append each token that lands inside a tail block its sequence
        owns alone; defer the rest. Returns the deferred pairs, their positions in ``steps`` and how many
        sequences had their flag raised -- ``(None, None, 0)`` when nothing was deferred."""
        bs, seqs = self.block_size, self._seqs
        slow = at = raised = None  # made at the first pair for the full path (most steps have none)
        # slow: pairs for the full path, in order; at: their positions in `steps` (not appended)
        # A sequence with a deferred pair must take its later pairs in this step in order, so it is
        # sent down the full path by the flag the common case already tests (cow_tail); the flags
        # are put back before anything is applied (raised). The common case stays one list append.
        pairs = iter(steps)  # on an error, its length hint says where the loop stopped
        try:
            try:
                for request_id, token in pairs:
                    seq = seqs.get(request_id)
                    if seq is None:
                        raise LedgerError(f"unknown sequence {show(request_id)}")
                    tokens = seq.tokens
                    n = len(tokens)
                    if (n % bs and seq.num_prompt < n < seq.limit and not seq.cow_tail
                            and type(token) is int and 0 <= token <= MAX_TOKEN_ID):
                        tokens.append(token)
                    else:
                        if slow is None or at is None or raised is None:
                            slow, at, raised = [], [], []
                        slow.append((seq, token))
                        at.append(len(steps) - operator.length_hint(pairs) - 1)
                        if not seq.cow_tail:
                            seq.cow_tail = True
                            raised.append(seq)
            finally:
                if raised:
                    for seq in raised:
                        seq.cow_tail = False
        except (LedgerError, TypeError, ValueError) as exc:
            self._undo_fast(steps, len(steps) - operator.length_hint(pairs) - 1, at)
            if isinstance(exc, LedgerError):
                raise
            raise ConfigError("decode_step takes (request_id, token_id) pairs") from None
        return slow, at, len(raised) if raised else 0

    def _undo_fast(self, steps: list, stop: int, deferred: list[int] | None) -> None:
        """Take back the tokens :meth:`decode_step` appended in its common case: every pair before
        position ``stop`` that was not deferred to the full path (their positions are ``deferred``)."""
        seqs, skip = self._seqs, set(deferred or ())
        for i in range(stop - 1, -1, -1):
            if i not in skip:
                seqs[steps[i][0]].tokens.pop()

    def _no_room(self, seq: SequenceState) -> OutOfBlocksError:
        return OutOfBlocksError(f"{seq.request_id!r} grew past its reservation and no unpromised block is left")

    def _token(self, seq: SequenceState, token: object) -> int:
        return as_token_id(token, seq.request_id)

    def _check_growth(self, items: list[tuple[SequenceState, object]]) -> tuple[list[tuple[SequenceState, int]], int]:
        """Check appending ``items`` in order, changing nothing. Token ids and length limits are
        checked for every pair (a bad one raises). Returns the pairs with their token ids as ``int``
        and how many leading pairs fit: a pair that opens a block beyond its sequence's promise needs
        one unpromised block, which lowers ``free + evictable - promised`` by one (promised blocks and
        copy-on-write copies, always promised, leave it as it is)."""
        bs = self.block_size
        state: dict[str, tuple[int, int, int]] = {}  # id -> (tokens, blocks, promise) after the pairs so far
        room = None  # unpromised blocks left, read once a pair needs one
        fits = -1
        out: list[tuple[SequenceState, int]] = []
        for seq, token in items:
            if type(token) is not int or not 0 <= token <= MAX_TOKEN_ID:
                token = self._token(seq, token)
            rid = seq.request_id
            st = state.get(rid)
            if st is None:
                n, held, promise = len(seq.tokens), len(seq.table.blocks), seq.promised
            else:
                n, held, promise = st
            if n >= seq.limit:
                raise LedgerError(f"{rid!r} already generated its max_new_tokens={seq.max_new_tokens}")
            if n % bs == 0 and n >= held * bs:
                held += 1
                if promise:
                    promise -= 1
                elif fits < 0:
                    if room is None:
                        room = self.promises.unpromised()
                    if room <= 0:
                        fits = len(out)
                    room -= 1
            state[rid] = (n + 1, held, promise)
            out.append((seq, token))  # type: ignore[arg-type]
        return out, (len(out) if fits < 0 else fits)

    def _grow(self, seq: SequenceState, token: int, confirm: bool = True) -> None:
        """Append one checked token (see :meth:`_check_growth`); ``confirm``: see :meth:`append_tokens`."""
        tokens = seq.tokens
        n = len(tokens)
        if n % self.block_size == 0:
            self._boundary(seq, n, confirm)
        else:
            if confirm:
                self._computed(seq, n)  # sampling this token confirms every earlier token (cheap if no new block)
            if seq.cow_tail:
                self._branches.copy_on_write(seq, n)
        tokens.append(token)

    def _boundary(self, seq: SequenceState, n: int, confirm: bool = True) -> None:
        """Token ``n`` starts a new block: the blocks before are fully written (unless the token is not
        ``confirm``-ed), and the new block comes from the sequence's promise or, past its reservation,
        from unpromised capacity."""
        if confirm:
            self._computed(seq, n)
        seq.cow_tail = False  # a full tail is immutable and shared as is; the new block is private
        blocks = seq.table.blocks
        if n < len(blocks) * self.block_size:
            return  # the block already exists (the prompt's allocation, or a speculative slot)
        promises = self.promises
        if not promises.redeem(seq) and promises.unpromised() <= 0:  # _check_growth rules this out
            raise OutOfBlocksError(f"{seq.request_id!r} grew past its reservation and no unpromised block is left")
        blocks.append(self.pool.allocate())

    # ---- speculative slots ----------------------------------------------------------------------
    def reserve_lookahead(self, request_id: str, slots: int) -> int:
        """Make sure blocks exist for ``slots`` positions beyond the newest token (draft tokens the
        verifier may accept). They come from the sequence's promise first. Returns blocks allocated.
        Draft slots are private to the sequence: a fork never shares its speculative blocks, and a
        partial tail still shared with a sibling is copied first (its copy-on-write happens now, not at
        the next token), since siblings drafting into one shared block would overwrite each other's
        draft KV in the same step. All or nothing: refused, nothing changes."""
        slots = checks.count(slots, "lookahead slots")
        if slots and self.groups is not None:
            raise LedgerError("a hybrid KV pool takes no speculative slots yet")
        with self._lock:
            seq = self.sequence(request_id)
            n = len(seq.tokens)
            need = self._blocks_for(n + slots) - len(seq.table.blocks)
            pool, promises = self.pool, self.promises
            if need > seq.promised + max(promises.unpromised(), 0):
                raise OutOfBlocksError(f"{request_id!r}: no room for {slots} lookahead slots")
            if slots and seq.cow_tail and n % self.block_size:
                self._branches.copy_on_write(seq, n)  # the copy was promised when the tail became shared
            for _ in range(max(need, 0)):
                promises.redeem(seq)
                seq.table.blocks.append(pool.allocate())
            seq.draft_end = n + slots
            return max(need, 0)

    def trim_lookahead(self, request_id: str) -> int:
        """Free blocks beyond the sequence's tokens (rejected draft slots); those within the
        reservation become promises again. Returns blocks freed.

        Only blocks whose release really returns capacity are trimmed: while the sequence has an
        outstanding lease (an in-flight step may still write its draft slots) nothing is trimmed, and
        a trailing block a transfer still leases stays the sequence's own slot. So a
        re-promise is always backed by a block that just became free (``promised <= free +
        evictable`` holds) and a full-reservation request never loses blocks it was promised."""
        with self._lock:
            seq = self.sequence(request_id)
            blocks = seq.table.blocks
            keep = self._blocks_for(len(seq.tokens))
            if self._leases.holds(request_id):
                return 0
            seq.draft_end = 0  # the step that wrote the drafts is confirmed: no draft slot is live
            if len(blocks) <= keep:
                return 0
            # Speculative blocks are never shared (check() enforces it), so only a block lease can
            # keep one from being freed.
            leased = self.pool.leased
            cut = len(blocks)
            while cut > keep and not leased[blocks[cut - 1]]:
                cut -= 1
            extra = blocks[cut:]
            if not extra:
                return 0
            del blocks[cut:]
            self.pool.release_many(extra[::-1])
            repromise = max(0, min(len(extra), seq.reserved_blocks - len(blocks) - seq.promised))
            self.promises.promise(seq, repromise)
            return len(extra)

    # ---- release --------------------------------------------------------------------------------
    def release(self, request_id: str) -> None:
        """Finish a sequence (see :meth:`_drop`)."""
        with self._lock:
            self._drop(request_id)
            self.counters.finished += 1

    def retract(self, request_id: str) -> None:
        """Undo one :meth:`admit` of a single sequence that the caller could not complete. (A family of
        branches comes back whole or not at all through :meth:`admit_family`, which needs no undo.)"""
        with self._lock:
            seq = self._drop(request_id)
            if seq.readmitted:
                self.counters.readmitted -= 1
            else:
                self.counters.admitted -= 1

    def preempt(self, request_id: str, *, counted: bool = True) -> list[int]:
        """Take a running sequence's memory away (the scheduler recovers it by recompute or from a host
        copy). Its full, written blocks stay in the prefix index as retained cache, which softens a later
        recompute. Returns its token ids: the state a recompute must replay. Counted once per sequence
        (a family of n live branches preempted together: n; the scheduler and the request count the
        family once). ``counted=False`` for a requeue that is no preemption (a cache reset's, or the
        driver's after a failed step part), which the scheduler does not count either."""
        with self._lock:
            tokens = list(self.sequence(request_id).tokens)
            self._drop(request_id)
            if counted:
                self.counters.preemptions += 1
            return tokens

    def cancel(self, request_id: str) -> bool:
        """Cancel a request at any point: every branch of it is dropped and its promises freed at once;
        blocks still leased by an in-flight step are released when that lease ends. Cancelling a
        request that was never admitted (or already finished) is a no-op and returns False."""
        with self._lock:
            if not isinstance(request_id, str):
                return False
            family = [rid for rid, s in self._seqs.items() if s.family == request_id or rid == request_id]
            for rid in family:
                self._drop(rid)
            if family:
                self.counters.cancelled += 1
            return bool(family)

    def _drop(self, request_id: str) -> SequenceState:
        """Drop a sequence's references, tail block first so that LRU eviction takes its deepest blocks
        before its shared head, and cancel its unmaterialised promises."""
        seq: SequenceState = pop_known(self._seqs, request_id, "sequence {} (already released?)")
        blocks = seq.table.blocks
        if seq.cow_tail:
            self.promises.redeem_copy(blocks[len(seq.tokens) // self.block_size])  # it leaves without copying
        if self._branches.copies:  # a copy into a block that is about to be released must never run
            self._branches.forget_copies_into(blocks if self.groups is None else blocks + self.groups.live(request_id))
        if self._leases.any_sequence():  # (a hybrid pool's other groups' blocks are the sequence's too)
            self._leases.hand_over(request_id, blocks if self.groups is None else blocks + self.groups.live(request_id))
        self.pool.release_many(blocks[::-1])
        self.promises.cancel(seq)
        if self.groups is not None:
            self.groups.close(request_id)
        return seq

    def _group_copy(self, src: int, dst: int, slots: int) -> None:
        """A hybrid pool's group copied a shared block for a work about to write into it: the runtime copies the
        first ``slots`` positions before the step, like a forked tail's (`take_copies`)."""
        self._branches.copies.append(CopyOp(src, dst, slots))
        self.counters.copies += 1

    def take_copies(self) -> list[CopyOp]:
        """Copy-on-write instructions recorded since the last call; the runtime executes them before
        the step that writes the destination blocks."""
        with self._lock:
            return self._branches.take_copies()

    # ---- admission (core/admission.py) ------------------------------------------------------------
    def can_admit(self, request: Request, keep_free: int = 0) -> Decision:
        """The decision :meth:`admit` would take now, without changing anything."""
        if self.groups is not None:
            return self._admit_grouped([request], keep_free, lambda rs, k: self._admission.can_admit(rs[0], k),
                                       open_=False)
        return self._admission.can_admit(request, keep_free)

    def admit(self, request: Request, keep_free: int = 0) -> Decision:
        """Admit ``request`` atomically: share indexed prefix blocks, allocate the rest of the prompt,
        and promise the reserved output allowance -- or change nothing and say why not. A request with
        ``branches=k`` opens ``k`` sequences (``id``, ``id/1`` ...), forks of one another.

        ``keep_free`` blocks must stay available after the admission: the watermark or emergency
        headroom of policies that do not reserve the whole output allowance."""
        if self.groups is not None:
            return self._admit_grouped([request], keep_free, lambda rs, k: self._admission.admit(rs[0], k))
        return self._admission.admit(request, keep_free)

    def admit_family(self, requests: Sequence[Request], keep_free: int = 0) -> Decision:
        """Re-admit the branches of one preempted request together, all-or-nothing.

        ``requests`` are single-branch requests (``branches == 1``) of one family: the same ``family``
        (or, for the first, its own id), distinct ids, one context, and the same ``readmission`` and
        ``read_prefix_cache`` switches; their tokens may have diverged. One decision is taken under
        the lock. On refusal nothing changes -- no eviction, no prefix-cache query or hit counted, no
        event, no index entry -- except the ``not_now`` / ``never`` outcome counter. On success the
        branches share the full blocks of their common token prefixes as :meth:`fork` would have
        shared them, with or without prefix caching; a partial tail held by branches with identical
        tokens is shared copy-on-write (one promised copy per extra holder); prefix-index hits are
        used when caching is on and the family reads the cache. A block shared by several branches
        appears in each of their tables: whoever restores contents (a swap-in) writes it once.

        The outcome is NEVER when the family could not fit even the empty pool, counting that
        sharing and every branch's whole ``max_new_tokens`` and lookahead.

        The returned decision names the family; its block figures are the family's: ``blocks_hit`` and
        ``blocks_new`` count distinct blocks, ``blocks_promised`` every branch's reserved allowance
        plus the tail copies, ``blocks_branches`` what the branches after the first add to it, and
        ``blocks_total`` the family's distinct blocks at its reserved lengths."""
        if self.groups is not None:
            if isinstance(requests, (str, bytes, Request)) or not hasattr(requests, "__iter__"):
                raise ConfigError("admit_family takes a sequence of Request, one per branch")
            return self._admit_grouped(list(requests), keep_free, self._admission.admit_family, family=True)
        return self._admission.admit_family(requests, keep_free)

    def _admit_grouped(self, requests: list[Request], keep_free: int,
                       decide: Callable[[list[Request], int], Decision], open_: bool = True,
                       family: bool = False) -> Decision:
        """A hybrid pool's admission: the first group's decision with the other groups' reservation kept free on
        top, and on success that reservation promised -- one decision under the lock. Every branch is promised
        its own reservation per group and opens its own tables there, the branches of a new request (``branches=n``)
        each with the prompt's hit (`core.windows.GroupTables.open`). A re-admitted family of several branches
        reads no prefix cache (the hit every group serves is agreed for one prompt, not a family's trie)."""
        reqs = [AdmissionControl.checked(r) for r in requests]
        if not reqs:
            raise ConfigError("admit_family needs at least one request")
        if any(r.lookahead for r in reqs):
            raise ConfigError(f"request {reqs[0].request_id!r}: a hybrid KV pool takes no speculative slots yet")
        groups = self.groups
        if groups is None:
            raise InvariantError("a grouped admission on a uniform pool")
        head = reqs[0]
        if family and len(reqs) > 1:  # a family's hits are not agreed per group: its branches recompute
            reqs = [replace(r, read_prefix_cache=False) for r in reqs]
        head = reqs[0]
        prompt_len = len(head.prompt)
        limits = [len(r.prompt) + r.max_new_tokens for r in reqs]
        if family:
            ids = [r.request_id for r in reqs]
        else:
            ids = [head.request_id, *(f"{head.request_id}/{i}" for i in range(1, head.branches))]
            limits = limits * head.branches
        need = sum(groups.need(lim) for lim in limits)
        opened: list[bool] = []

        def open_all(hit: int) -> None:
            for i, (rid, lim) in enumerate(zip(ids, limits, strict=True)):
                groups.open(rid, len(reqs[min(i, len(reqs) - 1)].prompt), lim, hit)
            groups.forget_hit()
            opened.append(True)

        def take() -> None:  # the first group holds its hits: the other groups take theirs before any allocation
            open_all(groups.agreed_hit)

        admission = self._admission
        with self._lock:
            first = self._blocks_for(limits[0])
            if first + need > self.pool.num_blocks:
                self.counters.rejected_never += 1
                return Decision(head.family or head.request_id, Outcome.NEVER,
                                f"needs {first + need} blocks ({first} full-attention + {need} in its other KV "
                                f"cache groups) but the pool has {self.pool.num_blocks}", first + need, 0, 0, 0, 0)
            groups.forget_hit()
            if self.prefix_caching:
                admission.hit_cap = lambda digests, hits: groups.agreed(digests, hits, prompt_len)
            admission.on_commit = take if open_ else None
            try:
                decision = decide(reqs, checks.count(keep_free, "keep_free") + need)
            finally:
                admission.hit_cap = admission.on_commit = None
            if not decision.admitted:
                return decision
            if open_ and not opened:
                open_all(0)
            return replace(decision, blocks_total=decision.blocks_total + need,
                           blocks_promised=decision.blocks_promised + need)

    def group_tables(self, request_id: str, start: int, end: int) -> tuple[list[int], ...]:
        """A hybrid pool: every KV cache group's block table for a work computing positions ``[start, end)`` --
        the sequence's own table first, then the others (sliding groups having released what left the window,
        `core.windows.GroupTables.tables`). The ledger's lists: read them, never change them."""
        groups = self.groups
        if groups is None:
            raise LedgerError("group_tables: this pool is uniform (one KV cache group)")
        with self._lock:
            seq = self.sequence(request_id)
            if end > len(seq.table.blocks) * self.block_size:
                raise LedgerError(f"{request_id!r}: a work up to {end} passes its table")
            return (seq.table.blocks, *groups.tables(request_id, start, end))


    def group_entries(self, request_id: str) -> list[tuple[int, int, int]]:
        """A hybrid pool: ``(group, entry, block)`` of each live block of the groups after the first (group 1 is
        the second): what swapping the sequence out copies besides its own table."""
        if self.groups is None:
            return []
        with self._lock:
            return self.groups.live_entries(request_id)

    def restore_group_tables(self, request_id: str, computed: int, host: dict[tuple[int, int], int]
                             ) -> list[tuple[int, int]] | None:
        """A hybrid pool: a swapped-in sequence's other groups' blocks for its first ``computed`` tokens, filled
        from ``host[(group, entry)]``: the ``(host slot, block)`` copies, or None when the host copy lacks an entry
        (recompute from 0). See `core.windows.GroupTables.restore`."""
        groups = self.groups
        if groups is None:
            raise LedgerError("restore_group_tables: this pool is uniform (one KV cache group)")
        with self._lock:
            self.sequence(request_id)
            return groups.restore(request_id, computed, host)

    def family_layout(self, requests: Sequence[Request], digests: list[list[bytes]]) -> FamilyLayout:
        """The block-sharing trie of a family (pure; see :class:`~kvledger.core.admission.FamilyLayout`)."""
        return FamilyLayout.of(requests, digests, self.block_size, self.prefix_caching)

    # ---- quotas (core/quota.py) -------------------------------------------------------------------
    def set_quota(self, trust_group: str, max_blocks: int | None) -> None:
        """Cap what ``trust_group`` may be charged (active + promised + growth blocks, see
        :mod:`kvledger.core.quota`) at ``max_blocks``; None removes the cap. A cap below the group's
        charge now refuses its admissions until it is back under; nothing running is touched."""
        with self._lock:
            self._quotas.set(trust_group, max_blocks)

    def quotas(self) -> dict[str, int]:
        with self._lock:
            return dict(self._quotas.caps)

    def group_usage(self, trust_group: str | None = None) -> dict[str, GroupUsage]:
        """The operator's view of the group ledgers: every group holding blocks or with a cap (or only
        ``trust_group``), with its cap. A tenant may be shown its own group's entry, never the others."""
        if trust_group is not None and (type(trust_group) is not str or not trust_group):
            raise ConfigError(f"group_usage takes a trust group name (a non-empty string), got {show(trust_group)}")
        with self._lock:
            if trust_group is not None:
                return {trust_group: self._quotas.usage_of(trust_group)}
            return self._quotas.usage()

    def group_stats(self) -> dict[str, dict[str, int | None]]:
        """The operator's per-group report, read under one lock: each group's ledger (active, promised,
        growth, charged, cap), its prefix-cache figures of first admissions (query_tokens, hit_tokens)
        and the admissions its quota refused, for every group with blocks, a cap or counters."""
        with self._lock:
            return self._quotas.report(self.counters)

    # ---- branches (core/branches.py) --------------------------------------------------------------
    def fork(self, parent_id: str, child_id: str) -> int:
        """Fork ``parent_id`` into a new sequence ``child_id``. Returns the blocks newly promised (the
        child's output allowance plus one tail copy if the tail is partial). Raises AdmissionError when
        the pool cannot promise them now: a fork is an admission of one more branch."""
        with self._lock:
            return self._branches.fork(parent_id, child_id)

    def beam_step(self, forks: list[tuple[str, str]], drops: list[str]) -> None:
        """One beam-search step: drop the pruned beams, then fork the survivors that spawn more than one
        continuation. Dropping releases only blocks no surviving beam holds (ref counts); a dropped
        beam's blocks that an in-flight step still reads stay until its lease ends. All or nothing."""
        pairs, dropped = beam_arguments(forks, drops)
        with self._lock:
            self._branches.beam_step(pairs, dropped, self._drop)

    # ---- leases and pins (core/lifetimes.py) ------------------------------------------------------
    def lease(self, request_ids: Iterable[str] = (), blocks: Iterable[int] = (), owner: str = "") -> int:
        """Mark an outstanding access to the named sequences and to extra ``blocks``; returns a lease id.
        ``owner`` names who took it (a step, a transfer): :meth:`leases` lists outstanding leases by
        owner, so a caller can check that every one belongs to something still in flight.

        Leasing a sequence costs O(1) however many blocks it holds (an engine leases every scheduled
        sequence every step). Only if a leased sequence is dropped -- finished, cancelled, pruned,
        preempted -- are its blocks leased one by one, so that their release is deferred until the
        lease ends. A block lease marks single blocks (a transfer reading blocks directly); only a
        block someone holds can be leased. Everything is checked before anything is leased."""
        ids, extra = lease_arguments(request_ids, blocks, owner)
        with self._lock:
            seqs = self._seqs
            for rid in ids:  # every id names a running sequence (one membership test each: a step leases all)
                try:
                    if rid in seqs:
                        continue
                except TypeError:
                    pass
                find_sequence(seqs, rid)  # raises the one "unknown sequence" error
            return self._leases.take(ids, extra, owner)

    def end_lease(self, lease_id: int) -> None:
        """The access finished: the releases it deferred complete now, tail block first."""
        with self._lock:
            self._leases.end(lease_id)

    def is_leased(self, request_id: str) -> bool:
        """Whether a sequence has an outstanding lease (its blocks cannot be released before it ends)."""
        return self._leases.holds(request_id)

    def outstanding_leases(self) -> int:
        return len(self._leases)

    def leases(self) -> dict[int, str]:
        """Every outstanding lease: lease id -> owner (the name given to :meth:`lease`)."""
        with self._lock:
            return self._leases.owners()

    def pin(self, name: str, prompt: Sequence[int], context: CacheContext) -> int:
        """Pin the cached, written full blocks of ``prompt`` (its leading chain in the prefix index) so
        they are never evicted. Returns the number of blocks pinned (0 if nothing is cached yet)."""
        if not self.prefix_caching:
            raise LedgerError("pinning needs prefix caching")
        if self.groups is not None:  # a hit needs every group's blocks; a pin would hold the first group's alone
            raise LedgerError("a hybrid KV pool pins no prefixes yet: a prefix hit needs every group's blocks, and a "
                              "pin would hold only the full-attention group's")
        if type(name) is not str or not name:
            raise ConfigError(f"a pin is named by a non-empty string, got {show(name)}")
        if not isinstance(context, CacheContext):
            raise ConfigError(f"pin: context must be a CacheContext, got {show(context)}")
        if prompt is None or isinstance(prompt, (str, bytes)):
            raise ConfigError(f"pin: the prompt must be a sequence of token ids, got {show(prompt)}")
        digests = prompt_digests(context.root_digest(), prompt, self.block_size, self._native)
        with self._lock:
            return self._pins.pin(name, digests)

    def unpin(self, name: str) -> None:
        with self._lock:
            self._pins.unpin(name)

    def pins(self) -> dict[str, int]:
        with self._lock:
            return self._pins.counts()

    # ---- lower tiers (core/offload.py) ------------------------------------------------------------
    def attach_tiers(self, tiers: TierLedger | None) -> None:
        """Demote evicted prefix blocks into ``tiers`` from now on (None detaches). Needs prefix caching:
        without block identities there is nothing to find again."""
        if tiers is not None and not isinstance(tiers, TierLedger):
            raise ConfigError(f"attach_tiers takes a TierLedger, got {type(tiers).__name__}")
        if tiers is not None and not self.prefix_caching:
            raise ConfigError("demoting prefix blocks to a lower tier needs prefix caching")
        if tiers is not None and self.groups is not None:
            raise ConfigError("a hybrid KV pool demotes no prefix blocks to a lower tier yet")
        with self._lock:
            self._handoff.attach(tiers)

    def promote_from_tiers(self, request: Request, owner: str, keep_free: int = 0
                           ) -> tuple[list[tuple[int, int]], int | None]:
        """Bring back the request's prompt blocks the tiers hold (after its device hits, same trust group,
        as far as unpromised capacity allows). Returns ``(pairs, lease)``: ``(tier slot, device block)`` per
        promoted block, in prompt order, and the lease that keeps them until the transfer is done (end it
        with ``end_lease``); ``([], None)`` when nothing is promoted. Changes nothing on a bad request."""
        keep_free = checks.count(keep_free, "keep_free")
        if type(owner) is not str or not owner:
            raise ConfigError("promote_from_tiers needs an owner name for its lease")
        admission = self._admission
        request = admission.checked(request)
        if (self._handoff.tiers is None or not self.prefix_caching or not request.read_prefix_cache
                or admission.never(request)):
            return [], None
        digests = admission.prepare(request, remember=True)  # the admission that follows reuses them
        with self._lock:
            return self._handoff.promote(digests, request.context.trust_group, owner, keep_free)

    def invalidate(self, blocks: list[int]) -> None:
        """A transfer into ``blocks`` failed: they lose their identity (nobody will hit them again). A
        retained one is freed; a held or leased one is freed when its holders let go."""
        with self._lock:
            self._handoff.invalidate(blocks)

    # ---- the prefix cache as a whole ----------------------------------------------------------------
    def clear_cache(self) -> int:
        """Evict every retained block (running requests and pins are untouched). Returns the count."""
        with self._lock:
            victims = self.pool.retained.blocks()
            for block in victims:
                self.pool.evict(block, kind="cleared")
            self.counters.cleared += len(victims)
            return len(victims)

    def reset_prefix_cache(self) -> CacheReset:
        """Forget the whole prefix cache, as vLLM's ``reset_prefix_cache`` does (after a weight update,
        say): only when no block is held -- by a sequence, a pin, a lease or a deferred release --
        since a held block's identity is still in use, and no transfer to or from an attached tier is
        in flight (a demotion still being written would land an old entry after the reset). Refused,
        it changes nothing and says why. Done, the prefix index, the retained blocks, the eviction
        policy's memory (priorities, expiry), the remembered digests of waiting requests, every cached
        entry of the attached tiers (host, disk: KV of the old weights must never be promoted back)
        and the hit-rate window are all empty, and every block is free."""
        with self._lock:
            pool, tiers = self.pool, self._handoff.tiers
            held = []
            if self._seqs:
                held.append(f"{len(self._seqs)} running sequences")
            pinned = self._pins.total()
            if pinned:
                held.append(f"{pinned} pinned blocks")
            if len(self._leases):
                held.append(f"{len(self._leases)} outstanding leases")
            if pool.deferred:
                held.append(f"{pool.deferred} deferred releases")
            moving = tiers.transfers_in_flight() if tiers is not None else 0
            if moving:
                held.append(f"{moving} tier transfers in flight")
            if held:
                return CacheReset(False, 0, "blocks are still held: " + ", ".join(held))
            cleared = pool.drop_cache()
            tier_cleared = tiers.clear_cache() if tiers is not None else 0
            self._admission.forget()
            self._branches.take_copies()
            self.counters.cleared += cleared
            self.counters.cache_resets += 1
            self.counters.window.clear()  # the hit rate restarts with the cache, as vLLM's metrics do
            where = f" and {tier_cleared} tier entries" if tiers is not None else ""
            return CacheReset(True, cleared, f"{cleared} cached blocks{where} cleared", tier_cleared)

    # ---- statistics -------------------------------------------------------------------------------
    def token_usage(self) -> dict[str, int]:
        """Usage in token states: a block half full is half used. Shared blocks count once."""
        with self._lock:
            bs = self.block_size
            fill: dict[int, int] = {}
            for seq in self._seqs.values():
                blocks, n = seq.table.blocks, len(seq.tokens)
                for i, b in enumerate(blocks):
                    used = min(bs, n - i * bs)
                    if used > fill.get(b, 0):
                        fill[b] = used
            for blocks in self._pins.held():
                for b in blocks:
                    fill[b] = bs
            held_slots = len(fill) * bs
            used = sum(fill.values())
            return {
                "token_slots_held": held_slots,  # slots of blocks held by sequences and pins
                "token_slots_used": used,  # of those, slots that hold a token
                "tail_slack_slots": held_slots - used,
                "retained_token_slots": self.pool.num_retained * bs,  # cached, idle, full blocks
            }

    def stats(self) -> dict[str, Any]:
        """The operator's view: counters, hit rates and usage of the whole pool, every group's totals.
        ``prefix_cache`` counts first admissions only; ``prefix_cache_readmissions`` the requests brought
        back after preemption (they mostly find their own blocks again). Never contains digests. A
        tenant's view is :meth:`tenant_stats`."""
        with self._lock:
            c = self.counters
            materialised = sum(len(s.table.blocks) for s in self._seqs.values())
            return {
                "prefix_cache": {**prefix_figures(c.totals()), "window_hit_rate": c.window_hit_rate(),
                                 "read_skipped": c.read_skipped},
                "prefix_cache_readmissions": prefix_figures(c.totals(readmission=True)),
                "admissions": {"admitted": c.admitted, "readmitted": c.readmitted, "not_now": c.rejected_not_now,
                               "never": c.rejected_never},
                "lifetimes": {"finished": c.finished, "cancelled": c.cancelled, "forks": c.forks,
                              "copies": c.copies, "preemptions": c.preemptions,
                              "evictions": self.pool.evictions, "cleared": c.cleared, "cache_resets": c.cache_resets,
                              "pending_releases": self.pool.deferred, "leases": len(self._leases)},
                "promises": {"promised": self.promises.total, "materialised_block_refs": materialised},
                "usage": self.usage().as_dict(),
                "tokens": self.token_usage(),
                "eviction_policy": self.policy_name,
            }

    def tenant_stats(self, trust_group: str) -> dict[str, Any]:
        """A tenant's view: its own group's prefix-cache figures (first admissions and re-admissions),
        nothing about the pool or any other group. ``trust_group`` must be a group name (a string)."""
        if type(trust_group) is not str:
            raise ConfigError(f"tenant_stats needs a trust group name (str), got {show(trust_group)}")
        with self._lock:
            c = self.counters
            return {
                "trust_group": trust_group,
                "prefix_cache": prefix_figures(c.groups.get(trust_group)),
                "prefix_cache_readmissions": prefix_figures(c.readmission_groups.get(trust_group)),
            }

    # ---- audit ----------------------------------------------------------------------------------
    def check(self) -> None:
        """Assert every conservation law; O(pool + tables). Tests call it after every operation."""
        with self._lock:
            pool = self.pool
            pool.check()
            refs = [0] * pool.num_blocks
            promised = 0  # the sequences' promises
            bs = self.block_size
            ref, digest_of = pool.ref, pool.digest
            for seq in self._seqs.values():
                blocks = seq.table.blocks
                n = len(seq.tokens)
                covered = -(-n // bs)
                if len(blocks) < covered:  # more is fine: speculative lookahead slots
                    raise InvariantError(f"{seq.request_id!r}: {len(blocks)} blocks for {n} tokens")
                if seq.promised < 0:
                    raise InvariantError(f"{seq.request_id!r}: negative promise")
                # Reservation law: a sequence is promised exactly what its reservation lacks in blocks.
                if seq.promised != max(0, seq.reserved_blocks - len(blocks)):
                    raise InvariantError(
                        f"{seq.request_id!r}: promised {seq.promised} but its reservation of {seq.reserved_blocks} "
                        f"blocks lacks {max(0, seq.reserved_blocks - len(blocks))} ({len(blocks)} held)")
                for b in blocks[covered:]:  # speculative slots are written by this sequence alone
                    if ref[b] != 1 or digest_of[b] is not None:
                        raise InvariantError(f"{seq.request_id!r}: speculative block {b} is shared or indexed")
                if seq.draft_end > n and n % bs and ref[blocks[n // bs]] != 1:
                    raise InvariantError(f"{seq.request_id!r}: draft slot {n} lies in block {blocks[n // bs]}, "
                                         f"held by {ref[blocks[n // bs]]} sequences or pins (draft slots are private)")
                identified = max(seq.num_prompt, seq.computed_mark) // bs
                if self.prefix_caching and len(seq.digests) != identified:
                    raise InvariantError(
                        f"{seq.request_id!r}: {len(seq.digests)} digests, expected {identified}")
                for b in blocks:
                    refs[b] += 1
                promised += seq.promised
            for blocks in self._pins.held():
                for b in blocks:
                    refs[b] += 1
            if self.groups is not None:
                self.groups.check(self._seqs, refs)
                promised += self.groups.total
            if refs != pool.ref:
                bad = [b for b in range(pool.num_blocks) if refs[b] != pool.ref[b]][:8]
                raise InvariantError(f"ref counts disagree with block tables and pins at blocks {bad}")
            self._leases.check(self._seqs)
            self.promises.check(promised)
            tiers = self._handoff.tiers
            if tiers is not None:
                if pool.on_evict is None:
                    raise InvariantError("tiers are attached but the pool's evictions are not demoted")
                tiers.check()
            self._quotas.check()
