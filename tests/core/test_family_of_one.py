"""A request with ``branches=k`` is admitted as a family of ``k``: one decision and one commit serve it and
a re-admitted family. What a user sees of that must be exactly what admitting the request alone and
forking it ``k - 1`` times gives (the ledger's behaviour before the two paths became one), and what
re-admitting ``k`` identical branches as a family gives, but for how the decision is named and counted.

Block size 4; prompts, reservations, lookahead, prior cache contents and prefix caching vary."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from kvledger.core.ledger import KVLedger, Request

BS = 4


def _state(led: KVLedger) -> dict:
    """Everything a caller can observe of the ledger's sequences and pool (not its counters)."""
    seqs = {}
    for rid in sorted(led.sequences()):
        s = led.sequence(rid)
        seqs[rid] = (list(s.table.blocks), s.promised, s.cow_tail, s.computed_mark, s.written_blocks,
                     s.hit_blocks, s.reserved_blocks, list(s.digests), list(s.tokens), s.family)
    return {"seqs": seqs, "usage": led.usage().as_dict(), "copies": led.promises.copies,
            "tokens": led.token_usage()}


def _warm(led: KVLedger, warm: int) -> None:
    """Leave ``warm`` full blocks of the prompt's prefix in the prefix index (retained)."""
    if warm:
        w = Request("warm", list(range(warm * BS)) + [999], 0)
        assert led.admit(w).admitted
        led.mark_computed("warm", len(w.prompt))
        led.release("warm")


requests = st.tuples(
    st.integers(1, 14),  # prompt length
    st.integers(0, 9),  # max_new_tokens
    st.integers(0, 9),  # reserve_new_tokens (capped at max_new)
    st.integers(1, 4),  # branches
    st.integers(0, 3),  # lookahead
    st.integers(0, 3),  # full prefix blocks already cached
    st.booleans(),  # prefix caching
)


def _two_ledgers(case: tuple) -> tuple[KVLedger, KVLedger, int, int, dict]:
    """Two equal ledgers for ``case`` (cache warmed alike), its branch count, its max_new_tokens and the
    keywords of one of its branches."""
    prompt_len, max_new, reserve, k, lookahead, warm, caching = case
    ledgers = KVLedger(64, BS, prefix_caching=caching), KVLedger(64, BS, prefix_caching=caching)
    for led in ledgers:
        _warm(led, warm if caching else 0)
    branch = {"prompt": list(range(prompt_len)), "max_new_tokens": max_new,
              "reserve_new_tokens": min(reserve, max_new), "lookahead": lookahead}
    return *ledgers, k, max_new, branch


@given(requests)
def test_a_branched_request_lands_exactly_as_admit_then_forks(case: tuple) -> None:
    one, forked, k, max_new, branch = _two_ledgers(case)
    d = one.admit(Request("r", branches=k, **branch))
    d1 = forked.admit(Request("r", **branch))
    assert d.admitted and d1.admitted
    promised = sum(forked.fork("r", f"r/{i}") for i in range(1, k))
    assert _state(one) == _state(forked)
    # The decision speaks of one branch's blocks and of the branches apart.
    assert (d.blocks_total, d.blocks_hit, d.blocks_new) == (d1.blocks_total, d1.blocks_hit, d1.blocks_new)
    assert d.blocks_branches == promised and d.blocks_promised == d1.blocks_promised + promised
    assert one.stats()["lifetimes"]["forks"] == k - 1 == forked.stats()["lifetimes"]["forks"]
    assert one.stats()["prefix_cache"] == forked.stats()["prefix_cache"]  # one query, not one per branch
    # The branches then live apart: each grows its own table (and copies a shared tail) alone.
    for led in (one, forked):
        for step in range(max_new):
            led.decode_step([(rid, 500 + 10 * b + step) for b, rid in enumerate(sorted(led.sequences()))])
    assert _state(one) == _state(forked) and one.take_copies() == forked.take_copies()
    one.check()
    forked.check()


@given(requests)
def test_a_branched_request_holds_what_its_identical_branches_readmitted_as_a_family_hold(case: tuple) -> None:
    one, family, k, _, branch = _two_ledgers(case)
    d = one.admit(Request("r", branches=k, **branch))
    members = [Request("r" if i == 0 else f"r/{i}", family="r", **branch) for i in range(k)]
    df = family.admit_family(members)
    assert d.admitted and df.admitted
    assert _state(one)["seqs"] == _state(family)["seqs"] and one.usage() == family.usage()
    # Named and counted apart: the family's figures are its distinct blocks, the request's one branch's.
    assert df.blocks_total == d.blocks_total + d.blocks_branches
    assert (df.blocks_hit, df.blocks_new, df.blocks_promised) == (d.blocks_hit, d.blocks_new, d.blocks_promised)
    one.check()
    family.check()


def test_a_refused_branched_request_changes_nothing_and_is_told_of_one_branch() -> None:
    """Not now: the reason quotes one branch's blocks, nothing is taken, the prompt's digests are
    remembered for the next attempt; admitted later, its branches open as forks of it."""
    led = KVLedger(10, BS)
    assert led.admit(Request("hog", list(range(100, 124)), 4)).admitted  # 6 + 1 promised of 10
    before = _state(led)
    d = led.admit(Request("r", list(range(6)), 4, branches=2))  # 2 prompt + 1 own + (1 own + 1 tail copy)
    assert not d.admitted and d.blocks_total == 3 and d.blocks_branches == 2
    assert d.reason == "needs 5 new blocks (0 of 3 shared); the pool cannot promise them now"
    assert _state(led) == before and led._admission.remembered() == ["r"]
    led.release("hog")
    d = led.admit(Request("r", list(range(6)), 4, branches=2))
    assert d.admitted and d.reason == "0 shared + 2 new + 3 promised = 5 blocks"
    assert sorted(led.sequences()) == ["r", "r/1"] and led._admission.remembered() == []
    led.check()
