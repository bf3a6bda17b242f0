"""Chosen cells of the fleet grid, each over several seeds: how much of a difference between two cells is
the routing's and how much is chance.

`fleet_grid.py` runs every cell once (seed 0). In a slice where the offered load outruns the fleet for a
while (Mooncake's first 15 minutes at 80% load), a run can tip into a congested state or not depending on
nothing but the routers' random tie-breaking, and its hit rate moves by several points between seeds.
This script reruns the cells named with ``--cells`` under ``--seeds`` seeds (``FleetConfig.seed``: the
routers' tie-breaking) and prints, per cell, the mean and the range of hit rate, mean TTFT and deferral
p99, then one JSON line. Load is read as offered rate (``fleet_grid.py --load-by rate``): the slice's
arrivals scaled to ``--load`` of ``--capacity`` requests/s.

Usage: python benchmarks/fleet_cells.py --capacity RPS [--gpu NAME] [--host-pool BYTES] [--duration-s S]
       [--load F] [--seeds N] [--affinity-wait S] --cells R:STALENESS[:ARM][:round-robin],...

Example (the H200 staleness check in docs/fleet.md):
    python benchmarks/fleet_cells.py --gpu h200-141gb --host-pool 164GiB --capacity 9.573659957220455 \
        --duration-s 900 --load 0.8 --seeds 5 --cells 1:0,1:10,2:0,2:10,4:0,4:10
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path
from typing import Any

from fleet_grid import DEFAULT_GPU, TRACE, load, offered_rate, replica_sim, run_fleet, scaled

from kvledger.errors import KVLedgerError
from kvledger.sim.cost_model import GPU_PROFILES
from kvledger.sim.fleet import ARMS
from kvledger.units import parse_bytes
from kvledger.workloads import load_mooncake, slice_requests

FIGURES = ("hit_rate", "ttft_mean_s", "deferral_p99_s", "refusals_per_request", "overcommits", "mean_use",
           "ttft_routing_mean_s", "ttft_replica_wait_mean_s", "ttft_prefill_mean_s", "ttft_alone_mean_s")


def parse_cells(text: str) -> list[dict[str, Any]]:
    """``R:STALENESS[:ARM][:round-robin]`` cells, comma-separated."""
    cells = []
    for item in text.split(","):
        parts = item.strip().split(":")
        if len(parts) < 2:
            raise ValueError(f"cell {item!r}: expected ROUTERS:STALENESS[:ARM][:round-robin]")
        try:
            routers, staleness = int(parts[0]), float(parts[1])
        except ValueError:
            raise ValueError(f"cell {item!r}: ROUTERS must be an integer and STALENESS a number of seconds") from None
        if not 1 <= routers <= 64 or not (math.isfinite(staleness) and 0 <= staleness <= 3600):
            raise ValueError(f"cell {item!r}: routers in [1, 64], staleness in [0, 3600] s")
        cell: dict[str, Any] = {"routers": routers, "staleness_s": staleness, "arm": "B", "routing": "score"}
        for extra in parts[2:]:
            if extra in ARMS:
                cell["arm"] = extra
            elif extra == "round-robin":
                cell["routing"] = extra
            else:
                raise ValueError(f"cell {item!r}: {extra!r} is neither an arm ({', '.join(ARMS)}) nor round-robin")
        cells.append(cell)
    return cells


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key in FIGURES:
        values = [r[key] for r in rows if r[key] is not None]
        out[key] = ({"mean": statistics.fmean(values), "min": min(values), "max": max(values)}
                    if values else None)
    out["runs"] = len(rows)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trace", default=TRACE)
    ap.add_argument("--gpu", default=DEFAULT_GPU, choices=sorted(GPU_PROFILES))
    ap.add_argument("--pool-blocks", type=int, default=None, help="blocks per replica (default: the inventory's)")
    ap.add_argument("--host-pool", default="0", help="a host tier per replica, with offload_prefixes (e.g. 164GiB)")
    ap.add_argument("--capacity", type=float, required=True, help="the fleet's capacity in requests/s "
                                                                  "(fleet_grid.py --load-by rate measures it)")
    ap.add_argument("--load", type=float, default=0.8, help="offered rate as a fraction of --capacity")
    ap.add_argument("--duration-s", type=float, default=None, help="the first S seconds of the trace (default: all)")
    ap.add_argument("--seeds", type=int, default=3, help="seeds 0..N-1 per cell")
    ap.add_argument("--affinity-wait", type=float, default=0.0,
                    help="arm B, score routing: FleetConfig.affinity_wait_s for every cell (default 0)")
    ap.add_argument("--cells", required=True, help="ROUTERS:STALENESS[:ARM][:round-robin], comma-separated")
    ap.add_argument("--out", default=None, help="write every run and the summaries to this JSON file")
    args = ap.parse_args()
    try:
        cells = parse_cells(args.cells)
        host = parse_bytes(args.host_pool, allow_zero=True)
    except (ValueError, KVLedgerError) as e:
        ap.error(str(e))
    if not (math.isfinite(args.capacity) and args.capacity > 0):
        ap.error("--capacity must be a positive number of requests/s")
    if not (math.isfinite(args.load) and 0 < args.load <= 2):
        ap.error("--load must be in (0, 2]")
    if not (math.isfinite(args.affinity_wait) and 0 <= args.affinity_wait <= 3600):
        ap.error("--affinity-wait must be in [0, 3600] seconds")
    if not 1 <= args.seeds <= 100:
        ap.error("--seeds must be in [1, 100]")
    if args.pool_blocks is not None and args.pool_blocks < 1:
        ap.error("--pool-blocks must be >= 1")
    if args.duration_s is not None and not args.duration_s > 0:
        ap.error("--duration-s must be positive")
    everything = load_mooncake(args.trace)
    reqs = slice_requests(everything, end_s=args.duration_s) if args.duration_s else everything
    sim = replica_sim(args.gpu, args.pool_blocks, host)
    lreqs = scaled(reqs, offered_rate(reqs, args.duration_s) / (args.load * args.capacity))
    print(f"{len(reqs)} requests at {args.load:g} x {args.capacity:.3f} req/s; {sim.pool_blocks} blocks per replica "
          f"on {args.gpu}" + (f" + a host tier of {args.host_pool}" if host else "") + f"; load {load()}", flush=True)
    runs: list[dict[str, Any]] = []
    summaries: list[dict[str, Any]] = []
    for cell in cells:
        rows = []
        for seed in range(args.seeds):
            row = run_fleet(lreqs, sim, replicas=4, seed=seed, affinity_wait_s=args.affinity_wait, **cell)
            row.update(cell, seed=seed)
            rows.append(row)
            runs.append(row)
            print("  " + "  ".join(f"{k}={row[k]}" for k in ("routers", "staleness_s", "arm", "routing", "seed"))
                  + f"  hit {row['hit_rate']:.1%}  ttft {row['ttft_mean_s'] * 1e3:,.0f} ms = routing "
                  f"{row['ttft_routing_mean_s'] * 1e3:,.0f} + replica wait {row['ttft_replica_wait_mean_s'] * 1e3:,.0f}"
                  f" + prefill {row['ttft_prefill_mean_s'] * 1e3:,.0f} (alone {row['ttft_alone_mean_s'] * 1e3:,.0f})"
                  f"  wall {row['wall_s']} s"
                  f"  load {row['load']}", flush=True)
        s = {**cell, **summarize(rows)}
        summaries.append(s)
        hit, ttft = s["hit_rate"], s["ttft_mean_s"]
        print(f"{cell['routing']} R={cell['routers']} staleness {cell['staleness_s']:g} s arm {cell['arm']}: hit rate "
              f"{hit['mean']:.1%} ({hit['min']:.1%}-{hit['max']:.1%}), TTFT mean {ttft['mean'] * 1e3:,.0f} ms "
              f"({ttft['min'] * 1e3:,.0f}-{ttft['max'] * 1e3:,.0f}), overcommits {s['overcommits']['max']:.0f} at most",
              flush=True)
    if args.out:
        record = {"gpu": args.gpu, "pool_blocks": sim.pool_blocks, "host_pool": args.host_pool,
                  "capacity_rps": args.capacity, "load": args.load, "duration_s": args.duration_s,
                  "seeds": args.seeds, "affinity_wait_s": args.affinity_wait, "runs": runs, "cells": summaries}
        Path(args.out).write_text(json.dumps(record, indent=1))
    print(json.dumps({"bench": "fleet_cells", "gpu": args.gpu, "load": args.load, "seeds": args.seeds,
                      "cells": [{k: s[k] for k in ("routers", "staleness_s", "arm", "routing")}
                                | {"hit_rate_mean": s["hit_rate"]["mean"], "ttft_mean_s": s["ttft_mean_s"]["mean"]}
                                for s in summaries]}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
