"""A prefix-cache reset forgets every copy of the old KV: the device pool, the tiers the ledger owns, the
hit-rate window; it refuses while a tier transfer is in flight; and a reset that requeues running
requests is no preemption on either side of the ledger/scheduler line."""

from __future__ import annotations

from kvledger.core.identity import CacheContext
from kvledger.core.ledger import KVLedger, Request
from kvledger.core.tiers import TierLedger
from kvledger.scheduler import GenRequest, Scheduler, SchedulerConfig

BS = 4


def req(rid: str, tokens: list[int], new: int = 1) -> Request:
    return Request(rid, tokens, new, CacheContext(trust_group="default"))


def run_and_cache(led: KVLedger, rid: str, tokens: list[int], new: int = 1) -> None:
    led.admit(req(rid, tokens, new)).raise_for_outcome()
    led.mark_computed(rid, len(tokens))
    led.release(rid)


def demoted() -> tuple[KVLedger, TierLedger]:
    """A ledger whose first prompt's blocks were all evicted down to the host tier."""
    tiers = TierLedger([("host", 4), ("disk", 4)])
    led = KVLedger(6, BS)
    led.attach_tiers(tiers)
    run_and_cache(led, "a", list(range(16)))
    run_and_cache(led, "b", list(range(100, 124)), new=0)  # evicts all 4 of a's blocks into the host tier
    return led, tiers


def test_a_ledger_reset_clears_the_tiers_it_owns_so_old_kv_is_never_promoted_back() -> None:
    """Before the fix the ledger's own reset cleared only the device pool: the host entries stayed and
    promote_from_tiers brought the pre-reset KV back on the next hit."""
    led, tiers = demoted()
    tiers.take_ops()
    tiers.complete()
    assert len(tiers.index) == 4
    reset = led.reset_prefix_cache()
    assert reset
    pairs, lease = led.promote_from_tiers(req("c", list(range(16)) + [1]), owner="promote")
    assert (pairs, lease) == ([], None)
    assert tiers.index == {} and tiers.num_used == 0 and tiers.flow["cleared"] == 4
    assert reset.cleared_tier_entries == 4 and "4 tier entries" in reset.reason
    d = led.admit(req("c", list(range(16)) + [1]))
    assert d.admitted and d.blocks_hit == 0  # recomputed from scratch: no old KV anywhere
    led.check()


def test_a_ledger_reset_refuses_while_a_tier_transfer_is_in_flight_and_changes_nothing() -> None:
    led, tiers = demoted()  # three demotions decided, not yet completed
    before = (led.usage(), dict(tiers.index), tiers.stats(), led.stats())
    reset = led.reset_prefix_cache()
    assert not reset and "4 tier transfers in flight" in reset.reason
    assert (led.usage(), dict(tiers.index), tiers.stats(), led.stats()) == before
    tiers.take_ops()
    tiers.complete()
    assert led.reset_prefix_cache()
    led.check()


def test_a_reset_restarts_the_hit_rate_window() -> None:
    led = KVLedger(16, BS)
    run_and_cache(led, "a", list(range(8)))
    run_and_cache(led, "b", list(range(8)) + [9])
    assert led.stats()["prefix_cache"]["window_hit_rate"] > 0
    assert led.reset_prefix_cache()
    assert led.stats()["prefix_cache"]["window_hit_rate"] == 0.0
    run_and_cache(led, "c", list(range(100, 108)))  # a miss after the reset
    assert led.stats()["prefix_cache"]["window_hit_rate"] == 0.0  # not diluted by pre-reset hits


def test_a_reset_that_requeues_running_requests_counts_no_preemption_anywhere() -> None:
    led = KVLedger(32, BS)
    s = Scheduler(led, SchedulerConfig(policy="full"))
    s.add(GenRequest("x", list(range(6)), 5, n=2))
    s.add(GenRequest("y", list(range(50, 53)), 4))
    plan = s.schedule()
    s.confirm(plan, {w.seq_id: [7] for w in plan.prefills if w.sample})
    assert s.running
    reset = s.reset_prefix_cache(requeue_running=True)
    assert reset
    assert s.preemptions == 0 and led.stats()["lifetimes"]["preemptions"] == 0
    assert not s.running and len(s.waiting) == 2
    s.check()


def toks(n: int, start: int) -> list[int]:
    return list(range(start, start + n))


def test_a_done_prefix_cache_reset_says_how_many_blocks_it_cleared() -> None:
    """An 8-token prompt, computed and released, leaves its 2 full blocks cached: the reset clears them
    and its explanation says so."""
    led = KVLedger(8, BS)
    led.admit(Request("a", toks(8, 10), 1)).raise_for_outcome()
    led.mark_computed("a", 8)
    led.release("a")
    reset = led.reset_prefix_cache()
    assert reset.done and reset.cleared_blocks == 2
    assert reset.reason == "2 cached blocks cleared"
