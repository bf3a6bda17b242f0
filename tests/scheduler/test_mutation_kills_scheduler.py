"""Tests written because a mutant of ``kvledger.scheduler`` survived ``make mutation`` (docs/testing.md):
each pins down behaviour a caller relies on that no other test checked -- the exact refusal of a bad
request, what a step plan reports about itself, the admission order and what each admission counts."""

from __future__ import annotations

import re

import pytest

from kvledger.core.ledger import KVLedger
from kvledger.core.tiers import TierLedger
from kvledger.core.types import CopyOp
from kvledger.errors import ConfigError, LedgerError
from kvledger.scheduler import (
    Admission,
    GenRequest,
    HostPool,
    RecoveryCosts,
    Scheduler,
    SchedulerConfig,
    Status,
    StepPlan,
    TransferModel,
    Work,
    validate_request,
)
from kvledger.scheduler.beam import PRUNED, BeamChoice, end_beams, fork_beams, prune_beams, select_beams
from kvledger.scheduler.config import SCHEDULER_KEYS

try:  # the module name pytest gives tests/scheduler/test_scheduler.py depends on its import mode
    from tests.scheduler.test_scheduler import BS, FakeEngine, assert_drained, swap_scenario, toks
except ImportError:  # pragma: no cover
    from test_scheduler import BS, FakeEngine, assert_drained, swap_scenario, toks


class _TierEngine(FakeEngine):
    """FakeEngine plus the tier transfers (tests/scheduler/test_scheduler_tiers.py has the full one): a tier slot
    holds what its device block held, so a wrong promotion shows up as a read of KV never written."""

    def run(self, plan: StepPlan) -> dict[str, list[int]]:
        for b, slot in (*plan.demote, *plan.writeback):
            self.host[slot] = list(self.block(b))
        for slot, d in plan.promote:
            assert slot in self.host, f"step {plan.step}: tier slot {slot} promoted but never written"
            self.dev[d] = list(self.host[slot])
        for src, dst in plan.tier_moves:
            self.host[dst] = list(self.host[src])
        return super().run(plan)


def _offload(pool: int = 8, host: int = 8, **cfg: object) -> tuple[Scheduler, _TierEngine]:
    s = Scheduler(KVLedger(pool, BS), SchedulerConfig(offload_prefixes=True, writeback_blocks=0, **cfg),  # type: ignore[arg-type]
                  host=TierLedger([("host", host)]))
    return s, _TierEngine(s)


def _run_one(s: Scheduler, engine: FakeEngine, request: GenRequest) -> list[StepPlan]:
    s.add(request)
    plans = engine.drain()
    s.forget(request.request_id)
    return plans


# ---- scheduler/plan.py ------------------------------------------------------------------------------

@pytest.mark.parametrize(("changes", "message"), [
    ({"request_id": ""}, "a request id must be a non-empty string without '/', got ''"),
    ({"request_id": "a/b"}, "a request id must be a non-empty string without '/', got 'a/b'"),
    ({"request_id": 7}, "a request id must be a non-empty string without '/', got 7"),
    ({"n": 0}, "request 'r': n must be an integer >= 1, got 0"),
    ({"n": True}, "request 'r': n must be an integer >= 1, got True"),
    ({"max_new_tokens": 0}, "request 'r': max_new_tokens must be an integer >= 1, got 0"),
    ({"max_new_tokens": 2.0}, "request 'r': max_new_tokens must be an integer >= 1, got 2.0"),
    ({"lookahead": -1}, "request 'r': lookahead must be an integer >= 0, got -1"),
    ({"priority": 1.5}, "request 'r': priority must be an integer, got 1.5"),
    ({"priority": False}, "request 'r': priority must be an integer, got False"),
    ({"prompt": ()}, "request 'r' needs a non-empty prompt"),
    ({"arrival_s": "0"}, "request 'r': arrival_s must be a number, got '0'"),
    ({"arrival_s": float("nan")}, "request 'r': arrival_s must be a number, got nan"),
])
def test_a_bad_request_is_refused_with_its_exact_message(changes: dict, message: str) -> None:
    fields = {"request_id": "r", "prompt": (1, 2, 3), "max_new_tokens": 4, **changes}
    request = GenRequest(**fields)
    with pytest.raises(ConfigError) as err:
        validate_request(request)
    assert str(err.value) == message
    s = Scheduler(KVLedger(8, BS), SchedulerConfig())
    with pytest.raises(ConfigError, match=f"^{re.escape(message)}$"):
        s.add(request)
    assert not s.has_work()


def test_the_smallest_good_requests_pass_validation() -> None:
    validate_request(GenRequest("r", [5], 1, n=1, lookahead=0, priority=-3, arrival_s=0))
    validate_request(GenRequest("r", (5,), 1, arrival_s=2.5))
    with pytest.raises(ConfigError, match="^expected a GenRequest, got dict$"):
        validate_request({"request_id": "r"})  # type: ignore[arg-type]


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


# ---- scheduler/config.py ----------------------------------------------------------------------------

@pytest.mark.parametrize(("changes", "message"), [
    ({"max_running": 0}, "max_running must be an integer >= 1, got 0"),
    ({"writeback_blocks": -1}, "writeback_blocks must be an integer >= 0, got -1"),
    ({"headroom_blocks": True}, "headroom_blocks must be an integer >= 0, got True"),
    ({"offload_prefixes": 1}, "offload_prefixes must be True or False, got 1"),
    ({"restore_ahead": "yes"}, "restore_ahead must be True or False, got 'yes'"),
    ({"watermark": 1}, "watermark must be in [0, 1), got 1"),
    ({"watermark": -0.1}, "watermark must be in [0, 1), got -0.1"),
    ({"predicted_quantile": 0}, "predicted_quantile must be in (0, 1], got 0"),
    ({"predicted_quantile": 1.5}, "predicted_quantile must be in (0, 1], got 1.5"),
    ({"predicted_quantile": True}, "predicted_quantile must be in (0, 1], got True"),
    ({"predicted_quantile": "0.5"}, "predicted_quantile must be in (0, 1], got '0.5'"),
    ({"predicted_quantile": float("nan")}, "predicted_quantile must be in (0, 1], got nan"),
])
def test_a_bad_scheduler_setting_is_refused_with_its_exact_message(changes: dict, message: str) -> None:
    with pytest.raises(ConfigError) as err:
        SchedulerConfig(**changes)
    assert str(err.value) == message


def test_the_lowest_good_settings_are_accepted() -> None:
    cfg = SchedulerConfig(writeback_blocks=0, headroom_blocks=0, watermark=0, predicted_quantile=1,
                          offload_prefixes=True, restore_ahead=True, max_running=1)
    assert (cfg.writeback_blocks, cfg.watermark, cfg.predicted_quantile) == (0, 0, 1)


def test_keep_free_is_the_watermark_share_plus_the_headroom_of_its_action() -> None:
    assert SchedulerConfig(policy="incremental", watermark=0.1).keep_free(100) == 10
    assert SchedulerConfig(policy="incremental", watermark=0.25).keep_free(10) == 2  # rounded down
    assert SchedulerConfig(policy="full", watermark=0.25).keep_free(100) == 0  # exact: nothing to protect
    assert SchedulerConfig(policy="incremental", watermark=0, headroom_blocks=5).keep_free(100) == 0
    assert SchedulerConfig(policy="incremental", watermark=0.1, headroom_blocks=5,
                           on_growth_failure="headroom").keep_free(100) == 15


def test_to_dict_round_trips_every_setting() -> None:
    cfg = SchedulerConfig(policy="predicted", victim="priority", max_running=7, watermark=0.05,
                          offload_prefixes=True, writeback_blocks=3)
    d = cfg.to_dict()
    assert d["policy"] == "predicted" and d["victim"] == "priority" and d["max_running"] == 7
    assert d["watermark"] == 0.05 and d["offload_prefixes"] is True and d["writeback_blocks"] == 3
    assert list(d) == list(SCHEDULER_KEYS)
    assert SchedulerConfig(**d) == cfg


# ---- scheduler/admission.py -------------------------------------------------------------------------

def test_the_first_request_admitted_comes_back_as_a_readmission() -> None:
    """The first request ever admitted has admission order 0; requeued before it sampled anything, it is
    still a readmission (counted apart by the ledger, reported so in the plan), not a fresh request."""
    led = KVLedger(16, BS)
    s = Scheduler(led, SchedulerConfig(prefill_chunk=4, token_budget=4))
    s.add(GenRequest("a", toks(10, 100), 2))
    engine = FakeEngine(s)
    first = engine.step()
    assert first.admissions == [Admission("a", 0, False)]
    assert [(w.start, w.end, w.sample) for w in first.prefills] == [(0, 4, False)]
    assert s.requeue("a")
    again = engine.step()
    assert again.admissions == [Admission("a", 4, True)]  # its one full written block is a prefix hit
    assert [(w.start, w.end) for w in again.prefills] == [(4, 8)]
    engine.drain()
    assert (led.counters.admitted, led.counters.readmitted) == (1, 1)
    assert led.stats()["prefix_cache_readmissions"]["hit_tokens"] == 4
    assert_drained(s)


@pytest.mark.parametrize("restore_ahead", [False, True])
def test_a_fresh_request_gets_its_prefix_promoted_from_the_tier_below(restore_ahead: bool) -> None:
    """With offload_prefixes, a fresh request whose prompt blocks were demoted gets them promoted back at
    its admission, and counts them as cached; with restore_ahead it computes from the next step."""
    s, engine = _offload(restore_ahead=restore_ahead)
    _run_one(s, engine, GenRequest("A", toks(16, 0), 2))  # 4 full prompt blocks cached on the device
    _run_one(s, engine, GenRequest("B", toks(24, 500), 2))  # evicts 3 of A's: demoted to the host tier
    assert len(s.host.index) == 3
    s.add(GenRequest("C", toks(16, 0) + toks(3, 900), 2))
    s.add(GenRequest("D", toks(2, 950), 2))  # admitted in the same step, behind C
    plans = engine.drain()
    admit = plans[0]
    assert admit.admitted == ["C", "D"]
    assert len(admit.promote) == 3 and admit.admissions == [Admission("C", 16, False), Admission("D", 0, False)]
    assert s.ledger.counters.promoted_blocks == 3 and s.promoted_tokens == 12
    assert sum(w.end - w.start for p in plans for w in p.prefills if w.seq_id == "C") == 3  # only its new tokens
    assert [w.seq_id for w in admit.works] == (["D"] if restore_ahead else ["C", "D"])
    s.check()


@pytest.mark.parametrize("restore_ahead", [False, True])
def test_a_requeued_request_gets_its_demoted_prefix_promoted_when_it_comes_back(restore_ahead: bool) -> None:
    """A recomputed family (not a swapped one) may find its prompt below the device when it comes back."""
    s, engine = _offload(restore_ahead=restore_ahead)
    s.add(GenRequest("A", toks(16, 0), 3))
    assert engine.step().admissions == [Admission("A", 0, False)]
    assert s.requeue("A")
    s.add(GenRequest("B", toks(24, 500), 2, priority=1))  # goes first and evicts A's cached blocks
    plans = engine.drain()
    assert plans[0].admitted == ["B"] and len(plans[0].demote) == 2
    back = next(p for p in plans if "A" in p.admitted)
    assert back.admissions == [Admission("A", 16, True)] and len(back.promote) == 3
    assert s.ledger.counters.promoted_blocks == 3 and s.promoted_tokens == 12
    assert all(w.start >= 16 for p in plans for w in (*p.prefills, *p.decodes) if w.seq_id == "A")
    assert [w.seq_id for w in back.works] == ([] if restore_ahead else ["A"])
    s.check()


def test_a_readmitted_family_leaves_the_headroom_free_while_others_run() -> None:
    """The headroom kept for the growth of running requests also holds back a readmission."""
    led = KVLedger(13, BS)
    s = Scheduler(led, SchedulerConfig(policy="incremental", watermark=0, on_growth_failure="headroom",
                                       headroom_blocks=3))
    s.add(GenRequest("X", toks(4, 0), 40))
    s.add(GenRequest("A", toks(8, 100), 20))
    engine = FakeEngine(s)
    assert engine.step().admitted == ["X", "A"]
    assert s.requeue("A")
    s.add(GenRequest("Z", toks(20, 700), 2, priority=1))  # admitted first
    plan = engine.step()
    assert plan.admitted == ["Z"]  # A would eat into the headroom kept for X's growth: it waits
    u = led.usage()
    assert u.free == 4 and u.evictable == 2
    engine.drain()
    assert [br.finish_reason for br in s.finished["A"]] == ["length"]
    assert_drained(s)


@pytest.mark.parametrize("clear_cache", [False, True])
def test_a_swap_restore_counts_its_prefix_hits_and_resumes_at_the_pending_token(clear_cache: bool) -> None:
    """tests/scheduler/test_scheduler.py's swap scenario: V (12 tokens in the ledger, 3 full blocks) comes back in
    step 12, with 2 blocks still cached on the device (or none, cache cleared): those are counted as
    cached and need no transfer, the rest is swapped in (and timed), and V computes only its pending
    position 11 and the sampled token after it -- nothing before is recomputed."""
    s, _engine, _snap, plans, back = swap_scenario(clear_cache)
    restore = plans[12]
    assert restore.admitted == ["V"]
    hits = 0 if clear_cache else 2
    assert back.hit_blocks == hits
    assert restore.admissions == [Admission("V", hits * BS, True)]
    assert len(restore.swap_in) == 3 - hits
    assert restore.transfer_wait_s == pytest.approx(
        TransferModel().time_s(3 - hits, RecoveryCosts().block_bytes, "in"))
    assert [(w.seq_id, w.start, w.end) for w in plans[13].works] == [("V", 11, 13)]
    assert_drained(s)


def test_a_swap_restore_with_every_block_still_cached_counts_all_but_the_last_token() -> None:
    """Same two requests, but G is cancelled right after it swapped V out: V's three full blocks stay cached,
    so V comes back with no transfer at all and 11 cached tokens (the last one is always computed)."""
    led = KVLedger(6, BS)
    s = Scheduler(led, SchedulerConfig(policy="incremental", victim="latest", recovery="swap", watermark=0.0),
                  host=HostPool(8))
    s.add(GenRequest("G", toks(4, 100), 12))
    s.add(GenRequest("V", toks(6, 200), 9))
    engine = FakeEngine(s)
    plans = []
    while s.has_work():
        plans.append(engine.step())
        if plans[-1].swap_out:
            assert plans[-1].step == 7 and len(plans[-1].swap_out) == 3
            s.cancel("G")
    restore = plans[8]
    assert restore.admissions == [Admission("V", 11, True)] and restore.swap_in == []
    assert restore.transfer_wait_s == 0
    assert [(w.seq_id, w.start, w.end) for w in plans[9].works] == [("V", 12, 13)]
    assert [br.finish_reason for br in s.finished["V"]] == ["length"]
    assert_drained(s)


def test_max_running_caps_the_admissions_of_a_step_and_of_later_steps() -> None:
    s = Scheduler(KVLedger(32, BS), SchedulerConfig(max_running=2))
    for rid in "abc":
        s.add(GenRequest(rid, toks(3, 10 * ord(rid)), 4))
    engine = FakeEngine(s)
    assert engine.step().admitted == ["a", "b"]  # c waits: two run already
    s.add(GenRequest("d", toks(3, 999), 4))
    assert engine.step().admitted == []  # still two running
    plans = engine.drain()
    assert [p.admitted for p in plans if p.admitted] == [["c", "d"]]
    assert_drained(s)


def test_a_family_of_exactly_max_running_branches_is_admitted() -> None:
    s = Scheduler(KVLedger(8, BS), SchedulerConfig(max_running=2))
    s.add(GenRequest("n2", toks(2, 0), 3, n=2))
    s.add(GenRequest("n3", toks(2, 50), 3, n=3))
    plan = s.schedule()
    assert plan.admitted == ["n2"]
    assert plan.ended == [(sid, "never: more branches than max_running") for sid in ("n3", "n3/1", "n3/2")]


def test_a_beam_request_too_big_for_the_pool_is_told_so_not_blamed_on_the_token_budget() -> None:
    s = Scheduler(KVLedger(4, BS), SchedulerConfig(token_budget=2))  # 2 beams == the token budget: fine
    s.add(GenRequest("bm", toks(20, 0), 3, n=2, beam=True))  # but 20 prompt tokens > the 16-token pool
    assert s.schedule().ended == [("bm", "never: larger than the whole pool"),
                                  ("bm/1", "never: larger than the whole pool")]
    s = Scheduler(KVLedger(4, BS), SchedulerConfig(token_budget=1))
    s.add(GenRequest("bm", toks(2, 0), 3, n=2, beam=True))
    assert s.schedule().ended == [(sid, "never: more beams than token_budget (beams decode in one step)")
                                  for sid in ("bm", "bm/1")]


def test_admission_stops_when_the_step_token_budget_is_spent() -> None:
    s = Scheduler(KVLedger(32, BS), SchedulerConfig(token_budget=4, prefill_chunk=4))
    s.add(GenRequest("a", toks(4, 0), 2))
    s.add(GenRequest("b", toks(4, 100), 2))
    engine = FakeEngine(s)
    first = engine.step()
    assert first.admitted == ["a"] and [(w.seq_id, w.start, w.end) for w in first.works] == [("a", 0, 4)]
    assert engine.step().admitted == ["b"]
    engine.drain()
    assert_drained(s)


def test_a_prompt_cached_whole_still_computes_its_last_token() -> None:
    s = Scheduler(KVLedger(8, BS), SchedulerConfig())
    engine = FakeEngine(s)
    s.add(GenRequest("a", toks(8, 0), 2))
    engine.drain()
    s.add(GenRequest("b", toks(8, 0), 2))  # both prompt blocks cached and written
    plan = engine.step()
    assert plan.admissions == [Admission("b", 7, False)]
    assert [(w.seq_id, w.start, w.end, w.sample) for w in plan.works] == [("b", 7, 8, True)]
    engine.drain()
    assert [br.finish_reason for br in s.finished["b"]] == ["length"]
    assert_drained(s)


def test_a_family_of_max_running_branches_too_big_for_the_pool_is_told_it_is_the_pool() -> None:
    s = Scheduler(KVLedger(4, BS), SchedulerConfig(max_running=2))
    s.add(GenRequest("big", toks(20, 0), 3, n=2))
    assert s.schedule().ended == [("big", "never: larger than the whole pool"),
                                  ("big/1", "never: larger than the whole pool")]


def test_a_swap_restore_is_timed_on_the_inbound_link() -> None:
    """The restore's link time uses the tier -> device rate (``in_link_Bps``), not the outbound one."""
    link = TransferModel(link_Bps=10e9, in_link_Bps=2e9)
    costs = RecoveryCosts(transfer=link)
    led = KVLedger(6, BS)
    s = Scheduler(led, SchedulerConfig(policy="incremental", victim="latest", recovery="swap", watermark=0.0),
                  host=HostPool(8), costs=costs)
    s.add(GenRequest("G", toks(4, 100), 12))
    s.add(GenRequest("V", toks(6, 200), 9))
    engine = FakeEngine(s)
    plans = []
    while s.has_work():
        plans.append(engine.step())
        if plans[-1].swap_out:
            led.clear_cache()  # every block comes back from the host
    (out,) = [p for p in plans if p.swap_out]
    (back,) = [p for p in plans if p.swap_in]
    assert out.transfer_wait_s == pytest.approx(link.time_s(3, costs.block_bytes, "out"))
    assert back.transfer_wait_s == pytest.approx(link.time_s(3, costs.block_bytes, "in"))
    assert link.time_s(3, costs.block_bytes, "in") > link.time_s(3, costs.block_bytes, "out")
    assert_drained(s)


# ---- scheduler/beam.py ------------------------------------------------------------------------------
# (tests/scheduler/test_scheduler_beam.py compares the scheduler's search with a reference built on select_beams
# itself, so select_beams's own ranking needs hand-computed answers.)

def _choices(cs: list[BeamChoice]) -> list[tuple[str, int, float]]:
    return [(c.parent, c.token, round(c.score, 6)) for c in cs]


def test_select_beams_ranks_by_summed_score_then_beam_then_candidate_rank() -> None:
    beams = [("a", 0.0), ("b", 0.0)]
    cands = {"a": [(-0.5, 5), (-1.0, 6)], "b": [(-1.0, 7), (-4.0, 8)]}
    running, finished = select_beams(beams, cands, 3)  # not the first step: both beams expand
    assert _choices(running) == [("a", 5, -0.5), ("a", 6, -1.0), ("b", 7, -1.0)] and finished == []
    running, _ = select_beams([("a", -2.0), ("b", 0.0)], cands, 2)
    assert _choices(running) == [("b", 7, -1.0), ("a", 5, -2.5)]
    # The first step expands the first beam only (the others are copies of it).
    running, _ = select_beams(beams, cands, 2, first_step=True)
    assert _choices(running) == [("a", 5, -0.5), ("a", 6, -1.0)]


def test_select_beams_turns_stop_tokens_among_the_best_into_hypotheses() -> None:
    STOP = 3
    cands = {"a": [(-0.1, STOP), (-0.2, 5), (-0.3, 6), (-0.4, 7)]}
    running, finished = select_beams([("a", 0.0)], cands, 2, {STOP})
    assert _choices(finished) == [("a", STOP, -0.1)]
    assert _choices(running) == [("a", 5, -0.2), ("a", 6, -0.3)]
    # A stop token ranked at or past the width is dropped, and only 2 * width candidates count.
    cands = {"a": [(-0.1, STOP), (-0.2, STOP), (-0.3, 9)]}
    running, finished = select_beams([("a", 0.0)], cands, 1, {STOP})
    assert _choices(finished) == [("a", STOP, -0.1)] and running == []
    with pytest.raises(LedgerError) as err:
        select_beams([("a", 0.0)], cands, 0)
    assert str(err.value) == "beam width must be >= 1"


def test_beam_helpers_on_a_request_that_is_not_running_change_nothing() -> None:
    s = Scheduler(KVLedger(16, BS), SchedulerConfig(policy="full"))
    assert prune_beams(s, "nope", set()) == []
    end_beams(s, "nope", "stop")
    assert fork_beams(s, "nope", []) == []


def test_pruned_and_ended_beams_carry_their_reasons() -> None:
    s = Scheduler(KVLedger(64, BS), SchedulerConfig(policy="full"))
    req = GenRequest("r", toks(5, 1), 4, n=3, beam=True)
    s.add(req)
    engine = FakeEngine(s)
    engine.step()
    with pytest.raises(LedgerError) as err:
        prune_beams(s, "r", set())
    assert str(err.value) == "pruning every beam of 'r': use end_beams to finish the request"
    assert prune_beams(s, "r", {"r"}) == ["r/1", "r/2"]
    pruned = s.branches("r")[1:]
    assert [(br.status, br.finish_reason) for br in pruned] == [(Status.FINISHED, PRUNED)] * 2
    assert [br.seq_id for br in s.running["r"]] == ["r"]
    end_beams(s, "r", "stop")
    assert "r" not in s.running and s.branches("r")[0].finish_reason == "stop"
    s.check()
    assert_drained(s)


def test_fork_beams_names_places_and_checks_each_new_beam() -> None:
    s = Scheduler(KVLedger(64, BS), SchedulerConfig(policy="full"))
    s.add(GenRequest("r", toks(5, 1), 6, n=2, beam=True, stop_token_ids=frozenset({3})))
    engine = FakeEngine(s)
    plan = s.schedule()
    with pytest.raises(LedgerError) as err:  # nothing sampled yet: no pending token to fork from
        fork_beams(s, "r", [("r", 7)])
    assert str(err.value) == "beam 'r' must have exactly this step's token pending to fork"
    s.confirm(plan, engine.run(plan))
    with pytest.raises(LedgerError) as err:
        fork_beams(s, "r", [("r/9", 7)])
    assert str(err.value) == "beam 'r/9' of 'r' is not running"
    parent = s.branches("r")[1]
    children = fork_beams(s, "r", [("r/1", 70), ("r", 71), ("r", 3)])
    assert [c.seq_id for c in children] == ["r/2", "r/3", "r/4"]
    assert [c.index for c in children] == [2, 3, 4]
    assert children[0].tokens == parent.tokens[: parent.in_ledger] + [70]
    assert (children[0].computed, children[0].admitted_order) == (parent.computed, parent.admitted_order)
    assert children[2].status is Status.FINISHED and children[2].finish_reason == "stop"  # its token is a stop
    assert [br.seq_id for br in s.running["r"]] == ["r", "r/1", "r/2", "r/3"]
    nxt = engine.step()
    assert sorted((w.seq_id, w.start, w.end) for w in nxt.works) == [
        ("r", 5, 6), ("r/1", 5, 6), ("r/2", 5, 6), ("r/3", 5, 6)]  # the forks decode; nothing is recomputed
    s.check()
    assert_drained(s)
