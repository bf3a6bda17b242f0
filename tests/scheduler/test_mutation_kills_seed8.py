"""Tests written because mutants drawn by ``tests/mutation.py sample`` (seed 8, docs/testing.md) survived
the suite. Each pins down something a caller can see that no other test checked."""

from __future__ import annotations

from kvledger.core.ledger import KVLedger
from kvledger.scheduler import ConstantExecutor, Driver, GenRequest, HostPool, Scheduler, SchedulerConfig

BS = 4


def toks(base: int, n: int) -> list[int]:
    return [base + i for i in range(n)]


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
    return [GenRequest("G", toks(100, 4), 16), GenRequest("V", toks(200, 6), 12), GenRequest("W", toks(300, 5), 16)]


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
