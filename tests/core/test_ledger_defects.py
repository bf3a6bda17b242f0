"""Regression tests for the ledger defects of issue 9 (each failed before its fix).

Defects: 1 speculative blocks shared by a fork, 2 trimmed draft blocks re-promised without capacity,
7 huge ``branches`` holding the lock, 8 invalid retention priority half-way through admit, 11 token ids
unchecked without prefix caching, 12 untyped ``CacheContext.extra`` and equal-comparing memo keys,
13 tenant-visible pool figures; and the "also" list: wrong-typed calls, floats as counts,
``decode_step`` with an unknown id.
"""

from __future__ import annotations

import pytest

from kvledger.core.identity import CacheContext, chain_digests, token_bytes
from kvledger.core.ledger import KVLedger, Outcome, Request
from kvledger.core.types import Retention
from kvledger.errors import ConfigError, KVLedgerError, LedgerError, OutOfBlocksError


def state(ledger: KVLedger) -> tuple:
    """Everything observable, counters included."""
    pool = ledger.pool
    seqs = tuple(sorted((rid, tuple(s.tokens), tuple(s.table.blocks), s.promised, s.computed_mark)
                        for rid, s in ((r, ledger.sequence(r)) for r in ledger.sequences())))
    return (ledger.usage(), tuple(pool.free_blocks()), tuple(pool.retained.blocks()), tuple(sorted(pool.index.items())),
            tuple(pool.ref), tuple(pool.leased), tuple(pool.written), seqs, repr(ledger.stats()), ledger.leases(),
            ledger.pins())


# ---- defect 1: fork after reserve_lookahead -----------------------------------------------------

@pytest.mark.parametrize("how", ["fork", "beam_step"])
def test_fork_after_reserve_lookahead_never_shares_the_draft_block(how: str) -> None:
    """The issue's recipe: 16 blocks of 4; admit 6 tokens, max_new 8, lookahead 4; mark 6 computed;
    reserve 4 lookahead slots; fork; append different tokens to each. Before the fix both branches
    wrote positions 8.. into one physical block and check() failed ("index entry ... disagrees")."""
    ledger = KVLedger(16, 4)
    ledger.admit(Request("p", list(range(6)), 8, lookahead=4)).raise_for_outcome()
    ledger.mark_computed("p", 6)
    assert ledger.reserve_lookahead("p", 4) == 1
    draft = ledger.sequence("p").table.blocks[2]
    if how == "fork":
        ledger.fork("p", "c")
    else:
        ledger.beam_step([("p", "c")], [])
    ledger.check()
    assert draft not in ledger.sequence("c").table.blocks and ledger.pool.ref[draft] == 1
    for i in range(8):
        ledger.append_token("p", 100 + i)
        ledger.append_token("c", 200 + i)
        ledger.mark_computed("p", len(ledger.sequence("p").tokens))
        ledger.mark_computed("c", len(ledger.sequence("c").tokens))
        ledger.check()
    p, c = ledger.sequence("p").table.blocks, ledger.sequence("c").table.blocks
    assert p[0] == c[0] and not set(p[1:]) & set(c[1:])  # only the full prompt block is shared
    ledger.release("p")
    ledger.release("c")
    ledger.check()


def test_check_catches_a_shared_speculative_block() -> None:
    ledger = KVLedger(16, 4)
    ledger.admit(Request("p", list(range(6)), 8, lookahead=4)).raise_for_outcome()
    ledger.reserve_lookahead("p", 4)
    ledger.fork("p", "c")
    draft = ledger.sequence("p").table.blocks[2]
    ledger.sequence("c").table.blocks.append(draft)  # what the old fork did
    ledger.pool.ref[draft] += 1
    ledger.sequence("c").promised -= 1
    ledger.promises.total -= 1
    with pytest.raises(AssertionError, match="speculative block"):
        ledger.check()


# ---- defect 2: trim_lookahead re-promising without capacity --------------------------------------

def test_trimming_a_leased_draft_block_keeps_it_instead_of_overcommitting() -> None:
    """A draft block still leased (a transfer reads it) frees nothing when trimmed; re-promising it
    anyway made promised > free + evictable."""
    ledger = KVLedger(4, 4)
    ledger.admit(Request("p", list(range(6)), 2, lookahead=4)).raise_for_outcome()  # 6 + 2 + 4: 3 blocks
    ledger.reserve_lookahead("p", 4)
    draft = ledger.sequence("p").table.blocks[2]
    lease = ledger.lease(blocks=[draft], owner="transfer")
    ledger.admit(Request("q", [9, 9, 9], 1)).raise_for_outcome()  # takes the last block
    assert ledger.trim_lookahead("p") == 0
    ledger.check()
    assert ledger.sequence("p").table.blocks[2] == draft
    ledger.end_lease(lease)
    assert ledger.trim_lookahead("p") == 1
    ledger.check()
    assert ledger.usage().promised == 1  # re-promised, now backed by the freed block


def test_a_sequence_with_an_outstanding_lease_keeps_its_draft_slots() -> None:
    ledger = KVLedger(8, 4)
    ledger.admit(Request("p", list(range(6)), 8, lookahead=4)).raise_for_outcome()
    ledger.reserve_lookahead("p", 4)
    lease = ledger.lease(request_ids=["p"], owner="step-1")  # the step writes the draft slots
    assert ledger.trim_lookahead("p") == 0
    ledger.end_lease(lease)
    assert ledger.trim_lookahead("p") == 1
    ledger.check()


@pytest.mark.parametrize("pool", [6, 8, 9])
def test_fork_beams_with_lookahead_through_the_scheduler_never_overcommits(pool: int) -> None:
    """The issue's scheduler recipe: policy "full", a request with lookahead 2, fork_beams after a
    decode step, then schedule() -- which raised InvariantError("overcommitted") in these pools."""
    from kvledger.scheduler.beam import fork_beams
    from kvledger.scheduler.config import SchedulerConfig
    from kvledger.scheduler.plan import GenRequest
    from kvledger.scheduler.scheduler import Scheduler

    ledger = KVLedger(pool, 4)
    s = Scheduler(ledger, SchedulerConfig(policy="full"))
    s.add(GenRequest("A", list(range(6)), 6, lookahead=2))
    forked = False
    for _ in range(12):
        plan = s.schedule()
        ledger.check()
        s.confirm(plan, {w.seq_id: [5] for w in plan.prefills + plan.decodes if w.sample})
        ledger.check()
        if not forked and plan.decodes:
            fork_beams(s, "A", [("A", 8), ("A", 9)])
            forked = True
            ledger.check()
    assert forked


def test_trimmed_draft_blocks_are_promised_again_so_full_reservation_reaches_its_limit() -> None:
    """If a trim did not re-promise, a full-reservation request would run out of blocks later."""
    ledger = KVLedger(5, 4)
    ledger.admit(Request("p", list(range(4)), 8, lookahead=4)).raise_for_outcome()  # 4+8+4: 4 blocks
    ledger.mark_computed("p", 4)
    for _ in range(3):
        ledger.reserve_lookahead("p", 4)
        assert ledger.trim_lookahead("p") >= 1
        ledger.check()
        ledger.append_token("p", 1)
    ledger.admit(Request("other", [1], 3)).raise_for_outcome()  # everything else in the pool
    for _ in range(5):
        ledger.append_token("p", 1)  # never OutOfBlocksError
    assert len(ledger.sequence("p").tokens) == 12
    ledger.check()


# ---- defect 7: huge branch counts decide "never" first --------------------------------------------

class ScanGuard(dict):
    """The ledger's sequence table, refusing to be probed more than a pool's worth of times in one
    call: admit() with a huge ``branches`` used to look up every branch id under the lock first."""

    def __contains__(self, key: object) -> bool:
        self.probes = getattr(self, "probes", 0) + 1
        if self.probes > 1000:
            raise RuntimeError("admission scanned branch ids before deciding 'never'")
        return super().__contains__(key)


@pytest.mark.parametrize("branches", [10**7, 99999999999999999999999])
def test_huge_branch_counts_are_never_before_any_per_branch_work(branches: int) -> None:
    ledger = KVLedger(64, 16)
    ledger.admit(Request("running", [1] * 16, 4)).raise_for_outcome()
    ledger._seqs = ScanGuard(ledger._seqs)
    req = Request("huge", list(range(20)), 0, branches=branches)
    assert ledger.admit(req).outcome is Outcome.NEVER
    assert ledger.can_admit(req).outcome is Outcome.NEVER
    # A block-aligned prompt with max_new 0 costs nothing per extra branch, so only the branch bound
    # (at most one sequence per block) can say never -- in O(1).
    aligned = ledger.admit(Request("aligned", [1] * 16, 0, branches=branches))
    assert aligned.outcome is Outcome.NEVER and "branches" in aligned.reason
    assert ledger.stats()["admissions"]["never"] == 2
    ledger.check()


def test_never_rule_is_checked_before_the_running_id_scan() -> None:
    """A running id is still a LedgerError for a request that could fit, and the scan it needs is
    bounded by the pool size (never-first keeps it so)."""
    ledger = KVLedger(8, 4)
    ledger.admit(Request("r", [1, 2, 3], 1)).raise_for_outcome()
    with pytest.raises(LedgerError):
        ledger.admit(Request("r", [1, 2, 3], 1, branches=2))
    assert ledger.admit(Request("r", [1, 2, 3], 1, branches=10**30)).outcome is Outcome.NEVER


def test_never_counts_the_lookahead_slots() -> None:
    """17 tokens (8 + 8 + 1 speculative slot) are 5 blocks of 4: more than a pool of 4 -- never. A
    rule that forgot the lookahead would call it "not now", and the request would wait forever."""
    ledger = KVLedger(4, 4)
    assert ledger.admit(Request("r", list(range(8)), 8, lookahead=1)).outcome is Outcome.NEVER
    assert ledger.admit(Request("r", list(range(8)), 8, lookahead=0)).outcome is Outcome.ADMITTED


# ---- defect 8: retention validated before anything changes ----------------------------------------

@pytest.mark.parametrize("bad", [
    {"priority": 101}, {"priority": -1}, {"priority": 50.0}, {"priority": True}, {"priority": "high"},
    {"start": 8, "end": 4}, {"duration_s": -1.0}, {"duration_s": float("nan")}, {"duration_s": "60"},
])
def test_invalid_retention_is_a_config_error_before_admission(bad: dict) -> None:
    fields = {"start": 0, "end": 8, "priority": 90, "duration_s": None, **bad}
    with pytest.raises(ConfigError):
        Retention(**fields)


def test_retention_cannot_fail_half_way_through_admit_or_append() -> None:
    """Before the fix, a priority of 101 raised ValueError from the policy after blocks were taken:
    they leaked and check() failed. Now the range cannot be built, so admit and append never see it."""
    ledger = KVLedger(16, 4, policy="priority")
    with pytest.raises(ConfigError):
        ledger.admit(Request("r", list(range(12)), 8, retention=(Retention(0, 20, 101),)))
    with pytest.raises(ConfigError):
        Request("r", list(range(12)), 8, retention=("not a range",))
    ledger.admit(Request("r", list(range(12)), 8, retention=(Retention(0, 20, 100, 60.0),))).raise_for_outcome()
    ledger.mark_computed("r", 12)
    ledger.append_tokens("r", [1, 2, 3, 4, 5])  # a generated block gets its priority at the boundary
    ledger.check()
    with pytest.raises(ConfigError):
        ledger.pool.retained.set_priority(0, 101, None)  # the policy's own check is typed too


# ---- defect 11: token ids checked without prefix caching ------------------------------------------

@pytest.mark.parametrize("bad", [1.5, -1, 2**32, "7", None, [1]])
@pytest.mark.parametrize("caching", [True, False])
def test_prompt_token_ids_are_checked_with_and_without_caching(bad: object, caching: bool) -> None:
    ledger = KVLedger(16, 4, prefix_caching=caching)
    before = state(ledger)
    req = Request("r", [1, 2, bad, 4, 5], 4)
    with pytest.raises(ConfigError):
        ledger.admit(req)
    with pytest.raises(ConfigError):
        ledger.can_admit(req)
    with pytest.raises(ConfigError):
        ledger.admit_family([req])
    assert state(ledger) == before
    ledger.check()


# ---- defect 12: typed extra values, typed trust group, exact memo keys ----------------------------

@pytest.mark.parametrize(("a", "b"), [(None, "None"), (1, "1"), (True, 1), (1, 1.0), (True, "True"),
                                      (0.0, -0.0), (b"x", "x"), (False, None), ("", None)])
def test_extra_values_are_encoded_with_their_type(a: object, b: object) -> None:
    ca, cb = CacheContext(extra=(("k", a),)), CacheContext(extra=(("k", b),))
    assert ca != cb
    assert ca.root_digest() != cb.root_digest()
    ledger = KVLedger(16, 4)
    ledger.admit(Request("warm", list(range(8)), 0, ca)).raise_for_outcome()
    ledger.mark_computed("warm", 8)
    ledger.release("warm")
    assert ledger.admit(Request("probe", list(range(8)), 0, cb)).blocks_hit == 0


@pytest.mark.parametrize("value", [object(), [1], {"a": 1}, (1, 2), 1j, CacheContext()])
def test_extra_values_of_unencodable_types_are_refused(value: object) -> None:
    with pytest.raises(ConfigError):
        CacheContext(extra=(("k", value),))


@pytest.mark.parametrize("fields", [{"trust_group": None}, {"trust_group": 7}, {"trust_group": b"t"},
                                    {"model": None}, {"revision": 1}, {"adapter": 3}, {"kv_dtype": None},
                                    {"extra": (("k",),)}, {"extra": ((1, "v"),)}, {"extra": "kv"},
                                    {"extra": (("k", 1), ("k", 2))}])
def test_context_fields_of_the_wrong_type_are_config_errors(fields: dict) -> None:
    with pytest.raises(ConfigError):
        CacheContext(**fields)


def test_a_memoised_root_belongs_to_exactly_one_encoding() -> None:
    """1 == True == 1.0 in Python and hash alike: before the fix, the lru_cache handed whichever
    context was hashed first to the others, and the ledger's retry memo did the same."""
    contexts = [CacheContext(extra=(("k", v),)) for v in (1, True, 1.0)]
    roots = [c.root_digest() for c in contexts]
    assert len(set(roots)) == 3
    for c in reversed(contexts):  # the other order gives the same, per-value roots
        assert CacheContext(extra=c.extra).root_digest() == roots[contexts.index(c)]
    assert len(set(contexts)) == 3
    # The retry memo: the same request id and prompt object asked again under an equal-hashing context.
    ledger = KVLedger(3, 4)
    prompt = tuple(range(8))
    ledger.admit(Request("busy", [9] * 12, 0)).raise_for_outcome()
    assert ledger.admit(Request("r", prompt, 0, contexts[0])).outcome is Outcome.NOT_NOW
    ledger.release("busy")
    ledger.admit(Request("r", prompt, 0, contexts[1])).raise_for_outcome()
    expected = chain_digests(contexts[1].root_digest(), token_bytes(list(prompt)), 4)
    assert ledger.sequence("r").digests == expected


def test_dict_extra_is_kept_in_order_and_equals_the_pairs() -> None:
    a = CacheContext(extra={"x": 1, "y": "z"})
    assert a == CacheContext(extra=(("x", 1), ("y", "z")))
    assert a != CacheContext(extra=(("y", "z"), ("x", 1)))


# ---- defect 13: tenant and operator views ---------------------------------------------------------

def test_a_not_now_reason_quotes_only_the_requests_own_figures() -> None:
    ledger = KVLedger(16, 4)
    ledger.admit(Request("big", list(range(40)), 4, CacheContext(trust_group="other"))).raise_for_outcome()
    d = ledger.admit(Request("mine", list(range(100, 120)), 8, CacheContext(trust_group="me")))
    assert d.outcome is Outcome.NOT_NOW
    for word in ("free", "evictable", "promised", "available", "kept"):
        assert word not in d.reason
    assert "needs 7 new blocks" in d.reason
    assert "(6 free + 0 evictable - 1 promised)" in d.detail


def test_stats_is_the_operator_view_and_tenant_stats_one_group() -> None:
    ledger = KVLedger(32, 4)
    for g in ("a", "b"):
        ledger.admit(Request(g, list(range(8)), 0, CacheContext(trust_group=g))).raise_for_outcome()
    operator = ledger.stats()
    assert operator["prefix_cache"]["queries"] == 2 and "usage" in operator
    tenant = ledger.tenant_stats("a")
    assert tenant["prefix_cache"]["queries"] == 1
    assert set(tenant) == {"trust_group", "prefix_cache", "prefix_cache_readmissions"}
    for bad in (None, 1, b"a"):
        with pytest.raises(ConfigError):
            ledger.tenant_stats(bad)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        ledger.stats(trust_group=None)  # type: ignore[call-arg]  # no "None means all groups" any more
    with pytest.raises(ConfigError):
        CacheContext(trust_group=None)  # type: ignore[arg-type]  # and None is no group


# ---- "also": wrong-typed library calls raise typed errors and change nothing ----------------------

def _ready_ledger() -> KVLedger:
    ledger = KVLedger(16, 4)
    ledger.admit(Request("r", list(range(6)), 6)).raise_for_outcome()
    ledger.mark_computed("r", 6)
    return ledger


BAD_CALLS = {
    "request-prompt-None": lambda led: Request("x", None, 4),
    "request-prompt-str": lambda led: Request("x", "hello", 4),
    "request-prompt-int": lambda led: Request("x", 5, 4),
    "request-max-new-str": lambda led: Request("x", [1], "5"),
    "request-max-new-float": lambda led: Request("x", [1], 5.0),
    "request-max-new-bool": lambda led: Request("x", [1], True),
    "request-branches-float": lambda led: Request("x", [1], 4, branches=1.5),
    "request-branches-zero": lambda led: Request("x", [1], 4, branches=0),
    "request-lookahead-float": lambda led: Request("x", [1], 4, lookahead=2.0),
    "request-reserve-str": lambda led: Request("x", [1], 4, reserve_new_tokens="2"),
    "request-id-int": lambda led: Request(7, [1], 4),
    "request-id-empty": lambda led: Request("", [1], 4),
    "request-context": lambda led: Request("x", [1], 4, context="tenant"),
    "request-family-int": lambda led: Request("x", [1], 4, family=3),
    "request-flag": lambda led: Request("x", [1], 4, read_prefix_cache="no"),
    "admit-not-a-request": lambda led: led.admit(("x", [1], 4)),
    "admit-keep-free-float": lambda led: led.admit(Request("x", [1], 4), keep_free=1.5),
    "mark-computed-str": lambda led: led.mark_computed("r", "3"),
    "mark-computed-float": lambda led: led.mark_computed("r", 3.0),
    "mark-computed-negative": lambda led: led.mark_computed("r", -1),
    "mark-computed-too-many": lambda led: led.mark_computed("r", 99),
    "mark-computed-unknown": lambda led: led.mark_computed("ghost", 1),
    "append-float-token": lambda led: led.append_token("r", 1.0),
    "append-bool-token": lambda led: led.append_token("r", True),
    "append-tokens-str": lambda led: led.append_tokens("r", "12"),
    "append-tokens-bad-last": lambda led: led.append_tokens("r", [1, 2, -3]),
    "append-tokens-past-limit": lambda led: led.append_tokens("r", [1] * 7),
    "append-unhashable-id": lambda led: led.append_token(["r"], 1),
    "lease-huge-block": lambda led: led.lease(blocks=[10**9]),
    "lease-float-block": lambda led: led.lease(blocks=[0.0]),
    "lease-str-ids": lambda led: led.lease(request_ids="r"),
    "lookahead-float": lambda led: led.reserve_lookahead("r", 2.0),
    "fork-int-child": lambda led: led.fork("r", 5),
    "fork-unknown": lambda led: led.fork("ghost", "c"),
    "beam-step-str": lambda led: led.beam_step("rc", []),
    "beam-step-int-child": lambda led: led.beam_step([("r", 3)], []),
    "pin-str-prompt": lambda led: led.pin("p", "abc", CacheContext()),
    "pin-bad-context": lambda led: led.pin("p", [1, 2, 3, 4], "ctx"),
    "pin-int-name": lambda led: led.pin(3, [1, 2, 3, 4], CacheContext()),
    "release-unknown": lambda led: led.release("ghost"),
    "release-unhashable": lambda led: led.release({"r": 1}),
    "end-lease-unknown": lambda led: led.end_lease(12345),
    "tenant-stats-None": lambda led: led.tenant_stats(None),
    "ledger-policy-name": lambda led: KVLedger(8, 4, policy="fifo"),
    "ledger-policy-object": lambda led: KVLedger(8, 4, policy=object()),
    "ledger-blocks-float": lambda led: KVLedger(8.0, 4),
    "ledger-blocks-bool": lambda led: KVLedger(True, 4),
    "ledger-blocks-huge": lambda led: KVLedger(10**30, 4),
    "ledger-block-size-str": lambda led: KVLedger(8, "16"),
    "ledger-caching-str": lambda led: KVLedger(8, 4, prefix_caching="yes"),
    "ledger-pinned-fraction": lambda led: KVLedger(8, 4, max_pinned_fraction=float("nan")),
    "ledger-clock": lambda led: KVLedger(8, 4, clock=3),
    "ledger-events": lambda led: KVLedger(8, 4, events=[]),
}


@pytest.mark.parametrize("call", sorted(BAD_CALLS))
def test_wrong_typed_calls_raise_typed_errors_and_change_nothing(call: str) -> None:
    ledger = _ready_ledger()
    before = state(ledger)
    with pytest.raises(KVLedgerError) as info:
        BAD_CALLS[call](ledger)
    assert not isinstance(info.value, AssertionError), "an invariant error for a caller's mistake"
    assert state(ledger) == before
    ledger.check()


def test_a_policy_by_registered_name() -> None:
    clock = [100.0]
    ledger = KVLedger(8, 4, policy="priority", clock=lambda: clock[0])
    assert ledger.policy_name == "priority"
    assert KVLedger(8, 4, policy="lru").policy_name == "lru"
    assert ledger.pool.retained._clock() == 100.0  # the named policy runs on the ledger's clock


def test_numpy_style_integers_are_counts_but_floats_never_are() -> None:
    class Index:  # what numpy integers look like to Python: __index__, not an int subclass
        def __init__(self, v: int) -> None:
            self.v = v

        def __index__(self) -> int:
            return self.v

    req = Request("x", [1, 2, 3], Index(4), branches=Index(2))
    assert (req.max_new_tokens, req.branches) == (4, 2) and type(req.max_new_tokens) is int
    ledger = KVLedger(Index(8), Index(4))
    ledger.admit(req).raise_for_outcome()
    ledger.mark_computed("x", Index(3))
    ledger.append_token("x", Index(7))
    ledger.check()


# ---- decode_step: all pairs checked before any is applied -----------------------------------------

@pytest.mark.parametrize("bad", [("ghost", 1), ("b", -1), ("b", 1.0), ("b", None), ("c", 1), ("b",), 5])
def test_decode_step_with_a_bad_pair_changes_nothing(bad: object) -> None:
    """An unknown id (or bad token, or a sequence at its limit) anywhere in the step -- even after
    boundary pairs that need the full path -- leaves every sequence as it was."""
    ledger = KVLedger(32, 4)
    ledger.admit(Request("a", list(range(8)), 8)).raise_for_outcome()  # at a block boundary
    ledger.admit(Request("b", list(range(20, 26)), 8)).raise_for_outcome()
    ledger.admit(Request("c", [1, 2, 3], 0)).raise_for_outcome()  # max_new 0: at its limit
    for rid in ("a", "b"):
        ledger.append_token(rid, 1)
    before = state(ledger)
    for steps in ([("a", 2), ("b", 3), ("a", 4), bad, ("b", 5)], [bad, ("a", 2)], [("b", 3), bad]):
        with pytest.raises(KVLedgerError):
            ledger.decode_step(steps)
        assert state(ledger) == before
        ledger.check()
    shared = ("a", 9)  # one pair object twice: undone as often as it was appended
    with pytest.raises(LedgerError):
        ledger.decode_step([shared, ("b", 3), shared, ("ghost", 1)])
    assert state(ledger) == before


def test_decode_step_that_runs_out_applies_the_pairs_before_in_order() -> None:
    """A full pool is not a bad call: pairs before the one that cannot grow are applied, as the
    scheduler expects, and the error names the sequence."""
    ledger = KVLedger(5, 4)
    ledger.admit(Request("a", [1, 2, 3, 4], 8, reserve_new_tokens=0)).raise_for_outcome()
    ledger.admit(Request("b", [5, 6, 7, 8], 8, reserve_new_tokens=0)).raise_for_outcome()
    ledger.admit(Request("c", [1, 1, 1, 1, 1], 8, reserve_new_tokens=0)).raise_for_outcome()  # 2 blocks
    # a and b are at a boundary with no promise; one block is left: a gets it, b cannot grow
    ledger.decode_step([("c", 1)])
    with pytest.raises(OutOfBlocksError, match="'b'"):
        ledger.decode_step([("c", 2), ("a", 9), ("b", 9), ("c", 3)])
    assert [len(ledger.sequence(r).tokens) for r in ("a", "b", "c")] == [5, 4, 7]
    ledger.check()


def test_decode_step_keeps_a_sequences_pairs_in_order_across_both_paths() -> None:
    """A sequence named twice in one step whose first pair needs the full path (here an integer-like
    token that is not an ``int``) still gets its tokens in the order given."""

    class Index:
        def __init__(self, v: int) -> None:
            self.v = v

        def __index__(self) -> int:
            return self.v

    ledger = KVLedger(16, 4)
    ledger.admit(Request("a", [1, 2, 3, 4, 5], 8)).raise_for_outcome()
    ledger.append_token("a", 9)
    ledger.decode_step([("a", Index(5)), ("a", 6), ("a", 7)])
    assert ledger.sequence("a").tokens[-4:] == [9, 5, 6, 7]
    ledger.check()


# ---- draft slots of sibling branches ----------------------------------------------------------------

@pytest.mark.parametrize("prompt_len", [1, 5, 6])
def test_siblings_draft_slots_land_in_private_blocks(prompt_len: int) -> None:
    """An n = 2 request with lookahead whose branches still share the partial tail block when they
    reach their last prompt token (a one-token prompt, a prompt cached up to its last token, a chunked
    prefill's last chunk): each branch's draft slots land in a block of its own. Before the fix
    reserve_lookahead placed both branches' drafts in the one shared tail, and they overwrote each
    other's draft KV in the same step."""
    ledger = KVLedger(16, 4)
    ledger.admit(Request("r", list(range(prompt_len)), 6, branches=2, lookahead=2)).raise_for_outcome()
    ledger.mark_computed("r", prompt_len - 1)
    first, second = ledger.sequence("r"), ledger.sequence("r/1")
    tail = prompt_len // 4
    assert first.table.blocks[tail] == second.table.blocks[tail]  # shared before any draft
    ledger.reserve_lookahead("r", 2)
    ledger.reserve_lookahead("r/1", 2)
    ledger.check()
    draft_blocks = [{s.table.blocks[p // 4] for p in range(prompt_len, prompt_len + 2)} for s in (first, second)]
    assert not draft_blocks[0] & draft_blocks[1], draft_blocks
    # The first branch took a copy of the tail (its valid slots copied), the last holder writes in place.
    copies = ledger.take_copies()
    assert [(c.src, c.slots) for c in copies] == [(second.table.blocks[tail], prompt_len % 4)]
    assert copies[0].dst == first.table.blocks[tail]
    assert ledger.usage().promised == ledger.sequence("r").promised + ledger.sequence("r/1").promised
    for rid in ("r", "r/1"):
        ledger.release(rid)
    ledger.check()
    assert ledger.usage().active == 0


def test_reserving_drafts_with_a_shared_tail_is_all_or_nothing() -> None:
    """Refused for want of a block beyond the tail, the reservation makes no tail copy either."""
    ledger = KVLedger(4, 4)
    ledger.admit(Request("r", [1], 2, reserve_new_tokens=0)).raise_for_outcome()
    ledger.fork("r", "r/1")  # one copy promised for the shared tail
    ledger.admit(Request("x", list(range(8)), 0)).raise_for_outcome()  # the last unpromised blocks
    before = (ledger.usage(), list(ledger.sequence("r").table.blocks), ledger.sequence("r").cow_tail)
    with pytest.raises(OutOfBlocksError, match="lookahead"):
        ledger.reserve_lookahead("r", 4)  # positions 1-4: a second block, which nothing can promise
    assert (ledger.usage(), list(ledger.sequence("r").table.blocks), ledger.sequence("r").cow_tail) == before
    assert ledger.take_copies() == []
    ledger.reserve_lookahead("r", 2)  # within the tail: only the promised copy
    ledger.check()
    assert len(ledger.take_copies()) == 1


def test_check_names_a_draft_slot_in_a_block_two_sequences_hold() -> None:
    ledger = KVLedger(16, 4)
    ledger.admit(Request("r", [1, 2, 3, 4, 5], 6, branches=2, lookahead=2)).raise_for_outcome()
    ledger.check()
    ledger.sequence("r").draft_end = 7  # what the old reserve_lookahead left: drafts in the shared tail
    with pytest.raises(AssertionError, match="draft slot 5 lies in block .* held by 2"):
        ledger.check()


def test_a_fork_after_drafts_were_reserved_asks_for_them_again() -> None:
    """Draft slots reserved in a tail that a fork then shares are no longer the parent's alone: the
    fork withdraws them, and reserving again copies the tail first."""
    ledger = KVLedger(16, 4)
    ledger.admit(Request("p", list(range(6)), 8, lookahead=2)).raise_for_outcome()
    ledger.reserve_lookahead("p", 2)
    ledger.fork("p", "c")
    ledger.check()
    assert ledger.sequence("p").draft_end == 0
    ledger.reserve_lookahead("p", 2)
    ledger.check()
    assert ledger.sequence("p").table.blocks[1] != ledger.sequence("c").table.blocks[1]
