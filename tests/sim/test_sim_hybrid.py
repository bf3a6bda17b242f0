"""Serving a Gemma-3-style model from a hybrid KV pool against a uniform one (`kvledger.sim.hybrid`): the same
requests, bytes and cost model; where KV is what limits the uniform pool, the hybrid pool runs more at once and
answers sooner."""

from __future__ import annotations

import json
from pathlib import Path

from kvledger.core.groups import GroupLedger
from kvledger.core.sizing.geometry import KVSpec
from kvledger.sim.cost_model import CostModel, get_profile
from kvledger.sim.hybrid import meets, pools, serve
from kvledger.workloads.requests import Prompt, SimRequest

ROOT = Path(__file__).resolve().parents[2]


def _run(budget: int) -> dict[str, dict]:
    cfg = json.loads((ROOT / "examples" / "configs" / "gemma-3-27b.json").read_text())
    spec = KVSpec.from_hf_config(cfg)
    _, made = pools(spec, budget, max_model_len=8192, step_tokens=2048)
    cost = CostModel(cfg, spec, get_profile("h200-141gb"))
    reqs = [SimRequest(f"r{i}", 0.05 * i, Prompt([(10000 * i, 3000)]), 40) for i in range(16)]
    out = {}
    for name, (blocks, groups) in made.items():
        ledger = GroupLedger(blocks, spec.block_size, groups, step_tokens=2048)
        out[name] = serve(reqs, ledger, cost, max_num_batched_tokens=2048, max_num_seqs=64)
        ledger.check()
        assert ledger.pool.num_active == 0 and ledger.promised == 0
    return out


def test_hybrid_pool_runs_more_at_once_and_answers_sooner() -> None:
    # 6 GB: the uniform pool's 738 blocks of 7.75 MiB hold three 3,040-token requests (190 blocks each); the hybrid
    # pool's 4,577 blocks of 1.25 MiB admit three at their prefill bound (190 full + 6 x 190 sliding), then twice as
    # many once their windows shrink to the decode step's (6 x 65).
    runs = _run(6 * 10**9)
    hybrid, uniform = runs["hybrid"], runs["uniform"]
    assert hybrid["finished"] == uniform["finished"] == 16
    assert uniform["peak_running"] == 3 and hybrid["peak_running"] == 6
    assert hybrid["ttft_p90_ms"] < 0.8 * uniform["ttft_p90_ms"]
    assert hybrid["served_rps"] > 1.25 * uniform["served_rps"]
    assert meets(hybrid, 1e9, 1e9) is (hybrid["served_rps"] >= 0.95 * hybrid["offered_rps"])
