"""The block pool (``core/pool.py``, exported as ``kvledger.core.BlockPool``): registering identities,
leases, eviction counting, the allocations it refuses and its audit's exact messages."""

from __future__ import annotations

from collections import OrderedDict

import pytest

from kvledger.core import BlockPool, native
from kvledger.core.eviction import PriorityPolicy
from kvledger.core.observe import EventLog
from kvledger.errors import InvariantError, LedgerError, OutOfBlocksError


def _pool_with_cache() -> BlockPool:
    """Twelve blocks: 0..9 retained (written, indexed), 10 and 11 freed (anonymous). The policy keeps its
    state in Python (not the C part), so that a test can corrupt it."""
    saved, native.MODULE = native.MODULE, None
    try:
        policy = PriorityPolicy(clock=lambda: 0.0)
    finally:
        native.MODULE = saved
    pool = BlockPool(12, policy)
    blocks = pool.allocate_many(12)
    assert blocks == list(range(12))
    for b in blocks[:10]:
        pool.register(b, bytes([b]) * 8)
        pool.written[b] = True
    pool.release_many(blocks)
    pool.check()
    assert pool.num_retained == 10 and pool.free_blocks() == [10, 11]
    return pool


def _duplicate_in_priority_policy(pool: BlockPool) -> None:
    policy = pool.retained
    policy._levels.setdefault(7, OrderedDict())[3] = None  # type: ignore[attr-defined]
    policy._count += 1  # type: ignore[attr-defined]


def test_the_block_pool_registers_an_identity_once_and_says_whether_it_did() -> None:
    """BlockPool is exported (kvledger.core): register returns whether the block became canonical."""
    pool = BlockPool(3)
    a, b = pool.allocate(), pool.allocate()
    assert pool.register(a, b"d1", "g") is True
    assert pool.register(b, b"d1", "g") is False  # another block holds it: b stays anonymous
    assert pool.index == {b"d1": a} and pool.digest[b] is None
    assert pool.register(b, b"d2") is True


def test_the_block_pool_refuses_to_lease_a_block_nobody_holds() -> None:
    pool = BlockPool(2)
    with pytest.raises(LedgerError) as exc:
        pool.lease(1)
    assert str(exc.value) == "block 1 is not held by anyone; it cannot be leased"


def test_the_block_pool_counts_an_eviction_by_default_but_not_a_clearing() -> None:
    events = EventLog()
    pool = BlockPool(3)
    pool.on_event = events.emit
    blocks = pool.allocate_many(3)
    for i, block in enumerate(blocks):
        pool.register(block, bytes([i]))
        pool.written[block] = True
    pool.release_many(blocks)
    assert pool.num_retained == 3
    pool.evict(blocks[0])
    assert pool.evictions == 1
    pool.evict(blocks[1], kind="cleared")
    pool.evict(blocks[2])
    assert pool.evictions == 2 and pool.num_free == 3
    assert [e.kind for e in events.all()][-3:] == ["evicted", "cleared", "evicted"]
    pool.check()


@pytest.mark.parametrize(("corrupt", "message"), [
    (lambda p: p._free.append(10), "a block is on the free list twice"),
    (_duplicate_in_priority_policy, "the eviction policy lists a block twice"),
    (lambda p: p._free.extend(range(1, 10)), "blocks both free and retained: [1, 2, 3, 4, 5, 6, 7, 8]"),
    (lambda p: p.ref.__setitem__(11, 1), "a referenced or leased block is also free or retained"),
    (lambda p: p.leased.__setitem__(4, 1), "a referenced or leased block is also free or retained"),
])
def test_the_pool_audit_says_exactly_what_is_broken(corrupt, message: str) -> None:
    """The operator reads these lines when check() fails: the first eight offending blocks at most."""
    pool = _pool_with_cache()
    corrupt(pool)
    with pytest.raises(InvariantError) as exc:
        pool.check()
    assert str(exc.value) == message


@pytest.mark.parametrize("with_events", [False, True])
def test_the_block_pool_registers_only_the_blocks_from_start(with_events: bool) -> None:
    events = EventLog()
    pool = BlockPool(4)
    if with_events:
        pool.on_event = events.emit
    blocks = pool.allocate_many(3)
    pool.register_many(blocks, [b"d0", b"d1", b"d2"], 1, "g")
    assert pool.index == {b"d1": blocks[1], b"d2": blocks[2]}
    assert pool.digest[blocks[0]] is None and pool.group[blocks[0]] is None and pool.group[blocks[2]] == "g"
    assert [e.block for e in events.all()] == (blocks[1:] if with_events else [])


def test_a_block_pool_needs_one_block_and_refuses_an_allocation_it_cannot_make_whole() -> None:
    with pytest.raises(ValueError) as exc:
        BlockPool(0)
    assert str(exc.value) == "a pool needs at least one block"
    assert BlockPool(1).allocate() == 0
    pool = BlockPool(4)
    a, b, c, d = pool.allocate_many(4)
    pool.register(a, b"a")
    pool.written[a] = True
    pool.release_many([a, b])  # a retained, b free; c and d held
    with pytest.raises(OutOfBlocksError) as exc2:
        pool.allocate_many(3)  # one free + one evictable: not three
    assert str(exc2.value) == "no free or evictable block left in the pool"
    assert pool.free_blocks() == [b] and pool.num_retained == 1 and pool.evictions == 0  # nothing taken
    pool.check()
    assert pool.allocate_many(2) == [b, a] and pool.evictions == 1
    pool.check()
