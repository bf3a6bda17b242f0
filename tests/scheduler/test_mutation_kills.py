"""Tests written because a mutant survived ``make mutation`` (docs/testing.md): each pins down behaviour a
user relies on that no other test of the core or the scheduler checked -- a number in a run summary, the
exact refusal a caller branches on, the order requests come back in."""

from __future__ import annotations

import pytest

from kvledger.core import native
from kvledger.core.eviction import LRUPolicy, PriorityPolicy, as_policy, make_policy
from kvledger.core.identity import CacheContext
from kvledger.core.ledger import KVLedger
from kvledger.errors import ConfigError, LedgerError
from kvledger.scheduler import (
    ConstantExecutor,
    Driver,
    GenRequest,
    HostPool,
    RecoveryCosts,
    Registry,
    RequestMetrics,
    Scheduler,
    SchedulerConfig,
    Status,
    TransferModel,
    percentile,
    summarize_requests,
)
from kvledger.scheduler.growth import REJECTED_OUTGREW
from kvledger.scheduler.policies import OutputLengthTracker, reserve_tokens
from kvledger.scheduler.victims import VICTIM_POLICIES, held_blocks, replay_tokens

try:  # the module name pytest gives tests/scheduler/test_scheduler.py depends on its import mode
    from tests.scheduler.test_scheduler import BS, FakeEngine, assert_drained, expected_output, toks
except ImportError:  # pragma: no cover
    from test_scheduler import BS, FakeEngine, assert_drained, expected_output, toks


# ---- scheduler/metrics.py ---------------------------------------------------------------------------

def _metrics(rid: str, arrival: float, first: float | None, finish: float | None, reason: str, *,
             prompt: int = 10, generated: int = 0, longest: int = 0, hits: int = 0, readmit: int = 0,
             preemptions: int = 0) -> RequestMetrics:
    m = RequestMetrics(rid, "g", arrival, prompt, 8)
    m.first_token_s, m.finish_s, m.finish_reason = first, finish, reason
    m.generated, m.longest, m.hit_tokens, m.readmit_hit_tokens, m.preemptions = generated, longest, hits, readmit, \
        preemptions
    return m


def test_a_run_summary_counts_every_figure_by_hand() -> None:
    """Three requests: two completed, one failed with an error (its reason has a colon). Every figure of
    the summary is worked out here from the definitions in docs/scheduler.md."""
    reqs = [
        _metrics("a", 1.0, 2.0, 5.0, "length", prompt=10, generated=5, longest=5, hits=4, preemptions=1),
        _metrics("b", 2.0, 3.0, 4.0, "stop", prompt=20, generated=3, longest=3, readmit=2),
        _metrics("c", 3.0, None, 7.0, "error: RuntimeError: boom: twice", prompt=30),
    ]
    s = summarize_requests(reqs)
    assert s["requests"] == 3 and s["completed"] == 2
    assert s["finish_reasons"] == {"length": 1, "stop": 1, "error": 1}
    assert s["duration_s"] == 6.0  # first arrival 1.0 .. last finish 7.0
    assert s["output_tokens"] == 8
    assert s["throughput_tok_s"] == pytest.approx(8 / 6)
    assert s["throughput_req_s"] == pytest.approx(2 / 6)
    assert s["total_tok_s"] == pytest.approx((8 + 10 + 20) / 6)  # prompts of completed requests only
    assert s["ttft_s"]["mean"] == pytest.approx(1.0) and s["ttft_s"]["max"] == 1.0
    assert s["tpot_s"]["p50"] == pytest.approx((3 / 4 + 1 / 2) / 2)  # (5-2)/(5-1), (4-3)/(3-1)
    assert s["e2e_s"]["max"] == 4.0 and s["e2e_s"]["p50"] == pytest.approx(3.0)  # completed only: 4, 2
    assert s["preempted_requests"] == 1
    assert (s["prefix_hit_tokens"], s["readmit_hit_tokens"], s["prompt_tokens"]) == (4, 2, 60)
    assert s["prefix_hit_rate"] == pytest.approx(4 / 60)


def test_an_unfinished_or_empty_run_summarises_without_dividing_by_zero() -> None:
    running = _metrics("r", 5.0, None, None, "")
    s = summarize_requests([running])
    assert s["finish_reasons"] == {"unfinished": 1}
    assert s["duration_s"] == 1e-12 and s["throughput_tok_s"] == 0.0  # no finish: the span is empty
    empty = summarize_requests([])
    assert (empty["requests"], empty["duration_s"], empty["prefix_hit_rate"]) == (0, 1e-12, 0.0)
    assert empty["ttft_s"] == {"mean": None, "p50": None, "p90": None, "p99": None, "max": None}
    # One arrival at 2.0 and nothing else: the span starts at the first arrival, not at 0 or 1.
    late = _metrics("l", 2.0, 2.5, 3.0, "length", generated=2, longest=2)
    assert summarize_requests([late])["duration_s"] == 1.0


def test_percentiles_accept_both_ends_and_interpolate_like_numpy() -> None:
    xs = [4.0, 1.0, 3.0, 2.0]
    assert percentile(xs, 0) == 1.0 and percentile(xs, 100) == 4.0
    assert percentile(xs, 50) == 2.5 and percentile(xs, 90) == pytest.approx(3.7)
    assert percentile([7.0], 100) == 7.0 and percentile([], 50) is None
    for bad in (-0.5, 100.5):
        with pytest.raises(ValueError, match=r"percentile must be in \[0, 100\]"):
            percentile(xs, bad)


def test_a_metrics_row_carries_every_field_and_the_derived_times() -> None:
    m = _metrics("a", 1.0, 1.5, 3.5, "length", generated=5, longest=5)
    row = m.to_row()
    assert row["request_id"] == "a" and row["finish_reason"] == "length" and row["generated"] == 5
    assert (row["ttft_s"], row["tpot_s"], row["e2e_s"]) == (0.5, 0.5, 2.5)
    assert set(row) == set(RequestMetrics.__slots__) | {"ttft_s", "tpot_s", "e2e_s"}


# ---- core/registry.py -------------------------------------------------------------------------------

def test_a_registry_refuses_bad_or_duplicate_names_and_lists_in_order() -> None:
    reg: Registry[int] = Registry("widget")
    assert reg.register("b", 2, "bee") == 2 and reg.register("a", 1) == 1
    assert reg.names() == ("b", "a") and list(reg) == ["b", "a"] and len(reg) == 2
    assert "a" in reg and "c" not in reg and 1 not in reg
    assert reg.help("b") == "bee" and repr(reg) == "Registry('widget': b, a)"
    for bad in ("", " a", "a ", None, 3):
        with pytest.raises(ConfigError, match="widget needs a non-empty name"):
            reg.register(bad, 0)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="widget 'a' is already registered"):
        reg.register("a", 9)
    assert reg["a"] == 1
    with pytest.raises(ConfigError, match="unknown widget 'z'; choose one of b, a"):
        reg["z"]


# ---- scheduler/driver.py ----------------------------------------------------------------------------

def test_driver_fail_ends_a_request_with_the_error_as_its_reason() -> None:
    s = Scheduler(KVLedger(32, BS), SchedulerConfig(policy="full"))
    driver = Driver(s, ConstantExecutor(step_s=0.01))
    driver.submit(GenRequest("a", toks(4, 0), 8))
    driver.submit(GenRequest("b", toks(4, 50), 8))
    driver.submit(GenRequest("c", toks(4, 90), 8))
    driver.step()
    assert driver.metrics("a").request_id == "a" and driver.metrics("zz") is None
    assert driver.fail("a", RuntimeError("callback blew up")) is True
    assert driver.fail("b", "callback said no") is True
    assert driver.fail("zz", "nobody") is False
    done = {f.request.request_id: f for f in driver.step().finished}
    assert done["a"].finish_reasons == ["error: RuntimeError: callback blew up"]
    assert done["b"].finish_reasons == ["error: callback said no"]
    rest = driver.run()
    assert [m.request_id for m in rest] == ["c"] and rest[0].finish_reason == "length"


# ---- scheduler/scheduler.py: reset_prefix_cache ------------------------------------------------------

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


def test_sampled_tokens_must_come_back_for_every_sampling_work() -> None:
    s = Scheduler(KVLedger(16, BS), SchedulerConfig(policy="full"))
    s.add(GenRequest("a", toks(3, 0), 4))
    plan = s.schedule()
    with pytest.raises(LedgerError, match="'a' was scheduled to sample but no token came back"):
        s.confirm(plan, {})



# ---- scheduler/victims.py: min_waste on families and shared prefixes ----------------------------------

def test_min_waste_counts_a_family_once_and_keeps_only_blocks_others_hold() -> None:
    """Blocks of 4. F (6-token prompt, n=2) and P (8 tokens) run a step; then Q (P's prompt: both its
    blocks are hits) and R (P's first block, then its own) join. After the second step, by hand:

    * F: its branches hold blocks {f0 shared, f1, f1'} = 3 distinct; the shared head is held only by
      F itself, so both branches replay all 8 tokens: 3 x 16 = 48 (branch 0 alone would say 2 x 4);
    * P: 3 blocks, its 2 written blocks are held by Q too, 10 - 8 = 2 tokens to replay: 6;
    * Q: 2 blocks, both written and shared -- every block kept, 9 - 8 = 1 token: 2;
    * R: 2 blocks, the first shared and written, the second its own: 9 - 4 = 5 tokens: 10."""
    led = KVLedger(32, BS)
    s = Scheduler(led, SchedulerConfig(policy="full", victim="min_waste"))
    s.add(GenRequest("F", toks(6, 0), 8, n=2))
    s.add(GenRequest("P", toks(8, 100), 8))
    engine = FakeEngine(s)
    engine.step()
    s.add(GenRequest("Q", toks(8, 100), 8))
    s.add(GenRequest("R", toks(4, 100) + toks(4, 300), 8))
    engine.step()
    key = VICTIM_POLICIES["min_waste"]
    assert {rid: key(led, brs) for rid, brs in s.running.items()} == {"F": 48, "P": 6, "Q": 2, "R": 10}
    assert {rid: held_blocks(led, brs) for rid, brs in s.running.items()} == {"F": 3, "P": 3, "Q": 2, "R": 2}
    assert {rid: replay_tokens(led, brs) for rid, brs in s.running.items()} == {"F": 16, "P": 2, "Q": 1, "R": 5}
    assert s.pick_victim() == "Q"
    engine.drain()
    assert_drained(s)


# ---- scheduler/growth.py: preempt, alone -------------------------------------------------------------

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


# ---- scheduler/recovery.py: the auto cost model --------------------------------------------------------

def test_auto_recovery_swaps_only_when_strictly_cheaper_and_nothing_to_replay_costs_nothing() -> None:
    """1 FLOP per token at 1 FLOP/s; blocks of 1 byte over a 1 B/s link with no per-round overhead: a
    recompute costs its replay tokens in seconds, a swap 2 x its blocks (out and back)."""
    costs = RecoveryCosts(flops_per_token=1.0, flops_per_s=1.0, block_bytes=1,
                          transfer=TransferModel(link_Bps=1.0, overhead_s=0.0, staging_blocks=64))
    assert costs.choose(4, 2) == ("recompute", 4.0, 4.0)  # a tie keeps the request off the host tier
    assert costs.choose(5, 2) == ("swap", 5.0, 4.0)
    assert costs.choose(3, 2) == ("recompute", 3.0, 4.0)
    # A victim whose every token sits in blocks others keep replays nothing: recompute is free.
    assert RecoveryCosts().recompute_s(0) == 0.0 and RecoveryCosts().recompute_s(-3) == 0.0
    assert RecoveryCosts().choose(0, 1)[0] == "recompute"


# ---- scheduler/policies.py: the predicted policy ---------------------------------------------------------

def test_output_length_quantiles_are_the_nearest_rank_of_what_finished() -> None:
    lengths = OutputLengthTracker()
    with pytest.raises(ValueError, match="^no output lengths observed yet$"):
        lengths.quantile(0.5)
    for n in (40, 10, 30, 20):
        lengths.observe(n)
    # Nearest rank: the smallest length with at least q of them at or below it.
    assert [lengths.quantile(q) for q in (0.0, 0.25, 0.26, 0.5, 0.75, 0.9, 1.0)] == [10, 10, 20, 20, 30, 40, 40]
    assert lengths.quantile(1.5) == 40 and lengths.quantile(-1.0) == 10  # clamped to what was seen


def test_predicted_reserves_the_quantile_minus_what_was_already_generated() -> None:
    """Median of 10, 20, 30, 40 is 20 once 2 requests have finished; before that, the whole allowance."""
    cfg = SchedulerConfig(policy="predicted", predicted_quantile=0.5, predicted_min_samples=2)
    lengths = OutputLengthTracker()
    lengths.observe(10)
    assert reserve_tokens(cfg, lengths, 100, 100) == 100  # one sample: not enough to predict
    for n in (20, 30, 40):
        lengths.observe(n)
    assert reserve_tokens(cfg, lengths, 100, 100) == 20  # a first admission
    assert reserve_tokens(cfg, lengths, 100, 85) == 5  # re-admitted after 15 tokens: 20 - 15 more
    assert reserve_tokens(cfg, lengths, 100, 75) == 1  # already past the prediction: the next token only
    assert reserve_tokens(cfg, lengths, 12, 12) == 12  # never more than the request may still generate
    assert reserve_tokens(cfg, lengths, 100, 0) == 0


# ---- core/eviction.py: retention priorities with expiry ------------------------------------------------

def test_priority_policy_expiry_is_inclusive_and_stale_entries_do_not_stop_it() -> None:
    """A manual clock. A priority that expires at t falls back to the default level (35) at t itself,
    both when the block is retained at t and when it was retained before; entries for blocks evicted or
    re-prioritised since are skipped, never the end of the expiry scan."""
    now = [0.0]
    p = PriorityPolicy(clock=lambda: now[0])
    assert p.is_empty()
    for bad in (True, -1, 101, 1.5, "9"):
        with pytest.raises(ConfigError, match=r"^priority must be an integer in 0\.\.100, got "):
            p.set_priority(1, bad, None)  # type: ignore[arg-type]
    p.set_priority(1, 90, 3.0)  # 1: kept at 90 until t=3
    p.set_priority(2, 90, 1.0)  # 2: evicted before its expiry (a stale heap entry)
    p.set_priority(3, 90, 1.5)  # 3: re-prioritised for good before its expiry (stale too)
    p.set_priority(4, 60, None)  # 4: 60 for good
    for b in (2, 3, 1, 4):
        p.add(b)
    p.set_priority(3, 95, None)
    p.remove(2)
    assert 2 not in p and 1 in p and len(p) == 3
    p.add(5)  # 5: the default level
    assert p.blocks() == [5, 4, 3, 1]  # at t=0: 35, 60, 90 (3 and 1 in release order)
    now[0] = 3.0
    assert p.blocks() == [5, 1, 4, 3]  # 1 expired at exactly t=3 and is now the most recent at 35
    p.set_priority(6, 90, 3.0)
    p.add(6)  # retained at its expiry: the default level straight away, released before 7
    p.add(7)
    assert p.pop_victims(4) == [5, 1, 6, 7]
    with pytest.raises(IndexError, match="^fewer retained blocks than requested victims$"):
        p.pop_victims(3)
    assert 6 not in p


def test_priority_policy_is_empty_only_when_it_remembers_nothing() -> None:
    p = PriorityPolicy(clock=lambda: 0.0)
    p.set_priority(7, 90, None)  # a priority for a block not retained yet
    assert not p.is_empty()
    p.forget(7)  # its content is gone: so is its priority
    assert p.is_empty()
    p.set_priority(8, 90, 5.0)
    p.add(8)
    p.remove(8)
    p.forget(8)
    assert not p.is_empty()  # its expiry is still pending in the heap
    p.clear()
    assert p.is_empty()


def test_lru_asked_for_more_victims_than_it_holds_takes_them_all_and_fails_like_popitem() -> None:
    lru = LRUPolicy()
    lru.add_many([3, 1])
    lru.add(2)
    lru.remove(1)
    assert lru.blocks() == [3, 2] and 2 in lru and 1 not in lru
    with pytest.raises(KeyError):
        lru.pop_victims(3)
    assert len(lru) == 0 and lru.blocks() == []


def test_lru_keeps_block_ids_in_the_native_order_when_the_c_part_is_loaded() -> None:
    """Block ids stay in the C part's flat order (one object per block would cost the memory it saves);
    only a key that is not a block id moves the order to an OrderedDict, for good, with the same order."""
    lru = LRUPolicy()
    lru.add_many([5, 6])
    lru.add(7)
    lru.remove(6)
    loaded = native.MODULE is not None
    assert (lru.native_order is not None) == loaded
    assert lru.pop_victims(1) == [5] and lru.blocks() == [7]
    lru.add("not-a-block")  # type: ignore[arg-type]
    assert lru.native_order is None and lru.blocks() == [7, "not-a-block"]


def test_a_policy_that_is_not_one_gets_one_clear_error() -> None:
    """What KVLedger(policy=...) says about what it cannot use (the CLI prints these lines as they are)."""
    with pytest.raises(ConfigError) as exc:
        make_policy(["lru"])  # type: ignore[arg-type]
    assert str(exc.value) == "unknown eviction policy ['lru']; choose one of lru, priority"
    with pytest.raises(ConfigError) as exc:
        as_policy(object())  # type: ignore[arg-type]
    assert str(exc.value) == ("policy must be an eviction policy or one of lru, priority; object lacks add, add_many, "
                              "remove, pop_victims, set_priority, blocks, __len__, __contains__")
    used = LRUPolicy()
    used.add(1)
    with pytest.raises(ConfigError) as exc:
        as_policy(used)
    assert str(exc.value) == "an eviction policy can serve one pool, from empty; this one already holds blocks"
