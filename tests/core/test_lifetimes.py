"""Block lifetimes: forks and copy-on-write tails, beam search, leases, cancellation, pins and token usage.

Every test states the exact block states it expects (block size 16 unless noted) and audits the ledger
with ``check()`` plus the lifetime invariants after every operation."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvledger.core.identity import CacheContext
from kvledger.core.ledger import KVLedger, Outcome, Request
from kvledger.core.types import CopyOp
from kvledger.errors import AdmissionError, ConfigError, LedgerError

BS = 16


def tokens(n: int, start: int = 1000) -> list[int]:
    return list(range(start, start + n))


def audit(ledger: KVLedger) -> None:
    """``check()`` plus the lifetime laws stated from the outside."""
    ledger.check()
    pool, u = ledger.pool, ledger.usage()
    assert u.free + u.active + u.retained == u.total
    free, retained = set(pool.free_blocks()), set(pool.retained.blocks())
    for b in range(pool.num_blocks):
        if pool.leased[b]:
            assert b not in free and b not in retained, f"leased block {b} is free or retained"
    assert u.promised <= u.free + u.evictable
    # Every referenced block is held by a live table or a pin: nothing is held by a dead sequence.
    held = {b for rid in ledger.sequences() for b in ledger.sequence(rid).table.blocks}
    held |= {b for blocks in ledger._pins.held() for b in blocks}
    assert {b for b in range(pool.num_blocks) if pool.ref[b] > 0} == held


def admit(ledger: KVLedger, rid: str, prompt: list[int], max_new: int = 0, **kw):
    decision = ledger.admit(Request(rid, prompt, max_new, **kw))
    audit(ledger)
    return decision


def table(ledger: KVLedger, rid: str) -> list[int]:
    return list(ledger.sequence(rid).table.blocks)


def append(ledger: KVLedger, rid: str, token: int = 7) -> list[CopyOp]:
    ops = ledger.append_token(rid, token)
    audit(ledger)
    return ops


def run_to_retained(ledger: KVLedger, rid: str, prompt: list[int], **kw) -> list[int]:
    admit(ledger, rid, prompt, **kw).raise_for_outcome()
    ledger.mark_computed(rid, len(prompt))
    blocks = table(ledger, rid)
    ledger.release(rid)
    audit(ledger)
    return blocks


# ---- forks and copy-on-write --------------------------------------------------------------------


def _check_four_way_fork(ledger: KVLedger, rids: list[str]) -> None:
    """55 tokens = 3 full blocks + a 7-token tail, max_new 20: each branch needs 1 allowance block
    (tokens 64..74) and 3 of the 4 branches need a copy of the tail: 4 * 1 + 3 = 7 promised."""
    assert rids[0] == "r"
    for rid in rids:
        assert table(ledger, rid) == [0, 1, 2, 3]
        assert ledger.sequence(rid).promised == 1
    assert [ledger.pool.ref[b] for b in range(4)] == [4, 4, 4, 4]
    assert ledger.promises.copies == {3: 3}
    assert ledger.usage().promised == 7
    assert ledger.usage().active == 4

    copies = [append(ledger, rid, 500 + i) for i, rid in enumerate(rids)]
    # The first three writers copy the 7 written slots of the original tail; the last writes in place.
    assert copies == [[CopyOp(3, 4, 7)], [CopyOp(3, 5, 7)], [CopyOp(3, 6, 7)], []]
    assert ledger.take_copies() == [CopyOp(3, 4, 7), CopyOp(3, 5, 7), CopyOp(3, 6, 7)]
    assert ledger.take_copies() == []
    assert [table(ledger, rid) for rid in rids] == [[0, 1, 2, 4], [0, 1, 2, 5], [0, 1, 2, 6], [0, 1, 2, 3]]
    assert [ledger.pool.ref[b] for b in range(7)] == [4, 4, 4, 1, 1, 1, 1]
    assert ledger.promises.copies == {}
    assert ledger.usage().promised == 4  # the copy promises are spent; each branch's allowance remains
    assert ledger.stats()["lifetimes"]["copies"] == 3

    # Growing past the tail spends each branch's own promise; full blocks stay shared.
    for rid in rids:
        ledger.append_tokens(rid, tokens(9, 600))  # 56 -> 65 tokens: crosses the 64 boundary
        audit(ledger)
    assert ledger.usage().promised == 0
    assert [table(ledger, rid)[4] for rid in rids] == [7, 8, 9, 10]
    assert ledger.take_copies() == []
    for rid in rids:
        ledger.release(rid)
        audit(ledger)
    u = ledger.usage()
    assert (u.active, u.promised, u.sequences) == (0, 0, 0)
    # Blocks 0..2 are shared cache; each branch's block 3 filled to 16 tokens with distinct tokens.
    assert sorted(ledger.pool.retained.blocks()) == [0, 1, 2, 3, 4, 5, 6]


def test_request_branches_four_share_full_blocks_and_copy_the_tail_three_times() -> None:
    ledger = KVLedger(32, BS)
    d = admit(ledger, "r", tokens(55), 20, branches=4)
    assert d.admitted
    assert (d.blocks_total, d.blocks_new, d.blocks_promised, d.blocks_branches) == (5, 4, 7, 6)
    assert ledger.sequences() == ["r", "r/1", "r/2", "r/3"]
    _check_four_way_fork(ledger, ["r", "r/1", "r/2", "r/3"])


def test_repeated_fork_equals_request_branches() -> None:
    ledger = KVLedger(32, BS)
    admit(ledger, "r", tokens(55), 20).raise_for_outcome()
    assert ledger.usage().promised == 1
    for i, child in enumerate(["a", "b", "c"], start=1):
        assert ledger.fork("r", child) == 2  # its allowance block + one tail copy
        audit(ledger)
        assert ledger.usage().promised == 1 + 2 * i
        assert ledger.promises.copies == {3: i}
    _check_four_way_fork(ledger, ["r", "a", "b", "c"])


def test_block_aligned_prompt_fork_never_copies() -> None:
    ledger = KVLedger(32, BS)
    d = admit(ledger, "r", tokens(48), 20, branches=4)
    # 68 tokens = 5 blocks; 3 prompt blocks shared; 2 allowance blocks per branch, no tail copies.
    assert (d.blocks_new, d.blocks_promised, d.blocks_branches) == (3, 8, 6)
    assert ledger.promises.copies == {}
    assert ledger.fork("r", "r/x") == 2
    audit(ledger)
    assert ledger.usage().promised == 10
    rids = ["r", "r/1", "r/2", "r/3", "r/x"]
    for i, rid in enumerate(rids):
        assert append(ledger, rid, 900 + i) == []
    assert ledger.take_copies() == []
    assert [table(ledger, rid) for rid in rids] == [[0, 1, 2, 3 + i] for i in range(5)]
    assert ledger.usage().promised == 5
    assert ledger.stats()["lifetimes"]["copies"] == 0


def test_fork_beyond_capacity_raises_and_changes_nothing() -> None:
    ledger = KVLedger(6, BS)
    admit(ledger, "r", tokens(40), 20).raise_for_outcome()  # 3 blocks + 1 promised (60 -> 4 blocks)
    assert ledger.fork("r", "f") == 2
    audit(ledger)
    before = (ledger.usage(), dict(ledger.promises.copies), list(ledger.pool.ref))
    with pytest.raises(AdmissionError):
        ledger.fork("r", "g")  # needs 2, only 6 - 3 - 3 = 0 available
    audit(ledger)
    assert (ledger.usage(), dict(ledger.promises.copies), list(ledger.pool.ref)) == before


# ---- beam search ----------------------------------------------------------------------------------


def test_beam_search_width_four_prunes_only_dead_exclusive_blocks() -> None:
    ledger = KVLedger(64, BS)
    # 30 tokens: block 0 full, block 1 holds 14. max_new 40 -> 70 tokens = 5 blocks, 3 allowance each.
    d = admit(ledger, "beam", tokens(30), 40, branches=4)
    assert (d.blocks_new, d.blocks_promised) == (2, 3 + 3 * 4)
    beams = ["beam", "beam/1", "beam/2", "beam/3"]
    for i, rid in enumerate(beams):
        append(ledger, rid, 10 + i)
    assert [table(ledger, r) for r in beams] == [[0, 2], [0, 3], [0, 4], [0, 1]]
    assert ledger.usage().promised == 12

    # Step: beam/2 and beam/3 die, beam and beam/1 each spawn one continuation.
    lease = ledger.lease(request_ids=["beam/2"])  # an in-flight step still reads the dying beam/2
    ledger.beam_step([("beam", "beam.a"), ("beam/1", "beam/1.a")], ["beam/2", "beam/3"])
    audit(ledger)
    live = ["beam", "beam/1", "beam.a", "beam/1.a"]
    assert sorted(ledger.sequences()) == sorted(live)
    assert ledger.pool.ref[0] == 4  # shared with the survivors: stays
    assert ledger.pool.ref[1] == 0 and 1 in ledger.pool.free_blocks()  # beam/3's exclusive tail: freed
    assert ledger.pool.ref[4] == 0 and ledger.pool.leased[4] == 1  # beam/2's: deferred by the lease
    assert ledger.usage().deferred == 1 and 4 not in ledger.pool.free_blocks()
    assert ledger.pool.ref[2] == 2 and ledger.pool.ref[3] == 2  # forked tails (31 tokens, partial)
    assert ledger.promises.copies == {2: 1, 3: 1}
    # 4 beams x 3 allowance blocks + 2 tail copies.
    assert ledger.usage().promised == 14
    ledger.end_lease(lease)
    audit(ledger)
    assert ledger.usage().deferred == 0 and 4 in ledger.pool.free_blocks()

    # Two more steps: write token 31 (copy-on-write), then token 32 (a boundary: a new block each).
    for step in range(2):
        for i, rid in enumerate(live):
            append(ledger, rid, 100 * step + i)
    assert ledger.promises.copies == {}
    assert ledger.usage().promised == 4 * 2 + 0
    heads = {tuple(table(ledger, r)[:2]) for r in live}
    assert len(heads) == 4  # every beam now owns its block 1 (distinct tokens)
    assert all(table(ledger, r)[0] == 0 for r in live)

    # Prune to one beam: dropped beams' full blocks become cache, shared block 0 stays held.
    ledger.beam_step([], ["beam/1", "beam.a", "beam/1.a"])
    audit(ledger)
    assert ledger.sequences() == ["beam"]
    assert ledger.pool.ref[0] == 1
    survivor = table(ledger, "beam")
    assert all(ledger.pool.ref[b] == 1 for b in survivor)
    assert ledger.usage().active == 3  # block 0, its block 1, its block 2
    assert ledger.usage().retained == 3  # the dead beams' full block 1s (written, indexed)
    assert ledger.usage().promised == 2
    ledger.release("beam")
    audit(ledger)
    assert (ledger.usage().active, ledger.usage().promised) == (0, 0)


def test_beam_step_dropping_a_beam_releases_only_its_exclusive_blocks() -> None:
    ledger = KVLedger(32, BS)
    admit(ledger, "b", tokens(40), 24).raise_for_outcome()  # blocks 0,1 full; block 2 holds 8
    ledger.mark_computed("b", 40)
    assert ledger.fork("b", "c") == 2
    audit(ledger)
    append(ledger, "c", 1)  # c copies the tail: c = [0, 1, 3]
    assert table(ledger, "c") == [0, 1, 3]
    ledger.beam_step([], ["c"])
    audit(ledger)
    assert ledger.pool.ref[:4] == [1, 1, 1, 0]
    assert 3 in ledger.pool.free_blocks()
    assert ledger.usage().retained == 0  # shared full blocks are still held by b
    assert ledger.usage().promised == 1


def test_beam_step_rejects_a_child_name_twice() -> None:
    """Two forks to the same new child in one beam step must be refused before anything changes
    (otherwise the second fork overwrites the first child and its references and promises leak)."""
    ledger = KVLedger(32, BS)
    admit(ledger, "b", tokens(55), 20).raise_for_outcome()
    before = (ledger.usage(), list(ledger.pool.ref), dict(ledger.promises.copies))
    with pytest.raises(LedgerError):
        ledger.beam_step([("b", "x"), ("b", "x")], [])
    audit(ledger)
    assert (ledger.usage(), list(ledger.pool.ref), dict(ledger.promises.copies)) == before


def test_beam_step_rejects_a_drop_named_twice() -> None:
    """A beam step that names the same dropped beam twice must be refused before anything changes.
    Bug (branches.py Branches.beam_step): drops are validated one by one against the running set, then
    dropped in a loop, so the first drop happens and the second raises LedgerError("unknown
    sequence"): the caller gets an error although beam "b/1" is already gone."""
    ledger = KVLedger(32, BS)
    admit(ledger, "b", tokens(55), 20, branches=2).raise_for_outcome()
    before = (ledger.usage(), list(ledger.pool.ref), dict(ledger.promises.copies), ledger.sequences())
    with pytest.raises(LedgerError):
        ledger.beam_step([], ["b/1", "b/1"])
    audit(ledger)
    assert (ledger.usage(), list(ledger.pool.ref), dict(ledger.promises.copies), ledger.sequences()) == before


# ---- leases and cancellation ------------------------------------------------------------------------


def test_cancel_of_leased_request_defers_its_blocks_until_end_lease() -> None:
    ledger = KVLedger(8, BS)
    admit(ledger, "r", tokens(40), 24).raise_for_outcome()  # 3 blocks + 1 promised (64 tokens)
    ledger.mark_computed("r", 40)
    audit(ledger)
    lease = ledger.lease(request_ids=["r"])
    audit(ledger)
    assert ledger.cancel("r") is True
    audit(ledger)
    u = ledger.usage()
    # Promises go at once; the blocks stay active (deferred) while the in-flight step holds them.
    assert (u.free, u.active, u.retained, u.deferred, u.promised, u.sequences) == (5, 3, 0, 3, 0, 0)
    for b in (0, 1, 2):
        assert b not in ledger.pool.free_blocks()
    assert ledger.stats()["lifetimes"]["pending_releases"] == 3
    # A new admission cannot use them: 6 new blocks do not fit in 5.
    assert admit(ledger, "n", tokens(96, 5000)).outcome is Outcome.NOT_NOW
    assert admit(ledger, "m", tokens(80, 5000)).admitted
    assert set(table(ledger, "m")).isdisjoint({0, 1, 2})
    ledger.release("m")  # unwritten: freed
    audit(ledger)
    ledger.end_lease(lease)
    audit(ledger)
    u = ledger.usage()
    # The written full blocks 0 and 1 are cache now; the partial tail is freed.
    assert (u.free, u.active, u.retained, u.deferred) == (6, 0, 2, 0)
    assert sorted(ledger.pool.retained.blocks()) == [0, 1]
    with pytest.raises(LedgerError):
        ledger.end_lease(lease)
    audit(ledger)


def test_leased_cancelled_prefix_can_be_hit_again_before_the_lease_ends() -> None:
    ledger = KVLedger(8, BS)
    admit(ledger, "r", tokens(32), 0).raise_for_outcome()
    ledger.mark_computed("r", 32)
    lease = ledger.lease(request_ids=["r"])
    ledger.cancel("r")
    audit(ledger)
    assert ledger.usage().deferred == 2
    d = admit(ledger, "s", tokens(40), 0)
    assert (d.blocks_hit, d.blocks_new) == (2, 1)
    assert table(ledger, "s") == [0, 1, 2]
    assert ledger.usage().deferred == 0
    ledger.end_lease(lease)
    audit(ledger)
    assert ledger.pool.ref[:3] == [1, 1, 1]


def test_lease_of_an_unheld_block_is_refused() -> None:
    ledger = KVLedger(4, BS)
    run_to_retained(ledger, "r", tokens(16))
    with pytest.raises(LedgerError):
        ledger.lease(blocks=[0])  # retained: nobody holds it
    with pytest.raises(LedgerError):
        ledger.lease(blocks=[3])  # free
    audit(ledger)
    assert ledger.outstanding_leases() == 0


def test_leases_name_their_owner_and_are_listed_until_they_end() -> None:
    """A scheduler audits that every outstanding lease belongs to a step still in flight."""
    ledger = KVLedger(8, BS)
    admit(ledger, "r", tokens(20), 4).raise_for_outcome()
    step = ledger.lease(request_ids=["r"], owner="step-7")
    copy = ledger.lease(blocks=[0, 1], owner="swap-out-3")
    anonymous = ledger.lease(request_ids=["r"])
    assert ledger.leases() == {step: "step-7", copy: "swap-out-3", anonymous: ""}
    ledger.end_lease(step)
    assert ledger.leases() == {copy: "swap-out-3", anonymous: ""}
    ledger.release("r")  # deferred until both remaining leases end
    ledger.end_lease(copy)
    ledger.end_lease(anonymous)
    assert ledger.leases() == {} and ledger.outstanding_leases() == 0
    audit(ledger)


@pytest.mark.parametrize(("kwargs", "error"), [
    ({"blocks": [10**9]}, ConfigError),
    ({"blocks": [-1]}, ConfigError),
    ({"blocks": [True]}, ConfigError),
    ({"blocks": [0, 2.0]}, ConfigError),
    ({"blocks": [0, 3]}, LedgerError),  # block 3 is free: only the good block 0 before it
    ({"request_ids": "r"}, ConfigError),  # a string is not a list of ids
    ({"request_ids": ["r", "ghost"]}, LedgerError),
    ({"request_ids": ["r"], "owner": 7}, ConfigError),
    ({"request_ids": ["r"], "owner": None}, ConfigError),
])
def test_a_refused_lease_leases_nothing(kwargs: dict, error: type[Exception]) -> None:
    ledger = KVLedger(4, BS)
    admit(ledger, "r", tokens(8), 0).raise_for_outcome()
    before = (list(ledger.pool.leased), ledger.leases())
    with pytest.raises(error):
        ledger.lease(**kwargs)
    assert (list(ledger.pool.leased), ledger.leases()) == before
    assert not ledger.is_leased("r")
    audit(ledger)


def test_cancel_unknown_request_is_a_no_op() -> None:
    ledger = KVLedger(8, BS)
    assert ledger.cancel("never-admitted") is False
    admit(ledger, "r", tokens(20), 10).raise_for_outcome()
    before = ledger.usage()
    assert ledger.cancel("r/1") is False  # not a branch of r: no such sequence
    assert ledger.usage() == before
    assert ledger.cancel("r") is True
    assert ledger.cancel("r") is False
    audit(ledger)
    assert ledger.stats()["lifetimes"]["cancelled"] == 1


def test_cancel_frees_promises_at_once() -> None:
    ledger = KVLedger(16, BS)
    admit(ledger, "r", tokens(20), 100, branches=2).raise_for_outcome()
    # 120 tokens = 8 blocks; 2 prompt blocks; own 6 + branch (6 + 1 tail copy) = 13 promised.
    assert ledger.usage().promised == 13
    assert admit(ledger, "x", tokens(32, 9000), 0).outcome is Outcome.NOT_NOW  # 2 > 16 - 2 - 13
    assert ledger.cancel("r") is True
    audit(ledger)
    assert ledger.usage().promised == 0
    assert ledger.promises.copies == {}
    assert admit(ledger, "x", tokens(32, 9000), 0).admitted


def test_cancel_a_pending_reader_leaves_the_filler_alone() -> None:
    ledger = KVLedger(16, BS)
    filler = tokens(40)
    admit(ledger, "a", filler, 8).raise_for_outcome()  # blocks 0,1 (indexed, pending) + 2 (partial)
    reader = filler[:32] + tokens(20, 7000)
    d = admit(ledger, "b", reader, 8)
    assert (d.blocks_hit, d.blocks_hit_pending, d.blocks_new) == (2, 2, 2)
    assert table(ledger, "b") == [0, 1, 3, 4]
    assert ledger.ready_tokens("b") == 0
    assert ledger.cancel("b") is True
    audit(ledger)
    assert ledger.pool.ref[:5] == [1, 1, 1, 0, 0]
    assert {3, 4} <= set(ledger.pool.free_blocks())
    assert ledger.pool.written[:2] == [False, False]
    assert ledger.pool.index.get(ledger.sequence("a").digests[0]) == 0  # still indexed, still pending
    # The filler keeps going and its blocks become cache as normal.
    ledger.mark_computed("a", 40)
    audit(ledger)
    ledger.append_tokens("a", tokens(8, 8000))
    audit(ledger)
    assert ledger.ready_tokens("a") == 47
    ledger.mark_computed("a", 48)
    ledger.release("a")
    audit(ledger)
    assert ledger.pool.retained.blocks() == [2, 1, 0]  # 48 tokens written: three full blocks
    d = admit(ledger, "b2", reader, 8)
    assert (d.blocks_hit, d.blocks_hit_pending) == (2, 0)


def test_cancel_mid_decode_keeps_written_blocks_as_cache() -> None:
    ledger = KVLedger(16, BS)
    prompt = tokens(40)
    admit(ledger, "r", prompt, 40).raise_for_outcome()  # 80 tokens = 5 blocks: 3 + 2 promised
    ledger.mark_computed("r", 40)
    generated = tokens(30, 3000)
    for t in generated:
        append(ledger, "r", t)
    assert table(ledger, "r") == [0, 1, 2, 3, 4]
    assert ledger.usage().promised == 0
    assert ledger.cancel("r") is True
    audit(ledger)
    # 70 tokens, of which 69 are written: blocks 0..3 are full and written, block 4 is partial.
    assert ledger.pool.retained.blocks() == [3, 2, 1, 0]
    assert 4 in ledger.pool.free_blocks()
    d = admit(ledger, "again", prompt + generated, 0)
    assert (d.blocks_hit, d.blocks_new) == (4, 1)


def test_cancel_family_mid_fork_drops_every_branch() -> None:
    ledger = KVLedger(32, BS)
    prompt = tokens(55)
    admit(ledger, "a", prompt, 20, branches=3).raise_for_outcome()
    assert ledger.usage().promised == 1 + 2 * 2
    assert append(ledger, "a/1", 1) == [CopyOp(3, 4, 7)]
    # Cancelling one branch by its own id drops only it (its copy is freed, its promise returned).
    assert ledger.cancel("a/1") is True
    audit(ledger)
    assert sorted(ledger.sequences()) == ["a", "a/2"]
    assert 4 in ledger.pool.free_blocks()
    assert ledger.promises.copies == {3: 1}
    assert ledger.usage().promised == 3
    # Parent cancelled while its children copy: forks made with fork() belong to the family too.
    assert ledger.fork("a", "child") == 2
    audit(ledger)
    assert append(ledger, "child", 2) == [CopyOp(3, 4, 7)]  # the freed copy block is reused first
    assert ledger.cancel("a") is True
    audit(ledger)
    u = ledger.usage()
    assert (u.sequences, u.active, u.promised) == (0, 0, 0)
    assert ledger.promises.copies == {}
    assert ledger.pool.retained.blocks() == [2, 1, 0]  # the written full prompt blocks
    assert ledger.cancel("a") is False
    assert ledger.cancel("a/2") is False
    d = admit(ledger, "same", prompt, 0)
    assert (d.blocks_hit, d.blocks_new) == (3, 1)
    assert table(ledger, "same")[:3] == [0, 1, 2]


def test_cancel_parent_made_by_fork_families() -> None:
    ledger = KVLedger(32, BS)
    admit(ledger, "p", tokens(55), 20).raise_for_outcome()
    ledger.fork("p", "c1")
    ledger.fork("p", "c2")
    audit(ledger)
    assert append(ledger, "c1", 3) == [CopyOp(3, 4, 7)]
    ledger.fork("c1", "c1.x")  # a grandchild: still family "p"
    audit(ledger)
    assert ledger.cancel("p") is True
    audit(ledger)
    assert ledger.sequences() == []
    assert ledger.usage().promised == 0 and ledger.usage().active == 0


# ---- pins ----------------------------------------------------------------------------------------


def test_pinned_prefix_survives_heavy_pressure_and_counts_as_used() -> None:
    ledger = KVLedger(8, BS)  # pin limit: int(0.25 * 8) = 2 blocks
    ctx = CacheContext(trust_group="t")
    system = tokens(32, 100)
    assert run_to_retained(ledger, "s", system, context=ctx) == [0, 1]
    assert ledger.pin("sys", system, ctx) == 2
    audit(ledger)
    u = ledger.usage()
    assert (u.pinned, u.active, u.retained, u.free) == (2, 2, 0, 6)
    digests = [ledger.pool.digest[0], ledger.pool.digest[1]]
    # Heavy pressure: every request fills all 6 unpinned blocks and is cached, then evicted again.
    for i in range(12):
        run_to_retained(ledger, f"w{i}", tokens(96, 10_000 + 100 * i), context=ctx)
        assert [ledger.pool.digest[0], ledger.pool.digest[1]] == digests
        assert ledger.pool.ref[:2] == [1, 1]
    assert ledger.stats()["lifetimes"]["evictions"] == 66
    # A request that would fit only by evicting pinned blocks waits.
    assert admit(ledger, "big", tokens(112, 50_000), context=ctx).outcome is Outcome.NOT_NOW
    assert admit(ledger, "fits", tokens(96, 50_000), context=ctx).admitted
    ledger.release("fits")
    audit(ledger)
    d = admit(ledger, "hit", system + [1], context=ctx)
    assert (d.blocks_hit, d.blocks_hit_pending) == (2, 0)
    ledger.release("hit")
    audit(ledger)
    # Unpinning makes the prefix ordinary cache again.
    ledger.unpin("sys")
    audit(ledger)
    u = ledger.usage()
    assert (u.pinned, u.active) == (0, 0)
    assert {0, 1} <= set(ledger.pool.retained.blocks())
    with pytest.raises(LedgerError):
        ledger.unpin("sys")


def test_pin_limit_raises_admission_error_and_changes_nothing() -> None:
    ledger = KVLedger(8, BS)
    ctx = CacheContext()
    run_to_retained(ledger, "s", tokens(32))
    run_to_retained(ledger, "t", tokens(16, 5000))
    assert ledger.pin("s", tokens(32), ctx) == 2
    before = (ledger.usage(), list(ledger.pool.ref), ledger.pins())
    with pytest.raises(AdmissionError):
        ledger.pin("t", tokens(16, 5000), ctx)
    audit(ledger)
    assert (ledger.usage(), list(ledger.pool.ref), ledger.pins()) == before
    with pytest.raises(LedgerError):
        ledger.pin("s", tokens(32), ctx)  # name taken
    assert ledger.pin("nothing-cached", tokens(32, 70_000), ctx) == 0
    audit(ledger)
    ledger.unpin("s")
    ledger.unpin("nothing-cached")
    audit(ledger)
    assert ledger.usage().retained == 3


def test_pin_survives_clear_cache() -> None:
    ledger = KVLedger(8, BS)
    run_to_retained(ledger, "s", tokens(32))
    run_to_retained(ledger, "t", tokens(16, 5000))
    ledger.pin("s", tokens(32), CacheContext())
    assert ledger.clear_cache() == 1
    audit(ledger)
    assert ledger.usage().pinned == 2 and ledger.pool.digest[0] is not None


# ---- token usage ---------------------------------------------------------------------------------


def test_token_usage_counts_half_full_blocks_by_their_tokens() -> None:
    ledger = KVLedger(8, BS)
    admit(ledger, "r", tokens(24), 8).raise_for_outcome()
    assert ledger.token_usage() == {
        "token_slots_held": 32, "token_slots_used": 24, "tail_slack_slots": 8, "retained_token_slots": 0}
    ledger.fork("r", "f")
    audit(ledger)
    assert ledger.token_usage()["token_slots_used"] == 24  # shared blocks count once
    append(ledger, "f", 1)  # f copies the tail: f holds 25 tokens in [0, 2]
    assert ledger.token_usage() == {
        "token_slots_held": 48, "token_slots_used": 16 + 8 + 9, "tail_slack_slots": 15,
        "retained_token_slots": 0}
    ledger.release("f")
    ledger.mark_computed("r", 24)
    ledger.release("r")
    audit(ledger)
    assert ledger.token_usage() == {
        "token_slots_held": 0, "token_slots_used": 0, "tail_slack_slots": 0, "retained_token_slots": 16}


# ---- random lifetimes ------------------------------------------------------------------------------

GROUPS = ("g0", "g1", "g2")


class LifetimeMachine(RuleBasedStateMachine):
    """Random admissions (with branches and lookahead), writes, forks, speculative slots, leases,
    cancels, beam prunes, family preemption and re-admission, pins, cache clears and resets. Full
    reservation throughout, so no write may ever run out of blocks."""

    def __init__(self) -> None:
        super().__init__()
        self.ledger: KVLedger | None = None
        self.leases: list[int] = []
        self.pins: list[str] = []
        self.lookahead: dict[str, int] = {}  # family -> lookahead slots it reserved at admission
        self.n = 0

    @initialize(bs=st.sampled_from([2, 4, 16]), num_blocks=st.integers(8, 32), data=st.data())
    def setup(self, bs: int, num_blocks: int, data: st.DataObject) -> None:
        self.bs = bs
        self.ledger = KVLedger(num_blocks, bs, max_pinned_fraction=0.5)
        self.prefixes = data.draw(
            st.lists(st.lists(st.integers(0, 7), min_size=1, max_size=3 * bs), min_size=1, max_size=3),
            label="prefixes")

    def _name(self, stem: str) -> str:
        self.n += 1
        return f"{stem}{self.n}"

    def _live(self) -> list[str]:
        return sorted(self.ledger.sequences())

    # ---- moves --------------------------------------------------------------------------------
    @rule(group=st.sampled_from(GROUPS), which=st.integers(0, 2),
          extra=st.lists(st.integers(0, 7), max_size=20),
          max_new=st.integers(0, 12), branches=st.integers(1, 3), lookahead=st.sampled_from([0, 0, 1, 3]))
    def admit(self, group: str, which: int, extra: list[int], max_new: int, branches: int, lookahead: int) -> None:
        prompt = self.prefixes[which % len(self.prefixes)] + extra
        rid = self._name("r")
        before = self.ledger.usage()
        request = Request(rid, prompt, max_new, CacheContext(trust_group=group), branches=branches,
                          lookahead=lookahead)
        d = self.ledger.admit(request)
        self.lookahead[rid] = lookahead
        if d.admitted:
            assert rid in self.ledger
            assert all(f"{rid}/{i}" in self.ledger for i in range(1, branches))
        else:
            assert self.ledger.usage() == before

    @precondition(lambda self: self.ledger and self.ledger.sequences())
    @rule(data=st.data())
    def mark_computed(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(self._live()), label="rid")
        n = data.draw(st.integers(0, self.ledger.sequence(rid).num_tokens), label="n")
        self.ledger.mark_computed(rid, n)

    @precondition(lambda self: self.ledger and self.ledger.sequences())
    @rule(data=st.data(), count=st.integers(1, 6))
    def append(self, data: st.DataObject, count: int) -> None:
        rid = data.draw(st.sampled_from(self._live()), label="rid")
        seq = self.ledger.sequence(rid)
        for _ in range(min(count, seq.limit - seq.num_tokens)):
            at = seq.num_tokens // self.bs  # the block the token lands in (speculative blocks may follow)
            tail = seq.table.blocks[at] if seq.num_tokens % self.bs else None
            shared = tail is not None and self.ledger.pool.ref[tail] > 1
            ops = self.ledger.append_token(rid, data.draw(st.integers(0, 7), label="token"))
            if shared:
                assert len(ops) == 1 and ops[0].src == tail and ops[0].dst == seq.table.blocks[at]
            else:
                assert ops == []
        self.ledger.take_copies()

    @precondition(lambda self: self.ledger and self.ledger.sequences())
    @rule(data=st.data())
    def fork(self, data: st.DataObject) -> None:
        parent = data.draw(st.sampled_from(self._live()), label="parent")
        before = self.ledger.usage()
        try:
            self.ledger.fork(parent, self._name(parent + "."))
        except AdmissionError:
            assert self.ledger.usage() == before

    @precondition(lambda self: self.ledger and self.ledger.sequences())
    @rule(data=st.data())
    def lease(self, data: st.DataObject) -> None:
        rids = data.draw(st.lists(st.sampled_from(self._live()), max_size=3, unique=True), label="rids")
        pool = self.ledger.pool
        held = [b for b in range(pool.num_blocks) if pool.ref[b] or pool.leased[b]]
        extra = data.draw(st.lists(st.sampled_from(held), max_size=2), label="blocks")
        self.leases.append(self.ledger.lease(request_ids=rids, blocks=extra))

    @precondition(lambda self: self.leases)
    @rule(data=st.data())
    def end_lease(self, data: st.DataObject) -> None:
        i = data.draw(st.integers(0, len(self.leases) - 1), label="lease")
        self.ledger.end_lease(self.leases.pop(i))

    @precondition(lambda self: self.ledger and self.ledger.sequences())
    @rule(data=st.data(), family=st.booleans())
    def cancel(self, data: st.DataObject, family: bool) -> None:
        rid = data.draw(st.sampled_from(self._live()), label="rid")
        target = self.ledger.sequence(rid).family if family else rid
        expected = {r for r in self._live() if r == target or self.ledger.sequence(r).family == target}
        assert self.ledger.cancel(target) is bool(expected)
        assert expected.isdisjoint(self.ledger.sequences())
        assert self.ledger.cancel("no-such-request") is False

    @precondition(lambda self: self.ledger and self.ledger.sequences())
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        self.ledger.release(data.draw(st.sampled_from(self._live()), label="rid"))

    @precondition(lambda self: self.ledger and len(self.ledger.sequences()) >= 2)
    @rule(data=st.data())
    def beam_prune(self, data: st.DataObject) -> None:
        live = self._live()
        drops = data.draw(st.lists(st.sampled_from(live), min_size=1, max_size=len(live) - 1, unique=True),
                          label="drops")
        survivors = [r for r in live if r not in drops]
        parents = data.draw(st.lists(st.sampled_from(survivors), max_size=2), label="parents")
        forks = [(p, self._name(p + "~")) for p in parents]
        try:
            self.ledger.beam_step(forks, drops)
        except AdmissionError:
            assert not any(child in self.ledger for _, child in forks)  # the forks did not fit
        else:
            assert all(child in self.ledger for _, child in forks)
            assert set(drops).isdisjoint(self.ledger.sequences())
        assert set(survivors) <= set(self.ledger.sequences())

    @precondition(lambda self: self.ledger and self.ledger.sequences())
    @rule(data=st.data(), trim=st.booleans())
    def speculate(self, data: st.DataObject, trim: bool) -> None:
        """Draft slots within the reservation come from the promise; a trim gives back what it can."""
        rid = data.draw(st.sampled_from(self._live()), label="rid")
        seq = self.ledger.sequence(rid)
        slots = data.draw(st.integers(0, self.lookahead.get(seq.family, 0)), label="slots")
        if seq.num_tokens + slots > seq.limit + self.lookahead.get(seq.family, 0):
            return
        self.ledger.reserve_lookahead(rid, slots)  # within the reservation: never OutOfBlocksError
        assert len(seq.table.blocks) >= -(-(seq.num_tokens + slots) // self.bs)
        if trim:
            self.ledger.trim_lookahead(rid)

    @precondition(lambda self: self.ledger and self.ledger.sequences())
    @rule(data=st.data())
    def preempt_and_readmit_family(self, data: st.DataObject) -> None:
        """Preempt every branch of a family and bring it back whole, or change nothing and wait."""
        rid = data.draw(st.sampled_from(self._live()), label="rid")
        family = self.ledger.sequence(rid).family
        members = [r for r in self._live() if self.ledger.sequence(r).family == family]
        seqs = {r: self.ledger.sequence(r) for r in members}
        requests = [Request(r, s.tokens, s.limit - s.num_tokens, s.context, family=family, readmission=True,
                            lookahead=self.lookahead.get(family, 0)) for r, s in seqs.items()]
        for r in members:
            self.ledger.preempt(r)
        audit(self.ledger)
        before = (self.ledger.usage(), dict(self.ledger.pool.index), self.ledger.pool.retained.blocks(),
                  self.ledger.stats()["prefix_cache_readmissions"])
        d = self.ledger.admit_family(requests)
        if d.admitted:
            assert set(members) <= set(self.ledger.sequences())
            for r in members:
                assert self.ledger.sequence(r).tokens == list(seqs[r].tokens)
        else:
            after = (self.ledger.usage(), dict(self.ledger.pool.index), self.ledger.pool.retained.blocks(),
                     self.ledger.stats()["prefix_cache_readmissions"])
            assert after == before

    @rule()
    def reset_prefix_cache(self) -> None:
        u = self.ledger.usage()
        busy = u.sequences or u.pinned or self.leases or u.deferred
        before = (dict(self.ledger.pool.index), self.ledger.pool.retained.blocks())
        result = self.ledger.reset_prefix_cache()
        assert result.done is (not busy)
        if busy:
            assert (dict(self.ledger.pool.index), self.ledger.pool.retained.blocks()) == before
        else:
            assert self.ledger.pool.index == {} and self.ledger.usage().free == u.total

    @precondition(lambda self: self.ledger and self.ledger.pool.index)
    @rule(group=st.sampled_from(GROUPS), which=st.integers(0, 2))
    def pin(self, group: str, which: int) -> None:
        name = self._name("pin")
        before = self.ledger.usage()
        try:
            self.ledger.pin(name, self.prefixes[which % len(self.prefixes)], CacheContext(trust_group=group))
        except AdmissionError:
            assert self.ledger.usage() == before
        else:
            self.pins.append(name)

    @precondition(lambda self: self.pins)
    @rule(data=st.data())
    def unpin(self, data: st.DataObject) -> None:
        i = data.draw(st.integers(0, len(self.pins) - 1), label="pin")
        self.ledger.unpin(self.pins.pop(i))

    @precondition(lambda self: self.ledger and self.ledger.usage().retained)
    @rule()
    def evict(self) -> None:
        retained = self.ledger.usage().retained
        assert self.ledger.clear_cache() == retained
        assert self.ledger.usage().retained == 0

    # ---- invariants ---------------------------------------------------------------------------
    @invariant()
    def laws(self) -> None:
        if self.ledger is not None:
            audit(self.ledger)

    def teardown(self) -> None:
        ledger = self.ledger
        if ledger is None:
            return
        for lease in self.leases:
            ledger.end_lease(lease)
        for rid in ledger.sequences():
            ledger.release(rid)
        for name in self.pins:
            ledger.unpin(name)
        audit(ledger)
        u = ledger.usage()
        assert (u.active, u.promised, u.deferred, u.sequences, u.pinned) == (0, 0, 0, 0, 0)
        assert ledger.promises.copies == {}
        assert ledger.outstanding_leases() == 0
        assert u.free + u.retained == u.total


# Examples, seeds and shrinking come from the profile (tests/conftest.py): derandomised in `make test`.
LifetimeMachine.TestCase.settings = settings(
    stateful_step_count=40, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
test_lifetime_machine = LifetimeMachine.TestCase
