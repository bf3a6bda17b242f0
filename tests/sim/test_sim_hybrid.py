"""Serving a Gemma-3-style model from a hybrid KV pool against a uniform one (`kvledger.sim.hybrid`, through the
simulator's one step loop): the same requests, bytes and cost model; where KV is what limits the uniform pool, the
hybrid pool runs more at once and answers sooner."""

from __future__ import annotations

import json
from pathlib import Path

from kvledger.core.sizing.geometry import KVSpec
from kvledger.sim.hybrid import config, meets, serve
from kvledger.workloads.requests import Prompt, SimRequest

ROOT = Path(__file__).resolve().parents[2]
GEMMA3 = ROOT / "examples" / "configs" / "gemma-3-27b.json"


def _run(budget: int) -> dict[str, dict]:
    spec = KVSpec.from_hf_config(json.loads(GEMMA3.read_text()))
    reqs = [SimRequest(f"r{i}", 0.05 * i, Prompt([(10000 * i, 3000)]), 40) for i in range(16)]
    return {name: serve(reqs, config(str(GEMMA3), "h200-141gb", budget // spec.block_bytes, hybrid=name == "hybrid",
                                     max_num_batched_tokens=2048, max_num_seqs=64, max_model_len=8192, check_every=1))
            for name in ("hybrid", "uniform")}


def test_hybrid_pool_runs_more_at_once_and_answers_sooner() -> None:
    # 6 GB: the uniform pool's 738 blocks of 7.75 MiB hold three 3,040-token requests (190 blocks each); the hybrid
    # pool's 4,575 blocks of 1.25 MiB (the same bytes) admit three at their prefill bound (190 full + 6 x 190
    # sliding), then twice as many once their windows shrink to the decode step's (6 x 65).
    runs = _run(6 * 10**9)
    hybrid, uniform = runs["hybrid"], runs["uniform"]
    assert hybrid["finished"] == uniform["finished"] == 16
    assert (uniform["pool_blocks"], hybrid["pool_blocks"]) == (738, 4575)
    assert uniform["peak_running"] == 3 and hybrid["peak_running"] == 6
    assert hybrid["ttft_p90_ms"] < 0.8 * uniform["ttft_p90_ms"]
    assert hybrid["served_rps"] > 1.25 * uniform["served_rps"]
    assert meets(hybrid, 1e9, 1e9) is (hybrid["served_rps"] >= 0.95 * hybrid["offered_rps"])
