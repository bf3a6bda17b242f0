"""Regression tests for scheduler defects of issue 9 (each failed before its fix), the liveness rule,
priority-ordered admission, the prefix-cache reset and write-only requests, and victim / growth
scenarios with ties and counted outcomes. Every scenario runs on ``FakeEngine`` (tests/scheduler/test_scheduler.py),
which checks every KV position a step reads, so a wrong restore or a wrong share fails here too."""

from __future__ import annotations

import pytest

from kvledger.core.identity import CacheContext
from kvledger.core.ledger import KVLedger
from kvledger.core.observe import EventLog
from kvledger.errors import InvariantError
from kvledger.scheduler import (
    VICTIM_POLICIES,
    Driver,
    GenRequest,
    HostPool,
    Scheduler,
    SchedulerConfig,
    Status,
)
from kvledger.scheduler.growth import REJECTED_NO_ROOM, REJECTED_OUTGREW
from kvledger.scheduler.queue import WaitingQueue

try:  # the module name pytest gives tests/scheduler/test_scheduler.py depends on its import mode
    from tests.scheduler.test_scheduler import (
        BS,
        SHARED,
        FakeEngine,
        assert_drained,
        expected_output,
        toks,
        victim_scenario,
    )
except ImportError:  # pragma: no cover
    from test_scheduler import BS, SHARED, FakeEngine, assert_drained, expected_output, toks, victim_scenario


def family_scenario(recovery: str = "recompute", prefix_caching: bool = True, events: EventLog | None = None,
                    ) -> tuple[Scheduler, FakeEngine]:
    """Pool of 9 four-token blocks, incremental, victim latest, no watermark. G (group g): 4-token
    prompt, 20 new. F (group f): 8-token prompt (2 full blocks), 12 new, n=2 -- 2 shared prompt blocks
    + a private block per branch at admission. F is admitted after G, so it is the victim when growth
    first fails (step 9); it can come back only once G has finished."""
    led = KVLedger(9, BS, prefix_caching=prefix_caching, events=events)
    cfg = SchedulerConfig(policy="incremental", victim="latest", watermark=0.0, recovery=recovery)
    s = Scheduler(led, cfg, host=HostPool(16))
    s.add(GenRequest("G", toks(4, 100), 20, CacheContext(trust_group="g")))
    s.add(GenRequest("F", toks(8, 200), 12, CacheContext(trust_group="f"), n=2))
    return s, FakeEngine(s)


def assert_family_done(s: Scheduler) -> None:
    assert [(b.finish_reason, b.output) for b in s.branches("G")] == [("length", expected_output("G", 4, 20))]
    assert [(b.finish_reason, b.output) for b in s.branches("F")] == [
        ("length", expected_output(sid, 8, 12)) for sid in ("F", "F/1")]
    assert_drained(s)


# ---- defect 3: a refused family re-admission changes nothing --------------------------------------
def test_a_refused_family_readmission_changes_nothing() -> None:
    """Before the fix the branches were admitted one at a time and retracted when the second did not
    fit: every waiting step took F's cached prefix, counted a prefix query and hits, indexed and
    removed blocks (stored / removed events) and refreshed the LRU order of F's cached blocks."""
    events = EventLog()
    s, engine = family_scenario(events=events)
    led = s.ledger
    waited = 0
    while s.has_work():
        seen = len(events.all())
        before = (led.stats()["prefix_cache"], led.stats()["prefix_cache_readmissions"], led.pool.retained.blocks())
        plan = engine.step()
        waiting = any(u[0].request.request_id == "F" for u in s.waiting)
        if waiting and not plan.preempted:
            waited += 1
            assert [e.kind for e in events.all()[seen:] if e.trust_group == "f" and e.kind != "evicted"] == []
            after = (led.stats()["prefix_cache"], led.stats()["prefix_cache_readmissions"], led.pool.retained.blocks())
            assert after[:2] == before[:2], plan.step
            evicted = {e.block for e in events.all()[seen:] if e.kind == "evicted"}
            assert after[2] == [b for b in before[2] if b not in evicted] + after[2][len(before[2]) - len(evicted):]
    assert waited == 10  # steps 10..19: G finishes in step 19, F comes back in step 20
    stats = led.stats()
    # Cache statistics keep the re-admission apart: G and F's first admission; then F's two branches.
    assert stats["prefix_cache"]["queries"] == 2
    assert stats["prefix_cache_readmissions"]["queries"] == 2
    assert stats["admissions"]["readmitted"] == 1
    assert_family_done(s)


# ---- defect 4: cancelling a swapped family frees its shared host blocks once ----------------------
def test_cancel_of_a_swapped_family_frees_shared_host_blocks_once() -> None:
    """Before the fix each branch freed its host blocks, so the 2 shared prompt blocks were freed twice:
    ``InvariantError: host block ... freed but not in use``."""
    s, engine = family_scenario(recovery="swap")
    while not s.swapped:
        engine.step()
    (unit,) = s.swapped
    shared = set(unit[0].host_blocks) & set(unit[1].host_blocks)
    held = set(unit[0].host_blocks) | set(unit[1].host_blocks)
    assert len(shared) == 2 and s.host.num_used == len(held) < len(unit[0].host_blocks) + len(unit[1].host_blocks)
    assert s.cancel("F")
    s.check()
    assert s.host.num_used == 0 and [b.finish_reason for b in s.branches("F")] == ["cancelled", "cancelled"]
    engine.drain()
    assert s.branches("G")[0].finish_reason == "length"
    assert_drained(s)


# ---- defect 6: without prefix caching a preempted family fits again -------------------------------
@pytest.mark.parametrize("recovery", ["recompute", "swap"])
def test_a_preempted_family_fits_again_without_prefix_caching(recovery: str) -> None:
    """Before the fix each branch came back with a private copy of the prompt (no prefix index to
    share through): 2 x 5 blocks > 9, refused "not now" forever while the pool sat empty."""
    s, engine = family_scenario(recovery=recovery, prefix_caching=False)
    plans = engine.drain()
    back = [p for p in plans if p.step > 0 and "F" in p.admitted]
    assert len(back) == 1
    f, f1 = (s.ledger.sequence(sid) if sid in s.ledger else None for sid in ("F", "F/1"))
    assert f is None and f1 is None  # finished
    assert s.preemptions == 1
    assert_family_done(s)


# ---- the liveness rule ----------------------------------------------------------------------------
def pinned_pool(num_blocks: int, pinned: int, cfg: SchedulerConfig) -> tuple[Scheduler, FakeEngine]:
    """A pool with ``pinned`` blocks held by a pin (a cached system prompt nobody may evict)."""
    led = KVLedger(num_blocks, BS, max_pinned_fraction=0.5)
    s = Scheduler(led, cfg)
    engine = FakeEngine(s)
    system = toks(pinned * BS, 900)
    s.add(GenRequest("sys", system, 1))
    engine.drain()
    assert led.pin("system", system, CacheContext()) == pinned
    return s, engine


def test_a_request_that_outgrows_the_pool_alone_ends_instead_of_deferring_forever() -> None:
    """defer, alone in an 8-block pool with 3 blocks pinned: the request (4 + 20 tokens = 6 blocks, so
    it is not 'never') grows to 5 blocks = 20 tokens and can grow no further. Before, it deferred
    forever (the engine raised after 1,000 idle steps; the simulator cancelled it)."""
    cfg = SchedulerConfig(policy="incremental", on_growth_failure="defer", watermark=0.0)
    s, engine = pinned_pool(8, 3, cfg)
    s.add(GenRequest("r", toks(4, 100), 20))
    engine.drain(limit=40)
    (br,) = s.branches("r")
    assert br.finish_reason == REJECTED_OUTGREW
    # 5 blocks hold 20 tokens; the 21st was sampled but has no slot (its output is kept).
    assert br.output == expected_output("r", 4, 20)[:17] and br.in_ledger == 5 * BS
    s.ledger.unpin("system")
    assert_drained(s)


def test_a_queued_request_that_cannot_fit_the_emptied_pool_ends_and_the_queue_moves_on() -> None:
    """full, 8 blocks with 3 pinned: 'big' needs 6 blocks (not 'never': the pool has 8) but only 5 can
    ever be promised. With nothing running, it ends; 'small' behind it runs."""
    s, engine = pinned_pool(8, 3, SchedulerConfig(policy="full"))
    s.add(GenRequest("big", toks(4, 100), 20))
    s.add(GenRequest("small", toks(4, 300), 4))
    plans = engine.drain(limit=20)
    assert ("big", REJECTED_NO_ROOM) in plans[0].ended
    assert s.branches("big")[0].output == []
    assert s.branches("small")[0].finish_reason == "length"
    s.ledger.unpin("system")
    assert_drained(s)


# ---- admission order ------------------------------------------------------------------------------
def test_admission_follows_priority_then_arrival() -> None:
    """One 2-block request fits at a time (full reservation, 2-block pool)."""
    s = Scheduler(KVLedger(2, BS), SchedulerConfig(policy="full"))
    for rid, prio in (("a", 0), ("b", 2), ("c", 1), ("d", 2), ("e", 0)):
        s.add(GenRequest(rid, toks(4, 100 * (ord(rid) - 96)), 4, priority=prio))
    order = [rid for p in FakeEngine(s).drain() for rid in p.admitted]
    assert order == ["b", "d", "c", "a", "e"]
    assert_drained(s)


def test_the_waiting_queue_orders_by_priority_and_puts_preempted_units_first() -> None:
    q = WaitingQueue()

    def unit(rid: str, prio: int) -> list:
        return [type("B", (), {"request": GenRequest(rid, [1], 1, priority=prio)})()]

    a, b, c, d = unit("a", 0), unit("b", 1), unit("c", 0), unit("d", 1)
    for u in (a, b, c):
        q.append(u)
    q.appendleft(d)  # preempted: first among priority 1
    assert [u[0].request.request_id for u in q] == ["d", "b", "a", "c"]
    assert q[0] is d and q[2] is a and len(q) == 4
    q.remove(b)
    assert q.popleft() is d and q.popleft() is a and q.popleft() is c and not q
    with pytest.raises(IndexError):
        q.popleft()


# ---- the prefix cache -----------------------------------------------------------------------------
def test_reset_prefix_cache_refuses_while_held_and_can_requeue_running_requests() -> None:
    s = Scheduler(KVLedger(16, BS), SchedulerConfig(policy="full"))
    engine = FakeEngine(s)
    s.add(GenRequest("old", toks(8, 100), 2))
    engine.drain()
    s.add(GenRequest("run", toks(8, 100), 6))  # hits old's cached prompt
    engine.step()
    led = s.ledger
    assert led.pool.num_retained == 0 and led.sequence("run").hit_blocks == 2
    refused = s.reset_prefix_cache()
    assert not refused and "running sequences" in refused.reason and "run" in s.running
    plan = s.schedule()
    assert not s.reset_prefix_cache(requeue_running=True) and "in flight" in s.reset_prefix_cache().reason
    s.confirm(plan, engine.run(plan))
    done = s.reset_prefix_cache(requeue_running=True)
    assert done and "run" not in s.running and s.waiting[0][0].seq_id == "run"
    assert led.pool.index == {} and led.usage().retained == 0 and led.usage().free == 16
    assert s.preemptions == 0  # a requeue is not a preemption (full reservation stays exact)
    engine.drain()
    run = s.branches("run")[0]
    assert (run.finish_reason, run.output) == ("length", expected_output("run", 8, 6))
    assert_drained(s)


def test_a_write_only_request_computes_its_prompt_and_still_fills_the_cache() -> None:
    """read_prefix_cache=False (prompt logprobs): no hits, the whole prompt runs; later requests hit."""
    led = KVLedger(32, BS)
    driver = Driver(Scheduler(led, SchedulerConfig(policy="full")), _Tokens(), check_every=1, keep_records=True)
    driver.submit(GenRequest("first", toks(12, 100), 2))
    driver.run()
    driver.submit(GenRequest("write-only", toks(12, 100), 2, read_prefix_cache=False))
    steps = []
    driver.on_planned = lambda plan, t: steps.append([(w.seq_id, w.start, w.end) for w in plan.prefills])
    driver.run()
    assert steps[0] == [("write-only", 0, 12)]
    driver.submit(GenRequest("reader", [*toks(12, 100), 5], 2))
    driver.run()
    hits = {m.request_id: m.hit_tokens for m in driver.records}
    assert hits == {"first": 0, "write-only": 0, "reader": 12}
    assert led.stats()["prefix_cache"]["read_skipped"] == 1
    driver.scheduler.check()


class _Tokens:
    def execute(self, plan):
        from kvledger.scheduler import StepOutput

        return StepOutput({w.seq_id: [w.end % 50] for w in (*plan.prefills, *plan.decodes) if w.sample})


# ---- victims: keys, ties, counted outcomes ----------------------------------------------------------
def _keys_at_first_preemption(victim: str) -> dict[str, dict[str, float]]:
    s, engine = victim_scenario(victim)
    seen: dict[str, dict[str, float]] = {}
    original = s.preempt

    def spy(rid, plan, why, force=None):
        if not seen:
            for name in VICTIM_POLICIES.names():
                key = VICTIM_POLICIES[name]
                seen[name] = {r: key(s.ledger, brs) for r, brs in s.running.items()}
        return original(rid, plan, why, force)

    s.preempt = spy  # type: ignore[method-assign]
    for _ in range(5):
        engine.step()
    return seen


def test_victim_keys_are_the_documented_formulas() -> None:
    """The victim table of tests/scheduler/test_scheduler.py: min_waste = held blocks x replay tokens."""
    keys = _keys_at_first_preemption("latest")
    assert keys["min_waste"] == {"B": 3 * 13, "A": 2 * 9, "C": 3 * 5, "D": 4 * 8}
    assert keys["least_computed"] == {"B": 12, "A": 8, "C": 12, "D": 15}
    assert keys["priority"] == {"B": -1, "A": 0, "C": 0, "D": 0}
    assert keys["latest"] == {"B": 0, "A": 0, "C": 0, "D": 0}


@pytest.mark.parametrize("victim", VICTIM_POLICIES.names())
def test_ties_go_to_the_latest_admitted(victim: str) -> None:
    """A, B, C alike (4-token prompts, 12 new, equal priority), admitted in that order into 6 blocks:
    2 each. In step 5 A appends position 8 and needs a third block. Every key ties (computed 8, held
    2, replay 9 each): every policy takes C, the latest admitted; C's 2 blocks let A and B grow."""
    led = KVLedger(6, BS)
    s = Scheduler(led, SchedulerConfig(policy="incremental", victim=victim, watermark=0.0))
    for i, rid in enumerate("ABC"):
        s.add(GenRequest(rid, toks(4, 100 * (i + 1)), 12))
    engine = FakeEngine(s)
    plans = [engine.step() for _ in range(6)]
    assert [p.preempted for p in plans[:5]] == [[]] * 5
    assert [(p.request_id, p.reason) for p in plans[5].preempted] == [("C", "A needed a block")]
    engine.drain()
    for rid in "ABC":
        br = s.branches(rid)[0]
        assert (br.finish_reason, br.output) == ("length", expected_output(rid, 4, 12))
    assert_drained(s)


def test_the_grower_waits_one_step_after_a_swap() -> None:
    """min_waste with swap on the victim table. Step 5: B needs a block; C (15) is swapped out, but its
    blocks come free only when the copy is done, so B defers instead of picking a second victim. A
    then needs a block: B 39, A 18, D 4 x 16 = 64 (with C gone D's SHARED blocks are its own): A swaps
    itself out. Over the run: 6 preemptions (retrying the grower at once after a swap gives 9)."""
    s, engine = victim_scenario("min_waste", recovery="swap", host=HostPool(64))
    plans = [engine.step() for _ in range(5)]
    step5 = plans[4]
    assert [(p.request_id, p.mode, p.reason) for p in step5.preempted] == [
        ("C", "swap", "B needed a block"), ("A", "swap", "A needed a block")]
    assert "B" not in {w.seq_id for w in (*step5.prefills, *step5.decodes)}
    assert s.branches("B")[0].deferred
    engine.drain()
    assert s.preemptions == 6
    for rid in "ABCD":
        br = s.branches(rid)[0]
        assert (br.finish_reason, br.output) == ("length", expected_output(rid, len(br.request.prompt), 20))
    assert_drained(s)


# Every growth action on the victim table's requests (victim latest, recompute). Step 5 is the first
# growth failure: B (first in admission order) needs a fourth block, A a third and C a fourth, with no
# block left.
#   defer:    B, A, C defer; D still has room, so not everyone is deferred. Step 6: D needs its fifth
#             block: now all are deferred and the latest (D) is recomputed to break the deadlock.
#   reject:   B ends (5 tokens); its 3 blocks let A and C grow. A ends in step 9, D in step 14.
#   headroom: 1 block kept free at admission: D waits in step 1 (1 new + 1 promised would leave 0).
#             In step 5 B and A take the 2 free blocks and C, the latest, preempts itself.
GROWTH = {
    "defer": (dict(), (6, ["D"], []), 4, {}),
    "reject": (dict(), (5, [], [("B", "rejected: no memory to grow")]), 0,
               {"B": 5, "A": 8, "D": 13}),
    "headroom": (dict(headroom_blocks=1), (5, ["C"], []), 4, {}),
}


@pytest.mark.parametrize("action", list(GROWTH))
def test_every_growth_action_on_the_victim_table(action: str) -> None:
    extra, first, total, rejected = GROWTH[action]
    led = KVLedger(10, BS)
    s = Scheduler(led, SchedulerConfig(policy="incremental", on_growth_failure=action, victim="latest",
                                       watermark=0.0, **extra))
    engine = FakeEngine(s)
    s.add(GenRequest("B", toks(8, 200), 20, priority=-1))
    engine.step()
    for rid, prompt in (("A", toks(5, 100)), ("C", [*SHARED, 7]), ("D", [*SHARED, 1, 2, 3, 4])):
        s.add(GenRequest(rid, prompt, 20))
    plans = engine.drain()
    assert plans[0].admitted == (["A", "C"] if action == "headroom" else ["A", "C", "D"])
    events = [(p.step, [x.request_id for x in p.preempted], p.ended) for p in plans if p.preempted or p.ended]
    assert events[0] == first
    assert s.preemptions == total
    for rid in "ABCD":
        br = s.branches(rid)[0]
        if rid in rejected:
            assert (br.finish_reason, br.num_generated) == ("rejected: no memory to grow", rejected[rid])
            assert br.output == expected_output(rid, len(br.request.prompt), 20)[: rejected[rid]]
        else:
            assert (br.finish_reason, br.output) == ("length", expected_output(rid, len(br.request.prompt), 20))
    assert_drained(s)


def test_check_notices_a_branch_that_lost_its_block_table() -> None:
    s, engine = victim_scenario("latest")
    engine.step()
    s.running["A"][0].blocks = list(s.running["A"][0].blocks)  # a copy: the plan would name stale blocks
    with pytest.raises(InvariantError, match="block table"):
        s.check()
    s.running["A"][0].blocks = s.ledger.sequence("A").table.blocks
    s.check()
    assert s.branches("A")[0].status is Status.RUNNING


def test_reset_with_requeue_refuses_pins_and_leases_first_and_keeps_admission_order() -> None:
    led = KVLedger(32, BS)
    s = Scheduler(led, SchedulerConfig(policy="full"))
    engine = FakeEngine(s)
    s.add(GenRequest("warm", toks(8, 100), 2))
    engine.drain()  # its 8 prompt tokens are two written, cached blocks
    assert led.pin("keep", toks(8, 100), CacheContext()) == 2
    for rid, start in (("x", 0), ("y", 40), ("z", 80)):
        s.add(GenRequest(rid, toks(5, start), 6))
    engine.step()
    assert list(s.running) == ["x", "y", "z"]
    plan = s.schedule()
    in_flight = s.reset_prefix_cache(requeue_running=True)
    assert (in_flight.done, in_flight.cleared_blocks) == (False, 0)
    assert in_flight.reason == f"step {plan.step} is in flight: reset between steps"
    s.confirm(plan, engine.run(plan))
    refused = s.reset_prefix_cache(requeue_running=True)
    assert (refused.done, refused.cleared_blocks, refused.reason) == (False, 0, "blocks are still held: 1 pins")
    assert list(s.running) == ["x", "y", "z"]  # nothing was requeued before refusing
    led.unpin("keep")
    lease = led.lease(blocks=[led.sequence("x").table.blocks[0]], owner="transfer")
    refused = s.reset_prefix_cache(requeue_running=True)
    assert refused.reason == "blocks are still held: 1 outstanding leases" and "x" in s.running
    led.end_lease(lease)
    done = s.reset_prefix_cache(requeue_running=True)
    assert done.done and done.cleared_blocks > 0 and not s.running
    # Requeued at the front, in their admission order, each as a fresh wait with nothing computed.
    assert [u[0].seq_id for u in s.waiting] == ["x", "y", "z"]
    for unit in s.waiting:
        br = unit[0]
        assert (br.status, br.computed, br.in_ledger, br.blocks, br.deferred) == (Status.WAITING, 0, 0, [], False)
    engine.drain()
    for rid in ("x", "y", "z"):
        br = s.branches(rid)[0]
        assert br.finish_reason == "length" and len(br.output) == 6


@pytest.mark.parametrize("recovery", ["recompute", "swap"])
def test_a_lone_request_that_outgrows_the_pool_is_rejected_not_preempted(recovery: str) -> None:
    """on_growth_failure=preempt, alone in an 8-block pool with 3 blocks pinned: the request (4 + 20
    tokens = 6 blocks, so not 'never') fills 5 blocks = 20 tokens and can grow no further. Preempting
    itself would free nothing it could use again: it ends 'outgrew the whole pool', never preempted."""
    cfg = SchedulerConfig(policy="incremental", on_growth_failure="preempt", recovery=recovery, watermark=0.0)
    led = KVLedger(8, BS, max_pinned_fraction=0.5)
    s = Scheduler(led, cfg, host=HostPool(16))
    engine = FakeEngine(s)
    system = toks(3 * BS, 900)
    s.add(GenRequest("sys", system, 1))
    engine.drain()
    assert led.pin("system", system, CacheContext()) == 3
    s.add(GenRequest("r", toks(4, 100), 20))
    plans = engine.drain(limit=40)
    (br,) = s.branches("r")
    assert (br.finish_reason, s.preemptions) == (REJECTED_OUTGREW, 0)
    # The step that ended it says so (executors drop a branch's state on plan.ended).
    assert [e for p in plans for e in p.ended] == [("r", REJECTED_OUTGREW)]
    assert br.output == expected_output("r", 4, 20)[:17] and br.in_ledger == 5 * BS
    s.ledger.unpin("system")
    assert_drained(s)


def test_a_reset_refused_for_pins_and_leases_names_both() -> None:
    from kvledger.scheduler import GenRequest, Scheduler, SchedulerConfig
    led = KVLedger(32, BS)
    s = Scheduler(led, SchedulerConfig(policy="full"))
    engine = FakeEngine(s)
    s.add(GenRequest("warm", toks(8, 100), 2))
    engine.drain()
    led.pin("keep", toks(8, 100), CacheContext())
    s.add(GenRequest("x", toks(5, 0), 6))
    engine.step()
    lease = led.lease(blocks=[led.sequence("x").table.blocks[0]], owner="transfer")
    refused = s.reset_prefix_cache(requeue_running=True)
    assert refused.reason == "blocks are still held: 1 pins, 1 outstanding leases"
    led.end_lease(lease)
