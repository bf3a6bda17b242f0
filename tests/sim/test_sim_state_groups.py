"""`kvledger simulate --kv-groups` on a Granite-4.0-H-style model (10 Mamba-2 : 2 attention layers,
examples/configs/granite-4-h-small-style.json): the pool, the blocks a request holds and the cost model's bytes,
computed by hand, through the one step loop (the real scheduler over `KVLedger(kv_groups=...)` with state groups)."""

from __future__ import annotations

from pathlib import Path

from kvledger.core.groups import NULL_BLOCK
from kvledger.scheduler.scheduler import Scheduler
from kvledger.sim.simulator import SimConfig, Simulator
from kvledger.workloads.requests import Prompt, SimRequest

GRANITE = str(Path(__file__).resolve().parents[2] / "examples" / "configs" / "granite-4-h-small-style.json")
STATE_BYTES = (3 * 2304 + 32 * 64 * 128) * 2  # one Mamba-2 layer's conv + SSM state, bf16: 538,112


def _config(**kw: object) -> SimConfig:
    return SimConfig(model=GRANITE, gpu="h200-141gb", pool_blocks=400, token_budget=2048, prefill_chunk=2048,
                     max_running=64, max_model_len=8192, check_every=1, prefix_cache=False, **kw)


def test_state_groups_are_charged_one_block_a_request_through_the_driver() -> None:
    """400 uniform blocks: 16 tokens x 12 layers x 1 KiB = 196,608 B each, 78,643,200 B. The hybrid pool's block
    grows to 528 tokens (16 x ceil(538,112 / (16 x 1,024))) so an attention page (540,672 B) holds a layer's state;
    two layers a group: 1,081,344 B a block, 72 blocks. A 3,040-token request (3,000 prompt + 40 out) holds
    ceil(3,040 / 528) = 6 full-attention blocks and one block in each of the 5 state groups: 11, so 6 run at once;
    uniform it holds 190 blocks, so 2 do."""
    reqs = [SimRequest(f"r{i}", 0.0, Prompt([(10000 * i, 3000)]), 40) for i in range(12)]
    runs, sims = {}, {}
    for kv_groups in (False, True):
        sim = sims[kv_groups] = Simulator(_config(kv_groups=kv_groups))  # check_every=1: the audit every step
        runs[kv_groups] = sim.run(reqs).summary()
        assert sim.scheduler.ledger.usage().active == 0 and sim.scheduler.ledger.usage().promised == 0
    uniform, hybrid = runs[False], runs[True]
    dep = sims[True].dep
    assert (dep.block_size, dep.block_bytes, dep.pool_blocks) == (528, 1_081_344, 72)
    assert [g.kind for g in dep.kv_groups] == ["full"] + ["state"] * 5
    assert dep.kv_groups[1].layer_block_bytes == STATE_BYTES
    assert sims[True].scheduler.ledger.groups.need(3040) == 5  # the state groups' one block each
    assert (uniform["pool_blocks"], hybrid["pool_blocks"]) == (400, 72)
    assert (uniform["block_size"], hybrid["block_size"]) == (16, 528)  # what the report shows
    assert uniform["completed"] == hybrid["completed"] == 12
    assert (uniform["peak_running"], hybrid["peak_running"]) == (2, 6)
    assert hybrid["throughput_req_s"] > 2 * uniform["throughput_req_s"]


def test_every_work_carries_one_state_block_per_state_group() -> None:
    sim = Simulator(_config(kv_groups=True))
    works = []
    plan_tables = Scheduler._group_tables

    def record(self, plan):  # type: ignore[no-untyped-def]
        plan_tables(self, plan)
        works.extend((w.seq_id, w.start, w.end, w.groups) for w in plan.works)

    Scheduler._group_tables = record  # type: ignore[method-assign]
    try:
        sim.run([SimRequest(f"r{i}", 0.0, Prompt([(10000 * i, 3000)]), 40) for i in range(3)])
    finally:
        Scheduler._group_tables = plan_tables  # type: ignore[method-assign]
    states: dict[str, set] = {}
    for seq, _start, end, (full, *rest) in works:
        assert len(full) * 528 >= end and len(rest) == 5
        assert all(len(t) == 1 and t[0] != NULL_BLOCK for t in rest)
        states.setdefault(seq, set()).add(tuple(t[0] for t in rest))
    assert {seq: len(s) for seq, s in states.items()} == {"r0": 1, "r1": 1, "r2": 1}  # the same blocks all its life


def test_the_cost_model_charges_state_layers_their_state_not_a_context() -> None:
    """A decode at context 4,000 reads the 2 attention layers' KV (4,000 tokens x 1 KiB each) and each of the 10
    Mamba-2 layers' state once in and once out; a state layer reads no context, so 8,000 tokens cost the state
    layers what 40 do."""
    cost = Simulator(_config(kv_groups=True)).dep.cost
    assert (cost.full_layers, cost.state_layers, cost.state_layer_bytes) == (2, 10, STATE_BYTES)
    one = cost.breakdown([], [4000])
    assert one.kv_bytes == 2 * 4000 * 1024 + 2 * 10 * STATE_BYTES
    assert cost.breakdown([], [8000]).kv_bytes - one.kv_bytes == 2 * 4000 * 1024
    two = cost.breakdown([(40, 0)], [4000])
    assert two.kv_bytes - one.kv_bytes == 2 * 40 * 1024 + 2 * 10 * STATE_BYTES
