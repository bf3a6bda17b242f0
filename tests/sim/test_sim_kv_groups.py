"""`kvledger simulate` charging a sliding-window model by KV cache group through the one step loop
(`SimConfig(kv_groups=True)`: the real scheduler over `KVLedger(kv_groups=...)`, the cost model's executor): the same
requests and KV bytes as the uniform pool, more of them at once, sooner."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvledger.errors import ConfigError
from kvledger.sim.simulator import SimConfig, Simulator
from kvledger.workloads.requests import Prompt, SimRequest

GEMMA3 = str(Path(__file__).resolve().parents[2] / "examples" / "configs" / "gemma-3-27b.json")


def _config(**kw: object) -> SimConfig:
    kw.setdefault("prefix_cache", False)
    return SimConfig(model=GEMMA3, gpu="h200-141gb", pool_blocks=738, token_budget=2048, prefill_chunk=2048,
                     max_running=64, max_model_len=8192, check_every=1, **kw)


def test_the_hybrid_pool_runs_more_at_once_and_answers_sooner_through_the_driver() -> None:
    # 738 uniform blocks of 7.75 MiB (6.0 GB) hold three 3,040-token requests (190 blocks each); the same bytes are
    # 4,575 blocks of 1.25 MiB charged by group: three at their prefill bound (190 full + 6 x 190 sliding), then
    # twice as many once their windows shrink to the decode step's (6 x 65) -- the figures `GroupLedger` gives,
    # here from the real scheduler and the one driver.
    reqs = [SimRequest(f"r{i}", 0.05 * i, Prompt([(10000 * i, 3000)]), 40) for i in range(16)]
    runs = {}
    for kv_groups in (False, True):
        sim = Simulator(_config(kv_groups=kv_groups))
        runs[kv_groups] = sim.run(reqs).summary()
        assert sim.scheduler.ledger.usage().active == 0
    uniform, hybrid = runs[False], runs[True]
    assert (uniform["pool_blocks"], hybrid["pool_blocks"]) == (738, 4575)
    assert abs(hybrid["pool_bytes"] - uniform["pool_bytes"]) < hybrid["block_bytes"]  # the same KV bytes
    assert uniform["completed"] == hybrid["completed"] == 16
    assert (uniform["peak_running"], hybrid["peak_running"]) == (3, 6)
    assert hybrid["ttft_s"]["p90"] < 0.8 * uniform["ttft_s"]["p90"]
    assert hybrid["throughput_req_s"] > 1.25 * uniform["throughput_req_s"]


def test_a_shared_prefix_is_served_from_the_cache_by_every_group() -> None:
    """Sixteen requests with one 2,000-token head, arriving one after another: with the prefix cache the hybrid pool
    serves each later head from the cache (the full group's blocks and the sliding groups' last window blocks, kept
    after they left the window), as the uniform pool does."""
    reqs = [SimRequest(f"r{i}", 2.0 * i, Prompt([(7, 2000), (10000 * i, 500)]), 20) for i in range(16)]
    hits = {}
    for kv_groups in (False, True):
        sim = Simulator(_config(kv_groups=kv_groups, prefix_cache=True))
        summary = sim.run(reqs).summary()
        assert summary["completed"] == 16 and sim.scheduler.ledger.usage().active == 0
        hits[kv_groups] = summary["prefix_hit_tokens"]
    assert hits[True] == hits[False] >= 15 * 1984  # each later head's full blocks (16 tokens a block)


def test_kv_groups_need_sliding_layers() -> None:
    with pytest.raises(ConfigError, match="no sliding-window or state layers"):
        Simulator(SimConfig(model="llama-3.1-8b", pool_blocks=100, prefix_cache=False, kv_groups=True))
