"""The simulator's clock: a step takes its compute plus its *exposed* transfer time, never the hidden part.

scheduler/transfers.py is the rule: a transfer the step reads is waited for in full (needed); any other
transfer runs beside the compute and only what outlasts the compute is exposed. Every expected time here is
worked out by hand from a stub device (each step's compute is its fixed 10 ms overhead) and a host link of
known speed, so a simulator that charged the whole transfer, or none of it, gives other numbers."""

from __future__ import annotations

import pytest

from kvledger.scheduler import GenRequest, StepPlan, TransferModel, Work
from kvledger.sim.cost_model import DeviceProfile
from kvledger.sim.simulator import CostModelExecutor, SimConfig, Simulator
from kvledger.workloads import SimRequest

COMPUTE = 0.010  # every step's compute on the stub device
BLOCK_BYTES = 16 * 30 * 3 * 64 * 2 * 2  # SmolLM2-135M, bf16, 16-token blocks: 30 layers x 3 KV heads x 64 x (K, V)
OUT_PER_BLOCK = 0.0125  # device -> host, seconds per block (no fixed cost per round)
IN_PER_BLOCK = 0.002  # host -> device


def stub_profile() -> DeviceProfile:
    return DeviceProfile(name="stub", peak_flops=1e30, mem_bandwidth_Bps=1e30, flops_efficiency=1.0,
                         bw_efficiency=1.0, step_overhead_s=COMPUTE, host_link_Bps=1e30, transfer_overhead_s=0.0,
                         source="test stub",
                         links={"host": {"out_Bps": BLOCK_BYTES / OUT_PER_BLOCK, "out_overhead_s": 0.0,
                                         "in_Bps": BLOCK_BYTES / IN_PER_BLOCK, "in_overhead_s": 0.0}})


def test_a_swap_out_beside_a_decode_costs_the_compute_plus_only_its_exposed_part() -> None:
    """Three requests of a 16-token prompt and 24 output tokens share a 7-block pool. Each holds 2 blocks
    after its prefill and needs a third at its 17th token: a takes the free block, b finds none and preempts
    c (the latest) by swap. That step decodes a (10 ms of compute) while c's 2 blocks go to the host
    (2 x 12.5 = 25 ms) beside it: 10 ms of the copy hides behind the compute, 15 ms is exposed, so the step
    lasts 10 + 15 = 25 ms -- not 10 + 25 = 35 ms."""
    config = SimConfig(model="smollm2-135m", gpu="stub", profile=stub_profile(), pool_blocks=7, block_size=16,
                       policy="incremental", watermark=0.0, recovery="swap", max_running=3,
                       host_pool_bytes=8 * BLOCK_BYTES, check_every=1)
    requests = [SimRequest(rid, 0.0, list(range(100 * i, 100 * i + 16)), 24) for i, rid in enumerate("abc")]
    result = Simulator(config).run(requests)
    assert result.deployment.block_bytes == BLOCK_BYTES
    assert result.preemptions == {"recompute": 0, "swap": 1}
    exposed = 2 * OUT_PER_BLOCK - COMPUTE  # 15 ms

    tl = result.timeline
    swap_step = tl.swapped.index(1)  # the step that planned c's swap-out
    assert swap_step == 17  # after the prefill step and 16 decode steps
    assert tl.t_s[swap_step] == pytest.approx(17 * COMPUTE)
    assert tl.decodes[swap_step] == 1 and tl.prefill_tokens[swap_step] == 0  # only a's decode computes
    assert tl.dt_s[swap_step] == pytest.approx(COMPUTE + exposed)  # 25 ms; charging the whole copy: 35 ms
    assert tl.t_s[swap_step + 1] == pytest.approx(17 * COMPUTE + COMPUTE + exposed)  # the clock moved 25 ms
    # Every other step is pure compute: c's restore later (1 block back, 2 ms: its prompt block stayed
    # cached on the device) runs beside b's last decode and the step nobody reads it in hides it whole.
    assert [dt for k, dt in enumerate(tl.dt_s) if k != swap_step] == pytest.approx([COMPUTE] * (result.steps - 1))

    transfers = result.counters["transfers"]
    assert transfers["transfer_s"] == pytest.approx(2 * OUT_PER_BLOCK + IN_PER_BLOCK)  # 27 ms moved
    assert transfers["exposed_s"] == pytest.approx(exposed)  # 15 ms charged
    assert transfers["hidden_s"] == pytest.approx(COMPUTE + IN_PER_BLOCK)  # 12 ms hidden

    # The request metrics read the same clock. a: its prefill and 23 decodes, one of them the 25 ms step.
    finish = {r.request_id: r.finish_s for r in result.requests}
    assert finish["a"] == pytest.approx(23 * COMPUTE + COMPUTE + exposed)  # 0.255 s
    # b waited out the swap step (its growth needed c's blocks back) and took 24 more steps of 10 ms.
    assert finish["b"] == pytest.approx(24 * COMPUTE + COMPUTE + exposed)  # 0.265 s
    # c: restored beside b's last decode, computing from the next step, its last 7 tokens 10 ms apart.
    assert finish["c"] == pytest.approx(finish["b"] + 7 * COMPUTE)  # 0.335 s
    assert result.summary()["sim_duration_s"] == pytest.approx(31 * COMPUTE + COMPUTE + exposed)
    assert sum(tl.dt_s) == pytest.approx(finish["c"])


def _decode(blocks: list[int], end: int) -> Work:
    return Work("r", end - 1, end, True, 0, GenRequest("r", [1], 4), 0, blocks, list(range(end)))


def test_a_step_waits_for_what_it_reads_and_hides_the_rest_behind_its_compute() -> None:
    """One step: a decode of 10 ms reads block 100, which a swap-in brings back (1 block in, 2 ms: needed);
    2 blocks of another request go out beside it (2 x 4 ms = 8 ms: hidden behind the compute). The step
    takes 10 + 2 = 12 ms: not 10 + 10 = 20 ms (everything charged) and not 10 ms (the read hidden too)."""
    link = TransferModel(link_Bps=BLOCK_BYTES / 0.004, overhead_s=0.0, in_link_Bps=BLOCK_BYTES / IN_PER_BLOCK,
                         in_overhead_s=0.0, staging_blocks=64, overlap=True)
    executor = CostModelExecutor(lambda prefills, decodes: COMPUTE, links=lambda slot: link,
                                 block_bytes=BLOCK_BYTES, block_size=16)
    plan = StepPlan(0, swap_in=[(5, 100)], swap_out=[(7, 6), (8, 7)], decodes=[_decode([100], 10)])
    out = executor.execute(plan)
    assert out.elapsed_s == pytest.approx(COMPUTE + IN_PER_BLOCK)  # 12 ms
    assert out.transfer_s == pytest.approx(IN_PER_BLOCK + 2 * 0.004)  # 10 ms moved
    assert out.transfer_exposed_s == pytest.approx(IN_PER_BLOCK)
    assert out.transfer_hidden_s == pytest.approx(2 * 0.004)
