"""The fleet demonstration: Mooncake's conversation trace over N = 4 simulated replicas.

Part 1 (the whole hour, unless --duration-s): hit rate, prefill balance and TTFT of the scoring router
against round-robin and against a single pool of the same total capacity (one replica of 4x the pool and
tp=4, i.e. about 4x the compute) -- with unbounded caches (no eviction ever) and with pools sized for
about 65% and 80% mean use. Pools are sized from the unbounded run: the mean number of blocks a replica
has in use (held by running requests + promised) divided by 0.65 or 0.80; the measured mean use of each
run is reported beside it.

With --load-by rate, "65% / 80% load" is read as offered load instead: every replica gets a pool of
--pool-blocks (default: what the inventory gives the model on the GPU, as `kvledger plan` does), the
fleet's capacity in requests/s is measured by a saturation run (the slice's first --saturation-requests
arrivals compressed 100x, so
the queue never empties; round-robin routing, so no router's cache affinity is counted as capacity;
requests finished per simulated second between the 10th and 90th percentile of finish times), and the
slice's arrival times are scaled so the offered rate is 65% and 80% of that capacity (conversation turns
keep their order; their gaps scale with the rest). Part 1 then
runs at each load with those pools (no unbounded rows), and the grid on its slice scaled the same way.

Part 2 (the first --grid-s seconds, 20 minutes by default): the staleness grid -- R in {1, 2, 4} routers,
staleness in {0, 0.1, 1, 10} s, arm A (the router decides, the replica commits whatever it is sent) and
arm B (the replica's ledger decides, the router retries), at both pool sizes. Per cell: overcommitted
admissions and the largest overshoot, refusals per request, deferral wait p50/p99, hit rate, TTFT p50/p90,
the largest replica share of prefill, the view's age and the routing decision time.

Writes results.json and overcommits.png (overcommits against staleness, both arms) into --out, prints
tables as it goes and ends with one JSON line. Simulated time; the wall time of each run is printed with
the machine's load average (the decision times are wall-clock microseconds, noisy under load).

Usage: python benchmarks/fleet_grid.py [--trace PATH] [--out DIR] [--duration-s S] [--grid-s S] [--pools P65,P80]
       [--skip-part1] [--skip-grid]
       [--load-by rate [--gpu NAME] [--pool-blocks N] [--capacity RPS] [--host-pool BYTES]]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from kvledger.errors import KVLedgerError
from kvledger.sim.cost_model import GPU_PROFILES
from kvledger.sim.fleet import FleetConfig, FleetSimulator
from kvledger.sim.simulator import SimConfig, Simulator, build_deployment, prefix_hit_bound
from kvledger.units import parse_bytes
from kvledger.workloads import load_mooncake, slice_requests

TRACE = "../shared/traces/mooncake_fast25_conversation_trace.jsonl"
KEYS = ("overcommits", "max_overshoot", "refusals_per_request", "deferred_requests", "deferral_p50_s",
        "deferral_p99_s", "hit_rate", "ttft_mean_s", "ttft_p50_s", "ttft_p90_s", "max_prefill_share", "mean_use",
        "view_age_mean_s", "view_age_p99_s", "decision_us_p50", "decision_us_p99", "rejected", "completed",
        "cross_tenant_hit_blocks", "promoted_tokens", "ttft_routing_mean_s", "ttft_replica_wait_mean_s",
        "ttft_prefill_mean_s", "ttft_alone_mean_s")


DEFAULT_GPU = "h100-80gb"


def replica_sim(gpu: str, pool_blocks: int | None, host_pool_bytes: int, block_size: int = 512) -> SimConfig:
    """One replica of the rate-load study: Llama-3.1-8B on ``gpu`` with ``pool_blocks`` (default: what the
    inventory gives on that GPU) and, when ``host_pool_bytes``, a host tier below it with evicted prefix
    blocks demoted to it (offload_prefixes)."""
    sim = SimConfig(model="llama-3.1-8b", gpu=gpu, block_size=block_size)
    sim = sim.with_values(pool_blocks=pool_blocks if pool_blocks is not None else build_deployment(sim).pool_blocks)
    if host_pool_bytes:
        sim = sim.with_values(host_pool_bytes=host_pool_bytes, offload_prefixes=True)
    return sim


def load() -> str:
    return f"{os.getloadavg()[0]:.2f}"


def run_fleet(reqs: list[Any], sim: SimConfig, **kw: Any) -> dict[str, Any]:
    t = time.perf_counter()
    res = FleetSimulator(FleetConfig(sim=sim, **kw)).run(reqs)
    row = {k: res.summary[k] for k in KEYS}
    row.update({k: v for k, v in kw.items() if k in ("replicas", "routers", "staleness_s", "arm", "routing",
                                                     "affinity_wait_s")})
    row["pool_blocks"] = sim.pool_blocks
    row["wall_s"] = round(time.perf_counter() - t, 1)
    row["load"] = load()
    return row


def run_single(reqs: list[Any], sim: SimConfig, pool: int, replicas: int = 4) -> dict[str, Any]:
    """One replica with the fleet's total pool and tp=4 (about the fleet's compute), and with a host tier
    the fleet's total host slots (a block of one tp=4 rank is a quarter of a replica's, so the bytes are
    scaled to keep the slot count)."""
    t = time.perf_counter()
    single = sim.with_values(pool_blocks=pool, tp=4)
    if sim.host_pool_bytes:
        slots = replicas * build_deployment(sim).host_blocks
        single = single.with_values(host_pool_bytes=slots * build_deployment(single).block_bytes)
    s = Simulator(single).run(reqs).summary()
    return {"routing": "single pool", "pool_blocks": pool, "hit_rate": s["prefix_hit_rate"],
            "ttft_mean_s": s["ttft_s"]["mean"], "ttft_p50_s": s["ttft_s"]["p50"], "ttft_p90_s": s["ttft_s"]["p90"],
            "wall_s": round(time.perf_counter() - t, 1), "load": load()}


def scaled(reqs: list[Any], factor: float) -> list[Any]:
    """The same requests with every arrival time multiplied by `factor` (< 1: a higher rate)."""
    return [replace(r, arrival_s=r.arrival_s * factor) for r in reqs]


def offered_rate(reqs: list[Any], span_s: float | None) -> float:
    """Requests per second the slice offers (over its window, or its arrival span)."""
    span = span_s if span_s else max(r.arrival_s for r in reqs)
    return len(reqs) / span


def saturation_capacity(reqs: list[Any], sim: SimConfig) -> dict[str, Any]:
    """The fleet's throughput (requests/s) with the queue never empty: arrivals compressed 100x,
    round-robin routing (no cache affinity counted as capacity), arm B. Measured between the 10th and
    the 90th percentile of finish times, so neither the ramp-up nor the drain of the last long requests
    (when replicas sit idle) counts; completed / makespan is reported beside it."""
    t = time.perf_counter()
    fleet = FleetSimulator(FleetConfig(sim=sim, replicas=4, routers=1, staleness_s=0.0, routing="round-robin"))
    s = fleet.run(scaled(reqs, 0.01)).summary
    ends = sorted(m.finish_s for _, m in fleet.finished_metrics if m.finish_s is not None)
    lo, hi = ends[len(ends) // 10], ends[(9 * len(ends)) // 10]
    steady = ((9 * len(ends)) // 10 - len(ends) // 10) / (hi - lo) if hi > lo else s["completed"] / s["sim_duration_s"]
    return {"capacity_rps": steady, "makespan_rps": s["completed"] / s["sim_duration_s"], "completed": s["completed"],
            "sim_duration_s": s["sim_duration_s"], "hit_rate": s["hit_rate"], "mean_use": s["mean_use"],
            "wall_s": round(time.perf_counter() - t, 1), "load": load()}


def fmt(row: dict[str, Any]) -> str:
    def f(v: Any) -> str:
        if v is None:
            return "-"
        if isinstance(v, float):
            return f"{v:.4g}"
        return str(v)
    return "  ".join(f"{k}={f(v)}" for k, v in row.items())


def plot(grid: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    loads = sorted({r["label"] for r in grid})
    fig, axes = plt.subplots(1, len(loads), figsize=(6 * len(loads), 4.2), squeeze=False)
    stales = sorted({r["staleness_s"] for r in grid})
    xs = list(range(len(stales)))
    for ax, label in zip(axes[0], loads, strict=True):
        for arm, style in (("A", "-o"), ("B", "--s")):
            for routers in sorted({r["routers"] for r in grid}):
                ys = []
                for s in stales:
                    row = next(r for r in grid if r["label"] == label and r["arm"] == arm and r["routers"] == routers
                               and r["staleness_s"] == s)
                    ys.append(row["overcommits"])
                ax.plot(xs, ys, style, label=f"arm {arm}, R={routers}")
        ax.set_xticks(xs, [f"{s:g}" for s in stales])
        ax.set_xlabel("staleness of the routers' view (s)")
        ax.set_ylabel("overcommitted admissions")
        ax.set_title(f"N=4 replicas, {label}")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("Arm A: the router decides on its view. Arm B: the replica's ledger decides (always 0).", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)



def run_cells(grid: list[dict[str, Any]], reqs: list[Any], sim: SimConfig, label: str, results: dict[str, Any],
              out: Path) -> None:
    """One pool's (or load's) cells of the grid: routers x staleness x arm, saved after each cell."""
    for routers in (1, 2, 4):
        for staleness in (0.0, 0.1, 1.0, 10.0):
            for arm in ("A", "B"):
                row = run_fleet(reqs, sim, replicas=4, routers=routers, staleness_s=staleness, arm=arm)
                row["label"] = label
                grid.append(row)
                print(fmt(row), flush=True)
                results["grid"] = grid
                (out / "results.json").write_text(json.dumps(results, indent=1))

def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trace", default=TRACE)
    ap.add_argument("--out", default="reports/fleet-grid")
    ap.add_argument("--duration-s", type=float, default=None, help="part 1 on the first S seconds (default: all)")
    ap.add_argument("--grid-s", type=float, default=1200.0, help="part 2 on the first S seconds")
    ap.add_argument("--skip-part1", action="store_true")
    ap.add_argument("--skip-grid", action="store_true")
    ap.add_argument("--pools", default=None, help="P65,P80 pool blocks per replica (skip the sizing run)")
    ap.add_argument("--load-by", choices=("pool", "rate"), default="pool",
                    help="pool: size pools for 65%%/80%% mean use at the trace's rate (default); rate: fixed pools, "
                         "arrivals scaled to 65%%/80%% of the fleet's measured capacity")
    ap.add_argument("--pool-blocks", type=int, default=None,
                    help="--load-by rate: blocks per replica (default: the inventory's for the model on the GPU)")
    ap.add_argument("--gpu", default=None, choices=sorted(GPU_PROFILES),
                    help="--load-by rate: the device profile of every replica; its memory sets the default pool "
                         f"(default {DEFAULT_GPU})")
    ap.add_argument("--saturation-requests", type=int, default=400,
                    help="--load-by rate: how many of the slice's first requests the saturation run uses (a few "
                         "pool-fulls; more is slow -- the router rescans its queue on every retry -- and packs "
                         "conversation turns together, which inflates the figure: see docs/fleet.md)")
    ap.add_argument("--capacity", type=float, default=None,
                    help="--load-by rate: the fleet's capacity in requests/s (skip the saturation run)")
    ap.add_argument("--affinity-wait", type=float, default=0.0,
                    help="arm B, score routing: seconds a request may wait for its cheapest replica when that one "
                         "does not fit yet (FleetConfig.affinity_wait_s; 0: the cheapest that fits)")
    ap.add_argument("--host-pool", default="0",
                    help="--load-by rate: a host tier per replica (e.g. 164GiB) below the device pool, with evicted "
                         "prefix blocks demoted to it and promoted back on a hit (offload_prefixes); the saturation "
                         "run and the single pool get the same tiers")
    args = ap.parse_args()
    try:
        args.host_pool = parse_bytes(args.host_pool, allow_zero=True)
    except KVLedgerError as e:
        ap.error(f"--host-pool: {e}")
    if args.gpu is not None and args.load_by != "rate":
        ap.error("--gpu needs --load-by rate")
    if args.host_pool and args.load_by != "rate":
        ap.error("--host-pool needs --load-by rate")
    if args.pool_blocks is not None and args.pool_blocks < 1:
        ap.error("--pool-blocks must be >= 1")
    if args.saturation_requests < 10:
        ap.error("--saturation-requests must be >= 10")
    if args.capacity is not None and not (math.isfinite(args.capacity) and args.capacity > 0):
        ap.error("--capacity must be a positive number of requests/s")
    if args.load_by == "rate":
        return main_by_rate(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    everything = load_mooncake(args.trace)
    reqs = slice_requests(everything, end_s=args.duration_s) if args.duration_s else everything
    grid_reqs = slice_requests(everything, end_s=args.grid_s)
    bs = 512
    sim = SimConfig(model="llama-3.1-8b", gpu="h100-80gb", block_size=bs)
    results: dict[str, Any] = {"trace": Path(args.trace).name, "requests": len(reqs), "grid_requests": len(grid_reqs),
                               "block_size": bs, "model": "llama-3.1-8b", "gpu": "h100-80gb"}
    results["bound"] = prefix_hit_bound(reqs, bs)["bound"]
    results["grid_bound"] = prefix_hit_bound(grid_reqs, bs)["bound"]
    print(f"{len(reqs)} requests; single-pool bound {results['bound']:.4f}; grid slice {len(grid_reqs)} requests, "
          f"bound {results['grid_bound']:.4f}", flush=True)
    unbounded = sum(-(-(r.prompt_len + r.output_len) // bs) for r in reqs) + 1
    part1: list[dict[str, Any]] = []
    if args.pools:
        p65, p80 = (int(x) for x in args.pools.split(","))
    else:
        row = run_fleet(reqs, sim.with_values(pool_blocks=unbounded), replicas=4, routers=1, staleness_s=0.0)
        row["label"] = "unbounded"
        part1.append(row)
        print(fmt(row), flush=True)
        used = row["mean_use"] * unbounded
        p65, p80 = math.ceil(used / 0.65), math.ceil(used / 0.80)
    results["pools"] = {"65%": p65, "80%": p80, "unbounded": unbounded}
    print(f"pools per replica: 65% -> {p65} blocks, 80% -> {p80} blocks", flush=True)
    if not args.skip_part1:
        plan = [("unbounded", unbounded, dict(routing="round-robin", staleness_s=0.0)),
                ("unbounded", unbounded, dict(staleness_s=10.0)),
                ("unbounded", unbounded, dict(staleness_s=10.0, routers=4))]
        for label, pool in (("65%", p65), ("80%", p80)):
            plan += [(label, pool, dict(staleness_s=0.0)), (label, pool, dict(staleness_s=1.0, routers=4)),
                     (label, pool, dict(routing="round-robin", staleness_s=0.0))]
        for label, pool, kw in plan:
            kw = {"replicas": 4, "routers": 1, **kw}
            row = run_fleet(reqs, sim.with_values(pool_blocks=pool), **kw)
            row["label"] = label
            part1.append(row)
            print(fmt(row), flush=True)
        for label, pool in (("unbounded", unbounded), ("65%", 4 * p65), ("80%", 4 * p80)):
            row = run_single(reqs, sim, pool)
            row["label"] = label
            part1.append(row)
            print(fmt(row), flush=True)
        results["part1"] = part1
        (out / "results.json").write_text(json.dumps(results, indent=1))
    grid: list[dict[str, Any]] = []
    if not args.skip_grid:
        for label, pool in (("65%", p65), ("80%", p80)):
            run_cells(grid, grid_reqs, sim.with_values(pool_blocks=pool), label, results, out)
        plot(grid, out / "overcommits.png")
    results["grid"] = grid
    (out / "results.json").write_text(json.dumps(results, indent=1))
    b = [r for r in grid if r["arm"] == "B"]
    a2 = [r for r in grid if r["arm"] == "A" and r["routers"] >= 2]
    print(json.dumps({"bench": "fleet_grid", "requests": len(reqs), "pools": results["pools"],
                      "arm_b_overcommits": sum(r["overcommits"] for r in b),
                      "arm_a_r2plus_overcommits": sum(r["overcommits"] for r in a2),
                      "out": str(out)}), flush=True)


def main_by_rate(args: argparse.Namespace) -> None:
    """65% / 80% load as offered rate over the fleet's measured capacity, with pools of a real size."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    everything = load_mooncake(args.trace)
    reqs = slice_requests(everything, end_s=args.duration_s) if args.duration_s else everything
    grid_reqs = slice_requests(everything, end_s=args.grid_s)
    bs = 512
    gpu = args.gpu or DEFAULT_GPU
    sim = replica_sim(gpu, args.pool_blocks, args.host_pool, bs)
    pool = sim.pool_blocks
    native = offered_rate(reqs, args.duration_s)
    results: dict[str, Any] = {"trace": Path(args.trace).name, "load_by": "rate", "requests": len(reqs),
                               "grid_requests": len(grid_reqs), "block_size": bs, "model": "llama-3.1-8b",
                               "gpu": gpu, "pool_blocks": pool, "native_rps": native,
                               "host_pool_bytes": args.host_pool, "host_blocks": build_deployment(sim).host_blocks,
                               "bound": prefix_hit_bound(reqs, bs)["bound"]}
    print(f"{len(reqs)} requests at {native:.3f}/s; single-pool bound {results['bound']:.4f}; "
          f"{pool} blocks of {bs} tokens per replica"
          + (f" + {results['host_blocks']} host blocks (offload_prefixes)" if args.host_pool else ""), flush=True)
    if args.capacity:
        results["capacity"] = {"capacity_rps": args.capacity, "given": True}
    else:
        results["capacity"] = saturation_capacity(reqs[:args.saturation_requests], sim)
        print("saturation: " + fmt(results["capacity"]), flush=True)
    cap = results["capacity"]["capacity_rps"]
    loads = (("65%", 0.65), ("80%", 0.80))
    factors = {label: native / (frac * cap) for label, frac in loads}
    results["time_scale"] = factors
    print(f"capacity {cap:.3f} req/s; arrival times x " + ", ".join(f"{k}: {v:.4g}" for k, v in factors.items()),
          flush=True)
    part1: list[dict[str, Any]] = []
    if not args.skip_part1:
        for label, _ in loads:
            lreqs = scaled(reqs, factors[label])
            for kw in (dict(staleness_s=0.0), dict(staleness_s=1.0, routers=4),
                       dict(routing="round-robin", staleness_s=0.0)):
                row = run_fleet(lreqs, sim, **{"replicas": 4, "routers": 1, "affinity_wait_s": args.affinity_wait,
                                               **kw})
                row["label"] = label
                part1.append(row)
                print(fmt(row), flush=True)
                results["part1"] = part1
                (out / "results.json").write_text(json.dumps(results, indent=1))
            row = run_single(lreqs, sim, 4 * pool)
            row["label"] = label
            part1.append(row)
            print(fmt(row), flush=True)
        results["part1"] = part1
        (out / "results.json").write_text(json.dumps(results, indent=1))
    grid: list[dict[str, Any]] = []
    if not args.skip_grid:
        for label, _ in loads:
            run_cells(grid, scaled(grid_reqs, factors[label]), sim, label, results, out)
        plot(grid, out / "overcommits.png")
    results["grid"] = grid
    (out / "results.json").write_text(json.dumps(results, indent=1))
    b = [r for r in grid if r["arm"] == "B"]
    a2 = [r for r in grid if r["arm"] == "A" and r["routers"] >= 2]
    print(json.dumps({"bench": "fleet_grid", "load_by": "rate", "requests": len(reqs), "pool_blocks": pool,
                      "host_blocks": results["host_blocks"],
                      "capacity_rps": cap, "arm_b_overcommits": sum(r["overcommits"] for r in b),
                      "arm_a_r2plus_overcommits": sum(r["overcommits"] for r in a2), "out": str(out)}), flush=True)


if __name__ == "__main__":
    sys.exit(main())
