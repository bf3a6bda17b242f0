"""The beam bookkeeping of ``kvledger.scheduler.beam`` without a model: selection rules, and prune /
fork / end on a real scheduler and ledger (copy-on-write of the shared tail included)."""

from __future__ import annotations

import pytest

from kvledger.core.ledger import KVLedger
from kvledger.errors import LedgerError
from kvledger.scheduler import GenRequest, Scheduler, SchedulerConfig, Status
from kvledger.scheduler.beam import BeamChoice, end_beams, fork_beams, prune_beams, select_beams


def test_first_step_expands_only_the_first_beam() -> None:
    cands = {"a": [(-0.1, 5), (-0.2, 6), (-0.3, 7)], "b": [(-0.05, 9), (-0.06, 8), (-1.0, 1)]}
    running, finished = select_beams([("a", 0.0), ("b", 0.0)], cands, 2, first_step=True)
    assert [(c.parent, c.token) for c in running] == [("a", 5), ("a", 6)]
    assert finished == []


def test_scores_add_and_ties_break_by_beam_then_token_rank() -> None:
    cands = {"a": [(-1.0, 1), (-2.0, 2)], "b": [(-0.5, 3), (-1.5, 4)]}
    running, _ = select_beams([("a", -1.0), ("b", -1.5)], cands, 3)
    assert running == [BeamChoice("a", 1, -2.0), BeamChoice("b", 3, -2.0), BeamChoice("a", 2, -3.0)]


def test_stop_tokens_finish_hypotheses_only_among_the_best_width() -> None:
    cands = {"a": [(-0.1, 0), (-0.2, 4), (-0.3, 5), (-3.0, 0)], "b": [(-0.15, 6), (-2.5, 0)]}
    running, finished = select_beams([("a", 0.0), ("b", 0.0)], cands, 2, stop_token_ids={0})
    assert finished == [BeamChoice("a", 0, -0.1)]  # ranked first: a finished hypothesis
    assert [(c.parent, c.token) for c in running] == [("b", 6), ("a", 4)]  # still two running beams
    # a stop token ranked below the width is skipped, not finished
    running, finished = select_beams([("a", 0.0)], {"a": [(-0.1, 4), (-0.2, 5), (-0.3, 0)]}, 2,
                                     stop_token_ids={0})
    assert finished == [] and [c.token for c in running] == [4, 5]


def test_prune_fork_and_end_on_a_real_ledger() -> None:
    ledger = KVLedger(40, 4)
    sched = Scheduler(ledger, SchedulerConfig(policy="full"))
    sched.add(GenRequest("r", list(range(6)), 5, n=3))
    plan = sched.schedule()
    assert [w.seq_id for w in plan.prefills] == ["r", "r/1", "r/2"]
    prune_beams(sched, "r", {"r", "r/1"})
    assert [b.seq_id for b in sched.running["r"]] == ["r", "r/1"]
    assert sched.branches("r")[2].finish_reason == "pruned" and "r/2" not in ledger
    sched.confirm(plan, {"r": [10], "r/1": [11]})
    (child,) = fork_beams(sched, "r", [("r", 12)])
    assert child is not None and child.seq_id == "r/3" and child.tokens == list(range(6)) + [12]
    assert ledger.sequence("r/3").table.blocks == ledger.sequence("r").table.blocks  # shared, tail included
    plan = sched.schedule()  # every beam appends into the shared partial tail: copy-on-write
    assert len(plan.copies) == 2 and {w.seq_id for w in plan.decodes} == {"r", "r/1", "r/3"}
    ledger.check()
    sched.confirm(plan, {"r": [1], "r/1": [2], "r/3": [3]})
    end_beams(sched, "r", "length")
    assert all(b.status is Status.FINISHED for b in sched.branches("r"))
    assert "r" in sched.finished
    u = ledger.usage()
    assert (u.active, u.promised, u.sequences) == (0, 0, 0) and ledger.outstanding_leases() == 0
    ledger.check()


def test_prune_refuses_to_drop_every_beam() -> None:
    ledger = KVLedger(20, 4)
    sched = Scheduler(ledger)
    sched.add(GenRequest("r", [1, 2, 3], 4, n=2))
    plan = sched.schedule()
    with pytest.raises(LedgerError):
        prune_beams(sched, "r", set())
    sched.confirm(plan, {"r": [4], "r/1": [5]})
    end_beams(sched, "r", "cancelled")
    ledger.check()
