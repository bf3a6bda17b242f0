"""Tests written because mutants drawn by ``tests/mutation.py sample`` (seed 6: a seeded uniform sample of
every mutant of ``core/`` and ``scheduler/``, docs/testing.md) survived the suite. Each pins down something
a caller can see -- a message, a value accepted, when a run stops, which request comes back, the order in
which a failed step's parts run -- that no other test checked."""

from __future__ import annotations

import pytest

from kvledger.core.identity import CacheContext
from kvledger.core.ledger import KVLedger, Retention
from kvledger.core.tiers import TierLedger
from kvledger.errors import ConfigError, LedgerError
from kvledger.scheduler import (
    ConstantExecutor,
    Driver,
    GenRequest,
    HostPool,
    Scheduler,
    SchedulerConfig,
)

BS = 4


try:  # the module name pytest gives tests/scheduler/test_scheduler.py depends on its import mode
    from tests.scheduler import test_scheduler as _sched_h
except ImportError:  # pragma: no cover - run from inside tests/
    from scheduler import test_scheduler as _sched_h
toks = _sched_h.toks  # toks(n, start): n consecutive token ids from start


# ---- value types and the tiers -------------------------------------------------------------------------

def test_a_bad_retention_end_names_the_field() -> None:
    """The message says which field of the Retention is wrong, spelt as the caller wrote it."""
    with pytest.raises(ConfigError, match=r"^Retention\.end must be an integer, got 'x'$"):
        Retention(0, "x", 1)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"^Retention\.end must be >= 0, got -1$"):
        Retention(0, -1, 1)


def test_a_retention_of_zero_seconds_is_accepted() -> None:
    """``duration_s`` must be finite and >= 0 (its own message says so): zero is allowed, negative not."""
    r = Retention(0, 4, 50, duration_s=0)
    assert r.duration_s == 0.0 and type(r.duration_s) is float
    with pytest.raises(ConfigError, match=r"finite and >= 0, got -1\.0"):
        Retention(0, 4, 50, duration_s=-1)


def test_demote_quotes_the_trust_group_it_refuses() -> None:
    """The error shows the value that was given as the trust group, not some other value."""
    tiers = TierLedger([("host", 8)])
    with pytest.raises(ConfigError, match=r"^demote: the trust group must be a string, got 5$"):
        tiers.demote(0, b"d" * 32, 5)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"got b'g'$"):
        tiers.demote(0, b"d" * 32, b"g")  # type: ignore[arg-type]


# ---- the scheduler -------------------------------------------------------------------------------------

def test_forget_of_an_unfinished_request_says_it_is_not_finished() -> None:
    s = Scheduler(KVLedger(8, BS))
    with pytest.raises(LedgerError, match=r"^request 'nope' is not finished$"):
        s.forget("nope")
    s.add(GenRequest("a", toks(3, 100), 2))
    with pytest.raises(LedgerError, match=r"request 'a' is not finished"):
        s.forget("a")


def test_a_swapped_request_of_another_group_comes_back_past_one_held_by_its_quota() -> None:
    """Pool of 6 blocks, swap recovery, the latest request is the victim: acme's a0 and a2 and globex's
    b1 run until a2 and then b1 are swapped out (swapped queue: a2, b1; a0 runs). acme's quota is then
    set to 3 blocks: a0 holds 3 of them and a2 needs 2 more, so a2 is refused for its group's quota
    (not "never": 2 <= 3), and b1, behind it, comes back in the next step; a2 waits, then finishes.
    Every output is the fake model's own."""
    acme, globex = CacheContext(trust_group="acme"), CacheContext(trust_group="globex")
    led = KVLedger(6, BS)
    cfg = SchedulerConfig(policy="incremental", watermark=0.0, recovery="swap", victim="latest")
    s = Scheduler(led, cfg, host=HostPool(64))
    for i, g in enumerate("aba"):
        s.add(GenRequest(f"{g}{i}", toks(4, 100 + 10 * i), 8, acme if g == "a" else globex))
    eng = _sched_h.FakeEngine(s)
    for _ in range(20):
        eng.step()
        if [u[0].request.request_id for u in s.swapped] == ["a2", "b1"]:
            break
    assert [u[0].request.request_id for u in s.swapped] == ["a2", "b1"]
    assert list(s.running) == ["a0"]
    led.set_quota("acme", 3)
    plan = eng.step()
    assert plan.admitted == ["b1"] and plan.swap_in and not plan.ended
    assert [u[0].request.request_id for u in s.swapped] == ["a2"]
    eng.drain()
    for rid in ("a0", "b1", "a2"):
        (br,) = s.branches(rid)
        assert (br.finish_reason, br.output) == ("length", _sched_h.expected_output(rid, 4, 8)), rid
    _sched_h.assert_drained(s)


# ---- the driver ----------------------------------------------------------------------------------------

def test_run_stops_after_max_steps() -> None:
    """A request of 3 prompt tokens and 20 new tokens needs 20 steps; ``run(max_steps=3)`` returns after
    exactly 3 with the request still running (nothing finished), and the next run finishes it."""
    driver = Driver(Scheduler(KVLedger(16, BS)), ConstantExecutor())
    driver.submit(GenRequest("a", toks(3, 100), 20))
    assert driver.run(max_steps=3) == []
    assert driver.steps == 3 and driver.has_work()
    assert len(driver.scheduler.branches("a")[0].output) == 3  # one token per step
    seen: list[int] = []
    done = driver.run(progress=lambda d: seen.append(d.steps), progress_every=5)
    assert [m.request_id for m in done] == ["a"] and driver.steps == 20
    assert seen == [8, 13, 18, 20]  # every 5th step of this run (its steps 5, 10, 15), then at the end


try:  # the fault-injecting executor of the shared-prefill tests: FakeEngine behind the executor protocol
    from tests.scheduler.test_scheduler_shared_prefill import FakeExecutor as _PartExecutor
except ImportError:  # pragma: no cover - run from inside tests/
    from test_scheduler_shared_prefill import FakeExecutor as _PartExecutor


def test_after_a_part_fails_the_other_ready_parts_run_before_the_readers_that_waited() -> None:
    """Step 1 admits W, X, R, Y (in that order); R's prompt opens with W's 12-token head, which it reads
    from W's work of the same step. X's part raises, so the driver runs the step again one request at a
    time: a pass runs every part that is ready, in plan order -- W, X (fails), Y -- and R, which waited
    for its writer W, runs in the next pass. X ends with the error; W, R and Y finish normally."""
    head = toks(12, 500)  # 3 full blocks of 4
    s = Scheduler(KVLedger(64, BS), SchedulerConfig(policy="full"))
    ex = _PartExecutor(s, fail={"X"})
    driver = Driver(s, ex, check_every=1, keep_records=True)
    prompts = {"W": head + toks(5, 100), "X": toks(7, 300), "R": head + toks(3, 200), "Y": toks(6, 400)}
    for rid, p in prompts.items():
        driver.submit(GenRequest(rid, p, 4))
    result = driver.step()
    assert [rid for rid, _ in result.failed] == ["X"]
    assert ex.calls == [["R", "W", "X", "Y"], ["W"], ["X"], ["Y"], ["R"]]
    driver.run()
    reasons = {m.request_id: m.finish_reason for m in driver.records}
    assert reasons == {"X": "error: RuntimeError: part of ['X'] failed", "W": "length", "R": "length",
                       "Y": "length"}
