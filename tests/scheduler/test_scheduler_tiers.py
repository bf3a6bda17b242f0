"""The scheduler with tiers below the device pool: demotion, promotion, swapping to any tier, restore-ahead,
failed transfers and resets -- on fake KV memory that checks every position a step reads."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from kvledger.core.identity import CacheContext
from kvledger.core.ledger import KVLedger
from kvledger.core.tiers import TierLedger
from kvledger.errors import ConfigError, InvariantError
from kvledger.scheduler import (
    ConstantExecutor,
    Driver,
    GenRequest,
    HostPool,
    Scheduler,
    SchedulerConfig,
    StepOutput,
    StepPlan,
)
from kvledger.scheduler.transfers import reads_inbound


def _scheduler_helpers():
    """The fake KV memory of tests/scheduler/test_scheduler.py (tests run with --import-mode=importlib)."""
    name = "kvledger_test_scheduler_helpers"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, Path(__file__).with_name("test_scheduler.py"))
        module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
        sys.modules[name] = module
        spec.loader.exec_module(module)  # type: ignore[union-attr]
    return sys.modules[name]


_h = _scheduler_helpers()
BS, FakeEngine, toks = _h.BS, _h.FakeEngine, _h.toks
assert_drained, expected_output = _h.assert_drained, _h.expected_output


class TierEngine(FakeEngine):
    """FakeEngine plus the tier transfers, in the executors' order: moves, demotions, promotions, then
    copies and swaps. Tier slots hold what the device block held, so a wrong transfer shows up as a read
    of KV that was never written there."""

    def __init__(self, s: Scheduler) -> None:
        super().__init__(s)
        self.moved = self.demoted = self.promoted = 0

    def run(self, plan: StepPlan) -> dict[str, list[int]]:
        pool = self.s.ledger.pool
        for b, slot in plan.demote:  # A: before anything writes the evicted blocks
            self.host[slot] = list(self.block(b))
        for slot, d in plan.promote:  # B
            assert slot in self.host, f"step {plan.step}: tier slot {slot} promoted but never written"
            assert pool.leased[d], f"step {plan.step}: promoted block {d} is not leased"
            self.dev[d] = list(self.host[slot])
        # C runs beside the compute: its device blocks must be nobody's in this step.
        touched = {b for w in (*plan.prefills, *plan.decodes) for b in w.blocks}
        touched.update(c.dst for c in plan.copies)
        touched.update(d for _, d in (*plan.swap_in, *plan.promote))
        for src, dst in plan.tier_moves:
            assert src in self.host, f"step {plan.step}: tier slot {src} moved but never written"
            self.host[dst] = list(self.host[src])
        for b, slot in plan.writeback:
            assert b not in touched and pool.ref[b] == 0 and b in pool.retained, \
                f"step {plan.step}: block {b} written back while the step uses it"
            self.host[slot] = list(self.block(b))
        self.moved += len(plan.tier_moves)
        self.demoted += len(plan.demote) + len(plan.writeback)
        self.promoted += len(plan.promote)
        return super().run(plan)


def offload(pool: int = 8, host: int = 8, disk: int = 0, **cfg: object) -> tuple[Scheduler, TierEngine]:
    """Offloading scheduler; no write-back unless asked (the exact counts below are of urgent demotions)."""
    cfg.setdefault("writeback_blocks", 0)
    tiers = TierLedger([(n, b) for n, b in (("host", host), ("disk", disk)) if b])
    s = Scheduler(KVLedger(pool, BS), SchedulerConfig(offload_prefixes=True, **cfg), host=tiers)  # type: ignore[arg-type]
    return s, TierEngine(s)


def run_one(s: Scheduler, engine: TierEngine, request: GenRequest) -> list[StepPlan]:
    s.add(request)
    plans = engine.drain()
    s.forget(request.request_id)
    return plans


def test_a_demoted_prefix_comes_back_by_promotion_with_its_exact_kv() -> None:
    s, engine = offload()
    run_one(s, engine, GenRequest("A", toks(16, 0), 2))  # 4 full prompt blocks cached on the device
    run_one(s, engine, GenRequest("B", toks(24, 500), 2))  # 7 blocks: evicts 3 of A's, demoted to the host
    assert engine.demoted == 3 and len(s.host.index) == 3
    plans = run_one(s, engine, GenRequest("C", toks(16, 0) + toks(3, 900), 2))
    admit = next(p for p in plans if "C" in p.admitted)
    assert len(admit.promote) == 3 and admit.admissions[0].cached_tokens == 16  # 1 device hit + 3 promoted
    assert s.ledger.counters.promoted_blocks == 3 and s.promoted_tokens == 12
    # C computes only its 3 new prompt tokens: the 16 cached ones were read as context (checked by the engine).
    assert sum(w.end - w.start for p in plans for w in p.prefills) == 3
    stats = s.tier_stats()
    assert stats["flow"]["promoted"] == 3 and stats["offload_prefixes"]
    s.check()


@pytest.mark.parametrize("disk", [0, 16])
def test_write_back_copies_retained_blocks_ahead_of_eviction_so_evicting_them_copies_nothing(disk: int) -> None:
    s, engine = offload(host=4, disk=disk, writeback_blocks=4)
    plans = run_one(s, engine, GenRequest("A", toks(16, 0), 2))
    plans += run_one(s, engine, GenRequest("B", toks(24, 500), 2))
    written = sum(len(p.writeback) for p in plans)
    urgent = sum(len(p.demote) for p in plans)
    assert written > 0  # copied while still on the device, beside a step's compute (TierEngine checks it)
    assert urgent < 3  # A's evicted blocks were mostly below already: nothing to copy at eviction
    plans = run_one(s, engine, GenRequest("C", toks(16, 0) + toks(3, 900), 2))
    admit = next(p for p in plans if "C" in p.admitted)
    assert admit.admissions[0].cached_tokens == 16  # device hits and promotions, with the exact KV
    s.check()


def test_without_offload_the_same_prompt_recomputes_what_was_evicted() -> None:
    s = Scheduler(KVLedger(8, BS), SchedulerConfig(), host=HostPool(8))
    engine = TierEngine(s)
    run_one(s, engine, GenRequest("A", toks(16, 0), 2))
    run_one(s, engine, GenRequest("B", toks(24, 500), 2))
    plans = run_one(s, engine, GenRequest("C", toks(16, 0) + toks(3, 900), 2))
    admit = next(p for p in plans if "C" in p.admitted)
    assert admit.promote == [] and admit.admissions[0].cached_tokens == 4  # only A's first block was left
    assert engine.demoted == 0 and s.host.index == {}


def test_spill_keeps_free_fast_slots_and_its_drained_slots_wait_for_the_step() -> None:
    tiers = TierLedger([("host", 3), ("disk", 3)])
    for i in range(3):
        tiers.demote(i, bytes([i + 1]), "g")
    tiers.complete()
    tiers.take_ops()
    assert tiers.free_in(0) == 0
    assert tiers.spill(0, 2) == 2
    assert [(op.kind, op.src) for op in tiers.take_ops()] == [("move", 0), ("move", 1)]  # coldest first
    assert tiers.free_in(0) == 0  # the moved-out slots are read this step: not reusable yet
    # So an urgent demotion takes the disk's last free slot rather than drop the host's last entry.
    slot = tiers.demote(9, b"x", "g")
    assert tiers.tier_name(slot) == "disk" and tiers.flow["dropped"] == 0 and tiers.free_in(1) == 0
    tiers.complete()
    assert tiers.free_in(0) == 2 and tiers.tier_name(tiers.index[bytes([1])]) == "disk"
    assert tiers.tier_name(tiers.index[bytes([3])]) == "host" and tiers.tier_name(tiers.index[b"x"]) == "disk"
    tiers.check()


def test_a_tier_never_promotes_another_tenants_prefix() -> None:
    s, engine = offload()
    a, b = CacheContext(trust_group="a"), CacheContext(trust_group="b")
    run_one(s, engine, GenRequest("A", toks(16, 0), 2, a))
    run_one(s, engine, GenRequest("B", toks(24, 500), 2, a))
    assert len(s.host.index) == 3
    plans = run_one(s, engine, GenRequest("X", toks(16, 0) + toks(3, 900), 2, b))
    admit = next(p for p in plans if "X" in p.admitted)
    assert admit.promote == [] and admit.admissions[0].cached_tokens == 0
    plans = run_one(s, engine, GenRequest("Y", toks(16, 0) + toks(3, 900), 2, a))
    admit = next(p for p in plans if "Y" in p.admitted)
    assert admit.admissions[0].cached_tokens > 0  # the owner still finds its prefix (device or tier)
    s.check()


def test_write_backs_cascade_to_disk_and_come_back_from_there() -> None:
    s, engine = offload(pool=8, host=2, disk=16, writeback_blocks=8)
    run_one(s, engine, GenRequest("A", toks(16, 0), 2))
    run_one(s, engine, GenRequest("B", toks(24, 500), 2))  # A's blocks go down: the host holds 2, moves on
    run_one(s, engine, GenRequest("D", toks(24, 700), 2))  # B's blocks go down too: more moves to disk
    assert engine.moved >= 1
    tiers = s.host
    # The host keeps writeback_blocks (8 > its 2 slots) free: every entry has been spilled to disk.
    assert {tiers.tier_name(slot) for slot in tiers.index.values()} == {"disk"}
    assert tiers.free_in(0) == 2
    plans = run_one(s, engine, GenRequest("C", toks(16, 0) + toks(3, 900), 2))
    admit = next(p for p in plans if "C" in p.admitted)
    assert admit.admissions[0].cached_tokens >= 12
    assert any(tiers.tier_name(slot) == "disk" for slot, _ in admit.promote)
    s.check()


def test_swapped_requests_use_any_tier_and_come_back_bit_for_bit() -> None:
    """Swap a victim into a disk-only tier ledger: the fake KV it reads after the restore is checked."""
    tiers = TierLedger([("host", 1), ("disk", 8)])
    s = Scheduler(KVLedger(6, BS), SchedulerConfig(policy="incremental", victim="latest", recovery="swap",
                                                   watermark=0.0), host=tiers)
    engine = TierEngine(s)
    s.add(GenRequest("G", toks(4, 100), 12))
    s.add(GenRequest("V", toks(6, 200), 9))
    plans = engine.drain()
    (out,) = [p for p in plans if p.swap_out]
    assert {tiers.tier_name(h) for _, h in out.swap_out} == {"host", "disk"}
    v = s.branches("V")[0]
    assert (v.finish_reason, v.output) == ("length", expected_output("V", 6, 9))
    assert_drained(s)


@pytest.mark.parametrize("restore_ahead", [False, True])
def test_restore_ahead_computes_a_restored_request_from_the_next_step(restore_ahead: bool) -> None:
    """V is swapped out half-way through its prefill (the scenario of test_scheduler's unfinished-prefill
    test), so on restore it has prompt left to compute. Without restore_ahead it computes in the restore step
    itself -- the step reads the blocks coming back, so the transfer cannot hide; with it, from the next."""
    s = Scheduler(KVLedger(6, BS), SchedulerConfig(policy="incremental", victim="latest", recovery="swap",
                                                   watermark=0.0, prefill_chunk=4, token_budget=5,
                                                   restore_ahead=restore_ahead), host=HostPool(8))
    engine = TierEngine(s)
    s.add(GenRequest("G", toks(4, 100), 8))
    engine.step()
    engine.step()
    s.add(GenRequest("V", toks(15, 200), 3))
    plans = engine.drain()
    (restore,) = [p for p in plans if p.swap_in]
    computes = {w.request_id for w in (*restore.prefills, *restore.decodes)}
    assert ("V" in computes) is not restore_ahead
    assert reads_inbound(restore, BS) is not restore_ahead
    after = plans[plans.index(restore) + 1]
    assert restore_ahead is ("V" in {w.request_id for w in after.prefills})
    assert [b.output for b in s.branches("V")] == [expected_output("V", 15, 3)]  # same tokens either way
    assert_drained(s)


def test_restore_ahead_delays_a_promoted_request_by_one_step_only() -> None:
    s, engine = offload(restore_ahead=True)
    run_one(s, engine, GenRequest("A", toks(16, 0), 2))
    run_one(s, engine, GenRequest("B", toks(24, 500), 2))
    plans = run_one(s, engine, GenRequest("C", toks(16, 0) + toks(3, 900), 2))
    admit = next(p for p in plans if "C" in p.admitted)
    assert admit.promote and not admit.prefills and not admit.decodes
    nxt = plans[plans.index(admit) + 1]
    assert [w.request_id for w in nxt.prefills] == ["C"] and nxt.prefills[0].start == 16


def test_offload_needs_tiers_and_prefix_caching() -> None:
    with pytest.raises(ConfigError, match="needs tiers below"):
        Scheduler(KVLedger(8, BS), SchedulerConfig(offload_prefixes=True))
    with pytest.raises(ConfigError, match="needs prefix caching"):
        Scheduler(KVLedger(8, BS, prefix_caching=False), SchedulerConfig(offload_prefixes=True), host=HostPool(4))
    with pytest.raises(ConfigError, match="offload_prefixes must be True or False"):
        SchedulerConfig(offload_prefixes="yes")  # type: ignore[arg-type]


def test_a_failed_promotion_never_serves_its_blocks() -> None:
    s, engine = offload()
    run_one(s, engine, GenRequest("A", toks(16, 0), 2))
    run_one(s, engine, GenRequest("B", toks(24, 500), 2))
    s.add(GenRequest("C", toks(16, 0) + toks(3, 900), 2))
    plan = s.schedule()
    assert plan.promote
    promoted = [d for _, d in plan.promote]
    s.transfers_failed(plan)  # what the runtime executor calls when the copy raised
    s.cancel("C", "error: transfer failed")
    s.confirm(plan, {})
    assert all(s.ledger.pool.digest[b] is None for b in promoted)
    s.check()
    # The next request with that prompt recomputes instead of reading the failed blocks.
    plans = run_one(s, engine, GenRequest("E", toks(16, 0) + toks(3, 900), 2))
    admit = next(p for p in plans if "E" in p.admitted)
    assert admit.promote == [] and admit.admissions[0].cached_tokens == 4
    s.check()


def test_a_prefix_cache_reset_empties_the_tiers_too() -> None:
    s, engine = offload()
    run_one(s, engine, GenRequest("A", toks(16, 0), 2))
    run_one(s, engine, GenRequest("B", toks(24, 500), 2))
    assert s.host.index
    assert s.reset_prefix_cache()
    assert s.host.index == {} and s.host.flow["cleared"] == 3
    s.check()


class FailingTransfers(ConstantExecutor):
    """Raises whenever a plan (or a part of one) carries tier transfers: the driver isolates the step."""

    def __init__(self) -> None:
        super().__init__()
        self.parts: list[StepPlan] = []

    def execute(self, plan: StepPlan) -> StepOutput:
        self.parts.append(plan)
        if plan.tier_transfers:
            raise OSError("disk gone")
        return super().execute(plan)


def test_the_driver_runs_the_prefix_caches_transfers_as_the_unowned_part_of_a_failing_step() -> None:
    s, engine = offload()
    run_one(s, engine, GenRequest("A", toks(16, 0), 2))
    run_one(s, engine, GenRequest("B", toks(24, 500), 2))
    ex = FailingTransfers()
    driver = Driver(s, ex, check_every=1)
    driver.submit(GenRequest("C", toks(16, 0) + toks(3, 900), 2))
    result = driver.step()
    assert result.failed == []  # the orphan part failed: its cache entries are lost, nobody's request
    orphan = ex.parts[1]
    assert orphan.promote and not orphan.prefills and not orphan.decodes
    assert "C" not in s.running and s.waiting[0][0].request.request_id == "C"  # to recompute its prefix
    assert s.tier_stats()["promotion_failures"] == len(orphan.promote)
    s.check()


def test_check_catches_a_lease_of_a_promotion_that_outlived_its_step() -> None:
    s, engine = offload()
    run_one(s, engine, GenRequest("A", toks(16, 0), 2))
    run_one(s, engine, GenRequest("B", toks(24, 500), 2))
    s.add(GenRequest("C", toks(16, 0) + toks(3, 900), 2))
    plan = s.schedule()
    engine.run(plan)
    leases = list(s._swap_leases)
    s._swap_leases.clear()  # forget to end the promotion's lease at confirm
    s.confirm(plan, {w.seq_id: [7] for w in plan.prefills if w.sample})
    with pytest.raises(InvariantError, match="outlived its step"):
        s.check()
    for lease in leases:
        s.ledger.end_lease(lease)
