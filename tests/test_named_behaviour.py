"""Finish reasons and preemption counts, each rule in a test named after it.

The golden transcripts (``tests/golden/transcripts.py``) pin these behaviours only as digests of whole
fuzzed runs, and a regeneration would bless any change. Here every rule has its own test with the exact
expected value, driven through the real pieces: the :class:`Driver` (which assembles finish reasons and
:class:`RequestMetrics`) over the real :class:`Scheduler` and ledger, with ``FakeEngine`` from
``test_scheduler.py`` as the executor (it checks every position a step reads against the KV it must hold).

The rules, as the code and docs/scheduler.md state them:

* ``stop``: a token in ``stop_token_ids`` was sampled; it is kept as the branch's last output token. The
  stop token is checked before the length limit, so a stop token sampled as the ``max_new_tokens``-th
  token ends the branch ``stop`` (as vLLM: stop wins over length). Tokens a step returns after a stop
  token or past the limit (accepted draft tokens) are dropped.
* ``length``: exactly ``max_new_tokens`` generated and no stop token among them. A request without stop
  tokens (``ignore_eos``) never stops early, whatever it samples; a stop token in the prompt is no stop.
* Each branch of an ``n > 1`` request ends with its own reason; the request's ``finish_reason`` is the
  branches' reason or their distinct reasons sorted and joined by ``,``.
* ``cancelled`` ends every branch still running; a branch that had already ended keeps its reason.
* ``never: ...``: a request that can never run ends without running.
* Preemption is gang preemption: a family of ``n`` branches preempted once is one preemption for the
  scheduler (``Scheduler.preemptions``) and for the request (``RequestMetrics.preemptions``, the engine's
  ``RequestResult.preemptions``). The ledger's own counter (``stats()["lifetimes"]["preemptions"]``,
  incremented by ``KVLedger.preempt``) counts *sequences*: one per live branch taken off the device.
  Both recoveries (recompute, swap) count. A requeue (``Scheduler.requeue``, a cache reset with
  ``requeue_running=True``) is no preemption for any of the three.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from kvledger.core.ledger import KVLedger
from kvledger.scheduler import (
    ConstantExecutor,
    Driver,
    GenRequest,
    HostPool,
    Scheduler,
    SchedulerConfig,
    StepOutput,
    StepPlan,
    Work,
)
from kvledger.scheduler.driver import FinishedRequest

try:  # the module names pytest gives tests/test_*.py depend on its import mode
    from tests.scheduler.test_driver import assert_clean
    from tests.scheduler.test_scheduler import BS, FakeEngine, expected_output, sample_token, toks
except ImportError:  # pragma: no cover
    from scheduler.test_driver import assert_clean
    from scheduler.test_scheduler import BS, FakeEngine, expected_output, sample_token, toks

STOP = 7  # sample_token never returns it (its tokens are >= 10): only a script samples it


class ScriptedFake(FakeEngine):
    """``FakeEngine`` as a driver's executor; ``script`` replaces the token sampled at ``(seq_id,
    position)`` (the position the token takes in the branch's token list)."""

    def __init__(self, s: Scheduler, script: dict[tuple[str, int], int] | None = None,
                 accept: Callable[[Work], int] | None = None) -> None:
        super().__init__(s, accept)
        self.script = script or {}

    def run(self, plan: StepPlan) -> dict[str, list[int]]:
        sampled = super().run(plan)
        for w in (*plan.prefills, *plan.decodes):
            got = sampled.get(w.seq_id)
            if got is not None:
                sampled[w.seq_id] = [self.script.get((w.seq_id, w.end + i), t) for i, t in enumerate(got)]
        return sampled

    def execute(self, plan: StepPlan) -> StepOutput:
        return StepOutput(sampled=self.run(plan), elapsed_s=0.01)


def make_driver(num_blocks: int = 64, config: SchedulerConfig | None = None, host: HostPool | None = None,
                script: dict[tuple[str, int], int] | None = None,
                accept: Callable[[Work], int] | None = None) -> Driver:
    s = Scheduler(KVLedger(num_blocks, BS), config or SchedulerConfig(), host=host)
    return Driver(s, ScriptedFake(s, script, accept), check_every=1)


def pressure(recovery: str = "recompute", num_blocks: int = 9) -> tuple[SchedulerConfig, HostPool | None]:
    """Incremental reservation, growth failures preempt the latest admitted request, no watermark."""
    cfg = SchedulerConfig(policy="incremental", on_growth_failure="preempt", victim="latest", recovery=recovery,
                          watermark=0.0)
    return cfg, (HostPool(64) if recovery == "swap" else None)


def finish(driver: Driver, on_step: Callable[[StepPlan], None] | None = None,
           limit: int = 300) -> dict[str, FinishedRequest]:
    """Step until the driver has nothing left; every finished request by id."""
    out: dict[str, FinishedRequest] = {}
    steps = 0
    while driver.has_work():
        steps += 1
        assert steps <= limit, "the driver did not finish its work"
        result = driver.step()
        if result.plan is not None and on_step is not None:
            on_step(result.plan)
        for f in result.finished:
            out[f.request.request_id] = f
    assert_clean(driver)
    return out


def ledger_preemptions(driver: Driver) -> int:
    return driver.scheduler.ledger.stats()["lifetimes"]["preemptions"]


def outputs_and_reasons(f: FinishedRequest) -> tuple[list[list[int]], list[str], str]:
    return f.outputs, f.finish_reasons, f.metrics.finish_reason


# ---- finish reasons -------------------------------------------------------------------------------
@pytest.mark.parametrize("max_new", [1, 3], ids=["sampled-by-the-prefill", "sampled-by-a-decode"])
def test_a_stop_token_sampled_as_the_last_allowed_token_ends_with_stop_not_length(max_new: int) -> None:
    """The ``max_new_tokens``-th token is a stop token: both rules would end the branch at this very
    token; the stop token wins (checked first, as vLLM), and it is the last output token."""
    last = 4 + max_new - 1  # its position after a 4-token prompt
    driver = make_driver(script={("r", last): STOP})
    driver.submit(GenRequest("r", toks(4, 100), max_new, stop_token_ids=frozenset({STOP})))
    f = finish(driver)["r"]
    assert outputs_and_reasons(f) == ([expected_output("r", 4, max_new - 1) + [STOP]], ["stop"], "stop")
    assert (f.metrics.generated, f.metrics.longest, f.metrics.completed) == (max_new, max_new, True)


def test_a_stop_token_before_the_limit_ends_with_stop_and_is_kept_as_the_last_output_token() -> None:
    driver = make_driver(script={("r", 5): STOP})  # the second of six allowed tokens
    driver.submit(GenRequest("r", toks(4, 100), 6, stop_token_ids=frozenset({STOP})))
    f = finish(driver)["r"]
    assert outputs_and_reasons(f) == ([[sample_token("r", 4), STOP]], ["stop"], "stop")
    assert f.metrics.generated == 2


def test_without_a_stop_token_a_request_ends_with_length_after_exactly_max_new_tokens() -> None:
    driver = make_driver()
    driver.submit(GenRequest("r", toks(4, 100), 5, stop_token_ids=frozenset({STOP})))
    f = finish(driver)["r"]
    assert outputs_and_reasons(f) == ([expected_output("r", 4, 5)], ["length"], "length")
    assert f.metrics.generated == 5


def test_a_request_without_stop_tokens_runs_through_a_sampled_stop_token_to_exactly_max_new_tokens() -> None:
    """``ignore_eos`` (the server passes no stop tokens): the token that ends a request that declares
    it is an ordinary token for one that does not."""
    driver = make_driver(script={("eos", 5): STOP, ("ignore_eos", 5): STOP})
    driver.submit(GenRequest("eos", toks(4, 100), 6, stop_token_ids=frozenset({STOP})))
    driver.submit(GenRequest("ignore_eos", toks(4, 200), 6))
    done = finish(driver)
    assert outputs_and_reasons(done["eos"]) == ([[sample_token("eos", 4), STOP]], ["stop"], "stop")
    plain = expected_output("ignore_eos", 4, 6)
    plain[1] = STOP
    assert outputs_and_reasons(done["ignore_eos"]) == ([plain], ["length"], "length")


def test_a_stop_token_in_the_prompt_does_not_end_the_request() -> None:
    driver = make_driver()
    driver.submit(GenRequest("r", [1, 2, STOP], 4, stop_token_ids=frozenset({STOP})))
    assert outputs_and_reasons(finish(driver)["r"]) == ([expected_output("r", 3, 4)], ["length"], "length")


# Prompt 4, max_new_tokens 3, lookahead 2 with every draft accepted: the prefill samples position 4, the
# next decode returns three tokens at once (positions 5, 6, 7) -- one more than the allowance has room for.
@pytest.mark.parametrize("stop_at,reason,kept", [
    (5, "stop", 2),  # positions 6 and 7 came back in the same step after the stop token: dropped
    (6, "stop", 3),  # the stop token is the last allowed token: stop, and position 7 is dropped
    (7, "length", 3),  # the stop token came back past the allowance: never seen, the branch ends length
    (None, "length", 3),
])
def test_tokens_a_step_returns_after_a_stop_token_or_past_max_new_tokens_are_dropped(
        stop_at: int | None, reason: str, kept: int) -> None:
    script = {} if stop_at is None else {("r", stop_at): STOP}
    driver = make_driver(script=script)
    driver.submit(GenRequest("r", toks(4, 100), 3, lookahead=2, stop_token_ids=frozenset({STOP})))
    f = finish(driver)["r"]
    want = [script.get(("r", p), sample_token("r", p)) for p in range(4, 4 + kept)]
    assert outputs_and_reasons(f) == ([want], [reason], reason)


def test_each_branch_of_an_n_request_ends_with_its_own_reason() -> None:
    """n = 3, four tokens each: branch 1 samples a stop token second, branch 2 as its fourth and last
    allowed token, branch 0 none. The request's reason is the distinct reasons, sorted and joined. A
    branch that stops leaves the ledger at once while its siblings go on."""
    driver = make_driver(script={("F/1", 5): STOP, ("F/2", 7): STOP, ("S/1", 4): STOP, ("S", 6): STOP})
    driver.submit(GenRequest("F", toks(4, 100), 4, n=3, stop_token_ids=frozenset({STOP})))
    driver.submit(GenRequest("S", toks(4, 200), 4, n=2, stop_token_ids=frozenset({STOP})))
    led = driver.scheduler.ledger
    ended_with_siblings_running: list[str] = []

    def watch(plan: StepPlan) -> None:
        for br in driver.scheduler.branches("F") if "F" in driver.scheduler else ():
            if br.finish_reason == "stop" and br.seq_id not in led and "F" in led:
                ended_with_siblings_running.append(br.seq_id)

    done = finish(driver, watch)
    assert outputs_and_reasons(done["F"]) == (
        [expected_output("F", 4, 4), [sample_token("F/1", 4), STOP], expected_output("F/2", 4, 3) + [STOP]],
        ["length", "stop", "stop"], "length,stop")
    assert [len(o) for o in done["F"].outputs] == [4, 2, 4]
    assert done["F"].metrics.generated == 10 and done["F"].metrics.longest == 4
    assert "F/1" in ended_with_siblings_running
    # Every branch stopped: the request's reason is the one reason, and it counts as completed.
    assert outputs_and_reasons(done["S"]) == ([[sample_token("S", 4), sample_token("S", 5), STOP], [STOP]],
                                              ["stop", "stop"], "stop")
    assert done["S"].metrics.completed


def test_cancelling_a_running_request_ends_every_branch_cancelled_with_the_tokens_so_far() -> None:
    driver = make_driver()
    driver.submit(GenRequest("r", toks(4, 100), 8, n=2))
    for _ in range(3):  # the prefill samples one token, each decode one more
        driver.step()
    assert driver.cancel("r")
    f = finish(driver)["r"]
    assert outputs_and_reasons(f) == ([expected_output("r", 4, 3), expected_output("r/1", 4, 3)],
                                      ["cancelled", "cancelled"], "cancelled")
    assert not f.metrics.completed


def test_a_branch_that_stopped_before_its_request_was_cancelled_keeps_stop() -> None:
    driver = make_driver(script={("r/1", 4): STOP})  # branch 1 stops on its first token
    driver.submit(GenRequest("r", toks(4, 100), 8, n=2, stop_token_ids=frozenset({STOP})))
    for _ in range(3):
        driver.step()
    assert driver.cancel("r")
    f = finish(driver)["r"]
    assert outputs_and_reasons(f) == ([expected_output("r", 4, 3), [STOP]], ["cancelled", "stop"], "cancelled,stop")


def test_a_request_cancelled_before_it_arrives_ends_cancelled_with_no_tokens_in_every_branch() -> None:
    driver = make_driver()
    driver.submit(GenRequest("now", toks(4, 100), 2))
    driver.submit(GenRequest("later", toks(4, 200), 2, n=3, arrival_s=5.0))
    driver.step()
    assert driver.cancel("later")
    f = finish(driver)["later"]
    assert outputs_and_reasons(f) == ([[], [], []], ["cancelled"] * 3, "cancelled")
    assert (f.metrics.admitted_s, f.metrics.first_token_s, f.metrics.generated) == (None, None, 0)


def test_a_request_larger_than_the_whole_pool_ends_never_without_running() -> None:
    """Two branches of 4 + 8 tokens need 3 + 2 blocks (the full prompt block is shared): more than 4."""
    driver = make_driver(num_blocks=4, config=SchedulerConfig(policy="incremental"))
    driver.submit(GenRequest("big", toks(4, 100), 8, n=2))
    driver.submit(GenRequest("small", toks(4, 200), 2))
    done = finish(driver)
    f = done["big"]
    why = "never: larger than the whole pool"
    assert outputs_and_reasons(f) == ([[], []], [why, why], why)
    assert (f.metrics.admitted_s, f.metrics.first_token_s, f.metrics.preemptions) == (None, None, 0)
    assert outputs_and_reasons(done["small"]) == ([expected_output("small", 4, 2)], ["length"], "length")


def test_more_branches_than_max_running_ends_never_more_branches_than_max_running() -> None:
    driver = make_driver(config=SchedulerConfig(max_running=2))
    driver.submit(GenRequest("wide", toks(4, 100), 2, n=3))
    f = finish(driver)["wide"]
    why = "never: more branches than max_running"
    assert outputs_and_reasons(f) == ([[], [], []], [why] * 3, why)


# ---- preemption counts of n > 1 requests ----------------------------------------------------------
# Pool of 9 four-token blocks. G (4-token prompt, 12 tokens) and F (5-token prompt, n = 3, 6 tokens) run
# together; in step 5 G needs a block, none is left, and F (the latest admitted) is preempted: all three
# branches at once. F comes back when G has finished.
def one_preemption_scenario(recovery: str) -> Driver:
    cfg, host = pressure(recovery)
    driver = make_driver(9, cfg, host)
    driver.submit(GenRequest("G", toks(4, 100), 12))
    driver.submit(GenRequest("F", toks(5, 200), 6, n=3))
    return driver


@pytest.mark.parametrize("recovery", ["recompute", "swap"])
def test_a_family_of_three_preempted_once_counts_one_preemption_and_three_ledger_preemptions(recovery: str) -> None:
    driver = one_preemption_scenario(recovery)
    preempted: list[tuple[int, str, str]] = []
    done = finish(driver, lambda p: preempted.extend((p.step, x.request_id, x.mode) for x in p.preempted))
    assert preempted == [(5, "F", recovery)]
    assert driver.scheduler.preemptions == 1  # gang semantics: the family is one victim
    assert (done["F"].metrics.preemptions, done["G"].metrics.preemptions) == (1, 0)
    assert ledger_preemptions(driver) == 3  # the ledger counts the sequences it took off the device
    # Preemption changes no token.
    assert done["F"].outputs == [expected_output(sid, 5, 6) for sid in ("F", "F/1", "F/2")]
    assert done["F"].finish_reasons == ["length"] * 3


# Pool of 8. A (6 tokens) and G (16 tokens) are admitted first, F (n = 2, 8 tokens) last: F is preempted
# in step 4, comes back when A finishes, and is preempted again in step 9 when G grows.
@pytest.mark.parametrize("recovery", ["recompute", "swap"])
def test_a_family_of_two_preempted_twice_counts_two_preemptions_and_four_ledger_preemptions(recovery: str) -> None:
    cfg, host = pressure(recovery)
    driver = make_driver(8, cfg, host)
    driver.submit(GenRequest("A", toks(4, 300), 6))
    driver.submit(GenRequest("G", toks(4, 100), 16))
    driver.submit(GenRequest("F", toks(5, 200), 8, n=2))
    preempted: list[tuple[int, str, str]] = []
    done = finish(driver, lambda p: preempted.extend((p.step, x.request_id, x.mode) for x in p.preempted))
    assert preempted == [(4, "F", recovery), (9, "F", recovery)]
    assert driver.scheduler.preemptions == 2
    assert {rid: f.metrics.preemptions for rid, f in done.items()} == {"A": 0, "G": 0, "F": 2}
    assert ledger_preemptions(driver) == 4  # two branches, twice
    assert done["F"].outputs == [expected_output("F", 5, 8), expected_output("F/1", 5, 8)]


def test_the_ledger_counts_only_the_live_branches_of_a_preempted_family() -> None:
    """Pool of 7: F's branch 1 stops on its second token (step 1) and leaves the ledger; in step 5 F is
    preempted with two live branches. One preemption for the scheduler and the request, two for the
    ledger; the stopped branch keeps its reason and its two tokens."""
    cfg, _ = pressure("recompute")
    driver = make_driver(7, cfg, script={("F/1", 6): STOP})
    driver.submit(GenRequest("G", toks(4, 100), 12))
    driver.submit(GenRequest("F", toks(5, 200), 6, n=3, stop_token_ids=frozenset({STOP})))
    preempted: list[tuple[int, str]] = []
    done = finish(driver, lambda p: preempted.extend((p.step, x.request_id) for x in p.preempted))
    assert preempted == [(5, "F")]
    assert (driver.scheduler.preemptions, done["F"].metrics.preemptions, ledger_preemptions(driver)) == (1, 1, 2)
    assert outputs_and_reasons(done["F"]) == (
        [expected_output("F", 5, 6), [sample_token("F/1", 5), STOP], expected_output("F/2", 5, 6)],
        ["length", "stop", "length"], "length,stop")


def _requeue_by_the_scheduler(driver: Driver) -> None:
    assert driver.scheduler.requeue("F")


def _requeue_by_a_cache_reset(driver: Driver) -> None:
    assert driver.scheduler.reset_prefix_cache(requeue_running=True)


@pytest.mark.parametrize("requeue", [_requeue_by_the_scheduler, _requeue_by_a_cache_reset],
                         ids=["Scheduler.requeue", "reset_prefix_cache(requeue_running=True)"])
def test_a_requeued_family_counts_no_preemption_for_the_scheduler_the_request_or_the_ledger(
        requeue: Callable[[Driver], None]) -> None:
    driver = make_driver()
    driver.submit(GenRequest("F", toks(5, 200), 6, n=2))
    for _ in range(3):
        driver.step()
    assert "F" in driver.scheduler.running
    requeue(driver)
    assert "F" not in driver.scheduler.running and len(driver.scheduler.waiting) == 1
    done = finish(driver)
    assert (driver.scheduler.preemptions, done["F"].metrics.preemptions, ledger_preemptions(driver)) == (0, 0, 0)
    assert outputs_and_reasons(done["F"]) == ([expected_output("F", 5, 6), expected_output("F/1", 5, 6)],
                                              ["length", "length"], "length")


def run(num_blocks: int, config: SchedulerConfig, host: HostPool | None, requests: list[GenRequest]):
    driver = Driver(Scheduler(KVLedger(num_blocks, BS), config, host=host), ConstantExecutor(7), check_every=1,
                    keep_records=True)
    outputs = {}
    for r in requests:
        driver.submit(r)
    while driver.has_work():
        for f in driver.step().finished:
            outputs[f.request.request_id] = f.outputs
    driver.scheduler.check()
    return driver, outputs


def three() -> list[GenRequest]:
    return [GenRequest("G", toks(4, 100), 16), GenRequest("V", toks(6, 200), 12), GenRequest("W", toks(5, 300), 16)]


def test_a_request_swapped_out_twice_counts_two_preemptions() -> None:
    """Pool of 6 blocks of 4, the latest admitted is the victim, swap: W is swapped out twice, V once.
    Each swap counts (``Scheduler.preempt`` once set the count to 1 instead of adding one), and swapping
    changes no output."""
    cfg = SchedulerConfig(policy="incremental", victim="latest", recovery="swap", watermark=0.0)
    driver, outputs = run(6, cfg, HostPool(64), three())
    counts = {r.request_id: r.preemptions for r in driver.records}
    assert counts == {"G": 0, "V": 1, "W": 2}
    assert driver.scheduler.preemptions == 3
    _, undisturbed = run(64, SchedulerConfig(), None, three())
    assert outputs == undisturbed
