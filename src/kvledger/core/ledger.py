"""The KV ledger: admission with full reservation, block tables, prefix sharing, growth and release.

Two ledgers live side by side and are never mixed:

* **live blocks** -- physical blocks in the :class:`BlockPool` (free / active / retained);
* **promises** -- blocks a running sequence has been promised for its declared output allowance but
  has not materialised yet. They hold no data and no block id; they are a claim on capacity.

The promise rule (checked by :meth:`KVLedger.check`): ``promised <= free + evictable``. Admission keeps
it true, so every promise can be turned into a block without evicting or preempting a running request.
Admission is one atomic decision under the ledger's lock, so concurrent admissions cannot overcommit.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from enum import Enum

from ..errors import AdmissionError, ConfigError, InvariantError, LedgerError, OutOfBlocksError
from .eviction import EvictionPolicy
from .identity import CacheContext, block_digest, chain_digests, token_bytes
from .pool import BlockPool
from .table import BlockTable

_DEFAULT_CONTEXT = CacheContext()


class Outcome(str, Enum):
    ADMITTED = "admitted"
    NOT_NOW = "not_now"  # fits an empty pool, but not beside what is running/promised now
    NEVER = "never"  # larger than the whole pool: waiting will not help


@dataclass(frozen=True, slots=True)
class Request:
    """What admission needs to know. ``reserve_new_tokens`` is the output allowance to reserve now;
    ``None`` means the whole declared ``max_new_tokens`` (full reservation, the default policy)."""

    request_id: str
    prompt: Sequence[int]
    max_new_tokens: int
    context: CacheContext = _DEFAULT_CONTEXT
    reserve_new_tokens: int | None = None


@dataclass(frozen=True, slots=True)
class Decision:
    request_id: str
    outcome: Outcome
    reason: str
    blocks_total: int  # blocks the sequence occupies at its reserved length, shared ones included
    blocks_hit: int  # leading full blocks found in the prefix index (charged once, to nobody new)
    blocks_hit_pending: int  # of those, blocks another request is still filling
    blocks_new: int  # blocks allocated now for the rest of the prompt
    blocks_promised: int  # blocks promised for the reserved output allowance

    @property
    def admitted(self) -> bool:
        return self.outcome is Outcome.ADMITTED

    @property
    def blocks_charged(self) -> int:
        """Capacity this admission consumed: new blocks plus promises (hits are charged once, earlier)."""
        return self.blocks_new + self.blocks_promised

    def raise_for_outcome(self) -> Decision:
        if not self.admitted:
            raise AdmissionError(f"request {self.request_id!r} {self.outcome.value}: {self.reason}")
        return self


@dataclass(slots=True)
class SequenceState:
    """A running sequence: its tokens, its block table and its outstanding promises."""

    request_id: str
    context: CacheContext
    root: bytes
    tokens: list[int]
    num_prompt: int
    max_new_tokens: int
    table: BlockTable
    promised: int
    digests: list[bytes] = field(default_factory=list)  # one per identified full block, in order
    computed_mark: int = 0  # tokens confirmed written by mark_computed or a block boundary
    written_blocks: int = 0  # leading blocks known to be written
    hit_blocks: int = 0
    limit: int = 0  # num_prompt + max_new_tokens: the declared maximum length

    def __post_init__(self) -> None:
        self.limit = self.num_prompt + self.max_new_tokens

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    @property
    def num_generated(self) -> int:
        return len(self.tokens) - self.num_prompt

    @property
    def num_computed(self) -> int:
        """Tokens whose KV is written. Once a token has been sampled, every earlier token was run
        through the model, so during decode this is ``num_tokens - 1`` (the newest token is written by
        the next step); the ledger only records it eagerly at block boundaries."""
        if len(self.tokens) > self.num_prompt:
            return max(self.computed_mark, len(self.tokens) - 1)
        return self.computed_mark


@dataclass(frozen=True, slots=True)
class Usage:
    total: int
    free: int
    active: int
    retained: int
    evictable: int
    promised: int
    sequences: int

    @property
    def available(self) -> int:
        """Blocks a new admission may still claim: free + evictable - already promised."""
        return self.free + self.evictable - self.promised

    def as_dict(self) -> dict[str, int]:
        return {
            "total": self.total, "free": self.free, "active": self.active, "retained": self.retained,
            "evictable": self.evictable, "promised": self.promised, "available": self.available,
            "sequences": self.sequences,
        }


class KVLedger:
    """Owns one block pool and every sequence that holds blocks of it. Thread-safe."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int = 16,
        *,
        prefix_caching: bool = True,
        policy: EvictionPolicy | None = None,
    ) -> None:
        if not isinstance(num_blocks, int) or num_blocks <= 0:
            raise ConfigError(f"the pool needs at least one block, got {num_blocks!r}")
        if not isinstance(block_size, int) or block_size <= 0:
            raise ConfigError(f"block size must be a positive integer, got {block_size!r}")
        self.block_size = block_size
        self.prefix_caching = prefix_caching
        self.pool = BlockPool(num_blocks, policy)
        self.promised = 0
        self._seqs: dict[str, SequenceState] = {}
        self._lock = threading.RLock()

    # ---- queries --------------------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks covering ``num_tokens``: the tail block is charged whole."""
        return -(-num_tokens // self.block_size)

    def usage(self) -> Usage:
        with self._lock:
            p = self.pool
            return Usage(p.num_blocks, p.num_free, p.num_active, p.num_retained, p.num_evictable,
                         self.promised, len(self._seqs))

    def sequence(self, request_id: str) -> SequenceState:
        try:
            return self._seqs[request_id]
        except KeyError:
            raise LedgerError(f"unknown sequence {request_id!r}") from None

    def sequences(self) -> list[str]:
        with self._lock:
            return list(self._seqs)

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
        if not request.prompt:
            raise ConfigError(f"request {request.request_id!r} has an empty prompt")
        if request.max_new_tokens < 0:
            raise ConfigError(f"request {request.request_id!r}: max_new_tokens must be >= 0")
        reserve = request.max_new_tokens if request.reserve_new_tokens is None else request.reserve_new_tokens
        if not 0 <= reserve <= request.max_new_tokens:
            raise ConfigError(
                f"request {request.request_id!r}: reserve_new_tokens must be in [0, max_new_tokens]")
        return len(request.prompt), reserve

    def _digests(self, request: Request) -> list[bytes]:
        if not self.prefix_caching:
            return []
        return chain_digests(request.context.root_digest(), token_bytes(request.prompt), self.block_size)

    def can_admit(self, request: Request) -> Decision:
        """The decision :meth:`admit` would take now, without changing anything."""
        digests = self._digests(request)
        with self._lock:
            return self._decide(request, digests)[0]

    def admit(self, request: Request) -> Decision:
        """Admit ``request`` atomically: share indexed prefix blocks, allocate the rest of the prompt,
        and promise the reserved output allowance -- or change nothing and say why not."""
        digests = self._digests(request)  # hashing is pure: keep it outside the lock
        with self._lock:
            if request.request_id in self._seqs:
                raise LedgerError(f"request id {request.request_id!r} is already running")
            decision, hits = self._decide(request, digests)
            if decision.admitted:
                self._commit(request, digests, hits, decision)
            return decision

    def _decide(self, request: Request, digests: list[bytes]) -> tuple[Decision, list[int]]:
        prompt_len, reserve = self._validate(request)
        pool = self.pool
        total = self.blocks_for(prompt_len + reserve)
        prompt_blocks = self.blocks_for(prompt_len)
        rid = request.request_id
        if self.blocks_for(prompt_len + request.max_new_tokens) > pool.num_blocks or total > pool.num_blocks:
            need = self.blocks_for(prompt_len + request.max_new_tokens)
            reason = (f"needs {need} blocks ({prompt_len} + {request.max_new_tokens} tokens) but the whole "
                      f"pool has {pool.num_blocks}")
            return Decision(rid, Outcome.NEVER, reason, need, 0, 0, 0, 0), []
        hits: list[int] = []
        index, ref, written = pool.index, pool.ref, pool.written
        for d in digests:
            block = index.get(d)
            if block is None:
                break
            hits.append(block)
        retained_hits = sum(1 for b in hits if ref[b] == 0)
        pending_hits = sum(1 for b in hits if not written[b])
        new_now = prompt_blocks - len(hits)
        promise = total - prompt_blocks
        need = new_now + promise
        # Retained hits stop being evictable once taken, so they cannot also back a new block.
        available = pool.num_free + pool.num_evictable - self.promised - retained_hits
        if need > available:
            reason = (f"needs {need} new blocks ({len(hits)} of {total} shared) but only {max(available, 0)} "
                      f"can be promised now ({pool.num_free} free + {pool.num_evictable} evictable - "
                      f"{self.promised} promised" + (f" - {retained_hits} own hits" if retained_hits else "")
                      + ")")
            return Decision(rid, Outcome.NOT_NOW, reason, total, len(hits), pending_hits, new_now,
                            promise), hits
        reason = f"{len(hits)} shared + {new_now} new + {promise} promised = {total} blocks"
        return Decision(rid, Outcome.ADMITTED, reason, total, len(hits), pending_hits, new_now, promise), hits

    def _commit(self, request: Request, digests: list[bytes], hits: list[int], decision: Decision) -> None:
        pool = self.pool
        # Take the hits first, so allocating the new blocks can never evict the request's own hits.
        for block in hits:
            pool.share(block)
        blocks = hits + pool.allocate_many(decision.blocks_new)
        # Index the new full prompt blocks (inlined BlockPool.register): pending until written.
        index, block_digest_of = pool.index, pool.digest
        for i in range(len(hits), len(digests)):
            d = digests[i]
            if d not in index:
                index[d] = blocks[i]
                block_digest_of[blocks[i]] = d
        self.promised += decision.blocks_promised
        written = pool.written
        ready = 0
        while ready < len(hits) and written[hits[ready]]:
            ready += 1
        prompt = list(request.prompt)
        self._seqs[request.request_id] = SequenceState(
            request_id=request.request_id,
            context=request.context,
            root=request.context.root_digest() if self.prefix_caching else b"",
            tokens=prompt,
            num_prompt=len(prompt),
            max_new_tokens=request.max_new_tokens,
            table=BlockTable(self.block_size, blocks),
            promised=decision.blocks_promised,
            digests=digests,
            computed_mark=min(ready * self.block_size, len(prompt)),
            written_blocks=ready,
            hit_blocks=len(hits),
        )

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
        if self.prefix_caching:
            digests, tokens, register = seq.digests, seq.tokens, self.pool.register
            while len(digests) < full:
                i = len(digests)
                digest = block_digest(digests[-1] if digests else seq.root, tokens[i * bs : (i + 1) * bs])
                digests.append(digest)
                register(blocks[i], digest)

    def append_token(self, request_id: str, token_id: int) -> None:
        """Append one sampled token. Sampling it means the model has run over every earlier token, so
        their KV is confirmed written; the new token's KV is written by the next step."""
        with self._lock:
            self._append(self.sequence(request_id), token_id)

    def append_tokens(self, request_id: str, token_ids: Iterable[int]) -> None:
        with self._lock:
            seq = self.sequence(request_id)
            for token in token_ids:
                self._append(seq, token)

    def decode_step(self, steps: Iterable[tuple[str, int]]) -> None:
        """One engine step: append one token to each named sequence, under one lock acquisition.

        This is the ledger's hottest path, so the common case (the token lands inside the tail block)
        is inlined; every ``block_size`` tokens :meth:`_boundary` does the real work."""
        bs = self.block_size
        with self._lock:
            seqs = self._seqs
            for request_id, token in steps:
                seq = seqs.get(request_id)
                if seq is None:
                    raise LedgerError(f"unknown sequence {request_id!r}")
                tokens = seq.tokens
                n = len(tokens)
                if n % bs and n < seq.limit:
                    tokens.append(token)
                else:
                    self._append(seq, token)

    def _append(self, seq: SequenceState, token: int) -> None:
        tokens = seq.tokens
        n = len(tokens)
        if n >= seq.limit:
            raise LedgerError(f"{seq.request_id!r} already generated its max_new_tokens={seq.max_new_tokens}")
        if n % self.block_size == 0:
            self._boundary(seq, n)
        tokens.append(token)

    def _boundary(self, seq: SequenceState, n: int) -> None:
        """Token ``n`` starts a new block: the blocks before are fully written, and the new block comes
        from the sequence's promise or, past its reservation, from unpromised capacity."""
        self._computed(seq, n)
        blocks = seq.table.blocks
        if n < len(blocks) * self.block_size:
            return  # the block already exists (the prompt's reservation covered it)
        pool = self.pool
        if seq.promised:
            seq.promised -= 1
            self.promised -= 1
        elif pool.num_free + pool.num_evictable - self.promised <= 0:
            raise OutOfBlocksError(
                f"{seq.request_id!r} grew past its reservation and no unpromised block is left "
                f"({pool.num_free} free, {pool.num_evictable} evictable, {self.promised} promised)")
        blocks.append(pool.allocate())

    # ---- release --------------------------------------------------------------------------------
    def release(self, request_id: str) -> None:
        """Finish (or abandon) a sequence: drop its references, tail block first so that LRU eviction
        takes its deepest blocks before its shared head, and cancel its unmaterialised promises."""
        with self._lock:
            seq = self._seqs.pop(request_id, None)
            if seq is None:
                raise LedgerError(f"unknown sequence {request_id!r} (already released?)")
            self.pool.release_many(seq.table.blocks[::-1])
            self.promised -= seq.promised
            seq.promised = 0

    # ---- audit ----------------------------------------------------------------------------------
    def check(self) -> None:
        """Assert every conservation law; O(pool + tables). Tests call it after every operation."""
        with self._lock:
            pool = self.pool
            pool.check()
            refs = [0] * pool.num_blocks
            promised = 0
            bs = self.block_size
            for seq in self._seqs.values():
                blocks = seq.table.blocks
                n = len(seq.tokens)
                if len(blocks) != -(-n // bs):
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
            if refs != pool.ref:
                bad = [b for b in range(pool.num_blocks) if refs[b] != pool.ref[b]][:8]
                raise InvariantError(f"ref counts disagree with block tables at blocks {bad}")
            if promised != self.promised:
                raise InvariantError(f"promise ledger {self.promised} != sum of sequence promises {promised}")
            if self.promised > pool.num_free + pool.num_evictable:
                raise InvariantError(
                    f"overcommitted: {self.promised} promised > {pool.num_free} free + "
                    f"{pool.num_evictable} evictable")
