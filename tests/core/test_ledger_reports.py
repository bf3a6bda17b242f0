"""What the ledger reports about itself: stored events, the prefix-hit figures per trust group and pool
wide, admission and refusal counters, leases and preemptions in ``stats()``."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from kvledger.core.identity import CacheContext
from kvledger.core.ledger import KVLedger, Outcome, Request
from kvledger.core.observe import EventLog
from kvledger.core.quota import GroupUsage, check_group_ledgers
from kvledger.errors import InvariantError

BS = 4


def toks(n: int, start: int) -> list[int]:
    return list(range(start, start + n))


ACME = CacheContext(trust_group="acme")


def test_every_stored_event_names_the_block_that_holds_the_identity() -> None:
    events = EventLog()
    led = KVLedger(8, BS, events=events)
    assert led.admit(Request("a", toks(10, 1), 2)).admitted
    blocks = led.sequence("a").table.blocks
    stored = [e for e in events.all() if e.kind == "stored"]
    assert [e.block for e in stored] == blocks[:2]  # the two full prompt blocks, pending until written


def test_a_released_prompt_that_was_never_computed_is_removed_from_the_index() -> None:
    events = EventLog()
    led = KVLedger(4, BS, events=events)
    assert led.admit(Request("a", toks(8, 1), 0)).admitted
    blocks = led.sequence("a").table.blocks
    led.release("a")  # pending blocks (never written) are freed, not retained
    assert [(e.kind, e.block) for e in events.all()] == [
        ("stored", blocks[0]), ("stored", blocks[1]), ("removed", blocks[1]), ("removed", blocks[0])]
    assert led.usage().free == 4
    led.check()


def test_the_operator_counts_every_admission_and_readmission() -> None:
    led = KVLedger(16, BS)
    for i in range(3):
        assert led.admit(Request(f"a{i}", toks(4, 10 * i), 0)).admitted
    for i in range(2):
        assert led.admit(Request(f"r{i}", toks(4, 100 + 10 * i), 0, readmission=True)).admitted
    assert led.stats()["admissions"] == {"admitted": 3, "readmitted": 2, "not_now": 0, "never": 0}
    led.retract("a0")
    led.retract("r0")
    assert led.stats()["admissions"] == {"admitted": 2, "readmitted": 1, "not_now": 0, "never": 0}


def test_every_not_now_refusal_is_counted() -> None:
    led = KVLedger(2, BS)
    assert led.admit(Request("a", toks(8, 1), 0)).admitted
    for i in range(3):
        assert led.admit(Request(f"b{i}", toks(4, 50), 0)).outcome is Outcome.NOT_NOW
    assert led.stats()["admissions"]["not_now"] == 3


def test_stats_lifetimes_report_preemptions() -> None:
    """``stats()['lifetimes']`` has a ``preemptions`` count (0 on a fresh ledger)."""
    assert KVLedger(4, BS).stats()["lifetimes"]["preemptions"] == 0


def test_stats_counts_outstanding_leases() -> None:
    led = KVLedger(8, BS)
    led.admit(Request("a", toks(5, 1), 2)).raise_for_outcome()
    assert led.stats()["lifetimes"]["leases"] == 0
    lease = led.lease(request_ids=["a"], owner="step 0")
    assert led.stats()["lifetimes"]["leases"] == 1
    led.end_lease(lease)
    assert led.stats()["lifetimes"]["leases"] == 0


def test_the_pool_wide_prefix_figures_add_up_every_trust_group() -> None:
    """Three queries, from groups x (6 + 4 tokens) and y (9 tokens): 19 prompt tokens queried in all."""
    led = KVLedger(16, BS)
    for rid, group, n in (("a", "x", 6), ("b", "y", 9), ("c", "x", 4)):
        led.admit(Request(rid, toks(n, ord(rid) * 100), 1, CacheContext(trust_group=group))).raise_for_outcome()
    figures = led.stats()["prefix_cache"]
    assert figures["queries"] == 3
    assert figures["query_tokens"] == 6 + 9 + 4


def test_the_query_totals_add_up_every_groups_queried_blocks() -> None:
    """Two prefix-cache queries in two trust groups: a 9-token prompt has 2 full blocks, a 4-token prompt
    1, so 3 queried blocks in all (13 tokens, no hits)."""
    led = KVLedger(16, BS)
    assert led.admit(Request("a", toks(9, 0), 1, ACME)).admitted
    assert led.admit(Request("b", toks(4, 100), 1, CacheContext(trust_group="globex"))).admitted
    t = led.counters.totals()
    assert (t.queries, t.query_blocks, t.hit_blocks, t.query_tokens, t.hit_tokens) == (2, 3, 0, 13, 0)


def test_a_group_holding_only_promises_is_lawful() -> None:
    """A group can hold promises and no active block (its request's blocks are another group's shared
    ones, or all still promised): the conservation check accepts it, and refuses a negative entry."""
    check_group_ledgers({"a": GroupUsage(0, 2, 0), "b": GroupUsage(3, 0, 0)}, referenced=3, promised=2)
    with pytest.raises(InvariantError, match="negative ledger entry"):
        check_group_ledgers({"a": GroupUsage(3, 2, -1)}, referenced=3, promised=2)


def test_group_reports_show_caps_and_zero_for_groups_holding_nothing_now(run_in_group: Callable[..., None]) -> None:
    led = KVLedger(16, BS)
    led.set_quota("t", 10)
    led.admit(Request("r", toks(8, 0), 4, CacheContext(trust_group="t"))).raise_for_outcome()
    assert led.group_usage()["t"].cap == 10
    run_in_group(led, "s", toks(8, 50), group="u")  # u holds nothing now, but has prefix-cache counters
    stats = led.group_stats()
    assert stats["u"]["active"] == 0 and stats["u"]["promised"] == 0 and stats["u"]["query_tokens"] == 8
    assert stats["t"]["cap"] == 10
    led.check()
