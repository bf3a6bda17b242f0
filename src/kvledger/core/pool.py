"""The block pool: every physical block of one managed KV pool, each in exactly one state.

    free      ref == 0, not leased, no identity, on the free list
    active    ref >= 1 (held by block tables or pins), or ref == 0 but still leased (a *deferred*
              release: an in-flight step or transfer still touches it)
    retained  ref == 0, not leased, indexed by its digest, evictable (an idle cache entry)

Conservation law (checked by :meth:`BlockPool.check`): ``free + active + retained == total``, and a
leased block is never free or retained. Ledger operations are O(1): per-block facts live in flat lists
indexed by block id, the free list is a stack, and retained blocks are ordered by an
:class:`~kvledger.core.eviction.EvictionPolicy`.

The pool is not thread-safe by itself; :class:`~kvledger.core.ledger.KVLedger` serialises access.
"""

from __future__ import annotations

from collections.abc import Callable

from ..errors import ConfigError, InvariantError, LedgerError, OutOfBlocksError
from . import native
from .eviction import EvictionPolicy, LRUPolicy

# (kind, block, digest, trust_group): "stored", "removed", "evicted"
EventHook = Callable[[str, int, bytes, "str | None"], None]


class BlockPool:
    __slots__ = ("num_blocks", "ref", "leased", "digest", "group", "written", "_free", "retained", "index",
                 "on_event", "on_evict", "deferred", "evictions", "_policy_forget", "_policy_link", "_native",
                 "_core")

    def __init__(self, num_blocks: int, policy: EvictionPolicy | None = None) -> None:
        if num_blocks <= 0:
            raise ConfigError("a pool needs at least one block")
        self.num_blocks = num_blocks
        self.ref: list[int] = [0] * num_blocks
        self.leased: list[int] = [0] * num_blocks  # outstanding accesses (steps, transfers)
        self.digest: list[bytes | None] = [None] * num_blocks
        self.group: list[str | None] = [None] * num_blocks  # trust group of an indexed block
        # A block is `written` once every token slot in it holds computed KV. An indexed block that is
        # not yet written is *pending*: others may share it, but must not read it before it is written.
        self.written: list[bool] = [False] * num_blocks
        # Pop from the end: block 0 is handed out first, which keeps small demos readable.
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self.retained: EvictionPolicy = policy if policy is not None else LRUPolicy()
        # Policies that remember per-block facts (priorities) are told when a block loses its identity.
        self._policy_forget: Callable[[int], None] | None = getattr(self.retained, "forget", None)
        # Policies that see the prefix tree (core.eviction_tree) are told each identity's parent and depth.
        self._policy_link: Callable[[int, bytes, int | None, int], None] | None = getattr(
            self.retained, "link", None)
        # A policy whose state lives in the C part (kvledger.core._native.PolicyCore): the pool calls it
        # directly, with no Python frame per block operation.
        self._core = getattr(self.retained, "native_core", None)
        if self._core is not None:
            self._policy_forget = self._core.forget
            if self._policy_link is not None:
                self._policy_link = self._core.link
        self.index: dict[bytes, int] = {}
        self.on_event: EventHook | None = None
        # Told of every block evicted for a new allocation, before it loses its identity (the ledger's tier
        # demotion); never of blocks cleared by a cache reset.
        self.on_evict: Callable[[list[int]], None] | None = None
        self.deferred = 0  # blocks whose last reference is gone but whose lease is not
        self.evictions = 0
        # The optional C part (kvledger.core.native): same transitions, per-block loops in C.
        self._native = native.MODULE

    # ---- counts -------------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_retained(self) -> int:
        return len(self.retained)

    @property
    def num_active(self) -> int:
        return self.num_blocks - len(self._free) - len(self.retained)

    @property
    def num_evictable(self) -> int:
        return len(self.retained)

    # ---- transitions --------------------------------------------------------------------------
    def allocate(self) -> int:
        """free -> active, or (free list empty) evict one retained block -> active."""
        if self._free:  # the common case, once per block_size tokens of every sequence
            block = self._free.pop()
            self.ref[block] = 1
            return block
        core = self._core
        if (self.retained and self.on_event is None and self.on_evict is None
                and (self._policy_forget is None or core is not None)):
            # The pool is full of cache (an engine's steady state): evict one block, inlined (a native
            # policy forgets it as it takes it).
            block = (self.retained.pop_victims(1) if core is None else core.take_victims(1))[0]
            self.evictions += 1
            del self.index[self.digest[block]]  # type: ignore[arg-type]
            self.digest[block] = None
            self.group[block] = None
            self.written[block] = False
            self.ref[block] = 1
            return block
        return self.allocate_many(1)[0]

    def allocate_many(self, n: int) -> list[int]:
        """``n`` blocks: from the free list first, then by evicting retained blocks in policy order."""
        free, fast = self._free, self._native
        take = min(n, len(free))
        if take:
            blocks = free[len(free) - take :]
            del free[len(free) - take :]
            blocks.reverse()
        else:
            blocks = []
        if take < n:
            if n - take > len(self.retained):
                free.extend(reversed(blocks))
                raise OutOfBlocksError("no free or evictable block left in the pool")
            core = self._core
            forgotten = core is not None and self.on_evict is None
            # a native policy forgets its victims as it takes them, unless someone must see them first
            victims = core.take_victims(n - take) if forgotten else self.retained.pop_victims(n - take)
            self.evictions += len(victims)
            if self.on_evict is not None:
                self.on_evict(victims)
            if (fast is not None and self.on_event is None and (self._policy_forget is None or forgotten)
                    and fast.clear_identity(victims, self.index, self.digest, self.group, self.written) is not None):
                blocks += victims  # each lost its identity (index entry, digest, group, written) in one C call
            else:
                self._clear_victims(victims, blocks)
        if fast is None or fast.set_items(self.ref, blocks, 0, len(blocks), 1) is None:
            ref = self.ref
            for block in blocks:
                ref[block] = 1
        return blocks

    def _clear_victims(self, victims: list[int], blocks: list[int]) -> None:
        """Evicted blocks lose their identity (inlined _forget: this loop runs once per block whenever
        the pool is full of cache) and join ``blocks``."""
        index, digest, written, group = self.index, self.digest, self.written, self.group
        hook = self.on_event
        forget = self._policy_forget
        for block in victims:
            if forget is not None:
                forget(block)
            d = digest[block]
            del index[d]  # type: ignore[arg-type]  # a retained block is its digest's canonical entry
            if hook is not None:
                hook("evicted", block, d, group[block])  # type: ignore[arg-type]
            digest[block] = None
            group[block] = None
            written[block] = False
            blocks.append(block)

    def share(self, block: int) -> None:
        """Take one more reference on an indexed block: retained -> active, or active ref += 1."""
        if self.ref[block] == 0 and not self.leased[block]:
            self.retained.remove(block)
        elif self.ref[block] == 0:
            self.deferred -= 1  # a deferred block picked up again before its lease ended
        self.ref[block] += 1

    def share_many(self, blocks: list[int]) -> None:
        """:meth:`share` each block, in order (a request's prefix hits, a fork's blocks)."""
        fast = self._native
        if fast is not None:
            if fast.add_refs(self.ref, blocks):
                return  # every block was held already: one more reference each, in C
            order = self._core if self._core is not None else getattr(self.retained, "native_order", None)
            if order is not None:
                picked_up = fast.share_blocks(self.ref, self.leased, order, blocks)
                if picked_up is not None:
                    self.deferred -= picked_up
                    return
        ref, leased, retained = self.ref, self.leased, self.retained
        for block in blocks:
            r = ref[block]
            if r == 0:
                if not leased[block]:
                    retained.remove(block)
                else:
                    self.deferred -= 1
            ref[block] = r + 1

    def register_many(self, blocks: list[int], digests: list[bytes], start: int, group: str | None) -> None:
        """:meth:`register` ``blocks[i]`` under ``digests[i]`` for every ``i >= start`` (a prompt's new
        full blocks)."""
        if self.on_event is not None:
            for i in range(start, len(digests)):
                self.register(blocks[i], digests[i], group, parent=digests[i - 1] if i else None, depth=i)
            return
        link = self._policy_link
        fast = self._native
        if (link is not None and self._core is not None and fast is not None
                and fast.register_linked(self.index, self.digest, self.group, blocks, digests, start, group,
                                         self._core) is not None):
            return  # registered and linked in one C call
        if link is not None:  # register, inlined, telling a tree policy each new identity's place
            index, block_digest_of, block_group = self.index, self.digest, self.group
            for i in range(start, len(digests)):
                d = digests[i]
                if d not in index:
                    block = blocks[i]
                    index[d] = block
                    block_digest_of[block] = d
                    block_group[block] = group
                    link(block, d, index.get(digests[i - 1]) if i else None, i)
            return
        if fast is not None and fast.register_many(self.index, self.digest, self.group, blocks, digests, start,
                                                   group) is not None:
            return
        index, block_digest_of, block_group = self.index, self.digest, self.group
        for i in range(start, len(digests)):
            d = digests[i]
            if d not in index:
                index[d] = blocks[i]
                block_digest_of[blocks[i]] = d
                block_group[blocks[i]] = group

    def register(self, block: int, digest: bytes, group: str | None = None, *, parent: bytes | None = None,
                 depth: int = 0) -> bool:
        """Index ``block`` under ``digest``. If another block already holds that identity the first one
        stays canonical and this block stays anonymous (it is freed, not retained, on release).
        ``parent`` (the previous block's digest) and ``depth`` are for policies that see the prefix tree."""
        if digest in self.index:
            return False
        self.index[digest] = block
        self.digest[block] = digest
        self.group[block] = group
        if self.on_event is not None:
            self.on_event("stored", block, digest, group)
        if self._policy_link is not None:
            self._policy_link(block, digest, None if parent is None else self.index.get(parent), depth)
        return True

    def release(self, block: int) -> None:
        """Drop one reference (see :meth:`release_many`)."""
        self.release_many((block,))

    def release_many(self, blocks: list[int] | tuple[int, ...]) -> None:
        """Drop one reference on each block, in order. At zero references a leased block is deferred
        until its lease ends; otherwise a written, indexed block is retained and anything else freed."""
        fast = self._native
        if fast is not None:
            # One C pass decides every block (None: an odd input, which the Python loop handles).
            scan = fast.release_scan(blocks, self.ref, self.leased, self.digest, self.written)
            if scan is not None:
                keep, freed, deferred, bad = scan
                self.deferred += deferred
                for block in freed:
                    self._forget(block)
                    self._free.append(block)
                if bad >= 0:
                    raise InvariantError(f"block {blocks[bad]} released more often than it was taken")
                if keep:  # in release order: the first released is evicted first
                    (self.retained if self._core is None else self._core).add_many(keep)
                return
        ref, digest, written, leased = self.ref, self.digest, self.written, self.leased
        keep = []
        for block in blocks:
            r = ref[block] - 1
            if r > 0:
                ref[block] = r
                continue
            if r < 0:
                raise InvariantError(f"block {block} released more often than it was taken")
            ref[block] = 0
            if leased[block]:
                self.deferred += 1
            elif digest[block] is not None and written[block]:
                keep.append(block)
            else:
                self._forget(block)
                self._free.append(block)
        if keep:
            self.retained.add_many(keep)  # in release order: the first released is evicted first

    def lease(self, block: int) -> None:
        """Mark an outstanding access. Only blocks someone holds can be leased."""
        if self.ref[block] == 0 and not self.leased[block]:
            raise LedgerError(f"block {block} is not held by anyone; it cannot be leased")
        self.leased[block] += 1

    def unlease(self, block: int) -> None:
        """End one access; a deferred block then completes its release."""
        n = self.leased[block] - 1
        if n < 0:
            raise InvariantError(f"block {block} unleased more often than leased")
        self.leased[block] = n
        if n == 0 and self.ref[block] == 0:
            self.deferred -= 1
            if self.digest[block] is not None and self.written[block]:
                self.retained.add(block)
            else:
                self._forget(block)
                self._free.append(block)

    def evict(self, block: int, kind: str = "evicted") -> None:
        """Evict one specific retained block; ``kind`` names the event ("cleared" for cache clearing)."""
        self.retained.remove(block)
        if kind == "evicted":
            self.evictions += 1
        self._forget(block, event=kind)
        self._free.append(block)

    def _forget(self, block: int, *, event: str = "removed") -> None:
        digest = self.digest[block]
        if digest is not None:
            if self.index.get(digest) == block:
                del self.index[digest]
                if self.on_event is not None:
                    self.on_event(event, block, digest, self.group[block])
            self.digest[block] = None
            self.group[block] = None
        if self._policy_forget is not None:  # also for anonymous blocks that were given a priority
            self._policy_forget(block)
        self.written[block] = False

    def drop_cache(self) -> int:
        """Evict every retained block ("cleared" events) and let the policy forget everything it
        remembers (priorities, expiry heaps). Returns the number of blocks evicted."""
        victims = self.retained.blocks()
        for block in victims:
            self.evict(block, kind="cleared")
        clear = getattr(self.retained, "clear", None)
        if clear is not None:
            clear()
        return len(victims)

    # ---- audit --------------------------------------------------------------------------------
    def free_blocks(self) -> list[int]:
        return list(self._free)

    def check(self) -> None:
        """Assert the pool's own invariants (O(total)); the ledger adds the per-sequence ones."""
        free = set(self._free)
        retained = set(self.retained.blocks())
        if len(free) != len(self._free):
            raise InvariantError("a block is on the free list twice")
        if len(retained) != len(self.retained):
            raise InvariantError("the eviction policy lists a block twice")
        if free & retained:
            raise InvariantError(f"blocks both free and retained: {sorted(free & retained)[:8]}")
        active = {b for b in range(self.num_blocks) if self.ref[b] > 0 or self.leased[b] > 0}
        if active & (free | retained):
            raise InvariantError("a referenced or leased block is also free or retained")
        if len(free) + len(active) + len(retained) != self.num_blocks:
            raise InvariantError(
                f"conservation broken: free {len(free)} + active {len(active)} + retained "
                f"{len(retained)} != total {self.num_blocks}"
            )
        deferred = sum(1 for b in range(self.num_blocks) if self.ref[b] == 0 and self.leased[b] > 0)
        if deferred != self.deferred:
            raise InvariantError(f"deferred count {self.deferred} != {deferred} blocks awaiting a lease")
        for block in free:
            if self.digest[block] is not None or self.group[block] is not None or self.written[block]:
                raise InvariantError(f"free block {block} still carries an identity")
        for block in retained:
            d = self.digest[block]
            if d is None or self.index.get(d) != block or not self.written[block]:
                raise InvariantError(f"retained block {block} is not a written, indexed entry")
        for d, block in self.index.items():
            if self.digest[block] != d:
                raise InvariantError(f"index entry for block {block} disagrees with the block")
