"""Branches: forks for parallel sampling and beam search, with copy-on-write partial tails.

A fork shares every block of its parent. Full blocks are immutable and stay shared for as long as both
branches live. The partial tail block is the only writable shared block: the first branch that writes
into it while another still holds it gets a private copy (a :class:`CopyOp` the runtime executes before
the write); the last holder writes in place. So a tail shared by k branches is copied at most k - 1
times, and exactly that many copies are promised when the fork happens: ``promises.copies[tail]`` always
equals ``ref[tail] - 1`` (checked by ``KVLedger.check``). The copies not yet taken by the runtime wait
in :class:`Branches`'s queue.

Under full reservation each branch is charged its own output allowance, because any branch may diverge
at its next token and then needs its own blocks.

Speculative (lookahead) blocks beyond a parent's tokens are never shared: each branch writes its own
draft tokens there, so a child starts with the blocks covering the parent's tokens only and is
promised the rest of its reservation.

:class:`Branches` is a collaborator of :class:`~kvledger.core.ledger.KVLedger`: it owns the copy queue and
runs under the ledger's lock. On a hybrid pool (``groups``, `core.windows.GroupTables`) a fork also shares the
other KV cache groups' live blocks and promises the child its reservation there, in the same decision.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from ..errors import AdmissionError, ConfigError, LedgerError, OutOfBlocksError
from .observe import Counters, EventLog
from .pool import BlockPool
from .promises import PromiseBook
from .table import BlockTable
from .types import CopyOp, SequenceState, find_sequence, show

if TYPE_CHECKING:
    from .windows import GroupTables


class Branches:
    """Forks, beam steps and copy-on-write for one ledger's sequences; owns the copies the runtime has
    not taken yet. It holds nothing of the ledger's own: a beam step is handed the ledger's release of one
    sequence for the call (kept here it would make every ledger a reference cycle, freed only by the
    cyclic garbage collector, whose pauses then grow with every dropped ledger)."""

    __slots__ = ("_block_size", "_counters", "_events", "_pool", "_promises", "_seqs", "copies", "groups")

    def __init__(self, *, pool: BlockPool, promises: PromiseBook, seqs: dict[str, SequenceState],
                 counters: Counters, block_size: int, events: EventLog | None) -> None:
        self._pool = pool
        self._promises = promises
        self._seqs = seqs
        self._counters = counters
        self._block_size = block_size
        self._events = events
        self.copies: list[CopyOp] = []  # copy instructions the runtime has not taken yet
        self.groups: GroupTables | None = None  # a hybrid pool's groups after the first (set by the ledger)

    def take_copies(self) -> list[CopyOp]:
        copies, self.copies = self.copies, []
        return copies

    def forget_copies_into(self, blocks: list[int]) -> None:
        """``blocks`` are about to be released: a copy into one of them must never run."""
        mine = set(blocks)
        self.copies = [op for op in self.copies if op.dst not in mine]

    def fork(self, parent_id: str, child_id: str) -> int:
        """See ``KVLedger.fork``."""
        if type(child_id) is not str or not child_id:
            raise ConfigError(f"a branch id is a non-empty string, got {show(child_id)}")
        parent = find_sequence(self._seqs, parent_id)
        if child_id in self._seqs:
            raise LedgerError(f"request id {child_id!r} is already running")
        need = self._fork_need(parent)
        available = self._promises.unpromised()
        if need > available:
            raise AdmissionError(
                f"cannot fork {parent_id!r}: the branch needs {need} blocks, {max(available, 0)} available")
        self._fork_unchecked(parent, child_id)
        return need

    def _fork_need(self, parent: SequenceState) -> int:
        """A child's promise (its reservation beyond the blocks covering the parent's tokens; the
        parent's speculative blocks are not shared) plus one copy of a partial tail."""
        covered = -(-len(parent.tokens) // self._block_size)
        need = max(0, parent.reserved_blocks - covered) + (1 if len(parent.tokens) % self._block_size else 0)
        return need if self.groups is None else need + self.groups.fork_need(parent.request_id)

    def _fork_unchecked(self, parent: SequenceState, child_id: str) -> None:
        bs = self._block_size
        covered = -(-len(parent.tokens) // bs)
        blocks = parent.table.blocks[:covered]  # never the parent's speculative (draft) blocks
        self._pool.share_many(blocks)
        if len(parent.tokens) % bs:
            tail = blocks[len(parent.tokens) // bs]
            self._promises.promise_copies(tail)
            parent.cow_tail = True
            # Draft slots the parent reserved in this tail are shared now: they must be reserved again
            # (reserve_lookahead copies the tail first) before a step may write them.
            parent.draft_end = 0
            cow = True
        else:
            cow = False
        promise = max(0, parent.reserved_blocks - covered)
        child = SequenceState(
            request_id=child_id, context=parent.context, root=parent.root, tokens=list(parent.tokens),
            num_prompt=parent.num_prompt, max_new_tokens=parent.max_new_tokens,
            table=BlockTable(bs, blocks), promised=0,
            digests=list(parent.digests), computed_mark=parent.computed_mark,
            written_blocks=parent.written_blocks, hit_blocks=parent.hit_blocks, cow_tail=cow,
            family=parent.family, retention=parent.retention, reserved_blocks=parent.reserved_blocks,
            readmitted=parent.readmitted, mm_items=parent.mm_items,
        )
        self._promises.promise(child, promise)
        self._seqs[child_id] = child
        if self.groups is not None:
            self.groups.fork(parent.request_id, child_id)
        self._counters.forks += 1

    def copy_on_write(self, seq: SequenceState, n: int) -> None:
        """Token ``n`` is about to be written into a tail block that may still be shared."""
        seq.cow_tail = False
        blocks = seq.table.blocks
        at = n // self._block_size
        tail = blocks[at]
        pool = self._pool
        if pool.ref[tail] == 1:
            return  # every sibling has copied away or left: write in place
        promises = self._promises
        if not promises.redeem_copy(tail) and promises.unpromised() <= 0:
            seq.cow_tail = True
            raise OutOfBlocksError(f"{seq.request_id!r} needs a copy of its shared tail and no block is left")
        copy = pool.allocate()
        blocks[at] = copy
        pool.release_many((tail,))
        self.copies.append(CopyOp(tail, copy, n % self._block_size))
        self._counters.copies += 1
        if self._events is not None:
            self._events.emit("copied", copy, None, seq.context.trust_group, source_block=tail)

    def beam_step(self, forks: list[tuple[str, str]], drops: list[str],
                  drop: Callable[[str], SequenceState]) -> None:
        """See ``KVLedger.beam_step``; ``forks`` and ``drops`` are checked for their kinds by the caller."""
        seqs = self._seqs
        parents = {p for p, _ in forks}
        if parents & set(drops):
            raise LedgerError("a beam cannot both spawn a continuation and be dropped in one step")
        if len(set(drops)) != len(drops):
            raise LedgerError("a beam step names the same dropped beam twice")
        for rid in drops:
            find_sequence(seqs, rid)
        children = [c for _, c in forks]
        if len(set(children)) != len(children):
            raise LedgerError("a beam step names the same new branch twice")
        for parent, child in forks:
            find_sequence(seqs, parent)
            if child in seqs:
                raise LedgerError(f"request id {child!r} is already running")
        # Decide before changing anything: the drops give back at least their promises.
        need = sum(self._fork_need(seqs[p]) for p, _ in forks)
        available = self._promises.unpromised() + sum(seqs[rid].promised for rid in drops)
        if self.groups is not None:
            available += sum(self.groups.promised_of(rid) for rid in drops)
        if need > available:
            raise AdmissionError(f"beam step needs {need} blocks for its forks, {max(available, 0)} available")
        for rid in drops:
            drop(rid)
        for parent, child in forks:
            self._fork_unchecked(seqs[parent], child)


def beam_arguments(forks: object, drops: object) -> tuple[list[tuple[str, str]], list[str]]:
    """A beam step's arguments as lists, checked for their kinds."""
    if isinstance(forks, str) or isinstance(drops, str):
        raise ConfigError("beam_step takes (parent, child) pairs and a list of dropped ids, not a string")
    try:
        pairs = [(p, c) for p, c in forks]  # type: ignore[attr-defined]
        dropped = list(drops)  # type: ignore[call-overload]
    except (TypeError, ValueError):
        raise ConfigError("beam_step takes (parent, child) pairs and a list of dropped ids") from None
    if any(type(x) is not str or not x for pair in pairs for x in pair) or any(type(x) is not str for x in dropped):
        raise ConfigError("beam_step: every branch id is a non-empty string")
    return pairs, dropped


__all__ = ["Branches", "beam_arguments"]
