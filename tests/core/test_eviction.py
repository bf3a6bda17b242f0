"""Eviction order and accounting: LRU tail-first, own hits protected, retention priorities with expiry,
eviction statistics and explicit cache clearing. Block size 16; ``check()`` after every operation."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from kvledger.core import native
from kvledger.core.eviction import DEFAULT_PRIORITY, LRUPolicy, PriorityPolicy, as_policy, make_policy
from kvledger.core.identity import CacheContext
from kvledger.core.ledger import KVLedger, Outcome, Request
from kvledger.core.observe import EventLog
from kvledger.core.types import Retention
from kvledger.errors import ConfigError, LedgerError

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
    (lifetimes.py LeaseBook.end / lease record blocks head first; pool.unlease adds each.)"""
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
    assert policy.level(0) != DEFAULT_PRIORITY
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


SMALL_BS = 4  # the block size of the small hand-worked pools (the rest of test_eviction uses 16)


class _PlainPolicy(LRUPolicy):
    """A user's policy with every method KVLedger requires, and no optional ``clear``."""

    def __getattribute__(self, name: str) -> object:
        if name == "clear":
            raise AttributeError(name)
        return super().__getattribute__(name)


def _retained_order(led: KVLedger, blocks: list[int]) -> list[int]:
    """The eviction order of the retained blocks, first victim first, as positions in ``blocks``."""
    return [blocks.index(b) for b in led.pool.retained.blocks()]


def test_a_block_evicted_for_a_new_prompt_forgets_the_priority_of_its_old_content(
    run_once: Callable[..., None],
) -> None:
    """Priority policy: a's two blocks are kept at 90; b (the whole pool) evicts them and reuses them as its
    deepest blocks. Those now hold b's content, at the default level like the rest of b, so a later prompt
    that needs two blocks evicts b's deepest (released first), and b's head is still a prefix hit."""
    led = KVLedger(4, SMALL_BS, policy="priority", clock=lambda: 0.0)
    run_once(led, "a", tokens(8, 100), retention=(Retention(0, 8, 90),))
    run_once(led, "b", tokens(16, 200))
    run_once(led, "c", tokens(8, 300))
    again = led.admit(Request("b2", tokens(16, 200), 0))
    assert again.admitted and again.blocks_hit == 2
    led.check()


def test_a_prefix_cache_reset_works_with_a_policy_that_has_no_clear(run_once: Callable[..., None]) -> None:
    led = KVLedger(4, SMALL_BS, policy=_PlainPolicy())
    run_once(led, "a", tokens(8, 1))
    reset = led.reset_prefix_cache()
    assert reset.done and reset.cleared_blocks == 2
    assert led.usage().free == 4
    led.check()


def test_a_block_evicted_by_decode_growth_forgets_the_priority_of_its_old_content(
    run_once: Callable[..., None], grow_into_a_full_pool: Callable[[KVLedger], None],
) -> None:
    """As the prompt case above, for the one-block ``allocate`` of a decode step: the two blocks x took
    from a (kept at 90) hold x's generated tokens now, at the default level, so after x ends they are
    evicted by LRU order (x's tail first), not kept while x's prompt head goes."""
    led = KVLedger(4, SMALL_BS, policy="priority", clock=lambda: 0.0)
    run_once(led, "a", tokens(8, 100), retention=(Retention(0, 8, 90),))
    grow_into_a_full_pool(led)
    led.release("x")
    led.check()
    run_once(led, "c", tokens(8, 300))  # evicts two blocks: x's tail (released first), not its head
    again = led.admit(Request("x2", tokens(8, 500), 0))
    assert again.admitted and again.blocks_hit == 2


def test_decode_growth_into_a_full_lru_pool_counts_its_evictions_and_opens_an_unwritten_block(
    run_once: Callable[..., None],
) -> None:
    """The inlined eviction of ``allocate`` (LRU, no events, no tiers): the operator's eviction count, and
    the block it opens holds no computed KV yet, so only the computed tokens are ready."""
    led = KVLedger(4, SMALL_BS)
    run_once(led, "a", tokens(8, 100))
    assert led.admit(Request("x", tokens(8, 500), 8)).admitted
    led.append_token("x", 600)
    assert led.stats()["lifetimes"]["evictions"] == 1
    assert led.ready_tokens("x") == 8  # the ninth token's KV is written by the next step
    for t in range(1, 8):
        led.append_token("x", 600 + t)
    assert led.stats()["lifetimes"]["evictions"] == 2 and led.usage().retained == 0
    led.check()


def test_a_freed_block_forgets_the_priority_its_request_gave_it(run_once: Callable[..., None]) -> None:
    """a marks its last two prompt blocks 90 but is released before they are computed: they are freed,
    and b, which reuses them as its own last two blocks, must not inherit the 90."""
    led = KVLedger(4, SMALL_BS, policy="priority", clock=lambda: 0.0)
    assert led.admit(Request("a", tokens(16, 100), 0, retention=(Retention(8, 16, 90),))).admitted
    led.release("a")
    assert led.usage().free == 4
    run_once(led, "b", tokens(16, 200))
    run_once(led, "c", tokens(8, 300))  # evicts b's last two blocks (released first, all at 35)
    again = led.admit(Request("b2", tokens(16, 200), 0))
    assert again.admitted and again.blocks_hit == 2
    led.check()


def test_a_retention_range_covers_exactly_the_blocks_it_overlaps() -> None:
    """Ranges ending or starting on a block boundary give their priority to the blocks holding their
    tokens only; within a block the highest priority wins, the first of equal ones (with its duration)."""
    now = [0.0]
    led = KVLedger(8, SMALL_BS, policy="priority", clock=lambda: now[0])
    ranges = (Retention(0, 4, 90),  # block 0 only (ends on the boundary)
              Retention(12, 13, 80),  # block 3 only (starts on its boundary)
              Retention(16, 20, 10, duration_s=100.0), Retention(16, 20, 10, duration_s=1.0))  # block 4: 100 s
    assert led.admit(Request("a", tokens(20, 1), 0, retention=ranges)).admitted
    blocks = list(led.sequence("a").table.blocks)
    led.mark_computed("a", 20)
    led.release("a")  # tail first: 4, 3, 2, 1, 0
    now[0] = 5.0  # the 1 s duration would have expired by now; the 100 s one has not
    assert _retained_order(led, blocks) == [4, 2, 1, 3, 0]  # 10; 35: 2, 1 (released in that order); 80; 90
    led.check()


def test_generated_blocks_do_not_renew_the_expiry_of_the_prompt_blocks() -> None:
    """A prompt block kept at 90 for 10 s from admission (t=0): when generation completes a later block at
    t=5, the prompt blocks' priorities are not set again, so they still expire at t=10."""
    now = [0.0]
    led = KVLedger(8, SMALL_BS, policy="priority", clock=lambda: now[0])
    assert led.admit(Request("a", tokens(8, 1), 4, retention=(Retention(0, 8, 90, duration_s=10.0),))).admitted
    now[0] = 5.0
    led.append_tokens("a", [50, 51, 52, 53])
    led.mark_computed("a", 12)  # block 2 is written: it gets its identity (and no priority: no range covers it)
    blocks = list(led.sequence("a").table.blocks)
    led.release("a")
    assert _retained_order(led, blocks) == [2, 1, 0]
    now[0] = 12.0  # past t=10: both prompt blocks are back at the default level, after block 2
    assert _retained_order(led, blocks) == [2, 0, 1]
    led.check()


def test_a_retention_range_past_the_prompt_covers_the_generated_blocks_too() -> None:
    led = KVLedger(8, SMALL_BS, policy="priority", clock=lambda: 0.0)
    assert led.admit(Request("a", tokens(8, 1), 4, retention=(Retention(4, 100, 90),))).admitted
    led.append_tokens("a", [50, 51, 52, 53])
    led.mark_computed("a", 12)
    blocks = list(led.sequence("a").table.blocks)
    led.release("a")
    assert _retained_order(led, blocks) == [0, 2, 1]  # 35: block 0; 90: blocks 2 and 1, released in that order
    led.check()


@pytest.mark.parametrize("prompt", ["abcd", b"abcd"])
def test_pin_rejects_a_text_prompt(prompt: object) -> None:
    """A str or bytes prompt is not a sequence of token ids: ConfigError naming the prompt."""
    led = KVLedger(8, SMALL_BS, prefix_caching=True)
    with pytest.raises(ConfigError, match="the prompt must be a sequence of token ids"):
        led.pin("p", prompt, CacheContext())  # type: ignore[arg-type]


@pytest.mark.parametrize("frac", [2, 1.5, -0.5])
def test_max_pinned_fraction_outside_zero_one_is_rejected(frac: float) -> None:
    """``max_pinned_fraction`` must lie in [0, 1]: a finite value outside is a ConfigError."""
    with pytest.raises(ConfigError, match=r"max_pinned_fraction must be in \[0, 1\]"):
        KVLedger(8, SMALL_BS, max_pinned_fraction=frac)


def test_a_retention_given_whole_seconds_keeps_them_as_float_seconds() -> None:
    """``duration_s=5`` is 5.0 seconds, not forever (None)."""
    r = Retention(0, 8, 90, 5)
    assert r.duration_s == 5.0 and type(r.duration_s) is float
    assert (r.start, r.end, r.priority) == (0, 8, 90)


def test_a_bad_retention_end_names_the_field() -> None:
    """The message says which field of the Retention is wrong, spelt as the caller wrote it."""
    with pytest.raises(ConfigError, match=r"^Retention\.end must be an integer, got 'x'$"):
        Retention(0, "x", 1)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"^Retention\.end must be >= 0, got -1$"):
        Retention(0, -1, 1)


def test_a_retention_of_zero_seconds_is_accepted() -> None:
    """``duration_s`` must be finite and >= 0 (its own message says so): zero is allowed, negative not."""
    r = Retention(0, 4, 50, duration_s=0)
    assert r.duration_s == 0.0 and type(r.duration_s) is float
    with pytest.raises(ConfigError, match=r"finite and >= 0, got -1\.0"):
        Retention(0, 4, 50, duration_s=-1)


def test_invalidate_frees_a_retained_block_and_drops_it_from_the_cache() -> None:
    """A finished 8-token request leaves its 2 blocks retained (6 free of 8). Invalidating its first block
    frees it (7 free, 1 retained), and the same prompt then hits nothing: the chain starts there."""
    led = KVLedger(8, SMALL_BS)
    assert led.admit(Request("a", tokens(8, 1), 1)).admitted
    led.mark_computed("a", 8)
    first = led.sequence("a").table.blocks[0]
    led.release("a")
    assert (led.usage().free, led.usage().retained) == (6, 2)
    led.invalidate([first])
    assert (led.usage().free, led.usage().retained) == (7, 1)
    assert first in led.pool.free_blocks()
    assert led.admit(Request("b", tokens(8, 1), 1)).blocks_hit == 0
    led.check()


def test_priority_policy_expiry_is_inclusive_and_stale_entries_do_not_stop_it() -> None:
    """A manual clock. A priority that expires at t falls back to the default level (35) at t itself,
    both when the block is retained at t and when it was retained before; entries for blocks evicted or
    re-prioritised since are skipped, never the end of the expiry scan."""
    now = [0.0]
    p = PriorityPolicy(clock=lambda: now[0])
    assert p.is_empty()
    for bad in (True, -1, 101, 1.5, "9"):
        with pytest.raises(ConfigError, match=r"^priority must be an integer in 0\.\.100, got "):
            p.set_priority(1, bad, None)  # type: ignore[arg-type]
    p.set_priority(1, 90, 3.0)  # 1: kept at 90 until t=3
    p.set_priority(2, 90, 1.0)  # 2: evicted before its expiry (a stale heap entry)
    p.set_priority(3, 90, 1.5)  # 3: re-prioritised for good before its expiry (stale too)
    p.set_priority(4, 60, None)  # 4: 60 for good
    for b in (2, 3, 1, 4):
        p.add(b)
    p.set_priority(3, 95, None)
    p.remove(2)
    assert 2 not in p and 1 in p and len(p) == 3
    p.add(5)  # 5: the default level
    assert p.blocks() == [5, 4, 3, 1]  # at t=0: 35, 60, 90 (3 and 1 in release order)
    now[0] = 3.0
    assert p.blocks() == [5, 1, 4, 3]  # 1 expired at exactly t=3 and is now the most recent at 35
    p.set_priority(6, 90, 3.0)
    p.add(6)  # retained at its expiry: the default level straight away, released before 7
    p.add(7)
    assert p.pop_victims(4) == [5, 1, 6, 7]
    with pytest.raises(LedgerError, match="^fewer retained blocks than requested victims$"):
        p.pop_victims(3)
    assert 6 not in p


def test_priority_policy_is_empty_only_when_it_remembers_nothing() -> None:
    p = PriorityPolicy(clock=lambda: 0.0)
    p.set_priority(7, 90, None)  # a priority for a block not retained yet
    assert not p.is_empty()
    p.forget(7)  # its content is gone: so is its priority
    assert p.is_empty()
    p.set_priority(8, 90, 5.0)
    p.add(8)
    p.remove(8)
    p.forget(8)
    assert not p.is_empty()  # its expiry is still pending in the heap
    p.clear()
    assert p.is_empty()


def test_lru_asked_for_more_victims_than_it_holds_refuses_and_keeps_every_block() -> None:
    """Asking for more victims than there are is a LedgerError, as PriorityPolicy says it (the core raises
    only typed errors), and it takes nothing: before, LRU emptied itself and raised a bare KeyError, so the
    pool's retained blocks were lost from the policy while the pool still counted them as retained."""
    for lru in (LRUPolicy(), _dict_lru()):
        lru.add_many([3, 1])
        lru.add(2)
        lru.remove(1)
        assert lru.blocks() == [3, 2] and 2 in lru and 1 not in lru
        with pytest.raises(LedgerError, match="fewer retained blocks"):
            lru.pop_victims(3)
        assert len(lru) == 2 and lru.blocks() == [3, 2]
        assert lru.pop_victims(2) == [3, 2]


def _dict_lru() -> LRUPolicy:
    """An LRU whose order lives in the OrderedDict (what a non-block key moves it to)."""
    lru = LRUPolicy()
    lru._dict()
    return lru


def test_lru_keeps_block_ids_in_the_native_order_when_the_c_part_is_loaded() -> None:
    """Block ids stay in the C part's flat order (one object per block would cost the memory it saves);
    only a key that is not a block id moves the order to an OrderedDict, for good, with the same order."""
    lru = LRUPolicy()
    lru.add_many([5, 6])
    lru.add(7)
    lru.remove(6)
    loaded = native.MODULE is not None
    assert (lru.native_order is not None) == loaded
    assert lru.pop_victims(1) == [5] and lru.blocks() == [7]
    lru.add("not-a-block")  # type: ignore[arg-type]
    assert lru.native_order is None and lru.blocks() == [7, "not-a-block"]


def test_a_policy_that_is_not_one_gets_one_clear_error() -> None:
    """What KVLedger(policy=...) says about what it cannot use (the CLI prints these lines as they are)."""
    with pytest.raises(ConfigError) as exc:
        make_policy(["lru"])  # type: ignore[arg-type]
    names = "lru, arc, gdsf, lfu, priority, s3fifo, sglang-priority"
    assert str(exc.value) == f"unknown eviction policy ['lru']; choose one of {names}"
    with pytest.raises(ConfigError) as exc:
        as_policy(object())  # type: ignore[arg-type]
    assert str(exc.value) == (f"policy must be an eviction policy or one of {names}; object lacks add, add_many, "
                              "remove, pop_victims, set_priority, blocks, __len__, __contains__")
    used = LRUPolicy()
    used.add(1)
    with pytest.raises(ConfigError) as exc:
        as_policy(used)
    assert str(exc.value) == "an eviction policy can serve one pool, from empty; this one already holds blocks"


@pytest.mark.parametrize("fast", [None, native.MODULE], ids=["python", "native"])
def test_the_priority_policy_refuses_a_block_retained_twice(fast: object) -> None:
    """A block added twice used to be counted twice (len 2, one block listed): the pool's audit then saw a
    count the policy could never pay back. Now it is refused, as the tree policies refuse it."""
    saved, native.MODULE = native.MODULE, fast
    try:
        policy = PriorityPolicy(clock=lambda: 0.0)
    finally:
        native.MODULE = saved
    policy.add(1)
    with pytest.raises(LedgerError, match="block 1 is retained already"):
        policy.add(1)
    assert len(policy) == 1 and policy.blocks() == [1] and policy.pop_victims(1) == [1]
