"""Admission decisions as a caller reads them: the figures and the pool behind an admitted decision,
whose blocks and which rule a refusal names, a quota's charge for cached and shared blocks, and the
refusals of bad arguments and taken ids. Block size 4; ``check()`` after every operation."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from kvledger.core.identity import CacheContext
from kvledger.core.ledger import KVLedger, Outcome, Request
from kvledger.errors import AdmissionError, ConfigError, LedgerError

BS = 4


def toks(n: int, start: int) -> list[int]:
    return list(range(start, start + n))


def test_can_admit_names_keep_free_when_it_is_not_a_count() -> None:
    led = KVLedger(4, BS)
    req = Request("a", toks(4, 1), 0)
    for bad, message in ((-1, "keep_free must be >= 0, got -1"), ("2", "keep_free must be an integer, got '2'")):
        for call in (led.can_admit, led.admit):
            with pytest.raises(ConfigError) as exc:
                call(req, keep_free=bad)  # type: ignore[arg-type]
            assert str(exc.value) == message


def test_every_decision_names_its_request() -> None:
    led = KVLedger(4, BS)
    assert led.can_admit(Request("a", toks(8, 1), 0)).request_id == "a"
    assert led.admit(Request("a", toks(8, 1), 0)).request_id == "a"
    refused = led.admit(Request("b", toks(12, 50), 0))  # 3 blocks; 2 left
    assert refused.outcome is Outcome.NOT_NOW and refused.request_id == "b"
    assert (refused.blocks_total, refused.blocks_hit, refused.blocks_hit_pending, refused.blocks_new,
            refused.blocks_promised, refused.blocks_branches) == (3, 0, 0, 3, 0, 0)
    with pytest.raises(AdmissionError) as exc:
        refused.raise_for_outcome()
    assert str(exc.value).startswith("request 'b' not_now: needs 3 new blocks")
    assert led.admit(Request("c", toks(40, 80), 0)).request_id == "c"  # never


def test_a_quota_charges_a_request_for_the_cached_blocks_it_takes_back(run_once: Callable[..., None]) -> None:
    """Group t (cap 3) holds one block for r. b (10 tokens) hits a's two retained blocks, which nobody
    holds: taking them adds 2 to t's charge, its one new block (the partial tail) 1 more, its growth none
    (its whole output fits that block) and, one branch, no tail copies: 1 + 3 > 3."""
    ctx = CacheContext(trust_group="t")
    led = KVLedger(16, BS)
    run_once(led, "a", toks(8, 1), context=ctx)
    led.set_quota("t", 3)
    assert led.admit(Request("r", toks(4, 500), 0, context=ctx)).admitted
    d = led.admit(Request("b", [*toks(8, 1), 90, 91], 2, context=ctx))
    assert d.outcome is Outcome.NOT_NOW and d.over_quota and d.request_id == "b"
    assert (d.blocks_total, d.blocks_hit, d.blocks_hit_pending, d.blocks_new, d.blocks_promised,
            d.blocks_branches) == (3, 2, 0, 1, 0, 0)
    assert d.reason == ("needs 3 blocks of its trust group's quota of 3 blocks, of which 1 are held or committed "
                        "to its running requests now")
    led.set_quota("t", 4)
    assert led.admit(Request("b", [*toks(8, 1), 90, 91], 2, context=ctx)).admitted
    led.check()


def test_a_quota_charges_two_branches_one_copy_of_their_shared_partial_tail() -> None:
    """6 tokens (one full block and a partial tail), 2 new tokens, 2 branches: 2 blocks of its own plus one
    copy of the tail for the second branch -- exactly a cap of 3 (the never rule agrees: 3 blocks)."""
    ctx = CacheContext(trust_group="t")
    led = KVLedger(16, BS)
    led.set_quota("t", 3)
    d = led.admit(Request("e", toks(6, 1), 2, context=ctx, branches=2))
    assert d.admitted and (d.blocks_new, d.blocks_promised, d.blocks_branches) == (2, 1, 1)
    assert led.group_usage("t")["t"].charged == 3
    led.check()


def test_an_admitted_decision_reports_its_blocks_and_the_pool_behind_them(run_once: Callable[..., None]) -> None:
    led = KVLedger(16, BS)
    run_once(led, "a", toks(8, 1))
    d = led.admit(Request("b", [*toks(8, 1), 70, 71], 3, branches=2))  # 2 hits, tail block new, 2 branches
    assert d.admitted and d.request_id == "b"
    # 4 blocks of its own, 2 for the second branch (its output block and a copy of the partial tail)
    assert d.reason == "2 shared + 1 new + 3 promised = 6 blocks"
    assert d.detail == ("2 shared + 1 new + 3 promised = 6 blocks; 14 can be promised now (14 free + 2 evictable "
                        "- 0 promised - 2 own hits)")
    assert (d.blocks_total, d.blocks_branches) == (4, 2)
    led.check()


def test_a_never_decision_says_whose_blocks_and_why() -> None:
    led = KVLedger(4, BS)
    d = led.admit(Request("big", toks(10, 1), 4, branches=2))  # 4 blocks + (4 - 2) for the second branch
    assert d.outcome is Outcome.NEVER and d.request_id == "big" and not d.over_quota
    assert d.reason == d.detail == "needs 6 blocks (10 + 4 tokens for 2 branches) but the whole pool has 4"
    assert (d.blocks_total, d.blocks_hit, d.blocks_hit_pending, d.blocks_new, d.blocks_promised,
            d.blocks_branches) == (6, 0, 0, 0, 0, 0)
    ctx = CacheContext(trust_group="t")
    led.set_quota("t", 2)
    q = led.admit(Request("q", toks(10, 1), 0, context=ctx))
    assert q.outcome is Outcome.NEVER and q.request_id == "q" and q.over_quota
    assert q.reason == q.detail == "needs 3 blocks (10 + 0 tokens) but its trust group's quota is 2 blocks"
    assert (q.blocks_total, q.blocks_hit, q.blocks_hit_pending, q.blocks_new, q.blocks_promised,
            q.blocks_branches) == (3, 0, 0, 0, 0, 0)
    assert led.stats()["admissions"]["never"] == 2


def test_admit_refuses_an_id_whose_branch_names_are_taken_and_only_those() -> None:
    led = KVLedger(16, BS)
    assert led.admit(Request("x/1", toks(4, 1), 0)).admitted  # a request that happens to be named x/1
    assert led.admit(Request("y/0", toks(4, 9), 0)).admitted  # ... and y/0, which no branch of y is called
    for rid in ("x", "x/1"):
        with pytest.raises(LedgerError) as exc:
            led.admit(Request(rid, toks(4, 20), 0, branches=2 if rid == "x" else 1))
        assert str(exc.value) == f"request id {rid!r} is already running"
    assert led.admit(Request("x", toks(4, 20), 0)).admitted  # one branch: x/1 is not among its names
    assert led.admit(Request("y", toks(4, 30), 0, branches=3)).admitted  # y, y/1, y/2
    assert sorted(led.sequences()) == ["x", "x/1", "y", "y/0", "y/1", "y/2"]
    led.check()


def test_a_request_asked_again_with_a_new_prompt_is_hashed_again(run_once: Callable[..., None]) -> None:
    """a is told "not now" (its digests are remembered under its id); asked again under the same id with
    another prompt, its hits are those of the new prompt, never of the remembered one."""
    led = KVLedger(4, BS)
    run_once(led, "c", toks(8, 200))  # two retained blocks
    assert led.admit(Request("h", toks(4, 300), 0)).admitted  # one held: 3 can be promised
    assert led.admit(Request("a", toks(16, 100), 0)).outcome is Outcome.NOT_NOW
    d = led.admit(Request("a", toks(8, 200), 0))
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
