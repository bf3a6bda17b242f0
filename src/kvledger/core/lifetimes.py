"""Lifetimes: leases (outstanding accesses) and pins, each a book that owns its state.

A *lease* marks blocks an in-flight step or transfer still reads or writes. Releasing a sequence
(finish, cancel, beam pruning, preemption) while its blocks are leased defers their release: they stay
active (ref 0, leased) until the lease ends, so nothing is reused early and nothing leaks. Promises
hold no data, so cancelling frees them at once. Every lease names its *owner* (the step or transfer
that took it), so a caller can audit that no lease outlives what took it (:meth:`LeaseBook.owners`).

A *pin* holds a reference on a cached prefix (a system prompt, say) so that it is never evicted; pins
are bounded by ``max_pinned_fraction`` of the pool and are active blocks, which is how admission
accounts for them.

Both books are collaborators of :class:`~kvledger.core.ledger.KVLedger`: they have no lock of their own
(the ledger calls them under its lock) and every law they keep is stated by their ``check``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from ..errors import AdmissionError, ConfigError, InvariantError, LedgerError
from .pool import BlockPool
from .promises import PromiseBook
from .types import SequenceState, pop_known, show


@dataclass(slots=True)
class Lease:
    """One outstanding access: the sequences it covers (O(1) each, turned into block leases only if
    a sequence is dropped while leased), the blocks it leases directly, and who took it."""

    sequences: list[str]
    blocks: list[int]
    owner: str = ""


@dataclass(frozen=True, slots=True)
class CacheReset:
    """The result of ``KVLedger.reset_prefix_cache``: ``done`` (also its truth value), the
    retained blocks evicted, why not when refused, and the tier entries forgotten."""

    done: bool
    cleared_blocks: int  # device blocks
    reason: str
    cleared_tier_entries: int = 0  # cached entries of the attached tiers (host, disk)

    def __bool__(self) -> bool:
        return self.done


def lease_arguments(request_ids: Iterable[str], blocks: Iterable[int], owner: str) -> tuple[list[str], list[int]]:
    """A lease's arguments as lists, checked for their kinds (not yet against the pool)."""
    if type(owner) is not str:
        raise ConfigError(f"a lease owner is a name (str), got {show(owner)}")
    for name, value in (("request_ids", request_ids), ("blocks", blocks)):
        if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__"):
            raise ConfigError(f"lease {name} must be a collection, got {show(value)}")
    return list(request_ids), list(blocks)


class LeaseBook:
    """Outstanding accesses, by lease id and by sequence.

    Law (:meth:`check`): ``pool.leased[b]`` is the number of leases naming block ``b``; every lease has
    an owner name; every sequence entry names a live sequence and only outstanding leases."""

    __slots__ = ("_by_sequence", "_leases", "_next_id", "_pool")

    def __init__(self, pool: BlockPool) -> None:
        self._pool = pool
        self._leases: dict[int, Lease] = {}
        self._by_sequence: dict[str, set[int]] = {}  # sequence -> its outstanding leases
        self._next_id = 1

    def __len__(self) -> int:
        return len(self._leases)

    def take(self, request_ids: list[str], blocks: list[int], owner: str) -> int:
        """Lease the named (live, checked by the caller) sequences and ``blocks``; returns the lease id.
        Leasing a sequence is O(1) however many blocks it holds: its blocks are leased one by one only
        if it is dropped while leased (:meth:`hand_over`). Only a block someone holds can be leased.
        Every block is checked before any is leased."""
        pool = self._pool
        for block in blocks:
            if isinstance(block, bool) or type(block) is not int or not 0 <= block < pool.num_blocks:
                raise ConfigError(f"lease: {show(block)} is not a block of this pool (0..{pool.num_blocks - 1})")
            if pool.ref[block] == 0 and not pool.leased[block]:
                raise LedgerError(f"block {block} is not held by anyone; it cannot be leased")
        for block in blocks:
            pool.lease(block)
        lease_id = self._next_id
        self._next_id += 1
        self._leases[lease_id] = Lease(request_ids, blocks, owner)
        by_sequence = self._by_sequence
        for rid in request_ids:
            held = by_sequence.get(rid)
            if held is None:
                by_sequence[rid] = {lease_id}
            else:
                held.add(lease_id)
        return lease_id

    def end(self, lease_id: int) -> None:
        """The access finished: the releases it deferred complete now, tail block first."""
        lease: Lease = pop_known(self._leases, lease_id, "lease {} (already ended?)")
        for block in reversed(lease.blocks):
            self._pool.unlease(block)
        by_sequence = self._by_sequence
        for rid in lease.sequences:
            held = by_sequence.get(rid)
            if held is not None:
                held.discard(lease_id)
                if not held:
                    del by_sequence[rid]

    def any_sequence(self) -> bool:
        """Whether any sequence is leased (most drops then have nothing to hand over)."""
        return bool(self._by_sequence)

    def hand_over(self, request_id: str, blocks: list[int]) -> None:
        """A leased sequence is being dropped: move its leases onto its blocks (head first, so that
        ending the lease releases them tail first), before its references go."""
        leases = self._by_sequence.pop(request_id, None)
        if not leases:
            return
        pool = self._pool
        for lid in leases:
            extra = self._leases[lid].blocks
            for block in blocks:
                pool.lease(block)
            extra.extend(blocks)

    def holds(self, request_id: object) -> bool:
        """Whether a sequence has an outstanding lease (its blocks cannot be released before it ends)."""
        return isinstance(request_id, str) and request_id in self._by_sequence

    def owners(self) -> dict[int, str]:
        """Every outstanding lease: lease id -> owner."""
        return {lid: lease.owner for lid, lease in self._leases.items()}

    def check(self, sequences: Mapping[str, SequenceState]) -> None:
        pool = self._pool
        leased = [0] * pool.num_blocks
        for lid, lease in self._leases.items():
            if type(lease.owner) is not str:
                raise InvariantError(f"lease {lid} has no owner name")
            for b in lease.blocks:
                leased[b] += 1
        for rid, lids in self._by_sequence.items():
            if rid not in sequences or any(lid not in self._leases for lid in lids):
                raise InvariantError(f"lease bookkeeping for {rid!r} is stale")
        if leased != pool.leased:
            raise InvariantError("lease counts disagree with outstanding leases")


class PinBook:
    """Named references on cached prefix blocks, bounded by ``max_fraction`` of the pool.

    Law: a pin's blocks are referenced once each by it (counted with the tables by the ledger's
    audit), and the pinned blocks never exceed ``int(max_fraction * num_blocks)``."""

    __slots__ = ("_pins", "_pool", "_promises", "max_fraction")

    def __init__(self, pool: BlockPool, promises: PromiseBook, max_fraction: float) -> None:
        self._pool = pool
        self._promises = promises
        self.max_fraction = max_fraction
        self._pins: dict[str, list[int]] = {}

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and name in self._pins

    def __bool__(self) -> bool:
        return bool(self._pins)

    def held(self) -> Iterable[list[int]]:
        """Each pin's blocks (a view: read it under the ledger's lock)."""
        return self._pins.values()

    def total(self) -> int:
        return sum(len(blocks) for blocks in self._pins.values())

    def counts(self) -> dict[str, int]:
        return {name: len(blocks) for name, blocks in self._pins.items()}

    def pin(self, name: str, digests: Sequence[bytes]) -> int:
        """Pin the written blocks of the leading chain of ``digests`` in the prefix index; returns how
        many (0 if nothing is cached yet). Refused (nothing changes) past the pin limit, or when taking
        retained blocks out of the evictable ones would break a promise."""
        if name in self._pins:
            raise LedgerError(f"a pin named {name!r} already exists")
        pool = self._pool
        blocks: list[int] = []
        for d in digests:
            b = pool.index.get(d)
            if b is None or not pool.written[b]:
                break
            blocks.append(b)
        pinned = self.total()
        limit = int(self.max_fraction * pool.num_blocks)
        if pinned + len(blocks) > limit:
            raise AdmissionError(f"pinning {len(blocks)} blocks would exceed the pin limit of {limit} "
                                 f"({self.max_fraction:g} of the pool; {pinned} pinned)")
        retained = sum(1 for b in blocks if pool.ref[b] == 0 and not pool.leased[b])
        if retained > self._promises.unpromised():
            raise AdmissionError("pinning now would break promises already made to running requests")
        for b in blocks:
            pool.share(b)
        self._pins[name] = blocks
        return len(blocks)

    def unpin(self, name: str) -> None:
        blocks = self._pins.pop(name, None) if isinstance(name, str) else None
        if blocks is None:
            raise LedgerError(f"no pin named {name!r}")
        self._pool.release_many(blocks[::-1])
