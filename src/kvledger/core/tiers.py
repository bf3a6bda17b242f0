"""Tiers below the device pool: one ledger of slots in host memory, on disk, or any other store.

A tier is an ordered level (fastest first: ``host``, then ``disk``) of fixed-size slots, each able to
hold one whole device block's bytes. Slots have global ids -- tier ``i`` owns ``[base_i, base_i + size_i)``
-- so a swapped branch's ``host_blocks`` can name slots of any tier. Each slot is in exactly one state:

    free      holds nothing
    held      the only copy of a swapped request's block (it returns to the device on restore)
    cached    a demoted prefix block: indexed by its digest and tagged with its trust group
    draining  read by a transfer this step (a promotion back to the device, or a move one tier down);
              free once the step is done

A slot written by a transfer that has not completed is *in flight*: a held slot cannot be restored
and a cached one cannot be promoted or moved before :meth:`TierLedger.complete` (the scheduler calls it
when the step that carries the transfer is confirmed). The ledger decides; the runtime moves bytes.

**Conservation** (checked by :meth:`TierLedger.check`), per tier and across tiers:

* ``free + held + cached + draining == size`` for every tier, each slot in exactly one state;
* the digest index and the cached slots agree, one slot per digest across *all* tiers (a block identity
  is cached at most once below the device), every cached slot carries a trust group, and no free or
  held slot carries an identity;
* the flow of cached entries: ``demoted == cached + promoted + dropped + cleared + discarded`` (an
  entry enters by demotion and leaves exactly once; a move to a slower tier keeps it), and of held
  slots: ``held_total == held + freed``.

**Trust groups.** A cached entry is served only to a request of the same trust group: the digest
chain already starts from the group's context root, and :meth:`TierLedger.lookup` also compares the
group explicitly, so a tier never serves a block to another tenant even if two digests collided.

**Demotion** (:meth:`demote`) comes in two kinds. A *write-back* copies a retained device block that is
next in line for eviction while it still sits on the device (off the critical path); it goes to the
fastest tier with room: a free slot, else that tier's least recently used readable entry, which moves
one tier down (a ``move`` op) or, from the last tier, is dropped. When such a block is then evicted its
identity is already below, so nothing is copied. An *urgent* demotion copies a block being evicted now
(no write-back reached it) into a free slot, fastest tier first, else the slot of the slowest tier's
least recently used entry, which is dropped -- never a move, which would run on the critical path too
(spilling keeps fast slots free ahead of time, off it). **Holds** (:meth:`hold`, for swapped
requests) take free slots fastest tier first, then drop cached entries slowest tier first, so
``holdable = free + evictable`` is exact. Every operation is O(1) per slot (amortised) except :meth:`check`.
"""

from __future__ import annotations

import bisect
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from ..errors import ConfigError, InvariantError, LedgerError
from . import checks
from .checks import show

FREE, HELD, CACHED, DRAINING = 0, 1, 2, 3
STATE_NAMES = ("free", "held", "cached", "draining")
MAX_TIER_SLOTS = 2**24  # per-slot facts live in flat lists, as the device pool's do


def _slot_list(slots: object, what: str) -> list:
    """The caller's slots as a list (checked one by one by the caller)."""
    if isinstance(slots, (str, bytes)) or not hasattr(slots, "__iter__"):
        raise ConfigError(f"{what}: expected an iterable of tier slots, got {show(slots)}")
    return list(slots)  # type: ignore[call-overload]


@dataclass(frozen=True, slots=True)
class TierOp:
    """A transfer the tier ledger decided on its own: ``demote`` (an evicted device block ``src`` -> tier
    slot ``dst``: urgent, the block is reused this step), ``writeback`` (a retained device block that stays
    on the device -> slot ``dst``: a copy ahead of its eviction) or ``move`` (tier slot ``src`` -> slot
    ``dst`` of a slower tier, to make room for a write-back). Executors run a step's moves before its
    write-backs (one may reuse a moved entry's slot); urgent demotions never cause a move."""

    kind: str
    src: int
    dst: int


@dataclass(frozen=True, slots=True)
class TierSpec:
    """One tier: a name (``host``, ``disk``) and its size in slots (whole device blocks)."""

    name: str
    slots: int

    def __post_init__(self) -> None:
        if type(self.name) is not str or not self.name or not self.name.isidentifier():
            raise ConfigError(f"a tier name is an identifier such as 'host' or 'disk', got {show(self.name)}")
        if isinstance(self.slots, bool) or type(self.slots) is not int or not 0 <= self.slots <= MAX_TIER_SLOTS:
            raise ConfigError(f"tier {self.name!r}: slots must be an integer in 0..{MAX_TIER_SLOTS:,}, "
                              f"got {show(self.slots)}")


class TierLedger:
    """Slots of every tier below the device pool, fastest tier first. Thread-safe (one lock)."""

    def __init__(self, tiers: Sequence[TierSpec | tuple[str, int]]) -> None:
        if isinstance(tiers, (str, bytes)) or not hasattr(tiers, "__iter__"):
            raise ConfigError(f"tiers must be a sequence of (name, slots), got {show(tiers)}")
        specs = [t if isinstance(t, TierSpec) else TierSpec(*t) for t in tiers]
        if not specs:
            raise ConfigError("a tier ledger needs at least one tier")
        if len({s.name for s in specs}) != len(specs):
            raise ConfigError("tier names must be distinct")
        total = sum(s.slots for s in specs)
        if total > MAX_TIER_SLOTS:
            raise ConfigError(f"{total:,} tier slots is beyond the supported {MAX_TIER_SLOTS:,}")
        self.specs = tuple(specs)
        self.names = tuple(s.name for s in specs)
        self.sizes = tuple(s.slots for s in specs)
        self.bases = tuple(sum(self.sizes[:i]) for i in range(len(specs)))
        self.num_blocks = total
        self.state = [FREE] * total
        self.digest: list[bytes | None] = [None] * total
        self.group: list[str | None] = [None] * total
        self.in_flight = [False] * total
        self.depth = [0] * total  # a cached entry's depth in its prompt (0 = first block, or unknown)
        # Per tier: a free stack (lowest slot handed out first) and the readable cached slots, least
        # recently used first (in-flight entries join at completion).
        self._free = [list(range(b + n - 1, b - 1, -1)) for b, n in zip(self.bases, self.sizes, strict=True)]
        self._lru: list[OrderedDict[int, None]] = [OrderedDict() for _ in specs]
        self.index: dict[bytes, int] = {}
        self._pending: set[int] = set()  # slots written by a transfer not completed yet
        self._draining: list[int] = []
        self._ops: list[TierOp] = []
        self.counts = {"held": 0, "cached": 0, "draining": 0}
        self.flow = {"demoted": 0, "promoted": 0, "dropped": 0, "cleared": 0, "discarded": 0, "moved": 0,
                     "held_total": 0, "freed": 0, "demote_skipped": 0}
        # The demotion rule: worth(tier, depth, urgent) says whether a block at ``depth`` (None: unknown)
        # is worth a slot of ``tier`` -- loading it back is expected to beat recomputing it. None: always.
        self.worth: Callable[[int, int | None, bool], bool] | None = None
        self.declined = 0  # demotions the rule refused (no tier was worth it)
        self._lock = threading.RLock()
        # Called as on_event(kind, digest) when a digest enters ("stored") or leaves ("removed") the index
        # below the device, under this ledger's lock: a replica publishes what it holds in any tier to
        # routers (kvledger.fleet.door.CacheEventTap.attach_tiers). A move one tier down is a removal
        # followed by a store of the same digest.
        self.on_event: Callable[[str, bytes], None] | None = None

    # ---- layout ---------------------------------------------------------------------------------
    def tier_of(self, slot: int) -> int:
        """The index of the tier owning global slot ``slot``."""
        return bisect.bisect_right(self.bases, slot) - 1 if self.num_blocks else 0

    def tier_name(self, slot: int) -> str:
        return self.names[self.tier_of(slot)]

    def local(self, slot: int) -> tuple[int, int]:
        """``(tier index, slot within that tier)``."""
        i = self.tier_of(slot)
        return i, slot - self.bases[i]

    # ---- counts (also the host-pool view the scheduler and diagnostics read) -----------------------
    @property
    def num_free(self) -> int:
        """Free slots in every tier."""
        return sum(len(f) for f in self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    @property
    def num_evictable(self) -> int:
        """Cached entries that can give their slot up now (readable: not in flight, not draining)."""
        return sum(len(lru) for lru in self._lru)

    @property
    def holdable(self) -> int:
        """Slots :meth:`hold` can take now: free slots plus cached entries it may drop."""
        return self.num_free + self.num_evictable

    def usage(self) -> dict[str, dict[str, int]]:
        """Per tier: size and slots by state."""
        with self._lock:
            out: dict[str, dict[str, int]] = {}
            for i, name in enumerate(self.names):
                lo, hi = self.bases[i], self.bases[i] + self.sizes[i]
                counts = [0, 0, 0, 0]
                for s in range(lo, hi):
                    counts[self.state[s]] += 1
                out[name] = {"slots": self.sizes[i], **dict(zip(STATE_NAMES, counts, strict=True)),
                             "in_flight": sum(1 for s in range(lo, hi) if self.in_flight[s])}
            return out

    # ---- slots for swapped requests ---------------------------------------------------------------
    def hold(self, n: int) -> list[int]:
        """``n`` slots for a swapped request's blocks (held, in flight until :meth:`complete`): free slots
        fastest tier first, then cached entries dropped slowest tier first. All or nothing."""
        if isinstance(n, bool) or type(n) is not int or n < 0:
            raise ConfigError(f"hold: n must be an integer >= 0, got {show(n)}")
        with self._lock:
            if n > self.holdable:
                raise LedgerError(f"the tiers cannot hold {n} blocks: {self.holdable} slots can be freed")
            out: list[int] = []
            for free in self._free:
                while free and len(out) < n:
                    out.append(free.pop())
            for i in range(len(self.names) - 1, -1, -1):
                lru = self._lru[i]
                while lru and len(out) < n:
                    slot, _ = lru.popitem(last=False)
                    self._drop_entry(slot, "dropped")
                    out.append(self._free[i].pop())
            for slot in out:
                self.state[slot] = HELD
                self.in_flight[slot] = True
                self._pending.add(slot)
            self.counts["held"] += n
            self.flow["held_total"] += n
            return out

    def free(self, slots: Iterable[int]) -> None:
        """Held slots whose request was restored or cancelled become free. All or nothing."""
        slots = _slot_list(slots, "free")
        with self._lock:
            for slot in slots:
                # The caller's mistake (a slot it does not hold, freed twice, never a slot): a LedgerError,
                # like any other broken rule; InvariantError is kept for laws kvledger itself broke.
                if not self._valid(slot) or self.state[slot] != HELD:
                    raise LedgerError(f"tier slot {show(slot)} freed but not held")
            if len(set(slots)) != len(slots):  # freeing one twice would put it on the free list twice
                raise LedgerError("free: a tier slot is named twice")
            for slot in slots:
                self.state[slot] = FREE
                self.in_flight[slot] = False
                self._pending.discard(slot)
                self._free[self.tier_of(slot)].append(slot)
            self.counts["held"] -= len(slots)
            self.flow["freed"] += len(slots)

    def allocate(self, n: int) -> list[int]:
        """The host-pool name of :meth:`hold`."""
        return self.hold(n)

    # ---- the prefix cache below the device ------------------------------------------------------
    def demote(self, block: int, digest: bytes, group: str | None, *, urgent: bool = True,
               depth: int | None = None) -> int | None:
        """A device block's identity goes down: returns the slot its bytes go to (an op is recorded), or None
        when it is already cached below (no copy) or no tier has room (dropped).

        ``urgent``: the device block is being evicted now and is reused this step, so its copy is on the
        step's critical path: it takes a free slot (fastest tier first) or the slot of the slowest tier's
        least recently used entry, which is dropped -- never a move, which would have to run first. Not
        urgent (a *write-back* of a retained block that stays on the device, ahead of its eviction): the
        fastest tier with room,
        whose least recently used entry moves one tier down to make it (``move`` ops, run before it).

        With a demotion rule (:attr:`worth`) only the tiers it finds worth the block at ``depth`` are
        considered, and an entry moves down only to a tier worth it (else it is dropped); a block no tier
        is worth is not demoted at all (``declined``)."""
        if type(digest) is not bytes or not digest:
            raise ConfigError(f"demote: a digest is non-empty bytes, got {show(digest)}")
        if type(group) is not str:  # a cached entry without a trust group could be served to anyone
            raise ConfigError(f"demote: the trust group must be a string, got {show(group)}")
        with self._lock:
            held = self.index.get(digest)
            if held is not None:
                self.flow["demote_skipped"] += 1
                lru = self._lru[self.tier_of(held)]
                if held in lru:
                    lru.move_to_end(held)
                return None
            rule = self.worth
            allowed = range(len(self.names)) if rule is None else \
                [i for i in range(len(self.names)) if rule(i, depth, urgent)]
            if not allowed:
                self.declined += 1
                return None
            slot = None
            if urgent:
                slot = self._urgent_slot(allowed)
            else:
                for i in allowed:
                    slot = self._slot_for_cache(i)
                    if slot is not None:
                        break
            self.flow["demoted"] += 1
            if slot is None:
                self.flow["dropped"] += 1
                return None
            self._place(slot, digest, group, depth or 0)
            self._ops.append(TierOp("demote" if urgent else "writeback", block, slot))
            return slot

    def _urgent_slot(self, allowed: Sequence[int]) -> int | None:
        """A free slot, fastest tier first; else the slot of the slowest tier's least recently used readable
        entry, which is dropped (never a move: it would have to run before the copy, on the critical path
        too). Dropping the coldest entry of the whole hierarchy keeps what is likelier to be hit again."""
        for i in allowed:
            if self._free[i]:
                return self._free[i].pop()
        for i in reversed(allowed):
            lru = self._lru[i]
            if lru:
                slot, _ = lru.popitem(last=False)
                self._drop_entry(slot, "dropped")
                return self._free[i].pop()
        return None

    def _slot_below(self, i: int, depth: int = 0) -> int | None:
        """A slot for an entry leaving tier ``i``: in the first slower tier (worth it, under a demotion rule)
        that can give one, or None."""
        rule = self.worth
        for j in range(i + 1, len(self.names)):
            if rule is not None and not rule(j, depth, False):
                continue
            target = self._slot_for_cache(j)
            if target is not None:
                return target
        return None

    def _slot_for_cache(self, i: int) -> int | None:
        """A slot of tier ``i`` for a new cached entry: a free one, else the slot of its least recently
        used readable entry, which moves to a slower tier (or is dropped from the last)."""
        free = self._free[i]
        if free:
            return free.pop()
        lru = self._lru[i]
        if not lru:
            return None
        slot, _ = lru.popitem(last=False)
        digest, group, depth = self.digest[slot], self.group[slot], self.depth[slot]
        target = self._slot_below(i, depth)
        if target is None:
            self._drop_entry(slot, "dropped")
            return self._free[i].pop()
        # The entry keeps its identity in the slower tier; the move op reads the old slot first.
        self._unindex(digest)  # type: ignore[arg-type]
        self._clear(slot)
        self.counts["cached"] -= 1
        self._place(target, digest, group, depth)  # type: ignore[arg-type]
        self.flow["moved"] += 1
        self._ops.append(TierOp("move", slot, target))
        return slot

    def spill(self, tier: int, n: int) -> int:
        """Move up to ``n`` of tier ``tier``'s least recently used readable entries one tier down (``move``
        ops, off the critical path), so the tier has free slots for the next demotions. A moved entry's
        old slot drains: it is free once the step's transfers are done. Returns the entries moved."""
        self._check_tier(tier, "spill")
        checks.count(n, "spill: n")
        with self._lock:
            moved = 0
            lru = self._lru[tier]
            while moved < n and lru:
                head = next(iter(lru))
                target = self._slot_below(tier, self.depth[head])
                if target is None:
                    if self.worth is None or not any(self._free[j] or self._lru[j]
                                                     for j in range(tier + 1, len(self.names))):
                        break
                    lru.popitem(last=False)  # no slower tier is worth it: dropped, its slot free now
                    self._drop_entry(head, "dropped")
                    moved += 1
                    continue
                slot, _ = lru.popitem(last=False)
                digest, group, depth = self.digest[slot], self.group[slot], self.depth[slot]
                self._unindex(digest)  # type: ignore[arg-type]
                self._clear(slot)
                self.state[slot] = DRAINING
                self._draining.append(slot)
                self.counts["cached"] -= 1
                self.counts["draining"] += 1
                self._place(target, digest, group, depth)  # type: ignore[arg-type]
                self.flow["moved"] += 1
                self._ops.append(TierOp("move", slot, target))
                moved += 1
            return moved

    def free_in(self, tier: int) -> int:
        """Free slots of one tier."""
        self._check_tier(tier, "free_in")
        return len(self._free[tier])

    def _check_tier(self, tier: object, what: str) -> None:
        if not 0 <= checks.count(tier, f"{what}: tier", minimum=None) < len(self.names):
            raise ConfigError(f"{what}: tier must be an index in [0, {len(self.names)}), got {show(tier)}")

    def _place(self, slot: int, digest: bytes, group: str | None, depth: int = 0) -> None:
        self.depth[slot] = depth
        self.state[slot] = CACHED
        self.digest[slot] = digest
        self.group[slot] = group
        self.in_flight[slot] = True
        self._pending.add(slot)
        self.index[digest] = slot
        self.counts["cached"] += 1
        if self.on_event is not None:
            self.on_event("stored", digest)

    def _unindex(self, digest: bytes) -> None:
        del self.index[digest]
        if self.on_event is not None:
            self.on_event("removed", digest)

    def _clear(self, slot: int) -> None:
        self.state[slot] = FREE
        self.digest[slot] = None
        self.group[slot] = None
        self.in_flight[slot] = False
        self._pending.discard(slot)

    def _drop_entry(self, slot: int, why: str) -> None:
        """A cached entry leaves the tiers (its slot goes back to its tier's free stack)."""
        self._unindex(self.digest[slot])  # type: ignore[arg-type]
        self._clear(slot)
        self.counts["cached"] -= 1
        self.flow[why] += 1
        self._free[self.tier_of(slot)].append(slot)

    def lookup(self, digests: Sequence[bytes], start: int, group: str | None) -> list[int]:
        """Slots holding ``digests[start:]`` in order, as far as they are cached, readable and of
        ``group`` (the chain stops at the first miss: only a leading run extends a prefix)."""
        checks.count(start, "lookup: start")
        with self._lock:
            out: list[int] = []
            for k in range(start, len(digests)):
                slot = self.index.get(digests[k])
                if slot is None or self.in_flight[slot] or self.state[slot] != CACHED or self.group[slot] != group:
                    break
                out.append(slot)
            return out

    def take(self, slots: Sequence[int]) -> list[bytes]:
        """Promote cached entries: each leaves the index (it is on the device now) and its slot drains
        until :meth:`complete`. Returns their digests. All or nothing."""
        slots = _slot_list(slots, "take")
        with self._lock:
            for slot in slots:
                if not self._valid(slot) or self.state[slot] != CACHED or self.in_flight[slot]:
                    raise LedgerError(f"tier slot {show(slot)} holds no readable cached block")
            if len(set(slots)) != len(slots):  # promoting one twice would drain its slot twice
                raise LedgerError("take: a tier slot is named twice")
            out = []
            for slot in slots:
                d = self.digest[slot]
                out.append(d)
                self._unindex(d)  # type: ignore[arg-type]
                self._lru[self.tier_of(slot)].pop(slot, None)
                self.state[slot] = DRAINING
                self.digest[slot] = None
                self.group[slot] = None
                self._draining.append(slot)
            self.counts["cached"] -= len(slots)
            self.counts["draining"] += len(slots)
            self.flow["promoted"] += len(slots)
            return out  # type: ignore[return-value]

    # ---- transfers --------------------------------------------------------------------------------
    def take_ops(self) -> list[TierOp]:
        """Demotions and moves decided since the last call, in the order they must run."""
        with self._lock:
            ops, self._ops = self._ops, []
            return ops

    def complete(self) -> None:
        """Every transfer handed out so far is done: written slots become readable (cached ones join
        the LRU order, most recent last) and drained slots free."""
        with self._lock:
            for slot in sorted(self._pending):
                self.in_flight[slot] = False
                if self.state[slot] == CACHED:
                    self._lru[self.tier_of(slot)][slot] = None
            self._pending.clear()
            for slot in self._draining:
                self.state[slot] = FREE
                self._free[self.tier_of(slot)].append(slot)
            self.counts["draining"] -= len(self._draining)
            self._draining.clear()

    def discard(self, slots: Iterable[int]) -> int:
        """Transfers into these cached slots failed: drop the entries (their bytes are not trustworthy).
        Held slots are left to their request (which fails with the step). Returns entries dropped."""
        slots = _slot_list(slots, "discard")
        with self._lock:
            n = 0
            for slot in slots:
                if self._valid(slot) and self.state[slot] == CACHED:
                    self._lru[self.tier_of(slot)].pop(slot, None)
                    self._drop_entry(slot, "discarded")
                    n += 1
            return n

    def transfers_in_flight(self) -> int:
        """Slots a transfer handed out is still writing or reading (until :meth:`complete`)."""
        with self._lock:
            return len(self._pending) + len(self._draining)

    def clear_cache(self) -> int:
        """Forget every readable cached entry (a prefix-cache reset). Held slots stay. Returns the count."""
        with self._lock:
            n = 0
            for lru in self._lru:
                while lru:
                    slot, _ = lru.popitem(last=False)
                    self._drop_entry(slot, "cleared")
                    n += 1
            return n

    # ---- audit ------------------------------------------------------------------------------------
    def _valid(self, slot: object) -> bool:
        return type(slot) is int and 0 <= slot < self.num_blocks

    def check(self) -> None:
        """Every conservation law of the module docstring; O(slots)."""
        with self._lock:
            counts = [0, 0, 0, 0]
            for i, name in enumerate(self.names):
                lo, hi = self.bases[i], self.bases[i] + self.sizes[i]
                per = [0, 0, 0, 0]
                for s in range(lo, hi):
                    if self.state[s] in (FREE, HELD, CACHED, DRAINING):  # a slot in no state breaks the sum
                        per[self.state[s]] += 1
                free = self._free[i]
                if len(set(free)) != len(free):
                    raise InvariantError(f"tier {name}: a slot is on the free list twice")
                if any(not lo <= s < hi or self.state[s] != FREE for s in free):
                    raise InvariantError(f"tier {name}: the free list names a slot that is not a free slot of it")
                if len(free) != per[FREE]:
                    raise InvariantError(f"tier {name}: {len(free)} slots on the free list but {per[FREE]} free")
                if sum(per) != self.sizes[i]:
                    raise InvariantError(f"tier {name}: conservation broken: free {per[FREE]} + held {per[HELD]} + "
                                         f"cached {per[CACHED]} + draining {per[DRAINING]} != {self.sizes[i]}")
                for s in self._lru[i]:
                    if not lo <= s < hi or self.state[s] != CACHED or self.in_flight[s]:
                        raise InvariantError(f"tier {name}: slot {s} is evictable but not a readable cached entry")
                for k in range(4):
                    counts[k] += per[k]
            for s in range(self.num_blocks):
                st, d = self.state[s], self.digest[s]  # every state is one of the four (checked above)
                if st == CACHED:
                    if d is None or self.index.get(d) != s:
                        raise InvariantError(f"cached tier slot {s} is not its digest's index entry")
                    if self.group[s] is None:
                        raise InvariantError(f"cached tier slot {s} carries no trust group")
                    if not self.in_flight[s] and s not in self._lru[self.tier_of(s)]:
                        raise InvariantError(f"readable cached tier slot {s} is missing from its LRU order")
                elif d is not None or self.group[s] is not None:
                    raise InvariantError(f"{STATE_NAMES[st]} tier slot {s} still carries an identity")
                if self.in_flight[s] != (s in self._pending):
                    raise InvariantError(f"tier slot {s}: in-flight flag and pending transfers disagree")
                if self.in_flight[s] and st not in (HELD, CACHED):
                    raise InvariantError(f"tier slot {s} is in flight but {STATE_NAMES[st]}")
            for d, s in self.index.items():
                if not self._valid(s) or self.digest[s] != d:
                    raise InvariantError(f"tier index entry for slot {s} disagrees with the slot")
            if sorted(self._draining) != [s for s in range(self.num_blocks) if self.state[s] == DRAINING]:
                raise InvariantError("draining slots and the drain list disagree")
            if (counts[HELD], counts[CACHED], counts[DRAINING]) != (
                    self.counts["held"], self.counts["cached"], self.counts["draining"]):
                raise InvariantError(f"tier counters {self.counts} disagree with the slots "
                                     f"(held {counts[HELD]}, cached {counts[CACHED]}, draining {counts[DRAINING]})")
            f = self.flow
            left = f["promoted"] + f["dropped"] + f["cleared"] + f["discarded"] + counts[CACHED]
            if f["demoted"] != left:
                raise InvariantError(f"cached-entry flow broken: demoted {f['demoted']} != cached {counts[CACHED]} + "
                                     f"promoted {f['promoted']} + dropped {f['dropped']} + cleared {f['cleared']} + "
                                     f"discarded {f['discarded']}")
            if f["held_total"] != counts[HELD] + f["freed"]:
                raise InvariantError(f"held-slot flow broken: held {f['held_total']} != held now {counts[HELD]} + "
                                     f"freed {f['freed']}")

    def stats(self) -> dict[str, object]:
        with self._lock:
            out: dict[str, object] = {"tiers": self.usage(), "flow": dict(self.flow)}
            if self.worth is not None:
                out["declined"] = self.declined
            return out


__all__ = ["CACHED", "DRAINING", "FREE", "HELD", "STATE_NAMES", "TierLedger", "TierOp", "TierSpec"]
