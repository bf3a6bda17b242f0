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
    return SimConfig(model=GEMMA3, gpu="h200-141gb", pool_blocks=738, prefix_cache=False, token_budget=2048,
                     prefill_chunk=2048, max_running=64, max_model_len=8192, check_every=1, **kw)


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


def test_kv_groups_need_sliding_layers_and_no_prefix_cache() -> None:
    with pytest.raises(ConfigError, match="prefix cache"):
        SimConfig(model=GEMMA3, kv_groups=True)
    with pytest.raises(ConfigError, match="no sliding-window layers"):
        Simulator(SimConfig(model="llama-3.1-8b", pool_blocks=100, prefix_cache=False, kv_groups=True))
