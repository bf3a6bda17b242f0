"""The KV ledger: admission with reservation, block tables, prefix sharing, growth and release.

Two ledgers live side by side and are never mixed:

* **live blocks** -- physical blocks in the :class:`BlockPool` (free / active / retained);
* **promises** -- blocks a running sequence has been promised for its reserved output allowance (and
  copy-on-write copies its branches will need) but has not materialised yet. They hold no data and no
  block id; they are a claim on capacity.

The promise rule (checked by :meth:`KVLedger.check`): ``promised <= free + evictable``. Admission keeps
it true, so every promise can be turned into a block without evicting or preempting a running request.
Admission is one atomic decision under the ledger's lock, so concurrent admissions cannot overcommit.

Branches (forks, beam search), leases, pins and statistics live in :mod:`.branches` and
:mod:`.lifetimes`, demotion to and promotion from lower tiers in :mod:`.offload`, mixed into
:class:`KVLedger`; they share its lock and its state. This module keeps what every per-token operation
touches together (the pool, the tables, growth, speculative slots, release and the audit), which is why
it runs past 600 lines. Promises already have their owner (:class:`~kvledger.core.promises.PromiseBook`,
which every one of those paths asks); moving leases and quotas into objects that own their state is the
split still planned, not a further mixin.
"""

from __future__ import annotations

import math
import operator
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable

from ..errors import ConfigError, InvariantError, LedgerError, OutOfBlocksError
from . import native
from .admission import AdmissionOps
from .branches import BranchOps
from .eviction import EvictionPolicy, as_policy
from .identity import block_digest_at
from .lifetimes import Lease, LifetimeOps
from .observe import Counters, EventLog
from .offload import OffloadOps
from .pool import BlockPool
from .promises import PromiseBook, largest_allowance
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
    as_count,
    as_token_id,
    show,
)

MAX_POOL_BLOCKS = 2**24  # per-block facts live in flat lists: ~50 bytes of bookkeeping per block
MAX_BLOCK_SIZE = 2**16  # tokens per block

__all__ = ["CopyOp", "Decision", "KVLedger", "Outcome", "Request", "Retention", "SequenceState", "Usage"]


class KVLedger(AdmissionOps, BranchOps, LifetimeOps, OffloadOps):
    """Owns one block pool and every sequence that holds blocks of it. Thread-safe.

    ``policy`` is an eviction policy object or a registered name (``core.eviction.EVICTION_POLICIES``:
    ``"lru"``, ``"priority"``); a named priority policy uses the ledger's ``clock``. Every argument is
    checked here: a wrong type or an out-of-range number is a :class:`ConfigError`.
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
    ) -> None:
        num_blocks = as_count(num_blocks, "num_blocks", minimum=None)
        if num_blocks <= 0:
            raise ConfigError(f"the pool needs at least one block, got {show(num_blocks)}")
        if num_blocks > MAX_POOL_BLOCKS:
            raise ConfigError(f"a pool of {show(num_blocks)} blocks is beyond the supported {MAX_POOL_BLOCKS:,}")
        block_size = as_count(block_size, "block size", minimum=None)
        if not 0 < block_size <= MAX_BLOCK_SIZE:
            raise ConfigError(f"block size must be an integer in 1..{MAX_BLOCK_SIZE}, got {show(block_size)}")
        if type(prefix_caching) is not bool:
            raise ConfigError(f"prefix_caching must be True or False, got {show(prefix_caching)}")
        if (isinstance(max_pinned_fraction, bool) or not isinstance(max_pinned_fraction, (int, float))
                or not (math.isfinite(max_pinned_fraction) and 0 <= max_pinned_fraction <= 1)):
            raise ConfigError(f"max_pinned_fraction must be in [0, 1], got {show(max_pinned_fraction)}")
        if not callable(clock):
            raise ConfigError("clock must be a callable returning seconds")
        if events is not None and not callable(getattr(events, "emit", None)):
            raise ConfigError(f"events must be an EventLog (or have emit()), got {type(events).__name__}")
        self.block_size = block_size
        self.prefix_caching = prefix_caching
        self.pool = BlockPool(num_blocks, as_policy(policy, clock))
        self.promises = PromiseBook(self.pool)  # the only writer of every promise
        self.events = events
        if events is not None:
            self.pool.on_event = events.emit
        self.counters = Counters()
        self.max_pinned_fraction = float(max_pinned_fraction)
        self.clock = clock
        self._seqs: dict[str, SequenceState] = {}
        self._copies: list[CopyOp] = []  # copy instructions the runtime has not taken yet
        self._leases: dict[int, Lease] = {}  # outstanding accesses by lease id
        self._seq_leases: dict[str, set[int]] = {}  # sequence -> its outstanding leases
        self._next_lease = 1
        self._pins: dict[str, list[int]] = {}
        self._digest_cache: OrderedDict[str, tuple] = OrderedDict()  # requests told "not now"
        self._quotas: dict[str, int] = {}  # trust group -> cap on its charged blocks (core/admission.py)
        self._lock = threading.RLock()
        self._native = native.MODULE  # the optional C part (kvledger.core.native), None: pure Python
        self.tiers: TierLedger | None = None  # lower tiers evicted prefix blocks are demoted to (attach_tiers)

    # ---- queries --------------------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def promised(self) -> int:
        """Blocks promised and not yet materialised (read-only: :class:`PromiseBook` writes them)."""
        return self.promises.total

    @property
    def policy_name(self) -> str:
        return getattr(self.pool.retained, "name", type(self.pool.retained).__name__)

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks covering ``num_tokens``: the tail block is charged whole."""
        return self._blocks_for(as_count(num_tokens, "num_tokens"))

    def _blocks_for(self, num_tokens: int) -> int:
        # The ledger's own callers pass token counts it computed: no check on the per-step paths.
        return -(-num_tokens // self.block_size)

    def largest_allowance(self, request: Request) -> int:
        """The largest output allowance (``max_new_tokens``) that ``request`` -- its prompt, branches,
        speculative slots and trust group, its own ``max_new_tokens`` ignored -- could ever be promised
        here: the most whose declaration (:func:`~kvledger.core.promises.declared_blocks`) fits the whole
        pool and its trust group's quota; 0 when not even one token could. Asking for it is never
        "never" (it may still wait for room); one token more is."""
        request = self._request(request)
        limit = self.pool.num_blocks
        cap = self._quotas.get(request.context.trust_group) if self._quotas else None
        if cap is not None:
            limit = min(limit, cap)
        return largest_allowance(len(request.prompt), limit, self.block_size, request.branches, request.lookahead)

    def usage(self) -> Usage:
        with self._lock:
            p = self.pool
            return Usage(p.num_blocks, p.num_free, p.num_active, p.num_retained, p.num_evictable,
                         self.promises.total, len(self._seqs), sum(len(b) for b in self._pins.values()),
                         p.deferred)

    def sequence(self, request_id: str) -> SequenceState:
        try:
            return self._seqs[request_id]
        except (KeyError, TypeError):  # TypeError: an unhashable id is no sequence's id either
            raise LedgerError(f"unknown sequence {show(request_id)}") from None

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
        num_tokens = as_count(num_tokens, "mark_computed: num_tokens")
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
                digest = block_digest_at(digests[-1] if digests else seq.root, tokens, i * bs, bs, self._native)
                digests.append(digest)
                if pool.on_event is None and digest not in pool.index:  # BlockPool.register, inlined
                    pool.index[digest] = blocks[i]
                    pool.digest[blocks[i]] = digest
                    pool.group[blocks[i]] = group
                else:
                    pool.register(blocks[i], digest, group)
            if seq.retention:
                self._apply_retention(seq.retention, blocks, first, full)

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
            before = len(self._copies)
            self._grow(seq, checked[0][1])
            return self._copies[before:]

    def append_tokens(self, request_id: str, token_ids: Iterable[int]) -> None:
        """Append several tokens to one sequence. A bad token id or a length past ``max_new_tokens``
        changes nothing; growth past the reservation with no block left appends the tokens before it
        and raises :class:`OutOfBlocksError`."""
        if isinstance(token_ids, (str, bytes)) or not hasattr(token_ids, "__iter__"):
            raise ConfigError(f"{request_id!r}: token ids must be a sequence of integers, got {show(token_ids)}")
        with self._lock:
            seq = self.sequence(request_id)
            checked, fits = self._check_growth([(seq, t) for t in token_ids])
            for _, token in checked[:fits]:
                self._grow(seq, token)
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
                # cannot fail: applied as it stands, without the general check below.
                for seq, token in slow:
                    self._open_block(seq, len(seq.tokens), token)
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

    def _grow(self, seq: SequenceState, token: int) -> None:
        """Append one checked token (see :meth:`_check_growth`)."""
        tokens = seq.tokens
        n = len(tokens)
        if n % self.block_size == 0:
            self._boundary(seq, n)
        else:
            self._computed(seq, n)  # sampling this token confirms every earlier token (cheap if no new block)
            if seq.cow_tail:
                self._copy_on_write(seq, n)
        tokens.append(token)

    def _boundary(self, seq: SequenceState, n: int) -> None:
        """Token ``n`` starts a new block: the blocks before are fully written, and the new block comes
        from the sequence's promise or, past its reservation, from unpromised capacity."""
        self._computed(seq, n)
        seq.cow_tail = False  # a full tail is immutable and shared as is; the new block is private
        blocks = seq.table.blocks
        if n < len(blocks) * self.block_size:
            return  # the block already exists (the prompt's allocation, or a speculative slot)
        promises = self.promises
        if not promises.redeem(seq) and promises.unpromised() <= 0:  # _check_growth rules this out
            raise OutOfBlocksError(f"{seq.request_id!r} grew past its reservation and no unpromised block is left")
        blocks.append(self.pool.allocate())

    def _open_block(self, seq: SequenceState, n: int, token: int) -> None:
        """:meth:`_grow` for a checked token ``n`` that opens a new block the sequence was promised."""
        self._computed(seq, n)
        seq.cow_tail = False
        self.promises.redeem(seq)
        seq.table.blocks.append(self.pool.allocate())
        seq.tokens.append(token)

    # ---- speculative slots ----------------------------------------------------------------------
    def reserve_lookahead(self, request_id: str, slots: int) -> int:
        """Make sure blocks exist for ``slots`` positions beyond the newest token (draft tokens the
        verifier may accept). They come from the sequence's promise first. Returns blocks allocated.
        Draft slots are private to the sequence: a fork never shares its speculative blocks, and a
        partial tail still shared with a sibling is copied first (its copy-on-write happens now, not at
        the next token), since siblings drafting into one shared block would overwrite each other's
        draft KV in the same step. All or nothing: refused, nothing changes."""
        slots = as_count(slots, "lookahead slots")
        with self._lock:
            seq = self.sequence(request_id)
            n = len(seq.tokens)
            need = self._blocks_for(n + slots) - len(seq.table.blocks)
            pool, promises = self.pool, self.promises
            if need > seq.promised + max(promises.unpromised(), 0):
                raise OutOfBlocksError(f"{request_id!r}: no room for {slots} lookahead slots")
            if slots and seq.cow_tail and n % self.block_size:
                self._copy_on_write(seq, n)  # the copy was promised when the tail became shared
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
            if request_id in self._seq_leases:
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
        try:
            seq = self._seqs.pop(request_id, None)
        except TypeError:
            seq = None
        if seq is None:
            raise LedgerError(f"unknown sequence {show(request_id)} (already released?)")
        blocks = seq.table.blocks
        if seq.cow_tail:
            self.promises.redeem_copy(blocks[len(seq.tokens) // self.block_size])  # it leaves without copying
        if self._copies:  # a copy into a block that is about to be released must never run
            mine = set(blocks)
            self._copies = [op for op in self._copies if op.dst not in mine]
        if self._seq_leases:
            self._lease_blocks_of_dropped(request_id, blocks)
        self.pool.release_many(blocks[::-1])
        self.promises.cancel(seq)
        return seq

    def take_copies(self) -> list[CopyOp]:
        """Copy-on-write instructions recorded since the last call; the runtime executes them before
        the step that writes the destination blocks."""
        with self._lock:
            copies, self._copies = self._copies, []
            return copies

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
            for blocks in self._pins.values():
                for b in blocks:
                    refs[b] += 1
            if refs != pool.ref:
                bad = [b for b in range(pool.num_blocks) if refs[b] != pool.ref[b]][:8]
                raise InvariantError(f"ref counts disagree with block tables and pins at blocks {bad}")
            leases = [0] * pool.num_blocks
            for lid, lease in self._leases.items():
                if type(lease.owner) is not str:
                    raise InvariantError(f"lease {lid} has no owner name")
                for b in lease.blocks:
                    leases[b] += 1
            for rid, lids in self._seq_leases.items():
                if rid not in self._seqs or any(lid not in self._leases for lid in lids):
                    raise InvariantError(f"lease bookkeeping for {rid!r} is stale")
            if leases != pool.leased:
                raise InvariantError("lease counts disagree with outstanding leases")
            self.promises.check(promised)
            if self.tiers is not None:
                if pool.on_evict is None:
                    raise InvariantError("tiers are attached but the pool's evictions are not demoted")
                self.tiers.check()
            self._check_groups()
