"""Eviction order and accounting: LRU tail-first, own hits protected, retention priorities with expiry,
eviction statistics and explicit cache clearing. Block size 16; ``check()`` after every operation."""

from __future__ import annotations

from kvledger.core.eviction import DEFAULT_PRIORITY, PriorityPolicy
from kvledger.core.identity import CacheContext
from kvledger.core.ledger import KVLedger, Outcome, Request
from kvledger.core.observe import EventLog
from kvledger.core.types import Retention

BS = 16


def tokens(n: int, start: int = 1000) -> list[int]:
    return list(range(start, start + n))


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def audit(ledger: KVLedger) -> None:
    ledger.check()
    pool, u = ledger.pool, ledger.usage()
    assert u.free + u.active + u.retained == u.total
    free, retained = set(pool.free_blocks()), set(pool.retained.blocks())
    assert not any(pool.leased[b] and (b in free or b in retained) for b in range(pool.num_blocks))
    assert u.promised <= u.free + u.evictable


def admit(ledger: KVLedger, rid: str, prompt: list[int], max_new: int = 0, **kw):
    decision = ledger.admit(Request(rid, prompt, max_new, **kw))
    audit(ledger)
    return decision


def run(ledger: KVLedger, rid: str, prompt: list[int], **kw) -> list[int]:
    """Admit and compute ``prompt``; return its block table (the request keeps running)."""
    admit(ledger, rid, prompt, **kw).raise_for_outcome()
    ledger.mark_computed(rid, len(prompt))
    audit(ledger)
    return list(ledger.sequence(rid).table.blocks)


def release(ledger: KVLedger, *rids: str) -> None:
    for rid in rids:
        ledger.release(rid)
        audit(ledger)


def evicted(events: EventLog) -> list[int]:
    return [e.block for e in events.all() if e.kind == "evicted"]


# ---- LRU --------------------------------------------------------------------------------------------


def test_lru_evicts_the_first_released_request_tail_first() -> None:
    events = EventLog()
    ledger = KVLedger(6, BS, events=events)
    assert run(ledger, "a", tokens(48, 100)) == [0, 1, 2]
    assert run(ledger, "b", tokens(48, 200)) == [3, 4, 5]
    release(ledger, "a", "b")
    assert ledger.pool.retained.blocks() == [2, 1, 0, 5, 4, 3]
    # Two new blocks: a's deepest blocks go first, its head is the last of a to go.
    assert run(ledger, "x", tokens(32, 300)) == [2, 1]
    assert evicted(events) == [2, 1]
    assert run(ledger, "y", tokens(48, 400)) == [0, 5, 4]
    assert evicted(events) == [2, 1, 0, 5, 4]
    assert ledger.pool.retained.blocks() == [3]
    # b's head is still cached and hit; a's chain is gone.
    assert admit(ledger, "b2", tokens(16, 200)).blocks_hit == 1
    release(ledger, "b2", "x", "y")
    assert admit(ledger, "a2", tokens(16, 100)).blocks_hit == 0
    assert ledger.stats()["lifetimes"]["evictions"] == 5 + 1  # a2's new block evicted one more


def test_free_blocks_are_used_before_any_eviction() -> None:
    events = EventLog()
    ledger = KVLedger(6, BS, events=events)
    run(ledger, "a", tokens(32))
    release(ledger, "a")
    assert run(ledger, "b", tokens(64, 500)) == [2, 3, 4, 5]
    assert evicted(events) == []
    assert run(ledger, "c", tokens(16, 900)) == [1]
    assert evicted(events) == [1]
    assert ledger.stats()["lifetimes"]["evictions"] == 1


def test_a_hit_refreshes_recency() -> None:
    ledger = KVLedger(8, BS)
    run(ledger, "a", tokens(32, 100))
    run(ledger, "b", tokens(32, 200))
    release(ledger, "a", "b")
    assert ledger.pool.retained.blocks() == [1, 0, 3, 2]
    run(ledger, "a2", tokens(32, 100))  # hits a's blocks and releases them again: now most recent
    release(ledger, "a2")
    assert ledger.pool.retained.blocks() == [3, 2, 1, 0]


def test_tail_first_order_survives_a_deferred_release() -> None:
    """A request cancelled while leased completes its release at end_lease; its blocks must still
    become evictable deepest first, like a plain release ([2, 1, 0]). Bug: end_lease unleases in table
    order (head first), so LRU evicts the prefix head first and strands the rest of the chain.
    (lifetimes.py LifetimeOps.end_lease / lease record blocks head first; pool.unlease adds each.)"""
    ledger = KVLedger(8, BS)
    run(ledger, "r", tokens(48))
    lease = ledger.lease(request_ids=["r"])
    assert ledger.cancel("r") is True
    audit(ledger)
    ledger.end_lease(lease)
    audit(ledger)
    assert ledger.pool.retained.blocks() == [2, 1, 0]


def test_a_requests_own_hits_are_never_evicted_for_it() -> None:
    events = EventLog()
    ledger = KVLedger(4, BS, events=events)
    prefix = tokens(32, 100)
    run(ledger, "a", prefix)
    run(ledger, "c", tokens(32, 200))
    release(ledger, "a", "c")
    assert ledger.pool.retained.blocks() == [1, 0, 3, 2]  # a's hit blocks would be the first victims
    d = admit(ledger, "b", prefix + tokens(16, 300))
    assert (d.outcome, d.blocks_hit, d.blocks_new) == (Outcome.ADMITTED, 2, 1)
    assert ledger.sequence("b").table.blocks == [0, 1, 3]  # c's tail was evicted, not a's blocks
    assert evicted(events) == [3]


def test_a_request_that_would_need_its_own_hits_evicted_waits() -> None:
    ledger = KVLedger(4, BS)
    prefix = tokens(32, 100)
    run(ledger, "a", prefix)
    release(ledger, "a")
    run(ledger, "busy", tokens(32, 200))  # holds the other two blocks
    before = (ledger.usage(), ledger.pool.retained.blocks())
    d = admit(ledger, "b", prefix + tokens(32, 300))
    assert (d.outcome, d.blocks_hit, d.blocks_new) == (Outcome.NOT_NOW, 2, 2)
    assert "2 own hits" in d.detail  # the operator's detail; the tenant's reason quotes no pool figures
    assert "own hits" not in d.reason and "free" not in d.reason
    assert (ledger.usage(), ledger.pool.retained.blocks()) == before
    release(ledger, "busy")
    d = admit(ledger, "b", prefix + tokens(32, 300))
    assert d.admitted and ledger.sequence("b").table.blocks == [0, 1, 3, 2]


# ---- priorities -------------------------------------------------------------------------------------


def priority_ledger(num_blocks: int, events: EventLog | None = None) -> tuple[KVLedger, FakeClock]:
    clock = FakeClock()
    return KVLedger(num_blocks, BS, policy=PriorityPolicy(clock), clock=clock, events=events), clock


def test_priority_low_before_default_before_high_then_lru_within_a_level() -> None:
    events = EventLog()
    ledger, _ = priority_ledger(10, events)
    high = (Retention(0, 32, 90),)
    low = (Retention(0, 32, 10),)
    assert run(ledger, "h", tokens(32, 100), retention=high) == [0, 1]
    assert run(ledger, "d", tokens(32, 200)) == [2, 3]
    assert run(ledger, "l1", tokens(32, 300), retention=low) == [4, 5]
    assert run(ledger, "l2", tokens(32, 400), retention=low) == [6, 7]
    # Released high first: plain LRU would evict h first.
    release(ledger, "h", "d", "l1", "l2")
    assert ledger.pool.retained.blocks() == [5, 4, 7, 6, 3, 2, 1, 0]
    assert ledger.policy_name == "priority"
    assert run(ledger, "x", tokens(96, 500)) == [8, 9, 5, 4, 7, 6]  # free first, then the low level
    assert evicted(events) == [5, 4, 7, 6]
    assert run(ledger, "y", tokens(48, 600)) == [3, 2, 1]
    assert evicted(events) == [5, 4, 7, 6, 3, 2, 1]
    assert ledger.pool.retained.blocks() == [0]
    assert ledger.stats()["lifetimes"]["evictions"] == 7


def test_priority_applies_per_block_by_token_range() -> None:
    ledger, _ = priority_ledger(4)
    # Only block 0 (tokens 0..15) is high; block 1 is default, block 2 of the other request is low.
    run(ledger, "a", tokens(32, 100), retention=(Retention(0, 16, 90),))
    run(ledger, "b", tokens(16, 200), retention=(Retention(0, 16, 5),))
    release(ledger, "b", "a")
    assert ledger.pool.retained.blocks() == [2, 1, 0]


def test_expired_priority_falls_back_to_default() -> None:
    ledger, clock = priority_ledger(4)
    run(ledger, "h", tokens(16, 100), retention=(Retention(0, 16, 90, duration_s=5.0),))  # block 0
    run(ledger, "m", tokens(32, 200), retention=(Retention(0, 32, 50),))  # blocks 1, 2, forever
    run(ledger, "f", tokens(16, 300))  # block 3 stays busy
    release(ledger, "h", "m")
    assert ledger.pool.retained.blocks() == [2, 1, 0]
    clock.now = 4.0  # h still at 90: the 50s go first
    assert run(ledger, "g1", tokens(16, 400)) == [2]
    clock.now = 10.0  # h expired: back at the default level, below 50
    assert ledger.pool.retained.blocks() == [0, 1]
    assert run(ledger, "g2", tokens(16, 500)) == [0]
    assert ledger.pool.retained.blocks() == [1]


def test_expiry_never_demotes_a_block_whose_priority_is_now_permanent() -> None:
    """A block cached with (90, expires in 5 s) is hit by a request that keeps it at 90 forever. After
    t = 5 it must still rank above a 50 block. Bug: PriorityPolicy._expire acts on the stale heap entry
    of the old expiry: it only skips entries whose new expiry is *later*, not ``None`` (forever), so
    the block is demoted to DEFAULT_PRIORITY (35) and evicted before the 50 block."""
    ledger, clock = priority_ledger(4)
    prompt = tokens(16, 100)
    run(ledger, "a", prompt, retention=(Retention(0, 16, 90, duration_s=5.0),))
    release(ledger, "a")  # block 0 retained at 90 until t = 5
    clock.now = 1.0
    d = admit(ledger, "a2", prompt, retention=(Retention(0, 16, 90),))
    assert d.blocks_hit == 1
    release(ledger, "a2")  # block 0 retained at 90, forever
    run(ledger, "m", tokens(16, 200), retention=(Retention(0, 16, 50),))  # block 1
    release(ledger, "m")
    run(ledger, "busy", tokens(32, 300))  # blocks 2, 3
    clock.now = 10.0
    policy = ledger.pool.retained
    assert isinstance(policy, PriorityPolicy)
    assert policy.blocks() == [1, 0]  # 50 before 90
    assert policy._level_of[0] != DEFAULT_PRIORITY
    assert run(ledger, "g", tokens(16, 400)) == [1]


def test_lru_ignores_retention() -> None:
    ledger = KVLedger(4, BS)
    run(ledger, "h", tokens(16, 100), retention=(Retention(0, 16, 100),))
    run(ledger, "l", tokens(16, 200), retention=(Retention(0, 16, 0),))
    release(ledger, "h", "l")
    assert ledger.pool.retained.blocks() == [0, 1]


# ---- clearing ---------------------------------------------------------------------------------------


def test_clear_cache_evicts_every_retained_block_and_reports_it() -> None:
    events = EventLog()
    ledger = KVLedger(8, BS, events=events)
    ctx = CacheContext(trust_group="t")
    run(ledger, "a", tokens(32, 100), context=ctx)
    run(ledger, "b", tokens(32, 200), context=ctx)
    run(ledger, "keep", tokens(24, 300), context=ctx)
    release(ledger, "a", "b")
    digests = {b: ledger.pool.digest[b].hex() for b in ledger.pool.retained.blocks()}
    assert sorted(digests) == [0, 1, 2, 3]
    assert ledger.clear_cache() == 4
    audit(ledger)
    u = ledger.usage()
    assert (u.retained, u.active, u.free) == (0, 2, 6)
    assert ledger.sequence("keep").table.blocks == [4, 5]  # running requests are untouched
    assert ledger.pool.digest[4] is not None
    cleared = [e for e in events.all() if e.kind == "cleared"]
    assert [(e.block, e.digest, e.trust_group) for e in cleared] == [
        (b, digests[b], "t") for b in [1, 0, 3, 2]]
    stats = ledger.stats()["lifetimes"]
    assert (stats["cleared"], stats["evictions"]) == (4, 0)  # clearing is counted apart from pressure
    assert admit(ledger, "a2", tokens(32, 100), context=ctx).blocks_hit == 0
    assert ledger.clear_cache() == 0


def test_clear_cache_emits_one_event_per_block() -> None:
    """Each cleared block is one state change, reported once, as "cleared" (not also as "evicted"):
    a consumer mirroring the index must not see the same digest removed twice."""
    events = EventLog()
    ledger = KVLedger(4, BS, events=events)
    run(ledger, "a", tokens(16))
    release(ledger, "a")
    assert ledger.clear_cache() == 1
    assert [e.kind for e in events.all()] == ["stored", "cleared"]
