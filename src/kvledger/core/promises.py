"""The promise book: blocks promised but not yet materialised, and the one rule that bounds them.

A promise is a claim on capacity, not a block: a running sequence is promised the blocks its reserved
output allowance still lacks (``SequenceState.promised``), and a partial tail shared by ``k`` branches
carries ``k - 1`` promised copy-on-write copies (:attr:`PromiseBook.copies`). The book is the only
writer of both, and of their sum :attr:`PromiseBook.total`.

The promise rule: ``total <= free + evictable``. Every decision that hands out capacity asks
:meth:`PromiseBook.unpromised` (``free + evictable - total``) -- admission, forks, growth past a
reservation, lookahead, pins and promotions from lower tiers -- so the rule is written once, here.

What a request declares -- every branch's whole output allowance and speculative slots, the prompt's full
blocks shared once -- is :func:`declared_blocks`; :func:`largest_allowance` inverts it: the largest output
allowance whose declaration fits a given number of blocks (the whole pool, a trust group's quota). Both are
pure arithmetic, the one statement of that charge for the ledger's "never" rule, the fleet's ingress and
the server's default ``max_tokens``.

The book has no lock of its own: the :class:`~kvledger.core.ledger.KVLedger` that owns it calls it under
the ledger's lock. Every operation is O(1).
"""

from __future__ import annotations

from ..errors import InvariantError
from .pool import BlockPool
from .types import SequenceState


def declared_blocks(prompt_len: int, max_new_tokens: int, block_size: int, branches: int = 1,
                    lookahead: int = 0) -> int:
    """Blocks a request declares under full reservation: its longest branch covers the prompt, the whole
    output allowance and the speculative slots, and every other branch adds its own blocks past the
    prompt's full blocks (a partial prompt tail is copied on write, so each branch pays for it)."""
    longest = -(-(prompt_len + max_new_tokens + lookahead) // block_size)
    return longest + (branches - 1) * (longest - prompt_len // block_size)


def largest_allowance(prompt_len: int, limit_blocks: int, block_size: int, branches: int = 1,
                      lookahead: int = 0) -> int:
    """The largest ``max_new_tokens`` whose :func:`declared_blocks` is at most ``limit_blocks``; 0 when
    not even one token fits. O(1): ``declared_blocks`` is ``longest * branches`` less a constant, so the
    longest branch may cover ``(limit + (branches - 1) * full_prompt_blocks) // branches`` blocks."""
    longest = (limit_blocks + (branches - 1) * (prompt_len // block_size)) // branches
    return max(longest * block_size - prompt_len - lookahead, 0)


class PromiseBook:
    """``total == sum(seq.promised) + sum(copies.values())`` and ``total <= free + evictable``."""

    __slots__ = ("_pool", "copies", "total")

    def __init__(self, pool: BlockPool) -> None:
        self._pool = pool
        self.total = 0
        # shared partial tail block -> copy-on-write copies still promised for it (== its ref count - 1)
        self.copies: dict[int, int] = {}

    # ---- the rule -------------------------------------------------------------------------------
    def unpromised(self) -> int:
        """Blocks nobody was promised: what a new claim on capacity may take (negative never happens
        while the rule holds)."""
        pool = self._pool
        return pool.num_free + pool.num_evictable - self.total

    def room(self, retained_hits: int = 0, keep_free: int = 0) -> tuple[int, str]:
        """What an admission may promise now -- the unpromised blocks less the admission's own retained
        prefix hits (they stop being evictable once taken) and the blocks its caller keeps free -- and
        the operator's explanation of that figure."""
        pool = self._pool
        free, evictable, total = pool.num_free, pool.num_evictable, self.total  # read once: asked every step
        available = free + evictable - total - retained_hits - keep_free
        detail = (f"{max(available, 0)} can be promised now ({free} free + {evictable} evictable - {total} promised"
                  + (f" - {retained_hits} own hits" if retained_hits else "")
                  + (f" - {keep_free} kept free" if keep_free else "") + ")")
        return available, detail

    # ---- a sequence's reserved allowance ----------------------------------------------------------
    def promise(self, seq: SequenceState, blocks: int) -> None:
        """Promise ``seq`` ``blocks`` more of its reservation (admission, a fork, a trimmed draft)."""
        seq.promised += blocks
        self.total += blocks

    def redeem(self, seq: SequenceState) -> bool:
        """One block of ``seq`` materialises: from its promise if it has one (True), else it must come
        from unpromised capacity, which the caller checked (False)."""
        if seq.promised:
            seq.promised -= 1
            self.total -= 1
            return True
        return False

    def redeem_each(self, seqs: list[SequenceState]) -> None:
        """One block of each of ``seqs`` materialises from its promise (each was promised one: the caller
        checked) -- a decode step's block openings, in one call."""
        for seq in seqs:
            seq.promised -= 1
        self.total -= len(seqs)

    def cancel(self, seq: SequenceState) -> None:
        """``seq`` leaves: whatever it was still promised goes back to the pool."""
        self.total -= seq.promised
        seq.promised = 0

    def claim(self, blocks: int) -> None:
        """Blocks promised (or, negative, given back) in the KV cache groups after a hybrid model's first:
        `core.windows.GroupTables` keeps their split per sequence and group."""
        self.total += blocks

    # ---- copy-on-write copies of shared partial tails ---------------------------------------------
    def promise_copies(self, tail: int, copies: int = 1) -> None:
        """``copies`` more holders share the partial tail block ``tail``: each may need its own copy."""
        self.copies[tail] = self.copies.get(tail, 0) + copies
        self.total += copies

    def redeem_copy(self, tail: int) -> bool:
        """One holder of ``tail`` copies it away, or leaves without copying: one promised copy fewer.
        False when none was promised (the copy must then come from unpromised capacity)."""
        promised = self.copies.get(tail, 0)
        if not promised:
            return False
        if promised == 1:
            del self.copies[tail]
        else:
            self.copies[tail] = promised - 1
        self.total -= 1
        return True

    # ---- audit ----------------------------------------------------------------------------------
    def check(self, sequence_promises: int) -> None:
        """The book's law, given the sum of the sequences' promises (the ledger walks them once for
        every audit): a shared tail carries one promised copy per holder beyond the first (pins
        included), the total is the sequences' promises plus the copies, and the pool can back every
        promise."""
        pool = self._pool
        ref = pool.ref
        for block, count in self.copies.items():
            if count <= 0 or count != ref[block] - 1:
                raise InvariantError(f"shared tail {block}: {count} copy promises for ref {ref[block]}")
        promised = sequence_promises + sum(self.copies.values())
        if promised != self.total:
            raise InvariantError(f"promise ledger {self.total} != sequence and copy promises {promised}")
        if self.total > pool.num_free + pool.num_evictable:
            raise InvariantError(
                f"overcommitted: {self.total} promised > {pool.num_free} free + {pool.num_evictable} evictable")
