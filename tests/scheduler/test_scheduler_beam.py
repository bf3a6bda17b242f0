"""Beam search in the scheduler layer, without torch: ``BeamSearch`` driven by the one step loop with
an executor that returns scripted candidates. The result must equal a plain beam search over the same
candidate function (no cache, no scheduler), also when beams are held back (a prefill cut by the token
budget); every step is checked by ``FakeEngine``'s KV model."""

from __future__ import annotations

import zlib

import pytest

from kvledger.core.ledger import KVLedger
from kvledger.errors import LedgerError
from kvledger.scheduler import (
    Driver,
    GenRequest,
    Scheduler,
    SchedulerConfig,
    Status,
    StepOutput,
    StepPlan,
)
from kvledger.scheduler.beam import PRUNED, BeamChoice, BeamSearch, end_beams, fork_beams, prune_beams, select_beams
from kvledger.scheduler.growth import REJECTED_OUTGREW

try:  # the module name pytest gives tests/scheduler/test_scheduler.py depends on its import mode
    from tests.scheduler.test_scheduler import BS, FakeEngine, assert_drained, toks
except ImportError:  # pragma: no cover
    from test_scheduler import BS, FakeEngine, assert_drained, toks

STOP = 3


def candidates(tokens: list[int], k: int, stop_every: int = 0) -> list[tuple[float, int]]:
    """The model: ``k`` best (logprob, token) of the sequence ``tokens``, best first, distinct scores.
    With ``stop_every``, the stop token is among them for some prefixes."""
    h = zlib.crc32(bytes(str(tokens), "ascii"))
    out = []
    for i in range(k):
        token = 10 + (h >> (i % 16)) % 50 + 60 * i
        if stop_every and (h + i) % stop_every == 0:
            token = STOP
        out.append((-0.1 * (i + 1) - (h % 97) / 1000 - i * 0.013, token))
    return out


def reference(prompt: list[int], width: int, steps: int, stop: frozenset[int] = frozenset(),
              stop_every: int = 0) -> list[tuple[float, list[int], str]]:
    """Plain beam search with the same selection rule (kvledger.scheduler.beam.select_beams)."""
    beams: list[tuple[str, float, list[int]]] = [("b0", 0.0, [])]
    hyps: list[tuple[float, list[int], str]] = []
    for n in range(steps):
        cands = {sid: candidates(prompt + out, 2 * width, stop_every) for sid, _, out in beams}
        running, finished = select_beams([(sid, score) for sid, score, _ in beams], cands, width, stop,
                                         first_step=n == 0)
        outs = {sid: out for sid, _, out in beams}
        hyps += [(c.score, outs[c.parent] + [c.token], "stop") for c in finished]
        hyps = sorted(hyps, key=lambda h: -h[0])[:width]
        done = not running or n + 1 >= steps or (len(hyps) >= width and running[0].score <= hyps[-1][0])
        if done:
            final = hyps + [(c.score, outs[c.parent] + [c.token], "length") for c in running]
            return sorted(final, key=lambda h: -h[0])[:width]
        beams = [(f"b{i}", c.score, outs[c.parent] + [c.token]) for i, c in enumerate(running)]
    raise AssertionError("unreachable")


class BeamModel(FakeEngine):
    """FakeEngine's KV checks, plus candidates for beam works from ``candidates``."""

    def __init__(self, s: Scheduler, stop_every: int = 0) -> None:
        super().__init__(s)
        self.stop_every = stop_every

    def execute(self, plan: StepPlan) -> StepOutput:
        self.s.check()
        sampled = self.run(plan)  # writes KV and checks every read
        out = StepOutput()
        for w in (*plan.prefills, *plan.decodes):
            if w.sample:
                assert w.request is not None and w.request.beam
                out.candidates[w.seq_id] = candidates(list(w.tokens[: w.end]), 2 * w.request.n, self.stop_every)
                sampled.pop(w.seq_id, None)
        return out


def run_beam(prompt: list[int], width: int, steps: int, num_blocks: int = 64, token_budget: int = 8192,
             stop_every: int = 0) -> tuple[Driver, object]:
    s = Scheduler(KVLedger(num_blocks, BS), SchedulerConfig(policy="full", token_budget=token_budget))
    driver = Driver(s, BeamModel(s, stop_every), check_every=1, keep_records=True)
    stop = frozenset({STOP}) if stop_every else frozenset()
    driver.submit(GenRequest("r", prompt, steps, n=width, beam=True, stop_token_ids=stop))
    finished = []
    while driver.has_work():
        finished += driver.step().finished
    (f,) = finished
    return driver, f


@pytest.mark.parametrize("width", [1, 2, 3])
def test_beam_search_equals_a_plain_beam_search(width: int) -> None:
    prompt = toks(6, 100)
    driver, f = run_beam(prompt, width, 7)
    ref = reference(prompt, width, 7)
    assert f.outputs == [h[1] for h in ref]
    assert f.scores == pytest.approx([h[0] for h in ref])
    assert f.finish_reasons == [h[2] for h in ref]
    assert f.metrics.generated == sum(len(h[1]) for h in ref) and f.metrics.longest == 7
    assert driver.beams.states == {}  # forgotten when finished
    assert_clean(driver)


def test_stop_tokens_finish_hypotheses() -> None:
    prompt = toks(5, 40)
    driver, f = run_beam(prompt, 2, 9, stop_every=4)
    ref = reference(prompt, 2, 9, frozenset({STOP}), stop_every=4)
    assert "stop" in [h[2] for h in ref]  # the scenario does end a hypothesis with a stop token
    assert (f.outputs, f.finish_reasons) == ([h[1] for h in ref], [h[2] for h in ref])
    assert_clean(driver)


def test_beams_are_held_back_until_they_sample_at_one_position() -> None:
    """A 7-token budget cuts the second beam's prefill of the 6-token prompt: the first beam would sample
    alone, so its prefill stops one token short (no sample) until both can sample together."""
    prompt = toks(6, 100)
    driver, f = run_beam(prompt, 2, 5, token_budget=7)
    assert driver.beams.held_back > 0
    assert f.outputs == [h[1] for h in reference(prompt, 2, 5)]
    assert_clean(driver)


def test_cancelling_a_beam_request_ends_every_beam() -> None:
    s = Scheduler(KVLedger(64, BS), SchedulerConfig(policy="full"))
    driver = Driver(s, BeamModel(s), check_every=1, keep_records=True)
    driver.submit(GenRequest("r", toks(6, 1), 8, n=2, beam=True))
    driver.step()
    driver.step()
    driver.cancel("r")
    finished = []
    while driver.has_work():
        finished += driver.step().finished
    (f,) = finished
    assert (f.outputs, f.finish_reasons, f.scores) == ([[]], ["cancelled"], None)
    assert_clean(driver)


def test_the_beam_state_follows_forks_and_prunes() -> None:
    s = Scheduler(KVLedger(64, BS), SchedulerConfig(policy="full"))
    beams = BeamSearch(s)
    req = GenRequest("r", toks(5, 1), 4, n=2, beam=True)
    s.add(req)
    beams.add(req)
    assert "r" in beams and beams.states["r"].order == ["r", "r/1"]
    engine = BeamModel(s)
    for _ in range(3):
        plan = s.schedule()
        out = engine.execute(plan)
        beams.choose(plan, out.candidates, out.sampled)
        s.confirm(plan, out.sampled)
        beams.fork()
        state = beams.states["r"]
        live = [br.seq_id for br in s.running["r"]]
        assert sorted(state.order) == sorted(live) and set(state.scores) == set(live)
        assert state.pending == [] and state.forks == []
    assert beams.outcome("r")[2] is None  # not over yet: no scores


def assert_clean(driver: Driver) -> None:
    s = driver.scheduler
    s.check()
    u = s.ledger.usage()
    assert (u.active, u.promised, u.deferred, u.sequences) == (0, 0, 0, 0), u
    assert s.ledger.outstanding_leases() == 0
    assert not driver.has_work()


def test_a_requeued_family_that_outgrew_the_pool_ends_as_outgrown_not_as_never() -> None:
    """A request admitted alone (4 + 20 tokens = 6 blocks of an 8-block pool, incremental reservation) and
    forked after its first token comes back as a family of two branches of 24 tokens each: 1 shared block
    + 2 x 5 = 11 blocks > 8. It was admitted once, so it ends 'outgrew the whole pool', not 'never'."""
    s = Scheduler(KVLedger(8, BS), SchedulerConfig(policy="incremental", watermark=0.0))
    s.add(GenRequest("r", toks(4, 1), 20))
    engine = FakeEngine(s)
    assert engine.step().admitted == ["r"]
    (child,) = fork_beams(s, "r", [("r", 99)])
    assert child is not None and child.seq_id == "r/1"
    assert s.requeue("r")
    plan = engine.step()
    assert plan.ended == [("r", REJECTED_OUTGREW), ("r/1", REJECTED_OUTGREW)]
    assert [br.finish_reason for br in s.branches("r")] == [REJECTED_OUTGREW] * 2


def _choices(cs: list[BeamChoice]) -> list[tuple[str, int, float]]:
    return [(c.parent, c.token, round(c.score, 6)) for c in cs]


def test_a_beam_request_too_big_for_the_pool_is_told_so_not_blamed_on_the_token_budget() -> None:
    s = Scheduler(KVLedger(4, BS), SchedulerConfig(token_budget=2))  # 2 beams == the token budget: fine
    s.add(GenRequest("bm", toks(20, 0), 3, n=2, beam=True))  # but 20 prompt tokens > the 16-token pool
    assert s.schedule().ended == [("bm", "never: larger than the whole pool"),
                                  ("bm/1", "never: larger than the whole pool")]
    s = Scheduler(KVLedger(4, BS), SchedulerConfig(token_budget=1))
    s.add(GenRequest("bm", toks(2, 0), 3, n=2, beam=True))
    assert s.schedule().ended == [(sid, "never: more beams than token_budget (beams decode in one step)")
                                  for sid in ("bm", "bm/1")]


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
