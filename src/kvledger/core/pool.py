"""The block pool: every physical block of one managed KV pool, each in exactly one state.

    free      ref == 0, no identity, on the free list
    active    ref >= 1, held by one or more block tables (possibly shared)
    retained  ref == 0, still indexed by its digest, evictable (an idle cache entry)

Conservation law (checked by :meth:`BlockPool.check`): ``free + active + retained == total``.
Ledger operations are O(1): per-block facts live in flat lists indexed by block id, the free list is a
stack, and retained blocks are ordered by an :class:`~kvledger.core.eviction.EvictionPolicy`.

The pool is not thread-safe by itself; :class:`~kvledger.core.ledger.KVLedger` serialises access.
"""

from __future__ import annotations

from collections.abc import Callable

from ..errors import InvariantError, OutOfBlocksError
from .eviction import EvictionPolicy, LRUPolicy

EvictHook = Callable[[int, bytes], None]


class BlockPool:
    __slots__ = ("num_blocks", "ref", "digest", "written", "_free", "retained", "index", "on_evict")

    def __init__(self, num_blocks: int, policy: EvictionPolicy | None = None) -> None:
        if num_blocks <= 0:
            raise ValueError("a pool needs at least one block")
        self.num_blocks = num_blocks
        self.ref: list[int] = [0] * num_blocks
        self.digest: list[bytes | None] = [None] * num_blocks
        # A block is `written` once every token slot in it holds computed KV. An indexed block that is
        # not yet written is *pending*: others may share it, but must not read it before it is written.
        self.written: list[bool] = [False] * num_blocks
        # Pop from the end: block 0 is handed out first, which keeps small demos readable.
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self.retained: EvictionPolicy = policy if policy is not None else LRUPolicy()
        self.index: dict[bytes, int] = {}
        self.on_evict: EvictHook | None = None

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
        if self._free:
            block = self._free.pop()
        elif len(self.retained):
            block = self.retained.pop_victim()
            self._forget(block, evicted=True)  # the block goes straight to its new owner
        else:
            raise OutOfBlocksError("no free or evictable block left in the pool")
        self.ref[block] = 1
        return block

    def allocate_many(self, n: int) -> list[int]:
        """``n`` blocks at once (admission's prompt blocks); same rules as :meth:`allocate`."""
        free = self._free
        take = min(n, len(free))
        blocks = free[len(free) - take :]
        del free[len(free) - take :]
        blocks.reverse()
        if take < n:
            if n - take > len(self.retained):
                free.extend(reversed(blocks))
                raise OutOfBlocksError("no free or evictable block left in the pool")
            # Inlined _forget: this loop runs once per block whenever the pool is full of cache.
            index, digest, written = self.index, self.digest, self.written
            hook = self.on_evict
            for block in self.retained.pop_victims(n - take):
                d = digest[block]
                del index[d]  # a retained block is always its digest's canonical entry
                digest[block] = None
                written[block] = False
                if hook is not None:
                    hook(block, d)  # type: ignore[arg-type]
                blocks.append(block)
        ref = self.ref
        for block in blocks:
            ref[block] = 1
        return blocks

    def share(self, block: int) -> None:
        """Take one more reference on an indexed block: retained -> active, or active ref += 1."""
        if self.ref[block] == 0:
            self.retained.remove(block)
        self.ref[block] += 1

    def register(self, block: int, digest: bytes) -> bool:
        """Index ``block`` under ``digest``. If another block already holds that identity the first one
        stays canonical and this block stays anonymous (it is freed, not retained, on release)."""
        if digest in self.index:
            return False
        self.index[digest] = block
        self.digest[block] = digest
        return True

    def release(self, block: int) -> None:
        """Drop one reference; at zero a written, indexed block is retained, anything else is freed."""
        ref = self.ref[block] - 1
        if ref < 0:
            raise InvariantError(f"block {block} released more often than it was taken")
        self.ref[block] = ref
        if ref:
            return
        if self.digest[block] is not None and self.written[block]:
            self.retained.add(block)
        else:
            self._forget(block, evicted=False)
            self._free.append(block)

    def release_many(self, blocks: list[int]) -> None:
        """:meth:`release` for each block, in the given order (the hot path of finishing a request)."""
        ref, digest, written = self.ref, self.digest, self.written
        keep: list[int] = []
        for block in blocks:
            r = ref[block] - 1
            if r > 0:
                ref[block] = r
                continue
            if r < 0:
                raise InvariantError(f"block {block} released more often than it was taken")
            ref[block] = 0
            if digest[block] is not None and written[block]:
                keep.append(block)
            else:
                self._forget(block, evicted=False)
                self._free.append(block)
        if keep:
            self.retained.add_many(keep)  # in release order: the first released is evicted first

    def evict(self, block: int) -> None:
        """Evict one specific retained block (used by explicit cache clearing)."""
        self.retained.remove(block)
        self._forget(block, evicted=True)
        self._free.append(block)

    def _forget(self, block: int, *, evicted: bool) -> None:
        digest = self.digest[block]
        if digest is not None:
            if self.index.get(digest) == block:
                del self.index[digest]
            self.digest[block] = None
            if evicted and self.on_evict is not None:
                self.on_evict(block, digest)
        self.written[block] = False

    # ---- audit --------------------------------------------------------------------------------
    def free_blocks(self) -> list[int]:
        return list(self._free)

    def check(self) -> None:
        """Assert the pool's own invariants (O(total)); the ledger adds the per-sequence ones."""
        free = set(self._free)
        retained = set(self.retained.blocks())
        if len(free) != len(self._free):
            raise InvariantError("a block is on the free list twice")
        if free & retained:
            raise InvariantError(f"blocks both free and retained: {sorted(free & retained)[:8]}")
        active = {b for b in range(self.num_blocks) if self.ref[b] > 0}
        if active & (free | retained):
            raise InvariantError("a referenced block is also free or retained")
        if len(free) + len(active) + len(retained) != self.num_blocks:
            raise InvariantError(
                f"conservation broken: free {len(free)} + active {len(active)} + retained "
                f"{len(retained)} != total {self.num_blocks}"
            )
        for block in free:
            if self.digest[block] is not None or self.written[block]:
                raise InvariantError(f"free block {block} still carries an identity")
        for block in retained:
            d = self.digest[block]
            if d is None or self.index.get(d) != block or not self.written[block]:
                raise InvariantError(f"retained block {block} is not a written, indexed entry")
        for d, block in self.index.items():
            if self.digest[block] != d:
                raise InvariantError(f"index entry for block {block} disagrees with the block")
