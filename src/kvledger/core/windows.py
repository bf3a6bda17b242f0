"""The KV cache groups of a hybrid model beyond its first: `KVLedger`'s collaborator for their block tables.

A hybrid model (Gemma 3, gpt-oss, Qwen2 / Ministral with ``layer_types``; Granite-4.0-H / Qwen3-Next with
Mamba-2 / gated-delta-net layers) splits its layers into KV cache groups of
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
  runs. The table keeps ``NULL_BLOCK`` in their place, so position p still lives in entry ``p // block_size``;
- a **state** group (Mamba-2, gated-delta-net) reserves one block per sequence, allocated by its first work and
  held, rewritten in place, until the sequence leaves (finish, preemption by recompute); a work must start where
  the state stands (``state_at``, the end of the last work) or at 0 (a fresh state). A swap-out's entry for it is
  that position, and `restore` takes the state back only to resume exactly there (else: recompute from 0).

With prefix caching, a group's block is indexed under the first group's digest of the same prompt block keyed by
the group (`core.groups.GroupLedger`'s keys) once its tokens are written (`register`); a block a sliding group drops
out of the window stays in the index as retained cache, as vLLM does. A prefix hit is the longest length every group
serves (`agreed`, with `core.groups.longest_hit`): a sliding group only needs the blocks its window still reads; a
state group needs a state cached at the hit's block boundary, and none is kept here (a state block is never indexed),
so a pool with a state group serves no hit and a request recomputes its prompt. A
hit block may be held by several sequences: its capacity is carried by exactly one holder, its owner (the one that
allocated it, or took it back from the retained cache), and passes to another holder when the owner lets go, so a
drop re-promises a block only when one really came back.

Forks (n > 1, beams) share the same way: a child holds every live block of its parent in every group (a full
group the whole prefix, a sliding group the blocks its window still reads) and is promised its own reservation per
group, as under full reservation each branch is charged its own allowance (a sliding group's is bounded by the
window, which the branch will hold alone once it diverges). A work writing into a block another sequence still
holds -- a partial tail -- first takes a copy from its own promise (`on_copy`: the ledger's copy-on-write queue,
run before the step); the last holder writes in place. The branches of one new request (``branches=n``) each
open their own tables here (with the same prefix hit): their prompt works may run in different steps (a token
budget splits them), and a sliding group's blocks one branch released cannot serve another that lags, so each
computes the prompt into its own window (the first group's prompt blocks stay shared, written alike by each).

Its law (`check`): per sequence and group, held (owned) + promised == reserved, no live block before the window;
every live block is owned once and referenced by each holder, and every holder holds it; a state group reserves
exactly one block, holds at most one, never shares it, and from its first work to its end holds it. Not yet kept here
(the ledger refuses them for a hybrid pool): speculative slots and tiers, and forks on a pool with state groups. A swap
moves each group's live blocks (`live_entries`) and `restore` puts them back at the entries the window reads.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ..errors import ConfigError, InvariantError, LedgerError
from .groups import NULL_BLOCK, KVCacheGroup, longest_hit
from .pool import BlockPool
from .promises import PromiseBook


@dataclass(slots=True)
class GroupSeq:
    """One sequence's tables in the groups after the first: per group, the table, how many leading entries are
    ``NULL_BLOCK``, the live blocks it owns, the blocks still promised, the reservation, the live blocks it holds
    without owning them (prefix hits others carry) and how many leading entries are in the prefix index."""

    limit: int
    prompt: int
    tables: list[list[int]]
    nulled: list[int]
    held: list[int]
    promised: list[int]
    reserved: list[int]
    window_from: int = 0  # the start of the last work the sliding groups dropped blocks for
    state_at: int = 0  # the tokens the state groups' states have taken in (the end of the last work)
    decoding: bool = False  # the prompt is computed: the sliding groups' bounds are the decode step's
    shared: list[int] | None = None
    registered: list[int] | None = None


class GroupTables:
    """See the module docstring. No lock: `KVLedger` takes its own around every call."""

    __slots__ = ("_hit", "_holders", "_keys", "_lazy", "_owner", "_state", "_windows", "block_size", "decode_tokens",
                 "groups", "on_copy", "pool", "prefix_caching", "promises", "seqs", "step_tokens", "total")

    def __init__(self, pool: BlockPool, promises: PromiseBook, groups: tuple[KVCacheGroup, ...], block_size: int,
                 step_tokens: int, decode_tokens: int = 1, prefix_caching: bool = False) -> None:
        if len(groups) < 2 or groups[0].kind != "full":
            raise ConfigError("a hybrid pool needs at least two KV cache groups, the first of full attention")
        self.pool, self.promises = pool, promises
        self.groups = tuple(groups)
        self._windows = [g.window or 0 for g in self.groups[1:]]  # per group after the first: its window, 0: full
        self._state = [g.kind == "state" for g in self.groups[1:]]  # per group after the first: a state group
        self.block_size, self.step_tokens, self.decode_tokens = block_size, step_tokens, decode_tokens
        self.seqs: dict[str, GroupSeq] = {}
        self.total = 0  # promised to the groups after the first (part of the PromiseBook's total)
        self.prefix_caching = prefix_caching
        self._keys = [bytes((i,)) for i in range(len(self.groups))]  # GroupLedger's: a digest keyed by group
        # Every live block's owner, and the holders of the blocks held by several sequences (hits, forks). Without
        # prefix caching only forks share blocks, so owners are written only then (``_lazy``): a live block `_owner`
        # does not name is owned by its one holder, and a pool that never forked keeps no per-block entries.
        self._lazy = not prefix_caching
        self._owner: dict[int, str] = {}
        self._holders: dict[int, list[str]] = {}
        self._hit: tuple[int, list[list[int]]] = (0, [])  # the last `agreed` hit, which `open` takes
        # (src, dst, slots): a shared block copied before a work writes into it (the ledger queues a CopyOp).
        self.on_copy: Callable[[int, int, int], None] | None = None

    def need(self, limit: int) -> int:
        """Blocks a sequence of ``limit`` tokens reserves in the groups after the first."""
        bs, step = self.block_size, self.step_tokens
        return sum(g.reserved_blocks(limit, bs, step) for g in self.groups[1:])

    def agreed(self, digests: Sequence[bytes], hits: list[int], prompt_len: int) -> int:
        """How many of the first group's leading prefix hits ``hits`` every group serves (written blocks only; the
        prompt's last token is always computed). Remembers each group's blocks for the `open` that follows."""
        bs, index, written, keys, state = self.block_size, self.pool.index, self.pool.written, self._keys, self._state
        limit = min(len(hits), (prompt_len - 1) // bs)

        def cached(g: int, j: int) -> int | None:
            if g == 0:
                b: int | None = hits[j]
            elif state[g - 1]:
                return None  # no state is cached at a block boundary: a state group serves no hit
            else:
                b = index.get(digests[j] + keys[g])
            return b if b is not None and written[b] else None

        hit, per_group = longest_hit(self.groups, cached, limit, bs)
        self._hit = (hit, per_group[1:])
        return hit

    @property
    def agreed_hit(self) -> int:
        """The blocks of the last `agreed` hit."""
        return self._hit[0]

    def forget_hit(self) -> None:
        """No hit for the next `open` (the admission read no cache)."""
        self._hit = (0, [])

    def open(self, seq_id: str, prompt: int, limit: int, hit: int = 0) -> None:
        """Promise a newly admitted sequence its reservation in every group after the first (the caller decided
        it fits, under the ledger's lock); with a prefix hit of ``hit`` blocks, take each group's hit blocks that
        `agreed` found (a block nobody holds is taken back from the retained cache and owned). The branches of
        one request each take the same hit: the caller forgets it (`forget_hit`) once they are open."""
        if seq_id in self.seqs:
            raise LedgerError(f"sequence {seq_id!r} already holds group tables")
        bs, step = self.block_size, self.step_tokens
        reserved = [g.reserved_blocks(limit, bs, step) for g in self.groups[1:]]
        n = len(reserved)
        gs = self.seqs[seq_id] = GroupSeq(limit, prompt, [[] for _ in range(n)], [0] * n, [0] * n, list(reserved),
                                          reserved, shared=[0] * n)
        blocks = sum(reserved)
        self.total += blocks
        self.promises.claim(blocks)
        if not self.prefix_caching:
            return
        gs.registered = [0] * n
        got, per_group = self._hit
        if not hit:
            return
        if got != hit:
            raise InvariantError(f"{seq_id!r}: a hit of {hit} blocks, the groups agreed on {got}")
        pool, owner, holders = self.pool, self._owner, self._holders
        for i, taken in enumerate(per_group):
            first = hit - len(taken)
            gs.tables[i] = [NULL_BLOCK] * first + taken
            gs.nulled[i] = first
            gs.registered[i] = hit
            for b in taken:
                if pool.ref[b] == 0:  # retained cache: this sequence carries it now
                    owner[b] = seq_id
                    gs.held[i] += 1
                    gs.promised[i] -= 1
                    self.total -= 1
                    self.promises.claim(-1)
                else:
                    holding = holders.get(b)
                    if holding is None:
                        holders[b] = [owner[b], seq_id]
                    else:
                        holding.append(seq_id)
                    gs.shared[i] += 1
            pool.share_many(taken)
        gs.window_from = hit * bs

    def register(self, seq_id: str, digests: Sequence[bytes], full: int) -> None:
        """The first ``full`` blocks' tokens are written: index each group's live blocks among them under the
        prompt block's digest keyed by the group (an identity already indexed keeps its block)."""
        gs = self.seqs.get(seq_id)
        if gs is None or gs.registered is None:
            return
        pool, keys = self.pool, self._keys
        full = min(full, len(digests))
        for i, table in enumerate(gs.tables):
            start = gs.registered[i]
            if start >= full or self._state[i]:  # a state block is rewritten every step: never a cache entry
                continue
            key = keys[i + 1]
            for j in range(start, min(full, len(table))):
                b = table[j]
                if b != NULL_BLOCK and pool.register(b, digests[j] + key):
                    pool.written[b] = True
            gs.registered[i] = full

    def _let_go(self, seq_id: str, gs: GroupSeq, i: int, blocks: list[int]) -> None:
        """Group ``i``'s ``blocks`` leave the sequence: an owned block re-promises its capacity only when it
        really comes back; one another sequence still holds passes to that holder."""
        owner, holders, seqs, pool = self._owner, self._holders, self.seqs, self.pool
        if self._lazy and not owner:  # nothing was ever shared (or it is all gone): every block is its own
            n = len(blocks)
            pool.release_many(blocks)
            gs.held[i] -= n
            gs.promised[i] += n
            self.total += n
            self.promises.claim(n)
            return
        mine = seq_id if self._lazy else None  # an unnamed block is owned by its one holder (see __init__)
        for b in blocks:
            holding = holders.get(b)
            if holding is not None:
                holding.remove(seq_id)
                if len(holding) == 1:
                    del holders[b]
            if owner.get(b, mine) == seq_id:
                gs.held[i] -= 1
                gs.promised[i] += 1
                if holding:
                    heir = owner[b] = holding[0]
                    hs = seqs[heir]
                    hs.held[i] += 1
                    hs.promised[i] -= 1
                    hs.shared[i] -= 1  # type: ignore[index]
                else:
                    owner.pop(b, None)
                    self.total += 1
                    self.promises.claim(1)
            else:
                gs.shared[i] -= 1  # type: ignore[index]
            pool.release(b)

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
        state = self._state
        if 0 < start != gs.state_at and True in state:
            raise LedgerError(f"{seq_id!r}: a work from {start}, but its state groups' states stand at "
                              f"{gs.state_at} (a state cannot go back: recompute from 0)")
        bs, pool, promises, holders = self.block_size, self.pool, self.promises, self._holders
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
                        self._let_go(seq_id, gs, i, drop)
                if shrink:
                    self._shrink(gs, i)
            if holders:  # a block another sequence still holds is copied before this work writes into it
                for j in range(start // bs, min(want, len(table))):
                    if table[j] in holders:
                        self._copy_on_write(seq_id, gs, i, j, start)
            grow = (1 if state[i] else want) - len(table)  # a state group: one block, whatever the length
            if grow > 0:
                if grow > promised[i]:
                    raise InvariantError(f"group {i + 1} of {seq_id!r} needs {grow} blocks beyond its reservation "
                                         f"({promised[i]} promised)")
                fresh = pool.allocate_many(grow)
                table.extend(fresh)
                if not self._lazy:
                    for b in fresh:
                        self._owner[b] = seq_id
                held[i] += grow
                promised[i] -= grow
                self.total -= grow
                promises.claim(-grow)
        if shrink:
            gs.decoding = True
        gs.window_from = start
        gs.state_at = end
        return tuple(tables)

    def _copy_on_write(self, seq_id: str, gs: GroupSeq, i: int, j: int, start: int) -> None:
        """Group ``i``'s entry ``j`` is shared and a work from ``start`` writes into it: a new block from the
        sequence's promise takes its place, with the positions before ``start`` copied (`on_copy`)."""
        table = gs.tables[i]
        src = table[j]
        if gs.promised[i] - (gs.shared[i] if gs.shared is not None else 0) < 0:
            raise InvariantError(f"group {i + 1} of {seq_id!r}: no promise left for a copy")
        self._let_go(seq_id, gs, i, [src])
        dst = table[j] = self.pool.allocate()
        if not self._lazy:
            self._owner[dst] = seq_id
        gs.held[i] += 1
        gs.promised[i] -= 1
        self.total -= 1
        self.promises.claim(-1)
        slots = start - j * self.block_size
        if slots > 0:
            if self.on_copy is None:
                raise InvariantError("a hybrid pool copied a shared block with nobody to run the copy")
            self.on_copy(src, dst, min(slots, self.block_size))

    def fork_need(self, parent_id: str) -> int:
        """Blocks a fork of ``parent_id`` is promised in the groups after the first: the parent's reservation in
        each (the child shares the parent's live blocks and may come to carry them)."""
        gs = self.seqs.get(parent_id)
        if gs is None:
            raise LedgerError(f"unknown sequence {parent_id!r}")
        self._refuse_state_fork()
        return sum(gs.reserved)

    def _refuse_state_fork(self) -> None:
        if True in self._state:  # a state is the sequence's own and never shared: a branch needs a copy of it
            raise LedgerError("forks, n > 1 and beams on a pool with state groups are not supported yet (a branch "
                              "would need its own copy of each state)")

    def promised_of(self, seq_id: str) -> int:
        """Blocks still promised to the sequence in the groups after the first (what dropping it gives back)."""
        gs = self.seqs.get(seq_id)
        return 0 if gs is None else sum(gs.promised)

    def fork(self, parent_id: str, child_id: str) -> None:
        """``child_id`` becomes a branch of ``parent_id`` (the caller decided `fork_need` fits, under the ledger's
        lock): it holds every live block of the parent in every group and is promised the parent's reservation."""
        if child_id in self.seqs:
            raise LedgerError(f"sequence {child_id!r} already holds group tables")
        parent = self.seqs.get(parent_id)
        if parent is None:
            raise LedgerError(f"unknown sequence {parent_id!r}")
        n = len(parent.tables)
        self._refuse_state_fork()
        child = self.seqs[child_id] = GroupSeq(
            parent.limit, parent.prompt, [[] for _ in range(n)], [0] * n, [0] * n, list(parent.reserved),
            list(parent.reserved), window_from=parent.window_from, state_at=parent.state_at,
            decoding=parent.decoding, shared=[0] * n, registered=None if parent.registered is None else [0] * n)
        blocks = sum(parent.reserved)
        self.total += blocks
        self.promises.claim(blocks)
        self._share(parent_id, parent, child_id, child)

    def _share(self, parent_id: str, parent: GroupSeq, child_id: str, child: GroupSeq) -> None:
        """``child`` (holding nothing) takes the parent's tables: every live block held by both."""
        pool, owner, holders = self.pool, self._owner, self._holders
        for i, table in enumerate(parent.tables):
            child.tables[i] = list(table)
            child.nulled[i] = parent.nulled[i]
            live = [b for b in table if b != NULL_BLOCK]
            for b in live:
                holding = holders.get(b)
                if holding is None:  # (unnamed: the parent, its one holder, owns it)
                    holders[b] = [owner.setdefault(b, parent_id), child_id]
                else:
                    holding.append(child_id)
            pool.share_many(live)
            child.shared[i] = len(live)  # type: ignore[index]
            if child.registered is not None and parent.registered is not None:
                child.registered[i] = parent.registered[i]
        child.window_from = parent.window_from

    def live_entries(self, seq_id: str) -> list[tuple[int, int, int]]:
        """``(group, entry, block)`` of every live block the sequence holds after the first group (``group`` 1
        for the second group): what a swap-out copies. A state group's entry is the token position its state
        stands at (`restore` takes the state back only to resume exactly there)."""
        gs = self.seqs.get(seq_id)
        if gs is None:
            return []
        state = self._state
        return [(i + 1, gs.state_at if state[i] else j, b) for i, table in enumerate(gs.tables)
                for j, b in enumerate(table) if b != NULL_BLOCK]

    def restore(self, seq_id: str, computed: int, host: dict[tuple[int, int], int]) -> list[tuple[int, int]] | None:
        """A swapped-out sequence is back with its first ``computed`` tokens readable: give every group the
        entries a query at ``computed`` reads (a sliding group its window's, a full group all), each either a
        prefix hit it took at admission or a new block (from its promise) filled from the host copy ``host[(group,
        entry)]``. Returns the ``(host slot, block)`` copies, or None when an entry is neither (or lies before
        the hits' window): then every group lets its blocks go and the caller recomputes from 0."""
        gs = self.seqs.get(seq_id)
        if gs is None:
            raise LedgerError(f"unknown sequence {seq_id!r}")
        bs = self.block_size
        last = -(-computed // bs)
        spans = []
        for i, group in enumerate(self.groups[1:]):
            table, first = gs.tables[i], group.first_needed(computed, bs)
            if self._state[i]:  # its one block, the state after exactly `computed` tokens (none before any)
                if computed and not table and (i + 1, computed) not in host:
                    self._empty(seq_id, gs)
                    return None
                spans.append(0)
                continue
            missing = first < gs.nulled[i] or any(
                not (j < len(table) and table[j] != NULL_BLOCK) and (i + 1, j) not in host for j in range(first, last))
            if missing:
                self._empty(seq_id, gs)
                return None
            spans.append(first)
        copies: list[tuple[int, int]] = []
        for i, first in enumerate(spans):
            table = gs.tables[i]
            if self._state[i]:
                if computed and not table:
                    copies.append((host[(i + 1, computed)], self._take_state(seq_id, gs, i)))
                continue
            if first > gs.nulled[i]:  # hits the window no longer reads
                lo, hi = gs.nulled[i], min(first, len(table))
                drop = [b for b in table[lo:hi] if b != NULL_BLOCK]
                table[lo:hi] = [NULL_BLOCK] * (hi - lo)
                if len(table) < first:
                    table.extend([NULL_BLOCK] * (first - len(table)))
                gs.nulled[i] = first
                if drop:
                    drop.reverse()
                    self._let_go(seq_id, gs, i, drop)
            grow = last - len(table)
            if grow > 0:
                if grow > gs.promised[i]:
                    raise InvariantError(f"group {i + 1} of {seq_id!r} needs {grow} blocks beyond its reservation")
                start = len(table)
                fresh = self.pool.allocate_many(grow)
                table.extend(fresh)
                if not self._lazy:
                    for b in fresh:
                        self._owner[b] = seq_id
                gs.held[i] += grow
                gs.promised[i] -= grow
                self.total -= grow
                self.promises.claim(-grow)
                copies.extend((host[(i + 1, start + k)], b) for k, b in enumerate(fresh))
        gs.window_from = gs.state_at = computed
        return copies

    def _take_state(self, seq_id: str, gs: GroupSeq, i: int) -> int:
        """State group ``i``'s one block, from the sequence's promise."""
        if gs.promised[i] < 1:
            raise InvariantError(f"state group {i + 1} of {seq_id!r} has no block promised")
        b = self.pool.allocate_many(1)[0]
        gs.tables[i].append(b)
        if self.prefix_caching:
            self._owner[b] = seq_id
        gs.held[i] += 1
        gs.promised[i] -= 1
        self.total -= 1
        self.promises.claim(-1)
        return b

    def _empty(self, seq_id: str, gs: GroupSeq) -> None:
        """Let every live block of the sequence's groups go (it computes from 0 again)."""
        for i, table in enumerate(gs.tables):
            self._let_go(seq_id, gs, i, [b for b in reversed(table) if b != NULL_BLOCK])
            table.clear()
            gs.nulled[i] = 0
            if gs.registered is not None:
                gs.registered[i] = 0
        gs.window_from = gs.state_at = 0

    def _shrink(self, gs: GroupSeq, i: int) -> None:
        """The prompt is computed: from now on a step computes at most ``decode_tokens``, so sliding group ``i``'s
        bound shrinks from the prefill chunk's to the decode step's (after the window's release: what it holds is
        within the new bound) and the difference is promised to nobody. Once per sequence."""
        bound = self.groups[i + 1].reserved_blocks(gs.limit, self.block_size, self.decode_tokens)
        shared = gs.shared[i] if gs.shared is not None else 0  # blocks whose capacity may yet pass to it
        spare = min(gs.reserved[i] - bound, gs.promised[i] - shared)
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
        gs = self.seqs.get(seq_id)
        if gs is None:
            return
        for i, table in enumerate(gs.tables):
            self._let_go(seq_id, gs, i, [b for b in reversed(table) if b != NULL_BLOCK])
        del self.seqs[seq_id]
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
                owned = sum(1 for b in live if self._owner.get(b, seq_id if self._lazy else None) == seq_id)
                if owned != gs.held[i] or len(live) - owned != (gs.shared[i] if gs.shared is not None else 0):
                    raise InvariantError(f"{seq_id!r} group {g}: {owned} of {len(live)} live blocks owned, held "
                                         f"says {gs.held[i]}")
                if gs.promised[i] < 0 or gs.held[i] + gs.promised[i] != gs.reserved[i]:
                    raise InvariantError(f"{seq_id!r} group {g}: held {gs.held[i]} + promised {gs.promised[i]} "
                                         f"!= reserved {gs.reserved[i]}")
                if group.kind == "sliding":
                    first = min(group.first_needed(gs.window_from, bs), len(table))
                    if any(b != NULL_BLOCK for b in table[:first]):
                        raise InvariantError(f"{seq_id!r} group {g}: a block before the window is still held")
                elif NULL_BLOCK in table:
                    raise InvariantError(f"{seq_id!r} group {g}: a {group.kind} group dropped a block")
                if group.kind == "state" and (gs.reserved[i] != 1 or len(table) > 1 or len(live) != owned
                                              or (gs.state_at and gs.held[i] != 1)):
                    # A state is fixed-size and the sequence's own: one block reserved, none shared, and from its
                    # first work to the sequence's end it holds it (a block handed back early is caught).
                    raise InvariantError(f"{seq_id!r} group {g}: a state group holds {len(table)} blocks "
                                         f"({owned} its own) of its {gs.reserved[i]} after {gs.state_at} tokens")
                for b in live:
                    refs[b] += 1
                promised += gs.promised[i]
        live_of = {sid: {b for table in gs.tables for b in table if b != NULL_BLOCK} for sid, gs in self.seqs.items()}
        every = set().union(*live_of.values())
        if not (set(self._owner) <= every if self._lazy else set(self._owner) == every):
            raise InvariantError("group blocks' owners disagree with the live blocks")
        holding_count: dict[int, int] = {}
        for blocks in live_of.values():
            for b in blocks:
                holding_count[b] = holding_count.get(b, 0) + 1
        if any(c > 1 and len(self._holders.get(b, ())) != c for b, c in holding_count.items()):
            raise InvariantError("a group block held by several sequences is not listed with its holders")
        for b, holding in self._holders.items():
            if len(holding) < 2 or self._owner.get(b) not in holding or len(set(holding)) != len(holding):
                raise InvariantError(f"group block {b}: holders {holding}, owner {self._owner.get(b)!r}")
            if any(b not in live_of.get(h, ()) for h in holding):
                raise InvariantError(f"group block {b}: a holder in {holding} does not hold it")
        if promised != self.total:
            raise InvariantError(f"groups' promises {self.total} != the sequences' {promised}")
        for seq_id in known:
            if seq_id not in self.seqs:
                raise InvariantError(f"sequence {seq_id!r} holds no group tables in a hybrid pool")


__all__ = ["GroupSeq", "GroupTables"]
