"""The driver and the scheduler when the prefix cache's transfers fail: an executor whose tier writes or
reads raise (a full disk, a bad sector) costs cache entries, never requests. On fake KV memory that checks
every position a step reads, so a block that never arrived cannot go unnoticed."""

from __future__ import annotations

import errno

import pytest

from kvledger.core.ledger import KVLedger
from kvledger.core.tiers import TierLedger
from kvledger.scheduler import (
    Driver,
    GenRequest,
    HostPool,
    Scheduler,
    SchedulerConfig,
    StepOutput,
    StepPlan,
)

try:  # the module name pytest gives tests/scheduler/test_scheduler.py depends on its import mode
    from tests.scheduler.test_scheduler import BS, FakeEngine, assert_drained, expected_output, toks
except ImportError:  # pragma: no cover
    from test_scheduler import BS, FakeEngine, assert_drained, expected_output, toks


class FlakyTierExecutor(FakeEngine):
    """An executor on fake KV memory with tiers whose writes (demotions, write-backs, moves) or reads
    (promotions) raise ``OSError`` -- for the whole plan, before anything of it ran, as an executor that
    does not tell its transfers apart would. Tier slots hold what the device block held, so a promotion
    that never happened shows up as a read of KV that was never written there."""

    def __init__(self, s: Scheduler) -> None:
        super().__init__(s)
        self.fail_writes = self.fail_reads = False
        self.raised = 0

    def execute(self, plan: StepPlan) -> StepOutput:
        writes = plan.demote or plan.tier_moves or plan.writeback
        if (self.fail_writes and writes) or (self.fail_reads and plan.promote):
            self.raised += 1
            raise OSError(errno.ENOSPC if self.fail_writes else errno.EIO, "the disk tier failed")
        for b, slot in plan.demote:
            self.host[slot] = list(self.block(b))
        for slot, d in plan.promote:
            self.dev[d] = list(self.host[slot])
        for src, dst in plan.tier_moves:
            self.host[dst] = list(self.host[src])
        for b, slot in plan.writeback:
            self.host[slot] = list(self.block(b))
        return StepOutput(sampled=self.run(plan))


def offload(pool: int = 8, host: int = 8, disk: int = 0, **cfg: object) -> tuple[Scheduler, FlakyTierExecutor]:
    tiers = TierLedger([(n, b) for n, b in (("host", host), ("disk", disk)) if b])
    s = Scheduler(KVLedger(pool, BS), SchedulerConfig(offload_prefixes=True, **cfg), host=tiers)  # type: ignore[arg-type]
    return s, FlakyTierExecutor(s)


def run(driver: Driver, *requests: GenRequest) -> dict[str, tuple[list[str], list[list[int]]]]:
    """Submit the requests, step until all are done; each request's finish reasons and outputs."""
    for r in requests:
        driver.submit(r)
    out: dict[str, tuple[list[str], list[list[int]]]] = {}
    steps = 0
    while driver.has_work():
        steps += 1
        assert steps < 500, "the driver did not finish its work"
        result = driver.step()
        assert result.failed == [], result.failed
        for f in result.finished:
            out[f.request.request_id] = (f.finish_reasons, f.outputs)
    return out


def assert_clean(s: Scheduler) -> None:
    """Nothing running, nothing leaked; the tiers hold cache entries only."""
    u = s.ledger.usage()
    assert (u.active, u.promised, u.deferred, u.sequences) == (0, 0, 0, 0), u
    assert s.ledger.outstanding_leases() == 0
    assert s.host.counts["held"] == s.host.counts["draining"] == 0 and not any(s.host.in_flight)
    s.check()


def done(rid: str, prompt: int, new: int) -> tuple[list[str], list[list[int]]]:
    return ["length"], [expected_output(rid, prompt, new)]


@pytest.mark.parametrize("disk", [0, 16])
def test_a_failing_tier_write_only_loses_cache_entries(disk: int) -> None:
    """Regression (defect 3): the driver ran the prefix cache's transfers as a part of the step that
    belongs to nobody, and when it raised it failed every request of the step -- the request whose
    admission evicted someone else's idle block, and each one after it while the disk kept failing."""
    s, ex = offload(host=4 if disk else 8, disk=disk, writeback_blocks=2)
    driver = Driver(s, ex, check_every=1)
    assert run(driver, GenRequest("A", toks(16, 0), 2)) == {"A": done("A", 16, 2)}
    ex.fail_writes = True
    got = {}
    for i, rid in enumerate("BCDEFGHI"):  # each evicts the retained blocks of the one before
        evictions = s.ledger.pool.evictions
        got.update(run(driver, GenRequest(rid, toks(20, 1000 * (i + 1)), 2)))
        assert s.ledger.pool.evictions > evictions
    assert got == {rid: done(rid, 20, 2) for rid in "BCDEFGHI"}
    stats = s.tier_stats()
    assert ex.raised > 0 and stats["demotion_failures"] == stats["flow"]["discarded"] > 0
    assert s.host.index == {} and stats["promotion_failures"] == 0
    assert_drained(s)
    # The tier works again: A's prompt is computed (nothing of it was kept), then cached below as usual.
    ex.fail_writes = False
    assert run(driver, GenRequest("A2", toks(16, 0) + toks(3, 900), 2)) == {"A2": done("A2", 19, 2)}
    assert run(driver, GenRequest("J", toks(24, 500), 2)) == {"J": done("J", 24, 2)}
    assert s.host.index
    assert_clean(s)


@pytest.mark.parametrize("restore_ahead", [False, True])
def test_a_failing_promotion_sends_its_request_back_to_recompute(restore_ahead: bool) -> None:
    s, ex = offload(writeback_blocks=0, restore_ahead=restore_ahead)
    driver = Driver(s, ex, check_every=1)
    run(driver, GenRequest("A", toks(16, 0), 2))  # 4 full prompt blocks cached on the device
    run(driver, GenRequest("B", toks(24, 500), 2))  # evicts 3 of A's: demoted to the host tier
    assert len(s.host.index) == 3
    ex.fail_reads = True
    seen: list[StepPlan] = []
    driver.on_planned = lambda plan, t: seen.append(plan)
    got = run(driver, GenRequest("C", toks(16, 0) + toks(3, 900), 2), GenRequest("D", toks(6, 700), 2))
    assert got == {"C": done("C", 19, 2), "D": done("D", 6, 2)}  # the fake KV checks every position C read
    promoting = [p for p in seen if p.promote]
    assert len(promoting) == 1 and len(promoting[0].promote) == 3
    stats = s.tier_stats()
    assert stats["promotion_failures"] == 3 and stats["promoted_tokens"] == 0
    assert s.ledger.counters.preemptions == 0 and s.preemptions == 0  # a requeue, not a preemption
    # C came back without its head from the tier: it computed the 12 tokens the promotion would have served.
    after = seen[seen.index(promoting[0]) + 1:]
    again = next(p for p in after if "C" in p.admitted)
    assert again.promote == [] and again.admissions[0].cached_tokens == 4
    assert sum(w.end - w.start for p in after for w in p.prefills if w.request_id == "C") == 15
    assert_drained(s)


def _drive(driver: Driver, requests: list[GenRequest]) -> dict[str, str]:
    for r in requests:
        driver.submit(r)
    while driver.has_work():
        driver.step()
    return {r.request_id: r.finish_reason for r in driver.records}


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
