"""Serving a sliding-window model from a hybrid KV pool against a uniform one: the same trace, GPU, cost model and
scheduling rule, only the pool differs.

The hybrid pool is `core.groups.GroupLedger` over the KV cache groups `core.sizing.hybrid.hybrid_plan` makes for the
model (vLLM's grouping); the uniform pool is the same ledger with one full group of every layer, sized from the same
KV bytes (exactly the blocks `kvledger plan` reports). The step loop is vLLM's default shape: every running decode
gets one token, then running prefills and then waiting requests (first come, first served; the head of the queue
waits when it does not fit) share ``max_num_batched_tokens`` in chunks, up to ``max_num_seqs`` running. Admission
reserves a request's whole output (the scheduler's ``full`` policy), so nothing is ever preempted; step times come
from the roofline `CostModel`, which already charges sliding layers only their window. `scripts`-free: the study
behind docs/hybrid.md is `benchmarks/hybrid_serving.py`.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Any

from ..core.groups import GroupLedger, KVCacheGroup
from ..core.sizing.geometry import KVSpec
from ..core.sizing.hybrid import HybridPlan, hybrid_plan
from ..core.types import Outcome
from ..errors import ConfigError
from ..scheduler.metrics import percentile
from ..workloads.requests import SimRequest
from .cost_model import CostModel

SAMPLED_TOKEN = 7  # the id every simulated step samples (ids only feed the prefix index)


def pools(spec: KVSpec, kv_budget_bytes: int, *, max_model_len: int, step_tokens: int) -> tuple[HybridPlan, dict[
        str, tuple[int, list[KVCacheGroup]]]]:
    """The hybrid plan, and per pool ("hybrid", "uniform") its block count and KV cache groups."""
    plan = hybrid_plan(spec, kv_budget_bytes, max_model_len, step_tokens)
    hybrid = [KVCacheGroup(g.kind, g.layers, g.window, g.layer_block_bytes) for g in plan.groups]
    uniform = [KVCacheGroup("full", spec.layers, None, spec.layer_block_bytes)]
    return plan, {"hybrid": (plan.pool_blocks, hybrid), "uniform": (plan.uniform_pool_blocks, uniform)}


@dataclass(slots=True)
class _Live:
    req: SimRequest
    prompt_len: int
    output_len: int
    computed: int = 0
    generated: int = 0
    first_token_s: float | None = None


def _at(samples: list[float], q: float) -> float:
    """The project's one percentile (linear interpolation, ``q`` in [0, 100]); nan when there is nothing."""
    p = percentile(samples, q)
    return math.nan if p is None else p


def serve(requests: list[SimRequest], ledger: GroupLedger, cost: CostModel, *, max_num_batched_tokens: int = 8192,
          max_num_seqs: int = 256, max_steps: int = 2_000_000) -> dict[str, Any]:
    """Run ``requests`` (by arrival) to completion on ``ledger``; per-request latencies and the run's totals."""
    queue = deque(sorted(requests, key=lambda r: r.arrival_s))
    arrived: deque[SimRequest] = deque()
    running: dict[str, _Live] = {}
    t = 0.0
    ttft: list[float] = []
    tpot: list[float] = []
    never = peak_running = steps = 0
    hit_tokens = 0
    finished = 0
    last_finish = 0.0
    while queue or arrived or running:
        steps += 1
        if steps > max_steps:
            raise ConfigError(f"the run did not finish in {max_steps:,} steps")
        if not running and not arrived and queue[0].arrival_s > t:
            t = queue[0].arrival_s
        while queue and queue[0].arrival_s <= t:
            arrived.append(queue.popleft())
        budget = max_num_batched_tokens
        work: list[tuple[str, int]] = []
        for rid, live in running.items():
            if live.computed >= live.prompt_len:
                work.append((rid, 1))
                budget -= 1
        for rid, live in running.items():
            if live.computed < live.prompt_len and budget > 0:
                n = min(live.prompt_len - live.computed, budget)
                work.append((rid, n))
                budget -= n
        while arrived and budget > 0 and len(running) < max_num_seqs:
            r = arrived[0]
            out = max(1, r.output_len)
            d = ledger.admit(r.request_id, r.prompt_tokens.tolist(), out)
            if d.outcome is Outcome.NEVER:
                arrived.popleft()
                never += 1
                continue
            if not d.admitted:
                break
            arrived.popleft()
            live = _Live(r, r.prompt_len, out, computed=d.hit_tokens)
            hit_tokens += d.hit_tokens
            running[r.request_id] = live
            n = min(live.prompt_len - live.computed, budget)
            work.append((r.request_id, n))
            budget -= n
        if not work:
            if queue:
                t = max(t, queue[0].arrival_s)
                continue
            raise ConfigError("requests wait that no step can serve (a request larger than the pool?)")
        peak_running = max(peak_running, len(running))
        prefills, decodes = [], []
        for rid, n in work:
            live = running[rid]
            ledger.schedule(rid, n)
            if live.computed >= live.prompt_len:
                decodes.append(live.computed + 1)
            else:
                prefills.append((n, live.computed))
        t += cost.step_time(prefills, decodes)
        for rid, n in work:
            live = running[rid]
            live.computed += n
            if live.computed < live.prompt_len:
                ledger.confirm(rid)
                continue
            ledger.confirm(rid, SAMPLED_TOKEN)
            live.generated += 1
            if live.first_token_s is None:
                live.first_token_s = t
                ttft.append(t - live.req.arrival_s)
            if live.generated >= live.output_len:
                if live.output_len > 1:
                    tpot.append((t - live.first_token_s) / (live.output_len - 1))
                ledger.release(rid)
                del running[rid]
                finished += 1
                last_finish = t
    first = min((r.arrival_s for r in requests), default=0.0)
    span = max(r.arrival_s for r in requests) - first if requests else 0.0
    offered = (len(requests) - 1) / span if span > 0 else math.inf
    makespan = last_finish - first
    return {
        "requests": len(requests), "finished": finished, "never": never, "steps": steps,
        "offered_rps": offered, "served_rps": finished / makespan if makespan > 0 else math.inf,
        "ttft_p50_ms": 1e3 * _at(ttft, 50), "ttft_p90_ms": 1e3 * _at(ttft, 90),
        "tpot_p50_ms": 1e3 * _at(tpot, 50), "tpot_p90_ms": 1e3 * _at(tpot, 90),
        "peak_running": peak_running, "prefix_hit_tokens": hit_tokens,
    }


def meets(run: dict[str, Any], slo_ttft_ms: float, slo_tpot_ms: float) -> bool:
    """The sweep's rule (`kvledger simulate --slo-*`): p90 latencies within the targets, every request served, and
    served at least 95% of the offered rate."""
    return (run["ttft_p90_ms"] <= slo_ttft_ms and run["tpot_p90_ms"] <= slo_tpot_ms
            and run["finished"] == run["requests"] and run["served_rps"] >= 0.95 * run["offered_rps"])


__all__ = ["meets", "pools", "serve"]
