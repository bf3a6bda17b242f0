"""Lifetimes: leases (outstanding accesses), pins, cache clearing and reset, and statistics.

A *lease* marks blocks an in-flight step or transfer still reads or writes. Releasing a sequence
(finish, cancel, beam pruning, preemption) while its blocks are leased defers their release: they stay
active (ref 0, leased) until the lease ends, so nothing is reused early and nothing leaks. Promises
hold no data, so cancelling frees them at once. Every lease names its *owner* (the step or transfer
that took it), so a caller can audit that no lease outlives what took it (:meth:`LifetimeOps.leases`).

A *pin* holds a reference on a cached prefix (a system prompt, say) so that it is never evicted; pins
are bounded by ``max_pinned_fraction`` of the pool and are active blocks, which is how admission
accounts for them.

Statistics come in two views that are never mixed: :meth:`LifetimeOps.stats` is the operator's (the
whole pool, every group's totals), :meth:`LifetimeOps.tenant_stats` a tenant's (its own group's prefix
cache figures, nothing pool-wide).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..errors import AdmissionError, ConfigError, LedgerError
from .identity import CacheContext, prompt_digests
from .types import show

if TYPE_CHECKING:
    from .ledger import KVLedger


@dataclass(slots=True)
class Lease:
    """One outstanding access: the sequences it covers (O(1) each, turned into block leases only if
    a sequence is dropped while leased), the blocks it leases directly, and who took it."""

    sequences: list[str]
    blocks: list[int]
    owner: str = ""


@dataclass(frozen=True, slots=True)
class CacheReset:
    """The result of :meth:`LifetimeOps.reset_prefix_cache`: ``done`` (also its truth value), the
    retained blocks evicted, why not when refused, and the tier entries forgotten."""

    done: bool
    cleared_blocks: int  # device blocks
    reason: str
    cleared_tier_entries: int = 0  # cached entries of the attached tiers (host, disk)

    def __bool__(self) -> bool:
        return self.done


class LifetimeOps:
    """Mixed into :class:`~kvledger.core.ledger.KVLedger`; runs under its lock."""

    # ---- leases ---------------------------------------------------------------------------------
    def lease(self: KVLedger, request_ids: Iterable[str] = (), blocks: Iterable[int] = (), owner: str = "") -> int:
        """Mark an outstanding access to the named sequences and to extra ``blocks``; returns a lease id.
        ``owner`` names who took it (a step, a transfer): :meth:`leases` lists outstanding leases by
        owner, so a caller can check that every one belongs to something still in flight.

        Leasing a sequence costs O(1) however many blocks it holds (an engine leases every scheduled
        sequence every step). Only if a leased sequence is dropped -- finished, cancelled, pruned,
        preempted -- are its blocks leased one by one, so that their release is deferred until the
        lease ends. A block lease marks single blocks (a transfer reading blocks directly); only a
        block someone holds can be leased. Everything is checked before anything is leased."""
        if type(owner) is not str:
            raise ConfigError(f"a lease owner is a name (str), got {show(owner)}")
        for name, value in (("request_ids", request_ids), ("blocks", blocks)):
            if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__"):
                raise ConfigError(f"lease {name} must be a collection, got {show(value)}")
        ids = list(request_ids)
        extra = list(blocks)
        with self._lock:
            for rid in ids:
                self.sequence(rid)
            pool = self.pool
            for block in extra:
                if isinstance(block, bool) or type(block) is not int or not 0 <= block < pool.num_blocks:
                    raise ConfigError(f"lease: {show(block)} is not a block of this pool (0..{pool.num_blocks - 1})")
                if pool.ref[block] == 0 and not pool.leased[block]:
                    raise LedgerError(f"block {block} is not held by anyone; it cannot be leased")
            for block in extra:
                pool.lease(block)
            lease_id = self._next_lease
            self._next_lease += 1
            self._leases[lease_id] = Lease(ids, extra, owner)
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
            try:
                lease = self._leases.pop(lease_id, None)
            except TypeError:
                lease = None
            if lease is None:
                raise LedgerError(f"unknown lease {show(lease_id)} (already ended?)")
            for block in reversed(lease.blocks):
                self.pool.unlease(block)
            seq_leases = self._seq_leases
            for rid in lease.sequences:
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
            extra = self._leases[lid].blocks
            for block in blocks:
                self.pool.lease(block)
            extra.extend(blocks)

    def is_leased(self: KVLedger, request_id: str) -> bool:
        """Whether a sequence has an outstanding lease (its blocks cannot be released before it ends)."""
        return isinstance(request_id, str) and request_id in self._seq_leases

    def outstanding_leases(self: KVLedger) -> int:
        return len(self._leases)

    def leases(self: KVLedger) -> dict[int, str]:
        """Every outstanding lease: lease id -> owner (the name given to :meth:`lease`)."""
        with self._lock:
            return {lid: lease.owner for lid, lease in self._leases.items()}

    # ---- pins -----------------------------------------------------------------------------------
    def pin(self: KVLedger, name: str, prompt: Sequence[int], context: CacheContext) -> int:
        """Pin the cached, written full blocks of ``prompt`` (its leading chain in the prefix index) so
        they are never evicted. Returns the number of blocks pinned (0 if nothing is cached yet)."""
        if not self.prefix_caching:
            raise LedgerError("pinning needs prefix caching")
        if type(name) is not str or not name:
            raise ConfigError(f"a pin is named by a non-empty string, got {show(name)}")
        if not isinstance(context, CacheContext):
            raise ConfigError(f"pin: context must be a CacheContext, got {show(context)}")
        if prompt is None or isinstance(prompt, (str, bytes)):
            raise ConfigError(f"pin: the prompt must be a sequence of token ids, got {show(prompt)}")
        digests = prompt_digests(context.root_digest(), prompt, self.block_size, self._native)
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
            if retained > self.promises.unpromised():
                raise AdmissionError("pinning now would break promises already made to running requests")
            for b in blocks:
                pool.share(b)
            self._pins[name] = blocks
            return len(blocks)

    def unpin(self: KVLedger, name: str) -> None:
        with self._lock:
            blocks = self._pins.pop(name, None) if isinstance(name, str) else None
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

    def reset_prefix_cache(self: KVLedger) -> CacheReset:
        """Forget the whole prefix cache, as vLLM's ``reset_prefix_cache`` does (after a weight update,
        say): only when no block is held -- by a sequence, a pin, a lease or a deferred release --
        since a held block's identity is still in use, and no transfer to or from an attached tier is
        in flight (a demotion still being written would land an old entry after the reset). Refused,
        it changes nothing and says why. Done, the prefix index, the retained blocks, the eviction
        policy's memory (priorities, expiry), the remembered digests of waiting requests, every cached
        entry of the attached tiers (host, disk: KV of the old weights must never be promoted back)
        and the hit-rate window are all empty, and every block is free."""
        with self._lock:
            pool = self.pool
            held = []
            if self._seqs:
                held.append(f"{len(self._seqs)} running sequences")
            pinned = sum(len(blocks) for blocks in self._pins.values())
            if pinned:
                held.append(f"{pinned} pinned blocks")
            if self._leases:
                held.append(f"{len(self._leases)} outstanding leases")
            if pool.deferred:
                held.append(f"{pool.deferred} deferred releases")
            moving = self.tiers.transfers_in_flight() if self.tiers is not None else 0
            if moving:
                held.append(f"{moving} tier transfers in flight")
            if held:
                return CacheReset(False, 0, "blocks are still held: " + ", ".join(held))
            cleared = pool.drop_cache()
            tier_cleared = self.tiers.clear_cache() if self.tiers is not None else 0
            self._digest_cache.clear()
            self._copies.clear()
            self.counters.cleared += cleared
            self.counters.cache_resets += 1
            self.counters.window.clear()  # the hit rate restarts with the cache, as vLLM's metrics do
            where = f" and {tier_cleared} tier entries" if self.tiers is not None else ""
            return CacheReset(True, cleared, f"{cleared} cached blocks{where} cleared", tier_cleared)

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

    @staticmethod
    def _prefix_figures(q: Any) -> dict[str, Any]:
        return {
            "queries": q.queries if q else 0,
            "query_blocks": q.query_blocks if q else 0,
            "hit_blocks": q.hit_blocks if q else 0,
            "query_tokens": q.query_tokens if q else 0,
            "hit_tokens": q.hit_tokens if q else 0,
            "hit_rate": (q.hit_tokens / q.query_tokens) if q and q.query_tokens else 0.0,
        }

    def stats(self: KVLedger) -> dict[str, Any]:
        """The operator's view: counters, hit rates and usage of the whole pool, every group's totals.
        ``prefix_cache`` counts first admissions only; ``prefix_cache_readmissions`` the requests brought
        back after preemption (they mostly find their own blocks again). Never contains digests. A
        tenant's view is :meth:`tenant_stats`."""
        with self._lock:
            c = self.counters
            materialised = sum(len(s.table.blocks) for s in self._seqs.values())
            return {
                "prefix_cache": {**self._prefix_figures(c.totals()), "window_hit_rate": c.window_hit_rate(),
                                 "read_skipped": c.read_skipped},
                "prefix_cache_readmissions": self._prefix_figures(c.totals(readmission=True)),
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

    def tenant_stats(self: KVLedger, trust_group: str) -> dict[str, Any]:
        """A tenant's view: its own group's prefix-cache figures (first admissions and re-admissions),
        nothing about the pool or any other group. ``trust_group`` must be a group name (a string)."""
        if type(trust_group) is not str:
            raise ConfigError(f"tenant_stats needs a trust group name (str), got {show(trust_group)}")
        with self._lock:
            c = self.counters
            return {
                "trust_group": trust_group,
                "prefix_cache": self._prefix_figures(c.groups.get(trust_group)),
                "prefix_cache_readmissions": self._prefix_figures(c.readmission_groups.get(trust_group)),
            }
