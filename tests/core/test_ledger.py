"""KVLedger behaviour a user notices: admission numbers, sharing, retention, eviction, growth, errors."""

from __future__ import annotations

import pytest

from kvledger.core.identity import CacheContext
from kvledger.core.ledger import Decision, KVLedger, Outcome, Request
from kvledger.errors import AdmissionError, ConfigError, LedgerError, OutOfBlocksError


def tokens(n: int, start: int = 1000) -> list[int]:
    return list(range(start, start + n))


def snapshot(ledger: KVLedger) -> dict:
    """Everything observable about a ledger, for 'nothing changed' assertions."""
    pool = ledger.pool
    return {
        "usage": ledger.usage(),
        "free": pool.free_blocks(),
        "retained": pool.retained.blocks(),
        "index": dict(pool.index),
        "ref": list(pool.ref),
        "written": list(pool.written),
        "seqs": {
            rid: (list(s.tokens), list(s.table.blocks), s.promised, s.num_computed)
            for rid, s in ((rid, ledger.sequence(rid)) for rid in ledger.sequences())
        },
    }


class EvictionWatch:
    """Blocks that lost their cached identity while retained, in eviction (LRU) order. Observed from
    the pool's state, not from a hook: a hit keeps its digest, an evicted block loses it."""

    def __init__(self, ledger: KVLedger) -> None:
        self.ledger = ledger
        self.evicted: list[int] = []

    def __enter__(self) -> EvictionWatch:
        pool = self.ledger.pool
        self._order = pool.retained.blocks()
        self._digest = {b: pool.digest[b] for b in self._order}
        return self

    def __exit__(self, *exc: object) -> None:
        pool = self.ledger.pool
        self.evicted = [b for b in self._order if pool.digest[b] != self._digest[b]]


def admit(ledger: KVLedger, rid: str, prompt: list[int], max_new: int = 0, **kw) -> Decision:
    decision = ledger.admit(Request(rid, prompt, max_new, **kw))
    ledger.check()
    return decision


def run_to_retained(ledger: KVLedger, rid: str, prompt: list[int], **kw) -> list[int]:
    """Admit, compute and release ``prompt``; return its block table."""
    admit(ledger, rid, prompt, **kw).raise_for_outcome()
    ledger.mark_computed(rid, len(prompt))
    blocks = list(ledger.sequence(rid).table.blocks)
    ledger.release(rid)
    ledger.check()
    return blocks


# ---- the seed's fixed point ----------------------------------------------------------------------

SEED_PROMPT = tokens(2048)
SEED_MAX_NEW = 257  # 2048 + 257 = 2305 tokens -> 145 blocks of 16: 128 prompt + 17 promised


def test_seed_fixed_point_same_trust_group() -> None:
    ledger = KVLedger(256, 16)
    decisions = [admit(ledger, f"r{i}", SEED_PROMPT, SEED_MAX_NEW) for i in range(8)]

    assert [d.outcome for d in decisions] == [Outcome.ADMITTED] * 7 + [Outcome.NOT_NOW]
    first = decisions[0]
    assert (first.blocks_total, first.blocks_hit, first.blocks_hit_pending, first.blocks_new,
            first.blocks_promised) == (145, 0, 0, 128, 17)
    assert first.blocks_charged == 145
    for d in decisions[1:7]:
        # nothing was marked computed: every hit is a block the first request is still filling
        assert (d.blocks_total, d.blocks_hit, d.blocks_hit_pending, d.blocks_new, d.blocks_promised) == (
            145, 128, 128, 0, 17)
        assert d.blocks_charged == 17
    assert decisions[7].reason
    assert not decisions[7].admitted

    u = ledger.usage()
    assert (u.active, u.promised, u.available, u.free, u.retained, u.sequences) == (128, 119, 9, 128, 0, 7)
    assert u.active + u.promised == 247
    tables = {tuple(ledger.sequence(f"r{i}").table.blocks) for i in range(7)}
    assert len(tables) == 1  # all seven share the same 128 physical blocks
    assert "r7" not in ledger.sequences()


def test_seed_fixed_point_distinct_trust_groups() -> None:
    ledger = KVLedger(256, 16)
    decisions = [
        admit(ledger, f"r{i}", SEED_PROMPT, SEED_MAX_NEW, context=CacheContext(trust_group=f"tenant-{i}"))
        for i in range(8)
    ]
    assert [d.outcome for d in decisions] == [Outcome.ADMITTED] + [Outcome.NOT_NOW] * 7
    assert all(d.blocks_hit == 0 for d in decisions)
    u = ledger.usage()
    assert (u.active, u.promised, u.available) == (128, 17, 256 - 145)


def test_seed_request_larger_than_pool_is_never() -> None:
    ledger = KVLedger(256, 16)
    req = Request("huge", tokens(5000), SEED_MAX_NEW)
    before = snapshot(ledger)
    assert ledger.can_admit(req).outcome is Outcome.NEVER
    decision = ledger.admit(req)
    assert decision.outcome is Outcome.NEVER
    assert decision.reason
    assert not decision.admitted
    assert snapshot(ledger) == before
    with pytest.raises(AdmissionError):
        decision.raise_for_outcome()


def test_never_even_when_only_the_declared_maximum_does_not_fit() -> None:
    # the reservation fits, but the declared maximum can never fit: waiting will not help
    ledger = KVLedger(4, 4)
    decision = ledger.admit(Request("r", tokens(8), 16, reserve_new_tokens=0))
    assert decision.outcome is Outcome.NEVER
    assert ledger.sequences() == []


def test_seed_without_sharing_costs_eight_times_145() -> None:
    ledger = KVLedger(2000, 16, prefix_caching=False)
    decisions = [admit(ledger, f"r{i}", SEED_PROMPT, SEED_MAX_NEW) for i in range(8)]
    assert all(d.admitted for d in decisions)
    assert all((d.blocks_hit, d.blocks_new, d.blocks_promised) == (0, 128, 17) for d in decisions)
    u = ledger.usage()
    assert u.active + u.promised == 8 * 145 == 1160
    assert (u.active, u.promised) == (1024, 136)


# ---- release, retention, hits --------------------------------------------------------------------

def test_release_retains_written_full_blocks_and_frees_the_tail() -> None:
    ledger = KVLedger(8, 16)
    admit(ledger, "a", tokens(40), 0).raise_for_outcome()  # 2 full blocks + 8-token tail
    full0, full1, tail = ledger.sequence("a").table.blocks
    ledger.mark_computed("a", 40)
    ledger.release("a")
    ledger.check()
    u = ledger.usage()
    assert (u.active, u.retained, u.free, u.promised, u.sequences) == (0, 2, 6, 0, 0)
    # released tail first: the deeper full block is the first eviction victim
    assert ledger.pool.retained.blocks() == [full1, full0]
    assert tail in ledger.pool.free_blocks()


def test_unwritten_blocks_are_freed_not_retained() -> None:
    ledger = KVLedger(8, 16)
    admit(ledger, "a", tokens(40), 0).raise_for_outcome()
    ledger.mark_computed("a", 20)  # only block 0 is fully written
    first = ledger.sequence("a").table.blocks[0]
    ledger.release("a")
    ledger.check()
    assert ledger.pool.retained.blocks() == [first]
    assert ledger.usage().free == 7


def test_identical_prompt_hits_retained_blocks_and_reactivates_them() -> None:
    ledger = KVLedger(8, 16)
    prompt = tokens(40)
    old = run_to_retained(ledger, "a", prompt)
    before = ledger.usage()
    decision = admit(ledger, "b", prompt, 0)
    assert decision.admitted
    assert (decision.blocks_hit, decision.blocks_hit_pending, decision.blocks_new) == (2, 0, 1)
    blocks = ledger.sequence("b").table.blocks
    assert blocks[:2] == old[:2]
    assert all(ledger.pool.ref[b] == 1 for b in blocks)
    u = ledger.usage()
    assert (u.retained, u.active) == (0, 3)
    assert u.free == before.free - 1  # only the tail was newly allocated
    # the written hits are readable at once
    assert ledger.ready_tokens("b") == 32
    assert ledger.sequence("b").num_computed == 32


def test_hit_on_retained_prefix_of_a_longer_prompt() -> None:
    ledger = KVLedger(16, 4)
    run_to_retained(ledger, "a", tokens(12))
    decision = admit(ledger, "b", tokens(12) + [1, 2, 3, 4, 5], 3)
    assert (decision.blocks_hit, decision.blocks_new, decision.blocks_promised) == (3, 2, 0)
    decision = admit(ledger, "c", tokens(6) + [7, 7, 7, 7], 0)
    assert decision.blocks_hit == 1  # only the first block matches


def test_hits_are_charged_once() -> None:
    ledger = KVLedger(16, 4)
    admit(ledger, "a", tokens(16), 0).raise_for_outcome()
    free = ledger.usage().free
    for i in range(5):
        d = admit(ledger, f"b{i}", tokens(16), 0)
        assert d.admitted and d.blocks_charged == 0 and d.blocks_hit == 4
    assert ledger.usage().free == free
    assert ledger.usage().active == 4
    assert all(ledger.pool.ref[b] == 6 for b in ledger.sequence("a").table.blocks)


# ---- eviction ------------------------------------------------------------------------------------

def test_eviction_only_when_free_is_exhausted_only_retained_lru_tail_first() -> None:
    ledger = KVLedger(6, 4)
    a0, a1 = run_to_retained(ledger, "a", tokens(8, 100))
    b0, b1 = run_to_retained(ledger, "b", tokens(8, 200))
    assert ledger.pool.retained.blocks() == [a1, a0, b1, b0]  # LRU, each request tail first
    assert ledger.usage().free == 2

    # free blocks remain: nothing is evicted
    with EvictionWatch(ledger) as watch:
        admit(ledger, "c", tokens(4, 300), 0).raise_for_outcome()
    assert watch.evicted == []
    assert ledger.pool.retained.blocks() == [a1, a0, b1, b0]

    # one free block left, two needed: exactly one eviction, of the least recently used tail
    with EvictionWatch(ledger) as watch:
        admit(ledger, "d", tokens(8, 400), 0).raise_for_outcome()
    assert watch.evicted == [a1]
    assert a1 in ledger.sequence("d").table.blocks
    assert ledger.pool.retained.blocks() == [a0, b1, b0]
    assert ledger.usage().free == 0
    running = {rid: list(ledger.sequence(rid).table.blocks) for rid in ("c", "d")}

    # a's head block survived eviction and is still a hit; the new block evicts b's tail next
    with EvictionWatch(ledger) as watch:
        decision = admit(ledger, "e", tokens(8, 100), 0)
    assert (decision.blocks_hit, decision.blocks_new) == (1, 1)
    assert ledger.sequence("e").table.blocks == [a0, b1]
    assert watch.evicted == [b1]
    assert ledger.pool.retained.blocks() == [b0]
    # running requests' blocks were never touched
    for rid, blocks in running.items():
        assert ledger.sequence(rid).table.blocks == blocks
        assert all(ledger.pool.ref[b] == 1 for b in blocks)
    # one evictable block left: a request needing two must wait, whatever the LRU order
    assert ledger.admit(Request("f", tokens(8, 600), 0)).outcome is Outcome.NOT_NOW


def test_evicted_blocks_lose_their_identity() -> None:
    ledger = KVLedger(2, 4)
    run_to_retained(ledger, "a", tokens(8, 100))
    admit(ledger, "b", tokens(8, 200), 0).raise_for_outcome()  # evicts both
    ledger.release("b")
    decision = admit(ledger, "c", tokens(8, 100), 0)
    assert decision.blocks_hit == 0


def test_a_request_never_evicts_its_own_hit() -> None:
    ledger = KVLedger(8, 4)
    shared = tokens(16, 100)
    hit_blocks = run_to_retained(ledger, "a", shared)  # 4 retained: the oldest, first in LRU order
    other = run_to_retained(ledger, "x", tokens(8, 500))  # 2 more retained
    assert ledger.usage().free == 2
    assert ledger.pool.retained.blocks() == hit_blocks[::-1] + other[::-1]

    # 7 blocks: 4 hits + 3 new, with only 2 free -> must evict one retained block, but not a hit
    with EvictionWatch(ledger) as watch:
        decision = admit(ledger, "c", shared + tokens(12, 900), 0)
    assert decision.admitted
    assert (decision.blocks_hit, decision.blocks_new) == (4, 3)
    table = ledger.sequence("c").table.blocks
    assert table[:4] == hit_blocks
    assert len(set(table)) == 7
    assert watch.evicted == [other[1]]  # x's tail, not the LRU-older hit blocks
    assert all(ledger.pool.ref[b] == 1 for b in table)
    assert ledger.pool.retained.blocks() == [other[0]]
    assert ledger.ready_tokens("c") == 16


def test_admission_refuses_rather_than_evict_its_own_hit() -> None:
    ledger = KVLedger(8, 4)
    shared = tokens(16, 100)
    run_to_retained(ledger, "a", shared)  # 4 retained
    admit(ledger, "x", tokens(4, 500), 0).raise_for_outcome()  # 1 active, 3 free
    # 8 blocks = 4 hits + 4 new; only 3 free, and the only evictable blocks are its own hits
    req = Request("c", shared + tokens(16, 900), 0)
    before = snapshot(ledger)
    decision = ledger.admit(req)
    assert decision.outcome is Outcome.NOT_NOW
    assert decision.blocks_hit == 4
    assert snapshot(ledger) == before
    ledger.check()


# ---- promises and growth -------------------------------------------------------------------------

def test_promises_materialise_one_block_at_a_time() -> None:
    ledger = KVLedger(8, 4)
    d = admit(ledger, "a", tokens(4), 12)
    assert (d.blocks_total, d.blocks_new, d.blocks_promised) == (4, 1, 3)
    ledger.mark_computed("a", 4)
    seq = ledger.sequence("a")
    history = []
    for i in range(12):
        blocks_before = len(seq.table.blocks)
        ledger.append_token("a", i)
        ledger.check()
        u = ledger.usage()
        assert u.promised == seq.promised
        assert u.active == len(seq.table.blocks)
        assert u.promised + u.active == 4  # promise -> block, never both, never neither
        if len(seq.table.blocks) > blocks_before:
            history.append((i, u.promised))
    # a new block is entered at tokens 4, 8 and 12, i.e. the 1st, 5th and 9th generated token
    assert history == [(0, 2), (4, 1), (8, 0)]
    assert seq.num_generated == 12
    with pytest.raises(LedgerError):
        ledger.append_token("a", 99)
    ledger.release("a")
    assert ledger.usage().promised == 0


def test_release_cancels_unmaterialised_promises() -> None:
    ledger = KVLedger(8, 4)
    admit(ledger, "a", tokens(4), 12).raise_for_outcome()
    ledger.append_tokens("a", [1, 2, 3, 4])  # one promise materialised (block 1)
    assert ledger.usage().promised == 2
    ledger.release("a")
    ledger.check()
    u = ledger.usage()
    # block 0 was confirmed written when token 4 was sampled, so it stays as cache
    assert (u.promised, u.active, u.free, u.retained, u.available) == (0, 0, 7, 1, 8)


def test_growth_beyond_reservation_uses_only_unpromised_capacity() -> None:
    ledger = KVLedger(4, 4)
    d = admit(ledger, "a", tokens(4), 8, reserve_new_tokens=0)
    assert d.admitted and (d.blocks_new, d.blocks_promised) == (1, 0)
    admit(ledger, "b", tokens(4, 50), 4).raise_for_outcome()  # 1 block + 1 promised
    u = ledger.usage()
    assert (u.free, u.promised, u.available) == (2, 1, 1)

    ledger.append_tokens("a", [1, 2, 3, 4])  # enters block 2 from the one unpromised block
    ledger.check()
    assert len(ledger.sequence("a").table.blocks) == 2
    assert ledger.usage().available == 0

    before = snapshot(ledger)
    with pytest.raises(OutOfBlocksError):
        ledger.append_token("a", 5)  # the last free block is promised to b
    ledger.check()
    after = snapshot(ledger)
    assert after["usage"] == before["usage"]
    assert after["free"] == before["free"]
    assert after["seqs"]["a"][:3] == before["seqs"]["a"][:3]  # tokens, blocks, promised
    assert after["seqs"]["b"] == before["seqs"]["b"]
    with pytest.raises(OutOfBlocksError):
        ledger.append_token("a", 5)  # still refused, still consistent
    ledger.check()

    # b's promise is honoured in full
    ledger.append_tokens("b", [1, 2, 3, 4])
    ledger.check()
    assert ledger.usage().free == 0
    # once b is gone, a can grow again
    ledger.release("b")
    ledger.append_tokens("a", [5, 6, 7, 8])
    ledger.check()
    assert ledger.sequence("a").num_generated == 8


def test_growth_beyond_reservation_may_evict_retained_blocks() -> None:
    ledger = KVLedger(3, 4)
    (old,) = run_to_retained(ledger, "r", tokens(4, 700))
    admit(ledger, "a", tokens(4), 8, reserve_new_tokens=0).raise_for_outcome()
    with EvictionWatch(ledger) as watch:
        ledger.append_tokens("a", [1, 2, 3, 4])  # takes the last free block
    assert watch.evicted == []
    with EvictionWatch(ledger) as watch:
        ledger.append_token("a", 5)  # free exhausted: evicts the retained block
    assert watch.evicted == [old]
    assert ledger.sequence("a").table.blocks[-1] == old
    assert ledger.usage().retained == 0
    ledger.check()


def test_partial_reservation_uses_its_promises_first() -> None:
    ledger = KVLedger(8, 4)
    d = admit(ledger, "a", tokens(4), 12, reserve_new_tokens=4)
    assert d.blocks_promised == 1
    ledger.append_token("a", 1)
    assert ledger.usage().promised == 0
    ledger.append_tokens("a", [2, 3, 4, 5])  # beyond the reservation: unpromised capacity
    assert len(ledger.sequence("a").table.blocks) == 3
    ledger.check()


def test_append_beyond_max_new_tokens_is_a_ledger_error() -> None:
    ledger = KVLedger(8, 4)
    admit(ledger, "a", tokens(5), 3).raise_for_outcome()
    ledger.append_tokens("a", [1, 2, 3])
    before = snapshot(ledger)
    with pytest.raises(LedgerError) as info:
        ledger.append_token("a", 4)
    assert not isinstance(info.value, OutOfBlocksError)
    assert snapshot(ledger) == before
    with pytest.raises(LedgerError):
        ledger.decode_step([("a", 4)])
    assert snapshot(ledger) == before
    ledger.check()


def test_max_new_zero_admits_prompt_only_and_refuses_any_token() -> None:
    ledger = KVLedger(8, 4)
    d = admit(ledger, "a", tokens(4), 0)
    assert (d.blocks_total, d.blocks_promised) == (1, 0)
    with pytest.raises(LedgerError):
        ledger.append_token("a", 1)
    assert ledger.sequence("a").tokens == tokens(4)


def test_decode_step_matches_append_token() -> None:
    a, b = KVLedger(32, 4), KVLedger(32, 4)
    for ledger in (a, b):
        admit(ledger, "x", tokens(6), 10).raise_for_outcome()
        admit(ledger, "y", tokens(6), 10).raise_for_outcome()
        admit(ledger, "z", tokens(9, 50), 10).raise_for_outcome()
    for step in range(10):
        a.decode_step([("x", step), ("y", 100 + step), ("z", 200 + step)])
        a.check()
        for rid, tok in (("x", step), ("y", 100 + step), ("z", 200 + step)):
            b.append_token(rid, tok)
        b.check()
        assert snapshot(a) == snapshot(b)
    with pytest.raises(LedgerError):
        a.decode_step([("nope", 1)])


@pytest.mark.parametrize("bad", [1.5, -1, 2**32, "7", None], ids=repr)
@pytest.mark.parametrize("generated", [0, 1], ids=["first-token", "mid-decode"])
def test_decode_step_refuses_bad_token_ids_like_append_token(bad, generated: int) -> None:
    # decode_step is append_token for many sequences: a token id that append_token refuses with
    # ConfigError must be refused the same way, before anything changes -- a non-integer id accepted
    # mid-block would only fail when the block completes, leaving the ledger inconsistent.
    ledger = KVLedger(8, 4)
    admit(ledger, "a", tokens(5), 6).raise_for_outcome()
    ledger.append_tokens("a", [7] * generated)
    with pytest.raises(ConfigError):
        ledger.append_token("a", bad)
    before = snapshot(ledger)
    with pytest.raises(ConfigError):
        ledger.decode_step([("a", bad)])
    assert snapshot(ledger) == before
    ledger.append_tokens("a", [8] * (6 - generated))  # completes block 1, up to max_new
    ledger.check()


# ---- errors and queries --------------------------------------------------------------------------

def test_release_of_unknown_id_is_a_ledger_error() -> None:
    ledger = KVLedger(8, 4)
    with pytest.raises(LedgerError):
        ledger.release("ghost")
    admit(ledger, "a", tokens(4), 0).raise_for_outcome()
    ledger.release("a")
    with pytest.raises(LedgerError):
        ledger.release("a")  # double release
    ledger.check()
    assert ledger.usage().free == 8


def test_operations_on_unknown_id_are_ledger_errors() -> None:
    ledger = KVLedger(8, 4)
    for call in (lambda: ledger.append_token("x", 1), lambda: ledger.mark_computed("x", 1),
                 lambda: ledger.ready_tokens("x"), lambda: ledger.sequence("x")):
        with pytest.raises(LedgerError):
            call()


def test_duplicate_request_id_is_a_ledger_error() -> None:
    ledger = KVLedger(8, 4)
    admit(ledger, "a", tokens(4), 0).raise_for_outcome()
    before = snapshot(ledger)
    with pytest.raises(LedgerError):
        ledger.admit(Request("a", tokens(8, 77), 0))
    assert snapshot(ledger) == before
    ledger.check()


def test_mark_computed_beyond_the_sequence_is_a_ledger_error() -> None:
    ledger = KVLedger(8, 4)
    admit(ledger, "a", tokens(5), 2).raise_for_outcome()
    with pytest.raises(LedgerError):
        ledger.mark_computed("a", 6)
    ledger.check()


def test_can_admit_changes_nothing_and_predicts_admit() -> None:
    ledger = KVLedger(16, 4)
    run_to_retained(ledger, "old", tokens(8))
    admit(ledger, "run", tokens(6, 300), 4).raise_for_outcome()
    requests = [
        Request("hit", tokens(8) + [5, 6], 6),
        Request("big", tokens(40, 900), 8),
        Request("too-big", tokens(80, 900), 8),
        Request("run", tokens(4, 50), 0),  # id already running: can_admit still only predicts
    ]
    for req in requests:
        before = snapshot(ledger)
        predicted = ledger.can_admit(req)
        assert snapshot(ledger) == before
        ledger.check()
        if req.request_id == "run":
            continue
        assert ledger.admit(req) == predicted
        ledger.check()


@pytest.mark.parametrize(
    ("rid", "prompt", "max_new", "kw"),
    [
        ("empty", [], 4, {}),
        ("neg", [1, 2, 3], -1, {}),
        ("reserve-neg", [1, 2, 3], 4, {"reserve_new_tokens": -1}),
        ("reserve-big", [1, 2, 3], 4, {"reserve_new_tokens": 5}),
    ],
    ids=lambda v: v if isinstance(v, str) else "",
)
def test_invalid_requests_are_config_errors(rid: str, prompt: list[int], max_new: int, kw: dict) -> None:
    """A bad request is refused when it is built, or at the latest when it is admitted."""
    ledger = KVLedger(8, 4)
    try:
        request_ = Request(rid, prompt, max_new, **kw)
    except ConfigError:
        return
    with pytest.raises(ConfigError):
        ledger.admit(request_)
    with pytest.raises(ConfigError):
        ledger.can_admit(request_)
    assert ledger.sequences() == []
    ledger.check()


@pytest.mark.parametrize(("num_blocks", "block_size"), [(0, 16), (-1, 16), (8, 0), (8, -4)])
def test_invalid_ledger_geometry_is_a_config_error(num_blocks: int, block_size: int) -> None:
    with pytest.raises(ConfigError):
        KVLedger(num_blocks, block_size)


def test_raise_for_outcome() -> None:
    ledger = KVLedger(4, 4)
    ok = ledger.admit(Request("a", tokens(8), 4))
    assert ok.raise_for_outcome() is ok
    not_now = ledger.admit(Request("b", tokens(8, 50), 4))
    assert not_now.outcome is Outcome.NOT_NOW
    with pytest.raises(AdmissionError, match="b"):
        not_now.raise_for_outcome()
    never = ledger.admit(Request("c", tokens(17), 0))
    assert never.outcome is Outcome.NEVER
    with pytest.raises(AdmissionError):
        never.raise_for_outcome()
    assert ledger.sequences() == ["a"]


def test_usage_as_dict() -> None:
    ledger = KVLedger(10, 4)
    admit(ledger, "a", tokens(6), 6).raise_for_outcome()
    expected = {"total": 10, "free": 8, "active": 2, "retained": 0, "evictable": 0, "promised": 1,
                "available": 7, "sequences": 1}
    as_dict = ledger.usage().as_dict()
    assert {k: as_dict[k] for k in expected} == expected


# ---- pending blocks ------------------------------------------------------------------------------

def test_reader_waits_for_pending_blocks_until_the_filler_marks_them() -> None:
    ledger = KVLedger(8, 16)
    prompt = tokens(40)
    admit(ledger, "filler", prompt, 0).raise_for_outcome()
    d = admit(ledger, "reader", prompt, 0)
    assert (d.blocks_hit, d.blocks_hit_pending, d.blocks_new) == (2, 2, 1)
    assert ledger.ready_tokens("reader") == 0
    ledger.mark_computed("filler", 10)
    assert ledger.ready_tokens("reader") == 0
    ledger.mark_computed("filler", 16)
    assert ledger.ready_tokens("reader") == 16
    ledger.mark_computed("filler", 40)
    assert ledger.ready_tokens("reader") == 32  # the reader's own tail is its own job
    assert ledger.ready_tokens("filler") == 40
    ledger.mark_computed("reader", 40)
    assert ledger.ready_tokens("reader") == 40
    ledger.check()


def test_pending_blocks_outlive_a_filler_released_before_writing() -> None:
    ledger = KVLedger(8, 16)
    prompt = tokens(40)
    admit(ledger, "filler", prompt, 0).raise_for_outcome()
    admit(ledger, "reader", prompt, 0).raise_for_outcome()
    shared = ledger.sequence("reader").table.blocks[:2]
    filler_tail = ledger.sequence("filler").table.blocks[2]
    ledger.release("filler")
    ledger.check()
    # the shared pending blocks are still held by the reader: neither freed nor retained
    u = ledger.usage()
    assert (u.active, u.retained, u.free) == (3, 0, 5)
    for b in shared:
        assert ledger.pool.ref[b] == 1
        assert b not in ledger.pool.free_blocks()
        assert b not in ledger.pool.retained
    assert filler_tail in ledger.pool.free_blocks()
    assert ledger.ready_tokens("reader") == 0

    # a newcomer still finds them, as pending blocks
    d = admit(ledger, "late", prompt, 0)
    assert (d.blocks_hit, d.blocks_hit_pending) == (2, 2)
    ledger.release("late")

    # nobody wrote them: when the reader goes they are freed, not kept as cache
    ledger.release("reader")
    ledger.check()
    u = ledger.usage()
    assert (u.active, u.retained, u.free) == (0, 0, 8)
    assert ledger.pool.index == {}
    assert admit(ledger, "again", prompt, 0).blocks_hit == 0


def test_reader_that_computes_pending_blocks_itself_keeps_them_as_cache() -> None:
    ledger = KVLedger(8, 16)
    prompt = tokens(40)
    admit(ledger, "filler", prompt, 0).raise_for_outcome()
    admit(ledger, "reader", prompt, 0).raise_for_outcome()
    ledger.release("filler")
    ledger.mark_computed("reader", 40)
    assert ledger.ready_tokens("reader") == 40
    ledger.release("reader")
    ledger.check()
    assert ledger.usage().retained == 2
    d = admit(ledger, "again", prompt, 0)
    assert (d.blocks_hit, d.blocks_hit_pending) == (2, 0)


# ---- decode-generated blocks ---------------------------------------------------------------------

@pytest.mark.parametrize(("generated", "expected_hits"), [(9, 4), (8, 3), (5, 3), (4, 2)])
def test_decode_generated_full_blocks_are_indexed(generated: int, expected_hits: int) -> None:
    # prompt: 2 blocks of 4. The block holding the final generated token is never confirmed written
    # (no later token was sampled from it), so it is not offered to later requests.
    ledger = KVLedger(16, 4)
    admit(ledger, "a", tokens(8), 16).raise_for_outcome()
    ledger.mark_computed("a", 8)
    out = [500 + i for i in range(generated)]
    for t in out:
        ledger.append_token("a", t)
        ledger.check()
    full_text = ledger.sequence("a").tokens
    assert full_text == tokens(8) + out
    ledger.release("a")
    ledger.check()
    assert ledger.usage().retained == expected_hits

    d = admit(ledger, "b", full_text + [7], 0)
    assert (d.blocks_hit, d.blocks_hit_pending) == (expected_hits, 0)
    assert ledger.ready_tokens("b") == 4 * expected_hits


def test_decode_generated_blocks_are_shared_with_a_running_follower() -> None:
    ledger = KVLedger(16, 4)
    admit(ledger, "a", tokens(4), 12).raise_for_outcome()
    ledger.mark_computed("a", 4)
    ledger.append_tokens("a", [1, 2, 3, 4, 5])  # block 1 = [1, 2, 3, 4] written once 5 was sampled
    a_blocks = ledger.sequence("a").table.blocks
    d = admit(ledger, "b", tokens(4) + [1, 2, 3, 4, 9], 0)
    assert (d.blocks_hit, d.blocks_hit_pending) == (2, 0)
    assert ledger.sequence("b").table.blocks[:2] == a_blocks[:2]
    ledger.check()


def test_sampling_confirms_the_prompt_for_readers() -> None:
    # append_token: "sampling it means the model has run over every earlier token, so their KV is
    # confirmed written". A reader sharing the filler's prompt block must see that block ready.
    ledger = KVLedger(8, 4)
    prompt = tokens(6)  # one full block + a 2-token tail
    admit(ledger, "filler", prompt, 4).raise_for_outcome()
    d = admit(ledger, "reader", prompt, 4)
    assert (d.blocks_hit, d.blocks_hit_pending) == (1, 1)
    ledger.append_token("filler", 1)  # the engine sampled the first output token
    assert ledger.sequence("filler").num_computed == 6
    assert ledger.ready_tokens("reader") == 4
    ledger.check()


def test_sampling_confirms_the_prompt_for_retention() -> None:
    # a request that finishes without an explicit mark_computed still leaves its (confirmed) prompt
    # blocks as cache: it sampled a token, so every prompt token's KV was written
    ledger = KVLedger(8, 4)
    prompt = tokens(6)
    admit(ledger, "a", prompt, 1).raise_for_outcome()
    ledger.append_token("a", 1)
    ledger.release("a")
    ledger.check()
    assert ledger.usage().retained == 1
    d = admit(ledger, "b", prompt, 0)
    assert (d.blocks_hit, d.blocks_hit_pending) == (1, 0)


def test_refused_requests_do_not_keep_their_digests_forever() -> None:
    """A 'not now' request's prompt digests are remembered for its next attempt; admitted and 'never'
    requests leave nothing behind in that memo."""
    ledger = KVLedger(4, 4)
    big = Request("big", list(range(40)), 1)
    assert ledger.admit(big).outcome is Outcome.NEVER
    ledger.admit(Request("a", list(range(8)), 8)).raise_for_outcome()
    wait = Request("wait", list(range(100, 108)), 8)
    assert ledger.admit(wait).outcome is Outcome.NOT_NOW
    assert set(ledger._admission.remembered()) == {"wait"}
    ledger.release("a")
    ledger.admit(wait).raise_for_outcome()
    assert ledger._admission.remembered() == []
    ledger.check()


def test_keep_free_is_left_available_after_an_admission() -> None:
    """The watermark of non-full policies: an admission must leave ``keep_free`` blocks available."""
    ledger = KVLedger(10, 4)
    req = Request("r", tokens(8), 8)  # 2 prompt blocks + 2 promised
    refused = ledger.admit(req, keep_free=7)
    assert refused.outcome is Outcome.NOT_NOW and "7 kept free" in refused.detail
    assert ledger.can_admit(req, keep_free=6).admitted
    assert ledger.admit(req, keep_free=6).admitted and ledger.usage().available == 6
    ledger.check()
