"""Tests written because mutants drawn by ``tests/mutation.py sample`` (seed 7: a seeded uniform sample of
every mutant of ``core/`` and ``scheduler/``, docs/testing.md) survived the suite. Each pins down something
a caller can see -- a decision, a layout, which blocks a failed transfer frees, a message, a counter, a
step's output, the order of a plan's decodes, who owns a copy, a modelled transfer time -- that no other
test checked."""

from __future__ import annotations

import pytest

from kvledger.core.ledger import KVLedger, Outcome, Request
from kvledger.core.table import BlockTable
from kvledger.core.tiers import TierLedger
from kvledger.errors import InvariantError
from kvledger.scheduler import ConstantExecutor, Driver, GenRequest, Scheduler, SchedulerConfig, StepPlan
from kvledger.scheduler.host import TransferModel
from kvledger.scheduler.transfers import step_transfer_timing

BS = 4


def toks(base: int, n: int) -> list[int]:
    return [base + i for i in range(n)]


def sample_all(plan: StepPlan, token: int) -> dict[str, list[int]]:
    return {w.seq_id: [token] for w in (*plan.prefills, *plan.decodes) if w.sample}


# ---- admission of a family -------------------------------------------------------------------------------

def test_a_family_with_as_many_branches_as_the_pool_has_blocks_can_be_readmitted() -> None:
    """Two branches sharing one full block of 4 tokens, nothing more to generate: 1 block in a pool of 2.
    Only *more* branches than blocks is refused up front."""
    led = KVLedger(2, BS)
    reqs = [Request(rid, toks(1, 4), 0, family="F", readmission=True) for rid in ("F", "F/1")]
    d = led.admit_family(reqs)
    assert d.outcome is Outcome.ADMITTED and sorted(led.sequences()) == ["F", "F/1"]
    assert led.usage().free == 1  # the one shared block is the family's
    led.check()


def test_a_family_that_needs_more_than_the_pool_names_its_blocks_not_its_branches() -> None:
    """Two branches of 3 prompt + 4 new tokens in a pool of 2: each needs blocks_for(7) = 2 of its own,
    4 in all; the reason gives that figure (two branches do not exceed two blocks)."""
    led = KVLedger(2, BS)
    reqs = [Request(rid, toks(1, 3), 4, family="F", readmission=True) for rid in ("F", "F/1")]
    d = led.admit_family(reqs)
    assert d.outcome is Outcome.NEVER
    assert d.reason.startswith("needs 4 blocks for 2 branches") and "asks for" not in d.reason


def test_family_layout_marks_the_first_block_of_each_path_with_parent_minus_one() -> None:
    """``FamilyLayout.parents`` is documented as "-1 for the first block": two branches whose 8 tokens
    differ in the second block form nodes 0 (root), 1 and 2 (both children of 0)."""
    led = KVLedger(8, BS, prefix_caching=False)  # without caching the digests are not read
    reqs = [Request("F", toks(1, 8), 0, family="F"), Request("F/1", toks(1, 4) + toks(50, 4), 0, family="F")]
    layout = led.family_layout(reqs, [[], []])
    assert layout.parents == [-1, 0, 0]
    assert layout.paths == [[0, 1], [0, 2]] and layout.nodes == 3


# ---- failed transfers, tables, tiers ---------------------------------------------------------------------

def test_invalidate_frees_a_retained_block_and_drops_it_from_the_cache() -> None:
    """A finished 8-token request leaves its 2 blocks retained (6 free of 8). Invalidating its first block
    frees it (7 free, 1 retained), and the same prompt then hits nothing: the chain starts there."""
    led = KVLedger(8, BS)
    assert led.admit(Request("a", toks(1, 8), 1)).admitted
    led.mark_computed("a", 8)
    first = led.sequence("a").table.blocks[0]
    led.release("a")
    assert (led.usage().free, led.usage().retained) == (6, 2)
    led.invalidate([first])
    assert (led.usage().free, led.usage().retained) == (7, 1)
    assert first in led.pool.free_blocks()
    assert led.admit(Request("b", toks(1, 8), 1)).blocks_hit == 0
    led.check()


def test_slot_mapping_past_the_table_names_the_position_and_the_blocks() -> None:
    """Two blocks of 4 cover positions 0..7; asking for [0, 9) names position 8 and the 2 blocks."""
    table = BlockTable(BS, [3, 5])
    assert table.slot_mapping(0, 2) == [12, 13]
    with pytest.raises(IndexError, match=r"^token position 8 is beyond the table's 2 blocks$"):
        table.slot_mapping(0, 9)


def _tiers_with_cached(n: int) -> tuple[TierLedger, list[int]]:
    tiers = TierLedger([("host", 8)])
    slots = [tiers.demote(i, bytes([i + 1]) * 32, "g") for i in range(n)]
    tiers.complete()
    return tiers, slots  # type: ignore[return-value]


def test_two_takes_in_one_step_count_both_slots_as_draining() -> None:
    """Promoting one entry, then another before ``complete``: 2 slots drain, the counter says 2 and the
    tier ledger still checks; after ``complete`` none drains."""
    tiers, slots = _tiers_with_cached(2)
    tiers.take([slots[0]])
    tiers.take([slots[1]])
    assert tiers.counts["draining"] == 2 and tiers.usage()["host"]["draining"] == 2
    tiers.check()
    tiers.complete()
    assert tiers.counts["draining"] == 0
    tiers.check()


def test_the_drain_list_check_says_exactly_what_disagrees() -> None:
    """The InvariantError of a lost drain list reads "draining slots and the drain list disagree"."""
    tiers, slots = _tiers_with_cached(1)
    tiers.take(slots)
    tiers._draining.clear()  # the corruption this check exists for (as in tests/core/test_tiers.py)
    with pytest.raises(InvariantError, match=r"^draining slots and the drain list disagree$"):
        tiers.check()


# ---- the scheduler and its driver -------------------------------------------------------------------------

def test_a_driver_step_returns_the_executors_output() -> None:
    """``StepResult.output`` is the executor's output of that step: the prefill of a 3-token prompt
    samples one token for "a", and the step took the output's elapsed time."""
    driver = Driver(Scheduler(KVLedger(16, BS)), ConstantExecutor())
    driver.submit(GenRequest("a", toks(100, 3), 4))
    result = driver.step()
    assert result.output is not None
    assert list(result.output.sampled) == ["a"]
    assert result.end_s - result.start_s == pytest.approx(result.output.elapsed_s)


def test_decodes_keep_running_order_when_one_branch_finished_its_prefill_without_sampling() -> None:
    """With ``prefill_chunk=4``, "a" (5 prompt tokens) computes 4 in step 0 and "b" (3 tokens) all 3 and
    samples. In step 1 both decode one token; the plan lists them in running order, "a" first."""
    s = Scheduler(KVLedger(16, BS), SchedulerConfig(prefill_chunk=4))
    s.add(GenRequest("a", toks(100, 5), 3))
    s.add(GenRequest("b", toks(200, 3), 3))
    plan = s.schedule()
    assert [(w.request_id, w.start, w.end) for w in plan.prefills] == [("a", 0, 4), ("b", 0, 3)]
    s.confirm(plan, sample_all(plan, 7))
    plan = s.schedule()
    assert [(w.request_id, w.start, w.end) for w in plan.decodes] == [("a", 4, 5), ("b", 3, 4)]
    assert plan.prefills == []


def test_a_copy_on_write_copy_of_a_running_request_is_owned_by_it() -> None:
    """Two branches share the partial tail of a 7-token prompt; their first decode copies it once (3
    tokens) for branch "A": ``transfer_owners`` names "A" as the owner of that copy."""
    s = Scheduler(KVLedger(16, BS))
    s.add(GenRequest("A", toks(10, 7), 2, n=2))
    plan = s.schedule()
    s.confirm(plan, sample_all(plan, 7))
    plan = s.schedule()
    assert len(plan.copies) == 1 and plan.copies[0].slots == 3
    assert s.transfer_owners(plan) == (["A"], [], [])


def test_a_writeback_costs_its_bytes_over_the_link() -> None:
    """One write-back of a 1000-byte block over a 1000 B/s link with 0.5 s overhead per round:
    1000 / 1000 + 0.5 = 1.5 s, all exposed when transfers do not overlap."""
    plan = StepPlan(0)
    plan.writeback.append((3, 0))
    link = TransferModel(link_Bps=1000, overhead_s=0.5)
    t = step_transfer_timing(plan, 0.0, lambda slot: link, 1000, BS, overlap=False)
    assert t.blocks == 1
    assert t.total_s == pytest.approx(1.5) and t.exposed_s == pytest.approx(1.5)
