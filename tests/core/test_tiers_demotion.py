"""Cost-aware demotion (issue 38): with a demotion rule a block goes to a tier below the pool only when
loading it back (plus writing it, when the copy is urgent) is expected to beat recomputing it at its
depth; entries move down only to a tier worth them; the rule's depth comes from a tree policy."""

from __future__ import annotations

import pytest

from kvledger.core.identity import CacheContext
from kvledger.core.ledger import KVLedger, Request
from kvledger.core.tiers import TierLedger, TierOp
from kvledger.errors import ConfigError
from kvledger.scheduler.tiers import DEMOTION_RULES, cost_aware_rule

# host: load 1, write 1; disk: load 10, write 20. Recomputing the block at depth d takes 5 + d.
RULE = cost_aware_rule(lambda d: 5.0 + d, [1.0, 10.0], [1.0, 20.0])


def test_the_cost_rule_compares_load_and_urgent_write_with_recompute() -> None:
    assert RULE(0, 0, True) and RULE(0, None, False)  # host: a hit saves 5 - 1 > the write's 1
    assert not RULE(1, 0, False) and RULE(1, 6, False)  # disk read-back 10 beats recompute only past depth 5
    assert not RULE(1, 25, True) and RULE(1, 26, True)  # an urgent disk copy must save more than its write, 20
    chance = [0.5]
    rule = cost_aware_rule(lambda d: 5.0 + d, [1.0, 10.0], [1.0, 20.0], reuse=lambda: chance[0])
    assert rule(0, 0, True) and not rule(1, 26, True) and rule(1, 51, True)  # half the saving of 41 > 20
    chance[0] = 0.1  # entries rarely come back: only a deep block pays for an urgent copy
    assert not rule(0, 0, True) and rule(0, 7, True) and rule(0, 0, False)  # write-backs cost the step nothing
    assert DEMOTION_RULES.names() == ("always", "cost")
    with pytest.raises(ConfigError):
        cost_aware_rule(lambda d: 1.0, [1.0], [])


def test_an_urgent_demotion_goes_only_to_a_tier_worth_the_block() -> None:
    tiers = TierLedger([("host", 1), ("disk", 4)])
    tiers.worth = RULE
    assert tiers.demote(10, b"d1", "g", depth=0) == 0  # host
    tiers.complete()
    # Host full, and an urgent disk copy (10 + 20) is not worth a block recomputed in 8: the host's coldest
    # entry is dropped for it (rather than the free disk slot being used, as without a rule).
    assert tiers.demote(11, b"d2", "g", depth=3) == 0
    assert tiers.index == {b"d2": 0} and tiers.flow["dropped"] == 1
    assert tiers.demote(12, b"d3", "g", depth=30) == 1  # deep enough (35 > 30): a free disk slot
    tiers.complete()
    tiers.check()
    assert tiers.stats()["declined"] == 0


def test_a_block_no_tier_is_worth_is_declined_and_costs_nothing() -> None:
    tiers = TierLedger([("disk", 4)])
    tiers.worth = cost_aware_rule(lambda d: 5.0 + d, [10.0], [20.0])
    assert tiers.demote(10, b"d1", "g", depth=1) is None
    assert tiers.declined == 1 and tiers.flow["demoted"] == 0 and tiers.take_ops() == []
    assert tiers.demote(11, b"d2", "g", depth=None) is None  # unknown depth: taken as the cheapest
    assert tiers.declined == 2
    tiers.check()


def test_a_write_back_moves_an_entry_down_only_if_the_slower_tier_is_worth_it() -> None:
    tiers = TierLedger([("host", 1), ("disk", 1)])
    tiers.worth = RULE
    assert tiers.demote(10, b"d1", "g", urgent=False, depth=2) == 0
    tiers.complete()
    assert tiers.demote(11, b"d2", "g", urgent=False, depth=9) == 0  # d1 (depth 2) is not worth the disk: dropped
    assert tiers.index == {b"d2": 0} and tiers.flow["dropped"] == 1 and tiers.flow["moved"] == 0
    tiers.complete()
    assert tiers.demote(12, b"d3", "g", urgent=False, depth=9) == 0  # d2 (depth 9) moves to disk
    assert tiers.take_ops()[-2:] == [TierOp("move", 0, 1), TierOp("writeback", 12, 0)]
    assert tiers.depth[1] == 9
    tiers.complete()
    tiers.check()


def test_spilling_drops_an_entry_no_slower_tier_is_worth() -> None:
    tiers = TierLedger([("host", 2), ("disk", 2)])
    tiers.worth = RULE
    tiers.demote(10, b"d1", "g", urgent=False, depth=0)
    tiers.demote(11, b"d2", "g", urgent=False, depth=8)
    tiers.complete()
    assert tiers.spill(0, 2) == 2
    assert tiers.index == {b"d2": 2} and tiers.flow["dropped"] == 1
    tiers.complete()
    tiers.check()


def test_the_ledger_hands_a_tree_policys_depth_to_the_rule() -> None:
    ctx = CacheContext(model="m", trust_group="g")
    seen: list[tuple[int, int | None, bool]] = []

    def rule(tier: int, depth: int | None, urgent: bool) -> bool:
        seen.append((tier, depth, urgent))
        return True

    for policy, depths in (("gdsf", {1, 2}), ("lru", {None})):
        seen.clear()
        ledger = KVLedger(4, 2, prefix_caching=True, policy=policy)
        tiers = TierLedger([("host", 8)])
        tiers.worth = rule
        ledger.attach_tiers(tiers)
        ledger.admit(Request("a", [1, 2, 3, 4, 5, 6], 1, ctx))
        ledger.mark_computed("a", 6)
        ledger.release("a")
        ledger.admit(Request("b", [9, 8, 7, 6, 5, 4], 1, ctx))  # evicts a's two deepest blocks: urgent
        assert {d for _, d, _ in seen} == depths and all(u for _, _, u in seen)
