"""The audit can fail: every raise in ``BlockPool.check`` and ``KVLedger.check`` is reached by
corrupting one fact of an otherwise healthy ledger on purpose. Almost every other test relies on
``check()`` as its oracle; these show that the oracle notices each kind of corruption."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from kvledger.core import native
from kvledger.core.eviction import PriorityPolicy
from kvledger.core.ledger import KVLedger, Request
from kvledger.errors import InvariantError

BS = 4


def healthy() -> KVLedger:
    """Every block state in one small pool: a running sequence with a forked, copy-on-write tail and a
    speculative slot, a retained prefix, a pending release held by a lease, a pin and free blocks."""
    saved, native.MODULE = native.MODULE, None  # the policy's state in Python, so that a test can corrupt it
    try:
        policy = PriorityPolicy()
    finally:
        native.MODULE = saved
    ledger = KVLedger(24, BS, policy=policy)
    ledger.admit(Request("cached", list(range(8)), 0)).raise_for_outcome()
    ledger.mark_computed("cached", 8)
    ledger.release("cached")  # 2 retained blocks
    ledger.admit(Request("pinned", list(range(100, 108)), 0)).raise_for_outcome()
    ledger.mark_computed("pinned", 8)
    ledger.release("pinned")
    assert ledger.pin("system", list(range(100, 108)), Request("x", [1], 0).context) == 2
    ledger.admit(Request("r", list(range(200, 206)), 6, lookahead=4)).raise_for_outcome()
    ledger.mark_computed("r", 6)
    ledger.reserve_lookahead("r", 4)  # a private speculative block beyond r's tokens
    ledger.fork("r", "r/1")  # shares the partial tail block (not the speculative one): one copy promised
    ledger.admit(Request("gone", list(range(300, 305)), 2)).raise_for_outcome()
    lease = ledger.lease(request_ids=["gone"], owner="step-1")
    ledger.release("gone")  # its blocks wait for the lease: deferred
    ledger.lease(blocks=[ledger.sequence("r").table.blocks[0]], owner="transfer-1")
    ledger.check()
    u = ledger.usage()
    assert u.free and u.retained and u.deferred and u.pinned and ledger.promises.copies and lease
    return ledger


def seq(ledger: KVLedger, rid: str = "r"):
    return ledger.sequence(rid)


def free_block(ledger: KVLedger) -> int:
    return ledger.pool.free_blocks()[-1]


def retained_block(ledger: KVLedger) -> int:
    return ledger.pool.retained.blocks()[0]


def shared_tail(ledger: KVLedger) -> int:
    return next(iter(ledger.promises.copies))


def speculative(ledger: KVLedger) -> int:
    s = seq(ledger)
    return s.table.blocks[-(-len(s.tokens) // BS)]


def _duplicate_in_policy(ledger: KVLedger) -> None:
    policy = ledger.pool.retained  # PriorityPolicy: the block also appears in a second level
    block = retained_block(ledger)
    policy._levels.setdefault(7, {})[block] = None
    policy._count += 1


def _lose_a_free_block(ledger: KVLedger) -> None:
    ledger.pool._free.pop()


def _lease_block(ledger: KVLedger, block: int) -> None:
    ledger.pool.leased[block] += 1


POOL_CORRUPTIONS: dict[str, tuple[Callable[[KVLedger], object], str]] = {
    "free-twice": (lambda led: led.pool._free.append(led.pool._free[0]), "on the free list twice"),
    "policy-twice": (_duplicate_in_policy, "eviction policy lists a block twice"),
    "free-and-retained": (lambda led: led.pool._free.append(retained_block(led)), "both free and retained"),
    "held-and-free": (lambda led: led.pool.ref.__setitem__(free_block(led), 1), "also free or retained"),
    "leased-and-retained": (lambda led: _lease_block(led, retained_block(led)), "also free or retained"),
    "lost-block": (_lose_a_free_block, "conservation broken"),
    "deferred-count": (lambda led: setattr(led.pool, "deferred", led.pool.deferred + 1), "deferred count"),
    "free-with-digest": (lambda led: led.pool.digest.__setitem__(free_block(led), b"x" * 64), "carries an identity"),
    "free-with-group": (lambda led: led.pool.group.__setitem__(free_block(led), "t"), "carries an identity"),
    "free-written": (lambda led: led.pool.written.__setitem__(free_block(led), True), "carries an identity"),
    "retained-unwritten": (lambda led: led.pool.written.__setitem__(retained_block(led), False),
                           "not a written, indexed entry"),
    "retained-unindexed": (lambda led: led.pool.index.pop(led.pool.digest[retained_block(led)]),
                           "not a written, indexed entry"),
    "index-disagrees": (lambda led: led.pool.index.__setitem__(b"y" * 64, seq(led).table.blocks[0]),
                        "index entry for block"),
}


@pytest.mark.parametrize("name", sorted(POOL_CORRUPTIONS))
def test_every_pool_law_can_fail(name: str) -> None:
    ledger = healthy()
    corrupt, message = POOL_CORRUPTIONS[name]
    corrupt(ledger)
    with pytest.raises(InvariantError, match=message):
        ledger.pool.check()
    with pytest.raises(InvariantError, match=message):
        ledger.check()  # the ledger's audit runs the pool's first


def _more_tokens_than_blocks(ledger: KVLedger) -> None:
    s = seq(ledger, "r/1")
    s.tokens.extend([1] * (len(s.table.blocks) * BS - len(s.tokens) + 1))


def _overcommit(ledger: KVLedger) -> None:
    s = seq(ledger)
    extra = ledger.pool.num_free + ledger.pool.num_evictable - ledger.promised + 1
    s.promised += extra
    s.reserved_blocks += extra
    ledger.promises.total += extra


def _promise_more_than_reserved(ledger: KVLedger) -> None:
    seq(ledger).promised += 1
    ledger.promises.total += 1


def _share_speculative(ledger: KVLedger) -> None:
    block = speculative(ledger)
    seq(ledger, "r/1").table.blocks.append(block)
    ledger.pool.ref[block] += 1
    seq(ledger, "r/1").promised -= 1
    ledger.promises.total -= 1


def _extra_cow_promise(ledger: KVLedger) -> None:
    ledger.promises.copies[shared_tail(ledger)] += 1
    ledger.promises.total += 1


LEDGER_CORRUPTIONS: dict[str, tuple[Callable[[KVLedger], object], str]] = {
    "tokens-beyond-blocks": (_more_tokens_than_blocks, "blocks for"),
    "negative-promise": (lambda led: setattr(seq(led), "promised", -1), "negative promise"),
    "promise-vs-reservation": (_promise_more_than_reserved, "reservation of"),
    "speculative-shared": (_share_speculative, "speculative block"),
    "speculative-indexed": (lambda led: led.pool.digest.__setitem__(speculative(led), b"z" * 64), "speculative block"),
    "digest-count": (lambda led: seq(led).digests.append(b"w" * 64), "digests, expected"),
    "ref-count": (lambda led: led.pool.ref.__setitem__(seq(led).table.blocks[0], 9), "ref counts disagree"),
    "pin-lost": (lambda led: led._pins._pins["system"].pop(), "ref counts disagree"),
    "lease-owner": (lambda led: setattr(next(iter(led._leases._leases.values())), "owner", None), "no owner name"),
    "lease-stale-sequence": (lambda led: led._leases._by_sequence.__setitem__("ghost", {1}), "lease bookkeeping"),
    "lease-stale-id": (lambda led: led._leases._by_sequence.__setitem__("r", {999}), "lease bookkeeping"),
    "lease-count": (lambda led: _lease_block(led, seq(led).table.blocks[1]), "lease counts disagree"),
    "cow-promises": (_extra_cow_promise, "copy promises"),
    "promise-ledger": (lambda led: setattr(led.promises, "total", led.promises.total + 1), "promise ledger"),
    "overcommitted": (_overcommit, "overcommitted"),
}


@pytest.mark.parametrize("name", sorted(LEDGER_CORRUPTIONS))
def test_every_ledger_law_can_fail(name: str) -> None:
    ledger = healthy()
    ledger.pool.check()
    corrupt, message = LEDGER_CORRUPTIONS[name]
    corrupt(ledger)
    with pytest.raises(InvariantError, match=message):
        ledger.check()


def test_release_and_unlease_below_zero_are_invariant_errors() -> None:
    ledger = healthy()
    block = free_block(ledger)
    with pytest.raises(InvariantError, match="released more often"):
        ledger.pool.release(block)
    with pytest.raises(InvariantError, match="unleased more often"):
        ledger.pool.unlease(block)
