"""Tests written because a mutant of the ledger core survived ``make mutation`` (docs/testing.md, module by
module: ``core/pool.py``, ``core/admission.py``, ``core/ledger.py``): each pins down behaviour a caller of
the ledger (or of the exported :class:`~kvledger.core.BlockPool`) can see -- a count, a decision, which
cached prefix survives, an event, an error and its message -- that no other test of the core checked."""

from __future__ import annotations

from collections import OrderedDict

import pytest

from kvledger.core import BlockPool
from kvledger.core.eviction import LRUPolicy, PriorityPolicy
from kvledger.core.identity import CacheContext
from kvledger.core.ledger import KVLedger, Outcome, Request
from kvledger.core.observe import EventLog
from kvledger.core.types import Retention
from kvledger.errors import AdmissionError, ConfigError, InvariantError, LedgerError, OutOfBlocksError

BS = 4


def toks(base: int, n: int) -> list[int]:
    return [base + i for i in range(n)]


def run_once(led: KVLedger, rid: str, prompt: list[int], **kw: object) -> None:
    """Admit, compute the whole prompt, release: its full blocks stay behind as retained cache."""
    assert led.admit(Request(rid, prompt, 0, **kw)).admitted  # type: ignore[arg-type]
    led.mark_computed(rid, len(prompt))
    led.release(rid)
    led.check()


# ---- core/pool.py --------------------------------------------------------------------------------------

def test_a_block_evicted_for_a_new_prompt_forgets_the_priority_of_its_old_content() -> None:
    """Priority policy: a's two blocks are kept at 90; b (the whole pool) evicts them and reuses them as its
    deepest blocks. Those now hold b's content, at the default level like the rest of b, so a later prompt
    that needs two blocks evicts b's deepest (released first), and b's head is still a prefix hit."""
    led = KVLedger(4, BS, policy="priority", clock=lambda: 0.0)
    run_once(led, "a", toks(100, 8), retention=(Retention(0, 8, 90),))
    run_once(led, "b", toks(200, 16))
    run_once(led, "c", toks(300, 8))
    again = led.admit(Request("b2", toks(200, 16), 0))
    assert again.admitted and again.blocks_hit == 2
    led.check()


def test_every_stored_event_names_the_block_that_holds_the_identity() -> None:
    events = EventLog()
    led = KVLedger(8, BS, events=events)
    assert led.admit(Request("a", toks(1, 10), 2)).admitted
    blocks = led.sequence("a").table.blocks
    stored = [e for e in events.all() if e.kind == "stored"]
    assert [e.block for e in stored] == blocks[:2]  # the two full prompt blocks, pending until written


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


class _PlainPolicy(LRUPolicy):
    """A user's policy with every method KVLedger requires, and no optional ``clear``."""

    def __getattribute__(self, name: str) -> object:
        if name == "clear":
            raise AttributeError(name)
        return super().__getattribute__(name)


def test_a_prefix_cache_reset_works_with_a_policy_that_has_no_clear() -> None:
    led = KVLedger(4, BS, policy=_PlainPolicy())
    run_once(led, "a", toks(1, 8))
    reset = led.reset_prefix_cache()
    assert reset.done and reset.cleared_blocks == 2
    assert led.usage().free == 4
    led.check()


def _grow_into_a_full_pool(led: KVLedger) -> None:
    """x holds the two free blocks and is promised two more; its decode then opens blocks 3 and 4 with
    ``allocate`` one at a time, each evicting one of the retained blocks left by ``run_once``."""
    assert led.admit(Request("x", toks(500, 8), 8)).admitted
    for t in range(8):
        led.append_token("x", 600 + t)
        led.check()
    assert led.usage().free == 0 and len(led.sequence("x").table.blocks) == 4


def test_a_block_evicted_by_decode_growth_forgets_the_priority_of_its_old_content() -> None:
    """As the prompt case above, for the one-block ``allocate`` of a decode step: the two blocks x took
    from a (kept at 90) hold x's generated tokens now, at the default level, so after x ends they are
    evicted by LRU order (x's tail first), not kept while x's prompt head goes."""
    led = KVLedger(4, BS, policy="priority", clock=lambda: 0.0)
    run_once(led, "a", toks(100, 8), retention=(Retention(0, 8, 90),))
    _grow_into_a_full_pool(led)
    led.release("x")
    led.check()
    run_once(led, "c", toks(300, 8))  # evicts two blocks: x's tail (released first), not its head
    again = led.admit(Request("x2", toks(500, 8), 0))
    assert again.admitted and again.blocks_hit == 2


def test_a_block_evicted_by_decode_growth_is_demoted_to_the_attached_tier() -> None:
    from kvledger.core.tiers import TierLedger

    led = KVLedger(4, BS)
    tiers = TierLedger([("host", 8)])
    led.attach_tiers(tiers)
    run_once(led, "a", toks(100, 8))
    _grow_into_a_full_pool(led)
    assert led.pool.evictions == 2
    assert tiers.flow["demoted"] == 2 and tiers.num_used == 2  # both of a's blocks, one per decode block
    led.check()


def test_decode_growth_into_a_full_lru_pool_counts_its_evictions_and_opens_an_unwritten_block() -> None:
    """The inlined eviction of ``allocate`` (LRU, no events, no tiers): the operator's eviction count, and
    the block it opens holds no computed KV yet, so only the computed tokens are ready."""
    led = KVLedger(4, BS)
    run_once(led, "a", toks(100, 8))
    assert led.admit(Request("x", toks(500, 8), 8)).admitted
    led.append_token("x", 600)
    assert led.stats()["lifetimes"]["evictions"] == 1
    assert led.ready_tokens("x") == 8  # the ninth token's KV is written by the next step
    for t in range(1, 8):
        led.append_token("x", 600 + t)
    assert led.stats()["lifetimes"]["evictions"] == 2 and led.usage().retained == 0
    led.check()


def test_a_released_prompt_that_was_never_computed_is_removed_from_the_index() -> None:
    events = EventLog()
    led = KVLedger(4, BS, events=events)
    assert led.admit(Request("a", toks(1, 8), 0)).admitted
    blocks = led.sequence("a").table.blocks
    led.release("a")  # pending blocks (never written) are freed, not retained
    assert [(e.kind, e.block) for e in events.all()] == [
        ("stored", blocks[0]), ("stored", blocks[1]), ("removed", blocks[1]), ("removed", blocks[0])]
    assert led.usage().free == 4
    led.check()


def test_a_freed_block_forgets_the_priority_its_request_gave_it() -> None:
    """a marks its last two prompt blocks 90 but is released before they are computed: they are freed,
    and b, which reuses them as its own last two blocks, must not inherit the 90."""
    led = KVLedger(4, BS, policy="priority", clock=lambda: 0.0)
    assert led.admit(Request("a", toks(100, 16), 0, retention=(Retention(8, 16, 90),))).admitted
    led.release("a")
    assert led.usage().free == 4
    run_once(led, "b", toks(200, 16))
    run_once(led, "c", toks(300, 8))  # evicts b's last two blocks (released first, all at 35)
    again = led.admit(Request("b2", toks(200, 16), 0))
    assert again.admitted and again.blocks_hit == 2
    led.check()


def _pool_with_cache() -> BlockPool:
    """Twelve blocks: 0..9 retained (written, indexed), 10 and 11 freed (anonymous)."""
    pool = BlockPool(12, PriorityPolicy(clock=lambda: 0.0))
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


# ---- core/admission.py ---------------------------------------------------------------------------------

def test_can_admit_names_keep_free_when_it_is_not_a_count() -> None:
    led = KVLedger(4, BS)
    req = Request("a", toks(1, 4), 0)
    for bad, message in ((-1, "keep_free must be >= 0, got -1"), ("2", "keep_free must be an integer, got '2'")):
        for call in (led.can_admit, led.admit):
            with pytest.raises(ConfigError) as exc:
                call(req, keep_free=bad)  # type: ignore[arg-type]
            assert str(exc.value) == message


def test_every_decision_names_its_request() -> None:
    led = KVLedger(4, BS)
    assert led.can_admit(Request("a", toks(1, 8), 0)).request_id == "a"
    assert led.admit(Request("a", toks(1, 8), 0)).request_id == "a"
    refused = led.admit(Request("b", toks(50, 12), 0))  # 3 blocks; 2 left
    assert refused.outcome is Outcome.NOT_NOW and refused.request_id == "b"
    assert (refused.blocks_total, refused.blocks_hit, refused.blocks_hit_pending, refused.blocks_new,
            refused.blocks_promised, refused.blocks_branches) == (3, 0, 0, 3, 0, 0)
    with pytest.raises(AdmissionError) as exc:
        refused.raise_for_outcome()
    assert str(exc.value).startswith("request 'b' not_now: needs 3 new blocks")
    assert led.admit(Request("c", toks(80, 40), 0)).request_id == "c"  # never


def _retained_order(led: KVLedger, blocks: list[int]) -> list[int]:
    """The eviction order of the retained blocks, first victim first, as positions in ``blocks``."""
    return [blocks.index(b) for b in led.pool.retained.blocks()]


def test_a_retention_range_covers_exactly_the_blocks_it_overlaps() -> None:
    """Ranges ending or starting on a block boundary give their priority to the blocks holding their
    tokens only; within a block the highest priority wins, the first of equal ones (with its duration)."""
    now = [0.0]
    led = KVLedger(8, BS, policy="priority", clock=lambda: now[0])
    ranges = (Retention(0, 4, 90),  # block 0 only (ends on the boundary)
              Retention(12, 13, 80),  # block 3 only (starts on its boundary)
              Retention(16, 20, 10, duration_s=100.0), Retention(16, 20, 10, duration_s=1.0))  # block 4: 100 s
    assert led.admit(Request("a", toks(1, 20), 0, retention=ranges)).admitted
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
    led = KVLedger(8, BS, policy="priority", clock=lambda: now[0])
    assert led.admit(Request("a", toks(1, 8), 4, retention=(Retention(0, 8, 90, duration_s=10.0),))).admitted
    now[0] = 5.0
    led.append_tokens("a", [50, 51, 52, 53])
    led.mark_computed("a", 12)  # block 2 is written: it gets its identity (and no priority: no range covers it)
    blocks = list(led.sequence("a").table.blocks)
    led.release("a")
    assert _retained_order(led, blocks) == [2, 1, 0]
    now[0] = 12.0  # past t=10: both prompt blocks are back at the default level, after block 2
    assert _retained_order(led, blocks) == [2, 0, 1]
    led.check()


def test_a_quota_charges_a_request_for_the_cached_blocks_it_takes_back() -> None:
    """Group t (cap 3) holds one block for r. b (10 tokens) hits a's two retained blocks, which nobody
    holds: taking them adds 2 to t's charge, its one new block (the partial tail) 1 more, its growth none
    (its whole output fits that block) and, one branch, no tail copies: 1 + 3 > 3."""
    ctx = CacheContext(trust_group="t")
    led = KVLedger(16, BS)
    run_once(led, "a", toks(1, 8), context=ctx)
    led.set_quota("t", 3)
    assert led.admit(Request("r", toks(500, 4), 0, context=ctx)).admitted
    d = led.admit(Request("b", [*toks(1, 8), 90, 91], 2, context=ctx))
    assert d.outcome is Outcome.NOT_NOW and d.over_quota and d.request_id == "b"
    assert (d.blocks_total, d.blocks_hit, d.blocks_hit_pending, d.blocks_new, d.blocks_promised,
            d.blocks_branches) == (3, 2, 0, 1, 0, 0)
    assert d.reason == ("needs 3 blocks of its trust group's quota of 3 blocks, of which 1 are held or committed "
                        "to its running requests now")
    led.set_quota("t", 4)
    assert led.admit(Request("b", [*toks(1, 8), 90, 91], 2, context=ctx)).admitted
    led.check()


def test_a_quota_charges_two_branches_one_copy_of_their_shared_partial_tail() -> None:
    """6 tokens (one full block and a partial tail), 2 new tokens, 2 branches: 2 blocks of its own plus one
    copy of the tail for the second branch -- exactly a cap of 3 (the never rule agrees: 3 blocks)."""
    ctx = CacheContext(trust_group="t")
    led = KVLedger(16, BS)
    led.set_quota("t", 3)
    d = led.admit(Request("e", toks(1, 6), 2, context=ctx, branches=2))
    assert d.admitted and (d.blocks_new, d.blocks_promised, d.blocks_branches) == (2, 1, 1)
    assert led.group_usage("t")["t"].charged == 3
    led.check()


def test_an_admitted_decision_reports_its_blocks_and_the_pool_behind_them() -> None:
    led = KVLedger(16, BS)
    run_once(led, "a", toks(1, 8))
    d = led.admit(Request("b", [*toks(1, 8), 70, 71], 3, branches=2))  # 2 hits, tail block new, 2 branches
    assert d.admitted and d.request_id == "b"
    # 4 blocks of its own, 2 for the second branch (its output block and a copy of the partial tail)
    assert d.reason == "2 shared + 1 new + 3 promised = 6 blocks"
    assert d.detail == ("2 shared + 1 new + 3 promised = 6 blocks; 14 can be promised now (14 free + 2 evictable "
                        "- 0 promised - 2 own hits)")
    assert (d.blocks_total, d.blocks_branches) == (4, 2)
    led.check()


def test_a_retention_range_past_the_prompt_covers_the_generated_blocks_too() -> None:
    led = KVLedger(8, BS, policy="priority", clock=lambda: 0.0)
    assert led.admit(Request("a", toks(1, 8), 4, retention=(Retention(4, 100, 90),))).admitted
    led.append_tokens("a", [50, 51, 52, 53])
    led.mark_computed("a", 12)
    blocks = list(led.sequence("a").table.blocks)
    led.release("a")
    assert _retained_order(led, blocks) == [0, 2, 1]  # 35: block 0; 90: blocks 2 and 1, released in that order
    led.check()


def test_cancelling_a_family_drops_the_members_admitted_under_its_name() -> None:
    led = KVLedger(16, BS)
    assert led.admit(Request("f/1", toks(1, 6), 2, family="f")).admitted
    assert led.admit(Request("g", toks(20, 6), 2, branches=2)).admitted
    assert sorted(led.sequences()) == ["f/1", "g", "g/1"]
    assert led.cancel("f") is True and led.cancel("g") is True
    assert led.sequences() == [] and led.usage().free == 16
    led.check()


def test_the_operator_counts_every_admission_and_readmission() -> None:
    led = KVLedger(16, BS)
    for i in range(3):
        assert led.admit(Request(f"a{i}", toks(10 * i, 4), 0)).admitted
    for i in range(2):
        assert led.admit(Request(f"r{i}", toks(100 + 10 * i, 4), 0, readmission=True)).admitted
    assert led.stats()["admissions"] == {"admitted": 3, "readmitted": 2, "not_now": 0, "never": 0}
    led.retract("a0")
    led.retract("r0")
    assert led.stats()["admissions"] == {"admitted": 2, "readmitted": 1, "not_now": 0, "never": 0}


def test_a_never_decision_says_whose_blocks_and_why() -> None:
    led = KVLedger(4, BS)
    d = led.admit(Request("big", toks(1, 10), 4, branches=2))  # 4 blocks + (4 - 2) for the second branch
    assert d.outcome is Outcome.NEVER and d.request_id == "big" and not d.over_quota
    assert d.reason == d.detail == "needs 6 blocks (10 + 4 tokens for 2 branches) but the whole pool has 4"
    assert (d.blocks_total, d.blocks_hit, d.blocks_hit_pending, d.blocks_new, d.blocks_promised,
            d.blocks_branches) == (6, 0, 0, 0, 0, 0)
    ctx = CacheContext(trust_group="t")
    led.set_quota("t", 2)
    q = led.admit(Request("q", toks(1, 10), 0, context=ctx))
    assert q.outcome is Outcome.NEVER and q.request_id == "q" and q.over_quota
    assert q.reason == q.detail == "needs 3 blocks (10 + 0 tokens) but its trust group's quota is 2 blocks"
    assert (q.blocks_total, q.blocks_hit, q.blocks_hit_pending, q.blocks_new, q.blocks_promised,
            q.blocks_branches) == (3, 0, 0, 0, 0, 0)
    assert led.stats()["admissions"]["never"] == 2


def test_as_many_branches_as_the_pool_has_blocks_can_be_admitted() -> None:
    led = KVLedger(4, BS)
    d = led.admit(Request("w", toks(1, 4), 0, branches=4))  # one full block, shared by all four
    assert d.admitted and sorted(led.sequences()) == ["w", "w/1", "w/2", "w/3"]
    too_many = led.admit(Request("v", toks(9, 16), 0, branches=5))  # needs exactly the 4 blocks, but 5 branches
    assert too_many.reason == "asks for 5 branches but the whole pool has 4 blocks"
    led.check()


def test_admit_refuses_an_id_whose_branch_names_are_taken_and_only_those() -> None:
    led = KVLedger(16, BS)
    assert led.admit(Request("x/1", toks(1, 4), 0)).admitted  # a request that happens to be named x/1
    assert led.admit(Request("y/0", toks(9, 4), 0)).admitted  # ... and y/0, which no branch of y is called
    for rid in ("x", "x/1"):
        with pytest.raises(LedgerError) as exc:
            led.admit(Request(rid, toks(20, 4), 0, branches=2 if rid == "x" else 1))
        assert str(exc.value) == f"request id {rid!r} is already running"
    assert led.admit(Request("x", toks(20, 4), 0)).admitted  # one branch: x/1 is not among its names
    assert led.admit(Request("y", toks(30, 4), 0, branches=3)).admitted  # y, y/1, y/2
    assert sorted(led.sequences()) == ["x", "x/1", "y", "y/0", "y/1", "y/2"]
    led.check()


def test_every_not_now_refusal_is_counted() -> None:
    led = KVLedger(2, BS)
    assert led.admit(Request("a", toks(1, 8), 0)).admitted
    for i in range(3):
        assert led.admit(Request(f"b{i}", toks(50, 4), 0)).outcome is Outcome.NOT_NOW
    assert led.stats()["admissions"]["not_now"] == 3


def test_a_request_asked_again_with_a_new_prompt_is_hashed_again() -> None:
    """a is told "not now" (its digests are remembered under its id); asked again under the same id with
    another prompt, its hits are those of the new prompt, never of the remembered one."""
    led = KVLedger(4, BS)
    run_once(led, "c", toks(200, 8))  # two retained blocks
    assert led.admit(Request("h", toks(300, 4), 0)).admitted  # one held: 3 can be promised
    assert led.admit(Request("a", toks(100, 16), 0)).outcome is Outcome.NOT_NOW
    d = led.admit(Request("a", toks(200, 8), 0))
    assert d.admitted and d.blocks_hit == 2 and d.blocks_new == 0
    led.check()


def test_admission_says_what_it_cannot_take() -> None:
    led = KVLedger(4, BS)
    for bad in ("a prompt", {"request_id": "a"}):
        with pytest.raises(ConfigError) as exc:
            led.admit(bad)  # type: ignore[arg-type]
        assert str(exc.value) == f"admission takes a Request, got {type(bad).__name__}"
    with pytest.raises(ConfigError) as exc:
        led.can_admit(Request("e", [], 4))
    assert str(exc.value) == "request 'e' has an empty prompt"
