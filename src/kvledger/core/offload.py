"""The device pool's side of the tiers below it: demotion on eviction and promotion on a prefix hit.

With a :class:`~kvledger.core.tiers.TierLedger` attached (:meth:`OffloadOps.attach_tiers`), a retained
block the pool evicts for a new allocation is *demoted* instead of forgotten: before it loses its identity
the tier ledger gives its digest a slot and records a ``demote`` op (device block -> tier slot); the
runtime copies the bytes out before anything writes the block again (executors run demotions first).
A cache reset (``clear_cache``, ``reset_prefix_cache``) forgets blocks without demoting them.

:meth:`OffloadOps.promote_from_tiers` is the way back. For a request about to be admitted, the prompt's
leading full blocks found in the device index are followed by those the tiers hold *for the request's
trust group*; each of those gets a device block now, indexed under its digest, marked written and leased
(deferred, ref 0) until the transfer that fills it is done, so the admission that follows shares it as a
prefix hit. Promotion takes only capacity nobody was promised (``free + evictable - promised``, less the
request's own retained hits and ``keep_free``), so it cannot break a promise, and it protects the
request's own device hits from being evicted by its allocation.

Whoever runs the transfers must run them before any step reads the promoted blocks; when one fails,
:meth:`OffloadOps.invalidate` takes the blocks' identity away so nobody is ever served their bytes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..errors import ConfigError
from .tiers import TierLedger
from .types import Request, as_count

if TYPE_CHECKING:
    from .ledger import KVLedger


class OffloadOps:
    """Mixed into :class:`~kvledger.core.ledger.KVLedger`; runs under its lock."""

    def attach_tiers(self: KVLedger, tiers: TierLedger | None) -> None:
        """Demote evicted prefix blocks into ``tiers`` from now on (None detaches). Needs prefix caching:
        without block identities there is nothing to find again."""
        if tiers is not None and not isinstance(tiers, TierLedger):
            raise ConfigError(f"attach_tiers takes a TierLedger, got {type(tiers).__name__}")
        if tiers is not None and not self.prefix_caching:
            raise ConfigError("demoting prefix blocks to a lower tier needs prefix caching")
        with self._lock:
            self.tiers = tiers
            self.pool.on_evict = self._demote_evicted if tiers is not None else None

    def _demote_evicted(self: KVLedger, victims: list[int]) -> None:
        """The pool is about to reuse ``victims`` (retained: written and indexed): demote each."""
        tiers, digest, group = self.tiers, self.pool.digest, self.pool.group
        if tiers is None:
            return
        for block in victims:
            d = digest[block]
            if d is not None:
                tiers.demote(block, d, group[block])

    def promote_from_tiers(self: KVLedger, request: Request, owner: str, keep_free: int = 0
                           ) -> tuple[list[tuple[int, int]], int | None]:
        """Bring back the request's prompt blocks the tiers hold (after its device hits, same trust group,
        as far as unpromised capacity allows). Returns ``(pairs, lease)``: ``(tier slot, device block)`` per
        promoted block, in prompt order, and the lease that keeps them until the transfer is done (end it
        with ``end_lease``); ``([], None)`` when nothing is promoted. Changes nothing on a bad request."""
        keep_free = as_count(keep_free, "keep_free")
        if type(owner) is not str or not owner:
            raise ConfigError("promote_from_tiers needs an owner name for its lease")
        request = self._request(request)
        tiers = self.tiers
        if tiers is None or not self.prefix_caching or not request.read_prefix_cache or self._never(request):
            return [], None
        digests = self._prepare(request, remember=True)  # the admission that follows reuses them
        group = request.context.trust_group
        with self._lock:
            pool = self.pool
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
            room = self.promises.unpromised() - retained_hits - keep_free
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
            lease = self.lease(blocks=blocks, owner=owner)
            pool.release_many(blocks[::-1])  # ref 0 and leased: deferred until the transfer is done
            self.counters.promoted_blocks += len(blocks)
            return list(zip(slots, blocks, strict=True)), lease

    def invalidate(self: KVLedger, blocks: list[int]) -> None:
        """A transfer into ``blocks`` failed: they lose their identity (nobody will hit them again). A
        retained one is freed; a held or leased one is freed when its holders let go."""
        with self._lock:
            pool = self.pool
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


__all__ = ["OffloadOps"]
