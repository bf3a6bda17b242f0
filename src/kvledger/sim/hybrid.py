"""Serving a sliding-window or state-layer (Mamba-2 / gated-delta-net) model from a hybrid KV pool against a uniform
one: the same trace, GPU, cost model and scheduling rule, only the pool differs -- a thin face over the simulator,
whose one step loop (the real scheduler, the driver, the cost model's executor) charges the hybrid pool by KV cache
group (`SimConfig(kv_groups=True)`, `KVLedger(kv_groups=...)`).

The hybrid pool is the KV cache groups `core.sizing.hybrid.hybrid_plan` makes for the model (vLLM's grouping) from
the uniform pool's bytes (exactly the blocks `kvledger plan` reports). The step shape is vLLM's default: every running
decode gets one token, then prefills share ``max_num_batched_tokens`` (one chunk may take all of it), up to
``max_num_seqs`` running; admission reserves a request's whole output (the scheduler's ``full`` policy), so nothing is
preempted. Neither pool keeps a prefix cache (the pools' capacity alone is compared). Step times come from the
roofline `CostModel`, which already charges sliding layers only their window and state layers their fixed state.
The study behind docs/hybrid.md is `benchmarks/hybrid_serving.py`.
"""
from __future__ import annotations

import math
from typing import Any

from ..core.groups import KVCacheGroup
from ..core.sizing.geometry import KVSpec, StateGeometry
from ..core.sizing.hybrid import HybridPlan, hybrid_plan
from ..scheduler.metrics import percentile
from ..workloads.requests import SimRequest
from .simulator import SimConfig, Simulator


def pools(spec: KVSpec, kv_budget_bytes: int, *, max_model_len: int, step_tokens: int,
          state: StateGeometry | None = None) -> tuple[HybridPlan, dict[str, tuple[int, list[KVCacheGroup]]]]:
    """The hybrid plan, and per pool ("hybrid", "uniform") its block count and KV cache groups. ``state``
    (`geometry.state_geometry`): the model's Mamba / linear-attention layers, one block per request per state group
    (the hybrid pool's block then holds ``plan.block_size`` tokens)."""
    plan = hybrid_plan(spec, kv_budget_bytes, max_model_len, step_tokens, state)
    hybrid = [KVCacheGroup(g.kind, g.layers, g.window, g.layer_block_bytes) for g in plan.groups]
    uniform = [KVCacheGroup("full", spec.layers, None, spec.layer_block_bytes)]
    return plan, {"hybrid": (plan.pool_blocks, hybrid), "uniform": (plan.uniform_pool_blocks, uniform)}


def config(model: str, gpu: str, uniform_blocks: int, *, hybrid: bool, max_num_batched_tokens: int = 8192,
           max_num_seqs: int = 256, max_model_len: int | None = None, check_every: int = 0) -> SimConfig:
    """The simulation of one pool: ``uniform_blocks`` blocks of every layer (the hybrid pool: the same bytes in
    blocks of one group's page)."""
    return SimConfig(model=model, gpu=gpu, pool_blocks=uniform_blocks, prefix_cache=False, kv_groups=hybrid,
                     policy="full", token_budget=max_num_batched_tokens, prefill_chunk=max_num_batched_tokens,
                     max_running=max_num_seqs, max_model_len=max_model_len, check_every=check_every)


def _at(samples: list[float], q: float) -> float:
    """The project's one percentile (linear interpolation, ``q`` in [0, 100]); nan when there is nothing."""
    p = percentile(samples, q)
    return math.nan if p is None else p


def serve(requests: list[SimRequest], cfg: SimConfig) -> dict[str, Any]:
    """Run ``requests`` (by arrival) to completion through the simulator; per-request latencies and the run's
    totals."""
    sim = Simulator(cfg)
    result = sim.run(requests)
    recs = result.requests
    done = [r for r in recs if r.finish_reason == "length"]
    ttft = [r.ttft_s for r in done if r.ttft_s is not None]
    tpot = [r.tpot_s for r in done if r.tpot_s is not None]
    first = min((r.arrival_s for r in requests), default=0.0)
    span = max(r.arrival_s for r in requests) - first if requests else 0.0
    offered = (len(requests) - 1) / span if span > 0 else math.inf
    last = max((r.finish_s for r in done if r.finish_s is not None), default=first)
    makespan = last - first
    summary = result.summary()
    return {
        "requests": len(requests), "finished": len(done), "never": sum(r.finish_reason.startswith("never")
                                                                         for r in recs),
        "steps": result.steps, "offered_rps": offered, "served_rps": len(done) / makespan if makespan > 0 else math.inf,
        "ttft_p50_ms": 1e3 * _at(ttft, 50), "ttft_p90_ms": 1e3 * _at(ttft, 90),
        "tpot_p50_ms": 1e3 * _at(tpot, 50), "tpot_p90_ms": 1e3 * _at(tpot, 90),
        "peak_running": summary["peak_running"], "prefix_hit_tokens": summary["prefix_hit_tokens"],
        "pool_blocks": sim.dep.pool_blocks, "block_bytes": sim.dep.block_bytes,
    }


def meets(run: dict[str, Any], slo_ttft_ms: float, slo_tpot_ms: float) -> bool:
    """The sweep's rule (`kvledger simulate --slo-*`): p90 latencies within the targets, every request served, and
    served at least 95% of the offered rate."""
    return (run["ttft_p90_ms"] <= slo_ttft_ms and run["tpot_p90_ms"] <= slo_tpot_ms
            and run["finished"] == run["requests"] and run["served_rps"] >= 0.95 * run["offered_rps"])


__all__ = ["config", "meets", "pools", "serve"]
