"""The device pool's side of the tiers below it: demotion on eviction and promotion on a prefix hit.

With a :class:`~kvledger.core.tiers.TierLedger` attached (:meth:`TierHandoff.attach`), a retained
block the pool evicts for a new allocation is *demoted* instead of forgotten: before it loses its identity
the tier ledger gives its digest a slot and records a ``demote`` op (device block -> tier slot); the
runtime copies the bytes out before anything writes the block again (executors run demotions first).
A cache reset (``clear_cache``, ``reset_prefix_cache``) forgets blocks without demoting them.

:meth:`TierHandoff.promote` is the way back. For a request about to be admitted, the prompt's
leading full blocks found in the device index are followed by those the tiers hold *for the request's
trust group*; each of those gets a device block now, indexed under its digest, marked written and leased
(deferred, ref 0) until the transfer that fills it is done, so the admission that follows shares it as a
prefix hit. Promotion takes only capacity nobody was promised (``free + evictable - promised``, less the
request's own retained hits and ``keep_free``), so it cannot break a promise, and it protects the
request's own device hits from being evicted by its allocation.

Whoever runs the transfers must run them before any step reads the promoted blocks; when one fails,
:meth:`TierHandoff.invalidate` takes the blocks' identity away so nobody is ever served their bytes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from ..errors import ConfigError
from .lifetimes import LeaseBook
from .observe import Counters
from .pool import BlockPool
from .promises import PromiseBook
from .tiers import TierLedger


class TierHandoff:
    """The attached :class:`TierLedger` (or None) and the moves between it and the pool. No lock of its
    own: the ledger calls it under its lock (the pool calls its :class:`_Demoter` from inside an
    allocation, under the same lock)."""

    __slots__ = ("_counters", "_leases", "_pool", "_promises", "tiers")

    def __init__(self, pool: BlockPool, promises: PromiseBook, leases: LeaseBook, counters: Counters) -> None:
        self._pool = pool
        self._promises = promises
        self._leases = leases
        self._counters = counters
        self.tiers: TierLedger | None = None

    def attach(self, tiers: TierLedger | None) -> None:
        """Demote evicted prefix blocks into ``tiers`` from now on (None detaches)."""
        self.tiers = tiers
        self._pool.on_evict = None if tiers is None else _Demoter(tiers, self._pool.digest, self._pool.group,
                                                                  getattr(self._pool.retained, "depth", None))

    def promote(self, digests: Sequence[bytes], group: str, owner: str, keep_free: int
                ) -> tuple[list[tuple[int, int]], int | None]:
        """Bring back the blocks of ``digests`` the tiers hold for ``group``, after the device hits, as far
        as unpromised capacity (less the request's own retained hits and ``keep_free``) allows: see
        :meth:`KVLedger.promote_from_tiers <kvledger.core.ledger.KVLedger.promote_from_tiers>`."""
        tiers, pool = self.tiers, self._pool
        if tiers is None:
            return [], None
        index, ref, leased = pool.index, pool.ref, pool.leased
        hits: list[int] = []
        for d in digests:
            block = index.get(d)
            if block is None:
                break
            hits.append(block)
        slots = tiers.lookup(digests, len(hits), group)
        if not slots:
            return [], None
        retained_hits = sum(1 for b in hits if ref[b] == 0 and not leased[b])
        room = self._promises.unpromised() - retained_hits - keep_free
        slots = slots[:max(room, 0)]
        if not slots:
            return [], None
        # The entries leave the tiers first, so that demotions caused by the allocation below can
        # neither move nor drop them; the request's own device hits are held meanwhile.
        taken = tiers.take(slots)
        if hits:
            pool.share_many(hits)
        try:
            blocks = pool.allocate_many(len(slots))
        finally:
            if hits:
                pool.release_many(hits[::-1])
        written = pool.written
        for block, d in zip(blocks, taken, strict=True):
            pool.register(block, d, group)
            written[block] = True  # its bytes arrive before any step reads it (the executor waits)
        lease = self._leases.take([], blocks, owner)
        pool.release_many(blocks[::-1])  # ref 0 and leased: deferred until the transfer is done
        self._counters.promoted_blocks += len(blocks)
        return list(zip(slots, blocks, strict=True)), lease

    def invalidate(self, blocks: list[int]) -> None:
        """A transfer into ``blocks`` failed: they lose their identity (nobody will hit them again). A
        retained one is freed; a held or leased one is freed when its holders let go."""
        pool = self._pool
        for block in blocks:
            if isinstance(block, bool) or type(block) is not int or not 0 <= block < pool.num_blocks:
                raise ConfigError(f"invalidate: {block!r} is not a block of this pool")
        for block in blocks:
            if pool.ref[block] == 0 and not pool.leased[block]:
                if pool.digest[block] is not None and block in pool.retained:
                    pool.evict(block, kind="cleared")
                continue
            d = pool.digest[block]
            if d is not None and pool.index.get(d) == block:
                del pool.index[d]
            pool.digest[block] = None
            pool.group[block] = None
            pool.written[block] = False


__all__ = ["TierHandoff"]


class _Demoter:
    """The pool's ``on_evict`` while tiers are attached: each evicted block (retained: written and
    indexed) goes down to ``tiers`` under its identity. It holds the pool's identity lists, never the
    pool or the handoff, so that the pool pointing at it makes no reference cycle (a ledger left in one
    is freed only by the cyclic garbage collector, whose full passes then slow every later step)."""

    __slots__ = ("_digest", "_group", "_tiers", "_depth")

    def __init__(self, tiers: TierLedger, digest: list[bytes | None], group: list[str | None],
                 depth: Callable[[int], int] | None = None) -> None:
        self._tiers = tiers
        self._digest = digest
        self._group = group
        self._depth = depth  # a tree policy's depth of a block (for the tiers' demotion rule), or None

    def __call__(self, victims: list[int]) -> None:
        tiers, digest, group, depth = self._tiers, self._digest, self._group, self._depth
        for block in victims:
            d = digest[block]
            if d is not None:
                tiers.demote(block, d, group[block], depth=None if depth is None else depth(block))
