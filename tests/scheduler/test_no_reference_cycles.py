"""A ledger and a scheduler that go out of use are freed at once, by reference counting alone.

Every part of a ledger or a scheduler that points back at its owner (a stored bound method, a parent
reference) makes the whole graph -- the pool, every sequence, every request -- a cycle that only the
cyclic garbage collector frees. Its full passes walk every object alive, so each such graph left behind
slows every later step of the process (a benchmark running several policies one after another measured
the last one 25-40% slower). These tests run with the collector off: what is not freed by reference
counting stays alive until the collector's pass at the end, which lists it.
"""

from __future__ import annotations

import gc
import random
from collections.abc import Iterator

import pytest

from kvledger.core.identity import CacheContext
from kvledger.core.ledger import KVLedger, Request
from kvledger.core.tiers import TierLedger
from kvledger.scheduler import ConstantExecutor, Driver, GenRequest, Scheduler, SchedulerConfig


@pytest.fixture
def no_cycle_collector() -> Iterator[None]:
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()


def left_in_cycles() -> list[str]:
    """kvledger's objects that reference counting did not free: the collector's pass finds them."""
    gc.set_debug(gc.DEBUG_SAVEALL)  # keep what the pass finds in gc.garbage instead of freeing it
    gc.collect()
    gc.set_debug(0)
    found = sorted({type(o).__qualname__ for o in gc.garbage if type(o).__module__.startswith("kvledger.")})
    gc.garbage.clear()
    return found


def _requests(n: int, seed: int = 0) -> list[GenRequest]:
    rng = random.Random(seed)
    shared = [rng.randrange(1000) for _ in range(32)]
    return [GenRequest(f"r{i}", shared + [rng.randrange(1000) for _ in range(rng.randrange(1, 40))],
                       rng.randrange(1, 24), n=2 if i % 5 == 0 else 1) for i in range(n)]


def test_a_dropped_ledger_is_freed_without_the_cycle_collector(no_cycle_collector: None) -> None:
    ledger = KVLedger(64, 16, prefix_caching=True)
    ctx = CacheContext(model="m", trust_group="t")
    ledger.admit(Request("a", list(range(40)), 8, ctx, branches=2))
    ledger.decode_step([("a", 1), ("a/1", 2)])
    ledger.beam_step([("a", "a/2")], ["a/1"])  # the one operation that releases through the ledger
    del ledger
    assert left_in_cycles() == []


@pytest.mark.parametrize("policy", ["full", "incremental"])
def test_a_dropped_scheduler_and_its_driver_are_freed_without_the_cycle_collector(
        no_cycle_collector: None, policy: str) -> None:
    tiers = TierLedger([("host", 16)])
    sched = Scheduler(KVLedger(24, 16), SchedulerConfig(policy=policy, offload_prefixes=True, watermark=0.0),
                      host=tiers)
    driver = Driver(sched, ConstantExecutor())
    driver.run(_requests(30))
    assert sched.ledger.stats()["lifetimes"]["evictions"] > 0  # the tier path ran
    del sched, driver
    assert left_in_cycles() == []
