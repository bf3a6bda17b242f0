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
:mod:`.lifetimes`, mixed into :class:`KVLedger`; they share its lock and its state.
"""

from __future__ import annotations

import operator
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable

from ..errors import ConfigError, InvariantError, LedgerError, OutOfBlocksError
from .branches import BranchOps
from .eviction import EvictionPolicy
from .identity import block_digest, chain_digests, token_bytes
from .lifetimes import LifetimeOps
from .observe import Counters, EventLog
from .pool import BlockPool
from .table import BlockTable
from .types import CopyOp, Decision, Outcome, Request, Retention, SequenceState, Usage

_MAX_TOKEN = 2**32 - 1  # token ids are hashed as uint32

__all__ = ["Decision", "KVLedger", "Outcome", "Request", "Retention", "SequenceState", "Usage", "CopyOp"]


class KVLedger(BranchOps, LifetimeOps):
    """Owns one block pool and every sequence that holds blocks of it. Thread-safe."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int = 16,
        *,
        prefix_caching: bool = True,
        policy: EvictionPolicy | None = None,
        events: EventLog | None = None,
        max_pinned_fraction: float = 0.25,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks <= 0:
            raise ConfigError(f"the pool needs at least one block, got {num_blocks!r}")
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size <= 0:
            raise ConfigError(f"block size must be a positive integer, got {block_size!r}")
        if not 0 <= max_pinned_fraction <= 1:
            raise ConfigError(f"max_pinned_fraction must be in [0, 1], got {max_pinned_fraction!r}")
        self.block_size = block_size
        self.prefix_caching = prefix_caching
        self.pool = BlockPool(num_blocks, policy)
        self.promised = 0
        self.events = events
        if events is not None:
            self.pool.on_event = events.emit
        self.counters = Counters()
        self.max_pinned_fraction = max_pinned_fraction
        self.clock = clock
        self._seqs: dict[str, SequenceState] = {}
        self._cow_promises: dict[int, int] = {}  # shared partial tail -> copies still promised for it
        self._copies: list[CopyOp] = []  # copy instructions the runtime has not taken yet
        self._leases: dict[int, tuple[list[str], list[int]]] = {}  # lease -> (sequences, leased blocks)
        self._seq_leases: dict[str, set[int]] = {}  # sequence -> its outstanding leases
        self._next_lease = 1
        self._pins: dict[str, list[int]] = {}
        self._digest_cache: OrderedDict[str, tuple] = OrderedDict()  # requests told "not now"
        self._lock = threading.RLock()

    # ---- queries --------------------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def policy_name(self) -> str:
        return getattr(self.pool.retained, "name", type(self.pool.retained).__name__)

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks covering ``num_tokens``: the tail block is charged whole."""
        return -(-num_tokens // self.block_size)

    def usage(self) -> Usage:
        with self._lock:
            p = self.pool
            return Usage(p.num_blocks, p.num_free, p.num_active, p.num_retained, p.num_evictable,
                         self.promised, len(self._seqs), sum(len(b) for b in self._pins.values()),
                         p.deferred)

    def sequence(self, request_id: str) -> SequenceState:
        try:
            return self._seqs[request_id]
        except KeyError:
            raise LedgerError(f"unknown sequence {request_id!r}") from None

    def sequences(self) -> list[str]:
        with self._lock:
            return list(self._seqs)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._seqs

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

    # ---- admission ------------------------------------------------------------------------------
    def _validate(self, request: Request) -> tuple[int, int]:
        rid = request.request_id
        if not request.prompt:
            raise ConfigError(f"request {rid!r} has an empty prompt")
        if request.max_new_tokens < 0:
            raise ConfigError(f"request {rid!r}: max_new_tokens must be >= 0")
        reserve = request.max_new_tokens if request.reserve_new_tokens is None else request.reserve_new_tokens
        if not 0 <= reserve <= request.max_new_tokens:
            raise ConfigError(f"request {rid!r}: reserve_new_tokens must be in [0, max_new_tokens]")
        if request.branches < 1:
            raise ConfigError(f"request {rid!r}: branches must be >= 1")
        if request.lookahead < 0:
            raise ConfigError(f"request {rid!r}: lookahead must be >= 0")
        # Speculative slots sit beyond the newest token; they are reserved on top of the allowance.
        return len(request.prompt), reserve + request.lookahead

    def _digests(self, request: Request) -> list[bytes]:
        """Prompt block digests. A request that had to wait ("not now") is usually asked again every
        step, so its digests are remembered (keyed by its id, checked against the same prompt object
        and context) instead of hashing the whole prompt again."""
        if not self.prefix_caching:
            return []
        cache = self._digest_cache
        with self._lock:
            hit = cache.get(request.request_id)
        if hit is not None and hit[0] is request.prompt and hit[1] == request.context:
            return list(hit[2])  # same immutable prompt object (Request keeps a tuple): same digests
        digests = chain_digests(request.context.root_digest(), token_bytes(request.prompt), self.block_size)
        with self._lock:
            cache[request.request_id] = (request.prompt, request.context, tuple(digests))
            if len(cache) > 1024:
                cache.popitem(last=False)
        return digests

    def can_admit(self, request: Request, keep_free: int = 0) -> Decision:
        """The decision :meth:`admit` would take now, without changing anything."""
        digests = self._digests(request)
        with self._lock:
            return self._decide(request, digests, keep_free)[0]

    def admit(self, request: Request, keep_free: int = 0) -> Decision:
        """Admit ``request`` atomically: share indexed prefix blocks, allocate the rest of the prompt,
        and promise the reserved output allowance -- or change nothing and say why not.

        ``keep_free`` blocks must stay available after the admission: the watermark or emergency
        headroom of policies that do not reserve the whole output allowance."""
        digests = self._digests(request)  # hashing is pure: keep it outside the lock
        with self._lock:
            rid = request.request_id
            if rid in self._seqs or any(f"{rid}/{i}" in self._seqs for i in range(1, request.branches)):
                raise LedgerError(f"request id {rid!r} is already running")
            decision, hits = self._decide(request, digests, keep_free)
            c = self.counters
            if decision.admitted:
                self._digest_cache.pop(rid, None)
                self._commit(request, digests, hits, decision)
                c.admitted += 1
                if self.prefix_caching:
                    c.record_query(request.context.trust_group, len(digests), len(hits), len(request.prompt),
                                   len(hits) * self.block_size)
            elif decision.outcome is Outcome.NEVER:
                self._digest_cache.pop(rid, None)  # it will not be asked again: keep no copy of it
                c.rejected_never += 1
            else:
                c.rejected_not_now += 1
            return decision

    def _decide(self, request: Request, digests: list[bytes], keep_free: int = 0) -> tuple[Decision, list[int]]:
        prompt_len, reserve = self._validate(request)
        pool, bs = self.pool, self.block_size
        total = self.blocks_for(prompt_len + reserve)
        prompt_blocks = self.blocks_for(prompt_len)
        rid = request.request_id
        k = request.branches
        # Each extra branch: its own output allowance, plus a copy of the partial prompt tail.
        per_branch = (total - prompt_blocks) + (1 if prompt_len % bs else 0)
        longest = self.blocks_for(prompt_len + request.max_new_tokens + request.lookahead)
        if longest + (k - 1) * (longest - prompt_len // bs) > pool.num_blocks:
            need = longest + (k - 1) * (longest - prompt_len // bs)
            branches = f" for {k} branches" if k > 1 else ""
            reason = (f"needs {need} blocks ({prompt_len} + {request.max_new_tokens} tokens{branches}) but the "
                      f"whole pool has {pool.num_blocks}")
            return Decision(rid, Outcome.NEVER, reason, need, 0, 0, 0, 0), []
        hits: list[int] = []
        index, ref, leased, written = pool.index, pool.ref, pool.leased, pool.written
        for d in digests:
            block = index.get(d)
            if block is None:
                break
            hits.append(block)
        # Retained hits stop being evictable once taken, so they cannot also back a new block.
        retained_hits = sum(1 for b in hits if ref[b] == 0 and not leased[b])
        pending_hits = sum(1 for b in hits if not written[b])
        new_now = prompt_blocks - len(hits)
        branch_blocks = (k - 1) * per_branch
        promise = total - prompt_blocks + branch_blocks
        need = new_now + promise
        available = pool.num_free + pool.num_evictable - self.promised - retained_hits - keep_free
        if need > available:
            reason = (f"needs {need} new blocks ({len(hits)} of {total} shared) but only {max(available, 0)} "
                      f"can be promised now ({pool.num_free} free + {pool.num_evictable} evictable - "
                      f"{self.promised} promised" + (f" - {retained_hits} own hits" if retained_hits else "")
                      + (f" - {keep_free} kept free" if keep_free else "") + ")")
            return Decision(rid, Outcome.NOT_NOW, reason, total, len(hits), pending_hits, new_now, promise,
                            branch_blocks), hits
        reason = f"{len(hits)} shared + {new_now} new + {promise} promised = {total + branch_blocks} blocks"
        return Decision(rid, Outcome.ADMITTED, reason, total, len(hits), pending_hits, new_now, promise,
                        branch_blocks), hits

    def _commit(self, request: Request, digests: list[bytes], hits: list[int], decision: Decision) -> None:
        pool = self.pool
        # Take the hits first, so allocating the new blocks can never evict the request's own hits.
        for block in hits:
            pool.share(block)
        blocks = hits + pool.allocate_many(decision.blocks_new)
        group = request.context.trust_group
        if pool.on_event is None:
            # Index the new full prompt blocks (inlined BlockPool.register): pending until written.
            index, block_digest_of, block_group = pool.index, pool.digest, pool.group
            for i in range(len(hits), len(digests)):
                d = digests[i]
                if d not in index:
                    index[d] = blocks[i]
                    block_digest_of[blocks[i]] = d
                    block_group[blocks[i]] = group
        else:
            for i in range(len(hits), len(digests)):
                pool.register(blocks[i], digests[i], group)
        if request.retention:
            self._apply_retention(request.retention, blocks, 0, len(digests))
        own_promise = decision.blocks_promised - decision.blocks_branches
        self.promised += own_promise
        written = pool.written
        ready = 0
        while ready < len(hits) and written[hits[ready]]:
            ready += 1
        prompt = list(request.prompt)
        rid = request.request_id
        seq = SequenceState(
            request_id=rid, context=request.context,
            root=request.context.root_digest() if self.prefix_caching else b"",
            tokens=prompt, num_prompt=len(prompt), max_new_tokens=request.max_new_tokens,
            table=BlockTable(self.block_size, blocks), promised=own_promise, digests=digests,
            computed_mark=min(ready * self.block_size, len(prompt)), written_blocks=ready,
            hit_blocks=len(hits), retention=request.retention, family=request.family or rid,
            reserved_blocks=decision.blocks_total,
        )
        self._seqs[rid] = seq
        # Each fork charges its parent's promise plus a tail copy: exactly what _decide counted per branch.
        for i in range(1, request.branches):
            self._fork_unchecked(seq, f"{rid}/{i}")

    def _apply_retention(self, ranges: tuple[Retention, ...], blocks: list[int], start: int, end: int) -> None:
        """Tell the eviction policy the priority of blocks ``[start, end)`` from the request's ranges."""
        bs, now, policy = self.block_size, self.clock(), self.pool.retained
        for i in range(start, end):
            lo, hi = i * bs, (i + 1) * bs
            best: Retention | None = None
            for r in ranges:
                if r.start < hi and r.end > lo and (best is None or r.priority > best.priority):
                    best = r
            if best is not None:
                expires = None if best.duration_s is None else now + best.duration_s
                policy.set_priority(blocks[i], best.priority, expires)

    # ---- progress -------------------------------------------------------------------------------
    def mark_computed(self, request_id: str, num_tokens: int) -> None:
        """The first ``num_tokens`` tokens now have their KV written (after a prefill chunk or step)."""
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
        for i in range(seq.written_blocks, full):
            written[blocks[i]] = True
        seq.written_blocks = full
        if self.prefix_caching and len(seq.digests) < full:
            digests, tokens, register = seq.digests, seq.tokens, self.pool.register
            first = len(digests)
            while len(digests) < full:
                i = len(digests)
                digest = block_digest(digests[-1] if digests else seq.root, tokens[i * bs : (i + 1) * bs])
                digests.append(digest)
                register(blocks[i], digest, seq.context.trust_group)
            if seq.retention:
                self._apply_retention(seq.retention, blocks, first, full)

    def append_token(self, request_id: str, token_id: int) -> list[CopyOp]:
        """Append one sampled token. Sampling it means the model has run over every earlier token, so
        their KV is confirmed written; the new token's KV is written by the next step. Returns the
        copy-on-write copies the runtime must perform before writing (usually none)."""
        with self._lock:
            before = len(self._copies)
            self._append(self.sequence(request_id), token_id)
            return self._copies[before:]

    def append_tokens(self, request_id: str, token_ids: Iterable[int]) -> None:
        with self._lock:
            seq = self.sequence(request_id)
            for token in token_ids:
                self._append(seq, token)

    def decode_step(self, steps: Iterable[tuple[str, int]]) -> None:
        """One engine step: append one token to each named sequence, under one lock acquisition.

        This is the ledger's hottest path, so the common case (the token lands inside the tail block,
        which the sequence owns alone) is inlined; every ``block_size`` tokens, or on the first write
        into a forked tail, :meth:`_append` does the real work."""
        bs = self.block_size
        with self._lock:
            seqs = self._seqs
            for request_id, token in steps:
                seq = seqs.get(request_id)
                if seq is None:
                    raise LedgerError(f"unknown sequence {request_id!r}")
                tokens = seq.tokens
                n = len(tokens)
                if (n % bs and seq.num_prompt < n < seq.limit and not seq.cow_tail
                        and type(token) is int and 0 <= token <= _MAX_TOKEN):
                    tokens.append(token)
                else:
                    self._append(seq, token)

    def _append(self, seq: SequenceState, token: int) -> None:
        tokens = seq.tokens
        n = len(tokens)
        if n >= seq.limit:
            raise LedgerError(f"{seq.request_id!r} already generated its max_new_tokens={seq.max_new_tokens}")
        try:
            token = operator.index(token)
        except TypeError:
            raise ConfigError(f"{seq.request_id!r}: token id {token!r} is not an integer") from None
        if not 0 <= token <= _MAX_TOKEN:
            raise ConfigError(f"{seq.request_id!r}: token id {token} is outside [0, 2**32)")
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
            return  # the block already exists (the prompt's allocation covered it)
        pool = self.pool
        if seq.promised:
            seq.promised -= 1
            self.promised -= 1
        elif pool.num_free + pool.num_evictable - self.promised <= 0:
            raise OutOfBlocksError(
                f"{seq.request_id!r} grew past its reservation and no unpromised block is left "
                f"({pool.num_free} free, {pool.num_evictable} evictable, {self.promised} promised)")
        blocks.append(pool.allocate())

    # ---- speculative slots ----------------------------------------------------------------------
    def reserve_lookahead(self, request_id: str, slots: int) -> int:
        """Make sure blocks exist for ``slots`` positions beyond the newest token (draft tokens the
        verifier may accept). They come from the sequence's promise first. Returns blocks allocated."""
        with self._lock:
            seq = self.sequence(request_id)
            need = self.blocks_for(len(seq.tokens) + slots) - len(seq.table.blocks)
            pool = self.pool
            if need > seq.promised + max(pool.num_free + pool.num_evictable - self.promised, 0):
                raise OutOfBlocksError(f"{request_id!r}: no room for {slots} lookahead slots")
            for _ in range(max(need, 0)):
                if seq.promised:
                    seq.promised -= 1
                    self.promised -= 1
                seq.table.blocks.append(pool.allocate())
            return max(need, 0)

    def trim_lookahead(self, request_id: str) -> int:
        """Free blocks beyond the sequence's tokens (rejected draft slots). Blocks that were promised
        become promises again, up to the reservation. Returns blocks freed."""
        with self._lock:
            seq = self.sequence(request_id)
            keep = self.blocks_for(len(seq.tokens))
            extra = seq.table.blocks[keep:]
            if not extra:
                return 0
            del seq.table.blocks[keep:]
            self.pool.release_many(extra[::-1])
            repromise = max(0, min(len(extra), seq.reserved_blocks - len(seq.table.blocks) - seq.promised))
            seq.promised += repromise
            self.promised += repromise
            return len(extra)

    # ---- release --------------------------------------------------------------------------------
    def release(self, request_id: str) -> None:
        """Finish a sequence (see :meth:`_drop`)."""
        with self._lock:
            self._drop(request_id)
            self.counters.finished += 1

    def retract(self, request_id: str) -> None:
        """Undo an admission that a caller could not complete (a family admitted all-or-nothing)."""
        with self._lock:
            self._drop(request_id)
            self.counters.admitted -= 1

    def preempt(self, request_id: str) -> list[int]:
        """Take a running sequence's memory away (the scheduler recovers it by recompute or from a host
        copy). Its full, written blocks stay in the prefix index as retained cache, which softens a later
        recompute. Returns its token ids: the state a recompute must replay."""
        with self._lock:
            tokens = list(self.sequence(request_id).tokens)
            self._drop(request_id)
            self.counters.preemptions += 1
            return tokens

    def cancel(self, request_id: str) -> bool:
        """Cancel a request at any point: every branch of it is dropped and its promises freed at once;
        blocks still leased by an in-flight step are released when that lease ends. Cancelling a
        request that was never admitted (or already finished) is a no-op and returns False."""
        with self._lock:
            family = [rid for rid, s in self._seqs.items() if s.family == request_id or rid == request_id]
            for rid in family:
                self._drop(rid)
            if family:
                self.counters.cancelled += 1
            return bool(family)

    def _drop(self, request_id: str) -> None:
        """Drop a sequence's references, tail block first so that LRU eviction takes its deepest blocks
        before its shared head, and cancel its unmaterialised promises."""
        seq = self._seqs.pop(request_id, None)
        if seq is None:
            raise LedgerError(f"unknown sequence {request_id!r} (already released?)")
        blocks = seq.table.blocks
        if seq.cow_tail:
            self._trim_cow_promise(blocks[len(seq.tokens) // self.block_size])
        if self._copies:  # a copy into a block that is about to be released must never run
            mine = set(blocks)
            self._copies = [op for op in self._copies if op.dst not in mine]
        if self._seq_leases:
            self._lease_blocks_of_dropped(request_id, blocks)
        self.pool.release_many(blocks[::-1])
        self.promised -= seq.promised
        seq.promised = 0

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
            promised = sum(self._cow_promises.values())
            bs = self.block_size
            for seq in self._seqs.values():
                blocks = seq.table.blocks
                n = len(seq.tokens)
                if len(blocks) < -(-n // bs):  # more is fine: speculative lookahead slots
                    raise InvariantError(f"{seq.request_id!r}: {len(blocks)} blocks for {n} tokens")
                if seq.promised < 0:
                    raise InvariantError(f"{seq.request_id!r}: negative promise")
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
            for _, blocks in self._leases.values():
                for b in blocks:
                    leases[b] += 1
            for rid, lids in self._seq_leases.items():
                if rid not in self._seqs or any(lid not in self._leases for lid in lids):
                    raise InvariantError(f"lease bookkeeping for {rid!r} is stale")
            if leases != pool.leased:
                raise InvariantError("lease counts disagree with outstanding leases")
            for block, count in self._cow_promises.items():
                if count <= 0 or count != pool.ref[block] - 1:
                    raise InvariantError(f"shared tail {block}: {count} copy promises for ref {pool.ref[block]}")
            if promised != self.promised:
                raise InvariantError(f"promise ledger {self.promised} != sequence and copy promises {promised}")
            if self.promised > pool.num_free + pool.num_evictable:
                raise InvariantError(
                    f"overcommitted: {self.promised} promised > {pool.num_free} free + "
                    f"{pool.num_evictable} evictable")
