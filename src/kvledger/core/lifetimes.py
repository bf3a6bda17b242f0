"""Lifetimes: leases (outstanding accesses), pins, cache clearing and statistics.

A *lease* marks blocks an in-flight step or transfer still reads or writes. Releasing a sequence
(finish, cancel, beam pruning, preemption) while its blocks are leased defers their release: they stay
active (ref 0, leased) until the lease ends, so nothing is reused early and nothing leaks. Promises
hold no data, so cancelling frees them at once.

A *pin* holds a reference on a cached prefix (a system prompt, say) so that it is never evicted; pins
are bounded by ``max_pinned_fraction`` of the pool and are active blocks, which is how admission
accounts for them.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

from ..errors import AdmissionError, LedgerError
from .identity import CacheContext, chain_digests, token_bytes

if TYPE_CHECKING:
    from .ledger import KVLedger


class LifetimeOps:
    """Mixed into :class:`~kvledger.core.ledger.KVLedger`; runs under its lock."""

    # ---- leases ---------------------------------------------------------------------------------
    def lease(self: KVLedger, request_ids: Iterable[str] = (), blocks: Iterable[int] = ()) -> int:
        """Mark an outstanding access to the named sequences and to extra ``blocks``; returns a lease id.

        Leasing a sequence costs O(1) however many blocks it holds (an engine leases every scheduled
        sequence every step). Only if a leased sequence is dropped -- finished, cancelled, pruned,
        preempted -- are its blocks leased one by one, so that their release is deferred until the
        lease ends. A block lease marks single blocks (a transfer reading blocks directly)."""
        with self._lock:
            ids = list(request_ids)
            for rid in ids:
                self.sequence(rid)
            extra = list(blocks)
            for i, block in enumerate(extra):
                try:
                    self.pool.lease(block)
                except LedgerError:
                    for b in extra[:i]:
                        self.pool.unlease(b)
                    raise
            lease_id = self._next_lease
            self._next_lease += 1
            self._leases[lease_id] = (ids, extra)
            seq_leases = self._seq_leases
            for rid in ids:
                held = seq_leases.get(rid)
                if held is None:
                    seq_leases[rid] = {lease_id}
                else:
                    held.add(lease_id)
            return lease_id

    def end_lease(self: KVLedger, lease_id: int) -> None:
        """The access finished: the releases it deferred complete now, tail block first."""
        with self._lock:
            entry = self._leases.pop(lease_id, None)
            if entry is None:
                raise LedgerError(f"unknown lease {lease_id!r} (already ended?)")
            ids, extra = entry
            for block in reversed(extra):
                self.pool.unlease(block)
            seq_leases = self._seq_leases
            for rid in ids:
                held = seq_leases.get(rid)
                if held is not None:
                    held.discard(lease_id)
                    if not held:
                        del seq_leases[rid]

    def _lease_blocks_of_dropped(self: KVLedger, request_id: str, blocks: list[int]) -> None:
        """A leased sequence is being dropped: move its leases onto its blocks (head first, so that
        ending the lease releases them tail first), before its references go."""
        leases = self._seq_leases.pop(request_id, None)
        if not leases:
            return
        for lid in leases:
            extra = self._leases[lid][1]
            for block in blocks:
                self.pool.lease(block)
            extra.extend(blocks)

    def is_leased(self: KVLedger, request_id: str) -> bool:
        """Whether a sequence has an outstanding lease (its blocks cannot be released before it ends)."""
        return request_id in self._seq_leases

    def outstanding_leases(self: KVLedger) -> int:
        return len(self._leases)

    # ---- pins -----------------------------------------------------------------------------------
    def pin(self: KVLedger, name: str, prompt: Sequence[int], context: CacheContext) -> int:
        """Pin the cached, written full blocks of ``prompt`` (its leading chain in the prefix index) so
        they are never evicted. Returns the number of blocks pinned (0 if nothing is cached yet)."""
        if not self.prefix_caching:
            raise LedgerError("pinning needs prefix caching")
        digests = chain_digests(context.root_digest(), token_bytes(prompt), self.block_size)
        with self._lock:
            if name in self._pins:
                raise LedgerError(f"a pin named {name!r} already exists")
            pool = self.pool
            blocks: list[int] = []
            for d in digests:
                b = pool.index.get(d)
                if b is None or not pool.written[b]:
                    break
                blocks.append(b)
            pinned = sum(len(v) for v in self._pins.values())
            limit = int(self.max_pinned_fraction * pool.num_blocks)
            if pinned + len(blocks) > limit:
                raise AdmissionError(f"pinning {len(blocks)} blocks would exceed the pin limit of {limit} "
                                     f"({self.max_pinned_fraction:g} of the pool; {pinned} pinned)")
            retained = sum(1 for b in blocks if pool.ref[b] == 0 and not pool.leased[b])
            if retained > pool.num_free + pool.num_evictable - self.promised:
                raise AdmissionError("pinning now would break promises already made to running requests")
            for b in blocks:
                pool.share(b)
            self._pins[name] = blocks
            return len(blocks)

    def unpin(self: KVLedger, name: str) -> None:
        with self._lock:
            blocks = self._pins.pop(name, None)
            if blocks is None:
                raise LedgerError(f"no pin named {name!r}")
            self.pool.release_many(blocks[::-1])

    def pins(self: KVLedger) -> dict[str, int]:
        with self._lock:
            return {name: len(blocks) for name, blocks in self._pins.items()}

    # ---- cache ----------------------------------------------------------------------------------
    def clear_cache(self: KVLedger) -> int:
        """Evict every retained block (running requests and pins are untouched). Returns the count."""
        with self._lock:
            victims = self.pool.retained.blocks()
            for block in victims:
                self.pool.evict(block, kind="cleared")
            self.counters.cleared += len(victims)
            return len(victims)

    # ---- statistics -----------------------------------------------------------------------------
    def token_usage(self: KVLedger) -> dict[str, int]:
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
            for blocks in self._pins.values():
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

    def stats(self: KVLedger, trust_group: str | None = None) -> dict[str, Any]:
        """Counters, hit rates and usage. With ``trust_group``, the prefix-cache figures are that
        group's only (a tenant's view); without, the operator's totals. Never contains digests."""
        with self._lock:
            c = self.counters
            q = c.groups.get(trust_group) if trust_group is not None else c.totals()
            prefix = {
                "queries": q.queries if q else 0,
                "query_blocks": q.query_blocks if q else 0,
                "hit_blocks": q.hit_blocks if q else 0,
                "query_tokens": q.query_tokens if q else 0,
                "hit_tokens": q.hit_tokens if q else 0,
                "hit_rate": (q.hit_tokens / q.query_tokens) if q and q.query_tokens else 0.0,
            }
            if trust_group is not None:
                return {"trust_group": trust_group, "prefix_cache": prefix}
            materialised = sum(len(s.table.blocks) for s in self._seqs.values())
            return {
                "prefix_cache": {**prefix, "window_hit_rate": c.window_hit_rate()},
                "admissions": {"admitted": c.admitted, "not_now": c.rejected_not_now, "never": c.rejected_never},
                "lifetimes": {"finished": c.finished, "cancelled": c.cancelled, "forks": c.forks,
                              "copies": c.copies, "preemptions": c.preemptions,
                              "evictions": self.pool.evictions, "cleared": c.cleared,
                              "pending_releases": self.pool.deferred, "leases": len(self._leases)},
                "promises": {"promised": self.promised, "materialised_block_refs": materialised},
                "usage": self.usage().as_dict(),
                "tokens": self.token_usage(),
                "eviction_policy": self.policy_name,
            }
