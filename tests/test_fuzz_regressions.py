"""Defects the randomised fuzz (tests/fuzzing.py) found, each pinned down as a small hand-made scenario
that failed before its fix."""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import replace

from kvledger.core.ledger import KVLedger
from kvledger.core.tiers import TierLedger
from kvledger.scheduler import (
    ConstantExecutor,
    Driver,
    GenRequest,
    HostPool,
    Scheduler,
    SchedulerConfig,
    StepOutput,
    StepPlan,
)

try:  # the module name pytest gives tests/scheduler/test_scheduler.py depends on its import mode
    from tests import fuzzing
    from tests.scheduler.test_scheduler import FakeEngine, assert_drained, expected_output, sample_token, toks
except ImportError:  # pragma: no cover
    import fuzzing
    from scheduler.test_scheduler import FakeEngine, assert_drained, expected_output, sample_token, toks


def test_a_beam_whose_one_beam_is_deferred_does_not_stall_the_scheduler() -> None:
    """``on_growth_failure="defer"`` with beam search. Pool of 10 blocks of 4: a 2-beam request (13-token
    prompt, 5 new tokens) and a 15-token request that will need 10 blocks. At step 8 the second beam and
    the long request cannot grow and are deferred, while the first beam could: but beams sample in
    step, so the driver holds it back -- nobody can advance, yet "every running branch is deferred" was
    false, so no victim was ever chosen and the driver stopped with "the scheduler made no progress".
    A beam request with a deferred beam is stuck as a whole: one victim (``latest``: the long request)
    is recomputed and both requests finish."""
    s = Scheduler(KVLedger(10, 4), SchedulerConfig(policy="incremental", on_growth_failure="defer",
                                                   victim="latest", watermark=0.0))
    driver = Driver(s, ConstantExecutor(), check_every=1, stall_steps=50)
    driver.submit(GenRequest("beam", toks(13, 0), 5, n=2, beam=True))
    driver.submit(GenRequest("long", toks(15, 100), 23))
    finished = {}
    while driver.has_work():
        for f in driver.step().finished:
            finished[f.request.request_id] = f
    assert finished["beam"].finish_reasons == ["length", "length"]
    assert [len(o) for o in finished["beam"].outputs] == [5, 5]
    assert (finished["long"].finish_reasons, len(finished["long"].outputs[0])) == (["length"], 23)
    assert (finished["beam"].metrics.preemptions, finished["long"].metrics.preemptions) == (0, 1)
    assert s.preemptions == 1


def test_a_copy_on_write_copy_runs_before_its_block_is_swapped_out() -> None:
    """Pool of 5 blocks of 4, host of 8; ``incremental`` / ``preempt`` / ``priority`` / ``swap``.
    A (n=2, 7-token prompt, priority 0) shares its partial prompt tail between its branches; C
    (priority 5) holds one block; B (priority 1) arrives a step later. At step 3 A's first sampled
    token makes branch A copy the shared tail (copy-on-write), then B needs a block nobody has, and A,
    the lowest priority, is swapped out -- in the same schedule. The ledger dropped the copy with A's
    sequences, so the host received a block the copy never filled, and after the swap-in A read
    position 4 as KV that was never written (a real engine would have decoded from garbage). The copy
    now stays in the plan, before the swap-out, and belongs to A."""
    s = Scheduler(KVLedger(5, 4), SchedulerConfig(policy="incremental", on_growth_failure="preempt",
                                                  victim="priority", recovery="swap", watermark=0.0,
                                                  prefill_chunk=3), host=HostPool(8))
    engine = FakeEngine(s)  # checks every KV position each step reads
    s.add(GenRequest("A", toks(7, 10), 2, n=2, priority=0))
    s.add(GenRequest("C", toks(1, 90), 4, priority=5))
    engine.step()
    s.add(GenRequest("B", toks(3, 50), 4, priority=1))
    engine.step()
    engine.step()
    plan = s.schedule()
    assert [(p.request_id, p.mode) for p in plan.preempted] == [("A", "swap")]
    swapped = {d for d, _ in plan.swap_out}
    copies = [c for c in plan.copies if c.dst in swapped]
    assert len(copies) == 1 and copies[0].slots == 3  # the 3 prompt tokens of the shared tail
    assert s.transfer_owners(plan)[0] == ["A"] * len(plan.copies)
    s.confirm(plan, engine.run(plan))
    s.check()
    engine.drain()
    for rid, n_out in (("A", 2), ("B", 4), ("C", 4)):
        for br in s.branches(rid):
            assert br.finish_reason == "length" and len(br.output) == n_out, (br.seq_id, br.finish_reason)
            assert br.output == [sample_token(br.seq_id, len(br.request.prompt) + i) for i in range(n_out)]
    assert [br.preemptions for br in s.branches("A")] == [1, 1]
    u = s.ledger.usage()
    assert (u.active, u.promised, u.deferred) == (0, 0, 0)
    assert s.host.num_free == 8


def test_held_back_beams_do_not_starve_a_lagging_beam_of_the_token_budget() -> None:
    """Found by the fuzz (scheduler episode seed 2045599137606; replay:
    ``.venv/bin/python tests/fuzzing.py --part scheduler --seed 2045599137606 --episodes 1 --ops 0``).
    token_budget 4, on_growth_failure=defer. Beam r6 (n=3) has one beam deferred (no memory), so the
    driver holds its other beams back; beam r1 (n=3, read_prefix_cache off) has two branches at their
    last prompt token and one, r1/2, with nothing computed. Every step plans the four decodes
    r6, r6/3, r1, r1/1 -- all held back -- and r1/2 never gets a token of budget; r1 defers nothing,
    so the all-stuck rule never preempts anyone: no progress for 200 steps. The scheduler now spends no
    budget on a beam request's decodes unless all its beams decode together; r1/2's prefill runs."""
    sc = fuzzing.draw_scenario(random.Random(2045599137606))
    fuzzing.run_scenario(sc, Counter())


def test_a_lagging_beam_gets_token_budget_while_its_siblings_wait_to_decode() -> None:
    """Hand-made companion of the fuzz case above: pool of 10 blocks of 4, ``token_budget`` 4,
    ``prefill_chunk`` 2, ``on_growth_failure="defer"``; two beam requests of width 3 (six beams, more
    than the budget). Once memory runs short, one request has a deferred beam and the other a beam
    whose prefill lags behind its siblings. The scheduler used to plan the ready beams' decodes first
    -- four of them, the whole budget -- and beam search held them all back, so the lagging prefill
    never ran: "no progress in 50 steps". Ready beams now wait (no budget spent) until every beam of
    their request can decode together, and both searches finish."""
    s = Scheduler(KVLedger(10, 4), SchedulerConfig(policy="incremental", token_budget=4, prefill_chunk=2,
                                                   on_growth_failure="defer", watermark=0.0))
    driver = Driver(s, ConstantExecutor(), check_every=1, stall_steps=50)
    driver.submit(GenRequest("A", toks(7, 0), 6, n=3, beam=True))
    driver.submit(GenRequest("B", toks(8, 900), 5, n=3, beam=True))
    finished = {}
    while driver.has_work():
        for f in driver.step().finished:
            finished[f.request.request_id] = f
    assert sorted(finished) == ["A", "B"]
    for rid, n_out in (("A", 6), ("B", 5)):
        assert finished[rid].finish_reasons == ["length"] * 3, finished[rid].finish_reasons
        assert [len(o) for o in finished[rid].outputs] == [n_out] * 3
    assert s.num_live() == 0
    s.check()


def test_a_beam_wider_than_the_token_budget_is_refused_rather_than_stalling() -> None:
    """Found while fixing the case above: beams decode in one step, so a beam request with more beams
    than ``token_budget`` (3 beams, budget 2) could never take a step, and the driver stopped with "no
    progress" (a scheduler bug). It now ends at admission with a reason that says why; a request
    behind it runs."""
    s = Scheduler(KVLedger(64, 4), SchedulerConfig(token_budget=2, watermark=0.0))
    driver = Driver(s, ConstantExecutor(), check_every=1, stall_steps=50)
    driver.submit(GenRequest("wide", toks(5, 0), 3, n=3, beam=True))
    driver.submit(GenRequest("fits", toks(5, 100), 3, n=2, beam=True))
    finished = {}
    while driver.has_work():
        for f in driver.step().finished:
            finished[f.request.request_id] = f
    assert finished["wide"].finish_reasons == ["never: more beams than token_budget (beams decode in one step)"]
    assert finished["wide"].outputs == [[]]
    assert finished["fits"].finish_reasons == ["length", "length"]
    assert [len(o) for o in finished["fits"].outputs] == [3, 3]


def test_a_restored_familys_copy_on_write_reads_its_block_after_the_swap_in() -> None:
    """Found by the fuzz with transfer failures (scheduler seed 11000792 with ``--faults always``: its
    undisturbed run). Pool of 4 blocks of 4, host of 8; ``incremental`` / ``preempt`` / ``latest`` /
    ``swap``, prefill chunk 5, token budget 8. A (n=2, 6-token prompt, lookahead 1) is admitted at step 3:
    branch A prefills 5 tokens -- position 4 into the shared partial block 2 -- and A/1 two. At step 4
    G needs a block and A, the latest, is swapped out. When G is done A comes back: its full prompt
    block is still cached on the device, and the partial block returns from the host into block 3,
    shared by both branches; A's draft slot must not land in A/1's block, so the same plan copies block
    3 into A's own block 2 (copy-on-write). Copies execute first (``StepPlan.copies``; the executor
    order is copies, swap-out, swap-in, forward): the copy reads block 3 before the swap-in has filled
    it, and A then reads position 4 as KV that was never written (a real engine whose swap-in does not
    run before its copies decodes from garbage)."""
    s = Scheduler(KVLedger(4, 4), SchedulerConfig(policy="incremental", on_growth_failure="preempt",
                                                  victim="latest", recovery="swap", watermark=0.0,
                                                  prefill_chunk=5, token_budget=8), host=HostPool(8))
    engine = FakeEngine(s)  # checks every KV position each step reads
    s.add(GenRequest("G", toks(1, 100), 11))
    for _ in range(3):
        engine.step()
    s.add(GenRequest("A", toks(6, 0), 1, n=2, lookahead=1))
    plans = engine.drain()
    (restore,) = [p for p in plans if p.swap_in]
    arriving = {d for _, d in restore.swap_in}
    assert not [c for c in restore.copies if c.src in arriving], "a copy reads a block that arrives in its step"
    for rid, prompt, n_out in (("A", 6, 1), ("A/1", 6, 1), ("G", 1, 11)):
        br = next(b for b in s.branches(rid.split("/")[0]) if b.seq_id == rid)
        assert br.finish_reason == "length" and br.output[:n_out] == expected_output(rid, prompt, n_out)
    assert_drained(s)


class UnreadableTier(FakeEngine):
    """Every promotion read fails, told to the scheduler at once as the torch executor does (the step goes
    on; the requests sent back to recompute are skipped); in that step request X's part raises too."""

    promotion_step: int | None = None

    def execute(self, plan: StepPlan) -> StepOutput:
        if plan.promote:
            self.promotion_step = plan.step
            self.s.transfers_failed(StepPlan(plan.step, promote=list(plan.promote)))
        if plan.step == self.promotion_step and any(w.request_id == "X" for w in plan.works):
            raise RuntimeError("X's sampling failed")
        running = self.s.running
        rest = replace(plan, promote=[], prefills=[w for w in plan.prefills if w.request_id in running],
                       decodes=[w for w in plan.decodes if w.request_id in running])
        return StepOutput(sampled=self.run(rest))


def test_a_lost_promotion_is_counted_once_when_its_step_is_run_again() -> None:
    """Found by the fuzz with transfer failures (scheduler seed 9007021 with ``--faults always``: "3
    promotions failed of 2 planned"). A's 4 prompt blocks are cached, B's admission demotes 3 of them to
    the host tier, and C comes for A's prompt: its admission promotes the 3 blocks, whose reads fail --
    the executor tells ``Scheduler.transfers_failed`` at once and C goes back to recompute. In the same
    step X's part raises, so the driver runs the step again one part at a time, the prefix cache's
    transfers first: the promotions are read again, fail again and are told again. The scheduler counted
    them again: 6 promotion failures of 3 promoted blocks, and ``promoted_tokens`` -12 (in /metrics:
    ``kvledger:tier_promotion_failures_total``)."""
    s = Scheduler(KVLedger(8, 4), SchedulerConfig(offload_prefixes=True, writeback_blocks=0),
                  host=TierLedger([("host", 8)]))
    driver = Driver(s, UnreadableTier(s), check_every=1)

    def run(*requests: GenRequest) -> dict[str, list[str]]:
        for r in requests:
            driver.submit(r)
        out = {}
        while driver.has_work():
            out.update({f.request.request_id: f.finish_reasons for f in driver.step().finished})
        return out

    run(GenRequest("A", toks(16, 0), 2))
    run(GenRequest("B", toks(24, 500), 2))
    assert len(s.host.index) == 3
    driver.submit(GenRequest("X", toks(2, 900), 4))
    driver.step()  # X runs: it has a part in C's promotion step
    assert run(GenRequest("C", toks(16, 0) + toks(3, 700), 2)) == {
        "X": ["error: RuntimeError: X's sampling failed"], "C": ["length"]}
    stats = s.tier_stats()
    assert (stats["promotion_failures"], stats["promoted_tokens"]) == (3, 0)
    u = s.ledger.usage()
    assert (u.active, u.promised, u.sequences, s.ledger.outstanding_leases()) == (0, 0, 0, 0)
    s.check()


def test_the_fuzz_episode_that_counted_a_lost_promotion_twice() -> None:
    """The fuzz episode itself: a swap-in and a promotion of the same step fail; the executor writes the
    step's cache entries off (the lost promotion among them) and the step fails; the driver's rerun of the
    prefix cache's transfers fails the promotion again, and it was counted again."""
    sc = fuzzing.draw_scenario(random.Random(9007021), "always")
    fuzzing.run_scenario(sc, Counter())
