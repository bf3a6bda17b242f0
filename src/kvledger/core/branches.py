"""Branches: forks for parallel sampling and beam search, with copy-on-write partial tails.

A fork shares every block of its parent. Full blocks are immutable and stay shared for as long as both
branches live. The partial tail block is the only writable shared block: the first branch that writes
into it while another still holds it gets a private copy (a :class:`CopyOp` the runtime executes before
the write); the last holder writes in place. So a tail shared by k branches is copied at most k - 1
times, and exactly that many copies are promised when the fork happens: ``promises.copies[tail]`` always
equals ``ref[tail] - 1`` (checked by :meth:`KVLedger.check`).

Under full reservation each branch is charged its own output allowance, because any branch may diverge
at its next token and then needs its own blocks.

Speculative (lookahead) blocks beyond a parent's tokens are never shared: each branch writes its own
draft tokens there, so a child starts with the blocks covering the parent's tokens only and is
promised the rest of its reservation.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..errors import AdmissionError, ConfigError, LedgerError, OutOfBlocksError
from .table import BlockTable
from .types import CopyOp, SequenceState, show

if TYPE_CHECKING:
    from .ledger import KVLedger


class BranchOps:
    """Mixed into :class:`~kvledger.core.ledger.KVLedger`; runs under its lock."""

    def fork(self: KVLedger, parent_id: str, child_id: str) -> int:
        """Fork ``parent_id`` into a new sequence ``child_id``. Returns the blocks newly promised (the
        child's output allowance plus one tail copy if the tail is partial). Raises AdmissionError when
        the pool cannot promise them now: a fork is an admission of one more branch."""
        if type(child_id) is not str or not child_id:
            raise ConfigError(f"a branch id is a non-empty string, got {show(child_id)}")
        with self._lock:
            parent = self.sequence(parent_id)
            if child_id in self._seqs:
                raise LedgerError(f"request id {child_id!r} is already running")
            need = self._fork_need(parent)
            available = self.promises.unpromised()
            if need > available:
                raise AdmissionError(
                    f"cannot fork {parent_id!r}: the branch needs {need} blocks, {max(available, 0)} available")
            self._fork_unchecked(parent, child_id)
            return need

    def _fork_need(self: KVLedger, parent: SequenceState) -> int:
        """A child's promise (its reservation beyond the blocks covering the parent's tokens; the
        parent's speculative blocks are not shared) plus one copy of a partial tail."""
        covered = self._blocks_for(len(parent.tokens))
        return max(0, parent.reserved_blocks - covered) + (1 if len(parent.tokens) % self.block_size else 0)

    def _fork_unchecked(self: KVLedger, parent: SequenceState, child_id: str) -> None:
        covered = self._blocks_for(len(parent.tokens))
        blocks = parent.table.blocks[:covered]  # never the parent's speculative (draft) blocks
        self.pool.share_many(blocks)
        if len(parent.tokens) % self.block_size:
            tail = blocks[len(parent.tokens) // self.block_size]
            self.promises.promise_copies(tail)
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
            table=BlockTable(self.block_size, blocks), promised=0,
            digests=list(parent.digests), computed_mark=parent.computed_mark,
            written_blocks=parent.written_blocks, hit_blocks=parent.hit_blocks, cow_tail=cow,
            family=parent.family, retention=parent.retention, reserved_blocks=parent.reserved_blocks,
            readmitted=parent.readmitted,
        )
        self.promises.promise(child, promise)
        self._seqs[child_id] = child
        self.counters.forks += 1

    def _copy_on_write(self: KVLedger, seq: SequenceState, n: int) -> None:
        """Token ``n`` is about to be written into a tail block that may still be shared."""
        seq.cow_tail = False
        blocks = seq.table.blocks
        at = n // self.block_size
        tail = blocks[at]
        pool = self.pool
        if pool.ref[tail] == 1:
            return  # every sibling has copied away or left: write in place
        promises = self.promises
        if not promises.redeem_copy(tail) and promises.unpromised() <= 0:
            seq.cow_tail = True
            raise OutOfBlocksError(f"{seq.request_id!r} needs a copy of its shared tail and no block is left")
        copy = pool.allocate()
        blocks[at] = copy
        pool.release_many((tail,))
        op = CopyOp(tail, copy, n % self.block_size)
        self._copies.append(op)
        self.counters.copies += 1
        if self.events is not None:
            self.events.emit("copied", copy, None, seq.context.trust_group, source_block=tail)

    def beam_step(self: KVLedger, forks: list[tuple[str, str]], drops: list[str]) -> None:
        """One beam-search step: drop the pruned beams, then fork the survivors that spawn more than one
        continuation. Dropping releases only blocks no surviving beam holds (ref counts); a dropped
        beam's blocks that an in-flight step still reads stay until its lease ends."""
        if isinstance(forks, str) or isinstance(drops, str):
            raise ConfigError("beam_step takes (parent, child) pairs and a list of dropped ids, not a string")
        try:
            forks = [(p, c) for p, c in forks]
            drops = list(drops)
        except (TypeError, ValueError):
            raise ConfigError("beam_step takes (parent, child) pairs and a list of dropped ids") from None
        if any(type(x) is not str or not x for pair in forks for x in pair) or any(type(x) is not str for x in drops):
            raise ConfigError("beam_step: every branch id is a non-empty string")
        with self._lock:
            parents = {p for p, _ in forks}
            if parents & set(drops):
                raise LedgerError("a beam cannot both spawn a continuation and be dropped in one step")
            if len(set(drops)) != len(drops):
                raise LedgerError("a beam step names the same dropped beam twice")
            for rid in drops:
                self.sequence(rid)
            children = [c for _, c in forks]
            if len(set(children)) != len(children):
                raise LedgerError("a beam step names the same new branch twice")
            for parent, child in forks:
                self.sequence(parent)
                if child in self._seqs:
                    raise LedgerError(f"request id {child!r} is already running")
            # Decide before changing anything: the drops give back at least their promises.
            need = sum(self._fork_need(self._seqs[p]) for p, _ in forks)
            available = self.promises.unpromised() + sum(self._seqs[rid].promised for rid in drops)
            if need > available:
                raise AdmissionError(f"beam step needs {need} blocks for its forks, {max(available, 0)} available")
            for rid in drops:
                self._drop(rid)
            for parent, child in forks:
                self._fork_unchecked(self._seqs[parent], child)
