"""Tests written because mutants of the ledger core and the scheduler drawn by ``tests/mutation.py sample``
(a seeded uniform sample, seed 2; docs/testing.md) survived the suite. Each pins down something a caller
can see -- a decision's block figures, an error and its message, a stats key, a token budget, which
request the victim policy names -- that no other test checked."""

from __future__ import annotations

import pytest

from kvledger.core.identity import CacheContext
from kvledger.core.ledger import KVLedger, Request
from kvledger.core.tiers import TierLedger
from kvledger.core.types import Retention
from kvledger.errors import ConfigError, OutOfBlocksError
from kvledger.scheduler import GenRequest, Scheduler, SchedulerConfig
from kvledger.scheduler.victims import pick_victim

try:  # the module name pytest gives tests/scheduler/test_scheduler.py depends on its import mode
    from tests.scheduler.test_scheduler import FakeEngine
except ImportError:  # pragma: no cover
    from scheduler.test_scheduler import FakeEngine

BS = 4


def toks(base: int, n: int) -> list[int]:
    return [base + i for i in range(n)]


# ---- core/admission.py: a family of branches -----------------------------------------------------------

def test_an_admitted_family_reports_its_pending_hits_and_what_its_extra_branch_adds() -> None:
    """P's 8-token prompt (2 blocks) is admitted but not computed yet. A family of two branches, P's
    prompt plus one token each (1 and 2: different tails), comes back. By hand: both full blocks are
    hits, both still pending; 2 new tail blocks; each branch reserves 9 + 4 = 13 tokens = 4 blocks, 1
    beyond its 3, so 2 promised, of which the second branch adds 1; total 2 + 2 + 2 = 6."""
    led = KVLedger(16, BS)
    led.admit(Request("P", toks(100, 8), 1)).raise_for_outcome()
    family = [Request("F", toks(100, 8) + [1], 4, family="F"), Request("F/1", toks(100, 8) + [2], 4, family="F")]
    d = led.admit_family(family)
    assert d.admitted
    assert (d.blocks_total, d.blocks_hit, d.blocks_hit_pending, d.blocks_new, d.blocks_promised,
            d.blocks_branches) == (6, 2, 2, 2, 2, 1)
    assert d.reason == "family of 2 branches: 2 shared + 2 new + 2 promised = 6 blocks"
    led.check()


def test_a_family_member_asking_for_several_branches_is_refused_with_its_message() -> None:
    led = KVLedger(16, BS)
    with pytest.raises(ConfigError, match=r"^request 'F': a family member is one branch \(branches=1\)$"):
        led.admit_family([Request("F", toks(0, 5), 2, branches=2)])


# ---- core/ledger.py: growth ----------------------------------------------------------------------------

def test_append_tokens_that_cannot_open_its_first_new_block_confirms_nothing() -> None:
    """A pool of 4 blocks: a's 8-token prompt (no output reserved, not computed yet) holds 2, b's
    7-token prompt plus its 1 reserved token the other 2. Five tokens for a: the first opens a's block
    3, which no block is left for, so nothing is appended and the call raises -- and the failed call
    did not confirm a's prompt KV as written either (a later token that also opens a block must not
    move the cut past the first)."""
    led = KVLedger(4, BS)
    led.admit(Request("a", toks(1, 8), 8, reserve_new_tokens=0)).raise_for_outcome()
    led.admit(Request("b", toks(30, 7), 1)).raise_for_outcome()
    assert led.usage().available == 0
    with pytest.raises(OutOfBlocksError, match="grew past its reservation"):
        led.append_tokens("a", toks(50, 5))
    assert led.sequence("a").num_tokens == 8
    assert led.ready_tokens("a") == 0  # nothing was computed: no block is readable
    led.check()


def test_two_tokens_for_one_sequence_in_one_decode_step_open_one_block() -> None:
    """a: 8-token prompt (2 blocks) with 8 tokens reserved, i.e. 2 promised blocks. One decode step
    carrying two tokens for a: the first opens block 3 from the promise, the second lands inside it.
    So 3 blocks and 1 promise left, not 4 and 0."""
    led = KVLedger(8, BS)
    led.admit(Request("a", toks(1, 8), 8)).raise_for_outcome()
    led.mark_computed("a", 8)
    led.decode_step([("a", 70), ("a", 71)])
    seq = led.sequence("a")
    assert seq.tokens[-2:] == [70, 71]
    assert len(seq.table.blocks) == 3
    assert seq.promised == 1 and led.usage().promised == 1
    led.check()


# ---- core/lifetimes.py, core/observe.py: stats -----------------------------------------------------------

def test_stats_counts_outstanding_leases() -> None:
    led = KVLedger(8, BS)
    led.admit(Request("a", toks(1, 5), 2)).raise_for_outcome()
    assert led.stats()["lifetimes"]["leases"] == 0
    lease = led.lease(request_ids=["a"], owner="step 0")
    assert led.stats()["lifetimes"]["leases"] == 1
    led.end_lease(lease)
    assert led.stats()["lifetimes"]["leases"] == 0


def test_the_pool_wide_prefix_figures_add_up_every_trust_group() -> None:
    """Three queries, from groups x (6 + 4 tokens) and y (9 tokens): 19 prompt tokens queried in all."""
    led = KVLedger(16, BS)
    for rid, group, n in (("a", "x", 6), ("b", "y", 9), ("c", "x", 4)):
        led.admit(Request(rid, toks(ord(rid) * 100, n), 1, CacheContext(trust_group=group))).raise_for_outcome()
    figures = led.stats()["prefix_cache"]
    assert figures["queries"] == 3
    assert figures["query_tokens"] == 6 + 9 + 4


# ---- core/tiers.py ---------------------------------------------------------------------------------------

def test_two_tiers_of_one_name_are_refused_with_its_message() -> None:
    with pytest.raises(ConfigError, match="^tier names must be distinct$"):
        TierLedger([("host", 2), ("host", 4)])


def test_tier_usage_counts_the_slots_in_flight() -> None:
    """Two slots held for a swap-out are in flight until the transfer completes."""
    tiers = TierLedger([("host", 4)])
    tiers.hold(2)
    assert tiers.usage()["host"]["in_flight"] == 2
    tiers.complete()
    assert tiers.usage()["host"]["in_flight"] == 0


# ---- core/types.py -----------------------------------------------------------------------------------------

def test_a_retention_given_whole_seconds_keeps_them_as_float_seconds() -> None:
    """``duration_s=5`` is 5.0 seconds, not forever (None)."""
    r = Retention(0, 8, 90, 5)
    assert r.duration_s == 5.0 and type(r.duration_s) is float
    assert (r.start, r.end, r.priority) == (0, 8, 90)


# ---- scheduler: the token budget and the victim ---------------------------------------------------------

def test_a_decode_with_one_draft_slot_spends_two_tokens_of_the_budget() -> None:
    """token_budget=4. X (3-token prompt, lookahead=1) decodes in step 2: its token plus one draft slot,
    2 tokens. Y, admitted that step, gets the 4 - 2 = 2 tokens left as its first prefill chunk."""
    s = Scheduler(KVLedger(32, BS), SchedulerConfig(policy="full", token_budget=4))
    s.add(GenRequest("X", toks(100, 3), 8, lookahead=1))
    engine = FakeEngine(s)
    engine.step()
    s.add(GenRequest("Y", toks(200, 8), 4))
    plan = engine.step()
    assert plan.admitted == ["Y"]
    assert [(w.seq_id, w.start, w.end, w.lookahead) for w in plan.works] == [("Y", 0, 2, 0), ("X", 3, 4, 1)]
    assert plan.num_tokens == 4


def test_pick_victim_between_steps_sees_what_the_last_step_confirmed() -> None:
    """min_waste (held blocks x tokens a recompute replays). P and Q share an 8-token prompt (2 blocks),
    R has a 2-token prompt (1 block). Planned but not run: P holds 2 blocks and would replay 8 tokens,
    16; R 1 x 2 = 2: R is the victim. Once the step is confirmed P's two blocks are written and Q holds
    them too, so P replays only its sampled token: 2 x (9 - 8) = 2, less than R's 1 x 3 = 3 -- P is now
    the victim, as a full scan says."""
    led = KVLedger(32, BS)
    s = Scheduler(led, SchedulerConfig(policy="full", victim="min_waste"))
    s.add(GenRequest("P", toks(100, 8), 8))
    s.add(GenRequest("Q", toks(100, 8), 8))
    s.add(GenRequest("R", toks(900, 2), 8))
    engine = FakeEngine(s)
    plan = s.schedule()
    assert s.pick_victim() == "R"
    s.confirm(plan, engine.run(plan))
    assert pick_victim("min_waste", led, s.running) == "P"
    assert s.pick_victim() == "P"
