"""Tests written because mutants of a seeded sample (``tests/mutation.py sample``, seed 3) of every mutant of
``core/`` and ``scheduler/`` survived the suite (docs/testing.md). Each pins down something a caller can
see -- a family decision's figures and flags, a counter, a message, a tier's books, a transfer time, how a
failed step is run again request by request -- that no other test checked."""

from __future__ import annotations

import pytest

from kvledger.core.identity import CacheContext
from kvledger.core.ledger import KVLedger, Outcome, Request
from kvledger.core.tiers import TierLedger, TierSpec
from kvledger.errors import ConfigError
from kvledger.scheduler import (
    Driver,
    GenRequest,
    HostPool,
    Scheduler,
    SchedulerConfig,
    StepOutput,
    StepPlan,
    TransferModel,
)
from kvledger.scheduler.beam import fork_beams
from kvledger.scheduler.growth import REJECTED_OUTGREW

try:  # the module name pytest gives tests/scheduler/test_scheduler.py depends on its import mode
    from tests.scheduler.test_scheduler import FakeEngine
except ImportError:  # pragma: no cover
    from scheduler.test_scheduler import FakeEngine

BS = 4
ACME = CacheContext(trust_group="acme")


def toks(n: int, start: int) -> list[int]:
    return list(range(start, start + n))


# ---- core/admission.py: a family of branches under its trust group's quota -----------------------------

def _family_under_quota() -> tuple[KVLedger, list[Request]]:
    """A 64-block pool whose prefix index holds two full blocks of acme's (tokens 0..7), a running acme
    request "x" (1 block held + 1 promised = 2 charged), and a two-branch family "f" whose 10-token prompts
    share those two blocks and end in different 2-token tails, 4 new tokens each."""
    led = KVLedger(64, BS)
    assert led.admit(Request("w", [*range(8), 99], 1, ACME)).admitted
    led.mark_computed("w", 9)
    led.release("w")  # its two full blocks stay in the prefix index
    assert led.admit(Request("x", [7] * 4, 4, ACME)).admitted
    family = [Request("f", [*range(8), 50, 51], 4, ACME),
              Request("f/1", [*range(8), 60, 61], 4, ACME, family="f")]
    return led, family


def test_a_family_refused_by_its_quota_now_names_the_family_and_its_shared_hits() -> None:
    """The not-now decision a quota gives a family names the family and counts its prefix hits, as the
    pool's own refusals do: 2 shared hits; 2 new tail blocks + 1 promised block per branch = 4, so 6
    blocks in all; the quota needs 2 tails + 2 unheld hits + 1 growth block per branch = 6 on top of x's
    2, past the cap of 6."""
    led, family = _family_under_quota()
    led.set_quota("acme", 6)
    refused = led.admit_family(family)
    assert refused.outcome is Outcome.NOT_NOW and refused.over_quota
    assert refused.request_id == "f"
    assert (refused.blocks_total, refused.blocks_hit, refused.blocks_new, refused.blocks_promised) == (6, 2, 2, 2)
    assert refused.reason == ("needs 6 blocks of its trust group's quota of 6 blocks, of which 2 are held or "
                              "committed to its running requests now")


def test_a_family_larger_than_its_quota_is_never_and_says_the_quota_refused_it() -> None:
    """A family that could not fit its group's cap even alone is ``never`` *because of the quota*: the
    decision says so (``over_quota``) and the group's quota refusals count it. At their longest the
    branches need 2 shared blocks + 2 x (14 tokens = 4 blocks, less the 2 shared) = 6 > the cap of 4."""
    led, family = _family_under_quota()
    led.set_quota("acme", 4)
    never = led.admit_family(family)
    assert never.outcome is Outcome.NEVER
    assert never.over_quota is True
    assert never.reason == "needs 6 blocks for 2 branches at their longest but its trust group's quota is 4 blocks"
    assert led.counters.quota_refusals == {"acme": 1}
    assert led.counters.rejected_never == 1


def test_admit_family_names_keep_free_when_it_is_bad() -> None:
    led, family = _family_under_quota()
    with pytest.raises(ConfigError, match=r"^keep_free must be >= 0, got -1$"):
        led.admit_family(family, keep_free=-1)


# ---- core/ledger.py, core/lifetimes.py, core/observe.py -------------------------------------------------

class TokenId:
    """An integer-like token id (as a numpy or torch scalar is): it has ``__index__``, it is not an int."""

    def __init__(self, value: int) -> None:
        self.value = value

    def __index__(self) -> int:
        return self.value


def test_token_id_zero_given_as_an_integer_like_is_appended() -> None:
    """Token id 0 is a valid id ([0, 2**32)), also when the engine hands it over as an integer-like."""
    led = KVLedger(8, BS)
    led.admit(Request("a", [5, 6, 7], 4)).raise_for_outcome()
    led.mark_computed("a", 3)
    assert led.append_token("a", TokenId(0)) == []  # type: ignore[arg-type]
    assert led.sequence("a").tokens == [5, 6, 7, 0]
    led.decode_step([("a", TokenId(0))])  # type: ignore[list-item]
    assert led.sequence("a").tokens == [5, 6, 7, 0, 0]
    led.check()


def test_a_done_prefix_cache_reset_says_how_many_blocks_it_cleared() -> None:
    """An 8-token prompt, computed and released, leaves its 2 full blocks cached: the reset clears them
    and its explanation says so."""
    led = KVLedger(8, BS)
    led.admit(Request("a", toks(8, 10), 1)).raise_for_outcome()
    led.mark_computed("a", 8)
    led.release("a")
    reset = led.reset_prefix_cache()
    assert reset.done and reset.cleared_blocks == 2
    assert reset.reason == "2 cached blocks cleared"


def test_the_query_totals_add_up_every_groups_queried_blocks() -> None:
    """Two prefix-cache queries in two trust groups: a 9-token prompt has 2 full blocks, a 4-token prompt
    1, so 3 queried blocks in all (13 tokens, no hits)."""
    led = KVLedger(16, BS)
    assert led.admit(Request("a", toks(9, 0), 1, ACME)).admitted
    assert led.admit(Request("b", toks(4, 100), 1, CacheContext(trust_group="globex"))).admitted
    t = led.counters.totals()
    assert (t.queries, t.query_blocks, t.hit_blocks, t.query_tokens, t.hit_tokens) == (2, 3, 0, 13, 0)


# ---- core/tiers.py and scheduler/host.py --------------------------------------------------------------

def test_spill_counts_the_entries_it_moved_down() -> None:
    """Two cached host entries spilled to the disk tier: two moves in the tier ledger's flow."""
    tiers = TierLedger([("host", 2), ("disk", 3)])
    for i in range(2):
        tiers.demote(i, bytes([i + 1]), "g")
    tiers.complete()
    assert tiers.spill(0, 2) == 2
    assert tiers.flow["moved"] == 2


def test_tier_usage_reports_each_tiers_size_under_slots() -> None:
    tiers = TierLedger([("host", 2), ("disk", 3)])
    tiers.demote(0, b"\x01", "g")
    usage = tiers.usage()
    assert usage["host"]["slots"] == 2 and usage["disk"]["slots"] == 3
    assert usage["host"] == {"slots": 2, "free": 1, "held": 0, "cached": 1, "draining": 0, "in_flight": 1}


@pytest.mark.parametrize("name", ["a-b", "1st", "host disk"])
def test_a_tier_name_that_is_not_an_identifier_is_refused(name: str) -> None:
    with pytest.raises(ConfigError, match="a tier name is an identifier such as 'host' or 'disk'"):
        TierSpec(name, 3)


def test_a_host_pool_keeps_its_block_size_in_bytes() -> None:
    assert HostPool(8, block_bytes=4096).block_bytes == 4096
    assert HostPool(8).block_bytes == 0


def test_moving_no_blocks_takes_no_time() -> None:
    """No blocks, no staging round: zero seconds either way (not one round's overhead, nor a second)."""
    model = TransferModel(link_Bps=1e9, overhead_s=0.5)
    assert model.time_s(0, 4096) == 0.0
    assert model.time_s(0, 4096, "in") == 0.0
    assert model.blocking_time_s(0, 4096) == 0.0


# ---- scheduler/admission.py -----------------------------------------------------------------------------

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


# ---- scheduler/driver.py: a failed step run again request by request -----------------------------------

class Recording:
    """Token = f(branch, position); records (step, requests with works, swap-ins, demotions) of every
    call; raises on the calls ``fails`` picks."""

    def __init__(self, fails) -> None:
        self.fails = fails
        self.calls: list[tuple[int, list[str], int, int]] = []
        self.raised = 0

    def execute(self, plan: StepPlan) -> StepOutput:
        works = (*plan.prefills, *plan.decodes)
        self.calls.append((plan.step, sorted({w.request_id for w in works}), len(plan.swap_in), len(plan.demote)))
        if self.fails(self, plan):
            self.raised += 1
            raise RuntimeError(f"boom {self.raised}")
        out = StepOutput(elapsed_s=0.01)
        for w in works:
            if w.sample:
                out.sampled[w.seq_id] = [10 + (sum(map(ord, w.seq_id)) * 31 + w.end * 7) % 900]
        return out


def _drive(driver: Driver, requests: list[GenRequest]) -> dict[str, str]:
    for r in requests:
        driver.submit(r)
    while driver.has_work():
        driver.step()
    return {r.request_id: r.finish_reason for r in driver.records}


def test_a_failing_swap_in_fails_the_request_it_restores() -> None:
    """Pool of 6: V swaps itself out for G, and comes back once G is done. Every transfer that reads V's
    host copy back raises: the whole step fails (boom 1), then V's own part, which carries V's swap-in
    (boom 2), so V ends with that error -- the swap-in is V's, not a transfer of nobody's."""
    cfg = SchedulerConfig(policy="incremental", victim="latest", recovery="swap", watermark=0.0)
    executor = Recording(lambda ex, plan: bool(plan.swap_in))
    driver = Driver(Scheduler(KVLedger(6, BS), cfg, host=HostPool(16)), executor, check_every=1, keep_records=True)
    reasons = _drive(driver, [GenRequest("G", toks(4, 100), 12), GenRequest("V", toks(6, 200), 9)])
    assert reasons == {"G": "length", "V": "error: RuntimeError: boom 2"}
    failed = [c for c in executor.calls if c[2]]
    assert len(failed) == 2 and failed[0][0] == failed[1][0]  # the whole step, then V's part of it
    assert driver.scheduler.host.num_used == 0


def test_the_part_of_a_failed_step_that_belongs_to_nobody_runs_under_the_steps_number() -> None:
    """With prefix offload, B's admission evicts A's cached blocks, demoted to the host tier in B's first
    step (step 2). That step fails once; run again request by request, the demotions (nobody's) go first,
    in a plan numbered like the step they belong to, then B's part."""
    s = Scheduler(KVLedger(8, BS), SchedulerConfig(offload_prefixes=True, writeback_blocks=0),
                  host=TierLedger([("host", 8)]))  # type: ignore[arg-type]
    executor = Recording(lambda ex, plan: bool(plan.demote) and not ex.raised)
    driver = Driver(s, executor, check_every=1, keep_records=True)
    assert _drive(driver, [GenRequest("A", toks(16, 0), 2)]) == {"A": "length"}
    assert _drive(driver, [GenRequest("B", toks(24, 500), 2)]) == {"A": "length", "B": "length"}
    whole, orphan, b_part = executor.calls[2:5]
    assert whole[0] == 2 and whole[1] == ["B"] and whole[3] > 0
    assert orphan == (2, [], 0, whole[3])
    assert b_part == (2, ["B"], 0, 0)
