"""Re-admitting a preempted family of branches: all-or-nothing, and sharing exactly as fork() shares."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvledger.core.identity import CacheContext
from kvledger.core.ledger import KVLedger, Outcome, Request
from kvledger.core.observe import EventLog
from kvledger.core.types import Retention
from kvledger.errors import ConfigError, LedgerError


def full_snapshot(ledger: KVLedger, events: EventLog | None = None) -> tuple:
    """Everything a refusal must leave alone, counters and events included (outcome counters aside)."""
    pool = ledger.pool
    stats = ledger.stats()
    stats["admissions"] = {k: v for k, v in stats["admissions"].items() if k not in ("not_now", "never")}
    seqs = tuple(sorted((rid, tuple(s.tokens), tuple(s.table.blocks), s.promised)
                        for rid, s in ((r, ledger.sequence(r)) for r in ledger.sequences())))
    return (ledger.usage(), tuple(pool.free_blocks()), tuple(pool.retained.blocks()), tuple(sorted(pool.index.items())),
            tuple(pool.ref), tuple(pool.written), tuple(pool.digest), seqs, repr(stats),
            len(events) if events is not None else None, pool.evictions)


def run_family(ledger: KVLedger, rid: str, prompt: list[int], max_new: int, k: int,
               outputs: list[list[int]]) -> dict[str, list[int]]:
    """Admit ``rid`` with ``k`` branches, prefill it and append each branch's outputs; return tokens."""
    ledger.admit(Request(rid, prompt, max_new, branches=k)).raise_for_outcome()
    ledger.mark_computed(rid, len(prompt))
    ids = [rid] + [f"{rid}/{i}" for i in range(1, k)]
    for sid, out in zip(ids, outputs, strict=True):
        ledger.append_tokens(sid, out)
        ledger.check()
    return {sid: list(ledger.sequence(sid).tokens) for sid in ids}


def preempt_all(ledger: KVLedger, tokens: dict[str, list[int]]) -> None:
    for sid in tokens:
        ledger.preempt(sid)
    ledger.check()


def family_requests(tokens: dict[str, list[int]], max_new: int, prompt_len: int, family: str, **kw) -> list[Request]:
    return [Request(sid, toks, max_new - (len(toks) - prompt_len), family=family, readmission=True, **kw)
            for sid, toks in tokens.items()]


@pytest.mark.parametrize("caching", [True, False])
def test_a_family_that_fitted_before_preemption_fits_again(caching: bool) -> None:
    """Defect 6 at the ledger: 16 prompt tokens (4 blocks of 4) shared by 2 branches, each with 1 block
    of its own: 6 blocks in a pool of 6. Re-admitted branch by branch it would need 10 without
    caching and never fit; as a family it shares the prompt blocks again."""
    ledger = KVLedger(6, 4, prefix_caching=caching)
    prompt = list(range(100, 116))
    tokens = run_family(ledger, "F", prompt, 4, 2, [[1, 2, 3], [7, 8, 9]])
    before = ledger.usage()
    assert before.active + before.promised == 6
    preempt_all(ledger, tokens)
    if not caching:
        # what the scheduler did before admit_family: one branch at a time -- the second never fits
        assert ledger.can_admit(family_requests(tokens, 4, 16, "F")[0]).admitted
        assert sum(b.blocks_charged for b in map(ledger.can_admit, family_requests(tokens, 4, 16, "F"))) == 10
    decision = ledger.admit_family(family_requests(tokens, 4, 16, "F"))
    ledger.check()
    assert decision.outcome is Outcome.ADMITTED, decision.reason
    assert (decision.request_id, decision.blocks_hit, decision.blocks_new, decision.blocks_promised) == (
        "F", 4 if caching else 0, 2 if caching else 6, 0)
    a, b = (ledger.sequence(s).table.blocks for s in ("F", "F/1"))
    assert a[:4] == b[:4] and a[4] != b[4]
    assert all(ledger.pool.ref[x] == 2 for x in a[:4])
    after = ledger.usage()
    assert after.active + after.promised == 6
    assert ledger.sequence("F").family == ledger.sequence("F/1").family == "F"


def test_a_refused_family_changes_nothing_at_all() -> None:
    """Defect 3 at the ledger: the family's own cached prefix is evictable, another request holds the
    rest; the family does not fit. Nothing is evicted, counted, indexed or announced."""
    events = EventLog()
    ledger = KVLedger(10, 4, events=events)
    prompt = list(range(100, 108))
    tokens = run_family(ledger, "F", prompt, 8, 2, [[1, 2, 3, 4], [5, 6, 7, 8]])
    for sid in tokens:
        ledger.mark_computed(sid, len(tokens[sid]))
    preempt_all(ledger, tokens)
    assert ledger.usage().retained == 4  # the shared prompt and each branch's generated block
    ledger.admit(Request("other", list(range(500, 520)), 4)).raise_for_outcome()  # 5 + 1 promised
    before = full_snapshot(ledger, events)
    decision = ledger.admit_family(family_requests(tokens, 8, 8, "F"))
    assert decision.outcome is Outcome.NOT_NOW
    assert full_snapshot(ledger, events) == before
    assert ledger.stats()["admissions"]["not_now"] == 1
    ledger.check()
    # The tenant's reason speaks of the family's own blocks; the pool-wide figures are the operator's.
    assert "free" not in decision.reason and "evictable" not in decision.reason
    assert "free" in decision.detail and "evictable" in decision.detail
    ledger.release("other")
    decision = ledger.admit_family(family_requests(tokens, 8, 8, "F"))
    assert decision.admitted and decision.blocks_hit == 4  # the prompt (2) and both generated blocks
    ledger.check()


def test_never_counts_the_sharing_and_every_branch_at_its_longest() -> None:
    ledger = KVLedger(6, 4, prefix_caching=False)
    shared = list(range(16))
    fits = [Request("F", shared + [1], 3, family="F"), Request("F/1", shared + [2], 3, family="F")]
    assert ledger.admit_family(fits).admitted  # 4 shared + 1 block each
    ledger.cancel("F")
    ledger.check()
    longer = [Request("F", shared + [1], 4, family="F"), Request("F/1", shared + [2], 4, family="F")]
    decision = ledger.admit_family(longer)  # each branch may reach 21 tokens: 4 shared + 2 each = 8 > 6
    assert decision.outcome is Outcome.NEVER and "whole pool has 6" in decision.reason
    lookahead = [Request("F", shared + [1], 3, family="F", lookahead=1),
                 Request("F/1", shared + [2], 3, family="F", lookahead=1)]
    assert ledger.admit_family(lookahead).outcome is Outcome.NEVER
    assert ledger.usage().free == 6 and ledger.stats()["admissions"]["never"] == 2
    ledger.check()


def test_identical_partial_tails_are_shared_copy_on_write() -> None:
    """Three branches preempted before they diverged hold one tail block with two promised copies,
    exactly as a fork leaves them."""
    ledger = KVLedger(16, 4, prefix_caching=False)
    reqs = [Request(s, list(range(7)), 4, family="G") for s in ("G", "G/1", "G/2")]
    decision = ledger.admit_family(reqs)
    ledger.check()
    forked = KVLedger(16, 4, prefix_caching=False)
    forked.admit(Request("G", list(range(7)), 4, branches=3)).raise_for_outcome()
    assert ledger.usage() == forked.usage()
    assert (decision.blocks_new, decision.blocks_promised) == (2, 3 + 2)
    tables = {tuple(ledger.sequence(s).table.blocks) for s in ("G", "G/1", "G/2")}
    assert len(tables) == 1
    tail = ledger.sequence("G").table.blocks[1]
    assert ledger.pool.ref[tail] == 3
    copies = ledger.append_token("G/1", 9)
    assert [(c.src, c.slots) for c in copies] == [(tail, 3)]
    ledger.append_token("G/2", 8)
    assert ledger.append_token("G", 7) == []  # the last holder writes in place
    ledger.check()
    assert ledger.usage().promised == 3 - 3 + 3  # copies used; each branch keeps its own allowance


def test_family_uses_prefix_hits_and_indexes_its_new_blocks() -> None:
    ctx = CacheContext(trust_group="t")
    ledger = KVLedger(32, 4)
    ledger.admit(Request("warm", list(range(8)), 0, ctx)).raise_for_outcome()
    ledger.mark_computed("warm", 8)
    ledger.release("warm")
    reqs = [Request("F", list(range(12)) + [1], 2, ctx, family="F", readmission=True),
            Request("F/1", list(range(12)) + [2], 2, ctx, family="F", readmission=True)]
    decision = ledger.admit_family(reqs)
    assert (decision.blocks_hit, decision.blocks_new) == (2, 1 + 2)  # block 2 is new, shared; two tails
    a, b = (ledger.sequence(s).table.blocks for s in ("F", "F/1"))
    assert a[:3] == b[:3]
    assert ledger.pool.digest[a[2]] is not None  # the shared new block entered the index (pending)
    stats = ledger.stats()
    assert stats["admissions"]["readmitted"] == 1
    assert stats["prefix_cache"]["queries"] == 1  # only "warm"
    assert stats["prefix_cache_readmissions"]["hit_blocks"] == 4  # 2 hits for each branch
    assert ledger.tenant_stats("t")["prefix_cache_readmissions"]["queries"] == 2
    ledger.check()


def test_family_that_does_not_read_the_cache_still_shares_within_the_family() -> None:
    ledger = KVLedger(32, 4)
    ledger.admit(Request("warm", list(range(8)), 0)).raise_for_outcome()
    ledger.mark_computed("warm", 8)
    ledger.release("warm")
    reqs = [Request(s, list(range(8)) + [t], 2, family="F", read_prefix_cache=False) for s, t in (("F", 1), ("F/1", 2))]
    decision = ledger.admit_family(reqs)
    assert (decision.blocks_hit, decision.blocks_new) == (0, 2 + 2)
    a, b = (ledger.sequence(s).table.blocks for s in ("F", "F/1"))
    assert a[:2] == b[:2]
    assert ledger.stats()["prefix_cache"]["read_skipped"] == 2
    ledger.check()


@pytest.mark.parametrize("bad", [
    lambda: [Request("A", [1, 2], 2, family="F"), Request("B", [1, 2], 2, family="G")],
    lambda: [Request("A", [1, 2], 2, family="F", branches=2)],
    lambda: [Request("A", [1, 2], 2, family="F"), Request("A", [1, 2], 2, family="F")],
    lambda: [Request("A", [1, 2], 2, family="F"), Request("B", [1, 2], 2, CacheContext(trust_group="x"), family="F")],
    lambda: [Request("A", [1, 2], 2, family="F"), Request("B", [1, 2], 2, family="F", readmission=True)],
    lambda: [],
    lambda: Request("A", [1, 2], 2),
    lambda: [Request("A", [1, 2], 2, family="F"), Request("B", [1, 2.5], 2, family="F")],
], ids=["two-families", "branches", "same-id", "two-contexts", "mixed-flags", "empty", "not-a-list", "float-token"])
def test_malformed_families_are_typed_errors_and_change_nothing(bad) -> None:
    ledger = KVLedger(16, 4)
    ledger.admit(Request("x", [5, 6, 7, 8, 9], 3)).raise_for_outcome()
    before = full_snapshot(ledger)
    with pytest.raises(ConfigError):
        ledger.admit_family(bad())
    assert full_snapshot(ledger) == before
    ledger.check()


def test_a_running_branch_id_is_a_ledger_error() -> None:
    ledger = KVLedger(16, 4)
    ledger.admit(Request("F/1", [5, 6, 7], 3)).raise_for_outcome()
    before = full_snapshot(ledger)
    with pytest.raises(LedgerError):
        ledger.admit_family([Request("F", [1, 2], 2), Request("F/1", [1, 2], 2, family="F")])
    assert full_snapshot(ledger) == before


# ---- sharing equals fork's, for any divergence ---------------------------------------------------

def _lcp(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


@st.composite
def families(draw):
    bs = draw(st.sampled_from([1, 2, 4]))
    prompt = draw(st.lists(st.integers(0, 3), min_size=1, max_size=3 * bs))
    k = draw(st.integers(1, 4))
    outs = [draw(st.lists(st.integers(0, 1), max_size=2 * bs)) for _ in range(k)]
    max_new = max(len(o) for o in outs) + draw(st.integers(0, bs))
    return bs, prompt, outs, max_new, draw(st.booleans()), draw(st.booleans())


@given(families())
def test_family_shares_every_common_full_block_and_equal_tails_only(case) -> None:
    """Pairwise, two branches share exactly the full blocks of their common token prefix (computed
    here from the tokens, independently of hashing), and a partial tail exactly when their tokens are
    equal; the family then grows to max_new_tokens on its promises alone."""
    bs, prompt, outs, max_new, caching, cache_first = case
    ledger = KVLedger(64, bs, prefix_caching=caching)
    if cache_first:
        ledger.admit(Request("warm", prompt + outs[0], 0)).raise_for_outcome()
        ledger.mark_computed("warm", len(prompt) + len(outs[0]))
        ledger.release("warm")
    toks = {("F" if i == 0 else f"F/{i}"): prompt + out for i, out in enumerate(outs)}
    reqs = [Request(s, t, max_new - (len(t) - len(prompt)), family="F") for s, t in toks.items()]
    decision = ledger.admit_family(reqs)
    assert decision.admitted
    ledger.check()
    ids = list(toks)
    for i, a in enumerate(ids):
        for b in ids[i + 1:]:
            ta, tb = toks[a], toks[b]
            shared_full = min(_lcp(ta, tb), len(ta), len(tb)) // bs
            ba, bb = ledger.sequence(a).table.blocks, ledger.sequence(b).table.blocks
            assert ba[:shared_full] == bb[:shared_full]
            assert not set(ba[shared_full:len(ta) // bs]) & set(bb)
            tail_shared = ta == tb and len(ta) % bs
            if len(ta) % bs and len(tb) % bs:
                assert (ba[-1] == bb[-1]) == bool(tail_shared)
    for sid, t in toks.items():  # full reservation: every branch reaches its limit on promises
        ledger.append_tokens(sid, [3] * (len(prompt) + max_new - len(t)))
        ledger.check()
    assert all(ledger.sequence(sid).promised == 0 for sid in toks)


def test_family_hits_are_a_leading_run_of_the_chain() -> None:
    """A cached block whose predecessor was evicted cannot be hit: its KV depends on every earlier
    token, and the family recomputes from the first miss (as admit() does)."""
    ledger = KVLedger(8, 4, policy="priority")
    prompt = list(range(12))
    ledger.admit(Request("warm", prompt, 0, retention=(Retention(0, 4, 0), Retention(4, 12, 100)))).raise_for_outcome()
    ledger.mark_computed("warm", 12)
    ledger.release("warm")
    ledger.admit(Request("filler", list(range(100, 124)), 0)).raise_for_outcome()  # 5 free + 1 eviction
    assert ledger.usage().retained == 2  # blocks 1-2 of "warm" survive; block 0, priority 0, was evicted
    ledger.release("filler")
    reqs = [Request("F", prompt + [1], 2, family="F"), Request("F/1", prompt + [2], 2, family="F")]
    decision = ledger.admit_family(reqs)
    assert decision.admitted and decision.blocks_hit == 0
    # The family wrote block 0 again, so the whole chain is reachable once more.
    assert ledger.admit(Request("single", prompt, 0)).blocks_hit == 3
    ledger.check()


def test_keep_free_leaves_blocks_available_after_a_family() -> None:
    ledger = KVLedger(12, 4, prefix_caching=False)
    reqs = [Request(s, list(range(8)) + [t], 4, family="F") for s, t in (("F", 1), ("F/1", 2))]
    # 2 shared + 2 tails + 2 x 1 promised = 6 of 12
    assert ledger.admit_family(reqs, keep_free=7).outcome is Outcome.NOT_NOW
    decision = ledger.admit_family(reqs, keep_free=6)
    assert decision.admitted and ledger.usage().available == 6
    ledger.check()
