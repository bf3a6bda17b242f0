"""Overlap is possible, never guaranteed: the cost model hides a transfer only where the step does not need
its data, and only behind as much compute as the step has (scheduler/transfers.py)."""

from __future__ import annotations

import pytest

from kvledger.core.tiers import TierLedger
from kvledger.scheduler import GenRequest, StepPlan, TransferModel, Work
from kvledger.scheduler.transfers import reads_inbound, split, step_transfer_timing
from kvledger.sim.cost_model import DeviceProfile
from kvledger.sim.simulator import CostModelExecutor, SimConfig, Simulator
from kvledger.workloads import Poisson, Uniform, synthetic

MIB2 = 2 * 2**20
# The case: 100 blocks of 2 MiB over a 25 GB/s link, 64-block staging, 20 us per round.
LINK = TransferModel(link_Bps=25e9, overhead_s=20e-6, staging_blocks=64, overlap=True)
FULL_S = 100 * MIB2 / 25e9 + 2 * 20e-6  # 8.4286 ms


def test_a_100_block_transfer_the_step_needs_costs_all_of_it_even_with_overlap_on() -> None:
    assert LINK.time_s(100, MIB2) == pytest.approx(FULL_S)
    assert FULL_S == pytest.approx(8.4286e-3, rel=1e-4)
    # It used to be 2 x 20 us = 0.04 ms: overlap taken for a guarantee.
    assert LINK.blocking_time_s(100, MIB2, needed=True) == pytest.approx(FULL_S)
    assert LINK.blocking_time_s(100, MIB2) == pytest.approx(FULL_S)  # needed is the default


def test_an_overlapped_transfer_hides_only_behind_the_concurrent_compute() -> None:
    assert LINK.blocking_time_s(100, MIB2, needed=False, concurrent_s=3e-3) == pytest.approx(FULL_S - 3e-3)
    assert LINK.blocking_time_s(100, MIB2, needed=False, concurrent_s=0.0) == pytest.approx(FULL_S)
    assert LINK.blocking_time_s(100, MIB2, needed=False, concurrent_s=20e-3) == 0.0
    serial = TransferModel(link_Bps=25e9, overhead_s=20e-6, overlap=False)
    assert serial.blocking_time_s(100, MIB2, needed=False, concurrent_s=20e-3) == pytest.approx(FULL_S)


def test_directions_have_their_own_link() -> None:
    disk = TransferModel(link_Bps=1e9, overhead_s=1e-3, in_link_Bps=4e9, in_overhead_s=2e-3, staging_blocks=8)
    assert disk.time_s(16, 10**6, "out") == pytest.approx(16e6 / 1e9 + 2 * 1e-3)
    assert disk.time_s(16, 10**6, "in") == pytest.approx(16e6 / 4e9 + 2 * 2e-3)
    for bad in (dict(link_Bps=0), dict(overhead_s=-1), dict(staging_blocks=0), dict(in_link_Bps=float("nan"))):
        with pytest.raises(ValueError):
            TransferModel(**bad)  # type: ignore[arg-type]


def test_split_is_exposed_plus_hidden() -> None:
    t = split(needed_s=2.0, overlapped_s=5.0, compute_s=3.0)
    assert (t.hidden_s, t.exposed_s, t.total_s) == (3.0, 4.0, 7.0)
    t = split(needed_s=0.0, overlapped_s=1.0, compute_s=3.0)
    assert (t.hidden_s, t.exposed_s) == (1.0, 0.0)


def _decode(blocks: list[int], end: int) -> Work:
    return Work("r", end - 1, end, True, 0, GenRequest("r", [1], 4), 0, blocks, list(range(end)))


def links(slot: int) -> TransferModel:
    return LINK


def test_step_timing_follows_the_data_dependencies() -> None:
    compute = 5e-3
    # Swap-outs: the step does not read them (their device blocks stay leased): they hide.
    out = StepPlan(0, swap_out=[(d, d) for d in range(100)])
    t = step_transfer_timing(out, compute, links, MIB2, 16)
    assert t.hidden_s == pytest.approx(compute) and t.exposed_s == pytest.approx(FULL_S - compute)
    # A swap-in the step reads: all of it is waited for, however much compute there is.
    inbound = StepPlan(0, swap_in=[(h, 100 + h) for h in range(100)], decodes=[_decode([100, 101], 20)])
    assert reads_inbound(inbound, 16)
    t = step_transfer_timing(inbound, 1.0, links, MIB2, 16)
    assert (t.hidden_s, t.exposed_s) == (0.0, pytest.approx(FULL_S))
    # The same swap-in restored ahead (nobody reads it this step): it hides behind the compute.
    ahead = StepPlan(0, swap_in=[(h, 100 + h) for h in range(100)], decodes=[_decode([7], 10)])
    assert not reads_inbound(ahead, 16)
    t = step_transfer_timing(ahead, 1.0, links, MIB2, 16)
    assert (t.hidden_s, t.exposed_s) == (pytest.approx(FULL_S), 0.0)
    # Demotions: the evicted blocks are reused this step, so they are read out before anything runs.
    demote = StepPlan(0, demote=[(d, d) for d in range(100)], decodes=[_decode([7], 10)])
    t = step_transfer_timing(demote, 1.0, links, MIB2, 16)
    assert t.needed_s == pytest.approx(FULL_S) and t.exposed_s == pytest.approx(FULL_S)
    # An executor that does not overlap exposes everything.
    t = step_transfer_timing(out, compute, links, MIB2, 16, overlap=False)
    assert t.exposed_s == pytest.approx(FULL_S) and t.hidden_s == 0.0


def test_each_tier_batch_pays_its_own_rounds() -> None:
    host = TransferModel(link_Bps=1e9, overhead_s=1e-3, staging_blocks=4)
    disk = TransferModel(link_Bps=1e8, overhead_s=5e-3, staging_blocks=4)
    tiers = TierLedger([("host", 8), ("disk", 8)])
    links = lambda slot: (host, disk)[tiers.tier_of(slot)]  # noqa: E731
    plan = StepPlan(0, swap_out=[(0, 0), (1, 1), (2, 8), (3, 9), (4, 10), (5, 11), (6, 12)])
    t = step_transfer_timing(plan, 0.0, links, 10**6, 16)
    assert t.exposed_s == pytest.approx((2e6 / 1e9 + 1e-3) + (5e6 / 1e8 + 2 * 5e-3))


def test_the_simulator_charges_exposed_transfer_time_and_reports_the_hidden_part() -> None:
    base = dict(model="smollm2-135m", gpu="cpu-local", kv_dtype="fp32", weight_dtype="fp32", pool_blocks=40,
                block_size=16, policy="incremental", recovery="swap", max_running=8, token_budget=256,
                prefill_chunk=128, check_every=1)
    profile = DeviceProfile("p", 50e9, 10e9, 1.0, 1.0, 1e-3, 1e9, 1e-4, "test",
                            links={"host": {"out_Bps": 2e9, "out_overhead_s": 1e-4, "in_Bps": 3e9,
                                            "in_overhead_s": 1e-4}})
    reqs = synthetic(40, arrivals=Poisson(50.0), prompt_len=Uniform(32, 96), output_len=Uniform(16, 48),
                     system_prompts=2, system_prompt_len=32, shared_fraction=0.5, seed=3, token_base=100)
    res = Simulator(SimConfig(profile=profile, host_pool_bytes=40 * 16 * 46080, **base)).run(reqs)
    tr = res.counters["transfers"]
    assert res.preemptions["swap"] > 0 and tr["steps_with_transfers"] > 0
    assert tr["hidden_s"] + tr["exposed_s"] == pytest.approx(tr["transfer_s"])
    assert tr["hidden_s"] > 0  # swap-outs ran beside compute
    steps = sum(res.timeline.dt_s)
    assert steps >= tr["exposed_s"]


def test_offloaded_prefixes_raise_the_hit_rate_in_the_simulator() -> None:
    """A pool too small for the shared system prompts: without a tier their blocks are evicted and
    recomputed; with one they come back by promotion."""
    base = dict(model="smollm2-135m", gpu="h100-80gb", pool_blocks=48, block_size=16, max_running=4,
                token_budget=512, check_every=1)
    reqs = synthetic(60, arrivals=Poisson(4.0), prompt_len=Uniform(160, 200), output_len=Uniform(4, 8),
                     system_prompts=6, system_prompt_len=128, shared_fraction=1.0, seed=1, token_base=100)
    block_bytes = 16 * 30 * 3 * 64 * 2 * 2  # SmolLM2-135M, bf16: 30 layers x 3 KV heads x 64 x (K, V)
    off = Simulator(SimConfig(**base)).run(reqs).summary()
    on_res = Simulator(SimConfig(host_pool_bytes=256 * block_bytes, offload_prefixes=True, **base)).run(reqs)
    on = on_res.summary()
    assert on["prefix_hit_rate"] > off["prefix_hit_rate"] + 0.1
    tiers = on_res.counters["tiers"]
    assert tiers["flow"]["promoted"] > 0 and tiers["promoted_tokens"] > 0
    assert on_res.counters["transfers"]["transfer_s"] > 0


def test_cost_model_executor_without_tiers_keeps_the_plans_wait() -> None:
    ex = CostModelExecutor(lambda p, d: 1e-3)
    plan = StepPlan(0, swap_out=[(0, 0)], transfer_wait_s=2e-3, decodes=[_decode([0], 4)])
    out = ex.execute(plan)
    assert out.elapsed_s == pytest.approx(3e-3) and out.transfer_exposed_s == pytest.approx(2e-3)
