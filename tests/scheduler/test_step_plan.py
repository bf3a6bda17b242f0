"""What a step plan and its works say about themselves: the request and input ids of a work, and a plan's
tokens, transfers and progress, as an executor and a report read them."""

from __future__ import annotations

from kvledger.core.types import CopyOp
from kvledger.scheduler import (
    GenRequest,
    StepPlan,
    Work,
)


def test_a_work_names_its_request_and_input_ids() -> None:
    req = GenRequest("abc", (1, 2, 3), 2)
    tokens = [9, 8, 7, 6, 5]
    assert Work("abc/2", 1, 4, True, request=req, tokens=tokens).request_id == "abc"
    assert Work("xyz/3/4", 0, 1, False).request_id == "xyz"  # no request: the seq id's first part
    assert Work("xyz", 0, 1, False).request_id == "xyz"
    assert list(Work("abc", 1, 4, True, tokens=tokens).input_ids) == [8, 7, 6]


def test_a_step_plan_reports_its_tokens_transfers_and_progress() -> None:
    plan = StepPlan(3)
    assert plan.num_tokens == 0 and plan.works == []
    assert plan.empty and not plan.transfers and not plan.tier_transfers and not plan.progressed
    p1, p2 = Work("a", 0, 5, True), Work("b", 2, 4, False)
    d1, d2 = Work("c", 7, 8, True, lookahead=3), Work("d", 9, 10, True)
    plan.prefills += [p1, p2]
    plan.decodes += [d1, d2]
    assert plan.num_tokens == 5 + 2 + (1 + 3) + 1
    assert plan.works == [p1, p2, d1, d2]
    assert not plan.empty and plan.progressed and not plan.transfers
    # Each kind of transfer alone makes a plan non-empty, and the tier ones count as tier transfers.
    for name, value, tier in (("copies", CopyOp(1, 2, 3), False), ("swap_out", (1, 2), False),
                              ("swap_in", (1, 2), False), ("demote", (1, 2), True), ("tier_moves", (1, 2), True),
                              ("writeback", (1, 2), True), ("promote", (1, 2), True)):
        one = StepPlan(0)
        getattr(one, name).append(value)
        assert (one.transfers, one.tier_transfers, one.empty, one.progressed) == (True, tier, False, True), name
    # A plan with no work or transfer has progressed when it admitted, preempted or ended a request.
    for name in ("admitted", "preempted", "ended"):
        one = StepPlan(0)
        getattr(one, name).append("x")
        assert one.empty and one.progressed, name
    # Work alone (prefill or decode) is not empty either.
    for name in ("prefills", "decodes"):
        one = StepPlan(0)
        getattr(one, name).append(Work("a", 0, 1, True))
        assert not one.empty and not one.transfers, name
