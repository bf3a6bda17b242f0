"""Tests written because a mutant drawn by ``tests/mutation.py sample`` (a seeded uniform sample of every
mutant of ``core/`` and ``scheduler/``, docs/testing.md) survived the suite. Each pins down something a
caller can see -- a count, where a block goes, a default, an error and its message -- that no other
test checked."""

from __future__ import annotations

import pytest

from kvledger.core.identity import CacheContext
from kvledger.core.ledger import KVLedger, Request
from kvledger.core.quota import GroupUsage, check_group_ledgers
from kvledger.core.tiers import TierLedger, TierSpec
from kvledger.errors import ConfigError, InvariantError

BS = 4


def toks(base: int, n: int) -> list[int]:
    return [base + i for i in range(n)]


def run_once(led: KVLedger, rid: str, prompt: list[int], group: str = "default") -> None:
    assert led.admit(Request(rid, prompt, 1, CacheContext(trust_group=group))).admitted
    led.mark_computed(rid, len(prompt))
    led.release(rid)


# ---- the ledger's entry points -------------------------------------------------------------------------

def test_decode_step_takes_any_iterable_of_pairs() -> None:
    """``decode_step`` documents ``Iterable[tuple[str, int]]``: a tuple or a generator of pairs appends
    exactly as a list does."""
    led = KVLedger(8, BS)
    for rid in "ab":
        led.admit(Request(rid, toks(10, 3), 4)).raise_for_outcome()
        led.mark_computed(rid, 3)
    led.decode_step((("a", 1), ("b", 2)))
    led.decode_step((rid, 5) for rid in "ab")
    assert led.sequence("a").tokens[-2:] == [1, 5] and led.sequence("b").tokens[-2:] == [2, 5]
    led.check()


def test_a_bad_block_size_names_the_block_size() -> None:
    with pytest.raises(ConfigError, match="block size"):
        KVLedger(8, "four")  # type: ignore[arg-type]


def test_beam_step_refuses_what_is_not_pairs_with_its_message() -> None:
    led = KVLedger(8, BS)
    with pytest.raises(ConfigError, match=r"^beam_step takes \(parent, child\) pairs and a list of dropped ids$"):
        led.beam_step([("a",)], [])  # type: ignore[list-item]


def test_lease_names_the_argument_that_is_not_a_collection() -> None:
    led = KVLedger(8, BS)
    with pytest.raises(ConfigError, match="lease request_ids must be a collection"):
        led.lease(request_ids="a")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="lease blocks must be a collection"):
        led.lease(blocks=3)  # type: ignore[arg-type]


def test_tenant_stats_says_what_it_needs() -> None:
    with pytest.raises(ConfigError, match=r"tenant_stats needs a trust group name \(str\), got None"):
        KVLedger(8, BS).tenant_stats(None)  # type: ignore[arg-type]


def test_a_write_only_request_promotes_nothing_from_the_tiers() -> None:
    """A request that writes the prefix cache but does not read it (vLLM's prompt-logprobs case) must
    not pull its prefix back from the host tier: it would not use it."""
    tiers = TierLedger([("host", 8)])
    led = KVLedger(5, BS)
    led.attach_tiers(tiers)
    run_once(led, "a", toks(0, 16))
    run_once(led, "b", toks(100, 16))  # evicts three of a's blocks down to the host tier
    tiers.complete()
    assert len(tiers.index) == 3
    write_only = Request("c", toks(0, 16) + [7], 1, read_prefix_cache=False)
    assert led.promote_from_tiers(write_only, owner="x") == ([], None)
    assert tiers.flow["promoted"] == 0
    pairs, lease = led.promote_from_tiers(Request("d", toks(0, 16) + [7], 1), owner="x")
    assert len(pairs) == 3  # the same prompt read normally does come back
    led.end_lease(lease)
    led.check()


def test_promote_from_tiers_names_keep_free() -> None:
    led = KVLedger(5, BS)
    with pytest.raises(ConfigError, match="keep_free"):
        led.promote_from_tiers(Request("c", toks(0, 8), 1), owner="x", keep_free=-1)


# ---- trust-group ledgers -------------------------------------------------------------------------------

def test_a_group_holding_only_promises_is_lawful() -> None:
    """A group can hold promises and no active block (its request's blocks are another group's shared
    ones, or all still promised): the conservation check accepts it, and refuses a negative entry."""
    check_group_ledgers({"a": GroupUsage(0, 2, 0), "b": GroupUsage(3, 0, 0)}, referenced=3, promised=2)
    with pytest.raises(InvariantError, match="negative ledger entry"):
        check_group_ledgers({"a": GroupUsage(3, 2, -1)}, referenced=3, promised=2)


def test_group_reports_show_caps_and_zero_for_groups_holding_nothing_now() -> None:
    led = KVLedger(16, BS)
    led.set_quota("t", 10)
    led.admit(Request("r", toks(0, 8), 4, CacheContext(trust_group="t"))).raise_for_outcome()
    assert led.group_usage()["t"].cap == 10
    run_once(led, "s", toks(50, 8), group="u")  # u holds nothing now, but has prefix-cache counters
    stats = led.group_stats()
    assert stats["u"]["active"] == 0 and stats["u"]["promised"] == 0 and stats["u"]["query_tokens"] == 8
    assert stats["t"]["cap"] == 10
    led.check()


# ---- tiers ---------------------------------------------------------------------------------------------

def test_spill_moves_to_the_next_tier_with_room_not_the_last() -> None:
    tiers = TierLedger([("host", 1), ("disk", 1), ("cold", 1)])
    slot = tiers.demote(0, b"d" * 32, "g")
    assert slot is not None and tiers.tier_name(slot) == "host"
    tiers.complete()
    assert tiers.spill(0, 1) == 1
    moves = [op for op in tiers.take_ops() if op.kind == "move"]
    assert [tiers.tier_name(op.dst) for op in moves] == ["disk"]
    tiers.complete()
    assert tiers.free_in(0) == 1 and tiers.free_in(1) == 0 and tiers.free_in(2) == 1
    tiers.check()


def test_a_tier_spec_with_bad_slots_quotes_them() -> None:
    with pytest.raises(ConfigError, match=r"slots must be an integer in .*, got -3"):
        TierSpec("host", -3)



# ---- the scheduler and the step loop -------------------------------------------------------------------

def _helpers():
    """The fake KV memory of tests/scheduler/test_scheduler.py and the scripted executors of
    tests/scheduler/test_driver.py (tests run with --import-mode=importlib)."""
    import importlib.util
    import sys
    from pathlib import Path
    out = []
    for stem in ("test_scheduler", "test_driver"):
        name = f"kvledger_sample_kills_{stem}"
        if name not in sys.modules:
            spec = importlib.util.spec_from_file_location(name, Path(__file__).with_name(f"{stem}.py"))
            module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
            sys.modules[name] = module
            spec.loader.exec_module(module)  # type: ignore[union-attr]
        out.append(sys.modules[name])
    return out


_sched_h, _driver_h = _helpers()


def test_a_prefill_of_a_request_cancelled_mid_step_does_not_stop_the_others_being_confirmed() -> None:
    from kvledger.scheduler import GenRequest, Scheduler, SchedulerConfig
    s = Scheduler(KVLedger(16, BS), SchedulerConfig(policy="full", prefill_chunk=4, token_budget=16))
    for rid, base in (("a", 100), ("b", 200)):
        s.add(GenRequest(rid, toks(base, 8), 2))
    engine = _sched_h.FakeEngine(s)
    plan = s.schedule()
    assert [w.seq_id for w in plan.prefills] == ["a", "b"]
    sampled = engine.run(plan)
    assert s.cancel("a")  # between the executor and confirm, as the driver applies cancels
    s.confirm(plan, sampled)
    assert s.branches("b")[0].computed == 4
    s.check()


def test_a_reset_refused_for_pins_and_leases_names_both() -> None:
    from kvledger.scheduler import GenRequest, Scheduler, SchedulerConfig
    led = KVLedger(32, BS)
    s = Scheduler(led, SchedulerConfig(policy="full"))
    engine = _sched_h.FakeEngine(s)
    s.add(GenRequest("warm", toks(100, 8), 2))
    engine.drain()
    led.pin("keep", toks(100, 8), CacheContext())
    s.add(GenRequest("x", toks(0, 5), 6))
    engine.step()
    lease = led.lease(blocks=[led.sequence("x").table.blocks[0]], owner="transfer")
    refused = s.reset_prefix_cache(requeue_running=True)
    assert refused.reason == "blocks are still held: 1 pins, 1 outstanding leases"
    led.end_lease(lease)


def test_a_swap_that_falls_back_to_recompute_keeps_why_it_preempted() -> None:
    s, engine = _sched_h.victim_scenario("latest", recovery="swap", host=None)
    plans = [engine.step() for _ in range(5)]
    assert [(p.request_id, p.reason) for p in plans[4].preempted] == [
        ("D", "B needed a block; host pool cannot hold the blocks, recomputing instead"),
        ("C", "C needed a block; host pool cannot hold the blocks, recomputing instead")]


def test_write_back_spills_the_fast_tier_when_it_is_one_slot_short() -> None:
    """``writeback_blocks=1`` keeps one host slot free: a host tier of one slot holding one entry is one
    short, so the step spills that entry to the disk tier."""
    from kvledger.scheduler import GenRequest, Scheduler, SchedulerConfig
    tiers = TierLedger([("host", 1), ("disk", 4)])
    s = Scheduler(KVLedger(8, BS), SchedulerConfig(offload_prefixes=True, writeback_blocks=1), host=tiers)
    tiers.demote(0, b"e" * 32, "default")
    tiers.complete()
    tiers.take_ops()
    s.add(GenRequest("a", toks(0, 3), 1))
    plan = s.schedule()
    assert [tiers.tier_name(dst) for _, dst in plan.tier_moves] == ["disk"]
    s.confirm(plan, _sched_h.FakeEngine(s).run(plan))
    assert tiers.tier_name(tiers.index[b"e" * 32]) == "disk"


def test_a_driver_keeps_no_records_unless_asked() -> None:
    from kvledger.scheduler import Driver, GenRequest, Scheduler, SchedulerConfig
    driver = Driver(Scheduler(KVLedger(16, BS), SchedulerConfig()), _driver_h.Scripted())
    driver.submit(GenRequest("a", toks(0, 4), 2))
    finished = []
    while driver.has_work():
        finished += driver.step().finished
    assert [f.request.request_id for f in finished] == ["a"] and driver.records == []


def test_a_finished_id_used_again_can_be_cancelled_before_it_arrives() -> None:
    from kvledger.scheduler import GenRequest
    driver = _driver_h.make()
    driver.submit(GenRequest("a", toks(0, 4), 2))
    while driver.has_work():
        driver.step()
    driver.submit(GenRequest("a", toks(50, 4), 2, arrival_s=100.0))
    assert driver.cancel("a")
    finished = driver.step().finished
    assert [(f.request.request_id, f.metrics.finish_reason) for f in finished] == [("a", "cancelled")]
    assert not driver.has_work()


def test_a_step_run_again_request_by_request_takes_the_time_of_every_part() -> None:
    """The whole step raised once; run again one request at a time, it took three parts of 0.01 s."""
    driver = _driver_h.make(executor=_driver_h.Faulty(None, once=True))
    for r in _driver_h._mixed():
        driver.submit(r)
    result = driver.step()
    assert len({w.request_id for w in (*result.plan.prefills, *result.plan.decodes)}) == 3
    assert result.end_s - result.start_s == pytest.approx(0.03)


# ---- the planner's catalogues --------------------------------------------------------------------------

def test_the_gpu_catalogue_rows_parse_to_the_catalogue_and_bad_figures_are_refused() -> None:
    import json
    from importlib import resources

    from kvledger.core import gpus
    rows = json.loads(resources.files("kvledger").joinpath("data", "gpus.json").read_text(encoding="utf-8"))["gpus"]
    parsed = {row["name"]: gpus._gpu(row) for row in rows}
    assert parsed == gpus.GPUS
    h100 = next(r for r in rows if r["name"] == "h100-80gb")
    assert parsed[h100["name"]].datasheet_memory == str(h100["datasheet_memory"])
    for bad in (0, -1.5, True, "80"):
        with pytest.raises(ConfigError, match=f"host_link_Bps must be a positive number, got {bad!r}"):
            gpus._gpu(dict(h100, host_link_Bps=bad))
    with pytest.raises(ConfigError, match="lacks 'source'"):
        gpus._gpu({k: v for k, v in h100.items() if k != "source"})


def test_the_capacity_matrix_says_why_a_row_does_not_fit() -> None:
    """A request longer than the pool gets the pool's size and the request's need; a TP degree the
    model cannot be split by gets the first clause of the reason."""
    from kvledger.core.capacity import capacity_matrix
    from kvledger.core.models import load_model_config
    rows = capacity_matrix(load_model_config("llama-3.1-8b"), prompt=2_000_000, max_new=1, concurrency=4,
                           model_name="llama-3.1-8b", gpus=["l4"], tps=(1, 3))
    long, odd = rows
    assert (long.fits, long.pool_blocks, long.blocks_per_request) == (False, 1799, 125_001)
    assert long.note == "one request needs 125,001 of 1,799 blocks"
    assert (odd.fits, odd.pool_blocks, odd.note) == (
        False, 0, "tp=3 must divide the 8 KV heads or be a multiple of them")


def test_prices_that_are_not_numbers_are_named() -> None:
    from kvledger.core.capacity import parse_prices
    with pytest.raises(ConfigError, match=r"--prices: 'cheap' is not a number"):
        parse_prices("l4=cheap")


def test_the_largest_supported_pool_is_accepted_and_one_more_block_is_refused() -> None:
    """The refusal quotes the supported maximum (2**24 blocks); a pool of exactly that many blocks is a
    pool the ledger promises to manage (about 1.3 GB of bookkeeping, a second or two), one more is not.
    (Seed 2 of the sample: the bound as ``>=`` refused the documented maximum.)"""
    from kvledger.core.ledger import MAX_POOL_BLOCKS

    assert MAX_POOL_BLOCKS == 2**24
    with pytest.raises(ConfigError, match="beyond the supported 16,777,216"):
        KVLedger(MAX_POOL_BLOCKS + 1, BS)
    led = KVLedger(MAX_POOL_BLOCKS, BS)
    assert led.stats()["usage"]["total"] == MAX_POOL_BLOCKS
    del led


def test_a_request_whose_context_is_not_a_cache_context_quotes_what_it_got() -> None:
    """A trust group passed where the context goes (a common slip) is refused with the value shown, so
    the caller sees what went wrong. (Seed 3 of the sample: the message quoted None instead.)"""
    with pytest.raises(ConfigError, match=r"^request 'a': context must be a CacheContext, got 'tenant-a'$"):
        Request("a", [1, 2, 3], 1, "tenant-a")  # type: ignore[arg-type]
