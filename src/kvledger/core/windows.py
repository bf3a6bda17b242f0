"""The KV cache groups of a hybrid model beyond its first: `KVLedger`'s collaborator for their block tables.

A hybrid model (Gemma 3, gpt-oss, Qwen2 / Ministral with ``layer_types``) splits its layers into KV cache groups of
one kind each (`core.sizing.hybrid.hybrid_plan`, vLLM's grouping); a block id of the pool holds one group's page.
`KVLedger` keeps the first group -- a full-attention group -- in the sequence's own table, with everything the
ledger does for it (admission, growth, forks, leases, the prefix index). `GroupTables` keeps the others, over the
same `BlockPool` and the same `PromiseBook`, with the arithmetic of `core.groups.KVCacheGroup` (the one owner of a
group's reservation and window):

- a sequence's reservation in a **sliding** group is bounded by its window (``ceil((W - 1 + step) / block) + 1``
  blocks, ``step`` the most tokens one step computes; the decode step's bound once the prompt is computed), in a
  further **full** group by its length; it is promised at admission, in the ledger's one decision;
- blocks are allocated when the scheduler plans a work (`tables`), from the sequence's own promise, so a promise
  always becomes a block without touching another sequence;
- before a work that starts at position n, a sliding group releases the blocks wholly before ``n - W + 1`` (the step
  that read them was confirmed) and its promise grows back by as many: the pool gets them back while the sequence
  runs. The table keeps ``NULL_BLOCK`` in their place, so position p still lives in entry ``p // block_size``.

Its law (`check`): per sequence and group, held + promised == reserved, held <= reserved, no live block before the
window; every live block is held once. Not yet kept here (the ledger refuses them for a hybrid pool): prefix hits in
these groups (so the ledger's prefix caching is off), forks and beams, speculative slots, tiers and swaps.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import ConfigError, InvariantError, LedgerError
from .groups import NULL_BLOCK, KVCacheGroup
from .pool import BlockPool
from .promises import PromiseBook


@dataclass(slots=True)
class GroupSeq:
    """One sequence's tables in the groups after the first: per group, the table, how many leading entries are
    ``NULL_BLOCK``, the live blocks, the blocks still promised and the reservation."""

    limit: int
    prompt: int
    tables: list[list[int]]
    nulled: list[int]
    held: list[int]
    promised: list[int]
    reserved: list[int]
    window_from: int = 0  # the start of the last work the sliding groups dropped blocks for
    decoding: bool = False  # the prompt is computed: the sliding groups' bounds are the decode step's


class GroupTables:
    """See the module docstring. No lock: `KVLedger` takes its own around every call."""

    __slots__ = ("_windows", "block_size", "decode_tokens", "groups", "pool", "promises", "seqs", "step_tokens",
                 "total")

    def __init__(self, pool: BlockPool, promises: PromiseBook, groups: tuple[KVCacheGroup, ...], block_size: int,
                 step_tokens: int, decode_tokens: int = 1) -> None:
        if len(groups) < 2 or groups[0].kind != "full":
            raise ConfigError("a hybrid pool needs at least two KV cache groups, the first of full attention")
        if any(g.kind == "state" for g in groups):
            raise ConfigError("state (linear attention / Mamba) groups are not kept by the scheduler's ledger yet")
        self.pool, self.promises = pool, promises
        self.groups = tuple(groups)
        self._windows = [g.window or 0 for g in self.groups[1:]]  # per group after the first: its window, 0: full
        self.block_size, self.step_tokens, self.decode_tokens = block_size, step_tokens, decode_tokens
        self.seqs: dict[str, GroupSeq] = {}
        self.total = 0  # promised to the groups after the first (part of the PromiseBook's total)

    def need(self, limit: int) -> int:
        """Blocks a sequence of ``limit`` tokens reserves in the groups after the first."""
        bs, step = self.block_size, self.step_tokens
        return sum(g.reserved_blocks(limit, bs, step) for g in self.groups[1:])

    def open(self, seq_id: str, prompt: int, limit: int) -> None:
        """Promise a newly admitted sequence its reservation in every group after the first (the caller decided
        it fits, under the ledger's lock)."""
        if seq_id in self.seqs:
            raise LedgerError(f"sequence {seq_id!r} already holds group tables")
        bs, step = self.block_size, self.step_tokens
        reserved = [g.reserved_blocks(limit, bs, step) for g in self.groups[1:]]
        n = len(reserved)
        self.seqs[seq_id] = GroupSeq(limit, prompt, [[] for _ in range(n)], [0] * n, [0] * n, list(reserved),
                                     reserved)
        blocks = sum(reserved)
        self.total += blocks
        self.promises.claim(blocks)

    def tables(self, seq_id: str, start: int, end: int) -> tuple[list[int], ...]:
        """The tables of a work computing positions ``[start, end)``: sliding groups first release what left the
        window, then every group allocates up to ``end`` from the sequence's promise. The ledger's own lists:
        read them, never change them. O(groups) a step, plus the blocks it releases or allocates."""
        gs = self.seqs.get(seq_id)
        if gs is None:
            raise LedgerError(f"unknown sequence {seq_id!r}")
        if not 0 <= start < end <= gs.limit or end - start > self.step_tokens:
            raise LedgerError(f"{seq_id!r}: a work over [{start}, {end}) is outside its reservation of {gs.limit} "
                              f"tokens or longer than a step's {self.step_tokens}")
        shrink = False
        if start >= gs.prompt:
            if end - start > self.decode_tokens:
                raise LedgerError(f"{seq_id!r}: a decode work of {end - start} tokens (at most {self.decode_tokens})")
            shrink = not gs.decoding
        bs, pool, promises = self.block_size, self.pool, self.promises
        want = -(-end // bs)
        tables, nulled, held, promised = gs.tables, gs.nulled, gs.held, gs.promised
        for i, window in enumerate(self._windows):
            table = tables[i]
            if window:
                first = max(0, start - window + 1) // bs
                if first > len(table):
                    first = len(table)
                lo = nulled[i]
                if first > lo:  # only the entries that left the window since the last work
                    drop = [b for b in table[lo:first] if b != NULL_BLOCK]
                    table[lo:first] = [NULL_BLOCK] * (first - lo)
                    nulled[i] = first
                    if drop:
                        drop.reverse()
                        pool.release_many(drop)
                        n = len(drop)
                        held[i] -= n
                        promised[i] += n
                        self.total += n
                        promises.claim(n)
                if shrink:
                    self._shrink(gs, i)
            grow = want - len(table)
            if grow > 0:
                if grow > promised[i]:
                    raise InvariantError(f"group {i + 1} of {seq_id!r} needs {grow} blocks beyond its reservation "
                                         f"({promised[i]} promised)")
                table.extend(pool.allocate_many(grow))
                held[i] += grow
                promised[i] -= grow
                self.total -= grow
                promises.claim(-grow)
        if shrink:
            gs.decoding = True
        gs.window_from = start
        return tuple(tables)

    def _shrink(self, gs: GroupSeq, i: int) -> None:
        """The prompt is computed: from now on a step computes at most ``decode_tokens``, so sliding group ``i``'s
        bound shrinks from the prefill chunk's to the decode step's (after the window's release: what it holds is
        within the new bound) and the difference is promised to nobody. Once per sequence."""
        bound = self.groups[i + 1].reserved_blocks(gs.limit, self.block_size, self.decode_tokens)
        spare = min(gs.reserved[i] - bound, gs.promised[i])
        if spare > 0:
            gs.reserved[i] -= spare
            gs.promised[i] -= spare
            self.total -= spare
            self.promises.claim(-spare)

    def live(self, seq_id: str) -> list[int]:
        """The blocks the sequence holds in the groups after the first (what a step's lease must cover)."""
        gs = self.seqs.get(seq_id)
        if gs is None:
            return []
        return [b for table in gs.tables for b in table if b != NULL_BLOCK]

    def close(self, seq_id: str) -> None:
        """The sequence left (finished, preempted, cancelled): its blocks return, tail first, its promises end."""
        gs = self.seqs.pop(seq_id, None)
        if gs is None:
            return
        for table in gs.tables:
            live = [b for b in reversed(table) if b != NULL_BLOCK]
            if live:
                self.pool.release_many(live)
        promised = sum(gs.promised)
        self.total -= promised
        self.promises.claim(-promised)

    def held_by_group(self) -> list[int]:
        """Live blocks per group after the first, over every sequence."""
        return [sum(gs.held[i] for gs in self.seqs.values()) for i in range(len(self.groups) - 1)]

    def check(self, known: set[str] | dict, refs: list[int]) -> None:
        """Each group's law (see the module docstring); adds the live blocks to ``refs``."""
        promised = 0
        bs = self.block_size
        for seq_id, gs in self.seqs.items():
            if seq_id not in known:
                raise InvariantError(f"group tables of {seq_id!r}, which the ledger does not hold")
            for i, group in enumerate(self.groups[1:]):
                table = gs.tables[i]
                live = [b for b in table if b != NULL_BLOCK]
                g = i + 1
                if len(live) != gs.held[i]:
                    raise InvariantError(f"{seq_id!r} group {g}: {len(live)} live blocks, held says {gs.held[i]}")
                if gs.promised[i] < 0 or gs.held[i] + gs.promised[i] != gs.reserved[i]:
                    raise InvariantError(f"{seq_id!r} group {g}: held {gs.held[i]} + promised {gs.promised[i]} "
                                         f"!= reserved {gs.reserved[i]}")
                if group.kind == "sliding":
                    first = min(group.first_needed(gs.window_from, bs), len(table))
                    if any(b != NULL_BLOCK for b in table[:first]):
                        raise InvariantError(f"{seq_id!r} group {g}: a block before the window is still held")
                elif NULL_BLOCK in table:
                    raise InvariantError(f"{seq_id!r} group {g}: a full group dropped a block")
                for b in live:
                    refs[b] += 1
                promised += gs.promised[i]
        if promised != self.total:
            raise InvariantError(f"groups' promises {self.total} != the sequences' {promised}")
        for seq_id in known:
            if seq_id not in self.seqs:
                raise InvariantError(f"sequence {seq_id!r} holds no group tables in a hybrid pool")


__all__ = ["GroupSeq", "GroupTables"]
